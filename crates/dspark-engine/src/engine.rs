//! The engine thread and its handle.

use crate::request::{Event, Request, SubmitError, TokenLogprob, Usage, MAX_TOP_LOGPROBS};
use dspark_decode::FinishReason;
use dspark_drafter_models::BlockModel;
use dspark_drafters::{propose_batch, BatchEntry, BlockSeq};
use dspark_model::{KvCache, Model, SeqInput, SeqOutput, TapSpec};
use dspark_sampling::Sampler;
use dspark_schedule::calibration::{OnlineConfig, TrackStatus};
use dspark_schedule::{CostTable, OnlineCalibration, Policy, Scheduler};
use dspark_spec::{
    append_features, apply_stops, verify, DraftError, Drafter, Proposal, SpecStats, TargetFeatures,
};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub policy: Policy,
    pub cost: CostTable,
    /// γ: the most drafts per request per step (capped by the drafter's block).
    pub draft_len: usize,
    /// Requests decoded together at most.
    pub max_running: usize,
    /// Requests waiting for admission at most; more are refused.
    pub max_queue: usize,
    /// KV positions reserved across all running requests at most (each reserves its prompt,
    /// `max_tokens` and one verify block).
    pub kv_tokens: usize,
    /// Prefill work per step across requests, alongside decoding, in token-equivalents (a
    /// prompt token at context 0; see [`prefill_plan`]).
    pub prefill_chunk: usize,
    pub online_calibration: bool,
}

/// Live counters, read by the server's `/metrics`.
#[derive(Debug, Default)]
pub struct Shared {
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
    pub kv_reserved_tokens: AtomicUsize,
    pub kv_used_tokens: AtomicUsize,
    pub kv_capacity_tokens: AtomicUsize,
    pub kv_bytes_per_token: AtomicUsize,
    pub steps: AtomicU64,
    pub draft_steps: AtomicU64,
    /// Request-steps that committed tokens (τ = (accepted + rounds) / rounds).
    pub rounds: AtomicU64,
    pub drafted: AtomicU64,
    pub verified: AtomicU64,
    pub accepted: AtomicU64,
    pub committed: AtomicU64,
    pub cancelled: AtomicU64,
    pub stopping: AtomicBool,
    pub calibration: Mutex<Vec<TrackStatus>>,
    /// Why the engine thread died (a panic), if it did. Nothing is served after that: the
    /// server reports it on `/health` and exits non-zero so that a supervisor restarts it.
    pub failure: Mutex<Option<String>>,
}

impl Shared {
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

enum Msg {
    Submit(Request, Instant),
    Shutdown,
    /// Test hook: panic in the engine thread, as a bug in a step would.
    Panic,
}

pub struct EngineHandle {
    tx: Mutex<mpsc::Sender<Msg>>,
    pub shared: Arc<Shared>,
    pub config: EngineConfig,
    pub target: Arc<Model>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl EngineHandle {
    /// Checks a request against the model and the engine's limits without queueing it.
    pub fn check(&self, prompt: &[u32], p: &crate::RequestParams) -> Result<(), SubmitError> {
        p.sampling.validate().map_err(|e| SubmitError::Invalid(e.to_string()))?;
        if prompt.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty; give at least one token".into()));
        }
        if p.max_tokens == 0 {
            return Err(SubmitError::Invalid("max_tokens must be at least 1".into()));
        }
        if p.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            return Err(SubmitError::Invalid(format!(
                "at most {MAX_TOP_LOGPROBS} top log-probabilities per token can be returned"
            )));
        }
        let context = self.target.config.context_length;
        if prompt.len().saturating_add(p.max_tokens) > context {
            return Err(SubmitError::ContextExceeded {
                context,
                prompt: prompt.len(),
                max_tokens: p.max_tokens,
            });
        }
        if reservation(prompt.len(), p.max_tokens, self.config.draft_len, context) > self.config.kv_tokens {
            return Err(SubmitError::Invalid(format!(
                "prompt plus max_tokens needs more KV cache than the server has ({} positions); \
                 lower max_tokens or start the server with a larger --kv-tokens",
                self.config.kv_tokens
            )));
        }
        Ok(())
    }

    /// Queues a request; its tokens arrive on `req.events`.
    pub fn submit(&self, req: Request) -> Result<(), SubmitError> {
        self.check(&req.prompt, &req.params)?;
        if let Some(f) = self.shared.failure() {
            return Err(SubmitError::EngineFailed(f));
        }
        if self.shared.stopping.load(Relaxed) {
            return Err(SubmitError::ShuttingDown);
        }
        let waiting = self.shared.queued.fetch_add(1, Relaxed);
        if waiting >= self.config.max_queue {
            self.shared.queued.fetch_sub(1, Relaxed);
            return Err(SubmitError::QueueFull(waiting));
        }
        let sent = self.tx.lock().unwrap().send(Msg::Submit(req, Instant::now()));
        sent.map_err(|_| {
            self.shared.queued.fetch_sub(1, Relaxed);
            self.shared.failure().map_or(SubmitError::ShuttingDown, SubmitError::EngineFailed)
        })
    }

