//! Sequential temperature scaling (DSPARK.md §3): per draft position k, a temperature T_k (and
//! an offset b_k), fitted left to right to minimise the ECE of the prefix survival `∏_{i≤k} σ(z_i / T_i + b_i)`
//! against "the first k drafts were accepted", earlier positions held fixed.
//!
//! The offset b_k is ours, not the paper's (which has b = 0): a temperature only stretches the
//! logit about 0, so a head that is wrong by a constant — the shipped Qwen drafter's position 1
//! predicted ≈ 12 points above its held-out acceptance, ECE 12 % that no T lowered — stays wrong.
//! With the offset it is per-position Platt scaling, still monotone in z. `fit_with` over a bias
//! grid of `[0.0]` is the paper's STS exactly.
//!
//! [`OnlineCalibration`] refits the same scalings while serving, on a sliding window of
//! verified rounds, per workload tag.

use std::collections::{BTreeMap, VecDeque};

/// One verification round: the confidence head's logits (before any scaling) and how many
/// of the drafts were accepted.
#[derive(Debug, Clone)]
pub struct Round {
    pub logits: Vec<f32>,
    pub accepted: usize,
}

/// Per-position scaling of the confidence head's logit, `z / T_k + b_k`; positions past the
/// end of either list keep T = 1, b = 0.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Scaling {
    pub temps: Vec<f64>,
    pub biases: Vec<f64>,
}

impl Scaling {
    /// From a checkpoint's optional lists, padded to `gamma` positions.
    pub fn from_config(temps: Option<&[f32]>, biases: Option<&[f32]>, gamma: usize) -> Self {
        let pad = |v: Option<&[f32]>, d: f64| -> Vec<f64> {
            (0..gamma).map(|k| v.and_then(|v| v.get(k)).map_or(d, |&x| x as f64)).collect()
        };
        Self { temps: pad(temps, 1.0), biases: pad(biases, 0.0) }
    }

    pub fn identity(gamma: usize) -> Self {
        Self { temps: vec![1.0; gamma], biases: vec![0.0; gamma] }
    }

    pub fn temp(&self, k: usize) -> f64 {
        self.temps.get(k).copied().unwrap_or(1.0)
    }

    pub fn bias(&self, k: usize) -> f64 {
        self.biases.get(k).copied().unwrap_or(0.0)
    }

    /// The calibrated logit at position k.
    pub fn apply(&self, k: usize, z: f64) -> f64 {
        z / self.temp(k) + self.bias(k)
    }

    /// The raw logit whose calibrated value at position k is `s`.
    pub fn invert(&self, k: usize, s: f64) -> f64 {
        (s - self.bias(k)) * self.temp(k)
    }

    /// This scaling with position k set to (t, b), padding the positions before it.
    pub fn with(&self, k: usize, t: f64, b: f64) -> Self {
        let n = (k + 1).max(self.temps.len()).max(self.biases.len());
        let mut s = Self {
            temps: (0..n).map(|i| self.temp(i)).collect(),
            biases: (0..n).map(|i| self.bias(i)).collect(),
        };
        s.temps[k] = t;
        s.biases[k] = b;
        s
    }
}

pub const BINS: usize = 20;

pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Expected calibration error with equal-width bins: `Σ_b n_b/N · |mean(y) − mean(p)|`.
pub fn ece(pred: &[f64], label: &[bool]) -> f64 {
    if pred.is_empty() {
        return 0.0;
    }
    let mut n = [0usize; BINS];
    let (mut sp, mut sy) = ([0f64; BINS], [0f64; BINS]);
    for (&p, &y) in pred.iter().zip(label) {
        let b = ((p * BINS as f64) as usize).min(BINS - 1);
        n[b] += 1;
        sp[b] += p;
        sy[b] += y as u8 as f64;
    }
    (0..BINS).filter(|&b| n[b] > 0).map(|b| (sy[b] - sp[b]).abs()).sum::<f64>() / pred.len() as f64
}

