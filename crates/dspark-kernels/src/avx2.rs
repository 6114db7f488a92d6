//! AVX2 + FMA kernels. Each weight block is unpacked once into 32 bytes and multiplied against
//! every activation row of the batch, so a k-row verify pass reads the weights once.

#![allow(unsafe_op_in_unsafe_fn)]

use crate::format::{f16_at, Q8Rows, QuantFormat, QK};
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
    let x = u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]) as i32;
    let shuf =
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
    // Each byte keeps all bits but its own; OR-ing fills it to 0xFF only if its bit was set.
    let mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, mask), _mm256_set1_epi64x(-1))
}

/// Unpacks one block: the integers (signed, or unsigned for "_1" formats), d and m.
#[inline(always)]
unsafe fn unpack(format: QuantFormat, b: *const u8) -> (__m256i, f32, f32) {
    let blk = std::slice::from_raw_parts(b, format.block_bytes());
    let d = f16_at(blk, 0);
    match format {
        QuantFormat::Q4_0 => (_mm256_sub_epi8(nibbles(b.add(2)), _mm256_set1_epi8(8)), d, 0.0),
        QuantFormat::Q4_1 => (nibbles(b.add(4)), d, f16_at(blk, 2)),
        QuantFormat::Q5_0 => {
            let hi = _mm256_andnot_si256(bits_to_bytes(b.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
            (_mm256_or_si256(nibbles(b.add(6)), hi), d, 0.0)
        }
        QuantFormat::Q5_1 => {
            let hi = _mm256_and_si256(bits_to_bytes(b.add(4)), _mm256_set1_epi8(0x10));
            (_mm256_or_si256(nibbles(b.add(8)), hi), d, f16_at(blk, 2))
        }
        QuantFormat::Q8_0 => (_mm256_loadu_si256(b.add(2) as *const __m256i), d, 0.0),
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
/// The CPU must support AVX2 and FMA; `w` holds `n1` rows of `x.k / 32` blocks of `format`;
/// `out` has room for `x.rows` rows of stride `ldo` covering columns `n0..n1`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn matmul_range(
    format: QuantFormat,
    w: &[u8],
    x: &Q8Rows,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    let rows = x.rows;
    debug_assert!(rows <= MAX_ROWS);
    let nb = x.k / QK;
    let bb = format.block_bytes();
    let row_bytes = nb * bb;
    let signed = !format.has_min();
    // Even and odd blocks accumulate separately (two FMA chains); every row, whatever the batch
    // size, sums in this same order, so a row's result does not depend on its batch.
    let mut acc = [[_mm256_setzero_ps(); 2]; MAX_ROWS];
    let mut macc = [0f32; MAX_ROWS];
    let xq = x.qs.as_ptr();
    let one = _mm256_set1_epi16(1);
    for n in n0..n1 {
        let wrow = w.as_ptr().add(n * row_bytes);
        if rows == 1 {
            *out.add(n) = row1(format, wrow, x, nb, bb, signed);
            continue;
        }
        acc[..rows].fill([_mm256_setzero_ps(); 2]);
        macc[..rows].fill(0.0);
        for b in 0..nb {
            let (q, d, m) = unpack(format, wrow.add(b * bb));
            // Signed formats: |w| and the sign pattern are per-weight work shared by all rows.
            let wa = if signed { _mm256_sign_epi8(q, q) } else { q };
            let chain = b & 1;
            let (xd, xs) = (x.d.as_ptr(), x.s.as_ptr());
            for r in 0..rows {
                let a = _mm256_loadu_si256(xq.add(r * x.k + b * QK) as *const __m256i);
                let a = if signed { _mm256_sign_epi8(a, q) } else { a };
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, a), one);
                let xb = r * nb + b;
                let acc = acc.get_unchecked_mut(r).get_unchecked_mut(chain);
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * *xd.add(xb)), _mm256_cvtepi32_ps(p), *acc);
                *macc.get_unchecked_mut(r) += m * *xs.add(xb);
            }
        }
        for r in 0..rows {
            *out.add(r * ldo + n) = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + macc[r];
        }
    }
}

/// The batch-of-one case of `matmul_range`, same arithmetic in the same order, with the
/// accumulators in registers.
#[inline(always)]
unsafe fn row1(format: QuantFormat, wrow: *const u8, x: &Q8Rows, nb: usize, bb: usize, signed: bool) -> f32 {
    let xq = x.qs.as_ptr();
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut macc = 0f32;
    for b in 0..nb {
        let (q, d, m) = unpack(format, wrow.add(b * bb));
        let a = _mm256_loadu_si256(xq.add(b * QK) as *const __m256i);
        let (wa, a) = if signed { (_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q)) } else { (q, a) };
        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, a), _mm256_set1_epi16(1));
        let c = b & 1;
        acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d[b]), _mm256_cvtepi32_ps(p), acc[c]);
        macc += m * x.s[b];
    }
    hsum(_mm256_add_ps(acc[0], acc[1])) + macc
}
