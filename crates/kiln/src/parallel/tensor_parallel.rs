//! Tensor parallelism's building blocks: a mesh group as the communicator the tensor-parallel ops
//! use ([`TpGroup`]), and vocab-parallel cross-entropy ([`VocabParallelCrossEntropy`]), which
//! takes each rank's slice of the vocabulary logits and never gathers the full rows.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use std::collections::BTreeMap;

use super::collectives::{host, Collectives, ReduceOp};
use crate::contract::{Loss, ParamSplit, TensorParallelLayout, IGNORE_INDEX};
use crate::formats::safetensors::HostTensor;
use crate::formats::sharded::place_axis;
use crate::ops::{row_cross_entropy, KilnBackend, TpComm, TpReduce, VocabSlice};
use crate::{KilnError, Result};

/// A tensor-parallel group (any engine) as the ops' [`TpReduce`].
pub struct TpGroup<B: Backend> {
    comm: Arc<dyn Collectives<B>>,
}

impl<B: Backend> TpGroup<B> {
    /// The communicator the tensor-parallel ops and models hold.
    pub fn comm(comm: Arc<dyn Collectives<B>>) -> TpComm {
        Arc::new(Self { comm })
    }

    fn reduce(&self, values: Vec<f32>, op: ReduceOp) -> Vec<f32> {
        let n = values.len();
        let t = Tensor::from_data(TensorData::new(values, [n]), self.comm.device());
        match self.comm.all_reduce(t, op) {
            Ok(t) => host(t),
            // Inside backward there is no caller to return an error to; the engine's watchdog
            // has named a missing peer before a collective fails.
            Err(e) => {
                eprintln!(
                    "error: tensor-parallel rank {}: {e}; stopping this worker",
                    self.comm.rank()
                );
                std::process::exit(super::group::PEER_LOST_EXIT_CODE)
            }
        }
    }
}

impl<B: Backend> std::fmt::Debug for TpGroup<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TpGroup(rank {} of {})",
            self.comm.rank(),
            self.comm.size()
        )
    }
}

impl<B: Backend> TpReduce for TpGroup<B> {
    fn sum(&self, values: Vec<f32>) -> Vec<f32> {
        self.reduce(values, ReduceOp::Sum)
    }
    fn max(&self, values: Vec<f32>) -> Vec<f32> {
        self.reduce(values, ReduceOp::Max)
    }
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn size(&self) -> usize {
        self.comm.size()
    }
}

/// The whole model from every rank's shard (a collective: every rank of the group calls it; the
/// ranks with `keep` get the whole tensors, the others an empty map). Sharded parameters travel
/// one at a time, each rank filling its part, so no rank holds more than one whole parameter
/// besides what it keeps; replicated ones are checked equal on every rank — replicas that drifted
/// apart (a missing gradient sum) are an error naming the parameter, never a silent pick of one.
pub fn consolidate(
    layout: &TensorParallelLayout,
    local: BTreeMap<String, HostTensor>,
    keep: bool,
) -> Result<BTreeMap<String, HostTensor>> {
    let tp = &layout.tp;
    let split = |name: &str| {
        layout.splits.get(name).ok_or_else(|| {
            KilnError::Weights(format!("{name}: no tensor-parallel split is known for it"))
        })
    };
    // The replicated values (norms, biases, replicated key/value heads: small), checked at once.
    let mut replicated = Vec::new();
    for (name, t) in &local {
        if let ParamSplit::Replicated = split(name)? {
            replicated.extend_from_slice(&t.data);
        }
    }
    let most = tp.max(replicated.clone());
    let least: Vec<f32> = tp
        .max(replicated.iter().map(|v| -v).collect())
        .into_iter()
        .map(|v| -v)
        .collect();
    drop(replicated);
    let mut at_repl = 0;
    let mut out = BTreeMap::new();
    for (name, t) in local {
        let t = match split(&name)? {
            ParamSplit::Replicated => {
                let n = t.data.len();
                let spread = (at_repl..at_repl + n)
                    .map(|i| most[i] - least[i])
                    .fold(0f32, f32::max);
                at_repl += n;
                if spread > 0.0 || spread.is_nan() {
                    return Err(KilnError::Weights(format!(
                        "{name}: its copies on the tensor-parallel ranks differ (by up to {spread}); \
                         a replicated parameter must stay equal on every rank"
                    )));
                }
                t
            }
            ParamSplit::Sharded { axis, range, full } => {
                let mut shape = t.shape.clone();
                shape[*axis] = *full;
                let mut whole = vec![0.0; shape.iter().product()];
                place_axis(&mut whole, &t, *axis, range, *full);
                drop(t);
                HostTensor {
                    shape,
                    data: tp.sum(whole),
                }
            }
        };
        if keep {
            out.insert(name, t);
        }
    }
    Ok(out)
}

