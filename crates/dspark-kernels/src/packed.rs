//! GGUF weights repacked once at load time into a structure-of-arrays layout per row: the
//! quantized integers of all blocks contiguous, then the f16 scales (and offsets, and Q5 high
//! bits) contiguous, each row padded to a multiple of 8 blocks. The kernel then converts eight
//! scales with one instruction and keeps the offset term in vector registers, instead of
//! decoding two f16 values per block.

use crate::format::{decode_block, QuantFormat, QK};
use half::f16;

pub struct PackedMatrix {
    pub format: QuantFormat,
    pub n: usize,
    pub k: usize,
    /// Real and padded blocks per row.
    pub nb: usize,
    pub nbp: usize,
    /// Per row `nbp × qbytes`: low nibbles of elements 0..16 and high nibbles for 16..32 as in
    /// GGUF (4-bit formats), or the 32 signed bytes (Q8_0).
    pub qs: Vec<u8>,
    /// Per row `nbp × 4`: Q5 high bits (bit i → element i).
    pub qh: Vec<u8>,
    /// Per row `nbp`: scales and offsets as f16 bits.
    pub d: Vec<u16>,
    pub m: Vec<u16>,
}

impl PackedMatrix {
    pub fn qbytes(format: QuantFormat) -> usize {
        if format == QuantFormat::Q8_0 {
            32
        } else {
            16
        }
    }

    /// Repacks `n` rows of `k` values of GGUF blocks.
    pub fn from_gguf(format: QuantFormat, data: &[u8], n: usize, k: usize) -> Self {
        assert_eq!(k % QK, 0);
        let nb = k / QK;
        let nbp = nb.div_ceil(8) * 8;
        let bb = format.block_bytes();
        assert_eq!(data.len(), n * nb * bb, "weight bytes do not match n × k");
        let qb = Self::qbytes(format);
        let is_q5 = matches!(format, QuantFormat::Q5_0 | QuantFormat::Q5_1);
        let mut p = Self {
            format,
            n,
            k,
            nb,
            nbp,
            qs: vec![0; n * nbp * qb],
            qh: if is_q5 { vec![0; n * nbp * 4] } else { Vec::new() },
            d: vec![0; n * nbp],
            m: if format.has_min() { vec![0; n * nbp] } else { Vec::new() },
        };
        for row in 0..n {
            for b in 0..nb {
                let blk = &data[(row * nb + b) * bb..][..bb];
                let i = row * nbp + b;
                let u16_at = |o: usize| u16::from_le_bytes([blk[o], blk[o + 1]]);
                p.d[i] = u16_at(0);
                let (q_off, h_off) = match format {
                    QuantFormat::Q4_0 => (2, None),
                    QuantFormat::Q4_1 => (4, None),
                    QuantFormat::Q5_0 => (6, Some(2)),
                    QuantFormat::Q5_1 => (8, Some(4)),
                    QuantFormat::Q8_0 => (2, None),
                };
                if format.has_min() {
                    p.m[i] = u16_at(2);
                }
                p.qs[i * qb..(i + 1) * qb].copy_from_slice(&blk[q_off..q_off + qb]);
                if let Some(h) = h_off {
                    p.qh[i * 4..(i + 1) * 4].copy_from_slice(&blk[h..h + 4]);
                }
            }
        }
        p
    }

    /// Block `b` of row `row` as a GGUF block, for the portable decoder.
    fn gguf_block(&self, row: usize, b: usize, out: &mut [u8; 34]) -> usize {
        let i = row * self.nbp + b;
        let qb = Self::qbytes(self.format);
        out[..2].copy_from_slice(&self.d[i].to_le_bytes());
        let mut o = 2;
        if self.format.has_min() {
            out[2..4].copy_from_slice(&self.m[i].to_le_bytes());
            o = 4;
        }
        if !self.qh.is_empty() {
            out[o..o + 4].copy_from_slice(&self.qh[i * 4..(i + 1) * 4]);
            o += 4;
        }
        out[o..o + qb].copy_from_slice(&self.qs[i * qb..(i + 1) * qb]);
        o + qb
    }

    /// Integers and (d, m) of block `b` of row `row`.
    pub fn block(&self, row: usize, b: usize, q: &mut [i32; QK]) -> (f32, f32) {
        let mut raw = [0u8; 34];
        let len = self.gguf_block(row, b, &mut raw);
        decode_block(self.format, &raw[..len], q)
    }

    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let mut q = [0i32; QK];
        for (b, chunk) in out.chunks_mut(QK).enumerate().take(self.nb) {
            let (d, m) = self.block(row, b, &mut q);
            for (o, &qi) in chunk.iter_mut().zip(q.iter()) {
                *o = d * qi as f32 + m;
            }
        }
    }

    pub fn d_f32(&self, i: usize) -> f32 {
        f16::from_bits(self.d[i]).to_f32()
    }

    pub fn m_f32(&self, i: usize) -> f32 {
        if self.m.is_empty() {
            0.0
        } else {
            f16::from_bits(self.m[i]).to_f32()
        }
    }
}
