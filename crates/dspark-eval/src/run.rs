//! Runs every drafter and plain decoding over the same prompts at batch 1.

use crate::benchmarks::Benchmark;
use crate::report::{DrafterResult, Report};
use crate::EvalError;
use dspark_decode::{generate, GenerateParams};
use dspark_drafters::Recorder;
use dspark_engine::{generate as generate_spec, SpecParams};
use dspark_model::Model;
use dspark_sampling::SamplingParams;
use dspark_spec::{Drafter, SpecStats};

#[derive(Debug, Clone)]
pub struct EvalConfig {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    /// Block lengths for the τ-vs-block sweep (empty: no sweep).
    pub sweep: Vec<usize>,
}

pub struct EvalDrafter {
    pub name: String,
    pub drafter: Box<dyn Drafter>,
    /// The fixed block (γ) of the main table.
    pub gamma: usize,
    /// The scaling the drafter's confidence head applies, for drafters that have one: their
    /// rounds are recorded for the calibration report.
    pub scaling: Option<dspark_schedule::Scaling>,
    /// Largest γ this drafter can draft, when it takes part in the block sweep.
    pub sweep_max: Option<usize>,
}

/// Runs one drafter on one prompt; returns its tokens and statistics.
fn run_spec(
    target: &std::sync::Arc<Model>,
    d: &mut EvalDrafter,
    prompt: &[u32],
    gamma: usize,
    cfg: &EvalConfig,
    seed: u64,
    rounds: Option<&mut Vec<dspark_schedule::Round>>,
) -> Result<(Vec<u32>, SpecStats), EvalError> {
    let p = SpecParams {
        max_tokens: cfg.max_tokens,
        draft_len: gamma,
        sampling: cfg.sampling,
        seed,
        stop_tokens: target.tokenizer.eos().to_vec(),
        policy: dspark_schedule::Policy::Fixed,
        cost: None,
    };
    match (rounds, &d.scaling) {
        (Some(out), Some(scaling)) => {
            let mut rec = Recorder::new(d.drafter.as_mut(), scaling.clone());
            let r = generate_spec(target, &mut rec, prompt, &p, |_| {})?;
            out.append(&mut rec.rounds);
            Ok((r.tokens, r.stats))
        }
        _ => {
            let r = generate_spec(target, d.drafter.as_mut(), prompt, &p, |_| {})?;
            Ok((r.tokens, r.stats))
        }
    }
}

/// Evaluates `drafters` on `benches`; `tick` hears after each generation (for a progress bar).
/// Greedy runs fail with [`EvalError::NotLossless`] as soon as a drafter's output differs from
/// plain decoding's.
pub fn evaluate(
    target: &std::sync::Arc<Model>,
    benches: &[Benchmark],
    drafters: &mut [EvalDrafter],
    cfg: &EvalConfig,
    mut tick: impl FnMut(&str),
) -> Result<Report, EvalError> {
    let mut report = Report::new(benches, cfg);
    report.drafters = drafters
        .iter()
        .map(|d| DrafterResult {
            name: d.name.clone(),
            gamma: d.gamma,
            per_bench: vec![SpecStats::default(); benches.len()],
            rounds: Vec::new(),
            scaling: d.scaling.clone(),
            sweep: Vec::new(),
        })
        .collect();
    let context = target.config.context_length;
    for (b, bench) in benches.iter().enumerate() {
        for (i, text) in bench.prompts.iter().enumerate() {
            let prompt = target.chat_tokens(text).map_err(|e| EvalError::Other(e.to_string()))?;
            if prompt.len() + cfg.max_tokens + 16 > context {
                report.skipped[b] += 1;
                continue;
            }
            let seed = cfg.seed.wrapping_add(i as u64);
            let gp = GenerateParams {
                max_tokens: cfg.max_tokens,
                sampling: cfg.sampling,
                seed,
                stop_tokens: target.tokenizer.eos().to_vec(),
            };
            let plain = generate(target, &prompt, &gp, |_| {})?;
            report.plain[b].0 += plain.tokens.len().saturating_sub(1);
            report.plain[b].1 += plain.stats.decode_s;
            tick(&format!("{} plain", bench.name));
            for (d, res) in drafters.iter_mut().zip(report.drafters.iter_mut()) {
                let (tokens, stats) =
                    run_spec(target, d, &prompt, d.gamma, cfg, seed, Some(&mut res.rounds))?;
                if cfg.sampling.is_greedy() && tokens != plain.tokens {
                    let at = tokens.iter().zip(&plain.tokens).take_while(|(a, b)| a == b).count();
                    return Err(EvalError::NotLossless {
                        drafter: d.name.clone(),
                        bench: bench.name.clone(),
                        index: i,
                        at,
                    });
                }
                res.per_bench[b].merge(&stats);
                tick(&format!("{} {}", bench.name, d.name));
                let sweep: Vec<usize> =
                    cfg.sweep.iter().copied().filter(|&g| d.sweep_max.is_some_and(|m| g <= m)).collect();
                for g in sweep {
                    let (_, s) = run_spec(target, d, &prompt, g, cfg, seed, None)?;
                    match res.sweep.iter_mut().find(|(x, _)| *x == g) {
                        Some((_, acc)) => acc.merge(&s),
                        None => res.sweep.push((g, s)),
                    }
                    tick(&format!("{} {} γ={g}", bench.name, d.name));
                }
            }
        }
    }
    Ok(report)
}
