//! The generation shell (ledger + sim-llm engine) on tokio's paused clock: exact milliseconds of
//! each token as its caller takes it, disconnects, deadlines and the drain.

use std::sync::Arc;
use std::time::Duration;

use ferry_core::generation::capacity::{capacity, Limits, RequestShape, Targets, PRIOR_SHAPE};
use ferry_core::generation::kv::BlockPool;
use ferry_core::generation::ledger::Ledger;
use ferry_core::generation::scheduler::{Discipline, Policy, Scheduler};
use ferry_core::generation::sequence::FinishReason;
use ferry_core::generation::step::{StepCost, StepEstimator};
use ferry_core::outcome::Outcome;
use ferry_core::ticket::Priority;
use ferry_sidecar::engine::{BoxFuture, EngineError};
use ferry_sidecar::generation::engine::{
    ChatOptions, Detokenizer, Drawn, KvLayout, LanguageModel, Message, Sampling, StepEngine, StepInput,
};
use ferry_sidecar::generation::shell::Submission;
use ferry_sidecar::generation::sim::{SimLlm, SimLlmTimes};
use ferry_sidecar::generation::steps::{self, Generator, Prompt};
use ferry_sidecar::generation::stream::{Piece, Stream};
use ferry_sidecar::metrics::{GenerationMetrics, Metrics};
use ferry_sidecar::tally::Tally;
use std::time::Instant;

const MS: Duration = Duration::from_millis(1);

/// 10 ms a step + 1 ms per decoding sequence + 0.1 ms per prefill token.
fn times() -> SimLlmTimes {
    SimLlmTimes {
        step_time: 10 * MS,
        prefill_per_token: Duration::from_micros(100),
        decode_per_seq: MS,
        attention_per_slot: Duration::ZERO,
    }
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
    service_with(blocks, prior, None)
}

/// [`service`] with the prefix cache on (its hashes seeded with `seed`) or off.
fn service_with(blocks: u32, prior: Option<StepCost>, prefix_cache: Option<u64>) -> Service {
    let engine = Arc::new(SimLlm::new(times(), KvLayout { blocks, block_size: 4 }));
    let cost = prior.unwrap_or_else(|| engine.cost());
    let (generator, metrics) = spawn(engine.clone(), POLICY, cost, Duration::ZERO, prefix_cache);
    Service { generator, engine, metrics, start: ferry_core::clock::now() }
}

/// These tests' knobs: 8 sequences, a 4096-token context, room in the queue.
const POLICY: Policy = Policy {
    max_batch_tokens: 2048,
    max_sequences: 8,
    max_queue: 64,
    max_queue_bytes: 1 << 20,
    max_queue_tokens: 1 << 20,
    max_context: 4096,
    watermark: 0,
    discipline: Discipline::Deadlines,
};

/// The shell over `engine` and all its KV blocks, the estimator starting from `prior`, with the
/// deadline margin's floor at `margin`, the prefix cache on where `prefix_cache` seeds it.
fn spawn(
    engine: Arc<dyn StepEngine>,
    policy: Policy,
    prior: StepCost,
    margin: Duration,
    prefix_cache: Option<u64>,
) -> (Generator, GenerationMetrics) {
    let kv = engine.kv();
    let scheduler = Scheduler::new(policy, BlockPool::new(kv.blocks, kv.block_size), StepEstimator::new(prior));
    let metrics = Metrics::new().generation("m", "1");
    let targets = Targets { margin, ..TARGETS };
    (steps::spawn(Ledger::new(scheduler, margin, 3), engine, metrics.clone(), targets, prefix_cache), metrics)
}

/// The service's default deadlines, which its exported capacity keeps.
const TARGETS: Targets = Targets {
    ttft: Duration::from_secs(1),
    itl: Duration::from_millis(100),
    timeout: Duration::from_secs(30),
    margin: Duration::ZERO,
};

impl Service {
    fn submit(&self, prompt: &str, max_tokens: u32, timeout: Duration) -> Stream {
        self.submit_with(prompt, max_tokens, timeout, Duration::from_secs(10), timeout)
    }

