//! Matrix products for training in bf16: f32 operands rounded to bf16 (nearest even), their
//! products summed in f32 — the mixed precision drafter training runs (PyTorch's CPU autocast
//! does the same; master weights, gradients' sums and the optimiser stay f32). One AVX-512-BF16
//! `vdpbf16ps` does 32 multiply-adds, twice what an f32 FMA does, so the matmuls that are most of
//! a training step run twice as fast where the CPU has it. Elsewhere [`available`] is false and
//! callers keep their f32 products; [`matmul`] still answers there (portably, slowly).
//!
//! Unlike the inference kernels, nothing here promises a row's result independent of its batch:
//! training has no such contract. A product is deterministic (each output is summed by one
//! thread in one order whatever the thread count), so a resumed run repeats an uninterrupted one.

use rayon::prelude::*;

/// A logical `rows × cols` matrix, stored row-major, or `transposed`: its transpose stored
/// row-major (`data[c · rows + r]`), which is how a backward pass meets its operands.
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub transposed: bool,
}

impl<'a> Mat<'a> {
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self { data, rows, cols, transposed: false }
    }

    /// The transpose of this matrix, without moving anything.
    pub fn t(self) -> Self {
        Self { data: self.data, rows: self.cols, cols: self.rows, transposed: !self.transposed }
    }

    #[inline]
    fn at(&self, r: usize, c: usize) -> f32 {
        if self.transposed {
            self.data[c * self.rows + r]
        } else {
            self.data[r * self.cols + c]
        }
    }
}

/// Whether this CPU runs [`matmul`] in hardware (AVX-512-BF16, and AMX-BF16 tiles where it
/// has them). `DSPARK_TRAIN_MATMUL=f32` answers false, for A/B runs against candle's f32
/// products.
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        if std::env::var("DSPARK_TRAIN_MATMUL").is_ok_and(|v| v == "f32") {
            return false;
        }
        simd()
    })
}

/// The instructions [`matmul`] runs on, chosen once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Path {
    /// AMX-BF16 `tdpbf16ps` on 16 × 16 tiles (Intel Xeon 4th generation and later).
    Amx,
    /// AVX-512-BF16 `vdpbf16ps`.
    Avx512,
    /// [`reference`], portably.
    Portable,
}

impl Bf16Path {
    pub fn name(self) -> &'static str {
        match self {
            Self::Amx => "amx-bf16",
            Self::Avx512 => "avx512-bf16",
            Self::Portable => "portable",
        }
    }
}

/// The path of this process: AMX where the CPU has AMX-BF16 and Linux grants the tile state,
/// else AVX-512-BF16, else portable (and portable with `DSPARK_TRAIN_MATMUL=f32`, where callers
/// take f32 products instead). `DSPARK_TRAIN_MATMUL=avx512` keeps AMX out (A/B runs).
pub fn path() -> Bf16Path {
    static PATH: std::sync::OnceLock<Bf16Path> = std::sync::OnceLock::new();
    *PATH.get_or_init(|| {
        if !available() {
            return Bf16Path::Portable;
        }
        if std::env::var("DSPARK_TRAIN_MATMUL").map_or(true, |v| v != "avx512") && amx() {
            return Bf16Path::Amx;
        }
        Bf16Path::Avx512
    })
}

