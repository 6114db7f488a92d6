//! GGUF weights repacked once at load time into the layout every kernel path reads: output
//! columns (the weight matrix's rows) in tiles of [`NT`] = 16, each tile a contiguous run of
//! records, one per 256-value group (one K-quant super-block, or eight 32-value blocks of the
//! legacy formats; rows are padded to whole groups and columns to whole tiles, both with zero
//! scales). Within a record every 64-byte vector holds 4 consecutive values of each of the 16
//! columns (bytes `4c..4c + 4` are column `c`'s), so one `vpdpbusd` against 4 activation bytes
//! broadcast to every lane adds a 4-term dot product to 16 columns at once: the lanes are
//! columns, nothing is reduced across lanes, and each group's scales are applied once per
//! column for 256 values (see [`crate::scalar`] for the arithmetic).
//!
//! Record, in order (values `4t..4t + 4` of the group form "chunk" `t`):
//! - integers, unsigned (`u = q + bias`): 4-bit formats as 32 vectors of nibbles, vector `s`
//!   holding chunk `2s` in its low and chunk `2s + 1` in its high nibbles; Q8_0 as 64 vectors
//!   of bytes, one per chunk;
//! - Q5's fifth bits as one 64-bit mask per chunk (bit `4c + i`); Q6_K's two high bits as one
//!   vector per 16 values (half-block `l`, chunks `4l..4l + 4`: bits `2m..2m + 2` of byte
//!   `4c + i` belong to chunk `4l + m`);
//! - scales, column-minor (16 columns side by side): legacy formats `d` (and `m`) as f16 per
//!   block; Q4_K `d` and `−dmin` as f32, the 6-bit scales per block as bytes, and the mins of
//!   each pair of blocks as a pair of i16 per column;
//!   Q6_K `d` as f32, the i8 scale of each half-block, and those scales again as a pair of i16
//!   per column and pair of half-blocks.

use crate::format::{decode_block, QuantFormat, QK};
use half::f16;

/// Values per group.
pub const GROUP: usize = 256;
/// Columns per tile: the lanes of a 512-bit register of f32 or i32.
pub const NT: usize = 16;

/// How a group's scales are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleKind {
    /// One f16 scale (and offset) per 32-value block.
    F16,
    /// Q4_K: per group f32 `d`, `dmin`; per block 6-bit `sc`, `mn`: weight = d·sc·q − dmin·mn.
    K4,
    /// Q6_K: per group f32 `d`; per 16 values (half-block) an i8 scale.
    K6,
}

/// Byte offsets of a record's parts (see the module documentation).
#[derive(Debug, Clone, Copy)]
pub struct Record {
    pub qh: usize,
    /// F16: `d` as f16, 8 blocks × 16 columns. K4/K6: `d` as f32 × 16.
    pub d: usize,
    /// F16 with offset: `m` as f16, 8 × 16. K4: `−dmin` as f32 × 16.
    pub m: usize,
    /// K4: 8 blocks × 16 bytes. K6: 16 half-blocks × 16 bytes (i8).
    pub sc: usize,
    /// K4: the mins of blocks 2i and 2i + 1 as a pair of i16 per column (4 vectors of 16 × 4
    /// bytes), for one `vpdpwssd` per pair of blocks. K6: the scales of half-blocks 2i and
    /// 2i + 1 likewise (8 vectors), for the bias term `Σ sc_l · 32 · hsum_l`.
    pub mn: usize,
    pub size: usize,
}

impl Record {
    pub const fn scales(format: QuantFormat) -> ScaleKind {
        match format {
            QuantFormat::Q4K => ScaleKind::K4,
            QuantFormat::Q6K => ScaleKind::K6,
            _ => ScaleKind::F16,
        }
    }

    pub const fn of(format: QuantFormat) -> Self {
        let qs = if matches!(format, QuantFormat::Q8_0) { 64 * 64 } else { 32 * 64 };
        match format {
            QuantFormat::Q4K => {
                Self { qh: qs, d: qs, m: qs + 64, sc: qs + 128, mn: qs + 256, size: qs + 512 }
            }
            QuantFormat::Q6K => {
                let qh = qs + 16 * 64;
                Self { qh: qs, d: qh, m: qh, sc: qh + 64, mn: qh + 320, size: qh + 320 + 512 }
            }
            _ => {
                let qh = if matches!(format, QuantFormat::Q5_0 | QuantFormat::Q5_1) { 64 * 8 } else { 0 };
                let d = qs + qh;
                let m = if format.has_min() { 256 } else { 0 };
                Self { qh: qs, d, m: d + 256, sc: d + 256 + m, mn: d + 256 + m, size: d + 256 + m }
            }
        }
    }
}

