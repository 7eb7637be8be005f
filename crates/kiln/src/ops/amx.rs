//! The bf16 GEMM on AMX tiles (Intel Sapphire Rapids and later): `TDPBF16PS` multiplies a 16×32
//! bf16 tile of A by a 32×16 bf16 tile of B (stored as 16 rows of bf16 pairs, the "VNNI" layout)
//! into a 16×16 f32 tile of C, 16 times the multiply-adds of an AVX-512 FMA per instruction. The
//! numerics are those of [`super::bf16`]'s other kernels: operands rounded to bf16 (nearest, ties
//! to even), products summed in f32.
//!
//! Blocking, after oneDNN's brgemm and Intel's AMX guide: the eight tile registers hold a 2×2 grid
//! of C tiles (a 32×32 block of C), two A tiles and two B tiles, so each step loads four tiles for
//! four tile products. B is packed once, shared, as the 32-column panels of bf16 pairs the
//! AVX512-BF16 kernel reads. K is cut into blocks of [`KSTEPS`] steps; per block of K a task packs
//! its rows of A a chunk of [`CHUNK_ROWS`] at a time (each 32-row block one contiguous 2 KB piece
//! per 32 values of K, rows 0–15 then 16–31, 64 bytes a row) and runs them against B a chunk of
//! [`CHUNK_COLS`] columns at a time: both chunks stay in L2, and a block of A stays in L1 while
//! the chunk's panels of B stream past it. Edges are zero padding: rows of A to
//! 32, columns of B to 32, K to a multiple of 32; an edge block of C is stored to a scratch tile and
//! only its live part added to C.
//!
//! Rust has no stable AMX intrinsics, so the tile instructions are written with `asm!`. Linux
//! hands the tile registers' state only to a process that asks for it ([`request_tiles`]).

/// Steps of 32 K values per block of K: a 32-row block of A is then 32 KB, held in L1 across
/// every panel of B.
const KSTEPS: usize = 16;
/// Rows of A packed per chunk (512 KB of bf16 per block of K), and columns of B met per chunk
/// (512 KB likewise): together they stay in a 2 MB L2 (Sapphire Rapids' per core).
const CHUNK_ROWS: usize = 512;
const CHUNK_COLS: usize = 512;
/// bf16 pairs (u32) in one row of an A or B tile: 64 bytes.
const PAIRS: usize = 16;
/// Rows of A (and of C) per block: two tiles.
const ROWS: usize = 32;
/// u32s in one K step of a packed A block: 32 rows × 16 pairs.
const A_STEP: usize = ROWS * PAIRS;

/// The 64-byte `LDTILECFG` operand: palette 1, eight tiles of 16 rows × 64 bytes.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

