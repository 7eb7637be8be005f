//! Data parallelism as one strategy the trainer calls: which examples this rank trains on, one
//! gradient average per optimizer step, every rank starting from rank 0's weights, one writer,
//! and evaluation shares gathered back. A single-process run is the same object with a world of
//! one, so the trainer asks it rather than testing whether the run is distributed (it still
//! branches on rank 0's duties, ZeRO-1 and tensor parallelism).

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorPrimitive};

use super::collectives::{Collectives, ReduceOp};
use super::DistEnv;
use crate::Result;

/// A set of ranks' collectives, shared by the strategies that use them.
pub type SharedCollectives<B> = Arc<dyn Collectives<B>>;

/// A rank's place in a mesh: the data-parallel strategy, its tensor-parallel group and its
/// pipeline group (each `None` at size 1).
pub type JoinedMesh<B> = (
    DataParallel<B>,
    Option<SharedCollectives<B>>,
    Option<SharedCollectives<B>>,
);

pub struct DataParallel<B: Backend> {
    /// The data-parallel group: the ranks that hold the same model (shard) and average its
    /// gradients — the whole job unless tensor parallelism takes part of it; `None` alone.
    group: Option<Arc<dyn Collectives<B>>>,
    /// The whole job (`kiln launch`, torchrun, mpirun, a Kubernetes Job).
    world: Option<Arc<dyn Collectives<B>>>,
    env: Option<DistEnv>,
}

impl<B: Backend> Default for DataParallel<B> {
    fn default() -> Self {
        Self::single()
    }
}

impl<B: Backend> DataParallel<B> {
    /// A single-process run.
    pub fn single() -> Self {
        Self {
            group: None,
            world: None,
            env: None,
        }
    }

    /// Joins the job this process was launched into, as torch's `init_process_group` does at the
    /// top of a script: workers meet before each spends time loading, so a broken set-up is
    /// reported whatever the loading takes. A single-process run when no job is set.
    pub fn join(device: &B::Device) -> Result<Self> {
        Ok(match super::init_from_env::<B>(device)? {
            Some(j) => Self {
                group: Some(j.world.clone()),
                world: Some(j.world),
                env: Some(j.env),
            },
            None => Self::single(),
        })
    }

    /// Joins the job as [`Self::join`] does and lays it out as a mesh of `tp × dp × pp` ranks:
    /// `tp`-rank tensor-parallel groups (contiguous ranks), data parallelism across them, and
    /// `pp` pipeline stages. Returns the data-parallel strategy, this rank's tensor-parallel group
    /// (`None` at `tp` = 1) and its pipeline group (`None` at `pp` = 1), in which stage `s` is
    /// rank `s`, its links open.
    pub fn join_mesh_pp(device: &B::Device, tp: usize, pp: usize) -> Result<JoinedMesh<B>> {
        let joined = Self::join(device)?;
        if tp <= 1 && pp <= 1 {
            return Ok((joined, None, None));
        }
        let Some(world) = joined.world.clone() else {
            let n = super::Mesh::new(tp.saturating_mul(pp).max(1), tp, pp)?.world();
            let sizes = match (tp, pp) {
                (_, 1) => format!("--tensor-parallel-size {tp}"),
                (1, _) => format!("--pipeline-parallel-size {pp}"),
                _ => format!("--tensor-parallel-size {tp} × --pipeline-parallel-size {pp}"),
            };
            return Err(crate::KilnError::Config(format!(
                "{sizes} needs {n} processes: start them with `kiln launch --nproc-per-node {n} -- <command> ...` (or torchrun / mpirun)"
            )));
        };
        let mesh = super::Mesh::new(world.size(), tp, pp)?;
        // Pipeline stages call their groups' collectives at different times, so without an
        // engine's own sub-communicators the groups talk over the links, not the world.
        if pp > 1 {
            world.open_links()?;
        }
        // Every split is a collective: every rank makes them, in the same order.
        let split = |groups: Vec<Vec<usize>>| -> Result<Arc<dyn Collectives<B>>> {
            let g = super::Group::new(world.clone(), groups)?;
            Ok(Arc::new(if pp > 1 { g.over_links() } else { g }))
        };
        let tp_group = (tp > 1).then(|| split(mesh.tp_groups())).transpose()?;
        let dp_group = split(mesh.dp_groups())?;
        let pp_group = (pp > 1).then(|| split(mesh.pp_groups())).transpose()?;
        if joined.is_main() {
            tracing::info!("layout: {mesh} over {} processes", world.size());
        }
        Ok((
            Self {
                group: Some(dp_group),
                world: Some(world),
                env: joined.env,
            },
            tp_group,
            pp_group,
        ))
    }

