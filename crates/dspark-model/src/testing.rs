//! Tiny random models for tests in this and other crates (a Hugging Face directory written in
//! code), so that tests never depend on which real weights happen to be installed.

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

pub const VOCAB: usize = 96;

pub struct Tiny {
    pub family: &'static str,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub layers: usize,
    pub ffn: usize,
}

pub fn config_json(t: &Tiny) -> serde_json::Value {
    let mut c = serde_json::json!({
        "model_type": t.family,
        "vocab_size": VOCAB,
        "hidden_size": t.hidden,
        "intermediate_size": t.ffn,
        "num_hidden_layers": t.layers,
        "num_attention_heads": t.heads,
        "num_key_value_heads": t.kv_heads,
        "head_dim": t.head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "bos_token_id": 94,
        "eos_token_id": 95,
    });
    if t.family == "gemma3_text" {
        // Six layers, window 3: layers 0–4 slide, layer 5 is global (Gemma 3's pattern).
        c["sliding_window"] = 3.into();
        c["sliding_window_pattern"] = 6.into();
        c["rope_local_base_freq"] = 10000.0.into();
        c["rope_theta"] = 1_000_000.0.into();
        c["query_pre_attn_scalar"] = t.head_dim.into();
    }
    c
}

pub fn weights(t: &Tiny, seed: u64) -> HashMap<String, Tensor> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut w = HashMap::new();
    let mut put = |name: String, shape: &[usize], scale: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-scale..scale)).collect();
        w.insert(name, Tensor::from_vec(v, shape, &Device::Cpu).unwrap());
    };
    let (d, q, kv) = (t.hidden, t.heads * t.head_dim, t.kv_heads * t.head_dim);
    put("model.embed_tokens.weight".into(), &[VOCAB, d], 1.0);
    put("model.norm.weight".into(), &[d], 1.0);
    for l in 0..t.layers {
        let p = format!("model.layers.{l}.");
        put(format!("{p}input_layernorm.weight"), &[d], 1.0);
        put(format!("{p}self_attn.q_proj.weight"), &[q, d], 0.3);
        put(format!("{p}self_attn.k_proj.weight"), &[kv, d], 0.3);
        put(format!("{p}self_attn.v_proj.weight"), &[kv, d], 0.3);
        put(format!("{p}self_attn.o_proj.weight"), &[d, q], 0.3);
        put(format!("{p}post_attention_layernorm.weight"), &[d], 1.0);
        put(format!("{p}mlp.gate_proj.weight"), &[t.ffn, d], 0.3);
        put(format!("{p}mlp.up_proj.weight"), &[t.ffn, d], 0.3);
        put(format!("{p}mlp.down_proj.weight"), &[d, t.ffn], 0.3);
        if t.family == "qwen2" {
            put(format!("{p}self_attn.q_proj.bias"), &[q], 0.5);
            put(format!("{p}self_attn.k_proj.bias"), &[kv], 0.5);
            put(format!("{p}self_attn.v_proj.bias"), &[kv], 0.5);
        }
        if t.family == "qwen3" || t.family == "gemma3_text" {
            put(format!("{p}self_attn.q_norm.weight"), &[t.head_dim], 1.0);
            put(format!("{p}self_attn.k_norm.weight"), &[t.head_dim], 1.0);
        }
        if t.family == "gemma3_text" {
            put(format!("{p}pre_feedforward_layernorm.weight"), &[d], 1.0);
            put(format!("{p}post_feedforward_layernorm.weight"), &[d], 1.0);
        }
    }
    if t.family == "qwen2" {
        put("lm_head.weight".into(), &[VOCAB, d], 0.3); // untied, like Qwen2.5-1.5B
    }
    w
}

pub fn vocab() -> Vec<String> {
    let mut v: Vec<String> = (33u8..=125).map(|c| (c as char).to_string()).collect();
    v.push("ab".into());
    v.push("<s>".into());
    v.push("</s>".into());
    v
}

pub fn write_hf(dir: &Path, t: &Tiny, w: &HashMap<String, Tensor>) {
    std::fs::write(dir.join("config.json"), config_json(t).to_string()).unwrap();
    candle_core::safetensors::save(w, dir.join("model.safetensors")).unwrap();
    let vocab: serde_json::Map<String, serde_json::Value> =
        vocab().into_iter().enumerate().map(|(i, s)| (s, i.into())).collect();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "!"}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
}
