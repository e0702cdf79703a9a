//! The async shell around one model version's [`Ledger`]: it keeps what the ledger must not hold
//! (the callers' reply channels, the requests' inputs, the engine's outputs), gathers the events
//! of an instant, hands them to the ledger, and carries out its effects: batches to the engine,
//! answers and refusals to the callers, metrics. Every decision — admission, dispatch, deadlines
//! of running requests, retries and poison isolation, attempt fencing, the watchdog — is the
//! ledger's, so that [`ferry_core::replay`] of the same events gives the same outcomes.
//!
//! Every admitted request is answered exactly once — 200 with its own rows, 504 at its deadline,
//! or 500 when the engine failed — or counted `cancelled` when its caller went away.
//!
//! One task owns all of this state, so there are no locks; callers talk to it over a channel.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot, watch};

use crate::engine::{BatchOutputs, Engine, EngineError, Inputs};
use crate::metrics::ModelMetrics;
use crate::tally::Tally;
use crate::task::{sleep_until, OldestArrival, Stopped};
use crate::tensor::Tensor;
use ferry_core::estimate::CostModel;
pub use ferry_core::ledger::RetryPolicy;
use ferry_core::ledger::{Dispatch, Effect, Event, Ledger};
use ferry_core::lockout::Lockout;
use ferry_core::outcome::{Outcome, Refusal};
use ferry_core::scheduler::Scheduler;
use ferry_core::tenant::TenantId;
use ferry_core::ticket::{Priority, RequestId, Ticket, Tokens};

/// A request for the batcher: its payload and what admission needs to know.
#[derive(Debug)]
pub struct Submission {
    pub inputs: Vec<Tensor>,
    pub rows: u32,
    /// What the engine said the rows weigh in tokens ([`crate::engine::Engine::check`]).
    pub tokens: Tokens,
    pub bytes: u64,
    pub priority: Priority,
    /// Whose it is, and the tenant's weight.
    pub tenant: TenantId,
    pub weight: u32,
    pub arrival: Instant,
    pub deadline: Instant,
    /// Counts how the request ends; it comes back with the reply, and counts when the caller
    /// takes it ([`Pending::reply`]).
    pub tally: Tally,
}

/// A successful answer.
#[derive(Debug, Clone)]
pub struct Answer {
    pub outputs: Vec<Tensor>,
    /// Rows of the batch it rode in (`x-ferry-batch-size`).
    pub batch_rows: u32,
    /// Admission to dispatch.
    pub queued: Duration,
    /// Dispatch to result.
    pub engine: Duration,
    /// When the caller took it (and its deadline was checked): the end of `server-timing`.
    pub answered_at: Instant,
}

pub type Reply = Result<Answer, Refusal>;

/// What travels to the caller: an answer still to be settled, or a refusal, with the request's
/// tally, which counts the outcome when the caller takes it (or `cancelled` if nobody does).
type Delivery = (Result<(Answer, Settle), Refusal>, Tally);

/// Settles an answer at the moment its caller takes it, not when the batcher sent it: an answer
/// that reaches its caller after the deadline becomes a 504 (and a late result).
struct Settle {
    metrics: ModelMetrics,
    arrival: Instant,
    deadline: Instant,
}

impl Settle {
    fn settle(self, now: Instant) -> Result<(), Refusal> {
        self.metrics.request_duration.observe((now - self.arrival).as_secs_f64());
        if now <= self.deadline {
            return Ok(());
        }
        self.metrics.late_results.inc();
        Err(Refusal::new(
            Outcome::Expired,
            format!(
                "deadline passed while the answer was on its way: {} ms after arrival; the deadline was {} ms",
                (now - self.arrival).as_millis(),
                (self.deadline - self.arrival).as_millis()
            ),
        ))
    }
}

enum Command {
    Submit {
        id: RequestId,
        submission: Box<Submission>,
        reply: oneshot::Sender<Delivery>,
    },
    Cancel(RequestId),
    Drain(oneshot::Sender<()>),
    Calibrate(CostModel),
    TimerLateness(Vec<Duration>),
    /// An answer took this long from the batcher to its caller.
    Trip(Duration),
}

/// A handle to one model version's batcher task. Cheap to clone.
#[derive(Clone)]
pub struct Batcher {
    commands: mpsc::UnboundedSender<Command>,
    next_id: Arc<AtomicU64>,
    /// Arrival of the oldest queued request: `/metrics` computes the age at scrape time.
    oldest: OldestArrival,
    metrics: ModelMetrics,
    /// Turns true when the task has ended: after a drain, or because it panicked.
    stopped: watch::Receiver<bool>,
}

