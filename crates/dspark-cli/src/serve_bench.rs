//! `dspark bench serve`: the server under load over loopback, per policy and concurrency —
//! per-user against aggregate throughput (DSpark's Figure 7 in miniature).

use crate::serve::EngineArgs;
use crate::ModelArg;
use anyhow::{bail, Context, Result};
use clap::Args;
use dspark_schedule::Policy;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct ServeBenchArgs {
    #[command(flatten)]
    pub model: ModelArg,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Policies to compare, comma-separated (see `dspark serve --help`).
    #[arg(long, default_value = "plain,fixed,dspark,dspark-async")]
    pub policies: String,
    /// Concurrent clients per level, comma-separated.
    #[arg(long, default_value = "1,2,4,8")]
    pub concurrency: String,
    /// Requests per level (at least the concurrency).
    #[arg(long, default_value_t = 16)]
    pub requests: usize,
    /// A level stops sending new requests after this many seconds.
    #[arg(long, default_value_t = 120.0)]
    pub seconds: f64,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// 0 is greedy: every policy must then give the same text as plain, which is checked.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// JSONL prompts (`prompt`/`question`/`problem`/`text`); default: GSM8K and MBPP test
    /// prompts from the shipped benchmark files (GSM8K and MBPP test), interleaved.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Workload tag sent with each request (online calibration per tag).
    #[arg(long)]
    pub tag: Option<String>,
    /// Write `<out>.json` and `<out>.svg` (the plot).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
struct Level {
    policy: String,
    concurrency: usize,
    requests: usize,
    failed: usize,
    per_user_tok_s: f64,
    aggregate_tok_s: f64,
    mean_ttft_s: f64,
    mean_verify_budget: f64,
    mean_tau: f64,
    completion_tokens: usize,
    wall_s: f64,
}

struct Outcome {
    index: usize,
    text: String,
    tokens: usize,
    seconds: f64,
    ttft: f64,
    verify_budget: f64,
    tau: f64,
}

fn prompts(a: &ServeBenchArgs, n: usize) -> Result<Vec<String>> {
    if let Some(p) = &a.prompts {
        return crate::bench::read_prompts(p, n);
    }
    let dir = dspark_hub::bench_dir()?;
    let g = crate::bench::read_prompts(&dir.join("gsm8k-test.jsonl"), n)?;
    let m = crate::bench::read_prompts(&dir.join("mbpp-test.jsonl"), n)?;
    Ok(g.into_iter().zip(m).flat_map(|(x, y)| [x, y]).take(n).collect())
}

/// One streaming chat request; returns its text, tokens, timing and speculative statistics.
fn request(base: &str, model: &str, prompt: &str, a: &ServeBenchArgs, index: usize) -> Result<Outcome> {
    let mut body = json!({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": a.max_tokens,
        "temperature": a.temperature,
        "seed": index,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let Some(t) = &a.tag {
        body["metadata"] = json!({"tag": t});
    }
    let t0 = Instant::now();
    let resp = ureq::post(&format!("{base}/v1/chat/completions"))
        .timeout(Duration::from_secs(600))
        .send_json(body)
        .map_err(|e| anyhow::anyhow!("request {index}: {e}"))?;
    let mut text = String::new();
    let mut ttft = None;
    let mut usage = Value::Null;
    for line in std::io::BufReader::new(resp.into_reader()).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).context("a stream chunk is not JSON")?;
        if v.get("error").is_some() {
            bail!("request {index}: {}", v["error"]);
        }
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            if !c.is_empty() && ttft.is_none() {
                ttft = Some(t0.elapsed().as_secs_f64());
            }
            text += c;
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    let spec = &usage["speculative"];
    Ok(Outcome {
        index,
        text,
        tokens: usage["completion_tokens"].as_u64().context("no usage in the stream")? as usize,
        seconds: t0.elapsed().as_secs_f64(),
        ttft: ttft.unwrap_or(0.0),
        verify_budget: spec["mean_verify_budget"].as_f64().unwrap_or(0.0),
        tau: spec["tau"].as_f64().unwrap_or(0.0),
    })
}

fn level(
    base: &str,
    model: &str,
    prompts: &[String],
    a: &ServeBenchArgs,
    c: usize,
) -> (Vec<Outcome>, usize, f64) {
    let next = AtomicUsize::new(0);
    let done = Mutex::new(Vec::new());
    let failed = AtomicUsize::new(0);
    let t0 = Instant::now();
    let total = a.requests.max(c);
    std::thread::scope(|s| {
        for _ in 0..c {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total || t0.elapsed().as_secs_f64() > a.seconds {
                    break;
                }
                match request(base, model, &prompts[i % prompts.len()], a, i) {
                    Ok(o) => done.lock().unwrap().push(o),
                    Err(e) => {
                        eprintln!("  {e:#}");
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    (done.into_inner().unwrap(), failed.into_inner(), t0.elapsed().as_secs_f64())
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

pub fn run(a: ServeBenchArgs) -> Result<()> {
    let policies: Vec<Policy> = a.policies.split(',').map(|p| p.trim().parse()).collect::<Result<_, _>>()?;
    let levels: Vec<usize> = a
        .concurrency
        .split(',')
        .map(|c| c.trim().parse().with_context(|| format!("bad concurrency `{c}`")))
        .collect::<Result<_>>()?;
    if levels.contains(&0) || a.requests == 0 || a.max_tokens == 0 {
        bail!("--concurrency, --requests and --max-tokens must be at least 1");
    }
    let target = Arc::new(a.model.load()?);
    let name = a.model.name();
    let drafter = a.engine.drafter.load(&target, &name)?;
    let cost = a.engine.cost_table(&target, &name, &drafter)?;
    let n_prompts = a.requests.max(*levels.iter().max().unwrap());
    let prompts = prompts(&a, n_prompts)?;
    let mut rows: Vec<Level> = Vec::new();
    let mut texts: BTreeMap<(String, usize, usize), String> = BTreeMap::new();
    let mut calibration: Vec<String> = Vec::new();
    println!(
        "{:<14} {:>4} {:>5} {:>6} {:>12} {:>12} {:>9} {:>8} {:>6}",
        "policy", "conc", "reqs", "failed", "per-user t/s", "aggregate t/s", "TTFT s", "budget", "τ"
    );
    for &policy in &policies {
        let engine = a.engine.spawn(policy, target.clone(), &drafter, cost.clone())?;
        let state = Arc::new(dspark_server::AppState::new(engine, &name, None, a.max_tokens));
        let server = dspark_server::start(state, "127.0.0.1:0")?;
        let base = format!("http://{}", server.addr);
        // One request first so that lazily built state is not in the timings.
        let _ = request(&base, &name, &prompts[0], &a, 0);
        for &c in &levels {
            let (done, failed, wall) = level(&base, &name, &prompts, &a, c);
            let tokens: usize = done.iter().map(|o| o.tokens).sum();
            let row = Level {
                policy: policy.to_string(),
                concurrency: c,
                requests: done.len(),
                failed,
                per_user_tok_s: mean(done.iter().map(|o| o.tokens as f64 / o.seconds)),
                aggregate_tok_s: tokens as f64 / wall,
                mean_ttft_s: mean(done.iter().map(|o| o.ttft)),
                mean_verify_budget: mean(done.iter().map(|o| o.verify_budget)),
                mean_tau: mean(done.iter().map(|o| o.tau)),
                completion_tokens: tokens,
                wall_s: wall,
            };
            println!(
                "{:<14} {:>4} {:>5} {:>6} {:>12.1} {:>12.1} {:>9.3} {:>8.2} {:>6.2}",
                row.policy,
                c,
                row.requests,
                failed,
                row.per_user_tok_s,
                row.aggregate_tok_s,
                row.mean_ttft_s,
                row.mean_verify_budget,
                row.mean_tau
            );
            for o in done {
                texts.insert((policy.to_string(), c, o.index), o.text);
            }
            rows.push(row);
        }
        // The server's own view of its online calibration after the load.
        let metrics = ureq::get(&format!("{base}/metrics")).call().ok().and_then(|r| r.into_string().ok());
        if let Some(text) = metrics {
            for line in text.lines().filter(|l| l.starts_with("dspark_calibration_")) {
                println!("  {policy}: {line}");
                calibration.push(format!("{policy}: {line}"));
            }
        }
        server.stop()?;
    }
    println!("{}", ratios(&rows));
    let mut mismatches = 0;
    if a.temperature == 0.0 {
        let by_prompt: BTreeMap<usize, &String> = texts.iter().map(|((_, _, i), t)| (*i, t)).collect();
        for ((p, c, i), t) in &texts {
            if by_prompt.get(i).is_some_and(|r| *r != t) {
                mismatches += 1;
                eprintln!("  greedy text differs: policy {p}, concurrency {c}, request {i}");
            }
        }
        println!(
            "greedy outputs: {}",
            if mismatches == 0 {
                "identical across policies and concurrency levels".to_string()
            } else {
                format!("{mismatches} differ")
            }
        );
    }
    if let Some(out) = &a.out {
        let json = json!({
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "model": name,
            "threads": cost.threads,
            "max_tokens": a.max_tokens,
            "temperature": a.temperature,
            "greedy_mismatches": mismatches,
            "cost_table": cost,
            "levels": rows,
            "calibration_metrics": calibration,
        });
        let j = out.with_extension("json");
        std::fs::write(&j, serde_json::to_string_pretty(&json)? + "\n")?;
        let svg = out.with_extension("svg");
        std::fs::write(&svg, plot(&rows, &name))?;
        eprintln!("wrote {} and {}", j.display(), svg.display());
    }
    if mismatches > 0 {
        bail!("greedy outputs differ between runs — please report this bug");
    }
    Ok(())
}

/// Per-user tokens/s of each policy against plain and fixed at the same concurrency.
fn ratios(rows: &[Level]) -> String {
    let find = |p: &str, c: usize| rows.iter().find(|r| r.policy == p && r.concurrency == c);
    let mut s = String::from("per-user tokens/s ratios at equal concurrency:\n");
    for r in rows.iter().filter(|r| r.policy != "plain" && r.policy != "fixed") {
        let vs = |p: &str| {
            find(p, r.concurrency)
                .map_or("—".to_string(), |b| format!("{:.2}×", r.per_user_tok_s / b.per_user_tok_s))
        };
        s += &format!(
            "  {:<14} conc {:>3}: vs plain {}, vs fixed {}\n",
            r.policy,
            r.concurrency,
            vs("plain"),
            vs("fixed")
        );
    }
    s
}

/// Per-user against aggregate tokens/s, one line per policy, points labelled by concurrency.
fn plot(rows: &[Level], model: &str) -> String {
    let (w, h, pad) = (560.0, 380.0, 56.0);
    let xmax = rows.iter().map(|r| r.aggregate_tok_s).fold(1.0, f64::max) * 1.1;
    let ymax = rows.iter().map(|r| r.per_user_tok_s).fold(1.0, f64::max) * 1.1;
    let x = |v: f64| pad + v / xmax * (w - 2.0 * pad);
    let y = |v: f64| h - pad - v / ymax * (h - 2.0 * pad);
    let colors = ["#7f7f7f", "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e"];
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='11'>\n\
         <rect width='100%' height='100%' fill='white'/>\n\
         <text x='{pad}' y='20' font-size='14'>{model}: per-user vs aggregate throughput (labels: concurrency)</text>\n\
         <line x1='{pad}' y1='{}' x2='{}' y2='{}' stroke='#333'/>\n<line x1='{pad}' y1='{}' x2='{pad}' y2='{pad}' stroke='#333'/>\n\
         <text x='{}' y='{}' text-anchor='middle'>aggregate tokens/s</text>\n\
         <text x='14' y='{}' transform='rotate(-90 14 {})' text-anchor='middle'>per-user tokens/s</text>\n",
        h - pad,
        w - pad,
        h - pad,
        h - pad,
        w / 2.0,
        h - 16.0,
        h / 2.0,
        h / 2.0
    );
    for i in 0..=4 {
        let (vx, vy) = (xmax * i as f64 / 4.0, ymax * i as f64 / 4.0);
        s += &format!("<text x='{:.1}' y='{}' text-anchor='middle'>{vx:.0}</text>\n", x(vx), h - pad + 14.0);
        s += &format!("<text x='{}' y='{:.1}' text-anchor='end'>{vy:.0}</text>\n", pad - 4.0, y(vy) + 4.0);
    }
    let mut policies: Vec<&str> = rows.iter().map(|r| r.policy.as_str()).collect();
    policies.dedup();
    for (k, p) in policies.iter().enumerate() {
        let color = colors[k % colors.len()];
        let pts: Vec<&Level> = rows.iter().filter(|r| r.policy == *p).collect();
        let line: Vec<String> =
            pts.iter().map(|r| format!("{:.1},{:.1}", x(r.aggregate_tok_s), y(r.per_user_tok_s))).collect();
        s += &format!(
            "<polyline points='{}' fill='none' stroke='{color}' stroke-width='2'/>\n",
            line.join(" ")
        );
        for r in &pts {
            let (cx, cy) = (x(r.aggregate_tok_s), y(r.per_user_tok_s));
            s += &format!("<circle cx='{cx:.1}' cy='{cy:.1}' r='3' fill='{color}'/>\n");
            s += &format!(
                "<text x='{:.1}' y='{:.1}' fill='{color}'>{}</text>\n",
                cx + 4.0,
                cy - 4.0,
                r.concurrency
            );
        }
        s += &format!(
            "<rect x='{}' y='{}' width='12' height='3' fill='{color}'/><text x='{}' y='{}'>{p}</text>\n",
            w - pad - 110.0,
            pad + 14.0 * k as f64,
            w - pad - 94.0,
            pad + 14.0 * k as f64 + 4.0
        );
    }
    s + "</svg>\n"
}
