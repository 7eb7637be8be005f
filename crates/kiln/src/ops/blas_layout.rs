//! How a row-major product is asked of a column-major BLAS (cuBLAS): the arguments of one
//! `gemm` call. Kept apart from the CUDA code so that the mapping, which decides every GEMM of a
//! CUDA run, is checked on every machine (the tests below run it against cuBLAS's documented
//! column-major semantics, written out in plain loops).
//!
//! kiln's tensors are row-major. A row-major `[r, c]` buffer read column-major is its transpose
//! `[c, r]` with leading dimension `c`, so the row-major `C = op(A) · op(B)` is asked as the
//! column-major `Cᵀ = op(B)ᵀ · op(A)ᵀ`: the operands swap places and keep their own transpose flag.

/// Whether BLAS reads an operand as stored (`N`) or transposed (`T`), in its column-major view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    N,
    T,
}

/// The arguments of one column-major `gemm(transa, transb, m, n, k, A, lda, B, ldb, C, ldc)`:
/// `C[m×n] = op(A)[m×k] · op(B)[k×n]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmCall {
    pub transa: Op,
    pub transb: Op,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

/// The call computing the row-major `C[m, n] = op(L) · op(R)`, where `L` is stored row-major as
/// `[m, k]` (or `[k, m]` when `trans_l`) and `R` as `[k, n]` (or `[n, k]` when `trans_r`). BLAS's
/// `A` is then `R`'s buffer and its `B` is `L`'s.
pub fn row_major_gemm(m: usize, n: usize, k: usize, trans_l: bool, trans_r: bool) -> GemmCall {
    // A packed row-major buffer's leading dimension (column-major view) is its row length.
    let ld_l = if trans_l { m } else { k };
    let ld_r = if trans_r { k } else { n };
    row_major_gemm_strided(m, n, k, (trans_l, ld_l), (trans_r, ld_r))
}

/// [`row_major_gemm`] for operands whose stored rows lie `ld_*` elements apart (at least their
/// row length): a matrix inside a larger buffer, such as one head of a `[B, T, heads, D]` tensor.
pub fn row_major_gemm_strided(
    m: usize,
    n: usize,
    k: usize,
    (trans_l, ld_l): (bool, usize),
    (trans_r, ld_r): (bool, usize),
) -> GemmCall {
    let op = |t: bool| if t { Op::T } else { Op::N };
    GemmCall {
        transa: op(trans_r),
        transb: op(trans_l),
        m: n,
        n: m,
        k,
        lda: ld_r,
        ldb: ld_l,
        ldc: n,
    }
}

/// One matrix as cuBLASLt's `cublasLtMatrixLayoutCreate(type, rows, cols, ld)` describes it: as
/// stored, column-major, before the call's transpose flag applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredLayout {
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
}

impl GemmCall {
    /// The stored layouts of `A`, `B` and `C`/`D` for cuBLASLt, which takes each matrix's stored
    /// shape where `gemm` takes `m, n, k`: `A` is `m×k` read as stored, `k×m` when transposed.
    /// A bias epilogue then adds `bias[i]` to every column of row `i` of the `m×n` result, which
    /// is the row-major product's column `i`: a Linear's output feature.
    pub fn lt_layouts(&self) -> [StoredLayout; 3] {
        let stored = |op: Op, rows: usize, cols: usize, ld: usize| match op {
            Op::N => StoredLayout { rows, cols, ld },
            Op::T => StoredLayout {
                rows: cols,
                cols: rows,
                ld,
            },
        };
        [
            stored(self.transa, self.m, self.k, self.lda),
            stored(self.transb, self.k, self.n, self.ldb),
            StoredLayout {
                rows: self.m,
                cols: self.n,
                ld: self.ldc,
            },
        ]
    }

    /// Whether every size fits BLAS's 32-bit `int` arguments.
    pub fn fits_i32(&self) -> bool {
        [self.m, self.n, self.k, self.lda, self.ldb, self.ldc]
            .iter()
            .all(|&v| i32::try_from(v).is_ok())
    }
}

/// Where the matrices of one operand of a per-head product lie in its buffer: matrix `(b, head)`
/// starts at element `offset + b·batch_stride + head·head_stride`, its stored rows `ld` apart,
/// read transposed when `trans`. One head of a `[B, T, heads·D]` tensor (or of q, k or v inside
/// one `[B, T, 3H]`) is `batch_stride = T·row`, `head_stride = D`, `ld = row`: no copy per head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadOperand {
    pub offset: usize,
    pub batch_stride: usize,
    pub head_stride: usize,
    pub ld: usize,
    pub trans: bool,
}

