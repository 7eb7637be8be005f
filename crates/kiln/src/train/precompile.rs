//! `kiln precompile`'s shape enumeration: every batch shape a run can meet, found from the
//! examples' lengths and the padding rule, not sampled from a few steps (which is where
//! `neuron_parallel_compile` misses shapes: a length bucket first met at step 900 compiles at step
//! 900). The trainer then runs one training step on a batch of each shape (forward, backward, the
//! gradient sync and the optimizer: every kernel a step launches) and one evaluation batch of each
//! evaluation shape, so the kernel cache holds them all before the real run's step 1.
//!
//! A batch's shape is its size and its padded length. A batch is padded to the padded length of its
//! longest example, so the padded lengths a run meets are among its examples' padded lengths; a
//! size `b` meets length `P` only when at least `b` examples pad to `P` or less.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use burn::module::AutodiffModule;
use tracing::info;

use super::trainer::{evaluate, write_json, EvalOutput, Reported, TrainOutput, Trainer};
use crate::contract::{BatchSource, Loss, Model};
use crate::error::Result;
use crate::ops::TrainBackend;

/// The file the precompile run writes its [`PrecompileSummary`] to, in its output folder.
pub const SUMMARY_FILE: &str = "precompile.json";

/// One batch to run: its example indices, and the shape it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    pub indices: Vec<usize>,
    /// `(batch size, padded length)`.
    pub shape: (usize, usize),
}

/// One batch of every shape `(b, P)` for `b` in `sizes` over examples of `lengths`, each padded
/// length `P` given by `padded(longest)`. Sizes of 0 or past the examples are left out.
pub fn probes(lengths: &[usize], padded: impl Fn(usize) -> usize, sizes: &[usize]) -> Vec<Probe> {
    let mut by_length: Vec<usize> = (0..lengths.len()).collect();
    by_length.sort_by_key(|&i| (lengths[i], i));
    let mut sizes: Vec<usize> = sizes
        .iter()
        .copied()
        .filter(|&b| b > 0 && b <= lengths.len())
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut out = Vec::new();
    // The longest example of each padded length stands for it (`by_length` is ascending, so the
    // last one seen of each length wins); `rank` is its place in `by_length`.
    let mut reps: Vec<(usize, usize)> = Vec::new();
    for (rank, &i) in by_length.iter().enumerate() {
        let p = padded(lengths[i]);
        match reps.last_mut() {
            Some(last) if padded(lengths[by_length[last.1]]) == p => *last = (p, rank),
            _ => reps.push((p, rank)),
        }
    }
    for &(p, rank) in &reps {
        for &b in &sizes {
            // `rank + 1` examples pad to `p` or less: the representative and the shortest others.
            if b > rank + 1 {
                continue;
            }
            let mut indices = vec![by_length[rank]];
            indices.extend(by_length.iter().take(b - 1).copied());
            out.push(Probe {
                indices,
                shape: (b, p),
            });
        }
    }
    out
}

/// A source's batches at `indices` only: how the trainer evaluates one probe.
pub(crate) struct Subset<'a, S> {
    pub src: &'a S,
    pub indices: Vec<usize>,
}

impl<S: BatchSource> BatchSource for Subset<'_, S> {
    type Batch = S::Batch;
    fn len(&self) -> usize {
        self.indices.len()
    }
    fn lengths(&self) -> Vec<usize> {
        let all = self.src.lengths();
        self.indices.iter().map(|&i| all[i]).collect()
    }
    fn batch(&self, indices: &[usize]) -> (Self::Batch, Vec<i64>) {
        let mapped: Vec<usize> = indices.iter().map(|&i| self.indices[i]).collect();
        self.src.batch(&mapped)
    }
    fn padded_length(&self, longest: usize) -> usize {
        self.src.padded_length(longest)
    }
}

/// What a precompile run did.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct PrecompileSummary {
    /// `(batch size, padded length)` of every training step run.
    pub train_shapes: Vec<(usize, usize)>,
    /// The same for evaluation batches.
    pub eval_shapes: Vec<(usize, usize)>,
    /// Shapes whose step failed, with the reason.
    pub failed: Vec<String>,
    pub seconds: f64,
    /// GPU kernels compiled, and loaded from the cache instead (CUDA only).
    pub kernels_compiled: Option<u64>,
    pub kernel_cache_hits: Option<u64>,
}

