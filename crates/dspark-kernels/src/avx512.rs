//! AVX-512 VNNI kernels over the lane layout ([`crate::packed`]): a register tile of up to four
//! activation rows × two weight columns, one `vpdpbusd` per 64 weight bytes and row, each
//! weight vector unpacked once per tile and each activation vector loaded once per tile. The
//! float work follows [`crate::scalar`] lane for lane, so results equal the other paths' bits.

#![allow(unsafe_op_in_unsafe_fn)]
#![allow(clippy::needless_range_loop)]

use crate::format::Q8Rows;
use crate::packed::{PackedMatrix, ScaleKind, GROUP};
use crate::x86::{by_format, prefetch_group, Fmt, Ints};
use std::arch::x86_64::*;

/// # Safety
/// The CPU must have AVX-512 F/BW/VNNI, AVX2, FMA and F16C; `x` was quantized with `w.nbp`
/// blocks per row; `out` has room for `x.rows` rows of stride `ldo` covering columns `n0..n1`.
pub unsafe fn range(w: &PackedMatrix, x: &Q8Rows, n0: usize, n1: usize, out: *mut f32, ldo: usize) {
    by_format!(w.format, range_f(w, x, n0, n1, out, ldo))
}

/// Row tiles outer, columns inner: a task's columns (sized to stay in L2) meet each tile of
/// activation rows (in L1) in turn, so k rows cost one pass over the weights from memory.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn range_f<F: Fmt>(w: &PackedMatrix, x: &Q8Rows, n0: usize, n1: usize, out: *mut f32, ldo: usize) {
    let mut r0 = 0;
    while r0 < x.rows {
        let rt = (x.rows - r0).min(4);
        let first = r0 == 0;
        let mut n = n0;
        while n < n1 {
            // The first row tile streams the weights from memory: one column at a time keeps
            // that a single sequential stream (two interleaved ones read markedly slower);
            // later tiles find the columns in L2 and share each activation load between two.
            let c = if first { 1 } else { (n1 - n).min(2) };
            match (rt, c) {
                (4, 2) => tile::<F, 4, 2>(w, n, x, r0, out, ldo, first),
                (3, 2) => tile::<F, 3, 2>(w, n, x, r0, out, ldo, first),
                (2, 2) => tile::<F, 2, 2>(w, n, x, r0, out, ldo, first),
                (1, 2) => tile::<F, 1, 2>(w, n, x, r0, out, ldo, first),
                (4, _) => tile::<F, 4, 1>(w, n, x, r0, out, ldo, first),
                (3, _) => tile::<F, 3, 1>(w, n, x, r0, out, ldo, first),
                (2, _) => tile::<F, 2, 1>(w, n, x, r0, out, ldo, first),
                _ => tile::<F, 1, 1>(w, n, x, r0, out, ldo, first),
            }
            n += c;
        }
        r0 += rt;
    }
}

/// `W_{2h}` and `W_{2h+1}` of global group `gi`, as unsigned bytes.
#[inline(always)]
unsafe fn weights<F: Fmt>(w: &PackedMatrix, gi: usize, h: usize) -> [__m512i; 2] {
    let (qsb, qhb) = PackedMatrix::group_bytes(F::FORMAT);
    if F::INTS == Ints::Byte {
        let p = w.qs.as_ptr().add(gi * qsb + h * 128);
        return [_mm512_loadu_si512(p as *const _), _mm512_loadu_si512(p.add(64) as *const _)];
    }
    let m4 = _mm512_set1_epi8(0x0F);
    let v = _mm512_loadu_si512(w.qs.as_ptr().add(gi * qsb + h * 64) as *const _);
    let mut out = [_mm512_and_si512(v, m4), _mm512_and_si512(_mm512_srli_epi16(v, 4), m4)];
    match F::INTS {
        Ints::Five => {
            let qh = w.qh.as_ptr().add(gi * qhb);
            for (mm, o) in out.iter_mut().enumerate() {
                let bits = (qh.add((2 * h + mm) * 8) as *const u64).read_unaligned();
                *o = _mm512_mask_add_epi8(*o, _cvtu64_mask64(bits), *o, _mm512_set1_epi8(0x10));
            }
        }
        Ints::Six => {
            let hb = _mm512_loadu_si512(w.qh.as_ptr().add(gi * qhb) as *const _);
            let m30 = _mm512_set1_epi8(0x30);
            // Bits 2m..2m + 2 of each byte to bits 4..6 (16-bit shifts; the mask drops what
            // crossed bytes).
            let (a, b) = if h == 0 {
                (_mm512_slli_epi16(hb, 4), _mm512_slli_epi16(hb, 2))
            } else {
                (hb, _mm512_srli_epi16(hb, 2))
            };
            out[0] = _mm512_or_si512(out[0], _mm512_and_si512(a, m30));
            out[1] = _mm512_or_si512(out[1], _mm512_and_si512(b, m30));
        }
        _ => {}
    }
    out
}

