//! One request at the holder: which service it is for, its deadline, then relayed at once (a pod
//! is ready), refused at once (too late for the start-up, or the holder full for the service), or
//! held until a pod is ready or its deadline passes.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;
use std::time::Instant;
use tokio::sync::oneshot;

use super::metrics::{HELD, RELAYED, RELEASED};
use super::{Holder, Key, Shared};
use crate::deadline::{DeadlinePolicy, TIMEOUT_HEADER};
use crate::front::generate::{error_event, millis_header, TTFT_HEADERS};
use crate::front::openai::error_body;
use crate::front::status_of;
use ferry_core::hold::Key as HeldKey;
use ferry_core::outcome::{Outcome, Refusal};
use ferry_core::ticket::Priority;

/// Names the service a request is for, where its `Host` cannot (a gateway, a test): `NAMESPACE/NAME`.
pub const SERVICE_HEADER: &str = "x-ferry-service";

/// Headers that belong to one connection (RFC 9110 §7.6.1) or that the relay sets itself.
const NOT_RELAYED: [&str; 9] = [
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
    "trailer",
    "content-length",
];

/// What one request is, once read.
struct Incoming {
    method: Method,
    path: String,
    headers: HeaderMap,
    body: Bytes,
    /// Its whole deadline, and the one it is held to (a generation's first token's).
    deadline: Instant,
    hold_until: Instant,
    ttft_deadline: Option<Instant>,
    stream: bool,
}

pub async fn handle(State(holder): State<Shared>, request: Request) -> Response {
    let arrival = ferry_core::clock::now();
    // HTTP/2 carries the authority in the URI, not in a Host header.
    let authority = request.uri().authority().map(|a| a.as_str().to_owned());
    let key = match service_of(&holder, request.headers(), authority.as_deref()) {
        Ok(key) => key,
        Err(refusal) => {
            holder.metrics.request("", "", refusal.outcome.label());
            return refused(&refusal, request.uri().path());
        }
    };
    let path = request.uri().path_and_query().map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned());
    let incoming = match read(&holder, &key, request, arrival).await {
        Ok(incoming) => incoming,
        Err(refusal) => {
            holder.metrics.request(&key.0, &key.1, refusal.outcome.label());
            return refused(&refusal, &path);
        }
    };
    let (tx, rx) = oneshot::channel();
    let verdict = {
        let mut services = holder.services.lock().expect("holder lock");
        let total: usize = services.values().map(|s| s.held.bytes()).sum();
        // Forgotten while its body was read: as if never known.
        let Some(service) = services.get_mut(&key) else {
            drop(services);
            let refusal = not_held(&format!("{}/{}", key.0, key.1));
            holder.metrics.request(&key.0, &key.1, refusal.outcome.label());
            return refused(&refusal, &incoming.path);
        };
        match service.endpoint().filter(|_| service.held.is_empty()) {
            Some(endpoint) => Ok(Err(endpoint)),
            None => admit(&holder, service, total, &incoming, arrival, tx),
        }
    };
    match verdict {
        Ok(Err(endpoint)) => {
            holder.metrics.request(&key.0, &key.1, RELAYED);
            relay(&holder, &incoming, &endpoint).await
        }
        Ok(Ok(held)) => {
            holder.metrics.request(&key.0, &key.1, HELD);
            let waiting = Waiting { holder: holder.clone(), key, held, rx, done: false };
            if incoming.stream {
                held_stream(waiting, incoming)
            } else {
                waiting.answer(incoming).await
            }
        }
        Err(refusal) => {
            holder.metrics.request(&key.0, &key.1, refusal.outcome.label());
            refused(&refusal, &incoming.path)
        }
    }
}

