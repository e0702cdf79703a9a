//! The sidecar's Prometheus metrics. Their names and labels are a contract (DESIGN.md): the
//! operator's autoscaler and the dashboards read them. Every metric carries `model` and
//! `version`; histograms are in seconds, except `ferry_batch_size` (rows).

use prometheus::{
    exponential_buckets, Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

use ferry_core::metric;
use ferry_core::outcome::Outcome;

/// Latency buckets from 1 ms to 10 s, dense around the 100–300 ms where batch deadlines live.
const SECONDS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0];

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    tenant_requests: IntCounterVec,
    tenant_queue_wait: HistogramVec,
    queue_depth: IntGaugeVec,
    queue_bytes: IntGaugeVec,
    oldest_age: prometheus::GaugeVec,
    queue_wait: HistogramVec,
    request_duration: HistogramVec,
    batch_size: HistogramVec,
    batch_duration: HistogramVec,
    workers: IntGaugeVec,
    late_results: IntCounterVec,
    admission_locked: IntGaugeVec,
    ttft: HistogramVec,
    itl: HistogramVec,
    sequences: IntGaugeVec,
    kv_blocks: IntGaugeVec,
    kv_usage: prometheus::GaugeVec,
    kv_config: IntGaugeVec,
    preemptions: IntCounterVec,
    prompt_tokens: IntCounterVec,
    generation_tokens: IntCounterVec,
    prefix_queries: IntCounterVec,
    prefix_hits: IntCounterVec,
    step_tokens: HistogramVec,
    step_duration: HistogramVec,
    step_sequences: HistogramVec,
    queue_tokens: IntGaugeVec,
    step_cost: prometheus::GaugeVec,
    capacity_requests: prometheus::GaugeVec,
    targets: prometheus::GaugeVec,
    ready: IntGaugeVec,
    capacity_tokens: prometheus::GaugeVec,
}

/// Inter-token latency buckets: 1 ms to 1 s.
const ITL_SECONDS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0];

