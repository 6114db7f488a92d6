//! Single-thread kernel timing for development: `cargo run --release --example kbench`.
//! `FORMATS=Q4K,Q6K` and `ROWS=1,8,32` narrow the cases; `N`/`K` set the matrix shape.
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use dspark_kernels::{matmul, PackedMatrix, QuantFormat};
use std::time::Instant;

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name).unwrap_or_else(|_| default.into()).split(',').map(|s| s.trim().to_string()).collect()
}

fn main() {
    let n: usize = std::env::var("N").ok().and_then(|v| v.parse().ok()).unwrap_or(2048);
    let k: usize = std::env::var("K").ok().and_then(|v| v.parse().ok()).unwrap_or(1536);
    let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    println!("kernel path: {}", dspark_kernels::kernel_path().name());
    for f in env_list("FORMATS", "Q4_1,Q5_0,Q8_0,Q4K,Q6K") {
        let fmt = match f.as_str() {
            "Q4_0" => GgmlDType::Q4_0,
            "Q4_1" => GgmlDType::Q4_1,
            "Q5_0" => GgmlDType::Q5_0,
            "Q5_1" => GgmlDType::Q5_1,
            "Q8_0" => GgmlDType::Q8_0,
            "Q4K" => GgmlDType::Q4K,
            "Q6K" => GgmlDType::Q6K,
            other => panic!("unknown format {other}"),
        };
        let q = QTensor::quantize(&w, fmt).unwrap();
        let data = q.data().unwrap();
        let m = PackedMatrix::from_gguf(QuantFormat::from_ggml(fmt).unwrap(), &data, n, k);
        for rows in env_list("ROWS", "1,4,8,16,32") {
            let rows: usize = rows.parse().unwrap();
            let x: Vec<f32> = (0..rows * k).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
            let mut y = vec![0f32; rows * n];
            let reps = (400 / rows).max(10);
            let t = pool.install(|| {
                matmul(&m, &x, rows, &mut y, true);
                let t = Instant::now();
                for _ in 0..reps {
                    matmul(&m, &x, rows, &mut y, true);
                }
                t.elapsed().as_secs_f64() / reps as f64
            });
            println!(
                "{fmt:?} rows {rows:>2}: {:>8.1} us  {:>6.1} GMAC/s  {:>6.1} us/row",
                t * 1e6,
                (n * k * rows) as f64 / t / 1e9,
                t * 1e6 / rows as f64
            );
        }
    }
}
