//! Learning-rate schedules with warmup, as transformers' `get_scheduler` defines them.

use serde::{Deserialize, Serialize};

/// transformers' `lr_scheduler_type` names (`constant_with_warmup`; the dashed spelling is
/// accepted on the command line too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum SchedulerType {
    #[default]
    Linear,
    Cosine,
    Constant,
    #[value(alias = "constant-with-warmup")]
    ConstantWithWarmup,
}

/// The multiplier of the base learning rate used by optimizer step `step` (0-based) of `total`.
pub fn lr_factor(kind: SchedulerType, step: u64, warmup: u64, total: u64) -> f64 {
    let (s, w, t) = (step as f64, warmup as f64, total as f64);
    if kind != SchedulerType::Constant && step < warmup {
        return s / w.max(1.0);
    }
    match kind {
        SchedulerType::Constant | SchedulerType::ConstantWithWarmup => 1.0,
        SchedulerType::Linear => ((t - s) / (t - w).max(1.0)).max(0.0),
        SchedulerType::Cosine => {
            let progress = (s - w) / (t - w).max(1.0);
            (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_warmup_then_decay_matches_transformers() {
        // transformers: lambda(s) = s/w for s < w, else (t - s)/(t - w).
        assert_eq!(lr_factor(SchedulerType::Linear, 0, 10, 110), 0.0);
        assert_eq!(lr_factor(SchedulerType::Linear, 5, 10, 110), 0.5);
        assert_eq!(lr_factor(SchedulerType::Linear, 10, 10, 110), 1.0);
        assert_eq!(lr_factor(SchedulerType::Linear, 60, 10, 110), 0.5);
        assert_eq!(lr_factor(SchedulerType::Linear, 110, 10, 110), 0.0);
    }

    #[test]
    fn cosine_and_constant() {
        assert!((lr_factor(SchedulerType::Cosine, 60, 10, 110) - 0.5).abs() < 1e-12);
        assert!(lr_factor(SchedulerType::Cosine, 110, 10, 110).abs() < 1e-12);
        assert_eq!(lr_factor(SchedulerType::Constant, 0, 10, 110), 1.0);
        assert_eq!(lr_factor(SchedulerType::ConstantWithWarmup, 2, 4, 110), 0.5);
    }
}