/// Prefix survival at position `k` (0-based) of every round that drafted that far, with the
/// label "accepted at least k + 1".
pub fn survival(rounds: &[Round], s: &Scaling, k: usize) -> (Vec<f64>, Vec<bool>) {
    let mut pred = Vec::new();
    let mut label = Vec::new();
    for r in rounds.iter().filter(|r| r.logits.len() > k) {
        let a: f64 = (0..=k).map(|i| sigmoid(s.apply(i, r.logits[i] as f64))).product();
        pred.push(a);
        label.push(r.accepted > k);
    }
    (pred, label)
}

/// The temperature grid: 256 log-spaced values in [0.05, 20], plus 1.
pub fn grid() -> Vec<f64> {
    let (lo, hi) = (0.05f64.ln(), 20f64.ln());
    let mut g: Vec<f64> = (0..256).map(|i| (lo + (hi - lo) * i as f64 / 255.0).exp()).collect();
    g.push(1.0);
    g
}

/// The offset grid: −3 to 3 in steps of 0.1 (0 included exactly).
pub fn bias_grid() -> Vec<f64> {
    (-30..=30).map(|i| i as f64 / 10.0).collect()
}

/// Labels of each class a position needs before its scaling is fitted: with fewer, the ECE
/// it would minimise is a handful of rounds (the first shipped DSpark drafter got T₆ = 0.05, the
/// grid's floor, from an ECE of 0.02 %), so the position keeps T = 1, b = 0.
pub const MIN_LABELS: usize = 30;

/// A fit: the scaling, and the ECE per position before (identity) and after.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    pub scaling: Scaling,
    pub before: Vec<f64>,
    pub after: Vec<f64>,
}

/// Fits (T_k, b_k) left to right, over [`grid`] and, with `offsets`, [`bias_grid`] (else
/// b = 0: the paper's STS); the ECE is on the rounds fitted (see [`fit_held_out`] for an honest
/// "after").
pub fn fit(rounds: &[Round], gamma: usize, offsets: bool) -> Fit {
    let biases = if offsets { bias_grid() } else { vec![0.0] };
    fit_with(rounds, gamma, &grid(), &biases)
}

/// Brier score of prefix survivals: `mean((p − y)²)`. A proper score: unlike the binned ECE it
/// does not reward predictions flattened towards the base rate.
pub fn brier(pred: &[f64], label: &[bool]) -> f64 {
    if pred.is_empty() {
        return 0.0;
    }
    pred.iter().zip(label).map(|(&p, &y)| (p - y as u8 as f64).powi(2)).sum::<f64>() / pred.len() as f64
}

/// Fits on the even-numbered rounds and reports the ECE per position before and after on the
/// odd-numbered ones, which the fit never saw. Left to right, position k is fitted given the
/// scalings kept before it, and three candidates compete on the odd rounds: the identity, the
/// best temperature (STS) and, with `offsets`, the best (T, b). The lowest held-out ECE wins
/// among those whose held-out Brier score is no worse than the identity's (binned ECE alone
/// would reward a flat prediction at the base rate, which an offset makes reachable). ECE over
/// 20 bins is a noisy objective: the shipped Qwen drafter's fits sharpened positions 1–3
/// (T ≈ 0.6) while raising their held-out ECE. The "after" is measured on the rounds that chose
/// among the three, so it is slightly optimistic.
pub fn fit_held_out(rounds: &[Round], gamma: usize, offsets: bool) -> Fit {
    let fit_on: Vec<Round> = rounds.iter().step_by(2).cloned().collect();
    let test: Vec<Round> = rounds.iter().skip(1).step_by(2).cloned().collect();
    let (temps, biases) = (grid(), if offsets { bias_grid() } else { vec![0.0] });
    let scores = |s: &Scaling, k: usize| {
        let (p, y) = survival(&test, s, k);
        (ece(&p, &y), brier(&p, &y))
    };
    let ones = Scaling::identity(gamma);
    let before = (0..gamma).map(|k| scores(&ones, k).0).collect();
    let mut scaling = ones;
    for k in 0..gamma {
        let base = scores(&scaling, k);
        let mut best = (base.0, scaling.clone());
        let sts = fit_position(&fit_on, &scaling, k, &temps, &[0.0]);
        let joint = if offsets { fit_position(&fit_on, &scaling, k, &temps, &biases) } else { None };
        for (t, b) in [sts, joint].into_iter().flatten() {
            let trial = scaling.with(k, t, b);
            let (e, br) = scores(&trial, k);
            if e < best.0 && br <= base.1 + 1e-12 {
                best = (e, trial);
            }
        }
        scaling = best.1;
    }
    let after = (0..gamma).map(|k| scores(&scaling, k).0).collect();
    Fit { scaling, before, after }
}

