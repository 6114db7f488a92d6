//! Named tensors of a checkpoint: shape-checked reads with messages that name the file and the
//! tensor, a record of which tensors were read (a strict load refuses the rest), random
//! initialisation, and saving.

use crate::{NetworkError, Result};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The tensors a drafter is built from. Training builds the same structure from its variables,
/// so one constructor serves loading, initialisation and training.
pub struct Store {
    map: BTreeMap<String, Tensor>,
    source: String,
    used: RefCell<BTreeSet<String>>,
}

impl Store {
    /// A safetensors file. Read here rather than by candle's loader, which refuses `BOOL`
    /// tensors (SafeAILab's `t2d`); booleans become `U8`.
    pub fn load(path: &Path) -> Result<Self> {
        use safetensors::Dtype as S;
        let bad = |e: String| NetworkError::Checkpoint(format!("cannot read {}: {e}", path.display()));
        let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
        let mut map = BTreeMap::new();
        for (name, view) in st.tensors() {
            if name.ends_with(Q8_SCALE) || name.ends_with(Q4_SCALE) {
                continue; // read with its matrix
            }
            if view.dtype() == S::U8 {
                if let Ok(scales) = st.tensor(&format!("{name}{Q4_SCALE}")) {
                    let t = dequantize_q4(&name, &view, &scales).map_err(bad)?;
                    map.insert(name, t);
                    continue;
                }
            }
            if view.dtype() == S::I8 {
                let scales = st.tensor(&format!("{name}{Q8_SCALE}")).map_err(|_| {
                    bad(format!("8-bit tensor `{name}` has no `{name}{Q8_SCALE}` block scales"))
                })?;
                let t = dequantize_q8(&name, &view, &scales).map_err(bad)?;
                map.insert(name, t);
                continue;
            }
            let dtype = match view.dtype() {
                S::F32 => DType::F32,
                S::F16 => DType::F16,
                S::BF16 => DType::BF16,
                S::F64 => DType::F64,
                S::I64 => DType::I64,
                S::U8 | S::BOOL => DType::U8,
                other => {
                    return Err(bad(format!(
                        "tensor `{name}` has dtype {other:?}, which dspark does not read"
                    )))
                }
            };
            let t = Tensor::from_raw_buffer(view.data(), dtype, view.shape(), &Device::Cpu)
                .map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
            map.insert(name, t);
        }
        Ok(Self::from_map(map, &path.display().to_string()))
    }

