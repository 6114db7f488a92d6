//! Tables (Markdown), `results.json` and plots of an evaluation.

use crate::benchmarks::{Benchmark, Domain};
use crate::plot::{lines_svg, Panel};
use crate::run::EvalConfig;
use dspark_schedule::calibration::{ece, survival};
use dspark_schedule::Round;
use dspark_spec::SpecStats;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

pub struct DrafterResult {
    pub name: String,
    pub gamma: usize,
    /// Merged statistics per benchmark (in the report's benchmark order).
    pub per_bench: Vec<SpecStats>,
    /// Confidence logits and outcomes of every round, for drafters with a confidence head.
    pub rounds: Vec<Round>,
    /// The scaling the drafter's confidence head applies, for drafters that have one.
    pub scaling: Option<dspark_schedule::Scaling>,
    /// (γ, merged statistics) of the block sweep.
    pub sweep: Vec<(usize, SpecStats)>,
}

pub struct BenchInfo {
    pub name: String,
    pub domain: Domain,
    pub n: usize,
    pub source: String,
}

pub struct Report {
    pub benches: Vec<BenchInfo>,
    /// Plain decoding per benchmark: (tokens after the first, seconds).
    pub plain: Vec<(usize, f64)>,
    /// Prompts skipped per benchmark because prompt + max_tokens exceed the context.
    pub skipped: Vec<usize>,
    pub drafters: Vec<DrafterResult>,
    pub max_tokens: usize,
    pub temperature: f32,
    pub seed: u64,
}

/// Rounds that must reach a position before its acceptance is shown or plotted.
pub const MIN_REACHED: usize = 20;

fn pct(x: f64) -> String {
    format!("{:+.1} %", x * 100.0)
}

impl DrafterResult {
    pub fn tau(&self, b: usize) -> f64 {
        self.per_bench[b].tau()
    }

    /// Mean of the per-benchmark τ (benchmarks with at least one round).
    pub fn macro_tau(&self) -> f64 {
        let v: Vec<f64> =
            self.per_bench.iter().filter(|s| s.rounds + s.plain_steps > 0).map(|s| s.tau()).collect();
        v.iter().sum::<f64>() / v.len().max(1) as f64
    }

    pub fn by_domain(&self, benches: &[BenchInfo]) -> BTreeMap<Domain, SpecStats> {
        let mut m: BTreeMap<Domain, SpecStats> = BTreeMap::new();
        for (s, b) in self.per_bench.iter().zip(benches) {
            m.entry(b.domain).or_default().merge(s);
        }
        m
    }

    pub fn total(&self) -> SpecStats {
        let mut t = SpecStats::default();
        for s in &self.per_bench {
            t.merge(s);
        }
        t
    }

    pub fn tok_s(&self) -> f64 {
        let t = self.total();
        if t.decode_s > 0.0 {
            t.generated_tokens as f64 / t.decode_s
        } else {
            0.0
        }
    }

    /// ECE per position of the survivals the drafter reports (its own scaling) and of the
    /// raw head (T = 1, b = 0).
    pub fn ece(&self) -> Option<(Vec<f64>, Vec<f64>)> {
        let scaling = self.scaling.as_ref()?;
        let ones = dspark_schedule::Scaling::identity(self.gamma);
        let per = |t: &dspark_schedule::Scaling| {
            (0..self.gamma)
                .map(|k| {
                    let (p, y) = survival(&self.rounds, t, k);
                    ece(&p, &y)
                })
                .collect()
        };
        Some((per(scaling), per(&ones)))
    }
}

impl Report {
    pub fn new(benches: &[Benchmark], cfg: &EvalConfig) -> Self {
        Self {
            benches: benches
                .iter()
                .map(|b| BenchInfo {
                    name: b.name.clone(),
                    domain: b.domain,
                    n: b.prompts.len(),
                    source: b.source.clone(),
                })
                .collect(),
            plain: vec![(0, 0.0); benches.len()],
            skipped: vec![0; benches.len()],
            drafters: Vec::new(),
            max_tokens: cfg.max_tokens,
            temperature: cfg.sampling.temperature,
            seed: cfg.seed,
        }
    }

    /// The domains of the benchmarks, each once, in order.
    fn domains(&self) -> Vec<Domain> {
        let mut v: Vec<Domain> = self.benches.iter().map(|b| b.domain).collect();
        v.sort();
        v.dedup();
        v
    }

    pub fn plain_tok_s(&self) -> f64 {
        let (t, s) = self.plain.iter().fold((0, 0.0), |(a, b), &(t, s)| (a + t, b + s));
        if s > 0.0 {
            t as f64 / s
        } else {
            0.0
        }
    }

