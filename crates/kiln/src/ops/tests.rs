//! Fused CPU ops against the same math written with plain Burn tensor ops: values, and gradients
//! through Burn's own autodiff of those ops. Both are measured against the composed ops run in f64
//! (Burn's ndarray backend at f64, its autodiff for the gradients): the fused kernel may err by a
//! few times what the composed f32 ops err by, never by a constant tuned on one CPU kind — AVX2 and
//! AVX-512 machines sum in other orders, and an f32 gradient that cancels (attention's dQ, a
//! norm's dw) carries relative errors near 1e-4 on either path.

use burn::backend::{Autodiff, NdArray};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Element, Int, Tensor, TensorData};

use super::*;
use crate::backend::{Cpu, CpuTrain};

/// An attention spec from its parts, as the tests vary them.
fn attention_spec(heads: usize, window: Window, scale: f64, rate: f64, seed: u64) -> AttentionSpec {
    AttentionSpec {
        heads,
        window,
        scale,
        dropout: Dropout { rate, seed },
    }
}

/// The f64 reference backend.
type Exact = Autodiff<NdArray<f64>>;

/// A seeded N(0, 1) tensor. The backend's generator is process-wide and tests run side by side,
/// so it is seeded and drawn under `with_seeded_rng`'s lock: the same seed, the same inputs.
fn rand<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<CpuTrain, D> {
    let device = Default::default();
    let t = super::with_seeded_rng::<Cpu, _>(&device, seed, || {
        Tensor::<Cpu, D>::random(shape, Distribution::Normal(0.0, 1.0), &device)
    });
    Tensor::from_inner(t).require_grad()
}

fn host<const D: usize>(t: Tensor<Cpu, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

fn host64<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    t.into_data().convert::<f64>().into_vec::<f64>().unwrap()
}

/// Host values `v` of `shape` as a tensor of the backend `_like`'s inputs live on: how a reference
/// captures constants (masks, tables, targets) so the same expression runs in f32 and in f64.
fn data<B: Backend, const D: usize>(
    _like: &[Tensor<B, 2>],
    v: &[f32],
    shape: [usize; D],
) -> Tensor<B, D> {
    Tensor::from_data(
        TensorData::new(v.to_vec(), shape).convert::<B::FloatElem>(),
        &Default::default(),
    )
}

/// Integer host values (targets) of `shape` on the backend of `_like`.
fn ints<B: Backend, const D: usize>(
    _like: &[Tensor<B, 2>],
    v: &[i64],
    shape: [usize; D],
) -> Tensor<B, D, burn::tensor::Int> {
    Tensor::from_data(
        TensorData::new(v.to_vec(), shape).convert::<B::IntElem>(),
        &Default::default(),
    )
}

/// `t` in f64, tracked, for the exact reference.
fn to_exact<const D: usize>(t: &Tensor<CpuTrain, D>) -> Tensor<Exact, D> {
    let v: Vec<f64> = host(t.clone().inner()).into_iter().map(f64::from).collect();
    Tensor::<Exact, D>::from_data(TensorData::new(v, t.dims()), &Default::default()).require_grad()
}

/// ‖a − b‖ / ‖b‖.
fn rel_err<A: Element, T: Element>(a: &[A], b: &[T]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x.to_f64() - y.to_f64()).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| y.to_f64().powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn assert_close(name: &str, a: Vec<f32>, b: Vec<f32>, tol: f64) {
    let err = rel_err(&a, &b);
    assert!(err < tol, "{name}: rel err {err:e}");
}

/// How far a fused kernel may be from the f64 truth: [`ROUNDING_SLACK`] times the composed f32 ops'
/// own error (the same math, rounded in another order), or [`ROUNDING_FLOOR`] where those happen to
/// be nearly exact.
const ROUNDING_SLACK: f64 = 4.0;
/// 32 f32 roundings (2⁻¹⁹ ≈ 1.9e-6), relative: kiln's exponential alone is 2 ulp.
const ROUNDING_FLOOR: f64 = 32.0 * f32::EPSILON as f64 / 2.0;

