//! The step engine's [`Backend`]: ferry-core's generation [`Ledger`] decides every step,
//! preemption and deadline; this keeps what the ledger must not hold — each sequence's tokens,
//! its detokenizer and stop strings, its caller — runs one engine step at a time, sends each
//! sequence's new text the moment the step ends, and watches the step: an engine that stalls or
//! keeps failing ends the task, which takes the pod's readiness away.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use std::time::Instant;
use tokio::sync::mpsc;

use super::engine::{Detokenizer, Drawn, LanguageModel, Logprobs, Sampling, SeqInput, StepEngine, StepInput};
use super::shell::{self, Backend, CapacityExport, Handle, PromptTokens, Reply};
use super::stop::StopMatcher;
use super::stream::{Control, Piece, TokenLogprob};
use crate::engine::EngineError;
use crate::metrics::GenerationMetrics;
use crate::task::OldestArrival;
use ferry_core::generation::capacity::{self, Limits, Targets};
use ferry_core::generation::ledger::{Effect, Event, Ledger, StepOutcome};
use ferry_core::generation::prefix::Prefix;
use ferry_core::generation::scheduler::StepPlan;
use ferry_core::generation::sequence::{End, FinishReason, Request, SeqId};
use ferry_core::lockout::Lockout;
use ferry_core::outcome::{Outcome, Refusal};

/// A prompt for the step engine: its tokens and how its answer is drawn.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    pub sampling: Sampling,
    pub stop: Vec<String>,
}

impl PromptTokens for Prompt {
    fn prompt_tokens(&self) -> u32 {
        self.tokens.len() as u32
    }
}

/// A handle to one model version's step engine.
pub type Generator = Handle<Prompt>;

/// Starts the step engine's task; `targets` are the service's (its default deadlines), which the
/// capacity it exports keeps. With `prefix_cache` (the model version's
/// [`ferry_core::generation::prefix::seed`]) prompts share the KV blocks they start with.
pub fn spawn(
    ledger: Ledger,
    engine: Arc<dyn StepEngine>,
    metrics: GenerationMetrics,
    targets: Targets,
    prefix_cache: Option<u64>,
) -> Generator {
    let (done_tx, done_rx) = mpsc::unbounded_channel();
    let oldest = OldestArrival::new();
    let pool = ledger.scheduler().pool();
    metrics.kv_config.set(pool.block_size(), pool.total());
    let steps = Steps {
        lockout: Lockout::default(),
        ledger,
        engine,
        metrics: metrics.clone(),
        callers: HashMap::new(),
        sampled: HashMap::new(),
        running: None,
        done_tx,
        oldest: oldest.clone(),
        watchdog: None,
        failed_steps: 0,
        capacity: CapacityExport::new(targets, true),
        prefix_cache,
        prefix_counted: (0, 0),
    };
    Handle::spawn(steps, done_rx, oldest, metrics)
}

/// A sequence's caller and what the shell keeps for it.
struct Caller {
    reply: Reply,
    /// Prompt and produced tokens.
    tokens: Vec<u32>,
    prompt: u32,
    sampling: Sampling,
    detokenizer: Box<dyn Detokenizer>,
    stop: StopMatcher,
}

/// A step's end, from the task that ran it.
pub(super) struct StepDone {
    step: u64,
    result: Result<Vec<Drawn>, EngineError>,
}

struct Steps {
    ledger: Ledger,
    engine: Arc<dyn StepEngine>,
    metrics: GenerationMetrics,
    callers: HashMap<SeqId, Caller>,
    /// The token, text and log-probabilities each sequence got from the step that just ended,
    /// until the ledger says whether it is sent.
    sampled: HashMap<SeqId, (u32, String, Option<Box<TokenLogprob>>)>,
    /// The step on the engine.
    running: Option<(u64, StepPlan)>,
    done_tx: mpsc::UnboundedSender<StepDone>,
    oldest: OldestArrival,
    /// Whether it refuses every request while idle ([`ferry_core::lockout`]).
    lockout: Lockout,
    /// The running step's stall deadline.
    watchdog: Option<Watchdog>,
    /// Steps failed in a row.
    failed_steps: u32,
    /// The capacity it exports, from the step cost it learned.
    capacity: CapacityExport,
    /// The seed of the prefix cache's hashes; `None` with the cache off.
    prefix_cache: Option<u64>,
    /// The scheduler's prefix-cache counts already added to the metrics.
    prefix_counted: (u64, u64),
}

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

