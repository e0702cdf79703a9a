//! The async shell (batcher + sim engine) on tokio's paused clock: DESIGN.md's exercise table and
//! more, asserting exact milliseconds of admission, dispatch and reply.

use std::sync::Arc;
use std::time::Duration;

use ferry_core::clock::sleep_until;
use ferry_core::estimate::Estimator;
use ferry_core::outcome::Outcome;
use ferry_core::scheduler::{Policy, Scheduler};
use ferry_core::ticket::{Priority, Tokens};
use ferry_sidecar::batcher::{Answer, Batcher, Reply, RetryPolicy, Submission};
use ferry_sidecar::engine::sim::SimEngine;
use ferry_sidecar::metrics::{Metrics, ModelMetrics};
use ferry_sidecar::tally::Tally;
use ferry_sidecar::tensor::{DataType, Tensor, TensorData};
use std::time::Instant;
use tokio::task::JoinHandle;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

struct Service {
    batcher: Batcher,
    metrics: ModelMetrics,
    start: Instant,
}

/// cap 4, maxWait 10 ms, 100 ms batches unless said otherwise.
fn service(workers: usize, engine_ms: u64, estimate_ms: u64) -> Service {
    let policy = Policy {
        max_batch_rows: 4,
        max_wait: ms(10),
        deadline_margin: Duration::ZERO,
        max_queue: 64,
        max_queue_bytes: 1 << 20,
    };
    let scheduler = Scheduler::new(policy, workers, Estimator::new(ms(estimate_ms), Duration::ZERO));
    let metrics = Metrics::new().model("m", "1");
    let engine = Arc::new(SimEngine::new(ms(engine_ms), Duration::ZERO));
    Service {
        batcher: Batcher::spawn(scheduler, engine, metrics.clone(), RetryPolicy::default()),
        metrics,
        start: ferry_core::clock::now(),
    }
}

/// What a caller saw: its reply and when it came (ms since the start).
struct Seen {
    reply: Reply,
    at: Duration,
}

impl Seen {
    fn answer(&self) -> &Answer {
        self.reply.as_ref().expect("a 200 answer")
    }

    fn refusal(&self) -> Outcome {
        self.reply.as_ref().expect_err("a refusal").outcome
    }
}

impl Service {
    /// A caller that arrives at `at_ms` with rows `[value, value + 1, ...]` and a relative deadline.
    fn call(&self, at_ms: u64, timeout_ms: u64, value: f64, rows: u32) -> JoinHandle<Seen> {
        let (batcher, start) = (self.batcher.clone(), self.start);
        let tally = Tally::new(self.metrics.outcomes().clone());
        tokio::spawn(async move {
            sleep_until(start + ms(at_ms)).await;
            let now = ferry_core::clock::now();
            let data: Vec<f64> = (0..rows).map(|r| value + f64::from(r)).collect();
            let submission = Submission {
                inputs: vec![Tensor {
                    name: "INPUT0".into(),
                    datatype: DataType::Fp64,
                    shape: vec![u64::from(rows)],
                    data: TensorData::Float(data),
                }],
                rows,
                tokens: Tokens::default(),
                bytes: 100,
                priority: Priority::Interactive,
                tenant: 0,
                weight: 1,
                arrival: now,
                deadline: now + ms(timeout_ms),
                tally,
            };
            let reply = batcher.submit(submission).reply().await;
            Seen { reply, at: ferry_core::clock::now() - start }
        })
    }

    fn assert_conservation(&self, admitted: u64) {
        let m = &self.metrics;
        let ended: u64 = [Outcome::Ok, Outcome::Expired, Outcome::Cancelled, Outcome::Failed]
            .into_iter()
            .map(|o| m.outcome_total(o))
            .sum();
        assert_eq!(ended, admitted, "admitted = ok + expired + cancelled + failed");
    }
}

async fn all(calls: Vec<JoinHandle<Seen>>) -> Vec<Seen> {
    let mut seen = Vec::new();
    for call in calls {
        seen.push(call.await.unwrap());
    }
    seen
}

