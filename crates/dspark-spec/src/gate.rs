//! Whether drafting pays for a sequence, from the timing of its own rounds.

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
        // A probe whose drafts were all rejected committed one token a round, as plain steps do,
        // and paid for drafting on top: it cannot pay, whatever the clock said. Where verifying a
        // block costs about one step (a small target, AMX), timing noise alone would keep such a
        // drafter going (CI saw 32 rounds against 6 plain steps).
        let accepted_nothing = self.probe_tokens <= self.probe_rounds;
        if accepted_nothing || spec_rate < plain_rate {
            self.pause = self.next_pause;
            self.next_pause = (self.next_pause * 4).min(MAX_PAUSE);
        } else {
            self.next_pause = FIRST_PAUSE;
        }
        (self.probe_s, self.probe_tokens, self.probe_rounds) = (0.0, 0, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps of the gate until it drafts, recording `plain_s` per plain step.
    fn plain_until_drafting(g: &mut Gate, plain_s: f64) -> usize {
        let mut n = 0;
        while !g.drafts() {
            g.record(false, 1, plain_s);
            n += 1;
            assert!(n < 10_000, "the gate never drafts again");
        }
        n
    }

    #[test]
    fn a_probe_that_accepts_nothing_pauses_even_when_timed_faster_than_plain() {
        let mut g = Gate::default();
        assert_eq!(plain_until_drafting(&mut g, 0.010), PLAIN_SAMPLES);
        for _ in 0..PROBE_ROUNDS {
            g.record(true, 1, 0.001);
        }
        assert_eq!(plain_until_drafting(&mut g, 0.010), FIRST_PAUSE);
        for _ in 0..PROBE_ROUNDS {
            g.record(true, 1, 0.001);
        }
        // Failing again pauses four times longer.
        assert_eq!(plain_until_drafting(&mut g, 0.010), 4 * FIRST_PAUSE);
    }

    #[test]
    fn a_probe_that_commits_faster_than_plain_keeps_drafting() {
        let mut g = Gate::default();
        plain_until_drafting(&mut g, 0.010);
        for _ in 0..3 * PROBE_ROUNDS {
            assert!(g.drafts());
            // Three tokens in 1.5 plain steps' time: 2x plain.
            g.record(true, 3, 0.015);
        }
        assert!(g.drafts());
    }

    #[test]
    fn a_probe_that_accepts_but_commits_slower_than_plain_pauses_and_a_later_win_resets_the_pause() {
        let mut g = Gate::default();
        plain_until_drafting(&mut g, 0.010);
        for _ in 0..PROBE_ROUNDS {
            // Two tokens in three plain steps' time.
            g.record(true, 2, 0.030);
        }
        assert_eq!(plain_until_drafting(&mut g, 0.010), FIRST_PAUSE);
        for _ in 0..PROBE_ROUNDS {
            g.record(true, 4, 0.010);
        }
        for _ in 0..PROBE_ROUNDS {
            g.record(true, 1, 0.010);
        }
        // The win reset the pause: the next failure pauses for the first pause again.
        assert_eq!(plain_until_drafting(&mut g, 0.010), FIRST_PAUSE);
    }
}
