//! Writing GGUF files (version 3), laid out as llama.cpp's `gguf-py` writes them: the header,
//! the metadata in the order given, the tensor directory (dimensions innermost first, offsets
//! from the data section's start, each aligned to `general.alignment` = 32), then each tensor's
//! bytes padded to the alignment. Tensors are stored as F32, F16, BF16 or Q8_0, each encoded as
//! gguf-py encodes it (F16: round to nearest even; BF16: round to nearest even, NaN kept quiet;
//! Q8_0: blocks of 32 values as an f16 scale `max|x| / 127` and 32 int8 `round(x / scale)`,
//! halves away from zero), so a file kiln writes is the file llama.cpp's converter would write.
//!
//! The directory is written before any tensor is encoded (sizes follow from shapes and types), and
//! tensors are encoded and written one at a time through a temporary file renamed into place.

use std::io::Write;
use std::path::Path;

use crate::error::{KilnError, Result};
use crate::formats::gguf::GgmlType;

const ALIGNMENT: usize = 32;

/// A metadata value (gguf-py's types, by their GGUF type ids).
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

impl MetaValue {
    fn encode(&self, out: &mut Vec<u8>) {
        let string = |out: &mut Vec<u8>, s: &str| {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        };
        match self {
            Self::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Self::I32(v) => {
                out.extend(5u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Self::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Self::Bool(v) => {
                out.extend(7u32.to_le_bytes());
                out.push(u8::from(*v));
            }
            Self::Str(s) => {
                out.extend(8u32.to_le_bytes());
                string(out, s);
            }
            Self::Strs(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                for s in v {
                    string(out, s);
                }
            }
            Self::I32s(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                for x in v {
                    out.extend(x.to_le_bytes());
                }
            }
        }
    }
}

/// One tensor to write: its name, its shape in PyTorch's order (outermost first) and how it is
/// stored.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub ty: GgmlType,
}

impl TensorEntry {
    fn bytes(&self) -> usize {
        let n: usize = self.shape.iter().product();
        let (per_block, block_bytes) = self.ty.block();
        n / per_block * block_bytes
    }
}

/// Whether values of a tensor with rows of `row` values can be stored as `ty` (Q8_0 packs each
/// row in blocks of 32).
pub fn storable(ty: GgmlType, row: usize) -> bool {
    let (per_block, _) = ty.block();
    row.is_multiple_of(per_block)
}

/// Writes `metadata` and `tensors` to `path` (a new file replaces any old one whole, or nothing
/// is written); `data(i)` gives tensor `i`'s values, row-major, when it is its turn.
pub fn write_gguf(
    path: &Path,
    metadata: &[(String, MetaValue)],
    tensors: &[TensorEntry],
    mut data: impl FnMut(usize) -> Result<Vec<f32>>,
) -> Result<()> {
    let mut header = Vec::new();
    header.extend(b"GGUF");
    header.extend(3u32.to_le_bytes());
    header.extend((tensors.len() as u64).to_le_bytes());
    header.extend((metadata.len() as u64 + 1).to_le_bytes());
    let key = |out: &mut Vec<u8>, k: &str| {
        out.extend((k.len() as u64).to_le_bytes());
        out.extend(k.as_bytes());
    };
    for (k, v) in metadata {
        key(&mut header, k);
        v.encode(&mut header);
    }
    key(&mut header, "general.alignment");
    MetaValue::U32(ALIGNMENT as u32).encode(&mut header);
    let mut offset = 0usize;
    for t in tensors {
        let (per_block, _) = t.ty.block();
        let row = t.shape.last().copied().unwrap_or(1);
        if !row.is_multiple_of(per_block) {
            return Err(KilnError::Config(format!(
                "{}: rows of {row} values cannot be stored as {:?} (blocks of {per_block})",
                t.name, t.ty
            )));
        }
        key(&mut header, &t.name);
        header.extend((t.shape.len() as u32).to_le_bytes());
        for &d in t.shape.iter().rev() {
            header.extend((d as u64).to_le_bytes());
        }
        header.extend(type_id(t.ty).to_le_bytes());
        header.extend((offset as u64).to_le_bytes());
        offset += t.bytes().next_multiple_of(ALIGNMENT);
    }
    pad(&mut header);
    let tmp = crate::io::files::temp_path(path);
    let result = (|| -> Result<()> {
        let file = std::fs::File::create(&tmp).map_err(|e| KilnError::io(&tmp, e))?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
        let io = |e| KilnError::io(&tmp, e);
        w.write_all(&header).map_err(io)?;
        for (i, t) in tensors.iter().enumerate() {
            let values = data(i)?;
            let n: usize = t.shape.iter().product();
            if values.len() != n {
                return Err(KilnError::Weights(format!(
                    "{}: {} values for shape {:?}",
                    t.name,
                    values.len(),
                    t.shape
                )));
            }
            let mut bytes = encode(t.ty, &values);
            debug_assert_eq!(bytes.len(), t.bytes());
            pad(&mut bytes);
            w.write_all(&bytes).map_err(io)?;
        }
        let file = w
            .into_inner()
            .map_err(|e| KilnError::io(&tmp, e.into_error()))?;
        file.sync_all().map_err(io)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        KilnError::io(path, e)
    })
}

fn pad(bytes: &mut Vec<u8>) {
    bytes.resize(bytes.len().next_multiple_of(ALIGNMENT), 0);
}

fn type_id(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q4_1 => 3,
        GgmlType::Q8_0 => 8,
        GgmlType::Q4K => 12,
        GgmlType::Q6K => 14,
        GgmlType::BF16 => 30,
    }
}

