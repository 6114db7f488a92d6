//! Exact verification (Leviathan et al. / Chen et al.): accept draft `x` with probability
//! `min(1, p_t(x) / p_d(x))` left to right; at the first rejection draw from
//! `normalize(max(0, p_t − p_d))` (or `p_t` when that has no mass); if every draft survives,
//! draw the bonus token from the target's next distribution. The committed tokens are then
//! distributed exactly as plain sampling from `p_t`. This module knows nothing about drafters.

use crate::drafter::DraftDist;
use dspark_sampling::{argmax, Sampler, SamplingParams};

/// Residual mass below which the residual distribution is treated as empty.
const RESIDUAL_EPS: f64 = 1e-12;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Drafts accepted (a prefix of the proposal).
    pub accepted: usize,
    /// The correction token (after a rejection) or the bonus token (all accepted).
    pub next: u32,
}

/// `target(i)` gives the target's logits at verify row `i` (row 0 scores the first draft,
/// row `drafts.len()` gives the bonus distribution); `params` shapes them exactly as plain
/// sampling does. Rows are only computed when reached.
pub fn verify<'a>(
    target: impl Fn(usize) -> &'a [f32],
    drafts: &[u32],
    dists: &[DraftDist],
    params: &SamplingParams,
    rng: &mut Sampler,
) -> Verdict {
    debug_assert_eq!(drafts.len(), dists.len());
    if params.is_greedy() {
        // p_t is one-hot on the argmax: accept while equal, then the argmax is the next token,
        // whatever p_d was.
        for (i, &x) in drafts.iter().enumerate() {
            let t = argmax(target(i)) as u32;
            if t != x {
                return Verdict { accepted: i, next: t };
            }
        }
        return Verdict { accepted: drafts.len(), next: argmax(target(drafts.len())) as u32 };
    }
    for (i, (&x, q)) in drafts.iter().zip(dists).enumerate() {
        let p = params.distribution(target(i));
        if rng.uniform() < accept_probability(&p, q, x) {
            continue;
        }
        return Verdict { accepted: i, next: rng.draw(&residual(p, q, x)) as u32 };
    }
    let p = params.distribution(target(drafts.len()));
    Verdict { accepted: drafts.len(), next: rng.draw(&p) as u32 }
}

/// `min(1, p(x) / q(x))`.
pub fn accept_probability(p: &[f64], q: &DraftDist, x: u32) -> f64 {
    let qx = match q {
        DraftDist::OneHot => 1.0,
        DraftDist::Dense(q) => q[x as usize],
    };
    if qx <= 0.0 {
        return 0.0;
    }
    (p[x as usize] / qx).min(1.0)
}

