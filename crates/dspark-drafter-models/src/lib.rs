//! Drafter networks: DFlash's parallel backbone (with DSpark's sequential and confidence heads)
//! and EAGLE-3, on candle tensors so that the same code drafts and trains. Checkpoints are a
//! folder with `config.json` and `model.safetensors` in the public DeepSpec/EAGLE-3 layout.

pub mod common;
pub mod config;
pub mod dflash;
pub mod eagle3;
pub mod export;
pub mod formats;
pub mod nn;
mod pth;
pub mod store;

pub use common::{DraftVocab, LmHead};
pub use config::{BlockLayout, DrafterConfig, Extensions, Format, HeadKind, Method, TargetId};
pub use dflash::{BlockModel, ContextCache, DraftTrace};
pub use eagle3::{Eagle3Model, EagleCache};
pub use store::{Quant, Store};

use candle_core::{Device, Tensor};
use dspark_model::{Family, Model};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

/// What went wrong with a drafter network: its checkpoint or config, or its forward. Errors
/// while drafting in the decode loop are `dspark_spec::DraftError`s.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("drafter checkpoint: {0}")]
    Checkpoint(String),
    #[error("drafter config: {0}")]
    Config(String),
    #[error("{0}")]
    WrongTarget(String),
    #[error("drafter input: {0}")]
    Input(String),
    #[error(transparent)]
    Model(#[from] dspark_model::ModelError),
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, NetworkError>;

/// The weights a drafter drafts through, whatever precision its checkpoint stores. A drafting
/// round multiplies a few rows by every weight, so on two cores it is bound by the multiply rate
/// of the quantized kernels and by reading the weights: 4-bit blocks (Q4_0) read half the bytes
/// of 8-bit ones and on AVX2 sum in i16, and on the shipped Qwen drafter (AMD EPYC Rome, `avx2`)
/// cut a round from 9.7 to 6.5 ms at the same acceptance (τ 2.09 vs 2.08 on MBPP; docs/TRAINING.md,
/// seventeenth session). Which weights draft never changes the output, only how often drafts
/// are accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftWeights {
    /// Q4_0: the default.
    Q4,
    /// Q8_0.
    Q8,
    /// The checkpoint's values in f32 (slow: every round reads 4 bytes a weight).
    F32,
}

impl DraftWeights {
    /// `DSPARK_DRAFTER_WEIGHTS=q4|q8|f32`, [`DraftWeights::Q4`] when unset; another value is
    /// refused rather than silently replaced.
    pub fn from_env() -> Result<Self> {
        let v = match std::env::var("DSPARK_DRAFTER_WEIGHTS") {
            Err(std::env::VarError::NotPresent) => return Ok(Self::Q4),
            Err(std::env::VarError::NotUnicode(v)) => v.to_string_lossy().into_owned(),
            Ok(v) => v,
        };
        Self::parse(&v).ok_or_else(|| {
            NetworkError::Config(format!(
                "DSPARK_DRAFTER_WEIGHTS={v} is not one of q4, q8, f32 (the drafting weights' format; \
                 unset it for the default, q4)"
            ))
        })
    }

    pub fn parse(v: &str) -> Option<Self> {
        match v.trim().to_ascii_lowercase().as_str() {
            "q4" | "q4_0" => Some(Self::Q4),
            "q8" | "q8_0" => Some(Self::Q8),
            "f32" => Some(Self::F32),
            _ => None,
        }
    }
}

/// A loaded drafter network of either kind.
pub enum DrafterNet {
    Block(BlockModel),
    Eagle3(Eagle3Model),
}

impl DrafterNet {
    pub fn config(&self) -> &DrafterConfig {
        match self {
            Self::Block(m) => &m.config,
            Self::Eagle3(m) => &m.config,
        }
    }

    pub fn method(&self) -> Method {
        self.config().ext().method
    }

    /// Quantized weights for drafting, in the format `DSPARK_DRAFTER_WEIGHTS` names (default
    /// [`DraftWeights::Q4`]).
    pub fn quantize_for_inference(&mut self) -> Result<()> {
        let format = match DraftWeights::from_env()? {
            DraftWeights::F32 => return Ok(()),
            DraftWeights::Q8 => candle_core::quantized::GgmlDType::Q8_0,
            DraftWeights::Q4 => candle_core::quantized::GgmlDType::Q4_0,
        };
        match self {
            Self::Block(m) => m.quantize_for_inference(format),
            Self::Eagle3(m) => m.quantize_for_inference(format),
        }
    }

