//! AVX-512 VNNI kernels over the column tiles ([`crate::packed`]): a register's 16 lanes are
//! the tile's 16 columns. Each `vpdpbusd` multiplies one 64-byte weight vector (4 values of 16
//! columns) by 4 activation bytes broadcast from memory, and a weight vector, unpacked once,
//! serves up to 8 activation rows. The integer sums are exact; scales are applied per block
//! (legacy formats) or per group (K-quants) with the float operations of [`crate::scalar`],
//! lane-wise, so results are that definition's bits.

#![allow(unsafe_op_in_unsafe_fn)]
#![allow(clippy::needless_range_loop)]

use crate::format::{Q8Rows, QK};
use crate::packed::{PackedMatrix, ScaleKind, GROUP, NT};
use crate::x86::{by_format, prefetch_part, Fmt, Ints};
use std::arch::x86_64::*;

/// Rows a tile call computes at most: 3 × 8 accumulators (float, group integer, block integer)
/// plus the unpacked weights fit the 32 registers.
const MAX_R: usize = 8;

/// Tiles `t0..t1` of every row of `x`.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VNNI, AVX2, FMA and F16C; `x` was quantized with
/// `w.nbp` blocks per row; `out` has room for `x.rows` rows of stride `ldo` covering the
/// tiles' columns below `w.n`.
pub unsafe fn range(w: &PackedMatrix, x: &Q8Rows, t0: usize, t1: usize, out: *mut f32, ldo: usize) {
    by_format!(w.format, range_f(w, x, t0, t1, out, ldo))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn range_f<F: Fmt>(w: &PackedMatrix, x: &Q8Rows, t0: usize, t1: usize, out: *mut f32, ldo: usize) {
    // Row passes of equal size: 12 rows are two passes of 6, not 8 + 4.
    let per = x.rows.div_ceil(x.rows.div_ceil(MAX_R));
    let mut r0 = 0;
    while r0 < x.rows {
        let rt = per.min(x.rows - r0);
        // The first pass streams the weights from memory; later ones find them in L2.
        let first = r0 == 0;
        for t in t0..t1 {
            match rt {
                8 => tile::<F, 8>(w, t, x, r0, out, ldo, first),
                7 => tile::<F, 7>(w, t, x, r0, out, ldo, first),
                6 => tile::<F, 6>(w, t, x, r0, out, ldo, first),
                5 => tile::<F, 5>(w, t, x, r0, out, ldo, first),
                4 => tile::<F, 4>(w, t, x, r0, out, ldo, first),
                3 => tile::<F, 3>(w, t, x, r0, out, ldo, first),
                2 => tile::<F, 2>(w, t, x, r0, out, ldo, first),
                _ => tile::<F, 1>(w, t, x, r0, out, ldo, first),
            }
        }
        r0 += rt;
    }
}

/// Adds the dot products of chunks `ch0..ch0 + n` (4 values each) of a record to `p` (even
/// chunks) and `q` (odd chunks; with one or two rows, a second accumulator halves the chain
/// of dependent `vpdpbusd`s).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn dots<F: Fmt, const R: usize>(
    w: &PackedMatrix,
    rec: *const u8,
    ch0: usize,
    n: usize,
    a: *const u8,
    lda: usize,
    p: &mut [__m512i; R],
    q: &mut [__m512i; R],
) {
    let bcast =
        |r: usize, ch: usize| _mm512_set1_epi32((a.add(r * lda + 4 * ch) as *const i32).read_unaligned());
    let split = R <= 2;
    if F::INTS == Ints::Byte {
        for ch in ch0..ch0 + n {
            let wv = _mm512_loadu_si512(rec.add(ch * 64) as *const _);
            for r in 0..R {
                if split && ch % 2 == 1 {
                    q[r] = _mm512_dpbusd_epi32(q[r], wv, bcast(r, ch));
                } else {
                    p[r] = _mm512_dpbusd_epi32(p[r], wv, bcast(r, ch));
                }
            }
        }
        return;
    }
    let m4 = _mm512_set1_epi8(0x0F);
    for s in ch0 / 2..(ch0 + n) / 2 {
        let v = _mm512_loadu_si512(rec.add(s * 64) as *const _);
        let mut lo = _mm512_and_si512(v, m4);
        let mut hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        match F::INTS {
            Ints::Five => {
                let qh = rec.add(w.rec.qh) as *const u64;
                let b16 = _mm512_set1_epi8(0x10);
                lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(qh.add(2 * s).read_unaligned()), lo, b16);
                hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(qh.add(2 * s + 1).read_unaligned()), hi, b16);
            }
            Ints::Six => {
                // Half-block s / 2; this vector's chunks are its m = 2(s % 2) and m + 1: their
                // bits 2m..2m + 2 go to bits 4..6 (16-bit shifts; the mask drops what crossed
                // bytes).
                let hb = _mm512_loadu_si512(rec.add(w.rec.qh + (s / 2) * 64) as *const _);
                let m30 = _mm512_set1_epi8(0x30);
                let (b0, b1) = if s % 2 == 0 {
                    (_mm512_slli_epi16(hb, 4), _mm512_slli_epi16(hb, 2))
                } else {
                    (hb, _mm512_srli_epi16(hb, 2))
                };
                lo = _mm512_or_si512(lo, _mm512_and_si512(b0, m30));
                hi = _mm512_or_si512(hi, _mm512_and_si512(b1, m30));
            }
            _ => {}
        }
        for r in 0..R {
            p[r] = _mm512_dpbusd_epi32(p[r], lo, bcast(r, 2 * s));
            if split {
                q[r] = _mm512_dpbusd_epi32(q[r], hi, bcast(r, 2 * s + 1));
            } else {
                p[r] = _mm512_dpbusd_epi32(p[r], hi, bcast(r, 2 * s + 1));
            }
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<F: Fmt, const R: usize>(
    w: &PackedMatrix,
    t: usize,
    x: &Q8Rows,
    r0: usize,
    out: *mut f32,
    ldo: usize,
    prefetch: bool,
) {
    let groups = w.groups();
    let lda = x.nbp * QK;
    let z = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); R];
    for g in 0..groups {
        let rec = w.record(t, g);
        let a = x.qs.as_ptr().add(r0 * lda + g * GROUP) as *const u8;
        // Block index of row r's first block in this group.
        let blk = |r: usize| (r0 + r) * x.nbp + g * 8;
        match F::SCALES {
            ScaleKind::F16 => {
                for j in 0..8 {
                    if prefetch {
                        prefetch_part(rec, w.rec.size, j, 8);
                    }
                    let (mut p, mut q) = ([z; R], [z; R]);
                    dots::<F, R>(w, rec, 8 * j, 8, a, lda, &mut p, &mut q);
                    let dw = _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(w.rec.d + 32 * j) as *const _));
                    let mw = if F::MIN {
                        _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(w.rec.m + 32 * j) as *const _))
                    } else {
                        _mm512_setzero_ps()
                    };
                    for r in 0..R {
                        let b = blk(r) + j;
                        let mut pc = _mm512_add_epi32(p[r], q[r]);
                        if F::BIAS_SHIFT > 0 {
                            pc = _mm512_sub_epi32(
                                pc,
                                _mm512_set1_epi32(*x.bsum.get_unchecked(b) << F::BIAS_SHIFT),
                            );
                        }
                        let s = _mm512_mul_ps(dw, _mm512_set1_ps(*x.d.get_unchecked(b)));
                        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pc), s, acc[r]);
                        if F::MIN {
                            acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*x.xs.get_unchecked(b)), acc[r]);
                        }
                    }
                }
            }
            ScaleKind::K4 => {
                let mut i = [z; R];
                for j in 0..8 {
                    if prefetch {
                        prefetch_part(rec, w.rec.size, j, 8);
                    }
                    let (mut p, mut q) = ([z; R], [z; R]);
                    dots::<F, R>(w, rec, 8 * j, 8, a, lda, &mut p, &mut q);
                    let sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(rec.add(w.rec.sc + 16 * j) as *const _));
                    for r in 0..R {
                        i[r] = _mm512_add_epi32(i[r], _mm512_mullo_epi32(_mm512_add_epi32(p[r], q[r]), sc));
                    }
                }
                let mut m = [z; R];
                for i in 0..4 {
                    let mn = _mm512_loadu_si512(rec.add(w.rec.mn + 64 * i) as *const _);
                    for r in 0..R {
                        let s = _mm512_set1_epi32(*x.bpair.get_unchecked(blk(r) / 2 + i));
                        m[r] = _mm512_dpwssd_epi32(m[r], mn, s);
                    }
                }
                let d = _mm512_loadu_ps(rec.add(w.rec.d) as *const f32);
                let nd = _mm512_loadu_ps(rec.add(w.rec.m) as *const f32);
                for r in 0..R {
                    let dx = _mm512_set1_ps(*x.d.get_unchecked(blk(r)));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i[r]), _mm512_mul_ps(d, dx), acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m[r]), _mm512_mul_ps(nd, dx), acc[r]);
                }
            }
            ScaleKind::K6 => {
                let mut i = [z; R];
                for l in 0..16 {
                    if prefetch {
                        prefetch_part(rec, w.rec.size, l, 16);
                    }
                    let (mut p, mut q) = ([z; R], [z; R]);
                    dots::<F, R>(w, rec, 4 * l, 4, a, lda, &mut p, &mut q);
                    let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(rec.add(w.rec.sc + 16 * l) as *const _));
                    for r in 0..R {
                        let h = *x.hsum.get_unchecked(2 * blk(r) + l) << 5;
                        let pc = _mm512_sub_epi32(_mm512_add_epi32(p[r], q[r]), _mm512_set1_epi32(h));
                        i[r] = _mm512_add_epi32(i[r], _mm512_mullo_epi32(pc, sc));
                    }
                }
                let d = _mm512_loadu_ps(rec.add(w.rec.d) as *const f32);
                for r in 0..R {
                    let dx = _mm512_set1_ps(*x.d.get_unchecked(blk(r)));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i[r]), _mm512_mul_ps(d, dx), acc[r]);
                }
            }
        }
    }
    let valid = (w.n - t * NT).min(NT);
    for r in 0..R {
        let o = out.add((r0 + r) * ldo + t * NT);
        if valid == NT {
            _mm512_storeu_ps(o, acc[r]);
        } else {
            _mm512_mask_storeu_ps(o, ((1u32 << valid) - 1) as u16, acc[r]);
        }
    }
}