    /// Makes the engine thread panic, as a bug would (tests of what the server does then).
    #[doc(hidden)]
    pub fn inject_panic(&self) {
        let _ = self.tx.lock().unwrap().send(Msg::Panic);
    }

    /// Stops accepting requests, lets running and queued ones finish, then stops the thread.
    pub fn shutdown(&self) {
        self.shared.stopping.store(true, Relaxed);
        let _ = self.tx.lock().unwrap().send(Msg::Shutdown);
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
    }
}

/// Why a step failed: the target's forward (or its cache), or the drafter.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("target model: {0}")]
    Target(#[from] dspark_model::ModelError),
    #[error("drafter: {0}")]
    Draft(#[from] DraftError),
}

/// What drafts for the engine's requests.
pub enum EngineDrafter {
    /// DFlash or DSpark: one backbone pass and one LM-head product draft for every decoding
    /// request together.
    Block(Arc<BlockModel>),
    /// Any other drafter (prompt lookup, a draft model, EAGLE-3, `auto`): each request gets its
    /// own [`Drafter::fork`] of this one, which proposes for that request alone.
    Each(Box<dyn Drafter>),
}

impl EngineDrafter {
    /// Another engine's drafter with the same weights; `None` for a drafter that cannot fork.
    pub fn try_clone(&self) -> Option<Self> {
        match self {
            Self::Block(d) => Some(Self::Block(d.clone())),
            Self::Each(d) => d.fork().map(Self::Each),
        }
    }

    fn taps(&self) -> TapSpec {
        match self {
            Self::Block(d) => TapSpec { layers: d.config.target_layer_ids.clone(), final_norm: false },
            Self::Each(d) => d.taps(),
        }
    }

    pub fn has_confidence(&self) -> bool {
        match self {
            Self::Block(d) => d.config.dspark.as_ref().is_some_and(|e| e.confidence),
            Self::Each(d) => d.has_confidence(),
        }
    }
}

/// A request's drafting state. `'d`: a drafter lent by the caller ([`crate::generate`]).
pub(crate) enum DraftState<'d> {
    None,
    Block(Box<BlockSeq>),
    /// `begun` once its prompt is prefilled (`Drafter::begin` takes the prompt's features).
    Each {
        d: Box<dyn Drafter + 'd>,
        begun: bool,
    },
}

/// Pending drafter rows that force a feed even without drafting (bounds their memory).
const FEED_EVERY: usize = 256;

/// Mixed into a request's seed for its drafter's own sampling.
const DRAFT_SEED: u64 = 0x9E37_79B9_7F4A_7C15;

fn reservation(prompt: usize, max_tokens: usize, gamma: usize, context: usize) -> usize {
    prompt.saturating_add(max_tokens).saturating_add(gamma + 1).min(context)
}

/// Starts the engine thread. A drafter is needed by every policy but `plain`; the
/// survival-ranked policies need one with a confidence head.
pub fn spawn(
    target: Arc<Model>,
    drafter: Option<EngineDrafter>,
    mut config: EngineConfig,
) -> Result<Arc<EngineHandle>, SubmitError> {
    let drafter = if config.policy.drafts() { drafter } else { None };
    match &drafter {
        None if config.policy.drafts() => {
            return Err(SubmitError::Invalid(format!(
                "policy {} needs a drafter; use --policy plain without one",
                config.policy
            )))
        }
        Some(d) if config.policy.needs_confidence() && !d.has_confidence() => {
            return Err(SubmitError::Invalid(format!(
                "policy {} ranks drafts by predicted survival, but this drafter has no confidence head; \
                 use --policy fixed or a DSpark checkpoint",
                config.policy
            )))
        }
        Some(EngineDrafter::Each(d)) if d.fork().is_none() => {
            return Err(SubmitError::Invalid(format!(
                "drafter {} cannot draft for several requests; the engine needs one that can",
                d.name()
            )))
        }
        _ => {}
    }
    config.draft_len = match &drafter {
        Some(EngineDrafter::Block(d)) => config.draft_len.clamp(1, d.gamma()),
        Some(EngineDrafter::Each(_)) => config.draft_len.max(1),
        None => 0,
    };
    let c = &target.config;
    let shared = Arc::new(Shared::default());
    shared.kv_capacity_tokens.store(config.kv_tokens, Relaxed);
    shared.kv_bytes_per_token.store(2 * c.n_layers * c.n_kv_heads * c.head_dim * 4, Relaxed);
    let (tx, rx) = mpsc::channel();
    let taps = drafter.as_ref().map(|d| d.taps()).unwrap_or_default();
    let mut worker =
        Worker::new(target.clone(), drafter.is_some(), drafter, taps, config.clone(), shared.clone());
    let dead = shared.clone();
    let thread = std::thread::Builder::new()
        .name("dspark-engine".into())
        .spawn(move || {
            // A panic drops the running requests (their clients see the stream end); what is
            // left to do is to record it so that nobody mistakes the server for a healthy one.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run(rx)));
            if let Err(p) = r {
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "panic".into());
                *dead.failure.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(format!("engine thread panicked: {msg}"));
                dead.stopping.store(true, Relaxed);
            }
        })
        .map_err(|e| SubmitError::Invalid(format!("cannot start the engine thread: {e}")))?;
    Ok(Arc::new(EngineHandle {
        tx: Mutex::new(tx),
        shared,
        config,
        target,
        thread: Mutex::new(Some(thread)),
    }))
}

