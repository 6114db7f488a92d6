//! `dspark bench …`: figures printed side by side, measured in one run.

use crate::ModelArg;
use anyhow::{bail, Context, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use clap::Subcommand;
use dspark_kernels::{KernelChoice, QLinear};
use dspark_model::{SeqInput, TapSpec};
use std::time::Instant;

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Load the OpenAI server over loopback with N concurrent streaming clients per policy and
    /// concurrency level: per-user and aggregate tokens/s, mean verify budget, and a plot of one
    /// against the other.
    Serve(crate::serve_bench::ServeBenchArgs),
    /// Time one forward of k new tokens over a cache (logits at all k rows) for k = 1…64: the
    /// cost table a verification scheduler needs.
    Forward {
        #[command(flatten)]
        model: ModelArg,
        /// Positions already in the cache before each timed forward.
        #[arg(long, default_value_t = 128)]
        context: usize,
        /// Timed repetitions per k (the median is reported).
        #[arg(long, default_value_t = 10)]
        reps: usize,
        /// Print the table as JSON.
        #[arg(long)]
        json: bool,
        /// Also time the prefill of a prompt of this many tokens into an empty cache (0: skip).
        #[arg(long, default_value_t = 512)]
        prefill: usize,
    },
    /// Decode tokens/s over a set of prompts (greedy, chat template), the figure to compare with
    /// llama.cpp (`scripts/peer_llamacpp.py`) on the same GGUF and thread count.
    Decode {
        #[command(flatten)]
        model: ModelArg,
        /// JSONL with a `prompt` (or `question`/`problem`/`text`) field; built-in prompts if absent.
        #[arg(long)]
        prompts: Option<std::path::PathBuf>,
        /// Prompts to run (after one warm-up prompt).
        #[arg(long, default_value_t = 4)]
        n: usize,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Sampling temperature (0: greedy, and the speculative output is checked to equal plain
        /// decoding's; above 0 the acceptance figures are those of sampled verification).
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Skip this many prompts of the file first (e.g. those used for training).
        #[arg(long, default_value_t = 0)]
        skip: usize,
        /// Also run speculative decoding with this drafter on the same prompts, side by side.
        #[command(flatten)]
        spec: crate::DrafterArgs,
    },
    /// Cost of one drafting round (DFlash, DSpark with Markov and RNN heads, EAGLE-3; randomly
    /// initialised: cost does not depend on the weights) per γ and draft vocabulary, next to the
    /// target's single-token forward and its verify forward of γ+1 tokens, on this machine.
    Draft {
        #[command(flatten)]
        model: ModelArg,
        /// Committed positions before each round.
        #[arg(long, default_value_t = 256)]
        context: usize,
        /// Block lengths γ to time, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "3,7,15")]
        gammas: Vec<usize>,
        /// Draft vocabularies to time: `full` or a size V_d, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "full,8192")]
        vocabs: Vec<String>,
        /// Draft layers of the DFlash/DSpark backbone.
        #[arg(long, default_value_t = 1)]
        layers: usize,
        /// Width of the draft layers' MLP (default: the target's; `dspark train --intermediate`).
        #[arg(long)]
        intermediate: Option<usize>,
        /// Timed rounds per case (the median is reported).
        #[arg(long, default_value_t = 15)]
        reps: usize,
        /// Drafting methods to time, comma-separated, among dflash, dspark-markov, dspark-rnn and
        /// eagle3 (all by default); one method alone is what a profiler wants.
        #[arg(long, value_delimiter = ',', default_value = "dflash,dspark-markov,dspark-rnn,eagle3")]
        methods: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Quantized matmul throughput, dspark's kernels against candle's, on random weights.
    Kernels {
        /// Timed repetitions per case.
        #[arg(long, default_value_t = 20)]
        reps: usize,
        /// Only the training products (f32 against bf16), not the quantized kernels.
        #[arg(long)]
        training: bool,
    },
}

pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Forward { model, context, reps, json, prefill } => {
            forward(&model, context, reps, json, prefill)
        }
        BenchCmd::Kernels { reps, training } => kernels(reps, training),
        BenchCmd::Draft { model, context, gammas, vocabs, layers, intermediate, reps, methods, json } => {
            draft(&model, context, &gammas, &vocabs, (layers, intermediate), (reps, &methods), json)
        }
        BenchCmd::Decode { model, prompts, n, max_tokens, temperature, skip, spec } => {
            decode(&model, prompts.as_deref(), n, max_tokens, temperature, skip, &spec)
        }
        BenchCmd::Serve(a) => crate::serve_bench::run(a),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median seconds of `reps` runs of `f` (at least one) after one untimed warm-up run.
fn median_time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut v = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f()?;
        v.push(t.elapsed().as_secs_f64());
    }
    Ok(median(v))
}

