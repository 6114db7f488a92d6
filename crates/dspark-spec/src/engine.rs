//! The speculative decode loop for one sequence: draft → one target forward over
//! `[anchor, drafts]` → accept → roll the target's KV back to the committed length → feed back.
//! The per-sequence state is explicit ([`SpecSequence`]) so that a serving engine can step many
//! sequences with one batched forward.

use crate::drafter::{DraftError, Drafter, Proposal, TargetFeatures};
use crate::stats::SpecStats;
use crate::verify::verify;
use dspark_decode::FinishReason;
use dspark_model::{KvCache, Model, ModelError, SeqInput, SeqOutput, TapSpec};
use dspark_sampling::{Sampler, SamplingError, SamplingParams};
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Draft(#[from] DraftError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Prompt(#[from] dspark_decode::DecodeError),
    #[error("draft length must be at least 1 (got 0); use the `none` drafter for plain decoding")]
    DraftLen,
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
    /// Verify only the drafts whose predicted prefix survival (the product of the drafter's
    /// confidences) stays at or above this; 0 verifies every draft. The cut depends only on the
    /// drafter's own outputs, so the output distribution is unchanged.
    pub min_survival: f32,
}

/// Speculative rounds per probe, plain steps timed before the first probe, and how long drafting
/// pauses after a probe that did not pay (four times longer while probes keep failing). Used by
/// `--drafter auto` (`dspark_drafters::AutoDrafter`).
const PROBE_ROUNDS: usize = 4;
const PLAIN_SAMPLES: usize = 2;
const FIRST_PAUSE: usize = 32;
const MAX_PAUSE: usize = 1024;

/// Whether drafting pays, from timing: a drafter's rounds against plain steps of the same
/// sequence. When a probe of rounds commits tokens more slowly than plain steps do, drafting
/// pauses for a while before the next probe. What it measured so far:
#[derive(Debug, Clone)]
pub struct Gate {
    plain_s: f64,
    plain_steps: usize,
    probe_s: f64,
    probe_tokens: usize,
    probe_rounds: usize,
    pause: usize,
    next_pause: usize,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            plain_s: 0.0,
            plain_steps: 0,
            probe_s: 0.0,
            probe_tokens: 0,
            probe_rounds: 0,
            pause: 0,
            next_pause: FIRST_PAUSE,
        }
    }
}

impl Gate {
    /// Whether this step drafts. Uses past steps only.
    pub fn drafts(&mut self) -> bool {
        if self.plain_steps < PLAIN_SAMPLES {
            return false;
        }
        if self.pause > 0 {
            self.pause -= 1;
            return false;
        }
        true
    }

    /// A step's outcome: whether it drafted, the tokens it committed and its seconds.
    pub fn record(&mut self, drafted: bool, tokens: usize, seconds: f64) {
        if !drafted {
            self.plain_s += seconds;
            self.plain_steps += 1;
            return;
        }
        self.probe_s += seconds;
        self.probe_tokens += tokens;
        self.probe_rounds += 1;
        if self.probe_rounds < PROBE_ROUNDS {
            return;
        }
        let spec_rate = self.probe_tokens as f64 / self.probe_s;
        let plain_rate = self.plain_steps as f64 / self.plain_s;
        if spec_rate < plain_rate {
            self.pause = self.next_pause;
            self.next_pause = (self.next_pause * 4).min(MAX_PAUSE);
        } else {
            self.next_pause = FIRST_PAUSE;
        }
        (self.probe_s, self.probe_tokens, self.probe_rounds) = (0.0, 0, 0);
    }
}

/// One sequence being decoded. The target cache holds every committed token but the last one,
/// the anchor, which opens the next verify block.
pub struct SpecSequence {
    pub context: Vec<u32>,
    pub prompt_len: usize,
    pub cache: KvCache,
    pub finish: Option<FinishReason>,
    pub stats: SpecStats,
    rng: Sampler,
}

impl SpecSequence {
    /// Prefills the prompt (all but its last token) and starts the drafter.
    pub fn start(target: &Model, drafter: &mut dyn Drafter, prompt: &[u32], p: &SpecParams) -> Result<Self> {
        p.sampling.validate()?;
        dspark_decode::check_prompt(target, prompt)?;
        let t0 = Instant::now();
        let mut cache =
            target.new_cache(prompt.len().saturating_add(p.max_tokens).saturating_add(p.draft_len + 1));
        let taps = drafter.taps();
        let mut features = TargetFeatures::default();
        for chunk in prompt[..prompt.len() - 1].chunks(dspark_decode::PREFILL_CHUNK) {
            let rows = if wants(&taps) { (0..chunk.len()).collect() } else { Vec::new() };
            let mut seq =
                [SeqInput { cache: &mut cache, tokens: chunk, logit_rows: Vec::new(), tap_rows: rows }];
            let out = target.forward(&mut seq, &taps)?.remove(0);
            append_features(&mut features, out, chunk.len(), target.config.hidden);
        }
        drafter.begin(prompt, &features, p.seed ^ 0x9E37_79B9_7F4A_7C15)?;
        let stats = SpecStats {
            prompt_tokens: prompt.len(),
            prefill_s: t0.elapsed().as_secs_f64(),
            ..Default::default()
        };
        Ok(Self {
            context: prompt.to_vec(),
            prompt_len: prompt.len(),
            cache,
            finish: None,
            stats,
            rng: Sampler::new(p.seed),
        })
    }

    pub fn generated(&self) -> &[u32] {
        &self.context[self.prompt_len..]
    }

