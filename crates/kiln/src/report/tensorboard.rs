//! TensorBoard event files, written from the format: TFRecord framing (length, masked CRC-32C of
//! the length, data, masked CRC-32C of the data) around `tensorboard.Event` protocol buffers,
//! encoded by prost from the hand-written messages below (the field numbers are those of
//! tensorboard's `event.proto`, `summary.proto`, `tensor.proto` and `tensor_shape.proto`).
//!
//! The tags are Hugging Face's: [`hf_scalars`] turns a logged entry into the `(tag, value)` pairs
//! transformers' `TensorBoardCallback` writes (`train/loss`, `eval/accuracy`, …), and
//! [`EventWriter::add_text`] writes a text summary as PyTorch's `SummaryWriter.add_text` does
//! (the `args` text of the run's TrainingArguments, for one).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

use crate::error::{KilnError, Result};

/// `tensorboard.Event`.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    what: Option<What>,
    #[prost(message, optional, tag = "10")]
    source_metadata: Option<SourceMetadata>,
}

/// `Event.what` (the members kiln writes).
#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorboard.SourceMetadata`: which program wrote the file.
#[derive(Clone, PartialEq, prost::Message)]
struct SourceMetadata {
    #[prost(string, tag = "1")]
    writer: String,
}

/// `tensorboard.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorboard.Summary.Value`.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(message, optional, tag = "9")]
    metadata: Option<SummaryMetadata>,
    #[prost(oneof = "ValueKind", tags = "2, 8")]
    value: Option<ValueKind>,
}

/// `Summary.Value.value` (the members kiln writes).
#[derive(Clone, PartialEq, prost::Oneof)]
enum ValueKind {
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    #[prost(message, tag = "8")]
    Tensor(TensorProto),
}

/// `tensorboard.SummaryMetadata`.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    plugin_data: Option<PluginData>,
}

/// `tensorboard.SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, prost::Message)]
struct PluginData {
    #[prost(string, tag = "1")]
    plugin_name: String,
    #[prost(bytes = "vec", tag = "2")]
    content: Vec<u8>,
}

/// `tensorboard.TensorProto` (the fields of a string tensor).
#[derive(Clone, PartialEq, prost::Message)]
struct TensorProto {
    /// `tensorboard.DataType`, an enum: DT_STRING = 7.
    #[prost(int32, tag = "1")]
    dtype: i32,
    #[prost(message, optional, tag = "2")]
    tensor_shape: Option<TensorShapeProto>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    string_val: Vec<Vec<u8>>,
}

/// `tensorboard.TensorShapeProto`.
#[derive(Clone, PartialEq, prost::Message)]
struct TensorShapeProto {
    #[prost(message, repeated, tag = "2")]
    dim: Vec<Dim>,
}

/// `tensorboard.TensorShapeProto.Dim`.
#[derive(Clone, PartialEq, prost::Message)]
struct Dim {
    #[prost(int64, tag = "1")]
    size: i64,
}

const DT_STRING: i32 = 7;

/// The version string of the first event of every file (TensorBoard reads it to pick its rules).
const FILE_VERSION: &str = "brain.Event:2";

/// A TFRecord checksum: CRC-32C, rotated right by 15 bits plus a constant (so that a CRC of data
/// holding CRCs stays well distributed).
fn masked_crc(data: &[u8]) -> u32 {
    // `((crc >> 15) | (crc << 17)) + 0xa282ead8`, modulo 2^32.
    crc32c::crc32c(data)
        .rotate_right(15)
        .wrapping_add(0xa282_ead8)
}

