//! The training losses, as functions of tensors so they can be checked by hand.
//!
//! DSpark: `L = 0.1·CE + 0.9·‖p_d − p_t‖₁ + 1.0·BCE(c, c*)`, each term averaged over valid
//! slots with position weights, `c* = clamp(1 − ½‖p_d − p_t‖₁, 0, 1)` detached. DFlash: CE only.

use crate::Result;
use candle_core::{Device, Tensor, D};
use dspark_drafter_models::nn::softmax;

/// Per-slot inputs of a loss: `n` slots.
pub struct Targets {
    /// Label as a draft-vocabulary index; `None` for slots past the end or labels outside the
    /// draft vocabulary (no cross-entropy there).
    pub label: Vec<Option<u32>>,
    /// Slot inside the sequence (L1 and BCE apply).
    pub valid: Vec<bool>,
    /// Position weight of each slot.
    pub weight: Vec<f32>,
    /// The target's distribution over the draft vocabulary, `(n, V_d)` (constant).
    pub p_target: Tensor,
}

#[derive(Debug, Clone, Copy)]
pub struct Mix {
    pub ce: f64,
    pub l1: f64,
    pub bce: f64,
}

pub const DSPARK: Mix = Mix { ce: 0.1, l1: 0.9, bce: 1.0 };
pub const CE_ONLY: Mix = Mix { ce: 1.0, l1: 0.0, bce: 0.0 };

pub struct LossOut {
    pub loss: Tensor,
    /// `c*` per slot (1 − half the L1 distance), the acceptance estimate.
    pub c_star: Vec<f32>,
}

fn weighted_mean(per_slot: &Tensor, w: &[f32]) -> Result<Option<Tensor>> {
    let total: f32 = w.iter().sum();
    if total == 0.0 {
        return Ok(None);
    }
    let wt = Tensor::from_vec(w.iter().map(|x| x / total).collect::<Vec<_>>(), w.len(), &Device::Cpu)?;
    Ok(Some((per_slot * wt)?.sum_all()?))
}

/// `logits`: `(n, V_d)` final draft logits; `conf_logits`: `(n)` before the sigmoid.
pub fn loss(logits: &Tensor, conf_logits: Option<&Tensor>, t: &Targets, mix: Mix) -> Result<LossOut> {
    let n = t.valid.len();
    let p_d = softmax(logits)?;
    let l1 = (&p_d - &t.p_target)?.abs()?.sum(D::Minus1)?; // (n)
    let c_star: Vec<f32> = l1.to_vec1::<f32>()?.iter().map(|d| (1.0 - 0.5 * d).clamp(0.0, 1.0)).collect();
    let mut total = Tensor::zeros((), candle_core::DType::F32, &Device::Cpu)?;
    if mix.ce > 0.0 {
        let logp = logits.broadcast_sub(&logsumexp(logits)?)?;
        let idx: Vec<u32> = t.label.iter().map(|l| l.unwrap_or(0)).collect();
        let picked = logp.gather(&Tensor::from_vec(idx, (n, 1), &Device::Cpu)?, 1)?.squeeze(1)?;
        let w: Vec<f32> = (0..n).map(|i| if t.label[i].is_some() { t.weight[i] } else { 0.0 }).collect();
        if let Some(ce) = weighted_mean(&picked.neg()?, &w)? {
            total = (total + (ce * mix.ce)?)?;
        }
    }
    let w: Vec<f32> = (0..n).map(|i| if t.valid[i] { t.weight[i] } else { 0.0 }).collect();
    if mix.l1 > 0.0 {
        if let Some(m) = weighted_mean(&l1, &w)? {
            total = (total + (m * mix.l1)?)?;
        }
    }
    if mix.bce > 0.0 {
        if let Some(z) = conf_logits {
            let c = Tensor::from_vec(c_star.clone(), n, &Device::Cpu)?;
            // softplus(z) − c·z, written stably: max(z, 0) + log(1 + e^{−|z|}) − c·z.
            let bce = ((z.relu()? + (z.abs()?.neg()?.exp()? + 1.0)?.log()?)? - (&c * z)?)?;
            if let Some(m) = weighted_mean(&bce, &w)? {
                total = (total + (m * mix.bce)?)?;
            }
        }
    }
    Ok(LossOut { loss: total, c_star })
}

pub fn logsumexp(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    Ok((x.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?)
}

/// Soft cross-entropy `−Σ p_t log p_d` per row, weighted mean over `w` (EAGLE-3's step loss).
pub fn soft_ce(logits: &Tensor, p_target: &Tensor, w: &[f32]) -> Result<Option<Tensor>> {
    let logp = logits.broadcast_sub(&logsumexp(logits)?)?;
    let per = (p_target * logp)?.sum(D::Minus1)?.neg()?;
    weighted_mean(&per, w)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two slots, vocabulary 3, worked out by hand.
    #[test]
    fn dspark_loss_matches_a_hand_computed_example() {
        let logits = Tensor::new(&[[0f32, 0.0, 0.0], [2f32.ln(), 0.0, 0.0]], &Device::Cpu).unwrap();
        let pt = Tensor::new(&[[1f32, 0.0, 0.0], [0.5f32, 0.25, 0.25]], &Device::Cpu).unwrap();
        let conf = Tensor::new(&[0f32, 1.0], &Device::Cpu).unwrap();
        let t = Targets {
            label: vec![Some(0), Some(2)],
            valid: vec![true, true],
            weight: vec![1.0, 0.5],
            p_target: pt,
        };
        let out = loss(&logits, Some(&conf), &t, DSPARK).unwrap();
        // Slot 0: p_d = (1/3, 1/3, 1/3): CE = ln 3, L1 = 2/3 + 1/3 + 1/3 = 4/3, c* = 1/3.
        // Slot 1: p_d = (1/2, 1/4, 1/4) = p_t: CE = −ln(1/4) = ln 4, L1 = 0, c* = 1.
        let (ce0, ce1) = (3f64.ln(), 4f64.ln());
        let (l10, l11) = (4.0 / 3.0, 0.0);
        let (c0, c1) = (1.0 / 3.0, 1.0);
        let sp = |z: f64| (1.0 + z.exp()).ln();
        let (b0, b1) = (sp(0.0) - c0 * 0.0, sp(1.0) - c1 * 1.0);
        let wm = |a: f64, b: f64| (a * 1.0 + b * 0.5) / 1.5;
        let want = 0.1 * wm(ce0, ce1) + 0.9 * wm(l10, l11) + wm(b0, b1);
        let got = out.loss.to_scalar::<f32>().unwrap() as f64;
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        assert!((out.c_star[0] as f64 - c0).abs() < 1e-6 && (out.c_star[1] as f64 - c1).abs() < 1e-6);
        // A slot past the end counts for nothing; a label outside the vocabulary only drops CE.
        let t2 = Targets {
            label: vec![Some(0), None],
            valid: vec![true, false],
            weight: vec![1.0, 0.5],
            p_target: t.p_target.clone(),
        };
        let got = loss(&logits, Some(&conf), &t2, DSPARK).unwrap().loss.to_scalar::<f32>().unwrap() as f64;
        let want = 0.1 * ce0 + 0.9 * l10 + b0;
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        let ce = loss(&logits, None, &t, CE_ONLY).unwrap().loss.to_scalar::<f32>().unwrap() as f64;
        assert!((ce - wm(ce0, ce1)).abs() < 1e-5);
    }
}
