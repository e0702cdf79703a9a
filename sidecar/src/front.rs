//! The HTTP API: Open Inference Protocol v2 REST on the main listener, and `/metrics` with the
//! health endpoints on the admin listener, so that callers of the API never see other tenants'
//! figures (as Triton's :8002 and Knative's queue-proxy :9090 do).
//!
//! Every request gets an `x-request-id` (echoed, or made up) on its response; every error is
//! `{"error": "..."}` with a sentence that names the field, the value and the limit.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tokio::time::Instant;

use crate::batcher::{Batcher, Submission};
use crate::binary;
use crate::deadline::{DeadlinePolicy, TIMEOUT_HEADER};
use crate::engine::embedding;
use crate::engine::Engine;
use crate::idempotency::{self, Claim, Key, Saved, Store};
use crate::metrics::Metrics;
use crate::openai;
use crate::tensor::{parse_inputs, InferRequest, InferResponse, Tensor};
use ferry_core::outcome::{Outcome, Refusal};
use ferry_core::ticket::Priority;

/// Requests larger than this are checked by their engine on the blocking pool.
const OFFLOAD_CHECK_BYTES: usize = 64 * 1024;

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

/// State shared by the handlers.
pub struct Front {
    pub models: Vec<Arc<Served>>,
    pub deadlines: DeadlinePolicy,
    pub max_request_bytes: u64,
    pub metrics: Metrics,
    draining: AtomicBool,
    ids: RequestIds,
    idempotency: Mutex<Store>,
}

