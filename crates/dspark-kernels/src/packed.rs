//! GGUF weights repacked once at load time into a structure-of-arrays layout per row, in groups
//! of eight 32-value blocks: the integers of every block contiguous (4-bit formats as
//! "elements 0..16 in low nibbles, 16..32 in high nibbles", extra high bits as bit planes), then
//! the scales. The kernel converts a group's eight scales with one instruction and keeps offset
//! terms in vector registers instead of decoding two f16 values per block.
//!
//! K-quants keep their 256-value super-blocks as one group: an f32 super-scale (and super-min)
//! and eight small integer scales, so the layout stays about as compact as GGUF's.

use crate::format::{decode_block, QuantFormat, QK};
use half::f16;

/// How a group's scales are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleKind {
    /// One f16 scale (and offset) per block.
    F16,
    /// Q4_K: per super-block f32 `d`, `dmin`; per block 6-bit `sc`, `mn`: weight = d·sc·q − dmin·mn.
    K4,
    /// Q6_K: per super-block f32 `d`; per 16 values an i8 scale (block halves lo / hi).
    K6,
}

pub struct PackedMatrix {
    pub format: QuantFormat,
    pub n: usize,
    pub k: usize,
    /// Real and padded blocks per row (padded to a multiple of 8).
    pub nb: usize,
    pub nbp: usize,
    pub scales: ScaleKind,
    /// Per block: 16 bytes of nibbles, or 32 signed bytes (Q8_0).
    pub qs: WeightBuf,
    /// Per block, the bits above the nibble: Q5, one u32 bit plane (bit i → value i); Q6_K,
    /// 8 bytes where byte l holds the 2-bit fields of values l, l + 8, l + 16, l + 24 at bits
    /// 0–1, 2–3, 4–5, 6–7 (one 64-bit shift per quarter puts them in place).
    pub qh: WeightBuf,
    pub planes: usize,
    /// `F16`: per block `d` (and `m`) as f16 bits.
    pub d16: Vec<u16>,
    pub m16: Vec<u16>,
    /// `K4`/`K6`: per group (super-block) `d` and (K4) `dmin`.
    pub gd: Vec<f32>,
    pub gmin: Vec<f32>,
    /// `K4`: per block scale and min. `K6`: per block scale of the low and high half (as i8).
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

/// Nibble byte layout of a 32-value block: byte l holds value l (low) and value l + 16 (high).
fn pack_nibbles(v: &[u8; 32], out: &mut [u8]) {
    for l in 0..16 {
        out[l] = (v[l] & 0x0F) | ((v[l + 16] & 0x0F) << 4);
    }
}

/// Bit `bit` of each of 32 values as a little-endian u32 (value i → bit i).
fn plane(v: &[u8; 32], bit: u32) -> [u8; 4] {
    let mut m = 0u32;
    for (i, &x) in v.iter().enumerate() {
        m |= (((x >> bit) & 1) as u32) << i;
    }
    m.to_le_bytes()
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
        let scales = match format {
            QuantFormat::Q4K => ScaleKind::K4,
            QuantFormat::Q6K => ScaleKind::K6,
            _ => ScaleKind::F16,
        };
        let planes = match format {
            QuantFormat::Q5_0 | QuantFormat::Q5_1 => 1,
            QuantFormat::Q6K => 2,
            _ => 0,
        };
        let blocks = n * nbp;
        let groups = blocks / 8;
        let k_quant = scales != ScaleKind::F16;
        Self {
            format,
            n,
            k,
            nb,
            nbp,
            scales,
            qs: WeightBuf::zeroed(blocks * if Self::bytes(format) { 32 } else { 16 }),
            qh: WeightBuf::zeroed(blocks * planes * 4),
            planes,
            d16: if k_quant { Vec::new() } else { vec![0; blocks] },
            m16: if format.has_min() && !k_quant { vec![0; blocks] } else { Vec::new() },
            gd: if k_quant { vec![0.0; groups] } else { Vec::new() },
            gmin: if scales == ScaleKind::K4 { vec![0.0; groups] } else { Vec::new() },
            sc: if k_quant { vec![0; blocks] } else { Vec::new() },
            mn: if k_quant { vec![0; blocks] } else { Vec::new() },
        }
    }

