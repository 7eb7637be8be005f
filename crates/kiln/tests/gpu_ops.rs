//! kiln's ops on a GPU against the CPU path's fused ops: values and gradients, on the shapes the
//! CPU kernel tests use (padded keys, causal and sliding windows, `ignore_index`, dropout).
//! `--features wgpu` runs them on wgpu (Mesa's software Vulkan, lavapipe, when the machine has
//! none): every GPU kernel kiln adds is checked there, in CI, without a GPU. `--features cuda`
//! runs the same cases on CUDA (`scripts/gpu-checks`), where the Linear GEMMs are cuBLAS's.
//!
//! Measured error, relative to the largest magnitude of the CPU result: values ≤ 1e-6, gradients
//! ≤ 1e-5 on lavapipe (see each case's print); the bounds below leave 10× for other drivers.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use burn::tensor::{Int, Tensor, TensorData};
use kiln::backend::CpuTrain;
use kiln::ops::{MatmulPrecision, TrainBackend, Window};

#[cfg(feature = "cuda")]
type Gpu = kiln::backend::CudaTrain;
#[cfg(not(feature = "cuda"))]
type Gpu = kiln::backend::WgpuTrain;

const VALUE_TOL: f64 = 1e-5;
const GRAD_TOL: f64 = 1e-4;

/// Seeded values in [-2, 2) (a 64-bit LCG): the same inputs on both devices.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// One op written once for any training backend: its inputs are 2-D, reshaped inside.
trait Case {
    const NAME: &'static str;
    /// The GEMM precision and TF32 switch both devices run under (forward and backward).
    const PRECISION: (MatmulPrecision, bool) = (MatmulPrecision::F32, false);
    /// Value and gradient bounds, relative to the CPU result's largest magnitude.
    const TOL: (f64, f64) = (VALUE_TOL, GRAD_TOL);
    fn shapes() -> Vec<[usize; 2]>;
    fn run<B: TrainBackend>(x: &[Tensor<B, 2>]) -> Tensor<B, 2>;
}

fn inputs<B: TrainBackend>(shapes: &[[usize; 2]], device: &B::Device) -> Vec<Tensor<B, 2>> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let data = TensorData::new(values(s[0] * s[1], 11 + i as u64), *s);
            Tensor::<B, 2>::from_data(data, device).require_grad()
        })
        .collect()
}

fn host<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

/// The op's output and every input's gradient under a fixed upstream gradient.
fn output_and_grads<B: TrainBackend, C: Case>(device: &B::Device) -> (Vec<f32>, Vec<Vec<f32>>) {
    kiln::ops::reseed_dropout(5);
    kiln::ops::set_matmul_precision(C::PRECISION.0);
    kiln::ops::set_tf32(C::PRECISION.1);
    let x = inputs::<B>(&C::shapes(), device);
    let y = C::run::<B>(&x);
    let dims = y.dims();
    let upstream =
        Tensor::<B, 2>::from_data(TensorData::new(values(dims[0] * dims[1], 99), dims), device);
    let grads = (y.clone() * upstream).sum().backward();
    let g = x
        .iter()
        .map(|t| t.grad(&grads).map(host).unwrap_or_default())
        .collect();
    kiln::ops::set_matmul_precision(MatmulPrecision::F32);
    kiln::ops::set_tf32(false);
    (host(y), g)
}

fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-6f64, |m, v| m.max(v.abs() as f64));
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0.0, f64::max)
        / scale
}

fn same_on_gpu<C: Case>() {
    let (gpu, gpu_grads) = output_and_grads::<Gpu, C>(&Default::default());
    let (cpu, cpu_grads) = output_and_grads::<CpuTrain, C>(&Default::default());
    let (value_tol, grad_tol) = C::TOL;
    let d = rel_diff(&gpu, &cpu);
    eprintln!("{}: value {d:.1e}", C::NAME);
    assert!(d <= value_tol, "{}: GPU value differs by {d:e}", C::NAME);
    for (i, (g, c)) in gpu_grads.iter().zip(&cpu_grads).enumerate() {
        assert_eq!(g.is_empty(), c.is_empty(), "{} grad {i}", C::NAME);
        if !c.is_empty() {
            let d = rel_diff(g, c);
            eprintln!("{} grad {i}: {d:.1e}", C::NAME);
            assert!(d <= grad_tol, "{} grad {i}: GPU differs by {d:e}", C::NAME);
        }
    }
}

