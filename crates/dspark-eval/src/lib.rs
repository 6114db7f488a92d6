//! How good a drafter is, measured the paper's way (DSPARK.md §5): the same prompts, batch 1,
//! a fixed block (no scheduler), τ per benchmark and its macro average, conditional acceptance
//! per position and domain, calibration of the confidence head, and speed against plain
//! decoding — on real benchmarks.

pub mod benchmarks;
pub mod plot;
pub mod report;
pub mod run;

pub use benchmarks::{Benchmark, Domain};
pub use report::Report;
pub use run::{evaluate, EvalConfig, EvalDrafter};

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("benchmark {name}: {reason}")]
    Benchmark { name: String, reason: String },
    #[error(transparent)]
    Hub(#[from] dspark_hub::HubError),
    #[error(transparent)]
    Spec(#[from] dspark_engine::SpecError),
    #[error(transparent)]
    Decode(#[from] dspark_decode::DecodeError),
    #[error("{0}")]
    Other(String),
    #[error(
        "{drafter} on {bench} prompt {index}: greedy speculative output differs from plain decoding \
         at token {at} — a correctness bug, please report it"
    )]
    NotLossless { drafter: String, bench: String, index: usize, at: usize },
}
