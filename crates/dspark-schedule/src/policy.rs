//! How many drafts each running request verifies this step.
//!
//! Every policy decides from the drafter's predicted prefix survivals `a_{r,j}` only, and whether
//! slot `(r, j)` is verified never depends on draft `j` of request `r` itself (a_{r,j} is a
//! function of the drafts before j), so verification stays exact whatever the policy.

use crate::cost::CostTable;
use crate::ScheduleError;
use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// No drafting: plain decoding, one token per request per step.
    Plain,
    /// Verify every draft (γ per request).
    Fixed,
    /// Verify while the predicted prefix survival stays at or above this.
    Threshold(f32),
    /// DSpark's Algorithm 1 over all running requests, with its early stop.
    Dspark,
    /// The production variant: the budget is a global search (no early stop) on the confidences
    /// of two steps back; this step's slots are admitted by top-K survival.
    DsparkAsync,
}

impl FromStr for Policy {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ScheduleError::Policy(s.to_string());
        Ok(match s {
            "plain" | "none" => Policy::Plain,
            "fixed" => Policy::Fixed,
            "threshold" => Policy::Threshold(0.3),
            "dspark" => Policy::Dspark,
            "dspark-async" => Policy::DsparkAsync,
            _ => match s.strip_prefix("threshold:") {
                Some(v) => match v.parse::<f32>() {
                    Ok(p) if (0.0..=1.0).contains(&p) => Policy::Threshold(p),
                    _ => return Err(bad()),
                },
                None => return Err(bad()),
            },
        })
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::Plain => write!(f, "plain"),
            Policy::Fixed => write!(f, "fixed"),
            Policy::Threshold(p) => write!(f, "threshold:{p}"),
            Policy::Dspark => write!(f, "dspark"),
            Policy::DsparkAsync => write!(f, "dspark-async"),
        }
    }
}

impl Policy {
    pub fn drafts(&self) -> bool {
        *self != Policy::Plain
    }

    /// Policies that rank drafts by predicted survival need a confidence head.
    pub fn needs_confidence(&self) -> bool {
        matches!(self, Policy::Threshold(_) | Policy::Dspark | Policy::DsparkAsync)
    }
}

/// All `(request, position)` slots, best first: survival descending, ties to the earlier
/// position, then the earlier request. Because survivals never rise along a request's drafts,
/// any leading run of this order is a set of prefixes.
fn ranked(survival: &[Vec<f32>]) -> Vec<(f32, usize, usize)> {
    let mut slots: Vec<(f32, usize, usize)> = survival
        .iter()
        .enumerate()
        .flat_map(|(r, a)| a.iter().enumerate().map(move |(j, &x)| (x, j, r)))
        .collect();
    slots.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    slots
}

/// Algorithm 1: each request verifies its anchor; slots are admitted best first while
/// `Θ = τ · SPS(B)` rises, stopping at the first slot that does not raise it. Returns the
/// verify length per request. `survival[r]` is request r's prefix survivals `a_{r,1..}`.
pub fn prefix_schedule(survival: &[Vec<f32>], cost: &CostTable) -> Vec<usize> {
    let mut len = vec![0; survival.len()];
    let mut tau = survival.len() as f64;
    let mut theta = tau * cost.sps(survival.len());
    // B grows by one per admitted slot.
    for (b, (a, j, r)) in (survival.len() + 1..).zip(ranked(survival)) {
        let next = (tau + a as f64) * cost.sps(b);
        if next <= theta {
            break; // the early stop: nothing after this slot is looked at
        }
        debug_assert_eq!(len[r], j, "slots must be admitted as prefixes");
        len[r] += 1;
        tau += a as f64;
        theta = next;
    }
    len
}

/// The async policy's budget (paper §5.2): the number of best-ranked slots that maximises
/// `Θ = τ · SPS(B)` over every count — a global search, without Algorithm 1's early stop (the
/// budget comes from confidences two steps old, so looking past a non-improving slot peeks at
/// nothing of the drafts it will be applied to). Ties go to the smaller count.
pub fn global_budget(survival: &[Vec<f32>], cost: &CostTable) -> usize {
    let mut tau = survival.len() as f64;
    let (mut best, mut best_theta) = (0, tau * cost.sps(survival.len()));
    for (k, (a, _, _)) in ranked(survival).into_iter().enumerate() {
        tau += a as f64;
        let theta = tau * cost.sps(survival.len() + k + 1);
        if theta > best_theta {
            (best, best_theta) = (k + 1, theta);
        }
    }
    best
}