/// Holds the request, or refuses it; `total`: the bytes held for every service, which
/// `--max-held-bytes-total` bounds (the holder's memory, whatever the number of services).
fn admit(
    holder: &Holder,
    service: &mut super::Service,
    total: usize,
    incoming: &Incoming,
    now: Instant,
    tx: oneshot::Sender<String>,
) -> Result<Result<HeldKey, String>, Refusal> {
    let startup = service.startup();
    let bytes = incoming.body.len();
    let limit = holder.options.total_bytes;
    if total + bytes > limit {
        let left = startup.ready_at(now) - now;
        let message = format!(
            "the holder holds {total} bytes of requests for all the services at zero, at most {limit} \
             (--max-held-bytes-total); this service's first pod is expected ready in {} ms",
            left.as_millis()
        );
        return Err(Refusal::new(Outcome::QueueFull, message).retry_after(left));
    }
    match service.held.admit(now, incoming.hold_until, bytes, &startup, &holder.options.bounds, tx) {
        Ok(key) => Ok(Ok(key)),
        Err((refusal, _)) => Err(refusal),
    }
}

/// A held request's wait: its entry leaves the holder when the wait ends however it ends (its
/// deadline, its client gone), so nothing held outlives its caller.
struct Waiting {
    holder: Shared,
    key: Key,
    held: HeldKey,
    rx: oneshot::Receiver<String>,
    done: bool,
}

impl Waiting {
    /// The pod it was released to, or `None` at its deadline (or when the service was forgotten).
    async fn released(&mut self, until: Instant) -> Result<String, Refusal> {
        let outcome = tokio::select! {
            endpoint = &mut self.rx => endpoint.map_err(|_| Refusal::new(
                Outcome::Unavailable,
                "the service no longer scales to zero here; try again",
            ).retry_after(Duration::from_secs(1))),
            () = ferry_core::clock::sleep_until(until) => Err(Refusal::new(
                Outcome::Expired,
                "the deadline passed while the service was starting from zero",
            )),
        };
        self.done = true;
        let (namespace, name) = (&self.key.0, &self.key.1);
        match &outcome {
            Ok(_) => self.holder.metrics.finished(namespace, name, RELEASED),
            Err(refusal) => {
                self.remove();
                self.holder.metrics.finished(namespace, name, refusal.outcome.label());
            }
        }
        outcome
    }

    fn remove(&self) {
        if let Some(service) = self.holder.services.lock().expect("holder lock").get_mut(&self.key) {
            service.held.remove(self.held);
        }
    }