    pub fn vocab(&self) -> &DraftVocab {
        self.parts().1
    }

    fn parts(&self) -> (&BTreeMap<String, Tensor>, &DraftVocab) {
        match self {
            Self::Block(m) => (m.tensors(), &m.vocab),
            Self::Eagle3(m) => (m.tensors(), &m.vocab),
        }
    }

    /// Writes `DIR/config.json` and `DIR/model.safetensors`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let (tensors, vocab) = self.parts();
        save(dir, self.config(), tensors, vocab)
    }
}

pub fn save(
    dir: &Path,
    config: &DrafterConfig,
    tensors: &BTreeMap<String, Tensor>,
    vocab: &DraftVocab,
) -> Result<()> {
    let mut all = tensors.clone();
    if let Some(d2t) = vocab.tensor()? {
        all.insert("d2t".into(), d2t);
    }
    write_checkpoint(dir, &serde_json::to_string_pretty(config).expect("config serialises"), &all)
}

/// Writes `DIR/config.json` (`config`) and `DIR/model.safetensors` (`tensors`).
pub(crate) fn write_checkpoint(dir: &Path, config: &str, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    let io = |e: std::io::Error| NetworkError::Checkpoint(format!("cannot write {}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    // Write both files under temporary names first so that an interrupted save never leaves a
    // checkpoint whose config and weights disagree.
    let (cfg_tmp, st_tmp) = (dir.join("config.json.partial"), dir.join("model.safetensors.partial"));
    std::fs::write(&cfg_tmp, config).map_err(io)?;
    Store::save(tensors, &st_tmp)?;
    std::fs::rename(&st_tmp, dir.join("model.safetensors")).map_err(io)?;
    std::fs::rename(&cfg_tmp, dir.join("config.json")).map_err(io)?;
    Ok(())
}

/// Writes a deeper copy of the DFlash/DSpark drafter in `src` to `dst`: its draft layers kept and
/// new ones appended up to `layers`, each a copy of its last layer whose output projections
/// (`o_proj`, `down_proj`) are zero. A zero residual branch adds exactly nothing, so the deeper
/// drafter drafts what `src` drafts, and training continues from that function with more
/// capacity (the paper's drafters have 2–5 layers).
pub fn grow(src: &Path, layers: usize, dst: &Path) -> Result<()> {
    let mut config = read_config(src)?;
    if config.format != Format::Dspark {
        return Err(NetworkError::Config(format!(
            "{} is in a public layout; deepen a drafter this project trained",
            src.display()
        )));
    }
    if config.ext().method == Method::Eagle3 {
        return Err(NetworkError::Config(
            "an EAGLE-3 drafter has one layer by design; deepen a DFlash or DSpark drafter".into(),
        ));
    }
    if dst.join("config.json").exists() {
        return Err(NetworkError::Checkpoint(format!(
            "{} already holds a checkpoint; choose an empty folder",
            dst.display()
        )));
    }
    let old = config.num_hidden_layers;
    if layers <= old {
        return Err(NetworkError::Config(format!(
            "{} has {old} draft layer(s) already; ask for more",
            src.display()
        )));
    }
    let mut map = Store::load_dir(src)?.map().clone();
    let prefix = format!("layers.{}.", old - 1);
    let last: Vec<(String, Tensor)> =
        map.iter().filter_map(|(k, t)| k.strip_prefix(&prefix).map(|s| (s.to_string(), t.clone()))).collect();
    if last.is_empty() {
        return Err(NetworkError::Checkpoint(format!("{} has no tensors `{prefix}*`", src.display())));
    }
    for l in old..layers {
        for (suffix, t) in &last {
            let zero = suffix.starts_with("self_attn.o_proj.") || suffix.starts_with("mlp.down_proj.");
            map.insert(format!("layers.{l}.{suffix}"), if zero { t.zeros_like()? } else { t.clone() });
        }
    }
    config.num_hidden_layers = layers;
    config.validate()?;
    write_checkpoint(dst, &serde_json::to_string_pretty(&config).expect("config serialises"), &map)
}

/// Writes checkpoint folder `src` (ours) to `dst` with its large matrices in 8 or 4 bits
/// ([`Store::save_quantized`]: what ships in the repository, under its size limit); every other
/// file of the folder (config, calibration, training log, plots) is copied as it is. Returns the
/// bytes of the new weights.
pub fn compact(src: &Path, dst: &Path, quant: Quant) -> Result<u64> {
    let io = |p: &Path, e: std::io::Error| NetworkError::Checkpoint(format!("{}: {e}", p.display()));
    let config = read_config(src)?;
    if config.dspark.is_none() {
        return Err(NetworkError::Config(format!(
            "{} is in a public layout; compact a checkpoint of ours (what `dspark train` writes)",
            src.display()
        )));
    }
    let store = Store::load_dir(src)?;
    std::fs::create_dir_all(dst).map_err(|e| io(dst, e))?;
    let weights = ["model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"];
    for entry in std::fs::read_dir(src).map_err(|e| io(src, e))? {
        let entry = entry.map_err(|e| io(src, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let shard = name.starts_with("model-") && name.ends_with(".safetensors");
        if entry.path().is_file() && !weights.contains(&name.as_ref()) && !shard {
            std::fs::copy(entry.path(), dst.join(&*name)).map_err(|e| io(&entry.path(), e))?;
        }
    }
    let tmp = dst.join("model.safetensors.partial");
    let bytes = Store::save_quantized(store.map(), &tmp, quant)?;
    std::fs::rename(&tmp, dst.join("model.safetensors")).map_err(|e| io(dst, e))?;
    Ok(bytes)
}

/// Reads a checkpoint folder's config: ours, or a public one translated by [`formats`].
pub fn read_config(dir: &Path) -> Result<DrafterConfig> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        NetworkError::Checkpoint(format!(
            "cannot read {}: {e}; a drafter is a folder with config.json and model.safetensors \
             (make one with `dspark init-drafter`)",
            path.display()
        ))
    })?;
    let shown = path.display().to_string();
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| NetworkError::Checkpoint(format!("{shown}: {e}")))?;
    if !formats::is_ours(&v) {
        return formats::public(v, &shown);
    }
    let c: DrafterConfig =
        serde_json::from_value(v).map_err(|e| NetworkError::Checkpoint(format!("{shown}: {e}")))?;
    c.validate().map_err(|e| NetworkError::Config(format!("{shown}: {e}")))?;
    Ok(c)
}

