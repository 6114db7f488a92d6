//! DFlash and DSpark drafters: one backbone pass drafts a whole block; DSpark's heads then pick
//! the tokens left to right. The draft cache holds context keys/values only, fed by the target
//! features of committed tokens, so a rejection needs no rollback.

use crate::net_error;
use dspark_drafter_models::{BlockModel, ContextCache, DrafterNet};
use dspark_model::TapSpec;
use dspark_sampling::{Sampler, SamplingParams};
use dspark_spec::{DraftDist, DraftError, DraftResult, Drafter, Proposal, TargetFeatures};
use std::sync::Arc;

/// One sequence's drafting state.
pub struct BlockSeq {
    pub cache: ContextCache,
    rng: Sampler,
}

impl BlockSeq {
    pub fn new(net: &BlockModel, prompt_features: &TargetFeatures, seed: u64) -> DraftResult<Self> {
        let mut s = Self { cache: ContextCache::default(), rng: Sampler::new(seed) };
        s.feed(net, prompt_features)?;
        Ok(s)
    }

    /// Appends the features of newly committed rows.
    pub fn feed(&mut self, net: &BlockModel, f: &TargetFeatures) -> DraftResult<()> {
        net.extend(&mut self.cache, &f.taps, f.rows).map_err(net_error)
    }
}

/// Picks a draft-vocabulary index from final logits, recording its exact distribution over the
/// full target vocabulary.
pub(crate) fn choose(
    logits: &[f32],
    params: &SamplingParams,
    rng: &mut Sampler,
    scatter: impl FnOnce(Vec<f64>) -> Vec<f64>,
    dists: &mut Vec<DraftDist>,
) -> usize {
    if params.is_greedy() {
        dists.push(DraftDist::OneHot);
        return dspark_sampling::argmax(logits);
    }
    let q = params.distribution(logits);
    let i = rng.draw(&q);
    dists.push(DraftDist::Dense(scatter(q)));
    i
}

/// One sequence's part of a batched drafting call: its state, its committed tokens (last =
/// anchor) and how its drafts are chosen.
pub type BatchEntry<'a> = (&'a mut BlockSeq, &'a [u32], &'a SamplingParams);

/// Drafts for several sequences with one backbone pass and one LM-head product.
pub fn propose_batch(
    net: &BlockModel,
    seqs: &mut [BatchEntry],
    max_len: usize,
) -> DraftResult<Vec<Proposal>> {
    let n = max_len.min(net.gamma());
    if n == 0 || seqs.is_empty() {
        return Ok(seqs.iter().map(|_| Proposal::default()).collect());
    }
    for (s, ctx, _) in seqs.iter() {
        if s.cache.len() + 1 != ctx.len() {
            return Err(DraftError::Incompatible(format!(
                "drafter state holds {} committed rows but the context has {} tokens; \
                 every committed row's features must be fed back",
                s.cache.len(),
                ctx.len()
            )));
        }
    }
    let blocks: Vec<(&ContextCache, u32)> =
        seqs.iter().map(|(s, c, _)| (&s.cache, *c.last().unwrap())).collect();
    let hidden = net.block_hidden(&blocks).map_err(net_error)?;
    let raw = net.raw_logits(&hidden).map_err(net_error)?;
    let g = net.gamma();
    let mut out = Vec::with_capacity(seqs.len());
    for (i, (s, ctx, params)) in seqs.iter_mut().enumerate() {
        let rows = |t: &candle_core::Tensor| t.narrow(0, i * g, g);
        let (h, r) = (rows(&hidden).map_err(candle)?, rows(&raw).map_err(candle)?);
        let mut dists = Vec::with_capacity(n);
        let rng = &mut s.rng;
        let trace = net
            .draft(&h, &r, *ctx.last().unwrap(), n, |_, logits| {
                Ok(choose(logits, params, rng, |q| net.vocab.scatter(q), &mut dists))
            })
            .map_err(net_error)?;
        out.push(Proposal { tokens: trace.tokens, dists, confidence: trace.confidence });
    }
    Ok(out)
}

fn candle(e: candle_core::Error) -> DraftError {
    DraftError::Incompatible(format!("drafter tensor error: {e}"))
}

/// A DFlash or DSpark drafter for one sequence at a time.
pub struct BlockDrafter {
    pub net: Arc<BlockModel>,
    name: String,
    seq: Option<BlockSeq>,
}

impl BlockDrafter {
    pub fn new(net: Arc<BlockModel>, name: &str) -> Self {
        Self { net, name: name.to_string(), seq: None }
    }

    pub fn from_net(net: DrafterNet, name: &str) -> DraftResult<Self> {
        match net {
            DrafterNet::Block(m) => Ok(Self::new(Arc::new(m), name)),
            DrafterNet::Eagle3(_) => Err(DraftError::Incompatible(format!("{name} is an EAGLE-3 drafter"))),
        }
    }

    pub fn state(&self) -> Option<&BlockSeq> {
        self.seq.as_ref()
    }
}

impl Drafter for BlockDrafter {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn fork(&self) -> Option<Box<dyn Drafter>> {
        Some(Box::new(Self::new(self.net.clone(), &self.name)))
    }

    fn has_confidence(&self) -> bool {
        self.net.config.dspark.as_ref().is_some_and(|e| e.confidence)
    }

    fn taps(&self) -> TapSpec {
        TapSpec { layers: self.net.config.target_layer_ids.clone(), final_norm: false }
    }

    fn begin(&mut self, _prompt: &[u32], features: &TargetFeatures, seed: u64) -> DraftResult<()> {
        self.seq = Some(BlockSeq::new(&self.net, features, seed)?);
        Ok(())
    }

    fn propose(&mut self, context: &[u32], max_len: usize, params: &SamplingParams) -> DraftResult<Proposal> {
        let seq =
            self.seq.as_mut().ok_or_else(|| DraftError::Incompatible("propose() before begin()".into()))?;
        Ok(propose_batch(&self.net, &mut [(seq, context, params)], max_len)?.remove(0))
    }

    fn observe(&mut self, _context: &[u32], _accepted: usize, features: &TargetFeatures) -> DraftResult<()> {
        let seq =
            self.seq.as_mut().ok_or_else(|| DraftError::Incompatible("observe() before begin()".into()))?;
        seq.feed(&self.net, features)
    }
}
