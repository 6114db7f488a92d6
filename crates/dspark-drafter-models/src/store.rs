//! Named tensors of a checkpoint: shape-checked reads with messages that name the file and the
//! tensor, random initialisation, and saving.

use crate::{DrafterError, Result};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::path::Path;

/// The tensors a drafter is built from. Training builds the same structure from its variables,
/// so one constructor serves loading, initialisation and training.
pub struct Store {
    map: BTreeMap<String, Tensor>,
    source: String,
}

impl Store {
    pub fn load(path: &Path) -> Result<Self> {
        let map = candle_core::safetensors::load(path, &Device::Cpu)
            .map_err(|e| DrafterError::Checkpoint(format!("cannot read {}: {e}", path.display())))?;
        Ok(Self { map: map.into_iter().collect(), source: path.display().to_string() })
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
                return Err(DrafterError::Checkpoint(format!(
                    "{}: tensor `{name}` holds {x}; the checkpoint is corrupt — train or fetch it again",
                    self.source
                )));
            }
        }
        Ok(())
    }

    pub fn from_map(map: BTreeMap<String, Tensor>, source: &str) -> Self {
        Self { map, source: source.to_string() }
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.map.keys()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// The tensor `name` as f32, refusing a missing tensor or another shape.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.map.get(name).ok_or_else(|| {
            DrafterError::Checkpoint(format!(
                "{} lacks tensor `{name}`; the checkpoint is incomplete or was written for another method",
                self.source
            ))
        })?;
        if t.dims() != shape {
            return Err(DrafterError::Checkpoint(format!(
                "{}: tensor `{name}` has shape {:?} but the config implies {shape:?}",
                self.source,
                t.dims()
            )));
        }
        Ok(if t.dtype() == DType::F32 { t.clone() } else { t.to_dtype(DType::F32)? })
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
        self.map.get(name)
    }

    pub fn map(&self) -> &BTreeMap<String, Tensor> {
        &self.map
    }

    pub fn save(map: &BTreeMap<String, Tensor>, path: &Path) -> Result<()> {
        let map: std::collections::HashMap<&String, Tensor> =
            map.iter().map(|(k, v)| (k, v.clone())).collect();
        candle_core::safetensors::save(&map, path)
            .map_err(|e| DrafterError::Checkpoint(format!("cannot write {}: {e}", path.display())))
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
