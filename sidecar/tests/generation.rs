//! The generation shell (ledger + sim-llm engine) on tokio's paused clock: exact milliseconds of
//! each token as its caller takes it, disconnects, deadlines and the drain.

use std::sync::Arc;
use std::time::Duration;

use ferry_core::generation::kv::BlockPool;
use ferry_core::generation::ledger::Ledger;
use ferry_core::generation::scheduler::{Discipline, Policy, Scheduler};
use ferry_core::generation::sequence::FinishReason;
use ferry_core::generation::step::{StepCost, StepEstimator};
use ferry_core::outcome::Outcome;
use ferry_core::ticket::Priority;
use ferry_sidecar::generation::engine::{KvLayout, LanguageModel, Sampling, StepEngine};
use ferry_sidecar::generation::shell::{Generator, Submission};
use ferry_sidecar::generation::sim::{SimLlm, SimLlmTimes};
use ferry_sidecar::generation::stream::{Piece, Stream};
use ferry_sidecar::metrics::{GenerationMetrics, Metrics};
use ferry_sidecar::tally::Tally;
use tokio::time::Instant;

const MS: Duration = Duration::from_millis(1);

/// 10 ms a step + 1 ms per decoding sequence + 0.1 ms per prefill token.
fn times() -> SimLlmTimes {
    SimLlmTimes { step_time: 10 * MS, prefill_per_token: Duration::from_micros(100), decode_per_seq: MS }
}

#[derive(Clone)]
struct Service {
    generator: Generator,
    engine: Arc<SimLlm>,
    metrics: GenerationMetrics,
    start: Instant,
}

/// A generator over `blocks` KV blocks of 4 tokens; the estimator starts from `prior` (the
/// engine's true cost unless a test says otherwise).
fn service(blocks: u32, prior: Option<StepCost>) -> Service {
    let engine = Arc::new(SimLlm::new(times(), KvLayout { blocks, block_size: 4 }));
    let policy = Policy {
        max_batch_tokens: 2048,
        max_sequences: 8,
        max_queue: 64,
        max_queue_bytes: 1 << 20,
        max_queue_tokens: 1 << 20,
        max_context: 4096,
        watermark: 0,
        discipline: Discipline::Deadlines,
    };
    let cost = prior.unwrap_or_else(|| engine.cost());
    let scheduler = Scheduler::new(policy, BlockPool::new(blocks, 4), StepEstimator::new(cost));
    let metrics = Metrics::new().generation("m", "1");
    let generator = Generator::spawn(Ledger::new(scheduler, Duration::ZERO, 3), engine.clone(), metrics.clone());
    Service { generator, engine, metrics, start: Instant::now() }
}

impl Service {
    fn submit(&self, prompt: &str, max_tokens: u32, timeout: Duration) -> Stream {
        let now = Instant::now();
        let submission = Submission {
            prompt: self.engine.encode(prompt).unwrap(),
            max_tokens,
            sampling: Sampling::default(),
            stop: Vec::new(),
            priority: Priority::Interactive,
            tenant: 0,
            weight: 1,
            bytes: 64,
            arrival: now,
            ttft_deadline: now + timeout,
            itl: Duration::from_secs(10),
            deadline: now + timeout,
        };
        self.generator.submit(submission, Tally::new(self.metrics.outcomes().clone()))
    }

    fn ms(&self) -> f64 {
        (Instant::now() - self.start).as_secs_f64() * 1e3
    }
}

/// Takes a stream to its end: each text piece with the millisecond it was taken, and the end.
async fn collect(service: &Service, mut stream: Stream) -> (Vec<(f64, String)>, Piece) {
    let mut pieces = Vec::new();
    loop {
        match stream.next().await.expect("a stream ends with an end") {
            Piece::Text(text) => pieces.push((service.ms(), text)),
            end => return (pieces, end),
        }
    }
}

const HOUR: Duration = Duration::from_secs(3600);