const MV: &[&str] = &[metric::MODEL, metric::VERSION];

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        fn with(extra: &str) -> Vec<&str> {
            MV.iter().copied().chain([extra]).collect()
        }
        let hist = |name: &str, help: &str, buckets: Vec<f64>| {
            HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), MV).expect("valid histogram")
        };
        let m = Metrics {
            requests: IntCounterVec::new(
                Opts::new(metric::REQUESTS, "Requests by how they ended (see the outcome table)."),
                &with(metric::OUTCOME),
            )
            .expect("valid counter"),
            tenant_requests: IntCounterVec::new(
                Opts::new(metric::TENANT_REQUESTS, "Requests by tenant and how they ended (see the outcome table)."),
                &[metric::TENANT, metric::OUTCOME],
            )
            .expect("valid counter"),
            tenant_queue_wait: HistogramVec::new(
                HistogramOpts::new(metric::TENANT_QUEUE_WAIT, "Time from admission to dispatch, by tenant.").buckets(SECONDS.to_vec()),
                &[metric::TENANT],
            )
            .expect("valid histogram"),
            queue_depth: IntGaugeVec::new(Opts::new(metric::QUEUE_DEPTH, "Requests waiting in the queue."), MV)
                .expect("valid gauge"),
            queue_bytes: IntGaugeVec::new(Opts::new(metric::QUEUE_BYTES, "Payload bytes waiting in the queue."), MV)
                .expect("valid gauge"),
            oldest_age: prometheus::GaugeVec::new(
                Opts::new(metric::QUEUE_OLDEST_AGE, "How long the oldest queued request has waited (0 when empty)."),
                MV,
            )
            .expect("valid gauge"),
            queue_wait: hist(metric::QUEUE_WAIT, "Time from admission to dispatch.", SECONDS.to_vec()),
            request_duration: hist(
                metric::REQUEST_DURATION,
                "Time from admission to reply.",
                SECONDS.to_vec(),
            ),
            batch_size: hist(metric::BATCH_SIZE, "Rows per dispatched batch.", exponential_buckets(1.0, 2.0, 11).expect("valid buckets")),
            batch_duration: hist(metric::BATCH_DURATION, "Engine time per batch.", SECONDS.to_vec()),
            workers: IntGaugeVec::new(Opts::new(metric::WORKERS, "Engine workers by state."), &with(metric::STATE))
                .expect("valid gauge"),
            late_results: IntCounterVec::new(
                Opts::new(
                    metric::LATE_RESULTS,
                    "Engine results discarded because their request had already been answered (deadline passed or stale attempt).",
                ),
                MV,
            )
            .expect("valid counter"),
            admission_locked: IntGaugeVec::new(
                Opts::new(
                    metric::ADMISSION_LOCKED,
                    "1 while every request has been refused for 5 s though nothing was queued or running.",
                ),
                MV,
            )
            .expect("valid gauge"),
            ttft: hist(metric::TIME_TO_FIRST_TOKEN, "Time from arrival to the first token of a generation.", SECONDS.to_vec()),
            itl: hist(metric::INTER_TOKEN_LATENCY, "Time between consecutive tokens of a generation.", ITL_SECONDS.to_vec()),
            sequences: IntGaugeVec::new(
                Opts::new(metric::SEQUENCES, "Generation sequences: running (holding KV blocks) or waiting."),
                &with(metric::STATE),
            )
            .expect("valid gauge"),
            kv_blocks: IntGaugeVec::new(Opts::new(metric::KV_BLOCKS, "KV-cache blocks by state."), &with(metric::STATE))
                .expect("valid gauge"),
            kv_usage: prometheus::GaugeVec::new(Opts::new(metric::KV_USAGE, "Used KV-cache blocks over all blocks."), MV)
                .expect("valid gauge"),
            kv_config: IntGaugeVec::new(
                Opts::new(metric::KV_CACHE_CONFIG, "The KV cache's layout in its labels (always 1), as vLLM's cache_config_info."),
                &[metric::MODEL, metric::VERSION, metric::BLOCK_SIZE, metric::BLOCKS],
            )
            .expect("valid gauge"),
            preemptions: IntCounterVec::new(
                Opts::new(metric::PREEMPTIONS, "Sequences that gave their KV blocks back, to be recomputed."),
                MV,
            )
            .expect("valid counter"),
            prompt_tokens: IntCounterVec::new(Opts::new(metric::PROMPT_TOKENS, "Prompt tokens of admitted generations."), MV)
                .expect("valid counter"),
            generation_tokens: IntCounterVec::new(Opts::new(metric::GENERATION_TOKENS, "Tokens generated and sent."), MV)
                .expect("valid counter"),
            prefix_queries: IntCounterVec::new(
                Opts::new(metric::PREFIX_CACHE_QUERIES, "Prompt tokens of generations started with the prefix cache on."),
                MV,
            )
            .expect("valid counter"),
            prefix_hits: IntCounterVec::new(
                Opts::new(metric::PREFIX_CACHE_HITS, "Prompt tokens the prefix cache held (not prefilled)."),
                MV,
            )
            .expect("valid counter"),
            step_tokens: hist(
                metric::STEP_TOKENS,
                "Tokens fed to the model per engine step.",
                exponential_buckets(1.0, 2.0, 14).expect("valid buckets"),
            ),
            step_duration: hist(metric::STEP_DURATION, "Engine time per step.", SECONDS.to_vec()),
            step_sequences: hist(
                metric::STEP_SEQUENCES,
                "Sequences per engine step (decodes and prefill chunks).",
                exponential_buckets(1.0, 2.0, 12).expect("valid buckets"),
            ),
            queue_tokens: IntGaugeVec::new(
                Opts::new(metric::QUEUE_TOKENS, "Prompt tokens of waiting generation sequences."),
                MV,
            )
            .expect("valid gauge"),
            step_cost: prometheus::GaugeVec::new(
                Opts::new(
                    metric::STEP_COST,
                    "A generation step's learned cost, seconds per unit of each term (NaN where no step engine runs).",
                ),
                &with(metric::TERM),
            )
            .expect("valid gauge"),
            capacity_requests: prometheus::GaugeVec::new(
                Opts::new(
                    metric::CAPACITY_REQUESTS,
                    "Generation requests a second this pod serves with its promises kept, at the recent requests' shape (a 256-token prompt and answer until requests show theirs).",
                ),
                MV,
            )
            .expect("valid gauge"),
            capacity_tokens: prometheus::GaugeVec::new(
                Opts::new(metric::CAPACITY_TOKENS, "Generated tokens a second at that capacity."),
                MV,
            )
            .expect("valid gauge"),
            targets: prometheus::GaugeVec::new(
                Opts::new(metric::TARGET, "The deadline a request gets when it names none, by promise."),
                &with(metric::PROMISE),
            )
            .expect("valid gauge"),
            ready: IntGaugeVec::new(
                Opts::new(metric::READY, "1 while the model version takes requests (engine ready, batcher or step loop running, not draining)."),
                MV,
            )
            .expect("valid gauge"),
            registry,
        };
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(m.requests.clone()),
            Box::new(m.tenant_requests.clone()),
            Box::new(m.tenant_queue_wait.clone()),
            Box::new(m.queue_depth.clone()),
            Box::new(m.queue_bytes.clone()),
            Box::new(m.oldest_age.clone()),
            Box::new(m.queue_wait.clone()),
            Box::new(m.request_duration.clone()),
            Box::new(m.batch_size.clone()),
            Box::new(m.batch_duration.clone()),
            Box::new(m.workers.clone()),
            Box::new(m.late_results.clone()),
            Box::new(m.admission_locked.clone()),
            Box::new(m.ttft.clone()),
            Box::new(m.itl.clone()),
            Box::new(m.sequences.clone()),
            Box::new(m.kv_blocks.clone()),
            Box::new(m.kv_usage.clone()),
            Box::new(m.kv_config.clone()),
            Box::new(m.preemptions.clone()),
            Box::new(m.prompt_tokens.clone()),
            Box::new(m.generation_tokens.clone()),
            Box::new(m.prefix_queries.clone()),
            Box::new(m.prefix_hits.clone()),
            Box::new(m.step_tokens.clone()),
            Box::new(m.step_duration.clone()),
            Box::new(m.step_sequences.clone()),
            Box::new(m.queue_tokens.clone()),
            Box::new(m.step_cost.clone()),
            Box::new(m.capacity_requests.clone()),
            Box::new(m.capacity_tokens.clone()),
            Box::new(m.targets.clone()),
            Box::new(m.ready.clone()),
        ];
        for c in collectors {
            m.registry.register(c).expect("metric names are unique");
        }
        m
    }

    /// The `ferry_requests_total` series of one model version, one per outcome.
    pub fn outcomes(&self, model: &str, version: &str) -> Outcomes {
        Outcomes(Outcome::ALL.map(|o| self.requests.with_label_values(&[model, version, o.label()])))
    }

    /// The outcomes of requests that named no model this sidecar serves (`model=""`,
    /// `version=""`): counted, but never against a served model's series.
    /// Where a tenant's outcomes are counted (`ferry_tenant_requests_total`).
    pub fn tenant_outcomes(&self, tenant: &str) -> Outcomes {
        Outcomes(Outcome::ALL.map(|o| self.tenant_requests.with_label_values(&[tenant, o.label()])))
    }

    /// A tenant's request waited `wait` from admission to dispatch.
    pub fn observe_tenant_queue_wait(&self, tenant: &str, wait: std::time::Duration) {
        self.tenant_queue_wait.with_label_values(&[tenant]).observe(wait.as_secs_f64());
    }

    pub fn unknown_model(&self) -> Outcomes {
        self.outcomes("", "")
    }

    /// The handles of one model version, with every series created up front so that `/metrics`
    /// shows each name (at zero) before the first request.
    pub fn model(&self, model: &str, version: &str) -> ModelMetrics {
        let mv = [model, version];
        ModelMetrics {
            requests: self.outcomes(model, version),
            queue_depth: self.queue_depth.with_label_values(&mv),
            queue_bytes: self.queue_bytes.with_label_values(&mv),
            oldest_age: self.oldest_age.with_label_values(&mv),
            queue_wait: self.queue_wait.with_label_values(&mv),
            request_duration: self.request_duration.with_label_values(&mv),
            batch_size: self.batch_size.with_label_values(&mv),
            batch_duration: self.batch_duration.with_label_values(&mv),
            busy: self.workers.with_label_values(&[model, version, "busy"]),
            idle: self.workers.with_label_values(&[model, version, "idle"]),
            late_results: self.late_results.with_label_values(&mv),
            lockout: LockView::new(model, version, self.admission_locked.with_label_values(&mv)),
        }
    }

    /// The handles of one generation model version: the request series it shares with
    /// request-level services (outcomes, queue, durations) and the generation series.
    pub fn generation(&self, model: &str, version: &str) -> GenerationMetrics {
        let mv = [model, version];
        let state = |v: &IntGaugeVec, s: &str| v.with_label_values(&[model, version, s]);
        GenerationMetrics {
            requests: self.outcomes(model, version),
            queue_depth: self.queue_depth.with_label_values(&mv),
            queue_bytes: self.queue_bytes.with_label_values(&mv),
            oldest_age: self.oldest_age.with_label_values(&mv),
            queue_wait: self.queue_wait.with_label_values(&mv),
            request_duration: self.request_duration.with_label_values(&mv),
            late_results: self.late_results.with_label_values(&mv),
            lockout: LockView::new(model, version, self.admission_locked.with_label_values(&mv)),
            ttft: self.ttft.with_label_values(&mv),
            itl: self.itl.with_label_values(&mv),
            running: state(&self.sequences, "running"),
            waiting: state(&self.sequences, "waiting"),
            kv_used: state(&self.kv_blocks, "used"),
            kv_free: state(&self.kv_blocks, "free"),
            kv_usage: self.kv_usage.with_label_values(&mv),
            kv_config: KvConfig { gauge: self.kv_config.clone(), model: model.to_owned(), version: version.to_owned() },
            preemptions: self.preemptions.with_label_values(&mv),
            prompt_tokens: self.prompt_tokens.with_label_values(&mv),
            generation_tokens: self.generation_tokens.with_label_values(&mv),
            prefix_queries: self.prefix_queries.with_label_values(&mv),
            prefix_hits: self.prefix_hits.with_label_values(&mv),
            step_tokens: self.step_tokens.with_label_values(&mv),
            step_duration: self.step_duration.with_label_values(&mv),
            step_sequences: self.step_sequences.with_label_values(&mv),
            queue_tokens: self.queue_tokens.with_label_values(&mv),
            step_cost: STEP_COST_TERMS.map(|term| nan(self.step_cost.with_label_values(&[model, version, term]))),
            capacity_requests: nan(self.capacity_requests.with_label_values(&mv)),
            capacity_tokens: nan(self.capacity_tokens.with_label_values(&mv)),
        }
    }

    /// The default deadline of `promise` (`request`, `time_to_first_token`, `inter_token`) for
    /// one model version.
    pub fn target(&self, model: &str, version: &str, promise: &str, deadline: std::time::Duration) {
        self.targets.with_label_values(&[model, version, promise]).set(deadline.as_secs_f64());
    }

    /// Whether one model version takes requests now (set at each scrape).
    pub fn ready(&self, model: &str, version: &str, ready: bool) {
        self.ready.with_label_values(&[model, version]).set(i64::from(ready));
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        encode(&self.registry.gather())
    }

    /// The exposition served on the API port, for an endpoint picker that scrapes the port it
    /// routes to: every family but those with a [`metric::TENANT`] label, since callers of the API
    /// must not read other tenants' figures (the admin listener serves all of them).
    pub fn render_public(&self) -> String {
        let mut families = self.registry.gather();
        families.retain(|f| !f.get_metric().iter().any(|m| m.get_label().iter().any(|l| l.name() == metric::TENANT)));
        encode(&families)
    }
}

