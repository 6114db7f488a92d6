//! Sequential temperature scaling (DSPARK.md §3): per draft position k, one temperature T_k,
//! fitted left to right to minimise the ECE of the prefix survival `∏_{i≤k} σ(z_i / T_i)`
//! against "the first k drafts were accepted", earlier temperatures held fixed.

/// One verification round: the confidence head's logits (before any temperature) and how many
/// of the drafts were accepted.
#[derive(Debug, Clone)]
pub struct Round {
    pub logits: Vec<f32>,
    pub accepted: usize,
}

pub const BINS: usize = 20;

fn sigmoid(x: f64) -> f64 {
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
pub fn survival(rounds: &[Round], temps: &[f64], k: usize) -> (Vec<f64>, Vec<bool>) {
    let mut pred = Vec::new();
    let mut label = Vec::new();
    for r in rounds.iter().filter(|r| r.logits.len() > k) {
        let a: f64 =
            (0..=k).map(|i| sigmoid(r.logits[i] as f64 / temps.get(i).copied().unwrap_or(1.0))).product();
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

/// Fits T_1..T_γ left to right; returns them with the ECE per position before (T = 1) and after.
pub fn fit(rounds: &[Round], gamma: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let ones = vec![1.0; gamma];
    let mut temps: Vec<f64> = Vec::with_capacity(gamma);
    let mut before = Vec::with_capacity(gamma);
    let mut after = Vec::with_capacity(gamma);
    for k in 0..gamma {
        let (p, y) = survival(rounds, &ones, k);
        before.push(ece(&p, &y));
        let mut best: (f64, f64) = (f64::INFINITY, 1.0);
        for t in grid() {
            let mut trial = temps.clone();
            trial.push(t);
            let (p, y) = survival(rounds, &trial, k);
            let e = ece(&p, &y);
            // Ties go to the temperature closest to 1 (the least change).
            if e < best.0 - 1e-12 || ((e - best.0).abs() <= 1e-12 && (t.ln()).abs() < best.1.ln().abs()) {
                best = (e, t);
            }
        }
        temps.push(best.1);
        after.push(best.0);
    }
    (temps, before, after)
}

/// A reliability diagram (SVG): per position, observed acceptance against predicted prefix
/// survival in 10 bins, before and after calibration, with the diagonal.
pub fn reliability_svg(rounds: &[Round], temps: &[f64], title: &str) -> String {
    let gamma = temps.len();
    let cols = gamma.clamp(1, 4);
    let rows = gamma.div_ceil(cols);
    let (w, h, pad) = (220.0, 220.0, 34.0);
    let (width, height) = (cols as f64 * (w + pad) + pad, rows as f64 * (h + pad + 14.0) + 40.0);
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' font-family='sans-serif' font-size='11'>\n<rect width='100%' height='100%' fill='white'/>\n<text x='{pad}' y='20' font-size='14'>{title} — observed vs predicted prefix survival (red: before, blue: after STS)</text>\n"
    );
    let ones = vec![1.0; gamma];
    for k in 0..gamma {
        let (x0, y0) = (pad + (k % cols) as f64 * (w + pad), 40.0 + (k / cols) as f64 * (h + pad + 14.0));
        s += &format!("<rect x='{x0}' y='{y0}' width='{w}' height='{h}' fill='none' stroke='#999'/>\n");
        s += &format!("<line x1='{x0}' y1='{}' x2='{}' y2='{y0}' stroke='#ccc'/>\n", y0 + h, x0 + w);
        s += &format!("<text x='{}' y='{}'>position {}</text>\n", x0 + 4.0, y0 + 14.0, k + 1);
        for (t, color) in [(&ones, "#d62728"), (&temps.to_vec(), "#1f77b4")] {
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

/// Wraps a drafter and records, per round, its confidence logits (undoing the temperatures it
/// applied) and how many drafts were accepted.
pub struct Recorder<'a> {
    pub inner: &'a mut dyn dspark_spec::Drafter,
    /// Temperatures the drafter applies now (1 when uncalibrated).
    pub temps: Vec<f64>,
    pending: Option<Vec<f32>>,
    pub rounds: Vec<Round>,
}

impl<'a> Recorder<'a> {
    pub fn new(inner: &'a mut dyn dspark_spec::Drafter, temps: Vec<f64>) -> Self {
        Self { inner, temps, pending: None, rounds: Vec::new() }
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
                    ((q / (1.0 - q)).ln() * self.temps.get(k).copied().unwrap_or(1.0)) as f32
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ece_of_perfect_and_of_overconfident_predictions() {
        assert!(ece(&[0.5, 0.5], &[true, false]).abs() < 1e-12);
        assert!((ece(&[0.9, 0.9], &[false, false]) - 0.9).abs() < 1e-12);
    }

    /// Rounds where the head is overconfident at every position: the fitted temperatures are
    /// above 1 and the error falls.
    #[test]
    fn sts_cools_an_overconfident_head() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let rounds: Vec<Round> = (0..4000)
            .map(|_| {
                let z: Vec<f32> = (0..3).map(|_| rng.random_range(-1.0f32..4.0)).collect();
                // True survival uses z / 3: the head's logits are three times too sharp.
                let mut accepted = 0;
                while accepted < 3 && rng.random::<f64>() < sigmoid(z[accepted] as f64 / 3.0) {
                    accepted += 1;
                }
                Round { logits: z, accepted }
            })
            .collect();
        let (t, before, after) = fit(&rounds, 3);
        for k in 0..3 {
            assert!(t[k] > 1.5, "T_{k} = {}", t[k]);
            assert!(after[k] <= before[k] / 2.0, "position {k}: {} → {}", before[k], after[k]);
        }
        assert!(reliability_svg(&rounds, &t, "test").contains("<polyline"));
    }
}