/// Which head of an operand query head `h` reads: its own, or (grouped-query attention, keys
/// and values) its key/value head `h / group`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadOf {
    Query,
    KeyValue,
}

/// One strided-batched `gemm` over the batch `b`: `C(b) = op(A(b)) · op(B(b))`, each matrix at
/// its offset plus `b` times its stride; `accumulate` adds to `C` (β = 1) instead of writing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchedCall {
    pub call: GemmCall,
    pub a_offset: usize,
    pub b_offset: usize,
    pub c_offset: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
    pub batch: usize,
    pub accumulate: bool,
}

/// The calls computing the row-major `C(b, h)[m, n] = op(L(b, h)) · op(R(b, h))` for every batch
/// `b < batch` and query head `h < heads`, one strided-batched call per query head (the batch
/// folds into one stride per head, `(b, head)` does not). An operand marked [`HeadOf::KeyValue`]
/// is read (or, for `C`, written) at key/value head `h / group`; when `C` is, the `group` query
/// heads sharing it add into it in head order, the first writing it (grouped-query attention's
/// key and value gradients: the sum over the group, with no copy per query head). `C` is never
/// transposed.
pub fn per_head_calls(
    (m, n, k): (usize, usize, usize),
    (batch, heads, group): (usize, usize, usize),
    l: (HeadOperand, HeadOf),
    r: (HeadOperand, HeadOf),
    c: (HeadOperand, HeadOf),
) -> Vec<BatchedCall> {
    assert!(!c.0.trans, "the product is written as stored");
    let at = |(o, of): (HeadOperand, HeadOf), h: usize| {
        let head = match of {
            HeadOf::Query => h,
            HeadOf::KeyValue => h / group,
        };
        o.offset + head * o.head_stride
    };
    (0..heads)
        .map(|h| {
            let mut call =
                row_major_gemm_strided(m, n, k, (l.0.trans, l.0.ld), (r.0.trans, r.0.ld));
            call.ldc = c.0.ld;
            BatchedCall {
                call,
                // BLAS's A is R's buffer, its B is L's (see [`row_major_gemm`]).
                a_offset: at(r, h),
                b_offset: at(l, h),
                c_offset: at(c, h),
                stride_a: r.0.batch_stride,
                stride_b: l.0.batch_stride,
                stride_c: c.0.batch_stride,
                batch,
                accumulate: c.1 == HeadOf::KeyValue && h % group != 0,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cuBLAS's `gemm` as its documentation defines it (column-major, `α = 1`, `β = 0`), with
    /// each operand indexed through its leading dimension.
    fn blas_gemm(call: &GemmCall, a: &[f64], b: &[f64]) -> Vec<f64> {
        let at = |i: usize, p: usize| match call.transa {
            Op::N => a[i + p * call.lda],
            Op::T => a[p + i * call.lda],
        };
        let bt = |p: usize, j: usize| match call.transb {
            Op::N => b[p + j * call.ldb],
            Op::T => b[j + p * call.ldb],
        };
        let mut c = vec![f64::NAN; call.ldc * call.n];
        for j in 0..call.n {
            for i in 0..call.m {
                c[i + j * call.ldc] = (0..call.k).map(|p| at(i, p) * bt(p, j)).sum();
            }
        }
        c
    }

    /// Row-major `op(L) · op(R)` with plain loops.
    fn row_major(
        l: &[f64],
        r: &[f64],
        (m, n, k): (usize, usize, usize),
        tl: bool,
        tr: bool,
    ) -> Vec<f64> {
        let lv = |i: usize, p: usize| if tl { l[p * m + i] } else { l[i * k + p] };
        let rv = |p: usize, j: usize| if tr { r[j * k + p] } else { r[p * n + j] };
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| lv(i, p) * rv(p, j)).sum();
            }
        }
        c
    }

    #[test]
    fn every_transpose_combination_gives_the_row_major_product() {
        // Distinct, non-square sizes, so a swapped dimension or leading dimension reads out of
        // place (or out of bounds) and the comparison fails.
        let (m, n, k) = (3, 5, 7);
        let l: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
        let r: Vec<f64> = (0..k * n).map(|i| (i as f64 * 0.91).cos()).collect();
        for tl in [false, true] {
            for tr in [false, true] {
                let call = row_major_gemm(m, n, k, tl, tr);
                // BLAS's A is R's buffer, its B is L's.
                let got = blas_gemm(&call, &r, &l);
                let want = row_major(&l, &r, (m, n, k), tl, tr);
                assert_eq!(got.len(), want.len());
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() < 1e-12, "tl={tl} tr={tr}: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn operands_inside_wider_buffers() {
        // L is the left 3×4 block of a 3×6 buffer (rows 6 apart), R the top 4×5 block of a
        // 4×9 buffer, each also tried stored transposed inside its wider buffer.
        let (m, n, k) = (3, 5, 4);
        let l: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
        let r: Vec<f64> = (0..k * n).map(|i| (i as f64 * 0.91).cos()).collect();
        let embed = |x: &[f64], rows: usize, cols: usize, ld: usize| {
            let mut out = vec![f64::NAN; rows * ld];
            for i in 0..rows {
                out[i * ld..i * ld + cols].copy_from_slice(&x[i * cols..(i + 1) * cols]);
            }
            out
        };
        let transpose = |x: &[f64], rows: usize, cols: usize| -> Vec<f64> {
            (0..cols * rows)
                .map(|j| x[(j % rows) * cols + j / rows])
                .collect()
        };
        let want = row_major(&l, &r, (m, n, k), false, false);
        for tl in [false, true] {
            for tr in [false, true] {
                let (lb, ld_l) = if tl {
                    (embed(&transpose(&l, m, k), k, m, m + 2), m + 2)
                } else {
                    (embed(&l, m, k, k + 2), k + 2)
                };
                let (rb, ld_r) = if tr {
                    (embed(&transpose(&r, k, n), n, k, k + 5), k + 5)
                } else {
                    (embed(&r, k, n, n + 4), n + 4)
                };
                let call = row_major_gemm_strided(m, n, k, (tl, ld_l), (tr, ld_r));
                let got = blas_gemm(&call, &rb, &lb);
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() < 1e-12, "tl={tl} tr={tr}: {g} vs {w}");
                }
            }
        }
    }

    /// cuBLASLt's matmul with the `BIAS` epilogue as its documentation defines it: each operand
    /// read through its stored layout (column-major `rows×cols`, columns `ld` apart; an index
    /// outside `rows×cols` panics, so a wrong layout fails here), then the call's transpose, then
    /// `bias[i]` added to row `i` of `D`.
    fn lt_gemm_bias(call: &GemmCall, a: &[f64], b: &[f64], bias: &[f64]) -> Vec<f64> {
        let [la, lb, lc] = call.lt_layouts();
        let read = |x: &[f64], l: StoredLayout, r: usize, c: usize| {
            assert!(
                r < l.rows && c < l.cols && l.ld >= l.rows,
                "{l:?} at ({r}, {c})"
            );
            x[r + c * l.ld]
        };
        let at = |i: usize, p: usize| match call.transa {
            Op::N => read(a, la, i, p),
            Op::T => read(a, la, p, i),
        };
        let bt = |p: usize, j: usize| match call.transb {
            Op::N => read(b, lb, p, j),
            Op::T => read(b, lb, j, p),
        };
        assert_eq!((lc.rows, lc.cols, bias.len()), (call.m, call.n, call.m));
        let mut d = vec![f64::NAN; lc.ld * lc.cols];
        for j in 0..lc.cols {
            for i in 0..lc.rows {
                d[i + j * lc.ld] = (0..call.k).map(|p| at(i, p) * bt(p, j)).sum::<f64>() + bias[i];
            }
        }
        d
    }

    #[test]
    fn cublaslt_layouts_and_bias_give_the_linear_forward() {
        // y[M,N] = x[M,K] · w[N,K]ᵀ + b[N], also with x read from inside a wider buffer.
        let (m, n, k) = (3, 5, 7);
        let w: Vec<f64> = (0..n * k).map(|i| (i as f64 * 0.91).cos()).collect();
        let b: Vec<f64> = (0..n).map(|i| i as f64 - 1.5).collect();
        for ld_x in [k, k + 3] {
            let x: Vec<f64> = (0..m * ld_x).map(|i| (i as f64 * 0.37).sin()).collect();
            let packed: Vec<f64> = (0..m * k).map(|i| x[(i / k) * ld_x + i % k]).collect();
            let call = row_major_gemm_strided(m, n, k, (false, ld_x), (true, k));
            let got = lt_gemm_bias(&call, &w, &x, &b);
            let want = row_major(&packed, &w, (m, n, k), false, true);
            for i in 0..m {
                for j in 0..n {
                    let (g, e) = (got[i * n + j], want[i * n + j] + b[j]);
                    assert!((g - e).abs() < 1e-12, "ld_x={ld_x} y[{i},{j}]: {g} vs {e}");
                }
            }
        }
        // Every transpose combination reads inside its stored layout.
        for tl in [false, true] {
            for tr in [false, true] {
                let call = row_major_gemm(m, n, k, tl, tr);
                let l: Vec<f64> = (0..m * k).map(|i| i as f64).collect();
                let r: Vec<f64> = (0..k * n).map(|i| i as f64).collect();
                let want = row_major(&l, &r, (m, n, k), tl, tr);
                let got = lt_gemm_bias(&call, &r, &l, &vec![0.0; n]);
                assert_eq!(got, want, "tl={tl} tr={tr}");
            }
        }
    }

    /// One strided-batched call as cuBLAS defines it, on whole buffers: each matrix read at its
    /// offset plus `b` times its stride, `C` written (or added to) in place.
    fn blas_batched(x: &BatchedCall, a: &[f64], b: &[f64], c: &mut [f64]) {
        let call = &x.call;
        for bi in 0..x.batch {
            let (ao, bo, co) = (
                x.a_offset + bi * x.stride_a,
                x.b_offset + bi * x.stride_b,
                x.c_offset + bi * x.stride_c,
            );
            for j in 0..call.n {
                for i in 0..call.m {
                    let s: f64 = (0..call.k)
                        .map(|p| {
                            let av = match call.transa {
                                Op::N => a[ao + i + p * call.lda],
                                Op::T => a[ao + p + i * call.lda],
                            };
                            let bv = match call.transb {
                                Op::N => b[bo + p + j * call.ldb],
                                Op::T => b[bo + j + p * call.ldb],
                            };
                            av * bv
                        })
                        .sum();
                    let at = co + i + j * call.ldc;
                    c[at] = if x.accumulate { c[at] + s } else { s };
                }
            }
        }
    }

    #[test]
    fn per_head_products_read_and_write_heads_in_place() {
        // Attention's products on q, k and v side by side in one [B, T, 3H] buffer (keys and
        // values of `kv` heads, grouped-query when kv < heads): the scores q·kᵀ into
        // [B, heads, T, T], the output p·v into [B, T, H], and dk = Σ_group dsᵀ·q into a
        // [B, T, 3H] gradient buffer, against plain loops per (b, head).
        let (b, t, d) = (2, 5, 3);
        for (heads, kv) in [(4, 4), (4, 2), (3, 1)] {
            let group = heads / kv;
            let h = heads * d;
            let row = h + 2 * kv * d; // q, k, v of one token side by side
            let qkv: Vec<f64> = (0..b * t * row).map(|i| (i as f64 * 0.73).sin()).collect();
            let q = |bi: usize, hd: usize, i: usize, c: usize| qkv[(bi * t + i) * row + hd * d + c];
            let k =
                |bi: usize, g: usize, j: usize, c: usize| qkv[(bi * t + j) * row + h + g * d + c];
            let v = |bi: usize, g: usize, j: usize, c: usize| {
                qkv[(bi * t + j) * row + h + kv * d + g * d + c]
            };
            let head = |offset, ld, trans| HeadOperand {
                offset,
                batch_stride: t * row,
                head_stride: d,
                ld,
                trans,
            };
            let square = HeadOperand {
                offset: 0,
                batch_stride: heads * t * t,
                head_stride: t * t,
                ld: t,
                trans: false,
            };
            // Scores.
            let mut s = vec![f64::NAN; b * heads * t * t];
            for x in per_head_calls(
                (t, t, d),
                (b, heads, group),
                (head(0, row, false), HeadOf::Query),
                (head(h, row, true), HeadOf::KeyValue),
                (square, HeadOf::Query),
            ) {
                blas_batched(&x, &qkv, &qkv, &mut s);
            }
            for (bi, hd, i, j) in grid4(b, heads, t, t) {
                let want: f64 = (0..d)
                    .map(|c| q(bi, hd, i, c) * k(bi, hd / group, j, c))
                    .sum();
                let got = s[((bi * heads + hd) * t + i) * t + j];
                assert!(
                    (got - want).abs() < 1e-12,
                    "scores {heads}/{kv}: {got} vs {want}"
                );
            }
            // The output p·v, written into [B, T, H] (rows H apart).
            let p: Vec<f64> = (0..b * heads * t * t)
                .map(|i| (i as f64 * 0.31).cos())
                .collect();
            let mut out = vec![f64::NAN; b * t * h];
            let into = HeadOperand {
                offset: 0,
                batch_stride: t * h,
                head_stride: d,
                ld: h,
                trans: false,
            };
            for x in per_head_calls(
                (t, d, t),
                (b, heads, group),
                (square, HeadOf::Query),
                (head(h + kv * d, row, false), HeadOf::KeyValue),
                (into, HeadOf::Query),
            ) {
                blas_batched(&x, &qkv, &p, &mut out);
            }
            for (bi, hd, i, c) in grid4(b, heads, t, d) {
                let want: f64 = (0..t)
                    .map(|j| p[((bi * heads + hd) * t + i) * t + j] * v(bi, hd / group, j, c))
                    .sum();
                let got = out[(bi * t + i) * h + hd * d + c];
                assert!(
                    (got - want).abs() < 1e-12,
                    "output {heads}/{kv}: {got} vs {want}"
                );
            }
            // dk(b, g) = Σ_{h in g's group} ds(b, h)ᵀ · q(b, h), into the gradient's k columns.
            let ds = &p;
            let mut grad = vec![f64::NAN; b * t * row];
            for x in per_head_calls(
                (t, d, t),
                (b, heads, group),
                (
                    HeadOperand {
                        trans: true,
                        ..square
                    },
                    HeadOf::Query,
                ),
                (head(0, row, false), HeadOf::Query),
                (head(h, row, false), HeadOf::KeyValue),
            ) {
                blas_batched(&x, &qkv, ds, &mut grad);
            }
            for (bi, g, j, c) in grid4(b, kv, t, d) {
                let want: f64 = (g * group..(g + 1) * group)
                    .flat_map(|hd| (0..t).map(move |i| (hd, i)))
                    .map(|(hd, i)| ds[((bi * heads + hd) * t + i) * t + j] * q(bi, hd, i, c))
                    .sum();
                let got = grad[(bi * t + j) * row + h + g * d + c];
                assert!(
                    (got - want).abs() < 1e-12,
                    "dk {heads}/{kv}: {got} vs {want}"
                );
            }
            // Nothing outside the k columns was written.
            for (i, x) in grad.iter().enumerate() {
                let col = i % row;
                assert_eq!(x.is_nan(), !(h..h + kv * d).contains(&col), "element {i}");
            }
        }
    }

    /// Every `(a, b, c, d)` below the four bounds, in order.
    fn grid4(a: usize, b: usize, c: usize, d: usize) -> Vec<(usize, usize, usize, usize)> {
        let mut v = Vec::new();
        for i in 0..a {
            for j in 0..b {
                for k in 0..c {
                    for l in 0..d {
                        v.push((i, j, k, l));
                    }
                }
            }
        }
        v
    }

    #[test]
    fn linear_forward_and_backward_calls() {
        // y[M,N] = x[M,K] · w[N,K]ᵀ: cuBLAS reads w transposed, x as stored.
        let c = row_major_gemm(16, 384, 1536, false, true);
        assert_eq!(
            (c.transa, c.transb, c.m, c.n, c.k),
            (Op::T, Op::N, 384, 16, 1536)
        );
        assert_eq!((c.lda, c.ldb, c.ldc), (1536, 1536, 384));
        // dw[N,K] = dy[M,N]ᵀ · x[M,K].
        let c = row_major_gemm(384, 1536, 16, true, false);
        assert_eq!(
            (c.transa, c.transb, c.m, c.n, c.k),
            (Op::N, Op::T, 1536, 384, 16)
        );
        assert_eq!((c.lda, c.ldb, c.ldc), (1536, 384, 1536));
        assert!(c.fits_i32());
        assert!(!row_major_gemm(1 << 31, 1, 1, false, false).fits_i32());
    }
}
