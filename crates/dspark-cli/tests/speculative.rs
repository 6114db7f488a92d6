//! Speculative decoding is lossless: greedy output is token-for-token plain greedy output with
//! every drafter, and sampled output follows the target's distribution.

mod common;

use dspark_decode::{generate, GenerateParams};
use dspark_drafters::{DraftModel, NgramDrafter};
use dspark_model::{Model, SeqInput, TapSpec};
use dspark_sampling::{Sampler, SamplingParams};
use dspark_spec::{generate_spec, verify, DraftDist, Drafter, SpecParams};

fn bench_prompts(file: &str, field: &str, n: usize) -> Vec<String> {
    let p = common::shared().join("data/bench").join(file);
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .take(n)
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()[field].as_str().unwrap().to_string())
        .collect()
}

/// 50 GSM8K and 50 MBPP prompts through the chat template.
fn math_and_code(m: &Model, n_each: usize) -> Vec<Vec<u32>> {
    let mut texts = bench_prompts("gsm8k-test.jsonl", "question", n_each);
    texts.extend(bench_prompts("mbpp-test.jsonl", "text", n_each));
    texts.iter().map(|t| m.tokenizer.encode(&m.chat_prompt(t).unwrap(), true).unwrap()).collect()
}

fn plain(m: &Model, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let p = GenerateParams {
        max_tokens,
        sampling: SamplingParams::default(),
        seed: 0,
        stop_tokens: m.tokenizer.eos().to_vec(),
    };
    generate(m, prompt, &p, |_| {}).unwrap().tokens
}

fn spec(m: &Model, d: &mut dyn Drafter, prompt: &[u32], max_tokens: usize, gamma: usize) -> (Vec<u32>, f64) {
    let p = SpecParams {
        max_tokens,
        draft_len: gamma,
        sampling: SamplingParams::default(),
        seed: 0,
        stop_tokens: m.tokenizer.eos().to_vec(),
    };
    let r = generate_spec(m, d, prompt, &p, |_| {}).unwrap();
    (r.tokens, r.stats.tau())
}

#[test]
fn greedy_ngram_output_is_plain_greedy_output_on_100_prompts() {
    let m = Model::load(&common::model("smollm2-135m")).unwrap();
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
    let m = Model::load(&common::model("smollm2-135m")).unwrap();
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
    let m = Model::load(&path).unwrap();
    let mut d = DraftModel::new(Model::load(&path).unwrap(), "smollm2-135m", &m).unwrap();
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
fn a_draft_model_with_another_vocabulary_is_refused() {
    let m = Model::load(&common::model("smollm2-135m")).unwrap();
    let other = Model::load(&common::model("qwen2.5-coder-0.5b")).unwrap();
    let err = DraftModel::new(other, "qwen2.5-coder-0.5b", &m).err().unwrap().to_string();
    assert!(err.contains("different vocabulary"), "{err}");
}

#[test]
#[ignore = "opt-in: installs the 1.1 GB Qwen2.5-Coder-1.5B; run with `cargo test --release -- --ignored`"]
fn greedy_qwen_pair_output_is_plain_greedy_output_on_100_prompts() {
    let m = Model::load(&common::model("qwen2.5-coder-1.5b")).unwrap();
    let dm = Model::load(&common::model("qwen2.5-coder-0.5b")).unwrap();
    let mut d = DraftModel::new(dm, "qwen2.5-coder-0.5b", &m).unwrap();
    for (i, prompt) in math_and_code(&m, 50).iter().enumerate() {
        let want = plain(&m, prompt, 32);
        let (got, _) = spec(&m, &mut d, prompt, 32, 5);
        assert_eq!(got, want, "prompt {i}");
    }
}

/// Upper critical value of χ² with `k` degrees of freedom at p = 0.001 (Wilson–Hilferty).
fn chi2_critical(k: f64) -> f64 {
    let z = 3.090; // one-sided 0.1 %
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[test]
fn sampled_verification_follows_real_smollm2_distributions() {
    let m = Model::load(&common::model("smollm2-135m")).unwrap();
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
        // χ² over tokens with expected count ≥ 5; the rest pooled into one bin.
        let (mut chi2, mut bins, mut pool_e, mut pool_o) = (0.0, 0usize, 0.0, 0.0);
        for t in 0..v {
            let e = pt[t] * n as f64;
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
            assert!(
                pool_o <= 5.0 + 3.0 * pool_e.sqrt() + 5.0,
                "case {ci}: {pool_o} draws outside the target's support"
            );
        }
        let outside: usize = (0..v).filter(|&t| pt[t] == 0.0).map(|t| counts[t]).sum();
        assert_eq!(outside, 0, "case {ci}: tokens the target gives probability 0 were committed");
        let crit = chi2_critical((bins - 1) as f64);
        eprintln!(
            "case {ci}: χ² {chi2:.1} on {} dof (critical {crit:.1}), acceptance {:.2}",
            bins - 1,
            accepted as f64 / n as f64
        );
        assert!(chi2 < crit, "case {ci}: χ² {chi2} ≥ {crit}");
        assert!((accepted as f64 / n as f64) < 0.9, "the drafter should be poor");
    }
}

#[test]
fn sampled_speculative_runs_repeat_with_the_same_seed() {
    let m = Model::load(&common::model("smollm2-135m")).unwrap();
    let prompt = m.tokenizer.encode(&m.chat_prompt("Write a limerick about rust.").unwrap(), true).unwrap();
    let p = SpecParams {
        max_tokens: 40,
        draft_len: 4,
        sampling: SamplingParams { temperature: 0.8, top_k: Some(40), top_p: Some(0.9) },
        seed: 7,
        stop_tokens: m.tokenizer.eos().to_vec(),
    };
    let path = common::model("smollm2-135m");
    let mut d = DraftModel::new(Model::load(&path).unwrap(), "self", &m).unwrap();
    let a = generate_spec(&m, &mut d, &prompt, &p, |_| {}).unwrap().tokens;
    let b = generate_spec(&m, &mut d, &prompt, &p, |_| {}).unwrap().tokens;
    assert_eq!(a, b);
}
