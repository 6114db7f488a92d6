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
        let hidden = need("embedding_length")? as usize;
        let n_heads = need("attention.head_count")? as usize;
        let n_kv_heads = get("attention.head_count_kv").map(|x| x as usize).unwrap_or(n_heads);
        let head_dim = get("attention.key_length").map(|x| x as usize).unwrap_or(hidden / n_heads);
        let vocab_size = match get("vocab_size") {
            Some(v) => v as usize,
            None => content
                .tensor_infos
                .get("token_embd.weight")
                .map(|t| t.shape.dims()[0])
                .ok_or_else(|| ModelError::Format("GGUF lacks token_embd.weight".into()))?,
        };
        let sliding_window = if family == Family::Gemma3 {
            Some(get("attention.sliding_window").map(|x| x as usize).unwrap_or(512))
        } else {
            None
        };
        Ok(Self {
            family,
            vocab_size,
            hidden,
            intermediate: need("feed_forward_length")? as usize,
            n_layers: need("block_count")? as usize,
            n_heads,
            n_kv_heads,
            head_dim,
            rms_eps: get("attention.layer_norm_rms_epsilon").unwrap_or(1e-6) as f32,
            rope_theta: get("rope.freq_base").unwrap_or(10_000.0) as f32,
            rope_theta_local: 10_000.0,
            rope_interleaved: family == Family::Llama,
            context_length: get("context_length").map(|x| x as usize).unwrap_or(4096),
            sliding_window,
            sliding_pattern: 6,
            norm_adds_one: false,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
        })
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
        let n_kv_heads = c.num_key_value_heads.unwrap_or(c.num_attention_heads);
        let head_dim = c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads);
        let is_gemma = family == Family::Gemma3;
        let attn_scale = match (is_gemma, c.query_pre_attn_scalar) {
            (true, Some(s)) => 1.0 / (s as f32).sqrt(),
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        Ok(Self {
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
        })
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