/// Mean cross-entropy over the non-ignored targets (as [`crate::contract::CrossEntropy`]) of logits
/// split by vocabulary over a tensor-parallel group: rank `r` holds columns
/// `chunk_range(vocab, size, r)` ([`VocabSlice`], which computes it). Per row, three sums cross
/// the group, so each rank moves `3 × rows` values instead of `rows × vocab`. Every rank gets the
/// same loss, and the gradient of its own slice, `softmax − one-hot`, as Megatron's and NxD's do.
#[derive(Debug, Clone)]
pub struct VocabParallelCrossEntropy {
    pub tp: TpComm,
    /// The full vocabulary size.
    pub vocab: usize,
}

impl Loss for VocabParallelCrossEntropy {
    fn loss<B: KilnBackend>(
        &self,
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> Tensor<B, 1> {
        let count = crate::contract::target_count(&targets);
        let slice = VocabSlice::of(self.tp.clone(), self.vocab);
        row_cross_entropy(logits, targets, IGNORE_INDEX, Some(&slice)).sum() / count
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Cpu, CpuTrain};
    use crate::contract::CrossEntropy;
    use crate::parallel::collectives::chunk_range;
    use crate::parallel::threads::ThreadComm;
    use burn::tensor::Distribution;

    fn vec2(t: Tensor<Cpu, 2>) -> Vec<f32> {
        t.into_data().into_vec().unwrap()
    }

    /// Runs `f(rank, comm)` on `size` threads, one tensor-parallel rank each.
    fn on_ranks<T: Send>(size: usize, f: impl Fn(usize, TpComm) -> T + Sync) -> Vec<T> {
        let comms = ThreadComm::<Cpu>::group(size, &Default::default());
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(r, c)| {
                    let f = &f;
                    s.spawn(move || f(r, TpGroup::comm(Arc::new(c))))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        let err = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(err <= tol, "{what}: max |Δ| {err}");
    }

    /// Values and gradients of the vocab-parallel loss equal plain cross-entropy's, with ignored
    /// targets, a vocabulary that does not divide by the group (7 over 2 and 3) and large logits.
    #[test]
    fn vocab_parallel_cross_entropy_equals_cross_entropy() {
        let device = Default::default();
        let (n, vocab) = (6, 7);
        let full =
            Tensor::<Cpu, 2>::random([n, vocab], Distribution::Normal(0.0, 4.0), &device) + 30.0;
        let targets: Vec<i64> = vec![0, 6, IGNORE_INDEX, 3, 4, IGNORE_INDEX];
        let tt = |d: &<CpuTrain as Backend>::Device| {
            Tensor::<CpuTrain, 1, Int>::from_data(TensorData::new(targets.clone(), [n]), d)
        };
        let x = Tensor::<CpuTrain, 2>::from_inner(full.clone()).require_grad();
        let want = CrossEntropy.loss(x.clone(), tt(&device));
        let want_loss = want.clone().into_scalar();
        let want_grad = vec2(x.grad(&want.backward()).unwrap());
        for size in [1, 2, 3] {
            let got = on_ranks(size, |r, tp| {
                let cols = chunk_range(vocab, size, r);
                let slice = full.clone().slice([0..n, cols.clone()]);
                let x = Tensor::<CpuTrain, 2>::from_inner(slice).require_grad();
                let loss = VocabParallelCrossEntropy { tp, vocab }.loss(x.clone(), tt(&device));
                let value = loss.clone().into_scalar();
                (value, cols, vec2(x.grad(&loss.backward()).unwrap()))
            });
            for (value, cols, grad) in got {
                assert!(
                    (value - want_loss).abs() < 1e-5,
                    "tp={size}: {value} vs {want_loss}"
                );
                let want_slice: Vec<f32> = (0..n)
                    .flat_map(|i| want_grad[i * vocab + cols.start..i * vocab + cols.end].to_vec())
                    .collect();
                close(
                    &grad,
                    &want_slice,
                    1e-6,
                    &format!("tp={size} gradient of {cols:?}"),
                );
            }
        }
    }

    /// The output head's product and the loss a chunk of rows at a time over a vocabulary split
    /// by a tensor-parallel group (each rank holding its rows of the head) equal the whole head's
    /// log-softmax + gather at one process: every rank's losses, the input's gradient (summed
    /// over the group), each rank's rows of the weight's gradient, and the scored rows'
    /// statistics. Upstream gradients of one per row take the forward's gradients; differing
    /// ones recompute the weight's; scored rows always do.
    #[test]
    fn chunked_vocab_parallel_head_equals_the_whole_head() {
        use crate::ops::{linear_cross_entropy, scored_linear_cross_entropy, token_statistics};
        use burn::tensor::activation::log_softmax;
        let device = Default::default();
        let (n, h, vocab, chunk) = (13, 8, 23, 4);
        let normal = |dims: [usize; 2], scale: f64| {
            Tensor::<Cpu, 2>::random(dims, Distribution::Normal(0.0, scale), &device)
        };
        let (x0, w0) = (normal([n, h], 1.0), normal([vocab, h], 2.0));
        let targets: Vec<i64> = (0..n)
            .map(|r| match r % 5 {
                3 => IGNORE_INDEX,
                _ => ((r * 17 + 4) % vocab) as i64,
            })
            .collect();
        let tt = || {
            Tensor::<CpuTrain, 1, Int>::from_data(TensorData::new(targets.clone(), [n]), &device)
        };
        let upstream: Vec<f32> = (0..n).map(|r| 0.5 + r as f32 / 7.0).collect();
        let g =
            || Tensor::<CpuTrain, 1>::from_data(TensorData::new(upstream.clone(), [n]), &device);
        let param = |t: Tensor<Cpu, 2>| Tensor::<CpuTrain, 2>::from_inner(t).require_grad();
        let vec1 = |t: Tensor<Cpu, 1>| -> Vec<f32> { t.into_data().into_vec().unwrap() };
        // The whole head at one process, for unit and for differing upstream gradients.
        let whole = || {
            let (x, w) = (param(x0.clone()), param(w0.clone()));
            let logits = x.clone().matmul(w.clone().transpose());
            let keep = tt().not_equal_elem(IGNORE_INDEX).float();
            let safe = tt().clamp_min(0).reshape([n, 1]);
            let losses = log_softmax(logits.clone(), 1)
                .gather(1, safe)
                .reshape([n])
                .neg()
                * keep;
            (x, w, logits, losses)
        };
        let (_, _, logits, want_losses) = whole();
        let want_stats = token_statistics(logits.inner(), tt().inner(), IGNORE_INDEX, None);
        let want = |weighted: bool| {
            let (x, w, _, losses) = whole();
            let total = match weighted {
                true => (losses * g()).sum(),
                false => losses.sum(),
            };
            let grads = total.backward();
            (vec2(x.grad(&grads).unwrap()), vec2(w.grad(&grads).unwrap()))
        };
        let want_values = vec1(want_losses.clone().inner());
        for size in [2, 3] {
            for (scored, weighted) in [(false, false), (false, true), (true, true)] {
                let what = format!("tp={size} scored={scored} weighted={weighted}");
                let (want_dx, want_dw) = want(weighted);
                let got = on_ranks(size, |_, tp| {
                    let slice = VocabSlice::of(tp, vocab);
                    let rows = slice.columns.clone();
                    let x = param(x0.clone());
                    let w = param(w0.clone().slice([rows.clone(), 0..h]));
                    let (losses, stats) = match scored {
                        true => {
                            let (l, s) = scored_linear_cross_entropy(
                                x.clone(),
                                w.clone(),
                                tt(),
                                IGNORE_INDEX,
                                chunk,
                                Some(slice),
                            );
                            (l, Some(s))
                        }
                        false => {
                            let l = linear_cross_entropy(
                                x.clone(),
                                w.clone(),
                                tt(),
                                IGNORE_INDEX,
                                chunk,
                                Some(slice),
                            );
                            (l, None)
                        }
                    };
                    let values = vec1(losses.clone().inner());
                    let total = match weighted {
                        true => (losses * g()).sum(),
                        false => losses.sum(),
                    };
                    let grads = total.backward();
                    let (dx, dw) = (vec2(x.grad(&grads).unwrap()), vec2(w.grad(&grads).unwrap()));
                    let stats = stats.map(|s| {
                        let s = s.map(|t| t.inner());
                        [vec1(s.mean_logit), vec1(s.entropy), vec1(s.top1)]
                    });
                    (rows, values, dx, dw, stats)
                });
                for (rows, values, dx, dw, stats) in got {
                    close(&values, &want_values, 1e-5, &format!("{what}: losses"));
                    close(&dx, &want_dx, 1e-5, &format!("{what}: input gradient"));
                    let want_rows = &want_dw[rows.start * h..rows.end * h];
                    close(
                        &dw,
                        want_rows,
                        1e-5,
                        &format!("{what}: rows {rows:?} of dw"),
                    );
                    if let Some([mean, entropy, top1]) = stats {
                        let s = want_stats.clone();
                        close(
                            &mean,
                            &vec1(s.mean_logit),
                            1e-5,
                            &format!("{what}: mean logit"),
                        );
                        close(
                            &entropy,
                            &vec1(s.entropy),
                            1e-5,
                            &format!("{what}: entropy"),
                        );
                        close(&top1, &vec1(s.top1), 0.0, &format!("{what}: top-1"));
                    }
                }
            }
        }
    }

    /// A column-parallel layer followed by a row-parallel one (Megatron's MLP split) gives the
    /// full layer's output and gradients: the region ops sum what must be summed, once.
    #[test]
    fn column_then_row_parallel_equals_the_full_layers() {
        use crate::ops::{linear, swiglu, tp_enter, tp_sum};
        let device = Default::default();
        let (n, h, i) = (5, 8, 12);
        let normal = |dims: [usize; 2]| {
            Tensor::<Cpu, 2>::random(dims, Distribution::Normal(0.0, 0.5), &device)
        };
        let (x0, gate0, up0, down0) = (
            normal([n, h]),
            normal([i, h]),
            normal([i, h]),
            normal([h, i]),
        );
        let weight = normal([n, h]);
        let param = |t: Tensor<Cpu, 2>| Tensor::<CpuTrain, 2>::from_inner(t).require_grad();
        let run = |x: Tensor<CpuTrain, 2>, g, u, d, tp: Option<&TpComm>| {
            let x_in = match tp {
                Some(tp) => tp_enter(x, tp),
                None => x,
            };
            let a = swiglu(linear(x_in.clone(), g, None), linear(x_in, u, None));
            let y = linear(a, d, None);
            let y = match tp {
                Some(tp) => tp_sum(y, tp),
                None => y,
            };
            (y.clone() * Tensor::from_inner(weight.clone())).sum()
        };
        let (x, g, u, d) = (
            param(x0.clone()),
            param(gate0.clone()),
            param(up0.clone()),
            param(down0.clone()),
        );
        let loss = run(x.clone(), g.clone(), u.clone(), d.clone(), None);
        let grads = loss.backward();
        let want = |t: &Tensor<CpuTrain, 2>| vec2(t.grad(&grads).unwrap());
        let (wx, wg, wd) = (want(&x), want(&g), want(&d));
        for size in [2, 3] {
            let got = on_ranks(size, |r, tp| {
                let rows = chunk_range(i, size, r);
                let x = param(x0.clone());
                let g = param(gate0.clone().slice([rows.clone(), 0..h]));
                let u = param(up0.clone().slice([rows.clone(), 0..h]));
                let d = param(down0.clone().slice([0..h, rows.clone()]));
                let loss = run(x.clone(), g.clone(), u, d.clone(), Some(&tp));
                let grads = loss.backward();
                let get = |t: &Tensor<CpuTrain, 2>| vec2(t.grad(&grads).unwrap());
                (rows, get(&x), get(&g), get(&d))
            });
            for (rows, gx, gg, gd) in got {
                close(&gx, &wx, 1e-5, &format!("tp={size}: input gradient"));
                close(&gg, &wg[rows.start * h..rows.end * h], 1e-5, "gate rows");
                let want_d: Vec<f32> = (0..h)
                    .flat_map(|o| wd[o * i + rows.start..o * i + rows.end].to_vec())
                    .collect();
                close(&gd, &want_d, 1e-5, &format!("tp={size}: down columns"));
            }
        }
    }
}
