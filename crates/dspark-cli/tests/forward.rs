//! The forward API on the real default model: ragged batches, taps, KV rollback, limits.

mod common;

use dspark_model::{KvCache, Model, SeqInput, SeqOutput, TapSpec};

fn smollm2() -> Model {
    Model::load(&common::model("smollm2-135m")).unwrap()
}

fn tokens(m: &Model, text: &str) -> Vec<u32> {
    m.tokenizer.encode(&m.chat_prompt(text).unwrap(), true).unwrap()
}

fn taps() -> TapSpec {
    TapSpec { layers: vec![0, 14, 29], final_norm: true }
}

fn run_alone(m: &Model, prefix: &[u32], new: &[u32]) -> SeqOutput {
    let mut cache = m.new_cache(512);
    if !prefix.is_empty() {
        m.forward(&mut [SeqInput::logits_last(&mut cache, prefix)], &TapSpec::default()).unwrap();
    }
    let rows: Vec<usize> = (0..new.len()).collect();
    let mut seq = [SeqInput { cache: &mut cache, tokens: new, logit_rows: rows.clone(), tap_rows: rows }];
    m.forward(&mut seq, &taps()).unwrap().remove(0)
}

fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(worst <= tol, "{what}: max difference {worst}");
}

#[test]
fn ragged_batch_equals_each_sequence_alone() {
    let m = smollm2();
    // Three sequences at different lengths: a decode step, a verify block and a prefill chunk.
    let a = tokens(&m, "What is the capital of France?");
    let b = tokens(&m, "Write a Python function that reverses a list.");
    let c = tokens(&m, "Explain photosynthesis to a child in three sentences, please.");
    let cases: [(&[u32], &[u32]); 3] =
        [(&a[..a.len() - 1], &a[a.len() - 1..]), (&b[..b.len() - 6], &b[b.len() - 6..]), (&[], &c[..])];
    let alone: Vec<SeqOutput> = cases.iter().map(|(p, n)| run_alone(&m, p, n)).collect();

    let mut caches: Vec<KvCache> = (0..3).map(|_| m.new_cache(512)).collect();
    for ((p, _), cache) in cases.iter().zip(caches.iter_mut()) {
        if !p.is_empty() {
            m.forward(&mut [SeqInput::logits_last(cache, p)], &TapSpec::default()).unwrap();
        }
    }
    let mut seqs: Vec<SeqInput> = cases
        .iter()
        .zip(caches.iter_mut())
        .map(|((_, n), cache)| {
            let rows: Vec<usize> = (0..n.len()).collect();
            SeqInput { cache, tokens: n, logit_rows: rows.clone(), tap_rows: rows }
        })
        .collect();
    let batched = m.forward(&mut seqs, &taps()).unwrap();
    for (i, (x, y)) in alone.iter().zip(&batched).enumerate() {
        assert_close(&x.logits, &y.logits, 1e-4, &format!("seq {i} logits"));
        for (l, (tx, ty)) in x.taps.iter().zip(&y.taps).enumerate() {
            assert_close(tx, ty, 1e-4, &format!("seq {i} tap {l}"));
        }
        assert_close(x.final_norm.as_ref().unwrap(), y.final_norm.as_ref().unwrap(), 1e-4, "final norm");
    }
    for (c, (p, n)) in caches.iter().zip(&cases) {
        assert_eq!(c.len(), p.len() + n.len());
    }
}

#[test]
fn truncate_then_forward_equals_a_fresh_forward() {
    let m = smollm2();
    let t = tokens(&m, "Count from one to ten in French.");
    let keep = t.len() - 4;
    // Run the whole prompt plus a fake rejected draft, roll back, then continue.
    let mut cache = m.new_cache(256);
    let mut with_draft = t.clone();
    with_draft.extend([1234, 5678, 910]);
    m.forward(&mut [SeqInput::logits_last(&mut cache, &with_draft)], &TapSpec::default()).unwrap();
    cache.truncate(keep).unwrap();
    assert_eq!(cache.len(), keep);
    let rolled = m.forward(&mut [SeqInput::logits_all(&mut cache, &t[keep..])], &TapSpec::default()).unwrap();
    let fresh = run_alone(&m, &t[..keep], &t[keep..]);
    assert_close(&rolled[0].logits, &fresh.logits, 1e-4, "after truncate");
    assert!(cache.truncate(cache.len() + 1).is_err(), "truncate must not grow a cache");
}

#[test]
fn final_norm_tap_through_the_lm_head_gives_the_logits() {
    // Drafters rely on the taps being the real hidden states of the rows they name.
    let m = smollm2();
    let t = tokens(&m, "Hello!");
    let out = run_alone(&m, &[], &t);
    let d = m.config.hidden;
    let h = out.final_norm.as_ref().unwrap();
    assert_eq!(h.len(), t.len() * d);
    assert_eq!(out.taps.len(), 3);
    assert!(out.taps.iter().all(|tap| tap.len() == t.len() * d));
    let logits = m.lm_head_logits(h, t.len()).unwrap();
    assert_close(&logits, &out.logits, 1e-4, "lm_head(final_norm) vs logits");
    // A different row's hidden state gives different logits: rows are not mixed up.
    let shifted = m.lm_head_logits(&h[..d], 1).unwrap();
    assert!(shifted
        .iter()
        .zip(out.logits_row(t.len() - 1, m.vocab_size()))
        .any(|(a, b)| (a - b).abs() > 1e-2));
}

#[test]
fn exceeding_context_or_capacity_is_a_clear_error() {
    let m = smollm2();
    let mut small = m.new_cache(4);
    let err = m.forward(&mut [SeqInput::logits_last(&mut small, &[1, 2, 3, 4, 5])], &TapSpec::default());
    let msg = err.err().unwrap().to_string();
    assert!(msg.contains("KV cache holds 4"), "{msg}");
    let bad = m.forward(&mut [SeqInput::logits_last(&mut m.new_cache(8), &[u32::MAX])], &TapSpec::default());
    assert!(bad.err().unwrap().to_string().contains("outside the vocabulary"));
}

/// What makes greedy speculative output equal plain greedy output: a verify block's rows are the
/// single-token decode steps' results, bit for bit. 70 rows cross the kernels' 64-row pass and
/// attention's 64-row block.
#[test]
fn block_rows_equal_single_token_steps_bit_for_bit() {
    let m = smollm2();
    let prompt = tokens(&m, "Write a Python function that reverses a list, then explain it.");
    let block: Vec<u32> = (0..70u32).map(|i| 400 + 37 * i).collect();
    let mut cache = m.new_cache(512);
    m.forward(&mut [SeqInput::logits_last(&mut cache, &prompt)], &TapSpec::default()).unwrap();
    let together = m.forward(&mut [SeqInput::logits_all(&mut cache, &block)], &TapSpec::default()).unwrap();
    cache.truncate(prompt.len()).unwrap();
    let v = m.vocab_size();
    for (i, t) in block.iter().enumerate() {
        let one =
            m.forward(&mut [SeqInput::logits_all(&mut cache, std::slice::from_ref(t))], &TapSpec::default());
        let one = one.unwrap().remove(0);
        assert_eq!(one.logits, together[0].logits_row(i, v), "row {i}");
    }
}
