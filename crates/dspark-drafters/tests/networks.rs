//! Drafter networks on tiny random targets: an independent NumPy reference, checkpoints,
//! batching and the draft cache.

use candle_core::Tensor;
use dspark_drafter_models::{
    BlockLayout, BlockModel, ContextCache, DrafterNet, HeadKind, InitOptions, Method,
};
use dspark_drafters::{propose_batch, BatchEntry, BlockDrafter, BlockSeq, Eagle3Drafter};
use dspark_engine::SpecParams;
use dspark_model::testing::{weights, write_hf, Tiny};
use dspark_model::{Model, SeqInput, TapSpec};
use dspark_sampling::SamplingParams;
use dspark_spec::{Drafter, TargetFeatures};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

fn tiny(family: &'static str) -> Tiny {
    let head_dim = if family == "qwen3" { 32 } else { 16 };
    Tiny { family, hidden: 64, heads: 4, kv_heads: 2, head_dim, layers: 3, ffn: 96 }
}

fn target(dir: &Path, family: &'static str, seed: u64) -> Arc<Model> {
    let t = tiny(family);
    write_hf(dir, &t, &weights(&t, seed));
    Arc::new(Model::load(dir).unwrap())
}

fn opts(method: Method, head: HeadKind, vocab: Option<Vec<u32>>, layout: BlockLayout) -> InitOptions {
    InitOptions {
        method,
        layers: 2,
        intermediate: None,
        gamma: 5,
        head,
        rank: 8,
        draft_vocab: vocab,
        target_layers: Some(vec![0, 1]),
        mask_token: Some(93),
        layout,
        std: 0.3,
        seed: 11,
    }
}

fn block(net: DrafterNet) -> BlockModel {
    match net {
        DrafterNet::Block(b) => b,
        DrafterNet::Eagle3(_) => panic!("not a block drafter"),
    }
}

/// Deterministic pseudo-random target features, `rows × hidden` per tapped layer.
fn features(rows: usize, layers: usize, salt: u32) -> Vec<Vec<f32>> {
    (0..layers)
        .map(|l| {
            (0..rows * 64)
                .map(|i| {
                    let x = (i as u32).wrapping_mul(2654435761).wrapping_add(salt * 97 + l as u32 * 7919);
                    ((x >> 8) % 2000) as f32 / 500.0 - 2.0
                })
                .collect()
        })
        .collect()
}

/// A Python interpreter that can import NumPy: the system's, or NumPy pip-installed once into
/// the test scratch directory.
fn numpy_python() -> (String, Option<PathBuf>) {
    let ok = Command::new("python3")
        .args(["-c", "import numpy"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return ("python3".into(), None);
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("numpy");
    if !dir.join("numpy").exists() {
        let st = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--target"])
            .arg(&dir)
            .arg("numpy")
            .status()
            .expect("python3 must be installed");
        assert!(st.success(), "pip install numpy failed");
    }
    ("python3".into(), Some(dir))
}

fn reference(
    target_dir: &Path,
    drafter_dir: &Path,
    taps: &[Vec<f32>],
    rows: usize,
    anchor: u32,
) -> serde_json::Value {
    let inputs = drafter_dir.join("inputs.json");
    std::fs::write(&inputs, serde_json::json!({"taps": taps, "rows": rows, "anchor": anchor}).to_string())
        .unwrap();
    let script = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for tests"),
    )
    .join("../../tests/reference/dspark_drafter.py");
    let (py, path) = numpy_python();
    let mut cmd = Command::new(py);
    if let Some(p) = path {
        cmd.env("PYTHONPATH", p);
    }
    let out = cmd.arg(script).arg(target_dir).arg(drafter_dir).arg(&inputs).output().unwrap();
    assert!(out.status.success(), "reference failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    match v {
        serde_json::Value::Array(a) => a.iter().flat_map(floats).collect(),
        x => vec![x.as_f64().unwrap() as f32],
    }
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0f32, f32::max);
    assert!(worst < 1e-4, "{what}: worst relative difference {worst}");
}