/// `values` stored as `ty` (F32, F16, BF16 or Q8_0; the k-quants and 4-bit types are read-only).
pub fn encode(ty: GgmlType, values: &[f32]) -> Vec<u8> {
    match ty {
        GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::BF16 => values
            .iter()
            .flat_map(|&v| bf16_bits(v).to_le_bytes())
            .collect(),
        GgmlType::Q8_0 => values.chunks(32).flat_map(q8_0_block).collect(),
        other => unreachable!("kiln does not write {other:?}"),
    }
}

/// gguf-py's f32 → bf16: round to nearest even; a NaN stays a (quiet) NaN.
fn bf16_bits(v: f32) -> u16 {
    let mut n = v.to_bits();
    if n & 0x7fff_ffff > 0x7f80_0000 {
        n = (n & 0xffff_0000) | (64 << 16);
    }
    ((u64::from(n) + 0x7fff + u64::from((n >> 16) & 1)) >> 16) as u16
}

/// One Q8_0 block as gguf-py quantises it: `d = max|x| / 127` (f32), `q = round(x · (1/d))` with
/// halves away from zero, then `d` stored as f16 before the 32 int8 values.
fn q8_0_block(block: &[f32]) -> Vec<u8> {
    let amax = block.iter().fold(0f32, |a, &x| a.max(x.abs()));
    let d = amax / 127.0;
    let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
    let mut out = half::f16::from_f32(d).to_le_bytes().to_vec();
    out.extend(block.iter().map(|&x| {
        let y = x * inv;
        let a = y.abs();
        let rounded = a.floor() + (2.0 * (a - a.floor())).floor();
        (rounded.copysign(y) as i32).clamp(-128, 127) as i8 as u8
    }));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::gguf::{dequantize, GgufFile, Value};

    /// What kiln writes, kiln's reader reads back: the metadata, the shapes, F32/F16/BF16 values
    /// as each type rounds them, Q8_0 within half a quantisation step of each block (and the
    /// scale's own f16 rounding).
    #[test]
    fn written_files_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let values: Vec<f32> = (0..64 * 3)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut with_nan = values.clone();
        with_nan[5] = f32::NAN;
        let tensors = [
            TensorEntry {
                name: "a.f32".into(),
                shape: vec![3, 64],
                ty: GgmlType::F32,
            },
            TensorEntry {
                name: "b.f16".into(),
                shape: vec![3, 64],
                ty: GgmlType::F16,
            },
            TensorEntry {
                name: "c.bf16".into(),
                shape: vec![3, 64],
                ty: GgmlType::BF16,
            },
            TensorEntry {
                name: "d.q8_0".into(),
                shape: vec![3, 64],
                ty: GgmlType::Q8_0,
            },
        ];
        let metadata = vec![
            (
                "general.architecture".to_string(),
                MetaValue::Str("llama".into()),
            ),
            ("llama.block_count".into(), MetaValue::U32(2)),
            ("x.f".into(), MetaValue::F32(1e-5)),
            ("x.b".into(), MetaValue::Bool(true)),
            (
                "x.s".into(),
                MetaValue::Strs(vec!["a".into(), "b c".into()]),
            ),
            ("x.i".into(), MetaValue::I32s(vec![1, -3])),
        ];
        write_gguf(&path, &metadata, &tensors, |i| {
            Ok(if i == 2 {
                with_nan.clone()
            } else {
                values.clone()
            })
        })
        .unwrap();
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(
            g.get("general.architecture").and_then(Value::as_str),
            Some("llama")
        );
        assert_eq!(g.get("llama.block_count").and_then(Value::as_u64), Some(2));
        assert_eq!(g.get("general.alignment").and_then(Value::as_u64), Some(32));
        assert_eq!(g.get("x.b").and_then(Value::as_bool), Some(true));
        assert_eq!(g.strings("x.s").unwrap(), vec!["a", "b c"]);
        assert_eq!(g.integers("x.i").unwrap(), vec![1, -3]);
        let read = |name: &str| g.dequantize(g.tensor(name).unwrap()).unwrap();
        assert_eq!(g.tensor("a.f32").unwrap().shape, vec![3, 64]);
        assert_eq!(read("a.f32"), values);
        let f16: Vec<f32> = values
            .iter()
            .map(|&v| half::f16::from_f32(v).to_f32())
            .collect();
        assert_eq!(read("b.f16"), f16);
        let bf16 = read("c.bf16");
        assert!(bf16[5].is_nan());
        for (i, (&got, &v)) in bf16
            .iter()
            .zip(&values)
            .enumerate()
            .filter(|(i, _)| *i != 5)
        {
            assert_eq!(got, half::bf16::from_f32(v).to_f32(), "value {i}");
        }
        for (block, got) in values.chunks(32).zip(read("d.q8_0").chunks(32)) {
            let step = block.iter().fold(0f32, |a, &x| a.max(x.abs())) / 127.0;
            // Half a step, plus up to 127 × the scale's f16 rounding (2⁻¹¹ of it).
            for (&v, &q) in block.iter().zip(got) {
                assert!(
                    (v - q).abs() <= step * (0.5 + 127.0 / 2048.0) * 1.001,
                    "{v} → {q} (step {step})"
                );
            }
        }
        // The reader's own decoder agrees with the raw bytes.
        let raw = encode(GgmlType::Q8_0, &values);
        assert_eq!(
            dequantize(GgmlType::Q8_0, &raw, values.len()),
            read("d.q8_0")
        );
    }

    #[test]
    fn q8_0_rounds_halves_away_from_zero_and_keeps_zero_blocks() {
        // max 127 → d = 1: values land on integers and halves.
        let mut block = vec![0f32; 32];
        block[0] = 127.0;
        block[1] = 2.5;
        block[2] = -2.5;
        block[3] = 0.49;
        let b = q8_0_block(&block);
        assert_eq!(&b[..2], &half::f16::from_f32(1.0).to_le_bytes());
        assert_eq!(b[2] as i8, 127);
        assert_eq!(b[3] as i8, 3);
        assert_eq!(b[4] as i8, -3);
        assert_eq!(b[5] as i8, 0);
        assert!(q8_0_block(&[0.0; 32])[2..].iter().all(|&q| q == 0));
    }

    #[test]
    fn rows_that_do_not_fill_q8_0_blocks_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let t = [TensorEntry {
            name: "w".into(),
            shape: vec![2, 48],
            ty: GgmlType::Q8_0,
        }];
        let e = write_gguf(&path, &[], &t, |_| Ok(vec![0.0; 96])).unwrap_err();
        assert!(e.to_string().contains("rows of 48 values"), "{e}");
        assert!(!path.exists());
        assert!(storable(GgmlType::Q8_0, 64) && !storable(GgmlType::Q8_0, 48));
    }
}
