//! Training data: ShareGPT's truncated file, disjointness from benchmarks, and regeneration
//! that does not depend on batch size or interruptions.

use dspark_model::testing::{weights, write_hf, Tiny};
use dspark_model::Model;
use dspark_train::data::{read_samples, regen_sampling, regenerate, select_prompts, sharegpt_first_turns};

#[test]
fn sharegpt_is_read_record_by_record_up_to_the_truncation() {
    let text = r#"[{"id": "a", "conversations": [{"from": "human", "value": "first?"}, {"from": "gpt", "value": "x"}]},
 {"id": "b", "conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "second"}]},
 {"id": "c", "conversations": []},
 {"id": "d", "conversations": [{"from": "human", "value": "cut off mid-rec"#;
    assert_eq!(sharegpt_first_turns(text), vec!["first?".to_string(), "second".to_string()]);
}

#[test]
fn prompts_are_deduplicated_and_disjoint_from_benchmarks() {
    let bench = vec!["What is the sum of 2 and 3, written as a word?".to_string()];
    let cands = vec![
        "Tell me about   Rust's borrow checker".to_string(),
        "tell me about rust's borrow checker".to_string(),
        "what is the sum of 2 and 3, written as a word?".to_string(),
        "Please answer: What is the sum of 2 and 3, written as a word? Thanks".to_string(),
        "hi".to_string(),
        "Explain the difference between TCP and UDP".to_string(),
    ];
    let kept = select_prompts(cands, &bench, 16, 1000);
    assert_eq!(
        kept,
        vec!["Tell me about   Rust's borrow checker", "Explain the difference between TCP and UDP"]
    );
}

#[test]
fn regeneration_is_the_same_for_any_batch_size_and_after_an_interruption() {
    let dir = tempfile::tempdir().unwrap();
    let t = Tiny { family: "llama", hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, layers: 2, ffn: 96 };
    write_hf(dir.path(), &t, &weights(&t, 9));
    let m = Model::load(dir.path()).unwrap();
    let prompts: Vec<String> =
        ["a b c", "d e", "f g h i", "j", "k l m"].iter().map(|s| s.to_string()).collect();
    let p = regen_sampling();
    let one = dir.path().join("one.jsonl");
    regenerate(&m, &prompts, &one, 12, 1, 5, &p, |_, _| {}).unwrap();
    let four = dir.path().join("four.jsonl");
    // Interrupted: only the first two prompts, and a half-written line left behind.
    regenerate(&m, &prompts[..2], &four, 12, 4, 5, &p, |_, _| {}).unwrap();
    let mut f = std::fs::OpenOptions::new().append(true).open(&four).unwrap();
    std::io::Write::write_all(&mut f, b"{\"index\": 2, \"tok").unwrap();
    let n = regenerate(&m, &prompts, &four, 12, 4, 5, &p, |_, _| {}).unwrap();
    assert_eq!(n, 3, "only the missing prompts are answered");
    let sorted = |path| {
        let mut v = read_samples(path).unwrap();
        v.sort_by_key(|s| s.index);
        v.into_iter().map(|s| (s.index, s.tokens, s.prompt_len)).collect::<Vec<_>>()
    };
    let (a, b) = (sorted(&one), sorted(&four));
    assert_eq!(a.len(), 5);
    assert_eq!(a, b);
    assert!(a.iter().all(|(_, toks, pl)| toks.len() > *pl), "every prompt got an answer");
}
