//! The target distribution a sampler draws from: logits shaped by temperature, top-k and top-p.
//! Speculative verification uses the same shaping, so plain and speculative sampling target
//! exactly the same distribution.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be a finite number ≥ 0 (0 = greedy), got {0}")]
    Temperature(f32),
    #[error("top-p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("top-k must be ≥ 1 (or absent), got 0")]
    TopK,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 0.0, top_k: None, top_p: None }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(SamplingError::TopP(p));
            }
        }
        if self.top_k == Some(0) {
            return Err(SamplingError::TopK);
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The full-vocabulary distribution to sample from (for greedy: one-hot on the argmax).
    /// Probabilities are f64 so that exactness tests can sum them without drift.
    pub fn distribution(&self, logits: &[f32]) -> Vec<f64> {
        let mut p = vec![0f64; logits.len()];
        if self.is_greedy() {
            p[argmax(logits)] = 1.0;
            return p;
        }
        let t = self.temperature as f64;
        let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let weight = |i: usize| ((logits[i] as f64 - max) / t).exp();
        if self.top_k.is_none_or(|k| k >= logits.len()) && self.top_p.is_none_or(|q| q >= 1.0) {
            let w: Vec<f64> = (0..logits.len()).map(weight).collect();
            let z: f64 = w.iter().sum();
            return w.into_iter().map(|x| x / z).collect();
        }
        // Ties broken by token id so that the kept set never depends on sort stability.
        let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        let k = self.top_k.unwrap_or(logits.len()).min(logits.len());
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, by_logit);
            idx.truncate(k);
        }
        // The top-k set's mass normalises top-p, as in plain sampling; only the head that top-p
        // keeps needs sorting, so sort a growing prefix until its mass reaches p.
        let total: f64 = idx.iter().map(|&i| weight(i)).sum();
        let keep = match self.top_p {
            None => {
                idx.sort_unstable_by(by_logit);
                idx.len()
            }
            Some(top_p) => {
                let mut m = 64.min(idx.len());
                loop {
                    if m < idx.len() {
                        idx.select_nth_unstable_by(m - 1, by_logit);
                    }
                    idx[..m].sort_unstable_by(by_logit);
                    let mut cum = 0.0;
                    let cut = idx[..m].iter().position(|&i| {
                        cum += weight(i) / total;
                        cum >= top_p as f64
                    });
                    match cut {
                        Some(c) => break c + 1,
                        None if m == idx.len() => break m,
                        None => m = (m * 4).min(idx.len()),
                    }
                }
            }
        };
        let w: Vec<f64> = idx[..keep].iter().map(|&i| weight(i)).collect();
        let z: f64 = w.iter().sum();
        for (&i, wi) in idx[..keep].iter().zip(&w) {
            p[i] = wi / z;
        }
        p
    }
}

/// The first index of the largest value (NaNs never win, except a NaN at index 0, which nothing
/// beats: the running-best definition, [`argmax_scan`]). Two passes that vectorise, a lane-wise
/// maximum and then the first position equal to it, in place of one branch per element: greedy
/// verification takes it over the whole vocabulary for every verified position, and a drafter
/// once per drafted one (7 × 8 192 a SmolLM2 round, ~6 % of it with the branchy loop).
pub fn argmax(logits: &[f32]) -> usize {
    const LANES: usize = 16;
    match logits.first() {
        None => return 0,
        Some(v) if v.is_nan() => return 0,
        _ => {}
    }
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            // `f32::max` keeps the non-NaN side; written as a select so that it vectorises.
            *m = if v > *m { v } else { *m };
        }
    }
    let max = tail.iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    // All values NaN or −∞ past index 0: the running best never moves off index 0.
    if max == f32::NEG_INFINITY || max <= logits[0] {
        return 0;
    }
    logits.iter().position(|&v| v == max).unwrap_or(0)
}

/// The running-best definition of [`argmax`], one comparison per element.
pub fn argmax_scan(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best
}

/// A seeded random source; every draw of a run comes from it, so runs repeat exactly.
pub struct Sampler {
    rng: StdRng,
}

impl Sampler {
    pub fn new(seed: u64) -> Self {
        Self { rng: StdRng::seed_from_u64(seed) }
    }

    pub fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// Draws an index from a distribution whose entries sum to (about) one.
    pub fn draw(&mut self, p: &[f64]) -> usize {
        let total: f64 = p.iter().sum();
        let u = self.uniform() * total;
        let mut cum = 0.0;
        let mut last = 0;
        for (i, &pi) in p.iter().enumerate() {
            if pi > 0.0 {
                cum += pi;
                last = i;
                if u < cum {
                    return i;
                }
            }
        }
        last
    }