/// One column's share of one group, decoded: the unit repacking reads and writes.
#[derive(Clone)]
pub struct ColumnGroup {
    /// Unsigned integers `u = q + bias`.
    pub u: [u8; GROUP],
    /// F16: per block `d` and `m` as f16 bits.
    pub d16: [u16; 8],
    pub m16: [u16; 8],
    /// K4/K6: `d`; K4: `−dmin`.
    pub d: f32,
    pub nd: f32,
    /// K4: per block scale (8); K6: per half-block scale as i8 bits (16).
    pub sc: [u8; 16],
    /// K4: per block min.
    pub mn: [u8; 8],
}

impl Default for ColumnGroup {
    fn default() -> Self {
        Self { u: [0; GROUP], d16: [0; 8], m16: [0; 8], d: 0.0, nd: 0.0, sc: [0; 16], mn: [0; 8] }
    }
}

pub struct PackedMatrix {
    pub format: QuantFormat,
    pub n: usize,
    pub k: usize,
    /// Real and padded 32-value blocks per row (padded to whole groups).
    pub nb: usize,
    pub nbp: usize,
    pub scales: ScaleKind,
    /// Tiles of [`NT`] columns (the last one padded).
    pub tiles: usize,
    pub rec: Record,
    /// `tiles × groups` records, tile-major.
    pub buf: WeightBuf,
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
    fn empty(format: QuantFormat, n: usize, k: usize) -> Self {
        assert_eq!(k % QK, 0);
        let nb = k / QK;
        let nbp = nb.div_ceil(8) * 8;
        let scales = Record::scales(format);
        let tiles = n.div_ceil(NT);
        let rec = Record::of(format);
        let buf = WeightBuf::zeroed(tiles * (nbp / 8) * rec.size);
        Self { format, n, k, nb, nbp, scales, tiles, rec, buf }
    }

    /// Groups per row.
    pub fn groups(&self) -> usize {
        self.nbp / 8
    }

    /// The record of tile `t`, group `g`.
    #[inline(always)]
    pub fn record(&self, t: usize, g: usize) -> *const u8 {
        debug_assert!(t < self.tiles && g < self.groups());
        // SAFETY (of the pointer's later use): in bounds by the assertion above.
        self.buf.as_ptr().wrapping_add((t * self.groups() + g) * self.rec.size)
    }

    /// What is subtracted from the stored unsigned integers to get the signed ones.
    pub fn bias(&self) -> i32 {
        self.format.bias()
    }

    /// Writes column `col`'s part of group `g`.
    pub fn put(&mut self, col: usize, g: usize, cg: &ColumnGroup) {
        let (t, c) = (col / NT, col % NT);
        let (rec, f) = (self.rec, self.format);
        let off = (t * self.groups() + g) * rec.size;
        put_record(f, rec, &mut self.buf[off..off + rec.size], c, cg);
    }

    /// Reads column `col`'s part of group `g`.
    pub fn get(&self, col: usize, g: usize) -> ColumnGroup {
        let (t, c) = (col / NT, col % NT);
        let (rec, f) = (self.rec, self.format);
        let off = (t * self.groups() + g) * rec.size;
        let r = &self.buf[off..off + rec.size];
        let mut cg = ColumnGroup::default();
        for (v, u) in cg.u.iter_mut().enumerate() {
            let (ch, i) = (v / 4, v % 4);
            let byte = 4 * c + i;
            *u = match f {
                QuantFormat::Q8_0 => r[ch * 64 + byte],
                _ => (r[(ch / 2) * 64 + byte] >> (4 * (ch % 2))) & 0x0F,
            };
            match f {
                QuantFormat::Q5_0 | QuantFormat::Q5_1 => {
                    *u |= ((r[rec.qh + ch * 8 + byte / 8] >> (byte % 8)) & 1) << 4
                }
                QuantFormat::Q6K => *u |= ((r[rec.qh + (v / 16) * 64 + byte] >> (2 * (ch % 4))) & 3) << 4,
                _ => {}
            }
        }
        let f32_at = |o: usize| f32::from_le_bytes([r[o], r[o + 1], r[o + 2], r[o + 3]]);
        match self.scales {
            ScaleKind::F16 => {
                for j in 0..8 {
                    cg.d16[j] = f16_bits(r, rec.d + 32 * j + 2 * c);
                    if f.has_min() {
                        cg.m16[j] = f16_bits(r, rec.m + 32 * j + 2 * c);
                    }
                }
            }
            ScaleKind::K4 => {
                cg.d = f32_at(rec.d + 4 * c);
                cg.nd = f32_at(rec.m + 4 * c);
                for j in 0..8 {
                    cg.sc[j] = r[rec.sc + 16 * j + c];
                    cg.mn[j] = r[rec.mn + 64 * (j / 2) + 4 * c + 2 * (j % 2)];
                }
            }
            ScaleKind::K6 => {
                cg.d = f32_at(rec.d + 4 * c);
                for l in 0..16 {
                    cg.sc[l] = r[rec.sc + 16 * l + c];
                }
            }
        }
        cg
    }

