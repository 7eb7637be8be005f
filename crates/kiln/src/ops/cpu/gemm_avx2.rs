//! kiln's own f32 GEMM for one thread's tile of C on AVX2 + FMA, blocked as Goto and BLIS block:
//! B packed once per block of K and panel of columns (kept in L2), A's rows broadcast straight
//! from where they lie (six rows × a block of K stay in L1 while every column panel of B streams
//! past them), a 6-row × 16-column register tile of 12 accumulators. An A read down its columns
//! (a weight gradient) is packed as well, in Goto's order ([`gemm_packed_a`]).
//!
//! Why not the `gemm` crate here: capped to AVX2 on an Intel Xeon its 16 × 6 kernel ran the
//! models' products at 65–72 % of the FMA peak where MKL reaches 76–80 %; its inner loop steps
//! each of the six broadcast operands' addresses with its own add, while this tile's six rows
//! share one offset (docs/DESIGN.md "CPU GEMM").

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::LazyLock;

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

/// One cache line of packed values: the packed buffers are vectors of these, so every micro-panel
/// row of B (16 values) is one aligned line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Line([f32; 16]);

/// Calls `kernel::<R>(args)` for a tile of `rows` (1 to [`MR`]): the row count is a const
/// parameter, so each tile keeps its accumulators in registers fixed at compile time.
macro_rules! by_rows {
    ($rows:expr, $kernel:ident($($arg:expr),* $(,)?)) => {
        match $rows {
            6 => $kernel::<6>($($arg),*),
            5 => $kernel::<5>($($arg),*),
            4 => $kernel::<4>($($arg),*),
            3 => $kernel::<3>($($arg),*),
            2 => $kernel::<2>($($arg),*),
            _ => $kernel::<1>($($arg),*),
        }
    };
}

