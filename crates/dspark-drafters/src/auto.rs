//! `--drafter auto`: prompt lookup and a model-based drafter.
//!
//! A model drafter with a confidence head (DSpark) drafts every round; where prompt lookup also
//! matches, the round verifies whichever first draft is likelier to survive: the model's
//! confidence against lookup's first-draft acceptance so far in this sequence. The scheduler's
//! cost model decides how much of it to verify and when drafting pauses, so the timing gate
//! below is not consulted for it (judged by both, the DSpark drafter on Qwen2.5-Coder-1.5B sat out
//! steps it would have won: 1.48× plain on MBPP against 1.66× without that gate). The choice
//! reads only the first confidence, which depends on no draft of this round, so sampled
//! verification stays exact.
//!
//! Otherwise: prompt lookup wherever it finds a match (it costs nothing when it does not), the
//! model-based drafter where it does not; each only while its rounds commit tokens faster than
//! plain steps (on a larger target a rejected lookup draft costs a verify block: Qwen-1.5B lost
//! 4 % on MBPP with lookup ungated).

use crate::NgramDrafter;
use dspark_model::TapSpec;
use dspark_sampling::SamplingParams;
use dspark_spec::{DraftResult, Drafter, Gate, Proposal, TargetFeatures};
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Source {
    Lookup,
    Model,
    /// Lookup's drafts, chosen over the model's this round.
    LookupOverModel,
    /// Lookup's drafts, so likely to survive that the model drafter was not asked.
    SureLookup,
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
    /// Lookup rounds and those whose first draft survived, in this sequence (against a confidence
    /// head: the choice between the two drafters).
    lookup_tries: (f64, f64),
    /// Rounds drafted by the model drafter, rounds whose lookup drafts were chosen over a model
    /// drafter's, and rounds that drafted nothing.
    pub model_rounds: usize,
    pub lookup_over_model_rounds: usize,
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
            lookup_tries: (0.0, 0.0),
            model_rounds: 0,
            lookup_over_model_rounds: 0,
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
        self.lookup_tries = (0.0, 0.0);
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
        if let Some(m) = self.model.as_mut().filter(|m| m.has_confidence()) {
            let found = self.lookup.propose(context, max_len.min(self.lookup_len), params)?;
            let lookup_p = lookup_first(self.lookup_tries);
            if !found.is_empty() && lookup_p >= SURE_LOOKUP {
                // Copying: the model drafter's round would cost more than it could win.
                self.round = Some((Source::SureLookup, t0));
                return Ok(found);
            }
            if self.pending.rows > 0 {
                m.observe(context, 0, &std::mem::take(&mut self.pending))?;
            }
            let mine = m.propose(context, max_len, params)?;
            let model_first = mine.confidence.as_ref().and_then(|c| c.first()).copied().unwrap_or(0.0);
            let (source, proposal) = if !found.is_empty() && lookup_p > model_first as f64 {
                (Source::LookupOverModel, found)
            } else {
                (Source::Model, mine)
            };
            self.round = Some((source, t0));
            return Ok(proposal);
        }
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
            Source::LookupOverModel | Source::SureLookup => {
                self.lookup_over_model_rounds += 1;
                self.lookup_tries.0 += 1.0;
                self.lookup_tries.1 += if accepted > 0 { 1.0 } else { 0.0 };
            }
            Source::Untimed => {}
        }
        self.lookup.observe(context, accepted, features)?;
        if let Some(m) = &mut self.model {
            match source {
                Source::Model => m.observe(context, accepted, features)?,
                // It drafted, and none of its drafts were verified.
                Source::LookupOverModel => m.observe(context, 0, features)?,
                _ => self.pending.extend(features),
            }
        }
        Ok(())
    }
}

/// Lookup's first-draft survival from which lookup drafts without asking the model drafter.
const SURE_LOOKUP: f64 = 0.9;

