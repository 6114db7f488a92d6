//! An OpenAI-compatible HTTP server over the serving engine: `POST /v1/chat/completions`,
//! `POST /v1/completions` (both with SSE streaming), `GET /v1/models`, `GET /health`,
//! `GET /metrics`.

pub mod metrics;
pub mod openai;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dspark_engine::{
    EngineHandle, Event, FinishReason, Request, RequestParams, SubmitError, TokenLogprob, Usage,
};
use dspark_model::Model;
use dspark_sampling::SamplingParams;
use dspark_tokenizer::{ChatMessage, StreamDecoder};
use metrics::Metrics;
use openai::{ApiError, ChatRequest, CompletionRequest, Settings};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// How long a client may take to send what it sends: a client that trickles bytes (slowloris)
/// would otherwise hold a connection and its task forever.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// From the connection's first byte (or the previous response) to the end of the headers.
    pub header: std::time::Duration,
    /// To receive the whole request body.
    pub body: std::time::Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self { header: std::time::Duration::from_secs(10), body: std::time::Duration::from_secs(30) }
    }
}

/// The largest request body accepted (axum's default limit).
pub const MAX_BODY: usize = 2 << 20;

pub struct AppState {
    pub engine: Arc<EngineHandle>,
    /// Clients must send `Authorization: Bearer KEY` on every `/v1` route when set.
    pub api_key: Option<String>,
    pub timeouts: Timeouts,
    /// The id clients put in `model`.
    pub model_name: String,
    pub drafter_name: Option<String>,
    /// `max_tokens` when a request gives none (capped by the context left).
    pub default_max_tokens: usize,
    pub metrics: Metrics,
    next_id: AtomicU64,
    started: u64,
}

impl AppState {
    pub fn new(
        engine: Arc<EngineHandle>,
        model_name: &str,
        drafter_name: Option<String>,
        default_max_tokens: usize,
    ) -> Self {
        Self {
            engine,
            api_key: None,
            timeouts: Timeouts::default(),
            model_name: model_name.to_string(),
            drafter_name,
            default_max_tokens,
            metrics: Metrics::new(),
            next_id: AtomicU64::new(1),
            started: unix_now(),
        }
    }

    /// Requires `Authorization: Bearer KEY` on the `/v1` routes; `None` (or an empty key) leaves
    /// them open.
    pub fn with_api_key(mut self, key: Option<String>) -> Self {
        self.api_key = key.filter(|k| !k.is_empty());
        self
    }

    pub fn with_timeouts(mut self, t: Timeouts) -> Self {
        self.timeouts = t;
        self
    }

    fn model(&self) -> &Model {
        &self.engine.target
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(|| async {
            ApiError::invalid("no such endpoint; see /v1/chat/completions, /v1/completions, /v1/models", None)
                .status(StatusCode::NOT_FOUND)
        })
        .with_state(state)
}

/// Lets a `/v1` request through when the server has no API key or the request carries it.
/// `/health` and `/metrics` stay open for probes and scrapers.
async fn authorize(
    State(s): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(key) = &s.api_key else { return next.run(req).await };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    if given.is_some_and(|g| same(g.as_bytes(), key.as_bytes())) {
        return next.run(req).await;
    }
    s.metrics.request("rejected");
    let mut e = ApiError::invalid(
        "missing or incorrect API key: send `Authorization: Bearer KEY` with the server's --api-key",
        None,
    )
    .status(StatusCode::UNAUTHORIZED)
    .with_code("invalid_api_key");
    e.kind = "authentication_error";
    e.into_response()
}

/// Compares in time independent of where the inputs differ, so that the key cannot be guessed
/// byte by byte from response times.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The request body, within the body timeout and size limit.
async fn read_body(s: &AppState, body: axum::body::Body) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(s.timeouts.body, axum::body::to_bytes(body, MAX_BODY)).await {
        Err(_) => Err(ApiError::invalid(
            format!("the request body did not arrive within {} s", s.timeouts.body.as_secs_f64()),
            None,
        )
        .status(StatusCode::REQUEST_TIMEOUT)),
        Ok(Err(e)) => Err(ApiError::invalid(
            format!("cannot read the request body (at most {MAX_BODY} bytes): {e}"),
            None,
        )
        .status(StatusCode::PAYLOAD_TOO_LARGE)),
        Ok(Ok(b)) => Ok(b),
    }
}

