//! The async shell around one model version's [`Scheduler`]: it owns the waiting callers, sleeps
//! until the scheduler's next timer, runs batches on the engine, and answers every admitted
//! request exactly once — 200 with its own rows, 504 at its deadline, or 500 when the engine
//! failed — or counts it `cancelled` when its caller went away.
//!
//! One task owns all of this state, so there are no locks; callers talk to it over a channel.
//! At each instant it handles events in the order [`crate::replay`] uses (finished batches,
//! deadlines, arrivals, dispatches), which is what makes the paused-clock tests exact.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::engine::{BatchOutputs, Engine, EngineError, Inputs};
use crate::metrics::ModelMetrics;
use crate::outcome::{Outcome, Refusal};
use crate::scheduler::Scheduler;
use crate::tensor::Tensor;
use crate::ticket::{Priority, RequestId, Ticket};

/// A request for the batcher: its payload and what admission needs to know.
#[derive(Debug)]
pub struct Submission {
    pub inputs: Vec<Tensor>,
    pub rows: u32,
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
}

pub type Reply = Result<Answer, Refusal>;

enum Command {
    Submit { id: RequestId, submission: Submission, reply: oneshot::Sender<Reply> },
    Cancel(RequestId),
    Drain(oneshot::Sender<()>),
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
    pub fn spawn(scheduler: Scheduler, engine: Arc<dyn Engine>, metrics: ModelMetrics) -> Batcher {
        let (commands, rx) = mpsc::unbounded_channel();
        let epoch = Instant::now();
        let oldest_ns = Arc::new(AtomicU64::new(u64::MAX));
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        metrics.idle.set(scheduler.workers() as i64);
        let task = Task {
            scheduler,
            engine,
            metrics: metrics.clone(),
            waiters: HashMap::new(),
            running_deadlines: BTreeSet::new(),
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
    rx: oneshot::Receiver<Reply>,
    commands: mpsc::UnboundedSender<Command>,
    finished: bool,
}

impl Pending {
    pub async fn reply(mut self) -> Reply {
        let reply = (&mut self.rx).await;
        self.finished = true;
        reply.unwrap_or_else(|_| Err(Refusal::new(Outcome::Failed, "the batcher stopped before answering")))
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.commands.send(Command::Cancel(self.id));
        }
    }
}

/// What became of an admitted request that is no longer waiting for an answer while its batch
/// still runs; decides how the batch's result for it is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Expired,
    Cancelled,
}

struct Waiter {
    reply: Option<oneshot::Sender<Reply>>,
    inputs: Inputs,
    arrival: Instant,
    deadline: Instant,
    dispatched: Option<Instant>,
    ended: Option<Ended>,
}

struct BatchDone {
    worker: usize,
    dispatched_at: Instant,
    rows: u32,
    ids: Vec<RequestId>,
    result: Result<BatchOutputs, EngineError>,
}

struct Task {
    scheduler: Scheduler,
    engine: Arc<dyn Engine>,
    metrics: ModelMetrics,
    waiters: HashMap<RequestId, Waiter>,
    /// Deadlines of requests whose batch is running: they are answered 504 at their deadline,
    /// not when the batch ends.
    running_deadlines: BTreeSet<(Instant, RequestId)>,
    done_tx: mpsc::UnboundedSender<BatchDone>,
    drains: Vec<oneshot::Sender<()>>,
    oldest_ns: Arc<AtomicU64>,
    epoch: Instant,
}

