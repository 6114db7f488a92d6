//! Tiny random models for tests in this and other crates (a Hugging Face directory or a GGUF file
//! written in code), so that tests never depend on which real weights happen to be installed.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
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

/// llama.cpp's converter reorders q/k rows of llama models so that RoPE rotates adjacent pairs.
fn permute_for_gguf(w: &Tensor, heads: usize) -> Tensor {
    let (out, inp) = w.dims2().unwrap();
    w.reshape((heads, 2, out / heads / 2, inp)).unwrap().transpose(1, 2).unwrap().reshape((out, inp)).unwrap()
}

fn gguf_name(hf: &str, gemma: bool) -> String {
    let s = hf.replace("model.embed_tokens", "token_embd").replace("model.norm", "output_norm");
    let s = s.replace("lm_head", "output").replace("model.layers.", "blk.");
    let pairs: &[(&str, &str)] = &[
        ("input_layernorm", "attn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("self_attn.q_norm", "attn_q_norm"),
        ("self_attn.k_norm", "attn_k_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
        ("pre_feedforward_layernorm", "ffn_norm"),
        ("post_feedforward_layernorm", "post_ffw_norm"),
    ];
    let mut s = s;
    for (a, b) in pairs {
        s = s.replace(a, b);
    }
    let post = if gemma { "post_attention_norm" } else { "ffn_norm" };
    s.replace("post_attention_layernorm", post)
}

pub type GgufMetadata = Vec<(String, Value)>;
pub type GgufTensors = Vec<(String, QTensor)>;

/// The metadata and tensors llama.cpp's converter would write for these weights: GGUF names,
/// llama q/k permuted, Gemma norms stored as 1 + w.
pub fn gguf_parts(t: &Tiny, w: &HashMap<String, Tensor>) -> (GgufMetadata, GgufTensors) {
    let gemma = t.family == "gemma3_text";
    let arch = if gemma { "gemma3" } else { t.family };
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (name, tensor) in w {
        let mut x = tensor.clone();
        if t.family == "llama" && name.ends_with("q_proj.weight") {
            x = permute_for_gguf(&x, t.heads);
        }
        if t.family == "llama" && name.ends_with("k_proj.weight") {
            x = permute_for_gguf(&x, t.kv_heads);
        }
        if gemma && name.ends_with("norm.weight") {
            x = (x + 1.0).unwrap();
        }
        tensors.push((gguf_name(name, gemma), QTensor::quantize(&x, GgmlDType::F32).unwrap()));
    }
    let u = |v: usize| Value::U32(v as u32);
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (format!("{arch}.block_count"), u(t.layers)),
        (format!("{arch}.context_length"), u(256)),
        (format!("{arch}.embedding_length"), u(t.hidden)),
        (format!("{arch}.feed_forward_length"), u(t.ffn)),
        (format!("{arch}.attention.head_count"), u(t.heads)),
        (format!("{arch}.attention.head_count_kv"), u(t.kv_heads)),
        (format!("{arch}.attention.key_length"), u(t.head_dim)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (format!("{arch}.rope.freq_base"), Value::F32(if gemma { 1_000_000.0 } else { 10000.0 })),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(vocab().into_iter().map(Value::String).collect())),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array((0..VOCAB).map(|i| Value::I32(if i >= 94 { 3 } else { 1 })).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(vec![Value::String("a b".into())])),
        ("tokenizer.ggml.bos_token_id".into(), u(94)),
        ("tokenizer.ggml.eos_token_id".into(), u(95)),
    ];
    if gemma {
        md.push((format!("{arch}.attention.sliding_window"), u(3)));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    (md, tensors)
}

pub fn write_gguf_parts(path: &Path, md: &[(String, Value)], tensors: &[(String, QTensor)]) {
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
}

/// Writes the weights as a GGUF file, the way llama.cpp's converter would.
pub fn write_gguf(path: &Path, t: &Tiny, w: &HashMap<String, Tensor>) {
    let (md, tensors) = gguf_parts(t, w);
    write_gguf_parts(path, &md, &tensors);
}