fn forward(m: &ModelArg, context: usize, reps: usize, json: bool, prefill: usize) -> Result<()> {
    let model = m.load()?;
    let ks = [1usize, 2, 4, 8, 16, 32, 64];
    let mut cache = model.new_cache(context + 64);
    // Any fixed tokens will do: cost does not depend on their values.
    let prompt: Vec<u32> = (0..context as u32).map(|i| 100 + i % 1000).collect();
    dspark_decode::prefill(&model, &mut cache, &prompt)?;
    let block: Vec<u32> = (0..64u32).map(|i| 200 + i).collect();
    let mut rows = Vec::new();
    for &k in &ks {
        let mut times = Vec::with_capacity(reps);
        for r in 0..reps + 1 {
            let t = Instant::now();
            let mut seq = [SeqInput::logits_all(&mut cache, &block[..k])];
            model.forward(&mut seq, &TapSpec::default())?;
            let dt = t.elapsed().as_secs_f64();
            cache.truncate(context)?;
            if r > 0 {
                times.push(dt); // the first run warms caches and K-quant repacking
            }
        }
        rows.push((k, median(times)));
    }
    let single = rows[0].1;
    // Prefill: fresh tokens into an empty cache, through the same chunked path as generation.
    let prefill_s = if prefill > 0 {
        let prompt: Vec<u32> = (0..prefill as u32).map(|i| 300 + i % 5000).collect();
        let mut times = Vec::new();
        for r in 0..reps.min(3) + 1 {
            let mut cache = model.new_cache(prefill);
            let t = Instant::now();
            dspark_decode::prefill(&model, &mut cache, &prompt)?;
            if r > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        Some(median(times))
    } else {
        None
    };
    if json {
        let table: Vec<_> = rows
            .iter()
            .map(|&(k, s)| serde_json::json!({"k": k, "ms": s * 1e3, "tok_s": k as f64 / s}))
            .collect();
        println!(
            "{}",
            serde_json::json!({"model": m.model, "context": context, "threads": rayon_threads(),
                "kernels": kernels_in_use(), "cpu": cpu_summary(), "forward": table,
                "prefill": prefill_s.map(|s| serde_json::json!({"tokens": prefill, "s": s, "tok_s": prefill as f64 / s}))})
        );
    } else {
        println!("model {}  context {context}  threads {}  (median of {reps})", m.model, rayon_threads());
        println!("cpu {}  kernels {}", cpu_summary(), kernels_in_use());
        println!("{:>4} {:>10} {:>10} {:>12} {:>16}", "k", "ms", "tok/s", "vs single", "vs k × single");
        for (k, s) in rows {
            println!(
                "{k:>4} {:>10.2} {:>10.1} {:>11.2}× {:>15.2}×",
                s * 1e3,
                k as f64 / s,
                s / single,
                s / (k as f64 * single)
            );
        }
        if let Some(s) = prefill_s {
            println!("prefill of {prefill} tokens: {:.2} s = {:.1} tok/s", s, prefill as f64 / s);
        }
    }
    Ok(())
}

/// Median seconds of `reps` calls after one warm-up.
fn time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    Ok(median(t))
}

