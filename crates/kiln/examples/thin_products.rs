//! GFLOP/s of a rank-16 LoRA adapter's products (SmolLM2's q at b4×128 tokens: one side of 16)
//! on kiln's f32 Linear and on the fastest bf16 kernel this CPU has, 2 threads, best of 7 rounds
//! of 20 calls: `cargo run --release --example thin_products`.

#[path = "support/allocator.rs"]
mod allocator;

use std::time::Instant;

use burn::tensor::{Distribution, Tensor};
use kiln::backend::Cpu;
use kiln::ops::Strided;

fn main() {
    allocator::keep_freed_memory();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("a pool of 2");
    pool.install(|| {
        let device = Default::default();
        // (m, k, n) of x·Aᵀ, (x·Aᵀ)·Bᵀ, dA's d(xA)ᵀ·x and dB's dyᵀ·(xA), each as x·wᵀ.
        for &(m, k, n) in &[(512, 576, 16), (512, 16, 576), (16, 512, 576), (576, 512, 16)] {
            // Through an op: a tensor made from data is borrowed storage, which kiln's kernels
            // copy on every call, and a step's activations and updated weights never are.
            let x = Tensor::<Cpu, 2>::random([m, k], Distribution::Normal(0.0, 1.0), &device) * 1.0;
            let w = Tensor::<Cpu, 2>::random([n, k], Distribution::Normal(0.0, 1.0), &device) * 1.0;
            let flops = 2.0 * (m * k * n) as f64;
            let best = |f: &mut dyn FnMut()| {
                f();
                (0..7)
                    .map(|_| {
                        let t0 = Instant::now();
                        for _ in 0..20 {
                            f();
                        }
                        flops * 20.0 / t0.elapsed().as_secs_f64() / 1e9
                    })
                    .fold(0.0, f64::max)
            };
            let f32_linear = best(&mut || {
                let _ = kiln::ops::linear(x.clone(), w.clone(), None).into_primitive();
            });
            let (xs, ws) = (
                x.to_data().to_vec::<f32>().expect("f32"),
                w.to_data().to_vec::<f32>().expect("f32"),
            );
            let mut c = vec![0f32; m * n];
            let bf16 = best(&mut || {
                let (x, wt) = (Strided::rows(&xs[..], k), Strided::rows(&ws[..], k).t());
                kiln::ops::bf16::gemm_bf16((m, k, n), x, wt, 0.0, &mut c, |m, k, n, a, b, beta, c| {
                    // Rounded copies (a CPU without bf16 instructions): a plain f32 product.
                    for i in 0..m {
                        for j in 0..n {
                            let dot: f32 = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
                            c[i * n + j] = beta * c[i * n + j] + dot;
                        }
                    }
                })
            });
            let kernel = kiln::ops::bf16::Bf16Kernel::best();
            println!(
                "{m:4}×{k:4}×{n:4}: kiln f32 Linear {f32_linear:6.1}  bf16 ({kernel:?}) {bf16:6.1} GFLOP/s"
            );
        }
    });
}