/// The (T, b) over the grids that minimises the ECE of the prefix survival at position k,
/// earlier positions scaled by `s`; `None` when the position has fewer than [`MIN_LABELS`] of
/// either class. Ties go to the least change (`|ln T| + |b|`).
fn fit_position(
    rounds: &[Round],
    s: &Scaling,
    k: usize,
    temps: &[f64],
    biases: &[f64],
) -> Option<(f64, f64)> {
    let at_k: Vec<&Round> = rounds.iter().filter(|r| r.logits.len() > k).collect();
    let y: Vec<bool> = at_k.iter().map(|r| r.accepted > k).collect();
    let positives = y.iter().filter(|&&v| v).count();
    if positives < MIN_LABELS || y.len() - positives < MIN_LABELS {
        return None;
    }
    // The survival of the positions before k is fixed: one product per round.
    let prefix: Vec<f64> =
        at_k.iter().map(|r| (0..k).map(|i| sigmoid(s.apply(i, r.logits[i] as f64))).product()).collect();
    let mut pred = vec![0.0; at_k.len()];
    let mut best = (f64::INFINITY, f64::INFINITY, 1.0, 0.0);
    for &t in temps {
        for &b in biases {
            for ((q, r), a) in pred.iter_mut().zip(&at_k).zip(&prefix) {
                *q = a * sigmoid(r.logits[k] as f64 / t + b);
            }
            let e = ece(&pred, &y);
            let dist = t.ln().abs() + b.abs();
            if e < best.0 - 1e-12 || ((e - best.0).abs() <= 1e-12 && dist < best.1) {
                best = (e, dist, t, b);
            }
        }
    }
    Some((best.2, best.3))
}

/// Fits position after position with `choose` (given the scalings fitted before it; `None`
/// keeps T = 1, b = 0), with the ECE per position before and after on the same rounds.
fn fit_left_to_right(
    rounds: &[Round],
    gamma: usize,
    mut choose: impl FnMut(&Scaling, usize) -> Option<(f64, f64)>,
) -> Fit {
    let mut s = Scaling::identity(gamma);
    let ece_at = |s: &Scaling, k: usize| {
        let (p, y) = survival(rounds, s, k);
        ece(&p, &y)
    };
    let before = (0..gamma).map(|k| ece_at(&s, k)).collect();
    for k in 0..gamma {
        if let Some((t, b)) = choose(&s, k) {
            s = s.with(k, t, b);
        }
    }
    let after = (0..gamma).map(|k| ece_at(&s, k)).collect();
    Fit { scaling: s, before, after }
}

/// [`fit`] over given temperature and offset grids, searched jointly.
pub fn fit_with(rounds: &[Round], gamma: usize, temps: &[f64], biases: &[f64]) -> Fit {
    fit_left_to_right(rounds, gamma, |s, k| fit_position(rounds, s, k, temps, biases))
}

/// [`fit_with`] searched one axis at a time (the temperature with b = 0, then the offset at that
/// temperature): `|temps| + |biases|` trials a position instead of their product, for the
/// online refit, which runs inside the serving loop.
pub fn fit_alternating(rounds: &[Round], gamma: usize, temps: &[f64], biases: &[f64]) -> Fit {
    fit_left_to_right(rounds, gamma, |s, k| {
        let (t, _) = fit_position(rounds, s, k, temps, &[0.0])?;
        fit_position(rounds, s, k, &[t], biases)
    })
}

/// Logit of a probability, clamped away from 0 and 1.
pub fn logit(p: f32) -> f32 {
    let p = (p as f64).clamp(1e-6, 1.0 - 1e-6);
    (p / (1.0 - p)).ln() as f32
}

