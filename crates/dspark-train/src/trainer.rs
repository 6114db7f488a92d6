//! The training loop: batches of anchored blocks (or EAGLE-3's unrolled steps) over
//! target-regenerated samples, target features computed on the fly by the runtime's forward,
//! AdamW with warmup + cosine, checkpoints every N steps and on request, exact resume.

use crate::blocks::{anchor_candidates, block_slots, position_weight, sample_anchors};
use crate::checkpoint;
use crate::data::Sample;
use crate::loss::{self, Mix, Targets};
use crate::optim::{lr_at, AdamW};
use crate::{Result, TrainError};
use candle_core::{Device, Tensor, Var};
use dspark_drafter_models::common::stack_taps;
use dspark_drafter_models::nn::softmax;
use dspark_drafter_models::{DrafterConfig, DrafterNet, Method, Store};
use dspark_model::{Model, SeqInput, TapSpec};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A loss, per-position `(Σ c*, count)` acceptance estimates, and the positions trained.
pub type BatchLoss = (Tensor, Vec<(f32, u32)>, usize);

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainConfig {
    pub steps: usize,
    /// Sequences per step.
    pub batch: usize,
    /// Blocks anchored per sequence (block drafters).
    pub anchors: usize,
    /// Tokens per sequence (longer samples are cut).
    pub max_len: usize,
    pub lr: f64,
    pub warmup_frac: f64,
    pub clip: f64,
    pub weight_decay: f64,
    pub seed: u64,
    pub checkpoint_every: usize,
    /// EAGLE-3's per-step loss decay.
    pub ttt_decay: f64,
    /// DSpark's cross-entropy weight in place of the paper's 0.1 (L1 0.9 and BCE 1.0 stay).
    /// Absent in runs saved before it existed, which keep the paper's mix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ce_weight: Option<f64>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            steps: 1000,
            batch: 4,
            anchors: 16,
            max_len: 512,
            lr: 6e-4,
            warmup_frac: 0.04,
            clip: 1.0,
            weight_decay: 0.0,
            seed: 0,
            checkpoint_every: 100,
            ttt_decay: 0.8,
            ce_weight: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainState {
    pub step: usize,
    pub config: TrainConfig,
    pub elapsed_s: f64,
    pub positions: u64,
}

/// What one step reports.
#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    pub step: usize,
    pub loss: f32,
    /// Mean `c* = 1 − ½‖p_d − p_t‖₁` per draft position: the acceptance the drafter would get.
    pub accept: Vec<f32>,
    pub lr: f64,
    pub grad_norm: f64,
    /// Draft positions trained on this step.
    pub positions: usize,
    pub step_s: f64,
    /// Where the step's time went (seconds): the profile `docs/TRAINING.md` reads.
    pub phases: Phases,
}

/// Seconds per phase of a training step.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Phases {
    /// Target features: read from the cache, or the target's forward.
    pub features: f64,
    /// The drafter's forward up to the draft logits, and the target's distribution.
    pub forward: f64,
    /// The loss and its gradient at the logits.
    pub loss: f64,
    /// Back-propagation through the drafter.
    pub backward: f64,
    /// Gradient clipping and the AdamW update.
    pub optimizer: f64,
}

pub struct Trainer {
    pub target: Arc<Model>,
    pub net: DrafterNet,
    pub config: DrafterConfig,
    pub opt: AdamW,
    pub cfg: TrainConfig,
    data: Vec<Sample>,
    out: PathBuf,
    frozen: BTreeMap<String, Tensor>,
    /// The target's LM head over the draft vocabulary (f32, constant).
    target_head: Tensor,
    t2d: HashMap<u32, u32>,
    pub state: TrainState,
    /// Precomputed target features, when given.
    pub cache: Option<crate::features::FeatureCache>,
}

/// Checkpoint names that never train: the draft vocabulary map and EAGLE-3's head (shared
/// parts are frozen, as in the paper).
fn trainable(name: &str) -> bool {
    name != "d2t" && name != "lm_head.weight"
}

