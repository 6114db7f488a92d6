//! The public drafter checkpoints in `data/golden/drafters/` (saved by DeepSpec's, z-lab's and
//! SafeAILab's own code) load unmodified and reproduce the outputs their official inference code
//! recorded, round by round: target features, block hidden states, base and Markov/RNN-corrected
//! logits, confidence logits, greedy drafts, and a second round after the cache update.

use candle_core::Tensor;
use dspark_drafter_models::{ContextCache, DrafterNet, EagleCache};
use dspark_model::{Model, SeqInput, TapSpec, EMBEDDING_TAP};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const LOGITS_TOL: f32 = 1e-4;
const HIDDEN_TOL: f32 = 2e-5;

fn golden() -> PathBuf {
    std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for tests"),
    )
    .join("../../data/golden/drafters")
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn target() -> Arc<Model> {
    Arc::new(Model::load(&golden().join("target")).expect("the golden target loads"))
}

fn floats(v: &Value) -> Vec<f32> {
    match v {
        Value::Array(a) => a.iter().flat_map(floats).collect(),
        x => vec![x.as_f64().expect("a number") as f32],
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Largest absolute difference, after checking the lengths agree.
fn close(what: &str, got: &[f32], want: &[f32], tol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: {} values, recorded {}", got.len(), want.len());
    let d = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(d <= tol, "{what}: max abs difference {d} > {tol}");
    d
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// The recorded `[rows, m·hidden]` context feature as one `rows × hidden` slice per layer.
fn split_taps(feature: &Value, m: usize, d: usize) -> (Vec<Vec<f32>>, usize) {
    let rows = feature.as_array().unwrap();
    let mut taps = vec![Vec::new(); m];
    for r in rows {
        let v = floats(r);
        for (l, tap) in taps.iter_mut().enumerate() {
            tap.extend_from_slice(&v[l * d..(l + 1) * d]);
        }
    }
    (taps, rows.len())
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold(0, |b, (i, &x)| if x > row[b] { i } else { b })
}

/// Our target forward gives the features the official code fed the drafter.
fn check_features(t: &Model, tokens: &[u32], layers: &[usize], recorded: &Value, what: &str) -> f32 {
    let mut cache = t.new_cache(64);
    let mut seq = SeqInput::logits_last(&mut cache, tokens);
    seq.tap_rows = (0..tokens.len()).collect();
    let out =
        t.forward(&mut [seq], &TapSpec { layers: layers.to_vec(), final_norm: false }).unwrap().remove(0);
    let d = t.config.hidden;
    let got: Vec<f32> = (0..tokens.len())
        .flat_map(|r| out.taps.iter().flat_map(move |tap| tap[r * d..(r + 1) * d].to_vec()))
        .collect();
    close(what, &got, &floats(recorded), HIDDEN_TOL)
}

#[test]
fn target_matches_hugging_face() {
    let t = target();
    let o = json(&golden().join("target_outputs.json"));
    let prompt = ids(&o["prompt_ids"]);
    let mut cache = t.new_cache(64);
    let mut seq = SeqInput::logits_last(&mut cache, &prompt);
    seq.tap_rows = (0..prompt.len()).collect();
    let layers: Vec<usize> = std::iter::once(EMBEDDING_TAP).chain(0..t.config.n_layers - 1).collect();
    let out = t.forward(&mut [seq], &TapSpec { layers, final_norm: true }).unwrap().remove(0);
    let hs = o["hidden_states"].as_array().unwrap();
    for (i, tap) in out.taps.iter().enumerate() {
        close(&format!("hidden_states[{i}]"), tap, &floats(&hs[i]), HIDDEN_TOL);
    }
    close("final norm", out.final_norm.as_ref().unwrap(), &floats(&hs[t.config.n_layers]), HIDDEN_TOL);
    close("last logits", &out.logits, &floats(&o["last_position_logits"]), LOGITS_TOL);
    assert_eq!(argmax(&out.logits) as u64, o["greedy_next_token"].as_u64().unwrap());
}

/// DeepSpec DSpark / DFlash and z-lab DFlash: two rounds of block drafting.
fn block_variant(name: &str) -> f32 {
    let t = target();
    let dir = golden().join(name);
    let o = json(&dir.join("outputs.json"));
    let DrafterNet::Block(m) = dspark_drafter_models::load(&dir.join("model"), t.clone(), "target").unwrap()
    else {
        panic!("{name} is a block drafter")
    };
    let (d, layers) = (m.config.hidden_size, m.config.target_layer_ids.clone());
    let prompt = ids(&o["prompt_ids"]);
    let mut worst = 0f32;
    let mut cache = ContextCache::default();
    for (r, round) in o["rounds"].as_array().unwrap().iter().enumerate() {
        let what = |k: &str| format!("{name} round {r} {k}");
        if r == 0 {
            worst =
                worst.max(check_features(&t, &prompt, &layers, &round["context_feature"], &what("features")));
        }
        assert_eq!(
            cache.len() as u64,
            round["draft_cache_len_before"].as_u64().unwrap(),
            "{}",
            what("cache")
        );
        let (taps, rows) = split_taps(&round["context_feature"], layers.len(), d);
        m.extend(&mut cache, &taps, rows).unwrap();
        assert_eq!(cache.len() as u64, round["draft_cache_len_after"].as_u64().unwrap(), "{}", what("cache"));
        let anchor = round["anchor_token"].as_u64().unwrap() as u32;
        let hidden = m.block_hidden(&[(&cache, anchor)]).unwrap();
        // z-lab drafts from slots 1.. only; the record has every slot's hidden state.
        let slots: Vec<usize> = match round.get("draft_logits_slots") {
            Some(s) => ids(s).into_iter().map(|x| x as usize).collect(),
            None => (0..m.gamma()).collect(),
        };
        let recorded_hidden: Vec<f32> = {
            let all = round["block_hidden"].as_array().unwrap();
            slots.iter().flat_map(|&s| floats(&all[s])).collect()
        };
        worst = worst.max(close(&what("block_hidden"), &flat(&hidden), &recorded_hidden, HIDDEN_TOL));
        let raw = m.raw_logits(&hidden).unwrap();
        let base = round.get("base_logits").map(|b| {
            let all = b.as_array().unwrap();
            slots.iter().flat_map(|&s| floats(&all[s])).collect::<Vec<f32>>()
        });
        let base = base.unwrap_or_else(|| floats(&round["draft_logits"]));
        worst = worst.max(close(&what("base logits"), &flat(&raw), &base, LOGITS_TOL));
        let trace = m.draft(&hidden, &raw, anchor, m.gamma(), |_, row| Ok(argmax(row))).unwrap();
        assert_eq!(trace.tokens, ids(&round["draft_tokens"]), "{}", what("draft tokens"));
        let final_logits = round.get("corrected_logits").map(floats).unwrap_or(base);
        worst = worst.max(close(&what("final logits"), &trace.logits.concat(), &final_logits, LOGITS_TOL));
        match round.get("confidence_logits") {
            Some(c) => {
                let got = trace.confidence_logits.expect("a confidence head");
                worst = worst.max(close(&what("confidence logits"), &got, &floats(c), HIDDEN_TOL));
            }
            None => assert!(trace.confidence_logits.is_none(), "{}", what("no confidence head")),
        }
        if let Some(v) = round.get("verify") {
            // The next round's features are the target's over the verify block's first rows.
            let committed = 1 + v["forced_accepted"].as_u64().unwrap() as usize;
            let mut seq_tokens = prompt.clone();
            seq_tokens.extend(ids(&v["input_ids"]).into_iter().take(committed));
            let next = &o["rounds"][r + 1];
            let mut cache_t = t.new_cache(64);
            let mut seq = SeqInput::logits_last(&mut cache_t, &seq_tokens);
            seq.tap_rows = (prompt.len()..seq_tokens.len()).collect();
            let out = t.forward(&mut [seq], &TapSpec { layers: layers.clone(), final_norm: false }).unwrap();
            let got: Vec<f32> = (0..committed)
                .flat_map(|row| out[0].taps.iter().flat_map(move |tap| tap[row * d..(row + 1) * d].to_vec()))
                .collect();
            close(&what("verify features"), &got, &floats(&next["context_feature"]), HIDDEN_TOL);
        }
    }
    worst
}

#[test]
fn deepspec_dspark_markov_matches_official_outputs() {
    eprintln!("max abs error {}", block_variant("deepspec-dspark-markov"));
}

#[test]
fn deepspec_dspark_rnn_matches_official_outputs() {
    eprintln!("max abs error {}", block_variant("deepspec-dspark-rnn"));
}

#[test]
fn deepspec_dflash_matches_official_outputs() {
    eprintln!("max abs error {}", block_variant("deepspec-dflash"));
}

#[test]
fn zlab_dflash_matches_official_outputs() {
    eprintln!("max abs error {}", block_variant("zlab-dflash"));
}

fn eagle_round(
    m: &dspark_drafter_models::Eagle3Model,
    cache: &EagleCache,
    round: &Value,
    what: &str,
    target_ids_key: &str,
) -> f32 {
    let n = round["step_logits"].as_array().unwrap().len();
    let trace = m.draft(cache, n, |_, row| Ok(argmax(row))).unwrap();
    assert_eq!(trace.tokens, ids(&round[target_ids_key]), "{what}: draft tokens");
    close(&format!("{what} step logits"), &trace.logits.concat(), &floats(&round["step_logits"]), LOGITS_TOL)
}

#[test]
fn deepspec_eagle3_matches_official_outputs() {
    let t = target();
    let dir = golden().join("deepspec-eagle3");
    let o = json(&dir.join("outputs.json"));
    let DrafterNet::Eagle3(m) = dspark_drafter_models::load(&dir.join("model"), t.clone(), "target").unwrap()
    else {
        panic!("an EAGLE-3 drafter")
    };
    let (d, layers) = (m.config.hidden_size, m.config.target_layer_ids.clone());
    let mut worst = check_features(
        &t,
        &ids(&o["prompt_ids"]),
        &layers,
        &o["draft_prefill"]["context_feature"],
        "features",
    );
    let mut cache = EagleCache::default();
    let feed = |cache: &mut EagleCache, step: &Value, what: &str| -> f32 {
        let (taps, rows) = split_taps(&step["context_feature"], layers.len(), d);
        m.extend(cache, &taps, rows, &ids(&step["input_ids"])).unwrap();
        assert_eq!(cache.len() as u64, step["draft_cache_len_after"].as_u64().unwrap(), "{what}: cache");
        close(what, &flat(cache.last().unwrap()), &floats(&step["draft_hidden_last"]), HIDDEN_TOL)
    };
    worst = worst.max(feed(&mut cache, &o["draft_prefill"], "prefill hidden"));
    for (r, round) in o["rounds"].as_array().unwrap().iter().enumerate() {
        let what = format!("round {r}");
        close(&what, &flat(cache.last().unwrap()), &floats(&round["proposal_hidden_in"]), HIDDEN_TOL);
        worst = worst.max(eagle_round(&m, &cache, round, &what, "draft_tokens"));
        if let Some(u) = round.get("update") {
            worst = worst.max(feed(&mut cache, u, "update hidden"));
        }
    }
    eprintln!("max abs error {worst}");
}

fn safeailab(model_dir: &str) -> f32 {
    let t = target();
    let dir = golden().join("safeailab-eagle3");
    let o = json(&dir.join("outputs.json"));
    let DrafterNet::Eagle3(m) =
        dspark_drafter_models::load(&dir.join(model_dir), t.clone(), "target").unwrap()
    else {
        panic!("an EAGLE-3 drafter")
    };
    let (d, layers) = (m.config.hidden_size, m.config.target_layer_ids.clone());
    assert_eq!(m.vocab.len(), o["draft_vocab_size"].as_u64().unwrap() as usize);
    let rounds = o["rounds"].as_array().unwrap();
    let mut worst =
        check_features(&t, &ids(&o["prompt_ids"]), &layers, &rounds[0]["context_feature"], "features");
    let mut cache = EagleCache::default();
    for (r, round) in rounds.iter().enumerate() {
        let what = format!("{model_dir} round {r}");
        assert_eq!(cache.len() as u64, round["stable_kv_len_before"].as_u64().unwrap(), "{what}: cache");
        let (taps, rows) = split_taps(&round["context_feature"], layers.len(), d);
        m.extend(&mut cache, &taps, rows, &ids(&round["draft_prefill_input_ids"])).unwrap();
        assert_eq!(cache.len() as u64, round["stable_kv_len_after"].as_u64().unwrap(), "{what}: cache");
        worst = worst.max(eagle_round(&m, &cache, round, &what, "step_argmax_target_ids"));
    }
    worst
}

#[test]
fn safeailab_eagle3_pytorch_bin_matches_official_outputs() {
    eprintln!("max abs error {}", safeailab("model"));
}

#[test]
fn safeailab_eagle3_safetensors_matches_official_outputs() {
    eprintln!("max abs error {}", safeailab("model-safetensors"));
}

/// A copy of a golden checkpoint with its config edited by `edit` and, with `extra`, one more
/// tensor in its weights.
fn altered(variant: &str, edit: impl FnOnce(&mut Value), extra: Option<&str>) -> tempfile::TempDir {
    let src = golden().join(variant).join("model");
    let d = tempfile::tempdir().unwrap();
    let mut cfg = json(&src.join("config.json"));
    edit(&mut cfg);
    std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
    let st = src.join("model.safetensors");
    match extra {
        None => {
            std::fs::copy(&st, d.path().join("model.safetensors")).unwrap();
        }
        Some(name) => {
            let mut map = candle_core::safetensors::load(&st, &candle_core::Device::Cpu).unwrap();
            map.insert(
                name.to_string(),
                Tensor::zeros(3, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap(),
            );
            candle_core::safetensors::save(&map, d.path().join("model.safetensors")).unwrap();
        }
    }
    d
}

fn refusal(dir: &Path) -> String {
    match dspark_drafter_models::load(dir, target(), "target") {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn an_unused_tensor_is_refused_by_name() {
    let d = altered("deepspec-dspark-markov", |_| {}, Some("markov_head.gate_proj.weight"));
    let err = refusal(d.path());
    assert!(err.contains("`markov_head.gate_proj.weight`"), "{err}");
    // The RNN head's tensors are not silently ignored by a vanilla-head config either.
    let d = altered("deepspec-dspark-rnn", |c| c["markov_head_type"] = "vanilla".into(), None);
    let err = refusal(d.path());
    assert!(err.contains("markov_head.joint_proj.weight"), "{err}");
}

#[test]
fn unimplemented_config_fields_are_refused_by_name_and_value() {
    for (variant, key, value, says) in [
        (
            "deepspec-dspark-markov",
            "markov_head_type",
            serde_json::json!("gated"),
            "`markov_head_type` = \"gated\"",
        ),
        ("deepspec-dspark-markov", "markov_head_type", serde_json::json!("lstm"), "\"lstm\""),
        (
            "deepspec-dflash",
            "rope_parameters",
            serde_json::json!({"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}),
            "rope_type \"yarn\"",
        ),
        (
            "zlab-dflash",
            "rope_scaling",
            serde_json::json!({"rope_type": "llama3", "factor": 8.0}),
            "\"llama3\"",
        ),
        (
            "zlab-dflash",
            "layer_types",
            serde_json::json!(["sliding_attention", "full_attention", "full_attention"]),
            "`layer_types`",
        ),
        ("deepspec-eagle3", "is_causal", serde_json::json!(false), "`is_causal` = false"),
        ("deepspec-eagle3", "norm_before_residual", serde_json::json!(true), "`norm_before_residual` = true"),
        ("zlab-dflash", "use_sliding_window", serde_json::json!(true), "`use_sliding_window` = true"),
        ("deepspec-dflash", "hidden_act", serde_json::json!("gelu"), "`hidden_act` = \"gelu\""),
        ("deepspec-dflash", "some_new_switch", serde_json::json!(3), "`some_new_switch` = 3"),
        (
            "zlab-dflash",
            "dflash_config",
            serde_json::json!({"mask_token_id": 511, "causal": true}),
            "`causal` = true",
        ),
    ] {
        let d = altered(variant, |c| c[key] = value, None);
        let err = refusal(d.path());
        assert!(err.contains(says), "{variant} {key}: `{err}` should say `{says}`");
    }
}

#[test]
fn the_final_norm_output_is_not_a_target_layer_of_a_public_drafter() {
    let d = altered("deepspec-dflash", |c| c["target_layer_ids"] = serde_json::json!([-1, 2, 7]), None);
    let err = refusal(d.path());
    assert!(err.contains("target layer 7"), "{err}");
}

#[test]
fn a_loaded_public_checkpoint_saves_as_ours_and_loads_back() {
    let t = target();
    for variant in ["deepspec-dspark-rnn", "zlab-dflash", "deepspec-eagle3", "safeailab-eagle3"] {
        let net =
            dspark_drafter_models::load(&golden().join(variant).join("model"), t.clone(), "target").unwrap();
        let d = tempfile::tempdir().unwrap();
        net.save(d.path()).unwrap();
        let back = dspark_drafter_models::load(d.path(), t.clone(), "target")
            .unwrap_or_else(|e| panic!("{variant}: {e}"));
        assert_eq!(back.config().gamma(), net.config().gamma(), "{variant}");
        assert_eq!(back.method(), net.method(), "{variant}");
        assert_eq!(back.vocab().target_ids(), net.vocab().target_ids(), "{variant}");
        assert_eq!(back.config().target_layer_ids, net.config().target_layer_ids, "{variant}");
    }
}
