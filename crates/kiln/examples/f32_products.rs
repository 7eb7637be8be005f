//! GFLOP/s of kiln's f32 Linear (`x·wᵀ`, a PyTorch-layout weight) on the models' shapes, 2
//! threads (`THREADS=N`: N), best of 7 rounds, the calls of a round adding up to about 4 GFLOP:
//! `cargo run --release --example f32_products`. `KILN_CPU_ISA` caps the kernels as in training;
//! `ONLY=text` keeps the shapes whose label holds it; `IN_OUT=1` times `x·w` with the weight laid
//! out `[in, out]`, as inference holds it (`Linear::into_inference_layout`).

#[path = "support/allocator.rs"]
mod allocator;

use std::time::Instant;

use burn::tensor::{Distribution, Tensor};
use kiln::backend::Cpu;

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
        for &(label, m, k, n) in SHAPES {
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
            let calls = (4e9 / flops).ceil() as usize;
            let bias = Tensor::<Cpu, 1>::random([n], Distribution::Normal(0.0, 1.0), &device) * 1.0;
            let best = |b: Option<&Tensor<Cpu, 1>>| {
                let run = || {
                    let _ = if in_out {
                        kiln::ops::linear_in_out(x.clone(), w_in_out.clone(), b.cloned())
                    } else {
                        kiln::ops::linear(x.clone(), w.clone(), b.cloned())
                    }
                    .into_primitive();
                };
                run();
                (0..7)
                    .map(|_| {
                        let t0 = Instant::now();
                        (0..calls).for_each(|_| run());
                        flops * calls as f64 / t0.elapsed().as_secs_f64() / 1e9
                    })
                    .fold(0.0, f64::max)
            };
            let (plain, biased) = (best(None), best(Some(&bias)));
            println!("{label:<22} {m:>5}x{k:>5}x{n:>6} {plain:7.1} {biased:7.1} GFLOP/s (x·wᵀ, x·wᵀ + b)");
        }
    });
}