impl Batcher {
    /// Starts the batcher task on the current tokio runtime.
    pub fn spawn(scheduler: Scheduler, engine: Arc<dyn Engine>, metrics: ModelMetrics, retry: RetryPolicy) -> Batcher {
        let (commands, rx) = mpsc::unbounded_channel();
        let oldest = OldestArrival::new();
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        metrics.idle.set(scheduler.workers() as i64);
        let task = Task {
            lockout: Lockout::default(),
            ledger: Ledger::new(scheduler, retry),
            engine,
            metrics: metrics.clone(),
            callers: HashMap::new(),
            outputs: HashMap::new(),
            done_tx,
            drains: Vec::new(),
            oldest: oldest.clone(),
        };
        let (stopped_tx, stopped) = watch::channel(false);
        tokio::spawn(async move {
            let _stopped = Stopped(stopped_tx);
            task.run(rx, done_rx).await;
        });
        Batcher { commands, next_id: Arc::new(AtomicU64::new(0)), oldest, metrics, stopped }
    }

    /// Hands a request to the scheduler. The returned [`Pending`] resolves to its reply
    /// (immediately if admission refused it); dropping it cancels the request.
    pub fn submit(&self, submission: Submission) -> Pending {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, rx) = oneshot::channel();
        let sent = match self.commands.send(Command::Submit { id, submission: Box::new(submission), reply }) {
            Ok(()) => true,
            Err(mpsc::error::SendError(command)) => {
                // The batcher task is gone (a bug stopped it): the request fails here.
                if let Command::Submit { submission, .. } = command {
                    submission.tally.count(Outcome::Failed);
                }
                false
            }
        };
        Pending { id, rx, commands: self.commands.clone(), finished: !sent }
    }

    /// Replaces the batch-time estimator's starting model, e.g. with the figures an engine measured
    /// while it loaded (before any request was admitted).
    pub fn calibrate(&self, cost: CostModel) {
        let _ = self.commands.send(Command::Calibrate(cost));
    }

    /// Tells the scheduler how late this runtime's timers fire, measured before the first request
    /// (see [`measure_timer_lateness`]), so that the first deadline-driven batch already leaves
    /// early enough.
    pub fn timer_lateness(&self, samples: Vec<Duration>) {
        let _ = self.commands.send(Command::TimerLateness(samples));
    }

    /// Resolves once every admitted request has been answered.
    pub async fn drain(&self) {
        let (tx, rx) = oneshot::channel();
        if self.commands.send(Command::Drain(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    pub fn metrics(&self) -> &ModelMetrics {
        &self.metrics
    }

    /// Whether the task still runs. One that stopped without a drain died of a bug: the sidecar
    /// must not report ready, and should exit so that it is restarted.
    pub fn is_alive(&self) -> bool {
        !*self.stopped.borrow()
    }

    /// Resolves when the task has ended.
    pub async fn stopped(&self) {
        let mut stopped = self.stopped.clone();
        let _ = stopped.wait_for(|s| *s).await;
    }

    /// Sets `ferry_queue_oldest_age_seconds` from the current time.
    pub fn refresh_age(&self) {
        self.metrics.oldest_age.set(self.oldest.age());
    }
}

/// A submitted request's reply to come. Dropping it before the reply came (the caller went
/// away) tells the batcher, which takes the request out of the queue.
pub struct Pending {
    id: RequestId,
    rx: oneshot::Receiver<Delivery>,
    commands: mpsc::UnboundedSender<Command>,
    finished: bool,
}

impl Pending {
    /// The reply, settled at the moment it is taken (see [`Settle`]): call it right before
    /// answering the caller.
    pub async fn reply(mut self) -> Reply {
        let delivery = (&mut self.rx).await;
        self.finished = true;
        let (reply, tally) = match delivery {
            Ok((Ok((answer, settle)), tally)) => {
                let now = ferry_core::clock::now();
                // `answered_at` is when the batcher sent it: the trip is part of the deadline margin.
                let _ = self.commands.send(Command::Trip(now.saturating_duration_since(answer.answered_at)));
                (settle.settle(now).map(|()| Answer { answered_at: now, ..answer }), tally)
            }
            Ok((Err(refusal), tally)) => (Err(refusal), tally),
            // Its tally went with the batcher task (and counted `failed`), or with the submission.
            Err(_) => return Err(Refusal::new(Outcome::Failed, "the batcher stopped before answering")),
        };
        tally.count(reply.as_ref().map_or_else(|r| r.outcome, |_| Outcome::Ok));
        reply
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.commands.send(Command::Cancel(self.id));
        }
    }
}

/// A caller waiting for its request's end, and the request's inputs (kept for retries).
struct Caller {
    reply: oneshot::Sender<Delivery>,
    tally: Tally,
    inputs: Inputs,
    arrival: Instant,
    deadline: Instant,
}

struct BatchDone {
    seq: u64,
    result: Result<BatchOutputs, EngineError>,
}

struct Task {
    ledger: Ledger,
    engine: Arc<dyn Engine>,
    metrics: ModelMetrics,
    callers: HashMap<RequestId, Caller>,
    /// The outputs of a batch that just ended, by sequence number, until the ledger says whose
    /// they are (within the same step).
    outputs: HashMap<u64, Vec<Option<Vec<Tensor>>>>,
    done_tx: mpsc::UnboundedSender<BatchDone>,
    drains: Vec<oneshot::Sender<()>>,
    oldest: OldestArrival,
    /// Whether it refuses every request while idle ([`ferry_core::lockout`]).
    lockout: Lockout,
}

/// The task wakes at least this often while it serves (on a fixed schedule that arrivals do not
/// postpone), so that its lateness (part of the deadline margin) is measured all the time, whatever
/// the load: were it measured only on the timers that requests set, one late wake among few (a
/// process paused for 300 ms) could keep the margin so wide that every request is refused, and so
/// no timer is set that would measure again.
const TIMER_PROBE: Duration = Duration::from_millis(50);

impl Task {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut done: mpsc::UnboundedReceiver<BatchDone>,
    ) {
        let mut open = true;
        let mut probe = ferry_core::clock::now() + TIMER_PROBE;
        let mut waiting_for: Option<Instant> = None;
        let mut events = Vec::new();
        let mut effects = Vec::new();
        loop {
            let now = ferry_core::clock::now();
            // How late the loop got to the instant it slept for (the timer's lateness, or the
            // time spent on the events that came first): part of the deadline margin.
            if let Some(due) = waiting_for.filter(|due| *due <= now) {
                events.push(Event::Woke(now - due));
            }
            if now >= probe {
                probe = now + TIMER_PROBE;
            }
            self.ledger.step(now, std::mem::take(&mut events), &mut effects);
            for effect in effects.drain(..) {
                self.carry_out(effect, now);
            }
            self.outputs.clear();
            self.publish();
            self.metrics.lockout.show(self.lockout.locked(now));
            if self.ledger.is_idle() {
                self.drains.drain(..).for_each(|d| {
                    let _ = d.send(());
                });
                if !open && self.ledger.running() == 0 {
                    return;
                }
            }
            let wake = [self.ledger.next_wake(now), open.then_some(probe)].into_iter().flatten().min();
            waiting_for = wake;
            tokio::select! {
                biased;
                Some(batch) = done.recv() => self.finished(batch, &mut events),
                command = commands.recv(), if open => match command {
                    Some(command) => self.command(command, &mut events),
                    None => open = false,
                },
                () = sleep_until(wake) => {}
            }
            // Everything else that is ready at this instant joins the same step: other tasks
            // (callers, the engine) get to run first, and their events are gathered until none
            // comes. On tokio's paused clock the instant cannot pass meanwhile.
            loop {
                tokio::task::yield_now().await;
                let before = events.len();
                while let Ok(batch) = done.try_recv() {
                    self.finished(batch, &mut events);
                }
                while open {
                    match commands.try_recv() {
                        Ok(command) => self.command(command, &mut events),
                        Err(mpsc::error::TryRecvError::Empty) => break,
                        Err(mpsc::error::TryRecvError::Disconnected) => open = false,
                    }
                }
                if events.len() == before {
                    break;
                }
            }
        }
    }

    fn command(&mut self, command: Command, events: &mut Vec<Event>) {
        match command {
            Command::Submit { id, submission: s, reply } => {
                let ticket = Ticket {
                    id,
                    arrival: s.arrival,
                    deadline: s.deadline,
                    rows: s.rows,
                    bytes: s.bytes,
                    priority: s.priority,
                    tenant: s.tenant,
                    weight: s.weight,
                    tokens: s.tokens,
                };
                let caller = Caller {
                    reply,
                    tally: s.tally,
                    inputs: Arc::new(s.inputs),
                    arrival: s.arrival,
                    deadline: s.deadline,
                };
                self.callers.insert(id, caller);
                events.push(Event::Submit(ticket));
            }
            Command::Cancel(id) => {
                // Its tally, dropped with it, counts `cancelled`; the ledger sends nothing more for it.
                self.callers.remove(&id);
                events.push(Event::Cancel(id));
            }
            Command::Drain(tx) => self.drains.push(tx),
            Command::Calibrate(cost) => events.push(Event::Calibrate(cost)),
            Command::TimerLateness(samples) => events.extend(samples.into_iter().map(Event::Woke)),
            Command::Trip(trip) => events.push(Event::Trip(trip)),
        }
    }

    fn finished(&mut self, done: BatchDone, events: &mut Vec<Event>) {
        let result = match done.result {
            Ok(outputs) => {
                let n = outputs.len();
                self.outputs.insert(done.seq, outputs.into_iter().map(Some).collect());
                Ok(n)
            }
            Err(error) => Err(error.to_string()),
        };
        events.push(Event::Finished { seq: done.seq, result });
    }

    fn carry_out(&mut self, effect: Effect, now: Instant) {
        match effect {
            Effect::Dispatch(d) => {
                self.lockout.ran();
                self.dispatch(d)
            }
            Effect::Answer { id, seq, index, batch_rows, queued, engine } => {
                let outputs = self.outputs.get_mut(&seq).and_then(|o| o.get_mut(index)).and_then(Option::take);
                let Some(outputs) = outputs else { return };
                let answer = Answer { outputs, batch_rows, queued, engine, answered_at: now };
                self.reply(id, Ok(answer), true, now);
            }
            Effect::Refuse { id, refusal, admitted, .. } => {
                if !admitted && refusal.outcome == Outcome::Infeasible {
                    self.lockout.refused(now, self.ledger.is_idle(), &refusal.message);
                }
                self.reply(id, Err(refusal), admitted, now)
            }
            Effect::Late(n) => self.metrics.late_results.inc_by(n),
            Effect::BatchEnded { took, .. } => self.metrics.batch_duration.observe(took.as_secs_f64()),
            Effect::GaveUp { rows, error, .. } => {
                tracing::warn!(%error, rows, "watchdog: giving up on a batch and replacing its worker")
            }
        }
    }

    fn dispatch(&mut self, d: Dispatch) {
        for wait in &d.first_waits {
            self.metrics.queue_wait.observe(wait.as_secs_f64());
        }
        self.metrics.batch_size.observe(f64::from(d.rows));
        // Every member has its caller: the ledger never dispatches a cancelled request.
        let inputs: Vec<Inputs> =
            d.members.iter().filter_map(|id| self.callers.get(id)).map(|c| c.inputs.clone()).collect();
        let run = self.engine.infer(inputs);
        let (done, seq) = (self.done_tx.clone(), d.seq);
        tokio::spawn(async move {
            // A panic in the engine becomes an error here instead of a worker that never frees up.
            let result = match AssertUnwindSafe(run).catch_unwind().await {
                Ok(result) => result,
                Err(panic) => Err(EngineError(format!("the engine panicked: {}", panic_message(&*panic)))),
            };
            let _ = done.send(BatchDone { seq, result });
        });
    }

    /// Sends a request's end, with its tally, to its caller, which counts it when it takes it (a
    /// caller that went away meanwhile drops it, and the tally counts `cancelled`).
    fn reply(&mut self, id: RequestId, reply: Reply, admitted: bool, now: Instant) {
        let Some(caller) = self.callers.remove(&id) else { return };
        if admitted && reply.is_err() {
            self.metrics.request_duration.observe((now - caller.arrival).as_secs_f64());
        }
        let delivery = match reply {
            Ok(answer) => {
                let settle =
                    Settle { metrics: self.metrics.clone(), arrival: caller.arrival, deadline: caller.deadline };
                Ok((answer, settle))
            }
            Err(refusal) => Err(refusal),
        };
        let _ = caller.reply.send((delivery, caller.tally));
    }

    fn publish(&self) {
        let scheduler = self.ledger.scheduler();
        let busy = scheduler.busy_workers();
        self.metrics.busy.set(busy as i64);
        self.metrics.idle.set((scheduler.workers() - busy) as i64);
        self.metrics.queue_depth.set(scheduler.queue_depth() as i64);
        self.metrics.queue_bytes.set(scheduler.queue_bytes() as i64);
        self.oldest.set(scheduler.oldest_arrival());
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned())
}

/// How late this runtime's timers fire: a few short sleeps, each measured against the instant it
/// was set for. A sidecar does this at start-up, before it is ready.
pub async fn measure_timer_lateness() -> Vec<Duration> {
    let mut samples = Vec::with_capacity(8);
    for _ in 0..8 {
        let due = ferry_core::clock::now() + Duration::from_millis(1);
        ferry_core::clock::sleep_until(due).await;
        samples.push(ferry_core::clock::now().saturating_duration_since(due));
    }
    samples
}
