//! Batch-1 matmul time per token over every 2-D tensor of a real GGUF, weights streamed from
//! memory as in decoding: `cargo run --release --example stream -- MODEL.gguf [reps]`.
//! `HOT=NAME` instead repeats the first tensor whose name contains NAME, which then stays in
//! cache: the kernel's compute-bound rate.
use candle_core::quantized::gguf_file;
use dspark_kernels::{matmul, PackedMatrix, QuantFormat};
use std::time::Instant;

fn main() {
    let path = std::env::args().nth(1).expect("path to a .gguf");
    let reps: usize = std::env::args().nth(2).map(|s| s.parse().unwrap()).unwrap_or(10);
    let hot = std::env::var("HOT").ok();
    if std::env::var("NOHUGE").is_ok() {
        dspark_kernels::HUGE_PAGES.store(false, std::sync::atomic::Ordering::Relaxed);
    }
    let mut f = std::fs::File::open(&path).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut mats = Vec::new();
    let mut names: Vec<_> = content.tensor_infos.keys().cloned().collect();
    names.sort();
    for name in names {
        let info = &content.tensor_infos[&name];
        let dims = info.shape.dims();
        if dims.len() != 2
            || name.contains("token_embd") && content.tensor_infos.contains_key("output.weight")
        {
            continue;
        }
        if hot.as_ref().is_some_and(|h| !name.contains(h.as_str()) || !mats.is_empty()) {
            continue;
        }
        let Some(fmt) = QuantFormat::from_ggml(info.ggml_dtype) else { continue };
        let qt = info.read(&mut f, content.tensor_data_offset, &candle_core::Device::Cpu).unwrap();
        let data = qt.data().unwrap();
        mats.push((name.clone(), fmt, data.len(), PackedMatrix::from_gguf(fmt, &data, dims[0], dims[1])));
    }
    let bytes: usize = mats.iter().map(|m| m.2).sum();
    if let Ok(r) = std::fs::read_to_string("/proc/self/smaps_rollup") {
        r.lines().filter(|l| l.starts_with("AnonHuge")).for_each(|l| println!("{l}"));
    }
    let inner = if hot.is_some() { 50 } else { 1 };
    println!(
        "{} matrices, {:.1} MB{}",
        mats.len(),
        bytes as f64 / 1e6,
        if hot.is_some() { " (hot)" } else { "" }
    );
    if let Ok(list) = std::env::var("AB") {
        // Interleaved A/B of prefetch distances: the machine's bandwidth drifts over seconds.
        let ds: Vec<usize> = list.split(',').map(|v| v.parse().unwrap()).collect();
        let mut times = vec![Vec::new(); ds.len()];
        for _ in 0..reps {
            for (i, &d) in ds.iter().enumerate() {
                dspark_kernels::PREFETCH.store(d, std::sync::atomic::Ordering::Relaxed);
                let t0 = Instant::now();
                for (_, _, _, m) in &mats {
                    let x = input(m.k);
                    let mut y = vec![0f32; m.n];
                    matmul(m, &x, 1, &mut y, true);
                }
                times[i].push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        for (d, mut t) in ds.into_iter().zip(times) {
            t.sort_by(f64::total_cmp);
            println!("prefetch {d:>5}: median {:.2} ms  min {:.2} ms", t[t.len() / 2], t[0]);
        }
        return;
    }
    let mut per_fmt = std::collections::BTreeMap::<String, (f64, usize)>::new();
    let mut best = f64::MAX;
    for rep in 0..reps {
        let t0 = Instant::now();
        for (_, fmt, _, m) in &mats {
            let x = input(m.k);
            let mut y = vec![0f32; m.n];
            let t = Instant::now();
            for _ in 0..inner {
                matmul(m, &x, 1, &mut y, true);
            }
            if rep > 0 {
                let e = per_fmt.entry(format!("{fmt:?}")).or_default();
                e.0 += t.elapsed().as_secs_f64() / inner as f64;
                e.1 += m.n * m.k;
            }
        }
        let dt = t0.elapsed().as_secs_f64() / inner as f64;
        if rep > 0 {
            best = best.min(dt);
        }
    }
    println!("best {:.3} ms/token  {:.1} GB/s", best * 1e3, bytes as f64 / best / 1e9);
    for (k, (t, n)) in per_fmt {
        println!(
            "  {k}: {:.3} ms/token, {:.1} Mvals",
            t * 1e3 / (reps - 1) as f64,
            n as f64 / 1e6 / (reps - 1) as f64
        );
    }
}

/// A fixed activation row of width `k`.
fn input(k: usize) -> Vec<f32> {
    (0..k).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect()
}
