//! kiln's own f32 GEMM for one thread's tile of C on AVX2 + FMA, blocked as Goto and BLIS block:
//! B packed once per block of K and panel of columns (kept in L2), A's rows broadcast straight
//! from where they lie (six rows × a block of K stay in L1 while every column panel of B streams
//! past them), a 6-row × 16-column register tile of 12 accumulators.
//!
//! Why not the `gemm` crate here: capped to AVX2 on an Intel Xeon its 16 × 6 kernel ran the
//! models' products at 65–72 % of the FMA peak where MKL reaches 76–80 %; its inner loop steps
//! each of the six broadcast operands' addresses with its own add, while this tile's six rows
//! share one offset (docs/DESIGN.md "CPU GEMM").

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::cell::RefCell;

use crate::ops::Strided;

/// Rows of C per register tile: six broadcast values of A per step of K.
const MR: usize = 6;
/// Columns of C per register tile: two 8-lane registers.
const NR: usize = 16;
/// Steps of K between a line of B's prefetch and its use: the B micro-panel streams from L2 (a
/// paired run on the Xeon: +6 % over no prefetch, alike from 8 to 24 steps).
const PREFETCH: usize = 16;
/// The most values of K per block. K is cut into equal blocks of at most this many, so a tile's
/// six rows of a block (9 KB) stay in L1 (32 KB on the smallest cores kiln runs on) while B's
/// micro-panels stream past from L2 (384 to 768 ran alike; 128 and 256 slower: C is reloaded
/// once per block).
const KC: usize = 384;

thread_local! {
    /// The packed panel of B, kept per thread so a product maps no fresh pages.
    static PACKED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Columns of B per packed panel for blocks of `kc` values of K: the panel fills at most half of
/// this core's L2 (the rest holds C's rows and A's), in whole register tiles.
fn panel_columns(kc: usize) -> usize {
    let budget = *L2_BYTES / 2;
    (budget / (kc * 4)).max(NR * 4) / NR * NR
}

/// This core's L2 cache as Linux describes it (2 MB on a Sapphire Rapids core, 512 KB on a Zen 3
/// one), 1 MB where it does not say.
static L2_BYTES: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| {
    let cache = |i: usize, file: &str| {
        std::fs::read_to_string(format!(
            "/sys/devices/system/cpu/cpu0/cache/index{i}/{file}"
        ))
        .map(|s| s.trim().to_owned())
        .ok()
    };
    (0..8)
        .find(|&i| cache(i, "level").as_deref() == Some("2"))
        .and_then(|i| cache(i, "size"))
        .and_then(|s| {
            let (number, shift) = match s.strip_suffix('M') {
                Some(mb) => (mb, 20),
                None => (s.strip_suffix('K')?, 10),
            };
            number.parse::<usize>().ok().map(|v| v << shift)
        })
        .unwrap_or(1 << 20)
});

/// Whether this kernel runs a product of these sizes: at least one register tile's worth of
/// rows and columns, and some K (a product over no K only scales C, left to the caller's path).
pub(super) fn takes(m: usize, k: usize, n: usize) -> bool {
    m >= MR && n >= NR && k >= 1
}

/// [`takes`] where kiln dispatches at the AVX2 level (an AVX2-only CPU, or `KILN_CPU_ISA=avx2`).
pub(super) fn takes_here(m: usize, k: usize, n: usize) -> bool {
    takes(m, k, n) && crate::ops::isa::cpu_isa().level == crate::ops::isa::IsaLevel::Avx2
}

