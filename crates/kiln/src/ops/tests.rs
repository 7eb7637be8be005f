//! Fused CPU ops against the same math written with plain Burn tensor ops: values, and gradients
//! through Burn's own autodiff of those ops.

use burn::tensor::activation::softmax;
use burn::tensor::{Distribution, Tensor, TensorData};

use super::*;
use crate::backend::{Cpu, CpuTrain};

fn rand<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<CpuTrain, D> {
    Cpu::seed(&Default::default(), seed);
    let t = Tensor::<Cpu, D>::random(shape, Distribution::Normal(0.0, 1.0), &Default::default());
    Tensor::from_inner(t).require_grad()
}

fn host<const D: usize>(t: Tensor<Cpu, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

fn assert_close(name: &str, a: Vec<f32>, b: Vec<f32>, tol: f64) {
    let num: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    let err = (num / den.max(1e-30)).sqrt();
    assert!(err < tol, "{name}: rel err {err:e}");
}

/// Runs `fused` and `reference` on the same inputs with the same upstream gradient `w` and compares
/// outputs and every input's gradient.
fn check<const D: usize, const N: usize>(
    name: &str,
    inputs: [Tensor<CpuTrain, 2>; N],
    fused: impl Fn(&[Tensor<CpuTrain, 2>]) -> Tensor<CpuTrain, D>,
    reference: impl Fn(&[Tensor<CpuTrain, 2>]) -> Tensor<CpuTrain, D>,
) {
    let a = fused(&inputs);
    let b = reference(&inputs);
    assert_eq!(a.dims(), b.dims());
    // A random upstream gradient, so the backward pass is exercised beyond sum().
    let upstream = Tensor::<CpuTrain, D>::from_inner(rand(a.dims(), 99).inner());
    let ga = (a.clone() * upstream.clone()).sum().backward();
    let gb = (b.clone() * upstream).sum().backward();
    assert_close(
        &format!("{name} value"),
        host(a.inner()),
        host(b.inner()),
        1e-5,
    );
    for (i, x) in inputs.iter().enumerate() {
        let (da, db) = (x.grad(&ga), x.grad(&gb));
        if let (Some(da), Some(db)) = (da, db) {
            assert_close(&format!("{name} grad {i}"), host(da), host(db), 1e-4);
        }
    }
}

/// A weight laid out `[in, out]` gives the `[out, in]` Linear's output: few rows (decoding's
/// bands of weight rows, with a remainder of 2 rows) and many (the GEMM), with and without bias.
#[test]
fn linear_in_out_matches_linear() {
    let (k, n) = (50, 70);
    let w = rand([n, k], 51).inner();
    let wt = super::owned(w.clone().transpose());
    let b = rand([n], 52).inner();
    for m in [1, 3, 9, 40] {
        let x = rand([m, k], 53 + m as u64).inner();
        for bias in [None, Some(b.clone())] {
            let has_bias = bias.is_some();
            assert_close(
                &format!("linear_in_out m={m} bias={has_bias}"),
                host(super::linear_in_out(x.clone(), wt.clone(), bias.clone())),
                host(super::linear(x.clone(), w.clone(), bias)),
                1e-6,
            );
        }
    }
}

/// A first layer reads data that needs no gradient: the fused backward skips that product and
/// still gives the weight and bias theirs.
#[test]
fn linear_of_data_gives_parameter_gradients_only() {
    let x = Tensor::<CpuTrain, 2>::from_inner(rand([32, 78], 21).inner());
    let (w, b) = (rand([12, 78], 22), rand([12], 23));
    let upstream = Tensor::<CpuTrain, 2>::from_inner(rand([32, 12], 24).inner());
    let fused = (linear(x.clone(), w.clone(), Some(b.clone())) * upstream.clone())
        .sum()
        .backward();
    let reference = ((x.clone().matmul(w.clone().transpose()) + b.clone().unsqueeze_dim(0))
        * upstream)
        .sum()
        .backward();
    assert!(x.grad(&fused).is_none());
    assert_close(
        "weight grad",
        host(w.grad(&fused).unwrap()),
        host(w.grad(&reference).unwrap()),
        1e-5,
    );
    assert_close(
        "bias grad",
        host(b.grad(&fused).unwrap()),
        host(b.grad(&reference).unwrap()),
        1e-5,
    );
}

#[test]
fn gemm_tiles_are_one_per_thread_and_as_square_as_they_divide() {
    use super::cpu::gemm_grid;
    assert_eq!(
        gemm_grid(32, 120, 84, 2),
        (1, 1),
        "too small for a second thread"
    );
    assert_eq!(
        gemm_grid(32, 120, 784, 2),
        (1, 1),
        "the MNIST MLP stays on one thread"
    );
    assert_eq!(
        gemm_grid(32, 480, 784, 2),
        (1, 2),
        "few rows: split the columns"
    );
    assert_eq!(
        gemm_grid(1536, 384, 2048, 2),
        (2, 1),
        "few columns: split the rows"
    );
    assert_eq!(gemm_grid(1024, 1024, 1024, 4), (2, 2));
    assert_eq!(gemm_grid(1024, 1024, 1024, 1), (1, 1));
}

#[test]
fn linear_matches_matmul_with_transposed_weight() {
    let inputs = [rand([37, 24], 1), rand([19, 24], 2), rand([1, 19], 3)];
    check(
        "linear",
        inputs,
        |t| linear(t[0].clone(), t[1].clone(), Some(t[2].clone().reshape([19]))),
        |t| t[0].clone().matmul(t[1].clone().transpose()) + t[2].clone(),
    );
    let inputs = [rand([5, 3, 8], 4).reshape([15, 8]), rand([8, 8], 5)];
    check(
        "linear, square, no bias",
        inputs,
        |t| linear(t[0].clone(), t[1].clone(), None),
        |t| t[0].clone().matmul(t[1].clone().transpose()),
    );
    // Few rows and many columns split the columns across threads.
    let inputs = [rand([8, 64], 9), rand([600, 64], 10), rand([1, 600], 11)];
    check(
        "linear, column split",
        inputs,
        |t| {
            linear(
                t[0].clone(),
                t[1].clone(),
                Some(t[2].clone().reshape([600])),
            )
        },
        |t| t[0].clone().matmul(t[1].clone().transpose()) + t[2].clone(),
    );
    // Products big enough to split into one tile per thread: pools of 2, 3 and 4 threads cut C
    // by columns, by rows and into a 2×2 grid, at sizes that leave ragged edge tiles.
    for threads in [2, 3, 4] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            for (m, k, n) in [(37, 1801, 170), (203, 601, 170), (403, 1801, 21)] {
                let inputs = [rand([m, k], 12), rand([n, k], 13), rand([1, n], 14)];
                check(
                    &format!("linear, {m}×{k}×{n} on {threads} threads"),
                    inputs,
                    |t| linear(t[0].clone(), t[1].clone(), Some(t[2].clone().reshape([n]))),
                    |t| t[0].clone().matmul(t[1].clone().transpose()) + t[2].clone(),
                );
            }
        });
    }
    // A few rows (token-by-token decoding) take the dot-product path: odd sizes cross its
    // 16-lane chunks and 64-output blocks.
    for rows in [1, 3, 4] {
        let inputs = [rand([rows, 37], 6), rand([131, 37], 7), rand([1, 131], 8)];
        check(
            &format!("linear, {rows} rows"),
            inputs,
            |t| {
                linear(
                    t[0].clone(),
                    t[1].clone(),
                    Some(t[2].clone().reshape([131])),
                )
            },
            |t| t[0].clone().matmul(t[1].clone().transpose()) + t[2].clone(),
        );
    }
}

