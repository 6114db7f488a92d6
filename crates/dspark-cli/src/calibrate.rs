//! `dspark calibrate`: fit DSpark's confidence head to how often its drafts really survive.

use crate::ModelArg;
use anyhow::{bail, Context, Result};
use clap::Args;
use dspark_drafters::Recorder;
use dspark_engine::{generate as generate_spec, SpecParams};
use dspark_sampling::SamplingParams;
use dspark_schedule::calibration::{fit_held_out, reliability_svg, Fit, Scaling, MIN_LABELS};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args)]
pub struct CalibrateArgs {
    #[arg(long, default_value = dspark_hub::DEFAULT_MODEL)]
    target: String,
    /// A DSpark drafter checkpoint folder; its config.json receives the fitted temperatures
    /// and offsets.
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
    /// Fit temperatures alone, as the paper's STS does (b = 0). By default each position also
    /// gets an offset, `σ(z / T + b)`, which removes a constant over- or under-confidence that
    /// no temperature can; either is kept only where it lowers the held-out ECE.
    #[arg(long)]
    no_offsets: bool,
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
    let e = config.ext();
    let old =
        Scaling::from_config(e.calibration_temperatures.as_deref(), e.calibration_biases.as_deref(), gamma);
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
    // The paper's STS is always fitted too, so the table shows what the offsets add.
    let sts = fit_held_out(&rounds, gamma, false);
    let Fit { scaling, before, after } =
        if a.no_offsets { sts.clone() } else { fit_held_out(&rounds, gamma, true) };
    println!(
        "{} rounds: fitted on half, ECE of prefix survival per position (20 bins) on the other half \
         (positions with fewer than {MIN_LABELS} accepted or rejected drafts keep T = 1, b = 0); \
         written: {}",
        rounds.len(),
        if a.no_offsets { "STS (temperatures)" } else { "STS + offsets" }
    );
    if a.no_offsets {
        println!("{:>8} {:>10} {:>10} {:>8}", "position", "raw", "STS", "T");
    } else {
        println!(
            "{:>8} {:>10} {:>10} {:>8} {:>14} {:>8} {:>8}",
            "position", "raw", "STS", "T", "STS + offset", "T", "b"
        );
    }
    for k in 0..gamma {
        let sts_cols = format!(
            "{:>8} {:>9.2}% {:>9.2}% {:>8.3}",
            k + 1,
            before[k] * 100.0,
            sts.after[k] * 100.0,
            sts.scaling.temp(k)
        );
        if a.no_offsets {
            println!("{sts_cols}");
        } else {
            println!(
                "{sts_cols} {:>13.2}% {:>8.3} {:>8.2}",
                after[k] * 100.0,
                scaling.temp(k),
                scaling.bias(k)
            );
        }
    }
    let path = a.drafter.join("config.json");
    let mut c = config.clone();
    let mut ext = c.ext();
    ext.calibration_temperatures = Some(scaling.temps.iter().map(|&t| t as f32).collect());
    ext.calibration_biases = Some(scaling.biases.iter().map(|&b| b as f32).collect());
    c.dspark = Some(ext);
    std::fs::write(&path, serde_json::to_string_pretty(&c)?)?;
    let plot = a.plot.unwrap_or_else(|| a.drafter.join("reliability.svg"));
    std::fs::write(&plot, reliability_svg(&rounds, &scaling, &spec))?;
    let report = serde_json::json!({"rounds": rounds.len(), "temperatures": scaling.temps,
        "biases": scaling.biases, "offsets": !a.no_offsets, "ece_before": before, "ece_after": after,
        "sts_only": {"temperatures": sts.scaling.temps, "ece_after": sts.after}});
    std::fs::write(a.drafter.join("calibration.json"), serde_json::to_string_pretty(&report)?)?;
    eprintln!(
        "temperatures and offsets written to {}; reliability diagram {}",
        path.display(),
        plot.display()
    );
    Ok(())
}
