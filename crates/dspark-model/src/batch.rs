//! A ragged batch: several sequences, each with its own new tokens at its own positions, run as
//! one stack of rows through the weights and split apart only inside attention.

use crate::kv::KvCache;
use crate::ops::{axpy, dot, dot4_scaled, exp_sub_in_place, Rope};
use rayon::prelude::*;

/// One sequence's part of a forward call.
pub struct SeqInput<'a> {
    pub cache: &'a mut KvCache,
    /// New tokens, appended at positions `cache.len()..`.
    pub tokens: &'a [u32],
    /// Rows (indices into `tokens`) whose logits are wanted.
    pub logit_rows: Vec<usize>,
    /// Rows whose hidden states (taps and final-norm output) are wanted.
    pub tap_rows: Vec<usize>,
}

impl<'a> SeqInput<'a> {
    /// Logits at every new row, no hidden states: a verify block or plain decoding.
    pub fn logits_all(cache: &'a mut KvCache, tokens: &'a [u32]) -> Self {
        let rows = (0..tokens.len()).collect();
        Self { cache, tokens, logit_rows: rows, tap_rows: Vec::new() }
    }

    /// Logits at the last row only: prefill.
    pub fn logits_last(cache: &'a mut KvCache, tokens: &'a [u32]) -> Self {
        let rows = tokens.len().checked_sub(1).into_iter().collect();
        Self { cache, tokens, logit_rows: rows, tap_rows: Vec::new() }
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Span {
    pub row0: usize,
    pub n: usize,
    pub pos0: usize,
}

pub(crate) struct Batch<'s, 'a> {
    pub seqs: &'s mut [SeqInput<'a>],
    pub spans: Vec<Span>,
    pub rows: usize,
    pub positions: Vec<usize>,
}

impl<'s, 'a> Batch<'s, 'a> {
    pub fn new(seqs: &'s mut [SeqInput<'a>]) -> Self {
        let mut spans = Vec::with_capacity(seqs.len());
        let mut positions = Vec::new();
        let mut row0 = 0;
        for s in seqs.iter() {
            let pos0 = s.cache.len();
            spans.push(Span { row0, n: s.tokens.len(), pos0 });
            positions.extend(pos0..pos0 + s.tokens.len());
            row0 += s.tokens.len();
        }
        Self { seqs, spans, rows: row0, positions }
    }

    /// Per-sequence row lists (`pick`) as indices into the stacked batch.
    pub fn global_rows(&self, pick: impl for<'x> Fn(&'x SeqInput<'a>) -> &'x Vec<usize>) -> Vec<usize> {
        self.seqs
            .iter()
            .zip(&self.spans)
            .flat_map(|(s, sp)| pick(s).iter().map(move |r| sp.row0 + r))
            .collect()
    }

    pub fn tokens(&self) -> Vec<u32> {
        self.seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect()
    }

    pub fn rope(&self, head_dim: usize, theta: f32, interleaved: bool) -> Rope {
        Rope::new(&self.positions, head_dim, theta, interleaved)
    }

    /// Causal attention of the new rows over each sequence's cache plus themselves.
    /// `q`: `[rows][heads][hd]`, `k`/`v`: `[rows][kv_heads][hd]`, all already position-encoded.
    /// `window`: keys further back than this many positions are masked (sliding-window layers).
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        heads: usize,
        kv_heads: usize,
        hd: usize,
        scale: f32,
        window: Option<usize>,
    ) -> Vec<f32> {
        let kv_row = kv_heads * hd;
        for (s, sp) in self.seqs.iter_mut().zip(&self.spans) {
            let r = sp.row0 * kv_row..(sp.row0 + sp.n) * kv_row;
            s.cache.write(layer, &k[r.clone()], &v[r]);
        }
        let group = heads / kv_heads;
        let tasks: Vec<(usize, usize)> =
            (0..self.spans.len()).flat_map(|s| (0..heads).map(move |h| (s, h))).collect();
        let seqs = &*self.seqs;
        let spans = &self.spans;
        let parts: Vec<Vec<f32>> = tasks
            .par_iter()
            .map(|&(s, h)| {
                let sp = spans[s];
                let (kc, vc) = seqs[s].cache.head(layer, h / group, sp.pos0 + sp.n);
                let q_at = |i: usize| &q[((sp.row0 + i) * heads + h) * hd..][..hd];
                let mut out = vec![0f32; sp.n * hd];
                for (b, o) in out.chunks_mut(ROW_BLOCK * hd).enumerate() {
                    attend_rows(sp.pos0, b * ROW_BLOCK, o, q_at, kc, vc, hd, scale, window);
                }
                out
            })
            .collect();
        let mut out = vec![0f32; self.rows * heads * hd];
        for (&(s, h), part) in tasks.iter().zip(parts) {
            let sp = self.spans[s];
            for i in 0..sp.n {
                let dst = ((sp.row0 + i) * heads + h) * hd;
                out[dst..dst + hd].copy_from_slice(&part[i * hd..(i + 1) * hd]);
            }
        }
        out
    }
}