/// One admitted request.
pub(crate) struct Seq<'d> {
    req: Request,
    /// Prompt and committed tokens; the last one is the next verify block's anchor and is not
    /// in the cache yet.
    context: Vec<u32>,
    prompt_len: usize,
    cache: KvCache,
    reserved: usize,
    draft: DraftState<'d>,
    /// Target features not yet handed to the drafter: a block drafter's are fed at the next
    /// drafting step, so steps without drafting pay nothing for it; a per-request drafter's
    /// are its prompt's, handed to `begin`.
    pending: TargetFeatures,
    rng: Sampler,
    usage: Usage,
    /// Per-round statistics (acceptance per draft position, drafting and verifying time).
    pub(crate) stats: SpecStats,
    pub(crate) finish: Option<FinishReason>,
    failed: bool,
}

impl Seq<'_> {
    pub(crate) fn decoding(&self) -> bool {
        self.cache.len() + 1 >= self.prompt_len
    }

    /// Drafts this request may verify this step: γ, less near `max_tokens` or the cache's end,
    /// and none in its first step. That step verifies the last prompt token alone and commits
    /// the token sampled from it, which becomes the first anchor with the whole prompt as
    /// context: what the drafter saw in training and what DeepSpec's evaluator does (the prompt's
    /// last token is never an anchor).
    fn budget(&self, gamma: usize) -> usize {
        if self.context.len() == self.prompt_len {
            return 0;
        }
        let left = self.req.params.max_tokens.saturating_sub(self.context.len() - self.prompt_len + 1);
        let room = self.cache.capacity().saturating_sub(self.cache.len() + 1);
        gamma.min(left).min(room)
    }

    fn send(&mut self, e: Event) {
        if self.req.events.send(e).is_err() {
            self.failed = true;
        }
    }

    /// The client went away (its receiver is gone).
    fn abandoned(&self) -> bool {
        self.req.events.is_closed()
    }
}

/// What a row block of the step's forward is for.
enum Part {
    Verify { seq: usize, proposal: Proposal, survival: Vec<f32> },
    Prefill { seq: usize, rows: usize },
}

pub(crate) struct Worker {
    target: Arc<Model>,
    row_cost: RowCost,
    /// Whether requests draft: `drafter` makes their states, or the caller lends one.
    drafts: bool,
    drafter: Option<EngineDrafter>,
    taps: TapSpec,
    sched: Scheduler,
    calib: OnlineCalibration,
    config: EngineConfig,
    shared: Arc<Shared>,
    next_id: u64,
}

impl Worker {
    pub(crate) fn new(
        target: Arc<Model>,
        drafts: bool,
        drafter: Option<EngineDrafter>,
        taps: TapSpec,
        config: EngineConfig,
        shared: Arc<Shared>,
    ) -> Self {
        Self {
            drafts,
            taps,
            row_cost: RowCost::of(&target.config),
            target,
            drafter,
            sched: Scheduler::new(config.policy, config.cost.clone()),
            calib: OnlineCalibration::new(config.draft_len.max(1), OnlineConfig::default()),
            config,
            shared,
            next_id: 0,
        }
    }

