//! Gemma 3. Differs from llama in: RMSNorm before and after both attention and MLP, per-head
//! q/k RMSNorm, embeddings scaled by √d, GeGLU (tanh GELU) MLP, and layers that alternate
//! between a sliding window (local RoPE base) and global attention (global RoPE base), one
//! global layer in every `sliding_pattern`. Hugging Face stores norm weights as `w − 1`;
//! llama.cpp's GGUF already adds the one (`Config::norm_adds_one`).

use crate::batch::Batch;
use crate::config::Config;
use crate::ops::{add_inplace, gated, linear, rms_norm, rms_norm_to};
use crate::weights::Weights;
use crate::{Result, Taps};
use dspark_kernels::QLinear;

struct Layer {
    attn_norm: Vec<f32>,
    q: QLinear,
    k: QLinear,
    v: QLinear,
    o: QLinear,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    gate: QLinear,
    up: QLinear,
    down: QLinear,
    post_ffn_norm: Vec<f32>,
}

pub struct Gemma3 {
    cfg: Config,
    pub(crate) embed: QLinear,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    pub(crate) lm_head: Option<QLinear>,
}

impl Gemma3 {
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
                q_norm: w.vector(&n("attn_q_norm.weight"))?,
                k_norm: w.vector(&n("attn_k_norm.weight"))?,
                post_attn_norm: w.vector(&n("post_attention_norm.weight"))?,
                ffn_norm: w.vector(&n("ffn_norm.weight"))?,
                gate: w.linear(&n("ffn_gate.weight"))?,
                up: w.linear(&n("ffn_up.weight"))?,
                down: w.linear(&n("ffn_down.weight"))?,
                post_ffn_norm: w.vector(&n("post_ffw_norm.weight"))?,
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

    pub(crate) fn forward(&self, batch: &mut Batch, taps: &mut Taps) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (d, hd, t, one) = (c.hidden, c.head_dim, batch.rows, c.norm_adds_one);
        let scale = (d as f32).sqrt();
        let mut x = Vec::with_capacity(t * d);
        for tok in batch.tokens() {
            x.extend(self.embed.row(tok as usize)?.into_iter().map(|v| v * scale));
        }
        taps.record(crate::EMBEDDING_TAP, &x, d);
        let rope_global = batch.rope(hd, c.rope_theta, false);
        let rope_local = batch.rope(hd, c.rope_theta_local, false);
        for (i, l) in self.layers.iter().enumerate() {
            let sliding = c.is_sliding(i);
            let h = rms_norm_to(&x, &l.attn_norm, c.rms_eps, one);
            let mut q = linear(&l.q, &h, t)?;
            let mut k = linear(&l.k, &h, t)?;
            let v = linear(&l.v, &h, t)?;
            rms_norm(&mut q, &l.q_norm, c.rms_eps, one);
            rms_norm(&mut k, &l.k_norm, c.rms_eps, one);
            let rope = if sliding { &rope_local } else { &rope_global };
            rope.apply(&mut q, c.n_heads);
            rope.apply(&mut k, c.n_kv_heads);
            let window = if sliding { c.sliding_window } else { None };
            let a = batch.attention(i, &q, &k, &v, c.n_heads, c.n_kv_heads, hd, c.attn_scale, window);
            let mut o = linear(&l.o, &a, t)?;
            rms_norm(&mut o, &l.post_attn_norm, c.rms_eps, one);
            add_inplace(&mut x, &o);

            let h = rms_norm_to(&x, &l.ffn_norm, c.rms_eps, one);
            let mut g = linear(&l.gate, &h, t)?;
            gated(&mut g, &linear(&l.up, &h, t)?, true);
            let mut m = linear(&l.down, &g, t)?;
            rms_norm(&mut m, &l.post_ffn_norm, c.rms_eps, one);
            add_inplace(&mut x, &m);
            taps.record(i, &x, d);
        }
        rms_norm(&mut x, &self.norm, c.rms_eps, one);
        Ok(x)
    }
}
