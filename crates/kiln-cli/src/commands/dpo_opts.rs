//! The options of `kiln train --task dpo`, `--task orpo` and `--task reward-modeling`, under
//! TRL's `DPOConfig` / `ORPOConfig` / `RewardConfig` names.

use anyhow::{bail, Result};
use clap::Args;
use kiln::data::preference::PreferenceOptions;
use kiln::data::reward::RewardOptions;
use kiln::tasks::preference::{DpoLossType, PreferenceData, PreferenceMethod};
use kiln::tasks::reward::RewardData;

#[derive(Args, Clone, Default)]
#[command(next_help_heading = "Preference optimisation (TRL)")]
pub struct DpoOpts {
    /// DPO: how far the policy may move from the reference model (higher stays closer); ORPO:
    /// the weight of the odds-ratio term beside the chosen answer's NLL [default: 0.1].
    #[arg(long, value_name = "BETA")]
    beta: Option<f64>,
    /// DPO's loss: `sigmoid` (the DPO paper's), `hinge` (SLiC) or `ipo` [default: sigmoid].
    #[arg(long, value_name = "TYPE")]
    loss_type: Option<String>,
    /// Accepted as TRL accepts it: kiln always computes the reference model's log-probabilities
    /// once, before training (the same numbers as a frozen copy, without holding one).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    precompute_ref_log_probs: Option<bool>,
    /// Reward modelling: adds this × the mean of (r_chosen + r_rejected)² to the loss, which
    /// keeps rewards centred on 0 (TRL's `center_rewards_coefficient`; 0.01 is its suggestion).
    #[arg(long, value_name = "C")]
    center_rewards_coefficient: Option<f64>,
}

impl DpoOpts {
    /// `max_length`: `--max-length` when given, else TRL's 1024; `orpo`: `--task orpo`.
    pub fn data(
        &self,
        orpo: bool,
        max_length: Option<usize>,
        pad_to_multiple_of: Option<usize>,
    ) -> Result<PreferenceData> {
        let max_length = max_length.unwrap_or(1024);
        if max_length < 2 {
            bail!("--max-length {max_length}: a pair needs a prompt token and a completion token");
        }
        let beta = self.beta.unwrap_or(0.1);
        if !(beta.is_finite() && beta > 0.0) {
            bail!("--beta {beta}: β must be a positive number");
        }
        if orpo && (self.loss_type.is_some() || self.precompute_ref_log_probs.is_some()) {
            bail!(
                "--loss-type and --precompute-ref-log-probs are options of --task dpo: ORPO has \
                 one loss and no reference model"
            );
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
        Ok(PreferenceData {
            options: PreferenceOptions {
                max_length: Some(max_length),
                eos_token: None,
            },
            beta,
            method: if orpo {
                PreferenceMethod::Orpo
            } else {
                PreferenceMethod::Dpo(loss_type)
            },
            pad_to_multiple_of,
        })
    }

    /// `--task reward-modeling`'s settings: `max_length` is `--max-length` when given, else
    /// TRL's 1024.
    pub fn reward(
        &self,
        max_length: Option<usize>,
        pad_to_multiple_of: Option<usize>,
    ) -> Result<RewardData> {
        if self.any() {
            bail!(
                "--beta, --loss-type and --precompute-ref-log-probs are options of --task dpo \
                 (and --beta of --task orpo), not of reward modelling"
            );
        }
        if let Some(c) = self.center_rewards_coefficient {
            if !(c.is_finite() && c >= 0.0) {
                bail!("--center-rewards-coefficient {c}: must be a number ≥ 0");
            }
        }
        let max_length = max_length.unwrap_or(1024);
        if max_length < 1 {
            bail!("--max-length {max_length}: a side needs at least one token");
        }
        Ok(RewardData {
            options: RewardOptions {
                max_length: Some(max_length),
                eos_token: None,
            },
            center_rewards_coefficient: self.center_rewards_coefficient,
            pad_to_multiple_of,
        })
    }

    /// Whether any DPO option was given (they mean nothing to the other tasks).
    pub fn any(&self) -> bool {
        self.beta.is_some() || self.loss_type.is_some() || self.precompute_ref_log_probs.is_some()
    }

    /// Whether a reward-modelling option was given.
    pub fn any_reward(&self) -> bool {
        self.center_rewards_coefficient.is_some()
    }
}
