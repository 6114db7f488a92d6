//! The decode loop, for one request ([`generate`]) and for many (the serving engine: one thread
//! steps every running request together). Each step drafts for
//! all decoding requests in one drafter pass, lets the policy choose verify lengths, runs one
//! target forward over every verify block and prefill chunk, accepts per request and streams
//! the committed tokens out.

mod engine;
mod generate;
pub mod profile;
mod request;

pub use dspark_decode::FinishReason;
pub use engine::{log_probs, prefill_plan, RowCost};
pub use engine::{spawn, EngineConfig, EngineDrafter, EngineHandle, Shared, StepError};
pub use generate::{generate, SpecError, SpecParams, SpecRun};
pub use profile::{profile, profile_one};
pub use request::{Event, Request, RequestParams, SubmitError, TokenLogprob, Usage, MAX_TOP_LOGPROBS};
