//! Argument types and loaders shared by several commands: the target model, the drafter
//! (`--drafter`, parsed once by `DrafterSpec`), and a fresh drafter's shape.

use anyhow::{bail, Context, Result};
use clap::Args;
use dspark_drafter_models::{BlockLayout, InitOptions, Method};
use dspark_drafters::{DraftModel, DrafterSpec, NgramDrafter};
use dspark_model::Model;
use dspark_schedule::{CostTable, Policy};
use dspark_spec::Drafter;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args, Clone)]
pub struct ModelArg {
    /// A known model name (fetched on first use) or a path to a .gguf / Hugging Face directory.
    #[arg(long, short, default_value = dspark_hub::DEFAULT_MODEL)]
    pub model: String,
}

impl ModelArg {
    /// The name a drafter records for its target: the registry name, or the file's stem.
    pub fn name(&self) -> String {
        let p = std::path::Path::new(&self.model);
        if p.exists() {
            p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| self.model.clone())
        } else {
            self.model.clone()
        }
    }

    pub fn load(&self) -> Result<Model> {
        let path = dspark_hub::resolve(&self.model, true)?;
        Model::load(&path).with_context(|| format!("loading {}", path.display()))
    }

    /// The model as a draft model: its matrices in the drafting format of
    /// `DSPARK_DRAFTER_WEIGHTS` (Q4_0 by default; `f32` keeps the file's own formats), since
    /// every drafted token reads all of them.
    pub fn load_for_drafting(&self) -> Result<Model> {
        use candle_core::quantized::GgmlDType;
        use dspark_drafter_models::DraftWeights;
        let path = dspark_hub::resolve(&self.model, true)?;
        let loaded = match DraftWeights::from_env()? {
            DraftWeights::F32 => Model::load(&path),
            DraftWeights::Q8 => Model::load_requantized(&path, GgmlDType::Q8_0),
            DraftWeights::Q4 => Model::load_requantized(&path, GgmlDType::Q4_0),
        };
        loaded.with_context(|| format!("loading {}", path.display()))
    }
}

#[derive(Args, Clone)]
pub struct DrafterArgs {
    /// Speculative drafter: `auto` (prompt lookup where it matches, and the DSpark drafter shipped
    /// in drafters/ for this model, if any, only while it pays), `none` (plain decoding), `ngram`
    /// (prompt lookup),
    /// `draft:MODEL` (a small model with the same tokenizer, e.g. draft:qwen2.5-coder-0.5b), or a
    /// drafter checkpoint folder as `dspark:PATH`, `dflash:PATH` or `eagle3:PATH` (see
    /// `dspark init-drafter`). The output is the same as plain decoding either way.
    #[arg(long, default_value = "auto")]
    pub drafter: String,
    /// γ: the most tokens drafted per round. Default: 3 for ngram and draft models (measured
    /// best on two cores; see docs/BENCHMARKS.md), the checkpoint's block for network drafters.
    #[arg(long)]
    pub draft_len: Option<usize>,
    /// Verify only the drafts whose predicted prefix survival (product of a DSpark drafter's
    /// calibrated confidences) is at least this (`--policy threshold:P`); 0 verifies all γ.
    /// Drafters with a confidence head (DSpark, and `auto` with a shipped DSpark drafter) are
    /// scheduled by `--policy dspark` unless told otherwise. Output unchanged either way.
    #[arg(long)]
    pub min_survival: Option<f32>,
    /// How many of each round's drafts to verify: `fixed` (all γ), `threshold:P` (while the
    /// predicted prefix survival is at least P; the same as `--min-survival P`), `dspark`
    /// (DSpark's Algorithm 1: as many as pay on this machine's cost curve, which is measured in
    /// a few seconds on the first run and kept for the next, unless --profile gives one;
    /// drafting pauses while even the best plan would be slower than plain decoding) or
    /// `dspark-async`. The last three need a drafter with a confidence head. Default: dspark
    /// for those drafters (measured ahead of threshold:0.3 on code and chat, docs/TRAINING.md),
    /// fixed for the others. Output unchanged either way.
    #[arg(long)]
    pub policy: Option<String>,
    /// A cost table from `dspark profile` for `--policy dspark`, instead of measuring one.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Measure `--policy dspark`'s cost table again instead of reusing the one `generate`
    /// measured before for this model, drafter, γ, thread count, kernel path, drafting weights
    /// and CPU (kept in $DSPARK_HOME/profiles/): after a change to the machine or its load.
    #[arg(long)]
    pub reprofile: bool,
}

