//! The training losses, as functions of tensors so they can be checked by hand.
//!
//! DSpark: `L = 0.1·CE + 0.9·‖p_d − p_t‖₁ + 1.0·BCE(c, c*)`, each term averaged over valid
//! slots with position weights, `c* = clamp(1 − ½‖p_d − p_t‖₁, 0, 1)` detached. DFlash: CE only.

use crate::Result;
use candle_core::{Device, Tensor, D};
use dspark_drafter_models::nn::with_gradient;

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
///
/// The value and the gradient are computed row by row in plain Rust (in parallel) and handed to
/// candle's backward pass as they are ([`with_gradient`]). Written with candle's
/// elementwise ops the same loss made ~45 passes over `n × V_d` values per step, a third of a
/// training step; `tests::fused_loss_matches_autograd_of_the_written_formula` holds the two to
/// the same value and gradients.
pub fn loss(logits: &Tensor, conf_logits: Option<&Tensor>, t: &Targets, mix: Mix) -> Result<LossOut> {
    use rayon::prelude::*;
    let n = t.valid.len();
    let v = logits.dim(1)?;
    let z = logits.detach().flatten_all()?.to_vec1::<f32>()?;
    let pt = t.p_target.flatten_all()?.to_vec1::<f32>()?;
    let conf: Option<Vec<f32>> = match conf_logits {
        Some(c) => Some(c.detach().to_vec1::<f32>()?),
        None => None,
    };
    // Position weights normalised over the slots each term covers, as `weighted_mean` does.
    let ce_w: Vec<f32> = (0..n).map(|i| if t.label[i].is_some() { t.weight[i] } else { 0.0 }).collect();
    let w: Vec<f32> = (0..n).map(|i| if t.valid[i] { t.weight[i] } else { 0.0 }).collect();
    let norm = |w: &[f32]| {
        let s: f32 = w.iter().sum();
        if s == 0.0 {
            0.0
        } else {
            1.0 / s
        }
    };
    let (ce_k, w_k) = ((mix.ce as f32) * norm(&ce_w), norm(&w));
    let mut grad = vec![0f32; n * v];
    // Per row: (CE term, L1 term, BCE term, c*, ∂L/∂conf).
    let rows: Vec<(f64, f64, f64, f32, f32)> = grad
        .par_chunks_mut(v)
        .enumerate()
        .map(|(i, g)| {
            let zi = &z[i * v..(i + 1) * v];
            let ti = &pt[i * v..(i + 1) * v];
            let m = zi.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let mut sum = 0f32;
            for (gj, &zj) in g.iter_mut().zip(zi) {
                *gj = (zj - m).exp();
                sum += *gj;
            }
            let inv = 1.0 / sum;
            // g holds p_d from here on; then L1 = Σ|p − t| and Σ sign(p − t)·p.
            let (mut l1, mut sp) = (0f32, 0f32);
            for (gj, &tj) in g.iter_mut().zip(ti) {
                *gj *= inv;
                let d = *gj - tj;
                l1 += d.abs();
                sp += sign(d) * *gj;
            }
            let c_star = (1.0 - 0.5 * l1).clamp(0.0, 1.0);
            let ce = match t.label[i] {
                Some(l) if ce_w[i] > 0.0 => (sum.ln() - (zi[l as usize] - m)) as f64,
                _ => 0.0,
            };
            let a_ce = ce_k * ce_w[i];
            let a_l1 = mix.l1 as f32 * w_k * w[i];
            // ∂CE/∂z = p − onehot; ∂L1/∂z_k = p_k·(sign_k − Σ_j sign_j p_j).
            for (gj, &tj) in g.iter_mut().zip(ti) {
                let p = *gj;
                *gj = a_ce * p + a_l1 * p * (sign(p - tj) - sp);
            }
            if let Some(l) = t.label[i] {
                g[l as usize] -= a_ce;
            }
            let (bce, dconf) = match &conf {
                Some(c) => {
                    let zc = c[i];
                    // softplus(z) − c·z, written stably: max(z, 0) + log(1 + e^{−|z|}) − c·z.
                    let b = zc.max(0.0) + (-zc.abs()).exp().ln_1p() - c_star * zc;
                    let sig = 1.0 / (1.0 + (-zc).exp());
                    (b as f64, mix.bce as f32 * w_k * w[i] * (sig - c_star))
                }
                None => (0.0, 0.0),
            };
            (ce, l1 as f64, bce, c_star, dconf)
        })
        .collect();
    let mut value = 0f64;
    for (i, r) in rows.iter().enumerate() {
        value += (ce_k * ce_w[i]) as f64 * r.0;
        value += mix.l1 * (w_k * w[i]) as f64 * r.1;
        if conf.is_some() {
            value += mix.bce * (w_k * w[i]) as f64 * r.2;
        }
    }
    let dev = logits.device();
    let mut loss = with_gradient(logits, value as f32, Tensor::from_vec(grad, (n, v), dev)?)?;
    if let Some(c) = conf_logits {
        let gc = Tensor::from_vec(rows.iter().map(|r| r.4).collect::<Vec<_>>(), n, dev)?;
        loss = (loss + with_gradient(c, 0.0, gc)?)?;
    }
    Ok(LossOut { loss, c_star: rows.iter().map(|r| r.3).collect() })
}

fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
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
    use candle_core::Var;
    use dspark_drafter_models::nn::softmax;

    /// The loss written with candle's ops, differentiated by candle: the reference the fused
    /// [`loss`] must equal.
    fn reference(logits: &Tensor, conf_logits: Option<&Tensor>, t: &Targets, mix: Mix) -> Tensor {
        let n = t.valid.len();
        let p_d = softmax(logits).unwrap();
        let l1 = (&p_d - &t.p_target).unwrap().abs().unwrap().sum(D::Minus1).unwrap();
        let c_star: Vec<f32> =
            l1.to_vec1::<f32>().unwrap().iter().map(|d| (1.0 - 0.5 * d).clamp(0.0, 1.0)).collect();
        let mut total = Tensor::zeros((), candle_core::DType::F32, &Device::Cpu).unwrap();
        let logp = logits.broadcast_sub(&logsumexp(logits).unwrap()).unwrap();
        let idx: Vec<u32> = t.label.iter().map(|l| l.unwrap_or(0)).collect();
        let picked = logp
            .gather(&Tensor::from_vec(idx, (n, 1), &Device::Cpu).unwrap(), 1)
            .unwrap()
            .squeeze(1)
            .unwrap();
        let w: Vec<f32> = (0..n).map(|i| if t.label[i].is_some() { t.weight[i] } else { 0.0 }).collect();
        if let Some(ce) = weighted_mean(&picked.neg().unwrap(), &w).unwrap() {
            total = (total + (ce * mix.ce).unwrap()).unwrap();
        }
        let w: Vec<f32> = (0..n).map(|i| if t.valid[i] { t.weight[i] } else { 0.0 }).collect();
        if let Some(m) = weighted_mean(&l1, &w).unwrap() {
            total = (total + (m * mix.l1).unwrap()).unwrap();
        }
        if let Some(z) = conf_logits {
            let c = Tensor::from_vec(c_star, n, &Device::Cpu).unwrap();
            let bce = ((z.relu().unwrap()
                + (z.abs().unwrap().neg().unwrap().exp().unwrap() + 1.0).unwrap().log().unwrap())
            .unwrap()
                - (&c * z).unwrap())
            .unwrap();
            if let Some(m) = weighted_mean(&bce, &w).unwrap() {
                total = (total + (m * mix.bce).unwrap()).unwrap();
            }
        }
        total
    }

    #[test]
    fn fused_loss_matches_autograd_of_the_written_formula() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (n, v) = (9, 37);
        let z: Vec<f32> = (0..n * v).map(|_| rng.random_range(-4.0..4.0)).collect();
        let c: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
        let mut pt: Vec<f32> = (0..n * v).map(|_| rng.random_range(0.0f32..1.0).powi(4)).collect();
        for row in pt.chunks_mut(v) {
            let s: f32 = row.iter().sum();
            row.iter_mut().for_each(|x| *x /= s);
        }
        let t = Targets {
            label: (0..n).map(|i| if i % 4 == 3 { None } else { Some((i * 5 % v) as u32) }).collect(),
            valid: (0..n).map(|i| i != 7).collect(),
            weight: (0..n).map(|i| 1.0 / (1.0 + i as f32)).collect(),
            p_target: Tensor::from_vec(pt, (n, v), &Device::Cpu).unwrap(),
        };
        for mix in [DSPARK, CE_ONLY] {
            let zv = Var::from_vec(z.clone(), (n, v), &Device::Cpu).unwrap();
            let cv = Var::from_vec(c.clone(), n, &Device::Cpu).unwrap();
            let got = loss(zv.as_tensor(), Some(cv.as_tensor()), &t, mix).unwrap().loss;
            let want = reference(zv.as_tensor(), Some(cv.as_tensor()), &t, mix);
            let (g, w) = (got.to_scalar::<f32>().unwrap(), want.to_scalar::<f32>().unwrap());
            assert!((g - w).abs() < 1e-5 * w.abs().max(1.0), "{mix:?}: loss {g} vs {w}");
            let (gg, gw) = (got.backward().unwrap(), want.backward().unwrap());
            for var in [&zv, &cv] {
                let a = gg.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                // candle drops a branch scaled by 0 (BCE under CE_ONLY): no gradient means zeros.
                let b = gw
                    .get(var.as_tensor())
                    .map_or(vec![0.0; a.len()], |g| g.flatten_all().unwrap().to_vec1::<f32>().unwrap());
                for (x, y) in a.iter().zip(&b) {
                    assert!((x - y).abs() < 1e-6, "{mix:?}: gradient {x} vs {y}");
                }
            }
        }
    }

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
