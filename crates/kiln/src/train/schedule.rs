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
    /// Cosine decay restarting `num_cycles` times (hard restarts).
    CosineWithRestarts,
    /// (lr − lr_end) · remaining^power + lr_end.
    Polynomial,
    /// 1 / √((step + timescale − warmup) / timescale) after warmup.
    InverseSqrt,
    /// Cosine decay down to min_lr (or min_lr_rate × lr).
    CosineWithMinLr,
    /// Warmup, a constant stretch, then a decay over num_decay_steps.
    WarmupStableDecay,
    /// torch's ReduceLROnPlateau: the rate drops by `factor` when the evaluation metric
    /// (metric_for_best_model, default loss) stops improving; stepped after each evaluation,
    /// without warmup, as transformers' Trainer does.
    ReduceLrOnPlateau,
}

/// `lr_scheduler_kwargs`, with transformers' defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerKwargs {
    /// cosine: 0.5 (half a wave); cosine_with_restarts: 1; cosine_with_min_lr: 0.5;
    /// warmup_stable_decay (cosine decay): 0.5.
    pub num_cycles: Option<f64>,
    /// polynomial.
    pub power: f64,
    pub lr_end: f64,
    /// inverse_sqrt (default: the warmup steps, or 10 000 without warmup).
    pub timescale: Option<f64>,
    /// cosine_with_min_lr: one of the two.
    pub min_lr: Option<f64>,
    pub min_lr_rate: Option<f64>,
    /// warmup_stable_decay.
    pub num_decay_steps: Option<u64>,
    pub num_stable_steps: Option<u64>,
    pub min_lr_ratio: f64,
    pub warmup_type: String,
    pub decay_type: String,
    /// reduce_lr_on_plateau (torch's ReduceLROnPlateau keywords; `min_lr` above, default 0).
    pub mode: String,
    pub factor: f64,
    pub patience: u64,
    pub threshold: f64,
    pub threshold_mode: String,
    pub cooldown: u64,
    pub eps: f64,
}

impl Default for SchedulerKwargs {
    fn default() -> Self {
        Self {
            num_cycles: None,
            power: 1.0,
            lr_end: 1e-7,
            timescale: None,
            min_lr: None,
            min_lr_rate: None,
            num_decay_steps: None,
            num_stable_steps: None,
            min_lr_ratio: 0.0,
            warmup_type: "linear".into(),
            decay_type: "cosine".into(),
            mode: "min".into(),
            factor: 0.1,
            patience: 10,
            threshold: 1e-4,
            threshold_mode: "rel".into(),
            cooldown: 0,
            eps: 1e-8,
        }
    }
}

/// A schedule: the type, its options and the base learning rate, checked together.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub kind: SchedulerType,
    pub kw: SchedulerKwargs,
    pub lr: f64,
}

