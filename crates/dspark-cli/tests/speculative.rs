//! Speculative decoding is lossless: greedy output is token-for-token plain greedy output with
//! every drafter, and sampled output follows the target's distribution.

mod common;

use common::{math_and_code, plain, spec};
use dspark_drafters::{DraftModel, NgramDrafter};
use dspark_engine::{generate as generate_spec, SpecParams};
use dspark_model::{Model, SeqInput, TapSpec};
use dspark_sampling::{Sampler, SamplingParams};
use dspark_spec::{verify, DraftDist, Drafter};

#[test]
fn greedy_ngram_output_is_plain_greedy_output_on_100_prompts() {
    let m = std::sync::Arc::new(Model::load(&common::model("smollm2-135m")).unwrap());
    let mut total_tau = 0.0;
    let prompts = math_and_code(&m, 50);
    assert_eq!(prompts.len(), 100);
    for (i, prompt) in prompts.iter().enumerate() {
        let want = plain(&m, prompt, 48);
        let (got, tau) = spec(&m, &mut NgramDrafter::default(), prompt, 48, 4);
        assert_eq!(got, want, "prompt {i}: speculative output differs from plain greedy");
        total_tau += tau;
    }
    eprintln!("ngram mean τ {:.2}", total_tau / prompts.len() as f64);
}

#[test]
fn greedy_identity_at_gamma_1_and_16_with_max_tokens_mid_block() {
    let m = std::sync::Arc::new(Model::load(&common::model("smollm2-135m")).unwrap());
    for prompt in math_and_code(&m, 5) {
        // 37 is not a multiple of any round length here, so the last round is cut mid-block.
        let want = plain(&m, &prompt, 37);
        for gamma in [1, 16] {
            let (got, _) = spec(&m, &mut NgramDrafter { max_n: 2, min_n: 1 }, &prompt, 37, gamma);
            assert_eq!(got, want, "γ = {gamma}");
        }
    }
}

#[test]
fn self_drafting_accepts_whole_blocks_and_stops_at_eos_inside_one() {
    // The target drafting for itself: every draft is accepted, so blocks are full, max_tokens
    // is reached mid-block and EOS arrives inside an accepted block.
    let path = common::model("smollm2-135m");
    let m = std::sync::Arc::new(Model::load(&path).unwrap());
    // Drafting every γ, however unsure: full blocks are what this test is about.
    let mut d = DraftModel::new(Model::load(&path).unwrap(), "smollm2-135m", &m).unwrap().with_min_p(0.0);
    let eos = m.tokenizer.eos().to_vec();
    let short = m
        .tokenizer
        .encode(&m.chat_prompt("What is 2 + 2? Answer with just the number.").unwrap(), true)
        .unwrap();
    let want = plain(&m, &short, 64);
    assert!(want.len() < 64, "the short prompt should end with EOS, got {} tokens", want.len());
    let (got, tau) = spec(&m, &mut d, &short, 64, 6);
    assert_eq!(got, want);
    assert!(!got.iter().any(|t| eos.contains(t)), "EOS must not be emitted");
    assert!(tau > 2.0, "self-drafting should accept nearly everything, τ {tau}");
    for prompt in math_and_code(&m, 2) {
        let want = plain(&m, &prompt, 29);
        let (got, tau) = spec(&m, &mut d, &prompt, 29, 7);
        assert_eq!(got, want);
        assert!(tau > 4.0, "τ {tau}");
    }
}

