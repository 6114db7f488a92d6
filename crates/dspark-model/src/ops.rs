//! Row-wise building blocks on plain `f32` slices. The target's forward is inference only, so it
//! skips candle's tensor machinery here: per-op overhead would rival a 135M model's compute.

use crate::Result;
use dspark_kernels::QLinear;

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