/// Each of 8 bytes at `p` twice (lanes 2j, 2j + 1 take byte j), widened to i32.
#[inline(always)]
unsafe fn pairs_u8(p: *const u8) -> __m512i {
    let v = _mm_loadl_epi64(p as *const __m128i);
    _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(v, v))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<F: Fmt, const R: usize, const C: usize>(
    w: &PackedMatrix,
    n: usize,
    x: &Q8Rows,
    r0: usize,
    out: *mut f32,
    ldo: usize,
    prefetch: bool,
) {
    let groups = w.groups();
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    for g in 0..groups {
        if prefetch {
            prefetch_group::<F>(w, n * groups + g);
        }
        let mut p = [[_mm512_setzero_si512(); C]; R];
        for h in 0..2 {
            let mut wv = [[_mm512_setzero_si512(); 2]; C];
            for c in 0..C {
                wv[c] = weights::<F>(w, (n + c) * groups + g, h);
            }
            for mm in 0..2 {
                for r in 0..R {
                    let xa = x.qs.as_ptr().add(((r0 + r) * groups + g) * GROUP + (2 * h + mm) * 64);
                    let a = _mm512_loadu_si512(xa as *const _);
                    for c in 0..C {
                        p[r][c] = _mm512_dpbusd_epi32(p[r][c], wv[c][mm], a);
                    }
                }
            }
        }
        for c in 0..C {
            let gi = (n + c) * groups + g;
            match F::SCALES {
                ScaleKind::F16 => {
                    let d8 = _mm_loadu_si128(w.d16.as_ptr().add(gi * 8) as *const __m128i);
                    let d16 = _mm256_set_m128i(_mm_unpackhi_epi16(d8, d8), _mm_unpacklo_epi16(d8, d8));
                    let dw = _mm512_cvtph_ps(d16);
                    let mw = if F::MIN {
                        let m8 = _mm_loadu_si128(w.m16.as_ptr().add(gi * 8) as *const __m128i);
                        _mm512_cvtph_ps(_mm256_set_m128i(
                            _mm_unpackhi_epi16(m8, m8),
                            _mm_unpacklo_epi16(m8, m8),
                        ))
                    } else {
                        _mm512_setzero_ps()
                    };
                    for r in 0..R {
                        let xg = (r0 + r) * groups + g;
                        let pc = correct::<F>(p[r][c], x, xg);
                        let dx = _mm512_loadu_ps(x.dl.as_ptr().add(xg * 16));
                        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pc), _mm512_mul_ps(dw, dx), acc[r][c]);
                        if F::MIN {
                            let xs = _mm512_loadu_ps(x.xs.as_ptr().add(xg * 16));
                            acc[r][c] = _mm512_fmadd_ps(mw, xs, acc[r][c]);
                        }
                    }
                }
                ScaleKind::K4 => {
                    let gd = _mm512_set1_ps(w.gd[gi]);
                    let scd = _mm512_mul_ps(_mm512_cvtepi32_ps(pairs_u8(w.sc.as_ptr().add(gi * 8))), gd);
                    let wm = _mm512_mul_ps(
                        _mm512_cvtepi32_ps(pairs_u8(w.mn.as_ptr().add(gi * 8))),
                        _mm512_set1_ps(-w.gmin[gi]),
                    );
                    for r in 0..R {
                        let xg = (r0 + r) * groups + g;
                        let s = _mm512_mul_ps(scd, _mm512_set1_ps(*x.d.get_unchecked(xg * 8)));
                        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[r][c]), s, acc[r][c]);
                        let xs = _mm512_loadu_ps(x.xs.as_ptr().add(xg * 16));
                        acc[r][c] = _mm512_fmadd_ps(wm, xs, acc[r][c]);
                    }
                }
                ScaleKind::K6 => {
                    let sc =
                        _mm512_cvtepi8_epi32(_mm_loadu_si128(w.sc.as_ptr().add(gi * 16) as *const __m128i));
                    let scd = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), _mm512_set1_ps(w.gd[gi]));
                    for r in 0..R {
                        let xg = (r0 + r) * groups + g;
                        let s = _mm512_mul_ps(scd, _mm512_set1_ps(*x.d.get_unchecked(xg * 8)));
                        let pc = correct::<F>(p[r][c], x, xg);
                        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pc), s, acc[r][c]);
                    }
                }
            }
        }
    }
    for r in 0..R {
        for c in 0..C {
            *out.add((r0 + r) * ldo + n + c) = reduce16(acc[r][c]);
        }
    }
}

/// `P − bias·hs`: the dot of the signed integers from that of the stored unsigned ones.
#[inline(always)]
unsafe fn correct<F: Fmt>(p: __m512i, x: &Q8Rows, xg: usize) -> __m512i {
    if F::BIAS_SHIFT == 0 {
        return p;
    }
    let hs = _mm512_loadu_si512(x.hs.as_ptr().add(xg * 16) as *const _);
    _mm512_sub_epi32(p, _mm512_sllv_epi32(hs, _mm512_set1_epi32(F::BIAS_SHIFT as i32)))
}

/// [`crate::scalar::reduce16`] on a register.
#[inline(always)]
unsafe fn reduce16(v: __m512) -> f32 {
    crate::x86::reduce8(_mm256_add_ps(
        _mm512_castps512_ps256(v),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
    ))
}