impl Task {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut done: mpsc::UnboundedReceiver<BatchDone>,
    ) {
        let mut open = true;
        loop {
            let now = Instant::now();
            self.expire(now);
            self.dispatch(now);
            self.publish();
            if self.is_idle() {
                self.drains.drain(..).for_each(|d| {
                    let _ = d.send(());
                });
                if !open {
                    return;
                }
            }
            let wake = [self.scheduler.next_wake(now), self.running_deadlines.first().map(|(d, _)| *d)]
                .into_iter()
                .flatten()
                .min();
            tokio::select! {
                biased;
                Some(batch) = done.recv() => self.finish(batch),
                command = commands.recv(), if open => match command {
                    Some(Command::Submit { id, submission, reply }) => self.admit(id, submission, reply),
                    Some(Command::Cancel(id)) => self.cancel(id),
                    Some(Command::Drain(tx)) => self.drains.push(tx),
                    None => open = false,
                },
                () = sleep_until(wake) => {}
            }
        }
    }

    /// Nothing queued, and every request of a running batch already answered (a hung batch whose
    /// requests have all expired does not hold up a drain).
    fn is_idle(&self) -> bool {
        self.scheduler.queue_depth() == 0 && self.running_deadlines.is_empty()
    }

    fn admit(&mut self, id: RequestId, s: Submission, reply: oneshot::Sender<Reply>) {
        let now = Instant::now();
        let ticket =
            Ticket { id, arrival: s.arrival, deadline: s.deadline, rows: s.rows, bytes: s.bytes, priority: s.priority };
        match self.scheduler.admit(ticket, now) {
            Ok(()) => {
                let waiter = Waiter {
                    reply: Some(reply),
                    inputs: Arc::new(s.inputs),
                    arrival: s.arrival,
                    deadline: s.deadline,
                    dispatched: None,
                    ended: None,
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
        if self.scheduler.cancel(id).is_some() {
            self.waiters.remove(&id);
            self.metrics.count(Outcome::Cancelled);
        } else if let Some(w) = self.waiters.get_mut(&id) {
            if w.ended.is_none() {
                w.ended = Some(Ended::Cancelled);
                w.reply = None;
                self.running_deadlines.remove(&(w.deadline, id));
                self.metrics.count(Outcome::Cancelled);
            }
        }
    }

    /// Answers 504 for queued requests whose deadline has come, and for running ones too: their
    /// batch's result, when it comes, is discarded and counted late.
    fn expire(&mut self, now: Instant) {
        for ticket in self.scheduler.expire(now) {
            if let Some(w) = self.waiters.remove(&ticket.id) {
                let message = format!(
                    "deadline passed: waited {} ms in the queue; the deadline was {} ms after arrival",
                    (now - w.arrival).as_millis(),
                    (w.deadline - w.arrival).as_millis()
                );
                self.answer(w, Err(Refusal::new(Outcome::Expired, message)), now);
            }
        }
        while let Some(&(deadline, id)) = self.running_deadlines.first() {
            if deadline > now {
                break;
            }
            self.running_deadlines.pop_first();
            let Some(w) = self.waiters.get_mut(&id) else { continue };
            w.ended = Some(Ended::Expired);
            let (tx, arrival, deadline) = (w.reply.take(), w.arrival, w.deadline);
            let message = format!(
                "deadline passed while its batch was running: waited {} ms; the deadline was {} ms after arrival",
                (now - arrival).as_millis(),
                (deadline - arrival).as_millis()
            );
            self.reply(tx, Err(Refusal::new(Outcome::Expired, message)), arrival, now);
        }
    }

    fn dispatch(&mut self, now: Instant) {
        while let Some(batch) = self.scheduler.take(now) {
            for ticket in batch.doomed {
                if let Some(w) = self.waiters.remove(&ticket.id) {
                    let message = format!(
                        "deadline cannot be met any more: a batch leaving now would end in {} ms, the deadline is in {} ms",
                        self.scheduler.estimate(batch.rows).as_millis(),
                        w.deadline.saturating_duration_since(now).as_millis()
                    );
                    self.answer(w, Err(Refusal::new(Outcome::Expired, message)), now);
                }
            }
            if batch.tickets.is_empty() {
                continue;
            }
            let mut inputs = Vec::with_capacity(batch.tickets.len());
            let mut ids = Vec::with_capacity(batch.tickets.len());
            for ticket in &batch.tickets {
                let w = self.waiters.get_mut(&ticket.id).expect("every queued ticket has a waiter");
                w.dispatched = Some(now);
                self.metrics.queue_wait.observe((now - w.arrival).as_secs_f64());
                self.running_deadlines.insert((w.deadline, ticket.id));
                inputs.push(w.inputs.clone());
                ids.push(ticket.id);
            }
            self.metrics.batch_size.observe(f64::from(batch.rows));
            let run = self.engine.infer(inputs);
            let done = self.done_tx.clone();
            let (worker, rows) = (batch.worker, batch.rows);
            tokio::spawn(async move {
                // The engine runs in its own task so that a panic in it becomes an error here
                // instead of a worker that never frees up.
                let result = match tokio::spawn(run).await {
                    Ok(result) => result,
                    Err(e) => Err(EngineError(format!("the engine panicked: {e}"))),
                };
                let _ = done.send(BatchDone { worker, dispatched_at: now, rows, ids, result });
            });
        }
    }

    fn finish(&mut self, batch: BatchDone) {
        let now = Instant::now();
        self.scheduler.finish(batch.worker, now);
        self.metrics.batch_duration.observe((now - batch.dispatched_at).as_secs_f64());
        let mut outputs = match batch.result {
            Ok(outputs) if outputs.len() == batch.ids.len() => Ok(outputs.into_iter()),
            Ok(outputs) => Err(EngineError(format!(
                "the engine returned outputs for {} requests of a batch of {}",
                outputs.len(),
                batch.ids.len()
            ))),
            Err(e) => Err(e),
        };
        for id in batch.ids {
            let output = match &mut outputs {
                Ok(iter) => Ok(iter.next().expect("lengths checked above")),
                Err(e) => Err(e.clone()),
            };
            let Some(w) = self.waiters.remove(&id) else { continue };
            match w.ended {
                Some(Ended::Expired) => {
                    self.metrics.late_results.inc();
                    continue;
                }
                Some(Ended::Cancelled) => continue,
                None => {}
            }
            self.running_deadlines.remove(&(w.deadline, id));
            let reply = match output {
                Ok(outputs) => Ok(Answer {
                    outputs,
                    batch_rows: batch.rows,
                    queued: batch.dispatched_at - w.arrival,
                    engine: now - batch.dispatched_at,
                }),
                Err(e) => Err(Refusal::new(Outcome::Failed, e.to_string())),
            };
            self.answer(w, reply, now);
        }
    }

    /// Sends the final reply of a waiter that is leaving the table.
    fn answer(&mut self, mut w: Waiter, reply: Reply, now: Instant) {
        let tx = w.reply.take();
        self.reply(tx, reply, w.arrival, now);
    }

    /// Counts and sends a reply. A reply that finds nobody listening counts as `cancelled`: the
    /// caller went away before its cancellation reached the batcher.
    fn reply(&mut self, tx: Option<oneshot::Sender<Reply>>, reply: Reply, arrival: Instant, now: Instant) {
        let Some(tx) = tx else { return };
        let outcome = match &reply {
            Ok(_) => Outcome::Ok,
            Err(r) => r.outcome,
        };
        if tx.send(reply).is_ok() {
            self.metrics.count(outcome);
            self.metrics.request_duration.observe((now - arrival).as_secs_f64());
        } else {
            self.metrics.count(Outcome::Cancelled);
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

async fn sleep_until(wake: Option<Instant>) {
    match wake {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
