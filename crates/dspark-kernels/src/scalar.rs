//! The portable kernel and the definition of every path's arithmetic. Per weight column `n`
//! and activation row `r`, one float accumulator runs over the row's groups in order:
//!
//! ```text
//! P_b = Σ over block b's 32 values of q·a            exact integers (q signed)
//! P_l = the same over half-block l's 16 values
//! F16, per block b:  acc = fma(P_b, d_w·d_x, acc);   with offset m: acc = fma(m, xs_b, acc)
//! K4, per group:     I = Σ_j sc_j·P_j,  M = Σ_j mn_j·S_j     (exact; S_j = Σ a over block j)
//!                    acc = fma(I, d·d_x, acc);  acc = fma(M, (−dmin)·d_x, acc)
//! K6, per group:     I = Σ_l sc_l·P_l;  acc = fma(I, d·d_x, acc)
//! y = acc
//! ```
//!
//! `xs_b` is block b's activation sum times its scale; each product of scales is one f32
//! multiply, and an integer is converted to f32 once, rounding to nearest even. K-quant scales
//! apply to exact integer sums (as llama.cpp's do), so a K-quant group costs one or two float
//! operations per column. The SIMD paths compute the same integers (any exact way) and the
//! same float operations in the same order, with 16 (or 8) columns in a register's lanes, so
//! every path gives the same bits, and a row's result never depends on the other rows of its
//! batch.

use crate::format::{Q8Rows, QK};
use crate::packed::{PackedMatrix, ScaleKind, GROUP};
use half::f16;

/// `out[r·ldo + n] = Σ_k x[r][k]·w[n][k]` for `n` in `n0..n1`, all rows of `x`.
///
/// # Safety
/// `out` must have room for `x.rows` rows of stride `ldo` covering columns `n0..n1`.
pub unsafe fn range(w: &PackedMatrix, x: &Q8Rows, n0: usize, n1: usize, out: *mut f32, ldo: usize) {
    let mut acc = vec![0f32; x.rows];
    for n in n0..n1 {
        acc.fill(0.0);
        for g in 0..w.groups() {
            group(w, n, g, x, &mut acc);
        }
        for (r, &a) in acc.iter().enumerate() {
            *out.add(r * ldo + n) = a;
        }
    }
}

/// Adds group `g` of column `n` to every row's accumulator.
fn group(w: &PackedMatrix, n: usize, g: usize, x: &Q8Rows, acc: &mut [f32]) {
    let cg = w.get(n, g);
    let bias = w.bias();
    let kp = x.nbp * QK;
    for (r, acc) in acc.iter_mut().enumerate() {
        let a = &x.qs[r * kp + g * GROUP..][..GROUP];
        // Σ q·a over values v0..v0 + len, q signed.
        let dot = |v0: usize, len: usize| -> i32 {
            (v0..v0 + len).map(|v| (cg.u[v] as i32 - bias) * a[v] as i32).sum()
        };
        let blk = r * x.nbp + g * 8;
        match w.scales {
            ScaleKind::F16 => {
                for j in 0..8 {
                    let s = f16::from_bits(cg.d16[j]).to_f32() * x.d[blk + j];
                    *acc = (dot(j * QK, QK) as f32).mul_add(s, *acc);
                    if w.format.has_min() {
                        *acc = f16::from_bits(cg.m16[j]).to_f32().mul_add(x.xs[blk + j], *acc);
                    }
                }
            }
            ScaleKind::K4 => {
                let i: i32 = (0..8).map(|j| cg.sc[j] as i32 * dot(j * QK, QK)).sum();
                let m: i32 = (0..8).map(|j| cg.mn[j] as i32 * x.bsum[blk + j]).sum();
                let dx = x.d[blk];
                *acc = (i as f32).mul_add(cg.d * dx, *acc);
                *acc = (m as f32).mul_add(cg.nd * dx, *acc);
            }
            ScaleKind::K6 => {
                let i: i32 = (0..16).map(|l| cg.sc[l] as i8 as i32 * dot(l * 16, 16)).sum();
                *acc = (i as f32).mul_add(cg.d * x.d[blk], *acc);
            }
        }
    }
}
