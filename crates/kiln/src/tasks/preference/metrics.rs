//! The metrics TRL's preference trainers log, in training and evaluation, from a batch's
//! completion scores: the implicit rewards of each side, how often the chosen one wins and by how
//! much, the log-probabilities, and (DPO) the per-token statistics of the fused head or (ORPO)
//! the NLL and log odds.

use super::loss::PreferenceMethod;
use crate::models::completion_scores::Column;
use crate::train::trainer::TokenMetrics;

/// TRL's logged metrics of `method`, under its names (`rewards/chosen`, …); β scales the rewards.
#[derive(Debug, Clone, Copy)]
pub struct PreferenceMetrics {
    pub beta: f64,
    pub method: PreferenceMethod,
}

/// How many sums a batch adds.
const SUMS: usize = 14;

impl TokenMetrics for PreferenceMetrics {
    fn batch(&self, scores: &[f32], width: usize, _: &[i64]) -> Vec<f64> {
        let mut sums = vec![0.0; SUMS];
        if scores.is_empty() {
            return sums;
        }
        let rows: Vec<&[f32]> = scores.chunks(width).collect();
        let pairs = rows.len() / 2;
        for (chosen, rejected) in rows[..pairs].iter().zip(&rows[pairs..]) {
            let add = match self.method {
                PreferenceMethod::Dpo(_) => self.dpo_sums(chosen, rejected),
                PreferenceMethod::Orpo => self.orpo_sums(chosen, rejected),
            };
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
        let shared = [
            ("rewards/chosen", t[0] / pairs),
            ("rewards/rejected", t[1] / pairs),
            ("rewards/accuracies", t[2] / pairs),
            ("rewards/margins", t[3] / pairs),
            ("logps/chosen", t[4] / pairs),
            ("logps/rejected", t[5] / pairs),
        ];
        let own: Vec<(&str, f64)> = match self.method {
            PreferenceMethod::Dpo(_) => vec![
                ("logits/chosen", ratio(t[6], t[7])),
                ("logits/rejected", ratio(t[8], t[9])),
                ("mean_token_accuracy", ratio(t[10], t[7])),
                ("entropy", ratio(t[11], t[12])),
            ],
            PreferenceMethod::Orpo => vec![
                ("nll_loss", ratio(t[6], t[7])),
                ("log_odds_ratio", t[8] / pairs),
                ("log_odds_chosen", t[9] / pairs),
            ],
        };
        shared
            .into_iter()
            .chain(own)
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }
}

impl PreferenceMetrics {
    /// One pair's sums for DPO: rewards β·log(π/π_ref), and the fused head's token statistics.
    fn dpo_sums(&self, chosen: &[f32], rejected: &[f32]) -> [f64; SUMS] {
        let at = |row: &[f32], c: Column| f64::from(row[c.index()]);
        let reference = |row: &[f32]| f64::from(row[Column::COMPUTED]);
        let (c, r) = (at(chosen, Column::LogProb), at(rejected, Column::LogProb));
        let reward_c = self.beta * (c - reference(chosen));
        let reward_r = self.beta * (r - reference(rejected));
        [
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
        ]
    }

    /// One pair's sums for ORPO: rewards β·p̄ of the answers' average log-probabilities, the
    /// chosen sequence's NLL, the log odds.
    fn orpo_sums(&self, chosen: &[f32], rejected: &[f32]) -> [f64; SUMS] {
        let at = |row: &[f32], c: Column| f64::from(row[c.index()]);
        let average = |row: &[f32]| at(row, Column::LogProb) / at(row, Column::Tokens).max(1.0);
        let (c, r) = (average(chosen), average(rejected));
        let log1mexp = |x: f64| (-x.exp()).ln_1p();
        let log_odds = (c - r) - (log1mexp(c) - log1mexp(r));
        let log_sigmoid = if log_odds >= 0.0 {
            -(-log_odds).exp().ln_1p()
        } else {
            log_odds - log_odds.exp().ln_1p()
        };
        let (reward_c, reward_r) = (self.beta * c, self.beta * r);
        [
            reward_c,
            reward_r,
            f64::from(u8::from(reward_c > reward_r)),
            reward_c - reward_r,
            c,
            r,
            -at(chosen, Column::SequenceLogProb),
            at(chosen, Column::SequenceTokens),
            log_sigmoid,
            log_odds,
            0.0,
            0.0,
            0.0,
            1.0,
        ]
    }
}
