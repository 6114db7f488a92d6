//! Llama (SmolLM2). Pre-norm decoder, grouped-query attention with RoPE, SwiGLU MLP.
//! Qwen2 (QKV biases) and Qwen3 (per-head q/k RMSNorm) are this block with those parts present;
//! see `qwen2.rs` and `qwen3.rs`.

use crate::batch::Batch;
use crate::config::Config;
use crate::ops::{add_bias, add_inplace, gated, linear, rms_norm, rms_norm_to};
use crate::weights::Weights;
use crate::{Result, Taps};
use dspark_kernels::QLinear;

pub(crate) struct Layer {
    attn_norm: Vec<f32>,
    q: QLinear,
    k: QLinear,
    v: QLinear,
    o: QLinear,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    gate: QLinear,
    up: QLinear,
    down: QLinear,
}

pub struct Llama {
    cfg: Config,
    pub(crate) embed: QLinear,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    pub(crate) lm_head: Option<QLinear>,
}

impl Llama {
    pub fn load(cfg: &Config, w: &Weights) -> Result<Self> {
        // Layers load in parallel: reading, checking and repacking (or requantizing) each matrix
        // is CPU work that one thread would do alone.
        let layers = crate::load_layers(cfg.n_layers, |i| {
            let n = |s: &str| format!("blk.{i}.{s}");
            Ok(Layer {
                attn_norm: w.vector(&n("attn_norm.weight"))?,
                q: w.linear(&n("attn_q.weight"))?,
                k: w.linear(&n("attn_k.weight"))?,
                v: w.linear(&n("attn_v.weight"))?,
                o: w.linear(&n("attn_output.weight"))?,
                q_bias: w.optional_vector(&n("attn_q.bias"))?,
                k_bias: w.optional_vector(&n("attn_k.bias"))?,
                v_bias: w.optional_vector(&n("attn_v.bias"))?,
                q_norm: w.optional_vector(&n("attn_q_norm.weight"))?,
                k_norm: w.optional_vector(&n("attn_k_norm.weight"))?,
                ffn_norm: w.vector(&n("ffn_norm.weight"))?,
                gate: w.linear(&n("ffn_gate.weight"))?,
                up: w.linear(&n("ffn_up.weight"))?,
                down: w.linear(&n("ffn_down.weight"))?,
            })
        })?;
        let lm_head = if w.has("output.weight") { Some(w.linear("output.weight")?) } else { None };
        Ok(Self {
            cfg: cfg.clone(),
            embed: w.linear("token_embd.weight")?,
            layers,
            norm: w.vector("output_norm.weight")?,
            lm_head,
        })
    }

    /// Runs every layer over the batch's rows; returns the final-norm output of all rows.
    pub(crate) fn forward(&self, batch: &mut Batch, taps: &mut Taps) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (d, hd, t) = (c.hidden, c.head_dim, batch.rows);
        let mut x = Vec::with_capacity(t * d);
        for tok in batch.tokens() {
            x.extend(self.embed.row(tok as usize)?);
        }
        taps.record(crate::EMBEDDING_TAP, &x, d);
        let rope = batch.rope(hd, c.rope_theta, c.rope_interleaved);
        for (i, l) in self.layers.iter().enumerate() {
            let h = rms_norm_to(&x, &l.attn_norm, c.rms_eps, false);
            let mut q = linear(&l.q, &h, t)?;
            let mut k = linear(&l.k, &h, t)?;
            let mut v = linear(&l.v, &h, t)?;
            add_bias(&mut q, l.q_bias.as_ref());
            add_bias(&mut k, l.k_bias.as_ref());
            add_bias(&mut v, l.v_bias.as_ref());
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                rms_norm(&mut q, qn, c.rms_eps, false);
                rms_norm(&mut k, kn, c.rms_eps, false);
            }
            rope.apply(&mut q, c.n_heads);
            rope.apply(&mut k, c.n_kv_heads);
            let a = batch.attention(i, &q, &k, &v, c.n_heads, c.n_kv_heads, hd, c.attn_scale, None);
            add_inplace(&mut x, &linear(&l.o, &a, t)?);

            let h = rms_norm_to(&x, &l.ffn_norm, c.rms_eps, false);
            let mut g = linear(&l.gate, &h, t)?;
            gated(&mut g, &linear(&l.up, &h, t)?, false);
            add_inplace(&mut x, &linear(&l.down, &g, t)?);
            taps.record(i, &x, d);
        }
        rms_norm(&mut x, &self.norm, c.rms_eps, false);
        Ok(x)
    }
}
