//! Qwen3: the llama block (see `llama.rs`) without biases, with an RMSNorm over each query and
//! key head before RoPE, and RoPE over the two halves of each head.

use crate::config::Config;
use crate::llama::Llama;
use crate::weights::Weights;
use crate::{ModelError, Result};

pub fn load(cfg: &Config, w: &Weights) -> Result<Llama> {
    if !w.has("blk.0.attn_q_norm.weight") || !w.has("blk.0.attn_k_norm.weight") {
        return Err(ModelError::Format(
            "a qwen3 model must have per-head q/k norms (blk.0.attn_q_norm.weight is missing)".into(),
        ));
    }
    Llama::load(cfg, w)
}