/// A [B, T] additive key mask: batch row 1 pads its last 3 keys (f32::MIN, as the models build it).
fn key_mask<B: TrainBackend>(batch: usize, t: usize, device: &B::Device) -> Tensor<B, 2> {
    let mut m = vec![0f32; batch * t];
    for j in t - 3..t {
        m[t + j] = f32::MIN;
    }
    Tensor::from_data(TensorData::new(m, [batch, t]), device)
}

macro_rules! case {
    ($test:ident, $name:literal, [$($shape:expr),*], |$x:ident| $body:expr) => {
        case!($test, $name, [$($shape),*], (MatmulPrecision::F32, false), (VALUE_TOL, GRAD_TOL), |$x| $body);
    };
    ($test:ident, $name:literal, [$($shape:expr),*], $precision:expr, $tol:expr, |$x:ident| $body:expr) => {
        #[test]
        fn $test() {
            struct C;
            impl Case for C {
                const NAME: &'static str = $name;
                const PRECISION: (MatmulPrecision, bool) = $precision;
                const TOL: (f64, f64) = $tol;
                fn shapes() -> Vec<[usize; 2]> {
                    vec![$($shape),*]
                }
                #[allow(unused_braces)]
                fn run<B: TrainBackend>($x: &[Tensor<B, 2>]) -> Tensor<B, 2> {
                    $body
                }
            }
            same_on_gpu::<C>();
        }
    };
}

fn row<B: TrainBackend>(x: &Tensor<B, 2>) -> Tensor<B, 1> {
    let n = x.dims()[1];
    x.clone().reshape([n])
}

