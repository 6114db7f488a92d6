//! DFlash, DSpark and EAGLE-3 drafters on SmolLM2, randomly initialised: greedy output equals
//! plain greedy output, and sampled drafts report exactly the distributions they were drawn
//! from, so verification keeps the target's distribution.

mod common;

use common::{math_and_code, plain, spec};
use dspark_drafter_models::{BlockLayout, HeadKind, InitOptions, Method};
use dspark_drafters::{BlockDrafter, Eagle3Drafter};
use dspark_engine::SpecParams;
use dspark_model::{Model, SeqInput, TapSpec};
use dspark_sampling::{Sampler, SamplingParams};
use dspark_spec::{verify, DraftDist, Drafter, TargetFeatures};
use std::sync::Arc;

fn smollm2() -> Arc<Model> {
    Arc::new(Model::load(&common::model("smollm2-135m")).unwrap())
}

/// A fresh drafter with quantized drafting weights, as `--drafter` loads them.
fn drafter(m: &Arc<Model>, o: &InitOptions) -> Box<dyn Drafter> {
    let mut net = dspark_drafter_models::init(m.clone(), "smollm2-135m", o).unwrap();
    net.quantize_for_inference().unwrap();
    match o.method {
        Method::Eagle3 => Box::new(Eagle3Drafter::from_net(net, "eagle3").unwrap()),
        _ => Box::new(BlockDrafter::from_net(net, &format!("{}", o.method)).unwrap()),
    }
}

/// The `n` most frequent tokens, counting the tokens of the sampling test's text first.
fn reduced(m: &Model, n: usize) -> Option<Vec<u32>> {
    let mut counts = std::collections::HashMap::new();
    for t in m.tokenizer.encode(HELLO, false).unwrap() {
        *counts.entry(t).or_insert(0) += 1;
    }
    Some(dspark_drafter_models::frequent_tokens(m, &counts, n).unwrap())
}

const HELLO: &str = "hello hello hello hello hello hello hello hello";

#[test]
fn greedy_output_with_every_network_drafter_is_plain_greedy_output_on_50_prompts() {
    let m = smollm2();
    let base = InitOptions { gamma: 4, ..Default::default() };
    let kinds = [
        ("dspark-markov", InitOptions { ..base.clone() }),
        (
            "dspark-rnn-8k",
            InitOptions { head: HeadKind::Rnn, draft_vocab: reduced(&m, 8192), ..base.clone() },
        ),
        ("dflash", InitOptions { method: Method::Dflash, layout: BlockLayout::Dflash, ..base.clone() }),
        ("eagle3-8k", InitOptions { method: Method::Eagle3, draft_vocab: reduced(&m, 8192), ..base.clone() }),
    ];
    let mut drafters: Vec<(&str, Box<dyn Drafter>)> =
        kinds.iter().map(|(n, o)| (*n, drafter(&m, o))).collect();
    let prompts = math_and_code(&m, 25);
    assert_eq!(prompts.len(), 50);
    for (i, prompt) in prompts.iter().enumerate() {
        let want = plain(&m, prompt, 20);
        for (name, d) in drafters.iter_mut() {
            let (got, _) = spec(&m, d.as_mut(), prompt, 20, 4);
            assert_eq!(got, want, "prompt {i}, {name}: speculative output differs from plain greedy");
        }
    }
}

