//! GGUF files (llama.cpp's single-file model format): the header, typed metadata, tensor directory,
//! and the tensors themselves dequantised to f32 in PyTorch's layout.
//!
//! The format (spec: ggml's `docs/gguf.md`) is little-endian: magic `GGUF`, version, tensor count,
//! metadata count, the metadata key/values, one directory entry per tensor (name, dims innermost
//! first, ggml type, offset), then the aligned data section. A tensor whose dims are `[ne0, ne1]` is
//! the row-major PyTorch tensor `[ne1, ne0]`, so reversing the dims is the only layout change.
//!
//! The reader trusts nothing in the file: every count, length, dimension and offset is checked
//! against the bytes that remain before anything is read or allocated, so any byte sequence gives
//! either a [`GgufFile`] or a [`KilnError::Weights`] naming the file and the byte offset, key or
//! tensor at fault. Metadata arrays stay in the file bytes ([`Array`]) until asked for, so reading
//! a file needs little more memory than the file itself.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use half::{bf16, f16};

use crate::error::{KilnError, Result};

/// Deepest nesting of metadata arrays accepted. Real files nest one level (arrays of numbers or
/// strings); the bound keeps a forged 200k-deep nesting from recursing through the stack.
pub const MAX_ARRAY_DEPTH: usize = 8;
/// The most tensors, and the most metadata keys, accepted. Real files hold at most a few thousand
/// tensors and a few dozen keys; the cap keeps the parsed directory (a few hundred bytes an entry,
/// against 24 bytes of file) small whatever a forged count says.
pub const MAX_ENTRIES: usize = 1 << 16;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// The longest tensor name (the spec's limit; llama.cpp's GGML_MAX_NAME) and metadata key (the
/// spec's 2^16 − 1) accepted.
const MAX_NAME: usize = 64;
const MAX_KEY: usize = (1 << 16) - 1;
/// The data section's alignment when `general.alignment` is absent (the spec's default).
const DEFAULT_ALIGNMENT: usize = 32;
/// Metadata value type ids of the spec that need special handling.
const TYPE_STRING: u32 = 8;
const TYPE_ARRAY: u32 = 9;

/// The fewest bytes a metadata value of type `ty` occupies (`None`: not a type of the spec).
/// Every count is bounded by `bytes left / min_size`, so a forged count can neither allocate nor
/// loop past what the file could actually hold.
fn min_size(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,      // u8, i8, bool
        2 | 3 => 2,          // u16, i16
        4..=6 => 4,          // u32, i32, f32
        10..=12 => 8,        // u64, i64, f64
        TYPE_STRING => 8,    // u64 length (+ bytes)
        TYPE_ARRAY => 4 + 8, // u32 element type, u64 count (+ elements)
        _ => return None,
    })
}

/// The spec's name of a metadata value type, for messages.
fn type_name(ty: u32) -> String {
    const NAMES: [&str; 13] = [
        "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64",
        "f64",
    ];
    usize::try_from(ty)
        .ok()
        .and_then(|i| NAMES.get(i))
        .map_or_else(|| format!("unknown type {ty}"), |n| n.to_string())
}

/// `s` cut to its first 64 characters for a message: a forged string can be as long as the file,
/// and an error should stay one sentence.
pub fn short(s: &str) -> String {
    match s.char_indices().nth(64) {
        Some((cut, _)) => format!("{}…", s.get(..cut).unwrap_or_default()),
        None => s.to_string(),
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Array),
}

/// A metadata array, left in the file bytes: [`GgufFile::items`] (or [`GgufFile::strings`],
/// [`GgufFile::integers`]) decodes its elements on demand. Decoding every element up front would
/// turn each byte of a `u8` array into a 32-byte [`Value`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Array {
    /// The elements' metadata value type (the spec's ids: 4 = u32, 8 = string, 9 = array, …).
    pub elem_type: u32,
    pub len: usize,
    /// Where the first element starts in the file.
    start: usize,
    /// How deeply this array is nested (1: a metadata value itself).
    depth: usize,
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I64(v) => Some(v),
            Value::U64(v) => i64::try_from(v).ok(),
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
    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A value as messages show it: numbers as numbers (floats with their decimal point), strings