impl Backend for Steps {
    type Prompt = Prompt;
    type Report = StepDone;
    type Event = Event;
    type Effect = Effect;
    /// Each submission costs an admission forecast, and a step that ends meanwhile waits for the
    /// pass (the ledger sends the next step before the pass's admissions, so this bounds what a
    /// burst adds to one token's gap).
    const ADMISSIONS_PER_PASS: usize = 16;

    fn is_admission(event: &Event) -> bool {
        matches!(event, Event::Submit(..) | Event::SubmitGroup(..))
    }

    fn woke(&mut self, now: Instant, late: Duration, events: &mut Vec<Event>) {
        events.push(Event::Woke(late));
        self.paused(now, late);
    }

    fn submit(&mut self, request: Request, prompt: Prompt, reply: Reply, events: &mut Vec<Event>) {
        let named = match self.prefix_cache {
            Some(seed) => Prefix::of(seed, &prompt.tokens, self.engine.kv().block_size),
            None => Prefix::default(),
        };
        let caller = self.caller(&request, prompt, reply);
        self.callers.insert(request.id, caller);
        self.capacity.arrived(request.prompt);
        events.push(Event::Submit(request, named));
    }

    /// A request's sequences (`n` of each of its prompts): the ledger admits them all or none.
    fn submit_group(&mut self, group: Vec<(Request, Prompt, Reply)>, events: &mut Vec<Event>) {
        let mut members = Vec::with_capacity(group.len());
        for (request, prompt, reply) in group {
            let named = match self.prefix_cache {
                Some(seed) => Prefix::of(seed, &prompt.tokens, self.engine.kv().block_size),
                None => Prefix::default(),
            };
            self.callers.insert(request.id, self.caller(&request, prompt, reply));
            self.capacity.arrived(request.prompt);
            members.push((request, named));
        }
        events.push(Event::SubmitGroup(members));
    }

    fn control(&mut self, control: Control, events: &mut Vec<Event>) {
        match control {
            Control::Cancel(id) => {
                self.callers.remove(&id);
                events.push(Event::Cancel(id));
            }
            Control::Trip(trip) => events.push(Event::Trip(trip)),
        }
    }

    fn report(&mut self, done: StepDone, events: &mut Vec<Event>) {
        self.step_done(done, events);
    }

    /// Why the engine can no longer be trusted with steps, if it cannot: its step stalled while
    /// this task kept time, or too many steps failed in a row.
    fn broken(&self, now: Instant) -> Option<String> {
        if self.failed_steps >= MAX_FAILED_STEPS {
            return Some(format!("{} steps in a row failed", self.failed_steps));
        }
        // A wake late enough to be a stop of the process has moved the deadline past `now`
        // ([`Steps::paused`]): a deadline reached is the engine's.
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
        let refusal = Refusal::new(
            Outcome::Failed,
            format!("the engine failed: {why}; the pod restarts (retry: another pod can answer)"),
        );
        for (_, caller) in self.callers.drain() {
            caller.reply.send(Piece::End(Err(refusal.clone())), now);
        }
    }

    fn decide(&mut self, now: Instant, events: Vec<Event>, effects: &mut Vec<Effect>) {
        self.ledger.step(now, events, effects);
    }