#[test]
fn greedy_repeating_dspark_accepts_whole_blocks_and_matches_plain_output() {
    // Accepted multi-token blocks feed several committed rows back at once.
    let m = smollm2();
    let o = InitOptions { gamma: 4, std: 0.28, draft_vocab: reduced(&m, 4096), ..Default::default() };
    let mut d = repeating(&m, &o);
    let prompt = m.tokenizer.encode(HELLO, false).unwrap();
    let want = plain(&m, &prompt, 40);
    let (got, tau) = spec(&m, d.as_mut(), &prompt, 40, 4);
    assert_eq!(got, want);
    assert!(tau > 1.05, "τ {tau}: the repeating drafter should be accepted on the repeated words");
    // Verifying only confident prefixes, or only what pays on a cost curve (cheap verification,
    // where Algorithm 1 verifies much; dear, where it stops drafting; this machine's, measured),
    // changes what is verified, never the output.
    let table = |per_token: f64, draft: f64| dspark_schedule::CostTable {
        model: "tiny".into(),
        drafter: None,
        threads: 1,
        forward: (1..=5).map(|b| (b, 0.01 + per_token * (b - 1) as f64)).collect(),
        draft: vec![(1, draft)],
    };
    let measured = dspark_engine::profile_one(&m, "tiny", d.as_mut(), 4, 2, |_| {}).unwrap();
    assert_eq!(measured.forward.len(), 5, "forwards of 1 to γ + 1 tokens");
    assert!(
        measured.validate().is_ok() && measured.draft_s(1) > 0.0,
        "a DSpark round is timed: {measured:?}"
    );
    use dspark_schedule::Policy;
    let policies = [
        (Policy::Threshold(0.2), None),
        (Policy::Threshold(0.6), None),
        (Policy::Threshold(0.95), None),
        (Policy::Dspark, Some(table(0.0005, 0.001))),
        (Policy::Dspark, Some(table(0.02, 0.005))),
        (Policy::Dspark, Some(measured.clone())),
        (Policy::DsparkAsync, Some(measured)),
    ];
    let mut verified = Vec::new();
    for (policy, cost) in policies {
        let p = SpecParams {
            max_tokens: 40,
            draft_len: 4,
            sampling: SamplingParams::default(),
            seed: 0,
            stop_tokens: m.tokenizer.eos().to_vec(),
            policy,
            cost,
        };
        let r = dspark_engine::generate(&m, d.as_mut(), &prompt, &p, |_| {}).unwrap();
        assert_eq!(r.tokens, want, "policy {policy}");
        verified.push(r.stats.verified_len.iter().enumerate().map(|(k, n)| k * n).sum::<usize>());
    }
    // The plan follows the table: where a verified token costs twice a forward, nothing pays.
    assert!(verified[3] > 0 && verified[4] < verified[3], "drafts verified per policy: {verified:?}");
    let p = SpecParams {
        max_tokens: 4,
        draft_len: 4,
        sampling: SamplingParams::default(),
        seed: 0,
        stop_tokens: vec![],
        policy: Policy::Dspark,
        cost: None,
    };
    let e = dspark_engine::generate(&m, d.as_mut(), &prompt, &p, |_| {}).unwrap_err().to_string();
    assert!(e.contains("cost table"), "{e}");
}