/// Serves until `shutdown` resolves, then stops taking requests, lets in-flight ones finish and
/// stops the engine.
///
/// An engine that dies (a panic in a step) fails the whole server: `/health` answers 503 with
/// the reason, the server stops as on `shutdown`, and this returns an error, so that `dspark
/// serve` exits non-zero and a supervisor restarts it. Staying up would answer every request
/// with 503 while health checks kept passing.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let engine = state.engine.clone();
    let stopping = engine.clone();
    let watched = engine.clone();
    let signal = async move {
        let failed = async {
            while watched.shared.failure().is_none() {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            // A moment of failing health checks lets a load balancer take this server out of
            // rotation before connections are refused.
            tokio::time::sleep(FAILED_LINGER).await;
        };
        tokio::select! { _ = shutdown => {}, _ = failed => {} }
        stopping.shared.stopping.store(true, Relaxed);
    };
    accept_loop(listener, state, signal).await;
    let failure = engine.shared.failure();
    tokio::task::spawn_blocking(move || engine.shutdown()).await.ok();
    match failure {
        Some(f) => Err(std::io::Error::other(f)),
        None => Ok(()),
    }
}

/// Accepts connections until `signal`, then lets open ones finish. Like `axum::serve`, plus a
/// header read timeout (which `axum::serve` does not set), and while the open connections drain,
/// new ones are still answered (one request each): completions get 503 `shutting_down` with a
/// message and `/health` says `stopping`, where a closed port would only refuse them.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    signal: impl Future<Output = ()> + Send + 'static,
) {
    use hyper::server::conn::http1::Builder;
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::server::graceful::GracefulShutdown;
    let header_timeout = state.timeouts.header;
    let app = router(state);
    let accept = |r: std::io::Result<(tokio::net::TcpStream, SocketAddr)>| match r {
        Ok((stream, _)) => Some(TokioIo::new(stream)),
        // Out of file descriptors and the like: keep serving the connections there are.
        Err(_) => None,
    };
    let backoff = || tokio::time::sleep(std::time::Duration::from_millis(50));
    // HTTP/1.1 only, as with `axum::serve`'s defaults here.
    let mut builder = Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(header_timeout);
    let open = GracefulShutdown::new();
    let mut signal = std::pin::pin!(signal);
    loop {
        let io = tokio::select! {
            r = listener.accept() => accept(r),
            _ = &mut signal => break,
        };
        let Some(io) = io else {
            backoff().await;
            continue;
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = open.watch(builder.serve_connection(io, svc));
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    let mut late_builder = Builder::new();
    late_builder.timer(TokioTimer::new()).header_read_timeout(header_timeout).keep_alive(false);
    let late = GracefulShutdown::new();
    let mut drained = std::pin::pin!(open.shutdown());
    loop {
        let io = tokio::select! {
            r = listener.accept() => accept(r),
            _ = &mut drained => break,
        };
        let Some(io) = io else {
            backoff().await;
            continue;
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = late.watch(late_builder.serve_connection(io, svc));
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    drop(listener);
    // Late connections answer one quick refusal each; a silent one is not waited for long.
    let _ = tokio::time::timeout(header_timeout, late.shutdown()).await;
}

/// How long a server whose engine died keeps answering (503) before it stops.
pub const FAILED_LINGER: std::time::Duration = std::time::Duration::from_secs(1);

/// A server on its own thread and runtime (for benches and tests).
pub struct ServerHandle {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl ServerHandle {
    /// Graceful stop: waits for in-flight requests and the engine.
    pub fn stop(mut self) -> std::io::Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> std::io::Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.thread.take() {
            Some(t) => t.join().unwrap_or_else(|_| Err(std::io::Error::other("server thread panicked"))),
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

pub fn start(state: Arc<AppState>, addr: &str) -> std::io::Result<ServerHandle> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind(addr))?;
    let local = listener.local_addr()?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let thread = std::thread::Builder::new().name("dspark-http".into()).spawn(move || {
        rt.block_on(serve(listener, state, async {
            let _ = rx.await;
        }))
    })?;
    Ok(ServerHandle { addr: local, stop: Some(tx), thread: Some(thread) })
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    let sh = &s.engine.shared;
    let failure = sh.failure();
    let status = match (&failure, sh.stopping.load(Relaxed)) {
        (Some(_), _) => "failed",
        (None, true) => "stopping",
        (None, false) => "ok",
    };
    let body = json!({
        "status": status,
        "error": failure,
        "model": s.model_name,
        "drafter": s.drafter_name,
        "policy": s.engine.config.policy.to_string(),
        "running": sh.running.load(Relaxed),
        "queued": sh.queued.load(Relaxed),
    });
    let code = if sh.stopping.load(Relaxed) { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
    (code, Json(body)).into_response()
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [
        {"id": s.model_name, "object": "model", "created": s.started, "owned_by": "dspark",
         "max_model_len": s.model().config.context_length}
    ]}))
}

async fn metrics_text(State(s): State<Arc<AppState>>) -> Response {
    let text = s.metrics.render(&s.engine.shared);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Text,
}

async fn chat(State(s): State<Arc<AppState>>, body: axum::body::Body) -> Response {
    let arrived = Instant::now();
    let body = match read_body(&s, body).await {
        Ok(b) => b,
        Err(e) => return reject(&s, e),
    };
    let r: Result<_, ApiError> = (|| {
        let req: ChatRequest = openai::parse(&body)?;
        check_model(&s, &req.common.model)?;
        let turns = req.turns()?;
        let mut settings = req.common.settings()?;
        settings.logprobs = req.logprobs()?;
        let msgs: Vec<ChatMessage> = turns.iter().map(|(r, c)| ChatMessage::new(r, c)).collect();
        // Message text never becomes control tokens: a client cannot write other turns.
        let prompt = s
            .model()
            .encode_chat(&msgs)
            .map_err(|e| ApiError::invalid(format!("chat template: {e}"), Some("messages")))?;
        Ok((prompt, settings))
    })();
    match r {
        Ok((prompt, settings)) => generate(s, Kind::Chat, prompt, settings, arrived).await,
        Err(e) => reject(&s, e),
    }
}

async fn completions(State(s): State<Arc<AppState>>, body: axum::body::Body) -> Response {
    let arrived = Instant::now();
    let body = match read_body(&s, body).await {
        Ok(b) => b,
        Err(e) => return reject(&s, e),
    };
    let r: Result<_, ApiError> = (|| {
        let req: CompletionRequest = openai::parse(&body)?;
        check_model(&s, &req.common.model)?;
        let logprobs = req.logprobs()?;
        let prompts = req.prompt.into_vec();
        if prompts.len() != 1 {
            return Err(ApiError::invalid("give exactly one prompt string", Some("prompt")));
        }
        let mut settings = req.common.settings()?;
        settings.logprobs = logprobs;
        let prompt = s
            .model()
            .tokenizer
            .encode(&prompts[0], req.parse_special)
            .map_err(|e| ApiError::invalid(format!("cannot tokenize the prompt: {e}"), Some("prompt")))?;
        Ok((prompt, settings))
    })();
    match r {
        Ok((prompt, settings)) => generate(s, Kind::Text, prompt, settings, arrived).await,
        Err(e) => reject(&s, e),
    }
}

fn reject(s: &AppState, e: ApiError) -> Response {
    s.metrics.request("rejected");
    e.into_response()
}

fn check_model(s: &AppState, model: &str) -> Result<(), ApiError> {
    if model == s.model_name {
        return Ok(());
    }
    Err(ApiError::invalid(
        format!("the model `{model}` does not exist; this server serves `{}` (see /v1/models)", s.model_name),
        Some("model"),
    )
    .status(StatusCode::NOT_FOUND)
    .with_code("model_not_found"))
}

fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull(_) => ApiError::invalid(e.to_string(), None)
            .status(StatusCode::TOO_MANY_REQUESTS)
            .with_code("queue_full"),
        SubmitError::ShuttingDown => ApiError::invalid(e.to_string(), None)
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .with_code("shutting_down"),
        SubmitError::EngineFailed(_) => ApiError::invalid(e.to_string(), None)
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .with_code("engine_failed"),
        SubmitError::ContextExceeded { .. } => {
            ApiError::invalid(e.to_string(), Some("messages")).with_code("context_length_exceeded")
        }
        SubmitError::Invalid(m) => ApiError::invalid(m, None),
    }
}

/// Holds back text that might be the start of a stop sequence.
struct StopFilter {
    stops: Vec<String>,
    text: String,
    emitted: usize,
}

impl StopFilter {
    /// Adds text; returns what is safe to emit and whether a stop sequence was reached.
    fn push(&mut self, piece: &str) -> (String, bool) {
        self.text += piece;
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let from = self.emitted.saturating_sub(longest);
        let from = (0..=from).rev().find(|&i| self.text.is_char_boundary(i)).unwrap_or(0);
        let hit =
            self.stops.iter().filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i)).min();
        let end = match hit {
            Some(i) => i.max(self.emitted),
            None => {
                let mut e = self.text.len().saturating_sub(longest.saturating_sub(1)).max(self.emitted);
                while !self.text.is_char_boundary(e) {
                    e -= 1;
                }
                e.max(self.emitted)
            }
        };
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        (out, hit.is_some())
    }

    fn flush(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }
}