    async fn answer(mut self, incoming: Incoming) -> Response {
        match self.released(incoming.hold_until).await {
            Ok(endpoint) => relay(&self.holder, &incoming, &endpoint).await,
            Err(refusal) => refused(&refusal, &incoming.path),
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if !self.done {
            self.remove();
            self.holder.metrics.finished(&self.key.0, &self.key.1, Outcome::Cancelled.label());
        }
    }
}

/// A held stream: SSE headers at once, a comment every keep-alive period while held, then the
/// pod's stream — or, if the pod refuses or the first token's deadline passes, an error event.
fn held_stream(mut waiting: Waiting, incoming: Incoming) -> Response {
    let every = waiting.holder.options.keep_alive;
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.tick().await;
        let released = loop {
            tokio::select! {
                released = waiting.released(incoming.hold_until) => break released,
                // The client left: `waiting`, dropped, takes it out.
                () = tx.closed() => return,
                _ = ticks.tick() => {
                    if tx.send(Bytes::from_static(b": held while the service starts from zero\n\n")).await.is_err() {
                        return;
                    }
                }
            }
        };
        if tx.is_closed() {
            return;
        }
        let endpoint = match released {
            Ok(endpoint) => endpoint,
            Err(refusal) => {
                let _ = tx.send(error_event(&refusal)).await;
                return;
            }
        };
        match send(&waiting.holder, &incoming, &endpoint).await {
            Ok(response) if response.status().is_success() => {
                let mut response = response;
                while let Ok(Some(chunk)) = response.chunk().await {
                    if tx.send(chunk).await.is_err() {
                        return;
                    }
                }
            }
            Ok(response) => {
                let status = response.status();
                let text = response.text().await.unwrap_or_default();
                let message = serde_json::from_str::<Value>(&text)
                    .ok()
                    .and_then(|v| v["error"]["message"].as_str().or(v["error"].as_str()).map(str::to_owned))
                    .unwrap_or(text);
                let _ = tx.send(error_event_of(status, &message)).await;
            }
            Err(refusal) => {
                let _ = tx.send(error_event(&refusal)).await;
            }
        }
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (Ok::<_, std::convert::Infallible>(chunk), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .expect("a valid response")
}

fn error_event_of(status: StatusCode, message: &str) -> Bytes {
    Bytes::from(format!("data: {}\n\n", error_body(status, message)))
}

/// The service a request is for: its `x-ferry-service`, else its `Host`.
fn service_of(holder: &Holder, headers: &HeaderMap, authority: Option<&str>) -> Result<Key, Refusal> {
    let services = holder.services.lock().expect("holder lock");
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    if let Some(named) = text(SERVICE_HEADER) {
        let Some((namespace, name)) = named.split_once('/') else {
            return Err(Refusal::invalid(format!("{SERVICE_HEADER} is '{named}'; it must be NAMESPACE/NAME")));
        };
        let key = (namespace.to_owned(), name.to_owned());
        return match services.contains_key(&key) {
            true => Ok(key),
            false => Err(not_held(&named)),
        };
    }
    let host = text(header::HOST.as_str()).or_else(|| authority.map(str::to_owned)).unwrap_or_default();
    let bare = host.rsplit_once(':').filter(|(_, port)| port.parse::<u16>().is_ok()).map_or(host.as_str(), |(h, _)| h);
    let mut parts = bare.split('.');
    let name = parts.next().unwrap_or_default();
    let namespace = parts.next();
    let mut matching = services.keys().filter(|(ns, n)| n == name && namespace.is_none_or(|want| want == ns));
    match (matching.next(), matching.next()) {
        (Some(key), None) => Ok(key.clone()),
        (Some(_), Some(_)) => Err(Refusal::new(
            Outcome::NotFound,
            format!("Host '{host}' names a service in several namespaces; use NAME.NAMESPACE or {SERVICE_HEADER}"),
        )),
        (None, _) => Err(not_held(&host)),
    }
}

fn not_held(what: &str) -> Refusal {
    Refusal::new(
        Outcome::NotFound,
        format!("'{what}' is no service this holder holds for: it holds for Ferry services that scale to zero"),
    )
}

/// Reads the body and the deadlines, as the sidecar does.
async fn read(holder: &Holder, key: &Key, request: Request, arrival: Instant) -> Result<Incoming, Refusal> {
    let state = {
        let services = holder.services.lock().expect("holder lock");
        services.get(key).ok_or_else(|| not_held(&format!("{}/{}", key.0, key.1)))?.state.clone()
    };
    let (parts, body) = request.into_parts();
    let limit = holder.options.bounds.bytes;
    let body = axum::body::to_bytes(body, limit).await.map_err(|_| {
        Refusal::new(
            Outcome::TooLarge,
            format!("request body is more than {limit} bytes, what the holder holds for a service"),
        )
    })?;
    let json: Option<Value> = serde_json::from_slice(&body).ok();
    let budget = Duration::from_millis(state.latency_budget_ms);
    let policy = DeadlinePolicy { budget, batch_budget: budget, max_timeout: budget };
    let header_text = parts.headers.get(TIMEOUT_HEADER).map(|v| v.to_str().unwrap_or("?"));
    let parameters = json.as_ref().and_then(|v| v.get("parameters")).and_then(Value::as_object);
    let timeout = policy.timeout(Priority::Interactive, header_text, parameters)?;
    let deadline = arrival + timeout;
    let ttft_deadline = if state.generation {
        let default = Duration::from_millis(state.ttft_budget_ms.unwrap_or(1000));
        Some(arrival + millis_header(&parts.headers, &TTFT_HEADERS)?.unwrap_or(default).min(timeout))
    } else {
        None
    };
    let stream = json.as_ref().and_then(|v| v.get("stream")).and_then(Value::as_bool).unwrap_or(false);
    Ok(Incoming {
        method: parts.method,
        path: parts.uri.path_and_query().map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned()),
        headers: parts.headers,
        body,
        deadline,
        hold_until: ttft_deadline.unwrap_or(deadline),
        ttft_deadline,
        stream,
    })
}

/// Sends the request to the pod with the deadlines it has left.
async fn send(holder: &Holder, incoming: &Incoming, endpoint: &str) -> Result<reqwest::Response, Refusal> {
    let now = ferry_core::clock::now();
    let expired = || Refusal::new(Outcome::Expired, "the deadline passed while the service was starting from zero");
    let left = incoming.deadline.checked_duration_since(now).filter(|d| d.as_millis() > 0).ok_or_else(expired)?;
    let mut headers = reqwest::header::HeaderMap::new();
    let connection = connection_headers(&incoming.headers);
    for (name, value) in &incoming.headers {
        let name_text = name.as_str();
        if !NOT_RELAYED.contains(&name_text)
            && name_text != SERVICE_HEADER
            && !connection.contains(&name_text.to_owned())
        {
            headers.append(name.clone(), value.clone());
        }
    }
    headers.insert(HeaderName::from_static(TIMEOUT_HEADER), HeaderValue::from(left.as_millis() as u64));
    if let Some(ttft) = incoming.ttft_deadline {
        let ttft_left = ttft.checked_duration_since(now).filter(|d| d.as_millis() > 0).ok_or_else(expired)?;
        for name in TTFT_HEADERS {
            headers.remove(name);
        }
        headers.insert(HeaderName::from_static(TTFT_HEADERS[0]), HeaderValue::from(ttft_left.as_millis() as u64));
    }
    let url = format!("http://{endpoint}{}", incoming.path);
    holder
        .http
        .request(incoming.method.clone(), &url)
        .headers(headers)
        .body(incoming.body.clone())
        // The pod answers by the deadline; a pod that does not is no reason to hold the caller.
        .timeout(left + Duration::from_secs(1))
        .send()
        .await
        .map_err(|e| Refusal::new(Outcome::Failed, format!("relaying to the service's pod {endpoint} failed: {e}")))
}

/// The headers a `Connection` header names: they belong to that connection alone (RFC 9110 §7.6.1).
fn connection_headers(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .filter(|name| !name.is_empty())
        .collect()
}

/// Relays to the pod and streams its answer back as it is.
async fn relay(holder: &Holder, incoming: &Incoming, endpoint: &str) -> Response {
    let response = match send(holder, incoming, endpoint).await {
        Ok(response) => response,
        Err(refusal) => return refused(&refusal, &incoming.path),
    };
    let mut builder = Response::builder().status(response.status());
    let connection = connection_headers(response.headers());
    for (name, value) in response.headers() {
        if !NOT_RELAYED.contains(&name.as_str()) && !connection.contains(&name.as_str().to_owned()) {
            builder = builder.header(name, value);
        }
    }
    builder.body(Body::from_stream(chunks(response))).expect("a valid response")
}

/// A response's body as it comes.
fn chunks(response: reqwest::Response) -> impl futures::Stream<Item = Result<Bytes, reqwest::Error>> {
    futures::stream::unfold(Some(response), |response| async move {
        let mut response = response?;
        match response.chunk().await {
            Ok(Some(chunk)) => Some((Ok(chunk), Some(response))),
            Ok(None) => None,
            // The error ends the body.
            Err(e) => Some((Err(e), None)),
        }
    })
}

/// A refusal in the shape of the path's protocol (OpenAI's under `/v1/`), with `Retry-After`.
fn refused(refusal: &Refusal, path: &str) -> Response {
    let status = status_of(refusal.outcome);
    let body = if path.starts_with("/v1/") {
        error_body(status, &refusal.message)
    } else {
        serde_json::json!({ "error": refusal.message })
    };
    let mut response = (status, Json(body)).into_response();
    if let Some(secs) = refusal.retry_after_secs() {
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}
