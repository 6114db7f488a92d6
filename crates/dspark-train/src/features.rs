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

/// Computes and writes the cache (resumable: samples already in it are kept).
pub fn build(
    model: &Model,
    samples: &[Sample],
    layers: &[usize],
    max_len: usize,
    dir: &Path,
    mut progress: impl FnMut(usize, usize),
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
    let (bin, idx_path) = (dir.join("features.f16"), dir.join("index.json"));
    let d = model.config.hidden;
    let mut ix = match std::fs::read_to_string(&idx_path) {
        Ok(t) => serde_json::from_str::<Index>(&t).map_err(|e| TrainError::Data(e.to_string()))?,
        Err(_) => Index { hidden: d, layers: layers.to_vec(), max_len, entries: vec![] },
    };
    if ix.layers != layers || ix.hidden != d || ix.max_len != max_len {
        return Err(TrainError::Data(format!(
            "{} holds features of other layers or length; use another folder",
            dir.display()
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
    let mut w = std::io::BufWriter::new(f);
    let have: std::collections::HashSet<usize> = ix.entries.iter().map(|e| e.0).collect();
    let mut off = end;
    for (n, s) in samples.iter().enumerate() {
        if have.contains(&s.index) {
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
        for r in 0..len {
            for src in out.taps.iter().chain(std::iter::once(&fin)) {
                for &x in &src[r * d..(r + 1) * d] {
                    buf.extend_from_slice(&half::f16::from_f32(x).to_le_bytes());
                }
            }
        }
        w.write_all(&buf).map_err(|e| TrainError::io(&bin, e))?;
        ix.entries.push((s.index, off, len));
        off += (len * per_row(&ix)) as u64;
        if ix.entries.len() % 50 == 0 || n + 1 == samples.len() {
            w.flush().map_err(|e| TrainError::io(&bin, e))?;
            write_index(&ix, &idx_path)?;
        }
        progress(n + 1, samples.len());
    }
    w.flush().map_err(|e| TrainError::io(&bin, e))?;
    write_index(&ix, &idx_path)
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