/// The online rule, per tag (and for all traffic together):
/// - every verified round adds its verified drafts' confidence logits and its accepted count to
///   a sliding window of the last `window` rounds; drafts beyond the verified length are never
///   labelled, so they are left out (position k learns from rounds that verified ≥ k drafts);
/// - every `refit_every` new rounds, once `min_rounds` are in the window, the scalings are
///   refitted over the window ([`fit_alternating`]: the temperature on a 33-point grid in
///   [0.1, 10] plus 1, then the offset, −1 to 1 in steps of 0.25; 43 trials a position, about
///   the 34 of the temperature-only refit it replaced);
/// - a request uses its tag's scaling once that tag has been fitted, else the global one.
///
/// Scalings used at a step come from rounds already verified, and a scaling maps each
/// confidence monotonically, so admission stays non-anticipating and the output exact.
#[derive(Debug, Clone)]
pub struct OnlineConfig {
    pub window: usize,
    pub refit_every: usize,
    pub min_rounds: usize,
}

impl Default for OnlineConfig {
    fn default() -> Self {
        Self { window: 1024, refit_every: 32, min_rounds: 64 }
    }
}

#[derive(Debug, Default, Clone)]
struct Track {
    rounds: VecDeque<Round>,
    scaling: Scaling,
    fits: usize,
    since_fit: usize,
    /// (survival predicted at decision time, realised) for the ECE reported in metrics.
    used: VecDeque<(f64, bool)>,
}

/// Summary of one calibration track, for metrics and logs.
#[derive(Debug, Clone, PartialEq)]
pub struct TrackStatus {
    pub tag: String,
    pub rounds: usize,
    pub fits: usize,
    pub temperatures: Vec<f64>,
    pub biases: Vec<f64>,
    /// ECE of the survivals the scheduler actually used, over the window.
    pub ece: f64,
}

pub const GLOBAL: &str = "global";

#[derive(Debug, Clone)]
pub struct OnlineCalibration {
    pub config: OnlineConfig,
    gamma: usize,
    grid: Vec<f64>,
    bias_grid: Vec<f64>,
    tracks: BTreeMap<String, Track>,
}

impl OnlineCalibration {
    pub fn new(gamma: usize, config: OnlineConfig) -> Self {
        let (lo, hi) = (0.1f64.ln(), 10f64.ln());
        let mut grid: Vec<f64> = (0..33).map(|i| (lo + (hi - lo) * i as f64 / 32.0).exp()).collect();
        grid.push(1.0);
        let bias_grid = (-4..=4).map(|i| i as f64 / 4.0).collect();
        Self { config, gamma, grid, bias_grid, tracks: BTreeMap::new() }
    }

    fn scaling_for(&self, tag: Option<&str>) -> Option<&Scaling> {
        let fitted = |t: &str| self.tracks.get(t).filter(|t| t.fits > 0).map(|t| &t.scaling);
        tag.and_then(fitted).or_else(|| fitted(GLOBAL))
    }

    /// Prefix survivals `a_k = ∏_{i≤k} σ(logit(c_i) / T_i + b_i)` for one request's drafts, from
    /// the drafter's confidences `c` (already offline-calibrated).
    pub fn survival(&self, tag: Option<&str>, confidence: &[f32]) -> Vec<f32> {
        let none = Scaling::default();
        let s = self.scaling_for(tag).unwrap_or(&none);
        let mut a = 1.0f64;
        confidence
            .iter()
            .enumerate()
            .map(|(k, &c)| {
                a *= sigmoid(s.apply(k, logit(c) as f64));
                a as f32
            })
            .collect()
    }

