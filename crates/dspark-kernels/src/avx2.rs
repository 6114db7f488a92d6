//! AVX2 + FMA + F16C kernels over the column tiles ([`crate::packed`]). A tile's 16 columns
//! are two halves of 8 lanes here, each computed in its own pass over the tile's records (the
//! second finds them in cache). The integers come from `maddubs`, summed in i16 over as many
//! chunks as cannot saturate (a whole 32-value block of 4-bit integers) and widened by one
//! `madd` against the block's scale: AVX2 has no `vpdpbusd`, and a `madd` per chunk was half
//! the multiply port's work. Integer sums are exact, and the float work is the lane-wise
//! operations of [`crate::scalar`] in the same order, so results are the other paths' bits.

#![allow(unsafe_op_in_unsafe_fn)]
#![allow(clippy::needless_range_loop)]

use crate::format::{Q8Rows, QK};
use crate::packed::{PackedMatrix, ScaleKind, GROUP, NT};
use crate::x86::{by_format, prefetch_part, Fmt, Ints};
use std::arch::x86_64::*;

/// Rows a tile call computes at most: 4 reuses each unpacked weight vector most within 16
/// registers (an i16 and an i32 accumulator per row, the weights); Q8_0, whose bytes need no
/// unpacking but whose dot products take more registers, is fastest at 3 (both measured on a
/// Zen 2, docs/BENCHMARKS.md).
const fn max_rows<F: Fmt>() -> usize {
    if matches!(F::INTS, Ints::Byte) {
        3
    } else {
        4
    }
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x` was quantized with `w.nbp` blocks per row;
/// `out` has room for `x.rows` rows of stride `ldo` covering the tiles' columns below `w.n`.
pub unsafe fn range(w: &PackedMatrix, x: &Q8Rows, t0: usize, t1: usize, out: *mut f32, ldo: usize) {
    by_format!(w.format, range_f(w, x, t0, t1, out, ldo))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn range_f<F: Fmt>(w: &PackedMatrix, x: &Q8Rows, t0: usize, t1: usize, out: *mut f32, ldo: usize) {
    let per = x.rows.div_ceil(x.rows.div_ceil(max_rows::<F>()));
    let mut r0 = 0;
    while r0 < x.rows {
        let rt = per.min(x.rows - r0);
        for t in t0..t1 {
            for h in 0..2 {
                let first = r0 == 0 && h == 0;
                match rt {
                    4 => tile::<F, 4>(w, t, h, x, r0, out, ldo, first),
                    3 => tile::<F, 3>(w, t, h, x, r0, out, ldo, first),
                    2 => tile::<F, 2>(w, t, h, x, r0, out, ldo, first),
                    _ => tile::<F, 1>(w, t, h, x, r0, out, ldo, first),
                }
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

/// Σ of each 4-byte group of `u·a` as i32 for Q8_0, whose biased bytes are multiplied as
/// signed values (a product of two bytes can reach 128², so its pairs cannot share an i16).
#[inline(always)]
unsafe fn dot4_byte(u: __m256i, a: __m256i) -> __m256i {
    let q = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
    _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q)),
        _mm256_set1_epi16(1),
    )
}

/// Adds Q8_0's dot products of chunks `ch0..ch0 + n` of half `h` of a record to `p` as i32.
#[inline(always)]
unsafe fn dots_byte<const R: usize>(
    rec: *const u8,
    h: usize,
    ch0: usize,
    n: usize,
    a: *const u8,
    lda: usize,
    p: &mut [__m256i; R],
) {
    for ch in ch0..ch0 + n {
        let wv = _mm256_loadu_si256(rec.add(ch * 64 + 32 * h) as *const _);
        for r in 0..R {
            p[r] = _mm256_add_epi32(p[r], dot4_byte(wv, bcast(a, r, lda, ch)));
        }
    }
}

/// The 4 activation bytes of chunk `ch` of row `r`, in every lane.
#[inline(always)]
unsafe fn bcast(a: *const u8, r: usize, lda: usize, ch: usize) -> __m256i {
    _mm256_set1_epi32((a.add(r * lda + 4 * ch) as *const i32).read_unaligned())
}

/// The dot products of the nibble formats' vectors `s0..s0 + ns` (chunks `2·s0..2·(s0 + ns)`)
/// of half `h` of a record, per row as **i16 pairs**: each 32-bit lane holds its column's two
/// partial sums, which a `madd` against the block's scale (or 1) then folds into one i32. Summing
/// in i16 halves the multiply-port work of `maddubs` + `madd` per chunk, and is exact as long as
/// `2·ns` chunks of `2·u_max·128` stay below 2¹⁵: [`run_len`] vectors, 4 of 4-bit integers (a
/// 32-value block: 8 · 3 840), 2 of 5-bit (4 · 7 936) or 1 of 6-bit (2 · 16 128).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn dots16<F: Fmt, const R: usize>(
    w: &PackedMatrix,
    rec: *const u8,
    h: usize,
    s0: usize,
    ns: usize,
    a: *const u8,
    lda: usize,
) -> [__m256i; R] {
    let mut p = [_mm256_setzero_si256(); R];
    let m4 = _mm256_set1_epi8(0x0F);
    for s in s0..s0 + ns {
        let v = _mm256_loadu_si256(rec.add(s * 64 + 32 * h) as *const _);
        let mut lo = _mm256_and_si256(v, m4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        match F::INTS {
            Ints::Five => {
                let qh = rec.add(w.rec.qh) as *const u64;
                let b16 = _mm256_set1_epi8(0x10);
                let bits = |ch: usize| bits_to_bytes((qh.add(ch).read_unaligned() >> (32 * h)) as u32);
                lo = _mm256_or_si256(lo, _mm256_and_si256(bits(2 * s), b16));
                hi = _mm256_or_si256(hi, _mm256_and_si256(bits(2 * s + 1), b16));
            }
            Ints::Six => {
                let hb = _mm256_loadu_si256(rec.add(w.rec.qh + (s / 2) * 64 + 32 * h) as *const _);
                let m30 = _mm256_set1_epi8(0x30);
                let (b0, b1) = if s.is_multiple_of(2) {
                    (_mm256_slli_epi16(hb, 4), _mm256_slli_epi16(hb, 2))
                } else {
                    (hb, _mm256_srli_epi16(hb, 2))
                };
                lo = _mm256_or_si256(lo, _mm256_and_si256(b0, m30));
                hi = _mm256_or_si256(hi, _mm256_and_si256(b1, m30));
            }
            _ => {}
        }
        for r in 0..R {
            let d = _mm256_add_epi16(
                _mm256_maddubs_epi16(lo, bcast(a, r, lda, 2 * s)),
                _mm256_maddubs_epi16(hi, bcast(a, r, lda, 2 * s + 1)),
            );
            p[r] = _mm256_add_epi16(p[r], d);
        }
    }
    p
}

/// Per column lane, the i32 `v` in both of its i16 halves: the partner of [`dots16`]'s pairs in
/// `madd`, for a scale that fits an i16.
#[inline(always)]
unsafe fn both_halves(v: __m256i) -> __m256i {
    _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32::<16>(v))
}

/// Vectors of a format's integers whose [`dots16`] sums cannot saturate an i16 (see there).
const fn run_len<F: Fmt>() -> usize {
    match F::INTS {
        Ints::Five => 2,
        Ints::Six => 1,
        _ => 4,
    }
}

/// Adds to `acc` the dot products of vectors `s0..s0 + n` of half `h` of a record as i32, each
/// pair of i16 sums widened by a `madd` against `scale` (1, or a block's scale in both halves
/// of its column's lane), in runs of [`run_len`] vectors.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn add_widened<F: Fmt, const R: usize>(
    w: &PackedMatrix,
    rec: *const u8,
    h: usize,
    s0: usize,
    n: usize,
    a: *const u8,
    lda: usize,
    scale: __m256i,
    acc: &mut [__m256i; R],
) {
    for s in (s0..s0 + n).step_by(run_len::<F>()) {
        let p = dots16::<F, R>(w, rec, h, s, run_len::<F>(), a, lda);
        for r in 0..R {
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p[r], scale));
        }
    }
}

/// `Σ_k madd(v_k, pair(r, k))` per row over `n` vectors of i16 pairs (this half's 32 bytes of
/// each 64-byte vector at `v`): a per-column pair of small integers against a row's pair of
/// block sums.
#[inline(always)]
unsafe fn pair_sums<const R: usize>(
    v: *const u8,
    n: usize,
    pair: impl Fn(usize, usize) -> i32,
) -> [__m256i; R] {
    let mut out = [_mm256_setzero_si256(); R];
    for k in 0..n {
        let vk = _mm256_loadu_si256(v.add(64 * k) as *const _);
        for (r, o) in out.iter_mut().enumerate() {
            *o = _mm256_add_epi32(*o, _mm256_madd_epi16(vk, _mm256_set1_epi32(pair(r, k))));
        }
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<F: Fmt, const R: usize>(
    w: &PackedMatrix,
    t: usize,
    h: usize,
    x: &Q8Rows,
    r0: usize,
    out: *mut f32,
    ldo: usize,
    prefetch: bool,
) {
    let groups = w.groups();
    let lda = x.nbp * QK;
    let z = _mm256_setzero_si256();
    let mut acc = [_mm256_setzero_ps(); R];
    // Q8_0's integers are already signed here (see `dot4`).
    let shift = if F::INTS == Ints::Byte { 0 } else { F::BIAS_SHIFT };
    for g in 0..groups {
        let rec = w.record(t, g);
        let a = x.qs.as_ptr().add(r0 * lda + g * GROUP) as *const u8;
        let blk = |r: usize| (r0 + r) * x.nbp + g * 8;
        match F::SCALES {
            ScaleKind::F16 => {
                for j in 0..8 {
                    if prefetch {
                        prefetch_part(rec, w.rec.size, j, 8);
                    }
                    let mut p = [z; R];
                    if F::INTS == Ints::Byte {
                        dots_byte::<R>(rec, h, 8 * j, 8, a, lda, &mut p);
                    } else {
                        add_widened::<F, R>(w, rec, h, 4 * j, 4, a, lda, _mm256_set1_epi16(1), &mut p);
                    }
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(rec.add(w.rec.d + 32 * j + 16 * h) as *const _));
                    let mw = if F::MIN {
                        _mm256_cvtph_ps(_mm_loadu_si128(rec.add(w.rec.m + 32 * j + 16 * h) as *const _))
                    } else {
                        _mm256_setzero_ps()
                    };
                    for r in 0..R {
                        let b = blk(r) + j;
                        let mut pc = p[r];
                        if shift > 0 {
                            pc = _mm256_sub_epi32(pc, _mm256_set1_epi32(*x.bsum.get_unchecked(b) << shift));
                        }
                        let s = _mm256_mul_ps(dw, _mm256_set1_ps(*x.d.get_unchecked(b)));
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pc), s, acc[r]);
                        if F::MIN {
                            acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*x.xs.get_unchecked(b)), acc[r]);
                        }
                    }
                }
            }
            ScaleKind::K4 => {
                let bytes =
                    |off: usize| _mm256_cvtepu8_epi32(_mm_loadl_epi64(rec.add(off + 8 * h) as *const _));
                let mut i = [z; R];
                for j in 0..8 {
                    if prefetch {
                        prefetch_part(rec, w.rec.size, j, 8);
                    }
                    // The block's 6-bit scale multiplies its i16 pairs in the `madd` that
                    // widens them (exact: 63 · 2 · 30 720 < 2³¹).
                    let sc = both_halves(bytes(w.rec.sc + 16 * j));
                    add_widened::<F, R>(w, rec, h, 4 * j, 4, a, lda, sc, &mut i);
                }
                let m = pair_sums::<R>(rec.add(w.rec.mn + 32 * h), 4, |r, i| {
                    *x.bpair.get_unchecked(blk(r) / 2 + i)
                });
                let d = _mm256_loadu_ps(rec.add(w.rec.d + 32 * h) as *const f32);
                let nd = _mm256_loadu_ps(rec.add(w.rec.m + 32 * h) as *const f32);
                for r in 0..R {
                    let dx = _mm256_set1_ps(*x.d.get_unchecked(blk(r)));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i[r]), _mm256_mul_ps(d, dx), acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m[r]), _mm256_mul_ps(nd, dx), acc[r]);
                }
            }
            ScaleKind::K6 => {
                let mut i = [z; R];
                for l in 0..16 {
                    if prefetch {
                        prefetch_part(rec, w.rec.size, l, 16);
                    }
                    let sc = both_halves(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                        rec.add(w.rec.sc + 16 * l + 8 * h) as *const _,
                    )));
                    add_widened::<F, R>(w, rec, h, 2 * l, 2, a, lda, sc, &mut i);
                }
                // The integers are stored plus 32: I −= 32 · Σ_l sc_l · hsum_l.
                let hb =
                    pair_sums::<R>(rec.add(w.rec.mn + 32 * h), 8, |r, k| *x.hpair.get_unchecked(blk(r) + k));
                for r in 0..R {
                    i[r] = _mm256_sub_epi32(i[r], _mm256_slli_epi32::<5>(hb[r]));
                }
                let d = _mm256_loadu_ps(rec.add(w.rec.d + 32 * h) as *const f32);
                for r in 0..R {
                    let dx = _mm256_set1_ps(*x.d.get_unchecked(blk(r)));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i[r]), _mm256_mul_ps(d, dx), acc[r]);
                }
            }
        }
    }
    let c0 = t * NT + 8 * h;
    let valid = w.n.saturating_sub(c0).min(8);
    for r in 0..R {
        let o = out.add((r0 + r) * ldo + c0);
        if valid == 8 {
            _mm256_storeu_ps(o, acc[r]);
        } else {
            let mut tmp = [0f32; 8];
            _mm256_storeu_ps(tmp.as_mut_ptr(), acc[r]);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), o, valid);
        }
    }
}
