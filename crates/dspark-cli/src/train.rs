//! `dspark train`: one binary, one machine, from regenerated data to a drafter checkpoint.

use crate::{InitOpts, ModelArg};
use anyhow::{bail, Context, Result};
use clap::Args;
use dspark_train::trainer::{TrainConfig, Trainer};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Args)]
pub struct TrainArgs {
    /// The target model (name or path).
    #[arg(long, default_value = dspark_hub::DEFAULT_MODEL)]
    target: String,
    /// Start from this drafter checkpoint instead of a fresh one built from the options below.
    #[arg(long)]
    init: Option<PathBuf>,
    #[command(flatten)]
    opts: InitOpts,
    /// Regenerated samples (`dspark data regenerate`).
    #[arg(long)]
    data: PathBuf,
    /// Precomputed target features (`dspark data features`, or `dspark data regenerate
    /// --features`); training then uses only the samples in it. Without it, every sample's
    /// features are computed by a target forward each time it is drawn.
    #[arg(long)]
    features: Option<PathBuf>,
    /// Output folder: the drafter checkpoint, optimiser state and train_log.jsonl.
    #[arg(long)]
    out: PathBuf,
    /// Continue the run in --out from its last checkpoint (same settings, same result).
    #[arg(long)]
    resume: bool,
    /// Optimisation steps of the run (default 1 000). A resumed run keeps the count it started
    /// with, so that it ends where the uninterrupted run would (its learning-rate schedule
    /// depends on it).
    #[arg(long)]
    steps: Option<usize>,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Blocks anchored per sequence. Many anchors share one pass over the context (the fused
    /// target features and their keys/values), so positions per second grow with them; the paper
    /// uses 512 on long sequences.
    #[arg(long, default_value_t = 64)]
    anchors: usize,
    /// Tokens per sequence (longer samples are cut).
    #[arg(long, default_value_t = 512)]
    max_len: usize,
    /// Peak learning rate (AdamW, 4 % warmup, cosine to 0).
    #[arg(long, default_value_t = 6e-4)]
    lr: f64,
    /// DSpark's cross-entropy weight (the paper's 0.1 beside L1 0.9 and BCE 1.0). The L1 term
    /// trains sampled acceptance; cross-entropy on the target's own greedy token trains top-1
    /// agreement, which is what greedy verification accepts. Ignored by other methods.
    #[arg(long)]
    ce_weight: Option<f64>,
    #[arg(long, default_value_t = 100)]
    checkpoint_every: usize,
    /// Use the first N samples of --data.
    #[arg(long)]
    n: Option<usize>,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

pub fn run(a: TrainArgs) -> Result<()> {
    let steps = a.steps.unwrap_or(1000);
    if steps == 0 || a.batch == 0 || a.anchors == 0 {
        bail!("--steps, --batch and --anchors must be at least 1");
    }
    if let Some(w) = a.ce_weight.filter(|w| !(w.is_finite() && *w >= 0.0)) {
        bail!("--ce-weight must be a finite number ≥ 0, got {w}");
    }
    let target_arg = ModelArg { model: a.target.clone() };
    let target = Arc::new(target_arg.load()?);
    let name = target_arg.name();
    let mut data =
        dspark_train::data::read_samples(&a.data).with_context(|| format!("reading {}", a.data.display()))?;
    if let Some(n) = a.n {
        data.truncate(n);
    }
    let cache = match &a.features {
        Some(f) => {
            let c = dspark_train::features::FeatureCache::open(f).with_context(|| {
                format!("opening the feature cache {} (`dspark data features`)", f.display())
            })?;
            // A sample outside the cache would cost a target forward every time it is drawn.
            let before = data.len();
            data.retain(|s| c.contains(s.index));
            if data.len() < before {
                eprintln!(
                    "{} of {before} samples have cached features; training on those (`dspark data features` computes the rest)",
                    data.len()
                );
            }
            Some(c)
        }
        None => None,
    };
    let init = match (&a.init, a.resume) {
        (_, true) => a.out.clone(),
        (Some(p), false) => p.clone(),
        (None, false) => {
            let p = a.out.join("init");
            crate::init_drafter(target.clone(), &name, &a.opts, &p)?;
            p
        }
    };
    if !a.resume && dspark_train::checkpoint::has_run(&a.out) {
        bail!(
            "{} already holds a run; pass --resume to continue it or choose another --out",
            a.out.display()
        );
    }
    let cfg = TrainConfig {
        steps,
        batch: a.batch,
        anchors: a.anchors,
        max_len: a.max_len,
        lr: a.lr,
        seed: a.opts.seed,
        checkpoint_every: a.checkpoint_every,
        ce_weight: a.ce_weight,
        ..Default::default()
    };
    let mut t = Trainer::new(target, &name, &init, data, cfg, &a.out, a.resume)?;
    t.cache = cache;
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
    }
    let c = &t.cfg;
    if let Some(s) = a.steps.filter(|&s| a.resume && s != c.steps) {
        eprintln!("--steps {s} ignored: the resumed run keeps its schedule of {} steps", c.steps);
    }
    if a.resume && a.ce_weight.is_some() && a.ce_weight != c.ce_weight {
        eprintln!("--ce-weight ignored: the resumed run keeps its loss mix");
    }
    if a.resume && a.lr != c.lr {
        eprintln!("--lr {} ignored: the resumed run keeps its peak learning rate {}", a.lr, c.lr);
    }
    // A step's largest tensors (the `(A·γ) × V_d` logits and their gradients, ~60 MB on Qwen)
    // exceed glibc's largest mmap threshold (32 MB), so their pages were faulted in afresh every
    // step: ~6 % of a Qwen drafter's step. From here on (the model and data are loaded, so their
    // temporaries are not pinned under the heap's top) every allocation stays in the heap: a
    // step's working set is the same every step, so the heap stops growing after the first.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes how glibc allocates; no allocation is in flight.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
    }
    eprintln!(
        "training {} for {name}: {} samples, {} steps × {} sequences{}, starting at step {}",
        t.config.ext().method,
        t.samples(),
        c.steps,
        c.batch,
        if t.config.ext().method == dspark_drafter_models::Method::Eagle3 {
            String::new()
        } else {
            format!(" × {} blocks of γ = {}", c.anchors, t.config.gamma())
        },
        t.state.step
    );
    let bar = indicatif::ProgressBar::new(c.steps as u64);
    bar.set_position(t.state.step as u64);
    bar.set_style(indicatif::ProgressStyle::with_template(
        "{bar:25} {pos}/{len} {msg} [{elapsed} eta {eta}]",
    )?);
    let finished = t.run(&STOP, |r| {
        let acc: Vec<String> = r.accept.iter().map(|a| format!("{a:.2}")).collect();
        bar.set_message(format!(
            "loss {:.3} acc≈[{}] {:.0} pos/s",
            r.loss,
            acc.join(" "),
            r.positions as f64 / r.step_s
        ));
        bar.set_position(r.step as u64);
    })?;
    bar.finish();
    if finished {
        eprintln!("done: drafter in {} (log: train_log.jsonl)", a.out.display());
    } else {
        eprintln!("stopped at step {}; checkpoint saved. Continue with --resume.", t.state.step);
    }
    Ok(())
}
