//! The portable kernel and the definition of every path's arithmetic. Per weight row and
//! activation row, 16 float lanes accumulate, group by group (256 values):
//!
//! ```text
//! Pc[l] = Σ over lane l's 16 values of q·a               exact integers (q signed)
//! F16: acc[l] = fma(Pc[l], d_w·d_x, acc[l]);  with offset m: acc[l] = fma(m, xs[l], acc[l])
//! K4:  acc[l] = fma(Pc[l], (sc·d)·d_x, acc[l]);  acc[l] = fma(mn·(−dmin), xs[l], acc[l])
//! K6:  acc[l] = fma(Pc[l], (sc[l]·d)·d_x, acc[l])
//! y   = ((acc[0..8] + acc[8..16]) folded 8 → 4 → 2 → 1, each step adding the upper half)
//! ```
//!
//! `xs[l]` is the activation's lane sum times its scale. Each product of scales is one f32
//! multiply, left to right as written (`sc·d` is exact: a small integer times an f16 value). The SIMD paths compute the same integers
//! (any exact way) and the same lane-wise float operations in the same order, so every path
//! gives the same bits, and a row's result never depends on the other rows of its batch.

use crate::format::Q8Rows;
use crate::packed::{lane_pos, PackedMatrix, ScaleKind, GROUP};
use half::f16;

/// The fixed reduction of 16 lanes.
#[inline]
pub fn reduce16(acc: &[f32; 16]) -> f32 {
    let mut r = [0f32; 8];
    for l in 0..8 {
        r[l] = acc[l] + acc[l + 8];
    }
    for w in [4, 2, 1] {
        for l in 0..w {
            r[l] += r[l + w];
        }
    }
    r[0]
}

/// `out[r·ldo + n] = Σ_k x[r][k]·w[n][k]` for `n` in `n0..n1`, all rows of `x`.
///
/// # Safety
/// `out` must have room for `x.rows` rows of stride `ldo` covering columns `n0..n1`.
pub unsafe fn range(w: &PackedMatrix, x: &Q8Rows, n0: usize, n1: usize, out: *mut f32, ldo: usize) {
    for n in n0..n1 {
        for r in 0..x.rows {
            *out.add(r * ldo + n) = dot(w, n, x, r);
        }
    }
}

fn dot(w: &PackedMatrix, n: usize, x: &Q8Rows, r: usize) -> f32 {
    let groups = w.groups();
    let bias = w.bias();
    let mut acc = [0f32; 16];
    for g in 0..groups {
        let gi = n * groups + g;
        let xg = r * groups + g;
        let a = &x.qs[xg * GROUP..(xg + 1) * GROUP];
        let mut pc = [0i32; 16];
        for v in 0..GROUP {
            let (m, byte) = lane_pos(v);
            let q = w.value(gi, v) as i32 - bias;
            pc[v / 16] += q * a[m * 64 + byte] as i32;
        }
        let dx = x.d[xg * 8];
        match w.scales {
            ScaleKind::F16 => {
                for l in 0..16 {
                    let b = gi * 8 + l / 2;
                    let s = f16::from_bits(w.d16[b]).to_f32() * x.d[xg * 8 + l / 2];
                    acc[l] = (pc[l] as f32).mul_add(s, acc[l]);
                    if !w.m16.is_empty() {
                        acc[l] = f16::from_bits(w.m16[b]).to_f32().mul_add(x.xs[xg * 16 + l], acc[l]);
                    }
                }
            }
            ScaleKind::K4 => {
                for l in 0..16 {
                    let s = w.sc[gi * 8 + l / 2] as f32 * w.gd[gi] * dx;
                    let wm = w.mn[gi * 8 + l / 2] as f32 * -w.gmin[gi];
                    acc[l] = (pc[l] as f32).mul_add(s, acc[l]);
                    acc[l] = wm.mul_add(x.xs[xg * 16 + l], acc[l]);
                }
            }
            ScaleKind::K6 => {
                for l in 0..16 {
                    let s = w.sc[gi * 16 + l] as i8 as f32 * w.gd[gi] * dx;
                    acc[l] = (pc[l] as f32).mul_add(s, acc[l]);
                }
            }
        }
    }
    reduce16(&acc)
}
