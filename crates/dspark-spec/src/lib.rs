//! Lossless speculative decoding: the [`Drafter`] trait every method implements, exact
//! verification that knows nothing about drafters, the decode loop and its statistics.

pub mod drafter;
pub mod engine;
pub mod stats;
pub mod verify;

pub use drafter::{DraftDist, DraftError, DraftResult, Drafter, Proposal, TargetFeatures};
pub use engine::{
    append_features, apply_stops, generate_spec, wants, Gate, SpecError, SpecParams, SpecRun, SpecSequence,
};
pub use stats::SpecStats;
pub use verify::{verify, Verdict};
