//! Our drafters written in the public layouts (DeepSpec, z-lab DFlash, SafeAILab / vLLM
//! EAGLE-3) load back through the strict loader, as that layout, and draft what the original
//! drafts on a prompt: the same tokens, logits and calibrated confidences. A layout whose code
//! would compute something else is refused with the reason.

use dspark_drafter_models::export::{export, PublicFormat};
use dspark_drafter_models::{
    BlockLayout, ContextCache, DraftTrace, DrafterNet, EagleCache, Format, HeadKind, InitOptions, Method,
};
use dspark_model::testing::{weights, write_hf, Tiny};
use dspark_model::{Model, SeqInput, TapSpec};
use std::path::Path;
use std::sync::Arc;

const PROMPT: [u32; 9] = [5, 17, 3, 60, 41, 8, 22, 70, 13];

fn target(dir: &Path, family: &'static str) -> Arc<Model> {
    let head_dim = if family == "qwen3" { 32 } else { 16 };
    let t = Tiny { family, hidden: 64, heads: 4, kv_heads: 2, head_dim, layers: 6, ffn: 96 };
    write_hf(dir, &t, &weights(&t, 7));
    Arc::new(Model::load(dir).unwrap())
}

fn opts(method: Method, head: HeadKind, vocab: Option<Vec<u32>>, layout: BlockLayout) -> InitOptions {
    InitOptions {
        method,
        layers: 2,
        intermediate: None,
        gamma: 4,
        head,
        rank: 8,
        draft_vocab: vocab,
        target_layers: Some(if method == Method::Eagle3 { vec![0, 2, 4] } else { vec![1, 3] }),
        mask_token: Some(93),
        layout,
        std: 0.3,
        seed: 5,
    }
}

/// A fresh drafter saved in our format, with calibration temperatures and offsets when it has a
/// confidence head, and loaded back as any checkpoint is.
fn ours(t: &Arc<Model>, o: &InitOptions, dir: &Path) -> DrafterNet {
    let net = dspark_drafter_models::init(t.clone(), "tiny", o).unwrap();
    net.save(dir).unwrap();
    if net.config().ext().confidence {
        let path = dir.join("config.json");
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        c["dspark"]["calibration_temperatures"] = serde_json::json!([0.5, 1.5, 2.0, 0.75]);
        c["dspark"]["calibration_biases"] = serde_json::json!([-1.0, 0.5, 0.0, 0.25]);
        std::fs::write(&path, c.to_string()).unwrap();
    }
    dspark_drafter_models::load(dir, t.clone(), "tiny").unwrap()
}