    pub fn rank(&self) -> usize {
        self.group.as_ref().map_or(0, |g| g.rank())
    }

    /// The number of data-parallel ranks.
    pub fn size(&self) -> usize {
        self.group.as_ref().map_or(1, |g| g.size())
    }

    /// Global rank 0 (or a single process): the one that logs and writes files.
    pub fn is_main(&self) -> bool {
        self.world.as_ref().is_none_or(|w| w.rank() == 0)
    }

    /// The first worker of its machine (transformers' `is_local_process_zero`).
    pub fn is_local_main(&self) -> bool {
        self.env.as_ref().is_none_or(|e| e.local_rank == 0)
    }

    /// How many examples each rank trains on per epoch of `n` (all ranks alike, see [`Self::shard`]).
    pub fn examples_per_rank(&self, n: usize, drop_last: bool) -> usize {
        match self.size() {
            1 => n,
            w if drop_last => n / w,
            w => n.div_ceil(w),
        }
    }

    /// This rank's share of an epoch's example order.
    pub fn shard(&self, order: &[usize], drop_last: bool) -> Vec<usize> {
        crate::data::batch::shard(order, self.rank(), self.size(), drop_last)
    }

    /// This rank's share of the eval examples: every `size`-th from `rank`, none twice.
    pub fn eval_share(&self, n: usize) -> Vec<usize> {
        (self.rank()..n).step_by(self.size()).collect()
    }

    /// The mean of `flat` (a step's gradients and loss in one buffer) over the ranks, before
    /// clipping, as DDP: one collective per step.
    pub fn average(&self, flat: Tensor<B, 1>) -> Result<Tensor<B, 1>> {
        match &self.group {
            Some(g) => g.all_reduce(flat, ReduceOp::Mean),
            None => Ok(flat),
        }
    }

    /// ZeRO-1 over the data-parallel group (`None` alone: there is nothing to shard).
    pub fn zero1(&self) -> Option<super::Zero1<B>> {
        self.group
            .as_ref()
            .filter(|g| g.size() > 1)
            .map(|g| super::Zero1::new(g.clone()))
    }

    /// A per-example table gathered from every rank, and two totals summed: row `r` of `rows`
    /// (`width` values) belongs to example `mine[r]` of `n`, and every rank gets all `n` rows in
    /// example order. One collective: each rank fills its own rows of a zeroed buffer (the totals
    /// at its end), and the group sums them. The evaluation gather.
    pub fn gather_rows(
        &self,
        n: usize,
        width: usize,
        mine: &[usize],
        rows: &[Vec<f32>],
        totals: [f32; 2],
    ) -> Result<(Vec<Vec<f32>>, [f32; 2])> {
        let mut buf = vec![0f32; n * width + 2];
        if width > 0 {
            for (&i, row) in mine.iter().zip(rows) {
                buf[i * width..(i + 1) * width].copy_from_slice(row);
            }
        }
        let last = buf.len() - 2;
        (buf[last], buf[last + 1]) = (totals[0], totals[1]);
        let buf = self.sum_host(buf)?;
        let (table, sums) = buf.split_at(last);
        let gathered = if width > 0 {
            table.chunks(width).map(<[f32]>::to_vec).collect()
        } else {
            Vec::new()
        };
        Ok((gathered, [sums[0], sums[1]]))
    }

    /// Sums host values over the ranks (eval losses, counts, gathered predictions).
    pub fn sum_host(&self, values: Vec<f32>) -> Result<Vec<f32>> {
        match &self.group {
            Some(g) => g.sum_host(values),
            None => Ok(values),
        }
    }

    /// Sums `values` over the whole job, every layout's ranks (tensor-parallel peers included):
    /// for choices every rank must share, such as where a restarted job resumes.
    pub fn sum_host_world(&self, values: Vec<f32>) -> Result<Vec<f32>> {
        match &self.world {
            Some(w) => w.sum_host(values),
            None => Ok(values),
        }
    }

