//! Chunked prefill: any chunking gives the tokens of plain decoding, and a long prompt's
//! prefill does not hold back a short request (it shares each step's prefill budget and then
//! decodes between the long prompt's chunks). The measurement of inter-token latency during an
//! 8k-token prefill is an opt-in bench (`--ignored`), quoted in docs/SERVING.md.

mod common;

use dspark_engine::{EngineConfig, EngineHandle, Event, Request, RequestParams};
use dspark_model::Model;
use dspark_sampling::SamplingParams;
use dspark_schedule::{CostTable, Policy};
use serde_json::{json, Value};
use std::io::BufRead;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MODEL: &str = "smollm2-135m";

fn target() -> Arc<Model> {
    Arc::new(Model::load(&common::model(MODEL)).unwrap())
}

fn engine(t: &Arc<Model>, policy: Policy, prefill_chunk: usize) -> Arc<EngineHandle> {
    let config = EngineConfig {
        policy,
        cost: CostTable {
            model: MODEL.into(),
            drafter: None,
            threads: 2,
            forward: vec![(1, 0.010), (256, 0.011)],
            draft: vec![(1, 0.0001), (64, 0.0002)],
        },
        draft_len: 7,
        max_running: 16,
        max_queue: 64,
        kv_tokens: 1 << 16,
        prefill_chunk,
        online_calibration: false,
    };
    dspark_engine::spawn(t.clone(), policy.drafts().then(|| common::shipped_block_drafter(t)), config)
        .unwrap()
}

fn submit(
    e: &EngineHandle,
    t: &Model,
    prompt: &[u32],
    max_tokens: usize,
) -> tokio::sync::mpsc::UnboundedReceiver<Event> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let params = RequestParams {
        max_tokens,
        sampling: SamplingParams::default(),
        seed: 0,
        stop_tokens: t.tokenizer.eos().to_vec(),
        logprobs: None,
    };
    e.submit(Request { prompt: prompt.to_vec(), params, tag: None, events: tx }).unwrap();
    rx
}

/// The answer's tokens and when its first and last tokens arrived.
fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> (Vec<u32>, Instant, Instant) {
    let (mut out, mut first) = (Vec::new(), None);
    loop {
        match rx.blocking_recv().expect("an answer") {
            Event::Tokens { tokens, .. } => {
                first.get_or_insert_with(Instant::now);
                out.extend(tokens);
            }
            Event::Done { .. } => return (out, first.unwrap_or_else(Instant::now), Instant::now()),
            Event::Error(e) => panic!("{e}"),
        }
    }
}

/// A prompt of about `n` tokens (GSM8K questions run together).
fn long_prompt(t: &Model, n: usize) -> Vec<u32> {
    let text = common::bench_prompts("gsm8k-test.jsonl", "question", 400).join("\n\n");
    let mut ids = t.tokenizer.encode(&text, false).unwrap();
    assert!(ids.len() >= n, "enough prompt text for {n} tokens");
    ids.truncate(n);
    ids
}

#[test]
fn chunked_prefill_gives_the_tokens_of_unchunked_prefill() {
    let t = target();
    let mut prompts = common::math_and_code(&t, 2);
    prompts.push(long_prompt(&t, 700));
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| common::plain(&t, p, 24)).collect();
    for policy in [Policy::Plain, Policy::Fixed] {
        // One chunk per prompt, the default, and chunks that split everything (several prompts
        // sharing each step's budget, the long one in many pieces).
        for chunk in [1 << 20, 256, 7] {
            let e = engine(&t, policy, chunk);
            let rxs: Vec<_> = prompts.iter().map(|p| submit(&e, &t, p, 24)).collect();
            for (i, rx) in rxs.into_iter().enumerate() {
                let (got, _, _) = collect(rx);
                assert_eq!(
                    got, want[i],
                    "{policy}, prefill chunk {chunk}, prompt {i}: differs from plain decoding"
                );
            }
            e.shutdown();
        }
    }
}

#[test]
fn a_short_request_is_answered_while_a_long_prompt_is_prefilled() {
    let t = target();
    let e = engine(&t, Policy::Plain, 64);
    let long = submit(&e, &t, &long_prompt(&t, 2000), 1);
    let short = submit(&e, &t, &t.chat_tokens("What is 2+2?").unwrap(), 8);
    let long = std::thread::spawn(move || collect(long));
    let (tokens, _, short_done) = collect(short);
    let (_, long_first, _) = long.join().unwrap();
    assert_eq!(tokens.len(), 8);
    // The long prompt needs 2000 / 64 ≈ 31 steps of prefill, the short one 1 + 8 steps: queued
    // behind the long prefill it would finish after it.
    assert!(
        short_done < long_first,
        "the short request finished {:?} after the long prompt's first token",
        short_done - long_first
    );
    e.shutdown();
}

