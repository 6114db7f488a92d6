//! Whether drafting pays for a sequence, from the timing of its own rounds.

use std::collections::VecDeque;

/// Speculative rounds judged before drafting can pause, the most judged together, plain steps
/// timed before the first probe, and how long drafting pauses after rounds that did not pay (four
/// times longer while probes keep failing). Used by `--drafter auto`
/// (`dspark_drafters::AutoDrafter`). Four rounds alone are a noisy verdict: on Qwen2.5-Coder-1.5B
/// a drafter at 1.6× plain failed such probes often enough to sit out a fifth of its steps.
const PROBE_ROUNDS: usize = 4;
const WINDOW_ROUNDS: usize = 8;
const PLAIN_SAMPLES: usize = 2;
const FIRST_PAUSE: usize = 32;
const MAX_PAUSE: usize = 1024;

/// Whether drafting pays, from timing: a drafter's latest rounds against plain steps of the same
/// sequence. When its latest rounds commit tokens more slowly than plain steps do, drafting
/// pauses for a while before the next probe. What it measured so far:
#[derive(Debug, Clone)]
pub struct Gate {
    plain_s: f64,
    plain_steps: usize,
    /// (tokens committed, seconds) of the latest drafting rounds since the last pause.
    rounds: VecDeque<(usize, f64)>,
    pause: usize,
    next_pause: usize,
}

impl Default for Gate {
    fn default() -> Self {
        Self { plain_s: 0.0, plain_steps: 0, rounds: VecDeque::new(), pause: 0, next_pause: FIRST_PAUSE }
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
        self.rounds.push_back((tokens, seconds));
        if self.rounds.len() > WINDOW_ROUNDS {
            self.rounds.pop_front();
        }
        if self.rounds.len() < PROBE_ROUNDS {
            return;
        }
        let (tokens, seconds) = self.rounds.iter().fold((0, 0.0), |(t, s), &(t1, s1)| (t + t1, s + s1));
        let spec_rate = tokens as f64 / seconds;
        let plain_rate = self.plain_steps as f64 / self.plain_s;
        // Rounds whose drafts were all rejected committed one token a round, as plain steps do,
        // and paid for drafting on top: they cannot pay, whatever the clock said. Where verifying
        // a block costs about one step (a small target, AMX), timing noise alone would keep such
        // a drafter going (CI saw 32 rounds against 6 plain steps).
        let accepted_nothing = tokens <= self.rounds.len();
        if accepted_nothing || spec_rate < plain_rate {
            self.pause = self.next_pause;
            self.next_pause = (self.next_pause * 4).min(MAX_PAUSE);
            self.rounds.clear();
        } else if self.rounds.len() == WINDOW_ROUNDS {
            self.next_pause = FIRST_PAUSE;
        }
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
    fn rounds_that_commit_slower_than_plain_pause_and_a_paying_window_resets_the_pause() {
        let mut g = Gate::default();
        plain_until_drafting(&mut g, 0.010);
        for _ in 0..PROBE_ROUNDS {
            // Two tokens in three plain steps' time.
            g.record(true, 2, 0.030);
        }
        assert_eq!(plain_until_drafting(&mut g, 0.010), FIRST_PAUSE);
        // A whole window that pays resets the pause; then rounds that lose pause it again, once
        // they outweigh the paying rounds still in the window.
        for _ in 0..WINDOW_ROUNDS {
            g.record(true, 4, 0.010);
            assert!(g.drafts());
        }
        let mut losing = 0;
        while g.drafts() {
            g.record(true, 1, 0.030);
            losing += 1;
            assert!(losing <= WINDOW_ROUNDS, "a window of losing rounds pauses drafting");
        }
        assert!(losing > 1, "one losing round among paying ones does not pause drafting");
        assert_eq!(plain_until_drafting(&mut g, 0.010) + 1, FIRST_PAUSE);
    }
}