    fn carry_out(&mut self, effect: Effect, now: Instant) {
        match effect {
            Effect::Step { step, plan } => {
                self.lockout.ran();
                self.start(step, plan)
            }
            Effect::Token { id, .. } => {
                let (Some(caller), Some((token, text, logprob))) =
                    (self.callers.get_mut(&id), self.sampled.remove(&id))
                else {
                    return;
                };
                caller.tokens.push(token);
                caller.reply.token(Piece::Text(text, logprob), now, &self.metrics);
            }
            Effect::End { id, end, admitted } => {
                let (caller, idle) = (self.callers.remove(&id), self.ledger.is_idle());
                let reply = caller.as_ref().map(|c| &c.reply);
                shell::ended(&mut self.lockout, &self.metrics, (&end, admitted, idle), reply, now);
                if let Some(caller) = caller {
                    self.end(caller, end, now);
                }
            }
            Effect::Started { id, waited } => {
                let caller = self.callers.get_mut(&id);
                let prompt = caller.as_ref().map_or(0, |c| c.prompt);
                shell::started(&self.metrics, caller.map(|c| &mut c.reply), prompt, waited, now);
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

    fn settle(&mut self, now: Instant) {
        self.sampled.clear();
        self.publish(now);
        self.metrics.lockout.show(self.lockout.locked(now));
    }

    fn is_idle(&self) -> bool {
        self.ledger.is_idle()
    }

    fn next_wake(&self) -> Option<Instant> {
        [self.ledger.next_wake(), self.watchdog.map(|w| w.due)].into_iter().flatten().min()
    }
}

impl Steps {
    fn caller(&self, request: &Request, prompt: Prompt, reply: Reply) -> Caller {
        Caller {
            reply,
            prompt: request.prompt,
            tokens: prompt.tokens,
            sampling: prompt.sampling,
            detokenizer: self.engine.model().detokenizer(),
            stop: StopMatcher::new(prompt.stop),
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
        let outcome = match result {
            Ok(tokens) => {
                let model = self.engine.model();
                let mut stopped = Vec::new();
                let sampling = plan.members.iter().filter(|m| m.sample);
                for (m, Drawn { token, logprobs }) in sampling.zip(tokens) {
                    let Some(caller) = self.callers.get_mut(&m.id) else { continue };
                    let end = model.is_end(token) && !caller.sampling.ignore_eos;
                    let released = if end {
                        // The end of the sequence: what the detokenizer holds (a character's
                        // first bytes) and what the stop matcher held back (a tail that could
                        // have grown into a stop string) are the answer's last text.
                        let mut released = caller.stop.push(&caller.detokenizer.finish());
                        if !released.stopped {
                            released.text.push_str(&caller.stop.finish());
                        }
                        released
                    } else if caller.sampling.holds_ends(caller.tokens.len() as u32 - caller.prompt) {
                        // One of the answer's first min_tokens tokens: no stop string yet.
                        caller.stop.pass(&caller.detokenizer.push(token))
                    } else {
                        caller.stop.push(&caller.detokenizer.push(token))
                    };
                    if end || released.stopped {
                        stopped.push(m.id);
                    }
                    let logprob = logprobs.map(|l| shown(model, token, l));
                    self.sampled.insert(m.id, (token, released.text, logprob));
                }
                StepOutcome::Ran { stopped }
            }
            Err(e) => StepOutcome::Failed(e.0),
        };
        events.push(Event::StepDone { step, outcome });
    }

    /// A sequence's last text and its end, to its caller.
    fn end(&mut self, mut caller: Caller, end: End, now: Instant) {
        match end {
            End::Finished(reason) => {
                if reason == FinishReason::Length {
                    // A character cut by max_tokens, then what the stop matcher held.
                    let cut = caller.detokenizer.finish();
                    let mut rest = caller.stop.push(&cut).text;
                    rest.push_str(&caller.stop.finish());
                    if !rest.is_empty() {
                        caller.reply.send(Piece::Text(rest, None), now);
                    }
                }
                let completion_tokens = caller.tokens.len() as u32 - caller.prompt;
                self.capacity.finished(completion_tokens);
                let finished = caller.reply.finished(reason, caller.prompt, completion_tokens);
                caller.reply.send(Piece::End(Ok(finished)), now);
            }
            End::Unfinished(refusal) => caller.reply.send(Piece::End(Err(refusal)), now),
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
                    sample: m.sample.then(|| caller.sampling.clone()),
                    history: if m.sample && caller.sampling.penalised() {
                        caller.tokens.as_slice().into()
                    } else {
                        Arc::from([])
                    },
                }
            })
            .collect();
        let run = self.engine.step(StepInput { shape: plan.shape, sequences });
        self.watchdog = Some(Watchdog::new(step, ferry_core::clock::now(), plan.expected));
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
        let limits = Limits::of(s.policy(), s.pool());
        self.capacity.publish(now, &self.metrics, |shape, targets| capacity::capacity(&cost, shape, targets, &limits));
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
        let (queries, hits) = s.prefix_stats();
        self.metrics.prefix_queries.inc_by(queries - self.prefix_counted.0);
        self.metrics.prefix_hits.inc_by(hits - self.prefix_counted.1);
        self.prefix_counted = (queries, hits);
    }
}

/// A drawn token's log-probabilities with the tokens as the model shows them.
fn shown(model: &dyn LanguageModel, token: u32, l: Logprobs) -> Box<TokenLogprob> {
    Box::new(TokenLogprob {
        token: model.token_shown(token),
        logprob: l.logprob,
        top: l.top.into_iter().map(|(t, p)| (model.token_shown(t), p)).collect(),
    })
}
