//! Quantized matmul for the GGUF formats our models use (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
//! Q6_K). candle runs the legacy formats with a scalar loop that does not speed up with batch
//! size, so verifying k tokens would cost k decodes. Here weights are repacked once at load
//! into tiles of 16 output columns ([`PackedMatrix`]), activations are quantized to 8 bits,
//! and AVX-512 VNNI or AVX2 kernels (detected at run time, with a portable fallback) reuse each
//! unpacked weight vector across up to 8 activation rows. Every row runs the same arithmetic
//! whatever its batch ([`scalar`] defines it), so batching never changes a result.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
#[doc(hidden)]
pub use x86::PREFETCH;

pub mod bf16;
mod format;
mod linear;
mod packed;
mod path;
mod scalar;

pub use format::{decode_block, dequantize_row, Q8Rows, QuantFormat, QK};
pub use linear::{KernelChoice, QLinear};
pub use packed::{ColumnGroup, PackedMatrix, Record, ScaleKind, WeightBuf, GROUP, HUGE_PAGES, NT};
pub use path::{kernel_env_error, kernel_path, KernelPath};

use rayon::prelude::*;

/// Rows handled per kernel call; larger batches are split into chunks of this many rows (each
/// chunk is one pass over the weights).
pub const MAX_BATCH_ROWS: usize = 64;

struct OutPtr(*mut f32);
// The threads write disjoint column ranges of the output.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `y[m][n] = Σ_k x[m][k]·W[n][k]`. `x` is `m × k` row-major, `y` is `m × n` row-major.
/// `simd = false` forces the portable kernel; otherwise the process's [`kernel_path`] runs.
pub fn matmul(w: &PackedMatrix, x: &[f32], m: usize, y: &mut [f32], simd: bool) {
    matmul_on(if simd { kernel_path() } else { KernelPath::Scalar }, w, x, m, y)
}

/// Below this many multiply-adds a product runs on the calling thread.
const SERIAL_MACS: usize = 1 << 20;