impl Schedule {
    /// Reads `lr_scheduler_kwargs` for `kind`; an option the type does not take, a missing
    /// required one, or an impossible value is an error naming it.
    pub fn new(
        kind: SchedulerType,
        kwargs: Option<&serde_json::Value>,
        lr: f64,
    ) -> Result<Self, String> {
        let kw: SchedulerKwargs = match kwargs {
            None | Some(serde_json::Value::Null) => SchedulerKwargs::default(),
            Some(v) => serde_json::from_value(v.clone())
                .map_err(|e| format!("lr_scheduler_kwargs: {e}"))?,
        };
        let given: Vec<String> = kwargs
            .and_then(|v| v.as_object())
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default();
        use SchedulerType as S;
        let takes: &[&str] = match kind {
            S::Linear | S::Constant | S::ConstantWithWarmup => &[],
            S::Cosine | S::CosineWithRestarts => &["num_cycles"],
            S::Polynomial => &["power", "lr_end"],
            S::InverseSqrt => &["timescale"],
            S::CosineWithMinLr => &["num_cycles", "min_lr", "min_lr_rate"],
            S::WarmupStableDecay => &[
                "num_decay_steps",
                "num_stable_steps",
                "min_lr_ratio",
                "warmup_type",
                "decay_type",
                "num_cycles",
            ],
            S::ReduceLrOnPlateau => &[
                "mode",
                "factor",
                "patience",
                "threshold",
                "threshold_mode",
                "cooldown",
                "min_lr",
                "eps",
            ],
        };
        if let Some(k) = given.iter().find(|k| !takes.contains(&k.as_str())) {
            return Err(format!(
                "lr_scheduler_kwargs: {kind:?} takes no `{k}` (it takes: {})",
                if takes.is_empty() {
                    "nothing".to_string()
                } else {
                    takes.join(", ")
                }
            ));
        }
        match kind {
            S::Polynomial if lr <= kw.lr_end => {
                return Err(format!(
                    "lr_scheduler_kwargs: lr_end ({}) must be below the learning rate ({lr})",
                    kw.lr_end
                ))
            }
            S::InverseSqrt if kw.timescale.is_some_and(|t| t <= 0.0 || !t.is_finite()) => {
                return Err(format!(
                    "lr_scheduler_kwargs: timescale must be above 0, got {}",
                    kw.timescale.unwrap_or_default()
                ))
            }
            S::CosineWithMinLr if kw.min_lr.is_some() == kw.min_lr_rate.is_some() => {
                return Err(
                    "lr_scheduler_kwargs: cosine_with_min_lr needs one of min_lr and min_lr_rate"
                        .into(),
                )
            }
            S::WarmupStableDecay if kw.num_decay_steps.is_none() => {
                return Err("lr_scheduler_kwargs: warmup_stable_decay needs num_decay_steps".into())
            }
            S::WarmupStableDecay
                if !["linear", "cosine", "1-sqrt"].contains(&kw.warmup_type.as_str())
                    || !["linear", "cosine", "1-sqrt"].contains(&kw.decay_type.as_str()) =>
            {
                return Err(
                    "lr_scheduler_kwargs: warmup_type and decay_type are linear, cosine or 1-sqrt"
                        .into(),
                )
            }
            S::ReduceLrOnPlateau if !(kw.factor < 1.0 && kw.factor >= 0.0) => {
                return Err(format!(
                    "lr_scheduler_kwargs: factor must be in [0, 1), got {}",
                    kw.factor
                ))
            }
            S::ReduceLrOnPlateau if !["min", "max"].contains(&kw.mode.as_str()) => {
                return Err(format!(
                    "lr_scheduler_kwargs: mode is min or max, got {:?}",
                    kw.mode
                ))
            }
            S::ReduceLrOnPlateau if !["rel", "abs"].contains(&kw.threshold_mode.as_str()) => {
                return Err(format!(
                    "lr_scheduler_kwargs: threshold_mode is rel or abs, got {:?}",
                    kw.threshold_mode
                ))
            }
            _ => {}
        }
        Ok(Self { kind, kw, lr })
    }