    /// τ per benchmark and macro average, then each drafter's macro τ against every other's.
    pub fn tau_md(&self) -> String {
        let mut s = format!(
            "| drafter (γ) | {} | macro |\n|---|",
            self.benches.iter().map(|b| b.name.as_str()).collect::<Vec<_>>().join(" | ")
        );
        s += &"---|".repeat(self.benches.len() + 1);
        s += "\n";
        for d in &self.drafters {
            let cells: Vec<String> = (0..self.benches.len()).map(|b| format!("{:.3}", d.tau(b))).collect();
            s +=
                &format!("| {} ({}) | {} | **{:.3}** |\n", d.name, d.gamma, cells.join(" | "), d.macro_tau());
        }
        if self.drafters.len() > 1 {
            s += "\n| macro τ ratio | ";
            s += &self.drafters.iter().map(|d| format!("vs {}", d.name)).collect::<Vec<_>>().join(" | ");
            s += " |\n|---|";
            s += &"---|".repeat(self.drafters.len());
            s += "\n";
            for a in &self.drafters {
                let cells: Vec<String> = self
                    .drafters
                    .iter()
                    .map(|b| {
                        if a.name == b.name {
                            "—".into()
                        } else {
                            pct(a.macro_tau() / b.macro_tau() - 1.0)
                        }
                    })
                    .collect();
                s += &format!("| {} | {} |\n", a.name, cells.join(" | "));
            }
        }
        s
    }

    /// Conditional acceptance per position, per domain; positions reached by fewer than
    /// [`MIN_REACHED`] rounds are left blank (too few to say anything).
    pub fn accept_md(&self) -> String {
        let g = self.drafters.iter().map(|d| d.gamma).max().unwrap_or(0);
        let mut s = format!(
            "| domain | drafter | {} |\n|---|---|",
            (1..=g).map(|k| k.to_string()).collect::<Vec<_>>().join(" | ")
        );
        s += &"---|".repeat(g);
        s += "\n";
        for dom in self.domains() {
            for d in &self.drafters {
                let st = d.by_domain(&self.benches).remove(&dom).unwrap_or_default();
                let a = st.accept_at();
                let cells: Vec<String> = (0..g)
                    .map(|k| match (a.get(k), st.reached_at.get(k)) {
                        (Some(x), Some(&n)) if n >= MIN_REACHED => format!("{x:.3}"),
                        _ => String::new(),
                    })
                    .collect();
                s += &format!("| {} | {} | {} |\n", dom.name(), d.name, cells.join(" | "));
            }
        }
        s
    }

    pub fn calibration_md(&self) -> String {
        let mut s = String::new();
        for d in &self.drafters {
            if let Some((with, raw)) = d.ece() {
                let f = |v: &[f64]| {
                    v.iter().map(|x| format!("{:.1} %", x * 100.0)).collect::<Vec<_>>().join(" | ")
                };
                if s.is_empty() {
                    let g = with.len();
                    s += &format!(
                        "| drafter | ECE | {} |\n|---|---|",
                        (1..=g).map(|k| format!("pos {k}")).collect::<Vec<_>>().join(" | ")
                    );
                    s += &"---|".repeat(g);
                    s += "\n";
                }
                s += &format!("| {} | raw head (T = 1, b = 0) | {} |\n", d.name, f(&raw));
                s += &format!("| {} | as shipped (its scaling) | {} |\n", d.name, f(&with));
            }
        }
        s
    }

    pub fn speed_md(&self) -> String {
        let plain = self.plain_tok_s();
        let mut s =
            format!("| decoding | tokens/s | vs plain |\n|---|---|---|\n| plain | {plain:.1} | 1.00× |\n");
        for d in &self.drafters {
            s += &format!(
                "| {} (γ = {}) | {:.1} | {:.2}× |\n",
                d.name,
                d.gamma,
                d.tok_s(),
                d.tok_s() / plain.max(1e-9)
            );
        }
        s
    }

    pub fn sweep_md(&self) -> String {
        let mut s = String::new();
        for d in self.drafters.iter().filter(|d| !d.sweep.is_empty()) {
            if s.is_empty() {
                s += "| drafter | γ | τ |\n|---|---|---|\n";
            }
            let mut pts: Vec<(usize, f64)> = d.sweep.iter().map(|(g, st)| (*g, st.tau())).collect();
            pts.sort_by_key(|p| p.0);
            for (g, t) in pts {
                s += &format!("| {} | {g} | {t:.3} |\n", d.name);
            }
        }
        s
    }

    pub fn to_json(&self, command: &str, target: &str) -> Value {
        let mut drafters = serde_json::Map::new();
        for d in &self.drafters {
            let tau: serde_json::Map<String, Value> =
                self.benches.iter().enumerate().map(|(b, bi)| (bi.name.clone(), json!(d.tau(b)))).collect();
            let by_domain = d.by_domain(&self.benches);
            let per_domain = |f: &dyn Fn(&SpecStats) -> Value| -> serde_json::Map<String, Value> {
                by_domain.iter().map(|(k, s)| (k.name().to_string(), f(s))).collect()
            };
            let acc = per_domain(&|s| json!(s.accept_at()));
            let reached = per_domain(&|s| json!(s.reached_at));
            let ece = d.ece().map(|(w, r)| json!({"shipped": w, "raw": r}));
            let sweep: serde_json::Map<String, Value> =
                d.sweep.iter().map(|(g, s)| (g.to_string(), json!(s.tau()))).collect();
            drafters.insert(
                d.name.clone(),
                json!({"gamma": d.gamma, "macro_tau": d.macro_tau(), "tau": tau, "accept_at": acc, "reached_at": reached, "tok_s": d.tok_s(),
                       "ece": ece, "tau_by_block": sweep, "rounds": d.total().rounds}),
            );
        }
        json!({
            "command": command,
            "versions": {"dspark": env!("CARGO_PKG_VERSION"), "target": target},
            "settings": {"max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed, "batch": 1,
                         "scheduler": "off (fixed block)"},
            "benchmarks": self.benches.iter().zip(&self.skipped).map(|(b, &sk)| json!({"name": b.name, "domain": b.domain.name(),
                          "n": b.n - sk, "skipped_over_context": sk, "source": b.source})).collect::<Vec<_>>(),
            "drafters": drafters,
            "plain_tok_s": self.plain_tok_s(),
        })
    }

