//! A preallocated per-sequence KV cache with rollback.

use crate::{ModelError, Result};

/// Keys and values of one sequence for every layer, laid out `[kv_head][position][head_dim]` so
/// that attention streams each head's positions contiguously.
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
    capacity: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl KvCache {
    pub fn new(n_layers: usize, kv_heads: usize, head_dim: usize, capacity: usize) -> Self {
        let per_layer = kv_heads * capacity * head_dim;
        Self {
            k: (0..n_layers).map(|_| vec![0f32; per_layer]).collect(),
            v: (0..n_layers).map(|_| vec![0f32; per_layer]).collect(),
            len: 0,
            capacity,
            kv_heads,
            head_dim,
        }
    }

    /// Committed positions.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every position from `len` on (rejected draft tokens). Growing is an error.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(ModelError::Cache(format!(
                "cannot truncate a cache of {} positions to {len}",
                self.len
            )));
        }
        self.len = len;
        Ok(())
    }

    pub(crate) fn check_room(&self, n_new: usize, context: usize) -> Result<()> {
        let end = self.len + n_new;
        if end > context {
            return Err(ModelError::ContextExceeded { needed: end, context });
        }
        if end > self.capacity {
            return Err(ModelError::Cache(format!(
                "sequence needs {end} positions but its KV cache holds {}; allocate a larger cache",
                self.capacity
            )));
        }
        Ok(())
    }

    /// Writes `n` new rows (`[n][kv_heads][head_dim]`) of keys and values at positions `len..`.
    pub(crate) fn write(&mut self, layer: usize, k_rows: &[f32], v_rows: &[f32]) {
        let hd = self.head_dim;
        let n = k_rows.len() / (self.kv_heads * hd);
        for i in 0..n {
            let pos = self.len + i;
            for h in 0..self.kv_heads {
                let src = (i * self.kv_heads + h) * hd;
                let dst = (h * self.capacity + pos) * hd;
                self.k[layer][dst..dst + hd].copy_from_slice(&k_rows[src..src + hd]);
                self.v[layer][dst..dst + hd].copy_from_slice(&v_rows[src..src + hd]);
            }
        }
    }

    /// Keys and values of one head over positions `0..end`.
    pub(crate) fn head(&self, layer: usize, h: usize, end: usize) -> (&[f32], &[f32]) {
        let off = h * self.capacity * self.head_dim;
        let n = end * self.head_dim;
        (&self.k[layer][off..off + n], &self.v[layer][off..off + n])
    }

    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
    }
}
