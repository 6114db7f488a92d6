//! Weight sources: a GGUF file or a Hugging Face directory, both addressed by GGUF tensor names.

use crate::config::Family;
use crate::{ModelError, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use dspark_kernels::{KernelChoice, QLinear};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

pub enum Weights {
    Gguf { path: PathBuf, content: Content, kernels: KernelChoice, requant: Option<GgmlDType> },
    Hf { tensors: HashMap<String, Tensor>, family: Family, requant: Option<GgmlDType> },
}

impl Weights {
    pub fn gguf(path: &Path, content: Content) -> Self {
        Self::Gguf { path: path.to_path_buf(), content, kernels: KernelChoice::from_env(), requant: None }
    }

    /// Every matrix read as `linear` is requantized to `format` (a draft model's weights: see
    /// [`crate::Model::load_requantized`]); norms and biases are untouched.
    pub fn requantized(mut self, format: GgmlDType) -> Self {
        match &mut self {
            Self::Gguf { requant, .. } | Self::Hf { requant, .. } => *requant = Some(format),
        }
        self
    }

    /// Reads every `*.safetensors` file of a Hugging Face model directory.
    pub fn hf(dir: &Path, family: Family) -> Result<Self> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| ModelError::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ModelError::Format(format!("{} has no .safetensors files", dir.display())));
        }
        let mut tensors = HashMap::new();
        for f in files {
            let loaded = candle_core::safetensors::load(&f, &Device::Cpu)
                .map_err(|e| ModelError::Format(format!("{}: {e}", f.display())))?;
            tensors.extend(loaded);
        }
        Ok(Self::Hf { tensors, family, requant: None })
    }

    fn hf_name(family: Family, gguf: &str) -> String {
        let tail = |s: &str| -> String {
            let (stem, kind) = s.rsplit_once('.').unwrap_or((s, "weight"));
            let mapped = match (family, stem) {
                (_, "attn_norm") => "input_layernorm",
                (_, "attn_q") => "self_attn.q_proj",
                (_, "attn_k") => "self_attn.k_proj",
                (_, "attn_v") => "self_attn.v_proj",
                (_, "attn_output") => "self_attn.o_proj",
                (_, "attn_q_norm") => "self_attn.q_norm",
                (_, "attn_k_norm") => "self_attn.k_norm",
                (Family::Gemma3, "ffn_norm") => "pre_feedforward_layernorm",
                (Family::Gemma3, "post_attention_norm") => "post_attention_layernorm",
                (Family::Gemma3, "post_ffw_norm") => "post_feedforward_layernorm",
                (_, "ffn_norm") => "post_attention_layernorm",
                (_, "ffn_gate") => "mlp.gate_proj",
                (_, "ffn_up") => "mlp.up_proj",
                (_, "ffn_down") => "mlp.down_proj",
                (_, other) => other,
            };
            format!("{mapped}.{kind}")
        };
        match gguf {
            "token_embd.weight" => "model.embed_tokens.weight".into(),
            "output_norm.weight" => "model.norm.weight".into(),
            "output.weight" => "lm_head.weight".into(),
            s if s.starts_with("blk.") => {
                let rest = &s[4..];
                let (layer, t) = rest.split_once('.').unwrap_or((rest, ""));
                format!("model.layers.{layer}.{}", tail(t))
            }
            s => s.into(),
        }
    }

    pub fn has(&self, name: &str) -> bool {
        match self {
            Self::Gguf { content, .. } => content.tensor_infos.contains_key(name),
            Self::Hf { tensors, family, .. } => tensors.contains_key(&Self::hf_name(*family, name)),
        }
    }

    /// A tensor's shape, rows first (`[out, in]` for a matrix), if the file has it.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self {
            Self::Gguf { content, .. } => content.tensor_infos.get(name).map(|t| t.shape.dims().to_vec()),
            Self::Hf { tensors, family, .. } => {
                tensors.get(&Self::hf_name(*family, name)).map(|t| t.dims().to_vec())
            }
        }
    }

    fn missing(name: &str) -> ModelError {
        ModelError::Format(format!("the model file lacks tensor `{name}`"))
    }

    pub fn linear(&self, name: &str) -> Result<QLinear> {
        match self {
            Self::Gguf { path, content, kernels, requant } => {
                if !content.tensor_infos.contains_key(name) {
                    return Err(Self::missing(name));
                }
                let mut f = File::open(path).map_err(|e| ModelError::io(path, e))?;
                let qt = content.tensor(&mut f, name, &Device::Cpu).map_err(|e| {
                    ModelError::Format(format!("tensor `{name}`: {e} (is the file truncated?)"))
                })?;
                check_raw(name, qt.dtype(), &qt.data()?)?;
                let qt = match requant {
                    Some(format) if qt.dtype() != *format => {
                        requantize(&qt.dequantize(&Device::Cpu)?, *format)?.unwrap_or(qt)
                    }
                    _ => qt,
                };
                Ok(QLinear::from_qtensor(qt, *kernels)?)
            }
            Self::Hf { tensors, family, requant } => {
                let t = tensors.get(&Self::hf_name(*family, name)).ok_or_else(|| Self::missing(name))?;
                check_values(name, &t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)?;
                match requant.map(|f| requantize(t, f)).transpose()?.flatten() {
                    Some(qt) => Ok(QLinear::from_qtensor(qt, KernelChoice::from_env())?),
                    None => Ok(QLinear::from_dense(t.clone())?),
                }
            }
        }
    }

    /// A 1-D tensor (norm weight, bias) as f32.
    pub fn vector(&self, name: &str) -> Result<Vec<f32>> {
        let t = match self {
            Self::Gguf { path, content, .. } => {
                if !content.tensor_infos.contains_key(name) {
                    return Err(Self::missing(name));
                }
                let mut f = File::open(path).map_err(|e| ModelError::io(path, e))?;
                content.tensor(&mut f, name, &Device::Cpu).and_then(|q| q.dequantize(&Device::Cpu)).map_err(
                    |e| ModelError::Format(format!("tensor `{name}`: {e} (is the file truncated?)")),
                )?
            }
            Self::Hf { tensors, family, .. } => {
                tensors.get(&Self::hf_name(*family, name)).ok_or_else(|| Self::missing(name))?.clone()
            }
        };
        let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        check_values(name, &v)?;
        Ok(v)
    }

    pub fn optional_vector(&self, name: &str) -> Result<Option<Vec<f32>>> {
        if self.has(name) {
            self.vector(name).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// `w` `(out, in)` in `format`, or `None` where its rows are not whole blocks of that format
/// (such a matrix keeps its own format).
fn requantize(w: &Tensor, format: GgmlDType) -> Result<Option<QTensor>> {
    let (_, k) = w.dims2()?;
    if !k.is_multiple_of(format.block_size()) {
        return Ok(None);
    }
    Ok(Some(QTensor::quantize(&w.to_dtype(DType::F32)?, format)?))
}

fn corrupt(name: &str, what: &str) -> ModelError {
    ModelError::Format(format!("tensor `{name}` holds {what}; the model file is corrupt — fetch it again"))
}

/// Norm weights and biases scale every activation: one NaN there poisons every token.
fn check_values(name: &str, v: &[f32]) -> Result<()> {
    match v.iter().find(|x| !x.is_finite()) {
        Some(x) => Err(corrupt(name, &x.to_string())),
        None => Ok(()),
    }
}

/// Checks a GGUF tensor's raw blocks before the kernels see them: every value of a float
/// tensor, and the f16 scales (and minimums) of each quantized block, whose payload bytes are
/// small integers that cannot be non-finite. Cheap: a few bytes per block of 32 or 256 values.
fn check_raw(name: &str, dtype: GgmlDType, data: &[u8]) -> Result<()> {
    let f16_bad = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]) & 0x7C00 == 0x7C00;
    let f32_bad = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7F80_0000 == 0x7F80_0000;
    let bf16_bad = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]) & 0x7F80 == 0x7F80;
    // (block bytes, offsets of f16 scale fields); f32 / f16 / bf16 tensors are all values.
    let (block, scales): (usize, &[usize]) = match dtype {
        GgmlDType::F32 => {
            return match data.chunks_exact(4).position(f32_bad) {
                Some(i) => Err(corrupt(name, &format!("a NaN or infinite value (element {i})"))),
                None => Ok(()),
            }
        }
        GgmlDType::F16 | GgmlDType::BF16 => {
            let bad = if dtype == GgmlDType::F16 { f16_bad } else { bf16_bad };
            return match data.chunks_exact(2).position(bad) {
                Some(i) => Err(corrupt(name, &format!("a NaN or infinite value (element {i})"))),
                None => Ok(()),
            };
        }
        GgmlDType::Q4_0 => (18, &[0]),
        GgmlDType::Q4_1 => (20, &[0, 2]),
        GgmlDType::Q5_0 => (22, &[0]),
        GgmlDType::Q5_1 => (24, &[0, 2]),
        GgmlDType::Q8_0 => (34, &[0]),
        GgmlDType::Q8_1 => (36, &[0, 2]),
        GgmlDType::Q2K => (84, &[80, 82]),
        GgmlDType::Q3K => (110, &[108]),
        GgmlDType::Q4K => (144, &[0, 2]),
        GgmlDType::Q5K => (176, &[0, 2]),
        GgmlDType::Q6K => (210, &[208]),
        GgmlDType::Q8K => {
            return match data.chunks_exact(292).position(|b| f32_bad(&b[..4])) {
                Some(i) => Err(corrupt(name, &format!("a NaN or infinite scale (block {i})"))),
                None => Ok(()),
            }
        }
        #[allow(unreachable_patterns)]
        _ => return Ok(()),
    };
    match data.chunks_exact(block).position(|b| scales.iter().any(|&o| f16_bad(&b[o..o + 2]))) {
        Some(i) => Err(corrupt(name, &format!("a NaN or infinite scale (block {i})"))),
        None => Ok(()),
    }
}