fn encode(families: &[prometheus::proto::MetricFamily]) -> String {
    let mut out = Vec::new();
    TextEncoder::new().encode(families, &mut out).expect("text encoding cannot fail");
    String::from_utf8(out).expect("the text format is UTF-8")
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// One model version's series.
/// One model version's `ferry_requests_total` series. Only a [`crate::tally::Tally`] counts into
/// them, once per request.
#[derive(Clone)]
pub struct Outcomes([prometheus::IntCounter; Outcome::ALL.len()]);

impl Outcomes {
    pub(crate) fn count(&self, outcome: Outcome) {
        let i = Outcome::ALL.iter().position(|o| *o == outcome).expect("ALL lists every outcome");
        self.0[i].inc();
    }

    pub fn total(&self, outcome: Outcome) -> u64 {
        let i = Outcome::ALL.iter().position(|o| *o == outcome).expect("ALL lists every outcome");
        self.0[i].get()
    }
}

#[derive(Clone)]
pub struct ModelMetrics {
    requests: Outcomes,
    pub queue_depth: prometheus::IntGauge,
    pub queue_bytes: prometheus::IntGauge,
    pub oldest_age: prometheus::Gauge,
    pub queue_wait: prometheus::Histogram,
    pub request_duration: prometheus::Histogram,
    pub batch_size: prometheus::Histogram,
    pub batch_duration: prometheus::Histogram,
    pub busy: prometheus::IntGauge,
    pub idle: prometheus::IntGauge,
    pub late_results: prometheus::IntCounter,
    pub lockout: LockView,
}

impl ModelMetrics {
    /// Its `ferry_requests_total` series, for a request's [`crate::tally::Tally`].
    pub fn outcomes(&self) -> &Outcomes {
        &self.requests
    }

    pub fn outcome_total(&self, outcome: Outcome) -> u64 {
        self.requests.total(outcome)
    }
}

/// One generation model version's series.
#[derive(Clone)]
pub struct GenerationMetrics {
    requests: Outcomes,
    pub queue_depth: prometheus::IntGauge,
    pub queue_bytes: prometheus::IntGauge,
    pub oldest_age: prometheus::Gauge,
    pub queue_wait: prometheus::Histogram,
    pub request_duration: prometheus::Histogram,
    pub late_results: prometheus::IntCounter,
    pub lockout: LockView,
    pub ttft: prometheus::Histogram,
    pub itl: prometheus::Histogram,
    pub running: prometheus::IntGauge,
    pub waiting: prometheus::IntGauge,
    pub kv_used: prometheus::IntGauge,
    pub kv_free: prometheus::IntGauge,
    pub kv_usage: prometheus::Gauge,
    pub kv_config: KvConfig,
    pub preemptions: prometheus::IntCounter,
    pub prompt_tokens: prometheus::IntCounter,
    pub generation_tokens: prometheus::IntCounter,
    pub prefix_queries: prometheus::IntCounter,
    pub prefix_hits: prometheus::IntCounter,
    pub step_tokens: prometheus::Histogram,
    pub step_duration: prometheus::Histogram,
    pub step_sequences: prometheus::Histogram,
    pub queue_tokens: prometheus::IntGauge,
    /// `ferry_step_cost_seconds` by [`STEP_COST_TERMS`].
    pub step_cost: [prometheus::Gauge; 5],
    pub capacity_requests: prometheus::Gauge,
    pub capacity_tokens: prometheus::Gauge,
}

/// `ferry_kv_cache_config_info` of one model version: its layout is known only once the engine
/// has loaded (the built-in decoder sizes its cache from the memory left), and the relay has none.
#[derive(Clone)]
pub struct KvConfig {
    gauge: IntGaugeVec,
    model: String,
    version: String,
}

impl KvConfig {
    /// The cache holds `blocks` blocks of `block_size` tokens.
    pub fn set(&self, block_size: u32, blocks: u32) {
        let (size, blocks) = (block_size.to_string(), blocks.to_string());
        self.gauge.with_label_values(&[self.model.as_str(), &self.version, &size, &blocks]).set(1);
    }
}

/// The `term` labels of `ferry_step_cost_seconds`, in the order of
/// [`ferry_core::generation::step::StepCost`]'s fields.
pub const STEP_COST_TERMS: [&str; 5] = ["fixed", "decode", "prefill_token", "context_token", "attended_slot"];

/// A gauge that reads NaN until it is set: no figure yet, which 0 would misstate.
fn nan(g: prometheus::Gauge) -> prometheus::Gauge {
    g.set(f64::NAN);
    g
}

impl GenerationMetrics {
    /// Its `ferry_requests_total` series, for a request's [`crate::tally::Tally`].
    pub fn outcomes(&self) -> &Outcomes {
        &self.requests
    }

    pub fn outcome_total(&self, outcome: Outcome) -> u64 {
        self.requests.total(outcome)
    }
}

/// What a model version's shell last found of its [`ferry_core::lockout::Lockout`], for the
/// gauge, the log and `/v2/health/ready`.
#[derive(Clone)]
pub struct LockView {
    model: String,
    version: String,
    gauge: prometheus::IntGauge,
    reason: std::sync::Arc<std::sync::Mutex<Option<String>>>,
}

impl LockView {
    fn new(model: &str, version: &str, gauge: prometheus::IntGauge) -> Self {
        LockView { model: model.into(), version: version.into(), gauge, reason: Default::default() }
    }

    /// The shell's latest finding: `Some(why)` while locked. Logged once as it starts and ends.
    pub fn show(&self, locked: Option<String>) {
        let mut reason = self.reason.lock().expect("no panic holds it");
        match (&*reason, &locked) {
            (None, Some(why)) => {
                tracing::warn!(model = %self.model, version = %self.version, "{why}");
                self.gauge.set(1);
            }
            (Some(_), None) => {
                tracing::info!(model = %self.model, version = %self.version, "admitting again");
                self.gauge.set(0);
            }
            _ => {}
        }
        *reason = locked;
    }

    /// Why it refuses every request while idle, if it does.
    pub fn reason(&self) -> Option<String> {
        self.reason.lock().expect("no panic holds it").clone()
    }
}
