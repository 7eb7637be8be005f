//! The order in which each pipeline stage runs its micro-batches' forwards and backwards.
//!
//! - **1F1B** (PipeDream-Flush, Megatron's and NxD's non-interleaved schedule): stage `s` of `p`
//!   runs `min(p - s - 1, m)` warm-up forwards, then alternates one forward and one backward until
//!   its forwards are done, then runs the remaining backwards (cool-down). A stage never holds more
//!   than `min(p - s, m)` micro-batches' activations, whatever `m`.
//! - **GPipe**: every forward, then every backward. It holds all `m` micro-batches' activations;
//!   it is kept as the simple reference the 1F1B runs are checked against.
//!
//! Both have the same bubble with uniform stages, `(p - 1) / (m + p - 1)` of the step
//! ([`simulate`] measures it for any costs). A forward of micro-batch `i` on stage `s > 0` needs
//! stage `s - 1`'s output for `i`; a backward needs stage `s + 1`'s input gradient for `i` (the
//! last stage starts from its own loss). Sends do not wait for their receiver (they are queued),
//! so a stage only ever waits on a receive.

use std::fmt;

use crate::{KilnError, Result};

/// Which schedule a pipeline runs (`--pipeline-schedule`; `pipeline_schedule` in argument files,
/// read and written as its name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum ScheduleKind {
    #[default]
    OneFOneB,
    GPipe,
}

impl ScheduleKind {
    /// `1f1b` or `gpipe`, as `--pipeline-schedule` takes them.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "1f1b" => Ok(Self::OneFOneB),
            "gpipe" => Ok(Self::GPipe),
            _ => Err(KilnError::Config(format!(
                "--pipeline-schedule {s:?} is not a pipeline schedule (1f1b or gpipe)"
            ))),
        }
    }

    /// The most micro-batches whose activations stage `stage` of `stages` holds at once.
    pub fn in_flight_bound(self, stages: usize, stage: usize, micro_batches: usize) -> usize {
        match self {
            Self::OneFOneB => (stages - stage).min(micro_batches),
            Self::GPipe => micro_batches,
        }
    }
}

impl ScheduleKind {
    /// [`Self::parse`] as a flag's value parser (the error as text).
    pub fn from_flag(s: &str) -> std::result::Result<Self, String> {
        Self::parse(s).map_err(|e| e.to_string())
    }
}

impl TryFrom<String> for ScheduleKind {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        Self::from_flag(&s)
    }
}

impl From<ScheduleKind> for String {
    fn from(k: ScheduleKind) -> String {
        k.to_string()
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::OneFOneB => "1f1b",
            Self::GPipe => "gpipe",
        })
    }
}

/// One step of a stage's work on micro-batch `.0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    Forward(usize),
    Backward(usize),
}

/// What stage `stage` of `stages` runs in one optimizer step of `micro_batches` micro-batches, in
/// order.
pub fn stage_actions(
    kind: ScheduleKind,
    stages: usize,
    stage: usize,
    micro_batches: usize,
) -> Vec<Action> {
    assert!(stage < stages, "stage {stage} of {stages}");
    let m = micro_batches;
    let mut out = Vec::with_capacity(2 * m);
    match kind {
        ScheduleKind::GPipe => {
            out.extend((0..m).map(Action::Forward));
            out.extend((0..m).map(Action::Backward));
        }
        ScheduleKind::OneFOneB => {
            let warm_up = (stages - stage - 1).min(m);
            out.extend((0..warm_up).map(Action::Forward));
            for i in 0..m - warm_up {
                out.push(Action::Forward(warm_up + i));
                out.push(Action::Backward(i));
            }
            out.extend((m - warm_up..m).map(Action::Backward));
        }
    }
    out
}

/// When each stage ran each of its actions, in [`simulate`]'s units of time.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// Per stage, its actions in order with their start and end.
    pub stages: Vec<Vec<(Action, f64, f64)>>,
}

impl Timeline {
    /// When the last action ended: the step's length.
    pub fn makespan(&self) -> f64 {
        self.stages
            .iter()
            .filter_map(|s| s.last().map(|a| a.2))
            .fold(0.0, f64::max)
    }

