//! GFLOP/s of kiln's f32 Linear (`x·wᵀ`, a PyTorch-layout weight) on the models' shapes, 2
//! threads (`THREADS=N`: N), best of 7 rounds, the calls of a round adding up to about 4 GFLOP:
//! `cargo run --release --example f32_products`. `KILN_CPU_ISA` caps the kernels as in training;
//! `ONLY=text` keeps the shapes whose label holds it, `SHAPE=m,k,n` times that one instead; `IN_OUT=1` times `x·w` with the weight laid
//! out `[in, out]`, as inference holds it (`Linear::into_inference_layout`). `GRADS=1` times a
//! training step's three products instead, on the training shapes: the forward `x·wᵀ`, the input
//! gradient `dy·w` and the weight gradient `dyᵀ·x` (`KilnBackend::kiln_linear_backward`).

#[path = "support/allocator.rs"]
mod allocator;

use std::time::Instant;

use burn::tensor::{Distribution, Tensor};
use kiln::backend::Cpu;
use kiln::ops::{KilnBackend, LinearGrads};

/// (label, m, k, n) of `x [m, k] · wᵀ` with `w [n, k]`.
const SHAPES: &[(&str, usize, usize, usize)] = &[
    ("sq1024", 1024, 1024, 1024),
    ("minilm infer qkv", 4096, 384, 1152),
    ("minilm infer out", 4096, 384, 384),
    ("minilm infer ffn1", 4096, 384, 1536),
    ("minilm infer ffn2", 4096, 1536, 384),
    ("bertbase ffn1", 1024, 768, 3072),
    ("bertbase ffn2", 1024, 3072, 768),
    ("prefill 128 q", 128, 576, 576),
    ("prefill 128 kv", 128, 576, 192),
    ("prefill 128 gate+up", 128, 576, 1536),
    ("prefill 128 down", 128, 1536, 576),
    ("prefill 128 head", 128, 576, 49152),
];

/// (label, m, k, n) of a training step's Linear: `x [m, k]`, `w [n, k]`, `dy [m, n]`.
const TRAIN_SHAPES: &[(&str, usize, usize, usize)] = &[
    ("minilm train qkv", 2048, 384, 1152),
    ("minilm train out", 2048, 384, 384),
    ("minilm train ffn1", 2048, 384, 1536),
    ("minilm train ffn2", 2048, 1536, 384),
    ("bertbase train qkv", 1024, 768, 2304),
    ("bertbase train ffn1", 1024, 768, 3072),
    ("bertbase train ffn2", 1024, 3072, 768),
    ("smollm2 train q", 512, 576, 576),
    ("smollm2 train gate+up", 512, 576, 3072),
    ("smollm2 train down", 512, 1536, 576),
    ("smollm2 train head", 512, 576, 49152),
];

/// The one shape `SHAPE=m,k,n` names, if it names one.
fn own_shape() -> Option<[(&'static str, usize, usize, usize); 1]> {
    let s = std::env::var("SHAPE").ok()?;
    let d: Vec<usize> = s
        .split(',')
        .map(|v| v.parse().expect("SHAPE=m,k,n"))
        .collect();
    assert_eq!(d.len(), 3, "SHAPE=m,k,n");
    Some([("shape", d[0], d[1], d[2])])
}

/// The best GFLOP/s of 7 rounds of `run`, each round about 4 GFLOP of `flops`-sized calls.
fn best_rate(flops: f64, run: &dyn Fn()) -> f64 {
    let calls = (4e9 / flops).ceil() as usize;
    run();
    (0..7)
        .map(|_| {
            let t0 = Instant::now();
            (0..calls).for_each(|_| run());
            flops * calls as f64 / t0.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// A training step's three products per shape: `x·wᵀ`, `dy·w`, `dyᵀ·x`.
fn grads(only: Option<&str>) {
    let device = Default::default();
    let own = own_shape();
    for &(label, m, k, n) in own.as_ref().map_or(TRAIN_SHAPES, |s| &s[..]) {
        if only.is_some_and(|o| !label.contains(o)) {
            continue;
        }
        let normal = |rows, cols| {
            Tensor::<Cpu, 2>::random([rows, cols], Distribution::Normal(0.0, 1.0), &device) * 1.0
        };
        let (x, w, dy) = (normal(m, k), normal(n, k), normal(m, n));
        let flops = 2.0 * (m * k * n) as f64;
        let fwd = best_rate(flops, &|| {
            let _ = kiln::ops::linear(x.clone(), w.clone(), None).into_primitive();
        });
        let backward = |input: bool| {
            best_rate(flops, &|| {
                let wants = LinearGrads {
                    input,
                    weight: !input,
                    bias: false,
                };
                let _ = Cpu::kiln_linear_backward(
                    x.clone().into_primitive().tensor(),
                    w.clone().into_primitive().tensor(),
                    dy.clone().into_primitive().tensor(),
                    wants,
                );
            })
        };
        let (dx, dw) = (backward(true), backward(false));
        println!(
            "{label:<22} {m:>5}x{k:>5}x{n:>6} {fwd:7.1} {dx:7.1} {dw:7.1} GFLOP/s (x·wᵀ, dy·w, dyᵀ·x)"
        );
    }
}

fn main() {
    allocator::keep_freed_memory();
    kiln::ops::isa::init().expect("KILN_CPU_ISA is a level");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(
            std::env::var("THREADS")
                .ok()
                .and_then(|t| t.parse().ok())
                .unwrap_or(2),
        )
        .build()
        .expect("a thread pool");
    pool.install(|| {
        let device = Default::default();
        let only = std::env::var("ONLY").ok();
        if std::env::var_os("GRADS").is_some() {
            return grads(only.as_deref());
        }
        let own = own_shape();
        for &(label, m, k, n) in own.as_ref().map_or(SHAPES, |s| &s[..]) {
            if only.as_deref().is_some_and(|o| !label.contains(o)) {
                continue;
            }
            // `* 1.0`: owned storage, as a step's activations and weights are (a tensor made from
            // data is borrowed, and kiln's kernels copy borrowed operands).
            let x = Tensor::<Cpu, 2>::random([m, k], Distribution::Normal(0.0, 1.0), &device) * 1.0;
            let w = Tensor::<Cpu, 2>::random([n, k], Distribution::Normal(0.0, 1.0), &device) * 1.0;
            let in_out = std::env::var_os("IN_OUT").is_some();
            let w_in_out = kiln::ops::owned(w.clone().transpose());
            let flops = 2.0 * (m * k * n) as f64;
            let bias = Tensor::<Cpu, 1>::random([n], Distribution::Normal(0.0, 1.0), &device) * 1.0;
            let best = |b: Option<&Tensor<Cpu, 1>>| {
                best_rate(flops, &|| {
                    let _ = if in_out {
                        kiln::ops::linear_in_out(x.clone(), w_in_out.clone(), b.cloned())
                    } else {
                        kiln::ops::linear(x.clone(), w.clone(), b.cloned())
                    }
                    .into_primitive();
                })
            };
            let (plain, biased) = (best(None), best(Some(&bias)));
            println!("{label:<22} {m:>5}x{k:>5}x{n:>6} {plain:7.1} {biased:7.1} GFLOP/s (x·wᵀ, x·wᵀ + b)");
        }
    });
}
