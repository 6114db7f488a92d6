//! Single-thread kernel timing for development: `cargo run --release --example kbench`.
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use dspark_kernels::{matmul, PackedMatrix, QuantFormat};
use std::time::Instant;

fn main() {
    let (n, k) = (2048, 1536);
    let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
    for fmt in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
        let q = QTensor::quantize(&w, fmt).unwrap();
        let data = q.data().unwrap();
        let m = PackedMatrix::from_gguf(QuantFormat::from_ggml(fmt).unwrap(), &data, n, k);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        for rows in [1, 2, 4, 8, 16] {
            let x: Vec<f32> = (0..rows * k).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
            let mut y = vec![0f32; rows * n];
            let reps = 200 / rows;
            let t = pool.install(|| {
                matmul(&m, &x, rows, &mut y, true);
                let t = Instant::now();
                for _ in 0..reps {
                    matmul(&m, &x, rows, &mut y, true);
                }
                t.elapsed().as_secs_f64() / reps as f64
            });
            println!(
                "{fmt:?} rows {rows:>2}: {:>8.1} us  {:>6.1} GF/s  {:>6.1} us/row",
                t * 1e6,
                2.0 * (n * k * rows) as f64 / t / 1e9,
                t * 1e6 / rows as f64
            );
        }
    }
}