/// quoted and cut short, arrays by length and type.
impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v:?}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::Str(s) => write!(f, "{:?}", short(s)),
            Value::Array(a) => write!(f, "an array of {} {}", a.len, type_name(a.elem_type)),
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
    /// Exact for tensors [`GgufFile::parse`] returned (it checked the product); saturates for a
    /// hand-made shape too large for memory, which [`GgufFile::raw`] then rejects.
    pub fn num_elements(&self) -> usize {
        self.shape.iter().fold(1, |n, &d| n.saturating_mul(d))
    }
    pub fn num_bytes(&self) -> usize {
        let (per, bytes) = self.ty.block();
        (self.num_elements() / per).saturating_mul(bytes)
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
    /// What is being read (`metadata key K`, `tensor T`), for messages.
    context: String,
}

impl<'a> Cursor<'a> {
    fn new(bytes: &'a [u8], path: &'a Path, pos: usize) -> Self {
        Self {
            bytes,
            pos,
            path,
            context: String::new(),
        }
    }
    fn err(&self, what: &str) -> KilnError {
        let sep = if self.context.is_empty() { "" } else { ": " };
        KilnError::Weights(format!(
            "{}: byte {}: {}{sep}{what}",
            self.path.display(),
            self.pos,
            self.context,
        ))
    }
    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let bytes = self.bytes;
        let s = self
            .pos
            .checked_add(n)
            .and_then(|end| bytes.get(self.pos..end))
            .ok_or_else(|| self.err("file ends early (truncated GGUF?)"))?;
        self.pos += n;
        Ok(s)
    }
    fn array_of<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.array_of::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array_of()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array_of()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array_of()?))
    }
    /// A u64 count of things at least `min` bytes each: at most what the rest of the file can hold.
    fn count(&mut self, min: usize, what: &str) -> Result<usize> {
        let at = self.pos;
        let n = self.u64()?;
        let fits = self.remaining() / min.max(1);
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= fits)
            .ok_or_else(|| {
                self.pos = at;
                self.err(&format!(
                    "{what} {n} needs more than the {} bytes left (the file ends early or the \
                     count is corrupt)",
                    self.remaining()
                ))
            })
    }
    fn str_bytes(&mut self) -> Result<&'a str> {
        let n = self.count(1, "string length")?;
        let at = self.pos;
        let b = self.take(n)?;
        std::str::from_utf8(b).map_err(|_| {
            self.pos = at;
            self.err("string is not UTF-8")
        })
    }
    fn string(&mut self) -> Result<String> {
        Ok(self.str_bytes()?.to_string())
    }
    /// A value of type `ty` inside `depth` arrays.
    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U64(self.u8()?.into()),
            1 => Value::I64((self.u8()? as i8).into()),
            2 => Value::U64(self.u16()?.into()),
            3 => Value::I64((self.u16()? as i16).into()),
            4 => Value::U64(self.u32()?.into()),
            5 => Value::I64((self.u32()? as i32).into()),
            6 => Value::F64(f32::from_bits(self.u32()?).into()),
            7 => Value::Bool(self.u8()? != 0),
            TYPE_STRING => Value::Str(self.string()?),
            TYPE_ARRAY => Value::Array(self.array(depth + 1)?),
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            t => return Err(self.err(&format!("unknown metadata value type {t}"))),
        })
    }
    /// An array's header, then its elements stepped over (checked, not decoded). Recursion only
    /// for arrays of arrays, and at most [`MAX_ARRAY_DEPTH`] deep.
    fn array(&mut self, depth: usize) -> Result<Array> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(self.err(&format!(
                "metadata arrays nested more than {MAX_ARRAY_DEPTH} deep"
            )));
        }
        let elem_type = self.u32()?;
        let min = min_size(elem_type)
            .ok_or_else(|| self.err(&format!("unknown array element type {elem_type}")))?;
        let len = self.count(min, "array length")?;
        let start = self.pos;
        match elem_type {
            TYPE_STRING => {
                for _ in 0..len {
                    self.str_bytes()?;
                }
            }
            TYPE_ARRAY => {
                for _ in 0..len {
                    self.array(depth + 1)?;
                }
            }
            // Fixed-size elements: `count` bounded len · min by the bytes left.
            _ => {
                self.take(len * min)?;
            }
        }
        Ok(Array {
            elem_type,
            len,
            start,
            depth,
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| KilnError::io(path, e))?;
        Self::parse(path, bytes)
    }

    pub fn parse(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        let mut c = Cursor::new(&bytes, path, 0);
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
        // A directory entry takes at least 24 bytes (name length, n_dims, type, offset) and a
        // key/value at least 13 (key length, type, a one-byte value).
        let n_tensors = c.count(24, "tensor count")?;
        let n_kv = c.count(13, "metadata count")?;
        for (n, what, at) in [(n_tensors, "tensors", 8), (n_kv, "metadata keys", 16)] {
            if n > MAX_ENTRIES {
                c.pos = at;
                return Err(c.err(&format!("{n} {what}: more than kiln reads ({MAX_ENTRIES})")));
            }
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            c.context.clear();
            let at = c.pos;
            let key = c.string()?;
            c.context = format!("metadata key {}", short(&key));
            if key.len() > MAX_KEY {
                c.pos = at;
                return Err(c.err(&format!(
                    "a key of {} bytes (GGUF allows {MAX_KEY})",
                    key.len()
                )));
            }
            if metadata.contains_key(&key) {
                c.pos = at;
                return Err(c.err("appears twice"));
            }
            let ty = c.u32()?;
            let value = c.value(ty, 0)?;
            metadata.insert(key, value);
        }
        c.context.clear();
        let align = alignment(path, &metadata)?;
        let mut tensors = Vec::with_capacity(n_tensors);
        let mut names = HashSet::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            c.context.clear();
            let at = c.pos;
            let name = c.string()?;
            c.context = format!("tensor {}", short(&name));
            if name.len() > MAX_NAME {
                c.pos = at;
                return Err(c.err(&format!(
                    "a name of {} bytes (GGUF allows {MAX_NAME})",
                    name.len()
                )));
            }
            if !names.insert(name.clone()) {
                c.pos = at;
                return Err(c.err("appears twice in the tensor directory"));
            }
            tensors.push(tensor_info(&mut c, name, align)?);
        }
        c.context.clear();
        // The data section starts at the next multiple of the alignment.
        let data_start = c
            .pos
            .checked_next_multiple_of(align)
            .ok_or_else(|| c.err(&format!("alignment {align} overflows")))?;
        check_data(path, &tensors, data_start, bytes.len())?;
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

    /// The elements of a metadata array, decoded from the file bytes one at a time.
    pub fn items<'a>(&'a self, a: &Array) -> impl Iterator<Item = Result<Value>> + 'a {
        let mut c = Cursor::new(&self.bytes, &self.path, a.start);
        let (ty, depth) = (a.elem_type, a.depth);
        let mut left = a.len;
        std::iter::from_fn(move || {
            left = left.checked_sub(1)?;
            Some(c.value(ty, depth))
        })
    }

    /// A required array key, with an error naming the file and key.
    fn require_array(&self, key: &str, want: &str, ok: impl Fn(u32) -> bool) -> Result<&Array> {
        let v = self.require(key)?;
        v.as_array().filter(|a| ok(a.elem_type)).ok_or_else(|| {
            KilnError::Weights(format!(
                "{}: metadata key {key} is {v}, not an array of {want}",
                self.path.display()
            ))
        })
    }

    /// A required array of strings (`tokenizer.ggml.tokens`, `tokenizer.ggml.merges`).
    pub fn strings(&self, key: &str) -> Result<Vec<String>> {
        let a = self.require_array(key, "strings", |t| t == TYPE_STRING)?;
        let mut out = Vec::with_capacity(a.len);
        for v in self.items(a) {
            if let Value::Str(s) = v? {
                out.push(s);
            }
        }
        Ok(out)
    }

    /// A required array of integers of any width (`tokenizer.ggml.token_type`).
    pub fn integers(&self, key: &str) -> Result<Vec<i64>> {
        let is_int = |t| matches!(t, 0..=5 | 10 | 11);
        let a = self.require_array(key, "integers", is_int)?;
        let mut out = Vec::with_capacity(a.len);
        for (i, v) in self.items(a).enumerate() {
            out.push(v?.as_i64().ok_or_else(|| {
                KilnError::Weights(format!(
                    "{}: metadata key {key}: element {i} does not fit in an i64",
                    self.path.display()
                ))
            })?);
        }
        Ok(out)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw (still quantised) bytes of a tensor.
    pub fn raw(&self, t: &TensorInfo) -> Result<&[u8]> {
        let start = self.data_start.checked_add(t.offset);
        start
            .and_then(|s| Some(s..s.checked_add(t.num_bytes())?))
            .and_then(|r| self.bytes.get(r))
            .ok_or_else(|| {
                KilnError::Weights(format!(
                    "{}: tensor {}: data lies outside the file",
                    self.path.display(),
                    t.name
                ))
            })
    }

    /// A tensor dequantised to f32, row-major in its PyTorch shape.
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>> {
        Ok(dequantize(t.ty, self.raw(t)?, t.num_elements()))
    }
}

