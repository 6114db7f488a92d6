//! Quantized matmul for the GGUF formats our models use (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
//! Q6_K). candle runs the legacy formats with a scalar loop that does not speed up with batch
//! size, so verifying k tokens would cost k decodes. Here weights are repacked once at load
//! ([`PackedMatrix`]), activations are quantized to 8 bits, and AVX2 kernels (detected at run
//! time, with a portable fallback) reuse each unpacked weight block across a register tile of
//! activation rows. Every row runs the same arithmetic whatever its batch, so batching never
//! changes a result.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
#[doc(hidden)]
pub use avx2::PREFETCH;

mod format;
mod linear;
mod packed;

pub use format::{decode_block, dequantize_row, Q8Rows, QuantFormat, QK};
pub use linear::{KernelChoice, QLinear};
pub use packed::{PackedMatrix, ScaleKind, WeightBuf, HUGE_PAGES};

use rayon::prelude::*;

/// Rows handled per kernel call; larger batches are split into chunks of this many rows.
pub const MAX_BATCH_ROWS: usize = 32;

pub fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

struct OutPtr(*mut f32);
// The threads write disjoint column ranges of the output.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `y[m][n] = Σ_k x[m][k]·W[n][k]`. `x` is `m × k` row-major, `y` is `m × n` row-major.
/// `simd = false` forces the portable kernel.
pub fn matmul(w: &PackedMatrix, x: &[f32], m: usize, y: &mut [f32], simd: bool) {
    let (n, k) = (w.n, w.k);
    assert_eq!(x.len(), m * k);
    assert_eq!(y.len(), m * n);
    let simd = simd && avx2_available();
    for r0 in (0..m).step_by(MAX_BATCH_ROWS) {
        let rows = (m - r0).min(MAX_BATCH_ROWS);
        // K-quant kernels sum whole super-blocks in integers: one activation scale per 256.
        let group = if w.scales == ScaleKind::F16 { 1 } else { 8 };
        let xq = Q8Rows::quantize(&x[r0 * k..(r0 + rows) * k], rows, k, w.nbp, group);
        let out = OutPtr(y[r0 * n..].as_mut_ptr());
        // Enough chunks for two threads to balance, few enough that scheduling stays cheap.
        let chunk = (n / 32).clamp(8, 256);
        let chunks = n.div_ceil(chunk);
        (0..chunks).into_par_iter().for_each(|c| {
            let n0 = c * chunk;
            let n1 = (n0 + chunk).min(n);
            let out = &out;
            if simd {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2/FMA/F16C were detected; x was quantized to w's padded width; each
                // task writes only its own columns n0..n1.
                unsafe {
                    avx2::matmul_range(w, &xq, n0, n1, out.0, n)
                };
            } else {
                // SAFETY: as above, disjoint columns.
                unsafe { scalar_range(w, &xq, n0, n1, out.0, n) };
            }
        });
    }
}

