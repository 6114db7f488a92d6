//! Target models for dspark: one file per family, a ragged batched forward that returns logits
//! and hidden states at chosen rows, and a KV cache that rolls back.
//!
//! ```text
//! forward([seq₀: new tokens @ its positions, seq₁: …]) → per sequence:
//!     logits at logit_rows, hidden states of the named layers (+ final norm) at tap_rows
//! ```

mod batch;
pub mod config;
mod gemma3;
mod kv;
mod llama;
pub mod ops;
mod qwen2;
mod qwen3;
#[doc(hidden)]
pub mod testing;
mod weights;

pub use batch::SeqInput;
pub use config::{Config, Family};
pub use kv::KvCache;
pub use weights::Weights;

use batch::Batch;
use candle_core::quantized::gguf_file;
use dspark_kernels::QLinear;
use dspark_tokenizer::{ChatTemplate, Tokenizer};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {msg}")]
    Io { path: String, msg: String },
    #[error("{0}")]
    Format(String),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("the sequence needs {needed} positions but the model's context is {context}; shorten the prompt or lower --max-tokens")]
    ContextExceeded { needed: usize, context: usize },
    #[error("the model produced {0}; its weights are probably corrupt — fetch the model again")]
    NonFinite(String),
    #[error("KV cache: {0}")]
    Cache(String),
    #[error("bad request: {0}")]
    Request(String),
    #[error(transparent)]
    Tokenizer(#[from] dspark_tokenizer::TokenizerError),
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
}

impl ModelError {
    pub(crate) fn io(path: &Path, e: impl std::fmt::Display) -> Self {
        Self::Io { path: path.display().to_string(), msg: e.to_string() }
    }
}

pub type Result<T> = std::result::Result<T, ModelError>;

/// `load(i)` for every layer `i`, on the compute pool's threads; the first error if any.
pub(crate) fn load_layers<L: Send>(n: usize, load: impl Fn(usize) -> Result<L> + Sync) -> Result<Vec<L>> {
    use rayon::prelude::*;
    pool().install(|| (0..n).into_par_iter().map(&load).collect())
}

/// The compute pool, one thread per core (`DSPARK_THREADS` overrides).
pub fn pool() -> &'static rayon::ThreadPool {
    static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::env::var("DSPARK_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("dspark-compute-{i}"))
            .build()
            .expect("thread pool")
    })
}

/// The layer id in [`TapSpec::layers`] that names the embedding output (the input of layer 0,
/// after any family scaling): Hugging Face's `hidden_states[0]`, which DeepSpec drafters read as
/// target layer `-1`.
pub const EMBEDDING_TAP: usize = usize::MAX;

/// Which hidden states a forward call should return.
#[derive(Debug, Clone, Default)]
pub struct TapSpec {
    /// Decoder layers (0-based) whose outputs, before the final norm, are wanted
    /// ([`EMBEDDING_TAP`] for the embedding output).
    pub layers: Vec<usize>,
    /// Also return the final-norm output (the LM head's input).
    pub final_norm: bool,
}

/// Collects the requested layers' outputs at the requested rows while the layers run.
pub(crate) struct Taps {
    layers: Vec<usize>,
    /// Global row indices (into the stacked batch) to copy.
    rows: Vec<usize>,
    data: Vec<Vec<f32>>,
}

impl Taps {
    fn new(layers: &[usize], rows: Vec<usize>) -> Self {
        Self { layers: layers.to_vec(), rows, data: vec![Vec::new(); layers.len()] }
    }

    pub(crate) fn record(&mut self, layer: usize, x: &[f32], d: usize) {
        for (slot, &l) in self.layers.iter().enumerate() {
            if l == layer {
                for &r in &self.rows {
                    self.data[slot].extend_from_slice(&x[r * d..(r + 1) * d]);
                }
            }
        }
    }
}

/// One sequence's results, rows in the order the caller listed them.
#[derive(Debug, Clone, Default)]
pub struct SeqOutput {
    /// `logit_rows.len() × vocab`.
    pub logits: Vec<f32>,
    /// Per requested layer: `tap_rows.len() × hidden`.
    pub taps: Vec<Vec<f32>>,
    /// Final-norm output at `tap_rows` when asked for.
    pub final_norm: Option<Vec<f32>>,
}

