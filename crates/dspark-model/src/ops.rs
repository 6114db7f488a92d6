//! Row-wise building blocks on plain `f32` slices. The target's forward is inference only, so it
//! skips candle's tensor machinery here: per-op overhead would rival a 135M model's compute.

use crate::Result;
use dspark_kernels::QLinear;

pub use crate::batch::attend_all;

#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `out[r][j] = dot(q[r], k_j) · scale` for four rows `q` and the keys `j ∈ js` (`k_j` is row
/// `j` of `k`, `q[r].len()` wide), with exactly `dot`'s arithmetic per score (eight lanes of
/// FMAs over the chunks in order, lanes summed in order, then the tail): four independent chains
/// keep the FMA units busy where one dot waits on its own latency.
pub fn dot4_scaled(q: [&[f32]; 4], k: &[f32], js: std::ops::Range<usize>, scale: f32, out: [&mut [f32]; 4]) {
    let hd = q[0].len();
    assert!(
        q.iter().all(|r| r.len() == hd) && k.len() >= js.end * hd && out.iter().all(|o| o.len() >= js.end)
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: AVX2 and FMA were detected; the lengths were checked above.
        unsafe { dot4_avx2(q, k, js, scale, out) };
        return;
    }
    let [o0, o1, o2, o3] = out;
    for j in js {
        let kj = &k[j * hd..(j + 1) * hd];
        for (o, qr) in [&mut *o0, &mut *o1, &mut *o2, &mut *o3].into_iter().zip(&q) {
            o[j] = dot(qr, kj) * scale;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot4_avx2(q: [&[f32]; 4], k: &[f32], js: std::ops::Range<usize>, scale: f32, out: [&mut [f32]; 4]) {
    use std::arch::x86_64::*;
    let hd = q[0].len();
    let n8 = hd / 8 * 8;
    let [o0, o1, o2, o3] = out;
    let outs = [o0.as_mut_ptr(), o1.as_mut_ptr(), o2.as_mut_ptr(), o3.as_mut_ptr()];
    let mut j = js.start;
    if n8 == hd {
        // Eight keys per row at a time: their lane accumulators transposed, so the lanes of all
        // eight are summed in order (0 + l0 + l1 + … + l7, as `dot`) by seven vector adds
        // instead of a store and eight scalar adds per score.
        while j + 8 <= js.end {
            for r in 0..4 {
                let qr = q[r].as_ptr();
                let mut acc = [_mm256_setzero_ps(); 8];
                for c in (0..hd).step_by(8) {
                    let qc = _mm256_loadu_ps(qr.add(c));
                    for (t, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k.as_ptr().add((j + t) * hd + c)), *a);
                    }
                }
                let lanes = transpose8(acc);
                let mut s = _mm256_setzero_ps();
                for l in lanes {
                    s = _mm256_add_ps(s, l);
                }
                _mm256_storeu_ps(outs[r].add(j), _mm256_mul_ps(s, _mm256_set1_ps(scale)));
            }
            j += 8;
        }
    }
    for j in j..js.end {
        let kj = k.as_ptr().add(j * hd);
        let mut acc = [_mm256_setzero_ps(); 4];
        for c in (0..n8).step_by(8) {
            let kc = _mm256_loadu_ps(kj.add(c));
            for r in 0..4 {
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r].as_ptr().add(c)), kc, acc[r]);
            }
        }
        for r in 0..4 {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r]);
            let mut s = lanes.iter().sum::<f32>();
            for e in n8..hd {
                s += *q[r].get_unchecked(e) * *kj.add(e);
            }
            *outs[r].add(j) = s * scale;
        }
    }
}

/// `out[l]` = lane `l` of every input: `out[l][t] = v[t][l]`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose8(v: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let t0 = _mm256_unpacklo_ps(v[0], v[1]);
    let t1 = _mm256_unpackhi_ps(v[0], v[1]);
    let t2 = _mm256_unpacklo_ps(v[2], v[3]);
    let t3 = _mm256_unpackhi_ps(v[2], v[3]);
    let t4 = _mm256_unpacklo_ps(v[4], v[5]);
    let t5 = _mm256_unpackhi_ps(v[4], v[5]);
    let t6 = _mm256_unpacklo_ps(v[6], v[7]);
    let t7 = _mm256_unpackhi_ps(v[6], v[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

/// `e^x` for the softmax (x ≤ 0): range reduction by ln 2 and a degree-6 polynomial (Cephes'
/// `expf`), within 2 ulp of the true value; 0 below −87. One formula for the scalar and the
/// vector code, so a score gets the same bits whichever computes it.
#[inline]
pub fn exp_softmax(x: f32) -> f32 {
    if x < EXP_MIN {
        return 0.0;
    }
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let mut p = EXP_P[0];
    for c in &EXP_P[1..] {
        p = p.mul_add(r, *c);
    }
    let e = (r * r).mul_add(p, r) + 1.0;
    e * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

const EXP_MIN: f32 = -87.0;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];

/// `x ← exp_softmax(x − max)` over a row, eight at a time where the CPU allows.
pub fn exp_sub_in_place(row: &mut [f32], max: f32) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: AVX2 and FMA were detected.
        done = unsafe { exp_sub_avx2(row, max) };
    }
    for v in &mut row[done..] {
        *v = exp_softmax(*v - max);
    }
}