/// Streams a chat completion; returns when each content chunk arrived (after `t0`).
fn timed_stream(base: &str, prompt: &str, max_tokens: usize) -> Vec<Instant> {
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                      "max_tokens": max_tokens, "temperature": 0, "stream": true});
    let r = ureq::post(&format!("{base}/v1/chat/completions")).send_json(body).unwrap();
    let mut times = Vec::new();
    for line in std::io::BufReader::new(r.into_reader()).lines() {
        let line = line.unwrap();
        let Some(d) = line.strip_prefix("data: ") else { continue };
        if d == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(d).unwrap();
        if v["choices"][0]["delta"]["content"].as_str().is_some_and(|c| !c.is_empty()) {
            times.push(Instant::now());
        }
    }
    times
}

fn quantile(xs: &mut [f64], q: f64) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[((xs.len() - 1) as f64 * q).round() as usize]
}

/// Short streamed chat requests run back to back; one second in, an 8,000-token prompt arrives.
/// Prints the short requests' time to first token and inter-token latency (p50 / p99 / max)
/// while that prompt is prefilled. `DSPARK_PREFILL_CHUNK` sets the chunk (default 256, the
/// server's default).
#[test]
#[ignore = "bench: a minute or more; run with --ignored --nocapture"]
fn bench_inter_token_latency_during_a_long_prefill() {
    let t = target();
    let chunk = std::env::var("DSPARK_PREFILL_CHUNK").map_or(256, |v| v.parse().unwrap());
    let table = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for tests"),
    )
    .join("../../docs/serve/smollm2-135m-cost.json");
    let config = EngineConfig {
        policy: Policy::Dspark,
        cost: CostTable::load(&table).unwrap(),
        draft_len: 7,
        max_running: 64,
        max_queue: 256,
        kv_tokens: 65536,
        prefill_chunk: chunk,
        online_calibration: true,
    };
    let e = dspark_engine::spawn(t.clone(), Some(common::shipped_block_drafter(&t)), config).unwrap();
    let state = Arc::new(dspark_server::AppState::new(e, MODEL, Some("dspark".into()), 64));
    let srv = dspark_server::start(state, "127.0.0.1:0").unwrap();
    let base = format!("http://{}", srv.addr);
    let prompt = t.tokenizer.decode(&long_prompt(&t, 8000)).unwrap();
    timed_stream(&base, "Warm up.", 4);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let shorts = {
        let (base, done) = (base.clone(), done.clone());
        std::thread::spawn(move || {
            let mut runs = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let t0 = Instant::now();
                runs.push((t0, timed_stream(&base, "Write a short poem about the sea.", 32)));
            }
            runs
        })
    };
    std::thread::sleep(Duration::from_secs(1));
    let t0 = Instant::now();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0});
    let r: Value =
        ureq::post(&format!("{base}/v1/completions")).send_json(body).unwrap().into_json().unwrap();
    let t1 = Instant::now();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let runs = shorts.join().unwrap();
    let (mut ttft, mut itl) = (Vec::new(), Vec::new());
    for (start, times) in &runs {
        // Requests that arrived during the prefill, and every gap that ended during it.
        if (t0..t1).contains(start) {
            ttft.push(times.first().map_or(f64::NAN, |f| (*f - *start).as_secs_f64()));
        }
        for w in times.windows(2) {
            if w[1] > t0 && w[1] <= t1 {
                itl.push((w[1] - w[0]).as_secs_f64());
            }
        }
    }
    eprintln!(
        "prefill chunk {chunk}: the {}-token prompt took {:.1} s; {} short requests arrived during it",
        r["usage"]["prompt_tokens"],
        (t1 - t0).as_secs_f64(),
        ttft.len()
    );
    if !ttft.is_empty() {
        eprintln!(
            "  their time to first token: p50 {:.2} s, max {:.2} s",
            quantile(&mut ttft, 0.5),
            quantile(&mut ttft, 1.0)
        );
    }
    if !itl.is_empty() {
        eprintln!(
            "  {} inter-token gaps during the prefill: p50 {:.3} s, p99 {:.3} s, max {:.3} s",
            itl.len(),
            quantile(&mut itl, 0.5),
            quantile(&mut itl, 0.99),
            quantile(&mut itl, 1.0)
        );
    }
    drop(srv);
}
