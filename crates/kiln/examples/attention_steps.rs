//! Times the CPU attention core alone at SmolLM2-135M's training shape (8×512, 9 heads of 64):
//! forward with probabilities and backward, in f32 and under `--bf16`'s precision, best of 5.
//! `cargo run --release --example attention_steps`.

#[path = "support/allocator.rs"]
mod allocator;

use std::time::Instant;

use burn::tensor::{Distribution, Tensor};
use kiln::backend::{Cpu, CpuDevice};
use kiln::ops::{set_matmul_precision, AttentionSpec, KilnBackend, MatmulPrecision, Window};

fn main() {
    allocator::keep_freed_memory();
    let (b, t, heads, d) = (8, 512, 9, 64);
    let h = heads * d;
    let spec = AttentionSpec::new(heads, d, Window::CAUSAL);
    let dev = CpuDevice::default();
    let rand = |shape: [usize; 3]| {
        Tensor::<Cpu, 3>::random(shape, Distribution::Uniform(-1.0, 1.0), &dev)
            .into_primitive()
            .tensor()
    };
    let mask = Tensor::<Cpu, 2>::zeros([b, t], &dev)
        .into_primitive()
        .tensor();
    for precision in [MatmulPrecision::F32, MatmulPrecision::Bf16] {
        set_matmul_precision(precision);
        let (mut fwd, mut bwd, mut infer) = (f64::MAX, f64::MAX, f64::MAX);
        for _ in 0..5 {
            let (q, k, v, dout) = (
                rand([b, t, h]),
                rand([b, t, h]),
                rand([b, t, h]),
                rand([b, t, h]),
            );
            // The forward, keeping the probabilities for a backward or not (inference).
            let attend = |with_probs| {
                Cpu::kiln_attention(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    mask.clone(),
                    spec,
                    with_probs,
                )
            };
            let start = Instant::now();
            let (_, probs) = attend(true);
            fwd = fwd.min(start.elapsed().as_secs_f64());
            let start = Instant::now();
            attend(false);
            infer = infer.min(start.elapsed().as_secs_f64());
            let start = Instant::now();
            let grads = Cpu::kiln_attention_backward(q, k, v, probs.unwrap(), dout, spec);
            bwd = bwd.min(start.elapsed().as_secs_f64());
            drop(grads);
        }
        println!(
            "{precision:?}: forward {:.1} ms, without probabilities {:.1} ms, backward {:.1} ms (one layer)",
            fwd * 1e3,
            infer * 1e3,
            bwd * 1e3
        );
    }
}
