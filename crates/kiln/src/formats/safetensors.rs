//! safetensors files: host tensors read (f32, bf16 and f16 widened to f32) and written, by
//! Hugging Face parameter name. Every tensor is stored in PyTorch's own layout, so loading and
//! saving never transpose. Walking a model's parameters is [`crate::models::params`].

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::{KilnError, Result};

/// Which parameters (by Hugging Face path) a process builds, reads and trains: a pipeline
/// stage's own ([`keep_all`] without a pipeline).
pub type Keep<'a> = &'a (dyn Fn(&str) -> bool + Sync);

/// Every parameter: the [`Keep`] of a process that holds the whole model.
pub fn keep_all(_: &str) -> bool {
    true
}

/// A named, shaped f32 tensor on the host.
#[derive(Debug, Clone)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Integer and boolean tensors are buffers (`embeddings.position_ids`), never parameters.
fn is_buffer_dtype(d: Dtype) -> bool {
    matches!(
        d,
        Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::I16
            | Dtype::U16
            | Dtype::I32
            | Dtype::U32
            | Dtype::I64
            | Dtype::U64
    )
}

/// Reads every tensor of a safetensors file as f32 (f32, f16, bf16 and f64 are converted; integer
/// buffers such as `embeddings.position_ids` are skipped: they are not parameters). A float type
/// kiln cannot read (FP8, ...) is an error, never a silently re-initialised weight.
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, HostTensor>> {
    read_safetensors_with(path, &keep_all, &mut |_, t| t)
}

/// [`read_safetensors`] of the tensors `wanted` names only, each handed to `keep` as soon as it is
/// converted (to cut it to a tensor-parallel shard before the next is made: the whole model is
/// never held as f32). The file is mapped, not read: only the wanted tensors' bytes are ever
/// brought into memory (a pipeline stage reads its own layers of a whole model's file).
pub fn read_safetensors_with(
    path: &Path,
    wanted: Keep,
    keep: &mut dyn FnMut(&str, HostTensor) -> HostTensor,
) -> Result<BTreeMap<String, HostTensor>> {
    let bytes = map_regular(path)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        KilnError::Weights(format!("{}: not a safetensors file: {e}", path.display()))
    })?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors().into_iter().filter(|(n, _)| wanted(n)) {
        let raw = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => raw
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => raw
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F64 => raw
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
                .collect(),
            d if is_buffer_dtype(d) => continue,
            d => {
                return Err(KilnError::Weights(format!(
                "{}: tensor {name} is stored as {d:?}; kiln reads F32, F16, BF16 and F64 weights",
                path.display()
            )))
            }
        };
        let t = HostTensor {
            shape: view.shape().to_vec(),
            data,
        };
        out.insert(name.clone(), keep(&name, t));
        let at = raw.as_ptr() as usize - bytes.as_ptr() as usize;
        release_pages(&bytes, at..at + raw.len());
    }
    Ok(out)
}

/// Lets the kernel drop the mapped pages wholly inside `range` of `map` (a tensor already
/// converted), so a file's pages do not pile up in the process's memory as it is read: at most
/// one tensor's bytes are resident at a time.
fn release_pages(map: &memmap2::Mmap, range: std::ops::Range<usize>) {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let start = range.start.div_ceil(page) * page;
    let end = range.end / page * page;
    if end > start {
        // SAFETY: the mapping is a read-only view of a file: dropped pages are read again from
        // the file if touched, with the same bytes, so no reference into them changes. A
        // failure only leaves the pages resident.
        let _ = unsafe {
            map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
        };
    }
}

/// The bytes of the regular file `path`, mapped read-only. kiln replaces the files it writes
/// (a new file renamed over the old), so a mapping never sees a file shrink under it.
fn map_regular(path: &Path) -> Result<memmap2::Mmap> {
    crate::io::files::ensure_regular(path, "safetensors file")?;
    let file = std::fs::File::open(path).map_err(|e| KilnError::io(path, e))?;
    // SAFETY: the mapping is read-only and lives no longer than this read; a file truncated by
    // another program while it is read is outside what any weights reader can guard against
    // (safetensors' own Python loader maps files the same way).
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| KilnError::io(path, e))
}

/// For an error about `missing` parameters: those the file does hold, under a dtype that is not a
/// float (`" (stored as I64: a, b)"`), or an empty string.
pub fn stored_as_other_dtype(path: &Path, missing: &[&String]) -> String {
    let Ok(bytes) = crate::io::files::read_regular(path, "safetensors file") else {
        return String::new();
    };
    let Ok((_, meta)) = SafeTensors::read_metadata(&bytes) else {
        return String::new();
    };
    let found: Vec<String> = missing
        .iter()
        .filter_map(|m| {
            let info = meta.info(m)?;
            Some(format!("{m} as {:?}", info.dtype))
        })
        .collect();
    if found.is_empty() {
        String::new()
    } else {
        format!(" (stored with a non-float dtype: {})", found.join(", "))
    }
}

/// How tensors are stored in a written safetensors file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreDtype {
    F32,
    /// Rounded to nearest even, as PyTorch's `.to(torch.bfloat16)`.
    BF16,
}

/// Writes named f32 tensors as safetensors (metadata `format: pt`, which transformers requires),
/// atomically: a temporary file in the same folder, then a rename.
pub fn write_safetensors(path: &Path, tensors: &BTreeMap<String, HostTensor>) -> Result<()> {
    write_safetensors_as(path, tensors, StoreDtype::F32)
}

/// [`write_safetensors`] storing every tensor as `dtype`.
pub fn write_safetensors_as(
    path: &Path,
    tensors: &BTreeMap<String, HostTensor>,
    dtype: StoreDtype,
) -> Result<()> {
    crate::io::atomic_write(path, &safetensors_bytes(tensors, dtype)?)
}

/// The bytes of a safetensors file holding `tensors` as `dtype` (metadata `format: pt`).
pub fn safetensors_bytes(
    tensors: &BTreeMap<String, HostTensor>,
    dtype: StoreDtype,
) -> Result<Vec<u8>> {
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(k, t)| {
            let b = match dtype {
                StoreDtype::F32 => t.data.iter().flat_map(|x| x.to_le_bytes()).collect(),
                StoreDtype::BF16 => t
                    .data
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect(),
            };
            (k.clone(), b, t.shape.clone())
        })
        .collect();
    let st_dtype = match dtype {
        StoreDtype::F32 => Dtype::F32,
        StoreDtype::BF16 => Dtype::BF16,
    };
    let views = bytes
        .iter()
        .map(|(k, b, s)| {
            safetensors::tensor::TensorView::new(st_dtype, s.clone(), b)
                .map(|v| (k.clone(), v))
                .map_err(|e| KilnError::Weights(format!("tensor {k}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(meta)).map_err(|e| KilnError::Weights(e.to_string()))
}