/// AMX-BF16 with the tile state granted, asked once (CPUID traps to a hypervisor).
fn amx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AMX: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AMX.get_or_init(|| simd() && crate::path::amx_with(1 << 22))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        has!("avx512f") && has!("avx512bw") && has!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `x` rounded to bf16, nearest even (the rounding `vcvtne2ps2bf16` does); NaN stays NaN.
#[inline]
pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if b & 0x7fff_ffff > 0x7f80_0000 {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The f32 value of bf16 bits.
#[inline]
pub fn from_bf16(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

#[inline]
fn pair(lo: f32, hi: f32) -> u32 {
    to_bf16(lo) as u32 | (to_bf16(hi) as u32) << 16
}

/// Columns per packed tile of `B`: one 16-lane register of f32 outputs.
const NT: usize = 16;
/// Rows of `A` per micro-kernel call (8 rows × 2 tiles = 16 accumulator registers).
const MR: usize = 8;
/// bf16 pairs along k per cache block: a micro-kernel's two tiles of `B` are 32 KiB, and a
/// task's `B` block stays in L2 while every row of `A` passes over it.
const KC: usize = 256;
/// Columns per task.
const NC: usize = 128;

/// `A`'s rows as bf16 pairs along k (element 2p in the low half): `kp` words of each row at a
/// stride of `ld ≥ kp` words, in `rows ≥ m` rows (the padding zero: whole AMX tiles).
fn pack_a(a: Mat, kp: usize, ld: usize, rows: usize) -> Vec<u32> {
    let (m, k) = (a.rows, a.cols);
    let mut out = vec![0u32; rows * ld];
    #[cfg(target_arch = "x86_64")]
    if simd() {
        if a.transposed {
            // Row i's pair p is (data[2p·m + i], data[(2p+1)·m + i]): 16 rows at a time from
            // two contiguous runs, written down a column of the packed rows.
            let out_ptr = OutPtr(out.as_mut_ptr() as *mut f32);
            (0..m.div_ceil(NT)).into_par_iter().for_each(|blk| {
                let (i0, out) = (blk * NT, &out_ptr);
                let lanes = NT.min(m - i0);
                let mut pairs = [0u32; NT];
                for p in 0..kp {
                    let lo = &a.data[2 * p * m + i0..][..lanes];
                    let hi =
                        if 2 * p + 1 < k { Some(&a.data[(2 * p + 1) * m + i0..][..lanes]) } else { None };
                    // SAFETY: AVX-512-BF16 was detected (`simd`).
                    unsafe { x86::interleave(lo, hi, &mut pairs) };
                    for (l, &w) in pairs[..lanes].iter().enumerate() {
                        // SAFETY: rows i0..i0+lanes are this task's; p < kp ≤ ld.
                        unsafe { *(out.0 as *mut u32).add((i0 + l) * ld + p) = w };
                    }
                }
            });
        } else {
            out.par_chunks_mut(ld.max(1)).take(m).enumerate().for_each(|(i, row)| {
                // SAFETY: AVX-512-BF16 was detected (`simd`).
                unsafe { x86::convert(&a.data[i * k..(i + 1) * k], &mut row[..kp]) }
            });
        }
        return out;
    }
    pack_a_portable(a, kp, ld, &mut out);
    out
}

fn pack_a_portable(a: Mat, kp: usize, ld: usize, out: &mut [u32]) {
    let k = a.cols;
    out.par_chunks_mut(ld.max(1)).take(a.rows).enumerate().for_each(|(i, row)| {
        for (p, w) in row[..kp].iter_mut().enumerate() {
            let hi = if 2 * p + 1 < k { a.at(i, 2 * p + 1) } else { 0.0 };
            *w = pair(a.at(i, 2 * p), hi);
        }
    });
}

/// `B` in tiles of 16 columns: per tile and pair p, 16 words (one per column) holding
/// `B[2p][j]` and `B[2p+1][j]`; columns past `n` are zero. Tiles are `ld ≥ kp` pairs apart and
/// there are `tiles ≥ ⌈n / 16⌉` of them (the padding zero: whole AMX tiles).
fn pack_b(b: Mat, kp: usize, ld: usize, tiles: usize) -> Vec<u32> {
    let (k, n) = (b.rows, b.cols);
    let mut out = vec![0u32; tiles * ld * NT];
    #[cfg(target_arch = "x86_64")]
    if simd() {
        out.par_chunks_mut((ld * NT).max(1)).take(n.div_ceil(NT)).enumerate().for_each(|(t, tile)| {
            let j0 = t * NT;
            let lanes = NT.min(n - j0);
            if b.transposed {
                // Column j's pairs are a contiguous run of storage row j.
                let mut row = vec![0u32; kp];
                for l in 0..lanes {
                    // SAFETY: AVX-512-BF16 was detected (`simd`).
                    unsafe { x86::convert(&b.data[(j0 + l) * k..(j0 + l + 1) * k], &mut row) };
                    for (p, &w) in row.iter().enumerate() {
                        tile[p * NT + l] = w;
                    }
                }
            } else {
                for p in 0..kp {
                    let lo = &b.data[2 * p * n + j0..][..lanes];
                    let hi =
                        if 2 * p + 1 < k { Some(&b.data[(2 * p + 1) * n + j0..][..lanes]) } else { None };
                    let dst: &mut [u32; NT] = (&mut tile[p * NT..(p + 1) * NT]).try_into().expect("16 words");
                    // SAFETY: AVX-512-BF16 was detected (`simd`).
                    unsafe { x86::interleave(lo, hi, dst) };
                }
            }
        });
        return out;
    }
    pack_b_portable(b, kp, ld, &mut out);
    out
}

fn pack_b_portable(b: Mat, kp: usize, ld: usize, out: &mut [u32]) {
    let (k, n) = (b.rows, b.cols);
    out.par_chunks_mut((ld * NT).max(1)).take(n.div_ceil(NT)).enumerate().for_each(|(t, tile)| {
        for p in 0..kp {
            for l in 0..NT {
                let j = t * NT + l;
                if j < n {
                    let hi = if 2 * p + 1 < k { b.at(2 * p + 1, j) } else { 0.0 };
                    tile[p * NT + l] = pair(b.at(2 * p, j), hi);
                }
            }
        }
    });
}

/// Conversions with `vcvtne2ps2bf16` (nearest even, as [`to_bf16`], but subnormals flushed).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// A contiguous run of values as bf16 pairs: `out[p]` holds `x[2p]` (low) and `x[2p+1]`;
    /// a missing last value is zero.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn convert(x: &[f32], out: &mut [u32]) {
        assert_eq!(out.len(), x.len().div_ceil(2), "one word per pair");
        let mut i = 0;
        while i < x.len() {
            let left = x.len() - i;
            let lo = _mm512_maskz_loadu_ps(mask(left), x.as_ptr().add(i));
            let hi = if left > 16 {
                _mm512_maskz_loadu_ps(mask(left - 16), x.as_ptr().add(i + 16))
            } else {
                _mm512_setzero_ps()
            };
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_mask_storeu_epi32(out.as_mut_ptr().add(i / 2) as *mut _, mask(left.div_ceil(2)), v);
            i += 32;
        }
    }

    /// Up to 16 lanes of pairs `(lo[l], hi[l])` (`hi` absent: zeros) into `out[l]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn interleave(lo: &[f32], hi: Option<&[f32]>, out: &mut [u32; 16]) {
        let m = mask(lo.len());
        let l = _mm512_maskz_loadu_ps(m, lo.as_ptr());
        let h = match hi {
            Some(h) => _mm512_maskz_loadu_ps(m, h.as_ptr()),
            None => _mm512_setzero_ps(),
        };
        // Words 0–15 are lo's, 16–31 hi's; pick them alternately.
        let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(h, l));
        let idx = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
            18, 2, 17, 1, 16, 0,
        );
        _mm512_storeu_si512(out.as_mut_ptr() as *mut _, _mm512_permutexvar_epi16(idx, v));
    }

    fn mask(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }
}