    /// The multiplier of the base learning rate used by optimizer step `step` (0-based) of
    /// `total`, after `warmup` warmup steps — transformers' `get_scheduler` lambdas.
    pub fn factor(&self, step: u64, warmup: u64, total: u64) -> f64 {
        use std::f64::consts::PI;
        use SchedulerType as S;
        let (s, w, t) = (step as f64, warmup as f64, total as f64);
        let kw = &self.kw;
        let warming = step < warmup;
        let ramp = s / w.max(1.0);
        let progress = (s - w) / (t - w).max(1.0);
        match self.kind {
            // Its rate follows the evaluations ([`Plateau`]), not the step.
            S::Constant | S::ReduceLrOnPlateau => 1.0,
            _ if warming && self.kind != S::WarmupStableDecay => ramp,
            S::ConstantWithWarmup => 1.0,
            S::Linear => ((t - s) / (t - w).max(1.0)).max(0.0),
            S::Cosine => {
                let cycles = kw.num_cycles.unwrap_or(0.5);
                (0.5 * (1.0 + (PI * cycles * 2.0 * progress).cos())).max(0.0)
            }
            S::CosineWithRestarts => {
                if progress >= 1.0 {
                    return 0.0;
                }
                let cycles = kw.num_cycles.unwrap_or(1.0);
                (0.5 * (1.0 + (PI * ((cycles * progress) % 1.0)).cos())).max(0.0)
            }
            S::Polynomial => {
                if step > total {
                    return kw.lr_end / self.lr;
                }
                let remaining = 1.0 - (s - w) / (t - w);
                ((self.lr - kw.lr_end) * remaining.powf(kw.power) + kw.lr_end) / self.lr
            }
            S::InverseSqrt => {
                let timescale = kw
                    .timescale
                    .unwrap_or(if warmup > 0 { w } else { 10_000.0 });
                1.0 / ((s + timescale - w) / timescale).sqrt()
            }
            S::CosineWithMinLr => {
                let rate = kw
                    .min_lr_rate
                    .unwrap_or_else(|| kw.min_lr.unwrap_or(0.0) / self.lr);
                let cycles = kw.num_cycles.unwrap_or(0.5);
                let f = 0.5 * (1.0 + (PI * cycles * 2.0 * progress).cos());
                (f * (1.0 - rate) + rate).max(0.0)
            }
            S::WarmupStableDecay => {
                let decay = kw.num_decay_steps.unwrap_or(0);
                let stable = kw
                    .num_stable_steps
                    .unwrap_or_else(|| total.saturating_sub(warmup + decay));
                let floor = kw.min_lr_ratio;
                let shape = |kind: &str, p: f64, rising: bool| match (kind, rising) {
                    ("linear", true) => p,
                    ("linear", false) => 1.0 - p,
                    ("cosine", true) => 0.5 * (1.0 - (PI * p).cos()),
                    ("cosine", false) => {
                        0.5 * (1.0 + (PI * kw.num_cycles.unwrap_or(0.5) * 2.0 * p).cos())
                    }
                    (_, true) => 1.0 - (1.0 - p).sqrt(),
                    (_, false) => 1.0 - p.sqrt(),
                };
                if warming {
                    (shape(&kw.warmup_type, ramp, true) * (1.0 - floor) + floor).max(0.0)
                } else if step < warmup + stable {
                    1.0
                } else if step < warmup + stable + decay {
                    let p = (step - warmup - stable) as f64 / (decay.max(1)) as f64;
                    (shape(&kw.decay_type, p, false) * (1.0 - floor) + floor).max(0.0)
                } else {
                    floor
                }
            }
        }
    }
}

/// reduce_lr_on_plateau's state, as torch's `ReduceLROnPlateau` keeps it: the rate now, the best
/// metric so far, and the counters. Saved in scheduler.json, so a resumed run goes on exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plateau {
    pub lr: f64,
    /// `None` before the first evaluation (torch's ±inf, which JSON cannot hold).
    pub best: Option<f64>,
    pub num_bad_epochs: u64,
    pub cooldown_counter: u64,
    /// Evaluations seen.
    pub last_epoch: u64,
}

impl Plateau {
    pub fn new(lr: f64) -> Self {
        Self {
            lr,
            best: None,
            num_bad_epochs: 0,
            cooldown_counter: 0,
            last_epoch: 0,
        }
    }

    /// One evaluation's `metric`: counts it as an improvement or not, and lowers the rate after
    /// more than `patience` evaluations without one (torch's `ReduceLROnPlateau.step`).
    pub fn step(&mut self, metric: f64, kw: &SchedulerKwargs) {
        self.last_epoch += 1;
        let max = kw.mode == "max";
        let better = match self.best {
            None => {
                if max {
                    metric > f64::NEG_INFINITY
                } else {
                    metric < f64::INFINITY
                }
            }
            Some(best) => match (max, kw.threshold_mode == "abs") {
                (false, false) => metric < best * (1.0 - kw.threshold),
                (false, true) => metric < best - kw.threshold,
                (true, false) => metric > best * (1.0 + kw.threshold),
                (true, true) => metric > best + kw.threshold,
            },
        };
        if better {
            self.best = Some(metric);
            self.num_bad_epochs = 0;
        } else {
            self.num_bad_epochs += 1;
        }
        if self.cooldown_counter > 0 {
            self.cooldown_counter -= 1;
            self.num_bad_epochs = 0; // bad evaluations in cooldown do not count
        }
        if self.num_bad_epochs > kw.patience {
            let new = (self.lr * kw.factor).max(kw.min_lr.unwrap_or(0.0));
            if self.lr - new > kw.eps {
                self.lr = new;
            }
            self.cooldown_counter = kw.cooldown;
            self.num_bad_epochs = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every schedule, step by step, against transformers' `get_scheduler`
    /// (tests/fixtures/lr_schedules.json, from tests/fixtures/gen_lr_schedules.py).
    #[test]
    fn every_schedule_matches_transformers() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/lr_schedules.json"
        );
        let fx: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let lr = fx["learning_rate"].as_f64().unwrap();
        let (total, warmup) = (
            fx["total"].as_u64().unwrap(),
            fx["warmup"].as_u64().unwrap(),
        );
        for case in fx["cases"].as_array().unwrap() {
            let kind: SchedulerType = serde_json::from_value(case["type"].clone()).unwrap();
            let kwargs = case["kwargs"].clone();
            let sched = Schedule::new(kind, Some(&kwargs), lr).unwrap();
            for (step, want) in case["lrs"].as_array().unwrap().iter().enumerate() {
                let want = want.as_f64().unwrap();
                let got = lr * sched.factor(step as u64, warmup, total);
                assert!(
                    (got - want).abs() <= 1e-12 + 1e-9 * want.abs(),
                    "{kind:?} {kwargs} step {step}: kiln {got}, transformers {want}"
                );
            }
        }
    }

