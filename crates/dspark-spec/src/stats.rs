//! Per-run and per-position statistics of speculative decoding.

use serde::Serialize;

#[derive(Debug, Clone, Default, Serialize)]
pub struct SpecStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub rounds: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// Tokens committed per round, bonus or correction included (accepted + 1 each round).
    pub committed: usize,
    /// Rounds in which verification reached draft position k (every earlier draft accepted).
    pub reached_at: Vec<usize>,
    /// Rounds in which the draft at position k was accepted.
    pub accepted_at_count: Vec<usize>,
    /// Rounds that verified k drafts, at index k: what the scheduler chose to verify (a round
    /// verifies at least one draft; steps that verified none are `plain_steps`).
    pub verified_len: Vec<usize>,
    pub prefill_s: f64,
    pub decode_s: f64,
    pub draft_s: f64,
    pub verify_s: f64,
    /// Steps that drafted nothing (no prompt-lookup match, or `--drafter auto` decided drafting
    /// did not pay): each verifies the anchor alone and commits one token. Not counted in
    /// `rounds`.
    pub plain_steps: usize,
}

impl SpecStats {
    pub fn record_round(&mut self, drafted: usize, accepted: usize, draft_s: f64, verify_s: f64) {
        self.rounds += 1;
        self.drafted += drafted;
        self.accepted += accepted;
        self.committed += accepted + 1;
        if self.reached_at.len() < drafted {
            self.reached_at.resize(drafted, 0);
            self.accepted_at_count.resize(drafted, 0);
        }
        for k in 0..drafted.min(accepted + 1) {
            self.reached_at[k] += 1;
        }
        for k in 0..accepted {
            self.accepted_at_count[k] += 1;
        }
        if self.verified_len.len() <= drafted {
            self.verified_len.resize(drafted + 1, 0);
        }
        self.verified_len[drafted] += 1;
        self.draft_s += draft_s;
        self.verify_s += verify_s;
    }

    /// τ: mean tokens committed per target forward (verify step), bonus included; a step that
    /// drafted nothing commits one.
    pub fn tau(&self) -> f64 {
        let steps = self.rounds + self.plain_steps;
        if steps == 0 {
            0.0
        } else {
            (self.committed + self.plain_steps) as f64 / steps as f64
        }
    }

    /// Conditional acceptance at each draft position: accepted at k / reached k.
    pub fn accept_at(&self) -> Vec<f64> {
        self.reached_at
            .iter()
            .zip(&self.accepted_at_count)
            .map(|(&r, &a)| if r == 0 { 0.0 } else { a as f64 / r as f64 })
            .collect()
    }

    /// Tokens per second of `decode_s`: every token but the first, which the prefill yields (as
    /// plain decoding counts it).
    pub fn decode_tok_s(&self) -> f64 {
        if self.decode_s > 0.0 {
            self.generated_tokens.saturating_sub(1) as f64 / self.decode_s
        } else {
            0.0
        }
    }

    /// Adds another run's counts (benchmarks over many prompts).
    pub fn merge(&mut self, o: &SpecStats) {
        self.prompt_tokens += o.prompt_tokens;
        self.generated_tokens += o.generated_tokens;
        self.rounds += o.rounds;
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        self.committed += o.committed;
        let n = self.reached_at.len().max(o.reached_at.len());
        self.reached_at.resize(n, 0);
        self.accepted_at_count.resize(n, 0);
        for (i, (&r, &a)) in o.reached_at.iter().zip(&o.accepted_at_count).enumerate() {
            self.reached_at[i] += r;
            self.accepted_at_count[i] += a;
        }
        if self.verified_len.len() < o.verified_len.len() {
            self.verified_len.resize(o.verified_len.len(), 0);
        }
        for (x, y) in self.verified_len.iter_mut().zip(&o.verified_len) {
            *x += y;
        }
        self.prefill_s += o.prefill_s;
        self.decode_s += o.decode_s;
        self.draft_s += o.draft_s;
        self.verify_s += o.verify_s;
        self.plain_steps += o.plain_steps;
    }

    /// Verify steps by the number of drafts they verified, steps that verified none (plain
    /// steps) at index 0: the scheduler's choices at a glance.
    pub fn verify_lengths(&self) -> Vec<usize> {
        let mut h = self.verified_len.clone();
        if h.is_empty() {
            h.push(0);
        }
        h[0] += self.plain_steps;
        h
    }

    /// `verify_lengths` as one line, e.g. `0:12 1:3 2:40 3:7` (lengths never chosen left out).
    pub fn verify_lengths_line(&self) -> String {
        let parts: Vec<String> = self
            .verify_lengths()
            .iter()
            .enumerate()
            .filter(|(_, &n)| n > 0)
            .map(|(k, n)| format!("{k}:{n}"))
            .collect();
        parts.join(" ")
    }

    /// The `--json` form: counts plus τ and per-position acceptance.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "decode_tok_s": self.decode_tok_s(),
            "rounds": self.rounds,
            "tau": self.tau(),
            "accept_at": self.accept_at(),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "plain_steps": self.plain_steps,
            "verify_lengths": self.verify_lengths(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tau_and_per_position_acceptance_from_a_hand_made_run() {
        // Four rounds of γ = 3: accepted 3, 0, 1, 2 drafts.
        let mut s = SpecStats::default();
        for a in [3, 0, 1, 2] {
            s.record_round(3, a, 0.0, 0.0);
        }
        // Committed: 4 + 1 + 2 + 3 = 10 over 4 rounds.
        assert_eq!(s.tau(), 2.5);
        // Position 0 reached 4×, accepted 3×; position 1 reached 3× (rounds 1, 3, 4), accepted
        // 2×; position 2 reached 2× (rounds 1, 4), accepted 1×.
        assert_eq!(s.reached_at, vec![4, 3, 2]);
        assert_eq!(s.accepted_at_count, vec![3, 2, 1]);
        assert_eq!(s.accept_at(), vec![0.75, 2.0 / 3.0, 0.5]);
    }

    #[test]
    fn verify_lengths_count_rounds_by_drafts_verified_and_plain_steps_at_zero() {
        let mut s = SpecStats::default();
        s.record_round(3, 1, 0.0, 0.0);
        s.record_round(1, 1, 0.0, 0.0);
        s.record_round(3, 0, 0.0, 0.0);
        s.plain_steps = 2;
        assert_eq!(s.verify_lengths(), vec![2, 1, 0, 2]);
        assert_eq!(s.verify_lengths_line(), "0:2 1:1 3:2");
        let mut t = SpecStats::default();
        t.record_round(5, 5, 0.0, 0.0);
        t.merge(&s);
        assert_eq!(t.verify_lengths(), vec![2, 1, 0, 2, 0, 1]);
        assert_eq!(t.rounds, 4);
    }
}
