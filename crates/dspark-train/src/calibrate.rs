//! Sequential temperature scaling (DSPARK.md §3): per draft position k, one temperature T_k,
//! fitted left to right to minimise the ECE of the prefix survival `∏_{i≤k} σ(z_i / T_i)`
//! against "the first k drafts were accepted", earlier temperatures held fixed.

pub use dspark_schedule::calibration::{
    ece, fit, fit_held_out, grid, sigmoid, survival, Round, BINS, MIN_LABELS,
};

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
    fn reliability_diagram_plots_both_curves() {
        let rounds: Vec<Round> =
            (0..200).map(|i| Round { logits: vec![(i % 7) as f32 - 3.0, 1.0], accepted: i % 3 }).collect();
        let svg = reliability_svg(&rounds, &[1.5, 0.8], "test");
        assert_eq!(svg.matches("<polyline").count(), 4, "two positions × before/after");
    }
}
