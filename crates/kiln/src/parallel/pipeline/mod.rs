//! Pipeline parallelism's pieces: where a model is cut into stages ([`stages`]) and the order in
//! which each stage runs its micro-batches ([`schedule`]: 1F1B, and GPipe as the reference), with
//! an event simulation that measures a schedule's bubble and finds a schedule that deadlocks.
//! The stage runner that executes a schedule over the `Collectives` is not built yet (issue 35).

pub mod schedule;
pub mod stages;

pub use schedule::{bubble_formula, simulate, stage_actions, Action, ScheduleKind, Timeline};
pub use stages::{cut_stages, parse_cuts, StageCut};
