//! Tiny random models written by the test itself, for the families and formats no installable
//! weights cover (Qwen3, Hugging Face directories, GGUF written from HF weights), checked against
//! an independent pure-Python reference (`tests/reference/transformer.py`).

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Tensor;
use dspark_model::testing::{vocab, weights, write_hf, Tiny, VOCAB};
use dspark_model::{Model, SeqInput, TapSpec};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

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

/// Writes the same weights as llama.cpp's converter would: GGUF names, llama q/k permuted,
/// Gemma norms stored as 1 + w.
fn write_gguf(path: &Path, t: &Tiny, w: &HashMap<String, Tensor>) {
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
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
}

/// Logits at every position, fed as a prefill of 5 then a block of the rest (cache reuse).
fn ours(m: &Model, ids: &[u32]) -> Vec<f32> {
    let mut cache = m.new_cache(64);
    let mut out = m.forward(&mut [SeqInput::logits_all(&mut cache, &ids[..5])], &TapSpec::default()).unwrap();
    out.extend(m.forward(&mut [SeqInput::logits_all(&mut cache, &ids[5..])], &TapSpec::default()).unwrap());
    out.into_iter().flat_map(|o| o.logits).collect()
}

fn reference(dir: &Path, ids: &[u32]) -> Vec<f32> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/reference/transformer.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(dir)
        .arg(serde_json::to_string(ids).unwrap())
        .output()
        .expect("python3 must be installed to run the reference");
    assert!(out.status.success(), "reference failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32))
        .collect()
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len());
    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0f32, f32::max);
    assert!(worst < 1e-4, "{what}: worst relative difference {worst}");
}

fn check(t: Tiny) {
    let dir = tempfile::tempdir().unwrap();
    let w = weights(&t, 42);
    write_hf(dir.path(), &t, &w);
    let ids: Vec<u32> = vec![94, 3, 17, 60, 22, 8, 45, 71, 5, 33];
    let want = reference(dir.path(), &ids);
    let hf = Model::load(dir.path()).unwrap();
    assert_close(&ours(&hf, &ids), &want, &format!("{} from HF", t.family));
    let gguf = dir.path().join("model.gguf");
    write_gguf(&gguf, &t, &w);
    let g = Model::load(&gguf).unwrap();
    assert_close(&ours(&g, &ids), &want, &format!("{} from GGUF", t.family));
}

#[test]
fn llama_matches_reference_from_hf_and_gguf() {
    check(Tiny { family: "llama", hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, layers: 2, ffn: 96 });
}

#[test]
fn qwen2_matches_reference_from_hf_and_gguf() {
    check(Tiny { family: "qwen2", hidden: 64, heads: 4, kv_heads: 1, head_dim: 16, layers: 2, ffn: 96 });
}

#[test]
fn qwen3_matches_reference_from_hf_and_gguf() {
    check(Tiny { family: "qwen3", hidden: 64, heads: 4, kv_heads: 2, head_dim: 32, layers: 2, ffn: 96 });
}

#[test]
fn gemma3_matches_reference_from_hf_and_gguf() {
    check(Tiny {
        family: "gemma3_text",
        hidden: 64,
        heads: 2,
        kv_heads: 1,
        head_dim: 32,
        layers: 6,
        ffn: 96,
    });
}
