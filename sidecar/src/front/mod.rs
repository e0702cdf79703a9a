//! The HTTP API: Open Inference Protocol v2 REST and OpenAI's embeddings on the main listener,
//! and `/metrics` with the health endpoints on the admin listener, so that callers of the API
//! never see other tenants' figures (as Triton's :8002 and Knative's queue-proxy :9090 do).
//!
//! # Layout
//! - this file: the shared state, the routers, health and metadata, `x-request-id`.
//! - [`oip`]: the Open Inference Protocol's JSON (parse, encode, errors), with [`binary`], Triton's
//!   binary tensor data extension.
//! - [`openai`]: OpenAI's `POST /v1/embeddings` (parse, encode, errors in OpenAI's shape).
//! - [`generate`]: OpenAI's `POST /v1/completions`, `POST /v1/chat/completions` (streamed as
//!   server-sent events, or whole) and `GET /v1/models`, for generation models; [`prompt`] reads
//!   their bodies, [`format`](mod@format) the structured output they ask for, [`tools`] their tools (and
//!   [`calls`] reads calls back out of the answer); [`shape`] writes OpenAI's answers, [`relayed`] merges an upstream's chunks and
//!   [`choices`] merges the streams of `n` > 1 choices.
//! - [`admit`]: the pipeline every protocol shares: checks, deadline and priority, the engine's
//!   own checks, submission to the batcher, and the answer's headers.
//! - [`idempotent`]: the path of a request with an `idempotency-key`.
//!
//! Every inference request gets a [`Tally`] when it arrives, which counts how it ended, once.
//! Every error is `{"error": "..."}` (OpenAI's shape on its endpoint) with a sentence that names
//! the field, the value and the limit.

mod admit;
pub mod binary;
mod calls;
mod choices;
pub mod format;
pub mod generate;
mod idempotent;
pub mod oip;
pub mod openai;
pub mod prompt;
mod relayed;
mod shape;
pub mod tools;
pub mod unserved;

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::batcher::Batcher;
use crate::deadline::DeadlinePolicy;
use crate::engine::Engine;
use crate::generation::engine::StepEngine;
use crate::generation::relay::Relay;
use crate::generation::steps::Generator;
use crate::idempotency::{self, Store};
use crate::metrics::{GenerationMetrics, Metrics, Outcomes};
use crate::tally::Tally;
use crate::tenants::{Tenant, Tenants};
use ferry_core::outcome::{Outcome, Refusal};

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
pub const PRIORITY: HeaderName = HeaderName::from_static("x-ferry-priority");
pub const BATCH_SIZE: HeaderName = HeaderName::from_static("x-ferry-batch-size");
pub const SERVER_TIMING: HeaderName = HeaderName::from_static("server-timing");

/// One model version served by this sidecar.
pub struct Served {
    pub name: String,
    pub version: String,
    pub engine: Arc<dyn Engine>,
    pub batcher: Batcher,
    /// `maxBatchSize`: the most rows one request may carry.
    pub max_rows: u32,
}

impl Served {
    /// Its engine takes batches and its batcher runs.
    pub fn is_ready(&self) -> bool {
        self.engine.ready() && self.batcher.is_alive()
    }
}

/// One generation model version served by this sidecar.
pub struct Generating {
    pub name: String,
    pub version: String,
    pub backend: Backend,
    /// The default TTFT deadline and inter-token target.
    pub ttft_budget: std::time::Duration,
    pub itl: std::time::Duration,
    /// Reads the model's tool calls out of its free text (`--tool-call-parser`).
    pub tool_parser: Option<tools::Parser>,
}

/// What generates: a step engine in the sidecar, or an LLM server beside it.
pub enum Backend {
    Steps(Steps),
    Relay(Relay),
}

/// A step engine and the task that runs its steps, once the engine has loaded: the llm engine
/// loads in the background, and until then the sidecar is live but the model not ready.
pub struct Steps {
    loaded: Arc<OnceLock<(Arc<dyn StepEngine>, Generator)>>,
    installed: tokio::sync::watch::Receiver<bool>,
    metrics: GenerationMetrics,
    platform: &'static str,
}

/// Puts a loaded engine and its task in their [`Steps`].
pub struct Installer {
    loaded: Arc<OnceLock<(Arc<dyn StepEngine>, Generator)>>,
    installed: tokio::sync::watch::Sender<bool>,
}

impl Installer {
    /// The model is ready from now on.
    pub fn install(self, engine: Arc<dyn StepEngine>, generator: Generator) {
        let _ = self.loaded.set((engine, generator));
        self.installed.send_replace(true);
    }
}