case!(linear, "linear", [[12, 40], [24, 40], [1, 24]], |x| {
    kiln::ops::linear(x[0].clone(), x[1].clone(), Some(row(&x[2])))
});
case!(
    linear_no_bias,
    "linear (no bias)",
    [[12, 40], [24, 40]],
    |x| { kiln::ops::linear(x[0].clone(), x[1].clone(), None) }
);
case!(
    linear_in_out,
    "linear_in_out",
    [[12, 40], [40, 24], [1, 24]],
    |x| { kiln::ops::linear_in_out(x[0].clone(), x[1].clone(), Some(row(&x[2]))) }
);
// BERT-base's FFN sizes: cuBLAS's tensor-core kernels, and a 3-D input folded to rows.
case!(
    linear_bert_ffn,
    "linear 256×768 → 3072",
    [[256, 768], [3072, 768], [1, 3072]],
    |x| {
        let x3 = x[0].clone().reshape([2, 128, 768]);
        kiln::ops::linear(x3, x[1].clone(), Some(row(&x[2]))).reshape([256, 3072])
    }
);
// Under --bf16 both devices round the same operands to bf16 and accumulate in f32: they agree
// to f32 rounding, not bf16's. CUDA only: WGSL has no bf16 (wgpu refuses --bf16).
#[cfg(feature = "cuda")]
case!(
    linear_bf16,
    "linear under --bf16",
    [[64, 384], [96, 384], [1, 96]],
    (MatmulPrecision::Bf16, false),
    (VALUE_TOL, GRAD_TOL),
    |x| { kiln::ops::linear(x[0].clone(), x[1].clone(), Some(row(&x[2]))) }
);
// TF32 keeps 10 mantissa bits of each operand (about 5e-4 relative each; the CPU stays f32):
// the bound is TF32's, and the case is CUDA's only (elsewhere --tf32 is refused).
#[cfg(feature = "cuda")]
case!(
    linear_tf32,
    "linear under --tf32",
    [[64, 384], [96, 384], [1, 96]],
    (MatmulPrecision::F32, true),
    (5e-3, 5e-3),
    |x| { kiln::ops::linear(x[0].clone(), x[1].clone(), Some(row(&x[2]))) }
);
case!(gelu, "gelu", [[16, 40]], |x| kiln::ops::gelu(x[0].clone()));
case!(
    layer_norm,
    "layer_norm",
    [[16, 40], [1, 40], [1, 40]],
    |x| { kiln::ops::layer_norm(x[0].clone(), row(&x[1]), row(&x[2]), 1e-12) }
);
case!(rms_norm, "rms_norm", [[16, 40], [1, 40]], |x| {
    kiln::ops::rms_norm(x[0].clone(), row(&x[1]), 1e-6)
});
case!(
    rms_norm_wide,
    "rms_norm (H 200 > one cube's units)",
    [[37, 200], [1, 200]],
    |x| { kiln::ops::rms_norm(x[0].clone(), row(&x[1]), 1e-6) }
);
case!(
    layer_norm_wide,
    "layer_norm (300 rows of 768)",
    [[300, 768], [1, 768], [1, 768]],
    |x| { kiln::ops::layer_norm(x[0].clone(), row(&x[1]), row(&x[2]), 1e-12) }
);
case!(swiglu, "swiglu", [[16, 40], [16, 40]], |x| {
    kiln::ops::swiglu(x[0].clone(), x[1].clone())
});
case!(
    residual_layer_norm,
    "residual_layer_norm (dropout 0.1)",
    [[16, 40], [16, 40], [1, 40], [1, 40]],
    |x| kiln::ops::residual_layer_norm(
        x[0].clone(),
        x[1].clone(),
        row(&x[2]),
        row(&x[3]),
        1e-12,
        0.1
    )
);
case!(
    residual_layer_norm_wide,
    "residual_layer_norm (300 rows of 768, dropout 0.1)",
    [[300, 768], [300, 768], [1, 768], [1, 768]],
    |x| kiln::ops::residual_layer_norm(
        x[0].clone(),
        x[1].clone(),
        row(&x[2]),
        row(&x[3]),
        1e-12,
        0.1
    )
);
case!(dropout, "dropout 0.3", [[16, 40]], |x| kiln::ops::dropout(
    x[0].clone(),
    0.3
));
case!(
    cross_entropy,
    "cross_entropy (ignore_index)",
    [[6, 50]],
    |x| {
        let device = x[0].device();
        let targets = Tensor::<B, 1, Int>::from_data(
            TensorData::new(vec![3i64, -100, 49, 0, 7, -100], [6]),
            &device,
        );
        kiln::ops::cross_entropy(x[0].clone(), targets, -100).reshape([1, 6])
    }
);
// A table of 70 rows (three cubes of 32) and 150 columns (two blocks of 128), ids repeated,
// the first and the last row among them.
case!(
    embedding,
    "embedding (70 rows, repeated ids)",
    [[70, 150]],
    |x| {
        let device = x[0].device();
        let ids: Vec<i64> = (0..45)
            .map(|i| (i * 37 % 70) as i64 % 70)
            .chain([0, 69, 69, 5])
            .collect();
        let n = ids.len();
        let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [n]), &device);
        kiln::ops::embedding(x[0].clone(), ids)
    }
);
// A table of 2 rows (BERT's token types) over 1,000 ids: too few cubes for the table alone, so
// the tokens are cut into 3 slices (the last shorter) whose partial tables a second kernel adds.
case!(
    embedding_sliced,
    "embedding (2 rows, 1,000 ids in 3 slices)",
    [[2, 150]],
    |x| {
        let device = x[0].device();
        let ids: Vec<i64> = (0..1000).map(|i| i64::from(i * 7 % 3 == 0)).collect();
        let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [1000]), &device);
        kiln::ops::embedding(x[0].clone(), ids)
    }
);
// A vocabulary wider than a cube (1,000 classes over 64 units), two ignored rows.
case!(
    cross_entropy_wide,
    "cross_entropy (1000 classes, ignore_index)",
    [[9, 1000]],
    |x| {
        let device = x[0].device();
        let targets = Tensor::<B, 1, Int>::from_data(
            TensorData::new(vec![999i64, -100, 0, 500, 63, 64, -100, 1, 998], [9]),
            &device,
        );
        kiln::ops::cross_entropy(x[0].clone(), targets, -100).reshape([1, 9])
    }
);
case!(
    masked_softmax,
    "masked_softmax (padded keys)",
    [[2 * 3 * 7, 7]],
    |x| {
        let device = x[0].device();
        let scores = x[0].clone().reshape([2, 3, 7, 7]);
        kiln::ops::masked_softmax(scores, key_mask::<B>(2, 7, &device), 0.25).reshape([42, 7])
    }
);
case!(
    masked_softmax_wide,
    "masked_softmax (128 keys > one cube's units)",
    [[2 * 3 * 128, 128]],
    |x| {
        let device = x[0].device();
        let scores = x[0].clone().reshape([2, 3, 128, 128]);
        kiln::ops::masked_softmax(scores, key_mask::<B>(2, 128, &device), 0.125).reshape([768, 128])
    }
);
case!(rope, "rope", [[2 * 2 * 5, 8]], |x| {
    let device = x[0].device();
    let (t, d) = (5usize, 8usize);
    let mut cos = vec![0f32; t * d];
    let mut sin = vec![0f32; t * d];
    for p in 0..t {
        for i in 0..d {
            let f = 1.0 / 10000f32.powf((2 * (i % (d / 2))) as f32 / d as f32);
            cos[p * d + i] = (p as f32 * f).cos();
            sin[p * d + i] = (p as f32 * f).sin();
        }
    }
    let cos = Tensor::<B, 2>::from_data(TensorData::new(cos, [t, d]), &device);
    let sin = Tensor::<B, 2>::from_data(TensorData::new(sin, [t, d]), &device);
    kiln::ops::rope(x[0].clone().reshape([2, t, 2, d]), &cos, &sin).reshape([20, 8])
});
case!(
    attention,
    "attention (padded keys, dropout 0.1)",
    [[2 * 9, 16], [2 * 9, 16], [2 * 9, 16]],
    |x| {
        let device = x[0].device();
        let r = |t: &Tensor<B, 2>| t.clone().reshape([2, 9, 16]);
        kiln::ops::attention(
            r(&x[0]),
            r(&x[1]),
            r(&x[2]),
            key_mask::<B>(2, 9, &device),
            4,
            0.1,
        )
        .reshape([18, 16])
    }
);
case!(
    causal_attention,
    "causal_attention",
    [[2 * 9, 16], [2 * 9, 16], [2 * 9, 16]],
    |x| {
        let r = |t: &Tensor<B, 2>| t.clone().reshape([2, 9, 16]);
        kiln::ops::causal_attention(r(&x[0]), r(&x[1]), r(&x[2]), 4).reshape([18, 16])
    }
);
case!(
    windowed_attention,
    "sliding-window attention (window 3, padded keys)",
    [[2 * 9, 16], [2 * 9, 16], [2 * 9, 16]],
    |x| {
        let device = x[0].device();
        let r = |t: &Tensor<B, 2>| t.clone().reshape([2, 9, 16]);
        kiln::ops::windowed_attention(
            r(&x[0]),
            r(&x[1]),
            r(&x[2]),
            key_mask::<B>(2, 9, &device),
            4,
            Window {
                before: 3,
                after: 3,
            },
            0.0,
        )
        .reshape([18, 16])
    }
);
// The fused kernels take a cube's width of keys at a time: 130 keys cross two chunk boundaries of
// a head dimension of 64 (BERT's), with the heads side by side in one [B, T, 3H] tensor.
case!(
    attention_qkv,
    "attention_qkv (130 keys, head dim 64, padded keys, dropout 0.1)",
    [[2 * 130, 3 * 128]],
    |x| {
        let device = x[0].device();
        let qkv = x[0].clone().reshape([2, 130, 3 * 128]);
        kiln::ops::attention_qkv(qkv, key_mask::<B>(2, 130, &device), 2, 0.1).reshape([260, 128])
    }
);
// A head dimension (40) that is no power of two: idle units in every cube.
case!(
    windowed_attention_dropout,
    "sliding-window attention (70 keys, head dim 40, window 5/2, dropout 0.2)",
    [[2 * 70, 120], [2 * 70, 120], [2 * 70, 120]],
    |x| {
        let device = x[0].device();
        let r = |t: &Tensor<B, 2>| t.clone().reshape([2, 70, 120]);
        kiln::ops::windowed_attention(
            r(&x[0]),
            r(&x[1]),
            r(&x[2]),
            key_mask::<B>(2, 70, &device),
            3,
            Window {
                before: 5,
                after: 2,
            },
            0.2,
        )
        .reshape([140, 120])
    }
);