    /// Integers summed exactly over the ranks ([`Collectives::sum_exact`]).
    pub fn sum_exact(&self, values: &[u64]) -> Result<Vec<u64>> {
        match &self.group {
            Some(g) => g.sum_exact(values),
            None => Ok(values.to_vec()),
        }
    }

    /// Integers summed exactly over the whole job ([`Collectives::sum_exact`]).
    pub fn sum_exact_world(&self, values: &[u64]) -> Result<Vec<u64>> {
        match &self.world {
            Some(w) => w.sum_exact(values),
            None => Ok(values.to_vec()),
        }
    }

    /// The number of processes of the whole job (1 alone).
    pub fn world_size(&self) -> usize {
        self.world.as_ref().map_or(1, |w| w.size())
    }

    /// Waits for every rank of the job (after rank 0 wrote files the others read).
    pub fn barrier(&self) -> Result<()> {
        match &self.world {
            Some(g) => g.barrier(),
            None => Ok(()),
        }
    }

    /// Makes every data-parallel rank start from the weights of the group's first rank (a resumed
    /// or freshly initialised model; under tensor parallelism each shard from its own).
    pub fn broadcast_model<AB, M>(&self, model: M) -> Result<M>
    where
        B: crate::ops::KilnBackend,
        AB: AutodiffBackend<InnerBackend = B>,
        M: Module<AB>,
    {
        match &self.group {
            Some(g) => broadcast_module::<B, AB, M>(g.as_ref(), model, |_| 0, |_| None),
            None => Ok(model),
        }
    }

    /// The launch contract this process runs under, if any (for tools that only need to know).
    pub fn env(&self) -> Option<&DistEnv> {
        self.env.as_ref()
    }
}

/// Gives every rank of `group` each parameter as its rank `root(path)` holds it. A parameter this
/// rank let go of (`released(path)`: its whole shape, and whether it was held in bf16) is received
/// whole.
pub fn broadcast_module<B, AB, M>(
    g: &dyn Collectives<B>,
    model: M,
    root: impl Fn(&str) -> usize,
    released: impl Fn(&str) -> Option<(Shape, bool)>,
) -> Result<M>
where
    B: crate::ops::KilnBackend,
    AB: AutodiffBackend<InnerBackend = B>,
    M: Module<AB>,
{
    let mut err = None;
    let model = crate::models::params::map_params(model, |info, value: FloatTensor<AB>| {
        // A frozen weight held in bf16 travels as its f32 values (exact) and is held again.
        let (inner, shape, held) = match released(info.path) {
            Some((shape, held)) => {
                let device = B::float_device(&AB::inner(value.clone()));
                let zeros = Tensor::<B, 1>::zeros([shape.num_elements()], &device);
                (zeros.into_primitive().tensor(), shape, held)
            }
            None => {
                let held = matches!(
                    burn::tensor::TensorMetadata::dtype(&value),
                    burn::tensor::DType::U16 | burn::tensor::DType::BF16
                );
                let shape = burn::tensor::TensorMetadata::shape(&value);
                let inner = match held {
                    true => B::kiln_bf16_load(AB::inner(value.clone())),
                    false => AB::inner(value.clone()),
                };
                (inner, shape, held)
            }
        };
        if shape.num_elements() == 0 {
            // Another pipeline stage's parameter, empty on every rank of a data-parallel group.
            return value;
        }
        let flat = B::float_reshape(inner, Shape::new([shape.num_elements()]));
        match g.broadcast(
            Tensor::from_primitive(TensorPrimitive::Float(flat)),
            root(info.path),
        ) {
            Ok(v) => {
                let v = B::float_reshape(v.into_primitive().tensor(), shape);
                AB::from_inner(match held {
                    true => B::kiln_bf16_store(v).expect("held in bf16 before"),
                    false => v,
                })
            }
            Err(e) => {
                err.get_or_insert(e);
                value
            }
        }
    });
    err.map_or(Ok(model), Err)
}

/// Whether this process is the job's rank 0 (or runs alone): for callers that print results
/// before or without joining.
pub fn is_main_process() -> Result<bool> {
    Ok(DistEnv::from_env()?.is_none_or(|e| e.rank == 0))
}

/// The world size this process was launched into (1 alone).
pub fn world_size_from_env() -> Result<usize> {
    Ok(DistEnv::from_env()?.map_or(1, |e| e.world_size))
}