fn rust_greedy(
    m: &BlockModel,
    taps: &[Vec<f32>],
    rows: usize,
    anchor: u32,
) -> (Vec<f32>, dspark_drafter_models::DraftTrace) {
    let mut cache = ContextCache::default();
    m.extend(&mut cache, taps, rows).unwrap();
    let h = m.block_hidden(&[(&cache, anchor)]).unwrap();
    let raw = m.raw_logits(&h).unwrap();
    let trace = m.draft(&h, &raw, anchor, m.gamma(), |_, l| Ok(dspark_sampling::argmax(l))).unwrap();
    (raw.flatten_all().unwrap().to_vec1().unwrap(), trace)
}

#[test]
fn block_drafters_match_the_numpy_reference() {
    let reduced: Vec<u32> = (0..96).filter(|i| i % 3 != 1 || *i == 95).collect();
    let cases = [
        ("llama", opts(Method::Dspark, HeadKind::Markov, None, BlockLayout::Dspark), None),
        (
            "qwen3",
            opts(Method::Dspark, HeadKind::Rnn, Some(reduced.clone()), BlockLayout::Dspark),
            Some(vec![0.5f32, 2.0, 1.0, 3.0, 0.7]),
        ),
        ("qwen2", opts(Method::Dspark, HeadKind::Markov, Some(reduced), BlockLayout::Dspark), None),
        ("llama", opts(Method::Dflash, HeadKind::Markov, None, BlockLayout::Dflash), None),
    ];
    for (i, (family, o, temps)) in cases.into_iter().enumerate() {
        let tdir = tempfile::tempdir().unwrap();
        let ddir = tempfile::tempdir().unwrap();
        let t = target(tdir.path(), family, 42 + i as u64);
        dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap().save(ddir.path()).unwrap();
        if let Some(temps) = temps {
            let p = ddir.path().join("config.json");
            let mut c: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            c["dspark"]["calibration_temperatures"] = serde_json::json!(temps);
            c["dspark"]["calibration_biases"] = serde_json::json!([-0.5f32, 0.25, 0.0, 1.0, -2.0]);
            std::fs::write(&p, c.to_string()).unwrap();
        }
        let m = block(dspark_drafter_models::load(ddir.path(), t, "tiny").unwrap());
        let (rows, anchor) = (6, 17);
        let taps = features(rows, 2, i as u32);
        let (raw, trace) = rust_greedy(&m, &taps, rows, anchor);
        let want = reference(tdir.path(), ddir.path(), &taps, rows, anchor);
        let what = format!("case {i} ({family}, {:?})", o.method);
        assert_close(&raw, &floats(&want["raw"]), &format!("{what}: raw logits"));
        let got_logits: Vec<f32> = trace.logits.concat();
        assert_close(&got_logits, &floats(&want["logits"]), &format!("{what}: sequential logits"));
        let conf = trace.confidence.clone().unwrap_or_default();
        assert_close(&conf, &floats(&want["confidence"]), &format!("{what}: confidences"));
        let want_tokens: Vec<u32> = floats(&want["tokens"]).iter().map(|&x| x as u32).collect();
        assert_eq!(trace.tokens, want_tokens, "{what}: greedy tokens");
        if o.method == Method::Dspark {
            // The sequential head must matter, or this test could not catch a broken one.
            let unbiased: Vec<f32> = raw[..trace.logits[1].len()].to_vec();
            assert!(unbiased.iter().zip(&trace.logits[0]).any(|(a, b)| (a - b).abs() > 1e-3), "{what}");
        }
    }
}

