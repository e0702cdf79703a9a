//! The async shell around one model version's [`Scheduler`]: it owns the waiting callers, sleeps
//! until the scheduler's next timer, runs batches on the engine, and answers every admitted
//! request exactly once — 200 with its own rows, 504 at its deadline, or 500 when the engine
//! failed — or counts it `cancelled` when its caller went away.
//!
//! When a batch fails (an engine error, a panic, or the watchdog giving up on it), the requests
//! it carried are retried within their deadline and attempt budget, and a poison row is isolated
//! by bisection ([`ferry_core::recovery`]). Every run of a request is an attempt with its own number;
//! a result for an attempt that is no longer current (the watchdog gave up on it) or for a
//! request already answered at its deadline is discarded and counted in
//! `ferry_late_results_total`.
//!
//! One task owns all of this state, so there are no locks; callers talk to it over a channel.
//! At each instant it handles events in the order [`ferry_core::replay`] uses (finished batches,
//! deadlines, arrivals, dispatches), which is what makes the paused-clock tests exact.

use std::collections::{BTreeSet, HashMap};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::engine::{BatchOutputs, Engine, EngineError, Inputs};
use crate::metrics::ModelMetrics;
use crate::tensor::Tensor;
use ferry_core::estimate::CostModel;
use ferry_core::outcome::{Outcome, Refusal};
use ferry_core::recovery::{self, Member, Recovery};
use ferry_core::scheduler::Scheduler;
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
    pub arrival: Instant,
    pub deadline: Instant,
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

/// What travels to the caller: an answer still to be settled, or a refusal (already counted).
type Delivery = Result<(Answer, Settle), Refusal>;

/// Counts an answer's outcome at the moment its caller takes it, not when the batcher sent it:
/// an answer that reaches its caller after the deadline becomes a 504 (and a late result), and
/// one whose caller went away is `cancelled` — so the count is of what callers actually got.
struct Settle {
    metrics: ModelMetrics,
    arrival: Instant,
    deadline: Instant,
    done: bool,
}

