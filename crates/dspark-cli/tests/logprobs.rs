//! `logprobs` / `top_logprobs` against a reference computed here: the log-softmax (in f64) of the
//! logits of plain one-token-at-a-time decoding of the same prompt. The values must not depend on
//! whether a token was drafted, on streaming, or on the request's temperature.

mod common;

use dspark_engine::EngineConfig;
use dspark_model::{Model, SeqInput, TapSpec};
use dspark_schedule::{CostTable, Policy};
use dspark_server::{AppState, ServerHandle};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::BufRead;
use std::sync::Arc;

const MODEL: &str = "smollm2-135m";
const PROMPT: &str =
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips \
                      in May. How many clips did Natalia sell altogether in April and May?";
const MAX_TOKENS: usize = 40;

fn server(t: &Arc<Model>, policy: Policy) -> (ServerHandle, String) {
    let drafter = policy.drafts().then(|| common::shipped_block_drafter(t));
    let config = EngineConfig {
        policy,
        // Verifying costs nothing here, so every draft is verified.
        cost: CostTable {
            model: MODEL.into(),
            drafter: None,
            threads: 2,
            forward: vec![(1, 0.010), (256, 0.010)],
            draft: vec![(1, 0.0001), (64, 0.0001)],
        },
        draft_len: 7,
        max_running: 8,
        max_queue: 64,
        kv_tokens: 1 << 14,
        prefill_chunk: 16,
        online_calibration: false,
    };
    let engine = dspark_engine::spawn(t.clone(), drafter, config).unwrap();
    let state = Arc::new(AppState::new(engine, MODEL, None, 64));
    let s = dspark_server::start(state, "127.0.0.1:0").unwrap();
    let base = format!("http://{}", s.addr);
    (s, base)
}

fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    match ureq::post(&format!("{base}{path}")).send_json(body.clone()) {
        Ok(r) => (r.status(), r.into_json().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap()),
        Err(e) => panic!("{e}"),
    }
}

/// The SSE chunks of a streamed request, `[DONE]` checked and left out.
fn stream(base: &str, path: &str, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = ureq::post(&format!("{base}{path}")).send_json(body).unwrap();
    let mut chunks = Vec::new();
    for line in std::io::BufReader::new(r.into_reader()).lines() {
        let line = line.unwrap();
        let Some(d) = line.strip_prefix("data: ") else { continue };
        if d == "[DONE]" {
            return chunks;
        }
        chunks.push(serde_json::from_str(d).unwrap());
    }
    panic!("the stream ended without [DONE]");
}

/// The streamed chat chunks' `logprobs.content` entries, in order.
fn streamed_content(chunks: &[Value]) -> Vec<Value> {
    let mut all = Vec::new();
    for c in chunks {
        if let Some(a) = c["choices"][0]["logprobs"]["content"].as_array() {
            all.extend(a.iter().cloned());
        }
    }
    all
}

/// The streamed completion chunks' legacy `logprobs` merged into one object.
fn streamed_legacy(chunks: &[Value]) -> Value {
    let mut merged = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for c in chunks {
        let lp = &c["choices"][0]["logprobs"];
        if lp.is_null() {
            continue;
        }
        for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let more = lp[k].as_array().unwrap().clone();
            merged[k].as_array_mut().unwrap().extend(more);
        }
    }
    merged
}

/// Per position of plain decoding (greedy when `forced` is `None`, else along `forced`): the
/// token and the log-softmax of the logits it was chosen from.
fn reference(t: &Model, prompt: &[u32], forced: Option<&[u32]>, n: usize) -> Vec<(u32, Vec<f64>)> {
    let mut cache = t.new_cache(prompt.len() + n + 1);
    let v = t.vocab_size();
    let mut out = Vec::new();
    let mut feed = prompt.to_vec();
    while out.len() < n {
        let last = feed.len() - 1;
        let mut input =
            [SeqInput { cache: &mut cache, tokens: &feed, logit_rows: vec![last], tap_rows: vec![] }];
        let logits = t.forward(&mut input, &TapSpec::default()).unwrap().remove(0).logits;
        assert_eq!(logits.len(), v);
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z = max + logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
        let lp: Vec<f64> = logits.iter().map(|&x| x as f64 - z).collect();
        let next = match forced {
            Some(f) => f[out.len()],
            None => (0..v).max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a))).unwrap() as u32,
        };
        if forced.is_none() && t.tokenizer.eos().contains(&next) {
            break;
        }
        out.push((next, lp));
        feed = vec![next];
    }
    out
}