/// One answer's tokens to text: incremental detokenization, stop sequences held back.
struct Detok<'a> {
    dec: StreamDecoder<'a>,
    stops: StopFilter,
    /// Log-probabilities of the tokens so far, each with the byte offset in the answer where the
    /// token's text starts; the first `reported` went out already.
    lps: Vec<(usize, TokenLogprob)>,
    reported: usize,
    /// A (byte, character) offset pair of the answer, to count character offsets incrementally.
    chars_at: (usize, usize),
}

impl<'a> Detok<'a> {
    fn new(tok: &'a dspark_tokenizer::Tokenizer, stops: &[String]) -> Self {
        Self {
            dec: StreamDecoder::new(tok),
            stops: StopFilter { stops: stops.to_vec(), text: String::new(), emitted: 0 },
            lps: Vec::new(),
            reported: 0,
            chars_at: (0, 0),
        }
    }

    /// Adds tokens (with their log-probabilities when asked for); returns the text safe to emit
    /// and whether a stop sequence was reached.
    fn push(&mut self, tokens: &[u32], logprobs: Option<Vec<TokenLogprob>>) -> (String, bool) {
        let (mut out, mut hit) = (String::new(), false);
        let mut logprobs = logprobs.map(Vec::into_iter);
        for &t in tokens {
            if let Some(lp) = logprobs.as_mut().and_then(Iterator::next) {
                self.lps.push((self.stops.text.len(), lp));
            }
            if let Ok(Some(p)) = self.dec.push(t) {
                let (e, h) = self.stops.push(&p);
                out += &e;
                hit |= h;
            }
        }
        (out, hit)
    }