/// C[m×n] = A·B (+ C if `accumulate`) (+ `bias`, n values, on every row) for C with rows `ldc`
/// apart and contiguous columns, A and B read through their strides. Each element of C is summed
/// over K in order with fused multiply-adds, a block of at most [`KC`] at a time.
///
/// # Safety
/// The CPU must have AVX2 and FMA. Every element addressed by the sizes and strides must lie
/// inside the pointed-to buffers, and no other thread may touch these elements of C meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn gemm_avx2(
    (m, k, n): (usize, usize, usize),
    a: Strided<*const f32>,
    b: Strided<*const f32>,
    accumulate: bool,
    bias: Option<*const f32>,
    c: *mut f32,
    ldc: usize,
) {
    debug_assert!(k >= 1);
    let kb = k.div_ceil(k.div_ceil(KC));
    let nb = panel_columns(kb).min(n.div_ceil(NR) * NR);
    PACKED.with_borrow_mut(|packed| {
        if packed.len() < nb * kb {
            packed.resize(nb * kb, 0.0);
        }
        let pb = packed.as_mut_ptr();
        for jc in (0..n).step_by(nb) {
            let nc = nb.min(n - jc);
            for pc in (0..k).step_by(kb) {
                let kc = kb.min(k - pc);
                let first = pc == 0;
                pack_b(kc, nc, b.map(|p| p.add(pc * b.rs + jc * b.cs)), pb);
                for ir in (0..m).step_by(MR) {
                    // These rows of A stay in L1 while every micro-panel of B streams past.
                    let ap = a.map(|p| p.add(ir * a.rs + pc * a.cs));
                    for jr in (0..nc).step_by(NR) {
                        let dst = (c.add(ir * ldc + jc + jr), ldc, NR.min(nc - jr));
                        let e = Epilogue {
                            load_c: accumulate || !first,
                            // The bias is added once, with the first block of K.
                            bias: bias.filter(|_| first).map(|b| b.add(jc + jr)),
                        };
                        let bp = pb.add(jr * kc);
                        match MR.min(m - ir) {
                            6 => tile::<6>(kc, ap, bp, dst, e),
                            5 => tile::<5>(kc, ap, bp, dst, e),
                            4 => tile::<4>(kc, ap, bp, dst, e),
                            3 => tile::<3>(kc, ap, bp, dst, e),
                            2 => tile::<2>(kc, ap, bp, dst, e),
                            _ => tile::<1>(kc, ap, bp, dst, e),
                        }
                    }
                }
            }
        }
    })
}

/// What a register tile does with C after its block of K.
#[derive(Clone, Copy)]
struct Epilogue {
    /// Add C's values (a later block of K, or β = 1) instead of overwriting them.
    load_c: bool,
    /// Add these 16 (or the tile's columns') values to every row.
    bias: Option<*const f32>,
}

/// C's `R × cols` corner (`cols` ≤ 16) = (or +=) `R` rows of A (read through their strides, `kc`
/// values each) times the packed B micro-panel (`[kc][16]`, zero past `cols`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const R: usize>(
    kc: usize,
    a: Strided<*const f32>,
    b: *const f32,
    (c, ldc, cols): (*mut f32, usize, usize),
    e: Epilogue,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let rows: [*const f32; R] = std::array::from_fn(|i| a.data.add(i * a.rs));
    let mut at = 0;
    for p in 0..kc {
        // Each step of K reads one cache line of B, from L2: fetched that many steps ahead.
        _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add((p + PREFETCH) * NR).cast());
        let b0 = _mm256_loadu_ps(b.add(p * NR));
        let b1 = _mm256_loadu_ps(b.add(p * NR + 8));
        for i in 0..R {
            let av = _mm256_broadcast_ss(&*rows[i].add(at));
            acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
        }
        at += a.cs;
    }
    // A full tile loads and stores plainly; a ragged one through lane masks (masked stores are
    // slow on some AMD cores, so only the edge pays for them).
    let full = cols == NR;
    let lanes = |from: usize| {
        let w = cols.saturating_sub(from).min(8) as i32;
        _mm256_cmpgt_epi32(
            _mm256_set1_epi32(w),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        )
    };
    let masks = [lanes(0), lanes(8)];
    let load = |at: *const f32, h: usize| {
        if full {
            _mm256_loadu_ps(at)
        } else {
            _mm256_maskload_ps(at, masks[h])
        }
    };
    let bias = e.bias.map(|b| [0, 1].map(|h| load(b.add(8 * h), h)));
    for (i, acc) in acc.iter().enumerate() {
        let row = c.add(i * ldc);
        for (h, &v) in acc.iter().enumerate() {
            let at = row.add(8 * h);
            let mut v = v;
            if let Some(bias) = bias {
                v = _mm256_add_ps(v, bias[h]);
            }
            if e.load_c {
                v = _mm256_add_ps(load(at, h), v);
            }
            if full {
                _mm256_storeu_ps(at, v);
            } else {
                _mm256_maskstore_ps(at, masks[h], v);
            }
        }
    }
}

