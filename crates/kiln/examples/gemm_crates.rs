//! GEMM throughput on the models' shapes: matrixmultiply (split over rayon by rows, as kiln's
//! `sgemm` did until issue 16) beside the `gemm` crate (what it calls now, with its own rayon parallelism). A probe for issue 16:
//! `cargo run --release -p kiln --example gemm_crates`.

#[path = "support/allocator.rs"]
mod allocator;

use std::time::Instant;

use rayon::prelude::*;

/// (name, m, k, n, transposed B: B given as [n, k] like a Linear weight, transposed A: A given as [k, m]).
const SHAPES: &[(&str, usize, usize, usize, bool, bool)] = &[
    ("sq1024", 1024, 1024, 1024, false, false),
    ("minilm qkv fwd", 2048, 384, 1152, true, false),
    ("minilm ffn1 fwd", 2048, 384, 1536, true, false),
    ("minilm ffn2 fwd", 2048, 1536, 384, true, false),
    ("minilm ffn1 dX", 2048, 1536, 384, false, false),
    ("minilm ffn1 dW", 1536, 2048, 384, false, true),
    ("smollm2 mlp fwd", 512, 576, 1536, true, false),
    ("smollm2 down dW", 576, 512, 1536, false, true),
    ("smollm2 lm_head", 512, 576, 49152, true, false),
    ("prefill 128 mlp", 128, 576, 1536, true, false),
    ("prefill 128 q", 128, 576, 576, true, false),
    ("prefill 128 kv", 128, 576, 192, true, false),
    ("prefill 128 qkv", 128, 576, 960, true, false),
    ("prefill 128 gate+up", 128, 576, 3072, true, false),
    ("prefill 128 down", 128, 1536, 576, true, false),
    ("prefill 128 head", 128, 576, 49152, true, false),
    ("prefill 128 down [k,n]", 128, 1536, 576, false, false),
    ("prefill 128 q [k,n]", 128, 576, 576, false, false),
    ("prefill 128 head [k,n]", 128, 576, 49152, false, false),
    ("infer 4096 qkv", 4096, 384, 1152, true, false),
    ("infer 4096 out", 4096, 384, 384, true, false),
    ("infer 4096 ffn1", 4096, 384, 1536, true, false),
    ("infer 4096 ffn2", 4096, 1536, 384, true, false),
    ("mnist fc1 fwd", 32, 784, 120, true, false),
    ("mnist fc1 dW", 120, 32, 784, false, true),
    ("mnist fc2 fwd", 32, 120, 84, true, false),
    ("mnist fc2 dX", 32, 84, 120, false, false),
];

/// One product's sizes and operands (by strides), as every variant below takes it.
#[derive(Clone, Copy)]
struct Product<'a> {
    m: usize,
    k: usize,
    n: usize,
    a: &'a [f32],
    sa: (usize, usize),
    b: &'a [f32],
    sb: (usize, usize),
}

fn strides(rows: usize, cols: usize, t: bool) -> (usize, usize) {
    // Element (i, j) of a rows×cols operand stored transposed lies at j*rows + i.
    if t {
        (1, rows)
    } else {
        (cols, 1)
    }
}

fn mm(p: Product, c: &mut [f32]) {
    let Product {
        m,
        k,
        n,
        a,
        sa,
        b,
        sb,
    } = p;
    let parts = rayon::current_num_threads();
    let rows = m.div_ceil(parts).div_ceil(8) * 8;
    c.par_chunks_mut(rows * n).enumerate().for_each(|(i, cp)| {
        let r0 = i * rows;
        let mr = cp.len() / n;
        unsafe {
            matrixmultiply::sgemm(
                mr,
                k,
                n,
                1.0,
                a.as_ptr().add(r0 * sa.0),
                sa.0 as isize,
                sa.1 as isize,
                b.as_ptr(),
                sb.0 as isize,
                sb.1 as isize,
                0.0,
                cp.as_mut_ptr(),
                n as isize,
                1,
            );
        }
    });
}

