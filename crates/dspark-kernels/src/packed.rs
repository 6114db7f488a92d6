//! GGUF weights repacked once at load time into the layout every kernel path reads: rows of
//! 256-value groups (one K-quant super-block, or eight 32-value blocks of the legacy formats;
//! rows are padded to whole groups). A group's values are ordered for a 16-lane integer dot
//! product: lane `l` owns the 16 values of half-block `l` (values `16l..16l + 16`), and the
//! group is four 64-byte vectors `W_m` where bytes `4l..4l + 4` of `W_m` are values
//! `16l + 4m..16l + 4m + 4`. One `vpdpbusd` per `W_m` then leaves in lane `l` a partial dot
//! of half-block `l` — exactly the granularity of every format's scales (Q6_K scales 16 values,
//! the others 32 = two lanes) — so scales apply lane-wise with no shuffles.
//!
//! Integers are stored unsigned (`u = q + bias`): 4-bit formats as nibbles (64 bytes hold `W_0`
//! in the low and `W_1` in the high nibbles, the next 64 `W_2`/`W_3`), Q5's fifth bit as one
//! 64-bit mask per `W_m`, Q6_K's two high bits as one byte per lane byte (bits `2m..2m + 2` for
//! `W_m`), Q8_0 as `q + 128` bytes.

use crate::format::{decode_block, QuantFormat, QK};
use half::f16;

/// Values per group.
pub const GROUP: usize = 256;

/// Where value `v` (0..256) of a group sits: vector `m` and byte `x` within it.
#[inline]
pub fn lane_pos(v: usize) -> (usize, usize) {
    let (l, m, i) = (v / 16, (v % 16) / 4, v % 4);
    (m, 4 * l + i)
}

/// How a group's scales are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleKind {
    /// One f16 scale (and offset) per 32-value block.
    F16,
    /// Q4_K: per group f32 `d`, `dmin`; per block 6-bit `sc`, `mn`: weight = d·sc·q − dmin·mn.
    K4,
    /// Q6_K: per group f32 `d`; per 16 values (lane) an i8 scale.
    K6,
}

pub struct PackedMatrix {
    pub format: QuantFormat,
    pub n: usize,
    pub k: usize,
    /// Real and padded 32-value blocks per row (padded to whole groups).
    pub nb: usize,
    pub nbp: usize,
    pub scales: ScaleKind,
    /// Per group: 128 bytes of nibbles, or 256 bytes (Q8_0).
    pub qs: WeightBuf,
    /// Per group, the bits above the nibble: Q5, four u64 masks (32 bytes); Q6_K, 64 bytes.
    pub qh: WeightBuf,
    /// `F16`: per block `d` (and `m`) as f16 bits.
    pub d16: Vec<u16>,
    pub m16: Vec<u16>,
    /// `K4`/`K6`: per group `d` and (K4) `dmin`.
    pub gd: Vec<f32>,
    pub gmin: Vec<f32>,
    /// `K4`: per block scale and min (8 per group). `K6`: per lane scale as i8 bits (16 per group).
    pub sc: Vec<u8>,
    pub mn: Vec<u8>,
}

/// Zeroed bytes, aligned to 2 MiB when large, with the kernel asked to back them with huge pages.
/// Decoding streams every weight once per token; with 4 KiB pages that is a TLB miss every 64
/// cache lines and a stop for the hardware prefetcher at every page boundary.
pub struct WeightBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    layout: std::alloc::Layout,
}

// SAFETY: a uniquely owned heap buffer of plain bytes.
unsafe impl Send for WeightBuf {}
unsafe impl Sync for WeightBuf {}

/// Whether new large weight buffers ask for huge pages (benchmarks switch it off to compare).
#[doc(hidden)]
pub static HUGE_PAGES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

impl WeightBuf {
    const HUGE: usize = 2 << 20;