/// Round 0 on `PROMPT`: the target's features of the prompt, its greedy next token as anchor.
fn drafts(net: &DrafterNet, t: &Model, n: usize) -> DraftTrace {
    let mut cache = t.new_cache(32);
    let mut seq = SeqInput::logits_last(&mut cache, &PROMPT);
    seq.tap_rows = (0..PROMPT.len()).collect();
    let taps = TapSpec { layers: net.config().target_layer_ids.clone(), final_norm: false };
    let out = t.forward(&mut [seq], &taps).unwrap().remove(0);
    let anchor = argmax(&out.logits) as u32;
    let greedy = |_: usize, row: &[f32]| Ok(argmax(row));
    match net {
        DrafterNet::Block(m) => {
            let mut c = ContextCache::default();
            m.extend(&mut c, &out.taps, PROMPT.len()).unwrap();
            let hidden = m.block_hidden(&[(&c, anchor)]).unwrap();
            let raw = m.raw_logits(&hidden).unwrap();
            m.draft(&hidden, &raw, anchor, n, greedy).unwrap()
        }
        DrafterNet::Eagle3(m) => {
            let mut c = EagleCache::default();
            let next: Vec<u32> = PROMPT[1..].iter().copied().chain([anchor]).collect();
            m.extend(&mut c, &out.taps, PROMPT.len(), &next).unwrap();
            m.draft(&c, n, greedy).unwrap()
        }
    }
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold(0, |b, (i, &x)| if x > row[b] { i } else { b })
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

/// Exports `o`'s drafter in `format`, loads it back and compares.
fn round_trip(t: &Arc<Model>, o: &InitOptions, format: PublicFormat, as_format: Format) {
    let what = format!("{:?} {:?} {:?} -> {format:?}", o.method, o.head, o.layout);
    let (src, dst) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let net = ours(t, o, src.path());
    export(&net, t, format, dst.path()).unwrap_or_else(|e| panic!("{what}: {e}"));
    let back =
        dspark_drafter_models::load(dst.path(), t.clone(), "tiny").unwrap_or_else(|e| panic!("{what}: {e}"));
    let (c, b) = (net.config(), back.config());
    assert_eq!(b.format, as_format, "{what}: read as");
    assert_eq!(b.ext().method, c.ext().method, "{what}");
    assert_eq!(b.ext().head, c.ext().head, "{what}");
    assert_eq!(b.ext().layout, c.ext().layout, "{what}");
    assert_eq!(b.ext().calibration_temperatures, c.ext().calibration_temperatures, "{what}");
    assert_eq!(b.ext().calibration_biases, c.ext().calibration_biases, "{what}");
    assert_eq!(b.ext().target, c.ext().target, "{what}");
    assert_eq!(b.target_layer_ids, c.target_layer_ids, "{what}");
    assert_eq!(back.vocab().target_ids(), net.vocab().target_ids(), "{what}");
    let n = c.gamma();
    let (want, got) = (drafts(&net, t, n), drafts(&back, t, n));
    assert_eq!(got.tokens, want.tokens, "{what}: drafts");
    let d = max_diff(&got.logits.concat(), &want.logits.concat());
    assert!(d < 1e-4, "{what}: logits differ by {d}");
    match (&got.confidence, &want.confidence) {
        (Some(g), Some(w)) => assert!(max_diff(g, w) < 1e-5, "{what}: confidences {g:?} vs {w:?}"),
        (None, None) => {}
        _ => panic!("{what}: the confidence head did not survive"),
    }
}

#[test]
fn our_drafters_load_back_from_every_public_layout_and_draft_the_same() {
    let (qd, ld) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (qwen3, llama) = (target(qd.path(), "qwen3"), target(ld.path(), "llama"));
    let reduced = Some((0..96u32).filter(|i| i % 3 != 1).collect::<Vec<_>>());
    use BlockLayout::{Dflash, Dspark};
    use HeadKind::{Markov, Rnn};
    for t in [&qwen3, &llama] {
        round_trip(
            t,
            &opts(Method::Dspark, Markov, reduced.clone(), Dspark),
            PublicFormat::DeepSpec,
            Format::DeepSpec,
        );
        round_trip(t, &opts(Method::Dspark, Rnn, None, Dspark), PublicFormat::DeepSpec, Format::DeepSpec);
        round_trip(t, &opts(Method::Dflash, Markov, None, Dspark), PublicFormat::DeepSpec, Format::DeepSpec);
        round_trip(
            t,
            &opts(Method::Dflash, Markov, reduced.clone(), Dflash),
            PublicFormat::Zlab,
            Format::Zlab,
        );
        round_trip(
            t,
            &opts(Method::Eagle3, Markov, reduced.clone(), Dspark),
            PublicFormat::DeepSpec,
            Format::DeepSpec,
        );
    }
    // SafeAILab's and vLLM's EAGLE-3 layers are LLaMA's (no QK norm).
    round_trip(
        &llama,
        &opts(Method::Eagle3, Markov, reduced.clone(), Dspark),
        PublicFormat::Eagle3,
        Format::SafeAiLab,
    );
    round_trip(&llama, &opts(Method::Eagle3, Markov, None, Dspark), PublicFormat::Eagle3, Format::SafeAiLab);
}

#[test]
fn layouts_whose_code_would_compute_something_else_are_refused() {
    let (qd, ld) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (qwen3, llama) = (target(qd.path(), "qwen3"), target(ld.path(), "llama"));
    use BlockLayout::{Dflash, Dspark};
    for (t, o, format, says) in [
        (
            &llama,
            opts(Method::Dspark, HeadKind::Markov, None, Dspark),
            PublicFormat::Zlab,
            "no Markov/RNN or confidence head",
        ),
        (&llama, opts(Method::Dflash, HeadKind::Markov, None, Dspark), PublicFormat::Zlab, "MASK-only"),
        (
            &llama,
            opts(Method::Dflash, HeadKind::Markov, None, Dflash),
            PublicFormat::DeepSpec,
            "use --format zlab",
        ),
        (
            &llama,
            opts(Method::Dspark, HeadKind::Markov, None, Dspark),
            PublicFormat::Eagle3,
            "use --format deepspec or zlab",
        ),
        (
            &llama,
            opts(Method::Eagle3, HeadKind::Markov, None, Dspark),
            PublicFormat::Zlab,
            "use --format eagle3 or deepspec",
        ),
        (&qwen3, opts(Method::Eagle3, HeadKind::Markov, None, Dspark), PublicFormat::Eagle3, "QK norm"),
        (
            &llama,
            InitOptions {
                target_layers: Some(vec![1, 5]),
                ..opts(Method::Dspark, HeadKind::Markov, None, Dspark)
            },
            PublicFormat::DeepSpec,
            "target layer 5 (the last)",
        ),
    ] {
        let net = dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let err = export(&net, t, format, dir.path())
            .err()
            .unwrap_or_else(|| panic!("{format:?} accepted"))
            .to_string();
        assert!(err.contains(says), "`{err}` should say `{says}`");
        assert!(!dir.path().join("config.json").exists(), "a refused export wrote nothing");
    }
}
