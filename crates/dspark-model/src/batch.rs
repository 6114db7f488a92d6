//! A ragged batch: several sequences, each with its own new tokens at its own positions, run as
//! one stack of rows through the weights and split apart only inside attention.

use crate::kv::KvCache;
use crate::ops::{axpy, dot, Rope};
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
/// `lo(i)..=pos0 + i`. Keys outer, rows inner: each key and value is read once per block of rows
/// instead of once per row (a long prompt's chunk would otherwise stream the whole cache per
/// row). Per row, the dots, the softmax and the sums over keys run in the same order as for that
/// row alone, so a row's result does not depend on its batch.
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
    let first = lo(0);
    // Rows of the block that see key j.
    let rows_of = move |j: usize| (j.saturating_sub(pos0 + i0)..n).filter(move |&i| j >= lo(i));
    let mut scores = vec![0f32; n * len];
    for j in first..len {
        let kj = &kc[j * hd..(j + 1) * hd];
        for i in rows_of(j) {
            scores[i * len + j] = dot(q_at(i0 + i), kj) * scale;
        }
    }
    let mut sums = vec![0f32; n];
    for (i, sum) in sums.iter_mut().enumerate() {
        let row = &mut scores[i * len + lo(i)..i * len + pos0 + i0 + i + 1];
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        for sc in row.iter_mut() {
            *sc = (*sc - max).exp();
            *sum += *sc;
        }
    }
    for j in first..len {
        let vj = &vc[j * hd..(j + 1) * hd];
        for i in rows_of(j) {
            axpy(scores[i * len + j] / sums[i], vj, &mut out[i * hd..(i + 1) * hd]);
        }
    }
}
