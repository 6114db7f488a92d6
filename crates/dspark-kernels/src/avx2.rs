//! AVX2 + FMA + F16C kernels over [`PackedMatrix`]. Each weight block is unpacked once per tile
//! of activation rows and multiplied against every row of the tile, so a k-row verify pass reads
//! the weights once per tile instead of once per row.

#![allow(unsafe_op_in_unsafe_fn)]
// The tile loops index several parallel per-row arrays by the same row.
#![allow(clippy::needless_range_loop)]

use crate::format::{Q8Rows, QuantFormat, QK};
use crate::packed::PackedMatrix;
use std::arch::x86_64::*;

pub const MAX_ROWS: usize = 32;

#[inline(always)]
unsafe fn nibbles(qs: *const u8) -> __m256i {
    let x = _mm_loadu_si128(qs as *const __m128i);
    let hi = _mm_srli_epi16(x, 4);
    _mm256_and_si256(_mm256_set_m128i(hi, x), _mm256_set1_epi8(0x0F))
}

/// One 0xFF byte per set bit of the 32-bit mask at `p` (bit i → byte i).
#[inline(always)]
unsafe fn bits_to_bytes(p: *const u8) -> __m256i {
    let x = (p as *const u32).read_unaligned() as i32;
    let shuf =
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
    // Each byte keeps all bits but its own; OR-ing fills it to 0xFF only if its bit was set.
    let mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, mask), _mm256_set1_epi64x(-1))
}

/// The 32 integers of block `i` (global block index): signed, or unsigned for "_1" formats.
#[inline(always)]
unsafe fn unpack(w: &PackedMatrix, i: usize) -> __m256i {
    match w.format {
        QuantFormat::Q4_0 => _mm256_sub_epi8(nibbles(w.qs.as_ptr().add(i * 16)), _mm256_set1_epi8(8)),
        QuantFormat::Q4_1 => nibbles(w.qs.as_ptr().add(i * 16)),
        QuantFormat::Q5_0 => {
            let hi =
                _mm256_andnot_si256(bits_to_bytes(w.qh.as_ptr().add(i * 4)), _mm256_set1_epi8(0xF0u8 as i8));
            _mm256_or_si256(nibbles(w.qs.as_ptr().add(i * 16)), hi)
        }
        QuantFormat::Q5_1 => {
            let hi = _mm256_and_si256(bits_to_bytes(w.qh.as_ptr().add(i * 4)), _mm256_set1_epi8(0x10));
            _mm256_or_si256(nibbles(w.qs.as_ptr().add(i * 16)), hi)
        }
        QuantFormat::Q8_0 => _mm256_loadu_si256(w.qs.as_ptr().add(i * 32) as *const __m256i),
    }
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Computes `out[r][n] = Σ_k x[r][k]·w[n][k]` for `n` in `n0..n1` and all rows of `x`.
/// `out` is row-major with row stride `ldo`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x` was quantized with `w.nbp` blocks per row;
/// `out` has room for `x.rows` rows of stride `ldo` covering columns `n0..n1`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn matmul_range(w: &PackedMatrix, x: &Q8Rows, n0: usize, n1: usize, out: *mut f32, ldo: usize) {
    let rows = x.rows;
    debug_assert!(rows <= MAX_ROWS && x.nbp == w.nbp);
    for n in n0..n1 {
        // Register tiles of 4 activation rows, then 2, then 1: every row runs the same
        // arithmetic in the same order, so its result does not depend on its batch.
        let mut r0 = 0;
        while r0 + 4 <= rows {
            store(out, ldo, n, r0, tile::<4>(w, n, x, r0));
            r0 += 4;
        }
        if r0 + 2 <= rows {
            store(out, ldo, n, r0, tile::<2>(w, n, x, r0));
            r0 += 2;
        }
        if r0 < rows {
            store(out, ldo, n, r0, tile::<1>(w, n, x, r0));
        }
    }
}

#[inline(always)]
unsafe fn store<const R: usize>(out: *mut f32, ldo: usize, n: usize, r0: usize, v: [f32; R]) {
    for (i, vi) in v.iter().enumerate() {
        *out.add((r0 + i) * ldo + n) = *vi;
    }
}

/// Dot products of weight row `n` with activation rows `r0..r0 + R`. Blocks go in groups of
/// eight: one conversion gives the eight weight scales, one multiply the eight combined scales
/// of a row, one FMA the offset terms; then each block costs an unpack plus, per row, an
/// integer dot, a conversion and an FMA. Even and odd blocks accumulate in separate chains.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize>(w: &PackedMatrix, n: usize, x: &Q8Rows, r0: usize) -> [f32; R] {
    let nbp = w.nbp;
    let kp = nbp * QK;
    let signed = !w.format.has_min();
    let has_min = w.format.has_min();
    let one = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    let mut macc = [_mm256_setzero_ps(); R];
    let mut scale = [[0f32; 8]; R];
    let base = n * nbp;
    for g in (0..nbp).step_by(8) {
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr().add(base + g) as *const __m128i));
        for r in 0..R {
            let xo = (r0 + r) * nbp + g;
            let s = _mm256_mul_ps(dw, _mm256_loadu_ps(x.d.as_ptr().add(xo)));
            _mm256_storeu_ps(scale[r].as_mut_ptr(), s);
        }
        if has_min {
            let mw = _mm256_cvtph_ps(_mm_loadu_si128(w.m.as_ptr().add(base + g) as *const __m128i));
            for r in 0..R {
                let xo = (r0 + r) * nbp + g;
                macc[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x.s.as_ptr().add(xo)), macc[r]);
            }
        }
        for j in 0..8 {
            let b = g + j;
            let q = unpack(w, base + b);
            let wa = if signed { _mm256_sign_epi8(q, q) } else { q };
            for r in 0..R {
                let a = _mm256_loadu_si256(x.qs.as_ptr().add((r0 + r) * kp + b * QK) as *const __m256i);
                let a = if signed { _mm256_sign_epi8(a, q) } else { a };
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, a), one);
                let sc = _mm256_broadcast_ss(&scale[r][j]);
                acc[j & 1][r] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(p), acc[j & 1][r]);
            }
        }
    }
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + hsum(macc[r]);
    }
    out
}
