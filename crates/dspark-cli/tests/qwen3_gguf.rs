//! A Qwen3 target as a GGUF file (arch `qwen3`, per-head `attn_q_norm` / `attn_k_norm`, as
//! llama.cpp's converter writes it) with the public drafters released for Qwen3 targets: the
//! golden Hugging Face target written as GGUF computes the same logits and drafter features, and
//! speculative greedy decoding with each public drafter, through `dspark generate` and through
//! the serving engine, gives exactly the plain greedy output.

mod common;

use candle_core::quantized::gguf_file::Value as Gguf;
use dspark_drafter_models::DrafterNet;
use dspark_engine::{EngineConfig, Event, Request, RequestParams};
use dspark_model::testing::{gguf_parts, write_gguf_parts, Tiny};
use dspark_model::{Model, SeqInput, TapSpec, EMBEDDING_TAP};
use dspark_sampling::SamplingParams;
use dspark_schedule::{CostTable, Policy};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const VOCAB: usize = 512;

fn golden() -> PathBuf {
    common::data().join("golden/drafters")
}

/// Token texts of the GGUF: single characters (so that a raw text prompt tokenizes), then
/// placeholders; 505…511 are control tokens as in the golden tokenizer (505 BOS, 507 EOS).
fn tokens() -> Vec<String> {
    (0..VOCAB)
        .map(|i| match i {
            0..93 => ((33 + i as u8) as char).to_string(),
            93 => "ab".to_string(),
            _ => format!("<|w{i}|>"),
        })
        .collect()
}

/// The golden HF target written as llama.cpp would: same weights (f32), Qwen3 metadata.
fn write_target_gguf(path: &Path) {
    let w =
        candle_core::safetensors::load(golden().join("target/model.safetensors"), &candle_core::Device::Cpu)
            .unwrap()
            .into_iter()
            .collect();
    let t = Tiny { family: "qwen3", hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, layers: 8, ffn: 128 };
    let (mut md, tensors) = gguf_parts(&t, &w);
    let toks = tokens();
    for (k, v) in md.iter_mut() {
        match k.as_str() {
            "qwen3.rope.freq_base" => *v = Gguf::F32(1e6),
            "qwen3.context_length" => *v = Gguf::U32(512),
            "tokenizer.ggml.tokens" => *v = Gguf::Array(toks.iter().cloned().map(Gguf::String).collect()),
            "tokenizer.ggml.token_type" => {
                *v = Gguf::Array((0..VOCAB).map(|i| Gguf::I32(if i >= 505 { 3 } else { 1 })).collect())
            }
            "tokenizer.ggml.bos_token_id" => *v = Gguf::U32(505),
            "tokenizer.ggml.eos_token_id" => *v = Gguf::U32(507),
            _ => {}
        }
    }
    write_gguf_parts(path, &md, &tensors);
}

fn gguf_target() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qwen3-tiny.gguf");
    write_target_gguf(&path);
    (dir, path)
}

fn prompt() -> Vec<u32> {
    let o: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden().join("target_outputs.json")).unwrap())
            .unwrap();
    common::ids(&o["prompt_ids"])
}

#[test]
fn qwen3_gguf_computes_what_the_hf_target_computes() {
    let (_dir, path) = gguf_target();
    let g = Model::load(&path).unwrap();
    assert_eq!(g.config.family, dspark_model::Family::Qwen3);
    let hf = Model::load(&golden().join("target")).unwrap();
    let p = prompt();
    let layers: Vec<usize> = std::iter::once(EMBEDDING_TAP).chain(0..7).collect();
    let run = |m: &Model| {
        let mut cache = m.new_cache(64);
        let mut seq = SeqInput::logits_all(&mut cache, &p);
        seq.tap_rows = (0..p.len()).collect();
        m.forward(&mut [seq], &TapSpec { layers: layers.clone(), final_norm: true }).unwrap().remove(0)
    };
    let (a, b) = (run(&g), run(&hf));
    let diff = |x: &[f32], y: &[f32]| {
        assert_eq!(x.len(), y.len());
        x.iter().zip(y).map(|(u, v)| (u - v).abs()).fold(0f32, f32::max)
    };
    let d = diff(&a.logits, &b.logits);
    assert!(d < 1e-4, "logits differ by {d}");
    for (l, (x, y)) in a.taps.iter().zip(&b.taps).enumerate() {
        let d = diff(x, y);
        assert!(d < 2e-5, "tap {l} differs by {d}");
    }
    let d = diff(a.final_norm.as_ref().unwrap(), b.final_norm.as_ref().unwrap());
    assert!(d < 2e-5, "final norm differs by {d}");
}