impl Trainer {
    /// Starts from the checkpoint in `init` (or resumes from `out` when it holds a run).
    pub fn new(
        target: Arc<Model>,
        target_name: &str,
        init: &Path,
        data: Vec<Sample>,
        cfg: TrainConfig,
        out: &Path,
        resume: bool,
    ) -> Result<Self> {
        let (src, state) = if resume {
            checkpoint::clean_temporaries(out)?;
            let src = checkpoint::latest(out)?;
            let state_path = src.join(checkpoint::STATE);
            let text = std::fs::read_to_string(&state_path).map_err(|e| {
                TrainError::Data(format!(
                    "cannot resume: {} ({e}); start without --resume",
                    state_path.display()
                ))
            })?;
            let st: TrainState = serde_json::from_str(&text).map_err(|e| {
                TrainError::Data(format!(
                    "cannot resume: {}: {e}; start without --resume",
                    state_path.display()
                ))
            })?;
            (src, st)
        } else {
            (init.to_path_buf(), TrainState { step: 0, config: cfg, elapsed_s: 0.0, positions: 0 })
        };
        let cfg = state.config.clone();
        if resume {
            // Steps logged after the last checkpoint will run again.
            let log = out.join("train_log.jsonl");
            if let Ok(text) = std::fs::read_to_string(&log) {
                let keep: Vec<&str> = text
                    .lines()
                    .filter(|l| {
                        serde_json::from_str::<serde_json::Value>(l)
                            .ok()
                            .and_then(|v| v["step"].as_u64())
                            .is_some_and(|s| s as usize <= state.step)
                    })
                    .collect();
                std::fs::write(&log, keep.iter().map(|l| format!("{l}\n")).collect::<String>())
                    .map_err(|e| TrainError::io(&log, e))?;
            }
        }
        let mut config = dspark_drafter_models::read_config(&src)?;
        if !resume {
            if let Some(ext) = config.dspark.as_mut() {
                // Temperatures fitted to the init's confidences do not fit the weights this run
                // trains: `dspark calibrate` fits new ones.
                ext.calibration_temperatures = None;
                ext.calibration_biases = None;
            }
        }
        config.check_target(&target, &dspark_drafter_models::TargetId::of(&target, target_name))?;
        let store = Store::load(&src.join("model.safetensors"))?;
        let mut vars = Vec::new();
        let mut frozen = BTreeMap::new();
        let mut map = BTreeMap::new();
        for name in store.names().cloned().collect::<Vec<_>>() {
            let t = store.raw(&name).expect("listed").clone();
            if trainable(&name) {
                let v = Var::from_tensor(&t.to_dtype(candle_core::DType::F32)?)?;
                map.insert(name.clone(), v.as_tensor().clone());
                vars.push((name, v));
            } else {
                map.insert(name.clone(), t.clone());
                frozen.insert(name, t);
            }
        }
        let mut net = dspark_drafter_models::from_store(
            config.clone(),
            &Store::from_map(map, "training variables"),
            target.clone(),
        )?;
        // Keep only what the network uses (a DeepSpec file also carries the target's tensors).
        let used: Vec<String> = match &net {
            DrafterNet::Block(m) => m.tensors().keys().cloned().collect(),
            DrafterNet::Eagle3(m) => m.tensors().keys().cloned().collect(),
        };
        vars.retain(|(n, _)| used.contains(n));
        if let DrafterNet::Block(m) = &mut net {
            m.use_dense_head()?;
        }
        let ids = net.vocab().target_ids();
        let t2d = ids.iter().enumerate().map(|(i, &t)| (t, i as u32)).collect();
        let target_head =
            Tensor::from_vec(target.lm_head_rows(&ids)?, (ids.len(), target.config.hidden), &Device::Cpu)?;
        let mut opt = AdamW::new(vars, cfg.weight_decay)?;
        if resume {
            opt.load(&src.join(checkpoint::OPTIMIZER))?;
            if opt.step != state.step {
                return Err(TrainError::Data(format!(
                    "cannot resume: {} mixes two checkpoints (optimiser at step {}, run state at step {}); \
                     remove it to resume from an earlier one, or start without --resume",
                    src.display(),
                    opt.step,
                    state.step
                )));
            }
        }
        let data: Vec<Sample> = data
            .into_iter()
            .filter(|s| {
                s.tokens.len().saturating_sub(s.prompt_len) >= 14
                    && !anchor_candidates(s, cfg.max_len).is_empty()
            })
            .collect();
        if data.is_empty() {
            return Err(TrainError::Data(format!(
                "no usable samples: each needs ≥ 14 answer tokens within the first {} tokens",
                cfg.max_len
            )));
        }
        Ok(Self {
            target,
            net,
            config,
            opt,
            cfg,
            data,
            out: out.to_path_buf(),
            frozen,
            target_head,
            t2d,
            state,
            cache: None,
        })
    }