struct OutPtr(*mut f32);
// Tasks write disjoint blocks of the output.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `C = A · B` (`m × k` times `k × n`, `C` row-major `m × n`) from bf16-rounded operands with
/// f32 sums, on this process's [`path`].
pub fn matmul(a: Mat, b: Mat) -> Vec<f32> {
    matmul_on(path(), a, b)
}

/// [`matmul`] on a given path (tests compare paths); one this CPU lacks runs [`reference`].
pub fn matmul_on(p: Bf16Path, a: Mat, b: Mat) -> Vec<f32> {
    assert_eq!(a.cols, b.rows, "inner dimensions");
    #[cfg(not(target_arch = "x86_64"))]
    return reference(a, b);
    #[cfg(target_arch = "x86_64")]
    {
        let usable = match p {
            Bf16Path::Amx => amx(),
            Bf16Path::Avx512 => simd(),
            Bf16Path::Portable => false,
        };
        if !usable {
            return reference(a, b);
        }
        let (m, k, n) = (a.rows, a.cols, b.cols);
        let kp = k.div_ceil(2);
        if m == 0 || n == 0 || k == 0 {
            return vec![0f32; m * n];
        }
        if p == Bf16Path::Amx {
            let (kq, mq, tq) = amx::padded(m, kp, n);
            let (ap, bp) = rayon::join(|| pack_a(a, kp, kq, mq), || pack_b(b, kp, kq, tq));
            // Every element is written by a tile store: zeroing C first (tens of MB a product)
            // was a tenth of a SmolLM2 training step in `memset`.
            let mut c: Vec<std::mem::MaybeUninit<f32>> = Vec::with_capacity(m * n);
            // SAFETY: MaybeUninit elements need no initialisation.
            unsafe { c.set_len(m * n) };
            amx::matmul(&ap, &bp, m, kq, n, c.as_mut_ptr() as *mut f32);
            let mut c = std::mem::ManuallyDrop::new(c);
            // SAFETY: `amx::matmul` wrote every (row < m, column < n) element; same allocation,
            // length and capacity, and f32 has MaybeUninit<f32>'s layout.
            return unsafe { Vec::from_raw_parts(c.as_mut_ptr() as *mut f32, c.len(), c.capacity()) };
        }
        let mut c = vec![0f32; m * n];
        let (ap, bp) = rayon::join(|| pack_a(a, kp, kp, m), || pack_b(b, kp, kp, n.div_ceil(NT)));
        let col_tasks = n.div_ceil(NC);
        // At least 8 tasks so that two threads balance, rows split in multiples of MR.
        let row_tasks = 8usize.div_ceil(col_tasks).min(m.div_ceil(MR));
        let mc = m.div_ceil(row_tasks).div_ceil(MR) * MR;
        let out = OutPtr(c.as_mut_ptr());
        (0..col_tasks * m.div_ceil(mc)).into_par_iter().for_each(|task| {
            let (j0, i0) = ((task % col_tasks) * NC, (task / col_tasks) * mc);
            let (j1, i1) = ((j0 + NC).min(n), (i0 + mc).min(m));
            let out = &out;
            // SAFETY: `simd()` checked the instructions; the packed operands cover every row,
            // pair and tile the block reads; the task writes only its own block of C.
            unsafe { block(&ap, &bp, kp, n, i0..i1, j0..j1, out.0) };
        });
        c
    }
}