impl Settle {
    fn settle(mut self, now: Instant) -> Result<(), Refusal> {
        self.done = true;
        self.metrics.request_duration.observe((now - self.arrival).as_secs_f64());
        if now <= self.deadline {
            self.metrics.count(Outcome::Ok);
            return Ok(());
        }
        self.metrics.count(Outcome::Expired);
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

impl Drop for Settle {
    fn drop(&mut self) {
        if !self.done {
            self.metrics.count(Outcome::Cancelled);
        }
    }
}

enum Command {
    Submit { id: RequestId, submission: Submission, reply: oneshot::Sender<Delivery> },
    Cancel(RequestId),
    Drain(oneshot::Sender<()>),
    Calibrate(CostModel),
    TimerLateness(Vec<Duration>),
}

/// A handle to one model version's batcher task. Cheap to clone.
#[derive(Clone)]
pub struct Batcher {
    commands: mpsc::UnboundedSender<Command>,
    next_id: Arc<AtomicU64>,
    /// Arrival of the oldest queued request, in ns since `epoch`; `u64::MAX` when empty. Lets
    /// `/metrics` compute the age at scrape time without asking the task.
    oldest_ns: Arc<AtomicU64>,
    epoch: Instant,
    metrics: ModelMetrics,
}

impl Batcher {
    /// Starts the batcher task on the current tokio runtime.
    pub fn spawn(scheduler: Scheduler, engine: Arc<dyn Engine>, metrics: ModelMetrics, retry: RetryPolicy) -> Batcher {
        let (commands, rx) = mpsc::unbounded_channel();
        let epoch = Instant::now();
        let oldest_ns = Arc::new(AtomicU64::new(u64::MAX));
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        metrics.idle.set(scheduler.workers() as i64);
        let task = Task {
            scheduler,
            engine,
            retry,
            metrics: metrics.clone(),
            waiters: HashMap::new(),
            outside: BTreeSet::new(),
            running: HashMap::new(),
            watchdogs: BTreeSet::new(),
            held: HashMap::new(),
            next_seq: 0,
            done_tx,
            drains: Vec::new(),
            oldest_ns: oldest_ns.clone(),
            epoch,
        };
        tokio::spawn(task.run(rx, done_rx));
        Batcher { commands, next_id: Arc::new(AtomicU64::new(0)), oldest_ns, epoch, metrics }
    }

    /// Hands a request to the scheduler. The returned [`Pending`] resolves to its reply
    /// (immediately if admission refused it); dropping it cancels the request.
    pub fn submit(&self, submission: Submission) -> Pending {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, rx) = oneshot::channel();
        let sent = self.commands.send(Command::Submit { id, submission, reply }).is_ok();
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

    /// Sets `ferry_queue_oldest_age_seconds` from the current time.
    pub fn refresh_age(&self) {
        let oldest = self.oldest_ns.load(Ordering::Relaxed);
        let age = if oldest == u64::MAX {
            0.0
        } else {
            let arrival = self.epoch + Duration::from_nanos(oldest);
            Instant::now().saturating_duration_since(arrival).as_secs_f64()
        };
        self.metrics.oldest_age.set(age);
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
        match delivery {
            Ok(Ok((answer, settle))) => {
                let now = Instant::now();
                settle.settle(now).map(|()| Answer { answered_at: now, ..answer })
            }
            Ok(Err(refusal)) => Err(refusal),
            Err(_) => Err(Refusal::new(Outcome::Failed, "the batcher stopped before answering")),
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.commands.send(Command::Cancel(self.id));
        }
    }
}

/// How failed batches are retried.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Runs a request may ride in, the first included.
    pub max_attempts: u32,
    /// The watchdog gives up on a batch after this many times its expected time...
    pub watchdog_factor: f64,
    /// ...plus this, so that a batch expected to take no time is not given up at once.
    pub watchdog_grace: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { max_attempts: 3, watchdog_factor: 3.0, watchdog_grace: Duration::from_millis(10) }
    }
}

/// Where an admitted, unanswered request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// In the scheduler (queue or probe).
    Waiting,
    /// Riding in the running batch of this sequence number.
    Running(u64),
    /// Held back while a probe runs.
    Held,
}

struct Waiter {
    /// `None` once answered: it stays only as a tombstone until its running batch returns, so
    /// that the batch's result for it is counted late rather than lost.
    reply: Option<oneshot::Sender<Delivery>>,
    expired: bool,
    ticket: Ticket,
    inputs: Inputs,
    place: Place,
    attempts: u32,
    failures: u32,
    last_error: Option<EngineError>,
}

struct BatchDone {
    seq: u64,
    result: Result<BatchOutputs, EngineError>,
}

struct Running {
    worker: usize,
    dispatched_at: Instant,
    watchdog: Instant,
    rows: u32,
    /// (request, attempt) in batch order.
    members: Vec<(RequestId, u32)>,
    /// When this batch is a probe: the group held back until it ends.
    held: Option<u64>,
}

