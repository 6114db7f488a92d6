//! One request through the engine's step, on the caller's thread: what `dspark generate`,
//! `bench decode`, `eval` and calibration run. The caller lends its drafter, so it can read the
//! drafter's state afterwards; the loop is the serving engine's, batch 1.

use crate::engine::{DraftState, EngineConfig, Shared, StepError, Worker};
use crate::request::{Event, Request, RequestParams};
use dspark_decode::FinishReason;
use dspark_model::{Model, ModelError};
use dspark_sampling::{SamplingError, SamplingParams};
use dspark_schedule::{CostTable, Policy};
use dspark_spec::{Drafter, SpecStats};
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Step(#[from] StepError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Prompt(#[from] dspark_decode::DecodeError),
    #[error("draft length must be at least 1 (got 0); use the `none` drafter for plain decoding")]
    DraftLen,
    #[error("min_survival must be between 0 and 1 (got {0})")]
    MinSurvival(f32),
    #[error("policy {0} plans with the machine's cost table: measure one with `profile_one` (or `dspark profile`)")]
    NoCostTable(Policy),
    #[error("policy plain drafts nothing: decode without a drafter instead")]
    Plain,
}

pub type Result<T> = std::result::Result<T, SpecError>;

#[derive(Debug, Clone)]
pub struct SpecParams {
    pub max_tokens: usize,
    /// γ: the most tokens drafted per round.
    pub draft_len: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    pub stop_tokens: Vec<u32>,
    /// How many of each round's drafts are verified: all (`Fixed`), those whose predicted prefix
    /// survival (the product of the drafter's confidences) stays at or above a threshold
    /// (`Threshold`), or as many as pay on the machine's cost curve (`Dspark`, Algorithm 1 with
    /// its draft/no-draft gate, and `DsparkAsync`). Each cut depends only on the drafter's own
    /// outputs, so the output distribution is unchanged.
    pub policy: Policy,
    /// The cost table `Dspark` and `DsparkAsync` plan with ([`crate::profile_one`]).
    pub cost: Option<CostTable>,
}

#[derive(Debug, Clone)]
pub struct SpecRun {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub stats: SpecStats,
}

/// Speculative generation for one prompt, streaming committed tokens to `on_token`.
pub fn generate(
    target: &Arc<Model>,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    p: &SpecParams,
    mut on_token: impl FnMut(u32),
) -> Result<SpecRun> {
    if p.draft_len == 0 {
        return Err(SpecError::DraftLen);
    }
    let cost = match p.policy {
        Policy::Plain => return Err(SpecError::Plain),
        Policy::Threshold(t) if !(0.0..=1.0).contains(&t) => return Err(SpecError::MinSurvival(t)),
        Policy::Dspark | Policy::DsparkAsync => p.cost.clone().ok_or(SpecError::NoCostTable(p.policy))?,
        // Neither of the others weighs costs.
        _ => CostTable::unmeasured(),
    };
    p.sampling.validate()?;
    dspark_decode::check_prompt(target, prompt)?;
    let config = EngineConfig {
        policy: p.policy,
        cost,
        draft_len: p.draft_len,
        max_running: 1,
        max_queue: 1,
        kv_tokens: usize::MAX,
        prefill_chunk: dspark_decode::PREFILL_CHUNK,
        online_calibration: false,
    };
    let taps = drafter.taps();
    let mut worker = Worker::new(target.clone(), true, None, taps, config, Arc::new(Shared::default()));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let params = RequestParams {
        max_tokens: p.max_tokens,
        sampling: p.sampling,
        seed: p.seed,
        stop_tokens: p.stop_tokens.clone(),
        logprobs: None,
    };
    let need = prompt
        .len()
        .saturating_add(p.max_tokens)
        .saturating_add(p.draft_len + 1)
        .min(target.config.context_length);
    let req = Request { prompt: prompt.to_vec(), params, tag: None, events: tx };
    let lent = DraftState::Each { d: Box::new(drafter), begun: false };
    let mut seqs = [worker.seq(req, Instant::now(), need, lent)];
    let t0 = Instant::now();
    let mut decode_from = None;
    let mut tokens = Vec::new();
    while seqs[0].finish.is_none() {
        worker.step(&mut seqs)?;
        while let Ok(e) = rx.try_recv() {
            if let Event::Tokens { tokens: new, .. } = e {
                for &t in &new {
                    on_token(t);
                }
                tokens.extend(new);
            }
        }
        // Prefill ends with the first token, as plain decoding counts it.
        if decode_from.is_none() && (!tokens.is_empty() || seqs[0].finish.is_some()) {
            decode_from = Some(Instant::now());
        }
    }
    let decode_from = decode_from.unwrap_or(t0);
    let [seq] = seqs;
    let mut stats = seq.stats;
    stats.prefill_s = (decode_from - t0).as_secs_f64();
    stats.decode_s = decode_from.elapsed().as_secs_f64();
    stats.generated_tokens = tokens.len();
    Ok(SpecRun { tokens, finish: seq.finish.expect("the loop ran to a finish"), stats })
}