#[test]
fn gelu_matches_erf_formula() {
    check(
        "gelu",
        [rand([33, 70], 6) * 3.0],
        |t| gelu(t[0].clone()),
        |t| {
            (t[0].clone() * std::f64::consts::FRAC_1_SQRT_2)
                .erf()
                .add_scalar(1.0)
                * t[0].clone()
                * 0.5
        },
    );
}

#[test]
fn layer_norm_matches_composed() {
    let inputs = [
        rand([29, 48], 7) * 2.0 + 0.5,
        rand([1, 48], 8),
        rand([1, 48], 9),
    ];
    check(
        "layer_norm",
        inputs,
        |t| {
            layer_norm(
                t[0].clone(),
                t[1].clone().reshape([48]),
                t[2].clone().reshape([48]),
                1e-12,
            )
        },
        |t| {
            let (var, mean) = t[0].clone().var_mean_bias(1);
            (t[0].clone() - mean) / (var + 1e-12).sqrt() * t[1].clone() + t[2].clone()
        },
    );
}

#[test]
fn masked_softmax_matches_composed() {
    let (b, h, q, s) = (3, 2, 5, 7);
    // Batch 1 masks its last 3 keys, batch 2 its last one.
    let mut m = vec![0f32; b * s];
    for j in 4..7 {
        m[s + j] = f32::MIN;
    }
    m[2 * s + 6] = f32::MIN;
    let mask = Tensor::<CpuTrain, 2>::from_data(TensorData::new(m, [b, s]), &Default::default());
    let scores = rand([b * h * q, s], 10);
    check(
        "masked_softmax",
        [scores],
        |t| masked_softmax(t[0].clone().reshape([b, h, q, s]), mask.clone(), 0.35),
        |t| {
            softmax(
                t[0].clone().reshape([b, h, q, s]) * 0.35 + mask.clone().reshape([b, 1, 1, s]),
                3,
            )
        },
    );
}