#[test]
fn a_draft_model_stops_before_a_draft_it_is_unsure_of_and_the_output_is_unchanged() {
    let path = common::model("smollm2-135m");
    let m = std::sync::Arc::new(Model::load(&path).unwrap());
    let greedy = SamplingParams::default();
    let unsure = 0.9f32;
    let mut shorter = 0;
    for prompt in math_and_code(&m, 3) {
        let mut all = DraftModel::new(Model::load(&path).unwrap(), "self", &m).unwrap().with_min_p(0.0);
        let mut sure = DraftModel::new(Model::load(&path).unwrap(), "self", &m).unwrap().with_min_p(unsure);
        all.begin(&prompt, &Default::default(), 0).unwrap();
        sure.begin(&prompt, &Default::default(), 0).unwrap();
        let every = all.propose(&prompt, 8, &greedy).unwrap().tokens;
        let kept = sure.propose(&prompt, 8, &greedy).unwrap().tokens;
        assert_eq!(every.len(), 8);
        assert_eq!(kept[..], every[..kept.len()], "the stopping rule only shortens the draft");
        // The draft model is the target: the next token's top probability is read off its logits.
        let mut cache = m.new_cache(prompt.len() + 16);
        let ctx: Vec<u32> = prompt.iter().chain(&every[..kept.len()]).copied().collect();
        let logits = m.forward(&mut [SeqInput::logits_last(&mut cache, &ctx)], &TapSpec::default()).unwrap();
        let l = &logits[0].logits;
        let top = l.iter().fold(f32::MIN, |a, &b| a.max(b));
        let p_top = 1.0 / l.iter().map(|x| (x - top).exp()).sum::<f32>();
        if kept.len() < 8 {
            shorter += 1;
            assert!(p_top < unsure, "stopped before a draft of top probability {p_top}");
        }
        let want = plain(&m, &prompt, 40);
        let (got, _) = spec(&m, &mut sure, &prompt, 40, 6);
        assert_eq!(got, want);
    }
    assert!(shorter > 0, "at {unsure}, some draft of these prompts should have stopped early");
}

#[test]
fn a_requantized_draft_model_is_close_to_its_file_and_keeps_the_output() {
    use candle_core::quantized::GgmlDType;
    let path = common::model("smollm2-135m");
    let m = std::sync::Arc::new(Model::load(&path).unwrap());
    let prompt = &math_and_code(&m, 1)[0];
    let last = |model: &Model| {
        let mut cache = model.new_cache(prompt.len());
        model.forward(&mut [SeqInput::logits_last(&mut cache, prompt)], &TapSpec::default()).unwrap()[0]
            .logits
            .clone()
    };
    let want = last(&m);
    let spread = want.iter().fold(0f32, |a, &b| a.max(b.abs()));
    let mut err = Vec::new();
    for format in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let q = Model::load_requantized(&path, format).unwrap();
        let got = last(&q);
        let e = got.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        assert!(e > 0.0 && e < 0.25 * spread, "{format:?}: logits off by {e} (largest {spread})");
        err.push(e);
        let mut d = DraftModel::new(q, "self-requantized", &m).unwrap();
        for prompt in math_and_code(&m, 2) {
            assert_eq!(spec(&m, &mut d, &prompt, 32, 5).0, plain(&m, &prompt, 32), "{format:?}");
        }
    }
    assert!(err[1] > err[0], "4 bits should round coarser than 8 (errors {err:?}): was Q4_0 used?");
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    let m = std::sync::Arc::new(Model::load(&common::model("smollm2-135m")).unwrap());
    let other = Model::load(&common::model("qwen2.5-coder-0.5b")).unwrap();
    let err = DraftModel::new(other, "qwen2.5-coder-0.5b", &m).err().unwrap().to_string();
    assert!(err.contains("different vocabulary"), "{err}");
}

#[test]
#[ignore = "opt-in: installs the 1.1 GB Qwen2.5-Coder-1.5B; run with `cargo test --release -- --ignored`"]
fn greedy_qwen_pair_output_is_plain_greedy_output_on_100_prompts() {
    let m = std::sync::Arc::new(Model::load(&common::model("qwen2.5-coder-1.5b")).unwrap());
    let dm = Model::load(&common::model("qwen2.5-coder-0.5b")).unwrap();
    let mut d = DraftModel::new(dm, "qwen2.5-coder-0.5b", &m).unwrap();
    for (i, prompt) in math_and_code(&m, 50).iter().enumerate() {
        let want = plain(&m, prompt, 32);
        let (got, _) = spec(&m, &mut d, prompt, 32, 5);
        assert_eq!(got, want, "prompt {i}");
    }
}

