//! The data options `train` and `eval` share: where the data is, how it is read and tokenized,
//! and how a causal LM's corpus is packed.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use kiln::backend::DeviceSpec;
use kiln::data::{Columns, DataArgs, TextEncoding};
use kiln::tasks::causal_lm::CausalLmOptions;
use kiln::tasks::text_classification::ClassificationOptions;

/// The data only training reads.
#[derive(Args, Clone, Default)]
#[command(next_help_heading = "Data")]
pub struct TrainData {
    /// Training data (.csv, .tsv, .json, .jsonl, .parquet, or a `datasets` save_to_disk folder).
    #[arg(long)]
    train_file: Option<PathBuf>,
    /// The split of --dataset-dir / --dataset-name to train on [default: train].
    #[arg(long, value_name = "SPLIT")]
    train_split: Option<String>,
    /// Train on the first N examples only (transformers' example scripts' name).
    #[arg(long, value_name = "N")]
    max_train_samples: Option<usize>,
}

/// How labelled text is read and tokenized, for training and evaluation alike.
#[derive(Args, Clone)]
#[command(next_help_heading = "Data")]
pub struct DataOpts {
    /// Evaluation data (.csv, .tsv, .json, .jsonl, .parquet, or a `datasets` save_to_disk folder).
    #[arg(long, alias = "validation-file")]
    eval_file: Option<PathBuf>,
    /// The split of --dataset-dir / --dataset-name to evaluate on [default: validation, else
    /// test]; or a fraction (0.1) of the training data held out for evaluation (seeded by --seed).
    #[arg(long, value_name = "SPLIT|FRACTION")]
    eval_split: Option<String>,
    /// A `datasets` DatasetDict folder (`save_to_disk`): its splits are the train and eval data.
    #[arg(long, conflicts_with_all = ["eval_file", "dataset_name"])]
    dataset_dir: Option<PathBuf>,
    /// A dataset on the Hugging Face Hub (`name` or `org/name`), read from the Parquet files the
    /// Hub converts every public dataset to (downloaded into the Hugging Face cache).
    #[arg(long, conflicts_with = "eval_file")]
    dataset_name: Option<String>,
    /// The Hub dataset's config (subset), when it has several.
    #[arg(long, requires = "dataset_name")]
    dataset_config: Option<String>,
    /// The column holding the text (for SFT: the column of plain-text rows, TRL's
    /// dataset_text_field).
    #[arg(long, default_value = "text", alias = "dataset-text-field")]
    text_column: String,
    /// The column holding the second text of a pair (sentence-pair tasks such as MRPC).
    #[arg(long)]
    text_pair_column: Option<String>,
    /// The column holding the label (names or integer ids).
    #[arg(long, default_value = "label")]
    label_column: String,
    /// Encoding of CSV/TSV files: utf-8, latin-1, windows-1252.
    #[arg(long, default_value = "utf-8")]
    encoding: String,
    /// Fail on the first malformed row instead of skipping and counting it.
    #[arg(long)]
    strict: bool,
    /// Evaluate on the first N examples only.
    #[arg(long, value_name = "N")]
    max_eval_samples: Option<usize>,
    /// Truncate to this many tokens.
    #[arg(long, default_value_t = 128, alias = "max-seq-length")]
    max_length: usize,
    /// Pad every batch to --max-length (fixed shapes) instead of the longest example in the batch.
    #[arg(long)]
    pad_to_max_length: bool,
    /// Round each batch's padded length up to a multiple of N (transformers' `pad_to_multiple_of`),
    /// at most --max-length: fewer distinct shapes. Default 8 on a GPU (tensor cores take
    /// multiples of 8; kiln's kernels are not compiled per length, so larger buckets would only add
    /// padding), 1 (no rounding) on the CPU, whose attention skips padding anyway.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pad_to_multiple_of: Option<u64>,
}

/// `--pad-to-multiple-of`'s default on a GPU: multiples of 8 suit tensor-core GEMMs (transformers'
/// advice for `pad_to_multiple_of`), and bound the lengths a run meets to max_length / 8.
const GPU_PAD_TO_MULTIPLE_OF: usize = 8;

/// How a causal LM's text corpus becomes blocks of tokens.
#[derive(Args, Clone)]
#[command(next_help_heading = "Causal LM")]
pub struct LmOpts {
    /// Tokens per packed block.
    #[arg(long, default_value_t = 128)]
    block_size: usize,
    /// tokenizer.json (or its folder, or a Hub id), when it is not the model folder's.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Causal LM, SFT, DPO and ORPO: the loss (DPO's and ORPO's completion scores) is computed
    /// inside the output head this many tokens at a time, never holding the whole [tokens,
    /// vocabulary] logits (TRL's `nll`, Liger's fused linear cross-entropy); 0 computes the
    /// whole logits first [default: ~256 MB of f32 logits per chunk].
    #[arg(long, value_name = "TOKENS")]
    loss_chunk_size: Option<usize>,
}

impl DataOpts {
    /// `--max-length`.
    pub fn max_length(&self) -> usize {
        self.max_length
    }