/// Loads a drafter for `target` (named `target_name` in messages), refusing one built for
/// another target and one whose files hold anything its config does not account for.
pub fn load(dir: &Path, target: Arc<Model>, target_name: &str) -> Result<DrafterNet> {
    let mut config = read_config(dir)?;
    config.family()?;
    config.resolve_taps(target.config.n_layers)?;
    config.check_target(&target, &TargetId::of(&target, target_name))?;
    let store = Store::load_dir(dir)?;
    store.check_finite()?;
    let net = from_store(config, &store, target)?;
    store.check_all_used()?;
    Ok(net)
}

/// Builds a drafter from named tensors (a checkpoint, a fresh initialisation, training variables).
pub fn from_store(config: DrafterConfig, store: &Store, target: Arc<Model>) -> Result<DrafterNet> {
    config.validate()?;
    let vocab = DraftVocab::load(store, &config)?;
    Ok(match config.ext().method {
        Method::Eagle3 => DrafterNet::Eagle3(Eagle3Model::new(config, store, vocab, target)?),
        _ => DrafterNet::Block(BlockModel::new(config, store, vocab, target)?),
    })
}

/// How to build a fresh drafter.
#[derive(Debug, Clone)]
pub struct InitOptions {
    pub method: Method,
    /// Draft decoder layers (EAGLE-3 always has one).
    pub layers: usize,
    /// Width of the draft layers' MLP (default: the target's). A narrower MLP keeps a drafter
    /// for a wide target small (Qwen2.5-1.5B's 8 960 would make one layer 232 MB in f32).
    pub intermediate: Option<usize>,
    /// γ, the drafts per round.
    pub gamma: usize,
    pub head: HeadKind,
    pub rank: usize,
    /// Target ids of a reduced draft vocabulary.
    pub draft_vocab: Option<Vec<u32>>,
    pub target_layers: Option<Vec<usize>>,
    pub mask_token: Option<u32>,
    pub layout: BlockLayout,
    /// Standard deviation of the random weights.
    pub std: f32,
    pub seed: u64,
}