#[test]
fn dropout_masks_are_seeded_and_scaled() {
    let shape = burn::tensor::Shape::new([1000, 100]);
    let a = host(Tensor::<Cpu, 1>::from_primitive(
        burn::tensor::TensorPrimitive::Float(Cpu::kiln_dropout_mask(
            shape.clone(),
            0.9,
            5,
            &Default::default(),
        )),
    ));
    let b = host(Tensor::<Cpu, 1>::from_primitive(
        burn::tensor::TensorPrimitive::Float(Cpu::kiln_dropout_mask(
            shape.clone(),
            0.9,
            5,
            &Default::default(),
        )),
    ));
    let c = host(Tensor::<Cpu, 1>::from_primitive(
        burn::tensor::TensorPrimitive::Float(Cpu::kiln_dropout_mask(
            shape,
            0.9,
            6,
            &Default::default(),
        )),
    ));
    assert_eq!(a, b);
    assert_ne!(a, c);
    let kept = a.iter().filter(|&&v| v > 0.0).count() as f64 / a.len() as f64;
    assert!((kept - 0.9).abs() < 0.005, "{kept}");
    assert!(a.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.9).abs() < 1e-6));
}

/// Head dimension 4 runs on `gemm` per head; 32 and 64 on kiln's register tiles, with query rows
/// that do not fill a tile (6, 37, 45; 6 rows' scores take less room than one tile's), tasks of
/// whole heads (4 batches × 4 heads) and of 32-row blocks (fewer heads than threads × 8).
#[test]
fn attention_matches_composed_ops() {
    for (b, t, h, heads) in [
        (2, 6, 8, 2),
        (2, 6, 64, 2),
        (2, 37, 64, 2),
        (1, 45, 128, 2),
        (4, 20, 128, 4),
    ] {
        attention_case(b, t, h, heads);
    }
}

fn attention_case(b: usize, t: usize, h: usize, heads: usize) {
    let scale = 1.0 / ((h / heads) as f64).sqrt();
    let mut m = vec![0f32; b * t];
    m[(b - 1) * t + 4] = f32::MIN;
    m[(b - 1) * t + 5] = f32::MIN;
    let mask = Tensor::<CpuTrain, 2>::from_data(TensorData::new(m, [b, t]), &Default::default());
    let inputs = [
        rand([b * t, h], 11),
        rand([b * t, h], 12),
        rand([b * t, h], 13),
    ];
    let split = |x: Tensor<CpuTrain, 2>| x.reshape([b, t, heads, h / heads]).swap_dims(1, 2);
    let band = super::Window {
        before: 2,
        after: 1,
    };
    for (dropout, seed, window) in [
        (0.0, 0, super::Window::FULL),
        (0.3, 77, super::Window::FULL),
        (0.0, 0, super::Window::CAUSAL),
        (0.3, 5, super::Window::CAUSAL),
        (0.0, 0, band),
        (0.3, 8, band),
    ] {
        check(
            &format!("attention {b}x{t}x{h}/{heads} p={dropout} {window:?}"),
            inputs.clone(),
            |x| {
                let r = |i: usize| x[i].clone().reshape([b, t, h]);
                let (out, _) = CpuTrain::kiln_attention(
                    p(r(0)),
                    p(r(1)),
                    p(r(2)),
                    p(mask.clone()),
                    heads,
                    window,
                    scale,
                    dropout,
                    seed,
                    false,
                );
                super::t::<CpuTrain, 3>(out)
            },
            |x| {
                let scores = split(x[0].clone()).matmul(split(x[1].clone()).swap_dims(2, 3));
                let scores = scores * scale + mask.clone().reshape([b, 1, 1, t]);
                // The window as its own additive mask, built here from positions.
                let hidden: Vec<f32> = (0..t * t)
                    .map(|ij| {
                        let (i, j) = (ij / t, ij % t);
                        let seen = if j <= i {
                            i - j <= window.before
                        } else {
                            j - i <= window.after
                        };
                        if seen {
                            0.0
                        } else {
                            1.0
                        }
                    })
                    .collect();
                let hidden = Tensor::<CpuTrain, 2>::from_data(
                    TensorData::new(hidden, [t, t]),
                    &Default::default(),
                );
                let scores = scores.mask_fill(
                    hidden.bool().unsqueeze::<4>().expand([b, heads, t, t]),
                    f32::MIN,
                );
                let probs = softmax(scores, 3);
                let probs = if dropout > 0.0 {
                    let m = Cpu::kiln_dropout_mask(
                        probs.shape(),
                        1.0 - dropout,
                        seed,
                        &Default::default(),
                    );
                    probs
                        * Tensor::<CpuTrain, 1>::from_inner(super::t::<Cpu, 1>(m))
                            .reshape([b, heads, t, t])
                } else {
                    probs
                };
                probs
                    .matmul(split(x[2].clone()))
                    .swap_dims(1, 2)
                    .reshape([b, t, h])
            },
        );
    }
}

