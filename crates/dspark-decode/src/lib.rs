//! Decoding loops over a target model. This crate holds plain decoding; speculative decoding
//! builds on the same pieces (prefill, stop handling, statistics).

use dspark_model::{KvCache, Model, ModelError, SeqInput, TapSpec};
use dspark_sampling::{Sampler, SamplingError, SamplingParams};
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error("the prompt is empty; give at least one token")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens but the model's context is {context}; shorten it")]
    PromptTooLong { prompt: usize, context: usize },
}

pub type Result<T> = std::result::Result<T, DecodeError>;

#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    /// Tokens that end generation (the model's EOS markers by default). They are not emitted.
    pub stop_tokens: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    Stop,
    Length,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Stats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// The prompt's forward pass, which also yields the first generated token.
    pub prefill_s: f64,
    /// Every later forward pass.
    pub decode_s: f64,
    /// Forward passes after the prefill per second of `decode_s`.
    pub decode_tok_s: f64,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub stats: Stats,
}

/// Prompt rows per prefill forward; bounds the activation memory of long prompts.
pub const PREFILL_CHUNK: usize = 256;

/// A prompt must have a token and leave room for at least one generated one.
pub fn check_prompt(model: &Model, prompt: &[u32]) -> Result<()> {
    let context = model.config.context_length;
    if prompt.is_empty() {
        return Err(DecodeError::EmptyPrompt);
    }
    if prompt.len() >= context {
        return Err(DecodeError::PromptTooLong { prompt: prompt.len(), context });
    }
    Ok(())
}

/// Feeds the prompt into `cache` and returns the logits of its last position.
pub fn prefill(model: &Model, cache: &mut KvCache, prompt: &[u32]) -> Result<Vec<f32>> {
    check_prompt(model, prompt)?;
    let mut last = Vec::new();
    for chunk in prompt.chunks(PREFILL_CHUNK) {
        let mut seq = [SeqInput::logits_last(cache, chunk)];
        last = model.forward(&mut seq, &TapSpec::default())?.swap_remove(0).logits;
    }
    Ok(last)
}

/// Plain autoregressive decoding: one target forward per token. `on_token` sees each token as it
/// is committed (for streaming).
pub fn generate(
    model: &Model,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_token: impl FnMut(u32),
) -> Result<Generation> {
    params.sampling.validate()?;
    check_prompt(model, prompt)?;
    let context = model.config.context_length;
    let capacity = prompt.len().saturating_add(params.max_tokens).min(context);
    let mut cache = model.new_cache(capacity);
    let mut sampler = Sampler::new(params.seed);
    let mut stats = Stats { prompt_tokens: prompt.len(), ..Default::default() };
    let mut tokens = Vec::new();

    let t0 = Instant::now();
    let mut logits = prefill(model, &mut cache, prompt)?;
    stats.prefill_s = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut passes = 0usize;
    let finish = loop {
        if tokens.len() >= params.max_tokens {
            break FinishReason::Length;
        }
        let next = sampler.sample(&logits, &params.sampling);
        if params.stop_tokens.contains(&next) {
            break FinishReason::Stop;
        }
        tokens.push(next);
        on_token(next);
        if tokens.len() >= params.max_tokens || cache.len() >= capacity {
            break FinishReason::Length;
        }
        let step = [next];
        let mut seq = [SeqInput::logits_last(&mut cache, &step)];
        logits = model.forward(&mut seq, &TapSpec::default())?.swap_remove(0).logits;
        passes += 1;
    };
    stats.decode_s = t1.elapsed().as_secs_f64();
    stats.generated_tokens = tokens.len();
    stats.decode_tok_s = if stats.decode_s > 0.0 { passes as f64 / stats.decode_s } else { 0.0 };
    Ok(Generation { tokens, finish, stats })
}
