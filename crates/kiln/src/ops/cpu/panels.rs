//! Inference's weights packed once into 32-column panels, and the product that reads them.
//!
//! A GEMM packs its weight operand on every call. In a prompt's products (128 rows for SmolLM2's
//! prefill) each packed value is used only 128 times, and the `gemm` crate's packing was a quarter
//! of the products' samples: it is where a weight that does not fit in the caches comes in from
//! memory. A model that only runs forward never changes its weights, so
//! `Linear::into_inference_layout` packs each once ([`pack`]): panel `p` holds output columns
//! `32p..32p + 32` for every input, `[K][32]`, one contiguous run. The product ([`linear`]) then
//! reads the activations where they lie (a 12-row tile broadcasts one value of each row per step)
//! and each panel streams in order, the next one prefetched into L2 while this one runs. On the
//! AMX Xeon that ran prefill's shapes 3–13 % faster than packing per call (BENCHMARKS.md, session
//! 10). AVX-512 only: elsewhere the inference layout stays `[K, N]` and the GEMM packs.

use std::cell::RefCell;

use super::gemm_avx2::{lines_for, Line};
use super::*;

/// Output columns per panel: two AVX-512 registers.
pub(super) const PANEL: usize = 32;

/// Rows of the activations per register tile: 24 accumulators, 2 panel loads and 12 broadcasts
/// per step of K.
const TILE_ROWS: usize = 12;

/// Rows of the activations per pass over the panels: 16 tiles, whose 192 rows of K floats stay in
/// L2 (432 KB at K = 576) while every panel streams past them.
const CHUNK_ROWS: usize = 16 * TILE_ROWS;

/// The most steps of K per tile before its sums go back to C: a panel's block of 384 × 32 floats
/// (48 KB) stays in L1 across the row tiles.
const KC: usize = 384;

/// The most rows [`linear`] runs on: past them (a long prompt) the `gemm` crate's blocking, which
/// packs the activations, is ahead of this kernel's (406 against 365 GFLOP/s at 2048 rows), so
/// the weight is unpacked ([`unpack`]) for it instead: a copy per call that leaves such products
/// 7–15 % behind the `[in, out]` layout at 1024 rows and 2–5 % at 2048 (BENCHMARKS.md, session 10).
pub(super) const MAX_ROWS: usize = 512;

/// Whether `w [n, k]` is packed for inference on this CPU: an f32 product on AVX-512, with whole
/// panels (every model kiln loads has a multiple of 32 outputs per projection).
pub(super) fn packs(k: usize, n: usize) -> bool {
    k > 0
        && n > 0
        && n.is_multiple_of(PANEL)
        && crate::ops::isa::cpu_isa().level == crate::ops::isa::IsaLevel::Avx512
        && crate::ops::matmul_precision() == crate::ops::MatmulPrecision::F32
}

/// The outputs of a packed weight of `shape` for inputs of width `k`, or `None` for a weight laid
/// out `[k, n]`. A packed weight is held as `[n/32 · k, 32]`; the two coincide when `n` is 32,
/// and then so do their bytes.
pub(super) fn packed_outputs(shape: &[usize], k: usize) -> Option<usize> {
    (shape.len() == 2 && shape[0] != k && shape[1] == PANEL && k > 0 && shape[0].is_multiple_of(k))
        .then(|| shape[0] / k * PANEL)
}

/// `w [n, k]` (PyTorch's layout) as panels `[n/32][k][32]`: panel `p`, row `r` holds
/// `w[32p..32p + 32, r]`.
pub(super) fn pack(w: &[f32], n: usize, k: usize) -> Vec<f32> {
    assert!(n.is_multiple_of(PANEL) && w.len() == n * k);
    let mut out = vec![0f32; n * k];
    out.par_chunks_mut(k * PANEL)
        .enumerate()
        .for_each(|(p, panel)| {
            for (j, row) in w[p * PANEL * k..(p + 1) * PANEL * k].chunks(k).enumerate() {
                for (r, &v) in row.iter().enumerate() {
                    panel[r * PANEL + j] = v;
                }
            }
        });
    out
}

