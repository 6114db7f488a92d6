//! Training data: ShareGPT's truncated file, disjointness from benchmarks, and regeneration
//! that does not depend on batch size or interruptions.

use dspark_model::testing::{weights, write_hf, Tiny};
use dspark_model::Model;
use dspark_train::data::{
    is_code_prompt, read_samples, regen_sampling, regenerate, select_prompts, sharegpt_first_turns,
};

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
    regenerate(&m, &prompts, 0, &one, 12, 1, 5, &p, None, |_, _| {}).unwrap();
    let four = dir.path().join("four.jsonl");
    // Interrupted: only the first two prompts, and a half-written line left behind.
    regenerate(&m, &prompts[..2], 0, &four, 12, 4, 5, &p, None, |_, _| {}).unwrap();
    let mut f = std::fs::OpenOptions::new().append(true).open(&four).unwrap();
    std::io::Write::write_all(&mut f, b"{\"index\": 2, \"tok").unwrap();
    // A run over a later range (`--skip 3`) keeps the prompts' own indices.
    let n = regenerate(&m, &prompts, 3, &four, 12, 4, 5, &p, None, |_, _| {}).unwrap();
    assert_eq!(n, 2, "only the prompts from --skip on are answered");
    let n = regenerate(&m, &prompts, 0, &four, 12, 4, 5, &p, None, |_, _| {}).unwrap();
    assert_eq!(n, 1, "only the missing prompt is answered");
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

#[test]
fn features_captured_while_regenerating_are_the_features_of_a_prefill() {
    use dspark_train::features::{build, FeatureCache, FeatureWriter};
    let dir = tempfile::tempdir().unwrap();
    let t = Tiny { family: "llama", hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, layers: 2, ffn: 96 };
    write_hf(dir.path(), &t, &weights(&t, 9));
    let m = Model::load(dir.path()).unwrap();
    // The last prompt leaves too little room within the 40-token window and is skipped.
    let long = (0..30).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    let prompts: Vec<String> =
        ["a b c", "d e", "f g h i", long.as_str()].iter().map(|s| s.to_string()).collect();
    let (layers, window) = ([0usize, 1], 40);
    let captured = dir.path().join("captured");
    let out = dir.path().join("regen.jsonl");
    let mut w = FeatureWriter::open(&captured, 64, &layers, window).unwrap();
    let n = regenerate(&m, &prompts, 0, &out, 64, 3, 5, &regen_sampling(), Some(&mut w), |_, _| {}).unwrap();
    drop(w);
    let samples = read_samples(&out).unwrap();
    assert_eq!(n, 3, "the over-long prompt is skipped");
    assert!(samples.iter().all(|s| s.tokens.len() <= window), "answers stop at the window");
    assert!(
        samples.iter().any(|s| s.tokens.len() == window),
        "some answer reaches it: the closing row is captured"
    );
    let prefilled = dir.path().join("prefilled");
    build(&m, &samples, &layers, window, &prefilled, |_, _| {}).unwrap();
    let (a, b) = (FeatureCache::open(&captured).unwrap(), FeatureCache::open(&prefilled).unwrap());
    for s in &samples {
        let len = s.tokens.len();
        let (fa, na) = a.get(s.index, &layers, len).unwrap().expect("captured every row");
        let (fb, nb) = b.get(s.index, &layers, len).unwrap().expect("built");
        let flat = |t: candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(flat(fa), flat(fb), "sample {}: tapped layers", s.index);
        assert_eq!(flat(na), flat(nb), "sample {}: final norm", s.index);
    }
}

/// A minimal OpenAI-compatible server on loopback: answers every chat request with `reply`
/// (or HTTP 500 when `reply` is empty), echoing nothing else.
fn fake_server(reply: &'static str, requests: usize) -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in l.incoming().take(requests) {
            let mut s = stream.unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut len = 0;
            loop {
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                if let Some(v) = line.to_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap();
                }
                if line == "\r\n" {
                    break;
                }
            }
            let mut body = vec![0; len];
            r.read_exact(&mut body).unwrap();
            let req: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(req["messages"][0]["role"], "user");
            let (status, out) = if reply.is_empty() {
                ("500 Internal Server Error", "{}".to_string())
            } else {
                (
                    "200 OK",
                    serde_json::json!({"choices": [{"message": {"role": "assistant", "content": reply}}]})
                        .to_string(),
                )
            };
            write!(s, "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{out}", out.len()).unwrap();
        }
    });
    format!("http://{addr}")
}

#[test]
fn regeneration_through_an_openai_compatible_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let t = Tiny { family: "llama", hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, layers: 2, ffn: 96 };
    write_hf(dir.path(), &t, &weights(&t, 9));
    let m = Model::load(dir.path()).unwrap();
    let prompts: Vec<String> = ["a b", "c d e", "f"].iter().map(|s| s.to_string()).collect();
    let out = dir.path().join("remote.jsonl");
    let url = fake_server("x y z", 3);
    let n = dspark_train::data::regenerate_remote(
        &m,
        &url,
        "tiny",
        &prompts,
        0,
        &out,
        16,
        2,
        &regen_sampling(),
        |_, _| {},
    )
    .unwrap();
    assert_eq!(n, 3);
    let mut got = read_samples(&out).unwrap();
    got.sort_by_key(|s| s.index);
    for (s, p) in got.iter().zip(&prompts) {
        let want_prompt = m.tokenizer.encode(&m.chat_prompt(p).unwrap(), true).unwrap();
        assert_eq!(&s.tokens[..s.prompt_len], &want_prompt[..]);
        assert_eq!(&s.tokens[s.prompt_len..], &m.tokenizer.encode("x y z", false).unwrap()[..]);
    }
    let fail = |url: &str| {
        let out2 = dir.path().join("failing.jsonl");
        dspark_train::data::regenerate_remote(
            &m,
            url,
            "tiny",
            &prompts[..1],
            0,
            &out2,
            16,
            1,
            &regen_sampling(),
            |_, _| {},
        )
        .err()
        .unwrap()
        .to_string()
    };
    let err = fail(&fake_server("", 3));
    assert!(err.contains("run again to resume"), "{err}");
    let err = fail("https://x");
    assert!(err.contains("http://"), "{err}");
}

#[test]
fn code_prompts_are_told_from_other_prompts() {
    for p in [
        "How do I reverse a string in Python without a loop?",
        "```\nfoo = bar()\n```\nwhy does this fail?",
        "Write a SQL query that returns each customer's latest order",
        "My React component throws an error on mount",
    ] {
        assert!(is_code_prompt(p), "{p}");
    }
    for p in [
        "What do pythons eat?",
        "Write a poem about autumn leaves",
        "Which class should I take next semester, history or art?",
    ] {
        assert!(!is_code_prompt(p), "{p}");
    }
}