fn doubled_first(seen: &Seen) -> f64 {
    match &seen.answer().outputs[0].data {
        TensorData::Float(v) => v[0],
        other => panic!("unexpected output {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn sparse() {
    let s = service(1, 100, 100);
    let seen = all(vec![s.call(0, 200, 1.0, 1), s.call(7, 200, 2.0, 1)]).await;
    assert_eq!(seen[0].at, ms(110)); // A waited 110
    assert_eq!(seen[1].at, ms(110)); // B waited 103
    assert_eq!(seen[0].answer().queued, ms(10));
    assert_eq!(seen[1].answer().queued, ms(3));
    assert_eq!(seen[0].answer().engine, ms(100));
    assert_eq!(seen[0].answer().batch_rows, 2);
    assert_eq!((doubled_first(&seen[0]), doubled_first(&seen[1])), (2.0, 4.0));
    s.assert_conservation(2);
}

#[tokio::test(start_paused = true)]
async fn full() {
    let s = service(1, 100, 100);
    let seen = all((0..4).map(|i| s.call(0, 200, f64::from(i), 1)).collect()).await;
    for (i, seen) in seen.iter().enumerate() {
        assert_eq!(seen.at, ms(100));
        assert_eq!(seen.answer().queued, ms(0));
        assert_eq!(seen.answer().batch_rows, 4);
        assert_eq!(doubled_first(seen), 2.0 * i as f64);
    }
    s.assert_conservation(4);
}

#[tokio::test(start_paused = true)]
async fn busy() {
    let s = service(1, 100, 100);
    let mut calls: Vec<_> = (0..4).map(|i| s.call(0, 200, f64::from(i), 1)).collect();
    calls.push(s.call(1, 200, 10.0, 1));
    let seen = all(calls).await;
    // E starts at 100, done at 200: the 10 ms timer did not cap its wait.
    assert_eq!(seen[4].at, ms(200));
    assert_eq!(seen[4].answer().queued, ms(99));
    assert_eq!(seen[4].answer().batch_rows, 1);
    assert_eq!(doubled_first(&seen[4]), 20.0);
    s.assert_conservation(5);
}

#[tokio::test(start_paused = true)]
async fn deadline() {
    let s = service(1, 100, 100);
    let mut calls: Vec<_> = (0..4).map(|i| s.call(0, 200, f64::from(i), 1)).collect();
    calls.push(s.call(1, 149, 10.0, 1)); // E's deadline is 150
    let seen = all(calls).await;
    // Rejected at admission (t=1), not at 150.
    assert_eq!(seen[4].refusal(), Outcome::Infeasible);
    assert_eq!(seen[4].at, ms(1));
    let message = &seen[4].reply.as_ref().unwrap_err().message;
    assert_eq!(message, "deadline cannot be met: estimated completion in 199 ms, the deadline allows 149 ms");
    assert_eq!(s.metrics.outcome_total(Outcome::Infeasible), 1);
    assert_eq!(s.metrics.batch_size.get_sample_count(), 1);
    s.assert_conservation(4);
}

#[tokio::test(start_paused = true)]
async fn two_workers_and_rows_above_one() {
    let s = service(2, 100, 100);
    let seen = all(vec![
        s.call(0, 200, 1.0, 3),  // A: 3 rows
        s.call(2, 200, 10.0, 2), // B: does not fit beside A, so A leaves at 2 on worker 0
        s.call(4, 200, 20.0, 2), // C: fills B's batch to 4 rows; it leaves at 4 on worker 1
        s.call(5, 300, 30.0, 1), // D: both workers busy until 102
    ])
    .await;
    assert_eq!((seen[0].at, seen[0].answer().batch_rows), (ms(102), 3));
    assert_eq!((seen[1].at, seen[1].answer().batch_rows), (ms(104), 4));
    assert_eq!(seen[2].at, ms(104));
    assert_eq!((seen[3].at, seen[3].answer().queued), (ms(202), ms(97)));
    // Rows came back to their own callers, in order.
    let rows = |s: &Seen| match &s.answer().outputs[0].data {
        TensorData::Float(v) => v.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(rows(&seen[0]), vec![2.0, 4.0, 6.0]);
    assert_eq!(rows(&seen[2]), vec![40.0, 42.0]);
    s.assert_conservation(4);
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_gets_504_exactly_at_its_deadline() {
    // The estimate says 100 ms but the engine takes 300: E was admitted, and is still queued at
    // its deadline.
    let s = service(1, 300, 100);
    let mut calls: Vec<_> = (0..4).map(|i| s.call(0, 1000, f64::from(i), 1)).collect();
    calls.push(s.call(1, 200, 10.0, 1));
    let seen = all(calls).await;
    assert_eq!(seen[4].refusal(), Outcome::Expired);
    assert_eq!(seen[4].at, ms(201));
    assert_eq!(seen[0].at, ms(300));
    assert_eq!(s.metrics.late_results.get(), 0);
    s.assert_conservation(5);
}

#[tokio::test(start_paused = true)]
async fn a_running_request_gets_504_at_its_deadline_and_its_late_result_is_dropped() {
    let s = service(1, 300, 100);
    let seen = all(vec![s.call(0, 250, 1.0, 1)]).await;
    assert_eq!(seen[0].refusal(), Outcome::Expired);
    assert_eq!(seen[0].at, ms(250));
    sleep_until(s.start + ms(310)).await; // the batch ends at 10 + 300
    s.batcher.drain().await;
    assert_eq!(s.metrics.late_results.get(), 1);
    assert_eq!(s.metrics.outcome_total(Outcome::Ok), 0);
    s.assert_conservation(1);
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_goes_away_is_taken_out_of_the_queue() {
    let s = service(1, 100, 100);
    let mut calls: Vec<_> = (0..4).map(|i| s.call(0, 200, f64::from(i), 1)).collect();
    let gone = s.call(1, 300, 10.0, 1);
    sleep_until(s.start + ms(50)).await;
    gone.abort(); // drops its pending reply while it waits behind the busy worker
    let _ = gone.await;
    calls.push(s.call(60, 300, 20.0, 1));
    let seen = all(calls).await;
    assert_eq!(seen[4].answer().batch_rows, 1, "the cancelled request did not ride");
    assert_eq!(s.metrics.outcome_total(Outcome::Cancelled), 1);
    assert_eq!(s.metrics.batch_size.get_sample_sum(), 5.0);
    s.assert_conservation(6);
}

#[tokio::test(start_paused = true)]
async fn drain_waits_for_everything_admitted() {
    let s = service(1, 100, 100);
    let calls: Vec<_> = (0..6).map(|i| s.call(0, 300, f64::from(i), 1)).collect();
    sleep_until(s.start + ms(1)).await;
    s.batcher.drain().await;
    assert_eq!(ferry_core::clock::now() - s.start, ms(200));
    let seen = all(calls).await;
    assert!(seen.iter().all(|s| s.reply.is_ok()));
    s.assert_conservation(6);
}