#[test]
fn checkpoints_round_trip_and_mismatches_are_refused() {
    let tdir = tempfile::tempdir().unwrap();
    let t = target(tdir.path(), "llama", 1);
    let d = tempfile::tempdir().unwrap();
    let o = opts(Method::Dspark, HeadKind::Rnn, Some((0..60).chain([95]).collect()), BlockLayout::Dspark);
    let fresh = block(dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap());
    DrafterNet::Block(fresh).save(d.path()).unwrap();
    let fresh = block(dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap());
    let loaded = block(dspark_drafter_models::load(d.path(), t.clone(), "tiny").unwrap());
    let taps = features(5, 2, 3);
    let (a, ta) = rust_greedy(&fresh, &taps, 5, 9);
    let (b, tb) = rust_greedy(&loaded, &taps, 5, 9);
    assert_eq!(a, b, "raw logits after save → load");
    assert_eq!((ta.tokens, ta.logits, ta.confidence), (tb.tokens, tb.logits, tb.confidence));

    // EAGLE-3 round trip too.
    let e = tempfile::tempdir().unwrap();
    let eo = InitOptions { method: Method::Eagle3, layers: 1, ..o.clone() };
    dspark_drafter_models::init(t.clone(), "tiny", &eo).unwrap().save(e.path()).unwrap();
    assert_eq!(dspark_drafter_models::load(e.path(), t.clone(), "tiny").unwrap().method(), Method::Eagle3);

    // A tensor of the wrong shape, a missing tensor.
    let st = d.path().join("model.safetensors");
    let mut map = candle_core::safetensors::load(&st, &candle_core::Device::Cpu).unwrap();
    let good = map.clone();
    map.insert(
        "fc.weight".into(),
        Tensor::zeros((64, 64), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&map, &st).unwrap();
    let err = dspark_drafter_models::load(d.path(), t.clone(), "tiny").err().unwrap().to_string();
    assert!(err.contains("fc.weight") && err.contains("shape"), "{err}");
    let mut map = good.clone();
    map.remove("norm.weight");
    candle_core::safetensors::save(&map, &st).unwrap();
    let err = dspark_drafter_models::load(d.path(), t.clone(), "tiny").err().unwrap().to_string();
    assert!(err.contains("lacks tensor `norm.weight`"), "{err}");
    candle_core::safetensors::save(&good, &st).unwrap();

    // Another target: other dimensions; same dimensions with another tokenizer.
    let other = tempfile::tempdir().unwrap();
    let ot = Tiny { hidden: 32, ..tiny("llama") };
    write_hf(other.path(), &ot, &weights(&ot, 5));
    let err = dspark_drafter_models::load(d.path(), Arc::new(Model::load(other.path()).unwrap()), "other")
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("does not fit target `other`") && err.contains("hidden size"), "{err}");
    let swapped = tempfile::tempdir().unwrap();
    target(swapped.path(), "llama", 1);
    let tj = swapped.path().join("tokenizer.json");
    let text = std::fs::read_to_string(&tj).unwrap().replace("\"a\":", "\"A_\":");
    std::fs::write(&tj, text).unwrap();
    let err =
        dspark_drafter_models::load(d.path(), Arc::new(Model::load(swapped.path()).unwrap()), "swapped")
            .err()
            .unwrap()
            .to_string();
    assert!(err.contains("different tokenizer"), "{err}");
    // A DFlash checkpoint asked for as EAGLE-3.
    let err =
        dspark_drafters::load_network_drafter(Method::Eagle3, d.path(), t, "tiny").err().unwrap().to_string();
    assert!(err.contains("is a dspark drafter"), "{err}");
}

