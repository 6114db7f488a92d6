//! Prometheus metrics: latency histograms observed by the HTTP side, the engine's live counters
//! mirrored at scrape time.

use dspark_engine::Shared;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

type Labels = Vec<(String, String)>;
type FGauge = Gauge<f64, AtomicU64>;

pub struct Metrics {
    registry: Registry,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub verify_budget: Histogram,
    pub request_tau: Histogram,
    pub requests: Family<Labels, Counter>,
    queue: Gauge,
    running: Gauge,
    kv_used: Gauge,
    kv_reserved: Gauge,
    kv_capacity: Gauge,
    kv_bytes: Gauge,
    tau: FGauge,
    calibration_ece: Family<Labels, FGauge>,
    calibration_fits: Family<Labels, Gauge>,
    /// Engine counters as Prometheus counters: (counter, last value seen).
    mirrored: Vec<(Counter, &'static str)>,
    last: Mutex<Vec<u64>>,
}

const MIRRORED: [(&str, &str); 7] = [
    ("dspark_steps", "Engine steps (one target forward each)"),
    ("dspark_draft_steps", "Engine steps that drafted"),
    ("dspark_drafted_tokens", "Draft tokens proposed"),
    ("dspark_verified_tokens", "Draft tokens sent to verification by the policy"),
    ("dspark_accepted_tokens", "Draft tokens accepted"),
    ("dspark_generated_tokens", "Tokens streamed to clients"),
    ("dspark_cancelled_requests", "Requests dropped because their client went away"),
];

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registry::default();
        let ttft = Histogram::new(exponential_buckets(0.005, 2.0, 14));
        let itl = Histogram::new(exponential_buckets(0.001, 2.0, 14));
        let verify_budget =
            Histogram::new([0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 12.0, 16.0]);
        let request_tau = Histogram::new([1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0]);
        r.register(
            "dspark_time_to_first_token_seconds",
            "Time from request arrival to its first token",
            ttft.clone(),
        );
        r.register(
            "dspark_inter_token_latency_seconds",
            "Time between streamed tokens, per token",
            itl.clone(),
        );
        r.register(
            "dspark_verify_budget_per_request",
            "Mean drafts verified per step, per finished request",
            verify_budget.clone(),
        );
        r.register(
            "dspark_request_tau",
            "Tokens committed per target step, per finished request",
            request_tau.clone(),
        );
        let requests = Family::<Labels, Counter>::default();
        r.register(
            "dspark_requests",
            "Requests by outcome (ok, cancelled, error, rejected)",
            requests.clone(),
        );
        let gauge = |r: &mut Registry, name: &str, help: &str| {
            let g = Gauge::default();
            r.register(name, help, g.clone());
            g
        };
        let queue = gauge(&mut r, "dspark_queue_depth", "Requests waiting for admission");
        let running = gauge(&mut r, "dspark_running_sequences", "Requests being decoded");
        let kv_used = gauge(&mut r, "dspark_kv_used_tokens", "KV positions holding tokens");
        let kv_reserved =
            gauge(&mut r, "dspark_kv_reserved_tokens", "KV positions reserved by running requests");
        let kv_capacity = gauge(&mut r, "dspark_kv_capacity_tokens", "KV positions the server may reserve");
        let kv_bytes = gauge(&mut r, "dspark_kv_used_bytes", "Bytes of KV cache holding tokens");
        let tau = FGauge::default();
        r.register("dspark_tau", "Tokens committed per request-step since start", tau.clone());
        let calibration_ece = Family::<Labels, FGauge>::default();
        r.register(
            "dspark_calibration_ece",
            "Expected calibration error of the survivals the scheduler used, over the recent window, per workload tag",
            calibration_ece.clone(),
        );
        let calibration_fits = Family::<Labels, Gauge>::default();
        r.register(
            "dspark_calibration_fits",
            "Online recalibrations so far, per workload tag",
            calibration_fits.clone(),
        );
        let mirrored = MIRRORED
            .iter()
            .map(|&(name, help)| {
                let c = Counter::default();
                r.register(name, help, c.clone());
                (c, name)
            })
            .collect();
        Self {
            registry: r,
            ttft,
            itl,
            verify_budget,
            request_tau,
            requests,
            queue,
            running,
            kv_used,
            kv_reserved,
            kv_capacity,
            kv_bytes,
            tau,
            calibration_ece,
            calibration_fits,
            mirrored,
            last: Mutex::new(vec![0; MIRRORED.len()]),
        }
    }

    pub fn request(&self, outcome: &str) {
        self.requests.get_or_create(&vec![("outcome".into(), outcome.into())]).inc();
    }

    /// The text exposition, with the engine's state read now.
    pub fn render(&self, s: &Shared) -> String {
        let g = |x: &std::sync::atomic::AtomicUsize| x.load(Relaxed) as i64;
        self.queue.set(g(&s.queued));
        self.running.set(g(&s.running));
        self.kv_used.set(g(&s.kv_used_tokens));
        self.kv_reserved.set(g(&s.kv_reserved_tokens));
        self.kv_capacity.set(g(&s.kv_capacity_tokens));
        self.kv_bytes.set(g(&s.kv_used_tokens) * g(&s.kv_bytes_per_token));
        let rounds = s.rounds.load(Relaxed);
        if rounds > 0 {
            self.tau.set((s.accepted.load(Relaxed) + rounds) as f64 / rounds as f64);
        }
        for t in s.calibration.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let l = vec![("tag".to_string(), t.tag.clone())];
            self.calibration_ece.get_or_create(&l).set(t.ece);
            self.calibration_fits.get_or_create(&l).set(t.fits as i64);
        }
        let now = [
            s.steps.load(Relaxed),
            s.draft_steps.load(Relaxed),
            s.drafted.load(Relaxed),
            s.verified.load(Relaxed),
            s.accepted.load(Relaxed),
            s.committed.load(Relaxed),
            s.cancelled.load(Relaxed),
        ];
        let mut last = self.last.lock().unwrap();
        for ((c, _), (v, l)) in self.mirrored.iter().zip(now.iter().zip(last.iter_mut())) {
            c.inc_by(v.saturating_sub(*l));
            *l = *v;
        }
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String");
        out
    }
}