    /// The weights of a checkpoint folder, in whichever form its saver wrote them:
    /// `model.safetensors`, shards listed by `model.safetensors.index.json`, or a PyTorch
    /// `pytorch_model.bin` (SafeAILab's EAGLE-3 trainer).
    pub fn load_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        if single.is_file() {
            return Self::load(&single);
        }
        let index = dir.join("model.safetensors.index.json");
        if index.is_file() {
            return Self::load_sharded(dir, &index);
        }
        let bin = dir.join("pytorch_model.bin");
        if bin.is_file() {
            let map = crate::pth::read(&bin)?;
            return Ok(Self::from_map(map, &bin.display().to_string()));
        }
        Err(NetworkError::Checkpoint(format!(
            "{} has none of model.safetensors, model.safetensors.index.json or pytorch_model.bin; \
             a drafter is a folder with config.json and its weights",
            dir.display()
        )))
    }

    fn load_sharded(dir: &Path, index: &Path) -> Result<Self> {
        let bad = |e: String| NetworkError::Checkpoint(format!("{}: {e}", index.display()));
        let text = std::fs::read_to_string(index).map_err(|e| bad(e.to_string()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let weight_map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("has no `weight_map` object".into()))?;
        let mut files = BTreeSet::new();
        for (name, f) in weight_map {
            let f = f.as_str().ok_or_else(|| bad(format!("`{name}` maps to a non-string")))?;
            // A shard name is a file in this folder, never a path that leaves it.
            if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                return Err(bad(format!("shard `{f}` is not a file name in the checkpoint folder")));
            }
            files.insert(f.to_string());
        }
        let mut map = BTreeMap::new();
        for f in &files {
            map.extend(Self::load(&dir.join(f))?.map);
        }
        if let Some(name) = weight_map.keys().find(|n| !map.contains_key(*n)) {
            return Err(bad(format!("lists tensor `{name}` but its shard lacks it")));
        }
        Ok(Self::from_map(map, &dir.display().to_string()))
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Marks `name` as read (a tensor whose meaning the loader checked without converting it).
    pub fn mark_used(&self, name: &str) {
        self.used.borrow_mut().insert(name.to_string());
    }

    /// Refuses a checkpoint with tensors the loader never read: they mean the file was written
    /// for a variant this loader does not implement, and ignoring them would draft with
    /// something other than what the checkpoint computes.
    pub fn check_all_used(&self) -> Result<()> {
        let used = self.used.borrow();
        let unused: Vec<&String> = self.map.keys().filter(|n| !used.contains(*n)).collect();
        if unused.is_empty() {
            return Ok(());
        }
        let shown: Vec<String> = unused.iter().take(8).map(|n| format!("`{n}`")).collect();
        Err(NetworkError::Checkpoint(format!(
            "{} holds tensor{} {}{} that this drafter's config does not use; the checkpoint is for \
             a variant dspark does not implement (or its config.json does not match its weights)",
            self.source,
            if unused.len() == 1 { "" } else { "s" },
            shown.join(", "),
            if unused.len() > 8 { format!(" and {} more", unused.len() - 8) } else { String::new() }
        )))
    }

    /// Refuses weights with NaN or infinite values: a drafter built from them would propose
    /// garbage (or fail in the sampler) on every round.
    pub fn check_finite(&self) -> Result<()> {
        for (name, t) in &self.map {
            if !t.dtype().is_float() {
                continue;
            }
            let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            if let Some(x) = v.iter().find(|x| !x.is_finite()) {
                return Err(NetworkError::Checkpoint(format!(
                    "{}: tensor `{name}` holds {x}; the checkpoint is corrupt — train or fetch it again",
                    self.source
                )));
            }
        }
        Ok(())
    }

    pub fn from_map(map: BTreeMap<String, Tensor>, source: &str) -> Self {
        Self { map, source: source.to_string(), used: RefCell::new(BTreeSet::new()) }
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.map.keys()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// The tensor `name` as f32, refusing a missing tensor or another shape.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.mark_used(name);
        let t = self.map.get(name).ok_or_else(|| {
            NetworkError::Checkpoint(format!(
                "{} lacks tensor `{name}`; the checkpoint is incomplete or was written for another method",
                self.source
            ))
        })?;
        if t.dims() != shape {
            return Err(NetworkError::Checkpoint(format!(
                "{}: tensor `{name}` has shape {:?} but the config implies {shape:?}",
                self.source,
                t.dims()
            )));
        }
        Ok(if t.dtype() == DType::F32 { t.clone() } else { t.to_dtype(DType::F32)? })
    }

    /// The first of `names` the checkpoint has (else the first, for the error message).
    pub fn pick<'n>(&self, names: &'n [String]) -> &'n str {
        names.iter().find(|n| self.contains(n)).unwrap_or(&names[0])
    }

    pub fn opt(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.contains(name) {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A raw tensor (any dtype), e.g. `d2t`.
    pub fn raw(&self, name: &str) -> Option<&Tensor> {
        self.mark_used(name);
        self.map.get(name)
    }

    pub fn map(&self) -> &BTreeMap<String, Tensor> {
        &self.map
    }

    /// Writes `map` with every large matrix (at least 4 096 values, rows a multiple of 32) as
    /// 8-bit integers and one f32 scale per 32 values (`NAME` as I8, `NAME.q8_scale` as F32) —
    /// the precision the drafter's matmuls run at anyway (weights are quantized to 8 bits at
    /// load) — and the rest (norms, biases, small heads, the vocabulary map) as they are.
    /// [`Store::load`] reads it back as f32. Returns the bytes written.
    pub fn save_q8(map: &BTreeMap<String, Tensor>, path: &Path) -> Result<u64> {
        Self::save_quantized(map, path, Quant::Q8)
    }

    /// [`Store::save_q8`] at `quant`'s precision: [`Quant::Q4`] packs two 4-bit values a byte
    /// (`NAME` as U8 `[rows, cols / 2]`, low nibble first, `NAME.q4_scale` as F32), half the
    /// size, for drafters too deep for 8 bits under the repository's size limit.
    pub fn save_quantized(map: &BTreeMap<String, Tensor>, path: &Path, quant: Quant) -> Result<u64> {
        use safetensors::tensor::TensorView;
        use safetensors::Dtype as S;
        let err = |e: String| NetworkError::Checkpoint(format!("cannot write {}: {e}", path.display()));
        let mut owned: Vec<(String, S, Vec<usize>, Vec<u8>)> = Vec::new();
        for (name, t) in map {
            let dims = t.dims().to_vec();
            let big = dims.len() == 2 && dims[1] % 32 == 0 && t.elem_count() >= 1 << 12;
            if big && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) {
                let v: Vec<f32> = t
                    .to_dtype(DType::F32)
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_vec1())
                    .map_err(|e| err(e.to_string()))?;
                let (q, d) = quantize_blocks(&v, quant.max());
                let (dtype, shape, packed, suffix) = match quant {
                    Quant::Q8 => (S::I8, dims.clone(), q.into_iter().map(|x| x as u8).collect(), Q8_SCALE),
                    Quant::Q4 => (
                        S::U8,
                        vec![dims[0], dims[1] / 2],
                        // Offset by 8: the nibbles hold -7..=7 as 1..=15.
                        q.chunks_exact(2).map(|p| ((p[0] + 8) as u8) | (((p[1] + 8) as u8) << 4)).collect(),
                        Q4_SCALE,
                    ),
                };
                owned.push((name.clone(), dtype, shape, packed));
                let db = d.iter().flat_map(|x| x.to_le_bytes()).collect();
                owned.push((format!("{name}{suffix}"), S::F32, vec![dims[0], dims[1] / 32], db));
                continue;
            }
            let (dtype, bytes) = match t.dtype() {
                DType::F32 => (
                    S::F32,
                    t.flatten_all()
                        .and_then(|t| t.to_vec1::<f32>())
                        .map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()),
                ),
                DType::I64 => (
                    S::I64,
                    t.flatten_all()
                        .and_then(|t| t.to_vec1::<i64>())
                        .map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()),
                ),
                DType::U8 => (S::U8, t.flatten_all().and_then(|t| t.to_vec1::<u8>())),
                _ => (
                    S::F32,
                    t.to_dtype(DType::F32)
                        .and_then(|t| t.flatten_all())
                        .and_then(|t| t.to_vec1::<f32>())
                        .map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()),
                ),
            };
            owned.push((name.clone(), dtype, dims, bytes.map_err(|e| err(e.to_string()))?));
        }
        let views: Vec<(String, TensorView)> = owned
            .iter()
            .map(|(n, d, s, b)| TensorView::new(*d, s.clone(), b).map(|v| (n.clone(), v)))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| err(e.to_string()))?;
        safetensors::serialize_to_file(views, None, path).map_err(|e| err(e.to_string()))?;
        std::fs::metadata(path).map(|m| m.len()).map_err(|e| err(e.to_string()))
    }

    pub fn save(map: &BTreeMap<String, Tensor>, path: &Path) -> Result<()> {
        let map: std::collections::HashMap<&String, Tensor> =
            map.iter().map(|(k, v)| (k, v.clone())).collect();
        candle_core::safetensors::save(&map, path)
            .map_err(|e| NetworkError::Checkpoint(format!("cannot write {}: {e}", path.display())))
    }
}

