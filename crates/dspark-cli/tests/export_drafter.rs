//! The shipped SmolLM2 drafters, written by `dspark export-drafter` in each public layout that
//! fits them, load back through the strict loader and draft what the originals draft: the same
//! tokens over three `draft-trace` rounds of a real prompt, the same confidence logits.

mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};

const TARGET: &str = "smollm2-135m";

fn shipped(name: &str) -> PathBuf {
    std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for tests"),
    )
    .join("../../drafters")
    .join(name)
}

fn trace(drafter: &Path, prompt: &str) -> Value {
    common::dspark_json(&[
        "draft-trace",
        "--target",
        TARGET,
        "--drafter",
        drafter.to_str().unwrap(),
        "--prompt-tokens",
        prompt,
        "--rounds",
        "3",
        "--accept",
        "2",
        "--draft-len",
        "7",
        "--json",
    ])
}

fn max_diff(a: &Value, b: &Value) -> f64 {
    let flat = |v: &Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))
            .collect()
    };
    let (a, b) = (flat(a), flat(b));
    assert_eq!(a.len(), b.len());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

#[test]
fn shipped_drafters_exported_in_public_layouts_draft_the_same() {
    common::model(TARGET);
    let tokens = common::dspark_json(&[
        "tokenize",
        "-m",
        TARGET,
        "--json",
        "Write a Python function that returns the sum of a list.",
    ]);
    let prompt: Vec<String> = common::ids(&tokens["tokens"]).iter().map(|t| t.to_string()).collect();
    let prompt = prompt.join(",");
    // The DeepSpec layout carries f32 copies of the target's embedding and head, which DeepSpec's
    // code reads; the original drafts through the target's own Q4_1 head (its kernel quantizes
    // activations), so logits agree to about 0.1 there and exactly elsewhere.
    for (name, format, logits_tol) in [
        ("smollm2-135m-dspark-markov", "deepspec", 0.5),
        ("smollm2-135m-dspark-rnn", "deepspec", 0.5),
        ("smollm2-135m-dflash", "zlab", 1e-5),
        ("smollm2-135m-eagle3", "eagle3", 1e-5),
        ("smollm2-135m-eagle3", "deepspec", 1e-5),
    ] {
        let out = tempfile::tempdir().unwrap();
        let dir = out.path().join("exported");
        let r = common::dspark(&[
            "export-drafter",
            shipped(name).to_str().unwrap(),
            "--format",
            format,
            "--out",
            dir.to_str().unwrap(),
        ]);
        assert!(r.status.success(), "{name} -> {format}: {}", String::from_utf8_lossy(&r.stderr));
        let (want, got) = (trace(&shipped(name), &prompt), trace(&dir, &prompt));
        for (i, (w, g)) in
            want["rounds"].as_array().unwrap().iter().zip(got["rounds"].as_array().unwrap()).enumerate()
        {
            let what = format!("{name} -> {format}, round {i}");
            assert_eq!(g["draft_tokens"], w["draft_tokens"], "{what}: drafts");
            let d = max_diff(&g["logits"], &w["logits"]);
            assert!(d <= logits_tol, "{what}: logits differ by {d}");
            assert_eq!(g["confidence_logits"], w["confidence_logits"], "{what}: confidence logits");
        }
    }
}

#[test]
fn a_layout_that_would_compute_something_else_is_refused() {
    let out = tempfile::tempdir().unwrap();
    let r = common::dspark(&[
        "export-drafter",
        shipped("smollm2-135m-dspark-markov").to_str().unwrap(),
        "--format",
        "zlab",
        "--out",
        out.path().join("x").to_str().unwrap(),
    ]);
    assert!(!r.status.success());
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(err.contains("no Markov/RNN or confidence head") && err.contains("--format deepspec"), "{err}");
    assert!(!out.path().join("x").exists(), "nothing written");
}
