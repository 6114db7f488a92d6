//! The public drafter checkpoints in `data/golden/drafters/` run through the `Drafter` interface
//! the engine uses: the target's own taps (including DeepSpec's layer −1, the embedding output,
//! and SafeAILab's code-fixed layers) reach the drafter, round 0 proposes what the official code
//! drafted, and speculative greedy decoding with each of them gives the plain greedy output.

use dspark_drafters::{BlockDrafter, Eagle3Drafter};
use dspark_engine::{generate as generate_spec, SpecParams};
use dspark_model::{Model, SeqInput};
use dspark_sampling::SamplingParams;
use dspark_spec::{Drafter, TargetFeatures};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn golden() -> PathBuf {
    std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for tests"),
    )
    .join("../../data/golden/drafters")
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn drafter(dir: &Path, t: &Arc<Model>) -> Box<dyn Drafter> {
    let net = dspark_drafter_models::load(dir, t.clone(), "target").unwrap();
    match net.method() {
        dspark_drafter_models::Method::Eagle3 => Box::new(Eagle3Drafter::from_net(net, "e").unwrap()),
        _ => Box::new(BlockDrafter::from_net(net, "b").unwrap()),
    }
}

/// Plain greedy decoding, one token per forward.
fn greedy(t: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = t.new_cache(64);
    let mut next = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < n {
        let logits = t.forward(&mut [SeqInput::logits_last(&mut cache, &next)], &Default::default()).unwrap()
            [0]
        .logits
        .clone();
        let tok = logits.iter().enumerate().fold(0, |b, (i, &x)| if x > logits[b] { i } else { b }) as u32;
        out.push(tok);
        next = vec![tok];
    }
    out
}

#[test]
fn public_drafters_propose_the_official_drafts_and_keep_greedy_output() {
    let t = Arc::new(Model::load(&golden().join("target")).unwrap());
    let params = |draft_len| SpecParams {
        max_tokens: 12,
        draft_len,
        sampling: SamplingParams::default(),
        seed: 0,
        stop_tokens: Vec::new(),
        policy: dspark_schedule::Policy::Fixed,
        cost: None,
    };
    let mut plain: Option<Vec<u32>> = None;
    for (variant, model, drafts_key) in [
        ("deepspec-dspark-markov", "model", "draft_tokens"),
        ("deepspec-dspark-rnn", "model", "draft_tokens"),
        ("deepspec-dflash", "model", "draft_tokens"),
        ("zlab-dflash", "model", "draft_tokens"),
        ("deepspec-eagle3", "model", "draft_tokens"),
        ("safeailab-eagle3", "model", "step_argmax_target_ids"),
    ] {
        let o = json(&golden().join(variant).join("outputs.json"));
        let prompt = ids(&o["prompt_ids"]);
        let want = ids(&o["rounds"][0][drafts_key]);
        let mut d = drafter(&golden().join(variant).join(model), &t);
        // Round 0 as the engine runs it: the cache holds the prompt, the anchor is the target's
        // greedy token after it.
        let mut cache = t.new_cache(64);
        let mut seq = SeqInput::logits_last(&mut cache, &prompt);
        seq.tap_rows = (0..prompt.len()).collect();
        let out = t.forward(&mut [seq], &d.taps()).unwrap().remove(0);
        let mut context = prompt.clone();
        context.push(o["anchor_token"].as_u64().unwrap() as u32);
        let features = TargetFeatures { rows: prompt.len(), taps: out.taps, final_norm: out.final_norm };
        d.begin(&context, &features, 0).unwrap();
        let p = d.propose(&context, want.len(), &SamplingParams::default()).unwrap();
        assert_eq!(p.tokens, want, "{variant}: round-0 drafts");

        let mut d = drafter(&golden().join(variant).join(model), &t);
        let run = generate_spec(&t, d.as_mut(), &prompt, &params(want.len()), |_| {}).unwrap();
        let plain = plain.get_or_insert_with(|| greedy(&t, &prompt, 12));
        assert_eq!(&run.tokens, plain, "{variant}: speculative greedy output");
    }
}