    /// Drafts allowed this round: γ, less near the end of `max_tokens` or of the cache.
    pub fn budget(&self, p: &SpecParams, target: &Model) -> usize {
        let left = p.max_tokens.saturating_sub(self.generated().len()).saturating_sub(1);
        let room =
            self.cache.capacity().min(target.config.context_length).saturating_sub(self.cache.len() + 1);
        p.draft_len.min(left).min(room)
    }

    /// One round. Returns the tokens it committed (for streaming).
    pub fn step(&mut self, target: &Model, drafter: &mut dyn Drafter, p: &SpecParams) -> Result<Vec<u32>> {
        // Draft.
        let t0 = Instant::now();
        let gamma = self.budget(p, target);
        let mut proposal =
            if gamma > 0 { drafter.propose(&self.context, gamma, &p.sampling)? } else { Proposal::default() };
        if p.min_survival > 0.0 {
            proposal.truncate_below(p.min_survival);
        }
        let t1 = Instant::now();
        // Verify: one target forward over [anchor, drafts], logits at every row.
        let block: Vec<u32> =
            std::iter::once(*self.context.last().unwrap()).chain(proposal.tokens.iter().copied()).collect();
        let taps = drafter.taps();
        let rows: Vec<usize> = (0..block.len()).collect();
        let tap_rows = if wants(&taps) { rows.clone() } else { Vec::new() };
        let mut seq = [SeqInput { cache: &mut self.cache, tokens: &block, logit_rows: rows, tap_rows }];
        let out = target.forward(&mut seq, &taps)?.remove(0);
        let v = target.vocab_size();
        let verdict =
            verify(|i| out.logits_row(i, v), &proposal.tokens, &proposal.dists, &p.sampling, &mut self.rng);
        // Accept: the anchor and the accepted drafts stay in the cache; the rest rolls back.
        let kept = 1 + verdict.accepted;
        self.cache.truncate(self.cache.len() - (block.len() - kept))?;
        let mut committed: Vec<u32> = proposal.tokens[..verdict.accepted].to_vec();
        committed.push(verdict.next);
        self.context.extend_from_slice(&committed);
        // Feed back the target's hidden states of the rows that entered the cache.
        let mut features = TargetFeatures::default();
        append_features(&mut features, out, kept, target.config.hidden);
        drafter.observe(&self.context, verdict.accepted, &features)?;
        let t2 = Instant::now();
        if proposal.is_empty() {
            self.stats.plain_steps += 1;
        } else {
            self.stats.record_round(
                proposal.len(),
                verdict.accepted,
                (t1 - t0).as_secs_f64(),
                (t2 - t1).as_secs_f64(),
            );
        }
        Ok(self.finish_check(committed.len(), p))
    }

    /// Applies stop tokens and `max_tokens` to the tokens just committed; returns those kept.
    fn finish_check(&mut self, n_new: usize, p: &SpecParams) -> Vec<u32> {
        let (keep, finish) =
            apply_stops(&mut self.context, self.prompt_len, n_new, &p.stop_tokens, p.max_tokens);
        self.finish = finish;
        keep
    }
}

/// Applies stop tokens and `max_tokens` to the last `n_new` tokens of `context` (which starts
/// with a prompt of `prompt_len`): truncates after a finish and returns the tokens to emit (a
/// stop token is not emitted) with the finish reason, if reached.
pub fn apply_stops(
    context: &mut Vec<u32>,
    prompt_len: usize,
    n_new: usize,
    stop_tokens: &[u32],
    max_tokens: usize,
) -> (Vec<u32>, Option<FinishReason>) {
    let start = context.len() - n_new;
    let already = start - prompt_len;
    let mut keep = Vec::new();
    for i in 0..n_new {
        let t = context[start + i];
        if stop_tokens.contains(&t) {
            context.truncate(start + i);
            return (keep, Some(FinishReason::Stop));
        }
        keep.push(t);
        if already + keep.len() >= max_tokens {
            context.truncate(start + i + 1);
            return (keep, Some(FinishReason::Length));
        }
    }
    (keep, None)
}

pub fn wants(t: &TapSpec) -> bool {
    !t.layers.is_empty() || t.final_norm
}

/// Appends the first `rows` rows (of width `d`) of a forward's hidden states.
pub fn append_features(f: &mut TargetFeatures, out: SeqOutput, rows: usize, d: usize) {
    if out.taps.is_empty() && out.final_norm.is_none() {
        return;
    }
    f.taps.resize(out.taps.len(), Vec::new());
    for (dst, src) in f.taps.iter_mut().zip(&out.taps) {
        dst.extend_from_slice(&src[..rows * d]);
    }
    if let Some(fin) = &out.final_norm {
        f.final_norm.get_or_insert_with(Vec::new).extend_from_slice(&fin[..rows * d]);
    }
    f.rows += rows;
}

#[derive(Debug, Clone)]
pub struct SpecRun {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub stats: SpecStats,
}

/// Speculative generation for one prompt, streaming committed tokens to `on_token`.
pub fn generate_spec(
    target: &Model,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    p: &SpecParams,
    mut on_token: impl FnMut(u32),
) -> Result<SpecRun> {
    if p.draft_len == 0 {
        return Err(SpecError::DraftLen);
    }
    let mut seq = SpecSequence::start(target, drafter, prompt, p)?;
    let t0 = Instant::now();
    while seq.finish.is_none() {
        for t in seq.step(target, drafter, p)? {
            on_token(t);
        }
    }
    seq.stats.decode_s = t0.elapsed().as_secs_f64();
    seq.stats.generated_tokens = seq.generated().len();
    Ok(SpecRun { tokens: seq.generated().to_vec(), finish: seq.finish.unwrap(), stats: seq.stats })
}
