//! The `remote` engine: a sidecar in front of another Open Inference Protocol server — here a
//! second, real sidecar process on the `sim` engine — over real HTTP on 127.0.0.1.

mod support;

use std::time::Duration;

use futures::future::join_all;
use rand::Rng;
use serde_json::{json, Value};
use support::{body, metric_value, Sidecar};

async fn front_of(upstream: &Sidecar, extra: &[&str]) -> Sidecar {
    let url = format!("http://{}", upstream.api);
    let mut args = vec!["--engine", "remote", "--upstream", url.as_str(), "--model", "m", "--latency-budget", "5s"];
    args.extend_from_slice(extra);
    let front = Sidecar::start(&args).await;
    let ready = tokio::time::timeout(Duration::from_secs(20), async {
        while front.http.get(front.url("/v2/health/ready")).send().await.unwrap().status() != 200 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(ready.is_ok(), "the front sidecar became ready once the upstream model answered");
    front
}

#[tokio::test]
async fn batches_go_upstream_stacked_and_rows_come_back_to_their_callers() {
    // The upstream leaves at once (maxWait 0): each front batch is one upstream batch.
    let upstream = Sidecar::start(&[
        "--model",
        "m",
        "--sim-batch-time",
        "20ms",
        "--max-batch-size",
        "64",
        "--max-wait",
        "0ms",
        "--latency-budget",
        "5s",
    ])
    .await;
    let front = front_of(&upstream, &["--max-batch-size", "16", "--max-wait", "30ms"]).await;

    let meta: Value = front.http.get(front.url("/v2/models/m")).send().await.unwrap().json().await.unwrap();
    assert_eq!(meta["platform"], "ferry_sim", "the signature is the upstream model's");

    let requests: Vec<Vec<Vec<f32>>> = {
        let mut rng = rand::rng();
        (0..40)
            .map(|_| (0..rng.random_range(1..=3)).map(|_| vec![rng.random_range(-99..99) as f32, 0.5]).collect())
            .collect()
    };
    let responses = join_all(requests.iter().map(|rows| async { front.infer("m", &body(rows), &[]).await })).await;
    let mut shared = 0;
    for (rows, response) in requests.iter().zip(responses) {
        assert_eq!(response.status(), 200);
        let batch: usize = response.headers()["x-ferry-batch-size"].to_str().unwrap().parse().unwrap();
        shared += usize::from(batch > rows.len());
        let v: Value = response.json().await.unwrap();
        assert_eq!(v["outputs"][0]["shape"], json!([rows.len(), 2]));
        let want: Vec<f64> = rows.iter().flatten().map(|x| f64::from(x * 2.0)).collect();
        let got: Vec<f64> = v["outputs"][0]["data"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        assert_eq!(got, want, "a caller got someone else's rows");
    }
    assert!(shared > 0, "requests shared front batches");
    let (f, u) = (front.metrics().await, upstream.metrics().await);
    let rows = |m: &str| metric_value(m, "ferry_batch_size_sum", "model=\"m\"");
    let batches = |m: &str| metric_value(m, "ferry_batch_size_count", "model=\"m\"");
    assert_eq!(rows(&u), rows(&f), "every row the front batched went upstream once");
    assert_eq!(batches(&u), batches(&f), "one upstream request per front batch");
    assert_eq!(metric_value(&u, "ferry_requests_total", "outcome=\"ok\""), batches(&f));
}

#[tokio::test]
async fn inputs_are_checked_against_the_upstream_signature() {
    let upstream = Sidecar::start(&["--model", "m", "--sim-batch-time", "5ms"]).await;
    let front = front_of(&upstream, &[]).await;
    let wrong_name = json!({"inputs": [{"name": "X", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]});
    let r = front.infer("m", &wrong_name, &[]).await;
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "input 'X' is not an input of model 'm'; it has INPUT0");
    let wrong_type = json!({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}]});
    let r = front.infer("m", &wrong_type, &[]).await;
    assert_eq!(r.status(), 400);
    assert!(r.json::<Value>().await.unwrap()["error"].as_str().unwrap().contains("takes FP32"));
}

#[tokio::test]
async fn a_poison_row_behind_the_remote_engine_fails_alone() {
    let upstream = Sidecar::start(&[
        "--model",
        "m",
        "--sim-batch-time",
        "10ms",
        "--sim-poison",
        "-1",
        "--max-wait",
        "0ms",
        "--latency-budget",
        "5s",
    ])
    .await;
    let front = front_of(&upstream, &["--max-batch-size", "4", "--max-wait", "100ms"]).await;
    let bodies: Vec<Value> = [3.0, -1.0, 5.0, 7.0].iter().map(|&v| body(&[vec![v, 1.0]])).collect();
    let responses = join_all(bodies.iter().map(|b| front.infer("m", b, &[]))).await;
    for (i, r) in responses.into_iter().enumerate() {
        if i == 1 {
            assert_eq!(r.status(), 500);
            let error = r.json::<Value>().await.unwrap()["error"].as_str().unwrap().to_owned();
            assert!(error.contains("upstream answered 500") && error.contains("poison row"), "{error}");
        } else {
            assert_eq!(r.status(), 200, "request {i} shared a batch with the poison row");
        }
    }
}

#[tokio::test]
async fn without_its_upstream_the_sidecar_is_not_ready_and_says_why() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let url = format!("http://{closed}");
    let front = Sidecar::start(&["--engine", "remote", "--upstream", url.as_str(), "--model", "m"]).await;
    let ready = front.http.get(front.url("/v2/health/ready")).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let r = front.infer("m", &body(&[vec![1.0, 2.0]]), &[]).await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "model 'm' is not ready: its engine is still loading");
    assert_eq!(front.outcome("unavailable").await, 1);
}
