//! `config.json` of a drafter checkpoint: the keys of the public DeepSpec/EAGLE-3 configs, plus
//! our extensions under `"dspark"` (which those loaders ignore). Public checkpoints' own configs
//! are translated into this form by [`crate::formats`].

use crate::{NetworkError, Result};
use dspark_model::{Family, Model};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Largest size a drafter may declare (as for targets).
pub const MAX_DIM: usize = dspark_model::config::MAX_DIM;
/// Most tokens one block drafts: far above any useful γ, small enough that a block's buffers stay
/// small.
pub const MAX_BLOCK: usize = 256;
/// Most decoder layers (and target layers read) of a drafter.
pub const MAX_LAYERS: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Parallel backbone only, trained with cross-entropy.
    Dflash,
    /// Parallel backbone + sequential head + confidence head.
    Dspark,
    /// One autoregressive layer over fused target features.
    Eagle3,
}

impl std::str::FromStr for Method {
    type Err = NetworkError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "dflash" => Ok(Self::Dflash),
            "dspark" => Ok(Self::Dspark),
            "eagle3" => Ok(Self::Eagle3),
            other => {
                Err(NetworkError::Config(format!("unknown method `{other}`; use dflash, dspark or eagle3")))
            }
        }
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Dflash => "dflash",
            Self::Dspark => "dspark",
            Self::Eagle3 => "eagle3",
        })
    }
}

/// DSpark's sequential head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HeadKind {
    Markov,
    Rnn,
}

impl std::str::FromStr for HeadKind {
    type Err = NetworkError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "markov" => Ok(Self::Markov),
            "rnn" => Ok(Self::Rnn),
            other => Err(NetworkError::Config(format!("unknown head `{other}`; use markov or rnn"))),
        }
    }
}

/// Where the block's drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum BlockLayout {
    /// DSpark: γ inputs `[anchor, MASK × (γ−1)]`, slot k predicts the token after slot k.
    #[default]
    Dspark,
    /// Original DFlash: `block_size` inputs, slot k ≥ 1 predicts the token at its own position
    /// (γ = block_size − 1 drafts).
    Dflash,
}

/// What a drafter was built for; checked against the target at load.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetId {
    pub name: String,
    pub family: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    /// sha256 of the target's token strings in id order: same ids, same text.
    pub tokenizer_sha256: String,
}

impl TargetId {
    pub fn of(target: &Model, name: &str) -> Self {
        let mut vocab: Vec<(u32, String)> =
            target.tokenizer.vocab().into_iter().map(|(s, i)| (i, s)).collect();
        vocab.sort();
        let mut h = Sha256::new();
        for (i, s) in &vocab {
            h.update(i.to_le_bytes());
            h.update(s.as_bytes());
            h.update([0]);
        }
        let c = &target.config;
        Self {
            name: name.to_string(),
            family: family_name(c.family).to_string(),
            vocab_size: c.vocab_size,
            hidden_size: c.hidden,
            num_layers: c.n_layers,
            tokenizer_sha256: hex::encode(h.finalize()),
        }
    }
}

pub fn family_name(f: Family) -> &'static str {
    match f {
        Family::Llama => "llama",
        Family::Qwen2 => "qwen2",
        Family::Qwen3 => "qwen3",
        Family::Gemma3 => "gemma3",
    }
}

/// Our keys, absent from public checkpoints (then defaults are inferred from the tensors).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Extensions {
    pub method: Method,
    #[serde(default)]
    pub head: Option<HeadKind>,
    /// Rank r of the sequential head (Markov or RNN).
    #[serde(default)]
    pub head_rank: usize,
    #[serde(default)]
    pub confidence: bool,
    #[serde(default)]
    pub layout: BlockLayout,
    /// Per-position temperatures of sequential temperature scaling, once fitted.
    #[serde(default)]
    pub calibration_temperatures: Option<Vec<f32>>,
    /// Per-position offsets added after the temperature (`σ(z / T + b)`), once fitted; absent
    /// means 0 (the paper's STS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration_biases: Option<Vec<f32>>,
    #[serde(default)]
    pub target: Option<TargetId>,
    /// The confidence head reads `[h_k ; W1[x_{k−1}]]` (DeepSpec's `confidence_head_with_markov`)
    /// rather than `h_k` alone.
    #[serde(default = "yes")]
    pub confidence_with_markov: bool,
}

