//! GGUF block formats handled by our kernels, with their scalar decoding.
//!
//! Every format stores 32 weights per block. Decoding yields 32 small integers plus a scale `d`
//! and, for the "_1" formats, an offset `m`: weight = d·q + m.

use half::f16;

pub const QK: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum QuantFormat {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    /// K-quants: `block_bytes` is the size of a 256-value super-block.
    Q4K,
    Q6K,
}

impl QuantFormat {
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q6K => 210,
        }
    }

    /// What the kernels' stored unsigned integers exceed the signed ones by (`u = q + bias`).
    pub fn bias(self) -> i32 {
        match self {
            Self::Q4_0 => 8,
            Self::Q5_0 => 16,
            Self::Q8_0 => 128,
            Self::Q6K => 32,
            _ => 0,
        }
    }

    /// Formats with an offset `m`: their integers are unsigned.
    pub const fn has_min(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q5_1 | Self::Q4K)
    }

    pub fn from_ggml(dtype: candle_core::quantized::GgmlDType) -> Option<Self> {
        use candle_core::quantized::GgmlDType as G;
        Some(match dtype {
            G::Q4_0 => Self::Q4_0,
            G::Q4_1 => Self::Q4_1,
            G::Q5_0 => Self::Q5_0,
            G::Q5_1 => Self::Q5_1,
            G::Q8_0 => Self::Q8_0,
            G::Q4K => Self::Q4K,
            G::Q6K => Self::Q6K,
            _ => return None,
        })
    }
}

#[inline]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_le_bytes([b[off], b[off + 1]]).to_f32()
}

/// Decodes one 32-value block of a non-K format into integers `q` (signed for formats without
/// offset, unsigned otherwise), returning `(d, m)`.
pub fn decode_block(format: QuantFormat, block: &[u8], q: &mut [i32; QK]) -> (f32, f32) {
    let d = f16_at(block, 0);
    match format {
        QuantFormat::Q4_0 | QuantFormat::Q4_1 => {
            let (m, qs) = if format == QuantFormat::Q4_1 {
                (f16_at(block, 2), &block[4..20])
            } else {
                (0.0, &block[2..18])
            };
            let bias = if format == QuantFormat::Q4_0 { 8 } else { 0 };
            for j in 0..16 {
                q[j] = (qs[j] & 0x0F) as i32 - bias;
                q[j + 16] = (qs[j] >> 4) as i32 - bias;
            }
            (d, m)
        }
        QuantFormat::Q5_0 | QuantFormat::Q5_1 => {
            let (m, qh, qs) = if format == QuantFormat::Q5_1 {
                (f16_at(block, 2), &block[4..8], &block[8..24])
            } else {
                (0.0, &block[2..6], &block[6..22])
            };
            let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
            let bias = if format == QuantFormat::Q5_0 { 16 } else { 0 };
            for j in 0..16 {
                let h0 = ((qh >> j) & 1) as i32;
                let h1 = ((qh >> (j + 16)) & 1) as i32;
                q[j] = ((qs[j] & 0x0F) as i32 | (h0 << 4)) - bias;
                q[j + 16] = ((qs[j] >> 4) as i32 | (h1 << 4)) - bias;
            }
            (d, m)
        }
        QuantFormat::Q8_0 => {
            for j in 0..QK {
                q[j] = block[2 + j] as i8 as i32;
            }
            (d, 0.0)
        }
        QuantFormat::Q4K | QuantFormat::Q6K => unreachable!("K-quants are decoded by PackedMatrix"),
    }
}

/// Dequantizes one row of `k` weights.
pub fn dequantize_row(format: QuantFormat, row: &[u8], out: &mut [f32]) {
    let bb = format.block_bytes();
    let mut q = [0i32; QK];
    for (b, chunk) in out.chunks_mut(QK).enumerate() {
        let (d, m) = decode_block(format, &row[b * bb..(b + 1) * bb], &mut q);
        for (o, &qi) in chunk.iter_mut().zip(q.iter()) {
            *o = d * qi as f32 + m;
        }
    }
}