/// The suffix of an 8-bit matrix's block scales (see [`Store::save_q8`]).
pub const Q8_SCALE: &str = ".q8_scale";
/// The suffix of a 4-bit matrix's block scales (see [`Store::save_quantized`]).
pub const Q4_SCALE: &str = ".q4_scale";

/// The precision [`Store::save_quantized`] stores large matrices at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quant {
    Q8,
    Q4,
}

impl Quant {
    /// The largest magnitude a block's integers take (symmetric, so 0 stays exact).
    fn max(self) -> f32 {
        match self {
            Quant::Q8 => 127.0,
            Quant::Q4 => 7.0,
        }
    }
}

/// Blocks of 32 values as `round(x / d)` with `d = max|x| / max` (Q8_0's rule, f32 scales).
fn quantize_blocks(v: &[f32], max: f32) -> (Vec<i8>, Vec<f32>) {
    let mut q = Vec::with_capacity(v.len());
    let mut d = Vec::with_capacity(v.len() / 32);
    for b in v.chunks_exact(32) {
        let s = b.iter().fold(0f32, |m, x| m.max(x.abs())) / max;
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        q.extend(b.iter().map(|x| (x * inv).round().clamp(-max, max) as i8));
        d.push(s);
    }
    (q, d)
}

fn dequantize_q4(
    name: &str,
    q: &safetensors::tensor::TensorView,
    d: &safetensors::tensor::TensorView,
) -> std::result::Result<Tensor, String> {
    let packed = q.shape().to_vec();
    let shape = if packed.len() == 2 { vec![packed[0], packed[1] * 2] } else { packed.clone() };
    let blocks = q.data().len() * 2 / 32;
    if packed.len() != 2
        || shape[1] % 32 != 0
        || d.dtype() != safetensors::Dtype::F32
        || d.data().len() != blocks * 4
    {
        return Err(format!(
            "4-bit tensor `{name}` {packed:?} (two values a byte) does not match its scales {:?} {:?} \
             (one f32 per 32 values)",
            d.dtype(),
            d.shape()
        ));
    }
    let mut out = Vec::with_capacity(q.data().len() * 2);
    for (b, s) in q.data().chunks_exact(16).zip(d.data().chunks_exact(4)) {
        let s = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        for &x in b {
            out.push(((x & 15) as i32 - 8) as f32 * s);
            out.push(((x >> 4) as i32 - 8) as f32 * s);
        }
    }
    Tensor::from_vec(out, shape, &Device::Cpu).map_err(|e| format!("tensor `{name}`: {e}"))
}