    /// Formats stored as one signed byte per value.
    pub fn bytes(format: QuantFormat) -> bool {
        format == QuantFormat::Q8_0
    }

    /// Repacks `n` rows of `k` values of GGUF data.
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
            planes: self.planes,
            d16: pick(&self.d16, n, ids),
            m16: pick(&self.m16, n, ids),
            gd: pick(&self.gd, n, ids),
            gmin: pick(&self.gmin, n, ids),
            sc: pick(&self.sc, n, ids),
            mn: pick(&self.mn, n, ids),
        }
    }

    pub fn from_gguf(format: QuantFormat, data: &[u8], n: usize, k: usize) -> Self {
        let mut p = Self::empty(format, n, k);
        let (nb, nbp) = (p.nb, p.nbp);
        match format {
            QuantFormat::Q4K | QuantFormat::Q6K => {
                assert_eq!(k % 256, 0, "K-quant rows are whole 256-value super-blocks");
                let sbb = format.block_bytes();
                assert_eq!(data.len(), n * k / 256 * sbb, "weight bytes do not match n × k");
                for (s, sb) in data.chunks_exact(sbb).enumerate() {
                    let g = s; // nbp == nb for K-quants: super-block s is group s
                    if format == QuantFormat::Q4K {
                        p.pack_q4k(g, sb);
                    } else {
                        p.pack_q6k(g, sb);
                    }
                }
            }
            _ => {
                let bb = format.block_bytes();
                assert_eq!(data.len(), n * nb * bb, "weight bytes do not match n × k");
                let mut q = [0i32; QK];
                for row in 0..n {
                    for b in 0..nb {
                        let blk = &data[(row * nb + b) * bb..][..bb];
                        let i = row * nbp + b;
                        p.d16[i] = f16_bits(blk, 0);
                        if format.has_min() {
                            p.m16[i] = f16_bits(blk, 2);
                        }
                        decode_block(format, blk, &mut q);
                        // Store the unsigned form; the kernel re-applies each format's bias.
                        let bias = match format {
                            QuantFormat::Q4_0 => 8,
                            QuantFormat::Q5_0 => 16,
                            _ => 0,
                        };
                        let mut v = [0u8; 32];
                        for (x, &qi) in v.iter_mut().zip(&q) {
                            *x = (qi + bias) as u8;
                        }
                        p.put_ints(i, &v);
                    }
                }
            }
        }
        p
    }

    fn put_ints(&mut self, i: usize, v: &[u8; 32]) {
        if self.format == QuantFormat::Q4K {
            // Q4_K keeps GGUF's pairing: 32 bytes per two blocks, the even block in the low
            // nibbles and the odd one in the high nibbles, so one load serves both.
            let shift = 4 * (i % 2);
            for (dst, &x) in self.qs[(i / 2) * 32..][..32].iter_mut().zip(v) {
                *dst |= (x & 0x0F) << shift;
            }
            return;
        }
        if Self::bytes(self.format) {
            let bias = self.bias() as u8;
            for (dst, &x) in self.qs[i * 32..(i + 1) * 32].iter_mut().zip(v) {
                *dst = x.wrapping_sub(bias);
            }
            return;
        }
        pack_nibbles(v, &mut self.qs[i * 16..(i + 1) * 16]);
        for pl in 0..self.planes {
            let o = (i * self.planes + pl) * 4;
            self.qh[o..o + 4].copy_from_slice(&plane(v, 4 + pl as u32));
        }
    }

    fn pack_q4k(&mut self, g: usize, sb: &[u8]) {
        // d, dmin, scales[12], qs[128]; sub-block j: low (j even) or high (j odd) nibbles of
        // qs[32·(j/2) ..][..32].
        self.gd[g] = f32_of(f16_bits(sb, 0));
        self.gmin[g] = f32_of(f16_bits(sb, 2));
        let (scales, qs) = (&sb[4..16], &sb[16..144]);
        for j in 0..8 {
            let (sc, mn) = scale_min_k4(j, scales);
            let i = g * 8 + j;
            self.sc[i] = sc;
            self.mn[i] = mn;
            let src = &qs[32 * (j / 2)..][..32];
            let mut v = [0u8; 32];
            for (x, &b) in v.iter_mut().zip(src) {
                *x = if j % 2 == 0 { b & 0x0F } else { b >> 4 };
            }
            self.put_ints(i, &v);
        }
    }

    fn pack_q6k(&mut self, g: usize, sb: &[u8]) {
        // Kept in GGUF's own layout, ql[128], qh[64] per super-block: value e, 128-chunk c,
        // quarter t = (e % 128) / 32, lane l = e % 32 has its low 4 bits in
        // ql[64c + 32·(t % 2) + l] (low nibble for t < 2, high otherwise) and its 2 high bits in
        // qh[32c + l] at bit 2t, so one 32-byte load serves two or four blocks. Scales: e / 16.
        self.qs[g * 128..(g + 1) * 128].copy_from_slice(&sb[..128]);
        self.qh[g * 64..(g + 1) * 64].copy_from_slice(&sb[128..192]);
        self.gd[g] = f32_of(f16_bits(sb, 208));
        let scales = &sb[192..208];
        for j in 0..8 {
            self.sc[g * 8 + j] = scales[2 * j]; // i8 bits, read back as i8
            self.mn[g * 8 + j] = scales[2 * j + 1];
        }
    }

    /// The signed integers of block `b` of `row` and the scales of its low and high halves and
    /// its offset: value l = d_lo·q[l] + m for l < 16, d_hi·q[l] + m otherwise.
    pub fn block(&self, row: usize, b: usize, q: &mut [i32; QK]) -> (f32, f32, f32) {
        let i = row * self.nbp + b;
        let mut v = [0u8; 32];
        if Self::bytes(self.format) {
            for (qi, &x) in q.iter_mut().zip(&self.qs[i * 32..(i + 1) * 32]) {
                *qi = x as i8 as i32;
            }
        } else if self.format == QuantFormat::Q4K {
            for (x, &byte) in v.iter_mut().zip(&self.qs[(i / 2) * 32..][..32]) {
                *x = (byte >> (4 * (i % 2))) & 0x0F;
            }
        } else {
            for l in 0..16 {
                let byte = self.qs[i * 16 + l];
                v[l] = byte & 0x0F;
                v[l + 16] = byte >> 4;
            }
            if self.format == QuantFormat::Q6K {
                let (g, j) = (i / 8, i % 8);
                let (c, t) = (j / 4, j % 4);
                for (l, x) in v.iter_mut().enumerate() {
                    let lo = (self.qs[g * 128 + 64 * c + 32 * (t % 2) + l] >> (4 * (t / 2))) & 0x0F;
                    let hi = (self.qh[g * 64 + 32 * c + l] >> (2 * t)) & 3;
                    *x = lo | (hi << 4);
                }
            } else {
                for pl in 0..self.planes {
                    let o = (i * self.planes + pl) * 4;
                    let m = u32::from_le_bytes(self.qh[o..o + 4].try_into().unwrap());
                    for (l, x) in v.iter_mut().enumerate() {
                        *x |= (((m >> l) & 1) as u8) << (4 + pl);
                    }
                }
            }
        }
        if !Self::bytes(self.format) {
            let bias = self.bias();
            for (qi, &x) in q.iter_mut().zip(&v) {
                *qi = x as i32 - bias;
            }
        }
        let g = i / 8;
        match self.scales {
            ScaleKind::F16 => {
                let d = f32_of(self.d16[i]);
                let m = if self.m16.is_empty() { 0.0 } else { f32_of(self.m16[i]) };
                (d, d, m)
            }
            ScaleKind::K4 => {
                let d = self.gd[g] * self.sc[i] as f32;
                (d, d, -self.gmin[g] * self.mn[i] as f32)
            }
            ScaleKind::K6 => {
                (self.gd[g] * self.sc[i] as i8 as f32, self.gd[g] * self.mn[i] as i8 as f32, 0.0)
            }
        }
    }

    /// What is subtracted from the stored unsigned integers to get the signed ones.
    pub fn bias(&self) -> i32 {
        match self.format {
            QuantFormat::Q4_0 => 8,
            QuantFormat::Q5_0 => 16,
            QuantFormat::Q6K => 32,
            _ => 0,
        }
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