thread_local! {
    /// The packed panel of B, kept per thread so a product maps no fresh pages.
    static PACKED: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
    /// The packed block of A (products reading A down its columns only), likewise.
    static PACKED_A: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// `buffer` grown to at least `floats` values, as a pointer to its first.
pub(super) fn lines_for(buffer: &mut Vec<Line>, floats: usize) -> *mut f32 {
    let lines = floats.div_ceil(16);
    if buffer.len() < lines {
        buffer.resize(lines, Line([0.0; 16]));
    }
    buffer.as_mut_ptr().cast()
}

/// Columns of B per packed panel for blocks of `kc` values of K: the panel fills at most half of
/// this core's L2 (the rest holds C's rows and A's), in whole register tiles.
fn panel_columns(kc: usize) -> usize {
    let budget = *L2_BYTES / 2;
    (budget / (kc * 4)).max(NR * 4) / NR * NR
}

/// This core's L2 cache as Linux describes it (2 MB on a Sapphire Rapids core, 512 KB on a Zen 3
/// one), 1 MB where it does not say.
pub(crate) static L2_BYTES: LazyLock<usize> = LazyLock::new(|| cache_bytes(2).unwrap_or(1 << 20));

/// This core's L1 data cache (32 KB on a Zen 3 core, 48 KB on a Zen 5 or Sapphire Rapids one),
/// 32 KB where Linux does not say.
static L1D_BYTES: LazyLock<usize> = LazyLock::new(|| cache_bytes(1).unwrap_or(32 << 10));

/// The size of cpu0's data (or unified) cache of this `level` from sysfs.
fn cache_bytes(level: u32) -> Option<usize> {
    let cache = |i: usize, file: &str| {
        std::fs::read_to_string(format!(
            "/sys/devices/system/cpu/cpu0/cache/index{i}/{file}"
        ))
        .map(|s| s.trim().to_owned())
        .ok()
    };
    let s = (0..8)
        .find(|&i| {
            cache(i, "level").as_deref() == Some(&level.to_string())
                && cache(i, "type").as_deref() != Some("Instruction")
        })
        .and_then(|i| cache(i, "size"))?;
    let (number, shift) = match s.strip_suffix('M') {
        Some(mb) => (mb, 20),
        None => (s.strip_suffix('K')?, 10),
    };
    number.parse::<usize>().ok().map(|v| v << shift)
}

/// Whether an A read down its columns is packed ([`gemm_packed_a`]): where the cache lines a
/// tile's rows touch in one block of K read in place (one 64-byte line per step, 24 KB for
/// [`KC`]) fill more than half of L1. On a Zen 3 (32 KB) packing took the weight gradient from 33
/// to 49–57 GFLOP/s on one thread; on a Zen 5 (48 KB) it ran 9 % behind to 8 % ahead of reading in
/// place, shape by shape (docs/DESIGN.md, "The weight gradient packs A too").
static PACK_COLUMN_A: LazyLock<bool> = LazyLock::new(|| KC * 64 > *L1D_BYTES / 2);

/// Blocks for a product whose A is read down its columns (a weight gradient dyᵀ·x), where A is
/// packed too: `kc` values of K per block, so a packed micro-panel of B (`kc` × 16) fills at most
/// half of L1 and stays there while A's micro-panels stream past; `mc` rows of A per packed block,
/// filling at most half of L2; `nc` columns of B per packed block.
struct PackedBlocking {
    kc: usize,
    mc: usize,
    nc: usize,
}

static PACKED_BLOCKING: LazyLock<PackedBlocking> = LazyLock::new(|| {
    // 256 on a 32 KB L1, 384 on 48 KB (the probe on Zen 3: 256 to 512 ran alike).
    let kc = (*L1D_BYTES / 2 / (NR * 4)).clamp(256, 512);
    // 252 rows on a 512 KB L2; at most 288, the most the probe measured (72 to 288 ran alike).
    let mc = (*L2_BYTES / 2 / (kc * 4)).clamp(8 * MR, 288) / MR * MR;
    PackedBlocking { kc, mc, nc: 4080 }
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
    if a.rs == 1 && a.cs != 1 && *PACK_COLUMN_A {
        gemm_packed_a((m, k, n), a, b, accumulate, bias, c, ldc)
    } else {
        gemm_a_in_place((m, k, n), a, b, accumulate, bias, c, ldc)
    }
}

/// [`gemm_avx2`] reading A where it lies: six rows of a block of K stay in L1 while B's packed
/// micro-panels stream past from L2.
///
/// # Safety
/// As for [`gemm_avx2`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_a_in_place(
    (m, k, n): (usize, usize, usize),
    a: Strided<*const f32>,
    b: Strided<*const f32>,
    accumulate: bool,
    bias: Option<*const f32>,
    c: *mut f32,
    ldc: usize,
) {
    let kb = k.div_ceil(k.div_ceil(KC));
    let nb = panel_columns(kb).min(n.div_ceil(NR) * NR);
    PACKED.with_borrow_mut(|packed| {
        let pb = lines_for(packed, nb * kb);
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
                        let e = Epilogue::of_block(accumulate, first, bias, jc + jr);
                        let bp = pb.add(jr * kc);
                        by_rows!(MR.min(m - ir), tile(kc, ap, bp, dst, e));
                    }
                }
            }
        }
    })
}

/// [`gemm_avx2`] for an A read down its columns (`a.rs == 1`: the weight gradient dyᵀ·x), with A
/// packed too, in Goto's order. Read in place, each step of K of such an A touches a new cache line
/// for a tile's six values, so six rows of a block of K no longer fit in L1 (384 lines, 24 KB of a
/// Zen 3's 32): on Zen 3 these products ran at 76–90 GFLOP/s against MKL's 125–134 (2 threads).
/// Here a block of A (`mc` rows × `kc`) is packed into six-row micro-panels (`[kc][6]`) that stream
/// from L2 past one micro-panel of B held in L1 (114–120 GFLOP/s in the probe on the same shapes).
///
/// # Safety
/// As for [`gemm_avx2`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_packed_a(
    (m, k, n): (usize, usize, usize),
    a: Strided<*const f32>,
    b: Strided<*const f32>,
    accumulate: bool,
    bias: Option<*const f32>,
    c: *mut f32,
    ldc: usize,
) {
    let PackedBlocking { kc, mc, nc } = *PACKED_BLOCKING;
    let kb = k.div_ceil(k.div_ceil(kc));
    let nb = nc.min(n.div_ceil(NR) * NR);
    let mb = mc.min(m.div_ceil(MR) * MR);
    PACKED.with_borrow_mut(|packed_b| {
        PACKED_A.with_borrow_mut(|packed_a| {
            let (pb, pa) = (lines_for(packed_b, nb * kb), lines_for(packed_a, mb * kb));
            for jc in (0..n).step_by(nb) {
                let nc = nb.min(n - jc);
                for pc in (0..k).step_by(kb) {
                    let kc = kb.min(k - pc);
                    let first = pc == 0;
                    pack_b(kc, nc, b.map(|p| p.add(pc * b.rs + jc * b.cs)), pb);
                    for ic in (0..m).step_by(mb) {
                        let mc = mb.min(m - ic);
                        pack_a(mc, kc, a.map(|p| p.add(ic * a.rs + pc * a.cs)), pa);
                        for jr in (0..nc).step_by(NR) {
                            // This micro-panel of B stays in L1 while A's stream past.
                            let bp = pb.add(jr * kc);
                            let e = Epilogue::of_block(accumulate, first, bias, jc + jr);
                            for ir in (0..mc).step_by(MR) {
                                let ap = pa.add(ir * kc);
                                let dst = (c.add((ic + ir) * ldc + jc + jr), ldc, NR.min(nc - jr));
                                by_rows!(MR.min(mc - ir), packed_tile(kc, ap, bp, dst, e));
                            }
                        }
                    }
                }
            }
        })
    })
}

