//! `dspark draft-trace` follows the goldens' protocol: for every variant recorded in
//! `data/golden/drafters/` by the official code, the command's JSON (run on the golden target
//! and the unmodified drafter folder, accepting as many drafts as the recording forced) gives the
//! recorded drafts, final logits and confidence logits of every round.

mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};

const TOL: f64 = 1e-4;

fn golden() -> PathBuf {
    common::data().join("golden/drafters")
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(a) => a.iter().flat_map(floats).collect(),
        x => vec![x.as_f64().expect("a number")],
    }
}

/// The first of `keys` the recorded round has.
fn field<'a>(round: &'a Value, keys: &[&str]) -> &'a Value {
    keys.iter().find_map(|k| round.get(*k)).unwrap_or_else(|| panic!("a round with one of {keys:?}"))
}

fn close(what: &str, got: &Value, want: &Value) {
    let (g, w) = (floats(got), floats(want));
    assert_eq!(g.len(), w.len(), "{what}: {} values, recorded {}", g.len(), w.len());
    let d = g.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
    assert!(d <= TOL, "{what}: max abs difference {d} > {TOL}");
}

fn trace(model: &Path, o: &Value, accept: u64, drafts: usize) -> Value {
    let prompt: Vec<String> =
        o["prompt_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap().to_string()).collect();
    let rounds = o["rounds"].as_array().unwrap().len().to_string();
    let (accept, drafts) = (accept.to_string(), drafts.to_string());
    let target = golden().join("target");
    common::dspark_json(&[
        "draft-trace",
        "--target",
        target.to_str().unwrap(),
        "--drafter",
        model.to_str().unwrap(),
        "--prompt-tokens",
        &prompt.join(","),
        "--rounds",
        &rounds,
        "--accept",
        &accept,
        "--draft-len",
        &drafts,
        "--json",
    ])
}

#[test]
fn draft_trace_reproduces_every_golden_variant() {
    let mut checked = Vec::new();
    let mut variants: Vec<PathBuf> = std::fs::read_dir(golden())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("outputs.json").exists())
        .collect();
    variants.sort();
    for dir in variants {
        let o = json(&dir.join("outputs.json"));
        let recorded = o["rounds"].as_array().unwrap();
        let accept = recorded[0]["verify"]["forced_accepted"].as_u64().unwrap();
        let logits_keys = ["corrected_logits", "draft_logits", "step_logits", "base_logits"];
        let drafts = field(&recorded[0], &logits_keys).as_array().unwrap().len();
        // Every weights file the variant ships (SafeAILab's pytorch_model.bin and its
        // safetensors copy) must trace the same.
        for model in ["model", "model-safetensors"].map(|m| dir.join(m)).into_iter().filter(|m| m.exists()) {
            let name = format!(
                "{}/{}",
                dir.file_name().unwrap().to_string_lossy(),
                model.file_name().unwrap().to_string_lossy()
            );
            let out = trace(&model, &o, accept, drafts);
            let rounds = out["rounds"].as_array().unwrap();
            assert_eq!(rounds.len(), recorded.len(), "{name}: rounds");
            for (r, (got, want)) in rounds.iter().zip(recorded).enumerate() {
                let what = |k: &str| format!("{name} round {r} {k}");
                assert_eq!(
                    got["draft_tokens"],
                    *field(want, &["draft_tokens", "step_argmax_target_ids"]),
                    "{}",
                    what("draft tokens")
                );
                close(&what("logits"), &got["logits"], field(want, &logits_keys));
                let rows = got["logits"].as_array().unwrap();
                assert!(rows
                    .iter()
                    .all(|row| row.as_array().unwrap().len() == rows[0].as_array().unwrap().len()));
                match want.get("confidence_logits") {
                    Some(c) => close(&what("confidence logits"), &got["confidence_logits"], c),
                    None => assert_eq!(
                        got["confidence_logits"],
                        serde_json::json!([]),
                        "{}",
                        what("no confidence")
                    ),
                }
            }
            checked.push(name);
        }
    }
    // The six public variants, SafeAILab's twice.
    assert!(checked.len() >= 7, "only {checked:?}");
}

#[test]
fn draft_trace_refuses_more_accepted_drafts_than_drafted() {
    let dir = golden();
    let out = common::dspark(&[
        "draft-trace",
        "--target",
        dir.join("target").to_str().unwrap(),
        "--drafter",
        dir.join("zlab-dflash/model").to_str().unwrap(),
        "--prompt-tokens",
        "1,2,3",
        "--accept",
        "4",
        "--json",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--accept 4 exceeds the 3 drafts per round"), "{err}");
}