    /// reduce_lr_on_plateau against torch's ReduceLROnPlateau fed the same metrics
    /// (the fixture's `plateau` cases), including a resume from the saved state mid-way.
    #[test]
    fn reduce_lr_on_plateau_matches_torch() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/lr_schedules.json"
        );
        let fx: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let lr = fx["learning_rate"].as_f64().unwrap();
        let cases = fx["plateau"].as_array().unwrap();
        assert!(cases.len() >= 4);
        for case in cases {
            let kwargs = case["kwargs"].clone();
            let sched = Schedule::new(SchedulerType::ReduceLrOnPlateau, Some(&kwargs), lr).unwrap();
            let metrics: Vec<f64> = serde_json::from_value(case["metrics"].clone()).unwrap();
            let want: Vec<f64> = serde_json::from_value(case["lrs"].clone()).unwrap();
            let mut p = Plateau::new(lr);
            for (i, (&m, &w)) in metrics.iter().zip(&want).enumerate() {
                p.step(m, &sched.kw);
                assert!(
                    (p.lr - w).abs() <= 1e-15 + 1e-12 * w,
                    "{kwargs} after evaluation {i}: kiln {}, torch {w}",
                    p.lr
                );
                // Through scheduler.json and back, as a resumed run reads it.
                p = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
            }
            assert!(
                want.last() < want.first(),
                "{kwargs}: the rate never dropped"
            );
        }
    }

    #[test]
    fn options_a_schedule_does_not_take_are_refused_by_name() {
        let e = Schedule::new(
            SchedulerType::Linear,
            Some(&serde_json::json!({"num_cycles": 2})),
            1e-3,
        )
        .unwrap_err();
        assert!(e.contains("takes no `num_cycles`"), "{e}");
        let e = Schedule::new(
            SchedulerType::Cosine,
            Some(&serde_json::json!({"num_cylces": 2})),
            1e-3,
        )
        .unwrap_err();
        assert!(e.contains("num_cylces"), "{e}");
        let e = Schedule::new(SchedulerType::WarmupStableDecay, None, 1e-3).unwrap_err();
        assert!(e.contains("needs num_decay_steps"), "{e}");
        let e = Schedule::new(
            SchedulerType::InverseSqrt,
            Some(&serde_json::json!({"timescale": 0})),
            1e-3,
        )
        .unwrap_err();
        assert!(e.contains("timescale must be above 0"), "{e}");
        // reduce_lr_on_plateau's options, as torch checks them.
        let plateau = |kw: serde_json::Value| {
            Schedule::new(SchedulerType::ReduceLrOnPlateau, Some(&kw), 1e-3).unwrap_err()
        };
        let e = plateau(serde_json::json!({"factor": 1.5}));
        assert!(e.contains("factor must be in [0, 1)"), "{e}");
        let e = plateau(serde_json::json!({"num_cycles": 2}));
        assert!(e.contains("takes no `num_cycles`"), "{e}");
    }
}