/// The best `k` slots by survival, as verify lengths.
pub fn top_k(survival: &[Vec<f32>], k: usize) -> Vec<usize> {
    let mut len = vec![0; survival.len()];
    for (_, j, r) in ranked(survival).into_iter().take(k) {
        debug_assert_eq!(len[r], j);
        len[r] += 1;
    }
    len
}

/// One step's decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub lengths: Vec<usize>,
    /// Expected committed tokens `Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j})`.
    pub expected_tokens: f64,
    /// Tokens in the verify forward, `Σ_r (1 + ℓ_r)`.
    pub verify_tokens: usize,
}

/// Plans judged together before drafting pauses, and the most kept. One round's confidences say
/// little about the next (a low-confidence draft is usually one hard token: a name, a new line),
/// so a pause on one plan's prediction threw away the rounds after it. On the Qwen drafter with a
/// drafting round at 0.07× a step, each round whose first survival fell under the 8 % that
/// verifying one draft costs paused drafting for 16+ steps: 448 of 586 steps went undrafted and
/// the policy ran at 1.21× plain against 1.47× for verifying every draft (docs/TRAINING.md).
const PROBE_PLANS: usize = 4;
const WINDOW_PLANS: usize = 8;
/// Rounds without drafting after a window of plans that predicted drafting would not pay;
/// doubled while probes keep failing, up to [`MAX_BACKOFF`].
const PROBE_AFTER: usize = 16;
const MAX_BACKOFF: usize = 256;

/// The policy plus the state it keeps between steps.
pub struct Scheduler {
    pub policy: Policy,
    pub cost: CostTable,
    budgets: VecDeque<usize>,
    /// The latest plans since drafting last paused: (expected tokens, predicted seconds with
    /// drafting, predicted seconds of plain steps for the same requests, requests).
    plans: VecDeque<(f64, f64, f64, usize)>,
    skip: usize,
    backoff: usize,
}

impl Scheduler {
    pub fn new(policy: Policy, cost: CostTable) -> Self {
        Self { policy, cost, budgets: VecDeque::new(), plans: VecDeque::new(), skip: 0, backoff: PROBE_AFTER }
    }

    /// Whether to draft this step. The hardware-aware policies skip drafting (plain steps) when
    /// their latest plans predicted that drafting plus verifying would commit tokens more slowly
    /// than plain decoding, probing again after a while. The decision uses past steps only.
    pub fn should_draft(&mut self) -> bool {
        if !self.policy.drafts() {
            return false;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return false;
        }
        true
    }

    /// Verify lengths for this step's drafts (`survival[r]`: request r's prefix survivals, one
    /// per draft it has; for `fixed`, only the count matters).
    pub fn plan(&mut self, survival: &[Vec<f32>]) -> Plan {
        let lengths = match self.policy {
            Policy::Plain => vec![0; survival.len()],
            Policy::Fixed => survival.iter().map(Vec::len).collect(),
            Policy::Threshold(p) => {
                survival.iter().map(|a| a.iter().take_while(|&&x| x >= p).count()).collect()
            }
            Policy::Dspark => prefix_schedule(survival, &self.cost),
            Policy::DsparkAsync => {
                let now = global_budget(survival, &self.cost);
                self.budgets.push_back(now);
                let k = if self.budgets.len() >= 3 { self.budgets.pop_front().unwrap() } else { 0 };
                top_k(survival, k)
            }
        };
        let expected_tokens = survival
            .iter()
            .zip(&lengths)
            .map(|(a, &l)| 1.0 + a[..l].iter().map(|&x| x as f64).sum::<f64>())
            .sum();
        let verify_tokens = survival.len() + lengths.iter().sum::<usize>();
        let plan = Plan { lengths, expected_tokens, verify_tokens };
        // A step with no drafts at all (a drafter with nothing to propose, such as `auto` while
        // its own gate keeps the model drafter out) paid for no drafting and says nothing about
        // whether drafting pays: counted, four of them paused the drafter that was doing well.
        let drafted = survival.iter().any(|a| !a.is_empty());
        if drafted && matches!(self.policy, Policy::Dspark | Policy::DsparkAsync) {
            self.gate(&plan, survival.len());
        }
        plan
    }

