//! TrainingArguments from layers, each laid over the ones before: kiln's defaults, a task's own
//! defaults, an argument file (YAML or JSON, as transformers' `HfArgumentParser` reads one),
//! transformers flags given by name, and values set explicitly (a command line's own flags).
//! `kiln train` applies this precedence; a program that configures a run the same way gets it
//! here, with the same checks and the same messages.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Map, Value};

use super::TrainingArguments;
use crate::error::{KilnError, Result};
use crate::train::hf_fields::{sort_entries, Sorted, Source};

/// The layers laid so far: [`ArgLayers::new`], then each layer in order, then [`Self::build`].
#[derive(Debug, Clone)]
pub struct ArgLayers {
    /// Every layer's entries so far, later ones over earlier; kiln's defaults fill in the rest
    /// when the arguments are built ([`TrainingArguments::over_defaults`]).
    merged: Map<String, Value>,
    /// transformers fields kept as given, without effect (written back to training_args.json).
    recorded: BTreeMap<String, Value>,
    ignore_unknown: bool,
}

impl ArgLayers {
    /// kiln's defaults. With `ignore_unknown` a key nobody knows only warns
    /// (`--ignore-unknown-args`); otherwise it is an error naming it and where it is.
    pub fn new(ignore_unknown: bool) -> Self {
        Self {
            merged: Map::new(),
            recorded: BTreeMap::new(),
            ignore_unknown,
        }
    }

    /// A task's own defaults (kiln's field names), laid over kiln's.
    pub fn defaults(mut self, defaults: Map<String, Value>) -> Self {
        self.merged.extend(defaults);
        self
    }

    /// A YAML or JSON argument file's keys: transformers' renamed keys take their new name, its
    /// fields kiln does not act on are recorded, a bad value names the file, line and key.
    pub fn file(self, path: &Path) -> Result<Self> {
        let sorted = TrainingArguments::file_entries(path, self.ignore_unknown)?;
        Ok(self.sorted(sorted))
    }

    /// Entries given by transformers' field names (its flags without a kiln option of their own),
    /// from `source` (what messages call it, e.g. "the command line").
    pub fn named(self, entries: Map<String, Value>, source: &str) -> Result<Self> {
        let source = Source {
            name: source.into(),
            text: None,
        };
        let known = TrainingArguments::field_names();
        let sorted = sort_entries(entries, &known, &source, self.ignore_unknown)?;
        Ok(self.sorted(sorted))
    }

    /// Values set explicitly under kiln's field names (a command line's own flags, given there),
    /// laid over everything before.
    pub fn set(mut self, entries: impl IntoIterator<Item = (String, Value)>) -> Self {
        self.merged.extend(entries);
        self
    }

    /// The merged arguments, checked before any model or data is loaded
    /// ([`TrainingArguments::validate`]); a value of the wrong kind names its key.
    pub fn build(self) -> Result<TrainingArguments> {
        let mut args = TrainingArguments::over_defaults(self.merged, |key, e| {
            KilnError::Config(format!("training argument `{key}`: {e}"))
        })?;
        args.recorded = self.recorded;
        args.validate()?;
        Ok(args)
    }

    fn sorted(mut self, sorted: Sorted) -> Self {
        self.merged.extend(sorted.known);
        self.recorded.extend(sorted.recorded);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn map(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => panic!("an object"),
        }
    }

    /// Each layer overrides the ones before it, and only the keys it gives.
    #[test]
    fn later_layers_win_key_by_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("args.yaml");
        std::fs::write(
            &file,
            "learning_rate: 0.001\nnum_train_epochs: 2\nseed: 7\n",
        )
        .unwrap();
        let args = ArgLayers::new(false)
            .defaults(map(json!({"learning_rate": 0.5, "max_steps": 9})))
            .file(&file)
            .unwrap()
            .named(map(json!({"seed": 11})), "the command line")
            .unwrap()
            .set([("num_train_epochs".to_string(), json!(5.0))])
            .build()
            .unwrap();
        assert_eq!(
            args.learning_rate, 0.001,
            "the file over the task's default"
        );
        assert_eq!(args.max_steps, 9, "a task default no later layer gives");
        assert_eq!(args.seed, 11, "a named flag over the file");
        assert_eq!(
            args.num_train_epochs, 5.0,
            "an explicit value over the file"
        );
        assert_eq!(
            args.weight_decay,
            TrainingArguments::default().weight_decay,
            "kiln's default where no layer gives one"
        );
    }

    /// A value of the wrong kind names its key; an unknown key is an error unless ignored; a
    /// transformers field kiln does not act on is recorded; the checks of validate run.
    #[test]
    fn bad_layers_are_named() {
        let e = ArgLayers::new(false)
            .set([("learning_rate".to_string(), json!("fast"))])
            .build()
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("training argument `learning_rate`"), "{e}");
        let e = ArgLayers::new(false)
            .named(
                map(json!({"lr_sheduler_type": "cosine"})),
                "the command line",
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("lr_sheduler_type") && e.contains("the command line"),
            "{e}"
        );
        let ignored = ArgLayers::new(true)
            .named(
                map(json!({"lr_sheduler_type": "cosine"})),
                "the command line",
            )
            .unwrap()
            .build()
            .unwrap();
        assert!(!ignored.recorded.contains_key("lr_sheduler_type"));
        let recorded = ArgLayers::new(false)
            .named(
                map(json!({"dataloader_num_workers": 4})),
                "the command line",
            )
            .unwrap()
            .build()
            .unwrap();
        assert_eq!(recorded.recorded["dataloader_num_workers"], json!(4));
        let e = ArgLayers::new(false)
            .set([("learning_rate".to_string(), json!(-1.0))])
            .build()
            .unwrap_err()
            .to_string();
        assert!(e.contains("learning_rate"), "validate's check: {e}");
    }
}