fn yes() -> bool {
    true
}

/// Whose saver wrote a checkpoint: it decides the tensor names that differ between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// Ours (`"dspark"` key in config.json).
    #[default]
    Dspark,
    /// deepseek-ai/DeepSpec (`Qwen3DSparkModel`, `Qwen3Eagle3Model`).
    DeepSpec,
    /// z-lab/dflash (`DFlashDraftModel` with `dflash_config`).
    Zlab,
    /// SafeAILab/EAGLE and vLLM EAGLE-3 (`midlayer.*`, `draft_vocab_size`).
    SafeAiLab,
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Dspark => "dspark",
            Self::DeepSpec => "DeepSpec",
            Self::Zlab => "z-lab DFlash",
            Self::SafeAiLab => "SafeAILab EAGLE-3",
        })
    }
}

/// Target layer ids as DeepSpec writes them: `-1` is the embedding output
/// ([`dspark_model::EMBEDDING_TAP`]).
mod layer_ids {
    use dspark_model::EMBEDDING_TAP;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(ids: &[usize], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(ids.iter().map(|&i| if i == EMBEDDING_TAP { -1 } else { i as i64 }))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<usize>, D::Error> {
        Vec::<i64>::deserialize(d)?
            .into_iter()
            .map(|i| super::layer_id(i).map_err(serde::de::Error::custom))
            .collect()
    }
}

/// A target layer id from a config: `-1` → the embedding output, `0…` → that decoder layer.
pub fn layer_id(i: i64) -> std::result::Result<usize, String> {
    match i {
        -1 => Ok(dspark_model::EMBEDDING_TAP),
        i if (0..MAX_LAYERS as i64).contains(&i) => Ok(i as usize),
        i => Err(format!("target layer id {i} is neither -1 (the embedding output) nor a layer index")),
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterConfig {
    pub architectures: Vec<String>,
    /// The target's family; draft layers are built like its decoder layers.
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    /// Draft decoder layers.
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub vocab_size: usize,
    #[serde(default)]
    pub attention_bias: bool,
    /// DSpark layout: γ; DFlash layout: γ + 1. EAGLE-3: drafting steps per round.
    pub block_size: usize,
    #[serde(default)]
    pub markov_rank: usize,
    /// Decoder layers whose outputs are fused, in order ([`dspark_model::EMBEDDING_TAP`] for
    /// the embedding output, written `-1`).
    #[serde(with = "layer_ids")]
    pub target_layer_ids: Vec<usize>,
    #[serde(default)]
    pub mask_token_id: Option<u32>,
    /// Size of the reduced draft vocabulary (the `d2t` tensor), if any.
    #[serde(default)]
    pub draft_vocab_size: Option<usize>,
    #[serde(default)]
    pub dspark: Option<Extensions>,
    /// Whose saver wrote the checkpoint (not saved: we always write our own form).
    #[serde(skip)]
    pub format: Format,
    /// The target's depth the checkpoint declares (`num_target_layers`), checked at load.
    #[serde(skip)]
    pub num_target_layers: Option<usize>,
    /// SafeAILab's EAGLE-3 reads the inputs of target layers 2, L/2 and L−3, fixed by its code
    /// rather than its config: `target_layer_ids` is filled in once the target is known.
    #[serde(skip)]
    pub taps_from_target: bool,
}

impl DrafterConfig {
    /// Our extensions, or what a public checkpoint implies.
    pub fn ext(&self) -> Extensions {
        self.dspark.clone().unwrap_or_else(|| {
            let eagle = self.architectures.iter().any(|a| a.to_lowercase().contains("eagle"));
            let dspark = self.markov_rank > 0;
            Extensions {
                method: if eagle {
                    Method::Eagle3
                } else if dspark {
                    Method::Dspark
                } else {
                    Method::Dflash
                },
                head: dspark.then_some(HeadKind::Markov),
                head_rank: self.markov_rank,
                confidence: dspark,
                layout: BlockLayout::Dspark,
                calibration_temperatures: None,
                calibration_biases: None,
                target: None,
                confidence_with_markov: true,
            }
        })
    }

    /// Drafts per round.
    pub fn gamma(&self) -> usize {
        match (self.ext().method, self.ext().layout) {
            (Method::Eagle3, _) | (_, BlockLayout::Dspark) => self.block_size,
            (_, BlockLayout::Dflash) => self.block_size.saturating_sub(1),
        }
    }

    /// The draft vocabulary's size (the full target vocabulary when there is no `d2t`).
    pub fn draft_vocab(&self) -> usize {
        self.draft_vocab_size.unwrap_or(self.vocab_size)
    }

    pub fn family(&self) -> Result<Family> {
        match self.model_type.as_str() {
            "llama" => Ok(Family::Llama),
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" => Ok(Family::Qwen3),
            other => Err(NetworkError::Config(format!(
                "drafters for `{other}` targets are not supported (llama, qwen2 and qwen3 are)"
            ))),
        }
    }

    /// Checks every size and count before anything is allocated from them: a damaged or
    /// hand-edited config must be an error, not a 360 GB allocation or a division by zero.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| {
            Err(NetworkError::Config(format!(
                "{what}; the drafter's config.json is damaged — make a new one with `dspark init-drafter`"
            )))
        };
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("draft_vocab_size", self.draft_vocab()),
        ] {
            if v == 0 || v > MAX_DIM {
                return bad(format!("{name} is {v} (must be between 1 and {MAX_DIM})"));
            }
        }
        if self.num_hidden_layers > MAX_LAYERS {
            return bad(format!("num_hidden_layers is {} (at most {MAX_LAYERS})", self.num_hidden_layers));
        }
        if self.block_size == 0 || self.block_size > MAX_BLOCK || self.gamma() == 0 {
            return bad(format!(
                "block_size is {} (a block drafts between 1 and {MAX_BLOCK} tokens)",
                self.block_size
            ));
        }
        if self.markov_rank > MAX_DIM {
            return bad(format!("markov_rank is {} (at most {MAX_DIM})", self.markov_rank));
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return bad(format!(
                "{} attention heads cannot share {} key/value heads",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} is odd (rotary embeddings rotate pairs)", self.head_dim));
        }
        if self.draft_vocab() > self.vocab_size {
            return bad(format!(
                "draft_vocab_size {} exceeds vocab_size {}",
                self.draft_vocab(),
                self.vocab_size
            ));
        }
        if (self.target_layer_ids.is_empty() && !self.taps_from_target)
            || self.target_layer_ids.len() > MAX_LAYERS
        {
            return bad(format!("target_layer_ids has {} entries", self.target_layer_ids.len()));
        }
        if let Some(m) = self.mask_token_id.filter(|&m| m as usize >= self.vocab_size) {
            return bad(format!("mask_token_id {m} is outside the vocabulary of {}", self.vocab_size));
        }
        let sane = self.rms_norm_eps.is_finite()
            && self.rms_norm_eps >= 0.0
            && self.rope_theta.is_finite()
            && self.rope_theta > 0.0;
        if !sane {
            return bad(format!(
                "rms_norm_eps {} or rope_theta {} is not a positive finite number",
                self.rms_norm_eps, self.rope_theta
            ));
        }
        if let Some(t) = self.ext().calibration_temperatures {
            if t.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
                return bad(format!("calibration_temperatures {t:?} are not all positive and finite"));
            }
        }
        if let Some(b) = self.ext().calibration_biases {
            if b.iter().any(|x| !x.is_finite()) {
                return bad(format!("calibration_biases {b:?} are not all finite numbers"));
            }
        }
        Ok(())
    }

