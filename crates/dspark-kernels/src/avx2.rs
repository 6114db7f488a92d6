//! AVX2 + FMA + F16C kernels over [`PackedMatrix`]. Each weight block is unpacked once per tile
//! of activation rows and multiplied against every row of the tile, so a k-row verify pass reads
//! the weights once per tile instead of once per row.

#![allow(unsafe_op_in_unsafe_fn)]
// The tile loops index several parallel per-row arrays by the same row.
#![allow(clippy::needless_range_loop)]

use crate::format::{Q8Rows, QuantFormat, QK};
use crate::packed::{PackedMatrix, ScaleKind};
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

/// The 32 integers of block `i` (global block index): signed, or unsigned for formats with an
/// offset.
#[inline(always)]
unsafe fn unpack<F: Fmt>(w: &PackedMatrix, i: usize) -> __m256i {
    if F::BYTES {
        return _mm256_loadu_si256(w.qs.as_ptr().add(i * 32) as *const __m256i);
    }
    if F::SCALES == ScaleKind::K4 {
        let x = _mm256_loadu_si256(w.qs.as_ptr().add((i / 2) * 32) as *const __m256i);
        let x = if i.is_multiple_of(2) { x } else { _mm256_srli_epi16(x, 4) };
        return _mm256_and_si256(x, _mm256_set1_epi8(0x0F));
    }
    let mut v = nibbles(w.qs.as_ptr().add(i * 16));
    for pl in 0..F::PLANES {
        let bits = bits_to_bytes(w.qh.as_ptr().add((i * F::PLANES + pl) * 4));
        v = _mm256_or_si256(v, _mm256_and_si256(bits, _mm256_set1_epi8(0x10 << pl)));
    }
    if F::BIAS == 0 {
        v
    } else {
        _mm256_sub_epi8(v, _mm256_set1_epi8(F::BIAS))
    }
}

/// A weight format as compile-time constants, so that each format gets its own kernel with no
/// per-block branches.
trait Fmt {
    const BYTES: bool = false;
    const PLANES: usize = 0;
    const BIAS: i8 = 0;
    const SIGNED: bool = true;
    const SCALES: ScaleKind = ScaleKind::F16;
}
struct Q40;
struct Q41;
struct Q50;
struct Q51;
struct Q80;
struct Q4K;
struct Q6K;
impl Fmt for Q40 {
    const BIAS: i8 = 8;
}
impl Fmt for Q41 {
    const SIGNED: bool = false;
}
impl Fmt for Q50 {
    const PLANES: usize = 1;
    const BIAS: i8 = 16;
}
impl Fmt for Q51 {
    const PLANES: usize = 1;
    const SIGNED: bool = false;
}
impl Fmt for Q80 {
    const BYTES: bool = true;
}
impl Fmt for Q4K {
    const SIGNED: bool = false;
    const SCALES: ScaleKind = ScaleKind::K4;
}
impl Fmt for Q6K {
    const SCALES: ScaleKind = ScaleKind::K6;
}

/// Block `j` of Q6_K super-block `g`, from GGUF's layout (see `PackedMatrix::pack_q6k`): the
/// low nibbles and the high 2-bit fields each come from a 32-byte load shared with other blocks
/// and one shift.
#[inline(always)]
unsafe fn unpack_q6k(w: &PackedMatrix, g: usize, j: usize) -> __m256i {
    let (c, t) = (j / 4, j % 4);
    let x = _mm256_loadu_si256(w.qs.as_ptr().add(g * 128 + 64 * c + 32 * (t % 2)) as *const __m256i);
    let lo = _mm256_and_si256(if t < 2 { x } else { _mm256_srli_epi16(x, 4) }, _mm256_set1_epi8(0x0F));
    let h = _mm256_loadu_si256(w.qh.as_ptr().add(g * 64 + 32 * c) as *const __m256i);
    // Bits 2t..2t+2 of each byte to bits 4..6 (16-bit shifts; the mask drops what crossed bytes).
    let h = match t {
        0 => _mm256_slli_epi16(h, 4),
        1 => _mm256_slli_epi16(h, 2),
        2 => h,
        _ => _mm256_srli_epi16(h, 2),
    };
    let v = _mm256_or_si256(lo, _mm256_and_si256(h, _mm256_set1_epi8(0x30)));
    _mm256_sub_epi8(v, _mm256_set1_epi8(32))
}