/// `general.alignment`: an integer power of two (writers use 32; the spec says a multiple of 8,
/// kiln accepts any power of two, 1 included). Anything else would misplace every tensor.
fn alignment(path: &Path, metadata: &BTreeMap<String, Value>) -> Result<usize> {
    let Some(v) = metadata.get("general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    v.as_u64()
        .and_then(|a| usize::try_from(a).ok())
        .filter(|a| a.is_power_of_two())
        .ok_or_else(|| {
            KilnError::Weights(format!(
                "{}: general.alignment is {v}; it must be an integer power of two",
                path.display()
            ))
        })
}

/// One tensor directory entry after its name: dims, type, offset, each checked.
fn tensor_info(c: &mut Cursor, name: String, align: usize) -> Result<TensorInfo> {
    let n_dims = c.u32()?;
    if usize::try_from(n_dims).map_or(true, |n| n > MAX_DIMS) {
        return Err(c.err(&format!(
            "{n_dims} dimensions (ggml has at most {MAX_DIMS})"
        )));
    }
    let mut dims = Vec::with_capacity(MAX_DIMS);
    for _ in 0..n_dims {
        let at = c.pos;
        let d = c.u64()?;
        dims.push(usize::try_from(d).map_err(|_| {
            c.pos = at;
            c.err(&format!("dimension {d} does not fit in memory"))
        })?);
    }
    let elements = dims
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| c.err(&format!("dims {dims:?} overflow")))?;
    let at = c.pos;
    let id = c.u32()?;
    let ty = GgmlType::from_id(id).ok_or_else(|| {
        c.pos = at;
        c.err(&format!(
            "ggml type {id} is not one kiln dequantises (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)"
        ))
    })?;
    // ggml quantises rows: the innermost dim must be whole blocks (which also makes the byte size
    // exact).
    let (per, block_bytes) = ty.block();
    let row = dims.first().copied().unwrap_or(1);
    if !row.is_multiple_of(per) {
        return Err(c.err(&format!(
            "a row of {row} values is not a whole number of {ty:?} blocks of {per}"
        )));
    }
    (elements / per)
        .checked_mul(block_bytes)
        .ok_or_else(|| c.err(&format!("{elements} {ty:?} values overflow a byte size")))?;
    let at = c.pos;
    let offset = c.u64()?;
    let offset = usize::try_from(offset)
        .ok()
        .filter(|o| o.is_multiple_of(align))
        .ok_or_else(|| {
            c.pos = at;
            c.err(&format!(
                "data offset {offset} is not a multiple of the alignment {align}"
            ))
        })?;
    dims.reverse();
    Ok(TensorInfo {
        name,
        shape: dims,
        ty,
        offset,
    })
}

