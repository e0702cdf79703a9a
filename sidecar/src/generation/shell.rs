//! The async shell around one model version's generation [`Ledger`]: it keeps what the ledger
//! must not hold — each sequence's tokens, its detokenizer and stop strings, its caller's stream
//! — gathers the events of an instant, hands them to the ledger, and carries out its effects:
//! one engine step at a time, each sequence's new text to its caller the moment the step ends,
//! the ends, the metrics. Every decision (admission, the step rule, preemption, deadlines) is the
//! ledger's.
//!
//! One task owns all of this state; callers talk to it over a channel. A caller holds a
//! [`Stream`]: dropping it (the client went away) frees the sequence and its KV blocks before the
//! next step.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use super::engine::{Detokenizer, Sampling, SeqInput, StepEngine, StepInput};
use super::stop::StopMatcher;
use super::stream::{Control, Finished, Piece, Sent, Stream};
use crate::engine::EngineError;
use crate::metrics::GenerationMetrics;
use crate::tally::Tally;
use crate::task::{sleep_until, OldestArrival, Stopped};
use ferry_core::generation::capacity::{self, Limits, RecentShape, Targets};
use ferry_core::generation::ledger::{Effect, Event, Ledger};
use ferry_core::generation::scheduler::StepPlan;
use ferry_core::generation::sequence::{End, FinishReason, Request, SeqId};
use ferry_core::lockout::Lockout;
use ferry_core::outcome::Outcome;
use ferry_core::tenant::TenantId;
use ferry_core::ticket::Priority;

/// A generation request for the shell: its prompt's tokens and what admission needs.
#[derive(Debug)]
pub struct Submission {
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub priority: Priority,
    /// Whose it is, and the tenant's weight.
    pub tenant: TenantId,
    pub weight: u32,
    pub bytes: u64,
    pub arrival: Instant,
    pub ttft_deadline: Instant,
    pub itl: Duration,
    pub deadline: Instant,
}

enum Command {
    Submit { id: SeqId, submission: Submission, stream: mpsc::UnboundedSender<Sent> },
    Control(Control),
    Drain(oneshot::Sender<()>),
}

/// A handle to one model version's generation task. Cheap to clone.
#[derive(Clone)]
pub struct Generator {
    commands: mpsc::UnboundedSender<Command>,
    next_id: Arc<AtomicU64>,
    oldest: OldestArrival,
    metrics: GenerationMetrics,
    stopped: watch::Receiver<bool>,
}

impl Generator {
    /// Starts the task on the current tokio runtime; `targets` are the service's (its default
    /// deadlines), which the capacity it exports keeps.
    pub fn spawn(
        ledger: Ledger,
        engine: Arc<dyn StepEngine>,
        metrics: GenerationMetrics,
        targets: Targets,
    ) -> Generator {
        let (commands, rx) = mpsc::unbounded_channel();
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let oldest = OldestArrival::new();
        let task = Task {
            lockout: Lockout::default(),
            ledger,
            engine,
            metrics: metrics.clone(),
            callers: HashMap::new(),
            sampled: HashMap::new(),
            running: None,
            done_tx,
            drains: Vec::new(),
            oldest: oldest.clone(),
            watchdog: None,
            failed_steps: 0,
            targets,
            shape: RecentShape::default(),
            capacity_due: None,
        };
        let (stopped_tx, stopped) = watch::channel(false);
        tokio::spawn(async move {
            let _stopped = Stopped(stopped_tx);
            task.run(rx, done_rx).await;
        });
        Generator { commands, next_id: Arc::new(AtomicU64::new(0)), oldest, metrics, stopped }
    }

    /// Hands a request to the ledger; the [`Stream`] gives its text and its end, and counts how it
    /// ended in `tally` (`cancelled` if it is dropped before).
    pub fn submit(&self, submission: Submission, tally: Tally) -> Stream {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let commands = self.commands.clone();
        let control = Box::new(move |c: Control| {
            let _ = commands.send(Command::Control(c));
        });
        let mut stream = Stream::new(id, rx, control, tally, self.metrics.late_results.clone(), &submission);
        if self.commands.send(Command::Submit { id, submission, stream: tx }).is_err() {
            // The task is gone (a bug stopped it): the request fails here.
            stream.fail_now();
        }
        stream
    }