    /// The matrix made of rows `ids` (e.g. an LM head restricted to a draft vocabulary).
    pub fn select_rows(&self, ids: &[usize]) -> Self {
        assert!(ids.iter().all(|&i| i < self.n), "row index out of range");
        let mut p = Self::empty(self.format, ids.len(), self.k);
        for (j, &i) in ids.iter().enumerate() {
            for g in 0..self.groups() {
                p.put(j, g, &self.get(i, g));
            }
        }
        p
    }

    /// Repacks `n` rows of `k` values of GGUF data, a tile per task (tiles are disjoint runs of
    /// the buffer).
    pub fn from_gguf(format: QuantFormat, data: &[u8], n: usize, k: usize) -> Self {
        use rayon::prelude::*;
        let mut p = Self::empty(format, n, k);
        let (nb, groups, rec) = (p.nb, p.groups(), p.rec);
        let k_quant = matches!(format, QuantFormat::Q4K | QuantFormat::Q6K);
        // Bytes of one GGUF row.
        let row_bytes = if k_quant {
            assert_eq!(k % 256, 0, "K-quant rows are whole 256-value super-blocks");
            k / 256 * format.block_bytes()
        } else {
            nb * format.block_bytes()
        };
        assert_eq!(data.len(), n * row_bytes, "weight bytes do not match n × k");
        let bias = p.bias();
        let tile = |(t, tb): (usize, &mut [u8])| {
            let mut cg = ColumnGroup::default();
            let mut q = [0i32; QK];
            for c in 0..NT.min(n - t * NT) {
                let row = &data[(t * NT + c) * row_bytes..][..row_bytes];
                for g in 0..groups {
                    if k_quant {
                        // nbp == nb for K-quants: super-block g of a row is group g.
                        let sb = &row[g * format.block_bytes()..][..format.block_bytes()];
                        if format == QuantFormat::Q4K {
                            unpack_q4k(sb, &mut cg);
                        } else {
                            unpack_q6k(sb, &mut cg);
                        }
                    } else {
                        let bb = format.block_bytes();
                        cg = ColumnGroup::default();
                        for j in 0..8 {
                            let b = g * 8 + j;
                            if b >= nb {
                                break; // padding: zero scales, zero integers
                            }
                            let blk = &row[b * bb..][..bb];
                            cg.d16[j] = f16_bits(blk, 0);
                            if format.has_min() {
                                cg.m16[j] = f16_bits(blk, 2);
                            }
                            decode_block(format, blk, &mut q);
                            for (x, &qi) in cg.u[j * QK..(j + 1) * QK].iter_mut().zip(&q) {
                                *x = (qi + bias) as u8;
                            }
                        }
                    }
                    put_record(format, rec, &mut tb[g * rec.size..(g + 1) * rec.size], c, &cg);
                }
            }
        };
        let tile_bytes = groups * rec.size;
        if n * k >= 1 << 20 {
            p.buf.par_chunks_mut(tile_bytes).enumerate().for_each(tile);
        } else {
            p.buf.chunks_mut(tile_bytes).enumerate().for_each(tile);
        }
        p
    }

    /// Row `row` of the weights as f32, as candle dequantizes it.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let bias = self.bias();
        for (g, chunk) in out.chunks_mut(GROUP).enumerate() {
            let cg = self.get(row, g);
            for (v, o) in chunk.iter_mut().enumerate() {
                let j = v / QK;
                let q = cg.u[v] as i32 - bias;
                *o = match self.scales {
                    ScaleKind::F16 => {
                        let m = if self.format.has_min() { f32_of(cg.m16[j]) } else { 0.0 };
                        f32_of(cg.d16[j]) * q as f32 + m
                    }
                    ScaleKind::K4 => (cg.d * cg.sc[j] as f32) * q as f32 + cg.nd * cg.mn[j] as f32,
                    ScaleKind::K6 => (cg.d * cg.sc[v / 16] as i8 as f32) * q as f32,
                };
            }
        }
    }
}

