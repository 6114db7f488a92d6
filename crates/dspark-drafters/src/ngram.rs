//! Prompt lookup: find the most recent earlier occurrence of the last n committed tokens and
//! propose what followed it. No model, deterministic drafts (one-hot).

use dspark_sampling::SamplingParams;
use dspark_spec::{DraftDist, DraftResult, Drafter, Proposal, TargetFeatures};

pub struct NgramDrafter {
    /// Longest suffix tried first; shorter ones down to `min_n` if it does not match.
    pub max_n: usize,
    pub min_n: usize,
}

/// A 1-token match predicts poorly and a verify block costs more than a decode step, so by
/// default a bigram must match before anything is proposed.
impl Default for NgramDrafter {
    fn default() -> Self {
        Self { max_n: 4, min_n: 2 }
    }
}

impl NgramDrafter {
    /// The tokens that followed the latest earlier match of the context's last `n` tokens.
    fn lookup(context: &[u32], n: usize, max_len: usize) -> Option<&[u32]> {
        if context.len() <= n {
            return None;
        }
        let suffix = &context[context.len() - n..];
        // Latest match first: recent text predicts best. The match must end before the suffix.
        (0..context.len() - n).rev().find_map(|start| {
            (&context[start..start + n] == suffix).then(|| {
                let from = start + n;
                &context[from..(from + max_len).min(context.len())]
            })
        })
    }
}

impl Drafter for NgramDrafter {
    fn name(&self) -> String {
        "ngram".into()
    }

    fn fork(&self) -> Option<Box<dyn Drafter>> {
        Some(Box::new(Self { max_n: self.max_n, min_n: self.min_n }))
    }

    fn begin(&mut self, _prompt: &[u32], _f: &TargetFeatures, _seed: u64) -> DraftResult<()> {
        Ok(())
    }

    fn propose(&mut self, context: &[u32], max_len: usize, _p: &SamplingParams) -> DraftResult<Proposal> {
        for n in (self.min_n..=self.max_n).rev() {
            if let Some(found) = Self::lookup(context, n, max_len) {
                if !found.is_empty() {
                    return Ok(Proposal {
                        tokens: found.to_vec(),
                        dists: vec![DraftDist::OneHot; found.len()],
                        confidence: None,
                    });
                }
            }
        }
        Ok(Proposal::default())
    }

    fn observe(&mut self, _c: &[u32], _a: usize, _f: &TargetFeatures) -> DraftResult<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_match_of_the_longest_suffix() {
        let mut d = NgramDrafter { max_n: 3, min_n: 1 };
        let p = SamplingParams::default();
        // "1 2 3 4 9 | 1 2 3 5 6 | 1 2 3" → latest match of "1 2 3" is followed by "5 6 1 2 3".
        let ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3];
        assert_eq!(d.propose(&ctx, 3, &p).unwrap().tokens, vec![5, 6, 1]);
        // No 3-gram match, falls back to the 1-gram "7".
        let ctx = [7, 8, 1, 2, 7];
        assert_eq!(d.propose(&ctx, 2, &p).unwrap().tokens, vec![8, 1]);
        assert!(d.propose(&[1, 2, 3], 4, &p).unwrap().is_empty());
    }
}
