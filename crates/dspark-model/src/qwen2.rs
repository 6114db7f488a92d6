//! Qwen2 / Qwen2.5: the llama block (see `llama.rs`) with biases on the q, k and v projections
//! and RoPE over the two halves of each head (set by the config, not the weights).

use crate::config::Config;
use crate::llama::Llama;
use crate::weights::Weights;
use crate::{ModelError, Result};

pub fn load(cfg: &Config, w: &Weights) -> Result<Llama> {
    if !w.has("blk.0.attn_q.bias") {
        return Err(ModelError::Format(
            "a qwen2 model must have q/k/v biases (blk.0.attn_q.bias is missing)".into(),
        ));
    }
    Llama::load(cfg, w)
}