impl SeqOutput {
    pub fn logits_row(&self, i: usize, vocab: usize) -> &[f32] {
        &self.logits[i * vocab..(i + 1) * vocab]
    }
}

/// The model's chat template, with its BOS and EOS token texts.
fn template(src: &str, tokenizer: &Tokenizer) -> Result<ChatTemplate> {
    let text = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or_default();
    Ok(ChatTemplate::new(src, &text(tokenizer.bos()), &text(tokenizer.eos().first().copied()))?)
}

/// Opens a model file, refusing what is not a regular file (a FIFO would block the read
/// forever, a device would stream without end).
fn open_regular(path: &Path) -> Result<std::fs::File> {
    let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    if !meta.is_file() {
        return Err(ModelError::Format(format!(
            "{} is not a regular file; give a .gguf file or a model directory",
            path.display()
        )));
    }
    std::fs::File::open(path).map_err(|e| ModelError::io(path, e))
}

/// Every tensor the model reads has the shape the config implies, so that the forward pass never
/// indexes past a weight (and a config that claims 10⁹ layers fails at the first missing one).
fn check_shapes(c: &Config, w: &Weights) -> Result<()> {
    let (d, q, kv) = (c.hidden, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let check = |name: &str, want: &[usize], required: bool| -> Result<()> {
        match w.shape(name) {
            None if required => {
                Err(ModelError::Format(format!("the model file lacks tensor `{name}`; fetch it again")))
            }
            None => Ok(()),
            Some(got) => {
                let ok = if want.len() == 1 {
                    got.iter().product::<usize>() == want[0] && got.iter().filter(|&&x| x != 1).count() <= 1
                } else {
                    got == want
                };
                if ok {
                    Ok(())
                } else {
                    Err(ModelError::Format(format!(
                        "tensor `{name}` has shape {got:?} but the model's config implies {want:?}; the file is \
                         damaged or its metadata does not match its weights"
                    )))
                }
            }
        }
    };
    check("token_embd.weight", &[c.vocab_size, d], true)?;
    check("output.weight", &[c.vocab_size, d], false)?;
    check("output_norm.weight", &[d], true)?;
    let gemma = c.family == Family::Gemma3;
    for i in 0..c.n_layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        for (s, want) in [
            ("attn_norm.weight", vec![d]),
            ("attn_q.weight", vec![q, d]),
            ("attn_k.weight", vec![kv, d]),
            ("attn_v.weight", vec![kv, d]),
            ("attn_output.weight", vec![d, q]),
            ("ffn_norm.weight", vec![d]),
            ("ffn_gate.weight", vec![c.intermediate, d]),
            ("ffn_up.weight", vec![c.intermediate, d]),
            ("ffn_down.weight", vec![d, c.intermediate]),
        ] {
            check(&n(s), &want, true)?;
        }
        for (s, want) in [
            ("attn_q.bias", q),
            ("attn_k.bias", kv),
            ("attn_v.bias", kv),
            ("attn_q_norm.weight", c.head_dim),
            ("attn_k_norm.weight", c.head_dim),
            ("post_attention_norm.weight", d),
            ("post_ffw_norm.weight", d),
        ] {
            check(&n(s), &[want], gemma && !s.contains("bias"))?;
        }
    }
    Ok(())
}

enum Arch {
    Llama(llama::Llama),
    Gemma3(gemma3::Gemma3),
}

/// A loaded target: weights, tokenizer and chat template.
pub struct Model {
    pub config: Config,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    arch: Arch,
}