/// A cost table from `dspark profile`, with a warning where it was measured for another model
/// or without the drafter's timings.
pub fn load_cost_table(path: &std::path::Path, target_name: &str, drafts: bool) -> Result<CostTable> {
    let t = CostTable::load(path)?;
    if t.model != target_name {
        eprintln!("warning: {} was measured for {}, not {target_name}", path.display(), t.model);
    }
    if drafts && t.draft.is_empty() {
        eprintln!("warning: {} has no drafter timings; drafting is treated as free", path.display());
    }
    eprintln!("cost table: loaded {}", path.display());
    Ok(t)
}

/// Where `generate` keeps the cost table it measured for this target, drafter, γ, thread count,
/// kernel path, drafting weights and CPU model: a table is only as good as the machine (and the
/// drafting cost) it was measured on.
pub fn profile_cache_path(target_name: &str, drafter_name: &str, gamma: usize) -> PathBuf {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(|l| l.to_string()))
        .unwrap_or_default();
    let key = format!(
        "{target_name}\n{drafter_name}\n{gamma}\n{}\n{}\n{cpu}{}",
        dspark_model::pool().current_num_threads(),
        dspark_kernels::kernel_path().name(),
        // Tables kept before this key had it were measured on 8-bit drafting: none matches now.
        // `main` refuses an unknown value before any command runs.
        match dspark_drafter_models::DraftWeights::from_env() {
            Ok(w) => format!("\nweights {w:?}"),
            Err(e) => format!("\n{e}"),
        }
    );
    // FNV-1a: stable across builds, unlike std's hasher.
    let hash =
        key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    let stem: String = target_name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' })
        .collect();
    dspark_hub::home().join("profiles").join(format!("{stem}-{hash:016x}.json"))
}

impl DrafterArgs {
    /// The verify policy for `drafter` (γ = `gamma`), with the cost table it plans with: read
    /// from --profile, else (with `reuse`) the one measured before for the same model, drafter,
    /// γ, threads and CPU, else measured now on this machine (and kept for next time).
    /// Benchmarks pass `reuse = false`: their figures come with a table of the same minutes.
    pub fn policy_for(
        &self,
        target: &Model,
        target_name: &str,
        drafter: &mut dyn Drafter,
        gamma: usize,
        reuse: bool,
    ) -> Result<(Policy, Option<CostTable>)> {
        let policy = match (&self.policy, self.min_survival) {
            (Some(_), Some(_)) => bail!("--min-survival P is --policy threshold:P: give one of the two"),
            (Some(p), None) => p.parse::<Policy>()?,
            (None, Some(p)) if p > 0.0 => Policy::Threshold(p),
            (None, Some(_)) => Policy::Fixed,
            (None, None) if drafter.has_confidence() => Policy::Dspark,
            (None, None) => Policy::Fixed,
        };
        if policy == Policy::Plain {
            bail!("--policy plain drafts nothing: use --drafter none for plain decoding");
        }
        if policy.needs_confidence() && !drafter.has_confidence() {
            bail!(
                "--policy {policy} ranks drafts by predicted survival, but {} has no confidence head; \
                 use --policy fixed or a DSpark drafter",
                drafter.name()
            );
        }
        if !matches!(policy, Policy::Dspark | Policy::DsparkAsync) {
            return Ok((policy, None));
        }
        let kept = profile_cache_path(target_name, &drafter.name(), gamma);
        let cost = match &self.profile {
            Some(p) => load_cost_table(p, target_name, true)?,
            None if reuse && !self.reprofile && kept.exists() => match CostTable::load(&kept) {
                Ok(t) => {
                    eprintln!(
                        "cost table: reusing {} (measured before on this machine; --reprofile measures again)",
                        kept.display()
                    );
                    t
                }
                Err(e) => {
                    eprintln!("warning: ignoring the kept cost table: {e}");
                    self.measure(target, target_name, drafter, gamma, reuse.then_some(&kept))?
                }
            },
            None => self.measure(target, target_name, drafter, gamma, reuse.then_some(&kept))?,
        };
        Ok((policy, Some(cost)))
    }

