//! `dspark eval`: the τ bookkeeping against a drafter whose acceptance pattern is known, and a
//! small run over all nine benchmarks whose output files parse.

mod common;

use dspark_eval::benchmarks::{Benchmark, Domain};
use dspark_eval::{evaluate, EvalConfig, EvalDrafter};
use dspark_model::{Model, TapSpec};
use dspark_sampling::SamplingParams;
use dspark_spec::{DraftDist, DraftResult, Drafter, Proposal, TargetFeatures};

/// Knows plain greedy decoding's answer; proposes its next `right` tokens, then one wrong one.
/// Every round with room for more than `right` drafts therefore accepts exactly `right`.
struct Planted {
    answer: Vec<u32>,
    prompt_len: usize,
    right: usize,
    vocab: u32,
}

impl Drafter for Planted {
    fn name(&self) -> String {
        "planted".into()
    }

    fn taps(&self) -> TapSpec {
        TapSpec::default()
    }

    fn begin(&mut self, prompt: &[u32], _: &TargetFeatures, _: u64) -> DraftResult<()> {
        self.prompt_len = prompt.len();
        Ok(())
    }

    fn propose(&mut self, context: &[u32], max_len: usize, _: &SamplingParams) -> DraftResult<Proposal> {
        let at = context.len() - self.prompt_len;
        let mut tokens: Vec<u32> = self.answer[at..].iter().copied().take(self.right.min(max_len)).collect();
        if max_len > tokens.len() {
            let truth = self.answer.get(at + tokens.len()).copied().unwrap_or(0);
            tokens.push((truth + 1) % self.vocab);
        }
        let dists = vec![DraftDist::OneHot; tokens.len()];
        Ok(Proposal { tokens, dists, confidence: None })
    }

    fn observe(&mut self, _: &[u32], _: usize, _: &TargetFeatures) -> DraftResult<()> {
        Ok(())
    }
}

#[test]
fn tau_and_per_position_acceptance_match_a_planted_pattern() {
    let m = std::sync::Arc::new(Model::load(&common::model("smollm2-135m")).unwrap());
    let text = "Write a long story about a lighthouse keeper and a storm.";
    let prompt = m.tokenizer.encode(&m.chat_prompt(text).unwrap(), true).unwrap();
    let answer = common::plain(&m, &prompt, 30);
    assert_eq!(answer.len(), 30, "the story must run to max_tokens for the pattern to be exact");
    let bench = Benchmark {
        name: "story".into(),
        domain: Domain::Chat,
        prompts: vec![text.into()],
        source: "test".into(),
    };
    let planted = Planted { answer, prompt_len: 0, right: 2, vocab: m.vocab_size() as u32 };
    let mut drafters = vec![EvalDrafter {
        name: "planted".into(),
        drafter: Box::new(planted),
        gamma: 4,
        scaling: None,
        sweep_max: None,
    }];
    let cfg = EvalConfig { max_tokens: 30, sampling: SamplingParams::default(), seed: 0, sweep: vec![] };
    let r = evaluate(&m, &[bench], &mut drafters, &cfg, |_| {}).unwrap();
    let d = &r.drafters[0];
    // The prefill yields the first token; the other 29 come in rounds of 2 accepted + 1
    // correction (9 rounds, 27 tokens), then a round with room for one draft (right) and the
    // bonus: 10 rounds, τ = 29 / 10; position 3 (the planted wrong token) always rejected.
    let s = &d.per_bench[0];
    assert_eq!((s.rounds, s.accepted, s.generated_tokens, s.plain_steps), (10, 19, 30, 0));
    assert!((d.macro_tau() - 2.9).abs() < 1e-12, "{}", d.macro_tau());
    assert_eq!(s.accept_at(), vec![1.0, 1.0, 0.0]);
    assert_eq!((s.drafted, s.reached_at.clone()), (28, vec![10, 9, 9]));
    let json = r.to_json("test", "smollm2-135m");
    assert_eq!(json["drafters"]["planted"]["tau"]["story"], 2.9);
    assert_eq!(json["drafters"]["planted"]["accept_at"]["chat"], serde_json::json!([1.0, 1.0, 0.0]));
    assert!(r.tau_md().contains("| planted (4) | 2.900 | **2.900** |"), "{}", r.tau_md());
}

#[test]
fn a_small_run_over_the_nine_benchmarks_writes_files_that_parse() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("eval");
    let drafter = format!(
        "dspark=dspark:{}/../../drafters/smollm2-135m-dspark-markov,ngram=ngram",
        std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for tests")
    );
    let o = common::dspark(&[
        "eval",
        "--drafters",
        &drafter,
        "--n",
        "1",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--sweep",
        "3,7",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(v["benchmarks"].as_array().unwrap().len(), 9);
    for d in ["dspark", "ngram"] {
        let tau = v["drafters"][d]["tau"].as_object().unwrap();
        assert_eq!(tau.len(), 9);
        assert!(tau.values().all(|t| t.as_f64().unwrap() >= 1.0), "{tau:?}");
        assert!(v["drafters"][d]["macro_tau"].as_f64().unwrap() >= 1.0);
        assert_eq!(v["drafters"][d]["accept_at"].as_object().unwrap().len(), 3, "math, code, chat");
        assert!(v["drafters"][d]["tok_s"].as_f64().unwrap() > 0.0);
    }
    assert!(v["drafters"]["dspark"]["ece"]["shipped"].as_array().unwrap().len() == 7);
    assert_eq!(v["drafters"]["dspark"]["tau_by_block"].as_object().unwrap().len(), 2);
    assert!(v["plain_tok_s"].as_f64().unwrap() > 0.0);
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("livecodebench-sub") && md.contains("SUBSTITUTE"));
    for f in ["acceptance.svg", "reliability-dspark.svg", "tau_vs_block.svg"] {
        assert!(std::fs::read_to_string(out.join(f)).unwrap().starts_with("<svg"), "{f}");
    }
}

#[test]
fn eval_refuses_unknown_benchmarks_and_drafters() {
    let o = common::dspark(&["eval", "--bench", "nope", "--drafters", "x=ngram", "--n", "1"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a known benchmark"));
    let o = common::dspark(&["eval", "--drafters", "x", "--n", "1"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("NAME=SPEC"));
}