impl Steps {
    /// Empty until its [`Installer`] installs the engine; `platform` is what that engine is.
    pub fn new(metrics: GenerationMetrics, platform: &'static str) -> (Steps, Installer) {
        let loaded = Arc::new(OnceLock::new());
        let (tx, rx) = tokio::sync::watch::channel(false);
        (Steps { loaded: loaded.clone(), installed: rx, metrics, platform }, Installer { loaded, installed: tx })
    }

    /// The engine and its task, once loaded.
    pub fn get(&self) -> Option<(&Arc<dyn StepEngine>, &Generator)> {
        self.loaded.get().map(|(e, g)| (e, g))
    }
}

impl Generating {
    pub fn is_ready(&self) -> bool {
        match &self.backend {
            Backend::Steps(steps) => {
                steps.get().is_some_and(|(engine, generator)| engine.ready() && generator.is_alive())
            }
            Backend::Relay(relay) => relay.is_ready() && relay.is_alive(),
        }
    }

    pub fn metrics(&self) -> &GenerationMetrics {
        match &self.backend {
            Backend::Steps(steps) => &steps.metrics,
            Backend::Relay(relay) => relay.metrics(),
        }
    }

    /// Prompt plus answer tokens one request may hold (vLLM's `max_model_len`); unknown for an
    /// upstream server, which says so itself, and for an engine still loading.
    pub fn context_length(&self) -> Option<u32> {
        match &self.backend {
            Backend::Steps(steps) => steps.get().map(|(engine, _)| engine.model().context_length()),
            Backend::Relay(relay) => relay.context_length(),
        }
    }

    /// What serves the model (OpenAI's `owned_by`).
    pub fn platform(&self) -> &str {
        match &self.backend {
            Backend::Steps(steps) => steps.platform,
            Backend::Relay(_) => "ferry_openai_upstream",
        }
    }

    pub fn refresh_age(&self) {
        match &self.backend {
            Backend::Steps(steps) => {
                if let Some((_, generator)) = steps.get() {
                    generator.refresh_age()
                }
            }
            Backend::Relay(relay) => relay.refresh_age(),
        }
    }

    /// Resolves once everything admitted has ended (at once while the engine loads: nothing is).
    pub async fn drain(&self) {
        match &self.backend {
            Backend::Steps(steps) => {
                if let Some((_, generator)) = steps.get() {
                    generator.drain().await
                }
            }
            Backend::Relay(relay) => relay.drain().await,
        }
    }

    /// Resolves when its task has stopped (once the engine has loaded: a load that fails ends
    /// the sidecar by itself).
    pub async fn stopped(&self) {
        match &self.backend {
            Backend::Steps(steps) => {
                let mut installed = steps.installed.clone();
                if installed.wait_for(|done| *done).await.is_err() {
                    // The loader went away without installing: its failure ends the sidecar.
                    return std::future::pending().await;
                }
                if let Some((_, generator)) = steps.get() {
                    generator.stopped().await
                }
            }
            Backend::Relay(relay) => relay.stopped().await,
        }
    }
}

/// State shared by the handlers.
pub struct Front {
    /// Request-level (batched) model versions.
    pub models: Vec<Arc<Served>>,
    /// Generation model versions.
    pub generators: Vec<Arc<Generating>>,
    /// When the process started, in Unix seconds (`created` of `/v1/models`).
    pub started_unix: u64,
    pub deadlines: DeadlinePolicy,
    pub max_request_bytes: u64,
    pub metrics: Metrics,
    /// Who may call, and their quotas.
    pub tenants: Arc<Tenants>,
    /// Where requests that name no served model are counted.
    unknown: Outcomes,
    draining: AtomicBool,
    ids: RequestIds,
    idempotency: Mutex<Store>,
}

impl Front {
    pub fn new(
        models: Vec<Arc<Served>>,
        generators: Vec<Arc<Generating>>,
        deadlines: DeadlinePolicy,
        max_request_bytes: u64,
        metrics: Metrics,
        idempotency: idempotency::Limits,
        tenants: Arc<Tenants>,
    ) -> Self {
        assert!(!models.is_empty() || !generators.is_empty(), "a sidecar serves at least one model");
        Front {
            models,
            generators,
            started_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            deadlines,
            max_request_bytes,
            unknown: metrics.unknown_model(),
            metrics,
            tenants,
            draining: AtomicBool::new(false),
            ids: RequestIds::default(),
            idempotency: Mutex::new(Store::new(idempotency)),
        }
    }

    /// Stops admitting: readiness turns false and new infer requests get 503 `draining`.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// A tally for a request that has just arrived, counted as for no model until it names one.
    fn tally(&self) -> Tally {
        Tally::new(self.unknown.clone())
    }