    /// Samples a token from logits under `params`.
    pub fn sample(&mut self, logits: &[f32], params: &SamplingParams) -> u32 {
        if params.is_greedy() {
            return argmax(logits) as u32;
        }
        self.draw(&params.distribution(logits)) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_one_hot_on_the_first_maximum() {
        let p = SamplingParams::default().distribution(&[1.0, 3.0, 3.0, -1.0]);
        assert_eq!(p, vec![0.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    fn argmax_is_the_running_best() {
        let mut rng = StdRng::seed_from_u64(7);
        let specials = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0, 1.0];
        for len in [0usize, 1, 2, 15, 16, 17, 33, 100, 8192] {
            for _ in 0..200 {
                // Few distinct values, so that ties and specials are common.
                let v: Vec<f32> = (0..len)
                    .map(|_| match rng.random_range(0..10) {
                        0 => specials[rng.random_range(0..specials.len())],
                        _ => rng.random_range(-3i32..3) as f32,
                    })
                    .collect();
                assert_eq!(argmax(&v), argmax_scan(&v), "{v:?}");
            }
        }
        assert_eq!(argmax(&[f32::NAN, 5.0, 9.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 3.0, 3.0]), 2);
    }

    #[test]
    fn temperature_one_is_softmax() {
        let logits = [0.0f32, (2.0f32).ln(), (3.0f32).ln()];
        let p = SamplingParams { temperature: 1.0, ..Default::default() }.distribution(&logits);
        for (a, b) in p.iter().zip([1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0]) {
            assert!((a - b).abs() < 1e-6, "{p:?}");
        }
    }

    #[test]
    fn top_k_and_top_p_keep_the_right_set_and_renormalise() {
        let logits = [(1.0f32).ln(), (2.0f32).ln(), (3.0f32).ln(), (4.0f32).ln()];
        let s = SamplingParams { temperature: 1.0, top_k: Some(2), top_p: None };
        let p = s.distribution(&logits);
        assert!(
            (p[3] - 4.0 / 7.0).abs() < 1e-6 && (p[2] - 3.0 / 7.0).abs() < 1e-6 && p[0] == 0.0 && p[1] == 0.0
        );
        // Probabilities 0.4, 0.3, 0.2, 0.1: top-p 0.65 keeps {0.4, 0.3}.
        let s = SamplingParams { temperature: 1.0, top_k: None, top_p: Some(0.65) };
        let p = s.distribution(&logits);
        assert!((p[3] - 4.0 / 7.0).abs() < 1e-6 && p[1] == 0.0, "{p:?}");
    }

    /// The straightforward definition: sort everything, cut at k, then at p.
    fn naive(logits: &[f32], s: &SamplingParams) -> Vec<f64> {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b)));
        idx.truncate(s.top_k.unwrap_or(idx.len()));
        let t = s.temperature as f64;
        let w: Vec<f64> = idx.iter().map(|&i| (logits[i] as f64 / t).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut keep = w.len();
        if let Some(q) = s.top_p {
            let mut cum = 0.0;
            keep = w
                .iter()
                .position(|x| {
                    cum += x / total;
                    cum >= q as f64
                })
                .map_or(w.len(), |c| c + 1);
        }
        let z: f64 = w[..keep].iter().sum();
        let mut p = vec![0.0; logits.len()];
        for (&i, x) in idx[..keep].iter().zip(&w) {
            p[i] = x / z;
        }
        p
    }

    #[test]
    fn partial_sorting_keeps_exactly_the_naive_set() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for trial in 0..60 {
            let v = [10, 300, 5000][trial % 3];
            // Some ties, some spread.
            let logits: Vec<f32> =
                (0..v).map(|_| (rng.random_range(-8.0f32..8.0) * 4.0).round() / 4.0).collect();
            let s = SamplingParams {
                temperature: [0.3, 1.0, 1.7][trial % 3],
                top_k: [None, Some(1), Some(7), Some(500)][trial % 4],
                top_p: [None, Some(0.05), Some(0.5), Some(0.95), Some(1.0)][trial % 5],
            };
            let (a, b) = (s.distribution(&logits), naive(&logits, &s));
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 1e-9, "trial {trial} {s:?}");
            }
        }
    }

    #[test]
    fn draws_follow_the_distribution() {
        let mut s = Sampler::new(7);
        let p = [0.1, 0.0, 0.6, 0.3];
        let mut counts = [0usize; 4];
        let n = 200_000;
        for _ in 0..n {
            counts[s.draw(&p)] += 1;
        }
        assert_eq!(counts[1], 0);
        for i in 0..4 {
            assert!((counts[i] as f64 / n as f64 - p[i]).abs() < 0.005, "{counts:?}");
        }
    }

    #[test]
    fn bad_parameters_are_rejected() {
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { temperature: f32::NAN, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { top_p: Some(0.0), ..Default::default() }.validate().is_err());
        assert!(SamplingParams { top_p: Some(1.5), ..Default::default() }.validate().is_err());
        assert!(SamplingParams { top_k: Some(0), ..Default::default() }.validate().is_err());
    }
}
