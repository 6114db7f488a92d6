//! bf16 training-product timing for development: `cargo run --release --example bf16bench`.
//! `SHAPES=m×k×n,…` sets the products; every path this CPU has is timed (2 threads: rayon's
//! default pool). `dspark bench kernels --training` is the user-facing comparison.
use dspark_kernels::bf16::{matmul_on, path, Bf16Path, Mat};
use std::time::Instant;

fn main() {
    let shapes =
        std::env::var("SHAPES").unwrap_or_else(|_| "1792x1536x4096,4096x4096x4096,512x1536x1536".into());
    let mut paths = vec![Bf16Path::Avx512];
    if path() == Bf16Path::Amx {
        paths.push(Bf16Path::Amx);
    }
    for s in shapes.split(',') {
        let d: Vec<usize> = s.split('x').map(|v| v.trim().parse().expect("m×k×n")).collect();
        let (m, k, n) = (d[0], d[1], d[2]);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 104729) % 1000) as f32 / 500.0 - 1.0).collect();
        for &p in &paths {
            for (ta, tb) in [(false, true), (false, false), (true, false)] {
                let am = if ta { Mat::new(&a, k, m).t() } else { Mat::new(&a, m, k) };
                let bm = if tb { Mat::new(&b, n, k).t() } else { Mat::new(&b, k, n) };
                matmul_on(p, am, bm);
                let reps = 5;
                let t = Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(matmul_on(p, am, bm));
                }
                let s = t.elapsed().as_secs_f64() / reps as f64;
                println!(
                    "{:<12} {m}×{k}×{n} A{} B{}: {:8.2} ms {:8.1} GF/s",
                    p.name(),
                    if ta { "ᵀ" } else { " " },
                    if tb { "ᵀ" } else { " " },
                    s * 1e3,
                    2.0 * (m * k * n) as f64 / s / 1e9
                );
            }
        }
    }
}
