//! `dspark bench …`: figures printed side by side, measured in one run.

use crate::ModelArg;
use anyhow::Result;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use clap::Subcommand;
use dspark_kernels::{KernelChoice, QLinear};
use dspark_model::{SeqInput, TapSpec};
use std::time::Instant;

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Time one forward of k new tokens over a cache (logits at all k rows) for k = 1…32: the
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
    },
    /// Quantized matmul throughput, dspark's kernels against candle's, on random weights.
    Kernels {
        /// Timed repetitions per case.
        #[arg(long, default_value_t = 20)]
        reps: usize,
    },
}

pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Forward { model, context, reps, json } => forward(&model, context, reps, json),
        BenchCmd::Kernels { reps } => kernels(reps),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn forward(m: &ModelArg, context: usize, reps: usize, json: bool) -> Result<()> {
    let model = m.load()?;
    let ks = [1usize, 2, 4, 8, 16, 32];
    let mut cache = model.new_cache(context + 64);
    // Any fixed tokens will do: cost does not depend on their values.
    let prompt: Vec<u32> = (0..context as u32).map(|i| 100 + i % 1000).collect();
    dspark_decode::prefill(&model, &mut cache, &prompt)?;
    let block: Vec<u32> = (0..32u32).map(|i| 200 + i).collect();
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
    if json {
        let table: Vec<_> = rows
            .iter()
            .map(|&(k, s)| serde_json::json!({"k": k, "ms": s * 1e3, "tok_s": k as f64 / s}))
            .collect();
        println!(
            "{}",
            serde_json::json!({"model": m.model, "context": context, "threads": rayon_threads(), "forward": table})
        );
    } else {
        println!("model {}  context {context}  threads {}  (median of {reps})", m.model, rayon_threads());
        println!("{:>4} {:>10} {:>10} {:>16}", "k", "ms", "tok/s", "vs k × single");
        for (k, s) in rows {
            println!("{k:>4} {:>10.2} {:>10.1} {:>15.2}×", s * 1e3, k as f64 / s, s / (k as f64 * single));
        }
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

fn kernels(reps: usize) -> Result<()> {
    let shapes = [(576usize, 1536usize), (1536, 576), (576, 49152)];
    let formats = [GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q8_0];
    println!(
        "{:<6} {:>12} {:>5} {:>12} {:>12} {:>8}",
        "format", "K×N", "batch", "candle GF/s", "dspark GF/s", "speedup"
    );
    for &(k, n) in &shapes {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
        for &fmt in &formats {
            let q = QTensor::quantize(&w, fmt)?;
            let ours = QLinear::from_qtensor(QTensor::quantize(&w, fmt)?, KernelChoice::Ours)?;
            let theirs = QLinear::from_qtensor(q, KernelChoice::Candle)?;
            for &b in &[1usize, 16] {
                let x = Tensor::randn(0f32, 1.0, (b, k), &Device::Cpu)?;
                let time = |l: &QLinear| -> Result<f64> {
                    l.forward(&x)?;
                    let mut v = Vec::new();
                    for _ in 0..reps {
                        let t = Instant::now();
                        l.forward(&x)?;
                        v.push(t.elapsed().as_secs_f64());
                    }
                    Ok(median(v))
                };
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
    Ok(())
}
