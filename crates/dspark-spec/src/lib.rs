//! Lossless speculative decoding: the [`Drafter`] trait every method implements, exact
//! verification that knows nothing about drafters, what a round commits, and its statistics.
//! The decode loop itself is `dspark-engine`'s, for one request as for many.

pub mod commit;
pub mod drafter;
pub mod gate;
pub mod stats;
pub mod verify;

pub use commit::{append_features, apply_stops, wants};
pub use drafter::{DraftDist, DraftError, DraftResult, Drafter, Proposal, TargetFeatures};
pub use gate::Gate;
pub use stats::SpecStats;
pub use verify::{verify, Verdict};
