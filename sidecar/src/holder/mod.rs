//! The holder (`ferry-holder`): where a service's traffic goes while it has no ready pod
//! (DESIGN.md, "Scale to zero"). One per cluster, CPU-only, several replicas behind its Service;
//! the operator points a service at zero to it and tells it, every tick, each such service's
//! deadline defaults, its expected time-to-ready and its ready pods ([`ServiceState`]).
//!
//! A request is told apart by its service: the `x-ferry-service: NAMESPACE/NAME` header, else its
//! `Host` (`NAME`, `NAME.NAMESPACE`, `NAME.NAMESPACE.svc[.cluster.local]`, any port). Its deadline
//! is read as the sidecar reads it (for a generation, its first token's); then
//! [`ferry_core::hold`] refuses it at once if the start-up left would make it late (503
//! `infeasible`, `Retry-After`), or holds it, bounded, until a pod is ready — released in deadline
//! order, relayed to that pod with the deadline it has left in `x-ferry-timeout-ms` (and
//! `x-ferry-ttft-ms`) — or until its deadline (504). A held stream gets its SSE headers at once
//! and a comment every keep-alive period. What it holds and refuses is exported as the service's
//! offered load ([`metrics`]), which the operator scales it from zero on.
//!
//! - [`request`]: the API: one handler for every path.
//! - [`metrics`]: the holder's Prometheus metrics.

pub mod metrics;
pub mod request;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, put};
use axum::{Json, Router};
use std::time::Instant;
use tokio::sync::oneshot;

use ferry_core::hold::{Bounds, Held, ServiceState};

/// How a holder runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// What one service may hold.
    pub bounds: Bounds,
    /// Bytes of requests held for all services together at most.
    pub total_bytes: usize,
    /// How often a held stream gets an SSE comment.
    pub keep_alive: Duration,
    /// The bearer token the operator's directions must carry (`None`: any caller may direct it,
    /// for development only: a caller that may direct it may send a service's requests anywhere).
    pub token: Option<String>,
}

/// One service the operator said the holder may hold for.
struct Service {
    state: ServiceState,
    /// When `state` came: its `starting_for_ms` counts from here.
    received: Instant,
    /// Each held request waits on its sender for the pod it is released to.
    held: Held<oneshot::Sender<String>>,
    /// Round-robin over the endpoints.
    next: usize,
}

impl Service {
    fn startup(&self) -> ferry_core::hold::Startup {
        ferry_core::hold::Startup {
            time_to_ready: Duration::from_millis(self.state.time_to_ready_ms),
            starting_since: self.state.starting_for_ms.map(|ms| self.received - Duration::from_millis(ms)),
        }
    }

    /// The next ready pod, round-robin; `None` while there is none.
    fn endpoint(&mut self) -> Option<String> {
        let endpoints = &self.state.endpoints;
        if endpoints.is_empty() {
            return None;
        }
        self.next = (self.next + 1) % endpoints.len();
        Some(endpoints[self.next].clone())
    }

    /// Releases everything held, in deadline order, to the ready pods.
    fn release(&mut self) {
        if self.state.endpoints.is_empty() {
            return;
        }
        for waiter in self.held.release() {
            let endpoint = self.endpoint().expect("endpoints checked above");
            // A waiter gone (its deadline, its client) takes nothing.
            let _ = waiter.send(endpoint);
        }
    }
}

/// A service's key: "namespace/name".
type Key = (String, String);

pub struct Holder {
    options: Options,
    services: Mutex<HashMap<Key, Service>>,
    http: reqwest::Client,
    metrics: metrics::HolderMetrics,
}

pub type Shared = Arc<Holder>;

impl Holder {
    pub fn new(options: Options) -> Shared {
        Arc::new(Holder {
            options,
            services: Mutex::new(HashMap::new()),
            http: reqwest::Client::builder().build().expect("an HTTP client"),
            metrics: metrics::HolderMetrics::new(),
        })
    }

    /// The operator's word on one service: its state replaced, and what it holds released if a
    /// pod is ready now.
    pub fn set(&self, namespace: &str, name: &str, state: ServiceState) {
        let mut services = self.services.lock().expect("holder lock");
        let now = ferry_core::clock::now();
        let service = services.entry((namespace.to_owned(), name.to_owned())).or_insert_with(|| Service {
            state: state.clone(),
            received: now,
            held: Held::default(),
            next: 0,
        });
        service.state = state;
        service.received = now;
        service.release();
        self.metrics.known(namespace, name);
    }

    /// The service is gone (or no longer scales to zero): what it held is answered as if released
    /// to nowhere — its waiters see their sender dropped and answer 503.
    pub fn forget(&self, namespace: &str, name: &str) -> bool {
        let removed = self.services.lock().expect("holder lock").remove(&(namespace.to_owned(), name.to_owned()));
        self.metrics.forget(namespace, name);
        removed.is_some()
    }

    /// The services it knows, for its metrics: (namespace, name, held, oldest held).
    fn figures(&self) -> Vec<(String, String, usize, Duration)> {
        let now = ferry_core::clock::now();
        let services = self.services.lock().expect("holder lock");
        services.iter().map(|((ns, name), s)| (ns.clone(), name.clone(), s.held.len(), s.held.oldest(now))).collect()
    }
}

/// The API (port 8080): every path, every method.
pub fn api(holder: Shared) -> Router {
    Router::new().fallback(any(request::handle)).with_state(holder)
}

/// The admin listener (port 9090): the operator's directions, metrics and health.
pub fn admin(holder: Shared) -> Router {
    Router::new()
        .route("/services/{namespace}/{name}", put(set_service).delete(forget_service))
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(|| std::future::ready("ok")))
        .with_state(holder)
}

/// Whether `headers` carry the operator's token (compared in constant time).
fn authorized(holder: &Holder, headers: &HeaderMap) -> bool {
    use subtle::ConstantTimeEq;
    let Some(token) = &holder.options.token else { return true };
    let given =
        headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(token.as_bytes())))
}

async fn set_service(
    State(holder): State<Shared>,
    Path((namespace, name)): Path<(String, String)>,
    headers: HeaderMap,
    Json(state): Json<ServiceState>,
) -> StatusCode {
    if !authorized(&holder, &headers) {
        return StatusCode::UNAUTHORIZED;
    }
    holder.set(&namespace, &name, state);
    StatusCode::NO_CONTENT
}

async fn forget_service(
    State(holder): State<Shared>,
    Path((namespace, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> StatusCode {
    if !authorized(&holder, &headers) {
        return StatusCode::UNAUTHORIZED;
    }
    if holder.forget(&namespace, &name) {
        StatusCode::NO_CONTENT
    } else {
        StatusCode::NOT_FOUND
    }
}

async fn render_metrics(State(holder): State<Shared>) -> Response {
    holder.metrics.render(&holder.figures()).into_response()
}
