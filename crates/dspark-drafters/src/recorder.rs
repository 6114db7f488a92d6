//! Records what STS calibration fits on: a drafter's confidences per round and how many drafts
//! were accepted.

use dspark_schedule::calibration::{Round, Scaling};

/// Wraps a drafter and records, per round, its confidence logits (undoing the scaling it
/// applied) and how many drafts were accepted.
pub struct Recorder<'a> {
    pub inner: &'a mut dyn dspark_spec::Drafter,
    /// The scaling the drafter applies now (identity when uncalibrated).
    pub scaling: Scaling,
    pending: Option<Vec<f32>>,
    pub rounds: Vec<Round>,
}

impl<'a> Recorder<'a> {
    pub fn new(inner: &'a mut dyn dspark_spec::Drafter, scaling: Scaling) -> Self {
        Self { inner, scaling, pending: None, rounds: Vec::new() }
    }
}

impl dspark_spec::Drafter for Recorder<'_> {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn taps(&self) -> dspark_model::TapSpec {
        self.inner.taps()
    }

    fn begin(
        &mut self,
        prompt: &[u32],
        f: &dspark_spec::TargetFeatures,
        seed: u64,
    ) -> dspark_spec::DraftResult<()> {
        self.inner.begin(prompt, f, seed)
    }

    fn propose(
        &mut self,
        context: &[u32],
        max_len: usize,
        params: &dspark_sampling::SamplingParams,
    ) -> dspark_spec::DraftResult<dspark_spec::Proposal> {
        let p = self.inner.propose(context, max_len, params)?;
        self.pending = p.confidence.as_ref().map(|c| {
            c.iter()
                .enumerate()
                .map(|(k, &q)| {
                    let q = (q as f64).clamp(1e-7, 1.0 - 1e-7);
                    self.scaling.invert(k, (q / (1.0 - q)).ln()) as f32
                })
                .collect()
        });
        Ok(p)
    }

    fn observe(
        &mut self,
        context: &[u32],
        accepted: usize,
        f: &dspark_spec::TargetFeatures,
    ) -> dspark_spec::DraftResult<()> {
        if let Some(logits) = self.pending.take() {
            if !logits.is_empty() {
                self.rounds.push(Round { logits, accepted });
            }
        }
        self.inner.observe(context, accepted, f)
    }
}
