//! The holder (`ferry-holder`): its admission on tokio's paused clock, called in process — what
//! is refused at once and with which `Retry-After`, what is held and answered 504 at exactly its
//! deadline, the bounds, a client that leaves — and its release over real HTTP to a pod that
//! records what reached it: the deadlines left, a held stream's keep-alives.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use ferry_core::hold::{Bounds, ServiceState};
use ferry_sidecar::holder::{self, Holder, Options, Shared};
use tower::ServiceExt;

const MS: Duration = Duration::from_millis(1);

fn holder(requests: usize, keep_alive: Duration) -> Shared {
    Holder::new(Options { bounds: Bounds { requests, bytes: 1 << 20 }, total_bytes: 1 << 30, keep_alive, token: None })
}

fn at_zero(time_to_ready_ms: u64) -> ServiceState {
    ServiceState {
        generation: false,
        latency_budget_ms: 30_000,
        ttft_budget_ms: None,
        time_to_ready_ms,
        starting_for_ms: None,
        endpoints: vec![],
    }
}

fn infer(host: &str, timeout_ms: u64) -> Request<Body> {
    Request::post("/v2/models/m/infer")
        .header("host", host)
        .header("x-ferry-timeout-ms", timeout_ms.to_string())
        .header("content-type", "application/json")
        .body(Body::from(r#"{"inputs":[]}"#))
        .unwrap()
}

async fn call(h: &Shared, request: Request<Body>) -> Response {
    holder::api(h.clone()).oneshot(request).await.unwrap()
}

async fn text(response: Response) -> String {
    String::from_utf8(axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap().to_vec()).unwrap()
}

async fn metrics(h: &Shared) -> String {
    let response =
        holder::admin(h.clone()).oneshot(Request::get("/metrics").body(Body::empty()).unwrap()).await.unwrap();
    text(response).await
}

fn series(exposition: &str, name: &str, labels: &str) -> f64 {
    let prefix = format!("{name}{{{labels}}} ");
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {prefix} in\n{exposition}"))
        .parse()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_request_the_start_up_would_make_late_is_refused_at_once_and_the_rest_held_to_its_deadline() {
    let h = holder(2, Duration::from_secs(5));
    h.set("ns", "chat", at_zero(5000));
    let t0 = ferry_core::clock::now();
    // 4 s of deadline against 5 s of start-up: refused now, Retry-After the start-up.
    let refused = call(&h, infer("chat.ns.svc.cluster.local:8080", 4000)).await;
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers()["retry-after"], "5");
    assert_eq!(ferry_core::clock::now(), t0);
    let body = text(refused).await;
    assert!(body.contains("expected ready in 5000 ms") && body.contains("(in 4000 ms)"), "{body}");
    // 6 s: held, and answered 504 at exactly its deadline, no pod having come.
    let held = tokio::spawn({
        let h = h.clone();
        async move { call(&h, infer("chat.ns", 6000)).await }
    });
    tokio::time::sleep(5999 * MS).await;
    assert!(!held.is_finished());
    let m = metrics(&h).await;
    assert_eq!(series(&m, "ferry_holder_held", r#"namespace="ns",service="chat""#), 1.0);
    assert_eq!(series(&m, "ferry_holder_oldest_held_seconds", r#"namespace="ns",service="chat""#), 5.999);
    let expired = held.await.unwrap();
    assert_eq!(ferry_core::clock::now() - t0, 6000 * MS);
    assert_eq!(expired.status(), StatusCode::GATEWAY_TIMEOUT);
    let m = metrics(&h).await;
    for (outcome, n) in [("infeasible", 1.0), ("held", 1.0)] {
        let labels = format!(r#"namespace="ns",outcome="{outcome}",service="chat""#);
        assert_eq!(series(&m, "ferry_holder_requests_total", &labels), n, "{outcome}");
    }
    let labels = r#"namespace="ns",outcome="expired",service="chat""#;
    assert_eq!(series(&m, "ferry_holder_finished_total", labels), 1.0);
    assert_eq!(series(&m, "ferry_holder_held", r#"namespace="ns",service="chat""#), 0.0);
}

#[tokio::test(start_paused = true)]
async fn holding_is_bounded_a_client_that_leaves_is_let_go_and_services_are_told_apart() {
    let h = holder(2, Duration::from_secs(5));
    h.set("ns", "chat", at_zero(1000));
    let hold = |timeout| {
        let h = h.clone();
        tokio::spawn(async move { call(&h, infer("chat", timeout)).await })
    };
    let (first, second) = (hold(20_000), hold(20_000));
    tokio::time::sleep(10 * MS).await;
    let full = call(&h, infer("chat", 20_000)).await;
    assert_eq!(full.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(full.headers()["retry-after"], "1");
    assert!(text(full).await.contains("holds 2 requests"));
    // A client gone: its place is free at once.
    first.abort();
    let _ = first.await;
    tokio::time::sleep(MS).await;
    let m = metrics(&h).await;
    assert_eq!(series(&m, "ferry_holder_held", r#"namespace="ns",service="chat""#), 1.0);
    let labels = r#"namespace="ns",outcome="cancelled",service="chat""#;
    assert_eq!(series(&m, "ferry_holder_finished_total", labels), 1.0);
    let third = hold(20_000);
    tokio::time::sleep(MS).await;
    assert!(!third.is_finished() && !second.is_finished());
    // Unknown and ambiguous services are told so; a namespace or the header settles it.
    let unknown = call(&h, infer("other.ns", 1000)).await;
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    h.set("prod", "chat", at_zero(1000));
    let ambiguous = call(&h, infer("chat:8080", 1000)).await;
    assert_eq!(ambiguous.status(), StatusCode::NOT_FOUND);
    assert!(text(ambiguous).await.contains("several namespaces"));
    let named = Request::post("/v1/completions")
        .header("x-ferry-service", "prod/chat")
        .header("x-ferry-timeout-ms", "500")
        .body(Body::from("{}"))
        .unwrap();
    let named = call(&h, named).await;
    let status = named.status();
    let body = text(named).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "prod/chat: 500 ms against 1 s of start-up: {body}");
    assert!(body.contains(r#""type":"server_error""#), "OpenAI's error shape under /v1/: {body}");
    // A deadline beyond the service's budget is refused as its pods would.
    let long = call(&h, infer("chat.ns", 40_000)).await;
    assert_eq!(long.status(), StatusCode::BAD_REQUEST);
}

/// What reached the recording pod: (path, x-ferry-timeout-ms, x-ferry-ttft-ms, body).
type Seen = Arc<Mutex<Vec<(String, u64, Option<u64>, String)>>>;

/// A pod that records each request and answers it: JSON, or an SSE stream of two events.
async fn recording_pod() -> (String, Seen) {
    let seen: Seen = Arc::default();
    let record = seen.clone();
    let app = axum::Router::new().fallback(move |request: Request<Body>| {
        let record = record.clone();
        async move {
            let (parts, body) = request.into_parts();
            let header = |name: &str| parts.headers.get(name).map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
            let (timeout, ttft) = (header("x-ferry-timeout-ms").unwrap(), header("x-ferry-ttft-ms"));
            let path = parts.uri.path().to_owned();
            let body = String::from_utf8(axum::body::to_bytes(body, 1 << 20).await.unwrap().to_vec()).unwrap();
            let stream = body.contains(r#""stream":true"#);
            record.lock().unwrap().push((path, timeout, ttft, body));
            if stream {
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from("data: {\"token\":1}\n\ndata: [DONE]\n\n"))
                    .unwrap()
            } else {
                Response::builder()
                    .header("content-type", "application/json")
                    .body(Body::from(r#"{"ok":true}"#))
                    .unwrap()
            }
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (address, seen)
}

#[tokio::test]
async fn held_requests_go_to_the_first_ready_pod_with_the_deadline_they_have_left() {
    let h = holder(16, Duration::from_millis(50));
    h.set("ns", "chat", at_zero(100));
    let (pod, seen) = recording_pod().await;
    let mut waiting = Vec::new();
    for (i, timeout) in [30_000u64, 10_000, 20_000].into_iter().enumerate() {
        let h = h.clone();
        let request = Request::post(format!("/v2/models/m/infer?n={i}"))
            .header("host", "chat.ns")
            .header("x-ferry-timeout-ms", timeout.to_string())
            .body(Body::from(format!("{{\"n\":{i}}}")))
            .unwrap();
        waiting.push(tokio::spawn(async move { call(&h, request).await }));
    }
    // A held generation stream: SSE headers and keep-alive comments while held.
    let mut generation = at_zero(100);
    generation.generation = true;
    generation.ttft_budget_ms = Some(1000);
    h.set("ns", "gen", generation.clone());
    let stream = Request::post("/v1/completions")
        .header("host", "gen.ns")
        .header("x-ferry-timeout-ms", "20000")
        .header("x-llm-d-slo-ttft-ms", "15000")
        .body(Body::from(r#"{"prompt":"hi","stream":true}"#))
        .unwrap();
    let streamed = call(&h, stream).await;
    assert_eq!(streamed.status(), StatusCode::OK);
    assert_eq!(streamed.headers()["content-type"], "text/event-stream");
    let mut body = streamed.into_body().into_data_stream();
    use futures::StreamExt;
    let first = body.next().await.unwrap().unwrap();
    assert!(first.starts_with(b": held"), "{first:?}");
    // Wait for the holder's own figure: three requests and the stream held.
    let mut held = 0.0;
    for _ in 0..500 {
        let m = metrics(&h).await;
        held = series(&m, "ferry_holder_held", r#"namespace="ns",service="chat""#)
            + series(&m, "ferry_holder_held", r#"namespace="ns",service="gen""#);
        if held == 4.0 {
            break;
        }
        tokio::time::sleep(10 * MS).await;
    }
    assert_eq!(held, 4.0);
    let released = ferry_core::clock::now();
    h.set("ns", "chat", ServiceState { endpoints: vec![pod.clone()], ..at_zero(100) });
    h.set("ns", "gen", ServiceState { endpoints: vec![pod.clone()], ..generation });
    for task in waiting {
        let response = task.await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(text(response).await, r#"{"ok":true}"#);
    }
    let mut rest = Vec::new();
    while let Some(chunk) = body.next().await {
        rest.extend_from_slice(&chunk.unwrap());
    }
    let rest = String::from_utf8(rest).unwrap();
    assert!(rest.ends_with("data: {\"token\":1}\n\ndata: [DONE]\n\n"), "{rest}");
    let waited = ferry_core::clock::elapsed(released);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 4);
    let infers: Vec<_> = seen.iter().filter(|s| s.0.starts_with("/v2/")).collect();
    // Released in deadline order (ferry_core::hold's tests), then relayed at once, each on its
    // own connection: the order they reach the pod is the scheduler's, so the bodies are checked
    // as a set and each deadline against its own.
    let mut bodies: Vec<&str> = infers.iter().map(|s| s.3.as_str()).collect();
    bodies.sort();
    assert_eq!(bodies, [r#"{"n":0}"#, r#"{"n":1}"#, r#"{"n":2}"#]);
    for (_, timeout, ttft, body) in &infers {
        let asked = [30_000u64, 10_000, 20_000][usize::from(body.as_bytes()[5] - b'0')];
        assert!(*timeout < asked && *timeout + 5000 > asked, "{body}: {timeout} ms left of {asked}");
        assert_eq!(*ttft, None);
    }
    let (path, timeout, ttft, _) = seen.iter().find(|s| s.0 == "/v1/completions").unwrap();
    assert_eq!(path, "/v1/completions");
    assert!(*timeout < 20_000 && ttft.unwrap() < 15_000 && ttft.unwrap() + 5000 > 15_000, "{timeout} {ttft:?}");
    assert!(waited < Duration::from_secs(5), "released at once: {waited:?}");
    // Once a pod is ready, what comes is relayed straight away.
    let direct = call(&h, infer("chat.ns", 1000)).await;
    assert_eq!(direct.status(), StatusCode::OK);
    let m = metrics(&h).await;
    let labels = r#"namespace="ns",outcome="relayed",service="chat""#;
    assert_eq!(series(&m, "ferry_holder_requests_total", labels), 1.0);
    let labels = r#"namespace="ns",outcome="released",service="chat""#;
    assert_eq!(series(&m, "ferry_holder_finished_total", labels), 3.0);
}

#[tokio::test]
async fn only_the_operators_token_directs_the_holder() {
    let h = Holder::new(Options {
        bounds: Bounds { requests: 1, bytes: 1 << 20 },
        total_bytes: 1 << 30,
        keep_alive: Duration::from_secs(5),
        token: Some("s3cret".into()),
    });
    let body = serde_json::to_string(&at_zero(1000)).unwrap();
    let put = |auth: Option<&str>| {
        let mut request = Request::put("/services/ns/chat").header("content-type", "application/json");
        if let Some(auth) = auth {
            request = request.header("authorization", auth);
        }
        request.body(Body::from(body.clone())).unwrap()
    };
    for wrong in [None, Some("Bearer nope"), Some("s3cret")] {
        let response = holder::admin(h.clone()).oneshot(put(wrong)).await.unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{wrong:?}");
    }
    // Nothing was set: the service is unknown.
    assert_eq!(call(&h, infer("chat.ns", 5000)).await.status(), StatusCode::NOT_FOUND);
    let response = holder::admin(h.clone()).oneshot(put(Some("Bearer s3cret"))).await.unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    assert_eq!(call(&h, infer("chat.ns", 500)).await.status(), StatusCode::SERVICE_UNAVAILABLE);
    let delete = Request::delete("/services/ns/chat").body(Body::empty()).unwrap();
    assert_eq!(holder::admin(h.clone()).oneshot(delete).await.unwrap().status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test(start_paused = true)]
async fn what_all_services_hold_together_is_bounded() {
    // 13 bytes a request (`{"inputs":[]}`), at most 30 for all: two held, over two services;
    // the third refused, whichever service it is for.
    let h = Holder::new(Options {
        bounds: Bounds { requests: 16, bytes: 1 << 20 },
        total_bytes: 30,
        keep_alive: Duration::from_secs(5),
        token: None,
    });
    h.set("ns", "a", at_zero(1000));
    h.set("ns", "b", at_zero(1000));
    let hold = |host: &'static str| {
        let h = h.clone();
        tokio::spawn(async move { call(&h, infer(host, 20_000)).await })
    };
    let (first, second) = (hold("a.ns"), hold("b.ns"));
    tokio::time::sleep(10 * MS).await;
    let third = call(&h, infer("a.ns", 20_000)).await;
    assert_eq!(third.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = text(third).await;
    assert!(body.contains("holds 26 bytes of requests for all the services") && body.contains("at most 30"), "{body}");
    assert!(!first.is_finished() && !second.is_finished());
}
