//! Shared helpers for tests that run real models. Models are fetched into the cache on first
//! use, so a fresh machine (CI) installs them itself.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn model(name: &str) -> PathBuf {
    dspark_hub::resolve(name, false).unwrap_or_else(|e| panic!("cannot install {name}: {e}"))
}

pub fn shared() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared")
}

pub fn golden(name: &str) -> Vec<serde_json::Value> {
    let p = shared().join("data/golden").join(format!("{name}.jsonl"));
    std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

pub fn dspark(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dspark")).args(args).output().expect("run dspark")
}

pub fn dspark_json(args: &[&str]) -> serde_json::Value {
    let out = dspark(args);
    assert!(out.status.success(), "dspark {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("dspark printed JSON")
}