/// Inference (nothing tracked) skips the probabilities and gives the same output as training's
/// forward, on the tiles and on `gemm`, causal, within a window or not.
#[test]
fn untracked_attention_matches_tracked() {
    for (b, t, h, heads) in [(2, 6, 8, 2), (2, 6, 64, 2), (2, 37, 64, 2), (4, 20, 128, 4)] {
        let mut m = vec![0f32; b * t];
        m[t + 3] = f32::MIN;
        let mask = Tensor::<Cpu, 2>::from_data(TensorData::new(m, [b, t]), &Default::default());
        let qkv = rand([b, t, 3 * h], 41);
        let band = super::Window {
            before: 3,
            after: 1,
        };
        for window in [super::Window::FULL, super::Window::CAUSAL, band] {
            let run = |x: Tensor<CpuTrain, 3>, with_probs| {
                let [q, k, v] = [0, 1, 2].map(|i| p(x.clone().narrow(2, i * h, h)));
                let m = p(Tensor::<CpuTrain, 2>::from_inner(mask.clone()));
                CpuTrain::kiln_attention(q, k, v, m, heads, window, 0.3, 0.0, 0, with_probs)
            };
            let (tracked, probs) = run(qkv.clone(), true);
            let (untracked, none) = run(qkv.clone().detach(), false);
            assert!(probs.is_some() && none.is_none());
            assert_close(
                &format!("untracked attention {b}x{t}x{h}/{heads} {window:?}"),
                host(super::t::<CpuTrain, 3>(untracked).inner()),
                host(super::t::<CpuTrain, 3>(tracked).inner()),
                1e-9,
            );
        }
    }
}

/// One `[B, T, 3H]` input against the same q, k and v as three tensors (the kernel above): the
/// packed layout reads and writes every head at the right columns, forward and backward.
#[test]
fn packed_qkv_attention_matches_separate() {
    let (b, t, h, heads) = (2, 6, 8, 2);
    let mut m = vec![0f32; b * t];
    m[t + 5] = f32::MIN;
    let mask = Tensor::<CpuTrain, 2>::from_data(TensorData::new(m, [b, t]), &Default::default());
    for (dropout, seed) in [(0.0, 0), (0.3, 77)] {
        check(
            &format!("attention_qkv p={dropout}"),
            [rand([b * t, 3 * h], 31)],
            |x| {
                let (out, _) = CpuTrain::kiln_attention_qkv(
                    p(x[0].clone().reshape([b, t, 3 * h])),
                    p(mask.clone()),
                    heads,
                    0.5,
                    dropout,
                    seed,
                    false,
                );
                super::t::<CpuTrain, 3>(out)
            },
            |x| {
                let part = |i: usize| p(x[0].clone().narrow(1, i * h, h).reshape([b, t, h]));
                let (out, _) = CpuTrain::kiln_attention(
                    part(0),
                    part(1),
                    part(2),
                    p(mask.clone()),
                    heads,
                    super::Window::FULL,
                    0.5,
                    dropout,
                    seed,
                    false,
                );
                super::t::<CpuTrain, 3>(out)
            },
        );
    }
}