/// `export-drafter --format dspark-q8 | dspark-q4`: the 8- and 4-bit copies load through the
/// same strict loader and draft what the f32 checkpoint drafts, their logits within the storage's
/// rounding (the 4-bit one's coarser).
#[test]
fn eight_and_four_bit_copies_draft_like_their_checkpoint() {
    use dspark_drafter_models::Quant;
    let tdir = tempfile::tempdir().unwrap();
    let t = target(tdir.path(), "llama", 1);
    let d = tempfile::tempdir().unwrap();
    let o = opts(Method::Dspark, HeadKind::Markov, Some((0..60).chain([95]).collect()), BlockLayout::Dspark);
    dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap().save(d.path()).unwrap();
    std::fs::write(d.path().join("calibration.txt"), "kept").unwrap();
    let full = std::fs::metadata(d.path().join("model.safetensors")).unwrap().len();
    let a = block(dspark_drafter_models::load(d.path(), t.clone(), "tiny").unwrap());
    let taps = features(5, 2, 3);
    let (la, ta) = rust_greedy(&a, &taps, 5, 9);
    let scale = la.iter().fold(0f32, |m, x| m.max(x.abs()));
    let mut errors = Vec::new();
    let cosine = |x: &[f32], y: &[f32]| {
        let dot = |u: &[f32], v: &[f32]| u.iter().zip(v).map(|(a, b)| (a * b) as f64).sum::<f64>();
        dot(x, y) / (dot(x, x) * dot(y, y)).sqrt()
    };
    // Random weights (uniform, no outliers) are 4-bit storage's worst case; a trained drafter
    // loses ≈ 0.01 of τ in 4 bits (docs/TRAINING.md).
    for (quant, shrink, tolerance, similar) in [(Quant::Q8, 2, 0.02, 0.999), (Quant::Q4, 3, 0.5, 0.9)] {
        let q = tempfile::tempdir().unwrap();
        let bytes = dspark_drafter_models::compact(d.path(), q.path(), quant).unwrap();
        assert!(bytes * shrink < full, "{quant:?} copy {bytes} B vs {full} B");
        assert_eq!(std::fs::read_to_string(q.path().join("calibration.txt")).unwrap(), "kept");
        let b = block(dspark_drafter_models::load(q.path(), t.clone(), "tiny").unwrap());
        let (lb, tb) = rust_greedy(&b, &taps, 5, 9);
        let worst = la.iter().zip(&lb).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        let cos = cosine(&la, &lb);
        eprintln!("{quant:?}: logits moved by {worst} (largest {scale}), cosine {cos}");
        assert!(worst < tolerance * scale, "{quant:?}: logits moved by {worst} (largest {scale})");
        assert!(cos > similar, "{quant:?}: logits' cosine to the f32 checkpoint's {cos}");
        assert!(la != lb, "nothing was stored in {quant:?}");
        if quant == Quant::Q8 {
            assert_eq!(ta.tokens, tb.tokens);
        }
        errors.push(worst);
    }
    assert!(errors[1] > errors[0], "4 bits round more coarsely than 8: {errors:?}");
    // Only checkpoints of ours: a public layout keeps its own precision.
    let q = tempfile::tempdir().unwrap();
    let e = dspark_drafter_models::compact(tdir.path(), q.path(), Quant::Q8).err().unwrap().to_string();
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn batched_drafting_equals_drafting_each_alone() {
    let tdir = tempfile::tempdir().unwrap();
    let t = target(tdir.path(), "qwen2", 3);
    for o in [
        opts(Method::Dspark, HeadKind::Markov, None, BlockLayout::Dspark),
        opts(Method::Dspark, HeadKind::Rnn, Some((10..90).chain([95]).collect()), BlockLayout::Dspark),
        opts(Method::Dflash, HeadKind::Markov, None, BlockLayout::Dflash),
    ] {
        let m = block(dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap());
        let params = SamplingParams { temperature: 0.8, top_k: Some(30), top_p: None };
        let lens = [4usize, 9, 1];
        let contexts: Vec<Vec<u32>> =
            lens.iter().map(|&n| (0..=n as u32).map(|i| (i * 7 + n as u32) % 90).collect()).collect();
        let fresh = |i: usize| {
            let f = TargetFeatures { rows: lens[i], taps: features(lens[i], 2, i as u32), final_norm: None };
            BlockSeq::new(&m, &f, 100 + i as u64).unwrap()
        };
        let mut together: Vec<BlockSeq> = (0..3).map(fresh).collect();
        let mut refs: Vec<BatchEntry> =
            together.iter_mut().zip(&contexts).map(|(s, c)| (s, c.as_slice(), &params)).collect();
        let batch = propose_batch(&m, &mut refs, 4).unwrap();
        for i in 0..3 {
            let mut alone = fresh(i);
            let one =
                propose_batch(&m, &mut [(&mut alone, contexts[i].as_slice(), &params)], 4).unwrap().remove(0);
            assert_eq!(batch[i].tokens, one.tokens, "sequence {i}");
            assert_eq!(batch[i].tokens.len(), 4);
            let (a, b) =
                (batch[i].confidence.clone().unwrap_or_default(), one.confidence.unwrap_or_default());
            assert_close(&a, &b, "confidences");
        }
    }
}

/// Runs speculative decoding on the tiny target and returns the committed context as the
/// drafter last saw it (the final anchor included) and the drafts accepted.
fn run_rounds(t: &Arc<Model>, d: &mut dyn Drafter, max_tokens: usize) -> (Vec<u32>, usize) {
    /// Passes everything through, remembering what the loop told the drafter.
    struct Watch<'a> {
        d: &'a mut dyn Drafter,
        context: Vec<u32>,
        accepted: usize,
    }
    impl Drafter for Watch<'_> {
        fn name(&self) -> String {
            self.d.name()
        }
        fn taps(&self) -> dspark_model::TapSpec {
            self.d.taps()
        }
        fn begin(&mut self, prompt: &[u32], f: &TargetFeatures, seed: u64) -> dspark_spec::DraftResult<()> {
            self.context = prompt.to_vec();
            self.d.begin(prompt, f, seed)
        }
        fn propose(
            &mut self,
            context: &[u32],
            max_len: usize,
            p: &SamplingParams,
        ) -> dspark_spec::DraftResult<dspark_spec::Proposal> {
            self.d.propose(context, max_len, p)
        }
        fn observe(
            &mut self,
            context: &[u32],
            accepted: usize,
            f: &TargetFeatures,
        ) -> dspark_spec::DraftResult<()> {
            self.context = context.to_vec();
            self.accepted += accepted;
            self.d.observe(context, accepted, f)
        }
    }
    let p = SpecParams {
        max_tokens,
        draft_len: 4,
        sampling: SamplingParams { temperature: 0.9, top_k: None, top_p: None },
        seed: 5,
        stop_tokens: vec![],
        policy: dspark_schedule::Policy::Fixed,
        cost: None,
    };
    let prompt: Vec<u32> = vec![94, 3, 17, 60, 22, 8, 45];
    let mut w = Watch { d, context: vec![], accepted: 0 };
    dspark_engine::generate(t, &mut w, &prompt, &p, |_| {}).unwrap();
    (w.context, w.accepted)
}

