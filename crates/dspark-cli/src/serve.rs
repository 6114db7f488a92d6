//! `dspark profile` and `dspark serve`: the cost table and the OpenAI-compatible server.

use crate::ModelArg;
use anyhow::{bail, Context, Result};
use clap::Args;
use dspark_drafter_models::{DrafterNet, Method};
use dspark_drafters::DrafterSpec;
use dspark_engine::{EngineConfig, EngineDrafter, EngineHandle};
use dspark_model::Model;
use dspark_schedule::{CostTable, Policy};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args, Clone)]
pub struct ServeDrafter {
    /// `auto` (the DSpark drafter shipped in drafters/ for this model, else none), `none`, a
    /// checkpoint folder as `dspark:PATH`, `dflash:PATH` or `eagle3:PATH`, `ngram` (prompt
    /// lookup) or `draft:MODEL` (a small model with the same tokenizer). DSpark and DFlash draft
    /// for all running requests in one batched pass; the others draft request by request.
    #[arg(long, default_value = "auto")]
    pub drafter: String,
    /// γ: the most drafts per request per step (default: the drafter's block, or 3 for prompt
    /// lookup and draft models).
    #[arg(long)]
    pub draft_len: Option<usize>,
}

/// The engine's drafter, its display name and its γ.
pub type LoadedDrafter = Option<(EngineDrafter, String, usize)>;

impl ServeDrafter {
    /// The drafter; `None` for plain decoding.
    pub fn load(&self, target: &Arc<Model>, target_name: &str) -> Result<LoadedDrafter> {
        if self.draft_len == Some(0) {
            bail!("--draft-len must be at least 1; use --drafter none for plain decoding");
        }
        let spec = match self.drafter.parse::<DrafterSpec>()? {
            DrafterSpec::Auto => match crate::shipped_drafter(target_name) {
                Some(dir) => DrafterSpec::Network(Method::Dspark, dir),
                None => return Ok(None),
            },
            other => other,
        };
        match spec {
            DrafterSpec::None => Ok(None),
            DrafterSpec::Network(method @ (Method::Dspark | Method::Dflash), dir) => {
                let (net, name) = dspark_drafters::load_network(method, &dir, target.clone(), target_name)
                    .with_context(|| format!("loading drafter {}", dir.display()))?;
                match net {
                    DrafterNet::Block(m) => {
                        let gamma = crate::args::block_gamma(self.draft_len, m.gamma())?;
                        Ok(Some((EngineDrafter::Block(Arc::new(m)), name, gamma)))
                    }
                    DrafterNet::Eagle3(_) => unreachable!("the method was checked"),
                }
            }
            _ => {
                let args = crate::DrafterArgs {
                    drafter: self.drafter.clone(),
                    draft_len: self.draft_len,
                    min_survival: Some(0.0),
                    policy: None,
                    profile: None,
                    reprofile: false,
                };
                let (d, gamma) = args.build(target, target_name)?.expect("not plain decoding");
                let name = d.name();
                Ok(Some((EngineDrafter::Each(d), name, gamma)))
            }
        }
    }
}

#[derive(Args)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub model: ModelArg,
    #[command(flatten)]
    pub drafter: ServeDrafter,
    /// Timings per size (the median is kept).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Where to write the table (JSON), for `dspark serve --profile`.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run_profile(a: ProfileArgs) -> Result<()> {
    let target = Arc::new(a.model.load()?);
    let drafter = a.drafter.load(&target, &a.model.name())?;
    let t = measure(&target, &a.model.name(), &drafter, a.reps)?;
    t.save(&a.out).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

fn measure(target: &Model, name: &str, drafter: &LoadedDrafter, reps: usize) -> Result<CostTable> {
    // Drafting cost is profiled for the batched block drafters, whose rounds the dspark policies
    // weigh; the others are verified by the fixed policy, which needs no drafting cost.
    let d = match drafter {
        Some((EngineDrafter::Block(m), n, _)) => Some((m.as_ref(), n.as_str())),
        _ => None,
    };
    let t = dspark_engine::profile(target, name, d, reps, |line| eprintln!("  {line}"))?;
    let one = t.forward_s(1);
    eprintln!(
        "  SPS(1) = {:.1} steps/s; a forward at B = 8 costs {:.2}× one token{}",
        1.0 / one,
        t.forward_s(8) / one,
        if t.draft.is_empty() {
            String::new()
        } else {
            format!(", a drafting round {:.2}×", t.draft_s(1) / one)
        }
    );
    Ok(t)
}

#[derive(Args, Clone)]
pub struct EngineArgs {
    #[command(flatten)]
    pub drafter: ServeDrafter,
    /// A cost table from `dspark profile`; without one the server profiles at start.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Requests decoded together at most.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Requests waiting at most; more get HTTP 429.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// KV cache positions the running requests may reserve together.
    #[arg(long, default_value_t = 65536)]
    pub kv_tokens: usize,
    /// Prefill work per engine step, in prompt tokens at the start of a prompt: deeper in a long
    /// prompt, where attention costs more, a step takes fewer tokens, so decoding requests keep
    /// a bounded inter-token latency while long prompts are prefilled. Shared fairly between
    /// prompts: a short one is never queued behind a long one's prefill.
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Keep the drafter's offline calibration fixed instead of refitting it on live traffic.
    #[arg(long)]
    pub no_online_calibration: bool,
}