/// Appends one TFRecord: `u64` length (little-endian), its masked CRC, the data, the data's masked
/// CRC.
fn push_record(out: &mut Vec<u8>, data: &[u8]) {
    let len = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The `{n}` of the file names this process creates, as tensorboard's writer counts them.
static FILE_COUNTER: AtomicU64 = AtomicU64::new(0);

/// One TensorBoard event file, written as the run goes (each call's events are written and
/// flushed before it returns, so TensorBoard shows them while training continues).
pub struct EventWriter {
    file: File,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir` and a new event file named like PyTorch's SummaryWriter:
    /// `events.out.tfevents.{unix_secs}.{hostname}.{pid}.{n}`, starting with the file_version
    /// "brain.Event:2" event.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| KilnError::io(dir, e))?;
        let (file, path) = loop {
            let name = format!(
                "events.out.tfevents.{:010}.{}.{}.{}",
                now_secs() as u64,
                super::live::hostname(),
                std::process::id(),
                FILE_COUNTER.fetch_add(1, Ordering::Relaxed)
            );
            let path = dir.join(name);
            match File::options().write(true).create_new(true).open(&path) {
                Ok(f) => break (f, path),
                // Another writer (a process with the same id on another host sharing the folder,
                // or a restart within the same second) took the name: count on.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(KilnError::io(&path, e)),
            }
        };
        let mut writer = Self { file, path };
        writer.write_events(&[Event {
            wall_time: now_secs(),
            step: 0,
            what: Some(What::FileVersion(FILE_VERSION.into())),
            source_metadata: Some(SourceMetadata {
                writer: format!("kiln {}", env!("CARGO_PKG_VERSION")),
            }),
        }])?;
        Ok(writer)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One scalar event per (tag, value), all at `step`; flushed (the file is read while the run
    /// goes on). Values are stored as f32, as TensorBoard's `simple_value` is.
    pub fn add_scalars(&mut self, step: u64, values: &[(String, f64)]) -> Result<()> {
        let wall_time = now_secs();
        let events: Vec<Event> = values
            .iter()
            .map(|(tag, v)| {
                summary_event(
                    wall_time,
                    step,
                    SummaryValue {
                        tag: tag.clone(),
                        metadata: None,
                        value: Some(ValueKind::SimpleValue(*v as f32)),
                    },
                )
            })
            .collect();
        self.write_events(&events)
    }

    /// A text summary as PyTorch's `SummaryWriter.add_text(tag, text, step)` writes it: the tag
    /// `{tag}/text_summary`, the `text` plugin's metadata and a one-element string tensor
    /// (TensorBoard renders it as Markdown). Flushed.
    pub fn add_text(&mut self, tag: &str, step: u64, text: &str) -> Result<()> {
        let value = SummaryValue {
            tag: format!("{tag}/text_summary"),
            metadata: Some(SummaryMetadata {
                plugin_data: Some(PluginData {
                    plugin_name: "text".into(),
                    // TextPluginData(version=0) serialises to no bytes.
                    content: Vec::new(),
                }),
            }),
            value: Some(ValueKind::Tensor(TensorProto {
                dtype: DT_STRING,
                tensor_shape: Some(TensorShapeProto {
                    dim: vec![Dim { size: 1 }],
                }),
                string_val: vec![text.as_bytes().to_vec()],
            })),
        };
        self.write_events(&[summary_event(now_secs(), step, value)])
    }

    /// Frames `events` and writes them with one call, then flushes.
    fn write_events(&mut self, events: &[Event]) -> Result<()> {
        let mut out = Vec::new();
        for e in events {
            push_record(&mut out, &e.encode_to_vec());
        }
        self.file
            .write_all(&out)
            .and_then(|()| self.file.flush())
            .map_err(|e| KilnError::io(&self.path, e))
    }
}

fn summary_event(wall_time: f64, step: u64, value: SummaryValue) -> Event {
    Event {
        wall_time,
        step: i64::try_from(step).unwrap_or(i64::MAX),
        what: Some(What::Summary(Summary { value: vec![value] })),
        source_metadata: None,
    }
}

/// Hugging Face's `rewrite_logs` + `TensorBoardCallback.on_log`: a log entry (a JSON object such
/// as `{"loss":0.5,"learning_rate":1e-5,"grad_norm":2.0,"epoch":0.5,"step":10}` or
/// `{"eval_loss":..,"eval_accuracy":..}`) becomes (tag, value) pairs, in the entry's order: keys
/// starting with `eval_` → `eval/<rest>`, `test_` → `test/<rest>`, everything else →
/// `train/<key>`.
///
/// As transformers 5 does: every number is a scalar, the end-of-training summary's included
/// (`train/train_runtime`, `train/train_loss`, `train/total_flos`, … — no key is special), and
/// a boolean too (Python's `isinstance(True, int)`), as 1 or 0; strings are texts, not scalars
/// (see [`hf_texts`]); anything else is dropped. The `step` key is not a scalar: transformers
/// adds it to `log_history` only, after the callbacks' copy (it is the events' step).
pub fn hf_scalars(entry: &serde_json::Map<String, serde_json::Value>) -> Vec<(String, f64)> {
    entry
        .iter()
        .filter(|(k, _)| k.as_str() != "step")
        .filter_map(|(k, v)| {
            let x = match v {
                serde_json::Value::Number(n) => n.as_f64()?,
                serde_json::Value::Bool(b) => f64::from(u8::from(*b)),
                _ => return None,
            };
            Some((hf_tag(k), x))
        })
        .collect()
}

/// The string values of a log entry, which transformers' `TensorBoardCallback` writes with
/// `add_text` under the same tags as [`hf_scalars`].
pub fn hf_texts(entry: &serde_json::Map<String, serde_json::Value>) -> Vec<(String, String)> {
    entry
        .iter()
        .filter(|(k, _)| k.as_str() != "step")
        .filter_map(|(k, v)| Some((hf_tag(k), v.as_str()?.to_string())))
        .collect()
}

/// transformers' `rewrite_logs` for one key.
fn hf_tag(key: &str) -> String {
    if let Some(rest) = key.strip_prefix("eval_") {
        format!("eval/{rest}")
    } else if let Some(rest) = key.strip_prefix("test_") {
        format!("test/{rest}")
    } else {
        format!("train/{key}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads TFRecords back by hand, checking both CRCs of each.
    fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let len_bytes = &bytes[at..at + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(len_crc, masked_crc(len_bytes), "length CRC at {at}");
            let data = &bytes[at + 12..at + 12 + len];
            let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc(data), "data CRC at {at}");
            out.push(data.to_vec());
            at += 16 + len;
        }
        assert_eq!(at, bytes.len());
        out
    }

    #[test]
    fn masked_crc_of_the_standard_check_string() {
        // CRC-32C's check value (RFC 3720 / the CRC catalogue): crc32c("123456789") = 0xE3069283.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        // Masked: rotate right 15 → 0x2507C60D (0xE3069283 >> 15 = 0x1C60D, low 15 bits 0x1283
        // << 17 = 0x25060000), plus 0xA282EAD8 → 0xC78AB0E5.
        assert_eq!(0xE306_9283u32.rotate_right(15), 0x2507_C60D);
        assert_eq!(masked_crc(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn records_round_trip_with_their_checksums() {
        let mut bytes = Vec::new();
        push_record(&mut bytes, b"");
        push_record(&mut bytes, b"hello");
        push_record(&mut bytes, &[7u8; 300]);
        // Header layout: the length little-endian, first.
        assert_eq!(&bytes[..8], &0u64.to_le_bytes());
        assert_eq!(
            records(&bytes),
            vec![b"".to_vec(), b"hello".to_vec(), vec![7u8; 300]]
        );
        // A flipped bit anywhere fails a check.
        let mut bad = bytes.clone();
        bad[16 + 12 + 2] ^= 1;
        assert!(std::panic::catch_unwind(|| records(&bad)).is_err());
    }

    #[test]
    fn an_event_file_holds_the_version_scalars_and_text() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(&dir.path().join("runs")).unwrap();
        let name = w.path().file_name().unwrap().to_str().unwrap().to_string();
        let parts: Vec<&str> = name.split('.').collect();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        assert_eq!(parts[3].len(), 10, "{name}");
        assert_eq!(
            parts[parts.len() - 2],
            std::process::id().to_string(),
            "{name}"
        );
        w.add_scalars(
            10,
            &[
                ("train/loss".into(), 0.25),
                ("train/learning_rate".into(), 1e-5),
            ],
        )
        .unwrap();
        w.add_text("args", 0, "{\"seed\": 42}").unwrap();
        let events: Vec<Event> = records(&std::fs::read(w.path()).unwrap())
            .iter()
            .map(|r| Event::decode(r.as_slice()).unwrap())
            .collect();
        assert_eq!(events.len(), 4);
        assert_eq!(
            events[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        assert!(events[0].wall_time > 1.5e9);
        let scalar = |e: &Event| match &e.what {
            Some(What::Summary(s)) => match &s.value[..] {
                [SummaryValue {
                    tag,
                    value: Some(ValueKind::SimpleValue(v)),
                    ..
                }] => (e.step, tag.clone(), *v),
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        };
        assert_eq!(scalar(&events[1]), (10, "train/loss".into(), 0.25));
        assert_eq!(
            scalar(&events[2]),
            (10, "train/learning_rate".into(), 1e-5f32)
        );
        let Some(What::Summary(s)) = &events[3].what else {
            panic!("{:?}", events[3])
        };
        let v = &s.value[0];
        assert_eq!(v.tag, "args/text_summary");
        let plugin = v.metadata.as_ref().unwrap().plugin_data.as_ref().unwrap();
        assert_eq!(plugin.plugin_name, "text");
        let Some(ValueKind::Tensor(t)) = &v.value else {
            panic!("{v:?}")
        };
        assert_eq!(t.dtype, DT_STRING);
        assert_eq!(t.tensor_shape.as_ref().unwrap().dim, vec![Dim { size: 1 }]);
        assert_eq!(t.string_val, vec![b"{\"seed\": 42}".to_vec()]);

        // A second writer in the same folder gets its own file.
        let w2 = EventWriter::create(&dir.path().join("runs")).unwrap();
        assert_ne!(w2.path(), w.path());
    }

    #[test]
    fn a_scalar_event_encodes_as_the_proto_says() {
        // Event{wall_time: 1.0, step: 3, summary{value{tag:"a", simple_value: 1.0}}}, by hand:
        // field 1 fixed64, field 2 varint, field 5 length-delimited { field 1 (Value) { tag 1
        // string, tag 2 fixed32 } }.
        let e = summary_event(
            1.0,
            3,
            SummaryValue {
                tag: "a".into(),
                metadata: None,
                value: Some(ValueKind::SimpleValue(1.0)),
            },
        );
        let mut want = vec![0x09];
        want.extend_from_slice(&1.0f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 3, 0x2a, 10, 0x0a, 8, 0x0a, 1, b'a', 0x15]);
        want.extend_from_slice(&1.0f32.to_le_bytes());
        assert_eq!(e.encode_to_vec(), want);
    }

    fn entry(json: &str) -> serde_json::Map<String, serde_json::Value> {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn log_entries_become_hugging_face_tags() {
        let train =
            entry(r#"{"loss":0.5,"grad_norm":2.0,"learning_rate":1e-5,"epoch":0.5,"step":10}"#);
        let got = hf_scalars(&train);
        // Compare as a set of pairs (the order is the entry's).
        let mut got_sorted = got.clone();
        got_sorted.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            got_sorted,
            vec![
                ("train/epoch".to_string(), 0.5),
                ("train/grad_norm".to_string(), 2.0),
                ("train/learning_rate".to_string(), 1e-5),
                ("train/loss".to_string(), 0.5),
            ]
        );
        let eval = entry(
            r#"{"eval_loss":0.7,"eval_accuracy":0.8,"eval_runtime":1.5,"test_f1":0.6,"step":10,"epoch":1,"eval_note":"x","eval_bad":null,"eval_list":[1],"eval_flag":true}"#,
        );
        let mut got: Vec<(String, f64)> = hf_scalars(&eval);
        got.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            got,
            vec![
                ("eval/accuracy".to_string(), 0.8),
                ("eval/flag".to_string(), 1.0),
                ("eval/loss".to_string(), 0.7),
                ("eval/runtime".to_string(), 1.5),
                ("test/f1".to_string(), 0.6),
                ("train/epoch".to_string(), 1.0),
            ]
        );
        assert_eq!(hf_texts(&eval), vec![("eval/note".into(), "x".into())]);
        // The end-of-training summary: every key a train/ scalar, total_flos included.
        let summary = entry(
            r#"{"train_runtime":12.5,"train_samples_per_second":160.0,"train_steps_per_second":10.0,"total_flos":1.5e12,"train_loss":0.65,"epoch":2.0,"step":125}"#,
        );
        let mut got = hf_scalars(&summary);
        got.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            got,
            vec![
                ("train/epoch".to_string(), 2.0),
                ("train/total_flos".to_string(), 1.5e12),
                ("train/train_loss".to_string(), 0.65),
                ("train/train_runtime".to_string(), 12.5),
                ("train/train_samples_per_second".to_string(), 160.0),
                ("train/train_steps_per_second".to_string(), 10.0),
            ]
        );
    }
}