/// [`matmul`] on a given path (tests compare paths). A path this CPU lacks runs the portable
/// kernel instead.
pub fn matmul_on(path: KernelPath, w: &PackedMatrix, x: &[f32], m: usize, y: &mut [f32]) {
    let (n, k) = (w.n, w.k);
    assert_eq!(x.len(), m * k);
    assert_eq!(y.len(), m * n);
    let path = if path.available() { path } else { KernelPath::Scalar };
    let tile_bytes = w.groups() * w.rec.size;
    // Enough chunks for two threads to balance, few enough that scheduling stays cheap, and
    // small enough that a chunk's weights stay in L2 while every pass of rows reads them.
    let chunk = (w.tiles / 32).clamp(1, 16).min((512 << 10) / tile_bytes.max(1)).max(1);
    let chunks = w.tiles.div_ceil(chunk);
    for r0 in (0..m).step_by(MAX_BATCH_ROWS) {
        let rows = (m - r0).min(MAX_BATCH_ROWS);
        // K-quants take one activation scale per 256-value super-block.
        let group = if w.scales == ScaleKind::F16 { 1 } else { 8 };
        let xq = Q8Rows::quantize(&x[r0 * k..(r0 + rows) * k], rows, k, w.nbp, group);
        let out = OutPtr(y[r0 * n..].as_mut_ptr());
        let run = |c: usize| {
            let t0 = c * chunk;
            let t1 = (t0 + chunk).min(w.tiles);
            let out = &out;
            // SAFETY: the path's instructions were detected; x was quantized to w's padded
            // width; each task writes only its own tiles' columns (below n) of rows it owns.
            unsafe {
                match path {
                    #[cfg(target_arch = "x86_64")]
                    KernelPath::Amx => avx512::range_amx(w, &xq, t0, t1, out.0, n),
                    #[cfg(target_arch = "x86_64")]
                    KernelPath::Avx512Vnni => avx512::range(w, &xq, t0, t1, out.0, n),
                    #[cfg(target_arch = "x86_64")]
                    KernelPath::Avx2 => avx2::range(w, &xq, t0, t1, out.0, n),
                    _ => scalar::range(w, &xq, t0 * NT, (t1 * NT).min(n), out.0, n),
                }
            }
        };
        // A product of under a million multiply-adds (a drafter's sequential head, a confidence
        // head) takes a few microseconds: less than waking the pool's threads. The columns are
        // the same either way, so results do not depend on this choice.
        if rows * n * k < SERIAL_MACS {
            (0..chunks).for_each(run);
        } else {
            (0..chunks).into_par_iter().for_each(run);
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

    /// Every path against the portable definition, bit for bit, for every format and batch
    /// sizes 1…64; and each row of a batch equals that row computed alone. Shapes with an odd
    /// number of groups, a partly padded last group and three tiles of columns, the last one
    /// partial, reach every tail.
    #[test]
    fn every_path_equals_the_scalar_definition_bit_for_bit_for_k_1_to_64() {
        let all = FORMATS.into_iter().chain([GgmlDType::Q4K, GgmlDType::Q6K]);
        for fmt in all {
            let k = if matches!(fmt, GgmlDType::Q4K | GgmlDType::Q6K) { 2304 } else { 1056 };
            let n = 37;
            let q = QTensor::quantize(&random(n, k, 11), fmt).unwrap();
            let w = PackedMatrix::from_gguf(QuantFormat::from_ggml(fmt).unwrap(), &q.data().unwrap(), n, k);
            let x: Vec<f32> = random(64, k, 12).flatten_all().unwrap().to_vec1().unwrap();
            let mut want = vec![0f32; 64 * n];
            matmul_on(KernelPath::Scalar, &w, &x, 64, &mut want);
            for path in [KernelPath::Amx, KernelPath::Avx512Vnni, KernelPath::Avx2] {
                if !path.available() {
                    eprintln!("skipped {}: this CPU lacks it", path.name());
                    continue;
                }
                for m in 1..=64 {
                    let mut y = vec![0f32; m * n];
                    matmul_on(path, &w, &x[..m * k], m, &mut y);
                    assert_eq!(y, want[..m * n], "{fmt:?} {} m={m}", path.name());
                }
            }
        }
    }

    /// The tests above would pass if every path were equally wrong in the same way; the
    /// definition itself is checked against candle here with inputs that make rounding small.
    #[test]
    fn k_quant_definition_matches_dequantize_then_matmul() {
        let (n, k) = (24, 2304);
        let w = random(n, k, 5);
        for fmt in [GgmlDType::Q4K, GgmlDType::Q6K] {
            let q = QTensor::quantize(&w, fmt).unwrap();
            for m in [1, 3, 8] {
                let x = random(m, k, 60 + m as u64);
                let want = reference(&q, &x);
                assert_close(&ours(&q, &x, false), &want, &format!("{fmt:?} scalar m={m}"));
                assert_close(&ours(&q, &x, true), &want, &format!("{fmt:?} simd m={m}"));
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

    /// Integers at their largest magnitude against activations at theirs: where a path sums
    /// products in a narrow type (AVX2 keeps a block's `maddubs` sums in i16), a sum that
    /// saturated would show here as a difference from the scalar definition.
    #[test]
    fn the_largest_integers_give_the_scalar_definition_on_every_path() {
        const ONE: [u8; 2] = [0x00, 0x3C]; // f16 1.0
        let all = FORMATS.into_iter().chain([GgmlDType::Q4K, GgmlDType::Q6K]);
        for fmt in all.map(|f| QuantFormat::from_ggml(f).unwrap()) {
            let (n, k) = (20, 512);
            let per_row = if matches!(fmt, QuantFormat::Q4K | QuantFormat::Q6K) { k / 256 } else { k / QK };
            let mut block = vec![0xFFu8; fmt.block_bytes()];
            match fmt {
                // -128: the one byte whose magnitude exceeds 127.
                QuantFormat::Q8_0 => block[2..].fill(0x80),
                QuantFormat::Q6K => block[192..208].fill(0x7F),
                _ => {}
            }
            match fmt {
                QuantFormat::Q6K => block[208..210].copy_from_slice(&ONE),
                QuantFormat::Q4_1 | QuantFormat::Q5_1 | QuantFormat::Q4K => {
                    block[0..2].copy_from_slice(&ONE);
                    block[2..4].copy_from_slice(&ONE);
                }
                _ => block[0..2].copy_from_slice(&ONE),
            }
            let data = block.repeat(n * per_row);
            let w = PackedMatrix::from_gguf(fmt, &data, n, k);
            // Rows of +1 and of −1 quantize to ±127 everywhere; the last mixes signs.
            let m = 9;
            let x: Vec<f32> = (0..m * k)
                .map(|i| match i / k {
                    r if r == m - 1 => {
                        if i % 3 == 0 {
                            -1.0
                        } else {
                            1.0
                        }
                    }
                    r if r % 2 == 0 => 1.0,
                    _ => -1.0,
                })
                .collect();
            let mut want = vec![0f32; m * n];
            matmul_on(KernelPath::Scalar, &w, &x, m, &mut want);
            assert!(want.iter().all(|v| v.is_finite() && *v != 0.0), "{fmt:?}: degenerate reference");
            for path in [KernelPath::Amx, KernelPath::Avx512Vnni, KernelPath::Avx2] {
                if !path.available() {
                    eprintln!("skipped {}: this CPU lacks it", path.name());
                    continue;
                }
                for rows in 1..=m {
                    let mut y = vec![0f32; rows * n];
                    matmul_on(path, &w, &x[..rows * k], rows, &mut y);
                    assert_eq!(y, want[..rows * n], "{fmt:?} {} rows={rows}", path.name());
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