fn dequantize_q8(
    name: &str,
    q: &safetensors::tensor::TensorView,
    d: &safetensors::tensor::TensorView,
) -> std::result::Result<Tensor, String> {
    let shape = q.shape().to_vec();
    let blocks = q.data().len() / 32;
    if shape.len() != 2
        || shape[1] % 32 != 0
        || d.dtype() != safetensors::Dtype::F32
        || d.data().len() != blocks * 4
    {
        return Err(format!(
            "8-bit tensor `{name}` {shape:?} does not match its scales {:?} {:?} (one f32 per 32 values)",
            d.dtype(),
            d.shape()
        ));
    }
    let mut out = Vec::with_capacity(q.data().len());
    for (b, s) in q.data().chunks_exact(32).zip(d.data().chunks_exact(4)) {
        let s = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        out.extend(b.iter().map(|&x| x as i8 as f32 * s));
    }
    Tensor::from_vec(out, shape, &Device::Cpu).map_err(|e| format!("tensor `{name}`: {e}"))
}

/// What each tensor of a fresh drafter starts as.
#[derive(Debug, Clone, Copy)]
pub enum Init {
    /// Uniform with standard deviation `std` (PyTorch-style small random weights).
    Random(f32),
    Ones,
    Zeros,
}

/// Fills tensors reproducibly from one seed, in the order they are requested.
pub struct Initializer {
    rng: rand::rngs::StdRng,
    pub map: BTreeMap<String, Tensor>,
}

impl Initializer {
    pub fn new(seed: u64) -> Self {
        Self { rng: rand::rngs::StdRng::seed_from_u64(seed), map: BTreeMap::new() }
    }

