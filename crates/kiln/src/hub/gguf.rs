//! GGUF files (llama.cpp's single-file model format): the header, typed metadata, tensor directory,
//! and the tensors themselves dequantised to f32 in PyTorch's layout.
//!
//! The format (spec: ggml's `docs/gguf.md`) is little-endian: magic `GGUF`, version, tensor count,
//! metadata count, the metadata key/values, one directory entry per tensor (name, dims innermost
//! first, ggml type, offset), then the aligned data section. A tensor whose dims are `[ne0, ne1]` is
//! the row-major PyTorch tensor `[ne1, ne0]`, so reversing the dims is the only layout change.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};

use crate::error::{KilnError, Result};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// ggml tensor types kiln can dequantise (the ids are ggml's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q6K,
    BF16,
}

impl GgmlType {
    fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            14 => Self::Q6K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// (values per block, bytes per block).
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q8_0 => (32, 34),
            Self::Q4K => (256, 144),
            Self::Q6K => (256, 210),
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// PyTorch order (outermost first): the file's dims reversed.
    pub shape: Vec<usize>,
    pub ty: GgmlType,
    /// Offset from the start of the data section.
    pub offset: usize,
}

impl TensorInfo {
    pub fn num_elements(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn num_bytes(&self) -> usize {
        let (per, bytes) = self.ty.block();
        self.num_elements() / per * bytes
    }
}

/// A GGUF file read into memory.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    bytes: Vec<u8>,
    data_start: usize,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl Cursor<'_> {
    fn err(&self, what: &str) -> KilnError {
        KilnError::Weights(format!(
            "{}: byte {}: {what}",
            self.path.display(),
            self.pos
        ))
    }
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| self.err("file ends early (truncated GGUF?)"))?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn len(&mut self) -> Result<usize> {
        let n = self.u64()?;
        // Any count larger than the file itself is corruption, not a reason to allocate.
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.bytes.len())
            .ok_or_else(|| self.err(&format!("implausible length {n}")))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.len()?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err("string is not UTF-8"))
    }
    fn value(&mut self, ty: u32) -> Result<Value> {
        Ok(match ty {
            0 => Value::U64(self.u8()? as u64),
            1 => Value::I64(self.u8()? as i8 as i64),
            2 => Value::U64(u16::from_le_bytes(self.take(2)?.try_into().expect("2")) as u64),
            3 => Value::I64(i16::from_le_bytes(self.take(2)?.try_into().expect("2")) as i64),
            4 => Value::U64(self.u32()? as u64),
            5 => Value::I64(self.u32()? as i32 as i64),
            6 => Value::F64(f32::from_bits(self.u32()?) as f64),
            7 => Value::Bool(self.u8()? != 0),
            8 => Value::Str(self.string()?),
            9 => {
                let inner = self.u32()?;
                let n = self.len()?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(inner)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            t => return Err(self.err(&format!("unknown metadata value type {t}"))),
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| KilnError::io(path, e))?;
        Self::parse(path, bytes)
    }

    pub fn parse(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        let mut c = Cursor {
            bytes: &bytes,
            pos: 0,
            path,
        };
        if c.take(4)? != b"GGUF" {
            return Err(KilnError::Weights(format!(
                "{}: not a GGUF file (no GGUF magic)",
                path.display()
            )));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(c.err(&format!("GGUF version {version} (kiln reads 2 and 3)")));
        }
        let n_tensors = c.len()?;
        let n_kv = c.len()?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let value = c.value(ty)?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()? as usize;
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.len()?);
            }
            dims.reverse();
            let id = c.u32()?;
            let ty = GgmlType::from_id(id).ok_or_else(|| {
                c.err(&format!(
                    "tensor {name}: ggml type {id} is not one kiln dequantises \
                     (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)"
                ))
            })?;
            let offset = c.len()?;
            let info = TensorInfo {
                name,
                shape: dims,
                ty,
                offset,
            };
            if !info.num_elements().is_multiple_of(ty.block().0) {
                return Err(c.err(&format!(
                    "tensor {}: {} values is not a whole number of {:?} blocks",
                    info.name,
                    info.num_elements(),
                    ty
                )));
            }
            tensors.push(info);
        }
        let align = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(32) as usize;
        let data_start = c.pos.div_ceil(align) * align;
        for t in &tensors {
            if data_start + t.offset + t.num_bytes() > bytes.len() {
                return Err(KilnError::Weights(format!(
                    "{}: tensor {} runs past the end of the file (truncated download?)",
                    path.display(),
                    t.name
                )));
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            bytes,
            data_start,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required metadata value, with an error naming the file and key.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| {
            KilnError::Weights(format!(
                "{}: metadata key {key} is missing",
                self.path.display()
            ))
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw (still quantised) bytes of a tensor.
    pub fn raw(&self, t: &TensorInfo) -> &[u8] {
        let start = self.data_start + t.offset;
        &self.bytes[start..start + t.num_bytes()]
    }

    /// A tensor dequantised to f32, row-major in its PyTorch shape.
    pub fn dequantize(&self, t: &TensorInfo) -> Vec<f32> {
        dequantize(t.ty, self.raw(t), t.num_elements())
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantises `n` values of type `ty` from `raw` (the block layouts of ggml's `ggml-quants.c`).
pub fn dequantize(ty: GgmlType, raw: &[u8], n: usize) -> Vec<f32> {
    let (per, bytes) = ty.block();
    assert_eq!(
        raw.len(),
        n / per * bytes,
        "raw size does not match {n} {ty:?} values"
    );
    let mut out = vec![0f32; n];
    match ty {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(raw.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(raw.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, b) in out.iter_mut().zip(raw.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        _ => {
            for (o, b) in out.chunks_exact_mut(per).zip(raw.chunks_exact(bytes)) {
                match ty {
                    GgmlType::Q4_0 => q4_0(b, o),
                    GgmlType::Q4_1 => q4_1(b, o),
                    GgmlType::Q8_0 => q8_0(b, o),
                    GgmlType::Q4K => q4_k(b, o),
                    GgmlType::Q6K => q6_k(b, o),
                    _ => unreachable!(),
                }
            }
        }
    }
    out
}

/// 32 values: f16 scale `d`, then 16 bytes of 4-bit codes (low nibbles are values 0..16, high
/// nibbles 16..32), each `d · (q − 8)`.
fn q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        out[j] = d * ((q & 0xF) as f32 - 8.0);
        out[j + 16] = d * ((q >> 4) as f32 - 8.0);
    }
}

/// Like Q4_0 with an offset instead of the −8: f16 `d`, f16 `m`, codes; `d · q + m`.
fn q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, &q) in b[4..20].iter().enumerate() {
        out[j] = d * (q & 0xF) as f32 + m;
        out[j + 16] = d * (q >> 4) as f32 + m;
    }
}

/// 32 values: f16 `d`, then 32 signed bytes; `d · q`.
fn q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = d * (q as i8) as f32;
    }
}

/// Scale and min of sub-block `j` (0..8) of a Q4_K super-block: 6 bits each, packed into 12 bytes.
fn scale_min_k4(j: usize, s: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((s[j] & 63) as f32, (s[j + 4] & 63) as f32)
    } else {
        let sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        let m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        (sc as f32, m as f32)
    }
}