/// Lookup's first-draft survival so far, pulled towards an optimistic 0.8 by two imagined rounds,
/// so that lookup is tried at the start of a sequence and judged on what it does after.
fn lookup_first((tries, survived): (f64, f64)) -> f64 {
    (survived + 1.6) / (tries + 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dspark_spec::DraftDist;
    use std::sync::{Arc, Mutex};

    /// A drafter with a confidence head: every draft token 99 at first confidence `c1`. Logs
    /// its proposals and the accepted counts it is told.
    struct Confident {
        c1: f32,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl Drafter for Confident {
        fn name(&self) -> String {
            "confident".into()
        }
        fn has_confidence(&self) -> bool {
            true
        }
        fn begin(&mut self, _: &[u32], _: &TargetFeatures, _: u64) -> DraftResult<()> {
            Ok(())
        }
        fn propose(&mut self, _: &[u32], n: usize, _: &SamplingParams) -> DraftResult<Proposal> {
            self.log.lock().unwrap().push("propose".into());
            Ok(Proposal {
                tokens: vec![99; n],
                dists: vec![DraftDist::OneHot; n],
                confidence: Some(vec![self.c1; n]),
            })
        }
        fn observe(&mut self, _: &[u32], accepted: usize, f: &TargetFeatures) -> DraftResult<()> {
            self.log.lock().unwrap().push(format!("observe {accepted} rows {}", f.rows));
            Ok(())
        }
    }

    fn rows(n: usize) -> TargetFeatures {
        TargetFeatures { rows: n, taps: vec![], final_norm: None }
    }

    /// Prompt lookup wins rounds while its first drafts survive more often than the model's
    /// first confidence, is asked alone once it is nearly always right, and loses the rounds to
    /// the model once it keeps failing; the model is told of every round it drafted for.
    #[test]
    fn lookup_and_a_confidence_head_compete_on_first_draft_survival() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let model = Confident { c1: 0.3, log: log.clone() };
        let mut d = AutoDrafter::new(Some(Box::new(model)), 3);
        // "1 2 3" occurred before: lookup proposes 4 5 1.
        let ctx = [1u32, 2, 3, 4, 5, 1, 2, 3];
        let greedy = SamplingParams::default();
        d.begin(&ctx, &rows(ctx.len() - 1), 0).unwrap();
        let mut entered = 0;
        let mut round = |d: &mut AutoDrafter, accepted: usize| {
            let p = d.propose(&ctx, 7, &greedy).unwrap();
            d.observe(&ctx, accepted, &rows(accepted + 1)).unwrap();
            entered += accepted + 1;
            p.tokens
        };
        // Optimistic at first (0.8 > 0.3): lookup's drafts, and the model was asked and told 0.
        assert_eq!(round(&mut d, 3), vec![4, 5, 1]);
        assert_eq!(*log.lock().unwrap(), ["propose", "observe 0 rows 4"]);
        // Right every time: past 0.9 the model is no longer asked.
        while log.lock().unwrap().len() < 100 {
            let before = log.lock().unwrap().len();
            assert_eq!(round(&mut d, 3), vec![4, 5, 1]);
            if log.lock().unwrap().len() == before {
                break;
            }
        }
        let asked = log.lock().unwrap().len();
        assert!(asked < 100, "lookup that keeps surviving is asked alone");
        assert!(lookup_first(d.lookup_tries) >= SURE_LOOKUP);
        // Failing every time, lookup falls under the model's 0.3 and the model's drafts win.
        let mut lost = 0;
        while round(&mut d, 0) == vec![4, 5, 1] {
            lost += 1;
            assert!(lost < 1000, "lookup that keeps failing loses the rounds");
        }
        assert!(lookup_first(d.lookup_tries) <= 0.3 + 1e-9);
        // Every row that entered the cache reached the model, those of rounds it sat out before
        // it drafted again.
        let fed: usize = log
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| l.strip_prefix("observe ")?.rsplit(' ').next()?.parse::<usize>().ok())
            .sum();
        assert_eq!(fed, entered);
    }
}
