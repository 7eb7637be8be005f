//! Pipeline parallelism's pieces: where a model is cut into stages ([`stages`]), how a rank's batch
//! becomes micro-batches ([`batches`]), and the order in which each stage runs them ([`schedule`]:
//! 1F1B, and GPipe as the reference), with an event simulation that measures a schedule's bubble
//! and finds a schedule that deadlocks.
//! What a stage hands its neighbour is [`wire`]'s one format. A stage runs its schedule in
//! `train::pipeline`, handing tensors over the `Collectives`' point-to-point links
//! (`parallel::p2p`).

pub mod batches;
pub mod schedule;
pub mod stages;
pub mod wire;

pub use batches::MicroBatches;
pub use schedule::{bubble_formula, simulate, stage_actions, Action, ScheduleKind, Timeline};
pub use stages::{
    cut_by_work, cut_stages, layer_index, owner_stage, parse_cuts, Balance, StageCut, StageHolds,
    Work,
};
pub use wire::{hand_over, receive};
