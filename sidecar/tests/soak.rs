//! A bounded soak of the real binary under random engine failures and hangs and impatient
//! clients: every request gets exactly one outcome, conservation holds, no 200 is sent after its
//! deadline, and memory stays bounded. About 15 s of load.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use ferry_core::clock::sleep_until;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::{body, metric_value, timing, Sidecar};

const RATE: u64 = 150;
const SECONDS: u64 = 15;

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[derive(Debug)]
enum Seen {
    Status { code: u16, total_ms: Option<f64>, timeout_ms: u64 },
    GaveUp,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_failures_hangs_and_disconnects() {
    let s = Sidecar::start(&[
        "--model",
        "m",
        "--workers",
        "2",
        "--max-batch-size",
        "16",
        "--sim-batch-time",
        "20ms",
        "--sim-per-item",
        "1ms",
        "--sim-fail-rate",
        "0.05",
        "--sim-hang-rate",
        "0.02",
        "--sim-seed",
        "7",
        "--latency-budget",
        "300ms",
        "--max-timeout",
        "1s",
        "--max-queue",
        "200",
    ])
    .await;
    let pid = s.child.id().unwrap();
    // Warm up, then measure the baseline.
    for _ in 0..20 {
        let _ = s.infer("m", &body(&[vec![1.0]]), &[]).await;
    }
    let warmup = 20;
    let before = rss_kib(pid);

    let mut rng = StdRng::seed_from_u64(11);
    let start = ferry_core::clock::now();
    let total = RATE * SECONDS;
    let mut tasks = Vec::with_capacity(total as usize);
    for i in 0..total {
        sleep_until(start + Duration::from_micros(i * 1_000_000 / RATE)).await;
        let (http, url) = (s.http.clone(), s.url("/v2/models/m/infer"));
        let rows = rng.random_range(1..=3);
        let timeout_ms: u64 = rng.random_range(100..=800);
        let impatient = rng.random_bool(0.05);
        let payload = body(&(0..rows).map(|r| vec![i as f32, r as f32]).collect::<Vec<_>>());
        tasks.push(tokio::spawn(async move {
            let send = http.post(url).header("x-ferry-timeout-ms", timeout_ms.to_string()).json(&payload).send();
            let patience = if impatient { Duration::from_millis(30) } else { Duration::from_secs(10) };
            match tokio::time::timeout(patience, send).await {
                Ok(Ok(r)) => {
                    let total_ms = (r.status() == 200).then(|| timing(&r, "total"));
                    Seen::Status { code: r.status().as_u16(), total_ms, timeout_ms }
                }
                Ok(Err(e)) => panic!("transport error: {e}"),
                Err(_) => Seen::GaveUp,
            }
        }));
    }
    let mut by_status: HashMap<u16, u64> = HashMap::new();
    let mut gave_up = 0;
    for task in tasks {
        match task.await.unwrap() {
            Seen::Status { code, total_ms, timeout_ms } => {
                *by_status.entry(code).or_default() += 1;
                assert!(matches!(code, 200 | 500 | 503 | 504), "unexpected status {code}");
                if let Some(total) = total_ms {
                    assert!(total <= timeout_ms as f64 + 0.1, "a 200 after its deadline: {total} ms > {timeout_ms} ms");
                }
            }
            Seen::GaveUp => gave_up += 1,
        }
    }

    // Quiet point: nothing queued or running for anyone who is still owed an answer.
    let quiet = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let m = s.metrics().await;
            let sum: f64 = ["ok", "expired", "cancelled", "failed", "queue_full", "infeasible"]
                .iter()
                .map(|o| metric_value(&m, "ferry_requests_total", &format!("outcome=\"{o}\"")))
                .sum();
            if sum as u64 == total + warmup && metric_value(&m, "ferry_queue_depth", "model=\"m\"") == 0.0 {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let m = quiet.expect("every request ended with exactly one outcome (the counters add up to the requests sent)");
    let count = |o: &str| metric_value(&m, "ferry_requests_total", &format!("outcome=\"{o}\"")) as u64;
    let status = |c: u16| by_status.get(&c).copied().unwrap_or(0);
    // What the clients saw matches what the sidecar counted, except for the impatient clients:
    // the sidecar counted each of those as cancelled, or by the answer it sent as they left.
    let answered = [("ok", status(200) + warmup), ("failed", status(500)), ("expired", status(504))];
    let mut unseen = count("cancelled");
    for (outcome, seen) in answered {
        assert!(count(outcome) >= seen, "{outcome}: counted {} < seen {seen}", count(outcome));
        unseen += count(outcome) - seen;
    }
    let refused = count("queue_full") + count("infeasible");
    assert!(refused >= status(503));
    unseen += refused - status(503);
    assert_eq!(unseen, gave_up, "every request the clients did not see answered was one that gave up");
    assert!(status(200) > total / 2, "most requests succeed despite the faults: {by_status:?}");
    assert!(count("failed") > 0 || count("expired") > 0, "faults were injected: {by_status:?}");

    let after = rss_kib(pid);
    assert!(after < before + 64 * 1024, "memory grew from {before} KiB to {after} KiB");
    eprintln!("soak: {by_status:?}, {gave_up} gave up, RSS {before} -> {after} KiB");
}