    fn run(&mut self, rx: mpsc::Receiver<Msg>) {
        let mut queue: VecDeque<(Request, Instant)> = VecDeque::new();
        let mut running: Vec<Seq<'static>> = Vec::new();
        let mut stopping = false;
        loop {
            if running.is_empty() && queue.is_empty() {
                if stopping {
                    break;
                }
                match rx.recv() {
                    Ok(m) => self.intake(m, &mut queue, &mut stopping),
                    Err(_) => break,
                }
            }
            while let Ok(m) = rx.try_recv() {
                self.intake(m, &mut queue, &mut stopping);
            }
            // A dropped receiver is a client gone: forget the request and its memory now.
            let before = queue.len();
            queue.retain(|(r, _)| !r.events.is_closed());
            self.shared.queued.fetch_sub(before - queue.len(), Relaxed);
            self.shared.cancelled.fetch_add((before - queue.len()) as u64, Relaxed);
            self.retire(&mut running, |s| s.abandoned() || s.failed);
            self.admit(&mut queue, &mut running);
            if running.is_empty() {
                continue;
            }
            if let Err(e) = self.step(&mut running) {
                for s in running.iter_mut() {
                    s.send(Event::Error(format!("engine step failed: {e}")));
                    s.failed = true;
                }
            }
            self.retire(&mut running, |s| s.finish.is_some() || s.failed);
            let steps = self.shared.steps.fetch_add(1, Relaxed) + 1;
            if self.config.online_calibration && steps.is_multiple_of(16) {
                *self.shared.calibration.lock().unwrap() = self.calib.status();
            }
        }
    }

    fn intake(&mut self, m: Msg, queue: &mut VecDeque<(Request, Instant)>, stopping: &mut bool) {
        match m {
            Msg::Submit(r, t) => queue.push_back((r, t)),
            Msg::Shutdown => *stopping = true,
            Msg::Panic => panic!("injected by EngineHandle::inject_panic"),
        }
    }

