//! The collector against real sidecars (in this process, over real HTTP on 127.0.0.1): rates,
//! batch time and queue age read correctly, and a restarted pod's counter reset handled.

use std::time::Duration;

use ferry_operator::autoscale::collect::{scrape, Collector};
use ferry_sidecar::server;

/// A sidecar; returns its infer URL and its metrics URL.
async fn sidecar(args: &[&str]) -> (String, String) {
    let mut all = vec!["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let (api, admin) = server::spawn(&all).await.unwrap();
    (format!("http://{api}/v2/models/m/infer"), format!("http://{admin}/metrics"))
}

async fn send(client: &reqwest::Client, url: &str, n: usize, rows: usize) {
    let body = serde_json::json!({"inputs": [{"name": "INPUT0", "shape": [rows, 1], "datatype": "FP32", "data": vec![1.0; rows]}]});
    let calls = (0..n).map(|_| client.post(url).json(&body).send());
    for r in futures::future::join_all(calls).await {
        assert_eq!(r.unwrap().status(), 200);
    }
}

const ARGS: &[&str] = &[
    "--model",
    "m",
    "--sim-batch-time",
    "50ms",
    "--max-batch-size",
    "8",
    "--latency-budget",
    "5s",
    "--max-wait",
    "5ms",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rates_and_batch_time_are_read_from_a_real_sidecar() {
    let (infer, metrics) = sidecar(ARGS).await;
    let client = reqwest::Client::new();
    let mut c = Collector::new(Duration::from_secs(60));
    let t0 = ferry_core::clock::now();
    c.observe("pod-a", t0, scrape(&client, &metrics).await.unwrap());
    send(&client, &infer, 40, 2).await;
    let t1 = t0 + Duration::from_secs(10); // the rate is taken over the times the collector was given
    c.observe("pod-a", t1, scrape(&client, &metrics).await.unwrap());
    let o = c.observed(&["pod-a".into()], &[], t1);
    assert!((o.arrival_rate - 4.0).abs() < 1e-9, "40 requests over 10 s: {o:?}");
    assert_eq!(o.rows_per_request, 2.0);
    let batch = o.batch_time.unwrap();
    assert!(batch >= Duration::from_millis(50) && batch < Duration::from_millis(150), "{batch:?}");
    assert_eq!((o.queue_depth, o.pressure), (0.0, 0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_pod_is_a_counter_reset_not_a_negative_rate() {
    let client = reqwest::Client::new();
    let mut c = Collector::new(Duration::from_secs(60));
    let t0 = ferry_core::clock::now();
    let (infer, metrics) = sidecar(ARGS).await;
    send(&client, &infer, 30, 1).await;
    c.observe("pod-a", t0, scrape(&client, &metrics).await.unwrap());
    send(&client, &infer, 10, 1).await;
    c.observe("pod-a", t0 + Duration::from_secs(5), scrape(&client, &metrics).await.unwrap());
    // The pod restarts (a fresh process, counters at zero) and serves 5 more.
    let (infer, metrics) = sidecar(ARGS).await;
    send(&client, &infer, 5, 1).await;
    c.observe("pod-a", t0 + Duration::from_secs(10), scrape(&client, &metrics).await.unwrap());
    let o = c.observed(&["pod-a".into()], &[], t0 + Duration::from_secs(10));
    assert!((o.arrival_rate - 1.5).abs() < 1e-9, "(10 + 5) requests over 10 s: {o:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_and_its_age_are_seen_while_requests_wait() {
    let (infer, metrics) =
        sidecar(&["--model", "m", "--sim-batch-time", "600ms", "--max-batch-size", "1", "--latency-budget", "5s"])
            .await;
    let client = reqwest::Client::new();
    let waiting = tokio::spawn({
        let (client, infer) = (client.clone(), infer.clone());
        async move { send(&client, &infer, 3, 1).await }
    });
    let sample = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let s = scrape(&client, &metrics).await.unwrap();
            if s.queue_depth == 2.0 && s.oldest_age > 0.1 {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("two requests queue behind the running one");
    assert!(sample.oldest_age < 1.5, "{sample:?}");
    waiting.await.unwrap();
    assert!(scrape(&client, "http://127.0.0.1:9/metrics").await.is_err(), "a failed scrape is an error, not zeros");
}