fn draft(
    m: &ModelArg,
    context: usize,
    gammas: &[usize],
    vocabs: &[String],
    (layers, intermediate): (usize, Option<usize>),
    (reps, only): (usize, &[String]),
    json: bool,
) -> Result<()> {
    use dspark_drafter_models::{HeadKind, InitOptions, Method};
    use dspark_spec::{Drafter, TargetFeatures};
    let target = std::sync::Arc::new(m.load()?);
    let name = m.name();
    let prompt: Vec<u32> = (0..context as u32 + 1).map(|i| 100 + i % 1000).collect();
    let mut cache = target.new_cache(context + 64);
    dspark_decode::prefill(&target, &mut cache, &prompt[..context])?;
    let target_ms = |k: usize, cache: &mut dspark_model::KvCache| -> Result<f64> {
        let block: Vec<u32> = (0..k as u32).map(|i| 200 + i).collect();
        Ok(time(reps, || {
            target.forward(&mut [SeqInput::logits_all(cache, &block)], &TapSpec::default())?;
            cache.truncate(context)?;
            Ok(())
        })? * 1e3)
    };
    let single = target_ms(1, &mut cache)?;
    // Target features for the context, once per set of tapped layers.
    let features = |layers: &[usize]| -> Result<TargetFeatures> {
        let mut c = target.new_cache(context);
        let seq = SeqInput {
            cache: &mut c,
            tokens: &prompt[..context],
            logit_rows: vec![],
            tap_rows: (0..context).collect(),
        };
        let out =
            target.forward(&mut [seq], &TapSpec { layers: layers.to_vec(), final_norm: false })?.remove(0);
        Ok(TargetFeatures { rows: context, taps: out.taps, final_norm: None })
    };
    let methods = [
        ("dflash", Method::Dflash, HeadKind::Markov),
        ("dspark-markov", Method::Dspark, HeadKind::Markov),
        ("dspark-rnn", Method::Dspark, HeadKind::Rnn),
        ("eagle3", Method::Eagle3, HeadKind::Markov),
    ];
    if let Some(bad) = only.iter().find(|m| !methods.iter().any(|(l, ..)| l == m)) {
        bail!("--methods: `{bad}` is not one of dflash, dspark-markov, dspark-rnn, eagle3");
    }
    let methods: Vec<_> = methods.into_iter().filter(|(l, ..)| only.iter().any(|m| m == l)).collect();
    let greedy = dspark_sampling::SamplingParams::default();
    let mut rows = Vec::new();
    let mut feats: std::collections::HashMap<Vec<usize>, TargetFeatures> = Default::default();
    if !json {
        println!(
            "target {name}  context {context}  threads {}  draft layers {layers}  drafting weights {:?}  \
             kernels {}  (median of {reps})",
            rayon_threads(),
            dspark_drafter_models::DraftWeights::from_env()?,
            kernels_in_use(),
        );
        println!("target forward: 1 token {single:.2} ms");
        println!(
            "{:<14} {:>3} {:>7} {:>10} {:>12} {:>14} {:>10}",
            "method", "γ", "V_d", "draft ms", "vs 1 token", "verify γ+1 ms", "feed 4 ms"
        );
    }
    for &gamma in gammas {
        let verify = target_ms(gamma + 1, &mut cache)?;
        for v in vocabs {
            let draft_vocab = match v.as_str() {
                "full" => None,
                n => {
                    let n: usize =
                        n.parse().with_context(|| format!("--vocabs: `{n}` is not full or a number"))?;
                    Some(dspark_drafter_models::frequent_tokens(&target, &Default::default(), n)?)
                }
            };
            for &(label, method, head) in &methods {
                let o = InitOptions {
                    method,
                    head,
                    layers,
                    intermediate,
                    gamma,
                    draft_vocab: draft_vocab.clone(),
                    layout: dspark_drafter_models::BlockLayout::Dspark,
                    ..Default::default()
                };
                let mut net = dspark_drafter_models::init(target.clone(), &name, &o)?;
                net.quantize_for_inference()?;
                let taps = net.config().target_layer_ids.clone();
                let mut d: Box<dyn Drafter> = match method {
                    Method::Eagle3 => Box::new(dspark_drafters::Eagle3Drafter::from_net(net, label)?),
                    _ => Box::new(dspark_drafters::BlockDrafter::from_net(net, label)?),
                };
                if !feats.contains_key(&taps) {
                    feats.insert(taps.clone(), features(&taps)?);
                }
                let f = &feats[&taps];
                // Rows 0..context-4 form the prompt; the last four are fed as one round's commit.
                let head_rows = |a: usize, b: usize| TargetFeatures {
                    rows: b - a,
                    taps: f
                        .taps
                        .iter()
                        .map(|t| t[a * target.config.hidden..b * target.config.hidden].to_vec())
                        .collect(),
                    final_norm: None,
                };
                // Feeding one round's commit (4 rows) to a drafter that holds the rest.
                let mut fed = Vec::with_capacity(reps);
                for _ in 0..reps {
                    d.begin(&prompt[..context - 3], &head_rows(0, context - 4), 0)?;
                    let t = Instant::now();
                    d.observe(&prompt[..context + 1], 3, &head_rows(context - 4, context))?;
                    fed.push(t.elapsed().as_secs_f64());
                }
                let feed4 = median(fed);
                let ms = time(reps, || {
                    d.propose(&prompt[..context + 1], gamma, &greedy)?;
                    Ok(())
                })? * 1e3;
                let vd = draft_vocab.as_ref().map_or(target.vocab_size(), |v| v.len());
                if !json {
                    println!(
                        "{label:<14} {gamma:>3} {vd:>7} {ms:>10.2} {:>11.2}× {verify:>14.2} {:>10.2}",
                        ms / single,
                        feed4 * 1e3
                    );
                }
                rows.push(serde_json::json!({
                    "method": label, "gamma": gamma, "draft_vocab": vd, "draft_ms": ms,
                    "vs_target_token": ms / single, "verify_ms": verify, "feed4_ms": feed4 * 1e3,
                }));
            }
        }
    }
    if json {
        println!(
            "{}",
            serde_json::json!({"model": m.model, "context": context, "threads": rayon_threads(),
                "kernels": dspark_kernels::kernel_path().name(),
                "drafting_weights": format!("{:?}", dspark_drafter_models::DraftWeights::from_env()?),
                "draft_layers": layers, "draft_intermediate": intermediate, "target_token_ms": single, "rounds": rows})
        );
    }
    Ok(())
}

