//! GFLOP/s of each bf16 GEMM kernel this CPU has (AMX tiles, AVX512-BF16 dot products, rounded
//! copies) against matrixmultiply's f32 GEMM on the Linear shapes of a MiniLM training step
//! (b16×128 tokens; `KILN_SHAPES=bertbase`: BERT-base at b8×128; `KILN_SHAPES=smollm2_head`:
//! SmolLM2's LM head at b8×512; `KILN_SHAPES=lora`: a rank-16 LoRA adapter on SmolLM2's q at
//! b4×128; `KILN_SHAPES=smollm2`: SmolLM2's layer at b4×128, the LoRA rows' base;
//! `KILN_SHAPES=deepseek`: deepseek-coder-1.3B's layer at 1×128, its held weights cycled through
//! copies larger than L3, as a step reads them from memory):
//! `cargo run --release --example gemm_shapes [Amx Dot Rounded]`.

#[path = "support/allocator.rs"]
mod allocator;

use std::time::Instant;

use kiln::ops::Strided;

/// (label, m, k, n, A, A strides, B, B strides)
type Case<'a> = (
    &'static str,
    usize,
    usize,
    usize,
    &'a [f32],
    (usize, usize),
    &'a [f32],
    (usize, usize),
);

fn f32_gemm(
    (m, k, n): (usize, usize, usize),
    a: Strided<&[f32]>,
    b: Strided<&[f32]>,
    c: &mut [f32],
) {
    let (sa, sb) = (a.strides(), b.strides());
    let (a, b) = (a.data, b.data);
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            sa.0 as isize,
            sa.1 as isize,
            b.as_ptr(),
            sb.0 as isize,
            sb.1 as isize,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// The f32 product of the kernels' rounded, row-major copies (CPUs without bf16 instructions).
fn rounded(m: usize, k: usize, n: usize, a: &[f32], b: &[f32], _: f32, c: &mut [f32]) {
    f32_gemm((m, k, n), Strided::rows(a, k), Strided::rows(b, n), c)
}

fn main() {
    allocator::keep_freed_memory();
    if let Some(peak) = kiln::bench::peak::measure() {
        println!("{}", peak.how);
    }
    // `KILN_SHAPES=bertbase`: BERT-base's Linear shapes at b8×128 tokens instead of MiniLM's.
    // `KILN_SHAPES=smollm2_head`: SmolLM2's tied LM head at b8×512 tokens (49152 columns).
    let shapes = std::env::var("KILN_SHAPES").unwrap_or_default();
    // `KILN_SHAPES=lora`: lora_A (576→16) and lora_B (16→576) at b4×128 tokens.
    let (t, h, ffn) = match shapes.as_str() {
        "bertbase" => (1024, 768, 3072),
        "smollm2_head" => (4096, 576, 49152),
        "lora" => (512, 576, 16),
        "smollm2" => (512, 576, 1536),
        "smollm2_head_b4" => (512, 576, 49152),
        "deepseek" => (128, 2048, 5504),
        _ => (2048, 384, 1536),
    };
    let products = [
        (format!("qkvo {h}→{h}"), h, h),
        (format!("up {h}→{ffn}"), h, ffn),
        (format!("down {ffn}→{h}"), ffn, h),
    ];
    let products = match shapes.as_str() {
        "smollm2_head" | "smollm2_head_b4" => &products[1..2],
        "lora" => &products[1..],
        _ => &products[..],
    };
    for (name, din, dout) in products.iter().cloned() {
        let x: Vec<f32> = (0..t * din).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..dout * din).map(|i| (i as f32 * 0.11).cos()).collect();
        let dy: Vec<f32> = (0..t * dout).map(|i| (i as f32 * 0.07).sin()).collect();
        let cases: [Case; 3] = [
            ("fwd x·wᵀ", t, din, dout, &x, (din, 1), &w, (1, din)),
            ("dx dy·w", t, dout, din, &dy, (dout, 1), &w, (din, 1)),
            ("dw dyᵀ·x", dout, t, din, &dy, (1, dout), &x, (din, 1)),
        ];
        // `KILN_PRODUCT=dx` (or fwd, dw) times that product alone, for a profiler.
        let product = std::env::var("KILN_PRODUCT").unwrap_or_default();
        for (label, m, k, n, a, sa, b, sb) in cases {
            if !label.starts_with(product.as_str()) {
                continue;
            }
            let mut c = vec![0f32; m * n];
            let flops = 2.0 * (m * k * n) as f64;
            let time = |f: &mut dyn FnMut(&mut [f32])| {
                let mut c = vec![0f32; m * n];
                f(&mut c);
                // The best of 5 rounds of 5 calls: a shared VM's neighbours only ever slow one down.
                (0..5)
                    .map(|_| {
                        let t0 = Instant::now();
                        for _ in 0..5 {
                            f(&mut c);
                        }
                        flops * 5.0 / t0.elapsed().as_secs_f64() / 1e9
                    })
                    .fold(0.0, f64::max)
            };
            // `gemm_shapes Amx` times only the kernels named (and not the f32 baseline).
            let only: Vec<String> = std::env::args().skip(1).collect();
            let mut line = String::new();
            if only.is_empty() {
                let g32 =
                    time(&mut |c| f32_gemm((m, k, n), Strided::new(a, sa), Strided::new(b, sb), c));
                line += &format!("f32 1 thread {g32:6.1}");
            }
            for kernel in kiln::ops::bf16::Bf16Kernel::available()
                .into_iter()
                .filter(|k| only.is_empty() || only.contains(&format!("{k:?}")))
            {
                let g = time(&mut |c| {
                    let (a, b) = (Strided::new(a, sa), Strided::new(b, sb));
                    kiln::ops::bf16::gemm_bf16_with(kernel, (m, k, n), a, b, 0.0, c, rounded)
                });
                line += &format!("  {kernel:?} {g:7.1}");
                // B as held bf16 bits (a frozen base under `--base-dtype bf16`): w's products.
                if label != "dw dyᵀ·x" {
                    // Enough copies of the weight that each call reads one from memory, not L3
                    // (deepseek-1.3B's step reads 2.6 GB of weights).
                    let copies = if shapes == "deepseek" { 12 } else { 1 };
                    let bits: Vec<Vec<u16>> = (0..copies)
                        .map(|_| b.iter().map(|&v| kiln::ops::bf16::bf16_bits(v)).collect())
                        .collect();
                    let mut call = 0;
                    let g = time(&mut |c| {
                        call += 1;
                        let (a, b) = (
                            Strided::new(a, sa),
                            Strided::new(&bits[call % copies][..], sb),
                        );
                        kiln::ops::bf16::gemm_bf16_held_b(kernel, (m, k, n), a, b, 0.0, c, rounded)
                    });
                    line += &format!(" held {g:7.1}");
                }
            }
            c[0] = 0.0;
            println!("{name:14} {label:10} {m:5}×{k:5}×{n:5}: {line} GFLOP/s");
        }
    }
}
