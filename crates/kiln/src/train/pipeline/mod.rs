//! Pipeline parallelism as the trainer runs it: this rank's stage as the plan holds it
//! ([`PipelinePlan`]: the cut, what the stage holds and owns, the sums across stages) and one
//! step's micro-batches on that stage in the schedule's order ([`stage_loss_and_grads`]). The
//! pieces that know no trainer (the cut, the schedule and its simulation, the micro-batches, the
//! hand-over format) are `parallel::pipeline`'s.

mod plan;
mod stage;

pub use plan::PipelinePlan;
pub use stage::{stage_loss_and_grads, Observe, Stage, StageStep};