/// The kernels the model's matmuls run on: candle's when `DSPARK_KERNELS=candle`, else our path.
fn kernels_in_use() -> &'static str {
    match KernelChoice::from_env() {
        KernelChoice::Candle => "candle",
        _ => dspark_kernels::kernel_path().name(),
    }
}

/// The CPU's model name and the instruction sets the kernels care about, for benchmark records.
pub fn cpu_summary() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default()
    };
    let flags = field("flags");
    let has: Vec<&str> = ["avx2", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8"]
        .into_iter()
        .filter(|f| flags.split_whitespace().any(|x| x == *f))
        .collect();
    format!("{} [{}]", field("model name"), has.join(" "))
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

fn kernels(reps: usize, training_only: bool) -> Result<()> {
    println!("cpu {}  kernels {}", cpu_summary(), dspark_kernels::kernel_path().name());
    if training_only {
        return training_matmuls(reps);
    }
    let shapes = [(576usize, 1536usize), (1536, 576), (576, 49152), (1536, 8960)];
    // Q4_0: the drafters' default drafting weights; the others: the GGUF targets' formats.
    let formats =
        [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K];
    println!(
        "{:<6} {:>12} {:>5} {:>12} {:>12} {:>8}",
        "format", "K×N", "batch", "candle GF/s", "dspark GF/s", "speedup"
    );
    for &(k, n) in &shapes {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
        for &fmt in &formats {
            if k % fmt.block_size() != 0 {
                continue; // K-quants need whole 256-value super-blocks
            }
            let q = QTensor::quantize(&w, fmt)?;
            let ours = QLinear::from_qtensor(QTensor::quantize(&w, fmt)?, KernelChoice::Ours)?;
            let theirs = QLinear::from_qtensor(q, KernelChoice::Candle)?;
            for &b in &[1usize, 4, 16] {
                let x = Tensor::randn(0f32, 1.0, (b, k), &Device::Cpu)?;
                let time = |l: &QLinear| median_time(reps, || l.forward(&x).map(|_| ()).map_err(Into::into));
                let flops = 2.0 * (k * n * b) as f64;
                let (tc, to) = (time(&theirs)?, time(&ours)?);
                println!(
                    "{:<6} {:>12} {:>5} {:>12.1} {:>12.1} {:>7.2}×",
                    format!("{fmt:?}"),
                    format!("{k}×{n}"),
                    b,
                    flops / tc / 1e9,
                    flops / to / 1e9,
                    tc / to
                );
            }
        }
    }
    training_matmuls(reps)
}

/// The products of a training step (Qwen2.5-Coder-1.5B drafter, 1 792 block positions): candle's
/// f32 matmul against our bf16 one on each path this CPU has, in the three layouts of a linear
/// layer's forward and backward.
fn training_matmuls(reps: usize) -> Result<()> {
    use dspark_kernels::bf16::{self, Bf16Path, Mat};
    if !bf16::available() {
        println!(
            "\ntraining matmuls: no AVX-512-BF16 here (or DSPARK_TRAIN_MATMUL=f32), so training takes \
             candle's f32 products; the bf16 column is the portable definition"
        );
    }
    let mut paths = vec![if bf16::available() { Bf16Path::Avx512 } else { Bf16Path::Portable }];
    if bf16::path() == Bf16Path::Amx {
        paths.push(Bf16Path::Amx);
    }
    println!("\ntraining matmuls (f32 operands, bf16 products; training uses {}):", bf16::path().name());
    print!("{:<28} {:>14} {:>12}", "product", "m×k×n", "candle GF/s");
    for p in &paths {
        print!(" {:>16}", format!("{} GF/s", p.name()));
    }
    println!(" {:>8}", "best ×");
    let (m, d, f) = (1792usize, 1536usize, 4096usize);
    let x = Tensor::randn(0f32, 1.0, (m, d), &Device::Cpu)?;
    let w = Tensor::randn(0f32, 1.0, (f, d), &Device::Cpu)?;
    let g = Tensor::randn(0f32, 1.0, (m, f), &Device::Cpu)?;
    let (xv, wv, gv) = (
        x.flatten_all()?.to_vec1::<f32>()?,
        w.flatten_all()?.to_vec1::<f32>()?,
        g.flatten_all()?.to_vec1::<f32>()?,
    );
    let time = |f: &dyn Fn() -> Result<()>| median_time(reps.min(5), f);
    type Run<'a> = Box<dyn Fn() -> Result<()> + 'a>;
    type Ours<'a> = Box<dyn Fn(Bf16Path) + 'a>;
    type Case<'a> = (&'static str, [usize; 3], Run<'a>, Ours<'a>);
    let cases: [Case; 3] = [
        (
            "y = x·Wᵀ (forward)",
            [m, d, f],
            Box::new(|| Ok(x.matmul(&w.t()?).map(|_| ())?)),
            Box::new(|p| drop(bf16::matmul_on(p, Mat::new(&xv, m, d), Mat::new(&wv, f, d).t()))),
        ),
        (
            "∂x = G·W (backward)",
            [m, f, d],
            Box::new(|| Ok(g.matmul(&w).map(|_| ())?)),
            Box::new(|p| drop(bf16::matmul_on(p, Mat::new(&gv, m, f), Mat::new(&wv, f, d)))),
        ),
        (
            "∂W = Gᵀ·x (backward)",
            [f, m, d],
            Box::new(|| Ok(g.t()?.matmul(&x).map(|_| ())?)),
            Box::new(|p| drop(bf16::matmul_on(p, Mat::new(&gv, m, f).t(), Mat::new(&xv, m, d)))),
        ),
    ];
    for (name, [a, b, c], theirs, ours) in &cases {
        let flops = 2.0 * (a * b * c) as f64;
        let tc = time(theirs.as_ref())?;
        print!("{:<28} {:>14} {:>12.1}", name, format!("{a}×{b}×{c}"), flops / tc / 1e9);
        let mut best = f64::INFINITY;
        for &p in &paths {
            let to = time(&|| {
                ours(p);
                Ok(())
            })?;
            best = best.min(to);
            print!(" {:>16.1}", flops / to / 1e9);
        }
        println!(" {:>7.2}×", tc / best);
    }
    Ok(())
}

