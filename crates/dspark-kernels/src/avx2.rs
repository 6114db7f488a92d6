//! AVX2 + FMA + F16C kernels over the lane layout ([`crate::packed`]). A 16-lane vector of the
//! definition ([`crate::scalar`]) is two registers here (lanes 0–7, 8–15); the integers come from
//! `maddubs` + `madd` (exact: no pair of products reaches i16 saturation for these formats), the
//! float work is the same lane-wise operations in the same order, so results are the other
//! paths' bits.

#![allow(unsafe_op_in_unsafe_fn)]
#![allow(clippy::needless_range_loop)]

use crate::format::Q8Rows;
use crate::packed::{PackedMatrix, ScaleKind, GROUP};
use crate::x86::{by_format, prefetch_group, reduce8, Fmt, Ints};
use std::arch::x86_64::*;

/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x` was quantized with `w.nbp` blocks per row;
/// `out` has room for `x.rows` rows of stride `ldo` covering columns `n0..n1`.
pub unsafe fn range(w: &PackedMatrix, x: &Q8Rows, n0: usize, n1: usize, out: *mut f32, ldo: usize) {
    by_format!(w.format, range_f(w, x, n0, n1, out, ldo))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn range_f<F: Fmt>(w: &PackedMatrix, x: &Q8Rows, n0: usize, n1: usize, out: *mut f32, ldo: usize) {
    let mut r0 = 0;
    while r0 < x.rows {
        let rt = (x.rows - r0).min(2);
        for n in n0..n1 {
            if rt == 2 {
                tile::<F, 2>(w, n, x, r0, out, ldo, r0 == 0);
            } else {
                tile::<F, 1>(w, n, x, r0, out, ldo, r0 == 0);
            }
        }
        r0 += rt;
    }
}

/// One 0xFF byte per set bit of the 32-bit mask `m` (bit i → byte i).
#[inline(always)]
unsafe fn bits_to_bytes(m: u32) -> __m256i {
    let shuf =
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(m as i32), shuf);
    // Each byte keeps all bits but its own; OR-ing fills it to 0xFF only if its bit was set.
    let mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, mask), _mm256_set1_epi64x(-1))
}

/// `W_m` of global group `gi` as unsigned bytes, lanes 0–7 and 8–15.
#[inline(always)]
unsafe fn weights<F: Fmt>(w: &PackedMatrix, gi: usize, m: usize) -> [__m256i; 2] {
    let (qsb, qhb) = PackedMatrix::group_bytes(F::FORMAT);
    if F::INTS == Ints::Byte {
        let p = w.qs.as_ptr().add(gi * qsb + m * 64);
        return [_mm256_loadu_si256(p as *const __m256i), _mm256_loadu_si256(p.add(32) as *const __m256i)];
    }
    let m4 = _mm256_set1_epi8(0x0F);
    let p = w.qs.as_ptr().add(gi * qsb + (m / 2) * 64);
    let mut out = [0, 1].map(|half| {
        let v = _mm256_loadu_si256(p.add(32 * half) as *const __m256i);
        _mm256_and_si256(if m.is_multiple_of(2) { v } else { _mm256_srli_epi16(v, 4) }, m4)
    });
    match F::INTS {
        Ints::Five => {
            let bits = (w.qh.as_ptr().add(gi * qhb + m * 8) as *const u64).read_unaligned();
            for (half, o) in out.iter_mut().enumerate() {
                let set = bits_to_bytes((bits >> (32 * half)) as u32);
                *o = _mm256_or_si256(*o, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
            }
        }
        Ints::Six => {
            for (half, o) in out.iter_mut().enumerate() {
                let hb = _mm256_loadu_si256(w.qh.as_ptr().add(gi * qhb + 32 * half) as *const __m256i);
                let hb = match m {
                    0 => _mm256_slli_epi16(hb, 4),
                    1 => _mm256_slli_epi16(hb, 2),
                    2 => hb,
                    _ => _mm256_srli_epi16(hb, 2),
                };
                *o = _mm256_or_si256(*o, _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
            }
        }
        _ => {}
    }
    out
}

/// Σ of each 4-byte group of `u·a` as i32 (`u` unsigned, at most 63, or Q8_0's biased bytes,
/// which are multiplied as signed values instead).
#[inline(always)]
unsafe fn dot4<F: Fmt>(u: __m256i, a: __m256i) -> __m256i {
    let one = _mm256_set1_epi16(1);
    if F::INTS == Ints::Byte {
        let q = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q)), one);
    }
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), one)
}

/// Each of 8 values twice (lanes 2j, 2j + 1 take value j): lanes 0–7 and 8–15.
#[inline(always)]
unsafe fn pairs_u8(p: *const u8) -> [__m256i; 2] {
    let v = _mm_loadl_epi64(p as *const __m128i);
    let v = _mm_unpacklo_epi8(v, v);
    [_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))]
}

#[inline(always)]
unsafe fn pairs_f16(p: *const u16) -> [__m256; 2] {
    let v = _mm_loadu_si128(p as *const __m128i);
    [_mm256_cvtph_ps(_mm_unpacklo_epi16(v, v)), _mm256_cvtph_ps(_mm_unpackhi_epi16(v, v))]
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<F: Fmt, const R: usize>(
    w: &PackedMatrix,
    n: usize,
    x: &Q8Rows,
    r0: usize,
    out: *mut f32,
    ldo: usize,
    prefetch: bool,
) {
    let groups = w.groups();
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for g in 0..groups {
        let gi = n * groups + g;
        if prefetch {
            prefetch_group::<F>(w, gi);
        }
        let mut p = [[_mm256_setzero_si256(); 2]; R];
        for m in 0..4 {
            let wv = weights::<F>(w, gi, m);
            for r in 0..R {
                let xa = x.qs.as_ptr().add(((r0 + r) * groups + g) * GROUP + m * 64);
                for half in 0..2 {
                    let a = _mm256_loadu_si256(xa.add(32 * half) as *const __m256i);
                    p[r][half] = _mm256_add_epi32(p[r][half], dot4::<F>(wv[half], a));
                }
            }
        }
        // Q8_0's integers are already signed here (see `dot4`).
        let shift = if F::INTS == Ints::Byte { 0 } else { F::BIAS_SHIFT };
        let hs = |xg: usize, half: usize| {
            _mm256_loadu_si256(x.hs.as_ptr().add(xg * 16 + 8 * half) as *const __m256i)
        };
        match F::SCALES {
            ScaleKind::F16 => {
                let dw = pairs_f16(w.d16.as_ptr().add(gi * 8));
                let mw =
                    if F::MIN { pairs_f16(w.m16.as_ptr().add(gi * 8)) } else { [_mm256_setzero_ps(); 2] };
                for r in 0..R {
                    let xg = (r0 + r) * groups + g;
                    for half in 0..2 {
                        let mut pc = p[r][half];
                        if shift > 0 {
                            pc = _mm256_sub_epi32(
                                pc,
                                _mm256_sll_epi32(hs(xg, half), _mm_cvtsi32_si128(shift as i32)),
                            );
                        }
                        let dx = _mm256_loadu_ps(x.dl.as_ptr().add(xg * 16 + 8 * half));
                        acc[r][half] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(pc),
                            _mm256_mul_ps(dw[half], dx),
                            acc[r][half],
                        );
                        if F::MIN {
                            let xs = _mm256_loadu_ps(x.xs.as_ptr().add(xg * 16 + 8 * half));
                            acc[r][half] = _mm256_fmadd_ps(mw[half], xs, acc[r][half]);
                        }
                    }
                }
            }
            ScaleKind::K4 => {
                let gd = _mm256_set1_ps(w.gd[gi]);
                let gmin = _mm256_set1_ps(-w.gmin[gi]);
                let scd =
                    pairs_u8(w.sc.as_ptr().add(gi * 8)).map(|v| _mm256_mul_ps(_mm256_cvtepi32_ps(v), gd));
                let wm =
                    pairs_u8(w.mn.as_ptr().add(gi * 8)).map(|v| _mm256_mul_ps(_mm256_cvtepi32_ps(v), gmin));
                for r in 0..R {
                    let xg = (r0 + r) * groups + g;
                    let dx = _mm256_set1_ps(*x.d.get_unchecked(xg * 8));
                    for half in 0..2 {
                        let s = _mm256_mul_ps(scd[half], dx);
                        acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[r][half]), s, acc[r][half]);
                        let xs = _mm256_loadu_ps(x.xs.as_ptr().add(xg * 16 + 8 * half));
                        acc[r][half] = _mm256_fmadd_ps(wm[half], xs, acc[r][half]);
                    }
                }
            }
            ScaleKind::K6 => {
                let v = _mm_loadu_si128(w.sc.as_ptr().add(gi * 16) as *const __m128i);
                let gd = _mm256_set1_ps(w.gd[gi]);
                let scd = [_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))]
                    .map(|v| _mm256_mul_ps(_mm256_cvtepi32_ps(v), gd));
                for r in 0..R {
                    let xg = (r0 + r) * groups + g;
                    let dx = _mm256_set1_ps(*x.d.get_unchecked(xg * 8));
                    for half in 0..2 {
                        let pc = _mm256_sub_epi32(p[r][half], _mm256_slli_epi32(hs(xg, half), 5));
                        let s = _mm256_mul_ps(scd[half], dx);
                        acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pc), s, acc[r][half]);
                    }
                }
            }
        }
    }
    for r in 0..R {
        *out.add((r0 + r) * ldo + n) = reduce8(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
}