/// Packs `mc × kc` of A as micro-panels of six rows, each `[kc][6]` (a ragged last one leaves its
/// missing rows unwritten: its tile reads only the rows it has).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_a(mc: usize, kc: usize, a: Strided<*const f32>, out: *mut f32) {
    for (s, i0) in (0..mc).step_by(MR).enumerate() {
        let rows = MR.min(mc - i0);
        let panel = out.add(s * MR * kc);
        if a.rs == 1 {
            // A step of K's six values lie side by side. A whole panel copies a constant six, which
            // compiles to two register moves; a copy of `rows` values was a `memcpy` call per
            // step of K, a tenth of a weight gradient with 384 columns.
            for p in 0..kc {
                let (src, dst) = (a.data.add(i0 + p * a.cs), panel.add(p * MR));
                if rows == MR {
                    std::ptr::copy_nonoverlapping(src, dst, MR);
                } else {
                    std::ptr::copy_nonoverlapping(src, dst, rows);
                }
            }
        } else {
            for p in 0..kc {
                for i in 0..rows {
                    *panel.add(p * MR + i) = *a.data.add((i0 + i) * a.rs + p * a.cs);
                }
            }
        }
    }
}

/// [`tile`] on a packed micro-panel of A (`[kc][6]`, the first `R` rows used).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn packed_tile<const R: usize>(
    kc: usize,
    a: *const f32,
    b: *const f32,
    dst: (*mut f32, usize, usize),
    e: Epilogue,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for p in 0..kc {
        let b0 = _mm256_load_ps(b.add(p * NR));
        let b1 = _mm256_load_ps(b.add(p * NR + 8));
        for (i, acc) in acc.iter_mut().enumerate() {
            let av = _mm256_broadcast_ss(&*a.add(p * MR + i));
            acc[0] = _mm256_fmadd_ps(av, b0, acc[0]);
            acc[1] = _mm256_fmadd_ps(av, b1, acc[1]);
        }
    }
    store_tile(acc, dst, e)
}

/// What a register tile does with C after its block of K.
#[derive(Clone, Copy)]
struct Epilogue {
    /// Add C's values (a later block of K, or β = 1) instead of overwriting them.
    load_c: bool,
    /// Add these 16 (or the tile's columns') values to every row.
    bias: Option<*const f32>,
}

impl Epilogue {
    /// A tile's epilogue in the block of K that starts at `first` or later, for the tile whose
    /// columns start at `column`: C is overwritten only by the first block of a product that does
    /// not accumulate, and the bias is added once, with the first block.
    ///
    /// # Safety
    /// `bias`, when given, holds at least `column + 16` values (or the tile's columns).
    unsafe fn of_block(
        accumulate: bool,
        first: bool,
        bias: Option<*const f32>,
        column: usize,
    ) -> Self {
        Self {
            load_c: accumulate || !first,
            bias: bias.filter(|_| first).map(|b| b.add(column)),
        }
    }
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
    store_tile(acc, (c, ldc, cols), e)
}

/// Writes a register tile's `R` rows to C's `R × cols` corner through the [`Epilogue`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn store_tile<const R: usize>(
    acc: [[__m256; 2]; R],
    (c, ldc, cols): (*mut f32, usize, usize),
    e: Epilogue,
) {
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
    let rows: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * lds)));
    for (c, column) in transposed8(rows).into_iter().enumerate() {
        _mm256_storeu_ps(dst.add(c * ldd), column);
    }
}