/// Rows attended together: their queries and scores stay in L1/L2 while the keys and values
/// stream past once.
const ROW_BLOCK: usize = 64;

/// Causal attention of rows `i0..i0 + out.len() / hd` (row i at position `pos0 + i`) over keys
/// `lo(i)..=pos0 + i`. Rows go four at a time over the keys all four see, so each key and value
/// is read once per four rows instead of once per row (a long prompt's chunk would otherwise
/// stream the whole cache per row). Per row, the dots, the softmax and the sums over keys run in
/// the same order as for that row alone, so a row's result does not depend on its batch.
#[allow(clippy::too_many_arguments)]
fn attend_rows<'q>(
    pos0: usize,
    i0: usize,
    out: &mut [f32],
    q_at: impl Fn(usize) -> &'q [f32],
    kc: &[f32],
    vc: &[f32],
    hd: usize,
    scale: f32,
    window: Option<usize>,
) {
    let n = out.len() / hd;
    let len = pos0 + i0 + n;
    let lo = |i: usize| window.map_or(0, |w| (pos0 + i0 + i + 1).saturating_sub(w));
    // Rows of the block that see key j: consecutive, from the first row at or after position j
    // to the last whose window still reaches back to j.
    let rows_of = move |j: usize| {
        let end = window.map_or(n, |w| (j + w).saturating_sub(pos0 + i0).min(n));
        j.saturating_sub(pos0 + i0)..end
    };
    // The keys all four rows `i..i + 4` see (empty for a group of fewer than four): the fast
    // sweeps run over these; keys before and after them go one row at a time.
    let shared = |i: usize| if i + 4 <= n { lo(i + 3)..pos0 + i0 + i + 1 } else { len..len };
    // Scores: each row's scores are written in key order.
    let mut scores = vec![0f32; n * len];
    for i in (0..n).step_by(4) {
        let rows = i..(i + 4).min(n);
        let (a, b) = (shared(i).start, shared(i).end);
        if a < b {
            let q = [0, 1, 2, 3].map(|r| q_at(i0 + i + r));
            let mut it = scores[i * len..(i + 4) * len].chunks_mut(len);
            let out = [(); 4].map(|_| it.next().unwrap());
            dot4_scaled(q, kc, a..b, scale, out);
        }
        for j in (lo(i)..pos0 + i0 + rows.end).filter(|j| !(a..b).contains(j)) {
            let kj = &kc[j * hd..(j + 1) * hd];
            for r in rows_of(j).filter(|r| rows.contains(r)) {
                scores[r * len + j] = dot(q_at(i0 + r), kj) * scale;
            }
        }
    }
    for i in 0..n {
        let row = &mut scores[i * len + lo(i)..i * len + pos0 + i0 + i + 1];
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        exp_sub_in_place(row, max);
        let s: f32 = row.iter().sum();
        // The weights `p / sum` once per score rather than once per score and value row.
        for sc in row.iter_mut() {
            *sc /= s;
        }
    }
    // out_i += p_ij · v_j over j in increasing order for every element. Four rows at a time over
    // the keys all four see, with their outputs held in registers (`weighted_sum4`); the keys
    // before and after that span, seen by only some of the four, one row at a time — each
    // element still takes its keys in increasing order.
    for i in (0..n).step_by(4) {
        let rows = i..(i + 4).min(n);
        let (a, b) = (shared(i).start, shared(i).end);
        let add = |out: &mut [f32], js: std::ops::Range<usize>| {
            for j in js {
                for r in rows_of(j) {
                    if rows.contains(&r) {
                        axpy(scores[r * len + j], &vc[j * hd..(j + 1) * hd], &mut out[r * hd..(r + 1) * hd]);
                    }
                }
            }
        };
        add(out, lo(i)..a.min(pos0 + i0 + rows.end));
        if a < b {
            let block = &mut out[i * hd..(i + 4) * hd];
            let p = [0, 1, 2, 3].map(|r| &scores[(i + r) * len..(i + r + 1) * len]);
            weighted_sum4(p, vc, a..b, hd, block);
        }
        add(out, b.max(a)..pos0 + i0 + rows.end);
    }
}