/// Every tensor's data lies inside the file, and no two overlap (so the tensors, dequantised, are
/// never more than the file's bytes expanded once).
fn check_data(path: &Path, tensors: &[TensorInfo], data_start: usize, len: usize) -> Result<()> {
    let mut spans = Vec::with_capacity(tensors.len());
    for t in tensors {
        // `tensor_info` checked the byte size; `num_bytes` is exact here.
        let end = data_start
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.num_bytes()))
            .filter(|&e| e <= len)
            .ok_or_else(|| {
                KilnError::Weights(format!(
                    "{}: tensor {}: its {} bytes at data offset {} (file byte {}) run past the end \
                     of the file ({len} bytes; truncated download?)",
                    path.display(),
                    t.name,
                    t.num_bytes(),
                    t.offset,
                    data_start.saturating_add(t.offset),
                ))
            })?;
        if t.num_bytes() > 0 {
            spans.push((end - t.num_bytes(), end, &t.name));
        }
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        if let [(_, a_end, a), (b_start, _, b)] = w {
            if b_start < a_end {
                return Err(KilnError::Weights(format!(
                    "{}: tensors {a} and {b} overlap (file bytes {b_start}..{a_end})",
                    path.display()
                )));
            }
        }
    }
    Ok(())
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
    move_qk_rows(w, rows, cols, heads, |file, hf| (file, hf))
}