impl Model {
    /// Loads a `.gguf` file or a Hugging Face directory (`config.json`, safetensors,
    /// `tokenizer.json`).
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_with(path, None)
    }

    /// [`Model::load`] with every matrix requantized to `format` (`Q4_0`, `Q8_0`): for a draft
    /// model, whose every drafted token reads all its weights. A row that is not whole blocks
    /// of `format` keeps the file's format. Outputs differ from the file's by the rounding.
    pub fn load_requantized(path: &Path, format: candle_core::quantized::GgmlDType) -> Result<Self> {
        Self::load_with(path, Some(format))
    }

    fn load_with(path: &Path, requant: Option<candle_core::quantized::GgmlDType>) -> Result<Self> {
        if path.is_dir() {
            Self::load_hf_with(path, requant)
        } else {
            Self::load_gguf_with(path, requant)
        }
    }

    pub fn load_gguf(path: &Path) -> Result<Self> {
        Self::load_gguf_with(path, None)
    }

    fn load_gguf_with(path: &Path, requant: Option<candle_core::quantized::GgmlDType>) -> Result<Self> {
        let mut f = open_regular(path)?;
        let not_gguf = |e: &dyn std::fmt::Display| {
            ModelError::Format(format!("{} is not a readable GGUF file: {e}", path.display()))
        };
        // The GGUF reader is a dependency: a header it does not expect must be an error here, not
        // a crash (it divides by `general.alignment`, for one).
        let content =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| gguf_file::Content::read(&mut f)))
                .map_err(|_| not_gguf(&"its header is malformed"))?
                .map_err(|e| not_gguf(&e))?;
        let file_len = f.metadata().map_err(|e| ModelError::io(path, e))?.len();
        let mut needed = 0u64;
        for (name, t) in &content.tensor_infos {
            let bad = |what: String| {
                ModelError::Format(format!(
                    "{}: tensor `{name}` {what}; the file is damaged — fetch it again",
                    path.display()
                ))
            };
            let dims = t.shape.dims();
            if dims.is_empty() || dims.contains(&0) {
                return Err(bad(format!("has an empty dimension ({dims:?})")));
            }
            let elems = dims
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
                .filter(|&n| n <= file_len.saturating_mul(8))
                .ok_or_else(|| bad(format!("has impossible dimensions {dims:?}")))?;
            let block = t.ggml_dtype.block_size() as u64;
            if !elems.is_multiple_of(block) || !(dims[dims.len() - 1] as u64).is_multiple_of(block) {
                return Err(bad(format!(
                    "has rows of {} values, not whole blocks of {block}",
                    dims[dims.len() - 1]
                )));
            }
            let end = (elems / block)
                .checked_mul(t.ggml_dtype.type_size() as u64)
                .and_then(|n| n.checked_add(t.offset))
                .and_then(|n| n.checked_add(content.tensor_data_offset))
                .ok_or_else(|| bad("lies past any file".into()))?;
            needed = needed.max(end);
        }
        if needed > file_len {
            return Err(ModelError::Format(format!(
                "{} is truncated: its tensors need {needed} bytes but the file has {file_len}; fetch it again",
                path.display()
            )));
        }
        let config = Config::from_gguf(&content)?;
        let tokenizer = Tokenizer::from_gguf(&content)?;
        let chat_template = match content.metadata.get("tokenizer.chat_template") {
            Some(v) => {
                Some(template(v.to_string().map_err(|e| ModelError::Format(e.to_string()))?, &tokenizer)?)
            }
            None => None,
        };
        let mut w = Weights::gguf(path, content);
        if let Some(format) = requant {
            w = w.requantized(format);
        }
        Self::build(config, tokenizer, chat_template, &w)
    }

    pub fn load_hf(dir: &Path) -> Result<Self> {
        Self::load_hf_with(dir, None)
    }

    fn load_hf_with(dir: &Path, requant: Option<candle_core::quantized::GgmlDType>) -> Result<Self> {
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read_to_string(&p).map_err(|e| ModelError::io(&p, e))
        };
        let cfg_text = read("config.json")?;
        let config = Config::from_hf_json(&cfg_text)?;
        let raw: serde_json::Value =
            serde_json::from_str(&cfg_text).map_err(|e| ModelError::Format(e.to_string()))?;
        let id = |k: &str| raw.get(k).and_then(|v| v.as_u64()).map(|v| v as u32);
        let eos: Vec<u32> = match raw.get("eos_token_id") {
            Some(serde_json::Value::Array(a)) => {
                a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32).collect()
            }
            _ => id("eos_token_id").into_iter().collect(),
        };
        let tok_cfg: Option<serde_json::Value> =
            read("tokenizer_config.json").ok().and_then(|t| serde_json::from_str(&t).ok());
        let add_bos = tok_cfg
            .as_ref()
            .and_then(|c| c.get("add_bos_token"))
            .and_then(|v| v.as_bool())
            .unwrap_or(config.family == Family::Gemma3);
        let tokenizer =
            Tokenizer::from_hf_file(&dir.join("tokenizer.json"), id("bos_token_id"), eos, add_bos)?;
        let chat_template =
            match tok_cfg.as_ref().and_then(|c| c.get("chat_template")).and_then(|v| v.as_str()) {
                Some(src) => Some(template(src, &tokenizer)?),
                None => None,
            };
        let mut w = Weights::hf(dir, config.family)?;
        if let Some(format) = requant {
            w = w.requantized(format);
        }
        Self::build(config, tokenizer, chat_template, &w)
    }

    fn build(
        config: Config,
        tokenizer: Tokenizer,
        chat_template: Option<ChatTemplate>,
        w: &Weights,
    ) -> Result<Self> {
        check_shapes(&config, w)?;
        let arch = match config.family {
            Family::Llama => Arch::Llama(llama::Llama::load(&config, w)?),
            Family::Qwen2 => Arch::Llama(qwen2::load(&config, w)?),
            Family::Qwen3 => Arch::Llama(qwen3::load(&config, w)?),
            Family::Gemma3 => Arch::Gemma3(gemma3::Gemma3::load(&config, w)?),
        };
        Ok(Self { config, tokenizer, chat_template, arch })
    }

    /// A KV cache for one sequence of up to `capacity` positions (capped by the context).
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        let c = &self.config;
        KvCache::new(c.n_layers, c.n_kv_heads, c.head_dim, capacity.min(c.context_length))
    }

    pub fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    /// The target's LM head over final-norm hidden states (`rows × hidden`); drafters share it.
    pub fn lm_head_logits(&self, hidden: &[f32], rows: usize) -> Result<Vec<f32>> {
        ops::linear(self.lm_head(), hidden, rows)
    }

    /// The target's token embeddings (`tokens.len() × hidden`, before any family scaling).
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let e = match &self.arch {
            Arch::Llama(m) => &m.embed,
            Arch::Gemma3(m) => &m.embed,
        };
        let mut x = Vec::with_capacity(tokens.len() * self.config.hidden);
        for &t in tokens {
            if t as usize >= self.config.vocab_size {
                return Err(ModelError::Request(format!("token id {t} is outside the vocabulary")));
            }
            x.extend(e.row(t as usize)?);
        }
        Ok(x)
    }

    /// The target's LM head restricted to `ids`, in its own format: a reduced draft vocabulary's
    /// head at the quantized kernels' cost.
    pub fn lm_head_subset(&self, ids: &[u32]) -> Result<QLinear> {
        let head = self.lm_head();
        if let Some(&i) = ids.iter().find(|&&i| i as usize >= head.out_dim()) {
            return Err(ModelError::Request(format!("token id {i} is outside the vocabulary")));
        }
        Ok(head.select_rows(&ids.iter().map(|&i| i as usize).collect::<Vec<_>>())?)
    }

    /// Rows of the target's LM head (`ids.len() × hidden`, f32): a reduced draft vocabulary's
    /// head is these rows.
    pub fn lm_head_rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let head = self.lm_head();
        let mut w = Vec::with_capacity(ids.len() * self.config.hidden);
        for &i in ids {
            if i as usize >= head.out_dim() {
                return Err(ModelError::Request(format!("token id {i} is outside the vocabulary")));
            }
            w.extend(head.row(i as usize)?);
        }
        Ok(w)
    }

    fn lm_head(&self) -> &QLinear {
        match &self.arch {
            Arch::Llama(m) => m.lm_head.as_ref().unwrap_or(&m.embed),
            Arch::Gemma3(m) => m.lm_head.as_ref().unwrap_or(&m.embed),
        }
    }

    /// One forward pass over several sequences. Each sequence's new tokens are appended to its
    /// cache (committed); roll back rejected ones with [`KvCache::truncate`].
    pub fn forward(&self, seqs: &mut [SeqInput], taps: &TapSpec) -> Result<Vec<SeqOutput>> {
        // The whole pass runs on the pool's threads: the caller's thread then takes part in every
        // parallel matmul instead of sleeping and being woken ~200 times per token.
        pool().install(|| self.forward_inner(seqs, taps))
    }

    fn forward_inner(&self, seqs: &mut [SeqInput], taps: &TapSpec) -> Result<Vec<SeqOutput>> {
        for s in seqs.iter() {
            if s.tokens.is_empty() {
                return Err(ModelError::Request("a sequence in the batch has no new tokens".into()));
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= self.config.vocab_size) {
                return Err(ModelError::Request(format!("token id {t} is outside the vocabulary")));
            }
            if s.logit_rows.iter().chain(&s.tap_rows).any(|&r| r >= s.tokens.len()) {
                return Err(ModelError::Request("a requested row is past the sequence's new tokens".into()));
            }
            s.cache.check_room(s.tokens.len(), self.config.context_length)?;
        }
        let mut batch = Batch::new(seqs);
        let tap_rows = batch.global_rows(|s| &s.tap_rows);
        let mut recorder = Taps::new(&taps.layers, tap_rows.clone());
        let hidden = match &self.arch {
            Arch::Llama(m) => m.forward(&mut batch, &mut recorder)?,
            Arch::Gemma3(m) => m.forward(&mut batch, &mut recorder)?,
        };
        let d = self.config.hidden;
        let logit_rows = batch.global_rows(|s| &s.logit_rows);
        let mut picked = Vec::with_capacity(logit_rows.len() * d);
        for &r in &logit_rows {
            picked.extend_from_slice(&hidden[r * d..(r + 1) * d]);
        }
        let logits = if logit_rows.is_empty() {
            Vec::new()
        } else {
            ops::linear(self.lm_head(), &picked, logit_rows.len())?
        };
        // NaN logits would otherwise be sampled as some token and printed as text.
        if let Some(i) = logits.iter().position(|x| !x.is_finite()) {
            return Err(ModelError::NonFinite(format!(
                "a non-finite logit ({}) at row {} of the batch",
                logits[i],
                i / self.config.vocab_size
            )));
        }
        let v = self.config.vocab_size;
        let mut outs = Vec::with_capacity(batch.seqs.len());
        let (mut lo, mut to) = (0, 0);
        for s in batch.seqs.iter_mut() {
            let (nl, nt) = (s.logit_rows.len(), s.tap_rows.len());
            let taps_out = recorder.data.iter().map(|buf| buf[to * d..(to + nt) * d].to_vec()).collect();
            let final_norm = taps.final_norm.then(|| {
                tap_rows[to..to + nt]
                    .iter()
                    .flat_map(|&r| hidden[r * d..(r + 1) * d].iter().copied())
                    .collect()
            });
            outs.push(SeqOutput {
                logits: logits[lo * v..(lo + nl) * v].to_vec(),
                taps: taps_out,
                final_norm,
            });
            s.cache.commit(s.tokens.len());
            lo += nl;
            to += nt;
        }
        Ok(outs)
    }

    /// The prompt ids of one user turn: see [`Self::encode_chat`].
    pub fn chat_tokens(&self, user: &str) -> Result<Vec<u32>> {
        self.encode_chat(&[dspark_tokenizer::ChatMessage::new("user", user)])
    }

    /// The prompt ids of a conversation through the chat template, the assistant's turn opened;
    /// models without a template get the contents joined by newlines. Message text is never
    /// parsed for special tokens: only the template's markup makes control tokens, so a message
    /// cannot forge another turn.
    pub fn encode_chat(&self, messages: &[dspark_tokenizer::ChatMessage]) -> Result<Vec<u32>> {
        match &self.chat_template {
            Some(t) => Ok(t.encode(&self.tokenizer, messages, true)?),
            None => {
                let text = messages.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n");
                Ok(self.tokenizer.encode(&text, false)?)
            }
        }
    }

    /// The prompt text for one user turn through the chat template (generation prompt opened),
    /// or the raw text for models without a template. For display: tokenize prompts with
    /// [`Self::chat_tokens`], which keeps special-token text in the message as text.
    pub fn chat_prompt(&self, user: &str) -> Result<String> {
        match &self.chat_template {
            Some(t) => Ok(t.render(&[dspark_tokenizer::ChatMessage::new("user", user)], true)?),
            None => Ok(user.to_string()),
        }
    }
}