/// Attention of the query rows `q` over every key of `kc`/`vc` (`len × hd` each, one head, no
/// mask): a drafter's block, which sees its whole context and itself. Rows go four at a time
/// over the keys (`dot4_scaled`, `weighted_sum4`), so each key and value is read once per four
/// rows; `out` (`q.len() × hd`) is overwritten.
pub fn attend_all(q: &[&[f32]], kc: &[f32], vc: &[f32], hd: usize, scale: f32, out: &mut [f32]) {
    let len = kc.len() / hd;
    assert!(vc.len() == kc.len() && out.len() == q.len() * hd && q.iter().all(|r| r.len() == hd));
    out.fill(0.0);
    if len == 0 {
        return;
    }
    let mut scores = vec![0f32; 4 * len];
    for i in (0..q.len()).step_by(4) {
        let m = (q.len() - i).min(4);
        if m == 4 {
            let mut it = scores.chunks_mut(len);
            let o = [(); 4].map(|_| it.next().expect("four rows"));
            dot4_scaled([q[i], q[i + 1], q[i + 2], q[i + 3]], kc, 0..len, scale, o);
        } else {
            for r in 0..m {
                for j in 0..len {
                    scores[r * len + j] = dot(q[i + r], &kc[j * hd..(j + 1) * hd]) * scale;
                }
            }
        }
        for row in scores.chunks_mut(len).take(m) {
            let max = row.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
            exp_sub_in_place(row, max);
            let s: f32 = row.iter().sum();
            row.iter_mut().for_each(|p| *p /= s);
        }
        let block = &mut out[i * hd..(i + m) * hd];
        if m == 4 {
            let p = [0, 1, 2, 3].map(|r| &scores[r * len..(r + 1) * len]);
            weighted_sum4(p, vc, 0..len, hd, block);
        } else {
            for r in 0..m {
                for j in 0..len {
                    axpy(scores[r * len + j], &vc[j * hd..(j + 1) * hd], &mut block[r * hd..(r + 1) * hd]);
                }
            }
        }
    }
}

/// `out[r] += Σ_{j ∈ js} p[r][j] · v_j` for four rows, each element accumulating its keys in
/// increasing order with one FMA each — exactly `axpy`'s arithmetic, with the outputs kept in
/// registers across keys instead of loaded and stored once per key.
fn weighted_sum4(p: [&[f32]; 4], v: &[f32], js: std::ops::Range<usize>, hd: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(16)
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        // SAFETY: AVX2 and FMA were detected; `out` holds four rows of `hd`, `v` covers `js`.
        unsafe { weighted_sum4_avx2(p, v, js, hd, out) };
        return;
    }
    for j in js {
        for (r, pr) in p.iter().enumerate() {
            axpy(pr[j], &v[j * hd..(j + 1) * hd], &mut out[r * hd..(r + 1) * hd]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_sum4_avx2(
    p: [&[f32]; 4],
    v: &[f32],
    js: std::ops::Range<usize>,
    hd: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    assert!(out.len() >= 4 * hd && v.len() >= js.end * hd && p.iter().all(|r| r.len() >= js.end));
    for e in (0..hd).step_by(16) {
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        for (r, a) in acc.iter_mut().enumerate() {
            let o = out.as_ptr().add(r * hd + e);
            *a = [_mm256_loadu_ps(o), _mm256_loadu_ps(o.add(8))];
        }
        for j in js.clone() {
            let vp = v.as_ptr().add(j * hd + e);
            let (v0, v1) = (_mm256_loadu_ps(vp), _mm256_loadu_ps(vp.add(8)));
            for (a, pr) in acc.iter_mut().zip(&p) {
                let w = _mm256_set1_ps(*pr.get_unchecked(j));
                a[0] = _mm256_fmadd_ps(w, v0, a[0]);
                a[1] = _mm256_fmadd_ps(w, v1, a[1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let o = out.as_mut_ptr().add(r * hd + e);
            _mm256_storeu_ps(o, a[0]);
            _mm256_storeu_ps(o.add(8), a[1]);
        }
    }
}