#[test]
fn residual_layer_norm_matches_composed() {
    let (r, h) = (21, 40);
    let inputs = [
        rand([r, h], 21),
        rand([r, h], 22) * 2.0,
        rand([1, h], 23),
        rand([1, h], 24),
    ];
    for (dropout, seed) in [(0.0, 0), (0.25, 5)] {
        check(
            &format!("residual_layer_norm p={dropout}"),
            inputs.clone(),
            |x| {
                let (y, _, _, _) = CpuTrain::kiln_residual_layer_norm(
                    p(x[0].clone()),
                    p(x[1].clone()),
                    p(x[2].clone().reshape([h])),
                    p(x[3].clone().reshape([h])),
                    1e-12,
                    dropout,
                    seed,
                );
                super::t::<CpuTrain, 2>(y)
            },
            |x| {
                let xd = if dropout > 0.0 {
                    let m = Cpu::kiln_dropout_mask(
                        x[0].shape(),
                        1.0 - dropout,
                        seed,
                        &Default::default(),
                    );
                    x[0].clone()
                        * Tensor::<CpuTrain, 1>::from_inner(super::t::<Cpu, 1>(m)).reshape([r, h])
                } else {
                    x[0].clone()
                };
                let z = xd + x[1].clone();
                let (var, mean) = z.clone().var_mean_bias(1);
                (z - mean) / (var + 1e-12).sqrt() * x[2].clone() + x[3].clone()
            },
        );
    }
}

#[test]
fn reshape_relabels_without_copying_and_differentiates() {
    // Values and gradients: a reshape, then an op that cares about the layout (matmul).
    let w = rand([6, 5], 11);
    check(
        "reshape",
        [rand([4, 6], 10)],
        |t| reshape::<_, 2, 3>(t[0].clone(), [2, 2, 6]).matmul(w.clone().unsqueeze_dim(0)),
        |t| {
            t[0].clone()
                .reshape([2, 2, 6])
                .matmul(w.clone().unsqueeze_dim(0))
        },
    );
    // A contiguous CPU tensor keeps its buffer: no copy, and neither does a later kernel's use of
    // it once it is owned (a tensor made from host data starts as a borrowed view that Burn copies
    // on every use).
    let addr = |t: &FloatTensor<Cpu>| match t {
        burn::backend::ndarray::NdArrayTensor::F32(s) => s.view().as_ptr() as usize,
        _ => unreachable!(),
    };
    let x = Cpu::kiln_from_host(
        (0..128).map(|i| i as f32).collect(),
        Shape::new([8, 16]),
        &Default::default(),
    );
    let a0 = addr(&x);
    let y = Cpu::kiln_reshape(x.clone(), Shape::new([4, 32]));
    assert_eq!(addr(&y), a0, "reshape copied the buffer");
    let owned = Cpu::kiln_into_owned(x);
    assert_eq!(addr(&owned), a0, "an owned tensor was copied again");
    let borrowed =
        Tensor::<Cpu, 2>::from_data(TensorData::new(vec![1f32; 6], [2, 3]), &Default::default());
    let owned = Cpu::kiln_into_owned(borrowed.into_primitive().tensor());
    let a1 = addr(&owned);
    assert_eq!(addr(&Cpu::kiln_reshape(owned, Shape::new([6]))), a1);
}

#[test]
fn rms_norm_matches_f64_and_composed_gradients() {
    let (r, h) = (37, 48);
    let (x, w) = (rand([r, h], 21), rand([1, h], 22));
    // values against an f64 computation
    let (xs, ws) = (host(x.clone().inner()), host(w.clone().inner()));
    let fused = super::rms_norm(x.clone(), w.clone().reshape([h]), 1e-5);
    let got = host(fused.clone().inner());
    let mut worst = 0f64;
    for (row, out) in xs.chunks(h).zip(got.chunks(h)) {
        let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / h as f64;
        let inv = 1.0 / (ms + 1e-5).sqrt();
        for i in 0..h {
            let exact = row[i] as f64 * inv * ws[i] as f64;
            worst = worst.max((out[i] as f64 - exact).abs() / exact.abs().max(1e-3));
        }
    }
    assert!(worst < 1e-6, "rms_norm value: worst rel err {worst:e}");
    // gradients against Burn's autodiff of the composed formula
    let upstream = Tensor::<CpuTrain, 2>::from_inner(rand([r, h], 99).inner());
    let ga = (fused * upstream.clone()).sum().backward();
    let inv = (x.clone() * x.clone())
        .mean_dim(1)
        .add_scalar(1e-5)
        .sqrt()
        .recip();
    let gb = (x.clone() * inv * w.clone() * upstream).sum().backward();
    for (name, a, b) in [
        ("dx", x.grad(&ga), x.grad(&gb)),
        ("dw", w.grad(&ga), w.grad(&gb)),
    ] {
        assert_close(
            &format!("rms_norm {name}"),
            host(a.unwrap()),
            host(b.unwrap()),
            1e-4,
        );
    }
}