#[test]
#[ignore = "opt-in: installs the 1.1 GB Qwen2.5-Coder-1.5B; run with `cargo test --release -- --ignored`"]
fn greedy_output_with_the_shipped_qwen_dspark_drafter_is_plain_greedy_output() {
    let m = std::sync::Arc::new(Model::load(&common::model("qwen2.5-coder-1.5b")).unwrap());
    let dir = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for tests"),
    )
    .join("../../drafters/qwen2.5-coder-1.5b-dspark-markov");
    let mut d = dspark_drafters::load_network_drafter(
        dspark_drafter_models::Method::Dspark,
        &dir,
        m.clone(),
        "qwen2.5-coder-1.5b",
    )
    .unwrap();
    for (i, prompt) in math_and_code(&m, 10).iter().enumerate() {
        let want = plain(&m, prompt, 48);
        let (got, _) = spec(&m, d.as_mut(), prompt, 48, 7);
        assert_eq!(got, want, "prompt {i}");
    }
}

#[test]
fn sampled_verification_follows_real_smollm2_distributions() {
    let m = std::sync::Arc::new(Model::load(&common::model("smollm2-135m")).unwrap());
    let v = m.vocab_size();
    let prompt =
        m.tokenizer.encode(&m.chat_prompt("Tell me a short story about a cat.").unwrap(), true).unwrap();
    let mut cache = m.new_cache(prompt.len());
    let logits = m
        .forward(&mut [SeqInput::logits_last(&mut cache, &prompt)], &TapSpec::default())
        .unwrap()
        .remove(0)
        .logits;
    // A deliberately poor drafter: the target's logits reversed in rank order, hot.
    let poor: Vec<f32> = logits.iter().map(|x| -x * 0.3).collect();
    let cases = [
        SamplingParams { temperature: 1.0, top_k: None, top_p: None },
        SamplingParams { temperature: 0.7, top_k: Some(20), top_p: None },
        SamplingParams { temperature: 1.0, top_k: None, top_p: Some(0.8) },
        SamplingParams { temperature: 0.7, top_k: Some(20), top_p: Some(0.8) },
    ];
    let n = 20_000;
    for (ci, params) in cases.iter().enumerate() {
        let pt = params.distribution(&logits);
        // The drafter proposes from a mix of the poor distribution and the target's support so
        // that some drafts are accepted and many are rejected.
        let pd_raw = SamplingParams { temperature: 1.0, top_k: Some(200), top_p: None }.distribution(&poor);
        let pd: Vec<f64> = pd_raw.iter().zip(&pt).map(|(a, b)| 0.7 * a + 0.3 * b).collect();
        let mut draw = Sampler::new(1000 + ci as u64);
        let mut rng = Sampler::new(2000 + ci as u64);
        let dist = [DraftDist::Dense(pd.clone())];
        let mut counts = vec![0usize; v];
        let mut accepted = 0;
        for _ in 0..n {
            let x = draw.draw(&pd) as u32;
            let verdict = verify(|_| &logits[..], &[x], &dist, params, &mut rng);
            let first = if verdict.accepted == 1 { x } else { verdict.next };
            accepted += verdict.accepted;
            counts[first as usize] += 1;
        }
        common::chi2_check(&counts, &pt, n, &format!("case {ci}"));
        eprintln!("case {ci}: acceptance {:.2}", accepted as f64 / n as f64);
        assert!((accepted as f64 / n as f64) < 0.9, "the drafter should be poor");
    }
}

