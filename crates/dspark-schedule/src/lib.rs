//! Where verification pays: a profiled cost table of the target's forward pass, the policies
//! that choose how many drafts each running request verifies, and calibration that keeps the
//! drafter's confidences honest (sequential temperature scaling, offline and online).

pub mod calibration;
pub mod cost;
pub mod policy;

pub use calibration::{OnlineCalibration, Round, Scaling};
pub use cost::CostTable;
pub use policy::{prefix_schedule, top_k, Policy, Scheduler};

#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error("cost table {path}: {reason}")]
    Table { path: String, reason: String },
    #[error("unknown policy `{0}`: use plain, fixed, threshold[:P], dspark or dspark-async")]
    Policy(String),
}