    /// With each of the three promises: first token, inter-token target, whole answer.
    fn submit_with(&self, prompt: &str, max_tokens: u32, ttft: Duration, itl: Duration, timeout: Duration) -> Stream {
        let now = ferry_core::clock::now();
        let submission = Submission {
            prompt: Prompt {
                tokens: self.engine.encode(prompt).unwrap(),
                sampling: Sampling::default(),
                stop: Vec::new(),
            },
            max_tokens,
            priority: Priority::Interactive,
            tenant: 0,
            weight: 1,
            bytes: 64,
            arrival: now,
            ttft_deadline: now + ttft,
            itl,
            deadline: now + timeout,
        };
        self.generator.submit(submission, Tally::new(self.metrics.outcomes().clone()))
    }

    fn ms(&self) -> f64 {
        (ferry_core::clock::now() - self.start).as_secs_f64() * 1e3
    }
}

/// Takes a stream to its end: each text piece with the millisecond it was taken, and the end.
async fn collect(service: &Service, mut stream: Stream) -> (Vec<(f64, String)>, Piece) {
    let mut pieces = Vec::new();
    loop {
        match stream.next().await.expect("a stream ends with an end") {
            Piece::Text(text, _) => pieces.push((service.ms(), text)),
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
        assert!(matches!(stream.next().await, Some(Piece::Text(..))));
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

/// Samples of a histogram above `bound` (its buckets are cumulative: `le` counts at most).
fn above(h: &prometheus::Histogram, bound: f64) -> u64 {
    let proto = prometheus::core::Metric::metric(h);
    let histogram = proto.get_histogram();
    let at_most = histogram.get_bucket().iter().find(|b| b.upper_bound() == bound).expect("a bucket at the bound");
    histogram.get_sample_count() - at_most.cumulative_count()
}

#[tokio::test(start_paused = true)]
async fn a_long_prompt_prefills_beside_decodes_without_stretching_their_steps() {
    // Attention counted: 20 ns per attended slot makes a prompt token at position 16 k cost 370 us
    // where one at its start costs 50 us. A step rule that timed chunks by their tokens alone
    // would give the late chunks 7 times the time their estimate says, and the decodes beside
    // them steps of a quarter of a second.
    let times = SimLlmTimes {
        step_time: 10 * MS,
        prefill_per_token: Duration::from_micros(50),
        decode_per_seq: Duration::from_micros(200),
        attention_per_slot: Duration::from_nanos(20),
    };
    let (blocks, block_size) = (2400, 16);
    let engine = Arc::new(SimLlm::new(times, KvLayout { blocks, block_size }));
    let policy = Policy { max_sequences: 64, max_context: 32_768, ..POLICY };
    // The deadline margin's floor at its default, 2 ms: steps beside decodes keep it free.
    let (generator, metrics) = spawn(engine.clone(), policy, engine.cost(), 2 * MS, None);
    let s = Service { generator, engine, metrics, start: ferry_core::clock::now() };
    let target = 50 * MS;

    // 32 streams decoding, each promised 50 ms between tokens. (They arrive together: streams
    // that join one by one make the step times a sawtooth of the timer's millisecond grain, whose
    // slope against context the estimator extrapolates over the streams' 400 tokens.)
    let mut streams = Vec::new();
    let submitted: Vec<Stream> =
        (0..32).map(|i| s.submit_with(&format!("s{i} a b c d e f g"), 400, HOUR, target, HOUR)).collect();
    for (i, mut stream) in submitted.into_iter().enumerate() {
        let first = stream.next().await;
        assert!(matches!(first, Some(Piece::Text(..))), "stream {i}: {first:?}");
        let s = s.clone();
        let first = s.ms();
        streams.push(tokio::spawn(async move {
            let (mut pieces, end) = collect(&s, stream).await;
            pieces.insert(0, (first, String::new()));
            (pieces, end)
        }));
    }

    // A 16 384-token prompt. Asked first with a first-token deadline of 1 ms, admission refuses it
    // and says when its forecast puts the first token; asked again at the same instant with room,
    // it is admitted, and its first token comes then, within 3 %: the forecast runs the estimator
    // as it stood at arrival, while the real steps go on learning from the chunks they measure
    // (the sim's sleeps end on the timer's millisecond, half a millisecond over the fit on
    // average), so over a hundred steps they cut a few chunks a few tokens differently.
    let prompt: String = (0..16_384).map(|i| format!("w{} ", i % 5000)).collect();
    let arrival = s.ms();
    let (pieces, end) = collect(&s, s.submit_with(&prompt, 8, MS, target, HOUR)).await;
    let Piece::End(Err(refusal)) = end else { panic!("{end:?}") };
    assert!(pieces.is_empty() && refusal.outcome == Outcome::Infeasible, "{refusal:?}");
    let forecast: f64 = refusal
        .message
        .split("the first token is forecast ")
        .nth(1)
        .and_then(|rest| rest.split(" ms").next())
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("no forecast in: {}", refusal.message));
    assert_eq!(s.ms(), arrival, "refused at arrival");
    let (long, end) = collect(&s, s.submit_with(&prompt, 8, Duration::from_secs(60), target, HOUR)).await;
    assert!(matches!(end, Piece::End(Ok(_))), "{end:?}");
    assert_eq!(long.len(), 8);
    let first = long[0].0 - arrival;
    assert!(
        (first - forecast).abs() <= 0.03 * forecast,
        "the first token {first} ms after arrival; forecast at {forecast} ms"
    );
    // The prompt took many steps: chunks cut to what the decodes' target leaves (2048 tokens a
    // step would have been 8 steps of 100 ms and more).
    assert!(first > 1000.0, "the first token after {first} ms");

    for (i, stream) in streams.into_iter().enumerate() {
        let (pieces, end) = stream.await.unwrap();
        assert!(matches!(end, Piece::End(Ok(_))), "stream {i}: {end:?}");
        assert_eq!(pieces.len(), 400, "stream {i}");
        assert!(pieces.last().unwrap().0 > long[0].0, "stream {i} ended before the prompt was in: not beside it");
        let gap = pieces.windows(2).map(|w| w[1].0 - w[0].0).fold(0.0, f64::max);
        assert!(gap <= 50.0 + 1e-6, "stream {i}: a gap of {gap} ms between tokens");
    }
    // The server's own account: no inter-token gap over the target.
    assert_eq!(above(&s.metrics.itl, 0.05), 0, "inter-token gaps over 50 ms");
    assert!(s.metrics.itl.get_sample_count() >= 32 * 399);
}

/// The sim-llm engine with an end-of-sequence word: its answers end where `</s>` comes.
struct WithEnd {
    sim: SimLlm,
    end: u32,
}

impl LanguageModel for WithEnd {
    fn context_length(&self) -> u32 {
        self.sim.model().context_length()
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.sim.model().encode(text)
    }
    fn vocab_size(&self) -> u32 {
        self.sim.model().vocab_size()
    }
    fn chat(&self, messages: &[Message], options: &ChatOptions) -> Result<String, String> {
        self.sim.model().chat(messages, options)
    }
    fn detokenizer(&self) -> Box<dyn Detokenizer> {
        self.sim.model().detokenizer()
    }
    fn is_end(&self, token: u32) -> bool {
        token == self.end
    }
    fn token_shown(&self, token: u32) -> Vec<u8> {
        self.sim.model().token_shown(token)
    }
}

impl StepEngine for WithEnd {
    fn model(&self) -> &dyn LanguageModel {
        self
    }
    fn kv(&self) -> KvLayout {
        self.sim.kv()
    }
    fn cost(&self) -> StepCost {
        self.sim.cost()
    }
    fn platform(&self) -> &str {
        self.sim.platform()
    }
    fn step(&self, step: StepInput) -> BoxFuture<Result<Vec<Drawn>, EngineError>> {
        self.sim.step(step)
    }
}

#[tokio::test(start_paused = true)]
async fn an_answer_that_ends_keeps_the_text_a_stop_string_held_back() {
    // "a b </s>" is answered "a", " b", then the end. With the stop string " b c", " b" is held
    // back after the second token (it could have grown into " b c"); the end settles it: it is
    // the answer's, not a stop string's.
    let sim = SimLlm::new(times(), KvLayout { blocks: 100, block_size: 4 });
    let end = sim.model().encode("</s>").unwrap()[0];
    let engine = Arc::new(WithEnd { sim, end });
    let (generator, metrics) = spawn(engine.clone(), POLICY, engine.cost(), Duration::ZERO, None);
    let answer = |stop: &[&str]| {
        let now = ferry_core::clock::now();
        let submission = Submission {
            prompt: Prompt {
                tokens: engine.encode("a b </s>").unwrap(),
                sampling: Sampling::default(),
                stop: stop.iter().map(|s| s.to_string()).collect(),
            },
            max_tokens: 10,
            priority: Priority::Interactive,
            tenant: 0,
            weight: 1,
            bytes: 64,
            arrival: now,
            ttft_deadline: now + HOUR,
            itl: HOUR,
            deadline: now + HOUR,
        };
        let mut stream = generator.submit(submission, Tally::new(metrics.outcomes().clone()));
        async move {
            let mut text = String::new();
            loop {
                match stream.next().await.expect("a stream ends with an end") {
                    Piece::Text(piece, _) => text.push_str(&piece),
                    Piece::End(end) => return (text, end.map(|f| (f.reason, f.completion_tokens))),
                    Piece::Relayed { .. } => unreachable!("a step engine's pieces are its own"),
                }
            }
        }
    };
    assert_eq!(answer(&[" b c"]).await, ("a b".to_owned(), Ok((FinishReason::Stop, 3))));
    assert_eq!(answer(&[]).await, ("a b".to_owned(), Ok((FinishReason::Stop, 3))), "the same without stop strings");
    assert_eq!(answer(&[" b"]).await, ("a".to_owned(), Ok((FinishReason::Stop, 2))), "a stop string is never sent");
}

/// The sim-llm engine, broken from its `after`-th step on: each later step hangs for ever, or
/// panics (as a forward pass that indexes out of bounds would), or returns no tokens.
struct Breaks {
    sim: Arc<SimLlm>,
    after: u32,
    how: Break,
    steps: std::sync::atomic::AtomicU32,
}

#[derive(Clone, Copy)]
enum Break {
    Hang,
    Panic,
    Short,
}

impl StepEngine for Breaks {
    fn model(&self) -> &dyn LanguageModel {
        self.sim.model()
    }
    fn kv(&self) -> KvLayout {
        self.sim.kv()
    }
    fn cost(&self) -> StepCost {
        self.sim.cost()
    }
    fn platform(&self) -> &str {
        self.sim.platform()
    }
    fn step(&self, step: StepInput) -> BoxFuture<Result<Vec<Drawn>, EngineError>> {
        if self.steps.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < self.after {
            return self.sim.step(step);
        }
        match self.how {
            Break::Hang => Box::pin(std::future::pending()),
            Break::Panic => Box::pin(async { panic!("index out of bounds in the forward pass") }),
            Break::Short => Box::pin(async { Ok(Vec::new()) }),
        }
    }
}

fn breaking(after: u32, how: Break) -> Service {
    let sim = Arc::new(SimLlm::new(times(), KvLayout { blocks: 1000, block_size: 4 }));
    let engine = Arc::new(Breaks { sim: sim.clone(), after, how, steps: 0.into() });
    let (generator, metrics) = spawn(engine, POLICY, sim.cost(), Duration::ZERO, None);
    Service { generator, engine: sim, metrics, start: ferry_core::clock::now() }
}

#[tokio::test(start_paused = true)]
async fn a_stalled_step_fails_its_sequences_and_stops_the_generator_within_two_seconds() {
    // Five steps run (the prefill and four tokens), then the sixth never returns.
    let s = breaking(5, Break::Hang);
    let generator = &s.generator;
    let (pieces, end) = collect(&s, s.submit("a b c d e f g h i j", 20, HOUR)).await;
    let text: String = pieces.iter().map(|(_, t)| t.as_str()).collect();
    assert_eq!(text, "a b c d e", "the tokens of the steps that ran");
    let Piece::End(Err(refusal)) = end else { panic!("{end:?}") };
    assert_eq!(refusal.outcome, Outcome::Failed);
    assert!(refusal.message.contains("step 5 has run 1500 ms"), "{}", refusal.message);
    // The sixth step started at 5 x 11 ms; the stall is declared 1.5 s later.
    assert!((s.ms() - (55.0 + 1500.0)).abs() < 1e-6, "at {} ms", s.ms());
    tokio::time::timeout(Duration::from_millis(1), generator.stopped()).await.expect("stopped at once");
    assert!(!generator.is_alive(), "readiness goes with it");
    assert_eq!(s.metrics.outcome_total(Outcome::Failed), 1);
    // A request after the stop fails at once rather than waiting on a hung engine.
    let mut after = s.submit("x y", 2, HOUR);
    assert!(after.next().await.is_none(), "ended before it began");
    assert_eq!(s.metrics.outcome_total(Outcome::Failed), 2);
}

#[tokio::test(start_paused = true)]
async fn the_pod_exports_its_step_cost_and_a_prior_capacity_at_once_then_its_capacity_at_the_prompts_asked_for() {
    let s = service(1000, None);
    let exported = |s: &Service| {
        let [fixed, per_decode, per_prefill_token, per_context_token, per_attended_slot] =
            s.metrics.step_cost.each_ref().map(|g| Duration::from_secs_f64(g.get()));
        StepCost { fixed, per_decode, per_prefill_token, per_context_token, per_attended_slot }
    };
    let limits = Limits { blocks: 1000, block_size: 4, watermark: 0, max_sequences: 8, max_batch_tokens: 2048 };
    let close = |got: f64, want: f64| (got - want).abs() <= 1e-6 * want;
    // Before any request: the prior (here the engine's own costs), and the capacity at the prior
    // shape — a chat turn whose answer runs to the default cap of a chat completion.
    tokio::time::sleep(MS).await;
    assert_eq!(exported(&s), s.engine.cost());
    assert_eq!(PRIOR_SHAPE.output, f64::from(ferry_sidecar::front::prompt::DEFAULT_CHAT_MAX_TOKENS));
    let prior = capacity(&exported(&s), &PRIOR_SHAPE, &TARGETS, &limits);
    assert!(prior.requests_per_second > 0.0, "{prior:?}");
    assert!(close(s.metrics.capacity_requests.get(), prior.requests_per_second), "{prior:?}");
    // Requests of 9 + 3 and 3 + 5 tokens finish: the shape is their mean, 6 prompt and 4 output
    // tokens, and the capacity at it is the function's for the service's targets and limits.
    let mut shape = RequestShape::default();
    for (words, max_tokens) in [(9, 3), (3, 5)] {
        let prompt: Vec<String> = (0..words).map(|i| format!("w{i}")).collect();
        let (_, end) = collect(&s, s.submit(&prompt.join(" "), max_tokens, HOUR)).await;
        let Piece::End(Ok(finished)) = end else { panic!("{end:?}") };
        shape.prompt += f64::from(finished.prompt_tokens) / 2.0;
        shape.output += f64::from(finished.completion_tokens) / 2.0;
    }
    assert_eq!(shape, RequestShape { prompt: 6.0, output: 4.0 });
    // It is computed once a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let expected = capacity(&exported(&s), &shape, &TARGETS, &limits);
    assert!(expected.requests_per_second > prior.requests_per_second, "shorter than the prior: {expected:?}");
    assert!(close(s.metrics.capacity_requests.get(), expected.requests_per_second), "{expected:?}");
    assert!(close(s.metrics.capacity_tokens.get(), expected.tokens_per_second), "{expected:?}");
    assert_eq!(s.metrics.queue_tokens.get(), 0, "nothing waits");
    // A request with a 600-token prompt arrives: the capacity falls to the function's at the
    // prompts asked for now (the mean of 9, 3 and 600), at the next computation, long before
    // that request's answer of 2000 tokens ends.
    let long: Vec<String> = (0..600).map(|i| format!("w{i}")).collect();
    let mut stream = s.submit(&long.join(" "), 2000, HOUR);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let grown = RequestShape { prompt: (9.0 + 3.0 + 600.0) / 3.0, output: 4.0 };
    let fallen = capacity(&exported(&s), &grown, &TARGETS, &limits);
    assert!(fallen.requests_per_second < expected.requests_per_second, "{fallen:?} vs {expected:?}");
    assert!(close(s.metrics.capacity_requests.get(), fallen.requests_per_second), "{fallen:?}");
    assert!(matches!(stream.next().await, Some(Piece::Text(..))), "still answering");
}

#[tokio::test(start_paused = true)]
async fn a_stop_of_the_process_that_ends_as_a_step_falls_due_is_not_a_stall() {
    // The sixth step (from 55 ms) hangs, and its watchdog falls due at 1555 ms; at 1400 ms the
    // clock jumps 200 ms with no task run, as when a stopped process resumes, 45 ms after that.
    // The stop is not the engine's: the deadline moves by what the task overslept (150 to 200 ms,
    // by where its 50 ms timer probe stood), so the stall is declared then, not on resuming.
    let s = breaking(5, Break::Hang);
    let collecting = tokio::spawn({
        let s = s.clone();
        async move { collect(&s, s.submit("a b c d e f g h i j", 20, HOUR)).await }
    });
    ferry_core::clock::sleep_until(s.start + Duration::from_millis(1400)).await;
    tokio::time::advance(Duration::from_millis(200)).await;
    let (pieces, end) = collecting.await.unwrap();
    assert_eq!(pieces.len(), 5, "the tokens of the steps that ran");
    let Piece::End(Err(refusal)) = end else { panic!("{end:?}") };
    assert_eq!(refusal.outcome, Outcome::Failed);
    let at = s.ms();
    assert!((1705.0..=1755.0).contains(&at), "the stall declared at {at} ms: {}", refusal.message);
    assert!(refusal.message.contains(&format!("step 5 has run {} ms", at as u64 - 55)), "{}", refusal.message);
}

#[tokio::test(start_paused = true)]
async fn an_engine_that_fails_every_step_stops_the_generator() {
    for how in [Break::Panic, Break::Short] {
        let s = breaking(0, how);
        let generator = &s.generator;
        // Each request's steps fail: it is retried by recompute for three attempts in all, then
        // fails; the second request's second failed step is the fifth in a row, which stops the
        // generator and fails the request at once, saying why.
        let mut ends = Vec::new();
        for i in 0..2 {
            let (pieces, end) = collect(&s, s.submit(&format!("r{i} a b"), 4, HOUR)).await;
            assert!(pieces.is_empty());
            let Piece::End(Err(refusal)) = end else { panic!("{end:?}") };
            assert_eq!(refusal.outcome, Outcome::Failed);
            ends.push(refusal.message);
        }
        assert!(ends[1].contains("5 steps in a row failed"), "{ends:?}");
        tokio::time::timeout(MS, generator.stopped()).await.expect("stopped");
        assert!(!generator.is_alive());
        assert_eq!(s.metrics.outcome_total(Outcome::Failed), 2);
    }
}

#[tokio::test(start_paused = true)]
async fn a_prompt_that_starts_like_one_before_reuses_its_kv_blocks_and_answers_alike() {
    // A 1500-word system prompt, then a question: A's prefill is 1503 tokens (10 + 150.3 ms);
    // B's first 1500 tokens are A's 375 blocks of 4, cached, so B prefills its last 4 (10.4 ms).
    let system: String = (0..1500).map(|i| format!("w{i} ")).collect();
    let (first, second) = (format!("{system}q1 a b"), format!("{system}q2 c d e"));
    let mut ttft = Vec::new();
    for cache in [Some(7), None] {
        let s = service_with(2000, None, cache);
        let (_, end) = collect(&s, s.submit(&first, 3, HOUR)).await;
        let Piece::End(Ok(a)) = end else { panic!("{end:?}") };
        // B's answer is its prompt, read back from its blocks: the cached ones hold its words.
        let (b, end) = collect(&s, s.submit(&second, 1504, HOUR)).await;
        let Piece::End(Ok(b_done)) = end else { panic!("{end:?}") };
        assert_eq!(b.iter().map(|(_, t)| t.as_str()).collect::<String>(), second);
        ttft.push((a.ttft, b_done.ttft));
        let counted = if cache.is_some() { (1503 + 1504, 1500) } else { (0, 0) };
        assert_eq!((s.metrics.prefix_queries.get(), s.metrics.prefix_hits.get()), counted, "{cache:?}");
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let [(a, b), (a_off, b_off)] = [ttft[0], ttft[1]].map(|(a, b)| (ms(a), ms(b)));
    // tokio's timer rounds a step's end up to its millisecond.
    assert_eq!((a, a_off, b_off), (161.0, 161.0, 161.0), "the first prompt, and either without the cache");
    assert_eq!(b, 11.0);
    assert!(b <= 0.15 * a);
}