/// The lanes of [`exp_softmax`]; returns how many leading elements it did (whole eights).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sub_avx2(row: &mut [f32], max: f32) -> usize {
    use std::arch::x86_64::*;
    let n8 = row.len() / 8 * 8;
    let (m, lo) = (_mm256_set1_ps(max), _mm256_set1_ps(EXP_MIN));
    for c in (0..n8).step_by(8) {
        let p_row = row.as_mut_ptr().add(c);
        let x = _mm256_sub_ps(_mm256_loadu_ps(p_row), m);
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let nn = _mm256_sub_ps(_mm256_setzero_ps(), n);
        let r = _mm256_fmadd_ps(nn, _mm256_set1_ps(LN2_LO), _mm256_fmadd_ps(nn, _mm256_set1_ps(LN2_HI), x));
        let mut p = _mm256_set1_ps(EXP_P[0]);
        for c in &EXP_P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let e = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(r, r), p, r), _mm256_set1_ps(1.0));
        // Below the cut-off n is far negative and the exponent bits would wrap: masked to 0.
        let bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        let v = _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
        let keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
        _mm256_storeu_ps(p_row, _mm256_and_ps(v, keep));
    }
    n8
}

#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi = alpha.mul_add(xi, *yi);
    }
}

/// RMSNorm of each `dim`-sized row, in place. `adds_one`: weights stored as `w − 1` (HF Gemma).
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32, adds_one: bool) {
    let dim = w.len();
    for row in x.chunks_exact_mut(dim) {
        let ms = dot(row, row) / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(w) {
            let g = if adds_one { 1.0 + g } else { g };
            *v = *v * inv * g;
        }
    }
}

pub fn rms_norm_to(x: &[f32], w: &[f32], eps: f32, adds_one: bool) -> Vec<f32> {
    let mut y = x.to_vec();
    rms_norm(&mut y, w, eps, adds_one);
    y
}

pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

pub fn add_bias(x: &mut [f32], bias: Option<&Vec<f32>>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            add_inplace(row, b);
        }
    }
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/π)
    0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
}

/// `gate ← act(gate) · up`.
pub fn gated(gate: &mut [f32], up: &[f32], gelu: bool) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = if gelu { gelu_tanh(*g) } else { silu(*g) } * u;
    }
}

/// `x · Wᵀ` for `rows` rows of `x`.
pub fn linear(l: &QLinear, x: &[f32], rows: usize) -> Result<Vec<f32>> {
    Ok(l.forward_slice(x, rows)?)
}

/// Cos/sin tables for the positions of a batch: `[rows][head_dim / 2]`.
pub struct Rope {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    half: usize,
    interleaved: bool,
}

impl Rope {
    pub fn new(positions: &[usize], head_dim: usize, theta: f32, interleaved: bool) -> Self {
        let half = head_dim / 2;
        let inv: Vec<f64> =
            (0..half).map(|i| (theta as f64).powf(-((2 * i) as f64) / head_dim as f64)).collect();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &inv {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Self { cos, sin, half, interleaved }
    }

    /// Rotates every head of every row of `x` (`[rows][heads][head_dim]`).
    pub fn apply(&self, x: &mut [f32], heads: usize) {
        let hd = 2 * self.half;
        for (r, row) in x.chunks_exact_mut(heads * hd).enumerate() {
            let (c, s) = (&self.cos[r * self.half..][..self.half], &self.sin[r * self.half..][..self.half]);
            for head in row.chunks_exact_mut(hd) {
                for i in 0..self.half {
                    let (a, b) = if self.interleaved { (2 * i, 2 * i + 1) } else { (i, i + self.half) };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * c[i] - x1 * s[i];
                    head[b] = x0 * s[i] + x1 * c[i];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn softmax_exp_is_within_2_ulp_and_the_same_in_every_lane() {
        let xs: Vec<f32> =
            (0..20000).map(|i| -(i as f32) * 0.0045).chain([0.0, -86.9, -87.5, -1e9]).collect();
        for &x in &xs {
            let (got, want) = (super::exp_softmax(x), (x as f64).exp() as f32);
            if x >= -87.0 {
                let ulps = (got.to_bits() as i64 - want.to_bits() as i64).abs();
                assert!(ulps <= 2 || want < 1.2e-38, "exp({x}) = {got}, want {want}");
            } else {
                assert_eq!(got, 0.0);
            }
        }
        let mut row = xs.clone();
        super::exp_sub_in_place(&mut row, 0.0);
        let want: Vec<f32> = xs.iter().map(|&x| super::exp_softmax(x)).collect();
        assert_eq!(row, want);
    }

    #[test]
    fn dot4_is_dot_bit_for_bit() {
        for hd in [5usize, 8, 64, 67, 128] {
            let v = |s: usize, n: usize| {
                (0..n).map(|i| ((i * 7919 + s * 104729) % 1013) as f32 / 97.0 - 5.0).collect::<Vec<_>>()
            };
            let q: Vec<Vec<f32>> = (1..5).map(|s| v(s, hd)).collect();
            // Keys 1..20: two groups of eight (the transposed sums) and three alone.
            let k = v(9, hd * 20);
            let mut out = vec![vec![0f32; 20]; 4];
            let [a, b, c, d] = &mut out[..] else { unreachable!() };
            super::dot4_scaled([&q[0], &q[1], &q[2], &q[3]], &k, 1..20, 0.125, [a, b, c, d]);
            for r in 0..4 {
                for j in 1..20 {
                    assert_eq!(out[r][j], super::dot(&q[r], &k[j * hd..(j + 1) * hd]) * 0.125, "hd {hd}");
                }
            }
        }
    }
}