/// Portable version of the AVX2 kernel: integer block dots, f32 scaling.
///
/// # Safety
/// `out` must have room for `x.rows` rows of stride `ldo` covering columns `n0..n1`.
unsafe fn scalar_range(w: &PackedMatrix, x: &Q8Rows, n0: usize, n1: usize, out: *mut f32, ldo: usize) {
    let mut q = [0i32; QK];
    for n in n0..n1 {
        for r in 0..x.rows {
            let mut acc = 0f32;
            for b in 0..w.nb {
                let (dlo, dhi, m) = w.block(n, b, &mut q);
                let xb = r * x.nbp + b;
                let a = &x.qs[xb * QK..(xb + 1) * QK];
                let dot = |h: std::ops::Range<usize>| {
                    q[h.clone()].iter().zip(&a[h]).map(|(&qi, &ai)| qi * ai as i32).sum::<i32>()
                };
                acc += x.d[xb] * (dlo * dot(0..16) as f32 + dhi * dot(16..32) as f32) + m * x.s[xb];
            }
            *out.add(r * ldo + n) = acc;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    const FORMATS: [GgmlDType; 5] =
        [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1, GgmlDType::Q8_0];

    fn random(rows: usize, cols: usize, seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let v: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
    }

    /// Reference: candle dequantizes the weights, then an f32 matmul.
    fn reference(q: &QTensor, x: &Tensor) -> Vec<f32> {
        let w = q.dequantize(&Device::Cpu).unwrap();
        x.matmul(&w.t().unwrap()).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    fn ours(q: &QTensor, x: &Tensor, simd: bool) -> Vec<f32> {
        let (n, k) = q.shape().dims2().unwrap();
        let (m, _) = x.dims2().unwrap();
        let data = q.data().unwrap();
        let w = PackedMatrix::from_gguf(QuantFormat::from_ggml(q.dtype()).unwrap(), &data, n, k);
        let mut y = vec![0f32; m * n];
        matmul(&w, &x.flatten_all().unwrap().to_vec1().unwrap(), m, &mut y, simd);
        y
    }

    /// Activations are quantized to 8 bits, so results differ from the f32 reference by about
    /// 1 % of the typical output magnitude; a wrong nibble order or scale is off by far more.
    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32).sqrt();
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 0.02 * rms + 1e-4, "{what}: element {i}: {g} vs {w} (rms {rms})");
        }
    }

    #[test]
    fn every_format_matches_dequantize_then_matmul_for_batches_1_to_40() {
        let (n, k) = (48, 256);
        let w = random(n, k, 1);
        for fmt in FORMATS {
            let q = QTensor::quantize(&w, fmt).unwrap();
            for m in [1, 2, 3, 7, 16, 32, 33, 40] {
                let x = random(m, k, 100 + m as u64);
                let want = reference(&q, &x);
                assert_close(&ours(&q, &x, true), &want, &format!("{fmt:?} simd m={m}"));
                assert_close(&ours(&q, &x, false), &want, &format!("{fmt:?} scalar m={m}"));
            }
        }
    }

    #[test]
    fn simd_and_scalar_kernels_agree_to_rounding() {
        let (n, k) = (64, 512);
        let w = random(n, k, 2);
        for fmt in FORMATS {
            let q = QTensor::quantize(&w, fmt).unwrap();
            for m in [1, 5, 32] {
                let x = random(m, k, 7);
                let (a, b) = (ours(&q, &x, true), ours(&q, &x, false));
                for (u, v) in a.iter().zip(&b) {
                    assert!((u - v).abs() <= 1e-4 * (1.0 + v.abs()), "{fmt:?} m={m}: {u} vs {v}");
                }
            }
        }
    }

    #[test]
    fn selected_rows_give_exactly_those_rows_of_the_full_product() {
        let (n, k) = (40, 512);
        let w = random(n, k, 4);
        let ids = [3usize, 0, 39, 17, 18, 5];
        for fmt in FORMATS.into_iter().chain([GgmlDType::Q4K, GgmlDType::Q6K]) {
            let q = QTensor::quantize(&w, fmt).unwrap();
            let data = q.data().unwrap();
            let full = PackedMatrix::from_gguf(QuantFormat::from_ggml(fmt).unwrap(), &data, n, k);
            let sub = full.select_rows(&ids);
            for m in [1, 3, 9] {
                let x: Vec<f32> = random(m, k, 50 + m as u64).flatten_all().unwrap().to_vec1().unwrap();
                let (mut yf, mut ys) = (vec![0f32; m * n], vec![0f32; m * ids.len()]);
                matmul(&full, &x, m, &mut yf, true);
                matmul(&sub, &x, m, &mut ys, true);
                for r in 0..m {
                    for (j, &i) in ids.iter().enumerate() {
                        assert_eq!(ys[r * ids.len() + j], yf[r * n + i], "{fmt:?} m={m} row {i}");
                    }
                }
            }
        }
    }

    #[test]
    fn rows_dequantize_like_candle() {
        let k = 512;
        let w = random(4, k, 3);
        for fmt in FORMATS {
            let q = QTensor::quantize(&w, fmt).unwrap();
            let want: Vec<f32> =
                q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let data = q.data().unwrap();
            let f = QuantFormat::from_ggml(fmt).unwrap();
            let packed = PackedMatrix::from_gguf(f, &data, 4, k);
            for r in 0..4 {
                let mut out = vec![0f32; k];
                packed.dequantize_row(r, &mut out);
                assert_eq!(out, want[r * k..(r + 1) * k], "{fmt:?} packed row {r}");
                if !matches!(f, QuantFormat::Q4K | QuantFormat::Q6K) {
                    let rb = k / QK * f.block_bytes();
                    let mut out = vec![0f32; k];
                    dequantize_row(f, &data[r * rb..(r + 1) * rb], &mut out);
                    assert_eq!(out, want[r * k..(r + 1) * k], "{fmt:?} row {r}");
                }
            }
        }
    }
}
