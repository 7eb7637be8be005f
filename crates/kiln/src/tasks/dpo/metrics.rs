//! The metrics TRL's `DPOTrainer` logs, in training and evaluation, from a batch's completion
//! scores: the implicit rewards β·log(π/π_ref) of each side, how often the chosen one wins and by
//! how much, the log-probabilities, and the per-token statistics of the fused head.

use crate::models::completion_scores::Column;
use crate::train::trainer::TokenMetrics;

/// TRL's logged DPO metrics, under its names (`rewards/chosen`, …); β scales the rewards.
#[derive(Debug, Clone, Copy)]
pub struct DpoMetrics {
    pub beta: f64,
}

/// The sums a batch adds, in order.
const SUMS: [&str; 14] = [
    "reward_chosen",
    "reward_rejected",
    "wins",
    "margin",
    "logp_chosen",
    "logp_rejected",
    "mean_logit_chosen",
    "tokens_chosen",
    "mean_logit_rejected",
    "tokens_rejected",
    "top1_chosen",
    "entropy",
    "tokens",
    "pairs",
];

impl TokenMetrics for DpoMetrics {
    fn batch(&self, scores: &[f32], width: usize, _: &[i64]) -> Vec<f64> {
        let mut sums = vec![0.0; SUMS.len()];
        if scores.is_empty() {
            return sums;
        }
        let rows: Vec<&[f32]> = scores.chunks(width).collect();
        let pairs = rows.len() / 2;
        let at = |row: &[f32], c: Column| f64::from(row[c.index()]);
        let reference = |row: &[f32]| f64::from(row[Column::COMPUTED]);
        for (chosen, rejected) in rows[..pairs].iter().zip(&rows[pairs..]) {
            let (c, r) = (at(chosen, Column::LogProb), at(rejected, Column::LogProb));
            let reward_c = self.beta * (c - reference(chosen));
            let reward_r = self.beta * (r - reference(rejected));
            let add = [
                reward_c,
                reward_r,
                f64::from(u8::from(reward_c > reward_r)),
                reward_c - reward_r,
                c,
                r,
                at(chosen, Column::MeanLogit),
                at(chosen, Column::Tokens),
                at(rejected, Column::MeanLogit),
                at(rejected, Column::Tokens),
                at(chosen, Column::Top1),
                at(chosen, Column::Entropy) + at(rejected, Column::Entropy),
                at(chosen, Column::Tokens) + at(rejected, Column::Tokens),
                1.0,
            ];
            sums.iter_mut().zip(add).for_each(|(s, a)| *s += a);
        }
        sums
    }

    fn finish(&self, t: &[f64]) -> Vec<(String, f64)> {
        let pairs = t[13];
        if pairs == 0.0 {
            return Vec::new();
        }
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        [
            ("rewards/chosen", t[0] / pairs),
            ("rewards/rejected", t[1] / pairs),
            ("rewards/accuracies", t[2] / pairs),
            ("rewards/margins", t[3] / pairs),
            ("logps/chosen", t[4] / pairs),
            ("logps/rejected", t[5] / pairs),
            ("logits/chosen", ratio(t[6], t[7])),
            ("logits/rejected", ratio(t[8], t[9])),
            ("mean_token_accuracy", ratio(t[10], t[7])),
            ("entropy", ratio(t[11], t[12])),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}