    /// Records a verified round: the confidences of the drafts that were verified, the
    /// survivals the scheduler used for them, and how many were accepted.
    pub fn observe(&mut self, tag: Option<&str>, confidence: &[f32], used: &[f32], accepted: usize) {
        if confidence.is_empty() {
            return;
        }
        let round = Round { logits: confidence.iter().map(|&c| logit(c)).collect(), accepted };
        let names: Vec<&str> = std::iter::once(GLOBAL).chain(tag.filter(|t| *t != GLOBAL)).collect();
        for name in names {
            let tr = self.tracks.entry(name.to_string()).or_default();
            tr.rounds.push_back(round.clone());
            if tr.rounds.len() > self.config.window {
                tr.rounds.pop_front();
            }
            for (k, &a) in used.iter().enumerate() {
                tr.used.push_back((a as f64, accepted > k));
            }
            while tr.used.len() > self.config.window * 4 {
                tr.used.pop_front();
            }
            tr.since_fit += 1;
            if tr.since_fit >= self.config.refit_every && tr.rounds.len() >= self.config.min_rounds {
                let rounds: Vec<Round> = tr.rounds.iter().cloned().collect();
                tr.scaling = fit_alternating(&rounds, self.gamma, &self.grid, &self.bias_grid).scaling;
                tr.fits += 1;
                tr.since_fit = 0;
            }
        }
    }

    pub fn status(&self) -> Vec<TrackStatus> {
        self.tracks
            .iter()
            .map(|(tag, t)| {
                let (p, y): (Vec<f64>, Vec<bool>) = t.used.iter().copied().unzip();
                TrackStatus {
                    tag: tag.clone(),
                    rounds: t.rounds.len(),
                    fits: t.fits,
                    temperatures: t.scaling.temps.clone(),
                    biases: t.scaling.biases.clone(),
                    ece: ece(&p, &y),
                }
            })
            .collect()
    }
}