    pub fn samples(&self) -> usize {
        self.data.len()
    }

    /// Target hidden states of a sample: fused-layer input `(L, m·d)` and final norm `(L, d)`.
    fn features(&self, index: usize, tokens: &[u32]) -> Result<(Tensor, Tensor)> {
        let d = self.target.config.hidden;
        let layers = self.config.target_layer_ids.clone();
        if let Some(c) = &self.cache {
            if let Some(f) = c.get(index, &layers, tokens.len())? {
                return Ok(f);
            }
        }
        let mut cache = self.target.new_cache(tokens.len());
        let seq =
            SeqInput { cache: &mut cache, tokens, logit_rows: vec![], tap_rows: (0..tokens.len()).collect() };
        let out =
            self.target.forward(&mut [seq], &TapSpec { layers: layers.clone(), final_norm: true })?.remove(0);
        let f = stack_taps(&out.taps, tokens.len(), d, layers.len())?;
        let fin = Tensor::from_vec(out.final_norm.expect("asked for"), (tokens.len(), d), &Device::Cpu)?;
        Ok((f, fin))
    }

    /// The target's distribution over the draft vocabulary at `rows` (constant). Overlapping
    /// blocks ask for the same row several times; each distinct row is computed once.
    fn target_probs(&self, fin: &Tensor, rows: &[usize]) -> Result<Tensor> {
        let mut distinct: Vec<usize> = rows.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let at = |r: &usize| distinct.binary_search(r).expect("listed") as u32;
        let pick = Tensor::from_vec(rows.iter().map(at).collect::<Vec<_>>(), rows.len(), &Device::Cpu)?;
        let idx = Tensor::from_vec(
            distinct.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            distinct.len(),
            &Device::Cpu,
        )?;
        let p = softmax(&dspark_drafter_models::nn::matmul_t_const(
            &fin.index_select(&idx, 0)?,
            &self.target_head,
        )?)?;
        Ok(p.index_select(&pick, 0)?.detach())
    }