    /// Pauses drafting when the latest plans, together, predict fewer tokens per second than
    /// plain steps would commit in the same time.
    /// Called for steps with drafts only, so `requests` ≥ 1.
    fn gate(&mut self, plan: &Plan, requests: usize) {
        let c = &self.cost;
        let with_s = c.draft_s(requests) + c.forward_s(plan.verify_tokens);
        self.plans.push_back((plan.expected_tokens, with_s, c.forward_s(requests), requests));
        if self.plans.len() > WINDOW_PLANS {
            self.plans.pop_front();
        }
        if self.plans.len() < PROBE_PLANS {
            return;
        }
        let (tokens, with_s, plain_s, plain_tokens) =
            self.plans.iter().fold((0.0, 0.0, 0.0, 0usize), |(t, w, p, n), &(t1, w1, p1, n1)| {
                (t + t1, w + w1, p + p1, n + n1)
            });
        if tokens / with_s < plain_tokens as f64 / plain_s {
            self.skip = self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            self.plans.clear();
        } else if self.plans.len() == WINDOW_PLANS {
            self.backoff = PROBE_AFTER;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(forward: &[(usize, f64)]) -> CostTable {
        CostTable { model: "t".into(), drafter: None, threads: 1, forward: forward.to_vec(), draft: vec![] }
    }

    /// The paper's Appendix A situation: verifying one draft costs more than it returns on its
    /// own, but a second, highly likely draft would make the pair worth it. Searching past the
    /// first non-improving slot would verify draft 1 only when draft 2 (chosen after seeing
    /// draft 1) looks good, a decision that peeks at draft 1 itself. The early stop returns 0.
    #[test]
    fn appendix_a_counterexample_verifies_nothing() {
        let c = cost(&[(1, 0.010), (2, 0.020), (3, 0.020)]);
        let a = vec![vec![0.9f32, 0.85]];
        // Θ: ℓ=0 → 100, ℓ=1 → 95, ℓ=2 → 137.5: the best prefix is 2, the exact answer 0.
        assert_eq!(prefix_schedule(&a, &c), vec![0]);
        let theta = |l: usize| (1.0 + a[0][..l].iter().map(|&x| x as f64).sum::<f64>()) * c.sps(1 + l);
        assert!(theta(2) > theta(0), "without the early stop ℓ = 2 would win");
    }

    /// The async budget searches past the first non-improving slot: on the Appendix A example it
    /// finds the pair worth verifying that Algorithm 1's early stop declines.
    #[test]
    fn async_budget_is_the_global_optimum_without_the_early_stop() {
        let c = cost(&[(1, 0.010), (2, 0.020), (3, 0.020)]);
        let a = vec![vec![0.9f32, 0.85]];
        assert_eq!(global_budget(&a, &c), 2);
        assert_eq!(prefix_schedule(&a, &c), vec![0]);
        // Steps 0 and 1 have no budget two steps old yet; step 2 uses step 0's.
        let mut s = Scheduler::new(Policy::DsparkAsync, c);
        assert_eq!(s.plan(&a).lengths, vec![0]);
        assert_eq!(s.plan(&a).lengths, vec![0]);
        assert_eq!(s.plan(&a).lengths, vec![2]);
        // A flat cost curve makes every slot with positive survival pay; a steep one none.
        let flat = cost(&[(1, 0.010), (64, 0.010)]);
        assert_eq!(global_budget(&[vec![0.5, 0.2, 0.01], vec![0.3]], &flat), 4);
        let steep = cost(&[(1, 0.010), (64, 0.640)]);
        assert_eq!(global_budget(&[vec![0.5, 0.2, 0.01], vec![0.3]], &steep), 0);
    }

    #[test]
    fn admits_prefixes_best_first_across_requests() {
        // Per-token cost falls with batch size: every slot worth more than ~0.05 pays.
        let c = cost(&[(1, 0.010), (16, 0.0105)]);
        let a = vec![vec![0.9f32, 0.5, 0.005], vec![0.8, 0.7, 0.6]];
        let l = prefix_schedule(&a, &c);
        assert_eq!(l, vec![2, 3]);
        for (al, &n) in a.iter().zip(&l) {
            assert!(al[..n].windows(2).all(|w| w[0] >= w[1]));
        }
    }

    #[test]
    fn ties_go_to_the_earlier_position() {
        let a = vec![vec![0.5f32, 0.5], vec![0.5, 0.5]];
        assert_eq!(top_k(&a, 1), vec![1, 0]);
        assert_eq!(top_k(&a, 2), vec![1, 1]);
        assert_eq!(top_k(&a, 3), vec![2, 1]);
    }

    #[test]
    fn a_flat_table_admits_everything_and_a_steep_one_nothing() {
        let a = vec![vec![0.9f32, 0.4, 0.01], vec![0.3, 0.001]];
        assert_eq!(prefix_schedule(&a, &cost(&[(1, 0.01), (64, 0.01)])), vec![3, 2]);
        // Cost proportional to tokens: any slot with a < 1 lowers Θ.
        assert_eq!(prefix_schedule(&a, &cost(&[(1, 0.01), (64, 0.64)])), vec![0, 0]);
    }

    #[test]
    fn policies_and_the_async_budget_lag() {
        let c = cost(&[(1, 0.01), (64, 0.01)]);
        let a = vec![vec![0.9f32, 0.8], vec![0.7]];
        let mut fixed = Scheduler::new(Policy::Fixed, c.clone());
        assert_eq!(fixed.plan(&a).lengths, vec![2, 1]);
        let mut th = Scheduler::new("threshold:0.75".parse().unwrap(), c.clone());
        let p = th.plan(&a);
        assert_eq!(p.lengths, vec![2, 0]);
        assert_eq!(p.verify_tokens, 4);
        assert!((p.expected_tokens - (2.0 + 0.9 + 0.8)).abs() < 1e-6);
        let mut asy = Scheduler::new(Policy::DsparkAsync, c.clone());
        assert_eq!(asy.plan(&a).lengths, vec![0, 0], "no budget two steps back yet");
        assert_eq!(asy.plan(&[vec![0.5]]).lengths, vec![0]);
        // Step 3 uses step 1's budget (3 slots) on step 3's confidences.
        assert_eq!(asy.plan(&[vec![0.2, 0.1], vec![0.9, 0.8, 0.7, 0.6]]).lengths, vec![0, 3]);
        assert_eq!(asy.plan(&a).lengths, vec![1, 0], "step 2's budget was 1");
        let mut plain = Scheduler::new(Policy::Plain, c);
        assert!(!plain.should_draft());
        assert!("threshold:2".parse::<Policy>().is_err() && "fast".parse::<Policy>().is_err());
    }

    #[test]
    fn stops_drafting_when_drafting_cannot_pay_and_probes_again() {
        let mut c = cost(&[(1, 0.010), (2, 0.020), (8, 0.080)]);
        c.draft = vec![(1, 0.005)];
        let mut s = Scheduler::new(Policy::Dspark, c);
        // A probe is a few plans: the first ones never pause drafting.
        for _ in 1..PROBE_PLANS {
            assert!(s.should_draft());
            assert_eq!(s.plan(&[vec![0.3, 0.1]]).lengths, vec![0]);
        }
        assert!(s.should_draft());
        s.plan(&[vec![0.3, 0.1]]);
        let skipped = (0..PROBE_AFTER).filter(|_| !s.should_draft()).count();
        assert_eq!(skipped, PROBE_AFTER);
        assert!(s.should_draft(), "a probe after the pause");
        for _ in 0..PROBE_PLANS {
            assert!(s.should_draft());
            s.plan(&[vec![0.3]]);
        }
        assert_eq!(
            (0..2 * PROBE_AFTER).filter(|_| !s.should_draft()).count(),
            2 * PROBE_AFTER,
            "backoff doubles"
        );
    }

    /// One round with a hard first draft does not pause drafting while the rounds around it
    /// pay: the gate judges the latest plans together (a pause on one plan cost the Qwen drafter
    /// 448 of 586 steps).
    #[test]
    fn one_unpromising_round_among_paying_ones_keeps_drafting() {
        let mut c = cost(&[(1, 0.010), (2, 0.0108), (8, 0.0137)]);
        c.draft = vec![(1, 0.0007)];
        let mut s = Scheduler::new(Policy::Dspark, c);
        let good = vec![0.7f32, 0.5, 0.35, 0.25, 0.18, 0.12, 0.08];
        let hard = vec![0.03f32, 0.02, 0.01, 0.005, 0.003, 0.002, 0.001];
        for round in 0..64 {
            assert!(s.should_draft(), "round {round} drafts");
            let a = if round % 3 == 1 { &hard } else { &good };
            let plan = s.plan(std::slice::from_ref(a));
            assert_eq!(plan.lengths[0] == 0, round % 3 == 1, "round {round}: {:?}", plan.lengths);
        }
        // Steps without drafts are not judged: they neither pause drafting nor count as a probe.
        for _ in 0..4 * WINDOW_PLANS {
            assert!(s.should_draft());
            assert_eq!(s.plan(&[vec![]]).lengths, vec![0]);
        }
        // A run of hard rounds does pause it.
        let paused = (0..WINDOW_PLANS).any(|_| {
            let draft = s.should_draft();
            if draft {
                s.plan(std::slice::from_ref(&hard));
            }
            !draft
        });
        assert!(paused || !s.should_draft(), "a window of hard rounds pauses drafting");
    }
}