/// The weight scales of the eight blocks of group `gi` (global group index): low halves, high
/// halves (equal except for Q6_K), and offsets.
#[inline(always)]
unsafe fn group_scales<F: Fmt>(w: &PackedMatrix, gi: usize) -> (__m256, __m256, __m256) {
    let i = gi * 8;
    match F::SCALES {
        ScaleKind::F16 => {
            let d = _mm256_cvtph_ps(_mm_loadu_si128(w.d16.as_ptr().add(i) as *const __m128i));
            let m = if F::SIGNED {
                _mm256_setzero_ps()
            } else {
                _mm256_cvtph_ps(_mm_loadu_si128(w.m16.as_ptr().add(i) as *const __m128i))
            };
            (d, d, m)
        }
        ScaleKind::K4 => {
            let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                w.sc.as_ptr().add(i) as *const __m128i
            )));
            let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                w.mn.as_ptr().add(i) as *const __m128i
            )));
            let d = _mm256_mul_ps(_mm256_set1_ps(w.gd[gi]), sc);
            (d, d, _mm256_mul_ps(_mm256_set1_ps(-w.gmin[gi]), mn))
        }
        ScaleKind::K6 => {
            let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                w.sc.as_ptr().add(i) as *const __m128i
            )));
            let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                w.mn.as_ptr().add(i) as *const __m128i
            )));
            let d = _mm256_set1_ps(w.gd[gi]);
            (_mm256_mul_ps(d, lo), _mm256_mul_ps(d, hi), _mm256_setzero_ps())
        }
    }
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Runs `$tile::<[$g,] R>(w, n, x, r0)` over register tiles of 4 activation rows, then 2, then 1,
/// storing each row's result: every row runs the same arithmetic in the same order, so its
/// result does not depend on its batch.
macro_rules! row_tiles {
    ($w:expr, $x:expr, $n0:expr, $n1:expr, $out:expr, $ldo:expr, $tile:ident $(, $g:ty)?) => {
        for n in $n0..$n1 {
            let mut r0 = 0;
            while r0 + 4 <= $x.rows {
                store($out, $ldo, n, r0, $tile::<$($g,)? 4>($w, n, $x, r0));
                r0 += 4;
            }
            if r0 + 2 <= $x.rows {
                store($out, $ldo, n, r0, $tile::<$($g,)? 2>($w, n, $x, r0));
                r0 += 2;
            }
            if r0 < $x.rows {
                store($out, $ldo, n, r0, $tile::<$($g,)? 1>($w, n, $x, r0));
            }
        }
    };
}

