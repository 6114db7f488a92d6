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

    pub fn save(map: &BTreeMap<String, Tensor>, path: &Path) -> Result<()> {
        let map: std::collections::HashMap<&String, Tensor> =
            map.iter().map(|(k, v)| (k, v.clone())).collect();
        candle_core::safetensors::save(&map, path)
            .map_err(|e| NetworkError::Checkpoint(format!("cannot write {}: {e}", path.display())))
    }
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
