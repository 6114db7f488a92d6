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
}

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
        Ok(Self { model, name: name.into(), cache: None, cached: Vec::new(), rng: Sampler::new(0) })
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
            let (tok, dist) = if p.is_greedy() {
                (dspark_sampling::argmax(&logits) as u32, DraftDist::OneHot)
            } else {
                let q = p.distribution(&logits);
                (self.rng.draw(&q) as u32, DraftDist::Dense(q))
            };
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
