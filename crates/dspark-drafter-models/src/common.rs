//! Pieces every drafter network shares: decoder layers of the target's family, the draft
//! vocabulary and LM head, and the target's embedding.

use crate::config::DrafterConfig;
use crate::nn::{Attention, Linear, Mlp};
use crate::store::{Init, Initializer, Store};
use crate::{NetworkError, Result};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use dspark_kernels::QLinear;
use dspark_model::{Family, Model};
use std::sync::Arc;

/// One tensor of a fresh checkpoint: name, shape and how it starts.
pub type Spec = (String, Vec<usize>, Init);

/// A pre-norm decoder layer (attention + SwiGLU) of the target's family.
#[derive(Clone, Debug)]
pub struct DecoderLayer {
    pub attn: Attention,
    pub input_norm: Tensor,
    pub post_attention_norm: Tensor,
    pub mlp: Mlp,
    pub eps: f64,
}

/// Tensors of a decoder layer under `p` whose attention reads `attn_in` features.
pub fn layer_specs(p: &str, c: &DrafterConfig, attn_in: usize, std: f32) -> Result<Vec<Spec>> {
    let (d, hd) = (c.hidden_size, c.head_dim);
    let (q, kv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let r = Init::Random(std);
    let mut s: Vec<Spec> = vec![
        (format!("{p}input_layernorm.weight"), vec![d], Init::Ones),
        (format!("{p}self_attn.q_proj.weight"), vec![q, attn_in], r),
        (format!("{p}self_attn.k_proj.weight"), vec![kv, attn_in], r),
        (format!("{p}self_attn.v_proj.weight"), vec![kv, attn_in], r),
        (format!("{p}self_attn.o_proj.weight"), vec![d, q], r),
        (format!("{p}post_attention_layernorm.weight"), vec![d], Init::Ones),
        (format!("{p}mlp.gate_proj.weight"), vec![c.intermediate_size, d], r),
        (format!("{p}mlp.up_proj.weight"), vec![c.intermediate_size, d], r),
        (format!("{p}mlp.down_proj.weight"), vec![d, c.intermediate_size], r),
    ];
    if c.attention_bias {
        s.push((format!("{p}self_attn.q_proj.bias"), vec![q], r));
        s.push((format!("{p}self_attn.k_proj.bias"), vec![kv], r));
        s.push((format!("{p}self_attn.v_proj.bias"), vec![kv], r));
        if c.family()? != Family::Qwen2 {
            s.push((format!("{p}self_attn.o_proj.bias"), vec![d], r));
        }
    }
    if c.family()? == Family::Qwen3 {
        s.push((format!("{p}self_attn.q_norm.weight"), vec![hd], Init::Ones));
        s.push((format!("{p}self_attn.k_norm.weight"), vec![hd], Init::Ones));
    }
    Ok(s)
}

pub fn init_all(init: &mut Initializer, specs: Vec<Spec>) -> Result<()> {
    for (name, shape, how) in specs {
        init.put(&name, &shape, how)?;
    }
    Ok(())
}

impl DecoderLayer {
    pub fn quantize(&mut self, format: GgmlDType) -> Result<()> {
        let a = &mut self.attn;
        for l in
            [&mut a.q, &mut a.k, &mut a.v, &mut a.o, &mut self.mlp.gate, &mut self.mlp.up, &mut self.mlp.down]
        {
            l.quantize(format)?;
        }
        Ok(())
    }

    pub fn load(s: &Store, p: &str, c: &DrafterConfig, attn_in: usize) -> Result<Self> {
        let (d, hd) = (c.hidden_size, c.head_dim);
        let (q, kv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        // Llama and Qwen3 attention with `attention_bias` also biases the output projection;
        // Qwen2 biases only q/k/v.
        let qwen2 = c.family()? == Family::Qwen2;
        let lin = |name: &str, out: usize, inp: usize| -> Result<Linear> {
            let o_proj = name.ends_with("o_proj");
            let bias = if c.attention_bias && name.contains("self_attn") && !(o_proj && qwen2) {
                Some(s.get(&format!("{p}{name}.bias"), &[out])?)
            } else {
                None
            };
            Ok(Linear::new(s.get(&format!("{p}{name}.weight"), &[out, inp])?, bias))
        };
        let qwen3 = c.family()? == Family::Qwen3;
        let norm = |name: &str| s.get(&format!("{p}self_attn.{name}.weight"), &[hd]);
        Ok(Self {
            attn: Attention {
                q: lin("self_attn.q_proj", q, attn_in)?,
                k: lin("self_attn.k_proj", kv, attn_in)?,
                v: lin("self_attn.v_proj", kv, attn_in)?,
                o: lin("self_attn.o_proj", d, q)?,
                q_norm: if qwen3 { Some(norm("q_norm")?) } else { None },
                k_norm: if qwen3 { Some(norm("k_norm")?) } else { None },
                n_heads: c.num_attention_heads,
                n_kv_heads: c.num_key_value_heads,
                head_dim: hd,
                eps: c.rms_norm_eps,
            },
            input_norm: s.get(&format!("{p}input_layernorm.weight"), &[d])?,
            post_attention_norm: s.get(&format!("{p}post_attention_layernorm.weight"), &[d])?,
            mlp: Mlp {
                gate: lin("mlp.gate_proj", c.intermediate_size, d)?,
                up: lin("mlp.up_proj", c.intermediate_size, d)?,
                down: lin("mlp.down_proj", d, c.intermediate_size)?,
            },
            eps: c.rms_norm_eps,
        })
    }
}

/// The draft vocabulary: the full target vocabulary, or `V_d` target ids (EAGLE-3's `d2t`).
#[derive(Clone, Debug)]
pub struct DraftVocab {
    d2t: Option<Vec<u32>>,
    full: usize,
}

impl DraftVocab {
    pub fn new(d2t: Option<Vec<u32>>, full: usize) -> Result<Self> {
        if let Some(ids) = &d2t {
            let mut seen = vec![false; full];
            for &t in ids {
                if t as usize >= full || std::mem::replace(&mut seen[t as usize], true) {
                    return Err(NetworkError::Checkpoint(format!(
                        "d2t maps to token {t}, which is outside the target's {full} tokens or repeated"
                    )));
                }
            }
        }
        Ok(Self { d2t, full })
    }

    /// From a checkpoint's `d2t` tensor (offsets: target id = draft id + d2t[draft id]).
    pub fn load(s: &Store, c: &DrafterConfig) -> Result<Self> {
        let Some(vd) = c.draft_vocab_size else {
            // SafeAILab keeps identity maps in a full-vocabulary checkpoint and its loader
            // drops them; so do we, once they are checked to be the identity.
            if c.format == crate::config::Format::SafeAiLab {
                let full = Self::new(Some((0..c.vocab_size as u32).collect()), c.vocab_size)?;
                if s.contains("d2t")
                    && Self::load_d2t(s, c.vocab_size, c.vocab_size)?.target_ids() != full.target_ids()
                {
                    return Err(NetworkError::Checkpoint(
                        "`d2t` of a full-vocabulary checkpoint is not the identity; set draft_vocab_size or fix the file".into(),
                    ));
                }
                full.check_t2d(s)?;
            }
            return Self::new(None, c.vocab_size);
        };
        let v = Self::load_d2t(s, vd, c.vocab_size)?;
        v.check_t2d(s)?;
        Ok(v)
    }

    /// SafeAILab's `t2d` (target id → in the draft vocabulary) says nothing `d2t` does not; it
    /// must agree with it.
    fn check_t2d(&self, s: &Store) -> Result<()> {
        let Some(t) = s.raw("t2d") else { return Ok(()) };
        let flags = t.to_dtype(DType::U8)?.flatten_all()?.to_vec1::<u8>()?;
        let mut want = vec![0u8; self.full];
        for i in self.target_ids() {
            want[i as usize] = 1;
        }
        if flags.len() != self.full || flags.iter().map(|&f| u8::from(f != 0)).ne(want) {
            return Err(NetworkError::Checkpoint(format!(
                "`t2d` ({} entries) does not mark exactly the target ids of `d2t`; the checkpoint is inconsistent",
                flags.len()
            )));
        }
        Ok(())
    }

    fn load_d2t(s: &Store, vd: usize, full: usize) -> Result<Self> {
        let t = s.raw("d2t").ok_or_else(|| {
            NetworkError::Checkpoint(format!(
                "config has draft_vocab_size {vd} but the checkpoint lacks `d2t`"
            ))
        })?;
        if t.dims() != [vd] {
            return Err(NetworkError::Checkpoint(format!("`d2t` has shape {:?}, expected [{vd}]", t.dims())));
        }
        let off = t.to_dtype(DType::I64)?.to_vec1::<i64>()?;
        let ids =
            off.iter().enumerate().map(|(i, o)| u32::try_from(i as i64 + o).unwrap_or(u32::MAX)).collect();
        Self::new(Some(ids), full)
    }

    pub fn tensor(&self) -> Result<Option<Tensor>> {
        let Some(ids) = &self.d2t else { return Ok(None) };
        let off: Vec<i64> = ids.iter().enumerate().map(|(i, &t)| t as i64 - i as i64).collect();
        Ok(Some(Tensor::from_vec(off, ids.len(), &Device::Cpu)?))
    }

    pub fn len(&self) -> usize {
        self.d2t.as_ref().map_or(self.full, |d| d.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn full(&self) -> usize {
        self.full
    }

    pub fn ids(&self) -> Option<&[u32]> {
        self.d2t.as_deref()
    }

    /// The target id of every draft-vocabulary entry, in draft order.
    pub fn target_ids(&self) -> Vec<u32> {
        self.d2t.clone().unwrap_or_else(|| (0..self.full as u32).collect())
    }

    pub fn to_target(&self, i: usize) -> u32 {
        self.d2t.as_ref().map_or(i as u32, |d| d[i])
    }

    /// A distribution over the draft vocabulary as one over the whole target vocabulary (zero
    /// outside it), which is what verification needs to stay exact.
    pub fn scatter(&self, p: Vec<f64>) -> Vec<f64> {
        match &self.d2t {
            None => p,
            Some(ids) => {
                let mut full = vec![0f64; self.full];
                for (&t, q) in ids.iter().zip(p) {
                    full[t as usize] = q;
                }
                full
            }
        }
    }
}

/// Turns final hidden states into draft-vocabulary logits.
pub enum LmHead {
    /// The target's own (quantized) head over the full vocabulary.
    Target(Arc<Model>),
    /// The target's head rows of a reduced vocabulary, in the target's (quantized) format.
    Rows(QLinear),
    /// A dense `(V_d, hidden)` matrix: EAGLE-3's own head, or a full-precision head for training.
    Dense(Tensor),
}

impl LmHead {
    /// The target's head restricted to `vocab`.
    pub fn shared(target: &Arc<Model>, vocab: &DraftVocab) -> Result<Self> {
        Ok(match vocab.ids() {
            None => Self::Target(target.clone()),
            Some(ids) => Self::Rows(target.lm_head_subset(ids)?),
        })
    }

    /// A quantized copy of a dense head for drafting.
    pub fn quantize(&mut self, format: GgmlDType) -> Result<()> {
        if let Self::Dense(w) = self {
            if w.dim(1)? % 32 == 0 {
                let q = candle_core::quantized::QTensor::quantize(w, format)?;
                *self = Self::Rows(QLinear::from_qtensor(q, dspark_kernels::KernelChoice::from_env())?);
            }
        }
        Ok(())
    }

    /// `h`: `(n, hidden)` → `(n, V_d)`.
    pub fn logits(&self, h: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(w) => Ok(crate::nn::matmul_t(h, w)?),
            Self::Rows(q) => Ok(q.forward(&h.contiguous()?)?),
            Self::Target(m) => {
                let n = h.dim(0)?;
                let x = h.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
                let y = m.lm_head_logits(&x, n)?;
                Ok(Tensor::from_vec(y, (n, m.vocab_size()), &Device::Cpu)?)
            }
        }
    }
}

/// Where a drafter's token embeddings come from: its checkpoint's own `embed_tokens` (DeepSpec
/// ships a copy of the target's) or the target's.
#[derive(Clone)]
pub enum Embedding {
    Target(Arc<Model>),
    Own(Tensor),
}

impl Embedding {
    /// The checkpoint's `embed_tokens.weight` when it has one.
    pub fn load(s: &Store, c: &DrafterConfig, target: &Arc<Model>) -> Result<Self> {
        Ok(match s.opt("embed_tokens.weight", &[c.vocab_size, c.hidden_size])? {
            Some(t) => Self::Own(t),
            None => Self::Target(target.clone()),
        })
    }

    /// `(tokens.len(), hidden)`.
    pub fn rows(&self, tokens: &[u32]) -> Result<Tensor> {
        match self {
            Self::Target(m) => embed(m, tokens),
            Self::Own(w) => {
                if let Some(&t) = tokens.iter().find(|&&t| t as usize >= w.dim(0).unwrap_or(0)) {
                    return Err(NetworkError::Input(format!("token id {t} is outside the vocabulary")));
                }
                let ids = Tensor::from_slice(tokens, tokens.len(), &Device::Cpu)?;
                Ok(w.index_select(&ids, 0)?)
            }
        }
    }

    pub fn own(&self) -> Option<&Tensor> {
        match self {
            Self::Own(t) => Some(t),
            Self::Target(_) => None,
        }
    }
}

/// The target's embeddings of `tokens`, `(n, hidden)`.
pub fn embed(target: &Model, tokens: &[u32]) -> Result<Tensor> {
    let e = target.embed(tokens)?;
    Ok(Tensor::from_vec(e, (tokens.len(), target.config.hidden), &Device::Cpu)?)
}

/// Target features for `rows` committed positions, one `rows × hidden` slice per tapped layer,
/// concatenated per row: `(rows, m·hidden)`.
pub fn stack_taps(taps: &[Vec<f32>], rows: usize, d: usize, want: usize) -> Result<Tensor> {
    if taps.len() != want || taps.iter().any(|t| t.len() != rows * d) {
        return Err(NetworkError::Input(format!(
            "expected {want} tapped layers of {rows} × {d} values, got {} of sizes {:?}",
            taps.len(),
            taps.iter().map(|t| t.len()).collect::<Vec<_>>()
        )));
    }
    let parts: Vec<Tensor> = taps
        .iter()
        .map(|t| Tensor::from_slice(t, (rows, d), &Device::Cpu))
        .collect::<candle_core::Result<_>>()?;
    Ok(Tensor::cat(&parts, 1)?)
}

/// Appends `(k, v)` rows to an optional cache.
pub fn append_kv(slot: &mut Option<(Tensor, Tensor)>, k: Tensor, v: Tensor) -> Result<()> {
    *slot = Some(match slot.take() {
        None => (k, v),
        Some((k0, v0)) => (Tensor::cat(&[&k0, &k], 0)?, Tensor::cat(&[&v0, &v], 0)?),
    });
    Ok(())
}

/// Keys/values of the cache followed by new ones.
pub fn with_new(slot: &Option<(Tensor, Tensor)>, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
    Ok(match slot {
        None => (k.clone(), v.clone()),
        Some((k0, v0)) => (Tensor::cat(&[k0, k], 0)?, Tensor::cat(&[v0, v], 0)?),
    })
}
