//! A disk cache of target features: for every sample, the hidden states of the tapped layers
//! and the final-norm output at every position, f16, memory-mapped. Computed once, shared by
//! every training run on the same data (any subset of its layers).

use crate::data::Sample;
use crate::{Result, TrainError};
use candle_core::{Device, Tensor};
use dspark_model::{Model, SeqInput, TapSpec};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Index {
    pub hidden: usize,
    pub layers: Vec<usize>,
    /// Tokens per sample actually cached (samples are cut at this length).
    pub max_len: usize,
    /// sample index → (offset in values, rows).
    pub entries: Vec<(usize, u64, usize)>,
}

/// Values stored per position: every tapped layer plus the final norm.
fn per_row(ix: &Index) -> usize {
    (ix.layers.len() + 1) * ix.hidden
}

/// Bytes the cache of `samples` will take.
pub fn estimate_bytes(samples: &[Sample], layers: usize, hidden: usize, max_len: usize) -> u64 {
    samples.iter().map(|s| s.tokens.len().min(max_len) as u64).sum::<u64>()
        * ((layers + 1) * hidden * 2) as u64
}

/// Appends samples' features to a cache folder; what an interrupted run left is kept up to its
/// last indexed sample. Shared by [`build`] and by regeneration, which captures the rows while
/// it generates them (a row does not depend on its batch, so they equal a prefill's).
pub struct FeatureWriter {
    ix: Index,
    w: std::io::BufWriter<std::fs::File>,
    off: u64,
    bin: std::path::PathBuf,
    idx_path: std::path::PathBuf,
    have: std::collections::HashSet<usize>,
    unindexed: usize,
}

impl FeatureWriter {
    pub fn open(dir: &Path, hidden: usize, layers: &[usize], max_len: usize) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
        let (bin, idx_path) = (dir.join("features.f16"), dir.join("index.json"));
        let ix = match std::fs::read_to_string(&idx_path) {
            Ok(t) => serde_json::from_str::<Index>(&t).map_err(|e| TrainError::Data(e.to_string()))?,
            Err(_) => Index { hidden, layers: layers.to_vec(), max_len, entries: vec![] },
        };
        if ix.layers != layers || ix.hidden != hidden || ix.max_len != max_len {
            return Err(TrainError::Data(format!(
                "{} holds features of other layers or length (layers {:?}, max-len {}); use another folder",
                dir.display(),
                ix.layers,
                ix.max_len
            )));
        }
        // Values past the last indexed sample are from an interrupted write: drop them.
        let end: u64 =
            ix.entries.iter().map(|&(_, off, rows)| off + (rows * per_row(&ix)) as u64).max().unwrap_or(0);
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&bin)
            .map_err(|e| TrainError::io(&bin, e))?;
        f.set_len(end * 2).map_err(|e| TrainError::io(&bin, e))?;
        let have = ix.entries.iter().map(|e| e.0).collect();
        Ok(Self { ix, w: std::io::BufWriter::new(f), off: end, bin, idx_path, have, unindexed: 0 })
    }

    pub fn layers(&self) -> &[usize] {
        &self.ix.layers
    }

    pub fn max_len(&self) -> usize {
        self.ix.max_len
    }

    pub fn contains(&self, index: usize) -> bool {
        self.have.contains(&index)
    }

    /// Appends sample `index`: `bytes` holds its rows as [`encode_rows`] writes them.
    pub fn append(&mut self, index: usize, bytes: &[u8]) -> Result<()> {
        let row_bytes = per_row(&self.ix) * 2;
        if !bytes.len().is_multiple_of(row_bytes) || self.have.contains(&index) {
            return Err(TrainError::Data(format!("features of sample {index}: malformed or already cached")));
        }
        let rows = bytes.len() / row_bytes;
        self.w.write_all(bytes).map_err(|e| TrainError::io(&self.bin, e))?;
        self.ix.entries.push((index, self.off, rows));
        self.have.insert(index);
        self.off += (rows * per_row(&self.ix)) as u64;
        self.unindexed += 1;
        if self.unindexed >= 50 {
            self.flush()?;
        }
        Ok(())
    }

    /// Makes everything appended so far durable and indexed.
    pub fn flush(&mut self) -> Result<()> {
        self.w.flush().map_err(|e| TrainError::io(&self.bin, e))?;
        write_index(&self.ix, &self.idx_path)?;
        self.unindexed = 0;
        Ok(())
    }
}

impl Drop for FeatureWriter {
    fn drop(&mut self) {
        // Best effort on an error path; the normal path has flushed already.
        let _ = self.flush();
    }
}

