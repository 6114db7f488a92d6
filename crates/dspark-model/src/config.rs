//! Model hyper-parameters, read from GGUF metadata or a Hugging Face `config.json`.

use crate::{ModelError, Result};
use candle_core::quantized::gguf_file::Content;
use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Family {
    pub fn from_arch(arch: &str) -> Result<Self> {
        Ok(match arch {
            "llama" => Self::Llama,
            "qwen2" => Self::Qwen2,
            "qwen3" => Self::Qwen3,
            "gemma3" | "gemma3_text" => Self::Gemma3,
            other => {
                return Err(ModelError::Unsupported(format!(
                    "architecture `{other}`; dspark runs llama, qwen2, qwen3 and gemma3"
                )))
            }
        })
    }
}

/// The largest size or count a model may declare (2^24): far above any real model's, and small
/// enough that products of three never overflow.
pub const MAX_DIM: usize = 1 << 24;

#[derive(Debug, Clone)]
pub struct Config {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// RoPE base of sliding-window layers (Gemma 3).
    pub rope_theta_local: f32,
    /// Rotate adjacent pairs (llama.cpp's GGUF llama layout) instead of the two halves.
    pub rope_interleaved: bool,
    pub context_length: usize,
    /// Sliding-window size and "every n-th layer is global" pattern (Gemma 3).
    pub sliding_window: Option<usize>,
    pub sliding_pattern: usize,
    /// RMSNorm weights stored as `w - 1` (Hugging Face Gemma); GGUF already adds the one.
    pub norm_adds_one: bool,
    pub attn_scale: f32,
}

impl Config {
    pub fn is_sliding(&self, layer: usize) -> bool {
        self.sliding_window.is_some() && !(layer + 1).is_multiple_of(self.sliding_pattern)
    }

    pub fn from_gguf(content: &Content) -> Result<Self> {
        let md = &content.metadata;
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .ok_or_else(|| ModelError::Format("GGUF lacks `general.architecture`".into()))?
            .clone();
        let family = Family::from_arch(&arch)?;
        let get = |key: &str| -> Option<f64> {
            let v = md.get(&format!("{arch}.{key}"))?;
            v.to_u32()
                .map(|x| x as f64)
                .or_else(|_| v.to_u64().map(|x| x as f64))
                .or_else(|_| v.to_i32().map(|x| x as f64))
                .or_else(|_| v.to_f32().map(|x| x as f64))
                .or_else(|_| v.to_f64())
                .ok()
        };
        let need = |key: &str| -> Result<f64> {
            get(key).ok_or_else(|| ModelError::Format(format!("GGUF lacks `{arch}.{key}`")))
        };
        // Counts and sizes must be whole numbers in range before anything is derived from them.
        let as_count = |key: &str, v: f64| -> Result<usize> {
            if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v <= MAX_DIM as f64 {
                Ok(v as usize)
            } else {
                Err(ModelError::Format(format!(
                    "GGUF `{arch}.{key}` = {v} is not a valid size; the file is damaged or not a model \
                     (fetch it again)"
                )))
            }
        };
        let count = |key: &str| -> Result<usize> { as_count(key, need(key)?) };
        let count_or = |key: &str, default: usize| -> Result<usize> {
            get(key).map_or(Ok(default), |v| as_count(key, v))
        };
        let hidden = count("embedding_length")?;
        let n_heads = count("attention.head_count")?;
        if n_heads == 0 {
            return Err(ModelError::Format(format!(
                "GGUF `{arch}.attention.head_count` is 0; the file is damaged or not a model (fetch it again)"
            )));
        }
        let n_kv_heads = count_or("attention.head_count_kv", n_heads)?;
        let head_dim = count_or("attention.key_length", hidden / n_heads)?;
        let vocab_size = match get("vocab_size") {
            Some(v) => as_count("vocab_size", v)?,
            None => content
                .tensor_infos
                .get("token_embd.weight")
                .map(|t| t.shape.dims()[0])
                .ok_or_else(|| ModelError::Format("GGUF lacks token_embd.weight".into()))?,
        };
        let sliding_window =
            if family == Family::Gemma3 { Some(count_or("attention.sliding_window", 512)?) } else { None };
        let c = Self {
            family,
            vocab_size,
            hidden,
            intermediate: count("feed_forward_length")?,
            n_layers: count("block_count")?,
            n_heads,
            n_kv_heads,
            head_dim,
            rms_eps: get("attention.layer_norm_rms_epsilon").unwrap_or(1e-6) as f32,
            rope_theta: get("rope.freq_base").unwrap_or(10_000.0) as f32,
            rope_theta_local: 10_000.0,
            rope_interleaved: family == Family::Llama,
            context_length: count_or("context_length", 4096)?,
            sliding_window,
            sliding_pattern: 6,
            norm_adds_one: false,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
        };
        c.validate()?;
        Ok(c)
    }

