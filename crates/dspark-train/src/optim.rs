//! AdamW with a warmup-then-cosine schedule and global-norm clipping, with state that can be
//! saved and restored exactly (resume gives the uninterrupted run's weights).

use crate::{Result, TrainError};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use std::collections::BTreeMap;
use std::path::Path;

pub struct AdamW {
    pub vars: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Updates done so far.
    pub step: usize,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// Peak `lr` after a linear warmup over the first `warmup` steps, then cosine to 0 at `total`.
pub fn lr_at(step: usize, total: usize, warmup: usize, peak: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1) as f64;
    let t = ((step - warmup) as f64 / span).min(1.0);
    peak * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
}

impl AdamW {
    pub fn new(vars: Vec<(String, Var)>, weight_decay: f64) -> Result<Self> {
        let zeros = |v: &Var| v.as_tensor().zeros_like();
        let m = vars.iter().map(|(_, v)| zeros(v)).collect::<candle_core::Result<_>>()?;
        let v = vars.iter().map(|(_, v)| zeros(v)).collect::<candle_core::Result<_>>()?;
        Ok(Self { vars, m, v, step: 0, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay })
    }

    /// Clips the gradients to global norm `clip`, applies one update at `lr`; returns the
    /// norm before clipping.
    pub fn step(&mut self, grads: &GradStore, lr: f64, clip: f64) -> Result<f64> {
        let mut sq = 0f64;
        for (_, var) in &self.vars {
            if let Some(g) = grads.get(var.as_tensor()) {
                sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            }
        }
        let norm = sq.sqrt();
        let scale = if norm > clip { clip / norm } else { 1.0 };
        self.step += 1;
        let t = self.step as i32;
        let (b1, b2) = (self.beta1, self.beta2);
        let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        for (i, (_, var)) in self.vars.iter().enumerate() {
            let Some(g) = grads.get(var.as_tensor()) else { continue };
            let g = (g * scale)?;
            self.m[i] = ((&self.m[i] * b1)? + (&g * (1.0 - b1))?)?;
            self.v[i] = ((&self.v[i] * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let update = ((&self.m[i] / c1)? / ((&self.v[i] / c2)?.sqrt()? + self.eps)?)?;
            let w = var.as_tensor().detach();
            let w = (&w - ((update + (&w * self.weight_decay)?)? * lr)?)?;
            var.set(&w)?;
        }
        Ok(norm)
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let mut map = std::collections::HashMap::new();
        for (i, (name, _)) in self.vars.iter().enumerate() {
            map.insert(format!("m.{name}"), self.m[i].clone());
            map.insert(format!("v.{name}"), self.v[i].clone());
        }
        map.insert("step".into(), Tensor::new(&[self.step as u32], &Device::Cpu)?);
        candle_core::safetensors::save(&map, path).map_err(|e| TrainError::io(path, e))
    }

    pub fn load(&mut self, path: &Path) -> Result<()> {
        let map: BTreeMap<String, Tensor> = candle_core::safetensors::load(path, &Device::Cpu)
            .map_err(|e| TrainError::io(path, e))?
            .into_iter()
            .collect();
        let get = |k: &str| {
            map.get(k).cloned().ok_or_else(|| TrainError::Data(format!("{} lacks `{k}`", path.display())))
        };
        for (i, (name, _)) in self.vars.iter().enumerate() {
            self.m[i] = get(&format!("m.{name}"))?;
            self.v[i] = get(&format!("v.{name}"))?;
        }
        self.step = get("step")?.to_vec1::<u32>()?[0] as usize;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_zero() {
        assert!((lr_at(0, 100, 4, 1.0) - 0.25).abs() < 1e-12);
        assert!((lr_at(3, 100, 4, 1.0) - 1.0).abs() < 1e-12);
        assert!((lr_at(4, 100, 4, 1.0) - 1.0).abs() < 1e-12);
        assert!((lr_at(52, 100, 4, 1.0) - 0.5).abs() < 1e-9);
        assert!(lr_at(100, 100, 4, 1.0).abs() < 1e-12);
    }

    #[test]
    fn adamw_minimises_a_quadratic_and_clips() {
        let x = Var::new(&[3f32, -2.0], &Device::Cpu).unwrap();
        let mut opt = AdamW::new(vec![("x".into(), x.clone())], 0.0).unwrap();
        for _ in 0..300 {
            let loss = x.as_tensor().sqr().unwrap().sum_all().unwrap();
            let g = loss.backward().unwrap();
            let n = opt.step(&g, 0.05, 1.0).unwrap();
            assert!(n >= 0.0);
        }
        let v = x.as_tensor().to_vec1::<f32>().unwrap();
        assert!(v.iter().all(|a| a.abs() < 0.05), "{v:?}");
    }
}