    pub fn zeroed(len: usize) -> Self {
        let huge = len >= Self::HUGE / 2 && HUGE_PAGES.load(std::sync::atomic::Ordering::Relaxed);
        let (size, align) =
            if huge { (len.next_multiple_of(Self::HUGE), Self::HUGE) } else { (len.max(1), 64) };
        let layout = std::alloc::Layout::from_size_align(size, align).expect("weight buffer layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = std::ptr::NonNull::new(raw) else { std::alloc::handle_alloc_error(layout) };
        #[cfg(target_os = "linux")]
        if huge {
            // Advice first, zeroing after: pages appear on first write, so they come huge.
            // Best effort: a refusal leaves 4 KiB pages.
            // SAFETY: the range is exactly this allocation; the advice changes no contents.
            unsafe { libc::madvise(raw as *mut libc::c_void, size, libc::MADV_HUGEPAGE) };
        }
        // SAFETY: `raw` points to `size` writable bytes.
        unsafe { raw.write_bytes(0, size) };
        Self { ptr, len, layout }
    }

    pub fn from_slice(v: &[u8]) -> Self {
        let mut b = Self::zeroed(v.len());
        b.copy_from_slice(v);
        b
    }
}

impl Drop for WeightBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl std::ops::Deref for WeightBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes live at `ptr` for as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for WeightBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

fn f16_bits(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

fn f32_of(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// Q4_K's packed 6-bit scale and min of sub-block `j`.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

impl PackedMatrix {
    /// Bytes of `qs` and `qh` per group.
    pub fn group_bytes(format: QuantFormat) -> (usize, usize) {
        match format {
            QuantFormat::Q8_0 => (256, 0),
            QuantFormat::Q5_0 | QuantFormat::Q5_1 => (128, 32),
            QuantFormat::Q6K => (128, 64),
            _ => (128, 0),
        }
    }

    fn empty(format: QuantFormat, n: usize, k: usize) -> Self {
        assert_eq!(k % QK, 0);
        let nb = k / QK;
        let nbp = nb.div_ceil(8) * 8;
        let scales = match format {
            QuantFormat::Q4K => ScaleKind::K4,
            QuantFormat::Q6K => ScaleKind::K6,
            _ => ScaleKind::F16,
        };
        let blocks = n * nbp;
        let groups = blocks / 8;
        let (qsb, qhb) = Self::group_bytes(format);
        let k_quant = scales != ScaleKind::F16;
        Self {
            format,
            n,
            k,
            nb,
            nbp,
            scales,
            qs: WeightBuf::zeroed(groups * qsb),
            qh: WeightBuf::zeroed(groups * qhb),
            d16: if k_quant { Vec::new() } else { vec![0; blocks] },
            m16: if format.has_min() && !k_quant { vec![0; blocks] } else { Vec::new() },
            gd: if k_quant { vec![0.0; groups] } else { Vec::new() },
            gmin: if scales == ScaleKind::K4 { vec![0.0; groups] } else { Vec::new() },
            sc: match scales {
                ScaleKind::K4 => vec![0; blocks],
                ScaleKind::K6 => vec![0; groups * 16],
                ScaleKind::F16 => Vec::new(),
            },
            mn: if scales == ScaleKind::K4 { vec![0; blocks] } else { Vec::new() },
        }
    }

    /// Groups per row.
    pub fn groups(&self) -> usize {
        self.nbp / 8
    }

    /// The matrix made of rows `ids` (e.g. an LM head restricted to a draft vocabulary).
    pub fn select_rows(&self, ids: &[usize]) -> Self {
        fn pick<T: Copy>(v: &[T], n: usize, ids: &[usize]) -> Vec<T> {
            if v.is_empty() {
                return Vec::new();
            }
            // Every array is row-major with the same number of entries per row.
            let per = v.len() / n;
            let mut out = Vec::with_capacity(per * ids.len());
            for &i in ids {
                out.extend_from_slice(&v[i * per..(i + 1) * per]);
            }
            out
        }
        assert!(ids.iter().all(|&i| i < self.n), "row index out of range");
        let n = self.n;
        Self {
            format: self.format,
            n: ids.len(),
            k: self.k,
            nb: self.nb,
            nbp: self.nbp,
            scales: self.scales,
            qs: WeightBuf::from_slice(&pick(&self.qs, n, ids)),
            qh: WeightBuf::from_slice(&pick(&self.qh, n, ids)),
            d16: pick(&self.d16, n, ids),
            m16: pick(&self.m16, n, ids),
            gd: pick(&self.gd, n, ids),
            gmin: pick(&self.gmin, n, ids),
            sc: pick(&self.sc, n, ids),
            mn: pick(&self.mn, n, ids),
        }
    }

    /// Repacks `n` rows of `k` values of GGUF data.
    pub fn from_gguf(format: QuantFormat, data: &[u8], n: usize, k: usize) -> Self {
        let mut p = Self::empty(format, n, k);
        let (nb, nbp) = (p.nb, p.nbp);
        let mut u = [0u8; GROUP];
        match format {
            QuantFormat::Q4K | QuantFormat::Q6K => {
                assert_eq!(k % 256, 0, "K-quant rows are whole 256-value super-blocks");
                let sbb = format.block_bytes();
                assert_eq!(data.len(), n * k / 256 * sbb, "weight bytes do not match n × k");
                // nbp == nb for K-quants: super-block s is group s.
                for (g, sb) in data.chunks_exact(sbb).enumerate() {
                    if format == QuantFormat::Q4K {
                        p.unpack_q4k(g, sb, &mut u);
                    } else {
                        p.unpack_q6k(g, sb, &mut u);
                    }
                    p.put_group(g, &u);
                }
            }
            _ => {
                let bb = format.block_bytes();
                assert_eq!(data.len(), n * nb * bb, "weight bytes do not match n × k");
                let bias = p.bias();
                let mut q = [0i32; QK];
                for row in 0..n {
                    for g in 0..nbp / 8 {
                        u.fill(0);
                        for j in 0..8 {
                            let b = g * 8 + j;
                            if b >= nb {
                                break; // padding: zero scales, any integers
                            }
                            let blk = &data[(row * nb + b) * bb..][..bb];
                            let i = row * nbp + b;
                            p.d16[i] = f16_bits(blk, 0);
                            if format.has_min() {
                                p.m16[i] = f16_bits(blk, 2);
                            }
                            decode_block(format, blk, &mut q);
                            for (x, &qi) in u[j * QK..(j + 1) * QK].iter_mut().zip(&q) {
                                *x = (qi + bias) as u8;
                            }
                        }
                        p.put_group(row * (nbp / 8) + g, &u);
                    }
                }
            }
        }
        p
    }

    /// Stores the 256 unsigned integers of global group `gi` in the lane layout.
    fn put_group(&mut self, gi: usize, u: &[u8; GROUP]) {
        let (qsb, qhb) = Self::group_bytes(self.format);
        let qs = &mut self.qs[gi * qsb..(gi + 1) * qsb];
        let qh = &mut self.qh[gi * qhb..(gi + 1) * qhb];
        // Value 16l + 4m + i goes to byte 4l + i of vector m (see `lane_pos`).
        for l in 0..16 {
            for m in 0..4 {
                let src = &u[16 * l + 4 * m..][..4];
                let byte = 4 * l;
                match self.format {
                    QuantFormat::Q8_0 => qs[m * 64 + byte..][..4].copy_from_slice(src),
                    _ => {
                        for (i, &x) in src.iter().enumerate() {
                            qs[(m / 2) * 64 + byte + i] |= (x & 0x0F) << (4 * (m % 2));
                        }
                    }
                }
                match self.format {
                    QuantFormat::Q5_0 | QuantFormat::Q5_1 => {
                        let bits = src.iter().enumerate().fold(0u8, |b, (i, &x)| b | (((x >> 4) & 1) << i));
                        qh[m * 8 + byte / 8] |= bits << (byte % 8);
                    }
                    QuantFormat::Q6K => {
                        for (i, &x) in src.iter().enumerate() {
                            qh[byte + i] |= ((x >> 4) & 3) << (2 * m);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// The unsigned integer of value `v` of global group `gi`.
    pub fn value(&self, gi: usize, v: usize) -> u8 {
        let (qsb, qhb) = Self::group_bytes(self.format);
        let (m, byte) = lane_pos(v);
        let qs = &self.qs[gi * qsb..];
        if self.format == QuantFormat::Q8_0 {
            return qs[m * 64 + byte];
        }
        let lo = (qs[(m / 2) * 64 + byte] >> (4 * (m % 2))) & 0x0F;
        let qh = &self.qh[gi * qhb..];
        match self.format {
            QuantFormat::Q5_0 | QuantFormat::Q5_1 => lo | (((qh[m * 8 + byte / 8] >> (byte % 8)) & 1) << 4),
            QuantFormat::Q6K => lo | (((qh[byte] >> (2 * m)) & 3) << 4),
            _ => lo,
        }
    }

    fn unpack_q4k(&mut self, g: usize, sb: &[u8], u: &mut [u8; GROUP]) {
        // d, dmin, scales[12], qs[128]; sub-block j: low (j even) or high (j odd) nibbles of
        // qs[32·(j/2) ..][..32].
        self.gd[g] = f32_of(f16_bits(sb, 0));
        self.gmin[g] = f32_of(f16_bits(sb, 2));
        let (scales, qs) = (&sb[4..16], &sb[16..144]);
        for j in 0..8 {
            let (sc, mn) = scale_min_k4(j, scales);
            self.sc[g * 8 + j] = sc;
            self.mn[g * 8 + j] = mn;
            for (l, &b) in qs[32 * (j / 2)..][..32].iter().enumerate() {
                u[j * 32 + l] = if j % 2 == 0 { b & 0x0F } else { b >> 4 };
            }
        }
    }

    fn unpack_q6k(&mut self, g: usize, sb: &[u8], u: &mut [u8; GROUP]) {
        // ql[128], qh[64], scales[16], d: value e, 128-chunk c, quarter t = (e % 128) / 32,
        // lane l = e % 32 has its low 4 bits in ql[64c + 32·(t % 2) + l] (low nibble for t < 2,
        // high otherwise) and its 2 high bits in qh[32c + l] at bit 2t. Scales: e / 16.
        let (ql, qh) = (&sb[..128], &sb[128..192]);
        for (e, x) in u.iter_mut().enumerate() {
            let (c, t, l) = (e / 128, (e % 128) / 32, e % 32);
            let lo = (ql[64 * c + 32 * (t % 2) + l] >> (4 * (t / 2))) & 0x0F;
            let hi = (qh[32 * c + l] >> (2 * t)) & 3;
            *x = lo | (hi << 4);
        }
        self.gd[g] = f32_of(f16_bits(sb, 208));
        self.sc[g * 16..(g + 1) * 16].copy_from_slice(&sb[192..208]);
    }

    /// The signed integers of block `b` of `row` and the scales of its low and high halves and
    /// its offset: value l = d_lo·q[l] + m for l < 16, d_hi·q[l] + m otherwise.
    pub fn block(&self, row: usize, b: usize, q: &mut [i32; QK]) -> (f32, f32, f32) {
        let i = row * self.nbp + b;
        let (gi, j) = (i / 8, i % 8);
        let bias = self.bias();
        for (l, qi) in q.iter_mut().enumerate() {
            *qi = self.value(gi, j * QK + l) as i32 - bias;
        }
        match self.scales {
            ScaleKind::F16 => {
                let d = f32_of(self.d16[i]);
                let m = if self.m16.is_empty() { 0.0 } else { f32_of(self.m16[i]) };
                (d, d, m)
            }
            ScaleKind::K4 => {
                let d = self.gd[gi] * self.sc[i] as f32;
                (d, d, -self.gmin[gi] * self.mn[i] as f32)
            }
            ScaleKind::K6 => {
                let s = &self.sc[gi * 16..];
                (self.gd[gi] * s[2 * j] as i8 as f32, self.gd[gi] * s[2 * j + 1] as i8 as f32, 0.0)
            }
        }
    }

    /// What is subtracted from the stored unsigned integers to get the signed ones.
    pub fn bias(&self) -> i32 {
        self.format.bias()
    }

    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let mut q = [0i32; QK];
        for (b, chunk) in out.chunks_mut(QK).enumerate().take(self.nb) {
            let (dlo, dhi, m) = self.block(row, b, &mut q);
            for (l, (o, &qi)) in chunk.iter_mut().zip(q.iter()).enumerate() {
                *o = if l < 16 { dlo } else { dhi } * qi as f32 + m;
            }
        }
    }
}