impl Default for InitOptions {
    fn default() -> Self {
        Self {
            method: Method::Dspark,
            layers: 1,
            intermediate: None,
            gamma: 7,
            head: HeadKind::Markov,
            rank: 64,
            draft_vocab: None,
            target_layers: None,
            mask_token: None,
            layout: BlockLayout::Dspark,
            std: 0.02,
            seed: 0,
        }
    }
}

/// DFlash's spread of `m` target layers over `[1, N−3]`: `round(1 + i·(N−4)/(m−1))`.
pub fn default_target_layers(n_layers: usize, m: usize) -> Vec<usize> {
    if m <= 1 || n_layers < 5 {
        return (0..m.min(n_layers.saturating_sub(1)).max(1)).collect();
    }
    let mut v: Vec<usize> = (0..m)
        .map(|i| (1.0 + i as f64 * (n_layers as f64 - 4.0) / (m as f64 - 1.0)).round() as usize)
        .collect();
    v.dedup();
    v
}

/// A dedicated MASK id: a special token the chat template never emits, preferring pad/reserved
/// ones; its embedding is the target's, frozen.
pub fn pick_mask_token(target: &Model) -> Result<u32> {
    let tok = &target.tokenizer;
    let chat = target.chat_prompt("hi").unwrap_or_default()
        + &tok.eos().iter().map(|&e| tok.token_text(e).unwrap_or_default()).collect::<String>();
    let reserved: Vec<(u32, String)> = tok
        .special_tokens()
        .into_iter()
        .filter(|(i, s)| {
            (*i as usize) < target.config.vocab_size
                && Some(*i) != tok.bos()
                && !tok.eos().contains(i)
                && !chat.contains(s.as_str())
        })
        .collect();
    let preferred = reserved.iter().rev().find(|(_, s)| {
        let s = s.to_lowercase();
        s.contains("pad") || s.contains("reserved") || s.contains("mask")
    });
    preferred.or(reserved.last()).map(|(i, _)| *i).ok_or_else(|| {
        NetworkError::Config(
            "the target has no unused special token to serve as MASK; pass --mask-token ID".into(),
        )
    })
}

/// The `n` most frequent target tokens by `counts` (ties and unseen tokens by id, which in BPE
/// vocabularies roughly follows merge order, i.e. frequency), always with the end-of-sequence
/// tokens; sorted by id.
pub fn frequent_tokens(target: &Model, counts: &HashMap<u32, u64>, n: usize) -> Result<Vec<u32>> {
    let v = target.config.vocab_size;
    if n == 0 || n > v {
        return Err(NetworkError::Config(format!("draft vocabulary size must be in 1..={v}, got {n}")));
    }
    let mut ids: Vec<u32> = (0..v as u32).collect();
    ids.sort_by_key(|i| (std::cmp::Reverse(counts.get(i).copied().unwrap_or(0)), *i));
    let mut keep: Vec<u32> = target.tokenizer.eos().iter().copied().filter(|&e| (e as usize) < v).collect();
    for i in ids {
        if keep.len() >= n {
            break;
        }
        if !keep.contains(&i) {
            keep.push(i);
        }
    }
    keep.sort();
    Ok(keep)
}

