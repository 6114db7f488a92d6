//! `dspark calibrate`: fit DSpark's confidence head to how often its drafts really survive.

use crate::ModelArg;
use anyhow::{bail, Context, Result};
use clap::Args;
use dspark_drafters::Recorder;
use dspark_engine::{generate as generate_spec, SpecParams};
use dspark_sampling::SamplingParams;
use dspark_schedule::calibration::{fit_held_out, reliability_svg, MIN_LABELS};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args)]
pub struct CalibrateArgs {
    #[arg(long, default_value = dspark_hub::DEFAULT_MODEL)]
    target: String,
    /// A DSpark drafter checkpoint folder; its config.json receives the temperatures.
    #[arg(long)]
    drafter: PathBuf,
    /// Held-out prompts (JSONL with `prompt`), none of them used in training.
    #[arg(long)]
    prompts: PathBuf,
    /// Skip this many prompts first (e.g. those the training data was made from).
    #[arg(long, default_value_t = 0)]
    skip: usize,
    /// Prompts to run.
    #[arg(long, default_value_t = 40)]
    n: usize,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature of the held-out rounds (the evaluation's, 1.0 in the paper).
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Reliability diagram (SVG); default DRAFTER/reliability.svg.
    #[arg(long)]
    plot: Option<PathBuf>,
}

pub fn run(a: CalibrateArgs) -> Result<()> {
    let target_arg = ModelArg { model: a.target.clone() };
    let target = Arc::new(target_arg.load()?);
    let config = dspark_drafter_models::read_config(&a.drafter)?;
    if !config.ext().confidence {
        bail!(
            "{} has no confidence head (only DSpark drafters do); nothing to calibrate",
            a.drafter.display()
        );
    }
    let gamma = config.gamma();
    let old: Vec<f64> =
        config.ext().calibration_temperatures.unwrap_or_default().iter().map(|&t| t as f64).collect();
    let spec = format!("dspark:{}", a.drafter.display());
    let mut d = dspark_drafters::load_network_drafter(
        dspark_drafter_models::Method::Dspark,
        &a.drafter,
        target.clone(),
        &target_arg.name(),
    )
    .with_context(|| format!("loading {spec}"))?;
    let texts = crate::bench::read_prompts(&a.prompts, a.skip + a.n)?;
    let texts = &texts[a.skip.min(texts.len())..];
    if texts.is_empty() {
        bail!("no prompts left after skipping {}", a.skip);
    }
    let mut rec = Recorder::new(d.as_mut(), old);
    let bar = indicatif::ProgressBar::new(texts.len() as u64);
    for (i, t) in texts.iter().enumerate() {
        let prompt = crate::prompt_tokens(&target, t, false)?;
        let p = SpecParams {
            max_tokens: a.max_tokens,
            draft_len: gamma,
            sampling: SamplingParams { temperature: a.temperature, top_k: None, top_p: None },
            seed: a.seed + i as u64,
            stop_tokens: target.tokenizer.eos().to_vec(),
            policy: dspark_schedule::Policy::Fixed,
            cost: None,
        };
        generate_spec(&target, &mut rec, &prompt, &p, |_| {})?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let rounds = std::mem::take(&mut rec.rounds);
    let (temps, before, after) = fit_held_out(&rounds, gamma);
    println!(
        "{} rounds: temperatures fitted on half, ECE of prefix survival per position (20 bins) on the other half \
         (positions with fewer than {MIN_LABELS} accepted or rejected drafts keep T = 1):",
        rounds.len()
    );
    println!("{:>8} {:>10} {:>10} {:>8}", "position", "before", "after", "T");
    for k in 0..gamma {
        println!("{:>8} {:>9.2}% {:>9.2}% {:>8.3}", k + 1, before[k] * 100.0, after[k] * 100.0, temps[k]);
    }
    let path = a.drafter.join("config.json");
    let mut c = config.clone();
    let mut ext = c.ext();
    ext.calibration_temperatures = Some(temps.iter().map(|&t| t as f32).collect());
    c.dspark = Some(ext);
    std::fs::write(&path, serde_json::to_string_pretty(&c)?)?;
    let plot = a.plot.unwrap_or_else(|| a.drafter.join("reliability.svg"));
    std::fs::write(&plot, reliability_svg(&rounds, &temps, &spec))?;
    let report = serde_json::json!({"rounds": rounds.len(), "temperatures": temps, "ece_before": before, "ece_after": after});
    std::fs::write(a.drafter.join("calibration.json"), serde_json::to_string_pretty(&report)?)?;
    eprintln!("temperatures written to {}; reliability diagram {}", path.display(), plot.display());
    Ok(())
}
