//! `dspark eval`: the paper's evaluation protocol on real benchmarks.

use crate::{DrafterArgs, ModelArg};
use anyhow::{bail, Context, Result};
use clap::Args;
use dspark_eval::benchmarks::{load, NINE};
use dspark_eval::{evaluate, EvalConfig, EvalDrafter};
use dspark_sampling::SamplingParams;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args)]
pub struct EvalArgs {
    /// The target model (name or path).
    #[arg(long, default_value = dspark_hub::DEFAULT_MODEL)]
    pub target: String,
    /// Drafters as NAME=SPEC, comma-separated; SPEC is anything `generate --drafter` takes
    /// (dspark:DIR, dflash:DIR, eagle3:DIR, ngram, draft:MODEL). Default: every drafter shipped
    /// in drafters/ for the target.
    #[arg(long)]
    pub drafters: Option<String>,
    /// Benchmarks, comma-separated: all (the nine), or names among gsm8k, math500, aime25, mbpp,
    /// humaneval, livecodebench-sub (a stated HumanEval+MBPP substitute), mt-bench, alpaca,
    /// arena-hard, or JSONL files with a `prompt` field (DOMAIN:PATH sets math/code/chat).
    #[arg(long, default_value = "all")]
    pub bench: String,
    /// Prompts per benchmark (the first N).
    #[arg(long, default_value_t = 30)]
    pub n: usize,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 1.0 is the paper's setting; 0 is greedy and also checks every output against plain
    /// decoding.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// γ: the fixed block (capped by each drafter's own block).
    #[arg(long, default_value_t = 7)]
    pub block: usize,
    /// Also measure τ at these block lengths for DSpark and DFlash drafters (those no longer
    /// than the drafter's trained block), e.g. 3,7,11,15.
    #[arg(long)]
    pub sweep: Option<String>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output folder: report.md, results.json, acceptance.svg, reliability-*.svg, tau_vs_block.svg.
    #[arg(long, default_value = "eval-out")]
    pub out: PathBuf,
}

fn shipped(target: &str) -> Vec<(String, String)> {
    let Some(root) = dspark_hub::drafters_dir() else { return Vec::new() };
    [("dspark-markov", "dspark"), ("dspark-rnn", "dspark"), ("dflash", "dflash"), ("eagle3", "eagle3")]
        .iter()
        .filter_map(|(suffix, method)| {
            let dir = root.join(format!("{target}-{suffix}"));
            dir.join("config.json")
                .exists()
                .then(|| (suffix.to_string(), format!("{method}:{}", dir.display())))
        })
        .collect()
}

pub fn run(a: EvalArgs) -> Result<()> {
    if a.n == 0 || a.max_tokens == 0 || a.block == 0 {
        bail!("--n, --max-tokens and --block must be at least 1");
    }
    let sampling = SamplingParams { temperature: a.temperature, top_k: None, top_p: None };
    sampling.validate()?;
    let sweep: Vec<usize> = match &a.sweep {
        Some(s) => s
            .split(',')
            .map(|x| x.trim().parse().with_context(|| format!("bad --sweep value `{x}`")))
            .collect::<Result<_>>()?,
        None => Vec::new(),
    };
    let target_arg = ModelArg { model: a.target.clone() };
    let target = Arc::new(target_arg.load()?);
    let name = target_arg.name();
    let specs: Vec<(String, String)> = match &a.drafters {
        Some(list) => list
            .split(',')
            .map(|e| {
                e.split_once('=')
                    .map(|(n, s)| (n.trim().to_string(), s.trim().to_string()))
                    .with_context(|| format!("`{e}`: give drafters as NAME=SPEC"))
            })
            .collect::<Result<_>>()?,
        None => shipped(&name),
    };
    if specs.is_empty() {
        bail!("no drafters: none are shipped for {name}; pass --drafters NAME=SPEC,…");
    }
    let mut drafters = Vec::new();
    for (dname, spec) in &specs {
        let args = DrafterArgs {
            drafter: spec.clone(),
            draft_len: Some(a.block),
            min_survival: Some(0.0),
            policy: None,
            profile: None,
            reprofile: false,
        };
        let (d, mut gamma) = args
            .build(&target, &name)?
            .with_context(|| format!("{dname}: `{spec}` is plain decoding, not a drafter"))?;
        let (mut scaling, mut sweep_max) = (None, None);
        if let dspark_drafters::DrafterSpec::Network(method, dir) = spec.parse()? {
            let c = dspark_drafter_models::read_config(&dir)?;
            gamma = gamma.min(c.gamma());
            if c.ext().confidence {
                let e = c.ext();
                scaling = Some(dspark_schedule::Scaling::from_config(
                    e.calibration_temperatures.as_deref(),
                    e.calibration_biases.as_deref(),
                    gamma,
                ));
            }
            if method != dspark_drafter_models::Method::Eagle3 {
                sweep_max = Some(c.gamma());
            }
        }
        drafters.push(EvalDrafter { name: dname.clone(), drafter: d, gamma, scaling, sweep_max });
    }
    let shared = dspark_hub::bench_dir()?;
    let names: Vec<String> = if a.bench == "all" {
        NINE.iter().map(|s| s.to_string()).collect()
    } else {
        a.bench.split(',').map(|s| s.trim().to_string()).collect()
    };
    let benches = names.iter().map(|b| load(b, &shared, a.n)).collect::<Result<Vec<_>, _>>()?;
    let per_prompt: usize = 1 + drafters
        .iter()
        .map(|d| 1 + sweep.iter().filter(|&&g| d.sweep_max.is_some_and(|m| g <= m)).count())
        .sum::<usize>();
    let total: usize = benches.iter().map(|b| b.prompts.len()).sum::<usize>() * per_prompt;
    let bar = indicatif::ProgressBar::new(total as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} generations, {elapsed} elapsed, ETA {eta} {msg}",
        )
        .expect("template"),
    );
    let cfg = EvalConfig { max_tokens: a.max_tokens, sampling, seed: a.seed, sweep };
    let report = evaluate(&target, &benches, &mut drafters, &cfg, |m| {
        bar.set_message(m.to_string());
        bar.inc(1);
    })?;
    bar.finish_and_clear();
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let files = report.write(&a.out, &command, &name)?;
    println!("{}", report.tau_md());
    println!("{}", report.speed_md());
    eprintln!("wrote {} in {}", files.join(", "), a.out.display());
    Ok(())
}
