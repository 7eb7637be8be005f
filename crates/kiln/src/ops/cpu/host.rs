//! The CPU backend's tensors as host memory: contiguous f32 arrays in and out of Burn's ndarray
//! tensors, slices shared between threads, seeded uniform values and dropout masks, column sums
//! and bf16 bits.

use burn::tensor::TensorMetadata;
use ndarray::{ArcArray, IxDyn};
use rayon::prelude::*;

use super::*;

/// The tensor as a contiguous row-major f32 array (a copy only if it is a strided view).
pub(crate) fn dense(t: NdArrayTensor) -> ArcArray<f32, IxDyn> {
    match t {
        NdArrayTensor::F32(s) => {
            let a = s.into_shared();
            if a.is_standard_layout() {
                a
            } else {
                a.as_standard_layout().into_owned().into_shared()
            }
        }
        other => panic!("kiln CPU kernels take f32 tensors, got {:?}", other.dtype()),
    }
}

/// `len` floats for a kernel that writes every one of them before anything reads them: a GEMM
/// with β = 0 (its C), whose output would otherwise be zero-filled first, a whole extra pass of
/// writes over memory (for MiniLM's inference step, 340 MB of products' outputs). Debug builds
/// (the test suite) fill the buffer with NaN, so a kernel that reads an element it has not
/// written spoils its result where the tests compare it with their references.
///
/// # Safety
/// Every element must be written before any is read; until then the contents are unspecified.
pub(crate) unsafe fn unfilled(len: usize) -> Vec<f32> {
    if cfg!(debug_assertions) {
        return vec![f32::NAN; len];
    }
    let mut v = std::mem::ManuallyDrop::new(Vec::<std::mem::MaybeUninit<f32>>::with_capacity(len));
    // SAFETY: the buffer has room for `len` f32s (same size and alignment as their `MaybeUninit`),
    // and the caller promises each is written before it is read.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<f32>(), len, v.capacity()) }
}

/// The elements of `a` (standard layout) as a vector to overwrite with a result of the same shape:
/// `a`'s own buffer when nothing else holds it — the gradient a backward kernel receives usually
/// is not kept anywhere else — and a copy otherwise. Saves an allocation and a pass over memory.
pub(crate) fn into_vec(a: ArcArray<f32, IxDyn>) -> Vec<f32> {
    let n = a.len();
    let (v, offset) = a.into_owned().into_raw_vec_and_offset();
    match offset {
        Some(0) if v.len() == n => v,
        Some(o) => v[o..o + n].to_vec(),
        None => Vec::new(), // no elements
    }
}

pub(crate) fn tensor(shape: &[usize], v: Vec<f32>) -> NdArrayTensor {
    NdArrayTensor::from(ArcArray::from_shape_vec(IxDyn(shape), v).expect("shape matches data"))
}

pub(crate) fn slice(a: &ArcArray<f32, IxDyn>) -> &[f32] {
    a.as_slice().expect("standard layout")
}

/// A counter-based hash (SplitMix64 finaliser) → uniform in [0, 1).
#[inline(always)]
pub(crate) fn uniform(seed: u64, i: u64) -> f32 {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// The values of a flat dropout mask of `n` elements: `1/keep` where the counter hash of the
/// element's index is below `keep`, else 0. Every backend's mask is these values, so a run drops
/// the same units on the CPU and on a GPU.
pub(crate) fn dropout_mask_values(n: usize, keep: f64, seed: u64) -> Vec<f32> {
    let (keep, value) = (keep as f32, (1.0 / keep) as f32);
    let mut m = vec![1f32; n];
    m.par_chunks_mut(16_384).enumerate().for_each(|(c, chunk)| {
        simd(
            #[inline(always)]
            || scale_by_dropout(chunk, (c * 16_384) as u64, seed, (keep, value)),
        )
    });
    m
}

/// `values[j] ×= value` (1/keep, as the caller rounds it) where element `first + j` of the dropout
/// mask of `seed` and `keep` is kept, else 0:
/// the mask of [`dropout_mask_values`], applied in place. Branch-free, and every operand a value
/// the loop holds in a register, so it vectorises inside [`simd`]: read through a closure's
/// captured references, the attention's copy of this loop reloaded `keep` per element, took a
/// branch per element (a misprediction per ten kept), and ran scalar, 10 % of a MiniLM training
/// step on an AVX2 Zen 4.
#[inline(always)]
pub(crate) fn scale_by_dropout(
    values: &mut [f32],
    first: u64,
    seed: u64,
    (keep, value): (f32, f32),
) {
    for (j, v) in values.iter_mut().enumerate() {
        let kept = uniform(seed, first + j as u64) < keep;
        *v *= if kept { value } else { 0.0 };
    }
}

/// A pointer that rayon tasks may share because each writes a disjoint region (see call sites).
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(pub(crate) *mut f32);

impl SharedMut {
    /// A method (not `.0`) so closures capture the `Sync` wrapper rather than the raw field.
    pub(crate) fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: callers stay inside the buffer (see each call site).
        unsafe { self.0.add(offset) }
    }
}

/// The sums of the columns of `dys [m, n]` (a bias's gradient).
pub(crate) fn column_sums(dys: &[f32], n: usize) -> NdArrayTensor {
    // Per-chunk partial sums added in chunk order: the chunks follow the shape only, so
    // the bits do not depend on the thread count or on which thread stole what (rayon's
    // `reduce` pairs partial sums in whatever tree the stealing made).
    let chunk = rows_per_task(n) * n;
    let partials: Vec<Vec<f32>> = dys
        .par_chunks(chunk)
        .map(|rows| {
            let mut acc = vec![0f32; n];
            for row in rows.chunks(n) {
                acc.iter_mut().zip(row).for_each(|(a, v)| *a += v);
            }
            acc
        })
        .collect();
    let mut sum = vec![0f32; n];
    for part in &partials {
        sum.iter_mut().zip(part).for_each(|(x, y)| *x += y);
    }
    tensor(&[n], sum)
}

/// The bf16 bits of a weight held by `--base-dtype bf16` ([`KilnBackend::kiln_bf16_store`]);
/// `None` for an f32 tensor.
pub(crate) fn bf16_bits(t: &NdArrayTensor) -> Option<ArcArray<u16, IxDyn>> {
    match t {
        NdArrayTensor::U16(s) => Some(s.clone().into_shared()),
        _ => None,
    }
}

pub(crate) fn bits(a: &ArcArray<u16, IxDyn>) -> &[u16] {
    a.as_slice().expect("a bf16 weight is stored contiguous")
}
