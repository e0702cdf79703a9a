//! The estimator and the deadline margin recover from a burst of slowness: the sidecar process is
//! stopped (SIGSTOP) under steady load and resumed, and goodput comes back.

mod support;

use std::time::Duration;

use support::{body, Sidecar};

/// One request's fate as the client saw it.
struct Sent {
    at: Duration,
    in_time: bool,
}

/// Steady open-loop load (100 req/s, a quarter of capacity); the sidecar is stopped for 300 ms
/// and resumed. The stop makes one batch look 300 ms slow (and one timer 300 ms late); goodput,
/// measured by the client in 250 ms windows of send time, must be back at 90 % of what it was
/// before within 2 s of the resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goodput_comes_back_after_the_process_was_stopped() {
    let s = Sidecar::start(&[
        "--model",
        "m",
        "--sim-batch-time",
        "20ms",
        "--max-batch-size",
        "8",
        "--latency-budget",
        "200ms",
    ])
    .await;
    let pid = s.child.id().unwrap().to_string();
    let deadline = Duration::from_millis(200);
    let start = ferry_core::clock::now();
    let (stop_at, resume_at, end) =
        (Duration::from_millis(1500), Duration::from_millis(1800), Duration::from_millis(4800));
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let mut tasks = tokio::task::JoinSet::new();
    let mut stopped = false;
    let mut resumed = false;
    loop {
        let now = tick.tick().await.into_std().duration_since(start);
        if now >= end {
            break;
        }
        if !stopped && now >= stop_at {
            signal(&pid, "-STOP");
            stopped = true;
        }
        if stopped && !resumed && now >= resume_at {
            signal(&pid, "-CONT");
            resumed = true;
        }
        let (http, url) = (s.http.clone(), s.url("/v2/models/m/infer"));
        tasks.spawn(async move {
            let sent = ferry_core::clock::now();
            let ok = match http.post(url).json(&body(&[vec![1.0]])).timeout(Duration::from_secs(5)).send().await {
                Ok(r) => r.status() == 200 && r.bytes().await.is_ok(),
                Err(_) => false,
            };
            Sent { at: sent.duration_since(start), in_time: ok && ferry_core::clock::elapsed(sent) <= deadline }
        });
    }
    let mut sent = Vec::new();
    while let Some(s) = tasks.join_next().await {
        sent.push(s.unwrap());
    }
    let share = |from: Duration, to: Duration| {
        let window: Vec<&Sent> = sent.iter().filter(|s| s.at >= from && s.at < to).collect();
        window.iter().filter(|s| s.in_time).count() as f64 / window.len().max(1) as f64
    };
    let s_metrics = s.metrics().await;
    let before = share(Duration::from_millis(500), stop_at);
    assert!(before > 0.9, "steady load at a quarter of capacity is served: {before}");
    let windows: Vec<(Duration, f64)> = (0..12)
        .map(|k| resume_at + Duration::from_millis(250 * k))
        .map(|from| (from, share(from, from + Duration::from_millis(250))))
        .collect();
    eprintln!("goodput before the stop {before}; in 250 ms windows from the resume: {windows:?}");
    let back = windows.iter().find(|(_, share)| *share >= 0.9 * before);
    let back =
        back.unwrap_or_else(|| panic!("goodput never came back: before {before}, after {windows:?}\n{}", s_metrics));
    assert!(
        back.0 - resume_at <= Duration::from_secs(2),
        "back only {:?} after the resume: {windows:?}",
        back.0 - resume_at
    );
    // And it stays back: the last second of the run is as good as before.
    let last = share(end - Duration::from_secs(1), end);
    assert!(last >= 0.9 * before, "before {before}, last second {last}: {windows:?}");
}

fn signal(pid: &str, which: &str) {
    let status = std::process::Command::new("kill").args([which, pid]).status().unwrap();
    assert!(status.success(), "kill {which} {pid}");
}
