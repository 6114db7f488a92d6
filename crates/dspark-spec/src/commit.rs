//! What a verified round commits: stop tokens and `max_tokens` applied to the new tokens, and
//! the target's hidden states of the rows that entered the cache, kept for the drafter.

use crate::drafter::TargetFeatures;
use dspark_decode::FinishReason;
use dspark_model::{SeqOutput, TapSpec};

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
