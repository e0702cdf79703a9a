//! Failure handling on tokio's paused clock, with exact outcomes: poison isolation, hung and
//! slow batches, stale results, retries only for who still has time.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::clock::sleep_until;
use ferry_core::estimate::Estimator;
use ferry_core::outcome::Outcome;
use ferry_core::scheduler::{Policy, Scheduler};
use ferry_core::ticket::{Priority, Tokens};
use ferry_sidecar::batcher::{Batcher, Reply, RetryPolicy, Submission};
use ferry_sidecar::engine::sim::{Faults, SimEngine};
use ferry_sidecar::engine::{BatchOutputs, BoxFuture, Engine, EngineError, Inputs, Signature};
use ferry_sidecar::metrics::{Metrics, ModelMetrics};
use ferry_sidecar::tally::Tally;
use ferry_sidecar::tensor::{DataType, Tensor, TensorData};
use std::time::Instant;
use tokio::task::JoinHandle;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// What the scripted engine does on each call, in order; `Run` once the script is used up.
#[derive(Debug, Clone, Copy)]
enum Step {
    Run(u64),
    Fail(u64),
    Hang,
    Panic,
    /// Panics in `infer` itself, inside the batcher's task, before any future is returned.
    PanicAtOnce,
}

/// An engine whose calls follow a script, so that a test can say exactly which batch hangs,
/// fails or is slow. Outputs are the sim engine's (doubled rows).
struct Scripted {
    script: Mutex<VecDeque<Step>>,
    calls: Mutex<Vec<usize>>,
    sim: SimEngine,
}

impl Scripted {
    fn new(script: &[Step]) -> Arc<Scripted> {
        Arc::new(Scripted {
            script: Mutex::new(script.iter().copied().collect()),
            calls: Mutex::new(Vec::new()),
            sim: SimEngine::new(Duration::ZERO, Duration::ZERO),
        })
    }
}

impl Engine for Scripted {
    fn signature(&self) -> &Signature {
        self.sim.signature()
    }

    fn check(&self, _: &[Tensor]) -> Result<Tokens, String> {
        Ok(Tokens::default())
    }

    fn infer(&self, batch: Vec<Inputs>) -> BoxFuture<Result<BatchOutputs, EngineError>> {
        self.calls.lock().unwrap().push(batch.len());
        let step = self.script.lock().unwrap().pop_front().unwrap_or(Step::Run(100));
        if let Step::PanicAtOnce = step {
            panic!("scripted panic while starting a batch");
        }
        let outputs = self.sim.infer(batch);
        Box::pin(async move {
            match step {
                Step::Hang => std::future::pending().await,
                Step::Panic => panic!("scripted panic in the engine"),
                Step::PanicAtOnce => unreachable!("panicked above"),
                Step::Fail(t) => {
                    tokio::time::sleep(ms(t)).await;
                    Err(EngineError("scripted failure".into()))
                }
                Step::Run(t) => {
                    tokio::time::sleep(ms(t)).await;
                    outputs.await
                }
            }
        })
    }
}

struct Service {
    batcher: Batcher,
    metrics: ModelMetrics,
    start: Instant,
}

/// cap 4, maxWait 10 ms, estimated 100 ms per batch, one worker.
fn service(engine: Arc<dyn Engine>) -> Service {
    let policy = Policy {
        max_batch_rows: 4,
        max_wait: ms(10),
        deadline_margin: Duration::ZERO,
        max_queue: 64,
        max_queue_bytes: 1 << 20,
    };
    let scheduler = Scheduler::new(policy, 1, Estimator::new(ms(100), Duration::ZERO));
    let metrics = Metrics::new().model("m", "1");
    let retry = RetryPolicy { watchdog_grace: ms(10), ..RetryPolicy::default() };
    let batcher = Batcher::spawn(scheduler, engine, metrics.clone(), retry);
    Service { batcher, metrics, start: ferry_core::clock::now() }
}

struct Seen {
    reply: Reply,
    at: Duration,
}