    fn flush(&mut self) -> String {
        self.stops.flush()
    }

    /// Log-probabilities not reported yet of the tokens whose text starts in what was emitted —
    /// so a token held back with a possible stop sequence is reported with its text, and tokens
    /// at or after a stop sequence never are — or, with `all` (the answer ended without a stop
    /// sequence), of every token left. Each comes with its text's offset in characters.
    fn take_logprobs(&mut self, all: bool) -> Vec<(usize, TokenLogprob)> {
        let limit = self.stops.emitted;
        let n = self.lps[self.reported..].iter().take_while(|(o, _)| all || *o < limit).count();
        let range = self.reported..self.reported + n;
        self.reported += n;
        let mut out = Vec::with_capacity(n);
        for i in range {
            let o = self.lps[i].0;
            let (b, c) = self.chars_at;
            self.chars_at = (o, c + self.stops.text[b..o].chars().count());
            out.push((self.chars_at.1, self.lps[i].1.clone()));
        }
        out
    }
}

/// A log-probability as its shortest decimal (`-0.3`, not the f32's exact `-0.30000001192092896`).
fn logprob_json(x: f32) -> Value {
    json!(x.to_string().parse::<f64>().unwrap_or(x as f64))
}

/// A token as OpenAI shows it: its text (lossy where the token holds part of a character) and
/// its exact bytes.
fn token_text(tok: &dspark_tokenizer::Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tok.token_bytes(id).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// The `logprobs` of a choice or chunk: chat's `{"content": [...]}`, or the legacy completions
/// object `{tokens, token_logprobs, top_logprobs, text_offset}`.
fn logprobs_json(tok: &dspark_tokenizer::Tokenizer, kind: Kind, lps: &[(usize, TokenLogprob)]) -> Value {
    match kind {
        Kind::Chat => {
            let entry = |id: u32, lp: f32| {
                let (token, bytes) = token_text(tok, id);
                json!({"token": token, "logprob": logprob_json(lp), "bytes": bytes})
            };
            let content: Vec<Value> = lps
                .iter()
                .map(|(_, lp)| {
                    let mut e = entry(lp.token, lp.logprob);
                    e["top_logprobs"] = lp.top.iter().map(|&(id, l)| entry(id, l)).collect();
                    e
                })
                .collect();
            json!({"content": content})
        }
        Kind::Text => {
            let mut tokens = Vec::new();
            let mut token_logprobs = Vec::new();
            let mut top = Vec::new();
            let mut offsets = Vec::new();
            for (offset, lp) in lps {
                let text = |id| token_text(tok, id).0;
                tokens.push(json!(text(lp.token)));
                token_logprobs.push(logprob_json(lp.logprob));
                // As in OpenAI's API: the alternatives and the chosen token (up to k + 1 keys);
                // two tokens with the same text keep the likelier one's value.
                let mut m = serde_json::Map::new();
                for &(id, l) in lp.top.iter().chain([(lp.token, lp.logprob)].iter()) {
                    m.entry(text(id)).or_insert(logprob_json(l));
                }
                top.push(Value::Object(m));
                offsets.push(json!(offset));
            }
            json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
        }
    }
}

struct Ids {
    id: String,
    prompt_tokens: usize,
    object: &'static str,
    created: u64,
    model: String,
}

impl Ids {
    fn chunk(
        &self,
        kind: Kind,
        content: Option<&str>,
        role: bool,
        finish: Option<&str>,
        logprobs: Value,
    ) -> Value {
        let choice = match kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(c) = content {
                    delta.insert("content".into(), json!(c));
                }
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Text => {
                json!({"index": 0, "text": content.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish})
            }
        };
        json!({"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": [choice]})
    }
}

