//! What the x86 kernel paths share: weight formats as compile-time constants (each format gets
//! its own kernel with no per-group branches), prefetching and the fixed float reduction.

#![allow(unsafe_op_in_unsafe_fn)]

use crate::format::QuantFormat;
use crate::packed::{PackedMatrix, ScaleKind};
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
    const FORMAT: QuantFormat;
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
    const FORMAT: QuantFormat = QuantFormat::Q4_0;
    const BIAS_SHIFT: u32 = 3;
}
impl Fmt for Q41 {
    const FORMAT: QuantFormat = QuantFormat::Q4_1;
    const MIN: bool = true;
}
impl Fmt for Q50 {
    const FORMAT: QuantFormat = QuantFormat::Q5_0;
    const INTS: Ints = Ints::Five;
    const BIAS_SHIFT: u32 = 4;
}
impl Fmt for Q51 {
    const FORMAT: QuantFormat = QuantFormat::Q5_1;
    const INTS: Ints = Ints::Five;
    const MIN: bool = true;
}
impl Fmt for Q80 {
    const FORMAT: QuantFormat = QuantFormat::Q8_0;
    const INTS: Ints = Ints::Byte;
    const BIAS_SHIFT: u32 = 7;
}
impl Fmt for Q4K {
    const FORMAT: QuantFormat = QuantFormat::Q4K;
    const SCALES: ScaleKind = ScaleKind::K4;
}
impl Fmt for Q6K {
    const FORMAT: QuantFormat = QuantFormat::Q6K;
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

/// How far ahead `prefetch_group` reaches, in bytes of `qs`. A static rather than a constant so
/// that the `stream` example can compare distances in one process.
pub static PREFETCH: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(2048);

/// Asks for the weights a fixed distance ahead of group `gi` (global group index): each thread
/// streams its rows from memory once per token, and with the kernel's arithmetic between loads
/// the hardware prefetcher alone keeps too few lines in flight.
#[inline(always)]
pub unsafe fn prefetch_group<F: Fmt>(w: &PackedMatrix, gi: usize) {
    let (qs_bytes, qh_bytes) = PackedMatrix::group_bytes(F::FORMAT);
    let d = PREFETCH.load(std::sync::atomic::Ordering::Relaxed);
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

/// Lanes 0..8 of [`crate::scalar::reduce16`] after its first step: `(l, l + 4)`, then
/// `(l, l + 2)`, then `(0, 1)`.
#[inline(always)]
pub unsafe fn reduce8(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}