// Grouped-query attention: 6 query heads over 2 key/value heads (3 each), causal, read by the
// kernel without repeating them (the CPU repeats them, as transformers does).
case!(
    grouped_query_attention,
    "grouped-query causal attention (6 query heads, 2 key/value heads, head dim 16)",
    [[2 * 40, 96], [2 * 40, 32], [2 * 40, 32]],
    |x| {
        let r = |t: &Tensor<B, 2>| {
            let w = t.dims()[1];
            t.clone().reshape([2, 40, w])
        };
        kiln::ops::causal_attention(r(&x[0]), r(&x[1]), r(&x[2]), 6).reshape([80, 96])
    }
);

/// RMSNorm's weight gradient sums over every row: over 70,000 rows both devices are held to an
/// f64 reference (each sums in its own order, so their f32 errors differ). Regression test: on
/// lavapipe a loop stops after 65,535 trips, so a kernel summing all rows in one loop (Burn's
/// composed reduction, or kiln's first dw kernel) left the last rows out (0.22 off).
#[test]
fn rms_norm_weight_gradient_over_many_rows_matches_f64() {
    let (r, h) = (70_000usize, 4usize);
    let (xs, ws, dys) = (values(r * h, 11), values(h, 12), values(r * h, 99));
    let mut dw64 = vec![0f64; h];
    for i in 0..r {
        let row = &xs[i * h..(i + 1) * h];
        let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / h as f64;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        for j in 0..h {
            dw64[j] += dys[i * h + j] as f64 * row[j] as f64 * inv;
        }
    }
    fn dw<B: TrainBackend>(xs: &[f32], ws: &[f32], dys: &[f32], r: usize, h: usize) -> Vec<f32> {
        let device = Default::default();
        let x = Tensor::<B, 2>::from_data(TensorData::new(xs.to_vec(), [r, h]), &device);
        let w =
            Tensor::<B, 1>::from_data(TensorData::new(ws.to_vec(), [h]), &device).require_grad();
        let dy = Tensor::<B, 2>::from_data(TensorData::new(dys.to_vec(), [r, h]), &device);
        let g = (kiln::ops::rms_norm(x, w.clone(), 1e-6) * dy)
            .sum()
            .backward();
        host(w.grad(&g).unwrap())
    }
    let scale = dw64.iter().fold(0f64, |m, v| m.max(v.abs()));
    for (name, got) in [
        ("cpu", dw::<CpuTrain>(&xs, &ws, &dys, r, h)),
        ("gpu", dw::<Gpu>(&xs, &ws, &dys, r, h)),
    ] {
        let err = got
            .iter()
            .zip(&dw64)
            .map(|(a, b)| (*a as f64 - b).abs())
            .fold(0f64, f64::max)
            / scale;
        eprintln!("rms_norm dw over {r} rows, {name} vs f64: {err:.1e} (dw {got:?} vs {dw64:?})");
        assert!(err < 1e-4, "{name}: {err:e}");
    }
}