/// Packs `kc × nc` of B as micro-panels of 16 columns, each `[kc][16]`, zero past column `nc`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_b(kc: usize, nc: usize, b: Strided<*const f32>, out: *mut f32) {
    for (s, j0) in (0..nc).step_by(NR).enumerate() {
        let cols = NR.min(nc - j0);
        let panel = out.add(s * NR * kc);
        if b.cs == 1 && cols == NR {
            // Rows of B contiguous: a row of the micro-panel is two register loads and stores (a
            // `memcpy` call per 64-byte row was 4 % of a capped MiniLM training step's samples,
            // more than the copying).
            for p in 0..kc {
                let (src, dst) = (b.data.add(p * b.rs + j0), panel.add(p * NR));
                _mm256_storeu_ps(dst, _mm256_loadu_ps(src));
                _mm256_storeu_ps(dst.add(8), _mm256_loadu_ps(src.add(8)));
            }
        } else if b.cs == 1 {
            // The last, ragged micro-panel: its columns, then zeros.
            for p in 0..kc {
                let dst = panel.add(p * NR);
                std::ptr::copy_nonoverlapping(b.data.add(p * b.rs + j0), dst, cols);
                std::ptr::write_bytes(dst.add(cols), 0, NR - cols);
            }
        } else if b.rs == 1 && cols == NR {
            // Columns of B contiguous (a Linear's weight read as wᵀ): 8 × 8 blocks transposed.
            let mut p0 = 0;
            while p0 + 8 <= kc {
                for h in 0..2 {
                    transpose8(
                        b.data.add((j0 + 8 * h) * b.cs + p0),
                        b.cs,
                        panel.add(p0 * NR + 8 * h),
                        NR,
                    );
                }
                p0 += 8;
            }
            for p in p0..kc {
                for j in 0..NR {
                    *panel.add(p * NR + j) = *b.data.add(p + (j0 + j) * b.cs);
                }
            }
        } else {
            for p in 0..kc {
                let dst = panel.add(p * NR);
                for j in 0..NR {
                    *dst.add(j) = if j < cols {
                        *b.data.add(p * b.rs + (j0 + j) * b.cs)
                    } else {
                        0.0
                    };
                }
            }
        }
    }
}

/// Writes the transpose of the 8 × 8 block at `src` (rows `lds` apart) to `dst` (rows `ldd` apart).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose8(src: *const f32, lds: usize, dst: *mut f32, ldd: usize) {
    let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * lds)));
    // Pairs of rows interleaved, then quads, then the 128-bit halves exchanged.
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (x, y) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(x, y)
        } else {
            _mm256_unpackhi_ps(x, y)
        }
    });
    // s[4q + c] holds column c (lower half) and c + 4 (upper half) of rows 4q..4q + 4.
    let s: [__m256; 8] = std::array::from_fn(|i| {
        let (q, col) = (i / 4, i % 4);
        let (x, y) = (t[4 * q + col / 2], t[4 * q + 2 + col / 2]);
        if col % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(x, y)
        } else {
            _mm256_shuffle_ps::<0xEE>(x, y)
        }
    });
    for col in 0..4 {
        let (lo, hi) = (s[col], s[4 + col]);
        _mm256_storeu_ps(dst.add(col * ldd), _mm256_permute2f128_ps::<0x20>(lo, hi));
        _mm256_storeu_ps(
            dst.add((col + 4) * ldd),
            _mm256_permute2f128_ps::<0x31>(lo, hi),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shapes at, below and past every block edge: one register tile, ragged rows (7, 13) and
    /// columns (17, 33, 70), K of one value, not a multiple of the 8-value transposes, past
    /// [`KC`] (two blocks), and columns past one packed panel.
    const SHAPES: [(usize, usize, usize); 6] = [
        (6, 1, 16),
        (7, 17, 33),
        (13, 300, 70),
        (50, 40, 100),
        (24, 800, 40),
        (9, 20, 5000),
    ];

    /// The kernel alone (one thread), every layout of both operands, β 0 and 1, with and
    /// without a bias, against the f64 reference within f32 summation's bound.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_products_match_an_f64_reference() {
        if !(std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma"))
        {
            eprintln!("no avx2/fma on this CPU: kiln's AVX2 GEMM is not tested");
            return;
        }
        assert!(SHAPES.iter().all(|&(m, k, n)| takes(m, k, n)));
        super::super::gemm::assert_products_within_f32_bound(
            &SHAPES,
            &|(m, k, n), a, b, beta, bias, c| {
                // SAFETY: AVX2 and FMA were detected; the checker's operands hold their
                // strides' reach and C is m rows of n.
                unsafe {
                    gemm_avx2(
                        (m, k, n),
                        a.map(|a| a.as_ptr()),
                        b.map(|b| b.as_ptr()),
                        beta != 0.0,
                        bias.map(|b| b.as_ptr()),
                        c.as_mut_ptr(),
                        n,
                    )
                }
            },
        );
    }
}