/// Sampled drafting from a fixed context, many times: the first draft's empirical distribution
/// must be its reported one, the second's (given the most frequent first) its reported one, and
/// the first committed token must follow the target's distribution — through acceptances and
/// rejections alike when `must_accept`.
fn check_sampled(m: &Arc<Model>, mut d: Box<dyn Drafter>, what: &str, must_accept: bool) {
    let params = SamplingParams { temperature: 0.7, top_k: Some(20), top_p: None };
    // A repetitive text, on which the drafter below proposes what the target expects.
    let prompt = m.tokenizer.encode(HELLO, false).unwrap();
    begin(m, d.as_mut(), &prompt, 1);
    let mut cache = m.new_cache(prompt.len());
    let logits = m
        .forward(&mut [SeqInput::logits_last(&mut cache, &prompt)], &TapSpec::default())
        .unwrap()
        .remove(0)
        .logits;
    let (v, n) = (m.vocab_size(), 3000);
    let pt = params.distribution(&logits);
    let mut rng = Sampler::new(9);
    let (mut first, mut committed) = (vec![0usize; v], vec![0usize; v]);
    let mut reported1: Option<Vec<f64>> = None;
    let mut accepted = 0;
    let mut second: std::collections::HashMap<u32, (Vec<usize>, Vec<f64>, usize)> = Default::default();
    for _ in 0..n {
        let p = d.propose(&prompt, 2, &params).unwrap();
        assert_eq!(p.len(), 2);
        let dense = |x: &DraftDist| match x {
            DraftDist::Dense(q) => q.clone(),
            DraftDist::OneHot => panic!("sampled drafts must report their distribution"),
        };
        let (q1, q2) = (dense(&p.dists[0]), dense(&p.dists[1]));
        assert!((q1.iter().sum::<f64>() - 1.0).abs() < 1e-9 && q1[p.tokens[0] as usize] > 0.0);
        match &reported1 {
            None => reported1 = Some(q1.clone()),
            Some(r) => {
                assert_eq!(r, &q1, "{what}: the first draft's distribution changed with the same context")
            }
        }
        first[p.tokens[0] as usize] += 1;
        let e = second.entry(p.tokens[0]).or_insert_with(|| (vec![0; v], q2.clone(), 0));
        assert_eq!(e.1, q2, "{what}: the second draft's distribution must depend only on the first token");
        e.0[p.tokens[1] as usize] += 1;
        e.2 += 1;
        let verdict = verify(|_| &logits[..], &p.tokens[..1], &p.dists[..1], &params, &mut rng);
        accepted += verdict.accepted;
        committed[if verdict.accepted == 1 { p.tokens[0] } else { verdict.next } as usize] += 1;
    }
    common::chi2_check(&first, reported1.as_ref().unwrap(), n, &format!("{what}: first draft vs reported"));
    let (_, (counts, q2, k)) = second.iter().max_by_key(|(_, e)| e.2).unwrap();
    common::chi2_check(counts, q2, *k, &format!("{what}: second draft vs reported"));
    common::chi2_check(&committed, &pt, n, &format!("{what}: committed vs target"));
    eprintln!("{what}: first draft accepted {accepted} of {n} times");
    assert!(
        !must_accept || accepted > n / 10,
        "{what}: too few acceptances ({accepted}) to test the accepting path"
    );
    if second.iter().filter(|(_, e)| e.2 > 0).count() > 1 {
        let mut qs = second.values().map(|e| &e.1);
        let q0 = qs.next().unwrap();
        assert!(
            qs.any(|q| q != q0),
            "{what}: the Markov/RNN head must make the second draft depend on the first"
        );
    }
}

#[test]
fn sampled_dspark_drafts_are_exact_with_markov_and_rnn_heads_full_and_reduced_vocabulary() {
    let m = smollm2();
    // W1 rows of norm² ≈ 5: the repeat bias is strong but leaves other tokens a chance.
    let base = InitOptions { gamma: 3, std: 0.28, ..Default::default() };
    let rnn = InitOptions { head: HeadKind::Rnn, ..base.clone() };
    for (what, o) in [
        ("markov, full vocabulary", base.clone()),
        ("markov, 4k vocabulary", InitOptions { draft_vocab: reduced(&m, 4096), ..base.clone() }),
        ("rnn, full vocabulary", rnn.clone()),
        ("rnn, 4k vocabulary", InitOptions { draft_vocab: reduced(&m, 4096), ..rnn.clone() }),
    ] {
        check_sampled(&m, repeating(&m, &o), what, true);
    }
}