    /// The names tensor `canonical` (as our saver writes it) may have in this checkpoint's file,
    /// in order of preference: DeepSpec's EAGLE-3 layer is `layers.0.*` where ours and
    /// SafeAILab's is `midlayer.*`, and our checkpoints saved before we adopted DeepSpec's
    /// names call the sequential head's tensors `markov_head.markov_w1` / `rnn_head.*`.
    pub fn file_names(&self, canonical: &str) -> Vec<String> {
        let mut v = Vec::with_capacity(2);
        match self.format {
            Format::DeepSpec if self.ext().method == Method::Eagle3 => v.push(
                canonical
                    .strip_prefix("midlayer.")
                    .map_or(canonical.to_string(), |r| format!("layers.0.{r}")),
            ),
            Format::Dspark => {
                v.push(canonical.to_string());
                let rnn = self.ext().head == Some(HeadKind::Rnn);
                let legacy = match canonical {
                    "markov_head.markov_w1.weight" if rnn => Some("rnn_head.rnn_w1"),
                    "markov_head.markov_w1.weight" => Some("markov_head.markov_w1"),
                    "markov_head.markov_w2.weight" if rnn => Some("rnn_head.rnn_w2"),
                    "markov_head.markov_w2.weight" => Some("markov_head.markov_w2"),
                    "markov_head.joint_proj.weight" => Some("rnn_head.cell.weight"),
                    "markov_head.joint_proj.bias" => Some("rnn_head.cell.bias"),
                    _ => None,
                };
                v.extend(legacy.map(String::from));
            }
            _ => v.push(canonical.to_string()),
        }
        v
    }

