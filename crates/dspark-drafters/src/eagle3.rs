//! EAGLE-3 drafting: one layer over fused target features, autoregressive over its own outputs.

use crate::block::choose;
use crate::net_error;
use dspark_drafter_models::{DrafterNet, Eagle3Model, EagleCache};
use dspark_model::TapSpec;
use dspark_sampling::{Sampler, SamplingParams};
use dspark_spec::{DraftError, DraftResult, Drafter, Proposal, TargetFeatures};
use std::sync::Arc;

pub struct Eagle3Drafter {
    pub net: Arc<Eagle3Model>,
    name: String,
    cache: EagleCache,
    rng: Sampler,
}

impl Eagle3Drafter {
    pub fn from_net(net: DrafterNet, name: &str) -> DraftResult<Self> {
        match net {
            DrafterNet::Eagle3(m) => Ok(Self {
                net: Arc::new(m),
                name: name.to_string(),
                cache: EagleCache::default(),
                rng: Sampler::new(0),
            }),
            DrafterNet::Block(_) => {
                Err(DraftError::Incompatible(format!("{name} is not an EAGLE-3 drafter")))
            }
        }
    }

    pub fn cache(&self) -> &EagleCache {
        &self.cache
    }

    /// Committed rows pair each position's features with the token after it.
    fn feed(&mut self, context: &[u32], f: &TargetFeatures) -> DraftResult<()> {
        let start = self.cache.len();
        let next = context
            .get(start + 1..start + 1 + f.rows)
            .ok_or_else(|| DraftError::Incompatible("features for tokens that are not committed".into()))?;
        self.net.extend(&mut self.cache, &f.taps, f.rows, next).map_err(net_error)
    }
}

impl Drafter for Eagle3Drafter {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn fork(&self) -> Option<Box<dyn Drafter>> {
        Some(Box::new(Self {
            net: self.net.clone(),
            name: self.name.clone(),
            cache: EagleCache::default(),
            rng: Sampler::new(0),
        }))
    }

    fn taps(&self) -> TapSpec {
        TapSpec { layers: self.net.config.target_layer_ids.clone(), final_norm: false }
    }

    fn begin(&mut self, prompt: &[u32], features: &TargetFeatures, seed: u64) -> DraftResult<()> {
        self.cache = EagleCache::default();
        self.rng = Sampler::new(seed);
        self.feed(prompt, features)
    }

    fn propose(&mut self, context: &[u32], max_len: usize, params: &SamplingParams) -> DraftResult<Proposal> {
        if self.cache.len() + 1 != context.len() {
            return Err(DraftError::Incompatible(format!(
                "EAGLE-3 state holds {} rows but the context has {} tokens",
                self.cache.len(),
                context.len()
            )));
        }
        let n = max_len.min(self.net.gamma());
        let mut dists = Vec::with_capacity(n);
        let (net, rng) = (&self.net, &mut self.rng);
        let trace = net
            .draft(&self.cache, n, |_, logits| {
                Ok(choose(logits, params, rng, |q| net.vocab.scatter(q), &mut dists))
            })
            .map_err(net_error)?;
        Ok(Proposal { tokens: trace.tokens, dists, confidence: None })
    }

    fn observe(&mut self, context: &[u32], _accepted: usize, features: &TargetFeatures) -> DraftResult<()> {
        self.feed(context, features)
    }
}