    /// Writes `report.md`, `results.json`, `acceptance.svg`, `reliability-<drafter>.svg` and,
    /// with a sweep, `tau_vs_block.svg` into `dir`.
    pub fn write(&self, dir: &Path, command: &str, target: &str) -> std::io::Result<Vec<String>> {
        std::fs::create_dir_all(dir)?;
        let mut files =
            vec!["report.md".to_string(), "results.json".to_string(), "acceptance.svg".to_string()];
        std::fs::write(
            dir.join("results.json"),
            serde_json::to_string_pretty(&self.to_json(command, target))? + "\n",
        )?;
        let mut panels = Vec::new();
        for dom in &self.domains() {
            let series = self
                .drafters
                .iter()
                .map(|d| {
                    let st = d.by_domain(&self.benches).remove(dom).unwrap_or_default();
                    let pts = st
                        .accept_at()
                        .iter()
                        .zip(&st.reached_at)
                        .enumerate()
                        .take_while(|(_, (_, &n))| n >= MIN_REACHED)
                        .map(|(k, (&x, _))| ((k + 1) as f64, x))
                        .collect();
                    (d.name.clone(), pts)
                })
                .collect();
            panels.push(Panel { title: dom.name().to_string(), series });
        }
        let title = format!("{target}: conditional acceptance per draft position");
        std::fs::write(
            dir.join("acceptance.svg"),
            lines_svg(&title, &panels, "draft position", "acceptance", Some((0.0, 1.0))),
        )?;
        for d in self.drafters.iter().filter(|d| d.scaling.is_some() && !d.rounds.is_empty()) {
            let f = format!("reliability-{}.svg", d.name);
            let svg = dspark_schedule::calibration::reliability_svg(
                &d.rounds,
                d.scaling.as_ref().unwrap(),
                &d.name,
            );
            std::fs::write(dir.join(&f), svg)?;
            files.push(f);
        }
        let sweeps: Vec<(String, Vec<(f64, f64)>)> = self
            .drafters
            .iter()
            .filter(|d| !d.sweep.is_empty())
            .map(|d| {
                let mut p: Vec<(f64, f64)> = d.sweep.iter().map(|(g, s)| (*g as f64, s.tau())).collect();
                p.sort_by(|a, b| a.0.total_cmp(&b.0));
                (d.name.clone(), p)
            })
            .collect();
        if !sweeps.is_empty() {
            let panel = Panel { title: "τ by block length".into(), series: sweeps };
            std::fs::write(
                dir.join("tau_vs_block.svg"),
                lines_svg(&format!("{target}: τ against γ"), &[panel], "γ", "τ", None),
            )?;
            files.push("tau_vs_block.svg".into());
        }
        let mut md = format!("# Evaluation: {target}\n\n`{command}`\n\nBatch 1, fixed block (scheduler off), temperature {}, max_tokens {}, seed {}.\n\n",
            self.temperature, self.max_tokens, self.seed);
        md += "## Benchmarks\n\n| benchmark | domain | prompts | source |\n|---|---|---|---|\n";
        for (b, &sk) in self.benches.iter().zip(&self.skipped) {
            md += &format!("| {} | {} | {} | {} |\n", b.name, b.domain.name(), b.n - sk, b.source);
        }
        md += &format!("\n## τ (tokens committed per round, bonus included)\n\n{}\n", self.tau_md());
        md += &format!(
            "## Conditional acceptance per position\n\n{}\nBlank: reached by fewer than {MIN_REACHED} rounds.\n\n![acceptance](acceptance.svg)\n\n",
            self.accept_md()
        );
        let cal = self.calibration_md();
        if !cal.is_empty() {
            md += &format!("## Calibration (ECE of predicted prefix survival, 20 bins)\n\n{cal}\n");
            for f in files.iter().filter(|f| f.starts_with("reliability-")) {
                md += &format!("![{f}]({f})\n");
            }
            md += "\n";
        }
        let sw = self.sweep_md();
        if !sw.is_empty() {
            md += &format!("## τ against block length\n\n{sw}\n![tau vs block](tau_vs_block.svg)\n\n");
        }
        md += &format!("## Speed (decode tokens/s, same prompts)\n\n{}", self.speed_md());
        std::fs::write(dir.join("report.md"), md)?;
        Ok(files)
    }
}