    /// Loss of one sample, with per-position `c*` sums and counts, and positions trained.
    fn sample_loss(&self, s: &Sample, rng: &mut impl Rng, ph: &mut Phases) -> Result<BatchLoss> {
        let len = s.tokens.len().min(self.cfg.max_len);
        let tokens = &s.tokens[..len];
        let t0 = Instant::now();
        let (feats, fin) = self.features(s.index, tokens)?;
        ph.features += t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let gamma = self.config.gamma();
        let mut acc = vec![(0f32, 0u32); gamma];
        match &self.net {
            DrafterNet::Block(m) => {
                let anchors = sample_anchors(&anchor_candidates(s, len), self.cfg.anchors, rng);
                let hidden = m.train_hidden(&feats, tokens, &anchors)?;
                let mut prev = Vec::new();
                let mut t = Targets {
                    label: vec![],
                    valid: vec![],
                    weight: vec![],
                    p_target: Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu)?,
                };
                let mut rows = Vec::new();
                for &p in &anchors {
                    for (k, slot) in block_slots(tokens, len, p, gamma).into_iter().enumerate() {
                        prev.push(slot.prev);
                        t.label.push(slot.label.and_then(|l| self.t2d.get(&l).copied()));
                        t.valid.push(slot.label.is_some());
                        t.weight.push(position_weight(k));
                        rows.push(slot.target_row);
                    }
                }
                t.p_target = self.target_probs(&fin, &rows)?;
                let (logits, conf) = m.train_heads(&hidden, &prev)?;
                let mix: Mix = match self.config.ext().method {
                    Method::Dspark => {
                        Mix { ce: self.cfg.ce_weight.unwrap_or(loss::DSPARK.ce), ..loss::DSPARK }
                    }
                    _ => loss::CE_ONLY,
                };
                ph.forward += t0.elapsed().as_secs_f64();
                let t0 = Instant::now();
                let out = loss::loss(&logits, conf.as_ref(), &t, mix)?;
                ph.loss += t0.elapsed().as_secs_f64();
                for (i, c) in out.c_star.iter().enumerate() {
                    if t.valid[i] {
                        acc[i % gamma].0 += c;
                        acc[i % gamma].1 += 1;
                    }
                }
                Ok((out.loss, acc, anchors.len() * gamma))
            }
            DrafterNet::Eagle3(m) => {
                let steps = m.train_ttt(&feats, tokens, gamma)?;
                let n = len - 1;
                let mut total = Tensor::zeros((), candle_core::DType::F32, &Device::Cpu)?;
                let mut wsum = 0f64;
                let mut positions = 0;
                for (j0, logits) in steps.iter().enumerate() {
                    let j = j0 + 1;
                    // Row i drafts the token at i + j + 1 from the context up to i + 1.
                    let valid: Vec<bool> = (0..n).map(|i| i + 1 >= s.prompt_len && i + j + 1 < len).collect();
                    let rows: Vec<usize> = (0..n).map(|i| (i + j).min(len - 1)).collect();
                    let pt = self.target_probs(&fin, &rows)?;
                    let w: Vec<f32> = valid.iter().map(|&v| if v { 1.0 } else { 0.0 }).collect();
                    let decay = self.cfg.ttt_decay.powi(j0 as i32);
                    if let Some(l) = loss::soft_ce(logits, &pt, &w)? {
                        total = (total + (l * decay)?)?;
                        wsum += decay;
                    }
                    let pd = softmax(&logits.detach())?;
                    let l1 = (&pd - &pt)?.abs()?.sum(1)?.to_vec1::<f32>()?;
                    for (i, d) in l1.iter().enumerate() {
                        if valid[i] {
                            acc[j0].0 += (1.0 - 0.5 * d).clamp(0.0, 1.0);
                            acc[j0].1 += 1;
                            positions += 1;
                        }
                    }
                }
                let total = if wsum > 0.0 { (total / wsum)? } else { total };
                ph.forward += t0.elapsed().as_secs_f64();
                Ok((total, acc, positions))
            }
        }
    }

    /// The loss of the batch of `step`, drawn from (seed, step): the same batch whenever the
    /// step runs, so a resumed run repeats the uninterrupted one. Also per-position acceptance
    /// estimates and the positions trained.
    pub fn batch_loss(&self, step: usize) -> Result<BatchLoss> {
        self.batch_loss_timed(step, &mut Phases::default())
    }

    fn batch_loss_timed(&self, step: usize, ph: &mut Phases) -> Result<BatchLoss> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(
            self.cfg.seed ^ (step as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        let mut total: Option<Tensor> = None;
        let gamma = self.config.gamma();
        let mut acc = vec![(0f32, 0u32); gamma];
        let mut positions = 0;
        for _ in 0..self.cfg.batch {
            let s = &self.data[rng.random_range(0..self.data.len())];
            let (l, a, p) = self.sample_loss(s, &mut rng, ph)?;
            positions += p;
            for (x, y) in acc.iter_mut().zip(a) {
                x.0 += y.0;
                x.1 += y.1;
            }
            total = Some(match total {
                None => l,
                Some(t) => (t + l)?,
            });
        }
        Ok(((total.expect("batch ≥ 1") / self.cfg.batch as f64)?, acc, positions))
    }

    /// One optimisation step.
    pub fn step(&mut self) -> Result<StepReport> {
        let t0 = Instant::now();
        let step = self.state.step;
        let mut phases = Phases::default();
        let (loss, acc, positions) = self.batch_loss_timed(step, &mut phases)?;
        let t1 = Instant::now();
        let grads = loss.backward()?;
        phases.backward = t1.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let warmup = ((self.cfg.steps as f64 * self.cfg.warmup_frac).ceil() as usize).max(1);
        let lr = lr_at(step, self.cfg.steps, warmup, self.cfg.lr);
        let grad_norm = self.opt.step(&grads, lr, self.cfg.clip)?;
        phases.optimizer = t1.elapsed().as_secs_f64();
        self.state.step += 1;
        self.state.positions += positions as u64;
        let step_s = t0.elapsed().as_secs_f64();
        self.state.elapsed_s += step_s;
        Ok(StepReport {
            step: self.state.step,
            loss: loss.to_scalar::<f32>()?,
            accept: acc.iter().map(|(s, n)| if *n > 0 { s / *n as f32 } else { f32::NAN }).collect(),
            lr,
            grad_norm,
            positions,
            step_s,
            phases,
        })
    }

    /// Writes a checkpoint (drafter, optimiser state, run state) as one directory that appears
    /// atomically (see [`checkpoint`]), then the drafter at the top of the output folder, where
    /// `dspark:OUT` finds it.
    pub fn save(&self) -> Result<()> {
        self.save_stages(usize::MAX)
    }

    /// The first `stages` stages of [`Self::save`]: what a kill during a save leaves on disk
    /// (tests).
    #[doc(hidden)]
    pub fn save_stages(&self, stages: usize) -> Result<()> {
        let mut tensors: BTreeMap<String, Tensor> = self.frozen.clone();
        for (name, v) in &self.opt.vars {
            tensors.insert(name.clone(), v.as_tensor().detach());
        }
        tensors.remove("d2t");
        let dest = checkpoint::final_dir(&self.out, self.state.step);
        // A checkpoint of this step is already in place (Ctrl-C right after a periodic save):
        // it holds this very state.
        if !dest.exists() {
            if stages < 1 {
                return Ok(());
            }
            let tmp = checkpoint::temp_dir(&self.out, self.state.step)?;
            dspark_drafter_models::save(&tmp, &self.config, &tensors, self.net.vocab())?;
            if stages < 2 {
                return Ok(());
            }
            self.opt.save(&tmp.join(checkpoint::OPTIMIZER))?;
            if stages < 3 {
                return Ok(());
            }
            let st = tmp.join(checkpoint::STATE);
            std::fs::write(&st, serde_json::to_string_pretty(&self.state).expect("state serialises"))
                .map_err(|e| TrainError::io(&st, e))?;
            if stages < 4 {
                return Ok(());
            }
            checkpoint::commit(&tmp, &dest)?;
        }
        if stages < 5 {
            return Ok(());
        }
        checkpoint::prune(&self.out, &dest)?;
        if stages < 6 {
            return Ok(());
        }
        // Earlier versions kept the run state at the top; it must not shadow the checkpoints.
        for f in [checkpoint::STATE, checkpoint::OPTIMIZER] {
            let _ = std::fs::remove_file(self.out.join(f));
        }
        dspark_drafter_models::save(&self.out, &self.config, &tensors, self.net.vocab())?;
        Ok(())
    }

    /// Runs to `cfg.steps`, saving every `checkpoint_every` steps, at the end, and when `stop`
    /// is raised (Ctrl-C). Returns whether the run finished.
    pub fn run(&mut self, stop: &AtomicBool, mut on_step: impl FnMut(&StepReport)) -> Result<bool> {
        std::fs::create_dir_all(&self.out).map_err(|e| TrainError::io(&self.out, e))?;
        let log = self.out.join("train_log.jsonl");
        while self.state.step < self.cfg.steps {
            if stop.load(Ordering::SeqCst) {
                self.save()?;
                return Ok(false);
            }
            let r = self.step()?;
            on_step(&r);
            let line = serde_json::to_string(&r).expect("report serialises");
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .map_err(|e| TrainError::io(&log, e))?;
            writeln!(f, "{line}").map_err(|e| TrainError::io(&log, e))?;
            if self.state.step.is_multiple_of(self.cfg.checkpoint_every) || self.state.step == self.cfg.steps
            {
                self.save()?;
            }
        }
        Ok(true)
    }
}