/// AMX-BF16: `C` in blocks of 32 × 32 (four 16 × 16 f32 tiles held across the whole of k),
/// from A's rows and B's column tiles packed as [`pack_a`] and [`pack_b`] make them — already
/// the tiles' layouts (a row of an A tile is 16 pairs of one row; a row of a B tile is one pair
/// of 16 columns) — padded with zeros to whole tiles.
#[cfg(target_arch = "x86_64")]
mod amx {
    use super::{OutPtr, NT};
    use rayon::prelude::*;
    use std::arch::asm;

    /// Rows, and pairs along k, per tile.
    const T: usize = 16;
    /// Column pairs (of 32 columns) per task: the task's 32 rows of A are read from L2 once per
    /// pair.
    const PAIRS: usize = 4;

    #[repr(C, align(64))]
    struct Tile([f32; T * T]);

    /// Pairs along k, rows of A and column tiles of B, padded to whole tiles (rows and column
    /// tiles to pairs of tiles: the 32 × 32 blocks).
    pub fn padded(m: usize, kp: usize, n: usize) -> (usize, usize, usize) {
        (kp.div_ceil(T) * T, m.div_ceil(2 * T) * 2 * T, n.div_ceil(NT).div_ceil(2) * 2)
    }

    /// `C` from `a` (`mq × kq` words) and `b` (`tq` tiles of `kq × 16` words) packed to
    /// [`padded`]'s sizes.
    /// Writes every element of the row-major `m × n` output at `c`.
    pub fn matmul(a: &[u32], b: &[u32], m: usize, kq: usize, n: usize, c: *mut f32) {
        let (mq, tq) = (a.len() / kq, b.len() / (kq * NT));
        let (row_blocks, col_groups) = (mq / (2 * T), (tq / 2).div_ceil(PAIRS));
        let out = OutPtr(c);
        (0..row_blocks * col_groups).into_par_iter().for_each(|task| {
            let (rb, cg) = (task / col_groups, task % col_groups);
            let out = &out;
            // SAFETY: the caller's path check found AMX-BF16 with the tile state granted; the
            // padded operands cover every tile read; the task writes only its own rows and
            // columns of C, below m and n.
            unsafe {
                block(a, b, kq, m, n, rb * 2 * T, cg * PAIRS * 2..((cg + 1) * PAIRS * 2).min(tq), out.0)
            };
        });
    }