    pub fn put(&mut self, name: &str, shape: &[usize], init: Init) -> Result<()> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = match init {
            Init::Random(std) => {
                let a = std * 3f32.sqrt();
                (0..n).map(|_| self.rng.random_range(-a..=a)).collect()
            }
            Init::Ones => vec![1.0; n],
            Init::Zeros => vec![0.0; n],
        };
        self.map.insert(name.to_string(), Tensor::from_vec(v, shape, &Device::Cpu)?);
        Ok(())
    }

    pub fn insert(&mut self, name: &str, t: Tensor) {
        self.map.insert(name.to_string(), t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eight_bit_checkpoints_read_back_within_half_a_step_and_small_tensors_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let (rows, cols) = (300, 256);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-0.3f32..0.3)).collect();
        let mut map = BTreeMap::new();
        map.insert("w".to_string(), Tensor::from_vec(w.clone(), (rows, cols), &Device::Cpu).unwrap());
        map.insert("bias".to_string(), Tensor::new(&[0.1f32, -2.5, 3.25], &Device::Cpu).unwrap());
        map.insert("d2t".to_string(), Tensor::new(&[5i64, -1, 9], &Device::Cpu).unwrap());
        let (q8, f32p) = (dir.path().join("q8.safetensors"), dir.path().join("f32.safetensors"));
        let bytes = Store::save_q8(&map, &q8).unwrap();
        Store::save(&map, &f32p).unwrap();
        assert!(bytes * 3 < std::fs::metadata(&f32p).unwrap().len(), "8-bit file is not smaller");
        let back = Store::load(&q8).unwrap();
        assert_eq!(back.map().len(), 3, "the scales are not tensors of the drafter");
        let got: Vec<f32> = back.map()["w"].flatten_all().unwrap().to_vec1().unwrap();
        for (b, (g, x)) in got.chunks(32).zip(w.chunks(32)).enumerate() {
            let half_step = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0 / 2.0;
            for (g, x) in g.iter().zip(x) {
                assert!((g - x).abs() <= half_step * 1.001, "block {b}: {g} vs {x}");
            }
        }
        assert_eq!(back.map()["bias"].to_vec1::<f32>().unwrap(), vec![0.1, -2.5, 3.25]);
        assert_eq!(back.map()["d2t"].to_vec1::<i64>().unwrap(), vec![5, -1, 9]);
    }

    #[test]
    fn four_bit_checkpoints_read_back_within_half_a_step_at_an_eighth_of_the_size() {
        let dir = tempfile::tempdir().unwrap();
        let (rows, cols) = (300, 256);
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-0.3f32..0.3)).collect();
        w[..32].iter_mut().for_each(|x| *x = 0.0); // an all-zero block stays zero
        let mut map = BTreeMap::new();
        map.insert("w".to_string(), Tensor::from_vec(w.clone(), (rows, cols), &Device::Cpu).unwrap());
        map.insert("bias".to_string(), Tensor::new(&[0.1f32, -2.5, 3.25], &Device::Cpu).unwrap());
        let (q4, f32p) = (dir.path().join("q4.safetensors"), dir.path().join("f32.safetensors"));
        let bytes = Store::save_quantized(&map, &q4, Quant::Q4).unwrap();
        Store::save(&map, &f32p).unwrap();
        assert!(bytes * 6 < std::fs::metadata(&f32p).unwrap().len(), "4-bit file is not small");
        let back = Store::load(&q4).unwrap();
        assert_eq!(back.map().len(), 2, "the scales are not tensors of the drafter");
        assert_eq!(back.map()["w"].dims(), &[rows, cols]);
        let got: Vec<f32> = back.map()["w"].flatten_all().unwrap().to_vec1().unwrap();
        for (b, (g, x)) in got.chunks(32).zip(w.chunks(32)).enumerate() {
            let half_step = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 7.0 / 2.0;
            for (g, x) in g.iter().zip(x) {
                assert!((g - x).abs() <= half_step * 1.001, "block {b}: {g} vs {x}");
            }
        }
        assert!(got[..32].iter().all(|&g| g == 0.0), "an all-zero block reads back as zeros");
        assert_eq!(back.map()["bias"].to_vec1::<f32>().unwrap(), vec![0.1, -2.5, 3.25]);
    }

    #[test]
    fn a_four_bit_matrix_whose_scales_do_not_match_is_refused_by_name() {
        use safetensors::tensor::TensorView;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.safetensors");
        let (data, scales) = (vec![0x88u8; 32], vec![0u8; 4]);
        let v = TensorView::new(safetensors::Dtype::U8, vec![2, 16], &data).unwrap();
        let d = TensorView::new(safetensors::Dtype::F32, vec![1, 1], &scales).unwrap();
        let views = vec![("fc.weight".to_string(), v), (format!("fc.weight{Q4_SCALE}"), d)];
        safetensors::serialize_to_file(views, None, &p).unwrap();
        let e = Store::load(&p).err().expect("refused").to_string();
        assert!(e.contains("fc.weight") && e.contains("4-bit"), "{e}");
    }

    #[test]
    fn an_eight_bit_matrix_without_its_scales_is_refused_by_name() {
        use safetensors::tensor::TensorView;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.safetensors");
        let data = vec![1u8; 64];
        let v = TensorView::new(safetensors::Dtype::I8, vec![2, 32], &data).unwrap();
        safetensors::serialize_to_file(vec![("fc.weight".to_string(), v)], None, &p).unwrap();
        let e = Store::load(&p).err().expect("refused").to_string();
        assert!(e.contains("fc.weight") && e.contains(Q8_SCALE), "{e}");
    }
}