fn usage_json(u: &Usage, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": u.prompt_tokens + completion_tokens,
        "speculative": {
            "rounds": u.rounds,
            "drafted_tokens": u.drafted_tokens,
            "verified_tokens": u.verified_tokens,
            "accepted_tokens": u.accepted_tokens,
            "tau": u.tau(),
            "mean_verify_budget": u.mean_verify_budget(),
            "queue_s": u.queue_s,
        }
    })
}

/// Per-request latency bookkeeping.
struct Clock {
    arrived: Instant,
    last: Option<Instant>,
}

impl Clock {
    fn tokens(&mut self, m: &Metrics, n: usize) {
        let now = Instant::now();
        match self.last {
            None => m.ttft.observe((now - self.arrived).as_secs_f64()),
            Some(t) => {
                let per = (now - t).as_secs_f64() / n.max(1) as f64;
                for _ in 0..n {
                    m.itl.observe(per);
                }
            }
        }
        self.last = Some(now);
    }
}

/// `arrived`: when the request came in, so that time to first token includes reading the body
/// and tokenizing.
async fn generate(
    s: Arc<AppState>,
    kind: Kind,
    prompt: Vec<u32>,
    st: Settings,
    arrived: Instant,
) -> Response {
    let model = s.model();
    let context = model.config.context_length;
    let room = context.saturating_sub(prompt.len());
    let max_tokens = st.max_tokens.unwrap_or_else(|| s.default_max_tokens.min(room.max(1)));
    let params = RequestParams {
        max_tokens,
        sampling: SamplingParams {
            temperature: st.temperature as f32,
            top_k: st.top_k,
            top_p: st.top_p.map(|p| p as f32),
        },
        seed: st.seed,
        stop_tokens: model.tokenizer.eos().to_vec(),
        logprobs: st.logprobs,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let prompt_tokens = prompt.len();
    let req = Request { prompt, params, tag: st.tag.clone(), events: tx };
    if let Err(e) = s.engine.submit(req) {
        return reject(&s, submit_error(e));
    }
    let n = s.next_id.fetch_add(1, Relaxed);
    let ids = Ids {
        id: format!("{}-{n}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }),
        object: match (kind, st.stream) {
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Text, _) => "text_completion",
        },
        prompt_tokens,
        created: unix_now(),
        model: s.model_name.clone(),
    };
    let clock = Clock { arrived, last: None };
    if st.stream {
        stream(s, kind, st, rx, ids, clock)
    } else {
        complete(s, kind, st, rx, ids, clock).await
    }
}

/// Collects the whole answer. A client that goes away drops this future and with it the
/// receiver, which cancels the request in the engine.
async fn complete(
    s: Arc<AppState>,
    kind: Kind,
    st: Settings,
    mut rx: mpsc::UnboundedReceiver<Event>,
    ids: Ids,
    mut clock: Clock,
) -> Response {
    let tok = &s.engine.target.tokenizer;
    let mut text = Detok::new(tok, &st.stop);
    let mut out = String::new();
    let mut count = 0;
    let (finish, usage) = loop {
        match rx.recv().await {
            Some(Event::Tokens { tokens: ts, logprobs }) => {
                clock.tokens(&s.metrics, ts.len());
                count += ts.len();
                let (piece, hit) = text.push(&ts, logprobs);
                out += &piece;
                if hit {
                    break ("stop", None);
                }
            }
            Some(Event::Done { finish, usage }) => {
                out += &text.flush();
                break (finish_reason(finish), Some(usage));
            }
            Some(Event::Error(e)) => {
                s.metrics.request("error");
                return ApiError::invalid(e, None)
                    .status(StatusCode::INTERNAL_SERVER_ERROR)
                    .with_code("engine_error")
                    .into_response();
            }
            None => {
                s.metrics.request("error");
                return ApiError::invalid("the engine stopped before finishing this request", None)
                    .status(StatusCode::SERVICE_UNAVAILABLE)
                    .into_response();
            }
        }
    };
    let logprobs = match st.logprobs {
        Some(_) => logprobs_json(tok, kind, &text.take_logprobs(usage.is_some())),
        None => Value::Null,
    };
    let usage = finished(&s, usage, count, ids.prompt_tokens);
    let choice = match kind {
        Kind::Chat => {
            json!({"index": 0, "message": {"role": "assistant", "content": out}, "logprobs": logprobs, "finish_reason": finish})
        }
        Kind::Text => json!({"index": 0, "text": out, "logprobs": logprobs, "finish_reason": finish}),
    };
    Json(json!({"id": ids.id, "object": ids.object, "created": ids.created, "model": ids.model,
                "choices": [choice], "usage": usage}))
    .into_response()
}

fn engine_error(message: &str) -> Value {
    json!({"error": {"message": message, "type": "server_error", "param": null, "code": "engine_error"}})
}

fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// Records a finished request and returns its usage object.
fn finished(s: &AppState, usage: Option<Usage>, count: usize, prompt_tokens: usize) -> Value {
    s.metrics.request("ok");
    let stopped_early = usage.is_none();
    let u = usage.unwrap_or(Usage { prompt_tokens, ..Default::default() });
    if u.rounds > 0 {
        s.metrics.verify_budget.observe(u.mean_verify_budget());
        s.metrics.request_tau.observe(u.tau());
    }
    let mut v = usage_json(&u, count);
    if stopped_early {
        // Ended by a stop sequence before the engine's summary: no speculative statistics.
        v["speculative"] = Value::Null;
    }
    v
}

fn stream(
    s: Arc<AppState>,
    kind: Kind,
    st: Settings,
    mut rx: mpsc::UnboundedReceiver<Event>,
    ids: Ids,
    mut clock: Clock,
) -> Response {
    let (tx, out) = mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        let model = s.engine.target.clone();
        let mut text = Detok::new(&model.tokenizer, &st.stop);
        let data = |v: Value| SseEvent::default().data(v.to_string());
        let first = ids.chunk(kind, Some(""), kind == Kind::Chat, None, Value::Null);
        let render = |lps: &[(usize, TokenLogprob)]| match st.logprobs {
            Some(_) => logprobs_json(&model.tokenizer, kind, lps),
            None => Value::Null,
        };
        if tx.send(data(first)).await.is_err() {
            s.metrics.request("cancelled");
            return;
        }
        let mut count = 0;
        let (finish, usage) = loop {
            let ev = tokio::select! {
                _ = tx.closed() => {
                    s.metrics.request("cancelled");
                    return; // drops `rx`: the engine cancels the request
                }
                ev = rx.recv() => ev,
            };
            match ev {
                Some(Event::Tokens { tokens: ts, logprobs }) => {
                    clock.tokens(&s.metrics, ts.len());
                    count += ts.len();
                    let (piece, hit) = text.push(&ts, logprobs);
                    // A token's log-probability goes with the chunk that shows its text.
                    if !piece.is_empty()
                        && tx
                            .send(data(ids.chunk(
                                kind,
                                Some(&piece),
                                false,
                                None,
                                render(&text.take_logprobs(false)),
                            )))
                            .await
                            .is_err()
                    {
                        s.metrics.request("cancelled");
                        return;
                    }
                    if hit {
                        break ("stop", None);
                    }
                }
                Some(Event::Done { finish, usage }) => {
                    let rest = text.flush();
                    let left = text.take_logprobs(true);
                    if !rest.is_empty() || !left.is_empty() {
                        let _ = tx.send(data(ids.chunk(kind, Some(&rest), false, None, render(&left)))).await;
                    }
                    break (finish_reason(finish), Some(usage));
                }
                Some(Event::Error(e)) => {
                    s.metrics.request("error");
                    let _ = tx.send(data(engine_error(&e))).await;
                    return;
                }
                None => {
                    s.metrics.request("error");
                    let _ =
                        tx.send(data(engine_error("the engine stopped before finishing this request"))).await;
                    return;
                }
            }
        };
        let usage = finished(&s, usage, count, ids.prompt_tokens);
        let _ = tx
            .send(data(ids.chunk(
                kind,
                if kind == Kind::Chat { None } else { Some("") },
                false,
                Some(finish),
                Value::Null,
            )))
            .await;
        if st.include_usage {
            let v = json!({"id": ids.id, "object": ids.object, "created": ids.created, "model": ids.model,
                           "choices": [], "usage": usage});
            let _ = tx.send(data(v)).await;
        }
        let _ = tx.send(SseEvent::default().data("[DONE]")).await;
    });
    let events = futures_util::stream::unfold(out, |mut out| async move {
        out.recv().await.map(|e| (Ok::<_, Infallible>(e), out))
    });
    Sse::new(events).into_response()
}

#[cfg(test)]
mod tests {
    use super::StopFilter;

    fn run(pieces: &[&str], stops: &[&str]) -> (Vec<String>, bool) {
        let mut f = StopFilter {
            stops: stops.iter().map(|s| s.to_string()).collect(),
            text: String::new(),
            emitted: 0,
        };
        let mut out = Vec::new();
        for p in pieces {
            let (e, hit) = f.push(p);
            out.push(e);
            if hit {
                return (out, true);
            }
        }
        out.push(f.flush());
        (out, false)
    }

    #[test]
    fn stop_sequences_are_held_back_and_never_emitted() {
        let (out, hit) = run(&["Hel", "lo wo", "rld ST", "OP more"], &["STOP"]);
        assert!(hit);
        assert_eq!(out.concat(), "Hello world ");
        assert!(out.iter().all(|p| !p.contains('S')), "{out:?}: a stop prefix was streamed");
        let (out, hit) = run(&["no ", "stop ", "here é"], &["STOP", "xyz"]);
        assert!(!hit);
        assert_eq!(out.concat(), "no stop here é");
        let (out, _) = run(&["abc"], &[]);
        assert_eq!(out[0], "abc", "without stops nothing is held back");
    }
}