/// Ids by their bytes, to read back which token an entry names.
fn by_bytes(t: &Model) -> HashMap<Vec<u8>, u32> {
    (0..t.vocab_size() as u32).map(|i| (t.tokenizer.token_bytes(i).unwrap(), i)).collect()
}

fn bytes_of(e: &Value) -> Vec<u8> {
    e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect()
}

/// Asserts that chat `content` entries are the reference's tokens with its log-probabilities, and
/// the `k` alternatives its most likely tokens.
fn check_chat(t: &Model, content: &[Value], want: &[(u32, Vec<f64>)], k: usize, what: &str) {
    assert_eq!(content.len(), want.len(), "{what}: one entry per emitted token");
    for (i, (e, (tok, lp))) in content.iter().zip(want).enumerate() {
        let bytes = t.tokenizer.token_bytes(*tok).unwrap();
        assert_eq!(bytes_of(e), bytes, "{what}, token {i}: bytes");
        assert_eq!(e["token"], String::from_utf8_lossy(&bytes).as_ref(), "{what}, token {i}: text");
        let got = e["logprob"].as_f64().unwrap();
        assert!((got - lp[*tok as usize]).abs() < 1e-5, "{what}, token {i}: {got} vs {}", lp[*tok as usize]);
        let mut order: Vec<usize> = (0..lp.len()).collect();
        order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), k, "{what}, token {i}: alternatives");
        for (r, (alt, &id)) in top.iter().zip(&order).enumerate() {
            let got = alt["logprob"].as_f64().unwrap();
            assert!((got - lp[id]).abs() < 1e-5, "{what}, token {i}, rank {r}: {got} vs {}", lp[id]);
            // Near-ties may order differently in f32 than in f64; the values above still match.
            let apart = lp[id] - lp[order[r + 1]] > 1e-4 && (r == 0 || lp[order[r - 1]] - lp[id] > 1e-4);
            if apart {
                assert_eq!(
                    bytes_of(alt),
                    t.tokenizer.token_bytes(id as u32).unwrap(),
                    "{what}, token {i}, rank {r}"
                );
            }
        }
    }
}

