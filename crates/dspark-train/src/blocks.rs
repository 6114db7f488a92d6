//! Anchored training blocks: where blocks may start, which labels they get, how much each
//! position counts.

use crate::data::Sample;
use rand::Rng;

/// Positions p where a block may be anchored: p and p + 1 are both assistant tokens.
pub fn anchor_candidates(s: &Sample, len: usize) -> Vec<usize> {
    let len = len.min(s.tokens.len());
    (s.prompt_len..len.saturating_sub(1)).filter(|&p| s.is_assistant(p) && s.is_assistant(p + 1)).collect()
}

/// `n` distinct anchors drawn uniformly from the candidates (all of them if fewer), sorted.
pub fn sample_anchors(candidates: &[usize], n: usize, rng: &mut impl Rng) -> Vec<usize> {
    let mut picked = if candidates.len() <= n {
        candidates.to_vec()
    } else {
        rand::seq::index::sample(rng, candidates.len(), n).into_iter().map(|i| candidates[i]).collect()
    };
    picked.sort_unstable();
    picked
}

/// One block's slots: slot k (0-based) predicts the token at `p + k + 1`, after the token at
/// `p + k`. Slots past the sequence's end are masked.
#[derive(Debug, Clone, PartialEq)]
pub struct Slot {
    /// The token before the slot (teacher forcing for the sequential head).
    pub prev: u32,
    /// The token to predict, if inside the sequence.
    pub label: Option<u32>,
    /// Position whose target final-norm state gives the target distribution for this slot.
    pub target_row: usize,
}

pub fn block_slots(tokens: &[u32], len: usize, p: usize, gamma: usize) -> Vec<Slot> {
    (0..gamma)
        .map(|k| {
            let at = p + k + 1;
            Slot {
                prev: tokens[(p + k).min(len - 1)],
                label: (at < len).then(|| tokens[at]),
                target_row: (p + k).min(len - 1),
            }
        })
        .collect()
}

/// DSpark's position weight for slot k (0-based): `exp(−k/4)`, i.e. `exp(−(k−1)/4)` 1-based.
pub fn position_weight(k: usize) -> f32 {
    (-(k as f32) / 4.0).exp()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn sample() -> Sample {
        // Prompt of 3 tokens, answer of 5: positions 3..=7 are assistant tokens.
        Sample { index: 0, tokens: vec![10, 11, 12, 20, 21, 22, 23, 24], prompt_len: 3 }
    }

    #[test]
    fn anchors_need_two_assistant_tokens_and_respect_the_cut() {
        assert_eq!(anchor_candidates(&sample(), 100), vec![3, 4, 5, 6]);
        assert_eq!(anchor_candidates(&sample(), 6), vec![3, 4]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for _ in 0..50 {
            let a = sample_anchors(&[3, 4, 5, 6], 2, &mut rng);
            assert_eq!(a.len(), 2);
            assert!(a[0] < a[1] && a.iter().all(|x| (3..=6).contains(x)));
        }
        assert_eq!(sample_anchors(&[3, 4], 5, &mut rng), vec![3, 4]);
    }

    #[test]
    fn slots_are_labelled_with_the_following_tokens_and_masked_past_the_end() {
        let s = sample();
        let slots = block_slots(&s.tokens, 8, 5, 3);
        assert_eq!(
            slots,
            vec![
                Slot { prev: 22, label: Some(23), target_row: 5 },
                Slot { prev: 23, label: Some(24), target_row: 6 },
                Slot { prev: 24, label: None, target_row: 7 },
            ]
        );
        assert!((position_weight(0) - 1.0).abs() < 1e-7);
        assert!((position_weight(4) - (-1f32).exp()).abs() < 1e-7);
    }
}