/// The config of a fresh drafter for `target`.
pub fn init_config(target: &Model, target_name: &str, o: &InitOptions) -> Result<DrafterConfig> {
    let c = &target.config;
    if c.family == Family::Gemma3 {
        return Err(NetworkError::Config(
            "drafters for gemma3 targets are not supported yet (llama, qwen2 and qwen3 are)".into(),
        ));
    }
    if o.gamma == 0 {
        return Err(NetworkError::Config("the block must draft at least one token (--block ≥ 1)".into()));
    }
    if o.layers == 0 {
        return Err(NetworkError::Config("a drafter needs at least one layer".into()));
    }
    let eagle = o.method == Method::Eagle3;
    let layers = o
        .target_layers
        .clone()
        .unwrap_or_else(|| default_target_layers(c.n_layers, if eagle { 3 } else { 5 }));
    if let Some(&bad) = layers.iter().find(|&&l| l >= c.n_layers) {
        return Err(NetworkError::Config(format!(
            "target layer {bad} does not exist (the target has {})",
            c.n_layers
        )));
    }
    let dspark = o.method == Method::Dspark;
    if dspark && o.rank == 0 {
        return Err(NetworkError::Config("the sequential head needs a rank ≥ 1".into()));
    }
    let mask = if eagle {
        None
    } else {
        Some(match o.mask_token {
            Some(m) => m,
            None => pick_mask_token(target)?,
        })
    };
    if mask.is_some_and(|m| m as usize >= c.vocab_size) {
        return Err(NetworkError::Config(format!("mask token {} is outside the vocabulary", mask.unwrap())));
    }
    let block_size = match (o.method, o.layout) {
        (Method::Eagle3, _) | (_, BlockLayout::Dspark) => o.gamma,
        (_, BlockLayout::Dflash) => o.gamma + 1,
    };
    let arch = match o.method {
        Method::Dflash => "DFlashDraftModel",
        Method::Dspark => "DSparkDraftModel",
        Method::Eagle3 => "LlamaForCausalLMEagle3",
    };
    Ok(DrafterConfig {
        architectures: vec![arch.into()],
        model_type: config::family_name(c.family).into(),
        hidden_size: c.hidden,
        intermediate_size: o.intermediate.unwrap_or(c.intermediate),
        num_hidden_layers: if eagle { 1 } else { o.layers },
        num_attention_heads: c.n_heads,
        num_key_value_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        rms_norm_eps: shortest(c.rms_eps),
        rope_theta: shortest(c.rope_theta),
        vocab_size: c.vocab_size,
        attention_bias: c.family == Family::Qwen2,
        block_size,
        markov_rank: if dspark && o.head == HeadKind::Markov { o.rank } else { 0 },
        target_layer_ids: layers,
        mask_token_id: mask,
        draft_vocab_size: o.draft_vocab.as_ref().map(|v| v.len()),
        dspark: Some(Extensions {
            method: o.method,
            head: dspark.then_some(o.head),
            head_rank: if dspark { o.rank } else { 0 },
            confidence: dspark,
            layout: if eagle { BlockLayout::Dspark } else { o.layout },
            calibration_temperatures: None,
            calibration_biases: None,
            target: Some(TargetId::of(target, target_name)),
            confidence_with_markov: true,
        }),
        format: config::Format::Dspark,
        num_target_layers: None,
        taps_from_target: false,
    })
}

/// A randomly initialised drafter (what training starts from, and what tests use).
pub fn init(target: Arc<Model>, target_name: &str, o: &InitOptions) -> Result<DrafterNet> {
    let config = init_config(&target, target_name, o)?;
    config.validate()?;
    let vocab = DraftVocab::new(o.draft_vocab.clone(), target.config.vocab_size)?;
    let map = match o.method {
        Method::Eagle3 => {
            let ids = vocab.target_ids();
            let rows = target.lm_head_rows(&ids)?;
            eagle3::init(
                &config,
                o.std,
                o.seed,
                Tensor::from_vec(rows, (ids.len(), target.config.hidden), &Device::Cpu)?,
            )?
        }
        _ => dflash::init(&config, o.std, o.seed)?,
    };
    let mut map = map;
    if let Some(d2t) = vocab.tensor()? {
        map.insert("d2t".into(), d2t);
    }
    from_store(config, &Store::from_map(map, "a fresh initialisation"), target)
}

/// An f32 config value as the f64 with the same shortest decimal form (1e-5, not 9.99…e-6).
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

#[cfg(test)]
mod tests {
    use super::DraftWeights;

    /// The names `DSPARK_DRAFTER_WEIGHTS` takes, in either spelling and case; anything else is
    /// refused rather than read as the default.
    #[test]
    fn drafting_weight_names() {
        for (v, w) in [("q4", DraftWeights::Q4), ("Q4_0", DraftWeights::Q4), ("q8", DraftWeights::Q8)] {
            assert_eq!(DraftWeights::parse(v), Some(w), "{v}");
        }
        assert_eq!(DraftWeights::parse(" f32 "), Some(DraftWeights::F32));
        for bad in ["", "q5", "8", "bf16"] {
            assert_eq!(DraftWeights::parse(bad), None, "{bad}");
        }
    }
}