#[test]
fn swiglu_matches_composed() {
    let inputs = [rand([37, 48], 23), rand([37, 48], 24)];
    check(
        "swiglu",
        inputs,
        |t| super::swiglu(t[0].clone(), t[1].clone()),
        |t| burn::tensor::activation::silu(t[0].clone()) * t[1].clone(),
    );
}

/// Per-row cross-entropy against Burn's log-softmax + gather (and Burn's autodiff of them): a
/// classifier's batch (one task), a language model's rows split across the pool, ignored rows, and
/// logits large enough that an unshifted exp would overflow.
#[test]
fn cross_entropy_matches_log_softmax_gather() {
    use burn::tensor::activation::log_softmax;
    use burn::tensor::Int;
    for (n, c, spread) in [(32, 10, 1.0), (300, 2000, 1.0), (7, 50, 60.0)] {
        let x = Tensor::<CpuTrain, 2>::from_inner(rand([n, c], 31).inner() * spread).require_grad();
        let targets: Vec<i64> = (0..n)
            .map(|r| {
                if r % 5 == 3 {
                    -100
                } else {
                    ((r * 7919) % c) as i64
                }
            })
            .collect();
        let t = || {
            Tensor::<CpuTrain, 1, Int>::from_data(
                TensorData::new(targets.clone(), [n]),
                &Default::default(),
            )
        };
        let keep = Tensor::<CpuTrain, 1>::from_data(
            TensorData::new(
                targets
                    .iter()
                    .map(|&t| f32::from(t != -100))
                    .collect::<Vec<_>>(),
                [n],
            ),
            &Default::default(),
        );
        check(
            &format!("cross_entropy {n}×{c}"),
            [x],
            |i| cross_entropy(i[0].clone(), t(), -100),
            |i| {
                let safe = t().clamp_min(0).reshape([n, 1]);
                log_softmax(i[0].clone(), 1)
                    .gather(1, safe)
                    .reshape([n])
                    .neg()
                    * keep.clone()
            },
        );
    }
}

#[test]
#[should_panic(expected = "cross-entropy target 10 is outside the 10 classes")]
fn cross_entropy_refuses_a_target_outside_the_classes() {
    use burn::tensor::Int;
    let x = rand([2, 10], 5);
    let t = Tensor::<CpuTrain, 1, Int>::from_data(
        TensorData::new(vec![3i64, 10], [2]),
        &Default::default(),
    );
    let _ = cross_entropy(x, t, -100);
}

/// Rotary embedding against transformers' formula in Burn ops (`x·cos + rotate_half(x)·sin`), its
/// gradient against Burn's autodiff of that formula. The tables are random, not the duplicated
/// halves RoPE uses, so each half's cos and sin are checked in their own place.
#[test]
fn rope_matches_rotate_half_formula() {
    let (b, t, h, d) = (2, 5, 3, 8);
    let (cos, sin) = (rand([t, d], 41), rand([t, d], 42));
    check(
        "rope",
        [rand([b * t, h * d], 43)],
        |i| rope(i[0].clone().reshape([b, t, h, d]), &cos, &sin),
        |i| {
            let x = i[0].clone().reshape([b, t, h, d]);
            let first = x.clone().slice([0..b, 0..t, 0..h, 0..d / 2]);
            let second = x.clone().slice([0..b, 0..t, 0..h, d / 2..d]);
            let rotated = Tensor::cat(vec![second.neg(), first], 3);
            x * cos.clone().reshape([1, t, 1, d]) + rotated * sin.clone().reshape([1, t, 1, d])
        },
    );
}