/// Target features of every committed row but the anchor, computed in one pass.
fn features_from_scratch(t: &Model, context: &[u32], layers: &[usize]) -> TargetFeatures {
    let mut cache = t.new_cache(context.len());
    let rows: Vec<usize> = (0..context.len() - 1).collect();
    let seq = SeqInput {
        cache: &mut cache,
        tokens: &context[..context.len() - 1],
        logit_rows: vec![],
        tap_rows: rows,
    };
    let out =
        t.forward(&mut [seq], &TapSpec { layers: layers.to_vec(), final_norm: false }).unwrap().remove(0);
    TargetFeatures { rows: context.len() - 1, taps: out.taps, final_norm: None }
}

/// Feeds a drafter the features of `context` the way rounds with acceptances would: the prompt,
/// then chunks of committed rows (anchor + accepted drafts), proposing between them.
fn feed_in_chunks(d: &mut dyn Drafter, f: &TargetFeatures, context: &[u32], prompt: usize, chunks: &[usize]) {
    let rows = |a: usize, b: usize| TargetFeatures {
        rows: b - a,
        taps: f.taps.iter().map(|t| t[a * 64..b * 64].to_vec()).collect(),
        final_norm: None,
    };
    d.begin(&context[..prompt], &rows(0, prompt - 1), 3).unwrap();
    let mut len = prompt - 1;
    let params = SamplingParams { temperature: 1.0, top_k: None, top_p: None };
    for &c in chunks {
        d.propose(&context[..len + 1], 4, &params).unwrap();
        d.observe(&context[..len + c + 1], c - 1, &rows(len, len + c)).unwrap();
        len += c;
    }
    assert_eq!(len, context.len() - 1);
}

