//! The IDX format of the MNIST files (`train-images-idx3-ubyte`, optionally gzipped): a big-endian
//! header (magic 0x0000_0803 for u8 images, 0x0000_0801 for u8 labels, then the dimensions) and
//! the raw bytes.

use std::io::Read;
use std::path::Path;

use crate::{KilnError, Result};

/// An IDX file of unsigned bytes: its dimensions and data.
#[derive(Debug, Clone, PartialEq)]
pub struct IdxU8 {
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
}

/// Reads `path`, or `path.gz` when only the gzipped file exists.
pub fn read_idx(path: &Path) -> Result<IdxU8> {
    let gz = path.with_file_name(format!(
        "{}.gz",
        path.file_name().map_or("".into(), |n| n.to_string_lossy())
    ));
    let (file, zipped) = if path.exists() {
        (
            path.to_path_buf(),
            path.extension().is_some_and(|e| e == "gz"),
        )
    } else if gz.exists() {
        (gz, true)
    } else {
        return Err(KilnError::Data(format!(
            "{}: no such IDX file (nor {}); run scripts/fetch-assets",
            path.display(),
            gz.display()
        )));
    };
    let raw = std::fs::read(&file).map_err(|e| KilnError::io(&file, e))?;
    let bytes = if zipped {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| KilnError::io(&file, e))?;
        out
    } else {
        raw
    };
    parse_idx(&bytes).map_err(|msg| KilnError::Data(format!("{}: {msg}", file.display())))
}

fn parse_idx(b: &[u8]) -> std::result::Result<IdxU8, String> {
    if b.len() < 4 || b[0] != 0 || b[1] != 0 {
        return Err("not an IDX file (bad magic number)".into());
    }
    if b[2] != 0x08 {
        return Err(format!(
            "element type 0x{:02x} is not unsigned bytes (0x08)",
            b[2]
        ));
    }
    let ndim = b[3] as usize;
    let header = 4 + 4 * ndim;
    if b.len() < header {
        return Err("truncated header".into());
    }
    let dims: Vec<usize> = (0..ndim)
        .map(|i| u32::from_be_bytes(b[4 + 4 * i..8 + 4 * i].try_into().expect("4 bytes")) as usize)
        .collect();
    let n: usize = dims.iter().product();
    if b.len() - header != n {
        return Err(format!(
            "header says {dims:?} ({n} bytes) but the file holds {} bytes of data",
            b.len() - header
        ));
    }
    Ok(IdxU8 {
        dims,
        data: b[header..].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_images_and_labels_and_rejects_bad_files() {
        let mut img = vec![0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 2];
        img.extend([1, 2, 3, 4]);
        let p = parse_idx(&img).unwrap();
        assert_eq!(p.dims, vec![2, 1, 2]);
        assert_eq!(p.data, vec![1, 2, 3, 4]);
        assert!(parse_idx(&img[..18]).unwrap_err().contains("header says"));
        assert!(parse_idx(&[1, 2, 3, 4]).unwrap_err().contains("magic"));
        assert!(parse_idx(&[0, 0, 0x0d, 1, 0, 0, 0, 0])
            .unwrap_err()
            .contains("unsigned"));
    }
}