/// Activations quantized to 8 bits, the partner of every weight format here. Each run of
/// `group` consecutive 32-value blocks shares one scale: 1 for the legacy formats, 8 (256
/// values, llama.cpp's Q8_K) for K-quants. Rows are padded with zeros to `nbp` blocks (whole
/// 256-value groups), values in their natural order: the kernels broadcast 4 of them at a time.
pub struct Q8Rows {
    pub rows: usize,
    pub k: usize,
    /// Padded blocks per row.
    pub nbp: usize,
    /// `rows × nbp × 32`.
    pub qs: Vec<i8>,
    /// Per block (`rows × nbp`): the scale.
    pub d: Vec<f32>,
    /// Per block: the sum of its 32 integers (the offset term of Q4_K, and the bias correction
    /// of formats stored with one).
    pub bsum: Vec<i32>,
    /// Per block: `d · bsum` (the offset term of the "_1" formats).
    pub xs: Vec<f32>,
    /// Per pair of blocks (`rows × nbp / 2`): their two sums as i16, low half first (a block's
    /// sum is at most 32 · 127), Q4_K's offset term's partner in `vpdpwssd`.
    pub bpair: Vec<i32>,
    /// Per block: the sums of its two halves as i16, low half first (Q6_K's bias term's partner
    /// in `vpdpwssd`).
    pub hpair: Vec<i32>,
}

impl Q8Rows {
    pub fn quantize(x: &[f32], rows: usize, k: usize, nbp: usize, group: usize) -> Self {
        use rayon::prelude::*;
        debug_assert_eq!(x.len(), rows * k);
        debug_assert!(nbp * QK >= k && (k / QK).is_multiple_of(group) && nbp.is_multiple_of(8));
        let kp = nbp * QK;
        let mut qs = vec![0i8; rows * kp];
        let mut d = vec![0f32; rows * nbp];
        let mut bsum = vec![0i32; rows * nbp];
        let mut hpair = vec![0i32; rows * nbp];
        let mut xs = vec![0f32; rows * nbp];
        // Rows are independent; big batches quantize on all threads. A few rows (a drafter's
        // block, a decode step) take microseconds, less than waking the pool.
        type Row<'a> =
            (((&'a [f32], &'a mut [i8]), &'a mut [f32]), ((&'a mut [i32], &'a mut [i32]), &'a mut [f32]));
        let row = |(((x, q), d), ((b, h), s)): Row| quantize_row(x, q, d, b, h, s, group);
        if rows * k >= 64 * 1024 {
            x.par_chunks(k)
                .zip(qs.par_chunks_mut(kp))
                .zip(d.par_chunks_mut(nbp))
                .zip(bsum.par_chunks_mut(nbp).zip(hpair.par_chunks_mut(nbp)).zip(xs.par_chunks_mut(nbp)))
                .for_each(row);
        } else {
            x.chunks(k)
                .zip(qs.chunks_mut(kp))
                .zip(d.chunks_mut(nbp))
                .zip(bsum.chunks_mut(nbp).zip(hpair.chunks_mut(nbp)).zip(xs.chunks_mut(nbp)))
                .for_each(row);
        }
        let bpair = bsum.chunks_exact(2).map(|p| (p[0] & 0xFFFF) | (p[1] << 16)).collect();
        Self { rows, k, nbp, qs, d, bsum, xs, bpair, hpair }
    }
}

fn quantize_row(
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    bsum: &mut [i32],
    hpair: &mut [i32],
    xs: &mut [f32],
    group: usize,
) {
    let span = group * QK;
    for b in 0..x.len() / QK {
        if b % group == 0 {
            // Lane-wise maxima so that the loop vectorises.
            let mut m = [0f32; 8];
            for c in x[b * QK..b * QK + span].chunks_exact(8) {
                for l in 0..8 {
                    m[l] = m[l].max(c[l].abs());
                }
            }
            let amax = m.iter().fold(0f32, |a, &v| a.max(v));
            d[b] = amax / 127.0;
        } else {
            d[b] = d[b - 1];
        }
        let id = if d[b] > 0.0 { 1.0 / d[b] } else { 0.0 };
        let q: &mut [i8; QK] = (&mut qs[b * QK..(b + 1) * QK]).try_into().expect("a block");
        let v: &[f32; QK] = x[b * QK..(b + 1) * QK].try_into().expect("a block");
        let (h0, h1) = quantize_block(v, id, q);
        hpair[b] = (h0 & 0xFFFF) | (h1 << 16);
        bsum[b] = h0 + h1;
        xs[b] = d[b] * (h0 + h1) as f32;
    }
}

