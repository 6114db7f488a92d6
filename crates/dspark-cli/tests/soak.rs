//! Opt-in soak test of the server (`cargo test --release -p dspark-cli --test soak -- --ignored
//! --nocapture`): 64 concurrent streams whose clients hang up at random, three storms of 64
//! clients hanging up at once, then 2,000 sequential requests. No error but the hang-ups, no
//! sequence, queue entry or KV left behind, and every answer that completes equals plain greedy
//! decoding of its prompt (which the non-streamed answer equals too). Figures in docs/SERVING.md.

mod common;

use dspark_drafter_models::DrafterNet;
use dspark_engine::EngineConfig;
use dspark_model::Model;
use dspark_schedule::{CostTable, Policy};
use dspark_server::AppState;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::io::{BufRead, Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MODEL: &str = "smollm2-135m";
/// Tokens per answer in the concurrent phase and in the storms' streams (cut short).
const CONCURRENT_TOKENS: usize = 24;
const STORM_TOKENS: usize = 2000;
const SEQUENTIAL_TOKENS: usize = 4;

fn metric(base: &str, name: &str) -> f64 {
    let text = ureq::get(&format!("{base}/metrics")).call().unwrap().into_string().unwrap();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).map(|v| v.trim().parse().unwrap())
        })
        .unwrap_or(0.0)
}

