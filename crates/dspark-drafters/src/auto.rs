//! `--drafter auto`: prompt lookup wherever it finds a match (it costs nothing when it does not),
//! the model-based drafter where it does not; each only while its rounds commit tokens faster
//! than plain steps (on a larger target a rejected lookup draft costs a verify block: Qwen-1.5B
//! lost 4 % on MBPP with lookup ungated).

use crate::NgramDrafter;
use dspark_model::TapSpec;
use dspark_sampling::SamplingParams;
use dspark_spec::{DraftResult, Drafter, Gate, Proposal, TargetFeatures};
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Source {
    Lookup,
    Model,
    Nothing,
    /// No proposal was asked for this round.
    Untimed,
}

pub struct AutoDrafter {
    lookup: NgramDrafter,
    /// Longest prompt-lookup draft (3: measured best on two cores, docs/BENCHMARKS.md).
    lookup_len: usize,
    model: Option<Box<dyn Drafter>>,
    gate: Gate,
    lookup_gate: Gate,
    /// Target features of rounds the model drafter sat out, fed before it drafts again, so that
    /// rounds without it cost what plain decoding costs.
    pending: TargetFeatures,
    round: Option<(Source, Instant)>,
    /// Rounds drafted by the model drafter, and rounds that drafted nothing.
    pub model_rounds: usize,
    pub empty_rounds: usize,
}

impl AutoDrafter {
    pub fn new(model: Option<Box<dyn Drafter>>, lookup_len: usize) -> Self {
        Self {
            lookup: NgramDrafter::default(),
            lookup_len: lookup_len.max(1),
            model,
            gate: Gate::default(),
            lookup_gate: Gate::default(),
            pending: TargetFeatures::default(),
            round: None,
            model_rounds: 0,
            empty_rounds: 0,
        }
    }
}

impl Drafter for AutoDrafter {
    fn name(&self) -> String {
        match &self.model {
            Some(m) => format!("auto (prompt lookup, {})", m.name()),
            None => "auto (prompt lookup)".into(),
        }
    }

    fn fork(&self) -> Option<Box<dyn Drafter>> {
        let model = match &self.model {
            Some(m) => Some(m.fork()?),
            None => None,
        };
        Some(Box::new(Self::new(model, self.lookup_len)))
    }

    fn has_confidence(&self) -> bool {
        self.model.as_ref().is_some_and(|m| m.has_confidence())
    }

    fn taps(&self) -> TapSpec {
        self.model.as_ref().map(|m| m.taps()).unwrap_or_default()
    }

    fn begin(&mut self, prompt: &[u32], features: &TargetFeatures, seed: u64) -> DraftResult<()> {
        // A new sequence: nothing held back from the last one, and its costs measured afresh.
        self.pending = TargetFeatures::default();
        self.round = None;
        self.gate = Gate::default();
        self.lookup_gate = Gate::default();
        self.lookup.begin(prompt, features, seed)?;
        if let Some(m) = &mut self.model {
            m.begin(prompt, features, seed)?;
        }
        Ok(())
    }

    fn propose(&mut self, context: &[u32], max_len: usize, params: &SamplingParams) -> DraftResult<Proposal> {
        let t0 = Instant::now();
        let found = if self.lookup_gate.drafts() {
            self.lookup.propose(context, max_len.min(self.lookup_len), params)?
        } else {
            Proposal::default()
        };
        let (source, proposal) = if !found.is_empty() {
            (Source::Lookup, found)
        } else if let Some(m) = self.model.as_mut().filter(|_| self.gate.drafts()) {
            if self.pending.rows > 0 {
                m.observe(context, 0, &std::mem::take(&mut self.pending))?;
            }
            (Source::Model, m.propose(context, max_len, params)?)
        } else {
            (Source::Nothing, Proposal::default())
        };
        self.round = Some((source, t0));
        Ok(proposal)
    }

    fn observe(&mut self, context: &[u32], accepted: usize, features: &TargetFeatures) -> DraftResult<()> {
        // A round's time runs from its proposal to this call: drafting, verification, acceptance.
        // A round the loop did not ask for drafts (the first, or one at the end of max_tokens)
        // was not timed and teaches the gates nothing.
        let (source, seconds) = match self.round.take() {
            Some((source, t0)) => (source, t0.elapsed().as_secs_f64()),
            None => (Source::Untimed, 0.0),
        };
        match source {
            Source::Model => {
                self.model_rounds += 1;
                self.gate.record(true, accepted + 1, seconds);
            }
            Source::Nothing => {
                self.empty_rounds += 1;
                self.gate.record(false, 1, seconds);
                self.lookup_gate.record(false, 1, seconds);
            }
            Source::Lookup => self.lookup_gate.record(true, accepted + 1, seconds),
            Source::Untimed => {}
        }
        self.lookup.observe(context, accepted, features)?;
        if let Some(m) = &mut self.model {
            if source == Source::Model {
                m.observe(context, accepted, features)?;
            } else {
                self.pending.extend(features);
            }
        }
        Ok(())
    }
}
