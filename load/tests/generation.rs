//! The OpenAI streaming driver against a real sidecar on the sim-llm engine (in this process,
//! over real HTTP on 127.0.0.1).

use std::time::Duration;

use ferry_load::generation::stream::{self, Target};
use ferry_load::generation::summary::Summary;
use ferry_load::generation::trace::{trace, Shape};
use ferry_sidecar::server;

/// A sidecar on a runtime of its own, as a separate process would be.
async fn sidecar(args: &[&str]) -> String {
    let mut all: Vec<String> = ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"].map(String::from).into();
    all.extend(args.iter().map(|a| a.to_string()));
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        runtime.block_on(async move {
            let args: Vec<&str> = all.iter().map(String::as_str).collect();
            let (api, _) = server::spawn(&args).await.unwrap();
            tx.send(api).unwrap();
            std::future::pending::<()>().await
        })
    });
    format!("http://{}/v1/completions", rx.await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_open_loop_run_measures_every_token() {
    let url = sidecar(&[
        "--engine",
        "sim-llm",
        "--model",
        "m",
        "--sim-step-time",
        "5ms",
        "--latency-budget",
        "60s",
        "--max-timeout",
        "60s",
        "--ttft-budget",
        "30s",
        "--max-inter-token-latency",
        "10s",
    ])
    .await;
    // Deadlines far beyond what a busy machine adds: this checks what is measured, not speed.
    let shape = Shape {
        rate: 20.0,
        duration: Duration::from_secs(2),
        prompt: (4, 40),
        output: (3, 20),
        ttft: Duration::from_secs(20),
        tpot: Duration::from_secs(2),
        seed: 9,
    };
    let requests = trace(&shape);
    let target = Target { url, model: "m".into(), send_deadlines: true, salt: None };
    let samples = stream::run(&target, &requests, Duration::from_secs(30)).await.unwrap();
    assert_eq!(samples.len(), requests.len());
    for s in &samples {
        assert_eq!(s.status, Some(200));
        assert!(s.completed, "{s:?}");
        assert_eq!(s.tokens, s.request.max_tokens, "sim-llm answers exactly max_tokens");
        assert_eq!(s.gaps.len() as u32, s.request.max_tokens - 1, "one event per token");
        assert!(s.first.unwrap() <= s.end.unwrap());
    }
    let summary = Summary::of(&samples, shape.duration);
    assert_eq!(summary.good_share, 1.0);
    assert_eq!(summary.completed, requests.len() as u64);
    let tokens: u32 = requests.iter().map(|r| r.max_tokens).sum();
    assert!((summary.tokens_per_s - f64::from(tokens) / 2.0).abs() < 1e-9);
}