    /// The share of the stages' time spent idle: 1 − busy / (stages × makespan).
    pub fn bubble_fraction(&self) -> f64 {
        let busy: f64 = self.stages.iter().flatten().map(|a| a.2 - a.1).sum();
        let span = self.makespan() * self.stages.len() as f64;
        if span == 0.0 {
            0.0
        } else {
            1.0 - busy / span
        }
    }
}

/// The 1F1B (and GPipe) bubble with uniform stages: `(p − 1) / (m + p − 1)`.
pub fn bubble_formula(stages: usize, micro_batches: usize) -> f64 {
    (stages - 1) as f64 / (micro_batches + stages - 1) as f64
}

/// Runs `kind`'s schedule over `stages` stages as an event simulation: each stage runs its actions
/// in order, each as soon as the stage is free and what it receives has arrived (a forward takes
/// `forward` units, a backward `backward`, hand-overs are instant). An error names the stage and
/// action that would wait forever (a schedule that deadlocks).
pub fn simulate(
    kind: ScheduleKind,
    stages: usize,
    micro_batches: usize,
    forward: f64,
    backward: f64,
) -> Result<Timeline> {
    let plans: Vec<Vec<Action>> = (0..stages)
        .map(|s| stage_actions(kind, stages, s, micro_batches))
        .collect();
    run_plans(&plans, micro_batches, forward, backward)
        .map_err(|e| KilnError::Distributed(format!("the {kind} schedule deadlocks: {e}")))
}

