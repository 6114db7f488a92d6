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
        if spec_rate < plain_rate {
            self.pause = self.next_pause;
            self.next_pause = (self.next_pause * 4).min(MAX_PAUSE);
        } else {
            self.next_pause = FIRST_PAUSE;
        }
        (self.probe_s, self.probe_tokens, self.probe_rounds) = (0.0, 0, 0);
    }
}