fn gm(p: Product, c: &mut [f32], threads: usize) {
    let Product {
        m,
        k,
        n,
        a,
        sa,
        b,
        sb,
    } = p;
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            sa.1 as isize,
            sa.0 as isize,
            b.as_ptr(),
            sb.1 as isize,
            sb.0 as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// One thread, K cut into `parts` blocks accumulated into C (two calls' worth of gemm's own K blocking).
fn gm_ksplit(p: Product, c: &mut [f32], parts: usize) {
    let Product {
        m,
        k,
        n,
        a,
        sa,
        b,
        sb,
    } = p;
    let kb = k.div_ceil(parts);
    for (i, k0) in (0..k).step_by(kb).enumerate() {
        let kr = kb.min(k - k0);
        unsafe {
            gemm::gemm(
                m,
                n,
                kr,
                c.as_mut_ptr(),
                1,
                n as isize,
                i > 0,
                a.as_ptr().add(k0 * sa.1),
                sa.1 as isize,
                sa.0 as isize,
                b.as_ptr().add(k0 * sb.0),
                sb.1 as isize,
                sb.0 as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    }
}

/// One thread computing Cᵀ = Bᵀ·Aᵀ (the same product with the operands' roles swapped).
fn gm_t(p: Product, c: &mut [f32]) {
    let Product {
        m,
        k,
        n,
        a,
        sa,
        b,
        sb,
    } = p;
    unsafe {
        gemm::gemm(
            n,
            m,
            k,
            c.as_mut_ptr(),
            n as isize,
            1,
            false,
            b.as_ptr(),
            sb.0 as isize,
            sb.1 as isize,
            a.as_ptr(),
            sa.0 as isize,
            sa.1 as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Two single-threaded products side by side: C's columns (or rows, when M is the larger side) split in half.
fn split2(p: Product, c: &mut [f32]) {
    let Product {
        m,
        k,
        n,
        a,
        sa,
        b,
        sb,
    } = p;
    struct P(*mut f32);
    unsafe impl Sync for P {}
    unsafe impl Send for P {}
    let cp = P(c.as_mut_ptr());
    let cp = &cp;
    let one = |m0: usize, mr: usize, n0: usize, nr: usize| unsafe {
        gemm::gemm(
            mr,
            nr,
            k,
            cp.0.add(m0 * n + n0),
            1,
            n as isize,
            false,
            a.as_ptr().add(m0 * sa.0),
            sa.1 as isize,
            sa.0 as isize,
            b.as_ptr().add(n0 * sb.1),
            sb.1 as isize,
            sb.0 as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    };
    if n >= m {
        let h = (n / 2).div_ceil(16) * 16;
        rayon::join(|| one(0, m, 0, h), || one(0, m, h, n - h));
    } else {
        let h = (m / 2).div_ceil(8) * 8;
        rayon::join(|| one(0, h, 0, n), || one(h, m - h, 0, n));
    }
}

fn time(f: &mut dyn FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let mut n = 0;
        while t.elapsed().as_secs_f64() < 0.2 || n < 2 {
            f();
            n += 1;
        }
        best = best.min(t.elapsed().as_secs_f64() / n as f64);
    }
    best
}

fn main() {
    allocator::keep_freed_memory();
    println!("threads {}", rayon::current_num_threads());
    for &(name, m, k, n, tb, ta) in SHAPES {
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 104729) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let (sa, sb) = (strides(m, k, ta), strides(k, n, tb));
        let p = Product {
            m,
            k,
            n,
            a: &a,
            sa,
            b: &b,
            sb,
        };
        let mut c1 = vec![0f32; m * n];
        let mut c2 = vec![0f32; m * n];
        let t1 = time(&mut || mm(p, &mut c1));
        let threads = rayon::current_num_threads();
        let t2 = time(&mut || gm(p, &mut c2, threads));
        let t3 = time(&mut || gm(p, &mut c2, 1));
        let mut c4 = vec![0f32; m * n];
        let t5 = time(&mut || gm_t(p, &mut c4));
        let mut c5 = vec![0f32; m * n];
        let t6 = time(&mut || gm_ksplit(p, &mut c5, 2));
        let t7 = time(&mut || gm_ksplit(p, &mut c5, 3));
        let err4 = c5
            .iter()
            .zip(&c2)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        let err3 = c4
            .iter()
            .zip(&c2)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        let mut c3 = vec![0f32; m * n];
        let t4 = time(&mut || split2(p, &mut c3));
        let err2 = c3
            .iter()
            .zip(&c2)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        let err = c1
            .iter()
            .zip(&c2)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        let gf = |t: f64| 2.0 * (m * k * n) as f64 / t / 1e9;
        println!(
            "{name:18} {m}x{k}x{n} matrixmultiply {:7.1} GF/s  gemm {:7.1} GF/s  gemm 1 thread {:7.1} GF/s  1 thread Cᵀ {:7.1} GF/s (max|d| {err3:.1e})  K/2 {:7.1}  K/3 {:7.1} (max|d| {err4:.1e})  split2 {:7.1} GF/s  max|d| {err:.1e} {err2:.1e}",
            gf(t1),
            gf(t2),
            gf(t3),
            gf(t5),
            gf(t6),
            gf(t7),
            gf(t4)
        );
    }
}