/// Asserts the fused result is within [`ROUNDING_SLACK`]× the composed f32 result's error against
/// the f64 truth (or [`ROUNDING_FLOOR`]), and returns (fused error, composed error).
fn assert_within_rounding(
    name: &str,
    fused: &[f32],
    composed: &[f32],
    truth: &[f64],
) -> (f64, f64) {
    let (e_fused, e_composed) = (rel_err(fused, truth), rel_err(composed, truth));
    let allowed = (ROUNDING_SLACK * e_composed).max(ROUNDING_FLOOR);
    eprintln!("{name}: fused {e_fused:.2e}, composed f32 {e_composed:.2e} (vs f64)");
    assert!(
        e_fused <= allowed,
        "{name}: fused rel err {e_fused:e} against f64, composed f32 ops {e_composed:e}: allowed {allowed:e}"
    );
    // The reference itself must be the same math: a composed result far from the truth would let
    // any fused result pass.
    assert!(
        e_composed < 1e-3,
        "{name}: the composed f32 ops are off by {e_composed:e}"
    );
    (e_fused, e_composed)
}

/// Runs `fused` and the composed `reference` ops on the same inputs, in f32 and (the reference) in
/// f64, with the same random upstream gradient, and bounds the fused output's and every input
/// gradient's error by [`assert_within_rounding`]. The reference expression is written once: the
/// macro gives it the f32 inputs, then the f64 ones.
macro_rules! check {
    ($name:expr, $inputs:expr, $fused:expr, |$x:ident| $reference:expr $(,)?) => {
        check_exact(
            $name,
            $inputs,
            $fused,
            |$x: &[Tensor<CpuTrain, 2>]| $reference,
            |$x: &[Tensor<Exact, 2>]| $reference,
        )
    };
}

fn check_exact<const D: usize, const N: usize>(
    name: &str,
    inputs: [Tensor<CpuTrain, 2>; N],
    fused: impl Fn(&[Tensor<CpuTrain, 2>]) -> Tensor<CpuTrain, D>,
    reference: impl Fn(&[Tensor<CpuTrain, 2>]) -> Tensor<CpuTrain, D>,
    exact: impl Fn(&[Tensor<Exact, 2>]) -> Tensor<Exact, D>,
) {
    let a = fused(&inputs);
    let b = reference(&inputs);
    let exact_inputs = inputs.each_ref().map(to_exact);
    let c = exact(&exact_inputs);
    assert_eq!(a.dims(), b.dims());
    assert_eq!(a.dims(), c.dims());
    // A random upstream gradient, so the backward pass is exercised beyond sum().
    let upstream = Tensor::<CpuTrain, D>::from_inner(rand(a.dims(), 99).inner());
    let upstream64 = to_exact(&upstream).detach();
    let ga = (a.clone() * upstream.clone()).sum().backward();
    let gb = (b.clone() * upstream).sum().backward();
    let gc = (c.clone() * upstream64).sum().backward();
    assert_within_rounding(
        &format!("{name} value"),
        &host(a.inner()),
        &host(b.inner()),
        &host64(c.inner()),
    );
    for (i, (x, x64)) in inputs.iter().zip(&exact_inputs).enumerate() {
        if let (Some(da), Some(db), Some(dc)) = (x.grad(&ga), x.grad(&gb), x64.grad(&gc)) {
            assert_within_rounding(
                &format!("{name} grad {i}"),
                &host(da),
                &host(db),
                &host64(dc),
            );
        }
    }
}

/// [`check`] for two fused paths that must agree to f32 rounding (no composed form to run in
/// f64): outputs and gradients within `tol`, relative.
fn check_same<const D: usize, const N: usize>(
    name: &str,
    inputs: [Tensor<CpuTrain, 2>; N],
    fused: impl Fn(&[Tensor<CpuTrain, 2>]) -> Tensor<CpuTrain, D>,
    other: impl Fn(&[Tensor<CpuTrain, 2>]) -> Tensor<CpuTrain, D>,
    tol: f64,
) {
    let a = fused(&inputs);
    let b = other(&inputs);
    assert_eq!(a.dims(), b.dims());
    let upstream = Tensor::<CpuTrain, D>::from_inner(rand(a.dims(), 99).inner());
    let ga = (a.clone() * upstream.clone()).sum().backward();
    let gb = (b.clone() * upstream).sum().backward();
    assert_close(
        &format!("{name} value"),
        host(a.inner()),
        host(b.inner()),
        tol,
    );
    for (i, x) in inputs.iter().enumerate() {
        if let (Some(da), Some(db)) = (x.grad(&ga), x.grad(&gb)) {
            assert_close(&format!("{name} grad {i}"), host(da), host(db), tol);
        }
    }
}