    /// Resolves once every sequence has ended.
    pub async fn drain(&self) {
        let (tx, rx) = oneshot::channel();
        if self.commands.send(Command::Drain(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    pub fn metrics(&self) -> &GenerationMetrics {
        &self.metrics
    }

    pub fn is_alive(&self) -> bool {
        !*self.stopped.borrow()
    }

    pub async fn stopped(&self) {
        let mut stopped = self.stopped.clone();
        let _ = stopped.wait_for(|s| *s).await;
    }

    /// Sets `ferry_queue_oldest_age_seconds` from the current time.
    pub fn refresh_age(&self) {
        self.metrics.oldest_age.set(self.oldest.age());
    }
}

/// A sequence's caller and what the shell keeps for it.
struct Caller {
    stream: mpsc::UnboundedSender<Sent>,
    /// Prompt and produced tokens.
    tokens: Vec<u32>,
    prompt: u32,
    sampling: Sampling,
    detokenizer: Box<dyn Detokenizer>,
    stop: StopMatcher,
    arrival: Instant,
    started: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

impl Caller {
    fn send(&self, piece: Piece, now: Instant) {
        let _ = self.stream.send(Sent { piece, at: now, queued: None });
    }
}

struct StepDone {
    step: u64,
    result: Result<Vec<u32>, EngineError>,
}

struct Task {
    ledger: Ledger,
    engine: Arc<dyn StepEngine>,
    metrics: GenerationMetrics,
    callers: HashMap<SeqId, Caller>,
    /// The token and text each sequence got from the step that just ended, until the ledger
    /// says whether it is sent.
    sampled: HashMap<SeqId, (u32, String)>,
    /// The step on the engine.
    running: Option<(u64, StepPlan)>,
    done_tx: mpsc::UnboundedSender<StepDone>,
    drains: Vec<oneshot::Sender<()>>,
    oldest: OldestArrival,
    /// Whether it refuses every request while idle ([`ferry_core::lockout`]).
    lockout: Lockout,
    /// The running step's stall deadline.
    watchdog: Option<Watchdog>,
    /// Steps failed in a row.
    failed_steps: u32,
    /// The service's default deadlines, and the shape of the requests finished lately: what the
    /// exported capacity is computed for.
    targets: Targets,
    shape: RecentShape,
    /// When the capacity is next computed.
    capacity_due: Option<Instant>,
}

/// The task wakes at least this often while it serves, so that its timer's lateness (part of the
/// deadline margin) is measured whatever the load.
const TIMER_PROBE: Duration = Duration::from_millis(50);

/// How often the exported capacity is computed (a bisection over queueing formulas: tens of
/// microseconds, not for every step).
const CAPACITY_PERIOD: Duration = Duration::from_secs(1);

/// A step still running this long after it started, and this many times its estimate, has
/// stalled: the engine is hung, and the pod must be restarted rather than keep its sequences
/// (and its readiness) waiting on it for ever.
const STALL_FLOOR: Duration = Duration::from_millis(1500);
const STALL_FACTOR: u32 = 20;
/// A watchdog that wakes this late did not see the engine stall: the whole process was stopped
/// (SIGSTOP, a CPU quota, a page-cache stall), the engine with it; the step gets its time again.
const PROCESS_PAUSED: Duration = Duration::from_millis(100);
/// Steps failed in a row, none run between them, that make the engine broken (a poisoned
/// cache fails every step): the pod restarts.
const MAX_FAILED_STEPS: u32 = 5;
/// Submissions taken into one pass of the ledger: each costs an admission forecast, and a step
/// that ends meanwhile waits for the pass (the ledger sends the next step before the pass's
/// admissions, so this bounds what a burst adds to one token's gap). The rest wait in the
/// channel for the next pass, a moment later.
const ADMISSIONS_PER_PASS: usize = 16;

fn admissions(events: &[Event]) -> usize {
    events.iter().filter(|e| matches!(e, Event::Submit(_))).count()
}

/// When the running step counts as stalled.
#[derive(Debug, Clone, Copy)]
struct Watchdog {
    step: u64,
    started: Instant,
    expected: Duration,
    due: Instant,
}

impl Watchdog {
    fn new(step: u64, started: Instant, expected: Duration) -> Watchdog {
        Watchdog { step, started, expected, due: started + Self::limit(expected) }
    }

    fn limit(expected: Duration) -> Duration {
        STALL_FLOOR.max(expected * STALL_FACTOR)
    }
}

impl Task {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut done: mpsc::UnboundedReceiver<StepDone>,
    ) {
        let mut open = true;
        let mut probe = Instant::now() + TIMER_PROBE;
        let mut waiting_for: Option<Instant> = None;
        let mut events = Vec::new();
        let mut effects = Vec::new();
        loop {
            let now = Instant::now();
            if let Some(due) = waiting_for.filter(|due| *due <= now) {
                events.push(Event::Woke(now - due));
                self.paused(now, now - due);
            }
            if now >= probe {
                probe = now + TIMER_PROBE;
            }
            if let Some(why) = self.broken(now) {
                self.abandon(&why, now);
                return;
            }
            self.ledger.step(now, std::mem::take(&mut events), &mut effects);
            for effect in effects.drain(..) {
                self.carry_out(effect, now);
            }
            self.sampled.clear();
            self.publish(now);
            self.metrics.lockout.show(self.lockout.locked(now));
            if self.ledger.is_idle() {
                self.drains.drain(..).for_each(|d| {
                    let _ = d.send(());
                });
                if !open {
                    return;
                }
            }
            let stall = self.watchdog.map(|w| w.due);
            let wake = [self.ledger.next_wake(), open.then_some(probe), stall].into_iter().flatten().min();
            waiting_for = wake;
            tokio::select! {
                biased;
                Some(step) = done.recv() => self.step_done(step, &mut events),
                command = commands.recv(), if open => match command {
                    Some(command) => self.command(command, &mut events),
                    None => open = false,
                },
                () = sleep_until(wake) => {}
            }
            // Everything else ready at this instant joins the same step (as in the batcher).
            for _ in 0..64 {
                tokio::task::yield_now().await;
                let before = events.len();
                while let Ok(step) = done.try_recv() {
                    self.step_done(step, &mut events);
                }
                while open && admissions(&events) < ADMISSIONS_PER_PASS {
                    match commands.try_recv() {
                        Ok(command) => self.command(command, &mut events),
                        Err(mpsc::error::TryRecvError::Empty) => break,
                        Err(mpsc::error::TryRecvError::Disconnected) => open = false,
                    }
                }
                if events.len() == before || Instant::now() != now {
                    break;
                }
            }
        }
    }

    fn command(&mut self, command: Command, events: &mut Vec<Event>) {
        match command {
            Command::Submit { id, submission: s, stream } => {
                let request = Request {
                    id,
                    arrival: s.arrival,
                    priority: s.priority,
                    tenant: s.tenant,
                    weight: s.weight,
                    prompt: s.prompt.len() as u32,
                    max_tokens: s.max_tokens,
                    bytes: s.bytes,
                    ttft_deadline: s.ttft_deadline,
                    itl: s.itl,
                    deadline: s.deadline,
                };
                let caller = Caller {
                    stream,
                    prompt: s.prompt.len() as u32,
                    tokens: s.prompt,
                    sampling: s.sampling,
                    detokenizer: self.engine.model().detokenizer(),
                    stop: StopMatcher::new(s.stop),
                    arrival: s.arrival,
                    started: None,
                    first_token: None,
                    last_token: None,
                };
                self.callers.insert(id, caller);
                events.push(Event::Submit(request));
            }
            Command::Control(Control::Cancel(id)) => {
                self.callers.remove(&id);
                events.push(Event::Cancel(id));
            }
            Command::Control(Control::Trip(trip)) => events.push(Event::Trip(trip)),
            Command::Drain(tx) => self.drains.push(tx),
        }
    }

    /// A wake `late` after it was due: past [`PROCESS_PAUSED`], the process did not run meanwhile
    /// (SIGSTOP, a CPU quota, a page-cache stall), the engine with it, so the running step's stall
    /// deadline moves by as much. The watchdog's own wake alone does not tell a stop that ends
    /// just as the deadline falls due: a step 120 ms in when a 2 s stop began was declared hung
    /// 3 ms after the process resumed. A stop that covered the deadline itself (the watchdog was
    /// the task's next wake: no timer probe while draining) leaves the step's own time unknown:
    /// it gets its whole limit again.
    fn paused(&mut self, now: Instant, late: Duration) {
        if let Some(w) = self.watchdog.as_mut().filter(|_| late > PROCESS_PAUSED) {
            w.due += late;
            if w.due <= now {
                w.due = now + Watchdog::limit(w.expected);
            }
        }
    }

    /// Why the engine can no longer be trusted with steps, if it cannot: its step stalled while
    /// this task kept time, or too many steps failed in a row.
    fn broken(&self, now: Instant) -> Option<String> {
        if self.failed_steps >= MAX_FAILED_STEPS {
            return Some(format!("{} steps in a row failed", self.failed_steps));
        }
        // A wake late enough to be a stop of the process has moved the deadline past `now`
        // ([`Task::paused`]): a deadline reached is the engine's.
        let w = self.watchdog.filter(|w| now >= w.due)?;
        Some(format!(
            "step {} has run {} ms, estimated at {:.1} ms, and has not returned",
            w.step,
            (now - w.started).as_millis(),
            w.expected.as_secs_f64() * 1e3
        ))
    }

    /// The engine is broken: every sequence fails now, saying why (a retry goes to another pod),
    /// and the task ends, which takes readiness away and makes the sidecar exit non-zero so that
    /// Kubernetes restarts it. A stalled step's KV blocks are never handed to another step.
    fn abandon(&mut self, why: &str, now: Instant) {
        tracing::error!(sequences = self.callers.len(), "the engine is broken: {why}; this pod must restart");
        let refusal = ferry_core::outcome::Refusal::new(
            Outcome::Failed,
            format!("the engine failed: {why}; the pod restarts (retry: another pod can answer)"),
        );
        for (_, caller) in self.callers.drain() {
            caller.send(Piece::End(Err(refusal.clone())), now);
        }
        for drain in self.drains.drain(..) {
            let _ = drain.send(());
        }
    }

    fn step_done(&mut self, done: StepDone, events: &mut Vec<Event>) {
        let Some((step, plan)) = self.running.take() else { return };
        debug_assert_eq!(step, done.step);
        self.watchdog = None;
        let sampled = plan.members.iter().filter(|m| m.sample).count();
        let result = match done.result {
            Ok(tokens) if tokens.len() != sampled => Err(EngineError(format!(
                "the engine returned {} tokens for a step that samples {sampled} sequences",
                tokens.len()
            ))),
            other => other,
        };
        self.failed_steps = if result.is_ok() { 0 } else { self.failed_steps + 1 };
        let result = match result {
            Ok(tokens) => {
                let model = self.engine.model();
                let mut stopped = Vec::new();
                let sampling = plan.members.iter().filter(|m| m.sample);
                for (m, token) in sampling.zip(tokens) {
                    let Some(caller) = self.callers.get_mut(&m.id) else { continue };
                    let end = model.is_end(token);
                    let released = if end {
                        // The end of the sequence: what the detokenizer holds (a character's
                        // first bytes) and what the stop matcher held back (a tail that could
                        // have grown into a stop string) are the answer's last text.
                        let mut released = caller.stop.push(&caller.detokenizer.finish());
                        if !released.stopped {
                            released.text.push_str(&caller.stop.finish());
                        }
                        released
                    } else {
                        caller.stop.push(&caller.detokenizer.push(token))
                    };
                    if end || released.stopped {
                        stopped.push(m.id);
                    }
                    self.sampled.insert(m.id, (token, released.text));
                }
                Ok(stopped)
            }
            Err(e) => Err(e.0),
        };
        events.push(Event::StepDone { step, result });
    }

    fn carry_out(&mut self, effect: Effect, now: Instant) {
        match effect {
            Effect::Step { step, plan } => {
                self.lockout.ran();
                self.start(step, plan)
            }
            Effect::Token { id, first } => {
                let (Some(caller), Some((token, text))) = (self.callers.get_mut(&id), self.sampled.remove(&id)) else {
                    return;
                };
                caller.tokens.push(token);
                self.metrics.generation_tokens.inc();
                if first {
                    self.metrics.ttft.observe((now - caller.arrival).as_secs_f64());
                    caller.first_token = Some(now);
                } else if let Some(last) = caller.last_token {
                    self.metrics.itl.observe((now - last).as_secs_f64());
                }
                caller.last_token = Some(now);
                // Sent even when empty (a token that ends mid-character): the caller checks each
                // token against its deadlines, the first against the TTFT deadline.
                let queued = first.then(|| caller.started.map_or(Duration::ZERO, |s| s - caller.arrival));
                let _ = caller.stream.send(Sent { piece: Piece::Text(text), at: now, queued });
            }
            Effect::End { id, end, admitted } => {
                if let (false, End::Refused(refusal)) = (admitted, &end) {
                    if refusal.outcome == Outcome::Infeasible {
                        self.lockout.refused(now, self.ledger.is_idle(), &refusal.message);
                    }
                }
                let Some(mut caller) = self.callers.remove(&id) else { return };
                if admitted {
                    self.metrics.request_duration.observe((now - caller.arrival).as_secs_f64());
                }
                match end {
                    End::Finished(reason) => {
                        if reason == FinishReason::Length {
                            // A character cut by max_tokens, then what the stop matcher held.
                            let cut = caller.detokenizer.finish();
                            let mut rest = caller.stop.push(&cut).text;
                            rest.push_str(&caller.stop.finish());
                            if !rest.is_empty() {
                                caller.send(Piece::Text(rest), now);
                            }
                        }
                        let completion_tokens = caller.tokens.len() as u32 - caller.prompt;
                        self.shape.observe(caller.prompt, completion_tokens);
                        let finished = Finished {
                            reason,
                            prompt_tokens: caller.prompt,
                            completion_tokens,
                            queued: caller.started.map_or(Duration::ZERO, |s| s - caller.arrival),
                            ttft: caller.first_token.map_or(Duration::ZERO, |f| f - caller.arrival),
                        };
                        caller.send(Piece::End(Ok(finished)), now);
                    }
                    End::Refused(refusal) => caller.send(Piece::End(Err(refusal)), now),
                }
            }
            Effect::Started { id, waited } => {
                self.metrics.queue_wait.observe(waited.as_secs_f64());
                if let Some(caller) = self.callers.get_mut(&id) {
                    caller.started = Some(now);
                    self.metrics.prompt_tokens.inc_by(u64::from(caller.prompt));
                }
            }
            Effect::Preempted(_) => self.metrics.preemptions.inc(),
            Effect::StepEnded { step, plan, took } => {
                tracing::debug!(
                    step,
                    took_ms = took.as_secs_f64() * 1e3,
                    expected_ms = plan.expected.as_secs_f64() * 1e3,
                    tokens = plan.shape.tokens(),
                    sequences = plan.members.len(),
                    "step ended"
                );
                self.metrics.step_duration.observe(took.as_secs_f64());
                self.metrics.step_tokens.observe(f64::from(plan.shape.tokens()));
                self.metrics.step_sequences.observe(plan.members.len() as f64);
            }
            Effect::Late(n) => self.metrics.late_results.inc_by(n),
        }
    }

    fn start(&mut self, step: u64, plan: StepPlan) {
        let sequences = plan
            .members
            .iter()
            .map(|m| {
                // The ledger never plans a sequence whose caller went away.
                let caller = &self.callers[&m.id];
                SeqInput {
                    id: m.id,
                    tokens: caller.tokens[m.start as usize..(m.start + m.len) as usize].to_vec(),
                    start: m.start,
                    prompt: m.prompt,
                    blocks: m.blocks.clone(),
                    sample: m.sample.then_some(caller.sampling),
                }
            })
            .collect();
        let run = self.engine.step(StepInput { shape: plan.shape, sequences });
        self.watchdog = Some(Watchdog::new(step, Instant::now(), plan.expected));
        self.running = Some((step, plan));
        let done = self.done_tx.clone();
        tokio::spawn(async move {
            let result = match AssertUnwindSafe(run).catch_unwind().await {
                Ok(result) => result,
                Err(_) => Err(EngineError("the engine panicked during a step".into())),
            };
            let _ = done.send(StepDone { step, result });
        });
    }

    fn publish(&mut self, now: Instant) {
        let s = self.ledger.scheduler();
        self.metrics.queue_tokens.set(s.queued_tokens() as i64);
        let cost = s.estimator().costs();
        for (gauge, term) in self.metrics.step_cost.iter().zip(cost.terms()) {
            gauge.set(term.as_secs_f64());
        }
        if self.capacity_due.is_none_or(|due| now >= due) {
            self.capacity_due = Some(now + CAPACITY_PERIOD);
            if let Some(shape) = self.shape.shape() {
                let limits = Limits::of(s.policy(), s.pool());
                let c = capacity::capacity(&cost, &shape, &self.targets, &limits);
                self.metrics.capacity_requests.set(c.requests_per_second);
                self.metrics.capacity_tokens.set(c.tokens_per_second);
            }
        }
        self.metrics.running.set(s.running() as i64);
        self.metrics.waiting.set(s.waiting() as i64);
        self.metrics.queue_depth.set(s.waiting() as i64);
        self.metrics.queue_bytes.set(s.queued_bytes() as i64);
        let pool = s.pool();
        self.metrics.kv_used.set(i64::from(pool.used()));
        self.metrics.kv_free.set(i64::from(pool.free()));
        self.metrics.kv_usage.set(if pool.total() == 0 {
            0.0
        } else {
            f64::from(pool.used()) / f64::from(pool.total())
        });
        self.oldest.set(s.oldest_waiting());
    }
}

impl super::stream::Deadlines for Submission {
    fn arrival(&self) -> Instant {
        self.arrival
    }

    fn ttft_deadline(&self) -> Instant {
        self.ttft_deadline
    }

    fn deadline(&self) -> Instant {
        self.deadline
    }
}
