//! The drafter interface: every drafting method (n-gram lookup, a draft LLM, DFlash/DSpark,
//! EAGLE-3) is one implementation. Verification sees only what is in a [`Proposal`].

use dspark_model::{ModelError, TapSpec};
use dspark_sampling::SamplingParams;

#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{0}")]
    Incompatible(String),
}

pub type DraftResult<T> = std::result::Result<T, DraftError>;

/// How a draft token was chosen, exactly: verification needs `p_d(x)` and, on rejection, the
/// whole `p_d` for the residual distribution.
#[derive(Debug, Clone, PartialEq)]
pub enum DraftDist {
    /// Chosen deterministically: `p_d` is one-hot on the token.
    OneHot,
    /// Sampled from this distribution over the full target vocabulary (after every adjustment
    /// and temperature the drafter applied).
    Dense(Vec<f64>),
}

#[derive(Debug, Clone, Default)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// One entry per token.
    pub dists: Vec<DraftDist>,
    /// Predicted probability that each token survives verification, when the drafter has one.
    pub confidence: Option<Vec<f32>>,
}

impl Proposal {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Predicted prefix survival `∏_{i≤k} c_i` of each draft, when the drafter gives
    /// confidences.
    pub fn survival(&self) -> Option<Vec<f32>> {
        let mut a = 1f32;
        self.confidence.as_ref().map(|c| {
            c.iter()
                .map(|&x| {
                    a *= x;
                    a
                })
                .collect()
        })
    }

    /// Keeps the longest prefix whose survival `∏ confidence` is at least `threshold` (all of it
    /// when the drafter gives no confidences).
    pub fn truncate_below(&mut self, threshold: f32) {
        let Some(a) = self.survival() else { return };
        let keep = a.iter().take_while(|&&x| x >= threshold).count();
        self.tokens.truncate(keep);
        self.dists.truncate(keep);
        if let Some(c) = self.confidence.as_mut() {
            c.truncate(keep);
        }
    }
}

/// The target's hidden states for committed tokens, computed by the verify pass anyway.
#[derive(Debug, Clone, Default)]
pub struct TargetFeatures {
    pub rows: usize,
    /// Per layer of [`Drafter::taps`]: `rows × hidden`.
    pub taps: Vec<Vec<f32>>,
    /// Final-norm output, `rows × hidden`, when asked for.
    pub final_norm: Option<Vec<f32>>,
}

impl TargetFeatures {
    /// Appends `more`'s rows after these (features held back for a drafter that sat out).
    pub fn extend(&mut self, more: &TargetFeatures) {
        self.taps.resize(self.taps.len().max(more.taps.len()), Vec::new());
        for (dst, src) in self.taps.iter_mut().zip(&more.taps) {
            dst.extend_from_slice(src);
        }
        if let Some(f) = &more.final_norm {
            self.final_norm.get_or_insert_with(Vec::new).extend_from_slice(f);
        }
        self.rows += more.rows;
    }
}

pub trait Drafter: Send {
    /// A short name for statistics and messages.
    fn name(&self) -> String;

    /// A fresh drafter for another sequence, sharing this one's weights: the serving engine
    /// gives every request its own. `None` when this drafter cannot serve several sequences.
    fn fork(&self) -> Option<Box<dyn Drafter>> {
        None
    }

    /// Whether proposals carry confidences (a DSpark confidence head): what the
    /// survival-ranked verification policies need.
    fn has_confidence(&self) -> bool {
        false
    }

    /// Which target hidden states the drafter needs; none by default.
    fn taps(&self) -> TapSpec {
        TapSpec::default()
    }

    /// Starts a sequence. `prompt` is committed; `features` covers its rows except the last
    /// (which becomes the first verify block's anchor). `seed` makes sampled drafts repeatable.
    fn begin(&mut self, prompt: &[u32], features: &TargetFeatures, seed: u64) -> DraftResult<()>;

    /// Proposes up to `max_len` tokens to follow `context` (every committed token; its last one
    /// is the anchor). Drafts follow `params` (greedy when its temperature is 0).
    fn propose(&mut self, context: &[u32], max_len: usize, params: &SamplingParams) -> DraftResult<Proposal>;

    /// After verification: `context` is the committed sequence now, of which the last token is
    /// the new anchor; `accepted` of the proposal's tokens were kept; `features` covers the
    /// tokens that entered the target's cache this round (the old anchor and the accepted
    /// drafts). Drafters roll back their own state here.
    fn observe(&mut self, context: &[u32], accepted: usize, features: &TargetFeatures) -> DraftResult<()>;
}

/// A borrowed drafter drafts like the drafter: a caller can lend its drafter to a loop that owns
/// its drafters, and read the drafter's state afterwards.
impl<D: Drafter + ?Sized> Drafter for &mut D {
    fn name(&self) -> String {
        (**self).name()
    }

    fn fork(&self) -> Option<Box<dyn Drafter>> {
        (**self).fork()
    }

    fn has_confidence(&self) -> bool {
        (**self).has_confidence()
    }

    fn taps(&self) -> TapSpec {
        (**self).taps()
    }

    fn begin(&mut self, prompt: &[u32], features: &TargetFeatures, seed: u64) -> DraftResult<()> {
        (**self).begin(prompt, features, seed)
    }

    fn propose(&mut self, context: &[u32], max_len: usize, params: &SamplingParams) -> DraftResult<Proposal> {
        (**self).propose(context, max_len, params)
    }

    fn observe(&mut self, context: &[u32], accepted: usize, features: &TargetFeatures) -> DraftResult<()> {
        (**self).observe(context, accepted, features)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposals_are_cut_where_prefix_survival_falls_below_the_threshold() {
        let mut p = Proposal {
            tokens: vec![1, 2, 3, 4],
            dists: vec![DraftDist::OneHot; 4],
            confidence: Some(vec![0.9, 0.8, 0.5, 0.99]),
        };
        let mut q = p.clone();
        p.truncate_below(0.5); // 0.9, 0.72, 0.36 → keep two
        assert_eq!((p.tokens.len(), p.dists.len(), p.confidence.as_ref().unwrap().len()), (2, 2, 2));
        q.truncate_below(0.95);
        assert!(q.is_empty());
        let mut r = Proposal { tokens: vec![5, 6], dists: vec![DraftDist::OneHot; 2], confidence: None };
        r.truncate_below(0.99);
        assert_eq!(r.len(), 2, "no confidences: nothing to cut on");
    }
}