    /// Rows `r0..r0 + 32` by column tiles `tiles` (an even count) of C.
    #[allow(clippy::too_many_arguments)]
    unsafe fn block(
        a: &[u32],
        b: &[u32],
        kq: usize,
        m: usize,
        n: usize,
        r0: usize,
        tiles: std::ops::Range<usize>,
        c: *mut f32,
    ) {
        let mut cfg = crate::x86::TileShapes::default();
        for t in 0..8 {
            cfg.set(t, T, 64);
        }
        cfg.load();
        let lda = kq * 4;
        let mut buf = Tile([0.0; T * T]);
        for t0 in tiles.step_by(2) {
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
            let a0 = a.as_ptr().add(r0 * kq);
            let a1 = a.as_ptr().add((r0 + T) * kq);
            let b0 = b.as_ptr().add(t0 * kq * NT);
            let b1 = b.as_ptr().add((t0 + 1) * kq * NT);
            for p in (0..kq).step_by(T) {
                asm!(
                    "tileloadd tmm4, [{a0} + {lda}*1]",
                    "tileloadd tmm5, [{a1} + {lda}*1]",
                    "tileloadd tmm6, [{b0} + {ldb}*1]",
                    "tileloadd tmm7, [{b1} + {ldb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a0.add(p),
                    a1 = in(reg) a1.add(p),
                    b0 = in(reg) b0.add(p * NT),
                    b1 = in(reg) b1.add(p * NT),
                    lda = in(reg) lda,
                    ldb = in(reg) 64usize,
                    options(nostack, readonly),
                );
            }
            for (q, (dr, dt)) in [(0, 0), (0, 1), (1, 0), (1, 1)].into_iter().enumerate() {
                let bp = buf.0.as_mut_ptr();
                match q {
                    0 => {
                        asm!("tilestored [{0} + {1}*1], tmm0", in(reg) bp, in(reg) 64usize, options(nostack))
                    }
                    1 => {
                        asm!("tilestored [{0} + {1}*1], tmm1", in(reg) bp, in(reg) 64usize, options(nostack))
                    }
                    2 => {
                        asm!("tilestored [{0} + {1}*1], tmm2", in(reg) bp, in(reg) 64usize, options(nostack))
                    }
                    _ => {
                        asm!("tilestored [{0} + {1}*1], tmm3", in(reg) bp, in(reg) 64usize, options(nostack))
                    }
                }
                let (i0, j0) = (r0 + dr * T, (t0 + dt) * NT);
                if i0 >= m || j0 >= n {
                    continue;
                }
                let w = (n - j0).min(NT);
                for r in 0..(m - i0).min(T) {
                    std::ptr::copy_nonoverlapping(buf.0.as_ptr().add(r * T), c.add((i0 + r) * n + j0), w);
                }
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    }
}

/// One task's block of `C`: rows `rows`, columns `cols` (a multiple of 32 wide but the last).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn block(
    ap: &[u32],
    bp: &[u32],
    kp: usize,
    n: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    c: *mut f32,
) {
    for p0 in (0..kp).step_by(KC) {
        let plen = KC.min(kp - p0);
        for i in rows.clone().step_by(MR) {
            let r = MR.min(rows.end - i);
            for j in cols.clone().step_by(2 * NT) {
                let w = (2 * NT).min(cols.end - j);
                let a = ap.as_ptr().add(i * kp + p0);
                let b = bp.as_ptr().add(((j / NT) * kp + p0) * NT);
                let cp = c.add(i * n + j);
                macro_rules! go {
                    ($($r:literal)*) => {
                        match (r, w > NT) {
                            $(($r, true) => micro::<$r, 2>(a, kp, b, kp * NT, plen, cp, n, w, p0 > 0),
                              ($r, false) => micro::<$r, 1>(a, kp, b, kp * NT, plen, cp, n, w, p0 > 0),)*
                            _ => unreachable!("1 ≤ rows ≤ MR"),
                        }
                    };
                }
                go!(1 2 3 4 5 6 7 8);
            }
        }
    }
}

/// `R` rows × `T` tiles of `C` over `plen` pairs: `R·T` accumulators, one `vdpbf16ps` per row,
/// tile and pair, `A`'s pair broadcast from memory. `w` is the number of valid columns (the
/// rest are masked); `load` adds to what `C` holds (later cache blocks of k).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro<const R: usize, const T: usize>(
    a: *const u32,
    lda: usize,
    b: *const u32,
    ldb: usize,
    plen: usize,
    c: *mut f32,
    ldc: usize,
    w: usize,
    load: bool,
) {
    use std::arch::x86_64::*;
    let mask = |t: usize| -> __mmask16 {
        let v = w.saturating_sub(t * NT).min(NT);
        ((1u32 << v) - 1) as __mmask16
    };
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    if load {
        for (r, row) in acc.iter_mut().enumerate() {
            for (t, x) in row.iter_mut().enumerate() {
                *x = _mm512_maskz_loadu_ps(mask(t), c.add(r * ldc + t * NT));
            }
        }
    }
    for p in 0..plen {
        let mut bv = [_mm512_setzero_si512(); T];
        for (t, v) in bv.iter_mut().enumerate() {
            *v = _mm512_loadu_si512(b.add(t * ldb + p * NT) as *const _);
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(r * lda + p) as i32));
            for (t, x) in row.iter_mut().enumerate() {
                *x = _mm512_dpbf16_ps(*x, av, std::mem::transmute::<__m512i, __m512bh>(bv[t]));
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (t, x) in row.iter().enumerate() {
            _mm512_mask_storeu_ps(c.add(r * ldc + t * NT), mask(t), *x);
        }
    }
}

