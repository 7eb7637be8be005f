//! The preference losses over the completion scores of a preference batch: TRL's `DPOTrainer`
//! loss types (with its reverse-KL scores) and its `ORPOTrainer`'s odds-ratio loss.

use burn::tensor::activation::log_sigmoid;
use burn::tensor::{Int, Tensor};

use crate::contract::Loss;
use crate::models::completion_scores::Column;
use crate::ops::KilnBackend;

/// TRL's DPO `loss_type` values kiln implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DpoLossType {
    /// `−log σ(β Δ)`, Δ = (log π/π_ref)(chosen) − (log π/π_ref)(rejected): the DPO paper's loss.
    #[default]
    Sigmoid,
    /// `max(0, 1 − β Δ)` (SLiC's hinge).
    Hinge,
    /// `(Δ̄ − 1/(2β))²` with each log-ratio averaged over its completion's tokens (IPO, as TRL
    /// normalises it).
    Ipo,
}

impl DpoLossType {
    pub const NAMES: [&'static str; 3] = ["sigmoid", "hinge", "ipo"];

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "sigmoid" => Some(Self::Sigmoid),
            "hinge" => Some(Self::Hinge),
            "ipo" => Some(Self::Ipo),
            _ => None,
        }
    }
}

/// How a preference pair is trained on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreferenceMethod {
    /// DPO against the reference model's log-probabilities, with this loss.
    Dpo(DpoLossType),
    /// ORPO (TRL's `ORPOTrainer`): no reference model; the chosen sequence's NLL (its prompt's
    /// tokens too) minus β × the mean log-sigmoid of the log odds ratio of the two answers'
    /// per-token average log-probabilities.
    Orpo,
}

impl PreferenceMethod {
    /// Whether the method needs the reference model's log-probabilities.
    pub fn needs_reference(self) -> bool {
        matches!(self, Self::Dpo(_))
    }
}

/// The loss of a batch of completion scores `[2 × pairs, …]` (every chosen row, then every
/// rejected row, each carrying its reference log-probability after the computed columns): the
/// mean over the pairs. The targets are not read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PreferenceLoss {
    pub beta: f64,
    pub method: PreferenceMethod,
}

impl Loss for PreferenceLoss {
    fn loss<B: KilnBackend>(&self, scores: Tensor<B, 2>, _: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let [rows, _] = scores.dims();
        let pairs = rows / 2;
        let column = |c: usize| scores.clone().narrow(1, c, 1).reshape([rows]);
        let halves = |t: Tensor<B, 1>| (t.clone().narrow(0, 0, pairs), t.narrow(0, pairs, pairs));
        let beta = self.beta;
        let loss_type = match self.method {
            PreferenceMethod::Orpo => return orpo(&column, halves, beta),
            PreferenceMethod::Dpo(t) => t,
        };
        let ratio = column(Column::LogProb.index()) - column(Column::COMPUTED);
        let (chosen, rejected) = halves(ratio);
        let per_pair = match loss_type {
            DpoLossType::Sigmoid => log_sigmoid((chosen - rejected) * beta).neg(),
            DpoLossType::Hinge => ((chosen - rejected) * (-beta) + 1.0).clamp_min(0.0),
            DpoLossType::Ipo => {
                let (nc, nr) = halves(column(Column::Tokens.index()).clamp_min(1.0));
                let delta = chosen / nc - rejected / nr;
                (delta - 1.0 / (2.0 * beta)).powi_scalar(2)
            }
        };
        per_pair.mean()
    }
}

/// ORPO's loss: the chosen rows' mean NLL over all their targets, minus β × the mean of
/// `log σ(log odds)`, the log odds of the answers' average log-probabilities `p̄`:
/// `(p̄c − p̄r) − (log(1 − e^p̄c) − log(1 − e^p̄r))`.
fn orpo<B: KilnBackend>(
    column: &dyn Fn(usize) -> Tensor<B, 1>,
    halves: impl Fn(Tensor<B, 1>) -> (Tensor<B, 1>, Tensor<B, 1>),
    beta: f64,
) -> Tensor<B, 1> {
    let average = column(Column::LogProb.index()) / column(Column::Tokens.index()).clamp_min(1.0);
    let (c, r) = halves(average);
    let log_odds = (c.clone() - r.clone()) - (c.exp().neg().log1p() - r.exp().neg().log1p());
    let (chosen_sum, _) = halves(column(Column::SequenceLogProb.index()));
    let (chosen_tokens, _) = halves(column(Column::SequenceTokens.index()));
    let nll = chosen_sum.sum().neg() / chosen_tokens.sum().clamp_min(1.0);
    nll - log_sigmoid(log_odds).mean() * beta
}
