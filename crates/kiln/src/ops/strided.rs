//! A matrix operand read in place through its strides: the one way every CPU product (f32,
//! bf16, AMX, the narrow kernel, the per-head `gemm` calls) is handed A, B and sometimes C.

/// Element `(i, j)` of a matrix at `i·rs + j·cs` of `data`. A transposed operand is the same
/// values with the strides swapped, so no product copies a matrix to transpose it (a Linear's
/// backward reads `w` and `x` transposed; attention reads `Kᵀ` from K's rows).
///
/// `D` is what holds the values: a slice (`&[f32]`, bf16 bits as `&[u16]`, f32 or bf16
/// [`super::bf16::Values`]), or a raw pointer where a task writes its own part of a shared buffer.
#[derive(Debug, Clone, Copy)]
pub struct Strided<D> {
    pub data: D,
    /// Elements from one row to the next.
    pub rs: usize,
    /// Elements from one column to the next.
    pub cs: usize,
}

impl<D> Strided<D> {
    /// `data` read with `(row stride, column stride)`.
    pub fn new(data: D, (rs, cs): (usize, usize)) -> Self {
        Self { data, rs, cs }
    }

    /// `(row stride, column stride)`.
    pub fn strides(&self) -> (usize, usize) {
        (self.rs, self.cs)
    }

    /// The same values read as the transposed matrix.
    pub fn t(self) -> Self {
        Self {
            data: self.data,
            rs: self.cs,
            cs: self.rs,
        }
    }

    /// The same strides over other storage (a rounded or packed copy, a value wrapper).
    pub fn map<E>(self, f: impl FnOnce(D) -> E) -> Strided<E> {
        Strided {
            data: f(self.data),
            rs: self.rs,
            cs: self.cs,
        }
    }

    /// Whether a buffer of `len` elements holds every element of a `rows × cols` matrix read with
    /// these strides (a matrix with no elements needs none).
    pub fn fits(&self, len: usize, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || len > (rows - 1) * self.rs + (cols - 1) * self.cs
    }
}

impl<'a, T> Strided<&'a [T]> {
    /// Row-major `data` with `cols` columns.
    pub fn rows(data: &'a [T], cols: usize) -> Self {
        Self {
            data,
            rs: cols,
            cs: 1,
        }
    }

    /// Whether `data` holds every element of a `rows × cols` matrix.
    pub fn covers(&self, rows: usize, cols: usize) -> bool {
        self.fits(self.data.len(), rows, cols)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposing_swaps_the_strides_and_bounds_follow() {
        // A 2×3 row-major matrix; its transpose is 3×2 over the same six values.
        let v = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let a = Strided::rows(&v[..], 3);
        assert!(a.covers(2, 3) && !a.covers(3, 3));
        let at = a.t();
        assert_eq!(at.strides(), (1, 3));
        assert_eq!(at.data[2 * at.rs + at.cs], 6.0); // (2, 1) of Aᵀ is (1, 2) of A
        assert!(at.covers(3, 2) && !at.covers(3, 3));
        assert!(a.covers(0, 9), "no elements, nothing to hold");
    }
}