#[cfg(target_arch = "x86_64")]
impl TileConfig {
    fn full() -> Self {
        let mut cfg = Self {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        cfg.bytes_per_row[..8].fill(64);
        cfg.rows[..8].fill(16);
        cfg
    }
}

/// The tile registers configured for this thread while it lives; released on drop (a configured
/// tile state makes every context switch save 8 KB more).
#[cfg(target_arch = "x86_64")]
struct Tiles;

#[cfg(target_arch = "x86_64")]
impl Tiles {
    /// # Safety
    /// [`request_tiles`] must have returned true.
    unsafe fn configure() -> Self {
        let cfg = TileConfig::full();
        std::arch::asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly));
        Tiles
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: a configured tile state exists (made by `configure`).
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// How the AMX GEMM splits `m×k·k×n` over `threads`: `tm × tn` tasks of `rows × cols` of C, rows
/// whole 32-row blocks and columns whole 32-column panels.
///
/// Tasks split the longer side while each gets whole blocks. Every task packs its own rows of A,
/// and B (packed once, shared) streams past them from L3 or memory, so split rows a task reads all
/// of B and 1/T of A, split columns all of A and 1/T of B: rows when m ≥ n. A held weight's input
/// gradient at 1×128 tokens (deepseek-1.3B: 128 rows, 2048–5504 columns) read its 22 MB of packed
/// weight in both tasks.
fn task_grid(m: usize, n: usize, k: usize, threads: usize) -> (usize, usize, usize, usize) {
    let (tm, tn) = match super::split::gemm_grid(m, n, k, threads) {
        (tm, tn) if m >= n && m.div_ceil(ROWS) >= tm * tn => (tm * tn, 1),
        (tm, tn) if m < n && n.div_ceil(32) >= tm * tn => (1, tm * tn),
        grid => grid,
    };
    let rows = m.div_ceil(tm).div_ceil(ROWS) * ROWS;
    let cols = n.div_ceil(tn).div_ceil(32) * 32;
    (tm, tn, rows, cols)
}

/// C[m×n] (row stride `n`) = A·B + β·C (β 0 or 1, as [`super::bf16::gemm_bf16_with`] asserts)
/// with A and B rounded to bf16 and f32 accumulation, on AMX tiles.
///
/// B is packed into the panels of [`super::bf16_pack::pack_b`] either whole, once, shared by tasks
/// that split the rows, or — where the tasks split the columns and each meets its rows of A in
/// one chunk — by each task a block of K and a chunk of its columns at a time, just before its
/// tiles read them ([`super::bf16_pack::pack_b_chunk`]). Packed whole, a large B went through memory
/// twice more (written, then read back): a held weight's input gradient at 1×128 tokens packs 16
/// MB of weight per product for 128 rows of A.
///
/// # Safety
/// [`request_tiles`] must have returned true and the CPU must have AVX512-F/BW. `a` holds every
/// element `(row, kk)` at `row·rsa + kk·csa` for row < m, kk < k; `b` every element `(kk, col)`
/// at `kk·rsb + col·csb`; `c` holds m·n values.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn gemm(
    (m, k, n): (usize, usize, usize),
    a: super::Strided<&[f32]>,
    b: super::Strided<super::bf16_pack::Values>,
    beta: f32,
    c: &mut [f32],
) {
    let (a, rsa, csa) = (a.data, a.rs, a.cs);
    let (b, rsb, csb) = (b.data, b.rs, b.cs);
    use rayon::prelude::*;
    // K padded to whole tiles: 32 values, 16 pairs.
    let steps = k.div_ceil(32);
    let kp_pad = steps * PAIRS;
    let (tm, tn, rows, cols) = task_grid(m, n, k, rayon::current_num_threads());
    // Chunks where B is row-major (the input gradient's weight); a transposed B packs fastest whole.
    let in_chunks = tm == 1 && m <= CHUNK_ROWS && csb == 1;
    let whole = if in_chunks {
        None
    } else {
        let _p = super::profile::scope("part: bf16 B packed");
        // SAFETY: as this function's.
        Some(unsafe { super::bf16_pack::pack_b((k, n), b, (rsb, csb), kp_pad) })
    };
    let cp = c.as_mut_ptr() as usize;
    let task = |t: usize| {
        let (i0, j0) = ((t / tn) * rows, (t % tn) * cols);
        if i0 >= m || j0 >= n {
            return;
        }
        let (mr, nc) = (rows.min(m - i0), cols.min(n - j0));
        // Per block of K, the task's rows of A are packed a chunk of rows at a time, and the chunk
        // meets B a chunk of columns at a time: both chunks stay in L2 while every 32-row block
        // of A (in L1) meets the chunk's 32-column panels. Without the column chunks a wide B
        // (BERT-base's 3072-wide up projection: 3 MB a block of K) streamed from L3 per block of A.
        let mut ap = APieces::new(mr.min(CHUNK_ROWS).div_ceil(ROWS), KSTEPS.min(steps));
        // A column-major A (the weight gradient's dyᵀ) is packed a chunk at a time, through its
        // pairs across the chunk's rows ([pair][row], one K step at a time).
        let by_columns = rsa == 1 && csa != 1;
        let mut across = if by_columns {
            // Rows rounded to 16: the transposes read whole groups of 16.
            vec![0u32; PAIRS * mr.min(CHUNK_ROWS).div_ceil(16) * 16]
        } else {
            vec![]
        };
        // This task's B, a block of K and a chunk of columns at a time (`in_chunks`).
        let mut b_chunk = vec![
            0u32;
            if in_chunks {
                KSTEPS.min(steps) * PAIRS * nc.min(CHUNK_COLS).div_ceil(32) * 32
            } else {
                0
            }
        ];
        let _tiles = Tiles::configure();
        let mut scratch = Scratch([0f32; ROWS * 32]);
        for kb in (0..steps).step_by(KSTEPS) {
            let ks = KSTEPS.min(steps - kb);
            let (k0, k1) = (kb * 32, ((kb + ks) * 32).min(k));
            let add_to_c = kb > 0 || beta != 0.0;
            for rc in (i0..i0 + mr).step_by(CHUNK_ROWS) {
                let chunk_rows = rc..(rc + CHUNK_ROWS).min(i0 + mr);
                if by_columns {
                    // SAFETY: the caller's CPU has AMX, and with it AVX-512 and AVX512-BF16.
                    unsafe {
                        pack_a_chunk_by_columns(
                            &a[rc + k0 * csa..],
                            csa,
                            chunk_rows.len(),
                            k1 - k0,
                            &mut across,
                            &mut ap,
                        )
                    };
                } else {
                    for (p, r0) in chunk_rows.clone().step_by(ROWS).enumerate() {
                        let live_rows = ROWS.min(m - r0);
                        let piece = &mut ap.piece_mut(p)[..ks * A_STEP];
                        if live_rows < ROWS || k1 - k0 < ks * 32 {
                            // Zero padding past the last row or K value (the buffer holds older
                            // rows).
                            piece.fill(0);
                        }
                        // SAFETY: as above.
                        unsafe {
                            pack_a_block(
                                &a[r0 * rsa + k0 * csa..],
                                (rsa, csa),
                                live_rows,
                                k1 - k0,
                                piece,
                            )
                        };
                    }
                }
                for cc in (j0..j0 + nc).step_by(CHUNK_COLS) {
                    let chunk_cols = cc..(cc + CHUNK_COLS).min(j0 + nc);
                    // Where the panel of column `first` starts at this block of K, and the values
                    // from one panel to the next: B's own panels, or this task's chunk of them.
                    let (b_first, first, panel_stride) = match &whole {
                        Some(bp) => (bp.as_ptr().add(kb * PAIRS * 32), 0, kp_pad * 32),
                        None => {
                            let _p =
                                super::profile::scope("part: bf16 B packed in tasks (thread time)");
                            let width = chunk_cols.len().div_ceil(32) * 32;
                            // SAFETY: as this function's; the chunk holds `width` columns of
                            // `ks` steps.
                            unsafe {
                                super::bf16_pack::pack_b_chunk(
                                    (k, n),
                                    b,
                                    rsb,
                                    (kb * PAIRS, ks),
                                    (cc, width),
                                    &mut b_chunk,
                                )
                            };
                            (b_chunk.as_ptr(), cc, ks * PAIRS * 32)
                        }
                    };
                    for (p, r0) in chunk_rows.clone().step_by(ROWS).enumerate() {
                        let live_rows = ROWS.min(m - r0);
                        let a_blk = ap.piece_mut(p).as_ptr();
                        for j in chunk_cols.clone().step_by(32) {
                            let live_cols = 32.min(n - j);
                            let b_blk = b_first.add(((j - first) / 32) * panel_stride);
                            let dst = (cp as *mut f32).add(r0 * n + j);
                            if live_rows == ROWS && live_cols == 32 {
                                block(ks, a_blk, b_blk, dst, n, add_to_c);
                            } else {
                                let s = scratch.0.as_mut_ptr();
                                block(ks, a_blk, b_blk, s, 32, false);
                                for r in 0..live_rows {
                                    for col in 0..live_cols {
                                        let d = dst.add(r * n + col);
                                        let v = *s.add(r * 32 + col);
                                        *d = if add_to_c { *d + v } else { v };
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    match tm * tn {
        1 => task(0),
        tasks => (0..tasks).into_par_iter().for_each(task),
    }
}

/// C[m×n] = x·Wᵀ (+ C when `beta` is 1) for x `[m, k]` (rounded to bf16) and a weight W `[n, k]`
/// held as bf16 bits, on AMX tiles that load W's rows where they lie: C is computed as its
/// transpose W·xᵀ, whose A tiles are 16 rows of W 64 bytes (32 values of K) wide at W's row
/// stride, a 32×32 block at a time, each block transposed into place. The weight is never
/// packed: a frozen base's forward read each weight twice (packing, then tiles) every step. Only x
/// is packed, as B, once. Tasks take whole 32-row blocks of W; within one, a block of W (36 KB at
/// K = 576) stays in L1 while the panels of x (all of them in L2) pass it.
///
/// # Safety
/// [`request_tiles`] must have returned true; `k` and `n` are multiples of 32; `x` holds m·k
/// values, `w` n·k and `c` m·n.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn gemm_held_rows(
    (m, k, n): (usize, usize, usize),
    x: &[f32],
    w: &[u16],
    beta: f32,
    c: &mut [f32],
) {
    use rayon::prelude::*;
    debug_assert!(k % 32 == 0 && n % ROWS == 0);
    debug_assert!(x.len() >= m * k && w.len() >= n * k && c.len() >= m * n);
    let kp = k / 2;
    // SAFETY: AMX implies AVX-512 F/BW and AVX512-BF16.
    let bp = unsafe {
        let _p = super::profile::scope("part: bf16 B packed");
        super::bf16_pack::pack_b((k, m), super::bf16_pack::Values::F32(x), (1, k), kp)
    };
    let blocks = n / ROWS;
    // A tiles of 16 rows of W, 64 bytes a step; rows 16–31 16 rows on.
    let w_layout: ALayout = (2 * k, 16 * 2 * k, 64);
    let tasks = rayon::current_num_threads().clamp(1, blocks.max(1));
    let per = blocks.div_ceil(tasks);
    let (cp, wp, bpp) = (
        c.as_mut_ptr() as usize,
        w.as_ptr() as usize,
        bp.as_ptr() as usize,
    );
    let task = |t: usize| {
        let _tiles = Tiles::configure();
        let mut scratch = Scratch([0f32; ROWS * 32]);
        let s = scratch.0.as_mut_ptr();
        for blk in t * per..((t + 1) * per).min(blocks) {
            let j0 = blk * ROWS;
            let a = (wp as *const u16).add(j0 * k).cast::<u32>();
            for (p, i0) in (0..m).step_by(32).enumerate() {
                let b = (bpp as *const u32).add(p * kp * 32);
                let live = 32.min(m - i0);
                // Row r of the block is W's row j0 + r against x's rows i0..: column j0 + r of C.
                // With β = 1 the tiles start from C's block, transposed in, so each sum is
                // C + products in the order of the packed kernel (bit for bit the same C).
                if beta != 0.0 {
                    for i in 0..32 {
                        let src = (cp as *const f32).add((i0 + i) * n + j0);
                        for r in 0..ROWS {
                            *s.add(r * 32 + i) = if i < live { *src.add(r) } else { 0.0 };
                        }
                    }
                }
                block_strided(k / 32, (a, w_layout), b, s, 32, beta != 0.0);
                for i in 0..live {
                    let dst = (cp as *mut f32).add((i0 + i) * n + j0);
                    for r in 0..ROWS {
                        *dst.add(r) = *s.add(r * 32 + i);
                    }
                }
            }
        }
    };
    match tasks {
        1 => task(0),
        _ => (0..tasks).into_par_iter().for_each(task),
    }
}

/// One K step of a packed block of A: 32 rows × 16 pairs, aligned for tile loads.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct AStep([u32; A_STEP]);

/// A chunk's packed blocks of A, each `steps` K steps long (a block of K, or all of a shorter K:
/// attention's products have K = 64, and zeroing whole blocks of K cost more than their tiles).
#[cfg(target_arch = "x86_64")]
struct APieces {
    steps: usize,
    buf: Vec<AStep>,
}

#[cfg(target_arch = "x86_64")]
impl APieces {
    fn new(pieces: usize, steps: usize) -> Self {
        Self {
            steps,
            buf: vec![AStep([0; A_STEP]); pieces * steps],
        }
    }

    /// Block `i`'s steps as `steps · A_STEP` values.
    fn piece_mut(&mut self, i: usize) -> &mut [u32] {
        let steps = &mut self.buf[i * self.steps..(i + 1) * self.steps];
        // SAFETY: `AStep` is `repr(C)` around `[u32; A_STEP]`, so its slice is these values in a row.
        unsafe { std::slice::from_raw_parts_mut(steps.as_mut_ptr().cast(), steps.len() * A_STEP) }
    }
}

/// A 32×32 f32 block, aligned for tile stores.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct Scratch([f32; ROWS * 32]);

/// `rows` (≤ 32) rows of A from `a` (row `r`, value `kk` at `r·rsa + kk·csa`; a column-major A
/// goes through [`pack_a_chunk_by_columns`]) rounded to bf16 and packed as pieces of [32 rows][16 pairs], one per 32 values of K, into `out`, whose rows past
/// `rows` and pairs past K must be zero (they are left as they are).
///
/// # Safety
/// The CPU must have AVX-512 F/BW and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
unsafe fn pack_a_block(
    a: &[f32],
    (rsa, csa): (usize, usize),
    rows: usize,
    k: usize,
    out: &mut [u32],
) {
    use super::bf16_pack::pairs_of;
    if csa == 1 {
        // Row-major: a row's 32 values of one K step are one tile row.
        for r in 0..rows {
            let row = &a[r * rsa..][..k];
            for (s, piece) in row.chunks(32).zip(out.chunks_mut(A_STEP)) {
                pairs_of(s, &mut piece[r * PAIRS..][..PAIRS]);
            }
        }
    } else {
        // Any other strides: element by element, into halves of zeroed pairs.
        use super::bf16_pack::bf16_bits;
        out.fill(0);
        for kk in 0..k {
            let (s, q, half) = (kk / 32, (kk % 32) / 2, (kk % 2) * 16);
            for r in 0..rows {
                out[s * A_STEP + r * PAIRS + q] |=
                    u32::from(bf16_bits(a[r * rsa + kk * csa])) << half;
            }
        }
    }
}

/// `rows` rows of a column-major A (value `kk` of row `r` at `kk·csa + r`; the weight gradient's
/// dyᵀ) rounded to bf16 and packed into the pieces of a chunk, K values `0..k` (≤ one block of
/// K): per step of 32 values, 16 pairs across all the chunk's rows into `across` ([pair][row]),
/// then transposed 16×16 at a time into each piece's [row][pair]. A row of `across` reads 2 KB
/// of one row of dy in sequence; packed 32 rows at a time it read 128 bytes from each of 512
/// rows that lie a row of dy apart (196 KB for SmolLM2's LM head), which the prefetchers do not
/// follow. Pairs past `k` are zero; rows past `rows` in the last piece are left as they are
/// (they only reach C's padding rows, which are never stored).
///
/// # Safety
/// The CPU must have AVX-512 F/BW and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
unsafe fn pack_a_chunk_by_columns(
    a: &[f32],
    csa: usize,
    rows: usize,
    k: usize,
    across: &mut [u32],
    pieces: &mut APieces,
) {
    use super::bf16_pack::{pack_pairs, transpose16};
    let zeros = [0f32; CHUNK_ROWS];
    let stride = across.len() / PAIRS;
    let column = |kk: usize| {
        if kk < k {
            &a[kk * csa..][..rows]
        } else {
            &zeros[..rows]
        }
    };
    let groups = rows.div_ceil(16);
    for s in 0..k.div_ceil(32) {
        for (q, lanes) in across.chunks_mut(stride).enumerate() {
            let kk = s * 32 + 2 * q;
            pack_pairs(column(kk), column(kk + 1), &mut lanes[..rows]);
        }
        for g in 0..groups {
            let piece = pieces.piece_mut(g / 2);
            transpose16(
                across.as_ptr().add(16 * g),
                stride,
                piece.as_mut_ptr().add(s * A_STEP + 16 * (g % 2) * PAIRS),
                PAIRS,
            );
        }
    }
}

/// One 32×32 block of C over `steps` steps of 32 K values: C tiles loaded from `c` when
/// `accumulate` (else zero), four tile products a step, stored back to `c` (row stride `ldc`).
///
/// # Safety
/// Tiles configured ([`Tiles::configure`]); `a` holds `steps` packed A pieces, `b` a B panel
/// from the block's first pair with `steps · 16` pair rows of 32 columns; `c` a 32×32 block.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block(
    steps: usize,
    a: *const u32,
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    block_strided(steps, (a, PACKED_A), b, c, ldc, accumulate)
}

/// Where a block's two A tiles lie, in bytes: (row stride, offset of rows 16–31, advance per K
/// step).
#[cfg(target_arch = "x86_64")]
type ALayout = (usize, usize, usize);

/// A packed block of A: 64-byte rows, rows 16–31 1 KB on, 2 KB a step.
#[cfg(target_arch = "x86_64")]
const PACKED_A: ALayout = (64, 1024, 2048);

/// [`block`] with A's tiles read at `layout`: packed, or rows of a held weight where they lie.
///
/// # Safety
/// As [`block`], with `steps` K steps of both A tiles at `layout`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block_strided(
    steps: usize,
    (a, (a_rs, a_hi, a_step)): (*const u32, ALayout),
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    use std::arch::asm;
    let ldc_bytes = ldc * 4;
    let c_lo = c.add(16 * ldc);
    if accumulate {
        asm!(
            "tileloadd tmm0, [{c} + {s}*1]",
            "tileloadd tmm1, [{c} + {s}*1 + 64]",
            "tileloadd tmm2, [{c2} + {s}*1]",
            "tileloadd tmm3, [{c2} + {s}*1 + 64]",
            c = in(reg) c, c2 = in(reg) c_lo, s = in(reg) ldc_bytes,
            options(nostack, readonly),
        );
    } else {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem),
        );
    }
    // A: two 16-row tiles a step (packed: 1 KB apart, rows 64 bytes apart); B: the panel's left and right
    // 16 columns, rows (pairs of K) 128 bytes apart, 2 KB per step. A block of A stays in L1
    // across the panels of B, which come from L2: the step after next is prefetched.
    asm!(
        "2:",
        "tileloadd tmm4, [{a} + {sa}*1]",
        "tileloadd tmm6, [{b} + {sb}*1]",
        "tileloadd tmm7, [{b} + {sb}*1 + 64]",
        "tdpbf16ps tmm0, tmm4, tmm6",
        "tileloadd tmm5, [{a2} + {sa}*1]",
        "tdpbf16ps tmm1, tmm4, tmm7",
        "tdpbf16ps tmm2, tmm5, tmm6",
        "tdpbf16ps tmm3, tmm5, tmm7",
        "prefetcht0 [{b} + 4096]",
        "prefetcht0 [{b} + 4160]",
        "prefetcht0 [{b} + 4224]",
        "prefetcht0 [{b} + 4288]",
        "prefetcht0 [{b} + 4352]",
        "prefetcht0 [{b} + 4416]",
        "prefetcht0 [{b} + 4480]",
        "prefetcht0 [{b} + 4544]",
        "prefetcht0 [{b} + 4608]",
        "prefetcht0 [{b} + 4672]",
        "prefetcht0 [{b} + 4736]",
        "prefetcht0 [{b} + 4800]",
        "prefetcht0 [{b} + 4864]",
        "prefetcht0 [{b} + 4928]",
        "prefetcht0 [{b} + 4992]",
        "prefetcht0 [{b} + 5056]",
        "prefetcht0 [{b} + 5120]",
        "prefetcht0 [{b} + 5184]",
        "prefetcht0 [{b} + 5248]",
        "prefetcht0 [{b} + 5312]",
        "prefetcht0 [{b} + 5376]",
        "prefetcht0 [{b} + 5440]",
        "prefetcht0 [{b} + 5504]",
        "prefetcht0 [{b} + 5568]",
        "prefetcht0 [{b} + 5632]",
        "prefetcht0 [{b} + 5696]",
        "prefetcht0 [{b} + 5760]",
        "prefetcht0 [{b} + 5824]",
        "prefetcht0 [{b} + 5888]",
        "prefetcht0 [{b} + 5952]",
        "prefetcht0 [{b} + 6016]",
        "prefetcht0 [{b} + 6080]",
        "add {a}, {astep}",
        "add {a2}, {astep}",
        "add {b}, 2048",
        "dec {n}",
        "jnz 2b",
        a = inout(reg) a => _, a2 = inout(reg) (a as *const u8).add(a_hi) => _,
        b = inout(reg) b => _, n = inout(reg) steps => _,
        sa = in(reg) a_rs, astep = in(reg) a_step, sb = in(reg) 128usize,
        options(nostack, readonly),
    );
    asm!(
        "tilestored [{c} + {s}*1], tmm0",
        "tilestored [{c} + {s}*1 + 64], tmm1",
        "tilestored [{c2} + {s}*1], tmm2",
        "tilestored [{c2} + {s}*1 + 64], tmm3",
        c = in(reg) c, c2 = in(reg) c_lo, s = in(reg) ldc_bytes,
        options(nostack),
    );
}

/// FLOP one round of [`peak_loop`] does: four 16×16 outputs, 32 multiply-adds each.
pub const PEAK_FLOP_PER_ROUND: f64 = 4.0 * 16.0 * 16.0 * 32.0 * 2.0;

/// The machine's AMX peak: `n` rounds of four independent tile products on tiles already in
/// registers (no memory traffic), the AMX counterpart of the bench's FMA loop. A and B tiles hold
/// 1.0 and 0.5, so every round adds 16 to each output; returns the first one (16·n).
///
/// # Safety
/// [`request_tiles`] must have returned true.
#[cfg(target_arch = "x86_64")]
pub unsafe fn peak_loop(n: u64) -> f32 {
    use std::arch::asm;
    #[repr(C, align(64))]
    struct Tile([u32; 256]);
    let _tiles = Tiles::configure();
    let ones = Tile([0x3F80_3F80; 256]);
    let halves = Tile([0x3F00_3F00; 256]);
    let mut out = Scratch([0f32; ROWS * 32]);
    asm!(
        "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
        "tileloadd tmm4, [{a} + {s}*1]",
        "tileloadd tmm5, [{a} + {s}*1]",
        "tileloadd tmm6, [{b} + {s}*1]",
        "tileloadd tmm7, [{b} + {s}*1]",
        "2:",
        "tdpbf16ps tmm0, tmm4, tmm6",
        "tdpbf16ps tmm1, tmm4, tmm7",
        "tdpbf16ps tmm2, tmm5, tmm6",
        "tdpbf16ps tmm3, tmm5, tmm7",
        "dec {n}",
        "jnz 2b",
        "tilestored [{o} + {s}*1], tmm0",
        a = in(reg) ones.0.as_ptr(), b = in(reg) halves.0.as_ptr(), o = in(reg) out.0.as_mut_ptr(),
        s = in(reg) 64usize, n = inout(reg) n.max(1) => _,
        options(nostack),
    );
    out.0[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tasks cover C in whole 32-row blocks and 32-column panels, splitting the longer side (no
    /// AMX needed: the split is arithmetic).
    #[test]
    fn tasks_cover_c_in_whole_blocks_along_the_longer_side() {
        for &(m, k, n) in &[
            (128, 2048, 5504),
            (1536, 2048, 384),
            (4096, 768, 768),
            (33, 64, 65),
            (1, 32, 1),
        ] {
            for threads in [1, 2, 4, 7] {
                let (tm, tn, rows, cols) = task_grid(m, n, k, threads);
                assert!(tm * rows >= m && tn * cols >= n, "{m}×{n} on {threads}");
                assert!(rows % ROWS == 0 && cols % 32 == 0, "{m}×{n} on {threads}");
                assert!(tm * tn <= threads.max(1), "{m}×{n} on {threads}");
                // No task lies wholly past C.
                assert!(
                    (tm - 1) * rows < m && (tn - 1) * cols < n,
                    "{m}×{n} on {threads}"
                );
            }
        }
        // deepseek-1.3B's held weight at 128 tokens: its columns split, its rows not.
        assert_eq!(task_grid(128, 5504, 2048, 2).0, 1);
        assert_eq!(task_grid(1536, 384, 2048, 2).1, 1);
    }
}