/// 256 values in 8 sub-blocks of 32: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales/mins, 128 bytes
/// of 4-bit codes; value = `d·sc · q − dmin·m`. Each 32 code bytes hold two sub-blocks (low
/// nibbles, then high nibbles).
fn q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for chunk in 0..4 {
        let q = &qs[chunk * 32..chunk * 32 + 32];
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let o = &mut out[chunk * 64..chunk * 64 + 64];
        for l in 0..32 {
            o[l] = d * sc1 * (q[l] & 0xF) as f32 - dmin * m1;
            o[l + 32] = d * sc2 * (q[l] >> 4) as f32 - dmin * m2;
        }
    }
}

/// 256 values: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 signed 8-bit scales, f16 `d`;
/// value = `d · scale · (q − 32)` with 6-bit `q`. Two halves of 128 values each.
fn q6_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[half * 64..half * 64 + 64];
        let qh = &b[128 + half * 32..128 + half * 32 + 32];
        let sc = &b[192 + half * 8..192 + half * 8 + 8];
        let o = &mut out[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |i: usize| d * (sc[i] as i8) as f32;
            o[l] = s(is) * q1 as f32;
            o[l + 32] = s(is + 2) * q2 as f32;
            o[l + 64] = s(is + 4) * q3 as f32;
            o[l + 96] = s(is + 6) * q4 as f32;
        }
    }
}

