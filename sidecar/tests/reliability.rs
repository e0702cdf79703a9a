//! Failure handling of the real binary over HTTP: poison isolation, a client that disconnects,
//! idempotent replay, join and conflict.

mod support;

use std::time::Duration;

use futures::future::join_all;
use serde_json::{json, Value};
use support::{body, metric_value, Sidecar};
use tokio::io::AsyncWriteExt;

/// Polls the sidecar's metrics until `ready` holds (bounded: a real process on a noisy machine).
async fn until(s: &Sidecar, what: &str, ready: impl Fn(&str) -> bool) {
    let waited = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if ready(&s.metrics().await) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "timed out waiting for {what}");
}

#[tokio::test]
async fn a_poison_row_fails_alone_and_its_batch_mates_succeed() {
    let s = Sidecar::start(&[
        "--model",
        "m",
        "--sim-poison",
        "-1",
        "--max-batch-size",
        "4",
        "--max-wait",
        "100ms",
        "--sim-batch-time",
        "50ms",
        "--latency-budget",
        "5s",
    ])
    .await;
    let bodies: Vec<Value> = [3.0, -1.0, 5.0, 7.0].iter().map(|&v| body(&[vec![v, 1.0]])).collect();
    let responses = join_all(bodies.iter().map(|b| s.infer("m", b, &[]))).await;
    for (i, r) in responses.into_iter().enumerate() {
        if i == 1 {
            assert_eq!(r.status(), 500);
            let v: Value = r.json().await.unwrap();
            let message = v["error"].as_str().unwrap();
            assert!(
                message.starts_with("engine error: poison row: its first element is -1 (--sim-poison)"),
                "{message}"
            );
        } else {
            assert_eq!(r.status(), 200, "request {i} shared a batch with the poison row");
        }
    }
    let m = s.metrics().await;
    let batches = metric_value(&m, "ferry_batch_size_count", "model=\"m\"");
    assert!(batches <= 4.0, "the first batch and at most ⌈log2 4⌉ + 1 = 3 more: {batches}");
    assert_eq!(metric_value(&m, "ferry_requests_total", "outcome=\"failed\""), 1.0);
}

#[tokio::test]
async fn a_client_that_disconnects_is_cancelled_and_never_executed() {
    let s = Sidecar::start(support::ONE_SLOW_WORKER).await;
    let first_body = body(&[vec![1.0]]);
    let first = s.infer("m", &first_body, &[]);
    let disconnect = async {
        until(&s, "the first request to run", |m| metric_value(m, "ferry_workers", "state=\"busy\"") == 1.0).await;
        let payload = body(&[vec![2.0]]).to_string();
        let mut raw = tokio::net::TcpStream::connect(s.api).await.unwrap();
        let request = format!(
            "POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{payload}",
            payload.len()
        );
        raw.write_all(request.as_bytes()).await.unwrap();
        until(&s, "the second request to queue", |m| metric_value(m, "ferry_queue_depth", "model=\"m\"") == 1.0).await;
        drop(raw); // the client goes away
        until(&s, "the cancellation", |m| metric_value(m, "ferry_requests_total", "outcome=\"cancelled\"") == 1.0)
            .await;
    };
    let (first, ()) = tokio::join!(first, disconnect);
    assert_eq!(first.status(), 200);
    let m = s.metrics().await;
    assert_eq!(metric_value(&m, "ferry_queue_depth", "model=\"m\""), 0.0);
    assert_eq!(metric_value(&m, "ferry_batch_size_count", "model=\"m\""), 1.0, "nothing ran for the cancelled request");
}

#[tokio::test]
async fn idempotent_requests_replay_join_and_conflict() {
    let s = Sidecar::start(&["--model", "m", "--sim-batch-time", "300ms", "--latency-budget", "5s"]).await;
    let a = body(&[vec![1.0, 2.0]]);
    let batches = |m: &str| metric_value(m, "ferry_batch_size_count", "model=\"m\"");

    // Replay: the second call with the same key and body gets the saved answer, marked.
    let first = s.infer("m", &a, &[("idempotency-key", "order-1")]).await;
    assert_eq!(first.status(), 200);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first_body: Value = first.json().await.unwrap();
    let again = s.infer("m", &a, &[("idempotency-key", "order-1")]).await;
    assert_eq!(again.status(), 200);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<Value>().await.unwrap(), first_body);
    assert_eq!(batches(&s.metrics().await), 1.0, "the replay did not run again");

    // Conflict: the same key for another body.
    let other = s.infer("m", &body(&[vec![9.0, 9.0]]), &[("idempotency-key", "order-1")]).await;
    assert_eq!(other.status(), 409);
    let v: Value = other.json().await.unwrap();
    assert!(v["error"].as_str().unwrap().contains("'order-1' was already used for a different request"), "{v}");

    // Join: two concurrent calls with one key run once and get the same answer.
    let (x, y) = tokio::join!(
        s.infer("m", &a, &[("idempotency-key", "order-2")]),
        s.infer("m", &a, &[("idempotency-key", "order-2")])
    );
    assert_eq!((x.status().as_u16(), y.status().as_u16()), (200, 200));
    let marked = [&x, &y].iter().filter(|r| r.headers().get("idempotent-replayed").is_some()).count();
    assert_eq!(marked, 1, "one ran, the other joined it");
    assert_eq!(x.json::<Value>().await.unwrap()["outputs"], json!(first_body["outputs"]));
    assert_eq!(y.json::<Value>().await.unwrap()["outputs"], json!(first_body["outputs"]));
    assert_eq!(batches(&s.metrics().await), 2.0, "the joined request ran once");

    // Keys are per tenant: another caller's credentials make another record.
    let tenant = s.infer("m", &a, &[("idempotency-key", "order-1"), ("authorization", "Bearer b")]).await;
    assert_eq!(tenant.status(), 200);
    assert!(tenant.headers().get("idempotent-replayed").is_none());
    assert_eq!(metric_value(&s.metrics().await, "ferry_requests_total", "outcome=\"conflict\""), 1.0);
}