/// A DSpark drafter whose backbone contributes nothing (zero weights, zero final norm: raw
/// logits 0) and whose sequential head is set to favour repeating the previous token
/// (`W2 = W1`, so the bias is `W1[x]·W1[y]`, largest for y = x). On a repetitive text that is
/// what the target expects, so drafts are often but not always accepted; the confidence head
/// stays random.
fn repeating(m: &Arc<Model>, o: &InitOptions) -> Box<dyn Drafter> {
    use candle_core::{Device, Tensor};
    let dir = tempfile::tempdir().unwrap();
    dspark_drafter_models::init(m.clone(), "smollm2-135m", o).unwrap().save(dir.path()).unwrap();
    let st = dir.path().join("model.safetensors");
    let mut map = candle_core::safetensors::load(&st, &Device::Cpu).unwrap();
    let rows_of = |w1: &Tensor| match &o.draft_vocab {
        Some(ids) => w1.index_select(&Tensor::new(ids.as_slice(), &Device::Cpu).unwrap(), 0).unwrap(),
        None => w1.clone(),
    };
    let r = o.rank;
    for (name, t) in map.clone() {
        let zero = t.zeros_like().unwrap();
        let layer_weight = name.starts_with("layers.") && !name.ends_with("layernorm.weight");
        if name == "fc.weight" || name == "norm.weight" || layer_weight {
            map.insert(name, zero);
        } else if name == "markov_head.markov_w1.weight" {
            map.insert("markov_head.markov_w2.weight".into(), rows_of(&t));
        } else if name == "markov_head.joint_proj.weight" {
            // Output gate o = W1[x]: identity from the embedding slice of [s; W1[x]; h].
            let (rows, cols) = t.dims2().unwrap();
            let v: Vec<f32> = (0..rows * cols)
                .map(|i| if i / cols >= 2 * r && i % cols == i / cols - r { 1.0 } else { 0.0 })
                .collect();
            map.insert(name, Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap());
        } else if name == "markov_head.joint_proj.bias" {
            map.insert(name, zero);
        }
    }
    candle_core::safetensors::save(&map, &st).unwrap();
    let mut net = dspark_drafter_models::load(dir.path(), m.clone(), "smollm2-135m").unwrap();
    if o.head == HeadKind::Rnn {
        net.quantize_for_inference().unwrap(); // quantized drafting weights for the RNN cases
    }
    Box::new(BlockDrafter::from_net(net, "dspark").unwrap())
}

/// Prefills `prompt` but its last token (the first anchor) and starts `d` on its features, as
/// the decode loop does.
fn begin(m: &Model, d: &mut dyn Drafter, prompt: &[u32], seed: u64) {
    let n = prompt.len() - 1;
    let mut cache = m.new_cache(prompt.len());
    let seq =
        SeqInput { cache: &mut cache, tokens: &prompt[..n], logit_rows: vec![], tap_rows: (0..n).collect() };
    let out = m.forward(&mut [seq], &d.taps()).unwrap().remove(0);
    d.begin(prompt, &TargetFeatures { rows: n, taps: out.taps, final_norm: out.final_norm }, seed).unwrap();
}

#[test]
fn sampled_eagle3_drafts_report_their_exact_distributions() {
    let m = smollm2();
    let o = InitOptions {
        method: Method::Eagle3,
        gamma: 3,
        draft_vocab: reduced(&m, 4096),
        ..Default::default()
    };
    let net = dspark_drafter_models::init(m.clone(), "smollm2-135m", &o).unwrap();
    // A random EAGLE-3 drafter is almost never accepted: this checks what it reports.
    check_sampled(
        &m,
        Box::new(Eagle3Drafter::from_net(net, "eagle3").unwrap()),
        "eagle3, 4k vocabulary",
        false,
    );
}

#[test]
fn init_drafter_then_generate_through_the_cli_equals_plain_output() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("dspark-rnn");
    let d = d.to_str().unwrap();
    let made = common::dspark(&[
        "init-drafter",
        "--head",
        "rnn",
        "--draft-vocab",
        "8192",
        "--block",
        "5",
        "--out",
        d,
    ]);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let args =
        ["generate", "--prompt", "Write a function that reverses a list.", "--max-tokens", "24", "--json"];
    let plain = common::dspark_json(&args);
    let spec = format!("dspark:{d}");
    let mut with = args.to_vec();
    with.extend(["--drafter", spec.as_str()]);
    let got = common::dspark_json(&with);
    assert_eq!(got["tokens"], plain["tokens"]);
    // γ defaults to the checkpoint's block (5), not the n-gram default (3): every draft verified
    // (a random drafter's predicted survival falls under the default threshold at once).
    with.extend(["--min-survival", "0"]);
    let got = common::dspark_json(&with);
    assert_eq!(got["tokens"], plain["tokens"]);
    let (drafted, rounds) =
        (got["stats"]["drafted"].as_f64().unwrap(), got["stats"]["rounds"].as_f64().unwrap());
    assert!(drafted / rounds > 3.5, "{drafted} drafts in {rounds} rounds");
}