/// [`pack`]'s panels back as `[k, n]`.
pub(super) fn unpack(panels: &[f32], k: usize, n: usize) -> Vec<f32> {
    assert!(n.is_multiple_of(PANEL) && panels.len() == n * k);
    // SAFETY: every row of `out` is written whole below (its n / 32 panels' rows), before any
    // read.
    let mut out = unsafe { unfilled(k * n) };
    out.par_chunks_mut(n).enumerate().for_each(|(r, row)| {
        for (p, cols) in row.chunks_mut(PANEL).enumerate() {
            cols.copy_from_slice(&panels[(p * k + r) * PANEL..(p * k + r + 1) * PANEL]);
        }
    });
    out
}

/// Where [`linear`]'s panels come from: packed once, or made from a weight held in bf16 (a frozen
/// base under `--base-dtype bf16`) one panel at a time, as each thread reaches it.
#[derive(Clone, Copy)]
pub(super) enum Weight<'a> {
    /// [`pack`]'s panels (inference).
    Panels(&'a [f32]),
    /// The bf16 bits of `w [n, k]`, PyTorch's layout, for `x · wᵀ` (a held base's forward): a
    /// panel is 32 of its rows, widened and transposed.
    HeldOutIn(&'a [u16]),
    /// The bf16 bits of `w [k, n]`, for `x · w` (a held base's input gradient `dy · w`, whose sum
    /// runs over the weight's rows): a panel is 32 of its columns, widened.
    HeldInOut(&'a [u16]),
}

/// Whether [`linear`] runs a product of `m` rows into `n` outputs on a weight held in bf16: on
/// AVX-512 under f32 products, whole panels, and rows that fit one chunk ([`CHUNK_ROWS`]), so each
/// block of a panel is widened once, in L2, as it is needed, where the GEMM's path widens 512 of
/// the weight's rows into memory and packs them again. Past one chunk every chunk widens the
/// panels anew, and at 512 rows that measured no faster than the GEMM's path (DESIGN.md, "A held
/// base's panels").
pub(super) fn takes_held(m: usize, n: usize) -> bool {
    m <= CHUNK_ROWS && packs(1, n)
}

/// `y = x · W + bias` for `x [m, k]` and `W [k, n]` given as panels ([`Weight`]). Each output is
/// summed over K in order in blocks of at most [`KC`] (fused multiply-adds, the blocks' sums
/// added in order, then the bias), so the bits do not depend on the thread count.
///
/// # Panics
/// Off AVX-512 (where [`packs`] makes no panels), or when an operand's length does not match.
pub(super) fn linear(
    (m, k, n): (usize, usize, usize),
    x: &[f32],
    w: Weight,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let len = match w {
        Weight::Panels(panels) => panels.len(),
        Weight::HeldOutIn(bits) | Weight::HeldInOut(bits) => bits.len(),
    };
    assert!(n.is_multiple_of(PANEL) && len == n * k && x.len() >= m * k);
    assert!(bias.is_none_or(|b| b.len() == n));
    assert!(
        crate::ops::isa::cpu_isa().level == crate::ops::isa::IsaLevel::Avx512,
        "panel weights are made and read on AVX-512 CPUs only"
    );
    // SAFETY: every (row, column) of y is written by exactly one tile's first K block below.
    let mut y = unsafe { unfilled(m * n) };
    if m == 0 {
        return y;
    }
    let count = n / PANEL;
    let threads = rayon::current_num_threads().min(count);
    let out = SharedMut(y.as_mut_ptr());
    let run = |t: usize| {
        let own = count * t / threads..count * (t + 1) / threads;
        for r0 in (0..m).step_by(CHUNK_ROWS) {
            let rows = CHUNK_ROWS.min(m - r0);
            // SAFETY: this task writes columns `own` of rows `r0..r0 + rows` only; the asserts
            // above keep every read and write in bounds.
            unsafe { chunk(&own, (r0, rows), (k, n), x, w, bias, out) };
        }
    };
    if threads <= 1 {
        run(0);
    } else {
        (0..threads).into_par_iter().for_each(run);
    }
    y
}

thread_local! {
    /// The panel widened from a held weight, kept per thread so a product maps no fresh pages;
    /// in 64-byte lines, so each of its rows (two registers) is two aligned loads.
    static WIDENED: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// Values `k0..k0 + kc` of K of panel `p` (of a weight of `n` outputs over `k`) as `[kc][32]` f32
/// values: where they lie in packed panels, else widened into `widened`.
///
/// # Safety
/// The CPU must have AVX-512; `w` holds `n · k` values, `p < n / 32` and `k0 + kc ≤ k`.
unsafe fn block_at(
    w: Weight,
    p: usize,
    (k0, kc): (usize, usize),
    (k, n): (usize, usize),
    widened: &mut Vec<Line>,
) -> *const f32 {
    match w {
        Weight::Panels(panels) => panels.as_ptr().add((p * k + k0) * PANEL),
        Weight::HeldOutIn(bits) => {
            let out = lines_for(widened, kc * PANEL);
            x86::widen_rows_transposed(bits.as_ptr().add(p * PANEL * k + k0), k, kc, out);
            out
        }
        Weight::HeldInOut(bits) => {
            let out = lines_for(widened, kc * PANEL);
            x86::widen_columns(bits.as_ptr().add(k0 * n + p * PANEL), kc, n, out);
            out
        }
    }
}

/// The cache lines [`block_at`] reads for the same block, to request into L2 while the block
/// before it runs.
///
/// # Safety
/// As [`block_at`].
unsafe fn source_of(
    w: Weight,
    p: usize,
    (k0, kc): (usize, usize),
    (k, n): (usize, usize),
) -> Prefetch {
    match w {
        Weight::Panels(panels) => {
            let lines = kc * PANEL * 4 / 64;
            let at = panels.as_ptr().add((p * k + k0) * PANEL).cast();
            Prefetch {
                at,
                run: lines,
                stride: 0,
                from: 0,
                lines,
            }
        }
        // 32 rows of the weight, `kc` bf16 values each.
        Weight::HeldOutIn(bits) => {
            let run = (kc * 2).div_ceil(64);
            let at = bits.as_ptr().add(p * PANEL * k + k0).cast();
            Prefetch {
                at,
                run,
                stride: k * 2,
                from: 0,
                lines: PANEL * run,
            }
        }
        // `kc` rows of the weight, 32 bf16 values (one line) each.
        Weight::HeldInOut(bits) => {
            let at = bits.as_ptr().add(k0 * n + p * PANEL).cast();
            Prefetch {
                at,
                run: 1,
                stride: n * 2,
                from: 0,
                lines: kc,
            }
        }
    }
}

/// Rows `r0..r0 + rows` of y for panels `own`, one block of K of one panel at a time, each next
/// block's source requested into L2 as the one before it runs. Where these rows of x fit in half
/// of L2 they stay there while every panel passes, a panel's blocks in turn; where they do not
/// (a long K: 2.8 MB for 128 rows of 5504), the blocks of K go outermost, so each block of x
/// stays in L2 across the panels instead of all of x coming from L3 once per panel. Each output
/// adds its blocks' sums in the same order either way.
///
/// # Safety
/// The CPU must have AVX-512; `x`, `w`, `bias` and `y` hold what [`linear`] asserts, and no other
/// thread writes these elements of y.
unsafe fn chunk(
    own: &std::ops::Range<usize>,
    (r0, rows): (usize, usize),
    (k, n): (usize, usize),
    x: &[f32],
    w: Weight,
    bias: Option<&[f32]>,
    y: SharedMut,
) {
    let blocks = k.div_ceil(KC);
    let kc = k.div_ceil(blocks);
    let tiles = rows.div_ceil(TILE_ROWS);
    let panels = own.len();
    let x_in_l2 = rows * k * 4 <= *super::gemm_avx2::L2_BYTES / 2;
    // Item `i` of this chunk's work: (panel, block of K).
    let item = |i: usize| {
        if x_in_l2 {
            (own.start + i / blocks, i % blocks)
        } else {
            (own.start + i % panels, i / panels)
        }
    };
    let items = panels * blocks;
    let span = |b: usize| (b * kc, kc.min(k - b * kc));
    WIDENED.with_borrow_mut(|widened| {
        for i in 0..items {
            let (p, b) = item(i);
            let (k0, steps) = span(b);
            let block = block_at(w, p, (k0, steps), (k, n), widened);
            // The next block's cache lines, shared out over this block's tiles.
            let next = if i + 1 < items {
                let (p, b) = item(i + 1);
                source_of(w, p, span(b), (k, n))
            } else {
                Prefetch::NONE
            };
            let per_tile = next.lines.div_ceil(tiles);
            let bias = bias.map(|b| b.as_ptr().add(p * PANEL));
            for t in 0..tiles {
                let i0 = t * TILE_ROWS;
                let first = (t * per_tile).min(next.lines);
                let io = Io {
                    x: x.as_ptr().add((r0 + i0) * k + k0),
                    ldx: k,
                    panel: block,
                    y: y.at((r0 + i0) * n + p * PANEL),
                    ldy: n,
                    bias: bias.filter(|_| b + 1 == blocks),
                    accumulate: b > 0,
                };
                let prefetch = next.part(first, per_tile.min(next.lines - first));
                x86::tile_rows(TILE_ROWS.min(rows - i0), steps, io, prefetch);
            }
        }
    })
}

/// One tile's operands: `x`'s rows `ldx` apart from the tile's first row and K block, the panel
/// from that block, y's rows `ldy` apart; blocks after the first add onto y, and the last adds the
/// bias.
#[derive(Clone, Copy)]
struct Io {
    x: *const f32,
    ldx: usize,
    panel: *const f32,
    y: *mut f32,
    ldy: usize,
    bias: Option<*const f32>,
    accumulate: bool,
}

/// Cache lines to request into L2 during a tile, spread evenly over its steps: lines
/// `from..from + lines` of a source laid out as runs of `run` consecutive lines, `stride` bytes
/// apart from `at`.
#[derive(Clone, Copy)]
struct Prefetch {
    at: *const u8,
    run: usize,
    stride: usize,
    from: usize,
    lines: usize,
}

impl Prefetch {
    const NONE: Self = Self {
        at: std::ptr::null(),
        run: 1,
        stride: 0,
        from: 0,
        lines: 0,
    };

    /// Lines `from..from + lines` of this source.
    fn part(self, from: usize, lines: usize) -> Self {
        Self {
            from,
            lines,
            ..self
        }
    }

    /// The address of the source's line `i`.
    fn line(&self, i: usize) -> *const u8 {
        self.at
            .wrapping_add(i / self.run * self.stride + i % self.run * 64)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Io, Prefetch, PANEL, TILE_ROWS};

    /// Widens `kc` values of 32 rows of bf16 bits (`k` apart, a block of a panel of `w [n, k]`)
    /// into `[kc][32]`: blocks of 8 rows × 8 values widened in registers (a shift of the 16 bits
    /// into an f32's high half, exact) and transposed with AVX's 8 × 8 shuffle.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `rows` holds 32 rows of `kc` values `k` apart and `out` room
    /// for `32·kc`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn widen_rows_transposed(
        rows: *const u16,
        k: usize,
        kc: usize,
        out: *mut f32,
    ) {
        let whole = kc / 8 * 8;
        for k0 in (0..whole).step_by(8) {
            for g in 0..PANEL / 8 {
                let block: [__m256; 8] = std::array::from_fn(|i| {
                    let bits = _mm_loadu_si128(rows.add((8 * g + i) * k + k0).cast());
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)))
                });
                let columns = super::super::gemm_avx2::transposed8(block);
                for (c, column) in columns.into_iter().enumerate() {
                    _mm256_storeu_ps(out.add((k0 + c) * PANEL + 8 * g), column);
                }
            }
        }
        for r in whole..kc {
            for j in 0..PANEL {
                *out.add(r * PANEL + j) = crate::ops::bf16::widen_bf16_bits(*rows.add(j * k + r));
            }
        }
    }

    /// Widens 32 columns of `kc` rows of bf16 bits (a block of a panel of `w [k, n]`, its rows
    /// `n` apart) into `[kc][32]`, two registers a row.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `columns` holds `kc` rows of 32 values `n` apart and `out` room
    /// for `32·kc`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn widen_columns(columns: *const u16, kc: usize, n: usize, out: *mut f32) {
        for r in 0..kc {
            for h in 0..2 {
                let bits = _mm256_loadu_si256(columns.add(r * n + 16 * h).cast());
                let wide = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits));
                _mm512_storeu_ps(out.add(r * PANEL + 16 * h), _mm512_castsi512_ps(wide));
            }
        }
    }

    /// [`tile`] for `rows` (1..=12) rows.
    ///
    /// # Safety
    /// As [`tile`].
    pub(super) unsafe fn tile_rows(rows: usize, steps: usize, io: Io, pf: Prefetch) {
        match rows {
            TILE_ROWS => tile::<TILE_ROWS>(steps, io, pf),
            11 => tile::<11>(steps, io, pf),
            10 => tile::<10>(steps, io, pf),
            9 => tile::<9>(steps, io, pf),
            8 => tile::<8>(steps, io, pf),
            7 => tile::<7>(steps, io, pf),
            6 => tile::<6>(steps, io, pf),
            5 => tile::<5>(steps, io, pf),
            4 => tile::<4>(steps, io, pf),
            3 => tile::<3>(steps, io, pf),
            2 => tile::<2>(steps, io, pf),
            1 => tile::<1>(steps, io, pf),
            _ => unreachable!("a tile has 1 to {TILE_ROWS} rows"),
        }
    }

    /// `R` rows × 32 columns of y: `steps` steps of K, each two panel loads and one broadcast per
    /// row into 2·R accumulators; the prefetches ride along the first steps.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `io` addresses `R` rows of `steps` x values, `steps` panel rows
    /// and `R` rows of 32 y values (and 32 bias values) that lie in their buffers, and no other
    /// thread touches these y values.
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn tile<const R: usize>(steps: usize, io: Io, pf: Prefetch) {
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        // `lines` requests over `steps` steps without a division per step: `due` gains `lines`
        // a step and each request takes `steps` from it.
        let (mut issued, mut due) = (0, 0);
        for s in 0..steps {
            due += pf.lines;
            while due >= steps && issued < pf.lines {
                _mm_prefetch::<_MM_HINT_T1>(pf.line(pf.from + issued).cast());
                issued += 1;
                due -= steps;
            }
            let b0 = _mm512_loadu_ps(io.panel.add(s * 32));
            let b1 = _mm512_loadu_ps(io.panel.add(s * 32 + 16));
            for (i, acc) in acc.iter_mut().enumerate() {
                let a = _mm512_set1_ps(*io.x.add(i * io.ldx + s));
                acc[0] = _mm512_fmadd_ps(a, b0, acc[0]);
                acc[1] = _mm512_fmadd_ps(a, b1, acc[1]);
            }
        }
        let bias = io
            .bias
            .map(|b| [_mm512_loadu_ps(b), _mm512_loadu_ps(b.add(16))]);
        for (i, acc) in acc.iter().enumerate() {
            let row = io.y.add(i * io.ldy);
            for (v, &sum) in acc.iter().enumerate() {
                let at = row.add(16 * v);
                let mut sum = sum;
                if io.accumulate {
                    sum = _mm512_add_ps(_mm512_loadu_ps(at), sum);
                }
                if let Some(bias) = bias {
                    sum = _mm512_add_ps(sum, bias[v]);
                }
                _mm512_storeu_ps(at, sum);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::{Io, Prefetch};

    /// Never reached: [`super::packs`] makes panels on AVX-512 CPUs only.
    pub(super) unsafe fn tile_rows(_: usize, _: usize, _: Io, _: Prefetch) {
        unreachable!("panel weights are made on AVX-512 CPUs only")
    }

    /// Never reached, as [`tile_rows`].
    pub(super) unsafe fn widen_rows_transposed(_: *const u16, _: usize, _: usize, _: *mut f32) {
        unreachable!("panel weights are made on AVX-512 CPUs only")
    }

    /// Never reached, as [`tile_rows`].
    pub(super) unsafe fn widen_columns(_: *const u16, _: usize, _: usize, _: *mut f32) {
        unreachable!("panel weights are made on AVX-512 CPUs only")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether this process dispatches at the AVX-512 level (the only one that packs panels);
    /// says so and skips otherwise.
    fn avx512_here() -> bool {
        let here = crate::ops::isa::cpu_isa().level == crate::ops::isa::IsaLevel::Avx512;
        if !here {
            eprintln!("no avx512f at this dispatch level: kiln's panel GEMM is not tested");
        }
        here
    }

    /// The product on packed panels against the f64 reference within f32 summation's bound:
    /// one row and a few, a partial last tile (13, 25 rows), more rows than a chunk (200), K of 1,
    /// across a block (385) and over three (800), one panel and several, with and without a
    /// bias; and a chunk of x too long for half of L2 (192 × 1400 floats, on any L2 up to 2 MB),
    /// whose blocks of K run outermost, beside a last chunk of 8 rows that fits. The checker's
    /// operands come in every layout; the adapter packs B and lays A out in rows, as a model's
    /// weight and activations are.
    #[test]
    fn panel_products_match_an_f64_reference() {
        if !avx512_here() {
            return;
        }
        let shapes = [
            (1, 7, 32),
            (3, 50, 64),
            (12, 385, 32),
            (13, 20, 96),
            (200, 64, 32),
            (25, 800, 64),
            (5, 1, 32),
            (200, 1400, 64),
        ];
        super::super::gemm::assert_products_within_f32_bound(
            &shapes,
            &|(m, k, n), a, b, beta, bias, c| {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| a.data[(i / k) * a.rs + (i % k) * a.cs])
                    .collect();
                let w: Vec<f32> = (0..n * k)
                    .map(|i| b.data[(i % k) * b.rs + (i / k) * b.cs])
                    .collect();
                let y = linear((m, k, n), &x, Weight::Panels(&pack(&w, n, k)), bias);
                for (c, y) in c.iter_mut().zip(y) {
                    *c = if beta == 0.0 { y } else { *c + y };
                }
            },
        );
    }

    /// Each output is one tile's sum over K, whoever runs it: the bits on 1 and on 3 threads
    /// are the same. `unpack` gives back the weight that was packed.
    #[test]
    fn panel_products_do_not_depend_on_the_threads() {
        if !avx512_here() {
            return;
        }
        let (m, k, n) = (37, 900, 160);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 13.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 17 % 89) as f32 - 44.0) / 19.0)
            .collect();
        let bias: Vec<f32> = (0..n).map(|j| j as f32 / 7.0).collect();
        let panels = pack(&w, n, k);
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a thread pool");
            pool.install(|| linear((m, k, n), &x, Weight::Panels(&panels), Some(&bias)))
        };
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(bits(on(1)), bits(on(3)));
        let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
        assert_eq!(unpack(&panels, k, n), wt);
    }

    /// A weight held in bf16 gives, through panels widened as they are reached, the bits of the
    /// same product on its values widened and packed once (itself checked against f64 above):
    /// both layouts (`[n, k]` read transposed, `[k, n]` read by columns), K not a multiple of the
    /// 8-value transposes (13, 805) and across blocks, one panel and several, 1 and 3 threads.
    #[test]
    fn held_bf16_panels_give_the_packed_panels_bits() {
        if !avx512_here() {
            return;
        }
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        for (m, k, n) in [(5, 13, 32), (37, 805, 96), (200, 64, 64)] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 31 % 97) as f32 - 48.0) / 13.0)
                .collect();
            let held: Vec<u16> = (0..n * k)
                .map(|i| crate::ops::bf16::bf16_bits(((i * 17 % 89) as f32 - 44.0) / 19.0))
                .collect();
            let wide: Vec<f32> = held
                .iter()
                .map(|&b| crate::ops::bf16::widen_bf16_bits(b))
                .collect();
            let bias: Vec<f32> = (0..n).map(|j| j as f32 / 7.0).collect();
            // `held` as `[n, k]` (y = x · heldᵀ) and, the same values, as `[k, n]` (y = x · held).
            let held_t: Vec<u16> = (0..k * n).map(|i| held[(i % n) * k + i / n]).collect();
            let want = bits(linear(
                (m, k, n),
                &x,
                Weight::Panels(&pack(&wide, n, k)),
                Some(&bias),
            ));
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("a thread pool");
                for (label, w) in [
                    ("[n, k]", Weight::HeldOutIn(&held)),
                    ("[k, n]", Weight::HeldInOut(&held_t)),
                ] {
                    let got = pool.install(|| linear((m, k, n), &x, w, Some(&bias)));
                    assert_eq!(
                        bits(got),
                        want,
                        "{label} held, {m}×{k}×{n}, {threads} threads"
                    );
                }
            }
        }
    }
}