/// `normalize(max(0, p − q))`, or `p` when that has (numerically) no mass.
pub fn residual(mut p: Vec<f64>, q: &DraftDist, x: u32) -> Vec<f64> {
    let original = p.clone();
    match q {
        DraftDist::OneHot => p[x as usize] = (p[x as usize] - 1.0).max(0.0),
        DraftDist::Dense(q) => {
            for (pi, qi) in p.iter_mut().zip(q) {
                *pi = (*pi - qi).max(0.0);
            }
        }
    }
    let mass: f64 = p.iter().sum();
    if mass <= RESIDUAL_EPS {
        return original;
    }
    for v in p.iter_mut() {
        *v /= mass;
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The probability of every possible committed sequence of one round, by enumerating the
    /// drafter's and the verifier's random choices exactly (no sampling). The drafter here is
    /// context-free: draft i is drawn from `pd[i]`; the target's rows are `pt[i]`.
    struct Enumeration<'a> {
        pt: &'a [Vec<f64>],
        pd: &'a [Vec<f64>],
        out: Vec<(Vec<u32>, f64)>,
    }

    impl Enumeration<'_> {
        fn round(&mut self, i: usize, prob: f64, prefix: &[u32]) {
            let with = |t: usize| [prefix, &[t as u32]].concat();
            if i == self.pd.len() {
                for (t, &p) in self.pt[i].iter().enumerate() {
                    self.out.push((with(t), prob * p)); // the bonus token
                }
                return;
            }
            let q = DraftDist::Dense(self.pd[i].clone());
            for (x, &qx) in self.pd[i].iter().enumerate().filter(|(_, &qx)| qx > 0.0) {
                let acc = accept_probability(&self.pt[i], &q, x as u32);
                self.round(i + 1, prob * qx * acc, &with(x));
                for (t, &rt) in residual(self.pt[i].clone(), &q, x as u32).iter().enumerate() {
                    self.out.push((with(t), prob * qx * (1.0 - acc) * rt));
                }
            }
        }
    }

    fn committed_distribution(pt: &[Vec<f64>], pd: &[Vec<f64>]) -> Vec<(Vec<u32>, f64)> {
        let mut e = Enumeration { pt, pd, out: Vec::new() };
        e.round(0, 1.0, &[]);
        e.out
    }

    fn random_dist(rng: &mut rand::rngs::StdRng, v: usize, zeros: bool) -> Vec<f64> {
        let mut p: Vec<f64> = (0..v).map(|_| rng.random::<f64>().powi(3)).collect();
        if zeros {
            p[rng.random_range(0..v)] = 0.0;
        }
        let s: f64 = p.iter().sum();
        p.iter().map(|x| x / s).collect()
    }

    #[test]
    fn enumerated_output_distribution_equals_the_target_exactly() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for trial in 0..40 {
            let v = 2 + trial % 4;
            let gamma = 1 + trial % 3;
            let pt: Vec<Vec<f64>> = (0..=gamma).map(|_| random_dist(&mut rng, v, trial % 2 == 0)).collect();
            let pd: Vec<Vec<f64>> = (0..gamma).map(|_| random_dist(&mut rng, v, trial % 3 == 0)).collect();
            let outcomes = committed_distribution(&pt, &pd);
            let total: f64 = outcomes.iter().map(|(_, p)| p).sum();
            assert!((total - 1.0).abs() < 1e-9, "total {total}");
            // The target rows do not depend on context here, so at every position j, among the
            // rounds that commit a token there, that token must follow p_t row j whatever the
            // tokens before it.
            for j in 0..=gamma {
                let mut by_prefix: std::collections::HashMap<Vec<u32>, Vec<f64>> = Default::default();
                for (s, p) in &outcomes {
                    if s.len() > j {
                        by_prefix.entry(s[..j].to_vec()).or_insert_with(|| vec![0.0; v])[s[j] as usize] += p;
                    }
                }
                for (prefix, counts) in by_prefix {
                    let mass: f64 = counts.iter().sum();
                    if mass < 1e-12 {
                        continue;
                    }
                    for (t, (&c, &want)) in counts.iter().zip(&pt[j]).enumerate() {
                        let got = c / mass;
                        assert!(
                            (got - want).abs() < 1e-9,
                            "trial {trial}, position {j} after {prefix:?}: token {t} has {got}, target {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn greedy_accepts_while_equal_to_the_argmax() {
        let rows = [vec![0.0f32, 5.0, 1.0], vec![3.0, 0.0, 1.0], vec![0.0, 0.0, 9.0]];
        let p = SamplingParams::default();
        let mut rng = Sampler::new(0);
        let v = verify(|i| &rows[i], &[1, 2], &[DraftDist::OneHot, DraftDist::OneHot], &p, &mut rng);
        assert_eq!(v, Verdict { accepted: 1, next: 0 });
        let v = verify(|i| &rows[i], &[1, 0], &[DraftDist::OneHot, DraftDist::OneHot], &p, &mut rng);
        assert_eq!(v, Verdict { accepted: 2, next: 2 });
    }

    #[test]
    fn residual_falls_back_to_the_target_when_it_has_no_mass() {
        let p = vec![0.0, 1.0, 0.0];
        assert_eq!(residual(p.clone(), &DraftDist::OneHot, 1), p);
        let r = residual(vec![0.5, 0.5], &DraftDist::Dense(vec![0.25, 0.75]), 1);
        assert_eq!(r, vec![1.0, 0.0]);
    }
}