impl EngineArgs {
    /// The cost table: loaded from --profile, or measured now.
    pub fn cost_table(
        &self,
        target: &Model,
        target_name: &str,
        drafter: &LoadedDrafter,
    ) -> Result<CostTable> {
        match &self.profile {
            Some(p) => crate::args::load_cost_table(p, target_name, drafter.is_some()),
            None => {
                let t0 = std::time::Instant::now();
                eprintln!(
                    "cost table: profiling {target_name} at start (save one with `dspark profile --out FILE` \
                     and pass --profile FILE to skip)"
                );
                let t = measure(target, target_name, drafter, 3)?;
                eprintln!("cost table: profiled in {:.1} s", t0.elapsed().as_secs_f64());
                Ok(t)
            }
        }
    }

    /// Starts an engine with `policy`.
    pub fn spawn(
        &self,
        policy: Policy,
        target: Arc<Model>,
        drafter: &LoadedDrafter,
        cost: CostTable,
    ) -> Result<Arc<EngineHandle>> {
        if policy.drafts() && drafter.is_none() {
            bail!("policy {policy} needs a drafter: pass --drafter dspark:PATH (or use --policy plain)");
        }
        if self.kv_tokens == 0 || self.max_running == 0 {
            bail!("--kv-tokens and --max-running must be at least 1");
        }
        let gamma = drafter.as_ref().map_or(0, |d| d.2);
        let config = EngineConfig {
            policy,
            cost,
            draft_len: gamma,
            max_running: self.max_running,
            max_queue: self.max_queue,
            kv_tokens: self.kv_tokens,
            prefill_chunk: self.prefill_chunk.max(1),
            online_calibration: !self.no_online_calibration,
        };
        let drafter = match drafter {
            Some((d, name, _)) => {
                Some(d.try_clone().with_context(|| format!("drafter {name} cannot serve several requests"))?)
            }
            None => None,
        };
        Ok(dspark_engine::spawn(target, drafter, config)?)
    }
}

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Verification policy: plain (no drafting), fixed (verify all γ drafts), threshold[:P]
    /// (verify while predicted prefix survival ≥ P, default 0.3), dspark (Algorithm 1 over all
    /// running requests against the profiled cost table), dspark-async (budget from confidences
    /// two steps back, top-K admission). Default: dspark for a drafter with a confidence head
    /// (DSpark), fixed for the others.
    #[arg(long)]
    pub policy: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// max_tokens for requests that give none (capped by the context left).
    #[arg(long, default_value_t = 512)]
    pub default_max_tokens: usize,
    /// Require `Authorization: Bearer KEY` on every /v1 route (401 otherwise); /health and
    /// /metrics stay open. Default: $DSPARK_API_KEY (prefer it: a flag shows in `ps`).
    #[arg(long)]
    pub api_key: Option<String>,
}

pub fn run_serve(a: ServeArgs) -> Result<()> {
    let target = Arc::new(a.model.load()?);
    let name = a.model.name();
    let asked: Option<Policy> = a.policy.as_deref().map(str::parse).transpose()?;
    let drafter =
        if asked.is_none_or(|p| p.drafts()) { a.engine.drafter.load(&target, &name)? } else { None };
    let policy = match (asked, &drafter) {
        (Some(p), _) => p,
        (None, Some((d, _, _))) if d.has_confidence() => Policy::Dspark,
        (None, Some(_)) => Policy::Fixed,
        (None, None) => {
            if a.engine.drafter.drafter == "auto" {
                // The default command should serve any model; speculation needs a drafter for it.
                eprintln!("no drafter is shipped for {name}: serving with --policy plain (pass --drafter to speculate)");
            }
            Policy::Plain
        }
    };
    let cost = a.engine.cost_table(&target, &name, &drafter)?;
    let engine = a.engine.spawn(policy, target, &drafter, cost)?;
    let drafter = drafter.map(|(_, n, _)| n);
    let api_key =
        a.api_key.clone().or_else(|| std::env::var("DSPARK_API_KEY").ok()).filter(|k| !k.is_empty());
    let state = Arc::new(
        dspark_server::AppState::new(engine, &name, drafter.clone(), a.default_max_tokens)
            .with_api_key(api_key.clone()),
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener =
            tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        eprintln!(
            "serving {name} (drafter {}, policy {}) on http://{}/v1{} — Ctrl-C stops after in-flight requests finish",
            drafter.as_deref().unwrap_or("none"),
            state.engine.config.policy,
            listener.local_addr()?,
            if api_key.is_some() { " (API key required)" } else { "" }
        );
        // An engine failure ends the process with an error: a supervisor restarts it.
        dspark_server::serve(listener, state, shutdown_signal())
            .await
            .context("the server stopped; restart it")?;
        eprintln!("stopped");
        Ok(())
    })
}

/// Resolves on Ctrl-C or SIGTERM.
async fn stop_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

async fn shutdown_signal() {
    stop_signal().await;
    eprintln!("shutting down: finishing in-flight requests (press Ctrl-C again to stop now)");
    // A second signal means "now": an operator should never have to reach for kill -9.
    tokio::spawn(async {
        stop_signal().await;
        eprintln!("second signal: stopping now, in-flight requests are dropped");
        std::process::exit(130);
    });
}