    /// Who is calling ([`Tenants::authenticate`]); from then on `tally` counts for the tenant too.
    fn authenticate(&self, headers: &axum::http::HeaderMap, tally: &mut Tally) -> Result<Arc<Tenant>, Refusal> {
        let tenant = self.tenants.authenticate(headers)?;
        tally.tenant(self.metrics.tenant_outcomes(&tenant.name));
        Ok(tenant)
    }

    /// Every model name and version served, for messages.
    fn served_list(&self) -> String {
        let known: Vec<String> = self
            .models
            .iter()
            .map(|m| (&m.name, &m.version))
            .chain(self.generators.iter().map(|g| (&g.name, &g.version)))
            .map(|(n, v)| format!("'{n}' (version {v})"))
            .collect();
        known.join(", ")
    }

    /// The generation model of that name.
    fn find_generating(&self, name: &str) -> Result<&Arc<Generating>, Refusal> {
        self.generators.iter().find(|g| g.name == name).ok_or_else(|| {
            let what =
                if self.models.iter().any(|m| m.name == name) { "is not a generation model" } else { "is unknown" };
            Refusal::new(
                Outcome::NotFound,
                format!("model '{name}' {what}; this sidecar generates with {}", {
                    let names: Vec<String> = self.generators.iter().map(|g| format!("'{}'", g.name)).collect();
                    if names.is_empty() {
                        "no model".to_owned()
                    } else {
                        names.join(", ")
                    }
                }),
            )
        })
    }

    fn find(&self, name: &str, version: Option<&str>) -> Result<&Arc<Served>, Refusal> {
        let versions: Vec<&Arc<Served>> = self.models.iter().filter(|m| m.name == name).collect();
        if versions.is_empty() && self.generators.iter().any(|g| g.name == name) {
            return Err(Refusal::new(
                Outcome::NotFound,
                format!("model '{name}' is a generation model; use {} or {}", generate::COMPLETIONS, generate::CHAT),
            ));
        }
        if versions.is_empty() {
            return Err(Refusal::new(
                Outcome::NotFound,
                format!("unknown model '{name}'; this sidecar serves {}", self.served_list()),
            ));
        }
        match version {
            None => Ok(versions[0]),
            Some(v) => versions.iter().find(|m| m.version == v).copied().ok_or_else(|| {
                let known: Vec<&str> = versions.iter().map(|m| m.version.as_str()).collect();
                Refusal::new(
                    Outcome::NotFound,
                    format!("model '{name}' has no version '{v}'; it has version {}", known.join(", ")),
                )
            }),
        }
    }
}

pub type Shared = Arc<Front>;

/// The inference API (port 8080 by default).
pub fn api(front: Shared) -> Router {
    Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/v2/models/{name}", get(model_metadata))
        .route("/v2/models/{name}/versions/{version}", get(model_version_metadata))
        .route("/v2/models/{name}/ready", get(model_ready))
        .route("/v2/models/{name}/versions/{version}/ready", get(model_version_ready))
        .route("/v2/models/{name}/infer", post(oip::infer))
        .route("/v2/models/{name}/versions/{version}/infer", post(oip::infer_version))
        .route(openai::PATH, post(openai::embeddings))
        .route(generate::COMPLETIONS, post(generate::completions))
        .route(generate::CHAT, post(generate::chat))
        .route(generate::MODELS, get(generate::models))
        // Where the clients of OpenAI-compatible servers wait for readiness (vLLM and llama.cpp
        // serve it on their API port).
        .route("/health", get(ready))
        // Where an endpoint picker (the Gateway API Inference Extension's) scrapes the pods it
        // routes to: the port its InferencePool targets. Every family but the tenants': callers
        // of the API never see other tenants' figures (DESIGN.md); the admin listener has all.
        .route("/metrics", get(public_metrics))
        .fallback(no_route)
        .layer(middleware::from_fn_with_state(front.clone(), request_id))
        .with_state(front)
}

/// The admin listener (port 9090 by default): metrics and health.
pub fn admin(front: Shared) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .fallback(no_route)
        .with_state(front)
}

/// Echoes `x-request-id`, or makes one up, on every response of the API.
async fn request_id(State(front): State<Shared>, mut request: Request, next: Next) -> Response {
    let id = match request.headers().get(&REQUEST_ID) {
        Some(v) if !v.is_empty() && v.len() <= 256 => v.clone(),
        _ => {
            let id = HeaderValue::from_str(&front.ids.next()).expect("hex is a valid header value");
            request.headers_mut().insert(REQUEST_ID, id.clone());
            id
        }
    };
    let mut response = next.run(request).await;
    response.headers_mut().insert(REQUEST_ID, id);
    response
}

/// Random-looking, unique request ids without another dependency: a per-process random hasher
/// over a counter.
#[derive(Default)]
struct RequestIds {
    counter: AtomicU64,
    hasher: RandomState,
}

