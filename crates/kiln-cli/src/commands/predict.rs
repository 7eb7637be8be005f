//! `kiln predict`: a fine-tuned text classifier's predictions, or a reward model's scores, as JSON
//! lines.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use kiln::data::Columns;
use kiln::tasks::reward;
use kiln::tasks::text_classification as tc;

#[derive(Args)]
pub struct PredictCmd {
    /// A fine-tuned text-classification model folder, a reward model's (`kiln train --task
    /// reward-modeling`, any Llama-family `…ForSequenceClassification`), or a Hub id.
    #[arg(long)]
    pub model: PathBuf,
    /// One text to classify.
    #[arg(long, conflicts_with = "input")]
    text: Vec<String>,
    /// A file of texts: .txt (one per line), or .csv/.jsonl/.parquet with --text-column.
    #[arg(long)]
    input: Option<PathBuf>,
    /// The column holding the text (.csv/.jsonl/.parquet input).
    #[arg(long, default_value = "text")]
    text_column: String,
    /// Encoding of CSV/TSV/TXT input: utf-8, latin-1, windows-1252.
    #[arg(long, default_value = "utf-8")]
    encoding: String,
    /// Write JSON lines here instead of standard output.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Truncate to this many tokens.
    #[arg(long, default_value_t = 128)]
    max_length: usize,
    /// Texts per forward pass.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
}

pub fn run<B: kiln::ops::KilnBackend>(cmd: PredictCmd, device: &B::Device) -> Result<()> {
    let texts = read_texts(&cmd)?;
    let mut out: Box<dyn std::io::Write> = match &cmd.output {
        Some(p) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("{}", p.display()))?,
        )),
        None => Box::new(std::io::stdout().lock()),
    };
    // A reward model (a Llama-family sequence classifier): each text's score, as transformers'
    // text-classification pipeline gives it with `function_to_apply="none"`.
    if reward::is_decoder_classifier(&cmd.model) {
        let scores =
            reward::score_texts::<B>(&cmd.model, &texts, cmd.max_length, cmd.batch_size, device)?;
        for (text, s) in texts.iter().zip(scores) {
            let line = match s.as_slice() {
                [one] => serde_json::json!({"text": text, "score": one}),
                _ => serde_json::json!({"text": text, "scores": s}),
            };
            writeln!(out, "{line}")?;
        }
        return Ok(());
    }
    let preds = tc::predict::<B>(&cmd.model, &texts, cmd.max_length, cmd.batch_size, device)?;
    for p in preds {
        writeln!(out, "{}", serde_json::to_string(&p)?)?;
    }
    Ok(())
}

fn read_texts(cmd: &PredictCmd) -> Result<Vec<String>> {
    if !cmd.text.is_empty() {
        return Ok(cmd.text.clone());
    }
    let Some(path) = &cmd.input else {
        bail!("give --text \"...\" or --input FILE");
    };
    if path.extension().and_then(|e| e.to_str()) == Some("txt") {
        let s = kiln::data::reader::read_text(path, cmd.encoding.parse()?)?;
        return Ok(s
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect());
    }
    let cols = Columns {
        text: cmd.text_column.clone(),
        text_pair: None,
        label: None,
    };
    let (rows, report) =
        kiln::data::reader::read_examples(path, &cols, cmd.encoding.parse()?, false)?;
    tracing::info!("{}: {}", path.display(), report.summary());
    Ok(rows.into_iter().map(|r| r.text).collect())
}