#[test]
fn sampled_speculative_runs_repeat_with_the_same_seed() {
    let m = std::sync::Arc::new(Model::load(&common::model("smollm2-135m")).unwrap());
    let prompt = m.tokenizer.encode(&m.chat_prompt("Write a limerick about rust.").unwrap(), true).unwrap();
    let p = SpecParams {
        max_tokens: 40,
        draft_len: 4,
        sampling: SamplingParams { temperature: 0.8, top_k: Some(40), top_p: Some(0.9) },
        seed: 7,
        stop_tokens: m.tokenizer.eos().to_vec(),
        policy: dspark_schedule::Policy::Fixed,
        cost: None,
    };
    let path = common::model("smollm2-135m");
    let mut d = DraftModel::new(Model::load(&path).unwrap(), "self", &m).unwrap();
    let a = generate_spec(&m, &mut d, &prompt, &p, |_| {}).unwrap().tokens;
    let b = generate_spec(&m, &mut d, &prompt, &p, |_| {}).unwrap().tokens;
    assert_eq!(a, b);
}

/// A drafter whose drafts are never accepted, counting the rows it is fed.
struct Hopeless {
    token: u32,
    fed_rows: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl dspark_spec::Drafter for Hopeless {
    fn name(&self) -> String {
        "hopeless".into()
    }
    fn begin(&mut self, _: &[u32], f: &dspark_spec::TargetFeatures, _: u64) -> dspark_spec::DraftResult<()> {
        self.fed_rows.store(f.rows, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn propose(
        &mut self,
        _: &[u32],
        n: usize,
        _: &SamplingParams,
    ) -> dspark_spec::DraftResult<dspark_spec::Proposal> {
        Ok(dspark_spec::Proposal {
            tokens: vec![self.token; n],
            dists: vec![DraftDist::OneHot; n],
            confidence: None,
        })
    }
    fn observe(
        &mut self,
        _: &[u32],
        _: usize,
        f: &dspark_spec::TargetFeatures,
    ) -> dspark_spec::DraftResult<()> {
        self.fed_rows.fetch_add(f.rows, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn taps(&self) -> TapSpec {
        TapSpec { layers: vec![1], final_norm: false }
    }
}

/// `--drafter auto`: a model drafter that never pays is soon not asked at all (plain steps,
/// probed again now and then), prompt lookup still drafts where it matches, the output is still
/// plain greedy output, and the model drafter is fed every row that entered the cache, late,
/// when it drafts again.
#[test]
fn auto_stops_asking_a_drafter_that_does_not_pay_and_keeps_the_output() {
    let m = std::sync::Arc::new(Model::load(&common::model("smollm2-135m")).unwrap());
    // A control token the chat never produces: every draft is rejected.
    let token = m.tokenizer.token_id("<|im_start|>").unwrap();
    for prompt in math_and_code(&m, 2) {
        let want = plain(&m, &prompt, 96);
        let fed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let hopeless = Hopeless { token, fed_rows: fed.clone() };
        let mut d = dspark_drafters::AutoDrafter::new(Some(Box::new(hopeless)), 3);
        let p = SpecParams {
            max_tokens: 96,
            draft_len: 7,
            sampling: SamplingParams::default(),
            seed: 0,
            stop_tokens: m.tokenizer.eos().to_vec(),
            policy: dspark_schedule::Policy::Fixed,
            cost: None,
        };
        let r = generate_spec(&m, &mut d, &prompt, &p, |_| {}).unwrap();
        assert_eq!(r.tokens, want);
        assert!(
            d.empty_rounds >= 2 * d.model_rounds,
            "{} plain steps, {} rounds of the model drafter",
            d.empty_rounds,
            d.model_rounds
        );
        // Every plain step is one the drafter proposed nothing for, except a last step at
        // max_tokens, where the loop asks for no drafts.
        let untimed = r.stats.plain_steps - d.empty_rounds;
        assert!(untimed <= 1, "{} plain steps, {} empty rounds", r.stats.plain_steps, d.empty_rounds);
        // Fed rows never exceed what entered the cache.
        let fed = fed.load(std::sync::atomic::Ordering::SeqCst);
        assert!(fed <= prompt.len() - 1 + r.tokens.len(), "fed {fed}");
    }
}

/// `--drafter auto` as `bench decode` and `eval` use it: one drafter, prompt after prompt, with
/// the shipped DSpark drafter inside. Each sequence starts clean (no rows held back from the last
/// one reach the model drafter), rounds go to prompt lookup or to the DSpark drafter (fed every
/// row either way), and the output is plain greedy output.
#[test]
fn auto_with_the_shipped_drafter_runs_prompt_after_prompt() {
    let m = std::sync::Arc::new(Model::load(&common::model("smollm2-135m")).unwrap());
    let dir = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for tests"),
    )
    .join("../../drafters/smollm2-135m-dspark-markov");
    let net = dspark_drafters::load_network_drafter(
        dspark_drafter_models::Method::Dspark,
        &dir,
        m.clone(),
        "smollm2-135m",
    )
    .unwrap();
    let mut d = dspark_drafters::AutoDrafter::new(Some(net), 3);
    // A copying prompt, where prompt lookup matches and competes with the confidence head.
    let copy = "Repeat this list exactly, one item per line: apple, banana, cherry, damson, elderberry, \
                fig, grape, honeydew, apple, banana, cherry, damson, elderberry, fig, grape, honeydew.";
    let mut prompts = math_and_code(&m, 3);
    prompts.push(m.tokenizer.encode(&m.chat_prompt(copy).unwrap(), true).unwrap());
    for prompt in prompts {
        let (tokens, _) = spec(&m, &mut d, &prompt, 64, 7);
        assert_eq!(tokens, plain(&m, &prompt, 64));
    }
    assert!(d.model_rounds > 0, "the DSpark drafter drafted");
    assert!(d.lookup_over_model_rounds > 0, "prompt lookup won some rounds against the confidence head");
}

/// `generate --policy dspark` measures its cost table once per model, drafter, γ and machine and
/// reuses it after (a second start costs no profiling); `--reprofile` measures again. The output
/// is plain greedy output every time.
#[test]
fn generate_keeps_the_measured_cost_table_and_reuses_it() {
    let model = common::model("smollm2-135m");
    let drafter = common::data().join("../drafters/smollm2-135m-dspark-markov");
    let home = std::env::temp_dir().join(format!("dspark-profiles-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate".to_string(),
            "-m".into(),
            model.display().to_string(),
            "--prompt".into(),
            "def fibonacci(n):".into(),
            "--max-tokens".into(),
            "24".into(),
            "--json".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_dspark"))
            .args(&args)
            .env("DSPARK_HOME", &home)
            .output()
            .expect("run dspark");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "dspark {args:?}: {stderr}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        (common::ids(&v["tokens"]), stderr)
    };
    let (want, _) = run(&["--drafter", "none"]);
    let spec =
        ["--drafter", &format!("dspark:{}", drafter.display()), "--policy", "dspark"].map(String::from);
    let spec: Vec<&str> = spec.iter().map(|s| s.as_str()).collect();
    let (first, log) = run(&spec);
    assert!(log.contains("measured in"), "the first start measures: {log}");
    let kept: Vec<_> = std::fs::read_dir(home.join("profiles")).expect("a profiles folder").collect();
    assert_eq!(kept.len(), 1, "one table kept");
    let (second, log) = run(&spec);
    assert!(log.contains("cost table: reusing") && !log.contains("measured in"), "the second reuses: {log}");
    let (third, log) = run(&[spec.as_slice(), &["--reprofile"]].concat());
    assert!(log.contains("measured in"), "--reprofile measures again: {log}");
    for got in [first, second, third] {
        assert_eq!(got, want, "speculative output = plain greedy output");
    }
    let _ = std::fs::remove_dir_all(&home);
}