/// Linear's bias gradient is a column sum over every row: over 70,000 rows (three passes of the
/// GPU's chunked column sum) it matches f64 on both devices.
#[test]
fn linear_bias_gradient_over_many_rows_matches_f64() {
    let (r, i, o) = (70_000usize, 3usize, 5usize);
    let (xs, ws, bs, dys) = (
        values(r * i, 21),
        values(o * i, 22),
        values(o, 23),
        values(r * o, 24),
    );
    let mut db64 = vec![0f64; o];
    for row in dys.chunks(o) {
        for (acc, d) in db64.iter_mut().zip(row) {
            *acc += *d as f64;
        }
    }
    fn db<B: TrainBackend>(xs: &[f32], ws: &[f32], bs: &[f32], dys: &[f32], i: usize) -> Vec<f32> {
        let device = Default::default();
        let (r, o) = (xs.len() / i, bs.len());
        let x = Tensor::<B, 2>::from_data(TensorData::new(xs.to_vec(), [r, i]), &device);
        let w = Tensor::<B, 2>::from_data(TensorData::new(ws.to_vec(), [o, i]), &device);
        let b =
            Tensor::<B, 1>::from_data(TensorData::new(bs.to_vec(), [o]), &device).require_grad();
        let dy = Tensor::<B, 2>::from_data(TensorData::new(dys.to_vec(), [r, o]), &device);
        let g = (kiln::ops::linear(x, w, Some(b.clone())) * dy)
            .sum()
            .backward();
        host(b.grad(&g).unwrap())
    }
    let scale = db64.iter().fold(0f64, |m, v| m.max(v.abs()));
    for (name, got) in [
        ("cpu", db::<CpuTrain>(&xs, &ws, &bs, &dys, i)),
        ("gpu", db::<Gpu>(&xs, &ws, &bs, &dys, i)),
    ] {
        let err = got
            .iter()
            .zip(&db64)
            .map(|(a, b)| (*a as f64 - b).abs())
            .fold(0f64, f64::max)
            / scale;
        eprintln!("linear db over {r} rows, {name} vs f64: {err:.1e} (db {got:?} vs {db64:?})");
        assert!(err < 1e-4, "{name}: {err:e}");
    }
}