/// Writes one column's part of a group into its record `r` (column `c` of the tile). The
/// record starts zeroed: the integers are OR-ed in.
fn put_record(f: QuantFormat, rec: Record, r: &mut [u8], c: usize, cg: &ColumnGroup) {
    for ch in 0..GROUP / 4 {
        let u = &cg.u[4 * ch..4 * ch + 4];
        let byte = 4 * c;
        if f == QuantFormat::Q8_0 {
            r[ch * 64 + byte..][..4].copy_from_slice(u);
            continue;
        }
        let (v, shift) = ((ch / 2) * 64 + byte, 4 * (ch % 2));
        for i in 0..4 {
            r[v + i] |= (u[i] & 0x0F) << shift;
        }
        match f {
            QuantFormat::Q5_0 | QuantFormat::Q5_1 => {
                let bits = (0..4).fold(0u8, |b, i| b | (((u[i] >> 4) & 1) << i));
                r[rec.qh + ch * 8 + byte / 8] |= bits << (byte % 8);
            }
            QuantFormat::Q6K => {
                let o = rec.qh + (ch / 4) * 64 + byte;
                for i in 0..4 {
                    r[o + i] |= ((u[i] >> 4) & 3) << (2 * (ch % 4));
                }
            }
            _ => {}
        }
    }
    match Record::scales(f) {
        ScaleKind::F16 => {
            for j in 0..8 {
                r[rec.d + 32 * j + 2 * c..][..2].copy_from_slice(&cg.d16[j].to_le_bytes());
                if f.has_min() {
                    r[rec.m + 32 * j + 2 * c..][..2].copy_from_slice(&cg.m16[j].to_le_bytes());
                }
            }
        }
        ScaleKind::K4 => {
            r[rec.d + 4 * c..][..4].copy_from_slice(&cg.d.to_le_bytes());
            r[rec.m + 4 * c..][..4].copy_from_slice(&cg.nd.to_le_bytes());
            for j in 0..8 {
                r[rec.sc + 16 * j + c] = cg.sc[j];
                r[rec.mn + 64 * (j / 2) + 4 * c + 2 * (j % 2)] = cg.mn[j];
            }
        }
        ScaleKind::K6 => {
            r[rec.d + 4 * c..][..4].copy_from_slice(&cg.d.to_le_bytes());
            for l in 0..16 {
                r[rec.sc + 16 * l + c] = cg.sc[l];
                let o = rec.mn + 64 * (l / 2) + 4 * c + 2 * (l % 2);
                r[o..o + 2].copy_from_slice(&(cg.sc[l] as i8 as i16).to_le_bytes());
            }
        }
    }
}

fn unpack_q4k(sb: &[u8], cg: &mut ColumnGroup) {
    // d, dmin, scales[12], qs[128]; sub-block j: low (j even) or high (j odd) nibbles of
    // qs[32·(j/2) ..][..32].
    cg.d = f32_of(f16_bits(sb, 0));
    cg.nd = -f32_of(f16_bits(sb, 2));
    let (scales, qs) = (&sb[4..16], &sb[16..144]);
    for j in 0..8 {
        let (sc, mn) = scale_min_k4(j, scales);
        cg.sc[j] = sc;
        cg.mn[j] = mn;
        for (l, &b) in qs[32 * (j / 2)..][..32].iter().enumerate() {
            cg.u[j * 32 + l] = if j % 2 == 0 { b & 0x0F } else { b >> 4 };
        }
    }
}

fn unpack_q6k(sb: &[u8], cg: &mut ColumnGroup) {
    // ql[128], qh[64], scales[16], d: value e, 128-chunk c, quarter t = (e % 128) / 32,
    // lane l = e % 32 has its low 4 bits in ql[64c + 32·(t % 2) + l] (low nibble for t < 2,
    // high otherwise) and its 2 high bits in qh[32c + l] at bit 2t. Scales: e / 16.
    let (ql, qh) = (&sb[..128], &sb[128..192]);
    for (e, x) in cg.u.iter_mut().enumerate() {
        let (c, t, l) = (e / 128, (e % 128) / 32, e % 32);
        let lo = (ql[64 * c + 32 * (t % 2) + l] >> (4 * (t / 2))) & 0x0F;
        let hi = (qh[32 * c + l] >> (2 * t)) & 3;
        *x = lo | (hi << 4);
    }
    cg.d = f32_of(f16_bits(sb, 208));
    cg.sc.copy_from_slice(&sb[192..208]);
}