/// Rows `rows` of a forward's taps and final norm, in the cache's order (per row: every tapped
/// layer, then the final norm; f16 little-endian), appended to `buf`.
pub fn encode_rows(
    taps: &[Vec<f32>],
    fin: &[f32],
    d: usize,
    rows: std::ops::Range<usize>,
    buf: &mut Vec<u8>,
) {
    for r in rows {
        for src in taps.iter().map(|t| t.as_slice()).chain(std::iter::once(fin)) {
            for &x in &src[r * d..(r + 1) * d] {
                buf.extend_from_slice(&half::f16::from_f32(x).to_le_bytes());
            }
        }
    }
}

/// Whether a sample has anything to train on within `max_len` tokens.
pub fn worth_caching(s: &Sample, max_len: usize) -> bool {
    s.prompt_len < max_len.min(s.tokens.len())
}

/// Computes and writes the cache (resumable: samples already in it are kept; samples whose
/// answer starts past `max_len` are skipped, training cannot use them).
pub fn build(
    model: &Model,
    samples: &[Sample],
    layers: &[usize],
    max_len: usize,
    dir: &Path,
    mut progress: impl FnMut(usize, usize),
) -> Result<()> {
    let d = model.config.hidden;
    let mut w = FeatureWriter::open(dir, d, layers, max_len)?;
    for (n, s) in samples.iter().enumerate() {
        if w.contains(s.index) || !worth_caching(s, max_len) {
            progress(n + 1, samples.len());
            continue;
        }
        let len = s.tokens.len().min(max_len);
        let mut cache = model.new_cache(len);
        let seq = SeqInput {
            cache: &mut cache,
            tokens: &s.tokens[..len],
            logit_rows: vec![],
            tap_rows: (0..len).collect(),
        };
        let out =
            model.forward(&mut [seq], &TapSpec { layers: layers.to_vec(), final_norm: true })?.remove(0);
        let fin = out.final_norm.expect("asked for");
        let mut buf = Vec::with_capacity(len * (layers.len() + 1) * d * 2);
        encode_rows(&out.taps, &fin, d, 0..len, &mut buf);
        w.append(s.index, &buf)?;
        progress(n + 1, samples.len());
    }
    w.flush()
}

fn write_index(ix: &Index, path: &Path) -> Result<()> {
    let tmp = path.with_extension("json.partial");
    std::fs::write(&tmp, serde_json::to_string(ix).expect("index serialises"))
        .map_err(|e| TrainError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| TrainError::io(path, e))
}

/// A memory-mapped feature cache.
pub struct FeatureCache {
    ix: Index,
    map: memmap2::Mmap,
    by_sample: HashMap<usize, (u64, usize)>,
}

impl FeatureCache {
    pub fn open(dir: &Path) -> Result<Self> {
        let idx_path = dir.join("index.json");
        let text = std::fs::read_to_string(&idx_path).map_err(|e| TrainError::io(&idx_path, e))?;
        let ix: Index = serde_json::from_str(&text).map_err(|e| TrainError::Data(e.to_string()))?;
        let bin = dir.join("features.f16");
        let f = std::fs::File::open(&bin).map_err(|e| TrainError::io(&bin, e))?;
        // SAFETY: the file is only appended to by `build`, never while training reads it.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| TrainError::io(&bin, e))?;
        let by_sample = ix.entries.iter().map(|&(i, off, rows)| (i, (off, rows))).collect();
        Ok(Self { ix, map, by_sample })
    }

    pub fn layers(&self) -> &[usize] {
        &self.ix.layers
    }

    pub fn contains(&self, index: usize) -> bool {
        self.by_sample.contains_key(&index)
    }

    /// Features of sample `index` for `layers` (`(len, m·d)`) and the final norm (`(len, d)`),
    /// or `None` when the sample or a layer is not cached or `len` exceeds what is.
    pub fn get(&self, index: usize, layers: &[usize], len: usize) -> Result<Option<(Tensor, Tensor)>> {
        let Some(&(off, rows)) = self.by_sample.get(&index) else { return Ok(None) };
        let slots: Option<Vec<usize>> =
            layers.iter().map(|l| self.ix.layers.iter().position(|x| x == l)).collect();
        let Some(slots) = slots else { return Ok(None) };
        if len > rows {
            return Ok(None);
        }
        let (d, pr) = (self.ix.hidden, per_row(&self.ix));
        let at = |r: usize, slot: usize, j: usize| {
            let o = ((off + (r * pr + slot * d + j) as u64) * 2) as usize;
            half::f16::from_le_bytes([self.map[o], self.map[o + 1]]).to_f32()
        };
        let mut f = Vec::with_capacity(len * layers.len() * d);
        let mut fin = Vec::with_capacity(len * d);
        let last = self.ix.layers.len();
        for r in 0..len {
            for &s in &slots {
                f.extend((0..d).map(|j| at(r, s, j)));
            }
            fin.extend((0..d).map(|j| at(r, last, j)));
        }
        Ok(Some((
            Tensor::from_vec(f, (len, layers.len() * d), &Device::Cpu)?,
            Tensor::from_vec(fin, (len, d), &Device::Cpu)?,
        )))
    }
}
