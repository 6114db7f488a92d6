//! Tiny random models written by the test itself, for the families and formats no installable
//! weights cover (Qwen3, Hugging Face directories, GGUF written from HF weights), checked against
//! an independent pure-Python reference (`tests/reference/transformer.py`).

use dspark_model::testing::{weights, write_gguf, write_hf, Tiny};
use dspark_model::{Model, SeqInput, TapSpec};
use std::path::Path;
use std::process::Command;

/// Logits at every position, fed as a prefill of 5 then a block of the rest (cache reuse).
fn ours(m: &Model, ids: &[u32]) -> Vec<f32> {
    let mut cache = m.new_cache(64);
    let mut out = m.forward(&mut [SeqInput::logits_all(&mut cache, &ids[..5])], &TapSpec::default()).unwrap();
    out.extend(m.forward(&mut [SeqInput::logits_all(&mut cache, &ids[5..])], &TapSpec::default()).unwrap());
    out.into_iter().flat_map(|o| o.logits).collect()
}

fn reference(dir: &Path, ids: &[u32]) -> Vec<f32> {
    let script = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for tests"),
    )
    .join("../../tests/reference/transformer.py");
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