impl Front {
    pub fn new(
        models: Vec<Arc<Served>>,
        deadlines: DeadlinePolicy,
        max_request_bytes: u64,
        metrics: Metrics,
        idempotency: idempotency::Limits,
    ) -> Self {
        assert!(!models.is_empty(), "a sidecar serves at least one model");
        Front {
            models,
            deadlines,
            max_request_bytes,
            metrics,
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

    fn find(&self, name: &str, version: Option<&str>) -> Result<&Arc<Served>, Refusal> {
        let versions: Vec<&Arc<Served>> = self.models.iter().filter(|m| m.name == name).collect();
        if versions.is_empty() {
            let known: Vec<String> =
                self.models.iter().map(|m| format!("'{}' (version {})", m.name, m.version)).collect();
            return Err(Refusal::new(
                Outcome::NotFound,
                format!("unknown model '{name}'; this sidecar serves {}", known.join(", ")),
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
        .route("/v2/models/{name}/infer", post(infer))
        .route("/v2/models/{name}/versions/{version}/infer", post(infer_version))
        .route(openai::PATH, post(embeddings))
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

fn error(refusal: &Refusal) -> Response {
    let mut response = (status_of(refusal.outcome), Json(json!({ "error": refusal.message }))).into_response();
    if let Some(secs) = refusal.retry_after_secs() {
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

async fn no_route(request: Request) -> Response {
    let refusal = Refusal::new(
        Outcome::NotFound,
        format!(
            "no endpoint {} {}; see GET /v2 and the Open Inference Protocol",
            request.method(),
            request.uri().path()
        ),
    );
    error(&refusal)
}

async fn server_metadata() -> Json<serde_json::Value> {
    Json(json!({ "name": "ferry-sidecar", "version": env!("CARGO_PKG_VERSION"), "extensions": [] }))
}

async fn live() -> Json<serde_json::Value> {
    Json(json!({ "live": true }))
}

async fn ready(State(front): State<Shared>) -> Response {
    let ready = !front.is_draining() && front.models.iter().all(|m| m.engine.ready());
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(json!({ "ready": ready }))).into_response()
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
            let ready = !front.is_draining() && served.engine.ready();
            let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
            (status, Json(json!({ "name": served.name, "ready": ready }))).into_response()
        }
        Err(refusal) => error(&refusal),
    }
}

async fn infer(State(front): State<Shared>, Path(name): Path<String>, headers: HeaderMap, body: Body) -> Response {
    run_infer(front, name, None, headers, body).await
}

async fn infer_version(
    State(front): State<Shared>,
    Path((name, version)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    run_infer(front, name, Some(version), headers, body).await
}

/// The protocols a request can arrive in; they share admission, batching and the engine, and
/// differ in how requests are read and answers written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    /// Open Inference Protocol v2 REST.
    Oip,
    /// OpenAI's `POST /v1/embeddings`.
    OpenAi,
}

async fn run_infer(front: Shared, name: String, version: Option<String>, headers: HeaderMap, body: Body) -> Response {
    let arrival = Instant::now();
    let served = match front.find(&name, version.as_deref()) {
        Ok(served) => served.clone(),
        Err(refusal) => return refuse(&front.models[0], refusal),
    };
    if let Err(refusal) = admits(&front, &served) {
        return refuse(&served, refusal);
    }
    let bytes = match read_body(&front, &headers, body).await {
        Ok(bytes) => bytes,
        Err(refusal) => return refuse(&served, refusal),
    };
    let path = match &version {
        Some(v) => format!("/v2/models/{name}/versions/{v}/infer"),
        None => format!("/v2/models/{name}/infer"),
    };
    call(front, Incoming { served, api: Api::Oip, headers, bytes, arrival }, &path).await
}

/// `POST /v1/embeddings`: the model is named in the body, so the body is read first. Errors are
/// rewritten into OpenAI's shape at the end, replays included.
async fn embeddings(State(front): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let arrival = Instant::now();
    let response = async {
        let bytes = match read_body(&front, &headers, body).await {
            Ok(bytes) => bytes,
            Err(refusal) => return refuse(&front.models[0], refusal),
        };
        let served = match openai::model_of(&bytes).and_then(|model| front.find(&model, None).cloned()) {
            Ok(served) => served,
            Err(refusal) => return refuse(&front.models[0], refusal),
        };
        if let Err(refusal) = admits(&front, &served) {
            return refuse(&served, refusal);
        }
        call(front.clone(), Incoming { served, api: Api::OpenAi, headers, bytes, arrival }, openai::PATH).await
    }
    .await;
    if response.status().is_success() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
    let message = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let body = openai::error_body(parts.status, &message).to_string();
    Response::from_parts(parts, Body::from(body))
}

/// Whether the model takes requests now: not while draining, nor before its engine is ready.
fn admits(front: &Front, served: &Served) -> Result<(), Refusal> {
    if front.is_draining() {
        return Err(Refusal::new(
            Outcome::Draining,
            "draining: this sidecar is shutting down and admits no new requests",
        ));
    }
    if !served.engine.ready() {
        return Err(Refusal::new(
            Outcome::Unavailable,
            format!("model '{}' is not ready: its engine is still loading", served.name),
        )
        .retry_after(Duration::from_secs(1)));
    }
    Ok(())
}

/// A request whose body has been read, for the model it names.
struct Incoming {
    served: Arc<Served>,
    api: Api,
    headers: HeaderMap,
    bytes: Bytes,
    arrival: Instant,
}

/// Runs a request under its `idempotency-key` when it has one; `path` is part of what the key
/// promises (with the method and body).
async fn call(front: Shared, request: Incoming, path: &str) -> Response {
    match request.headers.get(idempotency::KEY_HEADER).cloned() {
        None => process(&front, &request).await,
        Some(key) => idempotent(front, request, &key, path).await,
    }
}

/// Counts a refusal decided by the front (the batcher counts everything else itself).
fn refuse(served: &Served, refusal: Refusal) -> Response {
    served.batcher.metrics().count(refusal.outcome);
    error(&refusal)
}

async fn read_body(front: &Front, headers: &HeaderMap, body: Body) -> Result<Bytes, Refusal> {
    let limit = front.max_request_bytes;
    let too_large = |size: String| {
        Refusal::new(
            Outcome::TooLarge,
            format!("request body is {size} bytes; the limit (--max-request-bytes) is {limit}"),
        )
    };
    if let Some(length) = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok()) {
        if length > limit {
            return Err(too_large(length.to_string()));
        }
    }
    axum::body::to_bytes(body, limit as usize).await.map_err(|_| too_large(format!("more than {limit}")))
}

/// Runs a request under its `idempotency-key`: the first caller's request runs detached from its
/// connection (so that a retry after a dropped connection finds its outcome), joiners wait for
/// that outcome, later callers get it replayed, and another request under the same key is a 409.
async fn idempotent(front: Shared, request: Incoming, key: &HeaderValue, path: &str) -> Response {
    let Incoming { served, headers, bytes, arrival, .. } = &request;
    let key = match key.to_str() {
        Ok(k) if !k.is_empty() && k.len() <= 255 && k.bytes().all(|b| b.is_ascii_graphic()) => k.to_owned(),
        _ => {
            return refuse(
                served,
                Refusal::invalid(format!(
                    "{} must be 1 to 255 visible ASCII characters; got {} bytes",
                    idempotency::KEY_HEADER,
                    key.len()
                )),
            )
        }
    };
    // Keys are scoped per tenant: the caller's credentials, hashed (never stored in clear).
    let scope = headers
        .get(header::AUTHORIZATION)
        .map(|v| {
            let f = idempotency::fingerprint("", "", v.as_bytes());
            f.iter().map(|b| format!("{b:02x}")).collect()
        })
        .unwrap_or_default();
    let record = Key { scope, key: key.clone() };
    let fingerprint = idempotency::fingerprint("POST", path, bytes);
    let claim =
        front.idempotency.lock().unwrap_or_else(|p| p.into_inner()).claim(record.clone(), fingerprint, *arrival);
    let (mut outcome, replayed) = match claim {
        Claim::Conflict => {
            let message = format!(
                "{} '{key}' was already used for a different request (method, path or body differ); use a new key",
                idempotency::KEY_HEADER
            );
            return refuse(served, Refusal::new(Outcome::Conflict, message));
        }
        Claim::Replay(saved) => return replay(&saved, true),
        Claim::Join(rx) => (rx, true),
        Claim::Execute(rx) => {
            let front = front.clone();
            tokio::spawn(async move {
                let response = process(&front, &request).await;
                let saved = save(response).await;
                front.idempotency.lock().unwrap_or_else(|p| p.into_inner()).finish(&record, saved);
            });
            (rx, false)
        }
    };
    let saved = outcome.wait_for(Option::is_some).await.ok().and_then(|saved| saved.clone());
    match saved {
        Some(saved) => replay(&saved, replayed),
        None => {
            error(&Refusal::new(Outcome::Failed, "the request holding this idempotency-key ended without an answer"))
        }
    }
}

/// The headers of a response worth replaying.
const SAVED_HEADERS: [HeaderName; 5] =
    [header::CONTENT_TYPE, header::RETRY_AFTER, BATCH_SIZE, SERVER_TIMING, binary::HEADER];

async fn save(response: Response) -> Saved {
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
    let headers =
        SAVED_HEADERS.iter().filter_map(|name| parts.headers.get(name).map(|v| (name.clone(), v.clone()))).collect();
    Saved { status: parts.status, headers, body }
}

fn replay(saved: &Saved, replayed: bool) -> Response {
    let mut response = Response::new(Body::from(saved.body.clone()));
    *response.status_mut() = saved.status;
    let h = response.headers_mut();
    for (name, value) in &saved.headers {
        h.insert(name.clone(), value.clone());
    }
    if replayed {
        h.insert(idempotency::REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    response
}

/// Parses, checks, admits and waits for one request whose body has been read.
async fn process(front: &Front, request: &Incoming) -> Response {
    match admit_and_wait(front, request).await {
        Ok(response) => response,
        Err(refusal) if is_refused_at_the_front(refusal.outcome) => refuse(&request.served, refusal),
        Err(refusal) => error(&refusal),
    }
}

/// Refusals decided by the front, before the batcher sees the request.
fn is_refused_at_the_front(outcome: Outcome) -> bool {
    matches!(
        outcome,
        Outcome::Invalid
            | Outcome::NotFound
            | Outcome::TooLarge
            | Outcome::Draining
            | Outcome::Conflict
            | Outcome::Unavailable
    )
}

/// The HTTP status of an outcome.
pub fn status_of(outcome: Outcome) -> StatusCode {
    StatusCode::from_u16(outcome.status_code()).expect("outcomes have valid status codes")
}

/// A request as the shared path sees it, whatever protocol it came in.
struct Parsed {
    inputs: Vec<Tensor>,
    rows: u32,
    /// OIP's request id, echoed in the answer.
    id: Option<String>,
    /// OIP's request parameters (which may carry a timeout).
    parameters: Option<serde_json::Map<String, serde_json::Value>>,
    /// OIP's `outputs`: which outputs the caller wants.
    wanted: Option<Vec<String>>,
    /// Outputs to send as binary data (Triton's extension, [`binary`]).
    binary: Vec<String>,
    /// How the OpenAI API writes embeddings.
    encoding: openai::Encoding,
}

fn parse(served: &Served, api: Api, headers: &HeaderMap, bytes: &[u8]) -> Result<Parsed, Refusal> {
    match api {
        Api::Oip => {
            let (json, binary_part) = binary::split(headers, bytes)?;
            let mut request: InferRequest = serde_json::from_slice(json)
                .map_err(|e| Refusal::invalid(format!("the body is not a valid infer request: {e}")))?;
            binary::attach(&mut request.inputs, binary_part)?;
            let (inputs, rows) = parse_inputs(request.inputs, served.max_rows)?;
            let flag = |p: Option<&serde_json::Map<String, serde_json::Value>>, key: &str| {
                p.and_then(|p| p.get(key)).and_then(serde_json::Value::as_bool).unwrap_or(false)
            };
            let all_binary = flag(request.parameters.as_ref(), "binary_data_output");
            let binary = match &request.outputs {
                Some(outputs) => outputs
                    .iter()
                    .filter(|o| all_binary || flag(o.parameters.as_ref(), "binary_data"))
                    .map(|o| o.name.clone())
                    .collect(),
                None if all_binary => served.engine.signature().outputs.iter().map(|o| o.name.clone()).collect(),
                None => Vec::new(),
            };
            Ok(Parsed {
                inputs,
                rows,
                id: request.id,
                parameters: request.parameters,
                wanted: request.outputs.map(|o| o.into_iter().map(|o| o.name).collect()),
                binary,
                encoding: openai::Encoding::Float,
            })
        }
        Api::OpenAi => {
            let signature = served.engine.signature();
            let embeds = signature.inputs.iter().any(|i| i.name == embedding::INPUT && i.datatype == "BYTES")
                && signature.outputs.iter().any(|o| o.name == embedding::OUTPUT);
            if !embeds {
                return Err(Refusal::new(
                    Outcome::NotFound,
                    format!(
                        "model '{}' is not an embedding model (engine {}); {} serves the cuda engine's models",
                        served.name,
                        signature.platform,
                        openai::PATH
                    ),
                ));
            }
            let dim = signature.outputs[0].shape.get(1).copied().unwrap_or(0).max(0) as usize;
            let call = openai::EmbeddingsRequest::parse(bytes)?.into_call(dim, served.max_rows)?;
            Ok(Parsed {
                inputs: call.inputs,
                rows: call.rows,
                id: None,
                parameters: None,
                wanted: None,
                binary: Vec::new(),
                encoding: call.encoding,
            })
        }
    }
}

async fn admit_and_wait(front: &Front, incoming: &Incoming) -> Result<Response, Refusal> {
    let Incoming { served, api, headers, bytes, arrival } = incoming;
    let (api, arrival) = (*api, *arrival);
    let request = parse(served, api, headers, bytes)?;

    let header_text = |name: &str| -> Result<Option<&str>, Refusal> {
        headers
            .get(name)
            .map(|v| v.to_str().map_err(|_| Refusal::invalid(format!("header {name} is not readable text"))))
            .transpose()
    };
    let timeout = front.deadlines.timeout(header_text(TIMEOUT_HEADER)?, request.parameters.as_ref())?;
    let priority = match header_text(PRIORITY.as_str())? {
        None => Priority::Interactive,
        Some(text) => Priority::parse(text)
            .ok_or_else(|| Refusal::invalid(format!("{PRIORITY} is '{text}'; it must be 'interactive' or 'batch'")))?,
    };
    let wanted = request.wanted;
    let signature = served.engine.signature();
    if let Some(unknown) = wanted.iter().flatten().find(|w| !signature.outputs.iter().any(|o| &o.name == *w)) {
        let known: Vec<&str> = signature.outputs.iter().map(|o| o.name.as_str()).collect();
        return Err(Refusal::invalid(format!(
            "outputs: '{unknown}' is not an output of model '{}'; it has {}",
            served.name,
            known.join(", ")
        )));
    }
    let (inputs, rows) = (request.inputs, request.rows);
    // An engine's checks may tokenize: a large request's run on the blocking pool, so that it
    // does not hold up the runtime's threads (and every other request) meanwhile.
    let (inputs, tokens) = if bytes.len() > OFFLOAD_CHECK_BYTES {
        let engine = served.engine.clone();
        tokio::task::spawn_blocking(move || {
            let tokens = engine.check(&inputs);
            (inputs, tokens)
        })
        .await
        .map_err(|e| Refusal::new(Outcome::Failed, format!("checking the request failed: {e}")))?
    } else {
        let tokens = served.engine.check(&inputs);
        (inputs, tokens)
    };
    let tokens = tokens.map_err(Refusal::invalid)?;

    let submission =
        Submission { inputs, rows, tokens, bytes: bytes.len() as u64, priority, arrival, deadline: arrival + timeout };
    let answer = served.batcher.submit(submission).reply().await?;

    let mut outputs = answer.outputs;
    if let Some(wanted) = &wanted {
        outputs.retain(|o| wanted.contains(&o.name));
    }
    let mut response = match api {
        Api::Oip if request.binary.is_empty() => Json(InferResponse {
            model_name: &served.name,
            model_version: &served.version,
            id: request.id.as_deref(),
            outputs: &outputs,
        })
        .into_response(),
        Api::Oip => binary_response(served, request.id.as_deref(), &outputs, &request.binary),
        Api::OpenAi => Json(openai::response(&served.name, &outputs, tokens.total, request.encoding)).into_response(),
    };
    let h = response.headers_mut();
    h.insert(BATCH_SIZE, HeaderValue::from(answer.batch_rows));
    let timing = format!(
        "queue;dur={}, batch;dur={}, total;dur={}",
        millis(answer.queued),
        millis(answer.engine),
        millis(answer.answered_at - arrival)
    );
    h.insert(SERVER_TIMING, HeaderValue::from_str(&timing).expect("ASCII"));
    Ok(response)
}

/// An infer response whose `binary` outputs follow the JSON as raw bytes (Triton's extension).
fn binary_response(served: &Served, id: Option<&str>, outputs: &[Tensor], binary: &[String]) -> Response {
    let mut tail = Vec::new();
    let described: Vec<serde_json::Value> = outputs
        .iter()
        .map(|t| {
            if !binary.contains(&t.name) {
                return serde_json::to_value(t).expect("tensors serialize");
            }
            let bytes = binary::encode(t);
            let size = bytes.len();
            tail.extend(bytes);
            json!({ "name": t.name, "datatype": t.datatype.name(), "shape": t.shape, "parameters": { "binary_data_size": size } })
        })
        .collect();
    let mut head = json!({ "model_name": served.name, "model_version": served.version, "outputs": described });
    if let Some(id) = id {
        head["id"] = json!(id);
    }
    let head = serde_json::to_vec(&head).expect("JSON values serialize");
    let length = head.len();
    let mut body = head;
    body.extend(tail);
    let mut response = Response::new(Body::from(body));
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    h.insert(binary::HEADER, HeaderValue::from(length));
    response
}

/// Milliseconds with one decimal, as Server-Timing's `dur` is read.
fn millis(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

async fn metrics(State(front): State<Shared>) -> Response {
    for served in &front.models {
        served.batcher.refresh_age();
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], front.metrics.render()).into_response()
}