/// [`simulate`] over each stage's actions as given.
fn run_plans(
    plans: &[Vec<Action>],
    micro_batches: usize,
    forward: f64,
    backward: f64,
) -> Result<Timeline> {
    let stages = plans.len();
    // When each stage's forward and backward of each micro-batch ended, once run.
    let mut fwd_end = vec![vec![None::<f64>; micro_batches]; stages];
    let mut bwd_end = vec![vec![None::<f64>; micro_batches]; stages];
    // Each stage's actions run so far: how far it got, and when it is free again.
    let mut timeline: Vec<Vec<(Action, f64, f64)>> =
        vec![Vec::with_capacity(2 * micro_batches); stages];
    loop {
        let mut progressed = false;
        for s in 0..stages {
            while let Some(&action) = plans[s].get(timeline[s].len()) {
                let ready = match action {
                    Action::Forward(i) => match s {
                        0 => Some(0.0),
                        _ => fwd_end[s - 1][i],
                    },
                    Action::Backward(i) => {
                        let upstream = if s + 1 == stages {
                            Some(0.0)
                        } else {
                            bwd_end[s + 1][i]
                        };
                        // A backward needs its own forward's activations too.
                        upstream.zip(fwd_end[s][i]).map(|(a, b)| a.max(b))
                    }
                };
                let Some(ready) = ready else { break };
                let free_at = timeline[s].last().map_or(0.0, |a| a.2);
                let start = ready.max(free_at);
                let (end, slot) = match action {
                    Action::Forward(i) => (start + forward, &mut fwd_end[s][i]),
                    Action::Backward(i) => (start + backward, &mut bwd_end[s][i]),
                };
                *slot = Some(end);
                timeline[s].push((action, start, end));
                progressed = true;
            }
        }
        let waiting = (0..stages).find(|&s| timeline[s].len() < plans[s].len());
        match waiting {
            None => return Ok(Timeline { stages: timeline }),
            Some(s) if !progressed => {
                return Err(KilnError::Distributed(format!(
                    "stage {s} waits forever at {:?}",
                    plans[s][timeline[s].len()]
                )))
            }
            Some(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [ScheduleKind; 2] = [ScheduleKind::OneFOneB, ScheduleKind::GPipe];

    /// Megatron's and NxD's schedule checks: per stage, every micro-batch's forward and backward
    /// run once each, every backward after its forward, and the activations held never exceed
    /// the schedule's bound (1F1B: p − s, however many micro-batches).
    #[test]
    fn every_backward_follows_its_forward_and_in_flight_activations_stay_bounded() {
        for kind in KINDS {
            for p in [1, 2, 3, 4, 8] {
                for m in [1, 2, 3, 4, 8, 16] {
                    for s in 0..p {
                        let actions = stage_actions(kind, p, s, m);
                        let what = format!("{kind} p={p} m={m} stage {s}");
                        assert_eq!(actions.len(), 2 * m, "{what}");
                        let mut held = std::collections::BTreeSet::new();
                        let (mut fwds, mut bwds, mut peak) = (0, 0, 0);
                        for a in &actions {
                            match *a {
                                Action::Forward(i) => {
                                    assert!(held.insert(i), "{what}: forward {i} twice");
                                    // Forwards (and, in 1F1B, backwards) go in micro-batch order.
                                    assert_eq!(i, fwds, "{what}: forwards out of order");
                                    fwds += 1;
                                }
                                Action::Backward(i) => {
                                    assert!(
                                        held.remove(&i),
                                        "{what}: backward {i} before its forward"
                                    );
                                    assert_eq!(i, bwds, "{what}: backwards out of order");
                                    bwds += 1;
                                }
                            }
                            peak = peak.max(held.len());
                        }
                        assert_eq!((fwds, bwds), (m, m), "{what}");
                        assert!(held.is_empty(), "{what}");
                        let bound = kind.in_flight_bound(p, s, m);
                        assert!(peak <= bound, "{what}: {peak} in flight, bound {bound}");
                        if kind == ScheduleKind::OneFOneB {
                            // The bound is reached: the warm-up fills the pipe.
                            assert_eq!(peak, bound, "{what}");
                        }
                    }
                }
            }
        }
    }

    /// With uniform stages the simulated bubble is the formula's, for forward-to-backward cost
    /// ratios 1:1 and 1:2; 1F1B is never slower than GPipe, and GPipe holds every micro-batch.
    #[test]
    fn the_simulated_bubble_is_the_1f1b_formula_and_nothing_deadlocks() {
        for p in [1, 2, 4, 8] {
            for m in [1, 2, 4, 8, 16] {
                for (f, b) in [(1.0, 1.0), (1.0, 2.0)] {
                    let one = simulate(ScheduleKind::OneFOneB, p, m, f, b).unwrap();
                    let gpipe = simulate(ScheduleKind::GPipe, p, m, f, b).unwrap();
                    let want = bubble_formula(p, m);
                    let what = format!("p={p} m={m} f={f} b={b}");
                    assert!(
                        (one.bubble_fraction() - want).abs() < 1e-12,
                        "{what}: 1f1b {} vs {want}",
                        one.bubble_fraction()
                    );
                    assert!(
                        (gpipe.bubble_fraction() - want).abs() < 1e-12,
                        "{what}: gpipe"
                    );
                    assert!(one.makespan() <= gpipe.makespan() + 1e-12, "{what}");
                    assert_eq!(one.makespan(), (m + p - 1) as f64 * (f + b), "{what}");
                }
            }
        }
        // The formula at the sizes the benchmarks report.
        assert_eq!(bubble_formula(2, 2), 1.0 / 3.0);
        assert_eq!(bubble_formula(4, 8), 3.0 / 11.0);
    }

    /// The simulation names a schedule that cannot finish: two stages whose 1F1B orders were
    /// swapped (the first stage would wait for a backward the last has not run, while the last
    /// waits for a forward the first has not sent).
    #[test]
    fn a_schedule_that_deadlocks_is_named() {
        let bad = vec![
            vec![Action::Backward(0), Action::Forward(0)],
            vec![Action::Forward(0), Action::Backward(0)],
        ];
        let err = run_plans(&bad, 1, 1.0, 1.0).unwrap_err().to_string();
        assert_eq!(err, "stage 0 waits forever at Backward(0)");
        // The same stages in a valid order finish.
        let good: Vec<_> = (0..2)
            .map(|s| stage_actions(ScheduleKind::OneFOneB, 2, s, 1))
            .collect();
        assert!(run_plans(&good, 1, 1.0, 1.0).is_ok());
    }

    #[test]
    fn schedule_names_parse_as_pipeline_schedule_takes_them() {
        assert_eq!(ScheduleKind::parse("1F1B").unwrap(), ScheduleKind::OneFOneB);
        assert_eq!(ScheduleKind::parse("gpipe").unwrap(), ScheduleKind::GPipe);
        let err = ScheduleKind::parse("zb").unwrap_err().to_string();
        assert!(err.contains("--pipeline-schedule \"zb\""), "{err}");
    }
}