/// DeepSpec's DSpark checkpoint with its Markov head rewritten into the target's own bigrams
/// along `runs` (each a context followed by the target's greedy tokens): W1/W2 bias each
/// token's most frequent greedy successor by 100, so that drafts are often accepted and the
/// accept path runs too (random drafters are almost always rejected).
fn tuned_markov(runs: &[Vec<u32>]) -> tempfile::TempDir {
    let mut next: std::collections::BTreeMap<u32, std::collections::BTreeMap<u32, usize>> =
        Default::default();
    for r in runs {
        for w in r.windows(2) {
            *next.entry(w[0]).or_default().entry(w[1]).or_default() += 1;
        }
    }
    let src = golden().join("deepspec-dspark-markov/model");
    let dev = candle_core::Device::Cpu;
    let mut map = candle_core::safetensors::load(src.join("model.safetensors"), &dev).unwrap();
    let rank = 16;
    let (mut w1, mut w2) = (vec![0f32; VOCAB * rank], vec![0f32; VOCAB * rank]);
    for (j, (prev, counts)) in next.iter().take(rank).enumerate() {
        let best = counts.iter().max_by_key(|(t, c)| (**c, std::cmp::Reverse(**t))).unwrap().0;
        w1[*prev as usize * rank + j] = 10.0;
        w2[*best as usize * rank + j] = 10.0;
    }
    for (name, w) in [("markov_head.markov_w1.weight", w1), ("markov_head.markov_w2.weight", w2)] {
        map.insert(name.into(), candle_core::Tensor::from_vec(w, (VOCAB, rank), &dev).unwrap());
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    candle_core::safetensors::save(&map, dir.path().join("model.safetensors")).unwrap();
    dir
}

const DRAFTERS: [&str; 6] = [
    "dspark:deepspec-dspark-markov",
    "dspark:deepspec-dspark-rnn",
    "dflash:deepspec-dflash",
    "dflash:zlab-dflash",
    "eagle3:deepspec-eagle3",
    "eagle3:safeailab-eagle3",
];

fn generate(model: &Path, drafter: &str) -> (Vec<u32>, serde_json::Value) {
    let (tokens, stats, _) = generate_with_prompt(model, drafter);
    (tokens, stats)
}

/// Every draft verified (`--policy fixed`): the default, Algorithm 1, may stop drafting where a
/// tiny target's cost curve says drafts do not pay, and these tests are about what drafts do.
fn generate_with_prompt(model: &Path, drafter: &str) -> (Vec<u32>, serde_json::Value, Vec<u32>) {
    let policy: &[&str] = if drafter == "none" { &[] } else { &["--policy", "fixed"] };
    let out = common::dspark_json(
        &[
            &[
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--prompt",
                "qwen3:drafts_must_not_change_a_single_token!",
                "--raw",
                "--max-tokens",
                "24",
                "--drafter",
                drafter,
                "--json",
            ],
            policy,
        ]
        .concat(),
    );
    (common::ids(&out["tokens"]), out["stats"].clone(), common::ids(&out["prompt_tokens"]))
}

#[test]
fn generate_with_public_drafters_on_a_qwen3_gguf_equals_plain_greedy() {
    let (_dir, path) = gguf_target();
    let (plain, _, prompt) = generate_with_prompt(&path, "none");
    for d in DRAFTERS {
        let (kind, variant) = d.split_once(':').unwrap();
        let spec = format!("{kind}:{}", golden().join(variant).join("model").display());
        let (tokens, stats) = generate(&path, &spec);
        assert_eq!(tokens, plain, "{d}: speculative greedy output");
        assert!(stats["rounds"].as_u64().unwrap() > 0, "{d}: it drafted ({stats})");
    }
    let tuned = tuned_markov(&[prompt.last().copied().into_iter().chain(plain.iter().copied()).collect()]);
    let (tokens, stats) = generate(&path, &format!("dspark:{}", tuned.path().display()));
    assert_eq!(tokens, plain, "tuned Markov drafter: speculative greedy output");
    let tau = stats["tau"].as_f64().unwrap();
    assert!(tau > 1.5, "the tuned drafter's drafts are accepted (τ {tau})");
}

fn block(dir: &Path, t: &Arc<Model>) -> Arc<dspark_drafter_models::BlockModel> {
    let mut net = dspark_drafter_models::load(dir, t.clone(), "qwen3-tiny").unwrap();
    net.quantize_for_inference().unwrap();
    match net {
        DrafterNet::Block(m) => Arc::new(m),
        DrafterNet::Eagle3(_) => unreachable!("block drafters only"),
    }
}

fn engine_config(policy: Policy) -> EngineConfig {
    EngineConfig {
        policy,
        cost: CostTable {
            model: "qwen3-tiny".into(),
            drafter: None,
            threads: 2,
            forward: vec![(1, 0.010), (256, 0.011)],
            draft: vec![(1, 0.0001), (64, 0.0002)],
        },
        draft_len: 4,
        max_running: 8,
        max_queue: 64,
        kv_tokens: 1 << 14,
        prefill_chunk: 16,
        online_calibration: true,
    }
}

/// Plain greedy decoding, one token per forward.
fn greedy(t: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = t.new_cache(prompt.len() + n);
    let mut next = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < n {
        let o = t.forward(&mut [SeqInput::logits_last(&mut cache, &next)], &TapSpec::default()).unwrap();
        let tok = dspark_sampling::argmax(&o[0].logits) as u32;
        out.push(tok);
        next = vec![tok];
    }
    out
}

#[test]
fn the_serving_engine_with_public_drafters_on_a_qwen3_gguf_equals_plain_greedy() {
    let (_dir, path) = gguf_target();
    let t = Arc::new(Model::load(&path).unwrap());
    let base = prompt();
    // Several requests batched together, prompts of different lengths.
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| base[..base.len() - 3 * i].to_vec()).collect();
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&t, p, 20)).collect();
    let runs: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&want)
        .map(|(p, w)| std::iter::once(*p.last().unwrap()).chain(w.iter().copied()).collect())
        .collect();
    let tuned = tuned_markov(&runs);
    for (variant, dir, policy) in [
        ("deepspec-dspark-markov", golden().join("deepspec-dspark-markov/model"), Policy::Dspark),
        ("deepspec-dspark-rnn", golden().join("deepspec-dspark-rnn/model"), Policy::Fixed),
        ("deepspec-dflash", golden().join("deepspec-dflash/model"), Policy::Fixed),
        ("zlab-dflash", golden().join("zlab-dflash/model"), Policy::Fixed),
        ("tuned Markov", tuned.path().to_path_buf(), Policy::Dspark),
        ("tuned Markov", tuned.path().to_path_buf(), Policy::Fixed),
    ] {
        let mut accepted = 0;
        let engine = dspark_engine::spawn(
            t.clone(),
            Some(dspark_engine::EngineDrafter::Block(block(&dir, &t))),
            engine_config(policy),
        )
        .unwrap();
        let receivers: Vec<_> = prompts
            .iter()
            .map(|p| {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let params = RequestParams {
                    max_tokens: 20,
                    sampling: SamplingParams::default(),
                    seed: 0,
                    stop_tokens: vec![],
                    logprobs: None,
                };
                engine.submit(Request { prompt: p.clone(), params, tag: None, events: tx }).unwrap();
                rx
            })
            .collect();
        for (i, mut rx) in receivers.into_iter().enumerate() {
            let mut toks = Vec::new();
            loop {
                match rx.blocking_recv().expect("an answer") {
                    Event::Tokens { tokens, .. } => toks.extend(tokens),
                    Event::Done { usage, .. } => {
                        assert!(usage.drafted_tokens > 0, "{variant}: request {i} drafted");
                        accepted += usage.accepted_tokens;
                        break;
                    }
                    Event::Error(e) => panic!("{variant}: {e}"),
                }
            }
            assert_eq!(toks, want[i], "{variant}: request {i}");
        }
        engine.shutdown();
        if variant == "tuned Markov" {
            assert!(accepted >= 20, "{variant} {policy}: drafts are accepted ({accepted} of 80 tokens)");
        }
    }
}