/// The portable definition: `C[i][j] = Σ_r bf16(A[i][r]) · bf16(B[r][j])`, each product and
/// sum in f32, pairs along k in order. The SIMD path sums in the same pairs but in its own
/// association (and flushes subnormals), so the two agree to f32 rounding, not bit for bit.
pub fn reference(a: Mat, b: Mat) -> Vec<f32> {
    assert_eq!(a.cols, b.rows, "inner dimensions");
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let mut c = vec![0f32; m * n];
    c.par_chunks_mut(n.max(1)).enumerate().for_each(|(i, row)| {
        for (j, y) in row.iter_mut().enumerate() {
            let mut s = 0f32;
            for r in 0..k {
                s += from_bf16(to_bf16(a.at(i, r))) * from_bf16(to_bf16(b.at(r, j)));
            }
            *y = s;
        }
    });
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    #[test]
    fn rounding_is_nearest_even_and_keeps_nan() {
        // 1 + 2⁻⁸ lies halfway between two bf16 values: the even one (1.0) wins.
        assert_eq!(from_bf16(to_bf16(1.0 + 1.0 / 256.0)), 1.0);
        // 1 + 3·2⁻⁸ lies halfway: the even neighbour is 1 + 2⁻⁶.
        assert_eq!(from_bf16(to_bf16(1.0 + 3.0 / 256.0)), 1.0 + 1.0 / 64.0);
        assert_eq!(from_bf16(to_bf16(-2.5)), -2.5);
        assert!(from_bf16(to_bf16(f32::NAN)).is_nan());
        assert_eq!(from_bf16(to_bf16(f32::INFINITY)), f32::INFINITY);
        // The largest finite f32 rounds up to infinity, as the hardware does.
        assert_eq!(from_bf16(to_bf16(f32::MAX)), f32::INFINITY);
    }

    /// Every layout the backward pass uses, with edges: odd k, n not a multiple of a tile or of
    /// two, m not a multiple of the row block, and k over one cache block.
    #[test]
    fn products_match_the_portable_definition_in_every_layout() {
        if !simd() {
            eprintln!("skipped: this CPU has no AVX-512-BF16 (the portable path is the definition)");
            return;
        }
        let amx = amx();
        if !amx {
            eprintln!("skipped the AMX-BF16 path: this CPU lacks it");
        }
        let paths = if amx { vec![Bf16Path::Avx512, Bf16Path::Amx] } else { vec![Bf16Path::Avx512] };
        let shapes =
            [(1, 1, 1), (9, 7, 17), (8, 64, 32), (13, 515, 47), (37, 1030, 100), (64, 33, 200), (33, 40, 49)];
        for &(m, k, n) in &shapes {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                let (da, db) = (random(m * k, 1 + m as u64), random(k * n, 2 + n as u64));
                let a = if ta { Mat::new(&da, k, m).t() } else { Mat::new(&da, m, k) };
                let b = if tb { Mat::new(&db, n, k).t() } else { Mat::new(&db, k, n) };
                let want = reference(a, b);
                for &p in &paths {
                    let got = matmul_on(p, a, b);
                    assert_eq!(got.len(), want.len());
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        // Sums of k terms below 1 in magnitude: association changes at most a
                        // few ulps of the partial sums.
                        assert!(
                            (g - w).abs() <= 1e-5 * (k as f32).sqrt().max(1.0) * 4.0,
                            "{} m {m} k {k} n {n} transposed ({ta}, {tb}) element {i}: {g} vs {w}",
                            p.name()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn simd_packing_is_the_portable_packing() {
        if !simd() {
            eprintln!("skipped: this CPU has no AVX-512-BF16");
            return;
        }
        for &(r, c) in &[(1, 1), (3, 5), (16, 32), (17, 33), (40, 70)] {
            let d = random(r * c, 7 + r as u64);
            for m in [Mat::new(&d, r, c), Mat::new(&d, c, r).t()] {
                let kp = m.cols.div_ceil(2);
                let mut want = vec![0u32; m.rows * kp];
                pack_a_portable(m, kp, kp, &mut want);
                assert_eq!(pack_a(m, kp, kp, m.rows), want, "A {r}×{c} transposed {}", m.transposed);
                // AMX's padded layout: longer rows and more of them, the padding zero.
                let (ld, rows) = (kp + 5, m.rows + 3);
                let mut want = vec![0u32; rows * ld];
                pack_a_portable(m, kp, ld, &mut want);
                assert_eq!(pack_a(m, kp, ld, rows), want, "padded A {r}×{c} transposed {}", m.transposed);
                let kp = m.rows.div_ceil(2);
                let mut want = vec![0u32; m.cols.div_ceil(NT) * kp * NT];
                pack_b_portable(m, kp, kp, &mut want);
                assert_eq!(
                    pack_b(m, kp, kp, m.cols.div_ceil(NT)),
                    want,
                    "B {r}×{c} transposed {}",
                    m.transposed
                );
                let (ld, tiles) = (kp + 3, m.cols.div_ceil(NT) + 2);
                let mut want = vec![0u32; tiles * ld * NT];
                pack_b_portable(m, kp, ld, &mut want);
                assert_eq!(pack_b(m, kp, ld, tiles), want, "padded B {r}×{c} transposed {}", m.transposed);
            }
        }
    }

    #[test]
    fn bf16_products_are_within_bf16_rounding_of_f32_products() {
        let (m, k, n) = (5, 300, 7);
        let (da, db) = (random(m * k, 3), random(k * n, 4));
        let got = matmul(Mat::new(&da, m, k), Mat::new(&db, k, n));
        for i in 0..m {
            for j in 0..n {
                let exact: f64 = (0..k).map(|r| da[i * k + r] as f64 * db[r * n + j] as f64).sum();
                // Each operand is off by at most 2⁻⁹ relative; |terms| < 1, random signs.
                let bound = 2.0 * 2f64.powi(-9) * (k as f64).sqrt() * 3.0;
                assert!((got[i * n + j] as f64 - exact).abs() < bound, "({i}, {j})");
            }
        }
    }
}