const DEFAULT_PROMPTS: [&str; 5] = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in three sentences why the sky is blue.",
    "List five prime numbers and explain what makes them prime.",
    "Write a haiku about the sea.",
    "Describe how a hash map works, with a short example in Rust.",
];

/// Prompts from a JSONL file: the first of `prompt`, `question`, `problem`, `text` in each line.
pub fn read_prompts(path: &std::path::Path, n: usize) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{} line {}: not JSON", path.display(), i + 1))?;
        let p =
            ["prompt", "question", "problem", "text"].iter().find_map(|k| v.get(*k).and_then(|x| x.as_str()));
        match p {
            Some(p) => out.push(p.to_string()),
            None => bail!("{} line {}: no `prompt` field", path.display(), i + 1),
        }
        if out.len() == n {
            break;
        }
    }
    Ok(out)
}

fn decode(
    m: &ModelArg,
    prompts: Option<&std::path::Path>,
    n: usize,
    max_tokens: usize,
    temperature: f32,
    skip: usize,
    spec: &crate::DrafterArgs,
) -> Result<()> {
    let sampling = dspark_sampling::SamplingParams { temperature, top_k: None, top_p: None };
    sampling.validate()?;
    let model = std::sync::Arc::new(m.load()?);
    let mut drafter = spec.build(&model, &m.name())?;
    let texts: Vec<String> = match prompts {
        Some(p) => read_prompts(p, skip + n + 1)?.into_iter().skip(skip).collect(),
        None => DEFAULT_PROMPTS.iter().take(n + 1).map(|s| s.to_string()).collect(),
    };
    let params = dspark_decode::GenerateParams {
        max_tokens,
        sampling,
        seed: 0,
        stop_tokens: model.tokenizer.eos().to_vec(),
    };
    let (policy, cost) = match drafter.as_mut() {
        Some((d, gamma)) => spec.policy_for(&model, &m.name(), d.as_mut(), *gamma, false)?,
        None => (dspark_schedule::Policy::Fixed, None),
    };
    let sp = dspark_engine::SpecParams {
        max_tokens,
        draft_len: drafter.as_ref().map_or(1, |d| d.1),
        sampling,
        seed: 0,
        stop_tokens: params.stop_tokens.clone(),
        policy,
        cost,
    };
    let (mut plain_tokens, mut plain_s) = (0usize, 0f64);
    let mut stats = dspark_spec::SpecStats::default();
    for (i, text) in texts.iter().enumerate() {
        let prompt = crate::prompt_tokens(&model, text, false)?;
        // Plain and speculative alternate prompt by prompt so that machine noise hits both.
        let g = dspark_decode::generate(&model, &prompt, &params, |_| {})?;
        let s = match drafter.as_mut() {
            Some((d, _)) => Some(dspark_engine::generate(&model, d.as_mut(), &prompt, &sp, |_| {})?),
            None => None,
        };
        if let Some(s) = s.as_ref().filter(|_| sampling.is_greedy()) {
            if s.tokens != g.tokens {
                bail!("prompt {i}: speculative output differs from plain greedy output — a losslessness bug");
            }
        }
        if i == 0 {
            continue; // warm-up
        }
        // Every generated token over the whole decode phase, prefill excluded, for both.
        plain_tokens += g.stats.generated_tokens.saturating_sub(1);
        plain_s += g.stats.decode_s;
        if let Some(s) = s {
            let mut st = s.stats;
            st.generated_tokens = st.generated_tokens.saturating_sub(1);
            stats.merge(&st);
        }
    }
    let plain_tok_s = plain_tokens as f64 / plain_s.max(1e-9);
    let mut out = serde_json::json!({
        "engine": "dspark",
        "model": m.model,
        "threads": rayon_threads(),
        "prompts": texts.len().saturating_sub(1),
        "max_tokens": max_tokens,
        "plain_tok_s": plain_tok_s,
        "decode_tok_s": plain_tok_s,
    });
    if let Some(d) = &drafter {
        let spec_tok_s = stats.decode_tok_s();
        out["drafter"] = d.0.name().into();
        out["kernels"] = dspark_kernels::kernel_path().name().into();
        out["drafting_weights"] = format!("{:?}", dspark_drafter_models::DraftWeights::from_env()?).into();
        out["draft_len"] = d.1.into();
        out["policy"] = sp.policy.to_string().into();
        out["spec_tok_s"] = spec_tok_s.into();
        out["speedup"] = (spec_tok_s / plain_tok_s).into();
        out["tau"] = stats.tau().into();
        out["accept_at"] = stats.accept_at().into();
        out["draft_s"] = stats.draft_s.into();
        out["verify_s"] = stats.verify_s.into();
        out["verify_lengths"] = stats.verify_lengths().into();
        eprintln!(
            "plain {plain_tok_s:.1} tok/s | {} γ={} {} {spec_tok_s:.1} tok/s ({:.2}×), τ {:.2}, \
             acceptance per position {}\n  drafts verified per step (count:steps): {}",
            d.0.name(),
            d.1,
            sp.policy,
            spec_tok_s / plain_tok_s,
            stats.tau(),
            stats.accept_at().iter().map(|a| format!("{a:.2}")).collect::<Vec<_>>().join(" "),
            stats.verify_lengths_line()
        );
    }
    println!("{out}");
    Ok(())
}