/// The columns of the 8 × 8 block whose rows are `r`.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn transposed8(r: [__m256; 8]) -> [__m256; 8] {
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
    std::array::from_fn(|c| {
        let (lo, hi) = (s[c % 4], s[4 + c % 4]);
        if c < 4 {
            _mm256_permute2f128_ps::<0x20>(lo, hi)
        } else {
            _mm256_permute2f128_ps::<0x31>(lo, hi)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shapes at, below and past every block edge: one register tile, ragged rows (7, 13) and
    /// columns (17, 33, 70), K of one value, not a multiple of the 8-value transposes, past
    /// [`KC`] (two blocks), columns past one packed panel, and, for an A read down its columns
    /// (packed), rows past one packed block of A (at most 288) and past its 4080 columns of B.
    const SHAPES: [(usize, usize, usize); 8] = [
        (6, 1, 16),
        (7, 17, 33),
        (13, 300, 70),
        (50, 40, 100),
        (24, 800, 40),
        (9, 20, 5000),
        (601, 40, 20),
        (7, 3, 4100),
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
        // The dispatch, then both blockings on every layout (only one of them is this CPU's
        // choice for an A read down its columns).
        let kernels: [unsafe fn(_, _, _, _, _, _, _); 3] =
            [gemm_avx2, gemm_a_in_place, gemm_packed_a];
        for kernel in kernels {
            super::super::gemm::assert_products_within_f32_bound(
                &SHAPES,
                &move |(m, k, n), a, b, beta, bias, c| {
                    // SAFETY: AVX2 and FMA were detected; the checker's operands hold their
                    // strides' reach and C is m rows of n.
                    unsafe {
                        kernel(
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

    /// Not a test: times the weight gradient's layout (A read down its columns) packed against
    /// read in place, one thread, the two alternating call by call so the VM's drift falls on
    /// both alike: `cargo test --release -p kiln --lib packed_a_against_in_place -- --ignored
    /// --nocapture` (`KILN_BENCH_SHAPES="m,k,n;…"` for other shapes, m rows of C).
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore]
    fn packed_a_against_in_place() {
        if !std::arch::is_x86_feature_detected!("fma") {
            return;
        }
        let shapes: Vec<(usize, usize, usize)> = std::env::var("KILN_BENCH_SHAPES")
            .unwrap_or("1152,1024,384;384,1024,384;1536,1024,384;384,1024,1536".into())
            .split(';')
            .map(|s| {
                let d: Vec<usize> = s.split(',').map(|v| v.parse().unwrap()).collect();
                (d[0], d[1], d[2])
            })
            .collect();
        for (m, k, n) in shapes {
            // dyᵀ·x: dy [k, m] row-major read as A [m, k]; x [k, n] row-major.
            let dy: Vec<f32> = (0..k * m).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
            let x: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 * 0.2 - 0.5).collect();
            let mut c = vec![0f32; m * n];
            let (a, b) = (
                Strided::new(dy.as_ptr(), (1, m)),
                Strided::new(x.as_ptr(), (n, 1)),
            );
            let kernels: [unsafe fn(_, _, _, _, _, _, _); 2] = [gemm_a_in_place, gemm_packed_a];
            let mut rates = [vec![], vec![]];
            for round in 0..40 {
                for (v, kernel) in kernels.iter().enumerate() {
                    let t0 = std::time::Instant::now();
                    // SAFETY: FMA was detected (AVX2 with it on every CPU kiln runs on); A, B
                    // and C hold m·k, k·n and m·n values.
                    unsafe { kernel((m, k, n), a, b, false, None, c.as_mut_ptr(), n) };
                    if round > 0 {
                        rates[v].push(2.0 * (m * k * n) as f64 / t0.elapsed().as_secs_f64() / 1e9);
                    }
                }
            }
            let median = |r: &mut Vec<f64>| {
                r.sort_by(f64::total_cmp);
                r[r.len() / 2]
            };
            let (a, b) = (median(&mut rates[0]), median(&mut rates[1]));
            println!("{m}x{k}x{n} dyT.x GFLOP/s, medians of 39: in place {a:.1}, packed {b:.1}");
        }
    }
}
