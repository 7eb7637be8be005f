//! GFLOP/s of the CPU attention core (forward, no dropout) on the shapes of the benchmark rows:
//! MiniLM's inference batch (32 × 128, 12 heads of 32) and SmolLM2's prefill (1 × 128, 9 heads of
//! 64, causal). `KILN_CPU_ISA=avx2 cargo run --release --example attention_shapes` times the AVX2
//! tiles on any machine; rayon's pool takes `RAYON_NUM_THREADS`.

#[path = "support/allocator.rs"]
mod allocator;

use std::time::Instant;

use burn::tensor::{Distribution, Tensor};
use kiln::backend::{Cpu, CpuDevice};

fn main() {
    allocator::keep_freed_memory();
    let device = CpuDevice::default();
    for (name, b, t, heads, d, causal) in [
        ("minilm_infer 32×128, 12×32", 32, 128, 12, 32, false),
        ("smollm2_prefill 1×128, 9×64 causal", 1, 128, 9, 64, true),
    ] {
        let h = heads * d;
        let reps = if b > 1 { 20 } else { 200 };
        // Inputs drawn beforehand, one per call, each with a buffer of its own as a layer's
        // projection hands it over: a random tensor's storage is borrowed, and kiln's kernels
        // copy a borrowed operand first.
        let draw = || {
            kiln::ops::owned(Tensor::<Cpu, 3>::random(
                [b, t, 3 * h],
                Distribution::Default,
                &device,
            ))
        };
        let mask = Tensor::<Cpu, 2>::zeros([b, t], &device);
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let inputs: Vec<_> = (0..reps)
                .map(|_| {
                    if causal {
                        let part = || draw().narrow(2, 0, h);
                        (part(), Some((part(), part())))
                    } else {
                        (draw(), None)
                    }
                })
                .collect();
            let started = Instant::now();
            for (x, kv) in inputs {
                let out = match kv {
                    Some((k, v)) => kiln::ops::causal_attention(x, k, v, heads),
                    None => kiln::ops::attention_qkv(x, mask.clone(), heads, 0.0),
                };
                std::hint::black_box(out);
            }
            best = best.min(started.elapsed().as_secs_f64() / reps as f64);
        }
        // Two products of t×t×d per head (causal: about half of them).
        let flops = 4.0 * (b * heads * t * t * d) as f64 / if causal { 2.0 } else { 1.0 };
        println!(
            "{name}: {:.3} ms per call {:.1} GFLOP/s",
            best * 1e3,
            flops / best / 1e9
        );
    }
}