#[test]
fn greedy_logprobs_are_the_log_softmax_of_plain_decoding_drafted_or_not_streamed_or_not() {
    let t = Arc::new(Model::load(&common::model(MODEL)).unwrap());
    let prompt = t.chat_tokens(PROMPT).unwrap();
    let want = reference(&t, &prompt, None, MAX_TOKENS);
    assert!(want.len() >= 10, "the reference answer is long enough to test");
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                      "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": true, "top_logprobs": 5});
    let text_prompt = t.chat_prompt(PROMPT).unwrap();
    let text = json!({"model": MODEL, "prompt": text_prompt, "parse_special": true, "max_tokens": MAX_TOKENS,
                      "temperature": 0, "logprobs": 3});
    let mut answers = Vec::new();
    for policy in [Policy::Plain, Policy::Fixed] {
        let (_srv, base) = server(&t, policy);
        let (code, r) = post(&base, "/v1/chat/completions", &chat);
        assert_eq!(code, 200, "{r}");
        if policy == Policy::Fixed {
            let accepted = r["usage"]["speculative"]["accepted_tokens"].as_u64().unwrap();
            assert!(accepted > 0, "some emitted tokens were drafted, so their values come from verification");
        }
        let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
        check_chat(&t, &content, &want, 5, &format!("{policy} chat"));
        let chunks = stream(&base, "/v1/chat/completions", &chat);
        assert_eq!(streamed_content(&chunks), content, "{policy}: streamed chat logprobs = non-streamed");
        let text_of: String =
            chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(text_of, r["choices"][0]["message"]["content"].as_str().unwrap());

        let (code, r) = post(&base, "/v1/completions", &text);
        assert_eq!(code, 200, "{r}");
        let lp = r["choices"][0]["logprobs"].clone();
        let tokens = lp["tokens"].as_array().unwrap();
        assert_eq!(tokens.len(), want.len(), "{policy} completions: one entry per token");
        let answer = r["choices"][0]["text"].as_str().unwrap();
        let mut offset = 0;
        for (i, (tok, ref_lp)) in want.iter().enumerate() {
            let s = String::from_utf8_lossy(&t.tokenizer.token_bytes(*tok).unwrap()).into_owned();
            assert_eq!(tokens[i], s.as_str(), "{policy} completions, token {i}");
            let got = lp["token_logprobs"][i].as_f64().unwrap();
            assert!((got - ref_lp[*tok as usize]).abs() < 1e-5, "{policy} completions, token {i}");
            let top = lp["top_logprobs"][i].as_object().unwrap();
            assert!((3..=4).contains(&top.len()), "the 3 alternatives and the chosen token");
            assert_eq!(top[&s], lp["token_logprobs"][i], "the chosen token is among them");
            assert_eq!(lp["text_offset"][i], offset, "{policy} completions, token {i}: text offset");
            assert!(answer[..].chars().skip(offset).collect::<String>().starts_with(&s));
            offset += s.chars().count();
        }
        assert_eq!(streamed_legacy(&stream(&base, "/v1/completions", &text)), lp, "{policy}: streamed = not");

        // A stop sequence in the middle: only tokens whose text starts before it are reported,
        // the same streamed or not.
        let stop = json!({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                          "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": true, "stop": ["April"]});
        let (code, r) = post(&base, "/v1/chat/completions", &stop);
        assert_eq!(code, 200, "{r}");
        let stopped = r["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
        assert!(
            !stopped.is_empty() && stopped.len() < want.len(),
            "{policy}: the stop sequence cut the answer"
        );
        let shown: String = stopped.iter().map(|e| e["token"].as_str().unwrap()).collect();
        let visible = r["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(shown.starts_with(visible) && !visible.contains("April"), "{shown:?} vs {visible:?}");
        assert_eq!(streamed_content(&stream(&base, "/v1/chat/completions", &stop)), stopped);
        answers.push(content);
    }
    assert_eq!(answers[0], answers[1], "the same values with and without a drafter");
}

#[test]
fn sampled_requests_report_the_raw_distribution_and_bad_values_get_400() {
    let t = Arc::new(Model::load(&common::model(MODEL)).unwrap());
    let (_srv, base) = server(&t, Policy::Fixed);
    let ids = by_bytes(&t);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
                      "temperature": 1.3, "top_k": 5, "seed": 7, "logprobs": true, "top_logprobs": 2});
    let (code, r) = post(&base, "/v1/chat/completions", &body);
    assert_eq!(code, 200, "{r}");
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    let sampled: Vec<u32> = content.iter().map(|e| ids[&bytes_of(e)]).collect();
    // Temperature and top-k shape the draw, not the reported values: those are the target's
    // distribution at temperature 1 along the sampled answer.
    let want = reference(&t, &t.chat_tokens(PROMPT).unwrap(), Some(&sampled), sampled.len());
    check_chat(&t, &content, &want, 2, "sampled chat");

    let cases = [
        ("/v1/chat/completions", json!({"logprobs": true, "top_logprobs": 21}), "top_logprobs"),
        ("/v1/chat/completions", json!({"logprobs": true, "top_logprobs": -1}), "top_logprobs"),
        ("/v1/chat/completions", json!({"top_logprobs": 2}), "top_logprobs"),
        ("/v1/chat/completions", json!({"logprobs": 3}), "logprobs"),
        ("/v1/completions", json!({"logprobs": 6}), "logprobs"),
        ("/v1/completions", json!({"logprobs": -2}), "logprobs"),
        ("/v1/completions", json!({"logprobs": true}), "logprobs"),
    ];
    for (path, extra, param) in cases {
        let mut body = if path.contains("chat") {
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        } else {
            json!({"model": MODEL, "prompt": "hi", "max_tokens": 4})
        };
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (code, r) = post(&base, path, &body);
        assert_eq!(code, 400, "{path} {extra}: {r}");
        assert_eq!(r["error"]["param"], param, "{path} {extra}");
        let msg = r["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains(param) && (msg.contains("must") || msg.contains("needs")),
            "{path} {extra}: {msg}"
        );
    }
    let (code, r) = post(
        &base,
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!((code, &r["choices"][0]["logprobs"]), (200, &Value::Null), "none unless asked for");
}

#[test]
fn token_bytes_spell_the_text_exactly() {
    for name in [MODEL, "gemma3-270m"] {
        let t = Model::load(&common::model(name)).unwrap();
        let tok = &t.tokenizer;
        for text in [
            "Hello, world!  Two  spaces\n\ttab",
            "naïve café — 数学 🙂🚀 end",
            " leading space",
            "x = 12345;",
        ] {
            let ids = tok.encode(text, false).unwrap();
            let bytes: Vec<u8> = ids
                .iter()
                .filter(|&&id| Some(id) != tok.bos())
                .flat_map(|&id| tok.token_bytes(id).unwrap())
                .collect();
            assert_eq!(String::from_utf8_lossy(&bytes), text, "{name}: the tokens' bytes spell the text");
        }
        for (id, text) in tok.special_tokens() {
            assert_eq!(tok.token_bytes(id).unwrap(), text.as_bytes(), "{name}: {text}");
        }
        assert_eq!(tok.token_bytes(u32::MAX), None);
    }
}