/// Computes `out[r][n] = Σ_k x[r][k]·w[n][k]` for `n` in `n0..n1` and all rows of `x`.
/// `out` is row-major with row stride `ldo`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x` was quantized with `w.nbp` blocks per row;
/// `out` has room for `x.rows` rows of stride `ldo` covering columns `n0..n1`.
pub unsafe fn matmul_range(w: &PackedMatrix, x: &Q8Rows, n0: usize, n1: usize, out: *mut f32, ldo: usize) {
    debug_assert!(x.rows <= MAX_ROWS && x.nbp == w.nbp);
    match w.format {
        QuantFormat::Q4_0 => range::<Q40>(w, x, n0, n1, out, ldo),
        QuantFormat::Q4_1 => range::<Q41>(w, x, n0, n1, out, ldo),
        QuantFormat::Q5_0 => range::<Q50>(w, x, n0, n1, out, ldo),
        QuantFormat::Q5_1 => range::<Q51>(w, x, n0, n1, out, ldo),
        QuantFormat::Q8_0 => range::<Q80>(w, x, n0, n1, out, ldo),
        QuantFormat::Q4K if avx512_vnni() => range_q4k_512(w, x, n0, n1, out, ldo),
        QuantFormat::Q4K => range::<Q4K>(w, x, n0, n1, out, ldo),
        QuantFormat::Q6K if avx512_vnni() => range_q6k_512(w, x, n0, n1, out, ldo),
        QuantFormat::Q6K => range::<Q6K>(w, x, n0, n1, out, ldo),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn range<F: Fmt>(w: &PackedMatrix, x: &Q8Rows, n0: usize, n1: usize, out: *mut f32, ldo: usize) {
    if F::SCALES == ScaleKind::F16 {
        row_tiles!(w, x, n0, n1, out, ldo, tile, F);
    } else {
        row_tiles!(w, x, n0, n1, out, ldo, tile_k, F);
    }
}

#[inline(always)]
unsafe fn store<const R: usize>(out: *mut f32, ldo: usize, n: usize, r0: usize, v: [f32; R]) {
    for (i, vi) in v.iter().enumerate() {
        *out.add((r0 + i) * ldo + n) = *vi;
    }
}

/// How far ahead `prefetch_group` reaches, in bytes of `qs`. A static rather than a constant so
/// that the `stream` example can compare distances in one process.
pub static PREFETCH: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(2048);

#[inline(always)]
fn prefetch_distance() -> usize {
    PREFETCH.load(std::sync::atomic::Ordering::Relaxed)
}

/// Asks for the weights a fixed distance ahead of group `gi` (global group index): each thread
/// streams its rows from memory once per token, and with the kernel's arithmetic between loads
/// the hardware prefetcher alone keeps too few lines in flight.
#[inline(always)]
unsafe fn prefetch_group<F: Fmt>(w: &PackedMatrix, gi: usize) {
    let (qs_bytes, qh_bytes) = match F::SCALES {
        ScaleKind::K6 => (128, 64),
        _ if F::BYTES => (256, 0),
        _ => (128, 32 * F::PLANES),
    };
    let d = prefetch_distance();
    let p = w.qs.as_ptr().wrapping_add(gi * qs_bytes + d);
    for l in (0..qs_bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(l) as *const i8);
    }
    if qh_bytes > 0 {
        _mm_prefetch::<_MM_HINT_T0>(
            w.qh.as_ptr().wrapping_add(gi * qh_bytes + d * qh_bytes / qs_bytes) as *const i8
        );
    }
}

/// Dot products of weight row `n` with activation rows `r0..r0 + R`. Blocks go in groups of
/// eight: one conversion gives the eight weight scales, one multiply the eight combined scales
/// of a row, one FMA the offset terms; then each block costs an unpack plus, per row, an
/// integer dot, a conversion and an FMA. Even and odd blocks accumulate in separate chains.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<F: Fmt, const R: usize>(w: &PackedMatrix, n: usize, x: &Q8Rows, r0: usize) -> [f32; R] {
    let nbp = w.nbp;
    let kp = nbp * QK;
    let signed = F::SIGNED;
    let split = F::SCALES == ScaleKind::K6;
    let one = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    let mut macc = [_mm256_setzero_ps(); R];
    let mut lo = [[0f32; 8]; R];
    let mut hi = [[0f32; 8]; R];
    let base = n * nbp;
    for g in (0..nbp).step_by(8) {
        let gi = (base + g) / 8;
        prefetch_group::<F>(w, gi);
        let (dlo, dhi, mw) = group_scales::<F>(w, gi);
        for r in 0..R {
            let xo = (r0 + r) * nbp + g;
            let xd = _mm256_loadu_ps(x.d.as_ptr().add(xo));
            _mm256_storeu_ps(lo[r].as_mut_ptr(), _mm256_mul_ps(dlo, xd));
            if split {
                _mm256_storeu_ps(hi[r].as_mut_ptr(), _mm256_mul_ps(dhi, xd));
            }
            if !F::SIGNED {
                macc[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x.s.as_ptr().add(xo)), macc[r]);
            }
        }
        for j in 0..8 {
            let b = g + j;
            let q = unpack::<F>(w, base + b);
            let wa = if signed { _mm256_sign_epi8(q, q) } else { q };
            for r in 0..R {
                let a = _mm256_loadu_si256(x.qs.as_ptr().add((r0 + r) * kp + b * QK) as *const __m256i);
                let a = if signed { _mm256_sign_epi8(a, q) } else { a };
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, a), one);
                // Lanes 0–3 hold values 0–15 of the block, lanes 4–7 values 16–31.
                let sc = if split {
                    _mm256_set_m128(_mm_broadcast_ss(&hi[r][j]), _mm_broadcast_ss(&lo[r][j]))
                } else {
                    _mm256_broadcast_ss(&lo[r][j])
                };
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

/// Runs `$body` (one super-block's integer sums per row, and its float bookkeeping) over the
/// super-blocks of a row with the even ones into `acc0` and the odd ones into `acc1`, unrolled so
/// both chains stay in registers (an array indexed at run time is kept on the stack).
macro_rules! two_chains {
    ($nbp:expr, $g:ident, $acc:ident, $acc0:ident, $acc1:ident, $body:block) => {{
        let mut $g = 0;
        while $g < $nbp {
            {
                let $acc = &mut $acc0;
                $body
            }
            $g += 8;
            if $g >= $nbp {
                break;
            }
            {
                let $acc = &mut $acc1;
                $body
            }
            $g += 8;
        }
    }};
}

/// K-quant tile: activations share one scale per 256-value super-block, so a whole super-block
/// is summed in integers — each block's small scale enters through the `madd` that widens the
/// byte products (llama.cpp's Q8_K scheme) — and converted to float once. Per row and block this
/// is a load, `maddubs`, `madd` and an add. Q4_K's offset term uses the per-block sums of the
/// activation integers.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_k<F: Fmt, const R: usize>(w: &PackedMatrix, n: usize, x: &Q8Rows, r0: usize) -> [f32; R] {
    let nbp = w.nbp;
    let kp = nbp * QK;
    let mut acc0 = [_mm256_setzero_ps(); R];
    let mut acc1 = [_mm256_setzero_ps(); R];
    let mut macc = [_mm256_setzero_ps(); R];
    let base = n * nbp;
    two_chains!(nbp, g, acc, acc0, acc1, {
        let gi = (base + g) / 8;
        prefetch_group::<F>(w, gi);
        let mut isum = [_mm256_setzero_si256(); R];
        // The eight blocks' scales as i16, low halves in the low lane and high halves in the
        // high lane (equal for Q4_K); block j's pair is then one byte shuffle away.
        let sc16 = if F::SCALES == ScaleKind::K6 {
            let lo = _mm_cvtepi8_epi16(_mm_loadl_epi64(w.sc.as_ptr().add(gi * 8) as *const __m128i));
            let hi = _mm_cvtepi8_epi16(_mm_loadl_epi64(w.mn.as_ptr().add(gi * 8) as *const __m128i));
            _mm256_set_m128i(hi, lo)
        } else {
            _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64(
                w.sc.as_ptr().add(gi * 8) as *const __m128i
            )))
        };
        for j in 0..8 {
            let b = base + g + j;
            let q = if F::SCALES == ScaleKind::K6 { unpack_q6k(w, gi, j) } else { unpack::<F>(w, b) };
            let pick = (((2 * j + 1) << 8) | (2 * j)) as i16;
            let scv = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(pick));
            let wa = if F::SIGNED { _mm256_sign_epi8(q, q) } else { q };
            for r in 0..R {
                let a = _mm256_loadu_si256(x.qs.as_ptr().add((r0 + r) * kp + (g + j) * QK) as *const __m256i);
                let a = if F::SIGNED { _mm256_sign_epi8(a, q) } else { a };
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, a), scv));
            }
        }
        let mnf = if F::SCALES == ScaleKind::K4 {
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                w.mn.as_ptr().add(gi * 8) as *const __m128i
            )))
        } else {
            _mm256_setzero_ps()
        };
        for r in 0..R {
            let xo = (r0 + r) * nbp + g;
            let dx = *x.d.get_unchecked(xo);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(w.gd[gi] * dx), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            if F::SCALES == ScaleKind::K4 {
                let bs = _mm256_loadu_ps(x.bsum.as_ptr().add(xo));
                macc[r] = _mm256_fmadd_ps(_mm256_mul_ps(mnf, bs), _mm256_set1_ps(-w.gmin[gi] * dx), macc[r]);
            }
        }
    });
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r])) + hsum(macc[r]);
    }
    out
}