/// The permutation itself (llama.cpp's `LlamaModel.permute`), for writing GGUF: Hugging Face row
/// `p·half + i` of each head becomes row `2i + p`.
pub fn permute_qk(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    move_qk_rows(w, rows, cols, heads, |file, hf| (hf, file))
}

/// Copies rows of `w` within each head from `src` to `dst`, where `(src, dst) = order(file row,
/// Hugging Face row)` for each pair of rows the permutation relates.
fn move_qk_rows(
    w: &[f32],
    rows: usize,
    cols: usize,
    heads: usize,
    order: impl Fn(usize, usize) -> (usize, usize),
) -> Vec<f32> {
    assert_eq!(w.len(), rows * cols);
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for i in 0..half {
            for p in 0..2 {
                let (src, dst) = order(h * head_dim + 2 * i + p, h * head_dim + p * half + i);
                out[dst * cols..dst * cols + cols]
                    .copy_from_slice(&w[src * cols..src * cols + cols]);
            }
        }
    }
    out
}

/// A minimal GGUF writer for kiln's own unit tests (here and in `convert`).
#[cfg(test)]
pub(crate) mod testing {
    /// Metadata `(key, type id, payload)` and tensors `(name, PyTorch shape, ggml type id, data)`,
    /// kept editable until [`Writer::bytes`] lays them out.
    pub struct Writer {
        pub kv: Vec<(String, u32, Vec<u8>)>,
        pub tensors: Vec<(String, Vec<usize>, u32, Vec<u8>)>,
        /// Padding of the data section (set `general.alignment` separately).
        pub alignment: usize,
    }

    pub fn string(s: &str) -> Vec<u8> {
        let mut b = (s.len() as u64).to_le_bytes().to_vec();
        b.extend(s.as_bytes());
        b
    }

