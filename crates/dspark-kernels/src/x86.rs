//! What the x86 kernel paths share: weight formats as compile-time constants (each format gets
//! its own kernel with no per-group branches), prefetching and the fixed float reduction.

#![allow(unsafe_op_in_unsafe_fn)]

use crate::packed::ScaleKind;
use std::arch::x86_64::*;

/// How a format stores its integers.
#[derive(PartialEq, Eq)]
pub enum Ints {
    Four,
    /// Nibbles and one bit mask per vector.
    Five,
    /// Nibbles and 2 high bits per byte.
    Six,
    Byte,
}

pub trait Fmt {
    const INTS: Ints = Ints::Four;
    const SCALES: ScaleKind = ScaleKind::F16;
    /// Has a per-block offset `m` (the "_1" formats).
    const MIN: bool = false;
    /// log2 of the format's bias (0: none).
    const BIAS_SHIFT: u32 = 0;
}
pub struct Q40;
pub struct Q41;
pub struct Q50;
pub struct Q51;
pub struct Q80;
pub struct Q4K;
pub struct Q6K;
impl Fmt for Q40 {
    const BIAS_SHIFT: u32 = 3;
}
impl Fmt for Q41 {
    const MIN: bool = true;
}
impl Fmt for Q50 {
    const INTS: Ints = Ints::Five;
    const BIAS_SHIFT: u32 = 4;
}
impl Fmt for Q51 {
    const INTS: Ints = Ints::Five;
    const MIN: bool = true;
}
impl Fmt for Q80 {
    const INTS: Ints = Ints::Byte;
    const BIAS_SHIFT: u32 = 7;
}
impl Fmt for Q4K {
    const SCALES: ScaleKind = ScaleKind::K4;
}
impl Fmt for Q6K {
    const INTS: Ints = Ints::Six;
    const SCALES: ScaleKind = ScaleKind::K6;
    const BIAS_SHIFT: u32 = 5;
}

/// `$range::<F>(args)` for the format marker of `$format` (each path's entry point).
macro_rules! by_format {
    ($format:expr, $range:ident($($arg:expr),*)) => {{
        use crate::format::QuantFormat as Q;
        use crate::x86::{Q40, Q41, Q4K, Q50, Q51, Q6K, Q80};
        match $format {
            Q::Q4_0 => $range::<Q40>($($arg),*),
            Q::Q4_1 => $range::<Q41>($($arg),*),
            Q::Q5_0 => $range::<Q50>($($arg),*),
            Q::Q5_1 => $range::<Q51>($($arg),*),
            Q::Q8_0 => $range::<Q80>($($arg),*),
            Q::Q4K => $range::<Q4K>($($arg),*),
            Q::Q6K => $range::<Q6K>($($arg),*),
        }
    }};
}
pub(crate) use by_format;

/// How far ahead `prefetch_record` reaches, in bytes. A static rather than a constant so that
/// the `stream` example can compare distances in one process.
pub static PREFETCH: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(8192);

/// Asks for part `part` of `parts` of the record a fixed distance ahead of the one at `rec`
/// (`size` bytes): a tile's records are one contiguous stream, read from memory once per token,
/// and with the kernel's arithmetic between loads the hardware prefetcher alone keeps too few
/// lines in flight. Spread over the record's blocks rather than issued at once: a burst of 40
/// prefetches fills the miss buffers and stalls the arithmetic behind it.
#[inline(always)]
pub unsafe fn prefetch_part(rec: *const u8, size: usize, part: usize, parts: usize) {
    let d = PREFETCH.load(std::sync::atomic::Ordering::Relaxed);
    let lines = size / 64;
    let p = rec.wrapping_add(d);
    for l in lines * part / parts..lines * (part + 1) / parts {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64 * l) as *const i8);
    }
}

/// The shapes of AMX's tiles (palette 1): per tile, its rows and bytes per row.
#[derive(Default)]
pub struct TileShapes {
    rows: [u8; 16],
    colsb: [u16; 16],
}

impl TileShapes {
    pub fn set(&mut self, tile: usize, rows: usize, bytes: usize) {
        (self.rows[tile], self.colsb[tile]) = (rows as u8, bytes as u16);
    }

    /// Configures this thread's tiles (`ldtilecfg`).
    ///
    /// # Safety
    /// The CPU must have AMX-TILE with the tile state granted to the process.
    pub unsafe fn load(&self) {
        #[repr(C, align(64))]
        struct Config {
            palette: u8,
            start_row: u8,
            reserved: [u8; 14],
            colsb: [u16; 16],
            rows: [u8; 16],
        }
        let c = Config { palette: 1, start_row: 0, reserved: [0; 14], colsb: self.colsb, rows: self.rows };
        std::arch::asm!("ldtilecfg [{0}]", in(reg) &c as *const Config, options(nostack, readonly));
    }
}