    /// `--pad-to-multiple-of`, as given.
    pub fn pad_to_multiple_of(&self) -> Option<usize> {
        self.pad_to_multiple_of.map(|n| n as usize)
    }

    /// `--text-column` (`--dataset-text-field`).
    pub fn text_column(&self) -> &str {
        &self.text_column
    }

    /// The train and eval data (files, or the splits of --dataset-dir / --dataset-name) and the
    /// fraction of the training data to hold out, if one was asked for.
    fn sources(
        &self,
        train: &TrainData,
        want_train: bool,
    ) -> Result<(Option<PathBuf>, Option<PathBuf>, Option<f64>)> {
        let (fraction, split) = match self.eval_split.as_deref() {
            None => (None, None),
            Some(s) => match s.parse::<f64>() {
                Ok(f) if want_train => (Some(f), None),
                Ok(_) => bail!(
                    "--eval-split {s}: a fraction holds out part of the training data; here give \
                     a split name of --dataset-dir or --dataset-name"
                ),
                Err(_) => (None, Some(s)),
            },
        };
        let train_split = train.train_split.as_deref();
        if train.train_file.is_some() && (self.dataset_dir.is_some() || self.dataset_name.is_some())
        {
            bail!("--train-file and --dataset-dir / --dataset-name are two sources: give one");
        }
        let dataset = if let Some(dir) = &self.dataset_dir {
            Some(kiln::data::saved_dataset::dict_splits(
                dir,
                train_split,
                split,
                want_train,
            )?)
        } else if let Some(name) = &self.dataset_name {
            Some(kiln::hub::remote::dataset_splits(
                name,
                self.dataset_config.as_deref(),
                train_split,
                split,
                want_train,
            )?)
        } else {
            None
        };
        match dataset {
            // An explicit fraction holds out training data instead of the default eval split.
            Some((t, _)) if fraction.is_some() => Ok((t, None, fraction)),
            Some((t, e)) => Ok((t, e, None)),
            None => {
                if let Some(name) = split.or(train_split) {
                    bail!(
                        "split {name:?} given without --dataset-dir or --dataset-name (to hold \
                         out part of --train-file, give --eval-split a fraction such as 0.1)"
                    );
                }
                Ok((train.train_file.clone(), self.eval_file.clone(), fraction))
            }
        }
    }

    /// `train`: `None` for `kiln eval` (evaluation data only).
    fn to_data_args(
        &self,
        train: Option<&TrainData>,
        seed: u64,
        labelled: bool,
    ) -> Result<DataArgs> {
        let none = TrainData::default();
        let (train_file, eval_file, eval_split) =
            self.sources(train.unwrap_or(&none), train.is_some())?;
        Ok(DataArgs {
            train_file,
            eval_file,
            eval_split,
            columns: Columns {
                text: self.text_column.clone(),
                text_pair: self.text_pair_column.clone(),
                label: labelled.then(|| self.label_column.clone()),
            },
            encoding: self.encoding.parse::<TextEncoding>()?,
            strict: self.strict,
            max_train_samples: train.and_then(|t| t.max_train_samples),
            max_eval_samples: self.max_eval_samples,
            seed,
        })
    }
    /// `train`: `None` for `kiln eval` (evaluation data only).
    pub fn lm_options(
        &self,
        train: Option<&TrainData>,
        lm: &LmOpts,
        model: Option<PathBuf>,
        from_config: Option<PathBuf>,
    ) -> Result<CausalLmOptions> {
        let none = TrainData::default();
        let (train_file, eval_file, fraction) =
            self.sources(train.unwrap_or(&none), train.is_some())?;
        if fraction.is_some() {
            bail!("--eval-split: a causal LM evaluates on --eval-file or a dataset split, not a held-out fraction");
        }
        Ok(CausalLmOptions {
            model_dir: model,
            from_config,
            tokenizer: lm.tokenizer.clone(),
            train_file,
            eval_file,
            text_column: self.text_column.clone(),
            encoding: self.encoding.parse::<TextEncoding>()?,
            strict: self.strict,
            block_size: lm.block_size,
            max_train_samples: train.and_then(|t| t.max_train_samples),
            max_eval_samples: self.max_eval_samples,
            lora: None,
            lora_base_dtype: Default::default(),
            sft: None,
            dpo: None,
            reward: None,
            loss_chunk: lm.loss_chunk_size,
        })
    }
    pub fn options(
        &self,
        train: Option<&TrainData>,
        model: &std::path::Path,
        seed: u64,
        device: DeviceSpec,
    ) -> Result<ClassificationOptions> {
        let gpu_default = (device != DeviceSpec::Cpu).then_some(GPU_PAD_TO_MULTIPLE_OF);
        Ok(ClassificationOptions {
            model_dir: model.to_path_buf(),
            data: self.to_data_args(train, seed, true)?,
            max_length: self.max_length,
            pad_to_max_length: self.pad_to_max_length,
            pad_to_multiple_of: self.pad_to_multiple_of.map(|n| n as usize).or(gpu_default),
            lora: None,
            lora_base_dtype: Default::default(),
        })
    }
}