    /// Measures the single-request cost table now and, given `keep`, saves it there.
    fn measure(
        &self,
        target: &Model,
        target_name: &str,
        drafter: &mut dyn Drafter,
        gamma: usize,
        keep: Option<&PathBuf>,
    ) -> Result<CostTable> {
        let t0 = std::time::Instant::now();
        let t = dspark_engine::profile_one(target, target_name, drafter, gamma, 7, |_| {})?;
        let draft = if t.draft.is_empty() {
            "drafting is left to the drafter's own gate".to_string()
        } else {
            format!("a drafting round {:.2}×", t.draft_s(1) / t.forward_s(1))
        };
        eprintln!(
            "cost table: a forward of {} tokens costs {:.2}× one, {draft} (measured in {:.1} s; \
             pass --profile FILE to reuse a table from `dspark profile`)",
            gamma + 1,
            t.forward_s(gamma + 1) / t.forward_s(1),
            t0.elapsed().as_secs_f64()
        );
        if let Some(path) = keep {
            // Best effort: a read-only cache costs the next run a measurement, nothing more.
            let saved = path.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|_| t.save(path));
            if let Err(e) = saved {
                eprintln!("warning: cannot keep the cost table in {}: {e}", path.display());
            }
        }
        Ok(t)
    }

    /// The drafter and γ; `None` for plain decoding.
    pub fn build(&self, target: &Arc<Model>, target_name: &str) -> Result<Option<(Box<dyn Drafter>, usize)>> {
        if self.draft_len == Some(0) {
            bail!("--draft-len must be at least 1; use --drafter none for plain decoding");
        }
        if let Some(p) = self.min_survival.filter(|p| !(0.0..=1.0).contains(p)) {
            bail!("--min-survival must be between 0 and 1 (got {p})");
        }
        let gamma = self.draft_len.unwrap_or(3);
        Ok(match self.drafter.parse::<DrafterSpec>()? {
            DrafterSpec::Auto => {
                // Prompt lookup wherever it matches, the shipped DSpark drafter while it pays.
                let (model, block) = match shipped_drafter(target_name) {
                    Some(dir) => {
                        let d = dspark_drafters::load_network_drafter(
                            Method::Dspark,
                            &dir,
                            target.clone(),
                            target_name,
                        )?;
                        (Some(d), dspark_drafter_models::read_config(&dir)?.gamma())
                    }
                    None => (None, gamma),
                };
                let auto = dspark_drafters::AutoDrafter::new(model, gamma);
                Some((Box::new(auto), self.draft_len.unwrap_or(block.max(gamma))))
            }
            DrafterSpec::None => None,
            DrafterSpec::Ngram => Some((Box::new(NgramDrafter::default()), gamma)),
            DrafterSpec::DraftModel(name) => {
                let model = ModelArg { model: name.clone() }.load_for_drafting()?;
                Some((Box::new(DraftModel::new(model, &name, target)?), gamma))
            }
            DrafterSpec::Network(method, dir) => {
                let d = dspark_drafters::load_network_drafter(method, &dir, target.clone(), target_name)?;
                let block = dspark_drafter_models::read_config(&dir)?.gamma();
                Some((d, block_gamma(self.draft_len, block)?))
            }
        })
    }
}

/// γ for a drafter that drafts blocks of `block` tokens: the block unless asked for fewer; more
/// is an error (the same for every command).
pub fn block_gamma(draft_len: Option<usize>, block: usize) -> Result<usize> {
    match draft_len {
        Some(g) if g > block => {
            bail!("--draft-len {g} exceeds the drafter's block of {block} tokens; use at most {block}")
        }
        Some(g) => Ok(g),
        None => Ok(block),
    }
}

/// The DSpark drafter shipped with the repository for a target name, if there is one.
pub fn shipped_drafter(target_name: &str) -> Option<PathBuf> {
    let Some(root) = dspark_hub::drafters_dir() else {
        // A binary copied out of the repository finds no drafters and would silently draft with
        // prompt lookup alone.
        eprintln!(
            "note: no drafters/ folder beside the binary or in {}, so `auto` drafts with prompt \
             lookup only; link or copy the repository's drafters/ there for its DSpark drafters",
            dspark_hub::home().join("drafters").display()
        );
        return None;
    };
    let dir = root.join(format!("{target_name}-dspark-markov"));
    dir.join("config.json").exists().then_some(dir)
}

/// `raw` text is parsed for special tokens (the caller writes the markup); a chat prompt is one
/// user turn whose text never becomes control tokens.
pub fn prompt_tokens(model: &Model, text: &str, raw: bool) -> Result<Vec<u32>> {
    if raw {
        Ok(model.tokenizer.encode(text, true)?)
    } else {
        Ok(model.chat_tokens(text)?)
    }
}

