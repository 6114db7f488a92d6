//! What a client hands the engine and what comes back.

use dspark_decode::FinishReason;
use dspark_sampling::SamplingParams;
use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;

#[derive(Debug, Clone)]
pub struct RequestParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    /// Tokens that end generation; not emitted.
    pub stop_tokens: Vec<u32>,
    /// Log-probabilities to report with each emitted token: `None` for none, `Some(k)` for the
    /// token's own and the `k` most likely tokens' (at most [`MAX_TOP_LOGPROBS`]).
    pub logprobs: Option<usize>,
}

/// The most alternatives a request may ask log-probabilities for (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The target's log-probability of an emitted token and of the most likely tokens at its position:
/// log-softmax of the target's raw logits (temperature 1, before top-k/top-p), whatever the
/// request's sampling settings and whether the token was drafted or not.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// Most likely first; ties by smaller id.
    pub top: Vec<(u32, f32)>,
}

pub struct Request {
    pub prompt: Vec<u32>,
    pub params: RequestParams,
    /// Workload tag for online calibration (e.g. `code`, `chat`); global when absent.
    pub tag: Option<String>,
    /// Where tokens go. Dropping the receiver cancels the request.
    pub events: UnboundedSender<Event>,
}

/// Token counts and speculative statistics of one request.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Target steps that committed tokens for this request.
    pub rounds: usize,
    /// Drafts proposed for it.
    pub drafted_tokens: usize,
    /// Drafts the policy sent to verification (its verify budget, summed over rounds).
    pub verified_tokens: usize,
    pub accepted_tokens: usize,
    /// Seconds spent waiting for admission.
    pub queue_s: f64,
}

impl Usage {
    /// Tokens committed per target step.
    pub fn tau(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            (self.accepted_tokens + self.rounds) as f64 / self.rounds as f64
        }
    }

    /// Drafts verified per step.
    pub fn mean_verify_budget(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            self.verified_tokens as f64 / self.rounds as f64
        }
    }
}

#[derive(Debug, Clone)]
pub enum Event {
    /// Newly committed tokens, in order, with their log-probabilities (one per token) when the
    /// request asked for them.
    Tokens {
        tokens: Vec<u32>,
        logprobs: Option<Vec<TokenLogprob>>,
    },
    Done {
        finish: FinishReason,
        usage: Usage,
    },
    /// The request failed or was cancelled by the server.
    Error(String),
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SubmitError {
    #[error("the request queue is full ({0} requests waiting); retry later")]
    QueueFull(usize),
    #[error("the server is shutting down; no new requests are accepted")]
    ShuttingDown,
    #[error("the engine failed ({0}); the server is stopping — restart it")]
    EngineFailed(String),
    #[error(
        "this model's maximum context length is {context} tokens, but {prompt} prompt tokens plus \
         max_tokens {max_tokens} were requested; shorten the prompt or lower max_tokens"
    )]
    ContextExceeded { context: usize, prompt: usize, max_tokens: usize },
    #[error("{0}")]
    Invalid(String),
}