fn assert_tensors_close(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}");
    let (a, b): (Vec<f32>, Vec<f32>) =
        (a.flatten_all().unwrap().to_vec1().unwrap(), b.flatten_all().unwrap().to_vec1().unwrap());
    assert_close(&a, &b, what);
}

#[test]
fn draft_caches_after_rounds_with_rejections_equal_caches_rebuilt_from_scratch() {
    let tdir = tempfile::tempdir().unwrap();
    let t = target(tdir.path(), "llama", 8);
    let o = opts(Method::Dspark, HeadKind::Markov, None, BlockLayout::Dspark);
    let net = Arc::new(block(dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap()));
    let mut d = BlockDrafter::new(net.clone(), "dspark:tiny");
    let (context, accepted) = run_rounds(&t, &mut d, 40);
    eprintln!("DSpark: {} tokens committed, {accepted} drafts accepted", context.len());

    let rebuilt = BlockSeq::new(&net, &features_from_scratch(&t, &context, &[0, 1]), 0).unwrap();
    let live = d.state().unwrap();
    assert_eq!(live.cache.len(), context.len() - 1);
    for l in 0..2 {
        let (ka, va) = live.cache.layer(l).unwrap();
        let (kb, vb) = rebuilt.cache.layer(l).unwrap();
        assert_tensors_close(ka, kb, &format!("layer {l} keys"));
        assert_tensors_close(va, vb, &format!("layer {l} values"));
    }

    // Rounds that accept several drafts feed several rows at once.
    let chunks = [3usize, 1, 5, 2, 4, 1, 1, 5, 3];
    let prompt = context.len() - chunks.iter().sum::<usize>();
    let all = features_from_scratch(&t, &context, &[0, 1]);
    let mut chunked = BlockDrafter::new(net.clone(), "dspark:tiny");
    feed_in_chunks(&mut chunked, &all, &context, prompt, &chunks);
    for l in 0..2 {
        let (ka, va) = chunked.state().unwrap().cache.layer(l).unwrap();
        let (kb, vb) = rebuilt.cache.layer(l).unwrap();
        assert_tensors_close(ka, kb, &format!("chunked: layer {l} keys"));
        assert_tensors_close(va, vb, &format!("chunked: layer {l} values"));
    }

    let eo = InitOptions { method: Method::Eagle3, layers: 1, ..o };
    let mut e =
        Eagle3Drafter::from_net(dspark_drafter_models::init(t.clone(), "tiny", &eo).unwrap(), "eagle3:tiny")
            .unwrap();
    let (context, _) = run_rounds(&t, &mut e, 40);
    let mut fresh =
        Eagle3Drafter::from_net(dspark_drafter_models::init(t.clone(), "tiny", &eo).unwrap(), "e").unwrap();
    fresh.begin(&context, &features_from_scratch(&t, &context, &[0, 1]), 0).unwrap();
    let (a, b) = (e.cache(), fresh.cache());
    assert_eq!(a.len(), context.len() - 1);
    assert_eq!(a.len(), b.len());
    assert_tensors_close(&a.kv().unwrap().0, &b.kv().unwrap().0, "EAGLE-3 keys");
    assert_tensors_close(&a.kv().unwrap().1, &b.kv().unwrap().1, "EAGLE-3 values");
    assert_tensors_close(a.last().unwrap(), b.last().unwrap(), "EAGLE-3 last output");
    let mut chunked =
        Eagle3Drafter::from_net(dspark_drafter_models::init(t.clone(), "tiny", &eo).unwrap(), "e").unwrap();
    let prompt = context.len() - chunks.iter().sum::<usize>();
    feed_in_chunks(&mut chunked, &features_from_scratch(&t, &context, &[0, 1]), &context, prompt, &chunks);
    let c = chunked.cache();
    assert_tensors_close(&c.kv().unwrap().0, &b.kv().unwrap().0, "EAGLE-3 chunked keys");
    assert_tensors_close(c.last().unwrap(), b.last().unwrap(), "EAGLE-3 chunked last output");
}