    fn retire(&self, running: &mut Vec<Seq<'_>>, gone: impl Fn(&Seq<'_>) -> bool) {
        let (mut done, kept): (Vec<_>, Vec<_>) = running.drain(..).partition(|s| gone(s));
        *running = kept;
        // Every counter changes before a client hears `Done`, and the running count last: whoever
        // reads `/metrics` after an answer ends, or once nothing runs, sees the request counted
        // and its memory released.
        let cancelled = done.iter().filter(|s| s.finish.is_none() && s.abandoned()).count();
        self.shared.cancelled.fetch_add(cancelled as u64, Relaxed);
        let released: usize = done.iter().map(|s| s.reserved).sum();
        self.shared.kv_reserved_tokens.fetch_sub(released, Relaxed);
        let used = running.iter().map(|s| s.cache.len()).sum();
        self.shared.kv_used_tokens.store(used, Relaxed);
        self.shared.running.store(running.len(), Relaxed);
        for s in done.iter_mut() {
            if let (Some(finish), false) = (s.finish, s.failed) {
                s.usage.completion_tokens = s.context.len() - s.prompt_len;
                let usage = s.usage.clone();
                s.send(Event::Done { finish, usage });
            }
        }
    }

    /// Admits queued requests in arrival order while there is room in the running set and the
    /// KV budget.
    fn admit(&mut self, queue: &mut VecDeque<(Request, Instant)>, running: &mut Vec<Seq<'static>>) {
        let context = self.target.config.context_length;
        while running.len() < self.config.max_running {
            let Some((req, _)) = queue.front() else { break };
            let need = reservation(req.prompt.len(), req.params.max_tokens, self.config.draft_len, context);
            if self.shared.kv_reserved_tokens.load(Relaxed) + need > self.config.kv_tokens {
                break;
            }
            let (req, arrived) = queue.pop_front().unwrap();
            self.shared.queued.fetch_sub(1, Relaxed);
            self.shared.kv_reserved_tokens.fetch_add(need, Relaxed);
            self.next_id += 1;
            let seed = req.params.seed;
            let draft = match &self.drafter {
                Some(EngineDrafter::Block(d)) => {
                    match BlockSeq::new(d, &TargetFeatures::default(), seed ^ DRAFT_SEED) {
                        Ok(s) => DraftState::Block(Box::new(s)),
                        Err(e) => {
                            let _ = req.events.send(Event::Error(format!("drafter: {e}")));
                            self.shared.kv_reserved_tokens.fetch_sub(need, Relaxed);
                            continue;
                        }
                    }
                }
                Some(EngineDrafter::Each(d)) => {
                    DraftState::Each { d: d.fork().expect("checked at spawn"), begun: false }
                }
                None => DraftState::None,
            };
            running.push(self.seq(req, arrived, need, draft));
        }
        self.shared.running.store(running.len(), Relaxed);
    }

    /// A request's state on admission, `need` KV positions reserved.
    pub(crate) fn seq<'d>(
        &self,
        req: Request,
        arrived: Instant,
        need: usize,
        draft: DraftState<'d>,
    ) -> Seq<'d> {
        let usage = Usage {
            prompt_tokens: req.prompt.len(),
            queue_s: arrived.elapsed().as_secs_f64(),
            ..Default::default()
        };
        Seq {
            context: req.prompt.clone(),
            prompt_len: req.prompt.len(),
            cache: self.target.new_cache(need),
            reserved: need,
            draft,
            pending: TargetFeatures::default(),
            rng: Sampler::new(req.params.seed),
            stats: SpecStats { prompt_tokens: req.prompt.len(), ..Default::default() },
            usage,
            finish: None,
            failed: false,
            req,
        }
    }

    /// One step: draft → schedule → verify (one forward, prefill chunks included) → accept →
    /// feed back.
    pub(crate) fn step(&mut self, seqs: &mut [Seq<'_>]) -> Result<(), StepError> {
        let decoding: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].decoding()).collect();
        for &i in &decoding {
            let s = &mut seqs[i];
            if let DraftState::Each { d, begun: begun @ false } = &mut s.draft {
                d.begin(&s.context, &std::mem::take(&mut s.pending), s.req.params.seed ^ DRAFT_SEED)?;
                *begun = true;
            }
        }
        // A step where no request may draft (first steps, ends of max_tokens) is no drafting
        // step: the policy neither plans it nor learns from it.
        let gamma = self.config.draft_len;
        let drafting =
            self.drafts && decoding.iter().any(|&i| seqs[i].budget(gamma) > 0) && self.sched.should_draft();
        let t0 = Instant::now();
        let mut proposals = if drafting { self.draft(seqs, &decoding)? } else { vec![] };
        let draft_s = t0.elapsed().as_secs_f64();
        proposals.resize(decoding.len(), Proposal::default());
        let survival: Vec<Vec<f32>> =
            decoding.iter().zip(&proposals).map(|(&i, p)| self.survival(&seqs[i], p)).collect();
        let lengths = if drafting { self.sched.plan(&survival).lengths } else { vec![0; decoding.len()] };
        let mut parts: Vec<Part> = Vec::new();
        for ((&seq, mut proposal), (mut survival, len)) in
            decoding.iter().zip(proposals).zip(survival.into_iter().zip(lengths))
        {
            proposal.tokens.truncate(len);
            proposal.dists.truncate(len);
            survival.truncate(len);
            parts.push(Part::Verify { seq, proposal, survival });
        }
        let prefilling: Vec<(usize, usize, usize)> = (0..seqs.len())
            .filter(|&i| !seqs[i].decoding())
            .map(|i| (i, seqs[i].cache.len(), seqs[i].prompt_len - 1 - seqs[i].cache.len()))
            .collect();
        for (seq, rows) in prefill_plan(&self.row_cost, self.config.prefill_chunk, &prefilling) {
            parts.push(Part::Prefill { seq, rows });
        }
        let t0 = Instant::now();
        let outs = self.forward(seqs, &parts)?;
        let forward_s = t0.elapsed().as_secs_f64();
        for (part, out) in parts.into_iter().zip(outs) {
            match part {
                Part::Verify { seq, proposal, survival } => {
                    let (t0, n) = (Instant::now(), proposal.len());
                    // The first step commits the prefill's token: not a round, not a plain step.
                    let first = seqs[seq].context.len() == seqs[seq].prompt_len;
                    let accepted = self.accept(&mut seqs[seq], proposal, &survival, out)?;
                    let stats = &mut seqs[seq].stats;
                    if first {
                        // Part of the prefill.
                    } else if n == 0 {
                        stats.plain_steps += 1;
                    } else {
                        stats.record_round(n, accepted, draft_s, forward_s + t0.elapsed().as_secs_f64());
                    }
                }
                Part::Prefill { seq, rows } => self.feed(&mut seqs[seq], out, rows, 0)?,
            }
        }
        self.shared.draft_steps.fetch_add(drafting as u64, Relaxed);
        Ok(())
    }

    fn draft(&self, seqs: &mut [Seq<'_>], decoding: &[usize]) -> Result<Vec<Proposal>, DraftError> {
        let gamma = self.config.draft_len;
        let budgets: Vec<usize> = decoding.iter().map(|&i| seqs[i].budget(gamma)).collect();
        let mut proposals = match &self.drafter {
            Some(EngineDrafter::Block(net)) => {
                for &i in decoding {
                    self.flush(&mut seqs[i])?;
                }
                let mut entries: Vec<BatchEntry> = seqs
                    .iter_mut()
                    .filter(|s| s.decoding() && s.budget(gamma) > 0)
                    .map(|s| match &mut s.draft {
                        DraftState::Block(b) => (b.as_mut(), s.context.as_slice(), &s.req.params.sampling),
                        _ => unreachable!("a block drafter's requests hold block states"),
                    })
                    .collect();
                let mut drafted = propose_batch(net, &mut entries, gamma)?.into_iter();
                budgets
                    .iter()
                    .map(
                        |&b| if b > 0 { drafted.next().expect("one per entry") } else { Proposal::default() },
                    )
                    .collect()
            }
            // Per-request drafters, made by the engine or lent by the caller.
            _ => {
                let mut out = Vec::with_capacity(decoding.len());
                for (&i, &b) in decoding.iter().zip(&budgets) {
                    let s = &mut seqs[i];
                    out.push(match &mut s.draft {
                        DraftState::Each { d, .. } if b > 0 => {
                            d.propose(&s.context, b, &s.req.params.sampling)?
                        }
                        _ => Proposal::default(),
                    });
                }
                out
            }
        };
        for ((p, b), &i) in proposals.iter_mut().zip(budgets).zip(decoding) {
            p.tokens.truncate(b);
            p.dists.truncate(b);
            if let Some(c) = p.confidence.as_mut() {
                c.truncate(b);
            }
            seqs[i].usage.drafted_tokens += p.tokens.len();
            self.shared.drafted.fetch_add(p.tokens.len() as u64, Relaxed);
        }
        Ok(proposals)
    }

    /// Predicted prefix survival of each draft (1 for drafters without confidences, which only
    /// `fixed` accepts).
    fn survival(&self, s: &Seq<'_>, p: &Proposal) -> Vec<f32> {
        match &p.confidence {
            Some(c) if self.config.online_calibration => self.calib.survival(s.req.tag.as_deref(), c),
            _ => p.survival().unwrap_or_else(|| vec![1.0; p.len()]),
        }
    }

    fn forward(&self, seqs: &mut [Seq<'_>], parts: &[Part]) -> Result<Vec<SeqOutput>, StepError> {
        let tap = |n: usize| if self.drafts { (0..n).collect() } else { Vec::new() };
        let blocks: Vec<Vec<u32>> = parts
            .iter()
            .map(|p| match p {
                Part::Verify { seq, proposal, .. } => std::iter::once(*seqs[*seq].context.last().unwrap())
                    .chain(proposal.tokens.iter().copied())
                    .collect(),
                Part::Prefill { seq, rows } => {
                    let s = &seqs[*seq];
                    s.context[s.cache.len()..s.cache.len() + rows].to_vec()
                }
            })
            .collect();
        // Parts name distinct requests; hand each its cache in part order.
        let mut caches: Vec<Option<&mut KvCache>> = seqs.iter_mut().map(|s| Some(&mut s.cache)).collect();
        let mut inputs: Vec<SeqInput> = parts
            .iter()
            .zip(&blocks)
            .map(|(p, tokens)| {
                let (seq, logits) = match p {
                    Part::Verify { seq, .. } => (*seq, (0..tokens.len()).collect()),
                    Part::Prefill { seq, .. } => (*seq, Vec::new()),
                };
                let cache = caches[seq].take().expect("one part per request");
                SeqInput { cache, tokens, logit_rows: logits, tap_rows: tap(tokens.len()) }
            })
            .collect();
        Ok(self.target.forward(&mut inputs, &self.taps)?)
    }

    fn accept(
        &mut self,
        s: &mut Seq<'_>,
        proposal: Proposal,
        survival: &[f32],
        out: SeqOutput,
    ) -> Result<usize, StepError> {
        let v = self.target.vocab_size();
        let n = proposal.len();
        let params = &s.req.params.sampling;
        let verdict = verify(|i| out.logits_row(i, v), &proposal.tokens, &proposal.dists, params, &mut s.rng);
        s.cache.truncate(s.cache.len() - (n - verdict.accepted))?;
        s.context.extend_from_slice(&proposal.tokens[..verdict.accepted]);
        s.context.push(verdict.next);
        let committed = verdict.accepted + 1;
        if let (Some(c), true) = (&proposal.confidence, n > 0) {
            if self.config.online_calibration {
                self.calib.observe(s.req.tag.as_deref(), &c[..n], survival, verdict.accepted);
            }
        }
        s.usage.rounds += 1;
        self.shared.rounds.fetch_add(1, Relaxed);
        s.usage.verified_tokens += n;
        s.usage.accepted_tokens += verdict.accepted;
        self.shared.verified.fetch_add(n as u64, Relaxed);
        self.shared.accepted.fetch_add(verdict.accepted as u64, Relaxed);
        // Committed token j was chosen from row j of the verify block, drafted or not, so the
        // target's exact distribution is at hand for each.
        let new = s.context.len() - committed;
        let logprobs: Option<Vec<TokenLogprob>> = s.req.params.logprobs.map(|k| {
            (0..committed).map(|j| log_probs(out.logits_row(j, v), s.context[new + j], k)).collect()
        });
        self.feed(s, out, 1 + verdict.accepted, verdict.accepted)?;
        let p = &s.req.params;
        let (emit, finish) =
            apply_stops(&mut s.context, s.prompt_len, committed, &p.stop_tokens, p.max_tokens);
        let logprobs = logprobs.map(|mut l| {
            l.truncate(emit.len());
            l
        });
        s.finish = finish;
        self.shared.committed.fetch_add(emit.len() as u64, Relaxed);
        if !emit.is_empty() {
            s.send(Event::Tokens { tokens: emit, logprobs });
        }
        Ok(verdict.accepted)
    }

    /// Hands the drafter the target's hidden states of the first `rows` rows that entered the
    /// cache (a prefill chunk, or a verify block's anchor and `accepted` drafts). A per-request
    /// drafter observes every round, as its trait asks; before it has begun, its prompt's rows
    /// wait for `begin`.
    fn feed(&self, s: &mut Seq<'_>, out: SeqOutput, rows: usize, accepted: usize) -> Result<(), StepError> {
        let d = self.target.config.hidden;
        match &mut s.draft {
            DraftState::None => {}
            DraftState::Block(_) => {
                append_features(&mut s.pending, out, rows, d);
                if s.pending.rows >= FEED_EVERY {
                    self.flush(s)?;
                }
            }
            DraftState::Each { begun: false, .. } => append_features(&mut s.pending, out, rows, d),
            DraftState::Each { d: drafter, begun: true } => {
                let mut f = TargetFeatures::default();
                append_features(&mut f, out, rows, d);
                drafter.observe(&s.context, accepted, &f)?;
            }
        }
        Ok(())
    }

    /// Hands a block drafter every pending row.
    fn flush(&self, s: &mut Seq<'_>) -> Result<(), DraftError> {
        if let (Some(EngineDrafter::Block(net)), DraftState::Block(d), true) =
            (&self.drafter, &mut s.draft, s.pending.rows > 0)
        {
            d.feed(net, &std::mem::take(&mut s.pending))?;
        }
        Ok(())
    }
}

/// Multiply-adds of one row of a forward, in units of the matmuls' (a token-equivalent).
#[derive(Debug, Clone)]
pub struct RowCost {
    /// Multiply-adds of the projections and MLP of one row, all layers.
    matmuls: f64,
    /// Per layer: attention multiply-adds per key (scores and values), and the key window of a
    /// sliding-window layer.
    layers: Vec<(f64, Option<usize>)>,
}

impl RowCost {
    pub fn of(config: &dspark_model::Config) -> Self {
        let heads = (config.n_heads * config.head_dim) as f64;
        let kv = (config.n_kv_heads * config.head_dim) as f64;
        let d = config.hidden as f64;
        let per_layer = d * (heads + 2.0 * kv) + heads * d + 3.0 * d * config.intermediate as f64;
        Self {
            matmuls: (config.n_layers as f64 * per_layer).max(1.0),
            layers: (0..config.n_layers)
                .map(|l| (2.0 * heads, config.sliding_window.filter(|_| config.is_sliding(l))))
                .collect(),
        }
    }

    /// `rows` rows from context `c` on, each costed at the last one's (longest) attention.
    pub fn rows(&self, c: usize, rows: usize) -> f64 {
        let end = c + rows;
        let attention: f64 =
            self.layers.iter().map(|&(per_key, w)| per_key * w.map_or(end, |w| end.min(w)) as f64).sum();
        rows as f64 * (1.0 + attention / self.matmuls)
    }
}

/// Prompt rows to prefill this step, as `(request, rows)`, for requests given as `(request,
/// tokens in its cache, prompt rows left)`.
///
/// The step's budget is `chunk` token-equivalents: a row at context `c` costs `1 + attention(c) /
/// matmuls` (multiply-adds per row, from the model's shape), so a chunk deep in an 8k prompt,
/// whose attention outweighs the matmuls, gets fewer rows and the step — and with it every
/// decoding request's inter-token latency — stays about as long as a chunk at the start. The
/// budget is shared max-min fairly: requests with the least left go first, each gets at most an
/// equal share of what remains, and what it does not use passes on, so a short prompt is never
/// queued behind a long one's prefill while the long one still gets the rest. Every request
/// with rows left gets at least one, so none stalls.
pub fn prefill_plan(cost: &RowCost, chunk: usize, requests: &[(usize, usize, usize)]) -> Vec<(usize, usize)> {
    let cost = |c: usize, rows: usize| cost.rows(c, rows);
    let mut order: Vec<&(usize, usize, usize)> = requests.iter().filter(|r| r.2 > 0).collect();
    order.sort_by_key(|&&(i, _, left)| (left, i));
    let mut budget = chunk as f64;
    let mut plan = Vec::with_capacity(order.len());
    for (k, &&(i, c, left)) in order.iter().enumerate() {
        let share = budget / (order.len() - k) as f64;
        // The most rows within the share (cost grows with rows): a binary search.
        let (mut lo, mut hi) = (1, left);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if cost(c, mid) <= share {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        budget = (budget - cost(c, lo)).max(0.0);
        plan.push((i, lo));
    }
    plan.sort_unstable();
    plan
}

/// `token`'s log-probability under `logits` (log-softmax, temperature 1) and the `top` most
/// likely tokens' (ties by smaller id). The normaliser is summed in f64 so that a 150k-entry
/// vocabulary loses no precision.
pub fn log_probs(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let lp = |i: usize| (logits[i] as f64 - log_z) as f32;
    let mut best: Vec<u32> = Vec::with_capacity(top + 1);
    if top > 0 {
        // A bounded insertion list: `top` is at most 20, the vocabulary large.
        let after = |a: u32, b: u32| {
            let (x, y) = (logits[a as usize], logits[b as usize]);
            x < y || (x == y && a > b)
        };
        for i in 0..logits.len() as u32 {
            if best.len() == top && !after(best[top - 1], i) {
                continue;
            }
            let at = best.iter().position(|&b| after(b, i)).unwrap_or(best.len());
            best.insert(at, i);
            best.truncate(top);
        }
    }
    TokenLogprob {
        token,
        logprob: lp(token as usize),
        top: best.into_iter().map(|i| (i, lp(i as usize))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::{log_probs, prefill_plan, RowCost};

    /// SmolLM2-135M's shape: hidden 576, MLP 1536, 30 layers, 9 query and 3 KV heads of 64.
    fn smollm2_like() -> RowCost {
        let per_layer = 576.0 * (576.0 + 2.0 * 192.0) + 576.0 * 576.0 + 3.0 * 576.0 * 1536.0;
        RowCost { matmuls: 30.0 * per_layer, layers: vec![(2.0 * 576.0, None); 30] }
    }

    #[test]
    fn prefill_budget_is_shared_fairly_and_shrinks_with_context() {
        let c = smollm2_like();
        // Alone at the start of its prompt a request gets about the whole budget.
        let alone = prefill_plan(&c, 256, &[(0, 0, 8000)]);
        assert!((200..=256).contains(&alone[0].1), "{alone:?}");
        // Deep in the prompt, attention costs as much as the matmuls several times over: fewer rows.
        let deep = prefill_plan(&c, 256, &[(0, 7000, 1000)]);
        assert!(deep[0].1 < alone[0].1 / 2, "{deep:?}");
        // A short prompt next to a long one is prefilled whole in this step; the long one gets
        // what is left, not nothing.
        let plan = prefill_plan(&c, 256, &[(0, 2048, 6000), (1, 0, 20), (2, 5, 0)]);
        assert_eq!(plan.len(), 2, "a request with nothing left gets no part");
        assert_eq!(plan[1], (1, 20));
        assert!(plan[0].1 > 50, "{plan:?}");
        // Equal requests get equal shares; every request moves even on a tiny budget.
        let plan = prefill_plan(&c, 100, &[(0, 0, 500), (1, 0, 500)]);
        assert_eq!(plan[0].1, plan[1].1);
        let plan = prefill_plan(&c, 1, &[(0, 0, 500), (1, 8000, 500), (2, 0, 3)]);
        assert!(plan.iter().all(|p| p.1 == 1), "{plan:?}");
    }

    #[test]
    fn log_probs_are_a_normalised_log_softmax_with_the_best_first() {
        let logits = [1.0f32, 3.0, -2.0, 3.0, 0.5];
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        let want = |i: usize| ((logits[i] as f64).exp() / z).ln() as f32;
        let r = log_probs(&logits, 4, 3);
        assert_eq!(r.token, 4);
        assert!((r.logprob - want(4)).abs() < 1e-6);
        let ids: Vec<u32> = r.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 0], "descending, the tie broken by the smaller id");
        for (i, lp) in &r.top {
            assert!((lp - want(*i as usize)).abs() < 1e-6);
        }
        let total: f64 = (0..5).map(|i| (log_probs(&logits, i, 0).logprob as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(log_probs(&logits, 0, 0).top.is_empty());
        assert_eq!(log_probs(&logits, 0, 9).top.len(), 5, "no more alternatives than the vocabulary");
    }
}
