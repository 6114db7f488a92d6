//! Shared helpers for tests that run real models. Models are fetched into the cache on first
//! use, so a fresh machine (CI) installs them itself.
#![allow(dead_code)]

use dspark_decode::{generate, GenerateParams};
use dspark_engine::{generate as generate_spec, SpecParams};
use dspark_model::Model;
use dspark_sampling::SamplingParams;
use dspark_spec::Drafter;
use std::path::PathBuf;
use std::process::{Command, Output};

pub fn model(name: &str) -> PathBuf {
    dspark_hub::resolve(name, false).unwrap_or_else(|e| panic!("cannot install {name}: {e}"))
}

/// The repository's `data/` folder (benchmark prompts, llama.cpp goldens; see data/README.md).
pub fn data() -> PathBuf {
    std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for tests"),
    )
    .join("../../data")
}

pub fn golden(name: &str) -> Vec<serde_json::Value> {
    let p = data().join("golden").join(format!("{name}.jsonl"));
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

pub fn bench_prompts(file: &str, field: &str, n: usize) -> Vec<String> {
    let p = data().join("bench").join(file);
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .take(n)
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()[field].as_str().unwrap().to_string())
        .collect()
}

/// 50 GSM8K and 50 MBPP prompts through the chat template.
pub fn math_and_code(m: &Model, n_each: usize) -> Vec<Vec<u32>> {
    let mut texts = bench_prompts("gsm8k-test.jsonl", "question", n_each);
    texts.extend(bench_prompts("mbpp-test.jsonl", "text", n_each));
    texts.iter().map(|t| m.tokenizer.encode(&m.chat_prompt(t).unwrap(), true).unwrap()).collect()
}

pub fn plain(m: &Model, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let p = GenerateParams {
        max_tokens,
        sampling: SamplingParams::default(),
        seed: 0,
        stop_tokens: m.tokenizer.eos().to_vec(),
    };
    generate(m, prompt, &p, |_| {}).unwrap().tokens
}

pub fn spec(
    m: &std::sync::Arc<Model>,
    d: &mut dyn Drafter,
    prompt: &[u32],
    max_tokens: usize,
    gamma: usize,
) -> (Vec<u32>, f64) {
    let p = SpecParams {
        max_tokens,
        draft_len: gamma,
        sampling: SamplingParams::default(),
        seed: 0,
        stop_tokens: m.tokenizer.eos().to_vec(),
        policy: dspark_schedule::Policy::Fixed,
        cost: None,
    };
    let r = generate_spec(m, d, prompt, &p, |_| {}).unwrap();
    (r.tokens, r.stats.tau())
}

/// Upper critical value of χ² with `k` degrees of freedom at p = 0.001 (Wilson–Hilferty).
pub fn chi2_critical(k: f64) -> f64 {
    let z = 3.090; // one-sided 0.1 %
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// χ² goodness of fit of `counts` (n draws) against `p` at p = 0.001, tokens with expected
/// count below 5 pooled into one bin; also no draw outside `p`'s support.
pub fn chi2_check(counts: &[usize], p: &[f64], n: usize, what: &str) {
    let (mut chi2, mut bins, mut pool_e, mut pool_o) = (0.0, 0usize, 0.0, 0.0);
    for t in 0..p.len() {
        let e = p[t] * n as f64;
        if e >= 5.0 {
            chi2 += (counts[t] as f64 - e).powi(2) / e;
            bins += 1;
        } else {
            pool_e += e;
            pool_o += counts[t] as f64;
        }
    }
    if pool_e >= 5.0 {
        chi2 += (pool_o - pool_e).powi(2) / pool_e;
        bins += 1;
    } else {
        assert!(pool_o <= 5.0 + 3.0 * pool_e.sqrt() + 5.0, "{what}: {pool_o} draws outside the support");
    }
    let outside: usize = (0..p.len()).filter(|&t| p[t] == 0.0).map(|t| counts[t]).sum();
    assert_eq!(outside, 0, "{what}: tokens of probability 0 were drawn");
    let crit = chi2_critical((bins.max(2) - 1) as f64);
    eprintln!("{what}: χ² {chi2:.1} on {} dof (critical {crit:.1})", bins.max(2) - 1);
    assert!(chi2 < crit, "{what}: χ² {chi2} ≥ {crit}");
}

/// The shipped SmolLM2 DSpark-Markov drafter as the serving engine takes it: a block model with
/// its quantized drafting weights (Q4_0 by default).
pub fn shipped_block_drafter(t: &std::sync::Arc<Model>) -> dspark_engine::EngineDrafter {
    dspark_engine::EngineDrafter::Block(shipped_block_model(t))
}

pub fn shipped_block_model(t: &std::sync::Arc<Model>) -> std::sync::Arc<dspark_drafter_models::BlockModel> {
    let dir = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for tests"),
    )
    .join("../../drafters/smollm2-135m-dspark-markov");
    let mut net = dspark_drafter_models::load(&dir, t.clone(), "smollm2-135m").unwrap();
    net.quantize_for_inference().unwrap();
    match net {
        dspark_drafter_models::DrafterNet::Block(m) => std::sync::Arc::new(m),
        dspark_drafter_models::DrafterNet::Eagle3(_) => {
            panic!("the shipped DSpark drafter is a block drafter")
        }
    }
}