    /// Checks every size and count before anything is allocated or indexed with them: a
    /// damaged file must be an error, not a division by zero, an out-of-bounds slice or an
    /// allocation of terabytes. (Tensor shapes are checked against these at load.)
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| {
            Err(ModelError::Format(format!(
                "{what}; the model file (or config.json) is damaged or not supported — fetch it again"
            )))
        };
        for (name, v) in [
            ("vocab size", self.vocab_size),
            ("hidden size", self.hidden),
            ("feed-forward size", self.intermediate),
            ("layer count", self.n_layers),
            ("attention head count", self.n_heads),
            ("key/value head count", self.n_kv_heads),
            ("head size", self.head_dim),
            ("context length", self.context_length),
            ("sliding-window pattern", self.sliding_pattern),
            ("sliding window", self.sliding_window.unwrap_or(1)),
        ] {
            if v == 0 || v > MAX_DIM {
                return bad(format!("the {name} is {v} (must be between 1 and {MAX_DIM})"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} attention heads cannot share {} key/value heads (the first must be a multiple of the second)",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("the head size {} is odd (rotary embeddings rotate pairs)", self.head_dim));
        }
        let finite_pos = |x: f32| x.is_finite() && x > 0.0;
        let sane = self.rms_eps.is_finite()
            && self.rms_eps >= 0.0
            && finite_pos(self.rope_theta)
            && finite_pos(self.rope_theta_local)
            && finite_pos(self.attn_scale);
        if !sane {
            return bad(format!(
                "norm epsilon {}, rope bases {}/{} or attention scale {} is not a positive finite number",
                self.rms_eps, self.rope_theta, self.rope_theta_local, self.attn_scale
            ));
        }
        Ok(())
    }

    pub fn from_hf_json(text: &str) -> Result<Self> {
        let c: HfConfig =
            serde_json::from_str(text).map_err(|e| ModelError::Format(format!("config.json: {e}")))?;
        let arch = match (&c.model_type, c.architectures.as_ref().and_then(|a| a.first())) {
            (Some(t), _) => t.clone(),
            (None, Some(a)) => a.to_lowercase().replace("forcausallm", ""),
            _ => return Err(ModelError::Format("config.json has no `model_type`".into())),
        };
        let family = Family::from_arch(&arch)?;
        if c.num_attention_heads == 0 {
            return Err(ModelError::Format(
                "config.json: num_attention_heads is 0; the model directory is damaged".into(),
            ));
        }
        let n_kv_heads = c.num_key_value_heads.unwrap_or(c.num_attention_heads);
        let head_dim = c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads);
        let is_gemma = family == Family::Gemma3;
        let attn_scale = match (is_gemma, c.query_pre_attn_scalar) {
            (true, Some(s)) => 1.0 / (s as f32).sqrt(),
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        let cfg = Self {
            family,
            vocab_size: c.vocab_size,
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            n_layers: c.num_hidden_layers,
            n_heads: c.num_attention_heads,
            n_kv_heads,
            head_dim,
            rms_eps: c.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta: c.rope_theta.unwrap_or(10_000.0) as f32,
            rope_theta_local: c.rope_local_base_freq.unwrap_or(10_000.0) as f32,
            rope_interleaved: false,
            context_length: c.max_position_embeddings.unwrap_or(4096),
            sliding_window: if is_gemma { Some(c.sliding_window.unwrap_or(512)) } else { None },
            sliding_pattern: c.sliding_window_pattern.unwrap_or(6),
            norm_adds_one: is_gemma,
            attn_scale,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_local_base_freq: Option<f64>,
    max_position_embeddings: Option<usize>,
    sliding_window: Option<usize>,
    sliding_window_pattern: Option<usize>,
    query_pre_attn_scalar: Option<usize>,
}