/// One block of [`quantize_row`]: `q = round_ties_even(v · id)` (saturating, NaN → 0) and the
/// sums of its two halves. The scalar loop does not vectorise (each element's rounding,
/// clamping and byte store stay scalar: 9 % of a SmolLM2 `bench draft` process's samples, most
/// of them in target forwards), so x86 with AVX2 converts eight at a time; both give
/// the same bits (`quantized_blocks_match_the_scalar_definition`).
fn quantize_block(v: &[f32; QK], id: f32, q: &mut [i8; QK]) -> (i32, i32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was just detected.
        return unsafe { quantize_block_avx2(v, id, q) };
    }
    quantize_block_scalar(v, id, q)
}

fn quantize_block_scalar(v: &[f32; QK], id: f32, q: &mut [i8; QK]) -> (i32, i32) {
    for (q, &v) in q.iter_mut().zip(v) {
        *q = (v * id).round_ties_even() as i8;
    }
    let h0: i32 = q[..16].iter().map(|&v| v as i32).sum();
    let h1: i32 = q[16..].iter().map(|&v| v as i32).sum();
    (h0, h1)
}

/// `cvtps2dq` rounds to nearest-even under the default MXCSR, as `round_ties_even`; NaN lanes are
/// zeroed and the rest clamped to i8's range first, as the scalar cast does.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(v: &[f32; QK], id: f32, q: &mut [i8; QK]) -> (i32, i32) {
    use std::arch::x86_64::*;
    let idv = _mm256_set1_ps(id);
    let conv = |c: usize| {
        // SAFETY: `v` holds 32 f32s, `c < 4`.
        let x = _mm256_mul_ps(unsafe { _mm256_loadu_ps(v.as_ptr().add(8 * c)) }, idv);
        let x = _mm256_and_ps(x, _mm256_cmp_ps::<_CMP_ORD_Q>(x, x));
        // Clamped first: out of i32's range `cvtps2dq` gives i32::MIN, where the cast gives 127.
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-128.0)), _mm256_set1_ps(127.0));
        _mm256_cvtps_epi32(x)
    };
    let (i0, i1, i2, i3) = (conv(0), conv(1), conv(2), conv(3));
    // packs work within 128-bit lanes: bytes come out in the order 0 2 4 6 1 3 5 7 (dwords).
    let b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: `q` holds 32 bytes.
    unsafe { _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, b) };
    // Sums of the stored bytes.
    let halves = |h: usize| {
        // SAFETY: 16 bytes at offset 16·h < 32.
        let x = unsafe { _mm_loadu_si128(q.as_ptr().add(16 * h) as *const __m128i) };
        let w = _mm256_cvtepi8_epi16(x);
        let d = _mm256_madd_epi16(w, _mm256_set1_epi16(1));
        let s = _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256::<1>(d));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    };
    (halves(0), halves(1))
}

#[cfg(test)]
mod quantize_tests {
    use super::*;

    #[test]
    fn quantized_blocks_match_the_scalar_definition() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.5, -0.5, 1.5, -2.5, 127.5, -128.5, 1e9];
        for round in 0..2000 {
            let v: [f32; QK] = std::array::from_fn(|_| {
                let r = next();
                match r % 16 {
                    0 => specials[(r >> 8) as usize % specials.len()],
                    // Exact halves, where ties-to-even decides.
                    1 => ((r >> 8) % 512) as f32 / 2.0 - 128.0,
                    _ => ((r >> 8) as u32 as f32 / u32::MAX as f32 - 0.5) * 300.0,
                }
            });
            let id = match round % 3 {
                0 => 1.0,
                1 => 0.37,
                _ => 127.0 / v.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3),
            };
            let (mut a, mut b) = ([0i8; QK], [0i8; QK]);
            let ha = quantize_block_scalar(&v, id, &mut a);
            let hb = quantize_block(&v, id, &mut b);
            assert_eq!((a, ha), (b, hb), "{v:?} × {id}");
        }
    }
}
