//! A small LLM with the target's tokenizer drafting autoregressively (e.g. Qwen2.5-Coder-0.5B
//! for the 1.5B). It keeps its own KV cache and rolls it back to the committed prefix.

use dspark_model::{KvCache, Model, SeqInput, TapSpec};
use dspark_sampling::{Sampler, SamplingParams};
use dspark_spec::{DraftDist, DraftError, DraftResult, Drafter, Proposal, TargetFeatures};
use std::sync::Arc;

pub struct DraftModel {
    model: Arc<Model>,
    name: String,
    cache: Option<KvCache>,
    /// The tokens whose K/V are in `cache`, in order.
    cached: Vec<u32>,
    rng: Sampler,
    /// Drafting stops before a token whose draft distribution's top probability is below this.
    min_p: f32,
}

/// [`DraftModel`]'s default stopping probability. Qwen2.5-Coder-0.5B drafting for the 1.5B,
/// γ = 6 on MBPP and 4 on chat (docs/BENCHMARKS.md): 0.5 drafted chat at 1.05× plain where 0 gave
/// 0.93×, and MBPP at 1.39× against 1.33× (0.8 drafted too little: τ 3.7 against 5.1–5.4).
pub const DEFAULT_MIN_P: f32 = 0.5;

impl DraftModel {
    /// Refuses a draft model whose vocabulary differs from the target's: its token ids would
    /// mean different text and nothing it proposes could be verified.
    pub fn new(model: impl Into<Arc<Model>>, name: &str, target: &Model) -> DraftResult<Self> {
        let model = model.into();
        let (dv, tv) = (model.tokenizer.vocab(), target.tokenizer.vocab());
        if dv != tv {
            let only_d = dv.keys().filter(|k| !tv.contains_key(*k)).count();
            return Err(DraftError::Incompatible(format!(
                "draft model `{name}` has a different vocabulary from the target ({} vs {} tokens, {only_d} \
                 not in the target's); pick a draft model from the same family and tokenizer",
                dv.len(),
                tv.len()
            )));
        }
        Ok(Self {
            model,
            name: name.into(),
            cache: None,
            cached: Vec::new(),
            rng: Sampler::new(0),
            min_p: DEFAULT_MIN_P,
        })
    }

    /// Stop drafting before a token whose draft distribution's top probability is below `p`
    /// (0: always draft γ). The output never depends on it, only what each round costs.
    pub fn with_min_p(mut self, p: f32) -> Self {
        self.min_p = p;
        self
    }

    /// Runs `tokens` through the draft model after the cached prefix; logits of the last row.
    fn feed(&mut self, tokens: &[u32]) -> DraftResult<Vec<f32>> {
        let cache = self.cache.as_mut().expect("begin() was called");
        let mut last = Vec::new();
        for chunk in tokens.chunks(dspark_decode::PREFILL_CHUNK) {
            let mut seq = [SeqInput::logits_last(cache, chunk)];
            last = self.model.forward(&mut seq, &TapSpec::default())?.remove(0).logits;
        }
        self.cached.extend_from_slice(tokens);
        Ok(last)
    }
}

impl Drafter for DraftModel {
    fn name(&self) -> String {
        format!("draft:{}", self.name)
    }

    fn fork(&self) -> Option<Box<dyn Drafter>> {
        Some(Box::new(Self {
            model: self.model.clone(),
            name: self.name.clone(),
            cache: None,
            cached: Vec::new(),
            rng: Sampler::new(0),
            min_p: self.min_p,
        }))
    }

    fn begin(&mut self, prompt: &[u32], _f: &TargetFeatures, seed: u64) -> DraftResult<()> {
        self.cache = Some(self.model.new_cache(self.model.config.context_length.min(prompt.len() + 4096)));
        self.cached.clear();
        self.rng = Sampler::new(seed);
        Ok(())
    }

    fn propose(&mut self, context: &[u32], max_len: usize, p: &SamplingParams) -> DraftResult<Proposal> {
        // Roll back to the longest prefix of the context that is cached; re-feed the rest.
        let common =
            self.cached.iter().zip(context).take_while(|(a, b)| a == b).count().min(context.len() - 1);
        self.cache.as_mut().expect("begin() was called").truncate(common)?;
        self.cached.truncate(common);
        let room = self.cache.as_ref().map_or(0, |c| c.capacity()).saturating_sub(context.len());
        let max_len = max_len.min(room);
        let mut logits = self.feed(&context[common..])?;
        let mut out = Proposal::default();
        for i in 0..max_len {
            let (tok, dist, top) = if p.is_greedy() {
                let t = dspark_sampling::argmax(&logits);
                let z: f32 = logits.iter().map(|l| (l - logits[t]).exp()).sum();
                (t as u32, DraftDist::OneHot, 1.0 / z)
            } else {
                let q = p.distribution(&logits);
                let top = q.iter().fold(0f64, |m, &x| m.max(x)) as f32;
                (self.rng.draw(&q) as u32, DraftDist::Dense(q), top)
            };
            // An unsure draft model is mostly wrong, and each further draft costs a forward of it.
            if top < self.min_p {
                break;
            }
            out.tokens.push(tok);
            out.dists.push(dist);
            if i + 1 < max_len {
                logits = self.feed(&[tok])?;
            }
        }
        Ok(out)
    }

    fn observe(&mut self, _context: &[u32], _accepted: usize, _f: &TargetFeatures) -> DraftResult<()> {
        // Rollback happens lazily in `propose`, against the committed context.
        Ok(())
    }
}