/// AVX-512 VNNI, chosen once per machine (never per batch): the integer sums are exactly those
/// of `tile_k`, so results are bit-identical to the AVX2 path.
fn avx512_vnni() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        std::env::var("DSPARK_NO_AVX512").is_err()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    })
}

/// Folds a super-block's 16 integer lanes to the 8 of the AVX2 tile (same sums) and adds them,
/// scaled, to the row's float accumulator.
#[inline(always)]
unsafe fn add_super_block(acc: __m256, isum: __m512i, scale: f32) -> __m256 {
    let s = _mm256_add_epi32(_mm512_castsi512_si256(isum), _mm512_extracti64x4_epi64(isum, 1));
    _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(s), acc)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn range_q4k_512(w: &PackedMatrix, x: &Q8Rows, n0: usize, n1: usize, out: *mut f32, ldo: usize) {
    row_tiles!(w, x, n0, n1, out, ldo, tile_q4k_512);
}

/// `tile_k` for Q4_K with two blocks per 512-bit register: the 32 bytes of a block pair give
/// both blocks' values (low and high nibbles), `maddubs` + `dpwssd` multiply, widen, scale by
/// each block's small scale and accumulate in one step each.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn tile_q4k_512<const R: usize>(w: &PackedMatrix, n: usize, x: &Q8Rows, r0: usize) -> [f32; R] {
    let nbp = w.nbp;
    let kp = nbp * QK;
    let mut acc0 = [_mm256_setzero_ps(); R];
    let mut acc1 = [_mm256_setzero_ps(); R];
    let mut macc = [_mm256_setzero_ps(); R];
    let base = n * nbp;
    let m4 = _mm256_set1_epi8(0x0F);
    // i16 lanes 0–15 take block 2p's scale, lanes 16–31 block 2p + 1's.
    let idx: [__m512i; 4] = std::array::from_fn(|p| {
        _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_set1_epi16((2 * p) as i16)),
            _mm256_set1_epi16((2 * p + 1) as i16),
            1,
        )
    });
    two_chains!(nbp, g, acc, acc0, acc1, {
        let gi = (base + g) / 8;
        prefetch_group::<Q4K>(w, gi);
        let mut isum = [_mm512_setzero_si512(); R];
        let sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(
            w.sc.as_ptr().add(gi * 8) as *const __m128i
        )));
        for p in 0..4 {
            let xq = _mm256_loadu_si256(w.qs.as_ptr().add((base + g) / 2 * 32 + p * 32) as *const __m256i);
            let lo = _mm256_and_si256(xq, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16(xq, 4), m4);
            let q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            let scv = _mm512_permutexvar_epi16(idx[p], sc16);
            for r in 0..R {
                let a = _mm512_loadu_si512(x.qs.as_ptr().add((r0 + r) * kp + (g + 2 * p) * QK) as *const _);
                isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(q, a), scv);
            }
        }
        let mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
            w.mn.as_ptr().add(gi * 8) as *const __m128i
        )));
        for r in 0..R {
            let xo = (r0 + r) * nbp + g;
            let dx = *x.d.get_unchecked(xo);
            acc[r] = add_super_block(acc[r], isum[r], w.gd[gi] * dx);
            let bs = _mm256_loadu_ps(x.bsum.as_ptr().add(xo));
            macc[r] = _mm256_fmadd_ps(_mm256_mul_ps(mnf, bs), _mm256_set1_ps(-w.gmin[gi] * dx), macc[r]);
        }
    });
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r])) + hsum(macc[r]);
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn range_q6k_512(w: &PackedMatrix, x: &Q8Rows, n0: usize, n1: usize, out: *mut f32, ldo: usize) {
    row_tiles!(w, x, n0, n1, out, ldo, tile_q6k_512);
}

