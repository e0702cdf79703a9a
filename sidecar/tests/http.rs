//! Black-box tests: the real binary on 127.0.0.1, spoken to over real HTTP. Real time is noisy
//! on shared machines, so timings are checked with generous tolerances; exact milliseconds are
//! the paused-clock tests' job (`exercise.rs`).

mod support;

use std::time::Duration;

use futures::future::join_all as futures_join;
use rand::Rng;
use serde_json::{json, Value};
use support::{body, metric_value, timing, Sidecar};
use tokio::time::sleep;

/// The exercise's service, with the latency budget raised so that noise cannot expire anyone.
const EXERCISE: &[&str] = &[
    "--model",
    "m",
    "--max-batch-size",
    "4",
    "--max-wait",
    "10ms",
    "--sim-batch-time",
    "100ms",
    "--latency-budget",
    "400ms",
    "--max-timeout",
    "1s",
];

/// Polls the sidecar's metrics until `ready` holds (bounded: a real process on a noisy machine).
async fn until_metrics(s: &Sidecar, ready: impl Fn(&str) -> bool) {
    let waited = tokio::time::timeout(Duration::from_secs(20), async {
        while !ready(&s.metrics().await) {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(waited.is_ok(), "the sidecar's metrics never showed what the test waits for");
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn call_at(
    s: &Sidecar,
    after: Duration,
    value: f32,
    headers: Vec<(&'static str, String)>,
) -> (reqwest::Response, Duration) {
    sleep(after).await;
    let sent = ferry_core::clock::now();
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let response = s.infer("m", &body(&[vec![value]]), &headers).await;
    (response, ferry_core::clock::elapsed(sent))
}

async fn doubled(response: reqwest::Response) -> Vec<f64> {
    let v: Value = response.json().await.unwrap();
    v["outputs"][0]["data"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

#[tokio::test]
async fn sparse_arrivals_share_a_batch_after_max_wait() {
    // maxWait widened to 50 ms so that B (sent 20 ms after A) surely arrives inside it.
    let args: Vec<&str> = EXERCISE.iter().map(|a| if *a == "10ms" { "50ms" } else { a }).collect();
    let s = Sidecar::start(&args).await;
    let (a, b) =
        tokio::join!(call_at(&s, Duration::ZERO, 1.0, vec![]), call_at(&s, Duration::from_millis(20), 2.0, vec![]));
    let ((a, a_took), (b, _)) = (a, b);
    assert_eq!(a.status(), 200);
    assert_eq!(b.status(), 200);
    assert_eq!(a.headers()["x-ferry-batch-size"], "2");
    assert_eq!(b.headers()["x-ferry-batch-size"], "2");
    let queued = timing(&a, "queue");
    assert!((45.0..90.0).contains(&queued), "A left when it had waited maxWait: {queued} ms");
    assert!((95.0..160.0).contains(&timing(&a, "batch")));
    assert!((145.0..300.0).contains(&ms(a_took)), "A took {a_took:?}");
    assert_eq!(doubled(a).await, vec![2.0]);
    assert_eq!(doubled(b).await, vec![4.0]);
}

#[tokio::test]
async fn a_full_batch_leaves_at_once() {
    let s = Sidecar::start(EXERCISE).await;
    let calls = (0..4).map(|i| call_at(&s, Duration::ZERO, i as f32, vec![]));
    for (i, (response, took)) in futures_join(calls).await.into_iter().enumerate() {
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-ferry-batch-size"], "4");
        assert!(timing(&response, "queue") < 40.0, "a full batch does not wait for maxWait");
        assert!((95.0..250.0).contains(&ms(took)), "took {took:?}");
        assert_eq!(doubled(response).await, vec![2.0 * i as f64]);
    }
}

#[tokio::test]
async fn max_wait_does_not_cap_the_wait_for_a_busy_worker() {
    let s = Sidecar::start(EXERCISE).await;
    let mut calls: Vec<_> = (0..4).map(|i| call_at(&s, Duration::ZERO, i as f32, vec![])).collect();
    calls.push(call_at(&s, Duration::from_millis(30), 10.0, vec![]));
    let mut seen = futures_join(calls).await;
    let (e, took) = seen.pop().unwrap();
    assert_eq!(e.status(), 200);
    assert_eq!(e.headers()["x-ferry-batch-size"], "1");
    let queued = timing(&e, "queue");
    assert!(queued > 50.0, "E waited for the worker ({queued} ms), far past its 10 ms maxWait");
    assert!((150.0..350.0).contains(&ms(took)), "E was done at about 200 ms: {took:?}");
    assert_eq!(doubled(e).await, vec![20.0]);
}

#[tokio::test]
async fn a_deadline_that_cannot_be_met_is_refused_at_admission() {
    let s = Sidecar::start(EXERCISE).await;
    let mut calls: Vec<_> = (0..4).map(|i| call_at(&s, Duration::ZERO, i as f32, vec![])).collect();
    calls.push(call_at(&s, Duration::from_millis(30), 10.0, vec![("x-ferry-timeout-ms", "100".into())]));
    let mut seen = futures_join(calls).await;
    let (e, took) = seen.pop().unwrap();
    assert_eq!(e.status(), 503);
    assert!(ms(took) < 60.0, "refused at once, not at its deadline: {took:?}");
    assert!(e.headers()["retry-after"].to_str().unwrap().parse::<u64>().unwrap() >= 1);
    let error: Value = e.json().await.unwrap();
    let message = error["error"].as_str().unwrap();
    // "deadline cannot be met: estimated completion in N ms, the deadline allows M ms"
    let numbers: Vec<u64> = message.split(' ').filter_map(|w| w.trim_end_matches(',').parse().ok()).collect();
    assert!(message.starts_with("deadline cannot be met: estimated completion in"), "{message}");
    assert!(numbers[0] > numbers[1] && numbers[1] <= 100, "estimated vs allowed: {message}");
    assert!(seen.iter().all(|(r, _)| r.status() == 200));
    assert_eq!(s.outcome("infeasible").await, 1);
}

#[tokio::test]
async fn two_hundred_concurrent_callers_get_their_own_rows_back() {
    let s = Sidecar::start(&[
        "--model",
        "m",
        "--max-batch-size",
        "32",
        "--workers",
        "2",
        "--sim-batch-time",
        "20ms",
        "--latency-budget",
        "10s",
    ])
    .await;
    let requests: Vec<Vec<Vec<f32>>> = {
        let mut rng = rand::rng();
        (0..200)
            .map(|_| {
                let rows = rng.random_range(1..=4);
                (0..rows).map(|_| (0..3).map(|_| rng.random_range(-1000..1000) as f32 / 8.0).collect()).collect()
            })
            .collect()
    };
    let calls = requests.iter().map(|rows| async { s.infer("m", &body(rows), &[]).await });
    let responses = futures_join(calls).await;
    let mut shared = 0;
    for (rows, response) in requests.iter().zip(responses) {
        assert_eq!(response.status(), 200);
        let batch: u32 = response.headers()["x-ferry-batch-size"].to_str().unwrap().parse().unwrap();
        assert!(batch as usize >= rows.len() && batch <= 32);
        shared += usize::from(batch as usize > rows.len());
        let v: Value = response.json().await.unwrap();
        assert_eq!(v["outputs"][0]["shape"], json!([rows.len(), 3]));
        let want: Vec<f64> = rows.iter().flatten().map(|x| f64::from(x * 2.0)).collect();
        let got: Vec<f64> = v["outputs"][0]["data"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        assert_eq!(got, want, "a caller got someone else's rows");
    }
    assert!(shared > 100, "requests were batched together ({shared} of 200 shared a batch)");
    assert_eq!(s.outcome("ok").await, 200);
}

#[tokio::test]
async fn every_error_of_the_table_has_its_status_and_json_body() {
    let s = Sidecar::start(&[
        "--model",
        "m",
        "--model-version",
        "3",
        "--max-batch-size",
        "2",
        "--max-request-bytes",
        "4096",
        "--sim-batch-time",
        "300ms",
        "--max-queue",
        "2",
        "--max-wait",
        "1s",
        "--latency-budget",
        "5s",
    ])
    .await;
    async fn expect(response: reqwest::Response, status: u16, contains: &str) {
        assert_eq!(response.status(), status);
        assert!(response.headers().contains_key("x-request-id"));
        let v: Value = response.json().await.unwrap();
        let message = v["error"].as_str().unwrap_or_else(|| panic!("no error in {v}"));
        assert!(message.contains(contains), "{message:?} does not say {contains:?}");
    }
    // 400: malformed JSON, data that does not match the shape, a bad header.
    let raw = s.http.post(s.url("/v2/models/m/infer")).body("{not json").send().await.unwrap();
    expect(raw, 400, "not a valid infer request").await;
    let bad = json!({"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1, 2]}]});
    expect(s.infer("m", &bad, &[]).await, 400, "'data' has 2 elements, but shape [1, 3] needs 3").await;
    expect(s.infer("m", &body(&[vec![1.0]]), &[("x-ferry-timeout-ms", "9000")]).await, 400, "at most 5000 ms").await;
    expect(s.infer("m", &body(&[vec![1.0]]), &[("x-ferry-priority", "urgent")]).await, 400, "'urgent'").await;
    // 404: unknown model, unknown version.
    expect(s.infer("other", &body(&[vec![1.0]]), &[]).await, 404, "serves 'm' (version 3)").await;
    let v = s.http.post(s.url("/v2/models/m/versions/9/infer")).json(&body(&[vec![1.0]])).send().await.unwrap();
    expect(v, 404, "no version '9'; it has version 3").await;
    // 413: more rows than maxBatchSize, a body over the byte limit.
    let rows = body(&[vec![1.0], vec![2.0], vec![3.0]]);
    expect(s.infer("m", &rows, &[]).await, 413, "3 rows; this service accepts at most 2").await;
    let big = body(&[vec![1.0; 2000]]);
    expect(s.infer("m", &big, &[]).await, 413, "the limit (--max-request-bytes) is 4096").await;
    // 503 queue full: two-row batches leave at once, so of five one-row requests the first two
    // ride, the next two wait, and the fifth finds the queue full. Each is sent once the sidecar's
    // metrics show the one before it admitted.
    let s = &s;
    let mut responses = Vec::new();
    for (i, (depth, batches)) in [(1.0, 0.0), (0.0, 1.0), (1.0, 1.0), (2.0, 1.0)].into_iter().enumerate() {
        let url = s.url("/v2/models/m/infer");
        let request = s.http.post(url).json(&body(&[vec![i as f32]])).send();
        responses.push(tokio::spawn(request));
        until_metrics(s, |m| {
            metric_value(m, "ferry_queue_depth", "model=\"m\"") == depth
                && metric_value(m, "ferry_batch_size_count", "model=\"m\"") == batches
        })
        .await;
    }
    let fifth = s.infer("m", &body(&[vec![4.0]]), &[]).await;
    let responses: Vec<reqwest::Response> =
        futures_join(responses).await.into_iter().map(|r| r.unwrap().unwrap()).collect();
    assert!(fifth.headers()["retry-after"].to_str().unwrap().parse::<u64>().unwrap() >= 1);
    expect(fifth, 503, "queue full: 2 requests waiting, the bound (maxQueue) is 2").await;
    for r in responses {
        assert_eq!(r.status(), 200);
    }
    let m = s.metrics().await;
    for (outcome, n) in [("invalid", 4.0), ("not_found", 0.0), ("too_large", 2.0), ("queue_full", 1.0), ("ok", 4.0)] {
        assert_eq!(metric_value(&m, "ferry_requests_total", &format!("outcome=\"{outcome}\"")), n, "{outcome}");
    }
    // The unknown model and version count for no model, not against m.
    let unknown = m.lines().find(|l| l.starts_with("ferry_requests_total{model=\"\",outcome=\"not_found\""));
    assert!(unknown.is_some_and(|l| l.ends_with(" 2")), "{m}");
}

#[tokio::test]
async fn a_request_whose_batch_hangs_gets_504_at_its_deadline() {
    let s =
        Sidecar::start(&["--model", "m", "--sim-hang-rate", "1", "--sim-batch-time", "50ms", "--max-timeout", "1s"])
            .await;
    let sent = ferry_core::clock::now();
    // The watchdog gives up on the first run at 10 + 3 × 50 + 100 = 260 ms; the retry hangs too,
    // and its watchdog (at 520) comes after the deadline: the 504 comes at the deadline, 500.
    let response = s.infer("m", &body(&[vec![1.0]]), &[("x-ferry-timeout-ms", "500")]).await;
    let took = ferry_core::clock::elapsed(sent);
    assert_eq!(response.status(), 504);
    assert!((490.0..900.0).contains(&ms(took)), "answered at its deadline: {took:?}");
    let v: Value = response.json().await.unwrap();
    assert!(v["error"].as_str().unwrap().contains("deadline passed while its batch was running"), "{v}");
    assert_eq!(s.outcome("expired").await, 1);
}

#[tokio::test]
async fn an_engine_failure_is_a_500_naming_the_engine_error() {
    let s = Sidecar::start(&["--model", "m", "--sim-fail-rate", "1", "--sim-batch-time", "10ms"]).await;
    let response = s.infer("m", &body(&[vec![1.0]]), &[]).await;
    assert_eq!(response.status(), 500);
    let v: Value = response.json().await.unwrap();
    // A request failing alone is retried once; failing alone again, it is given up on.
    assert_eq!(
        v["error"],
        "engine error: injected failure (--sim-fail-rate) (failed 2 of 2 attempts; retries stopped)"
    );
    assert_eq!(s.outcome("failed").await, 1);
}

#[tokio::test]
async fn metrics_expose_every_name_of_the_contract_on_the_admin_port_only() {
    let s = Sidecar::start(&["--model", "m", "--sim-batch-time", "5ms", "--latency-budget", "750ms"]).await;
    assert_eq!(s.infer("m", &body(&[vec![1.0]]), &[]).await.status(), 200);
    let text = s.metrics().await;
    for name in [
        "ferry_model_ready",
        "ferry_target_seconds",
        "ferry_requests_total",
        "ferry_queue_depth",
        "ferry_queue_bytes",
        "ferry_queue_oldest_age_seconds",
        "ferry_queue_wait_seconds_bucket",
        "ferry_request_duration_seconds_bucket",
        "ferry_batch_size_bucket",
        "ferry_batch_duration_seconds_bucket",
        "ferry_workers",
        "ferry_late_results_total",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(&format!("{name}{{")) && l.contains("model=\"m\",")),
            "{name} missing"
        );
    }
    assert_eq!(metric_value(&text, "ferry_workers", "state=\"idle\""), 1.0);
    assert_eq!(metric_value(&text, "ferry_batch_size_count", "model=\"m\""), 1.0);
    assert_eq!(metric_value(&text, "ferry_model_ready", "model=\"m\""), 1.0);
    assert_eq!(metric_value(&text, "ferry_target_seconds", "promise=\"request\""), 0.75);
    // The API port serves them too, for an endpoint picker that scrapes the port it routes to.
    let on_api = s.http.get(s.url("/metrics")).send().await.unwrap();
    assert_eq!(on_api.status(), 200);
    assert!(on_api.headers()["content-type"].to_str().unwrap().starts_with("text/plain; version=0.0.4"));
    let on_api = on_api.text().await.unwrap();
    assert_eq!(metric_value(&on_api, "ferry_batch_size_count", "model=\"m\""), 1.0);
}

#[tokio::test]
async fn the_oldest_age_gauge_grows_while_a_request_waits() {
    // One 600 ms batch runs; the second request waits behind it, and its age grows on every scrape.
    let s = Sidecar::start(support::ONE_SLOW_WORKER).await;
    let first = tokio::spawn(s.http.post(s.url("/v2/models/m/infer")).json(&body(&[vec![1.0]])).send());
    until_metrics(&s, |m| metric_value(m, "ferry_workers", "state=\"busy\"") == 1.0).await;
    let second = tokio::spawn(s.http.post(s.url("/v2/models/m/infer")).json(&body(&[vec![2.0]])).send());
    until_metrics(&s, |m| metric_value(m, "ferry_queue_depth", "model=\"m\"") == 1.0).await;
    let age = |m: &str| metric_value(m, "ferry_queue_oldest_age_seconds", "model=\"m\"");
    let early = age(&s.metrics().await);
    // It keeps growing while the request waits (the gauge is computed at scrape time).
    until_metrics(&s, |m| age(m) > early + 0.05 || metric_value(m, "ferry_queue_depth", "model=\"m\"") == 0.0).await;
    let later = s.metrics().await;
    let (a, b) = (first.await.unwrap().unwrap(), second.await.unwrap().unwrap());
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    assert!(early < 0.6, "the second request waits at most one 600 ms batch: {early}");
    if metric_value(&later, "ferry_queue_depth", "model=\"m\"") == 1.0 {
        assert!(age(&later) > early, "{} after {early}", age(&later));
    }
    // Empty again: the gauge is 0.
    assert_eq!(age(&s.metrics().await), 0.0);
}

/// Deadlines no figure meets (20 ms against 100 ms batches, by the configured time too, so no
/// probe goes): after 5 s of refusing every request while idle, the sidecar says so in its gauge
/// and its readiness body (and stays ready); the first request that runs ends it.
#[tokio::test]
async fn a_sidecar_that_refuses_every_request_while_idle_says_so() {
    let s = Sidecar::start(&["--model", "m", "--sim-batch-time", "100ms"]).await;
    let locked = |m: &str| metric_value(m, "ferry_admission_locked", "model=\"m\"");
    assert_eq!(locked(&s.metrics().await), 0.0);
    let started = ferry_core::clock::now();
    // The offered load's pace (one request a tenth of a second), not a synchronisation.
    let mut pace = tokio::time::interval(Duration::from_millis(100));
    let mut refused = 0;
    while locked(&s.metrics().await) == 0.0 {
        assert!(
            ferry_core::clock::elapsed(started) < Duration::from_secs(30),
            "never shown as locked after {refused} refusals"
        );
        pace.tick().await;
        let r = s.infer("m", &body(&[vec![1.0]]), &[("x-ferry-timeout-ms", "20")]).await;
        assert_eq!(r.status(), 503);
        refused += 1;
    }
    assert!(
        ferry_core::clock::elapsed(started) >= Duration::from_secs(5),
        "shown after {:?}",
        ferry_core::clock::elapsed(started)
    );
    let ready = s.http.get(s.url("/v2/health/ready")).send().await.unwrap();
    assert_eq!(ready.status(), 200, "still ready: taking the pod out would not mend it");
    let ready: Value = ready.json().await.unwrap();
    assert_eq!(ready["ready"], true);
    let why = &ready["refusingEveryRequest"][0];
    assert_eq!((why["model"].as_str(), why["version"].as_str()), (Some("m"), Some("1")), "{ready}");
    let reason = why["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("refusing every request while idle") && reason.contains("deadline cannot be met"),
        "{reason}"
    );
    // A request with time to spare (the 200 ms default budget) runs, and the lock is over.
    let ok = s.infer("m", &body(&[vec![1.0]]), &[]).await;
    assert_eq!(ok.status(), 200);
    until_metrics(&s, |m| locked(m) == 0.0).await;
    let ready: Value = s.http.get(s.url("/v2/health/ready")).send().await.unwrap().json().await.unwrap();
    assert_eq!(ready, json!({"ready": true}));
}

/// An engine that hangs (here the sim-llm engine a thousand times slower than its estimate: a
/// 10 ms step takes 10 s) takes the pod out: the sidecar fails what it holds, goes unready and
/// exits non-zero, so that Kubernetes restarts it, instead of keeping its traffic for ever.
#[tokio::test]
async fn a_hung_engine_makes_the_sidecar_exit_non_zero() {
    let args = ["--engine", "sim-llm", "--model", "m", "--sim-slow-spell", "1000x@0s+1h", "--max-timeout", "30s"];
    let mut s = Sidecar::start(&args).await;
    let ready = s.http.get(s.url("/v2/health/ready")).send().await.unwrap();
    assert_eq!(ready.status(), 200, "ready: no step has run");
    let sent = ferry_core::clock::now();
    let answer = s
        .http
        .post(s.url("/v1/completions"))
        .header("x-ferry-ttft-ms", "5000")
        .header("x-ferry-timeout-ms", "20000")
        .json(&json!({"model": "m", "prompt": "a b c", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    // The step started at once; 1.5 s later it is abandoned and the request fails, saying why.
    assert_eq!(answer.status(), 500);
    let error: Value = answer.json().await.unwrap();
    let message = error["error"]["message"].as_str().unwrap_or_default().to_owned();
    assert!(message.contains("the engine failed: step 0 has run"), "{error}");
    let failed_after = ferry_core::clock::elapsed(sent);
    assert!(failed_after >= Duration::from_millis(1500) && failed_after < Duration::from_secs(5), "{failed_after:?}");
    let status =
        tokio::time::timeout(Duration::from_secs(30), s.child.wait()).await.expect("the sidecar exits").unwrap();
    assert!(!status.success(), "exit status {status}");
}

#[tokio::test]
async fn metadata_and_health_follow_the_open_inference_protocol() {
    let s = Sidecar::start(&["--model", "m", "--model-version", "2"]).await;
    let get = |path: &'static str| {
        let s = &s;
        async move {
            let r = s.http.get(s.url(path)).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    assert_eq!(get("/v2/health/live").await, (200, json!({"live": true})));
    assert_eq!(get("/v2/health/ready").await, (200, json!({"ready": true})));
    assert_eq!(get("/v2").await.1["name"], "ferry-sidecar");
    let (status, meta) = get("/v2/models/m").await;
    assert_eq!(status, 200);
    assert_eq!(meta["versions"], json!(["2"]));
    assert_eq!(meta["inputs"][0]["name"], "INPUT0");
    assert_eq!(get("/v2/models/m/versions/2/ready").await, (200, json!({"name": "m", "ready": true})));
    assert_eq!(get("/v2/models/x/ready").await.0, 404);
    let (status, err) = get("/v3/anything").await;
    assert_eq!(status, 404);
    assert!(err["error"].as_str().unwrap().contains("no endpoint GET /v3/anything"));
    // The request id is echoed when given, made up when not.
    let r = s.http.get(s.url("/v2")).header("x-request-id", "abc-123").send().await.unwrap();
    assert_eq!(r.headers()["x-request-id"], "abc-123");
    let r = s.http.get(s.url("/v2")).send().await.unwrap();
    assert_eq!(r.headers()["x-request-id"].len(), 32);
}

#[tokio::test]
async fn sigterm_drains_then_exits_zero() {
    let mut s = Sidecar::start(&[
        "--model",
        "m",
        "--sim-batch-time",
        "400ms",
        "--max-batch-size",
        "1",
        "--latency-budget",
        "5s",
    ])
    .await;
    let bodies: Vec<Value> = (0..3).map(|i| body(&[vec![i as f32]])).collect();
    let in_flight: Vec<_> = bodies.iter().map(|b| s.infer("m", b, &[])).collect();
    let terminate = async {
        // Wait until all three are admitted (one running, two queued), then send SIGTERM.
        loop {
            let text = s.metrics().await;
            if metric_value(&text, "ferry_queue_depth", "model=\"m\"") == 2.0 {
                break;
            }
            tokio::task::yield_now().await;
        }
        s.terminate();
        // Draining: not ready, and new requests are refused with 503 draining.
        loop {
            let r = s.http.get(s.admin_url("/v2/health/ready")).send().await.unwrap();
            if r.status() == 503 {
                break;
            }
        }
        // The metrics say so too: a draining pod's model takes no request.
        assert_eq!(metric_value(&s.metrics().await, "ferry_model_ready", "model=\"m\""), 0.0);
        s.infer("m", &body(&[vec![9.0]]), &[]).await
    };
    let (responses, refused) = tokio::join!(futures_join(in_flight), terminate);
    for r in responses {
        assert_eq!(r.status(), 200, "queued work finishes during the drain");
    }
    assert_eq!(refused.status(), 503);
    let v: Value = refused.json().await.unwrap();
    assert!(v["error"].as_str().unwrap().starts_with("draining"), "{v}");
    let status = tokio::time::timeout(Duration::from_secs(10), s.child.wait()).await.unwrap().unwrap();
    assert!(status.success(), "exit status {status:?}");
}

#[tokio::test]
async fn a_bad_setting_is_one_line_naming_the_field_and_exit_2() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_ferry-sidecar"))
        .args(["--max-batch-size", "0"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr, "ferry-sidecar: spec.batching.maxBatchSize (--max-batch-size) is 0; it must be at least 1\n");
}

#[tokio::test]
async fn the_quickstart_manifest_serves() {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/quickstart.yaml");
    let s = Sidecar::start(&["--config", manifest]).await;
    let r = s.infer("quickstart", &body(&[vec![1.5, 2.5]]), &[]).await;
    assert_eq!(r.status(), 200);
    let took = timing(&r, "total");
    assert!((105.0..300.0).contains(&took), "one request alone: maxWait 10 ms + 100 ms batch, took {took} ms");
    assert_eq!(doubled(r).await, vec![3.0, 5.0]);
}

#[tokio::test]
async fn without_tenants_a_gateways_fairness_ids_are_counted_as_tenants_on_the_admin_port_only() {
    let s = Sidecar::start(&["--model", "m"]).await;
    for (flow, n) in [("team-a", 2), ("team-b", 1)] {
        for _ in 0..n {
            let r = s
                .http
                .post(s.url("/v2/models/m/infer"))
                .header("x-llm-d-inference-fairness-id", flow)
                .json(&body(&[vec![1.0]]))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
    }
    let bad = s
        .http
        .post(s.url("/v2/models/m/infer"))
        .header("x-llm-d-inference-fairness-id", "x".repeat(200))
        .json(&body(&[vec![1.0]]))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    assert!(bad.text().await.unwrap().contains("x-llm-d-inference-fairness-id"));
    let admin = s.metrics().await;
    assert_eq!(metric_value(&admin, "ferry_tenant_requests_total", "outcome=\"ok\",tenant=\"team-a\""), 2.0);
    assert_eq!(metric_value(&admin, "ferry_tenant_requests_total", "outcome=\"ok\",tenant=\"team-b\""), 1.0);
    let api = s.http.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(!api.contains("team-a") && api.contains("ferry_requests_total"), "{api}");
}