/// Damaged drafter configs and weights are refused at load with a message, before anything is
/// allocated from them: `block_size = 100000` (360 GB), no layers, NaN weights; so is a fresh
/// drafter with an absurd block (`dspark init-drafter --block 100000`).
#[test]
fn damaged_drafter_checkpoints_are_refused_before_allocating() {
    let tdir = tempfile::tempdir().unwrap();
    let t = target(tdir.path(), "llama", 1);
    let mut huge = opts(Method::Dspark, HeadKind::Markov, None, BlockLayout::Dspark);
    huge.gamma = 100_000;
    let err = dspark_drafter_models::init(t.clone(), "tiny", &huge).err().expect("refused").to_string();
    assert!(err.contains("block_size is 100000"), "{err}");
    let good = tempfile::tempdir().unwrap();
    dspark_drafter_models::init(
        t.clone(),
        "tiny",
        &opts(Method::Dspark, HeadKind::Markov, None, BlockLayout::Dspark),
    )
    .unwrap()
    .save(good.path())
    .unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(good.path().join("config.json")).unwrap()).unwrap();
    for (key, v, says) in [
        ("block_size", serde_json::json!(100_000), "block_size is 100000"),
        ("block_size", serde_json::json!(0), "block_size is 0"),
        ("num_hidden_layers", serde_json::json!(0), "num_hidden_layers is 0"),
        ("num_key_value_heads", serde_json::json!(0), "num_key_value_heads is 0"),
        ("num_key_value_heads", serde_json::json!(3), "cannot share"),
        ("hidden_size", serde_json::json!(1u64 << 40), "hidden_size is"),
        ("target_layer_ids", serde_json::json!([]), "target_layer_ids"),
        ("mask_token_id", serde_json::json!(1_000_000), "mask_token_id"),
    ] {
        let d = tempfile::tempdir().unwrap();
        std::fs::copy(good.path().join("model.safetensors"), d.path().join("model.safetensors")).unwrap();
        let mut c = cfg.clone();
        c[key] = v;
        std::fs::write(d.path().join("config.json"), c.to_string()).unwrap();
        let err =
            dspark_drafter_models::load(d.path(), t.clone(), "tiny").err().expect("refused").to_string();
        assert!(err.contains(says) && err.contains("init-drafter"), "{key}: `{err}` should say `{says}`");
    }
    // NaN in a weight.
    let mut map: std::collections::HashMap<String, Tensor> =
        candle_core::safetensors::load(good.path().join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let name = map.keys().find(|k| k.contains("layers.0") && k.ends_with("weight")).unwrap().clone();
    let w = &map[&name];
    let mut v: Vec<f32> =
        w.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    v[3] = f32::NAN;
    let nan = Tensor::from_vec(v, w.dims(), &candle_core::Device::Cpu).unwrap().to_dtype(w.dtype()).unwrap();
    map.insert(name.clone(), nan);
    candle_core::safetensors::save(&map, good.path().join("model.safetensors")).unwrap();
    let err = dspark_drafter_models::load(good.path(), t, "tiny").err().expect("NaN refused").to_string();
    assert!(err.contains(&name) && err.contains("NaN"), "{err}");
}