#[tokio::test(start_paused = true)]
async fn tokens_reach_the_caller_the_moment_their_step_ends() {
    let s = service(1000, None);
    let a = s.submit("a b c d e f g h i j", 20, HOUR);
    let a = tokio::spawn({
        let s = s.clone();
        async move { collect(&s, a).await }
    });
    tokio::time::sleep(30 * MS).await;
    let (b, end) = collect(&s, s.submit("x y z u v w p q r s", 5, HOUR)).await;
    // A's prefill is 11 ms and its decodes 11 ms; B arrives at 30 during A's third step
    // (22..33), joins the next one (33..45) and decodes beside A, 12 ms a step.
    let times: Vec<f64> = b.iter().map(|(t, _)| *t).collect();
    assert_eq!(times, vec![45.0, 57.0, 69.0, 81.0, 93.0]);
    let text: String = b.iter().map(|(_, t)| t.as_str()).collect();
    assert_eq!(text, "x y z u v");
    let Piece::End(Ok(finished)) = end else { panic!("{end:?}") };
    assert_eq!((finished.reason, finished.prompt_tokens, finished.completion_tokens), (FinishReason::Length, 10, 5));
    assert_eq!(finished.ttft, 15 * MS);
    let (a, _) = a.await.unwrap();
    assert_eq!(a.len(), 20);
    assert_eq!(a.iter().map(|(_, t)| t.as_str()).collect::<String>(), "a b c d e f g h i j a b c d e f g h i j");
    assert_eq!(s.metrics.outcome_total(Outcome::Ok), 2);
    assert_eq!(s.metrics.generation_tokens.get(), 25);
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_goes_away_frees_its_blocks_before_the_next_step() {
    let s = service(1000, None);
    let mut stream = s.submit("a b c d", 100, HOUR);
    for _ in 0..3 {
        assert!(matches!(stream.next().await, Some(Piece::Text(_))));
    }
    assert!(s.metrics.kv_used.get() > 0);
    drop(stream);
    tokio::time::sleep(MS).await;
    assert_eq!(s.metrics.kv_used.get(), 0, "freed at once");
    assert_eq!(s.metrics.outcome_total(Outcome::Cancelled), 1);
    assert_eq!(s.metrics.running.get(), 0);
    // The step that was running when it left ends at 44 ms; its token is counted late.
    tokio::time::sleep(20 * MS).await;
    assert_eq!(s.metrics.late_results.get(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_stream_that_reaches_its_deadline_ends_with_the_deadline_not_silently() {
    // The estimator believes in 1 ms steps; the engine takes 11. Admitted for 10 tokens in 100 ms,
    // the sequence ends once its rest cannot fit, before 100 ms, with `expired`.
    let fast = StepCost { fixed: MS, ..StepCost::default() };
    let s = service(1000, Some(fast));
    let (pieces, end) = collect(&s, s.submit("a b c d", 10, 100 * MS)).await;
    assert!(!pieces.is_empty() && pieces.len() < 10, "{pieces:?}");
    let Piece::End(Err(refusal)) = end else { panic!("{end:?}") };
    assert_eq!(refusal.outcome, Outcome::Expired);
    assert!(s.ms() <= 100.0, "ended at {} ms", s.ms());
    assert_eq!(s.metrics.outcome_total(Outcome::Expired), 1);
}

#[tokio::test(start_paused = true)]
async fn an_infeasible_request_is_refused_before_any_token() {
    let s = service(1000, None);
    // 2 tokens take 10.2 + 11 ms; 20 ms is not enough.
    let (pieces, end) = collect(&s, s.submit("a b", 2, 20 * MS)).await;
    assert!(pieces.is_empty());
    let Piece::End(Err(refusal)) = end else { panic!("{end:?}") };
    assert_eq!(refusal.outcome, Outcome::Infeasible);
    assert_eq!(s.ms(), 0.0, "at arrival");
    assert!(refusal.message.contains("a max_tokens of 1 would fit"), "{}", refusal.message);
}

#[tokio::test(start_paused = true)]
async fn kv_exhaustion_preempts_and_the_preempted_stream_sends_no_token_twice() {
    // 10 blocks of 4 tokens; two sequences of 8 + 16 tokens need 6 blocks each at their longest.
    let s = service(10, None);
    let a = s.submit("a b c d e f g h", 16, HOUR);
    let b = s.submit("p q r s t u v w", 16, HOUR);
    let (a, b) = tokio::join!(collect(&s, a), collect(&s, b));
    for (pieces, words) in [(a, "a b c d e f g h"), (b, "p q r s t u v w")] {
        let text: String = pieces.0.iter().map(|(_, t)| t.as_str()).collect();
        assert_eq!(text, format!("{words} {words}"));
        assert!(matches!(pieces.1, Piece::End(Ok(_))));
    }
    assert_eq!(s.metrics.preemptions.get(), 1);
    assert_eq!(s.metrics.kv_used.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_drain_waits_for_running_sequences() {
    let s = service(1000, None);
    let stream = s.submit("a b c d e f g h i j", 5, HOUR);
    let collecting = tokio::spawn({
        let s = s.clone();
        async move { collect(&s, stream).await }
    });
    tokio::task::yield_now().await;
    s.generator.drain().await;
    // 11 ms for the prefill, then four decodes of 11 ms.
    assert_eq!(s.ms(), 55.0);
    let (pieces, end) = collecting.await.unwrap();
    assert_eq!(pieces.len(), 5);
    assert!(matches!(end, Piece::End(Ok(_))));
}