impl RequestIds {
    fn next(&self) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}{:016x}", self.hasher.hash_one(n), self.hasher.hash_one(!n))
    }
}

/// The `{"error": ...}` response of a refusal, with `Retry-After` where it applies.
fn error(refusal: &Refusal) -> Response {
    let mut response = (status_of(refusal.outcome), Json(json!({ "error": refusal.message }))).into_response();
    if let Some(secs) = refusal.retry_after_secs() {
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

/// The HTTP status of an outcome.
pub fn status_of(outcome: Outcome) -> StatusCode {
    StatusCode::from_u16(outcome.status_code()).expect("outcomes have valid status codes")
}

/// A path the API does not have: counted as a request for no model.
async fn no_route(State(front): State<Shared>, request: Request) -> Response {
    let refusal = Refusal::new(
        Outcome::NotFound,
        format!(
            "no endpoint {} {}; see GET /v2 and the Open Inference Protocol",
            request.method(),
            request.uri().path()
        ),
    );
    front.tally().count(refusal.outcome);
    error(&refusal)
}

async fn server_metadata() -> Json<serde_json::Value> {
    Json(json!({ "name": "ferry-sidecar", "version": env!("CARGO_PKG_VERSION"), "extensions": [] }))
}

async fn live() -> Json<serde_json::Value> {
    Json(json!({ "live": true }))
}

async fn ready(State(front): State<Shared>) -> Response {
    let ready = !front.is_draining()
        && front.models.iter().all(|m| m.is_ready())
        && front.generators.iter().all(|g| g.is_ready());
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    // A model version that refuses every request while idle stays ready (Kubernetes taking the
    // pod out of its Service would not mend it, and the probes that do need traffic), but says
    // so, as its `ferry_admission_locked` gauge and its log do.
    let models = front.models.iter().map(|m| (&m.name, &m.version, m.batcher.metrics().lockout.reason()));
    let generators = front.generators.iter().map(|g| (&g.name, &g.version, g.metrics().lockout.reason()));
    let refusing: Vec<serde_json::Value> = models
        .chain(generators)
        .filter_map(|(name, version, reason)| Some(json!({ "model": name, "version": version, "reason": reason? })))
        .collect();
    let body = if refusing.is_empty() {
        json!({ "ready": ready })
    } else {
        json!({ "ready": ready, "refusingEveryRequest": refusing })
    };
    (status, Json(body)).into_response()
}

async fn model_metadata(State(front): State<Shared>, Path(name): Path<String>) -> Response {
    describe(&front, &name, None)
}

async fn model_version_metadata(
    State(front): State<Shared>,
    Path((name, version)): Path<(String, String)>,
) -> Response {
    describe(&front, &name, Some(&version))
}

fn describe(front: &Front, name: &str, version: Option<&str>) -> Response {
    match front.find(name, version) {
        Ok(served) => {
            let versions: Vec<&str> =
                front.models.iter().filter(|m| m.name == name).map(|m| m.version.as_str()).collect();
            let sig = served.engine.signature();
            Json(json!({
                "name": served.name,
                "versions": versions,
                "platform": sig.platform,
                "inputs": sig.inputs,
                "outputs": sig.outputs,
            }))
            .into_response()
        }
        Err(refusal) => error(&refusal),
    }
}

async fn model_ready(State(front): State<Shared>, Path(name): Path<String>) -> Response {
    readiness(&front, &name, None)
}

async fn model_version_ready(State(front): State<Shared>, Path((name, version)): Path<(String, String)>) -> Response {
    readiness(&front, &name, Some(&version))
}

fn readiness(front: &Front, name: &str, version: Option<&str>) -> Response {
    match front.find(name, version) {
        Ok(served) => {
            let ready = !front.is_draining() && served.is_ready();
            let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
            (status, Json(json!({ "name": served.name, "ready": ready }))).into_response()
        }
        Err(refusal) => error(&refusal),
    }
}

async fn metrics(State(front): State<Shared>) -> Response {
    refresh(&front);
    ([(header::CONTENT_TYPE, EXPOSITION)], front.metrics.render()).into_response()
}

async fn public_metrics(State(front): State<Shared>) -> Response {
    refresh(&front);
    ([(header::CONTENT_TYPE, EXPOSITION)], front.metrics.render_public()).into_response()
}

/// Prometheus' text format 0.0.4.
const EXPOSITION: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The gauges read at a scrape rather than kept up to date.
fn refresh(front: &Front) {
    let draining = front.is_draining();
    for served in &front.models {
        served.batcher.refresh_age();
        front.metrics.ready(&served.name, &served.version, !draining && served.is_ready());
    }
    for served in &front.generators {
        served.refresh_age();
        front.metrics.ready(&served.name, &served.version, !draining && served.is_ready());
    }
}