#[cfg(feature = "cuda")]
type GpuInner = kiln::backend::Cuda;
#[cfg(not(feature = "cuda"))]
type GpuInner = kiln::backend::Wgpu;

/// One AdamW step (the optimizer's fused update, not differentiated) on both devices: p, m and v
/// agree to f32 rounding. Step 3, with weight decay and a clipping scale, so every scalar counts.
#[test]
fn adamw_step() {
    use kiln::ops::{AdamWStep, KilnBackend};
    let n = 70_001;
    let h = AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        bias_correction1: 1.0 - 0.9f64.powi(3),
        bias_correction2_sqrt: (1.0 - 0.999f64.powi(3)).sqrt(),
        grad_scale: 0.5,
    };
    fn step<B: KilnBackend>(n: usize, h: AdamWStep) -> Vec<Vec<f32>> {
        let device = Default::default();
        let v2: Vec<f32> = values(n, 4).iter().map(|v| v * v * 0.01).collect();
        let [p, g, m, v] = [values(n, 1), values(n, 2), values(n, 3), v2]
            .map(|x| Tensor::<B, 1>::from_data(TensorData::new(x, [n]), &device));
        let (p, m, v) = B::kiln_adamw(
            p.into_primitive().tensor(),
            g.into_primitive().tensor(),
            m.into_primitive().tensor(),
            v.into_primitive().tensor(),
            h,
        );
        [p, m, v]
            .into_iter()
            .map(|x| {
                host(Tensor::<B, 1>::from_primitive(
                    burn::tensor::TensorPrimitive::Float(x),
                ))
            })
            .collect()
    }
    let (gpu, cpu) = (step::<GpuInner>(n, h), step::<kiln::backend::Cpu>(n, h));
    for (name, (g, c)) in ["p", "m", "v"].iter().zip(gpu.iter().zip(&cpu)) {
        let d = rel_diff(g, c);
        eprintln!("adamw {name}: {d:.1e}");
        assert!(d <= VALUE_TOL, "adamw {name}: GPU differs by {d:e}");
    }
}

/// The global-norm sum of squares over several gradients (one read-back on a GPU) equals the CPU's
/// and an f64 reference.
#[test]
fn sum_squares_over_many_tensors() {
    use kiln::ops::KilnBackend;
    let sizes = [70_001usize, 384, 1, 4097];
    let want: f64 = sizes
        .iter()
        .enumerate()
        .flat_map(|(i, &n)| values(n, 20 + i as u64))
        .map(|v| (v as f64).powi(2))
        .sum();
    fn total<B: KilnBackend>(sizes: &[usize]) -> f64 {
        let device = Default::default();
        B::kiln_sum_squares_all(
            sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    Tensor::<B, 1>::from_data(
                        TensorData::new(values(n, 20 + i as u64), [n]),
                        &device,
                    )
                    .into_primitive()
                    .tensor()
                })
                .collect(),
        )
    }
    for (name, got) in [
        ("gpu", total::<GpuInner>(&sizes)),
        ("cpu", total::<kiln::backend::Cpu>(&sizes)),
    ] {
        let d = (got - want).abs() / want;
        eprintln!("sum of squares, {name} vs f64: {d:.1e}");
        assert!(d < 1e-5, "{name}: {got} vs {want}");
    }
}