/// How a fresh drafter is built (shared by `init-drafter` and `train`).
#[derive(Args, Clone)]
pub struct InitOpts {
    /// dspark (backbone + sequential + confidence heads), dflash (backbone only) or eagle3.
    #[arg(long, default_value = "dspark")]
    method: String,
    /// Draft decoder layers (EAGLE-3 always has one). One keeps drafting cheap on CPUs.
    #[arg(long, default_value_t = 1)]
    pub(crate) layers: usize,
    /// Width of each draft layer's MLP (default: the target's). Narrower makes a smaller,
    /// faster drafter; say 4096 for Qwen2.5-Coder-1.5B to keep its checkpoint under 80 MB in bf16.
    #[arg(long)]
    intermediate: Option<usize>,
    /// γ: tokens drafted per round.
    #[arg(long, default_value_t = 7)]
    block: usize,
    /// Rank r of DSpark's sequential head (W1: vocab × r, W2: draft vocab × r).
    #[arg(long, default_value_t = 64)]
    markov_rank: usize,
    /// DSpark's sequential head: markov or rnn.
    #[arg(long, default_value = "markov")]
    head: String,
    /// Reduced draft vocabulary: the V_d most frequent target tokens (frequencies from
    /// --vocab-from, else the tokenizer's merge order). Cuts the drafter's LM-head cost; drafts stay
    /// exact because verification sees the full-vocabulary distribution (zero outside).
    #[arg(long)]
    draft_vocab: Option<usize>,
    /// Text or JSONL file whose tokens decide which tokens make the draft vocabulary (regenerated
    /// training data works: its `tokens` are counted directly).
    #[arg(long)]
    vocab_from: Option<PathBuf>,
    /// Target layers whose hidden states the drafter reads, comma-separated (default: DFlash's
    /// spread, five layers over [1, N−3]; three for EAGLE-3).
    #[arg(long, value_delimiter = ',')]
    target_layers: Option<Vec<usize>>,
    /// The MASK token id of the block (default: an unused special token of the target).
    #[arg(long)]
    mask_token: Option<u32>,
    /// Block layout: dspark (γ inputs → γ drafts) or dflash (the original: γ+1 inputs).
    #[arg(long)]
    layout: Option<String>,
    /// Standard deviation of the random weights.
    #[arg(long, default_value_t = 0.02)]
    init_std: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

fn token_counts(model: &Model, path: &std::path::Path) -> Result<std::collections::HashMap<u32, u64>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut counts = std::collections::HashMap::new();
    for line in text.lines() {
        // JSONL: every string value of the record; plain text: the line itself.
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
            if let Some(toks) = v["tokens"].as_array() {
                let start = v["prompt_len"].as_u64().unwrap_or(0) as usize;
                for t in toks.iter().skip(start).filter_map(|t| t.as_u64()) {
                    *counts.entry(t as u32).or_insert(0) += 1;
                }
                continue;
            }
        }
        let pieces: Vec<String> = match serde_json::from_str::<serde_json::Value>(line) {
            Ok(serde_json::Value::Object(o)) => {
                o.values().filter_map(|v| v.as_str().map(str::to_string)).collect()
            }
            _ => vec![line.to_string()],
        };
        for p in pieces {
            for t in model.tokenizer.encode(&p, false)? {
                *counts.entry(t).or_insert(0) += 1;
            }
        }
    }
    Ok(counts)
}

/// Builds and saves a fresh drafter for `target`.
pub fn init_drafter(
    target: Arc<Model>,
    target_name: &str,
    a: &InitOpts,
    out: &std::path::Path,
) -> Result<()> {
    let method: Method = a.method.parse()?;
    let draft_vocab = match a.draft_vocab {
        None => None,
        Some(n) => {
            let counts = match &a.vocab_from {
                Some(p) => token_counts(&target, p)?,
                None => Default::default(),
            };
            Some(dspark_drafter_models::frequent_tokens(&target, &counts, n)?)
        }
    };
    // DFlash keeps its original block layout unless told otherwise; DSpark uses its own.
    let layout = match a.layout.as_deref() {
        None if method == Method::Dflash => BlockLayout::Dflash,
        None | Some("dspark") => BlockLayout::Dspark,
        Some("dflash") => BlockLayout::Dflash,
        Some(other) => bail!("unknown layout `{other}`; use dspark or dflash"),
    };
    let o = InitOptions {
        method,
        layers: a.layers,
        intermediate: a.intermediate,
        gamma: a.block,
        head: a.head.parse()?,
        rank: a.markov_rank,
        draft_vocab,
        target_layers: a.target_layers.clone(),
        mask_token: a.mask_token,
        layout,
        std: a.init_std,
        seed: a.seed,
    };
    let net = dspark_drafter_models::init(target, target_name, &o)?;
    net.save(out)?;
    let c = net.config();
    eprintln!(
        "wrote {} drafter to {} (target layers {:?}, γ {}, draft vocabulary {}{})",
        method,
        out.display(),
        c.target_layer_ids,
        c.gamma(),
        c.draft_vocab(),
        c.mask_token_id.map(|m| format!(", MASK id {m}")).unwrap_or_default()
    );
    Ok(())
}