struct Task {
    scheduler: Scheduler,
    engine: Arc<dyn Engine>,
    retry: RetryPolicy,
    metrics: ModelMetrics,
    waiters: HashMap<RequestId, Waiter>,
    /// Deadlines of unanswered requests that are not in the scheduler (running or held): they
    /// are answered 504 at their deadline, not when their batch ends.
    outside: BTreeSet<(Instant, RequestId)>,
    running: HashMap<u64, Running>,
    watchdogs: BTreeSet<(Instant, u64)>,
    /// Groups held back behind a probe, by probe tag.
    held: HashMap<u64, Vec<RequestId>>,
    next_seq: u64,
    done_tx: mpsc::UnboundedSender<BatchDone>,
    drains: Vec<oneshot::Sender<()>>,
    oldest_ns: Arc<AtomicU64>,
    epoch: Instant,
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
        let mut probe = Instant::now() + TIMER_PROBE;
        let mut waiting_for: Option<Instant> = None;
        loop {
            let now = Instant::now();
            // How late the loop got to the instant it slept for (the timer's lateness, or the
            // time spent on the events that came first): part of the deadline margin.
            if let Some(due) = waiting_for.filter(|due| *due <= now) {
                self.scheduler.observe_wake(now - due);
            }
            if now >= probe {
                probe = now + TIMER_PROBE;
            }
            self.watchdog(now);
            self.expire(now);
            self.dispatch(now);
            self.publish();
            if self.is_idle() {
                self.drains.drain(..).for_each(|d| {
                    let _ = d.send(());
                });
                if !open && self.running.is_empty() {
                    return;
                }
            }
            let wake = [
                self.scheduler.next_wake(now),
                self.outside.first().map(|(d, _)| *d),
                self.watchdogs.first().map(|(w, _)| *w),
                open.then_some(probe),
            ]
            .into_iter()
            .flatten()
            .min();
            waiting_for = wake;
            tokio::select! {
                biased;
                Some(batch) = done.recv() => self.finish(batch),
                command = commands.recv(), if open => match command {
                    Some(Command::Submit { id, submission, reply }) => self.admit(id, submission, reply),
                    Some(Command::Cancel(id)) => self.cancel(id),
                    Some(Command::Drain(tx)) => self.drains.push(tx),
                    Some(Command::Calibrate(cost)) => self.scheduler.calibrate(cost),
                    Some(Command::TimerLateness(samples)) => samples.into_iter().for_each(|l| self.scheduler.observe_wake(l)),
                    None => open = false,
                },
                () = sleep_until(wake) => {}
            }
        }
    }

    /// Every admitted request has been answered.
    fn is_idle(&self) -> bool {
        self.scheduler.queue_depth() == 0 && self.outside.is_empty()
    }

    fn admit(&mut self, id: RequestId, s: Submission, reply: oneshot::Sender<Delivery>) {
        let now = Instant::now();
        let ticket = Ticket {
            id,
            arrival: s.arrival,
            deadline: s.deadline,
            rows: s.rows,
            bytes: s.bytes,
            priority: s.priority,
            tokens: s.tokens,
        };
        match self.scheduler.admit(ticket, now) {
            Ok(()) => {
                let waiter = Waiter {
                    reply: Some(reply),
                    expired: false,
                    ticket,
                    inputs: Arc::new(s.inputs),
                    place: Place::Waiting,
                    attempts: 0,
                    failures: 0,
                    last_error: None,
                };
                self.waiters.insert(id, waiter);
            }
            Err(refusal) => {
                self.metrics.count(refusal.outcome);
                let _ = reply.send(Err(refusal));
            }
        }
    }

    fn cancel(&mut self, id: RequestId) {
        let Some(w) = self.waiters.get_mut(&id) else { return };
        if w.reply.is_none() {
            return; // already answered
        }
        w.reply = None;
        self.metrics.count(Outcome::Cancelled);
        match w.place {
            Place::Waiting => {
                self.scheduler.cancel(id);
                self.waiters.remove(&id);
            }
            Place::Held => {
                self.outside.remove(&(w.ticket.deadline, id));
                self.waiters.remove(&id);
            }
            // Its batch's result will be dropped when it comes.
            Place::Running(_) => {
                self.outside.remove(&(w.ticket.deadline, id));
            }
        }
    }

    /// Gives up on batches that ran past their watchdog: their worker slot is freed, and their
    /// requests are handled as if the batch had failed; a result that comes later is stale.
    fn watchdog(&mut self, now: Instant) {
        while let Some(&(at, seq)) = self.watchdogs.first() {
            if at > now {
                break;
            }
            self.watchdogs.pop_first();
            let Some(run) = self.running.remove(&seq) else { continue };
            self.scheduler.abandon(run.worker);
            let error = EngineError(format!(
                "the batch did not finish within {} ms (the watchdog gives up at {}× the expected time)",
                (now - run.dispatched_at).as_millis(),
                self.retry.watchdog_factor
            ));
            tracing::warn!(%error, rows = run.rows, "watchdog: giving up on a batch and replacing its worker");
            self.failed(run, error, now);
        }
    }

    /// Answers 504 for requests whose deadline has come, wherever they are.
    fn expire(&mut self, now: Instant) {
        for ticket in self.scheduler.expire(now) {
            if let Some(w) = self.waiters.remove(&ticket.id) {
                let message = format!(
                    "deadline passed: waited {} ms for a worker; the deadline was {} ms after arrival",
                    (now - w.ticket.arrival).as_millis(),
                    (w.ticket.deadline - w.ticket.arrival).as_millis()
                );
                self.reply(w.reply, Err(Refusal::new(Outcome::Expired, message)), &w.ticket, now);
            }
        }
        while let Some(&(deadline, id)) = self.outside.first() {
            if deadline > now {
                break;
            }
            self.outside.pop_first();
            let Some(w) = self.waiters.get_mut(&id) else { continue };
            let (tx, ticket) = (w.reply.take(), w.ticket);
            let arrival = ticket.arrival;
            w.expired = true;
            let where_ = if matches!(w.place, Place::Held) {
                self.waiters.remove(&id);
                "while its batch was retried"
            } else {
                "while its batch was running"
            };
            let message = format!(
                "deadline passed {where_}: waited {} ms; the deadline was {} ms after arrival",
                (now - arrival).as_millis(),
                (deadline - arrival).as_millis()
            );
            self.reply(tx, Err(Refusal::new(Outcome::Expired, message)), &ticket, now);
        }
    }

    fn dispatch(&mut self, now: Instant) {
        while let Some(batch) = self.scheduler.take(now) {
            for ticket in batch.doomed {
                if let Some(w) = self.waiters.remove(&ticket.id) {
                    let message = format!(
                        "deadline cannot be met any more: a batch leaving now would end in {} ms, the deadline is in {} ms",
                        self.scheduler.estimate(batch.shape).as_millis(),
                        ticket.deadline.saturating_duration_since(now).as_millis()
                    );
                    self.reply(w.reply, Err(Refusal::new(Outcome::Expired, message)), &ticket, now);
                }
            }
            let held = batch.probe.filter(|tag| self.held.contains_key(tag));
            if batch.tickets.is_empty() {
                // Nobody left to run: the probe proved nothing, so its held group is retried plainly.
                if let Some(tag) = held {
                    let group = self.held.remove(&tag).unwrap_or_default();
                    self.apply(Recovery { requeue: group, ..Recovery::default() }, now);
                }
                continue;
            }
            let seq = self.next_seq;
            self.next_seq += 1;
            let mut inputs = Vec::with_capacity(batch.tickets.len());
            let mut members = Vec::with_capacity(batch.tickets.len());
            for ticket in &batch.tickets {
                let w = self.waiters.get_mut(&ticket.id).expect("every waiting ticket has a waiter");
                w.attempts += 1;
                w.place = Place::Running(seq);
                if w.attempts == 1 {
                    self.metrics.queue_wait.observe((now - w.ticket.arrival).as_secs_f64());
                }
                self.outside.insert((w.ticket.deadline, ticket.id));
                inputs.push(w.inputs.clone());
                members.push((ticket.id, w.attempts));
            }
            self.metrics.batch_size.observe(f64::from(batch.rows));
            let expected = self.scheduler.estimate(batch.shape);
            let watchdog = now + expected.mul_f64(self.retry.watchdog_factor) + self.retry.watchdog_grace;
            self.watchdogs.insert((watchdog, seq));
            self.running.insert(
                seq,
                Running { worker: batch.worker, dispatched_at: now, watchdog, rows: batch.rows, members, held },
            );
            let run = self.engine.infer(inputs);
            let done = self.done_tx.clone();
            tokio::spawn(async move {
                // A panic in the engine becomes an error here instead of a worker that never
                // frees up.
                let result = match AssertUnwindSafe(run).catch_unwind().await {
                    Ok(result) => result,
                    Err(panic) => Err(EngineError(format!("the engine panicked: {}", panic_message(&*panic)))),
                };
                let _ = done.send(BatchDone { seq, result });
            });
        }
    }

    fn finish(&mut self, done: BatchDone) {
        let now = Instant::now();
        let Some(run) = self.running.remove(&done.seq) else {
            // The watchdog gave up on this batch and its requests moved on: every result is stale.
            if let Ok(outputs) = &done.result {
                self.metrics.late_results.inc_by(outputs.len() as u64);
            }
            return;
        };
        self.watchdogs.remove(&(run.watchdog, done.seq));
        // Only batches that ran to the end teach the estimator: a failure's time says nothing
        // about how long a batch takes.
        if done.result.is_ok() {
            self.scheduler.finish(run.worker, now);
        } else {
            self.scheduler.abandon(run.worker);
        }
        self.metrics.batch_duration.observe((now - run.dispatched_at).as_secs_f64());
        let outputs = match done.result {
            Ok(outputs) if outputs.len() == run.members.len() => outputs,
            Ok(outputs) => {
                let error = EngineError(format!(
                    "the engine returned outputs for {} requests of a batch of {}",
                    outputs.len(),
                    run.members.len()
                ));
                return self.failed(run, error, now);
            }
            Err(error) => return self.failed(run, error, now),
        };
        for (&(id, attempt), outputs) in run.members.iter().zip(outputs) {
            let Some(w) = self.waiters.get(&id) else { continue };
            if w.attempts != attempt {
                self.metrics.late_results.inc();
                continue;
            }
            let w = self.waiters.remove(&id).expect("just found");
            self.outside.remove(&(w.ticket.deadline, id));
            if w.expired {
                self.metrics.late_results.inc();
                continue;
            }
            let answer = Answer {
                outputs,
                batch_rows: run.rows,
                queued: run.dispatched_at - w.ticket.arrival,
                engine: now - run.dispatched_at,
                answered_at: now,
            };
            self.reply(w.reply, Ok(answer), &w.ticket, now);
        }
        if let Some(tag) = run.held {
            let group = self.held.remove(&tag).unwrap_or_default();
            let members = self.members(&group);
            let recovery = recovery::on_probe_success(&members, self.retry.max_attempts);
            self.apply(recovery, now);
        }
    }

    /// A batch failed or was given up on: its unanswered requests are retried or condemned.
    fn failed(&mut self, run: Running, error: EngineError, now: Instant) {
        tracing::debug!(%error, rows = run.rows, "batch failed");
        let mut live = Vec::new();
        for &(id, attempt) in &run.members {
            let Some(w) = self.waiters.get_mut(&id) else { continue };
            if w.attempts != attempt {
                continue;
            }
            if w.reply.is_none() {
                // Answered at its deadline, or cancelled, while the batch ran: nothing to retry.
                self.waiters.remove(&id);
                continue;
            }
            w.failures += 1;
            w.last_error = Some(error.clone());
            w.place = Place::Held;
            live.push(id);
        }
        let group = run.held.and_then(|tag| self.held.remove(&tag)).unwrap_or_default();
        let (failed, held) = (self.members(&live), self.members(&group));
        let recovery = recovery::on_failure(&failed, &held, self.retry.max_attempts);
        self.apply(recovery, now);
    }

    fn members(&self, ids: &[RequestId]) -> Vec<Member> {
        ids.iter()
            .filter_map(|id| {
                self.waiters.get(id).map(|w| Member { id: *id, attempts: w.attempts, failures: w.failures })
            })
            .collect()
    }

    fn apply(&mut self, mut recovery: Recovery, now: Instant) {
        // Nobody runs more often than the attempt budget allows.
        let spent = |id: &RequestId| self.waiters.get(id).is_some_and(|w| w.attempts >= self.retry.max_attempts);
        let mut over: Vec<RequestId> = recovery.requeue.extract_if(.., |id| spent(id)).collect();
        if let Some(probe) = &mut recovery.probe {
            over.extend(probe.run.extract_if(.., |id| spent(id)));
        }
        recovery.condemn.extend(over);
        for id in recovery.condemn {
            let Some(w) = self.waiters.remove(&id) else { continue };
            self.outside.remove(&(w.ticket.deadline, id));
            let error = w.last_error.map_or_else(|| "engine error".to_owned(), |e| e.to_string());
            let message = format!("{error} (failed {} of {} attempts; retries stopped)", w.failures, w.attempts);
            self.reply(w.reply, Err(Refusal::new(Outcome::Failed, message)), &w.ticket, now);
        }
        for id in recovery.requeue {
            if let Some(ticket) = self.leave_outside(id, Place::Waiting) {
                self.scheduler.requeue(ticket);
            }
        }
        if let Some(probe) = recovery.probe {
            let tag = self.next_seq;
            self.next_seq += 1;
            let run: Vec<Ticket> = probe.run.iter().filter_map(|&id| self.leave_outside(id, Place::Waiting)).collect();
            for &id in &probe.hold {
                if let Some(w) = self.waiters.get_mut(&id) {
                    w.place = Place::Held;
                }
            }
            self.held.insert(tag, probe.hold);
            self.scheduler.add_probe(tag, run);
        }
    }

    /// Moves an unanswered request from outside the scheduler back to `place`.
    fn leave_outside(&mut self, id: RequestId, place: Place) -> Option<Ticket> {
        let w = self.waiters.get_mut(&id)?;
        self.outside.remove(&(w.ticket.deadline, id));
        w.place = place;
        Some(w.ticket)
    }

    /// Sends a reply. Refusals are counted here; an answer is counted when its caller takes it
    /// ([`Settle`]). A reply that finds nobody listening counts as `cancelled`: the caller went
    /// away before its cancellation reached the batcher.
    fn reply(&mut self, tx: Option<oneshot::Sender<Delivery>>, reply: Reply, ticket: &Ticket, now: Instant) {
        let Some(tx) = tx else { return };
        let delivery = match reply {
            Ok(answer) => {
                let settle = Settle {
                    metrics: self.metrics.clone(),
                    arrival: ticket.arrival,
                    deadline: ticket.deadline,
                    done: false,
                };
                Ok((answer, settle))
            }
            Err(refusal) => Err(refusal),
        };
        let refused = delivery.as_ref().err().map(|r| r.outcome);
        match tx.send(delivery) {
            Ok(()) => {
                if let Some(outcome) = refused {
                    self.metrics.count(outcome);
                    self.metrics.request_duration.observe((now - ticket.arrival).as_secs_f64());
                }
            }
            // An unsettled answer counts itself as cancelled when dropped.
            Err(Ok(_)) => {}
            Err(Err(_)) => self.metrics.count(Outcome::Cancelled),
        }
    }

    fn publish(&self) {
        let busy = self.scheduler.busy_workers();
        self.metrics.busy.set(busy as i64);
        self.metrics.idle.set((self.scheduler.workers() - busy) as i64);
        self.metrics.queue_depth.set(self.scheduler.queue_depth() as i64);
        self.metrics.queue_bytes.set(self.scheduler.queue_bytes() as i64);
        let oldest = self.scheduler.oldest_arrival().map_or(u64::MAX, |a| (a - self.epoch).as_nanos() as u64);
        self.oldest_ns.store(oldest, Ordering::Relaxed);
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
        let due = Instant::now() + Duration::from_millis(1);
        tokio::time::sleep_until(due).await;
        samples.push(Instant::now().saturating_duration_since(due));
    }
    samples
}

async fn sleep_until(wake: Option<Instant>) {
    match wake {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