impl Service {
    fn call(&self, at_ms: u64, timeout_ms: u64, first: f64) -> JoinHandle<Seen> {
        let (batcher, start) = (self.batcher.clone(), self.start);
        let tally = Tally::new(self.metrics.outcomes().clone());
        tokio::spawn(async move {
            sleep_until(start + ms(at_ms)).await;
            let now = ferry_core::clock::now();
            let inputs = vec![Tensor {
                name: "INPUT0".into(),
                datatype: DataType::Fp64,
                shape: vec![1, 2],
                data: TensorData::Float(vec![first, 0.5]),
            }];
            let submission = Submission {
                inputs,
                rows: 1,
                tokens: Tokens::default(),
                bytes: 10,
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

    fn batches(&self) -> u64 {
        self.metrics.batch_size.get_sample_count()
    }

    fn conserved(&self, admitted: u64) {
        let ended: u64 = [Outcome::Ok, Outcome::Expired, Outcome::Cancelled, Outcome::Failed]
            .into_iter()
            .map(|o| self.metrics.outcome_total(o))
            .sum();
        assert_eq!(ended, admitted);
    }
}

async fn all(calls: Vec<JoinHandle<Seen>>) -> Vec<Seen> {
    let mut seen = Vec::new();
    for c in calls {
        seen.push(c.await.unwrap());
    }
    seen
}

#[tokio::test(start_paused = true)]
async fn a_poison_row_fails_alone_and_its_batch_mates_succeed() {
    for poison in 0..4 {
        let engine =
            SimEngine::new(ms(100), Duration::ZERO).with_faults(Faults { poison: Some(-1.0), ..Faults::default() });
        let s = service(Arc::new(engine));
        let calls = (0..4).map(|i| s.call(0, 2000, if i == poison { -1.0 } else { f64::from(i as u8) })).collect();
        let seen = all(calls).await;
        for (i, seen) in seen.iter().enumerate() {
            if i == poison {
                let refusal = seen.reply.as_ref().unwrap_err();
                assert_eq!(refusal.outcome, Outcome::Failed);
                assert!(
                    refusal.message.starts_with("engine error: poison row: its first element is -1"),
                    "{refusal:?}"
                );
            } else {
                assert!(seen.reply.is_ok(), "request {i} shared a batch with the poison at {poison}: {:?}", seen.reply);
            }
        }
        let extra = s.batches() - 1;
        assert!(extra <= 3, "poison at {poison}: {extra} extra batches, more than ⌈log2 4⌉ + 1");
        s.conserved(4);
    }
}

#[tokio::test(start_paused = true)]
async fn a_hung_batch_is_given_up_on_and_retried_when_there_is_time() {
    let engine = Scripted::new(&[Step::Hang, Step::Run(100)]);
    let s = service(engine.clone());
    let seen = all(vec![s.call(0, 1000, 1.0)]).await;
    // Dispatched at 10; the watchdog gives up at 10 + 3 × 100 + 10 = 320; the retry takes 100.
    assert_eq!(seen[0].at, ms(420));
    assert!(seen[0].reply.is_ok());
    assert_eq!(*engine.calls.lock().unwrap(), vec![1, 1]);
    s.conserved(1);
}

#[tokio::test(start_paused = true)]
async fn a_hung_batch_without_time_to_retry_is_504_at_the_deadline() {
    let s = service(Scripted::new(&[Step::Hang]));
    let seen = all(vec![s.call(0, 300, 1.0)]).await;
    assert_eq!(seen[0].reply.as_ref().unwrap_err().outcome, Outcome::Expired);
    assert_eq!(seen[0].at, ms(300));
    s.conserved(1);
}

#[tokio::test(start_paused = true)]
async fn a_late_result_after_a_retry_is_discarded_and_counted() {
    // The first run is slow (400 ms): the watchdog gives up on it at 320 and retries; the slow
    // run returns at 410, stale; the retry's answer comes at 420.
    let s = service(Scripted::new(&[Step::Run(400), Step::Run(100)]));
    let seen = all(vec![s.call(0, 1000, 1.0)]).await;
    assert_eq!(seen[0].at, ms(420));
    assert!(seen[0].reply.is_ok());
    assert_eq!(s.metrics.late_results.get(), 1);
    assert_eq!(s.metrics.outcome_total(Outcome::Ok), 1);
    s.conserved(1);
}

#[tokio::test(start_paused = true)]
async fn only_requests_with_time_left_are_retried() {
    // A batch of two fails at 110. B (due at 150) cannot finish a retry in time: it is answered
    // 504 at once instead of taking a seat. A (due at 1000) runs again, 110..210.
    let engine = Scripted::new(&[Step::Fail(100), Step::Run(100)]);
    let s = service(engine.clone());
    let seen = all(vec![s.call(0, 1000, 1.0), s.call(0, 150, 2.0)]).await;
    assert_eq!(seen[0].at, ms(210));
    assert!(seen[0].reply.is_ok());
    let refusal = seen[1].reply.as_ref().unwrap_err();
    assert_eq!(refusal.outcome, Outcome::Expired);
    assert!(refusal.message.starts_with("deadline cannot be met any more"), "{}", refusal.message);
    assert_eq!(seen[1].at, ms(110));
    assert_eq!(*engine.calls.lock().unwrap(), vec![2, 1]);
    s.conserved(2);
}

#[tokio::test(start_paused = true)]
async fn a_random_failure_is_retried_not_blamed_on_anyone() {
    let s = service(Scripted::new(&[Step::Fail(100)]));
    let seen = all((0..4).map(|i| s.call(0, 2000, f64::from(i))).collect()).await;
    assert!(seen.iter().all(|s| s.reply.is_ok()), "one failure condemns nobody");
    s.conserved(4);
}

#[tokio::test(start_paused = true)]
async fn the_attempt_budget_bounds_the_retries() {
    let s = service(Scripted::new(&[Step::Fail(10); 20]));
    let seen = all((0..4).map(|i| s.call(0, 5000, f64::from(i))).collect()).await;
    for seen in &seen {
        let refusal = seen.reply.as_ref().unwrap_err();
        assert_eq!(refusal.outcome, Outcome::Failed);
        assert!(refusal.message.contains("attempts; retries stopped"), "{}", refusal.message);
    }
    // Every request rode in at most 3 runs: 4 rows × 3 = 12 seats at most.
    assert!(s.metrics.batch_size.get_sample_sum() <= 12.0);
    s.conserved(4);
}

#[tokio::test(start_paused = true)]
async fn an_engine_panic_is_a_failed_batch_and_the_worker_is_freed() {
    let s = service(Scripted::new(&[Step::Panic, Step::Run(100)]));
    let seen = all(vec![s.call(0, 1000, 1.0)]).await;
    // The panic at dispatch (10) fails the batch at once; the retry runs 10..110.
    assert_eq!(seen[0].at, ms(110));
    assert!(seen[0].reply.is_ok());
    s.conserved(1);
}

#[tokio::test(start_paused = true)]
async fn a_batcher_that_dies_fails_what_it_held_and_says_it_stopped() {
    let s = service(Scripted::new(&[Step::PanicAtOnce]));
    assert!(s.batcher.is_alive());
    let seen = all(vec![s.call(0, 1000, 1.0), s.call(1, 1000, 2.0)]).await;
    for seen in &seen {
        let refusal = seen.reply.as_ref().unwrap_err();
        assert_eq!(refusal.outcome, Outcome::Failed, "{refusal}");
    }
    s.batcher.stopped().await;
    assert!(!s.batcher.is_alive());
    // Both requests are counted once, as failed, though nobody answered them.
    assert_eq!(s.metrics.outcome_total(Outcome::Failed), 2);
    s.conserved(2);
    // A request submitted afterwards fails at once, counted too.
    let late = all(vec![s.call(2000, 1000, 3.0)]).await;
    assert_eq!(late[0].reply.as_ref().unwrap_err().outcome, Outcome::Failed);
    assert_eq!(s.metrics.outcome_total(Outcome::Failed), 3);
}
