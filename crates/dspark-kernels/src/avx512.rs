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
    by_format!(w.format, range_vnni(w, x, t0, t1, out, ldo))
}

/// [`range`] with the integer sums from AMX tiles (`tdpbsud`); the rest is this path's.
///
/// # Safety
/// As [`range`], and the CPU must have AMX-TILE and AMX-INT8 with the tile state granted to the
/// process ([`crate::path::KernelPath::available`] checks both).
pub unsafe fn range_amx(w: &PackedMatrix, x: &Q8Rows, t0: usize, t1: usize, out: *mut f32, ldo: usize) {
    by_format!(w.format, range_amx_f(w, x, t0, t1, out, ldo));
    amx::release();
}

unsafe fn range_amx_f<F: Fmt>(w: &PackedMatrix, x: &Q8Rows, t0: usize, t1: usize, out: *mut f32, ldo: usize) {
    range_f::<F, true>(w, x, t0, t1, out, ldo)
}

unsafe fn range_vnni<F: Fmt>(w: &PackedMatrix, x: &Q8Rows, t0: usize, t1: usize, out: *mut f32, ldo: usize) {
    range_f::<F, false>(w, x, t0, t1, out, ldo)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn range_f<F: Fmt, const AMX: bool>(
    w: &PackedMatrix,
    x: &Q8Rows,
    t0: usize,
    t1: usize,
    out: *mut f32,
    ldo: usize,
) {
    // 20 KiB the VNNI instantiation never touches: neither zeroed nor pointed at there.
    let mut store = std::mem::MaybeUninit::<AmxScratch>::uninit();
    let scratch: *mut AmxScratch = if AMX { store.as_mut_ptr() } else { std::ptr::null_mut() };
    // Row passes of equal size: 12 rows are two passes of 6, not 8 + 4.
    let per = x.rows.div_ceil(x.rows.div_ceil(MAX_R));
    let mut r0 = 0;
    while r0 < x.rows {
        let rt = per.min(x.rows - r0);
        // The first pass streams the weights from memory; later ones find them in L2.
        let first = r0 == 0;
        // A tile product's cost hardly depends on its rows, a `vpdpbusd` pass's is linear in
        // them: few rows take the VNNI loop (the same integers either way).
        let tiles = AMX && rt >= AMX_MIN_ROWS;
        if tiles {
            amx::configure(rt, if F::SCALES == ScaleKind::K6 { 16 } else { 32 });
        }
        for t in t0..t1 {
            let a = scratch;
            macro_rules! go {
                ($r:literal) => {
                    if tiles {
                        tile::<F, $r, true>(w, t, x, r0, out, ldo, first, a)
                    } else {
                        tile::<F, $r, false>(w, t, x, r0, out, ldo, first, a)
                    }
                };
            }
            match rt {
                8 => go!(8),
                7 => go!(7),
                6 => go!(6),
                5 => go!(5),
                4 => go!(4),
                3 => go!(3),
                2 => go!(2),
                _ => go!(1),
            }
        }
        r0 += rt;
    }
}

/// Row passes at least this large use AMX tiles on the AMX path.
const AMX_MIN_ROWS: usize = 2;

/// Nibble vector `s` of a record as bytes: chunks `2s` (low nibbles) and `2s + 1` (high), with
/// Q5's fifth and Q6_K's high bits added.
#[inline(always)]
unsafe fn unpack<F: Fmt>(w: &PackedMatrix, rec: *const u8, s: usize) -> (__m512i, __m512i) {
    let m4 = _mm512_set1_epi8(0x0F);
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
            let (b0, b1) = if s.is_multiple_of(2) {
                (_mm512_slli_epi16(hb, 4), _mm512_slli_epi16(hb, 2))
            } else {
                (hb, _mm512_srli_epi16(hb, 2))
            };
            lo = _mm512_or_si512(lo, _mm512_and_si512(b0, m30));
            hi = _mm512_or_si512(hi, _mm512_and_si512(b1, m30));
        }
        _ => {}
    }
    (lo, hi)
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
    for s in ch0 / 2..(ch0 + n) / 2 {
        let (lo, hi) = unpack::<F>(w, rec, s);
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
#[allow(clippy::too_many_arguments)]
unsafe fn tile<F: Fmt, const R: usize, const AMX: bool>(
    w: &PackedMatrix,
    t: usize,
    x: &Q8Rows,
    r0: usize,
    out: *mut f32,
    ldo: usize,
    prefetch: bool,
    amx: *mut AmxScratch,
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
        if AMX {
            amx_group::<F>(amx, w, rec, a, lda);
        }
        match F::SCALES {
            ScaleKind::F16 => {
                for j in 0..8 {
                    if prefetch {
                        prefetch_part(rec, w.rec.size, j, 8);
                    }
                    let (mut p, mut q) = ([z; R], [z; R]);
                    block::<F, R, AMX>(amx, w, rec, 8 * j, 8, a, lda, &mut p, &mut q);
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
                    block::<F, R, AMX>(amx, w, rec, 8 * j, 8, a, lda, &mut p, &mut q);
                    let sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(rec.add(w.rec.sc + 16 * j) as *const _));
                    for r in 0..R {
                        i[r] = _mm512_add_epi32(i[r], _mm512_mullo_epi32(_mm512_add_epi32(p[r], q[r]), sc));
                    }
                }
                let m = pair_sums::<R>(rec.add(w.rec.mn), 4, |r, i| *x.bpair.get_unchecked(blk(r) / 2 + i));
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
                    block::<F, R, AMX>(amx, w, rec, 4 * l, 4, a, lda, &mut p, &mut q);
                    let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(rec.add(w.rec.sc + 16 * l) as *const _));
                    for r in 0..R {
                        i[r] = _mm512_add_epi32(i[r], _mm512_mullo_epi32(_mm512_add_epi32(p[r], q[r]), sc));
                    }
                }
                // The integers are stored plus 32: I −= 32 · Σ_l sc_l · hsum_l.
                let hb = pair_sums::<R>(rec.add(w.rec.mn), 8, |r, k| *x.hpair.get_unchecked(blk(r) + k));
                for r in 0..R {
                    i[r] = _mm512_sub_epi32(i[r], _mm512_slli_epi32::<5>(hb[r]));
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

/// `Σ_k vpdpwssd(v_k, pair(r, k))` per row over `n` 64-byte vectors of i16 pairs at `v`: a
/// per-column pair of small integers against a row's pair of block sums.
#[inline(always)]
unsafe fn pair_sums<const R: usize>(
    v: *const u8,
    n: usize,
    pair: impl Fn(usize, usize) -> i32,
) -> [__m512i; R] {
    let mut out = [_mm512_setzero_si512(); R];
    for k in 0..n {
        let vk = _mm512_loadu_si512(v.add(64 * k) as *const _);
        for (r, o) in out.iter_mut().enumerate() {
            *o = _mm512_dpwssd_epi32(*o, vk, _mm512_set1_epi32(pair(r, k)));
        }
    }
    out
}

/// Where AMX tiles are staged: a group's weights as bytes (B: 64 chunks of 64 bytes), and the
/// integer sums of each of its blocks (C: up to 16 blocks × 16 rows × 16 columns).
#[repr(C, align(64))]
struct AmxScratch {
    b: [u8; GROUP * 16],
    c: [i32; 16 * 16 * 16],
}

/// The integer sums of every block of one group (8 blocks of 32 values, or Q6_K's 16 of 16)
/// for the configured rows, into `s.c`: all tile products first, two at a time on distinct
/// tiles, so that the tile unit works while the previous sums are stored, and the float
/// epilogue reads them after.
#[inline(always)]
unsafe fn amx_group<F: Fmt>(s: *mut AmxScratch, w: &PackedMatrix, rec: *const u8, a: *const u8, lda: usize) {
    // Raw places only: the scratch is uninitialised until these writes and the tile stores.
    let sb = std::ptr::addr_of_mut!((*s).b) as *mut u8;
    let kb = if F::SCALES == ScaleKind::K6 { 16 } else { 32 };
    // B is a block's chunk vectors, 64 bytes each: a record's layout is the tile's.
    let b = if F::INTS == Ints::Byte {
        rec
    } else {
        for v in 0..GROUP / 8 {
            let (lo, hi) = unpack::<F>(w, rec, v);
            let o = sb.add(2 * v * 64);
            _mm512_store_si512(o as *mut _, lo);
            _mm512_store_si512(o.add(64) as *mut _, hi);
        }
        sb as *const u8
    };
    let c = std::ptr::addr_of_mut!((*s).c) as *mut i32;
    for j in (0..GROUP / kb).step_by(2) {
        amx::product2(a.add(j * kb), lda, b.add(j * kb * 16), c.add(j * 256), kb);
    }
}

/// The integer sums of chunks `ch0..ch0 + n` (one block) into `p`, by `vpdpbusd` or, on the
/// AMX path, from the group's tile products ([`amx_group`]); the same integers either way.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn block<F: Fmt, const R: usize, const AMX: bool>(
    s: *mut AmxScratch,
    w: &PackedMatrix,
    rec: *const u8,
    ch0: usize,
    n: usize,
    a: *const u8,
    lda: usize,
    p: &mut [__m512i; R],
    q: &mut [__m512i; R],
) {
    if !AMX {
        return dots::<F, R>(w, rec, ch0, n, a, lda, p, q);
    }
    // The group's tile products wrote these sums (`amx_group`).
    let c = (std::ptr::addr_of!((*s).c) as *const i32).add(ch0 / n * 256);
    for r in 0..R {
        p[r] = _mm512_load_si512(c.add(16 * r) as *const _);
    }
}

/// AMX-INT8 through inline assembly (Rust's AMX intrinsics are not stable): tile 0 holds the
/// activations (rows × block bytes, signed), tile 1 the weights (block bytes / 4 rows of 16
/// columns × 4 bytes, unsigned), tile 2 the sums (rows × 16 i32).
mod amx {
    use std::arch::asm;

    /// Shapes the tiles for `rows` activation rows and blocks of `kb` bytes: two products at a
    /// time, on tiles 0–2 and 3–5.
    pub unsafe fn configure(rows: usize, kb: usize) {
        let mut c = crate::x86::TileShapes::default();
        for t in [0, 3] {
            c.set(t, rows, kb);
            c.set(t + 1, kb / 4, 64);
            c.set(t + 2, rows, 64);
        }
        c.load();
    }

    /// Two consecutive blocks: `c[r][n] = Σ_k a[r][k]·b[k / 4][4n + k % 4]` over the configured
    /// shapes, for `(a, b, c)` and for the block after it (`a + kb`, `b + 16·kb`, `c + 256`).
    #[inline(always)]
    pub unsafe fn product2(a: *const u8, lda: usize, b: *const u8, c: *mut i32, kb: usize) {
        asm!(
            "tilezero tmm2",
            "tilezero tmm5",
            "tileloadd tmm0, [{a0} + {lda}*1]",
            "tileloadd tmm1, [{b0} + {ldb}*1]",
            "tileloadd tmm3, [{a1} + {lda}*1]",
            "tileloadd tmm4, [{b1} + {ldb}*1]",
            "tdpbsud tmm2, tmm0, tmm1",
            "tdpbsud tmm5, tmm3, tmm4",
            "tilestored [{c0} + {ldb}*1], tmm2",
            "tilestored [{c1} + {ldb}*1], tmm5",
            a0 = in(reg) a,
            a1 = in(reg) a.add(kb),
            lda = in(reg) lda,
            b0 = in(reg) b,
            b1 = in(reg) b.add(16 * kb),
            ldb = in(reg) 64usize,
            c0 = in(reg) c,
            c1 = in(reg) c.add(256),
            options(nostack),
        );
    }

    pub unsafe fn release() {
        asm!("tilerelease", options(nostack, nomem));
    }
}