/// The dropout mask, and dropout applied with the mask made inside the multiply, are the CPU's bit
/// for bit (the counter hash in u32 halves), over more elements than one grid pass covers per unit.
#[test]
fn dropout_mask_and_apply_are_the_cpus_bits() {
    use burn::tensor::{Shape, TensorPrimitive};
    use kiln::ops::KilnBackend;
    let (n, keep, seed) = (70_001usize, 0.9, 0x1234_5678_9abc_def0u64);
    fn run<B: KilnBackend>(n: usize, keep: f64, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let device = Default::default();
        let back = |x| host(Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(x)));
        let mask = back(B::kiln_dropout_mask(Shape::new([n]), keep, seed, &device));
        let x = Tensor::<B, 1>::from_data(TensorData::new(values(n, 31), [n]), &device);
        let applied = back(B::kiln_dropout_apply(
            x.into_primitive().tensor(),
            keep,
            seed,
        ));
        (mask, applied)
    }
    let (gpu, cpu) = (
        run::<GpuInner>(n, keep, seed),
        run::<kiln::backend::Cpu>(n, keep, seed),
    );
    let dropped = cpu.0.iter().filter(|&&m| m == 0.0).count();
    eprintln!("dropout mask: {dropped} of {n} dropped (keep {keep})");
    assert!((5_000..9_000).contains(&dropped), "{dropped} dropped");
    assert!(gpu.0 == cpu.0, "the GPU's mask differs from the CPU's");
    assert!(
        gpu.1 == cpu.1,
        "dropout applied on the GPU differs from the CPU"
    );
}

/// SGD steps (the optimizer's fused update) on both devices: without momentum, the first step
/// with momentum (the buffer starts at the gradient), and later steps with and without Nesterov.
#[test]
fn sgd_steps() {
    use kiln::ops::{KilnBackend, SgdStep};
    let n = 70_001;
    fn step<B: KilnBackend>(n: usize, h: SgdStep, with_buf: bool) -> Vec<Vec<f32>> {
        let device = Default::default();
        let t = |x: Vec<f32>| {
            Tensor::<B, 1>::from_data(TensorData::new(x, [n]), &device)
                .into_primitive()
                .tensor()
        };
        let buf = with_buf.then(|| t(values(n, 7)));
        let (p, b) = B::kiln_sgd(t(values(n, 5)), t(values(n, 6)), buf, h);
        let back = |x| {
            host(Tensor::<B, 1>::from_primitive(
                burn::tensor::TensorPrimitive::Float(x),
            ))
        };
        std::iter::once(back(p)).chain(b.map(back)).collect()
    }
    let base = SgdStep {
        lr: 0.05,
        weight_decay: 0.01,
        momentum: 0.0,
        dampening: 0.1,
        nesterov: false,
        grad_scale: 0.5,
    };
    let cases = [
        ("plain", base, false),
        (
            "momentum, first step",
            SgdStep {
                momentum: 0.9,
                ..base
            },
            false,
        ),
        (
            "momentum",
            SgdStep {
                momentum: 0.9,
                ..base
            },
            true,
        ),
        (
            "nesterov",
            SgdStep {
                momentum: 0.9,
                dampening: 0.0,
                nesterov: true,
                ..base
            },
            true,
        ),
    ];
    for (name, h, with_buf) in cases {
        let (gpu, cpu) = (
            step::<GpuInner>(n, h, with_buf),
            step::<kiln::backend::Cpu>(n, h, with_buf),
        );
        assert_eq!(gpu.len(), cpu.len(), "{name}: buffers");
        for (g, c) in gpu.iter().zip(&cpu) {
            let d = rel_diff(g, c);
            eprintln!("sgd {name}: {d:.1e}");
            assert!(d <= VALUE_TOL, "sgd {name}: GPU differs by {d:e}");
        }
    }
}

/// A target outside the classes (and not the ignored one) has no logit: the GPU cannot stop to
/// name it, so its loss is NaN (the trainer stops on a non-finite loss); other rows are unharmed.
#[test]
fn cross_entropy_target_outside_the_classes_is_nan() {
    let device = Default::default();
    let logits = Tensor::<Gpu, 2>::from_data(TensorData::new(values(3 * 5, 7), [3, 5]), &device);
    let targets =
        Tensor::<Gpu, 1, Int>::from_data(TensorData::new(vec![1i64, 5, -100], [3]), &device);
    let losses = host(kiln::ops::cross_entropy(logits, targets, -100));
    assert!(losses[0].is_finite() && losses[0] > 0.0, "{losses:?}");
    assert!(losses[1].is_nan(), "{losses:?}");
    assert_eq!(losses[2], 0.0, "{losses:?}");
}