/// Waits until no sequence runs, waits or holds KV; panics with what is left after 30 s.
fn drained(base: &str, when: &str) {
    let names = [
        "dspark_running_sequences",
        "dspark_queue_depth",
        "dspark_kv_reserved_tokens",
        "dspark_kv_used_tokens",
    ];
    let t0 = Instant::now();
    loop {
        let left: Vec<(&str, f64)> =
            names.iter().map(|n| (*n, metric(base, n))).filter(|(_, v)| *v != 0.0).collect();
        if left.is_empty() {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{when}: still in use after 30 s: {left:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Opens a streamed request on a raw socket and reads until `k` data events arrived (or the
/// answer ended); dropping the socket then hangs up.
fn open(addr: &str, path: &str, body: &Value, k: usize) -> Result<std::net::TcpStream, String> {
    let body = body.to_string();
    let mut s = std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let (mut seen, mut buf) = (String::new(), [0u8; 4096]);
    while seen.matches("data: ").count() < k {
        let n = s.read(&mut buf).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        seen += &String::from_utf8_lossy(&buf[..n]);
    }
    if !seen.starts_with("HTTP/1.1 200") {
        return Err(seen.lines().next().unwrap_or("").to_string());
    }
    Ok(s)
}

/// A streamed request: with `cut = Some(k)` the client hangs up after `k` data events, else it
/// reads to `[DONE]` and returns the text. `Err` on anything unexpected.
fn stream(addr: &str, path: &str, body: &Value, cut: Option<usize>) -> Result<Option<String>, String> {
    if let Some(k) = cut {
        return open(addr, path, body, k).map(|_| None);
    }
    let r = ureq::post(&format!("http://{addr}{path}")).send_json(body).map_err(|e| e.to_string())?;
    let mut text = String::new();
    let chat = path.contains("chat");
    for line in std::io::BufReader::new(r.into_reader()).lines() {
        let line = line.map_err(|e| e.to_string())?;
        let Some(d) = line.strip_prefix("data: ") else { continue };
        if d == "[DONE]" {
            return Ok(Some(text));
        }
        let v: Value = serde_json::from_str(d).map_err(|e| format!("{e}: {d}"))?;
        if v.get("error").is_some() {
            return Err(d.to_string());
        }
        let piece = if chat { &v["choices"][0]["delta"]["content"] } else { &v["choices"][0]["text"] };
        text += piece.as_str().unwrap_or("");
    }
    Err(format!("no [DONE] after {text:?}"))
}

fn complete(base: &str, path: &str, body: &Value) -> Result<String, String> {
    match ureq::post(&format!("{base}{path}")).send_json(body.clone()) {
        Ok(r) => {
            let v: Value = r.into_json().map_err(|e| e.to_string())?;
            let c = &v["choices"][0];
            Ok(c["message"]["content"].as_str().or(c["text"].as_str()).unwrap_or("").to_string())
        }
        Err(e) => Err(e.to_string()),
    }
}

#[test]
#[ignore = "soak: 64 streams with random hang-ups, three storms, 2,000 sequential requests; minutes"]
fn soak_hang_ups_storms_and_two_thousand_requests() {
    let t = Arc::new(Model::load(&common::model(MODEL)).unwrap());
    let dir = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for tests"),
    )
    .join("../../drafters/smollm2-135m-dspark-markov");
    let mut net = dspark_drafter_models::load(&dir, t.clone(), MODEL).unwrap();
    net.quantize_for_inference().unwrap();
    let DrafterNet::Block(drafter) = net else { unreachable!() };
    let config = EngineConfig {
        policy: Policy::Dspark,
        // Verifying is nearly free under this table, so drafts are verified and the speculative
        // paths (rollback after a rejection, cancellation mid-verify) all run.
        cost: CostTable {
            model: MODEL.into(),
            drafter: None,
            threads: 2,
            forward: vec![(1, 0.010), (256, 0.011)],
            draft: vec![(1, 0.0001), (64, 0.0002)],
        },
        draft_len: 7,
        max_running: 64,
        max_queue: 4096,
        kv_tokens: 1 << 18,
        prefill_chunk: 256,
        online_calibration: true,
    };
    let engine =
        dspark_engine::spawn(t.clone(), Some(dspark_engine::EngineDrafter::Block(Arc::new(drafter))), config)
            .unwrap();
    let srv = dspark_server::start(
        Arc::new(AppState::new(engine, MODEL, Some("dspark".into()), 64)),
        "127.0.0.1:0",
    )
    .unwrap();
    let base = format!("http://{}", srv.addr);
    let addr = srv.addr.to_string();

    let mut questions = common::bench_prompts("gsm8k-test.jsonl", "question", 12);
    questions.extend(common::bench_prompts("mbpp-test.jsonl", "text", 12));
    let reference = |ids: &[u32], n: usize| t.tokenizer.decode(&common::plain(&t, ids, n)).unwrap();
    let chat_want: Vec<String> =
        questions.iter().map(|q| reference(&t.chat_tokens(q).unwrap(), CONCURRENT_TOKENS)).collect();
    let chat = |k: usize, n: usize| {
        json!({"model": MODEL, "messages": [{"role": "user", "content": questions[k]}], "max_tokens": n,
               "temperature": 0, "stream": true})
    };
    // The non-streamed answer is the one streamed answers must equal; check it is plain decoding's.
    for (k, want) in chat_want.iter().enumerate() {
        let mut body = chat(k, CONCURRENT_TOKENS);
        body["stream"] = json!(false);
        assert_eq!(&complete(&base, "/v1/chat/completions", &body).unwrap(), want, "prompt {k}");
    }

    let errors = Mutex::new(Vec::<String>::new());
    let (completed, cut) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for c in 0..64u64 {
            let (errors, completed, cut, addr, chat, chat_want) =
                (&errors, &completed, &cut, &addr, &chat, &chat_want);
            s.spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(c);
                for _ in 0..4 {
                    let k = rng.random_range(0..chat_want.len());
                    let hang_up = rng.random_bool(0.4).then(|| rng.random_range(1..12));
                    match stream(addr, "/v1/chat/completions", &chat(k, CONCURRENT_TOKENS), hang_up) {
                        Ok(Some(text)) if text == chat_want[k] => _ = completed.fetch_add(1, Relaxed),
                        Ok(Some(text)) => errors.lock().unwrap().push(format!("prompt {k}: {text:?}")),
                        Ok(None) => _ = cut.fetch_add(1, Relaxed),
                        Err(e) => errors.lock().unwrap().push(e),
                    }
                }
            });
        }
    });
    let concurrent_s = t0.elapsed().as_secs_f64();
    drained(&base, "after the concurrent streams");

    let t1 = Instant::now();
    for storm in 0..3 {
        let sockets = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for c in 0..64 {
                let (errors, sockets, addr, chat) = (&errors, &sockets, &addr, &chat);
                s.spawn(move || {
                    match open(addr, "/v1/chat/completions", &chat((storm * 64 + c) % 24, STORM_TOKENS), 3) {
                        Ok(s) => sockets.lock().unwrap().push(s),
                        Err(e) => errors.lock().unwrap().push(format!("storm {storm}: {e}")),
                    }
                });
            }
        });
        // Every client has its first tokens; now they all hang up at once.
        assert!(metric(&base, "dspark_running_sequences") > 0.0, "storm {storm}: the streams are running");
        drop(sockets);
        drained(&base, &format!("after storm {storm}"));
    }
    let storms_s = t1.elapsed().as_secs_f64();

    let facts: Vec<String> = (0..50).map(|k| format!("Fact number {k}: the")).collect();
    let fact_want: Vec<String> =
        facts.iter().map(|p| reference(&t.tokenizer.encode(p, false).unwrap(), SEQUENTIAL_TOKENS)).collect();
    let t2 = Instant::now();
    let mut wrong = 0;
    for i in 0..2000 {
        let k = i % facts.len();
        let body = json!({"model": MODEL, "prompt": facts[k], "max_tokens": SEQUENTIAL_TOKENS, "temperature": 0,
                          "stream": i % 2 == 0});
        let got = if i % 2 == 0 {
            stream(&addr, "/v1/completions", &body, None).map(|t| t.unwrap_or_default())
        } else {
            complete(&base, "/v1/completions", &body)
        };
        match got {
            Ok(text) if text == fact_want[k] => {}
            Ok(text) => {
                wrong += 1;
                errors
                    .lock()
                    .unwrap()
                    .push(format!("sequential {i}: {text:?} instead of {:?}", fact_want[k]));
            }
            Err(e) => errors.lock().unwrap().push(format!("sequential {i}: {e}")),
        }
    }
    let sequential_s = t2.elapsed().as_secs_f64();
    drained(&base, "at the end");

    let errors = errors.into_inner().unwrap();
    eprintln!(
        "soak: 64 streams × 4 requests in {concurrent_s:.1} s ({} completed and equal to plain decoding, {} hung up); \
         3 storms of 64 hang-ups in {storms_s:.1} s; 2,000 sequential requests in {sequential_s:.1} s \
         ({:.1} ms each, {wrong} wrong); cancelled {}, errors {}; nothing left running, queued or in the KV cache",
        completed.load(Relaxed),
        cut.load(Relaxed),
        sequential_s * 1000.0 / 2000.0,
        metric(&base, "dspark_cancelled_requests_total"),
        metric(&base, "dspark_requests_total{outcome=\"error\"}"),
    );
    assert!(errors.is_empty(), "{} errors, first ones: {:?}", errors.len(), &errors[..errors.len().min(5)]);
    assert_eq!(completed.load(Relaxed) + cut.load(Relaxed), 256);
    assert!(cut.load(Relaxed) > 0 && completed.load(Relaxed) > 0);
    assert_eq!(metric(&base, "dspark_requests_total{outcome=\"error\"}"), 0.0);
    assert!(
        metric(&base, "dspark_cancelled_requests_total") >= 3.0 * 64.0,
        "every storm's requests were cancelled"
    );
    srv.stop().unwrap();
}