/// Undoes the row permutation llama.cpp's converter applies to `q_proj`/`k_proj` weights (it
/// interleaves the two rotary halves of every head for its own RoPE kernel). `w` is `[rows, cols]`
/// with `rows = heads · head_dim`; within each head, row `2i + p` of the file is row `p·half + i` of
/// the Hugging Face weight.
pub fn unpermute_qk(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    assert_eq!(w.len(), rows * cols);
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for i in 0..half {
            for p in 0..2 {
                let src = h * head_dim + 2 * i + p;
                let dst = h * head_dim + p * half + i;
                out[dst * cols..dst * cols + cols]
                    .copy_from_slice(&w[src * cols..src * cols + cols]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-built blocks whose values follow from the format by arithmetic.
    #[test]
    fn known_blocks() {
        // Q8_0: d = 0.5, codes -3..29 → -1.5..14.5.
        let mut b = f16::from_f32(0.5).to_le_bytes().to_vec();
        b.extend((0..32).map(|i| (i as i8 - 3) as u8));
        let v = dequantize(GgmlType::Q8_0, &b, 32);
        assert_eq!(v[0], -1.5);
        assert_eq!(v[31], 14.0);
        // Q4_1: d = 2, m = -1; byte j = (hi << 4) | lo with lo = j, hi = 15 - j.
        let mut b = f16::from_f32(2.0).to_le_bytes().to_vec();
        b.extend(f16::from_f32(-1.0).to_le_bytes());
        b.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
        let v = dequantize(GgmlType::Q4_1, &b, 32);
        assert_eq!(v[3], 2.0 * 3.0 - 1.0);
        assert_eq!(v[16 + 3], 2.0 * 12.0 - 1.0);
        // Q4_0: same codes, centred at 8.
        let mut b = f16::from_f32(2.0).to_le_bytes().to_vec();
        b.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
        let v = dequantize(GgmlType::Q4_0, &b, 32);
        assert_eq!(v[0], -16.0);
        assert_eq!(v[16], 14.0);
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // llama.cpp: reshape(heads, 2, half, cols).swapaxes(1, 2) — row h·hd + 2i + p ← p·half + i.
        let (heads, head_dim, cols) = (3, 8, 2);
        let rows = heads * head_dim;
        let hf: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
        let mut file = vec![0f32; hf.len()];
        for h in 0..heads {
            for i in 0..head_dim / 2 {
                for p in 0..2 {
                    let src = h * head_dim + p * head_dim / 2 + i;
                    let dst = h * head_dim + 2 * i + p;
                    file[dst * cols..dst * cols + cols]
                        .copy_from_slice(&hf[src * cols..src * cols + cols]);
                }
            }
        }
        assert_ne!(file, hf);
        assert_eq!(unpermute_qk(&file, rows, cols, heads), hf);
    }

    #[test]
    fn rejects_truncated_and_foreign_files() {
        let e = GgufFile::parse(Path::new("x.gguf"), b"GGML\0\0".to_vec())
            .err()
            .unwrap();
        assert!(e.to_string().contains("x.gguf: not a GGUF file"), "{e}");
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        let e = GgufFile::parse(Path::new("x.gguf"), b).err().unwrap();
        assert!(e.to_string().contains("ends early"), "{e}");
    }
}