    impl Writer {
        pub fn new() -> Self {
            Self {
                kv: Vec::new(),
                tensors: Vec::new(),
                alignment: 32,
            }
        }
        /// Sets (or replaces) a key.
        pub fn set(&mut self, key: &str, ty: u32, payload: Vec<u8>) -> &mut Self {
            self.kv.retain(|(k, _, _)| k != key);
            self.kv.push((key.into(), ty, payload));
            self
        }
        pub fn remove(&mut self, key: &str) -> &mut Self {
            self.kv.retain(|(k, _, _)| k != key);
            self
        }
        pub fn str(&mut self, key: &str, v: &str) -> &mut Self {
            self.set(key, 8, string(v))
        }
        pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
            self.set(key, 4, v.to_le_bytes().to_vec())
        }
        pub fn f32(&mut self, key: &str, v: f32) -> &mut Self {
            self.set(key, 6, v.to_le_bytes().to_vec())
        }
        pub fn bool(&mut self, key: &str, v: bool) -> &mut Self {
            self.set(key, 7, vec![v as u8])
        }
        pub fn strs(&mut self, key: &str, v: &[&str]) -> &mut Self {
            let mut b = 8u32.to_le_bytes().to_vec();
            b.extend((v.len() as u64).to_le_bytes());
            for s in v {
                b.extend(string(s));
            }
            self.set(key, 9, b)
        }
        pub fn i32s(&mut self, key: &str, v: &[i32]) -> &mut Self {
            let mut b = 5u32.to_le_bytes().to_vec();
            b.extend((v.len() as u64).to_le_bytes());
            b.extend(v.iter().flat_map(|x| x.to_le_bytes()));
            self.set(key, 9, b)
        }
        /// An F32 tensor of `shape` (PyTorch order) holding `f(i)` at flat index `i`.
        pub fn f32_tensor(&mut self, name: &str, shape: &[usize], f: impl Fn(usize) -> f32) {
            let n: usize = shape.iter().product();
            let data = (0..n).flat_map(|i| f(i).to_le_bytes()).collect();
            self.tensors.retain(|(t, ..)| t != name);
            self.tensors.push((name.into(), shape.to_vec(), 0, data));
        }
        pub fn bytes(&self) -> Vec<u8> {
            let mut b = b"GGUF".to_vec();
            b.extend(3u32.to_le_bytes());
            b.extend((self.tensors.len() as u64).to_le_bytes());
            b.extend((self.kv.len() as u64).to_le_bytes());
            for (k, ty, payload) in &self.kv {
                b.extend(string(k));
                b.extend(ty.to_le_bytes());
                b.extend(payload);
            }
            let mut data: Vec<u8> = Vec::new();
            for (name, shape, ty, bytes) in &self.tensors {
                data.resize(data.len().next_multiple_of(self.alignment), 0);
                b.extend(string(name));
                b.extend((shape.len() as u32).to_le_bytes());
                for d in shape.iter().rev() {
                    b.extend((*d as u64).to_le_bytes());
                }
                b.extend(ty.to_le_bytes());
                b.extend((data.len() as u64).to_le_bytes());
                data.extend(bytes);
            }
            b.resize(b.len().next_multiple_of(self.alignment), 0);
            b.extend(data);
            b
        }
    }
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

    use testing::{string, Writer};

    fn parse(b: Vec<u8>) -> Result<GgufFile> {
        GgufFile::parse(Path::new("x.gguf"), b)
    }

    /// The error of parsing `b`, which must start with the file name.
    fn error(b: Vec<u8>) -> String {
        let e = parse(b).err().expect("an error").to_string();
        assert!(e.starts_with("x.gguf: "), "{e}");
        e
    }

    /// A header, then `kv` metadata entries written by hand.
    fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(n_tensors.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        b
    }

    fn one_tensor() -> Writer {
        let mut w = Writer::new();
        w.str("general.architecture", "llama");
        w.f32_tensor("a", &[2, 4], |i| i as f32);
        w
    }

    #[test]
    fn reads_what_the_writer_wrote() {
        let mut w = one_tensor();
        w.strs("toks", &["a", "bc", ""]).i32s("types", &[1, -3, 4]);
        w.f32_tensor("b", &[3], |i| -(i as f32));
        let g = parse(w.bytes()).unwrap();
        assert_eq!(
            g.get("general.architecture").and_then(Value::as_str),
            Some("llama")
        );
        assert_eq!(g.strings("toks").unwrap(), ["a", "bc", ""]);
        assert_eq!(g.integers("types").unwrap(), [1, -3, 4]);
        let e = g.strings("types").unwrap_err().to_string();
        assert!(
            e.contains("types is an array of 3 i32, not an array of strings"),
            "{e}"
        );
        let a = g.tensor("a").unwrap();
        assert_eq!(a.shape, [2, 4]);
        assert_eq!(
            g.dequantize(a).unwrap(),
            (0..8).map(|i| i as f32).collect::<Vec<_>>()
        );
        assert_eq!(
            g.dequantize(g.tensor("b").unwrap()).unwrap(),
            [0.0, -1.0, -2.0]
        );
        // A hand-made TensorInfo pointing outside the file is an error, not a panic.
        let mut bogus = a.clone();
        bogus.offset = usize::MAX - 3;
        assert!(g.raw(&bogus).is_err());
        bogus.shape = vec![usize::MAX, 3];
        assert!(g.dequantize(&bogus).is_err());
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
        // Every prefix of a valid file is an error (the last tensor's data is cut), none a panic.
        let full = one_tensor().bytes();
        for n in 0..full.len() {
            assert!(parse(full[..n].to_vec()).is_err(), "prefix of {n} bytes");
        }
        assert!(parse(full).is_ok());
    }

    #[test]
    fn counts_and_lengths_are_bounded_by_the_file() {
        // Header counts that the remaining bytes cannot hold.
        let e = error(header(u64::MAX, 0));
        assert!(e.contains("tensor count 18446744073709551615"), "{e}");
        let e = error(header(0, 1 << 40));
        assert!(e.contains("byte 16: metadata count 1099511627776"), "{e}");
        // Counts the bytes could hold but no real file has.
        let mut b = header(100_000, 0);
        b.resize(100_000 * 24 + 24, 0);
        let e = error(b);
        assert!(
            e.contains("100000 tensors: more than kiln reads (65536)"),
            "{e}"
        );
        let mut b = header(0, 70_000);
        b.resize(70_000 * 13 + 24, 0);
        let e = error(b);
        assert!(e.contains("byte 16: 70000 metadata keys: more than"), "{e}");
        // A key whose string length runs past the end.
        let mut b = header(0, 1);
        b.extend(u64::MAX.to_le_bytes());
        b.extend(b"key and some more bytes");
        let e = error(b);
        assert!(
            e.contains("byte 24: string length 18446744073709551615"),
            "{e}"
        );
        // An array of u8 claiming more elements than there are bytes.
        let mut b = header(0, 1);
        b.extend(string("k"));
        b.extend(9u32.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend((1u64 << 40).to_le_bytes());
        b.extend([0u8; 16]);
        let e = error(b);
        assert!(
            e.contains("metadata key k: array length 1099511627776"),
            "{e}"
        );
    }

    #[test]
    fn rejects_bad_types_strings_and_duplicates() {
        let mut w = Writer::new();
        w.set("k", 13, vec![0; 8]);
        let e = error(w.bytes());
        assert!(
            e.contains("metadata key k: unknown metadata value type 13"),
            "{e}"
        );
        let mut w = Writer::new();
        w.set(
            "k",
            9,
            [77u32.to_le_bytes().to_vec(), 0u64.to_le_bytes().to_vec()].concat(),
        );
        let e = error(w.bytes());
        assert!(e.contains("unknown array element type 77"), "{e}");
        let mut w = Writer::new();
        w.set(
            "k",
            8,
            [2u64.to_le_bytes().to_vec(), vec![0xff, 0xfe]].concat(),
        );
        let e = error(w.bytes());
        assert!(e.contains("metadata key k: string is not UTF-8"), "{e}");
        let mut w = Writer::new();
        w.u32("k", 1);
        w.kv.push(("k".into(), 4, 2u32.to_le_bytes().to_vec()));
        let e = error(w.bytes());
        assert!(e.contains("metadata key k: appears twice"), "{e}");
        let mut w = one_tensor();
        w.tensors.push(w.tensors[0].clone());
        let e = error(w.bytes());
        assert!(e.contains("tensor a: appears twice"), "{e}");
    }

    #[test]
    fn names_keys_and_values_stay_short_in_messages() {
        let mut w = one_tensor();
        w.f32_tensor(&"n".repeat(65), &[1], |_| 0.0);
        let e = error(w.bytes());
        assert!(e.contains(": a name of 65 bytes (GGUF allows 64)"), "{e}");
        let mut w = Writer::new();
        w.u32(&"k".repeat(70_000), 1);
        let e = error(w.bytes());
        let key = format!("metadata key {}…: a key of 70000 bytes", "k".repeat(64));
        assert!(e.contains(&key), "{e}");
        assert!(e.len() < 200, "{e}");
        let mut w = one_tensor();
        w.str("general.alignment", &"x".repeat(1 << 20));
        let e = error(w.bytes());
        assert!(e.len() < 200, "{e}");
        assert_eq!(short("aé"), "aé");
    }

    #[test]
    fn alignment_must_be_an_integer_power_of_two() {
        for (ty, payload, shown) in [
            (4, 0u32.to_le_bytes().to_vec(), "is 0;"),
            (4, 24u32.to_le_bytes().to_vec(), "is 24;"),
            (5, (-32i32).to_le_bytes().to_vec(), "is -32;"),
            (6, 32f32.to_le_bytes().to_vec(), "is 32.0;"),
            (8, string("32"), "is \"32\";"),
        ] {
            let mut w = one_tensor();
            w.set("general.alignment", ty, payload);
            let e = error(w.bytes());
            assert!(e.contains(&format!("general.alignment {shown}")), "{e}");
        }
        for align in [1u32, 8, 64] {
            let mut w = one_tensor();
            w.u32("general.alignment", align);
            w.alignment = align as usize;
            let g = parse(w.bytes()).unwrap();
            assert_eq!(g.dequantize(&g.tensors[0]).unwrap()[7], 7.0);
        }
        // A huge power of two puts the data section far past the end of the file.
        let mut w = one_tensor();
        w.set("general.alignment", 10, (1u64 << 63).to_le_bytes().to_vec());
        let e = error(w.bytes());
        assert!(
            e.contains("(file byte 9223372036854775808) run past the end"),
            "{e}"
        );
    }

    /// `one_tensor`'s file with the u64 at `at` bytes after its directory entry's name overwritten.
    fn with_dir_field(skip: usize, width: usize, value: u64) -> Vec<u8> {
        let w = one_tensor();
        let mut b = w.bytes();
        let name = string("a");
        let at = b.windows(name.len()).rposition(|x| x == name).unwrap() + name.len() + skip;
        b[at..at + width].copy_from_slice(&value.to_le_bytes()[..width]);
        b
    }

    #[test]
    fn tensor_directory_is_checked() {
        // Entry after the name: n_dims u32, dims u64 × 2, type u32, offset u64.
        let e = error(with_dir_field(0, 4, 0xFFFF_FFFF));
        assert!(
            e.contains("tensor a: 4294967295 dimensions (ggml has at most 4)"),
            "{e}"
        );
        let e = error(with_dir_field(0, 4, 5));
        assert!(e.contains("5 dimensions"), "{e}");
        let e = error(with_dir_field(4, 8, 1 << 40));
        assert!(e.contains("tensor a: its 8796093022208 bytes"), "{e}");
        assert!(e.contains("run past the end of the file"), "{e}");
        let e = error(with_dir_field(4, 8, u64::MAX));
        assert!(e.contains("overflow"), "{e}");
        let e = error(with_dir_field(20, 4, 2));
        assert!(
            e.contains("tensor a: a row of 4 values is not a whole number of Q4_0 blocks"),
            "{e}"
        );
        let e = error(with_dir_field(20, 4, 7));
        assert!(e.contains("ggml type 7 is not one kiln dequantises"), "{e}");
        let e = error(with_dir_field(24, 8, 4));
        assert!(
            e.contains("data offset 4 is not a multiple of the alignment 32"),
            "{e}"
        );
        let e = error(with_dir_field(24, 8, 1 << 20));
        assert!(
            e.contains("tensor a: its 32 bytes at data offset 1048576"),
            "{e}"
        );
        let e = error(with_dir_field(24, 8, u64::MAX - 31));
        assert!(e.contains("run past the end"), "{e}");
        // Zero dimensions is a scalar (one value); a zero dim is an empty tensor. Both parse.
        let g = parse(with_dir_field(4, 8, 0)).unwrap();
        assert_eq!(g.tensors[0].num_elements(), 0);
    }

    #[test]
    fn overlapping_tensors_are_rejected() {
        let mut w = one_tensor();
        w.f32_tensor("b", &[8], |_| 0.0);
        let mut b = w.bytes();
        // b's offset (32) → 0: it now shares a's bytes.
        let name = string("b");
        let at = b.windows(name.len()).rposition(|x| x == name).unwrap() + name.len() + 4 + 8 + 4;
        b[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
        let e = error(b);
        assert!(e.contains("tensors a and b overlap"), "{e}");
    }

    /// An array of arrays of … `depth` deep, innermost empty, as the value of key `k`.
    fn nested(depth: usize) -> Vec<u8> {
        let mut b = header(0, 1);
        b.extend(string("k"));
        b.extend(9u32.to_le_bytes());
        for level in 1..=depth {
            let inner: u32 = if level < depth { 9 } else { 0 };
            b.extend(inner.to_le_bytes());
            b.extend(u64::from(level < depth).to_le_bytes());
        }
        b
    }

    #[test]
    fn array_nesting_is_bounded() {
        let g = parse(nested(MAX_ARRAY_DEPTH)).unwrap();
        let mut a = *g.get("k").unwrap().as_array().unwrap();
        for _ in 1..MAX_ARRAY_DEPTH {
            let items: Vec<Value> = g.items(&a).collect::<Result<_>>().unwrap();
            a = *items[0].as_array().unwrap();
        }
        assert_eq!((a.elem_type, a.len), (0, 0));
        let e = error(nested(MAX_ARRAY_DEPTH + 1));
        assert!(
            e.contains("metadata key k: metadata arrays nested more than 8 deep"),
            "{e}"
        );
        // 10k deep is rejected at depth 9 without recursing 10k times.
        let e = error(nested(10_000));
        assert!(e.contains("nested more than 8 deep"), "{e}");
    }

    #[test]
    fn large_arrays_stay_in_the_file() {
        // 2 MB of u8: a view of the bytes (no per-element Value), decoded on demand.
        let n = 2 << 20;
        let mut w = Writer::new();
        let mut payload = 0u32.to_le_bytes().to_vec();
        payload.extend((n as u64).to_le_bytes());
        payload.extend((0..n).map(|i| i as u8));
        w.set("big", 9, payload);
        let g = parse(w.bytes()).unwrap();
        let a = g.get("big").unwrap().as_array().unwrap();
        assert_eq!((a.elem_type, a.len), (0, n));
        let ints = g.integers("big").unwrap();
        assert_eq!((ints.len(), ints[300]), (n, 300 % 256));
        let e = g.strings("big").unwrap_err().to_string();
        assert!(e.contains("big is an array of 2097152 u8, not"), "{e}");
    }
}
