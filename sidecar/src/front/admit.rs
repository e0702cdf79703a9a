//! The admission pipeline every protocol shares: is the model taking requests, the body within
//! its limit, the request well formed (by its protocol), its deadline and priority, the engine's
//! own checks (which may tokenize: large requests run them on the blocking pool); then the
//! submission to the batcher, and the answer, encoded by its protocol, with the headers that say
//! how it was served.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::Response;
use std::time::Instant;

use super::{error, Front, Served, BATCH_SIZE, SERVER_TIMING};
use crate::batcher::Submission;
use crate::deadline::TIMEOUT_HEADER;
use crate::tally::Tally;
use crate::tenants::Tenant;
use crate::tensor::Tensor;
use ferry_core::outcome::{Outcome, Refusal};

/// Requests larger than this are checked by their engine on the blocking pool.
const OFFLOAD_CHECK_BYTES: usize = 64 * 1024;

/// How a protocol reads a request (Open Inference Protocol v2 REST with Triton's binary
/// extension, OpenAI's `POST /v1/embeddings`): the protocols share admission, batching and the
/// engine, and differ in how requests are read and answers written. Each protocol hands its own
/// reader and writer to this pipeline, which knows none of them.
pub(super) type Parse = fn(&Served, &HeaderMap, &[u8]) -> Result<Parsed, Refusal>;

/// How a protocol writes its answer: the request's own settings (OIP's binary outputs, OpenAI's
/// encoding), read with the request.
pub(super) trait Encode: Send + Sync {
    /// The answer to `outputs`, for a request of `tokens` tokens.
    fn encode(&self, served: &Served, outputs: &[Tensor], tokens: u32) -> Response;
}

/// A request whose body has been read, for the model it names.
pub(super) struct Incoming {
    pub served: Arc<Served>,
    pub parse: Parse,
    pub headers: HeaderMap,
    pub bytes: Bytes,
    pub arrival: Instant,
}

/// A request as the shared path sees it, whatever protocol it came in.
pub(super) struct Parsed {
    pub inputs: Vec<Tensor>,
    pub rows: u32,
    /// OIP's request parameters (which may carry a timeout).
    pub parameters: Option<serde_json::Map<String, serde_json::Value>>,
    /// Which outputs the caller wants (OIP's `outputs`).
    pub wanted: Option<Vec<String>>,
    /// How the answer is written: the protocol's own settings.
    pub answer: Box<dyn Encode>,
}

/// Whether the model takes requests now: not while draining, nor before its engine is ready.
pub(super) fn admits(front: &Front, served: &Served) -> Result<(), Refusal> {
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

/// Counts a refusal decided before the request reached the batcher, and answers it.
pub(super) fn refuse(tally: Tally, refusal: Refusal) -> Response {
    tally.count(refusal.outcome);
    error(&refusal)
}

/// The body, within `--max-request-bytes`.
pub(super) async fn read_body(front: &Front, headers: &HeaderMap, body: Body) -> Result<Bytes, Refusal> {
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

/// Parses, checks, admits and waits for one request whose body has been read; its tally counts
/// how it ended (the batcher's reply carries it back for the outcomes decided there).
pub(super) async fn process(front: &Front, request: &Incoming, tenant: &Tenant, tally: Tally) -> Response {
    let mut tally = Some(tally);
    match admit_and_wait(front, request, tenant, &mut tally).await {
        Ok(response) => response,
        // Refused before the batcher took the request (and its tally): counted here.
        Err(refusal) => match tally {
            Some(tally) => refuse(tally, refusal),
            None => error(&refusal),
        },
    }
}

/// `tally` is taken when the request is submitted: from then on its reply counts it.
async fn admit_and_wait(
    front: &Front,
    incoming: &Incoming,
    tenant: &Tenant,
    tally: &mut Option<Tally>,
) -> Result<Response, Refusal> {
    let Incoming { served, parse, headers, bytes, arrival } = incoming;
    let arrival = *arrival;
    let request = parse(served, headers, bytes)?;

    let header_text = |name: &str| -> Result<Option<&str>, Refusal> {
        headers
            .get(name)
            .map(|v| v.to_str().map_err(|_| Refusal::invalid(format!("header {name} is not readable text"))))
            .transpose()
    };
    let priority = tenant.tier(front.tenants.asked_tier(headers)?)?;
    let timeout = front.deadlines.timeout(priority, header_text(TIMEOUT_HEADER)?, request.parameters.as_ref())?;
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
    // The tenant's quotas: this request, its rows × tokens, its rows held until it ends.
    let weight = u64::from(rows) * u64::from(tokens.longest.max(1));
    let mut held = tenant.take(u64::from(rows), weight, ferry_core::clock::now())?;

    let submission = Submission {
        inputs,
        rows,
        tokens,
        bytes: bytes.len() as u64,
        priority,
        tenant: tenant.id,
        weight: tenant.weight,
        arrival,
        deadline: arrival + timeout,
        tally: tally.take().expect("a request is submitted once"),
    };
    let answer = match served.batcher.submit(submission).reply().await {
        Ok(answer) => answer,
        Err(refusal) => {
            // Refused (or shed) for want of capacity: it did no work, and its quota is given back.
            if matches!(refusal.outcome, Outcome::QueueFull | Outcome::Infeasible) {
                held.refund();
            }
            return Err(refusal);
        }
    };
    drop(held);
    front.metrics.observe_tenant_queue_wait(&tenant.name, answer.queued);

    let mut outputs = answer.outputs;
    if let Some(wanted) = &wanted {
        outputs.retain(|o| wanted.contains(&o.name));
    }
    let mut response = request.answer.encode(served, &outputs, tokens.total);
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

/// Milliseconds with one decimal, as Server-Timing's `dur` is read.
fn millis(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}
