//! The options of `kiln train --task dpo`, under TRL's `DPOConfig` names.

use anyhow::{bail, Result};
use clap::Args;
use kiln::data::preference::PreferenceOptions;
use kiln::tasks::dpo::{DpoData, DpoLossType};

#[derive(Args, Clone, Default)]
#[command(next_help_heading = "Preference optimisation (TRL)")]
pub struct DpoOpts {
    /// How far the policy may move from the reference model: higher stays closer [default: 0.1].
    #[arg(long, value_name = "BETA")]
    beta: Option<f64>,
    /// DPO's loss: `sigmoid` (the DPO paper's), `hinge` (SLiC) or `ipo` [default: sigmoid].
    #[arg(long, value_name = "TYPE")]
    loss_type: Option<String>,
    /// Accepted as TRL accepts it: kiln always computes the reference model's log-probabilities
    /// once, before training (the same numbers as a frozen copy, without holding one).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    precompute_ref_log_probs: Option<bool>,
}

impl DpoOpts {
    /// `max_length`: `--max-length` when given, else TRL's 1024.
    pub fn data(
        &self,
        max_length: Option<usize>,
        pad_to_multiple_of: Option<usize>,
    ) -> Result<DpoData> {
        let max_length = max_length.unwrap_or(1024);
        if max_length < 2 {
            bail!("--max-length {max_length}: a pair needs a prompt token and a completion token");
        }
        let beta = self.beta.unwrap_or(0.1);
        if !(beta.is_finite() && beta > 0.0) {
            bail!("--beta {beta}: β must be a positive number");
        }
        let loss_type = match self.loss_type.as_deref() {
            None => DpoLossType::Sigmoid,
            Some(name) => DpoLossType::from_name(name).ok_or_else(|| {
                anyhow::anyhow!(
                    "--loss-type {name}: kiln implements {} (TRL's other loss types are not \
                     implemented yet)",
                    DpoLossType::NAMES.join(", ")
                )
            })?,
        };
        Ok(DpoData {
            options: PreferenceOptions {
                max_length: Some(max_length),
                eos_token: None,
            },
            beta,
            loss_type,
            pad_to_multiple_of,
        })
    }

    /// Whether any DPO option was given (they mean nothing to the other tasks).
    pub fn any(&self) -> bool {
        self.beta.is_some() || self.loss_type.is_some() || self.precompute_ref_log_probs.is_some()
    }
}