/// `tile_k` for Q6_K, two blocks per 512-bit register, from GGUF's layout: blocks 4c + {0, 1}
/// are the low nibbles of 64 consecutive `ql` bytes, blocks 4c + {2, 3} their high nibbles;
/// their 2-bit fields come from 32 `qh` bytes. Signed values (q − 32) take the sign trick:
/// |w| × (a with w's sign).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn tile_q6k_512<const R: usize>(w: &PackedMatrix, n: usize, x: &Q8Rows, r0: usize) -> [f32; R] {
    let nbp = w.nbp;
    let kp = nbp * QK;
    let mut acc0 = [_mm256_setzero_ps(); R];
    let mut acc1 = [_mm256_setzero_ps(); R];
    let base = n * nbp;
    let m4 = _mm512_set1_epi8(0x0F);
    let m30 = _mm512_set1_epi8(0x30);
    // For blocks j, j + 1 (j = 0, 2, 4, 6): i16 lanes 0–7 / 8–15 take block j's low / high-half
    // scale, lanes 16–23 / 24–31 block j + 1's.
    let idx: [__m512i; 4] = std::array::from_fn(|h| {
        let j16 = 2 * h as i16;
        _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(8 + j16), _mm_set1_epi16(j16))),
            _mm256_set_m128i(_mm_set1_epi16(9 + j16), _mm_set1_epi16(1 + j16)),
            1,
        )
    });
    two_chains!(nbp, g, acc, acc0, acc1, {
        let gi = (base + g) / 8;
        prefetch_group::<Q6K>(w, gi);
        let mut isum = [_mm512_setzero_si512(); R];
        // i16 lanes 0–7: low-half scales of the eight blocks, 8–15: high-half scales.
        let lo = _mm_cvtepi8_epi16(_mm_loadl_epi64(w.sc.as_ptr().add(gi * 8) as *const __m128i));
        let hi = _mm_cvtepi8_epi16(_mm_loadl_epi64(w.mn.as_ptr().add(gi * 8) as *const __m128i));
        let sc16 = _mm512_castsi256_si512(_mm256_set_m128i(hi, lo));
        for c in 0..2 {
            let ql = _mm512_loadu_si512(w.qs.as_ptr().add(gi * 128 + 64 * c) as *const _);
            let qh = _mm256_loadu_si256(w.qh.as_ptr().add(gi * 64 + 32 * c) as *const __m256i);
            for half in 0..2 {
                let j = 4 * c + 2 * half;
                let low = if half == 0 { ql } else { _mm512_srli_epi16(ql, 4) };
                let high = if half == 0 {
                    _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_slli_epi16(qh, 4)),
                        _mm256_slli_epi16(qh, 2),
                        1,
                    )
                } else {
                    _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1)
                };
                let v = _mm512_or_si512(_mm512_and_si512(low, m4), _mm512_and_si512(high, m30));
                let q = _mm512_sub_epi8(v, _mm512_set1_epi8(32));
                let wa = _mm512_abs_epi8(q);
                let neg = _mm512_movepi8_mask(q);
                let scv = _mm512_permutexvar_epi16(idx[j / 2], sc16);
                for r in 0..R {
                    let a = _mm512_loadu_si512(x.qs.as_ptr().add((r0 + r) * kp + (g + j) * QK) as *const _);
                    let a = _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a);
                    isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(wa, a), scv);
                }
            }
        }
        for r in 0..R {
            let xo = (r0 + r) * nbp + g;
            let dx = *x.d.get_unchecked(xo);
            acc[r] = add_super_block(acc[r], isum[r], w.gd[gi] * dx);
        }
    });
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    /// The 512-bit K-quant tiles must give exactly the AVX2 tile's floats (same integer sums,
    /// same float chains), or a machine's results would depend on which path it took.
    #[test]
    fn avx512_k_quant_tiles_equal_the_avx2_tiles_bit_for_bit() {
        if !crate::avx2_available() || !avx512_vnni() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        }
        // k = 2304: nine super-blocks per row, so both chains and an odd tail run.
        let (n, k) = (24, 2304);
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
        for fmt in [GgmlDType::Q4K, GgmlDType::Q6K] {
            let q = QTensor::quantize(&w, fmt).unwrap();
            let p = PackedMatrix::from_gguf(QuantFormat::from_ggml(fmt).unwrap(), &q.data().unwrap(), n, k);
            for rows in [1, 2, 3, 4, 7] {
                let x: Vec<f32> = Tensor::randn(0f32, 1.0, (rows, k), &Device::Cpu)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let xq = Q8Rows::quantize(&x, rows, k, p.nbp, 8);
                let (mut a, mut b) = (vec![0f32; rows * n], vec![0f32; rows * n]);
                // SAFETY: AVX2 and AVX-512 VNNI were detected; outputs have rows × n entries.
                unsafe {
                    if fmt == GgmlDType::Q4K {
                        range_q4k_512(&p, &xq, 0, n, a.as_mut_ptr(), n);
                        range::<Q4K>(&p, &xq, 0, n, b.as_mut_ptr(), n);
                    } else {
                        range_q6k_512(&p, &xq, 0, n, a.as_mut_ptr(), n);
                        range::<Q6K>(&p, &xq, 0, n, b.as_mut_ptr(), n);
                    }
                }
                assert_eq!(a, b, "{fmt:?} rows {rows}");
            }
        }
    }
}