/// The bound rejects what it should: a fused result off by one part in 10⁴ where the composed ops
/// are at f32 rounding, and a reference far from the truth.
#[test]
fn the_rounding_bound_fails_a_wrong_kernel() {
    let truth: Vec<f64> = (0..1000)
        .map(|i| ((i * 7919 % 1000) as f64 - 500.0) / 300.0)
        .collect();
    let composed: Vec<f32> = truth.iter().map(|&v| v as f32).collect();
    let wrong: Vec<f32> = composed.iter().map(|v| v * (1.0 + 1e-4)).collect();
    let (e, _) = assert_within_rounding("control, right", &composed, &composed, &truth);
    assert!(e < 1e-7);
    let r =
        std::panic::catch_unwind(|| assert_within_rounding("control", &wrong, &composed, &truth));
    assert!(r.is_err(), "the bound let an error of 1e-4 through");
    let far: Vec<f32> = composed.iter().map(|v| v * 1.01).collect();
    let r = std::panic::catch_unwind(|| assert_within_rounding("control, far", &far, &far, &truth));
    assert!(r.is_err(), "a reference 1 % off the truth was accepted");
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

/// A weight in the backend's inference layout (panels on an AVX-512 CPU, `[in, out]` elsewhere)
/// gives `linear`'s outputs: decoding's rows (1, 4), a prompt's (130), and more rows than the
/// panel kernel takes (600, where the CPU unpacks the panels for the GEMM), with and without
/// bias.
#[test]
fn inference_layout_matches_linear() {
    let (k, n) = (40, 96);
    let w = rand([n, k], 71).inner();
    let packed = super::inference_layout(w.clone());
    let b = rand([n], 72).inner();
    for m in [1, 4, 130, 600] {
        let x = rand([m, k], 73 + m as u64).inner();
        for bias in [None, Some(b.clone())] {
            assert_close(
                &format!("inference layout m={m} bias={}", bias.is_some()),
                host(super::linear_in_out(
                    x.clone(),
                    packed.clone(),
                    bias.clone(),
                )),
                host(super::linear(x.clone(), w.clone(), bias)),
                1e-5,
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
    use super::split::gemm_grid;
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
    check!(
        "linear",
        inputs,
        |t| linear(t[0].clone(), t[1].clone(), Some(t[2].clone().reshape([19]))),
        |t| t[0].clone().matmul(t[1].clone().transpose()) + t[2].clone(),
    );
    let inputs = [rand([5, 3, 8], 4).reshape([15, 8]), rand([8, 8], 5)];
    check!(
        "linear, square, no bias",
        inputs,
        |t| linear(t[0].clone(), t[1].clone(), None),
        |t| t[0].clone().matmul(t[1].clone().transpose()),
    );
    // Few rows and many columns split the columns across threads.
    let inputs = [rand([8, 64], 9), rand([600, 64], 10), rand([1, 600], 11)];
    check!(
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
                check!(
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
        check!(
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
    check!(
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
    check!(
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
    let mask =
        Tensor::<CpuTrain, 2>::from_data(TensorData::new(m.clone(), [b, s]), &Default::default());
    let scores = rand([b * h * q, s], 10);
    check!(
        "masked_softmax",
        [scores],
        |t| masked_softmax(t[0].clone().reshape([b, h, q, s]), mask.clone(), 0.35),
        |t| {
            softmax(
                t[0].clone().reshape([b, h, q, s]) * 0.35 + data(t, &m, [b, 1, 1, s]),
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

/// `[B·T, H]` as `[B, heads, T, H/heads]`.
fn split_heads<B: Backend>(x: Tensor<B, 2>, [b, t, heads, d]: [usize; 4]) -> Tensor<B, 4> {
    x.reshape([b, t, heads, d]).swap_dims(1, 2)
}

fn attention_case(b: usize, t: usize, h: usize, heads: usize) {
    let scale = 1.0 / ((h / heads) as f64).sqrt();
    let mut m = vec![0f32; b * t];
    m[(b - 1) * t + 4] = f32::MIN;
    m[(b - 1) * t + 5] = f32::MIN;
    let mask =
        Tensor::<CpuTrain, 2>::from_data(TensorData::new(m.clone(), [b, t]), &Default::default());
    let inputs = [
        rand([b * t, h], 11),
        rand([b * t, h], 12),
        rand([b * t, h], 13),
    ];
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
        check!(
            &format!("attention {b}x{t}x{h}/{heads} p={dropout} {window:?}"),
            inputs.clone(),
            |x| {
                let r = |i: usize| x[i].clone().reshape([b, t, h]);
                let (out, _) = CpuTrain::kiln_attention(
                    p(r(0)),
                    p(r(1)),
                    p(r(2)),
                    p(mask.clone()),
                    attention_spec(heads, window, scale, dropout, seed),
                    false,
                );
                super::t::<CpuTrain, 3>(out)
            },
            |x| {
                let split = [b, t, heads, h / heads];
                let scores = split_heads(x[0].clone(), split)
                    .matmul(split_heads(x[1].clone(), split).swap_dims(2, 3));
                let scores = scores * scale + data(x, &m, [b, 1, 1, t]);
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
                let hidden = data(x, &hidden, [t, t]);
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
                    probs * data(x, &host(super::t::<Cpu, 1>(m)), [b, heads, t, t])
                } else {
                    probs
                };
                probs
                    .matmul(split_heads(x[2].clone(), split))
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
                CpuTrain::kiln_attention(
                    q,
                    k,
                    v,
                    m,
                    attention_spec(heads, window, 0.3, 0.0, 0),
                    with_probs,
                )
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
        check_same(
            &format!("attention_qkv p={dropout}"),
            [rand([b * t, 3 * h], 31)],
            |x| {
                let (out, _) = CpuTrain::kiln_attention_qkv(
                    p(x[0].clone().reshape([b, t, 3 * h])),
                    p(mask.clone()),
                    attention_spec(heads, super::Window::FULL, 0.5, dropout, seed),
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
                    attention_spec(heads, super::Window::FULL, 0.5, dropout, seed),
                    false,
                );
                super::t::<CpuTrain, 3>(out)
            },
            // The same kernel over the same numbers: only the layout differs.
            1e-6,
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
        check!(
            &format!("residual_layer_norm p={dropout}"),
            inputs.clone(),
            |x| {
                let out = CpuTrain::kiln_residual_layer_norm(
                    p(x[0].clone()),
                    p(x[1].clone()),
                    p(x[2].clone().reshape([h])),
                    p(x[3].clone().reshape([h])),
                    1e-12,
                    Dropout {
                        rate: dropout,
                        seed,
                    },
                );
                super::t::<CpuTrain, 2>(out.y)
            },
            |x| {
                let xd = if dropout > 0.0 {
                    let m = Cpu::kiln_dropout_mask(
                        x[0].shape(),
                        1.0 - dropout,
                        seed,
                        &Default::default(),
                    );
                    x[0].clone() * data(x, &host(super::t::<Cpu, 1>(m)), [r, h])
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
    let wv = host(w.clone().inner());
    check!(
        "reshape",
        [rand([4, 6], 10)],
        |t| reshape::<_, 2, 3>(t[0].clone(), [2, 2, 6]).matmul(w.clone().unsqueeze_dim(0)),
        |t| t[0]
            .clone()
            .reshape([2, 2, 6])
            .matmul(data(t, &wv, [1, 6, 5])),
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
fn rms_norm_matches_composed() {
    let (r, h) = (37, 48);
    check!(
        "rms_norm",
        [rand([r, h], 21), rand([1, h], 22)],
        |t| super::rms_norm(t[0].clone(), t[1].clone().reshape([h]), 1e-5),
        |t| {
            let rms = (t[0].clone() * t[0].clone())
                .mean_dim(1)
                .add_scalar(1e-5)
                .sqrt();
            t[0].clone() / rms * t[1].clone()
        },
    );
}

#[test]
fn swiglu_matches_composed() {
    let inputs = [rand([37, 48], 23), rand([37, 48], 24)];
    check!(
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
        let keep: Vec<f32> = targets.iter().map(|&t| f32::from(t != -100)).collect();
        check!(
            &format!("cross_entropy {n}×{c}"),
            [x],
            |i| cross_entropy(i[0].clone(), t(), -100),
            |i| {
                let safe = ints(i, &targets, [n]).clamp_min(0).reshape([n, 1]);
                log_softmax(i[0].clone(), 1)
                    .gather(1, safe)
                    .reshape([n])
                    .neg()
                    * data(i, &keep, [n])
            },
        );
    }
}

/// The output head's product and the cross-entropy a chunk of rows at a time (forward, and the
/// backward recomputing each chunk's logits) against the whole logits' log-softmax + gather:
/// values and both gradients (the head's input and its weight), for chunks of one row, of a
/// size that leaves a short last chunk, of all rows and of more, with ignored rows.
#[test]
fn linear_cross_entropy_in_chunks_matches_the_whole_logits() {
    use burn::tensor::activation::log_softmax;
    use burn::tensor::Int;
    let (n, h, v) = (37, 16, 300);
    let x = rand([n, h], 51).require_grad();
    let w = rand([v, h], 52).require_grad();
    let targets: Vec<i64> = (0..n)
        .map(|r| {
            if r % 6 == 2 {
                -100
            } else {
                ((r * 7919) % v) as i64
            }
        })
        .collect();
    let keep: Vec<f32> = targets.iter().map(|&t| f32::from(t != -100)).collect();
    let t = || {
        Tensor::<CpuTrain, 1, Int>::from_data(
            TensorData::new(targets.clone(), [n]),
            &Default::default(),
        )
    };
    for chunk in [1, 5, n, 64] {
        check!(
            &format!("linear_cross_entropy chunk {chunk}"),
            [x.clone(), w.clone()],
            |i| linear_cross_entropy(i[0].clone(), i[1].clone(), t(), -100, chunk, None),
            |i| {
                let safe = ints(i, &targets, [n]).clamp_min(0).reshape([n, 1]);
                let logits = i[0].clone().matmul(i[1].clone().transpose());
                log_softmax(logits, 1).gather(1, safe).reshape([n]).neg() * data(i, &keep, [n])
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
    let (cv, sv) = (host(cos.clone().inner()), host(sin.clone().inner()));
    check!(
        "rope",
        [rand([b * t, h * d], 43)],
        |i| rope(i[0].clone().reshape([b, t, h, d]), &cos, &sin),
        |i| {
            let x = i[0].clone().reshape([b, t, h, d]);
            let first = x.clone().slice([0..b, 0..t, 0..h, 0..d / 2]);
            let second = x.clone().slice([0..b, 0..t, 0..h, d / 2..d]);
            let rotated = Tensor::cat(vec![second.neg(), first], 3);
            x * data(i, &cv, [1, t, 1, d]) + rotated * data(i, &sv, [1, t, 1, d])
        },
    );
}

/// Every kernel that sums across rows or tasks — Linear's weight and bias gradients, LayerNorm's
/// and RMSNorm's weight gradients, attention forward and backward, the loss, the squared norm that
/// clipping reads, the few-rows product of decoding — gives the same bits on 1, 2 and 3 threads, and
/// on 2 threads while other work floods the same pool (so tasks are stolen in other orders). Partial
/// sums must follow the shapes, never the threads or the stealing.
#[test]
fn kernels_give_the_same_bits_on_any_thread_count_and_under_load() {
    use rayon::prelude::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    let (b, t, h, heads, classes) = (12, 120, 64, 2, 50);
    let inputs = [
        rand([b * t, h], 61),
        rand([h, h], 62),
        rand([1, h], 63),
        rand([1, h], 64),
        rand([classes, h], 65),
        rand([1, classes], 66),
    ];
    let mask = Tensor::<CpuTrain, 2>::zeros([b, t], &Default::default());
    let targets: Vec<i64> = (0..b * t).map(|i| ((i * 7919) % classes) as i64).collect();
    let big = rand([300_000, 1], 67).inner();
    let (x2, w_in_out) = (rand([2, 600], 68).inner(), rand([600, 90], 69).inner());
    let run = || -> Vec<Vec<u64>> {
        let [x, w, bias, norm_w, head_w, head_b] = inputs.clone();
        let y = linear(x.clone(), w.clone(), Some(bias.clone().reshape([h])));
        let y = layer_norm(
            y,
            norm_w.clone().reshape([h]),
            bias.clone().reshape([h]),
            1e-12,
        );
        let y = rms_norm(y, norm_w.clone().reshape([h]), 1e-6).reshape([b, t, h]);
        let (att, _) = CpuTrain::kiln_attention(
            p(y.clone()),
            p(y.clone() * 0.5),
            p(y),
            p(mask.clone()),
            attention_spec(heads, Window::FULL, 0.125, 0.1, 3),
            false,
        );
        let att = super::t::<CpuTrain, 3>(att).reshape([b * t, h]);
        let logits = linear(att, head_w.clone(), Some(head_b.clone().reshape([classes])));
        let targets = ints(&inputs, &targets, [b * t]);
        let loss = cross_entropy(logits, targets, -100).sum();
        let grads = loss.backward();
        let mut out = vec![host(loss.inner())];
        for x in [&x, &w, &bias, &norm_w, &head_w, &head_b] {
            out.push(host(x.grad(&grads).unwrap()));
        }
        out.push(host(super::linear_in_out(
            x2.clone(),
            w_in_out.clone(),
            None,
        )));
        let mut bits: Vec<Vec<u64>> = out
            .into_iter()
            .map(|v| v.into_iter().map(|x| u64::from(x.to_bits())).collect())
            .collect();
        bits.push(vec![Cpu::kiln_sum_squares(
            big.clone().into_primitive().tensor(),
        )
        .to_bits()]);
        bits
    };
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };
    let one = pool(1).install(run);
    for n in [2, 3] {
        assert!(
            pool(n).install(run) == one,
            "{n} threads gave other bits than 1"
        );
    }
    let two = pool(2);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                two.install(|| {
                    (0..64).into_par_iter().for_each(|i| {
                        std::hint::black_box((0..20_000u64).fold(i, |a, x| a ^ x.wrapping_mul(a)));
                    })
                });
            }
        });
        for round in 0..8 {
            let got = two.install(run);
            if got != one {
                stop.store(true, Ordering::Relaxed);
                panic!("round {round}: 2 threads beside other work gave other bits");
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
}

/// `--base-dtype bf16`: a frozen weight held in bf16 multiplies (forward and the input's
/// gradient, panel by panel) and looks up as its values rounded to bf16 in f32, and has no
/// gradient. Shapes cross the widening panels (512) on both the output and the input side; the
/// second has whole 32-wide panels on both sides, which AVX-512 makes as it reaches them.
#[test]
fn a_weight_held_in_bf16_multiplies_as_its_rounded_f32_values() {
    for (n, k) in [(1030, 600), (1056, 608)] {
        held_weight_multiplies_as_its_rounded_values(n, k);
    }
}

fn held_weight_multiplies_as_its_rounded_values(n: usize, k: usize) {
    let w = rand([n, k], 61).inner();
    let rounded: Vec<f32> = host(w.clone()).into_iter().map(bf16::round_bf16).collect();
    let w_r = Tensor::<CpuTrain, 2>::from_data(
        TensorData::new(rounded.clone(), [n, k]),
        &Default::default(),
    );
    let held =
        to_bf16_store(Tensor::<CpuTrain, 2>::from_inner(w.clone())).expect("the CPU holds bf16");
    assert!(is_bf16_store(&held) && !is_bf16_store(&w_r));
    assert_eq!(
        host(from_bf16_store(held.clone()).inner()),
        rounded,
        "widening is exact"
    );
    for m in [2, 37] {
        let x = rand([m, k], 62 + m as u64);
        let b = rand([n], 63);
        let upstream = Tensor::<CpuTrain, 2>::from_inner(rand([m, n], 64).inner());
        let run = |w: Tensor<CpuTrain, 2>| {
            let y = linear(x.clone(), w.clone(), Some(b.clone()));
            let grads = (y.clone() * upstream.clone()).sum().backward();
            assert!(w.grad(&grads).is_none(), "a frozen weight gets no gradient");
            (
                host(y.inner()),
                host(x.grad(&grads).unwrap()),
                host(b.grad(&grads).unwrap()),
            )
        };
        let (y, dx, db) = run(held.clone());
        let (y_r, dx_r, db_r) = run(w_r.clone());
        assert_close(&format!("held forward m={m}"), y.clone(), y_r, 1e-6);
        assert_close(&format!("held dx m={m}"), dx, dx_r, 1e-6);
        assert_eq!(db, db_r, "the bias gradient is the same sum");
        // Control: the unrounded weight is measurably another product.
        let (y_f32, _, _) = run(Tensor::from_inner(w.clone()));
        assert!(rel_err(&y, &y_f32) > 1e-4, "bf16 rounding shows");
    }
    let ids = Tensor::<CpuTrain, 1, Int>::from_data(
        TensorData::new(vec![5i64, 0, 1029, 5], [4]),
        &Default::default(),
    );
    let rows = host(embedding(held, ids).inner());
    let expected: Vec<f32> = [5usize, 0, 1029, 5]
        .iter()
        .flat_map(|&r| rounded[r * k..(r + 1) * k].to_vec())
        .collect();
    assert_eq!(
        rows, expected,
        "an embedding lookup widens its rows exactly"
    );
}

/// `--base-dtype bf16` with `--bf16`: a held weight multiplies on the bf16 kernels, its bits read
/// as they are, giving the products those kernels give for its values in f32 (x rounded to bf16
/// too, as PyTorch multiplies a bf16 base), across the 4096-row pieces a held product is cut into
/// on the output side (forward) and the summed side (the input's gradient); an odd K, and whole
/// tiles, where AMX reads the weight's rows in place.
#[test]
fn a_weight_held_in_bf16_multiplies_on_the_bf16_kernels_under_bf16() {
    if mixed_precision::<Cpu>(true) != MatmulPrecision::Bf16 {
        eprintln!("skipped: no AVX512-BF16 on this CPU (or KILN_CPU_ISA caps it): --bf16 is f32");
        return;
    }
    // An odd K (packed pieces); whole tiles (AMX reads the weight's rows where they lie).
    for ((n, k), m) in [(4100, 131), (1088, 192)]
        .into_iter()
        .flat_map(|nk| [(nk, 3), (nk, 37)])
    {
        let w = rand([n, k], 71).inner();
        let rounded: Vec<f32> = host(w.clone()).into_iter().map(bf16::round_bf16).collect();
        let w_r =
            Tensor::<CpuTrain, 2>::from_data(TensorData::new(rounded, [n, k]), &Default::default());
        let held = to_bf16_store(Tensor::<CpuTrain, 2>::from_inner(w)).expect("the CPU holds bf16");
        let x = rand([m, k], 72 + m as u64);
        let b = rand([n], 73);
        let upstream = Tensor::<CpuTrain, 2>::from_inner(rand([m, n], 74).inner());
        let run = |w: Tensor<CpuTrain, 2>, precision: MatmulPrecision| {
            let _precision = MatmulPrecisionScope::set(precision);
            let y = linear(x.clone(), w, Some(b.clone()));
            let grads = (y.clone() * upstream.clone()).sum().backward();
            (host(y.inner()), host(x.grad(&grads).unwrap()))
        };
        let (y, dx) = run(held.clone(), MatmulPrecision::Bf16);
        let (y_r, dx_r) = run(w_r.clone(), MatmulPrecision::Bf16);
        assert_close(&format!("held forward {m}x{k}x{n}"), y.clone(), y_r, 1e-6);
        assert_close(&format!("held dx {m}x{k}x{n}"), dx.clone(), dx_r, 1e-6);
        // Control: the held weight's f32 products (x not rounded) are measurably others.
        let (y_f32, dx_f32) = run(held.clone(), MatmulPrecision::F32);
        assert!(rel_err(&y, &y_f32) > 1e-4, "x's rounding shows in y");
        assert!(rel_err(&dx, &dx_f32) > 1e-4, "dy's rounding shows in dx");
    }
}

/// Window bands are kept per thread and shared between calls: a kept band must still be the
/// band its window and length ask for, whichever was made before it and however many were made.
#[test]
fn window_bands_reused_from_the_cache_stay_right() {
    let device = Default::default();
    let slide = Window {
        before: 2,
        after: 1,
    };
    // Which key j query i sees, written out here rather than through `Window::keys`.
    let sees = |w: Window, i: usize, j: usize| {
        if w == Window::CAUSAL {
            j <= i
        } else {
            j + 2 >= i && j <= i + 1
        }
    };
    let check = |w: Window, t: usize| {
        let band = w.band::<Cpu>(t, &device);
        assert_eq!(band.dims(), [t, t]);
        let values = band.into_data().to_vec::<f32>().unwrap();
        for i in 0..t {
            for j in 0..t {
                let want = if sees(w, i, j) { 0.0 } else { -1e30 };
                assert_eq!(values[i * t + j], want, "{w:?} t={t} ({i}, {j})");
            }
        }
    };
    // Twice: made, then from the cache.
    for _ in 0..2 {
        for (w, t) in [
            (Window::CAUSAL, 5),
            (slide, 5),
            (Window::CAUSAL, 3),
            (slide, 7),
        ] {
            check(w, t);
        }
    }
    // More lengths than are kept: the oldest are made again.
    for t in (1..=BANDS_KEPT + 3).chain(1..=3) {
        check(Window::CAUSAL, t);
    }
}
