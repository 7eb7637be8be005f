//! DPO's losses over the completion scores of a preference batch (TRL's `DPOTrainer` loss types,
//! with its reverse-KL scores).

use burn::tensor::activation::log_sigmoid;
use burn::tensor::{Int, Tensor};

use crate::contract::Loss;
use crate::models::completion_scores::Column;
use crate::ops::KilnBackend;

/// TRL's `loss_type` values kiln implements.
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

/// DPO's loss of a batch of completion scores `[2 × pairs, …]` (every chosen row, then every
/// rejected row, each carrying its reference log-probability after the computed columns): the
/// mean over the pairs. The targets are not read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DpoLoss {
    pub beta: f64,
    pub loss_type: DpoLossType,
}

impl Loss for DpoLoss {
    fn loss<B: KilnBackend>(&self, scores: Tensor<B, 2>, _: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let [rows, _] = scores.dims();
        let pairs = rows / 2;
        let column = |c: usize| scores.clone().narrow(1, c, 1).reshape([rows]);
        let ratio = column(Column::LogProb.index()) - column(Column::COMPUTED);
        let chosen = ratio.clone().narrow(0, 0, pairs);
        let rejected = ratio.narrow(0, pairs, pairs);
        let beta = self.beta;
        let per_pair = match self.loss_type {
            DpoLossType::Sigmoid => log_sigmoid((chosen - rejected) * beta).neg(),
            DpoLossType::Hinge => ((chosen - rejected) * (-beta) + 1.0).clamp_min(0.0),
            DpoLossType::Ipo => {
                let tokens = column(Column::Tokens.index()).clamp_min(1.0);
                let delta = chosen / tokens.clone().narrow(0, 0, pairs)
                    - rejected / tokens.narrow(0, pairs, pairs);
                (delta - 1.0 / (2.0 * beta)).powi_scalar(2)
            }
        };
        per_pair.mean()
    }
}