    /// Fills in target layers fixed by the drafter's code rather than its config.
    pub fn resolve_taps(&mut self, n_layers: usize) -> Result<()> {
        if !self.taps_from_target {
            return Ok(());
        }
        // SafeAILab: the inputs of decoder layers 2, L//2 and L−3 = outputs of 1, L//2−1, L−4.
        let inputs = [2, n_layers / 2, n_layers.saturating_sub(3)];
        if n_layers < 6 || inputs[1] == inputs[2] {
            return Err(NetworkError::WrongTarget(format!(
                "a SafeAILab EAGLE-3 drafter reads the inputs of target layers 2, L/2 and L−3, \
                 which are not three distinct layers of a {n_layers}-layer target"
            )));
        }
        self.target_layer_ids = inputs.iter().map(|&i| i - 1).collect();
        self.taps_from_target = false;
        Ok(())
    }

    /// Refuses a drafter made for another target, naming what differs.
    pub fn check_target(&self, target: &Model, id: &TargetId) -> Result<()> {
        let c = &target.config;
        let mut bad = Vec::new();
        if self.hidden_size != c.hidden {
            bad.push(format!("hidden size {} vs the target's {}", self.hidden_size, c.hidden));
        }
        if self.vocab_size != c.vocab_size {
            bad.push(format!("vocabulary {} vs the target's {}", self.vocab_size, c.vocab_size));
        }
        if let Some(&l) =
            self.target_layer_ids.iter().find(|&&l| l >= c.n_layers && l != dspark_model::EMBEDDING_TAP)
        {
            bad.push(format!("target layer {l} but the target has {} layers", c.n_layers));
        }
        // Public configs count Hugging Face's hidden_states, whose last entry is the final
        // norm's output, not the last layer's: their code refuses that id and so do we.
        if self.format != Format::Dspark && self.target_layer_ids.contains(&(c.n_layers - 1)) {
            bad.push(format!(
                "target layer {} (the final norm's output in this checkpoint's convention, refused by its own code)",
                c.n_layers - 1
            ));
        }
        if let Some(n) = self.num_target_layers.filter(|&n| n != c.n_layers) {
            bad.push(format!("num_target_layers {n} but the target has {} layers", c.n_layers));
        }
        // Drafters made by `init-drafter` build their layers like the target's; a public
        // checkpoint's model_type (kept when we save it) is its own layer recipe (SafeAILab's
        // are `llama` whatever the target).
        let ours = self.format == Format::Dspark && self.ext().target.is_some();
        if ours && self.model_type != family_name(c.family) {
            bad.push(format!("family {} vs the target's {}", self.model_type, family_name(c.family)));
        }
        if let Some(want) = &self.ext().target {
            if want.tokenizer_sha256 != id.tokenizer_sha256 {
                bad.push("a different tokenizer".to_string());
            }
            if want.num_layers != id.num_layers {
                bad.push(format!("{} target layers vs {}", want.num_layers, id.num_layers));
            }
        }
        if bad.is_empty() {
            return Ok(());
        }
        let made_for = self.ext().target.map(|t| format!(" (made for `{}`)", t.name)).unwrap_or_default();
        Err(NetworkError::WrongTarget(format!(
            "this drafter{made_for} does not fit target `{}`: {}; use a drafter built for this target \
             (`dspark init-drafter --target {}` or train one)",
            id.name,
            bad.join(", "),
            id.name
        )))
    }
}