impl<B, M, L> Trainer<B, M, L>
where
    B: TrainBackend,
    M: AutodiffModule<B> + Model<B> + Clone,
    M::InnerModule: Model<B::InnerBackend, Batch = M::Batch>,
    L: Loss,
{
    /// One training step on a batch of every shape `train` can form (the per-device batch size,
    /// and the last partial batch of an epoch unless it is dropped) and one evaluation of every
    /// shape `eval` can form; the summary goes to the output folder's [`SUMMARY_FILE`]. The
    /// weights these steps leave are thrown away with the (scratch) output folder.
    pub(super) fn precompile_shapes<S, E>(
        &mut self,
        train: &S,
        eval: Option<&E>,
    ) -> Result<(TrainOutput, Option<EvalOutput>)>
    where
        S: BatchSource<Batch = M::Batch>,
        E: BatchSource<Batch = M::Batch>,
    {
        let started = Instant::now();
        let plan = self.start(train, eval.is_some())?;
        let a = self.args.clone();
        let all: Vec<usize> = (0..train.len()).collect();
        let per_rank = self.parallel.data.shard(&all, a.dataloader_drop_last).len();
        let mut sizes = vec![plan.batch_size];
        if !a.dataloader_drop_last {
            sizes.push(per_rank % plan.batch_size);
        }
        let mut summary = PrecompileSummary::default();
        for p in probes(&train.lengths(), |l| train.padded_length(l), &sizes) {
            info!(
                "precompile: training step on a {}×{} batch",
                p.shape.0, p.shape.1
            );
            let step = catch_unwind(AssertUnwindSafe(|| {
                self.optimizer_step(train, &[&p.indices[..]], &plan)
            }));
            note(&mut summary.failed, "train", p.shape, step);
            summary.train_shapes.push(p.shape);
        }
        if let Some(eval) = eval {
            let bs = a.per_device_eval_batch_size.max(1);
            let sizes = [bs, eval.len() % bs];
            for p in probes(&eval.lengths(), |l| eval.padded_length(l), &sizes) {
                info!(
                    "precompile: evaluation of a {}×{} batch",
                    p.shape.0, p.shape.1
                );
                let subset = Subset {
                    src: eval,
                    indices: p.indices,
                };
                let out = catch_unwind(AssertUnwindSafe(|| {
                    evaluate(
                        &self.model().valid(),
                        &subset,
                        p.shape.0,
                        &self.loss,
                        Reported {
                            label_names: self.metrics.label_names.as_deref(),
                            ..Reported::default()
                        },
                        &crate::parallel::DataParallel::single(),
                    )
                }));
                note(&mut summary.failed, "eval", p.shape, out);
                summary.eval_shapes.push(p.shape);
            }
        }
        summary.seconds = started.elapsed().as_secs_f64();
        if let Some((compiled, hits)) = crate::backend::kernel_compilations() {
            summary.kernels_compiled = Some(compiled);
            summary.kernel_cache_hits = Some(hits);
        }
        write_json(&a.output_dir.join(SUMMARY_FILE), &summary)?;
        let out = TrainOutput {
            global_step: 0,
            metrics: BTreeMap::new(),
        };
        Ok((out, None))
    }
}

/// Records a failed (or panicked) probe as one line.
fn note<T>(
    failed: &mut Vec<String>,
    what: &str,
    (b, t): (usize, usize),
    result: std::thread::Result<Result<T>>,
) {
    let why = match result {
        Ok(Ok(_)) => return,
        Ok(Err(e)) => e.to_string(),
        Err(panic) => panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panicked".into()),
    };
    failed.push(format!("{what} {b}×{t}: {why}"));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round8(n: usize) -> usize {
        n.next_multiple_of(8).min(32)
    }

    /// Every shape a shuffled run could form, by brute force over all batches of each size.
    fn reachable(lengths: &[usize], sizes: &[usize]) -> Vec<(usize, usize)> {
        let n = lengths.len();
        let mut out = Vec::new();
        for mask in 1u32..(1 << n) {
            let b = mask.count_ones() as usize;
            if !sizes.contains(&b) {
                continue;
            }
            let longest = (0..n)
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| lengths[i])
                .max()
                .unwrap();
            out.push((b, round8(longest)));
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    #[test]
    fn probes_cover_exactly_the_reachable_shapes() {
        let lengths = [3, 17, 9, 40, 16, 2, 25, 8, 11, 30];
        let sizes = [4, 3, 0, 99];
        let got = probes(&lengths, round8, &sizes);
        for p in &got {
            assert_eq!(p.indices.len(), p.shape.0, "{p:?}");
            let longest = p.indices.iter().map(|&i| lengths[i]).max().unwrap();
            assert_eq!(round8(longest), p.shape.1, "{p:?} pads to its shape");
            let mut uniq = p.indices.clone();
            uniq.sort_unstable();
            uniq.dedup();
            assert_eq!(uniq.len(), p.indices.len(), "{p:?}: no example twice");
        }
        let mut shapes: Vec<_> = got.iter().map(|p| p.shape).collect();
        shapes.sort_unstable();
        assert_eq!(shapes, reachable(&lengths, &[3, 4]));
    }

    #[test]
    fn fixed_shapes_need_one_probe_per_size() {
        let got = probes(&[128; 10], |l| l, &[4, 2, 4]);
        let shapes: Vec<_> = got.iter().map(|p| p.shape).collect();
        assert_eq!(shapes, vec![(2, 128), (4, 128)]);
    }
}
