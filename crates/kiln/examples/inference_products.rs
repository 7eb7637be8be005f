//! GFLOP/s of inference's Linear products on SmolLM2's shapes with the weight `[in, out]` (the
//! GEMM packs it per call) and in the CPU's inference layout (`kiln::ops::inference_layout`:
//! 32-column panels on AVX-512, packed once), 2 threads, best of 5 rounds, each round cycling
//! over enough distinct weights (64 MB) that they come from memory, as a step's do:
//! `cargo run --release --example inference_products`. `ROWS=a,b,…` sets the rows (128: a
//! prompt of 128 tokens; 1: decoding).

#[path = "support/allocator.rs"]
mod allocator;

use std::time::Instant;

use burn::tensor::{Distribution, Tensor};
use kiln::backend::Cpu;

/// (label, k, n) of `x [rows, k] · W [k, n]`.
const SHAPES: &[(&str, usize, usize)] = &[
    ("q / o", 576, 576),
    ("k / v", 576, 192),
    ("gate / up", 576, 1536),
    ("down", 1536, 576),
    ("head", 576, 49152),
];

fn main() {
    allocator::keep_freed_memory();
    kiln::ops::isa::init().expect("KILN_CPU_ISA is a level");
    let rows: Vec<usize> = std::env::var("ROWS")
        .unwrap_or_else(|_| "128".into())
        .split(',')
        .map(|r| r.trim().parse().expect("ROWS: numbers"))
        .collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("a pool of 2");
    pool.install(|| {
        let device = Default::default();
        for &m in &rows {
            for &(label, k, n) in SHAPES {
                let count = (64usize << 20).div_ceil(k * n * 4).max(2);
                // `* 1.0`: owned storage, as a step's activations and a model's weights are.
                let x =
                    Tensor::<Cpu, 2>::random([m, k], Distribution::Normal(0.0, 1.0), &device) * 1.0;
                let ws: Vec<Tensor<Cpu, 2>> = (0..count)
                    .map(|_| Tensor::random([n, k], Distribution::Normal(0.0, 1.0), &device) * 1.0)
                    .collect();
                let in_out: Vec<_> = ws
                    .iter()
                    .map(|w| kiln::ops::owned(w.clone().transpose()))
                    .collect();
                let layout: Vec<_> = ws
                    .iter()
                    .map(|w| kiln::ops::inference_layout(w.clone()))
                    .collect();
                let flops = 2.0 * (m * k * n) as f64;
                let calls = count.max((2e9 / flops) as usize);
                let rate = |weights: &[Tensor<Cpu, 2>]| {
                    let t0 = Instant::now();
                    for i in 0..calls {
                        let w = weights[i % count].clone();
                        let _ = kiln::ops::linear_in_out(x.clone(), w, None).into_primitive();
                    }
                    flops * calls as f64 / t0.elapsed().as_secs_f64() / 1e9
                };
                // Alternating rounds, so both see the same machine.
                let (mut packed_per_call, mut packed_once) = (0f64, 0f64);
                for _ in 0..5 {
                    packed_per_call = packed_per_call.max(rate(&in_out));
                    packed_once = packed_once.max(rate(&layout));
                }
                println!(
                    "{label:<10} {m:>5}x{k:>5}x{n:>6}: [in, out] {packed_per_call:6.1}, \
                     inference layout {:?} {packed_once:6.1} GFLOP/s",
                    layout[0].dims()
                );
            }
        }
    });
}