/// A reliability diagram (SVG): per position, observed acceptance against predicted prefix
/// survival in 10 bins, before and after calibration, with the diagonal.
pub fn reliability_svg(rounds: &[Round], scaling: &Scaling, title: &str) -> String {
    let gamma = scaling.temps.len().max(scaling.biases.len());
    let cols = gamma.clamp(1, 4);
    let rows = gamma.div_ceil(cols);
    let (w, h, pad) = (220.0, 220.0, 34.0);
    let (width, height) = (cols as f64 * (w + pad) + pad, rows as f64 * (h + pad + 14.0) + 40.0);
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' font-family='sans-serif' font-size='11'>\n<rect width='100%' height='100%' fill='white'/>\n<text x='{pad}' y='20' font-size='14'>{title} — observed vs predicted prefix survival (red: before, blue: after scaling)</text>\n"
    );
    let ones = Scaling::identity(gamma);
    for k in 0..gamma {
        let (x0, y0) = (pad + (k % cols) as f64 * (w + pad), 40.0 + (k / cols) as f64 * (h + pad + 14.0));
        s += &format!("<rect x='{x0}' y='{y0}' width='{w}' height='{h}' fill='none' stroke='#999'/>\n");
        s += &format!("<line x1='{x0}' y1='{}' x2='{}' y2='{y0}' stroke='#ccc'/>\n", y0 + h, x0 + w);
        s += &format!("<text x='{}' y='{}'>position {}</text>\n", x0 + 4.0, y0 + 14.0, k + 1);
        for (t, color) in [(&ones, "#d62728"), (scaling, "#1f77b4")] {
            let (p, y) = survival(rounds, t, k);
            let mut pts = Vec::new();
            for b in 0..10 {
                let sel: Vec<usize> =
                    (0..p.len()).filter(|&i| ((p[i] * 10.0) as usize).min(9) == b).collect();
                if sel.len() < 3 {
                    continue;
                }
                let mp = sel.iter().map(|&i| p[i]).sum::<f64>() / sel.len() as f64;
                let my = sel.iter().map(|&i| y[i] as u8 as f64).sum::<f64>() / sel.len() as f64;
                pts.push(format!("{:.1},{:.1}", x0 + mp * w, y0 + h - my * h));
            }
            if !pts.is_empty() {
                s += &format!(
                    "<polyline points='{}' fill='none' stroke='{color}' stroke-width='2'/>\n",
                    pts.join(" ")
                );
                for p in &pts {
                    let (a, b) = p.split_once(',').expect("point");
                    s += &format!("<circle cx='{a}' cy='{b}' r='2.5' fill='{color}'/>\n");
                }
            }
        }
        s += &format!("<text x='{}' y='{}' fill='#555'>predicted</text>\n", x0 + w - 52.0, y0 + h + 12.0);
    }
    s + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` rounds of `gamma` head logits uniform in [−1, 4); each draft survives with
    /// probability `truth(z)` while the ones before it did.
    fn synthetic(seed: u64, n: usize, gamma: usize, truth: impl Fn(f64) -> f64) -> Vec<Round> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let z: Vec<f32> = (0..gamma).map(|_| rng.random_range(-1.0f32..4.0)).collect();
                let mut accepted = 0;
                while accepted < gamma && rng.random::<f64>() < truth(z[accepted] as f64) {
                    accepted += 1;
                }
                Round { logits: z, accepted }
            })
            .collect()
    }

    #[test]
    fn ece_of_perfect_and_of_overconfident_predictions() {
        assert!(ece(&[0.5, 0.5], &[true, false]).abs() < 1e-12);
        assert!((ece(&[0.9, 0.9], &[false, false]) - 0.9).abs() < 1e-12);
    }

    /// Rounds where the head is overconfident at every position: the fitted temperatures are
    /// above 1 and the error falls.
    #[test]
    fn sts_cools_an_overconfident_head() {
        // True survival uses z / 3: the head's logits are three times too sharp.
        let rounds = synthetic(4, 4000, 3, |z| sigmoid(z / 3.0));
        let Fit { scaling, before, after } = fit(&rounds, 3, false);
        let t = scaling.temps;
        for k in 0..3 {
            assert!(t[k] > 1.5, "T_{k} = {}", t[k]);
            assert!(after[k] <= before[k] / 2.0, "position {k}: {} → {}", before[k], after[k]);
        }
    }

    /// A position whose drafts are almost never accepted has too few labels to fit: it keeps
    /// T = 1 instead of the grid's extreme; the held-out report measures on rounds the fit never
    /// saw.
    #[test]
    fn sparse_positions_keep_t_1_and_the_report_is_held_out() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let rounds: Vec<Round> = (0..2000)
            .map(|i| {
                let z: Vec<f32> = (0..3).map(|_| rng.random_range(-1.0f32..4.0)).collect();
                let mut accepted = 0;
                while accepted < 2 && rng.random::<f64>() < sigmoid(z[accepted] as f64 / 3.0) {
                    accepted += 1;
                }
                // The third draft is accepted in 10 rounds of 2000.
                if accepted == 2 && i % 200 == 0 {
                    accepted = 3;
                }
                Round { logits: z, accepted }
            })
            .collect();
        let t = fit(&rounds, 3, false).scaling.temps;
        assert!(t[0] > 1.5 && t[1] > 1.0, "{t:?}");
        assert_eq!(t[2], 1.0, "too few accepted third drafts to fit");
        let Fit { scaling: th, before, after } = fit_held_out(&rounds, 3, false);
        let odd: Vec<Round> = rounds.iter().skip(1).step_by(2).cloned().collect();
        let (p, y) = survival(&odd, &th, 0);
        assert_eq!(after[0], ece(&p, &y));
        assert!(after[0] < before[0] / 2.0, "{} → {}", before[0], after[0]);
    }

    /// Rounds whose two halves disagree: the even ones (fitted) from an overconfident head,
    /// the odd ones (scored) from a calibrated one. The fit cools the head, which would raise
    /// the held-out error, so T = 1 is kept; with both halves overconfident it is not.
    #[test]
    fn a_temperature_that_worsens_held_out_rounds_is_not_kept() {
        use rand::{Rng, SeedableRng};
        let make = |sharpness_odd: f64, seed: u64| -> Vec<Round> {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            (0..4000)
                .map(|i| {
                    let z: Vec<f32> = (0..3).map(|_| rng.random_range(-1.0f32..4.0)).collect();
                    let s = if i % 2 == 0 { 3.0 } else { sharpness_odd };
                    let mut accepted = 0;
                    while accepted < 3 && rng.random::<f64>() < sigmoid(z[accepted] as f64 / s) {
                        accepted += 1;
                    }
                    Round { logits: z, accepted }
                })
                .collect()
        };
        let Fit { scaling, before, after } = fit_held_out(&make(1.0, 6), 3, false);
        assert_eq!(
            scaling,
            Scaling::identity(3),
            "fitted on overconfident rounds, scored on calibrated ones"
        );
        assert_eq!(before, after);
        let Fit { scaling, before, after } = fit_held_out(&make(3.0, 7), 3, false);
        let t = scaling.temps;
        for k in 0..3 {
            assert!(t[k] > 1.5 && after[k] < before[k], "{t:?}: {before:?} → {after:?}");
        }
    }

    /// A workload whose drafts survive far less often than the drafter claims: after enough
    /// rounds the online temperatures pull the survivals down and the error of what the
    /// scheduler uses falls; another tag keeps its own calibration.
    #[test]
    fn online_calibration_learns_a_workload_and_keeps_tags_apart() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let mut cal = OnlineCalibration::new(3, OnlineConfig::default());
        let conf = [0.9f32, 0.9, 0.9];
        let truth = 0.5; // each draft survives half the time
        let mut errors = Vec::new();
        for round in 0..1500 {
            let used = cal.survival(Some("chat"), &conf);
            let mut accepted = 0;
            while accepted < 3 && rng.random::<f64>() < truth {
                accepted += 1;
            }
            cal.observe(Some("chat"), &conf, &used, accepted);
            if round == 0 || round == 1499 {
                errors.push((used[0] - 0.5).abs());
            }
        }
        assert!(errors[0] > 0.35, "starts overconfident");
        assert!(errors[1] < 0.08, "ends near the true survival: {}", errors[1]);
        let s = cal.status();
        let chat = s.iter().find(|t| t.tag == "chat").unwrap();
        assert!(chat.fits > 10 && chat.temperatures[0] > 1.0);
        assert_eq!(
            cal.survival(Some("code"), &conf),
            cal.survival(None, &conf),
            "unknown tags use the global fit"
        );
        // A tag with perfect acceptance learns to trust the drafter again.
        for _ in 0..400 {
            let used = cal.survival(Some("code"), &conf);
            cal.observe(Some("code"), &conf, &used, 3);
        }
        assert!(cal.survival(Some("code"), &conf)[0] > cal.survival(Some("chat"), &conf)[0] + 0.3);
    }

    /// A head that is right about which drafts are likelier but 1.5 logits too hopeful at
    /// every confidence: no temperature fixes a shift (STS leaves most of the error), the offset
    /// does, and the fitted b is near −1.5.
    #[test]
    fn offsets_remove_a_constant_overconfidence_that_temperatures_cannot() {
        let rounds = synthetic(11, 6000, 2, |z| sigmoid(z - 1.5));
        let sts = fit_held_out(&rounds, 2, false);
        let platt = fit_held_out(&rounds, 2, true);
        assert_eq!(sts.before, platt.before);
        assert!(platt.after[0] < sts.after[0] / 2.0, "{:?} vs {:?}", platt.after, sts.after);
        assert!(platt.after[0] < platt.before[0] / 4.0, "{:?} → {:?}", platt.before, platt.after);
        let b = platt.scaling.bias(0);
        assert!((b + 1.5).abs() < 0.35, "b₁ = {b}");
        // The scaling inverts exactly (the recorder undoes it to recover the raw logit).
        let s = &platt.scaling;
        assert!((s.invert(0, s.apply(0, 2.5)) - 2.5).abs() < 1e-12);
    }

    #[test]
    fn reliability_diagram_plots_both_curves() {
        let rounds: Vec<Round> =
            (0..200).map(|i| Round { logits: vec![(i % 7) as f32 - 3.0, 1.0], accepted: i % 3 }).collect();
        let s = Scaling { temps: vec![1.5, 0.8], biases: vec![0.0, -0.5] };
        let svg = reliability_svg(&rounds, &s, "test");
        assert_eq!(svg.matches("<polyline").count(), 4, "two positions × before/after");
    }
}
