//! Everything one model version's batcher knows about the requests it holds, as a synchronous
//! state machine: events go in with `now`, effects come out. The async shell (the sidecar's
//! `batcher`) only moves data — it hands the effects' batches to the engine and the effects'
//! answers to the callers — and [`crate::replay`] drives this same ledger in virtual time, so a
//! trace replayed there is, by construction, what the sidecar does on a paused clock.
//!
//! Beside the [`Scheduler`] (queue, admission, dispatch rule), the ledger keeps:
//! - every admitted, unanswered request and where it is: waiting in the scheduler, riding in a
//!   running batch, or held back behind a probe of the failure recovery;
//! - attempts and fencing: every run of a request is an attempt with its number, and a result for
//!   an attempt that is no longer current (the watchdog gave up on its batch) or for a request
//!   already answered at its deadline is discarded and counted late;
//! - the deadlines of requests outside the scheduler (running or held): they are answered 504 at
//!   their deadline, not when their batch ends;
//! - the watchdog: a batch that runs past `factor × expected + grace` is given up, its worker
//!   freed, its requests handled as if it had failed;
//! - retries and poison isolation ([`crate::recovery`]).
//!
//! # The order of one instant
//! [`Ledger::step`] takes every event of an instant at once and applies them in one order:
//! finished batches (by sequence number), the watchdog, expiries, then the callers' commands in
//! the order given (submissions, cancellations), then dispatches. The shell gathers all the events
//! ready at an instant before it calls `step`, and replay does the same.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use std::time::Instant;

use crate::estimate::CostModel;
use crate::outcome::{Outcome, Refusal};
use crate::recovery::{self, Member, Recovery};
use crate::scheduler::{Scheduler, Trigger};
use crate::ticket::{RequestId, Ticket};

/// How failed batches are retried.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Runs a request may ride in, the first included.
    pub max_attempts: u32,
    /// The watchdog gives up on a batch after this many times its expected time...
    pub watchdog_factor: f64,
    /// ...plus this, so that a short batch is not given up over a hiccup of the machine (a
    /// scheduler's time slice, a page fault) that says nothing about the engine.
    pub watchdog_grace: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { max_attempts: 3, watchdog_factor: 3.0, watchdog_grace: Duration::from_millis(100) }
    }
}

/// What happened, for the ledger to take into account.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A request arrives (its ticket made by the front).
    Submit(Ticket),
    /// Its caller went away.
    Cancel(RequestId),
    /// Batch `seq` ended: with this many outputs (one per member, in member order), or an error.
    Finished { seq: u64, result: Result<usize, String> },
    /// The batch-time estimator starts over from this model (an engine that timed itself).
    Calibrate(CostModel),
    /// The shell's timer woke it this late (part of the deadline margin).
    Woke(Duration),
    /// An answer took this long from the ledger's effect to its caller (part of the margin).
    Trip(Duration),
}

/// A batch to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatch {
    /// Report its end with [`Event::Finished`] and this number.
    pub seq: u64,
    pub worker: usize,
    pub trigger: Trigger,
    /// Its requests in batch order: their inputs are concatenated in this order, and output `i`
    /// belongs to `members[i]`.
    pub members: Vec<RequestId>,
    pub rows: u32,
    /// What the estimator expects it to take.
    pub expected: Duration,
    /// For each member on its first attempt, how long it waited from arrival to this dispatch.
    pub first_waits: Vec<Duration>,
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Run this batch on the engine.
    Dispatch(Dispatch),
    /// Give the request its answer: output `index` of batch `seq`'s result.
    Answer { id: RequestId, seq: u64, index: usize, batch_rows: u32, queued: Duration, engine: Duration },
    /// End the request without an answer. `admitted` is false for a refusal at admission.
    Refuse { id: RequestId, refusal: Refusal, admitted: bool },
    /// Engine results were discarded: stale attempts, or requests already answered.
    Late(u64),
    /// A batch ended after `took` (successfully or not), for the batch-duration metric.
    BatchEnded { seq: u64, took: Duration },
    /// A batch was given up by the watchdog; its result, if it ever comes, is stale.
    GaveUp { seq: u64, rows: u32, error: String },
}

/// Where an admitted, unanswered request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// In the scheduler (queue or probe).
    Waiting,
    /// Riding in the running batch of this sequence number.
    Running,
    /// Held back while a probe runs.
    Held,
}

#[derive(Debug, Clone)]
struct Entry {
    ticket: Ticket,
    place: Place,
    /// Answered (at its deadline) or cancelled while its batch ran: kept only as a tombstone until
    /// that batch returns, so that its result is counted late rather than lost.
    answered: bool,
    attempts: u32,
    failures: u32,
    last_error: Option<String>,
}

#[derive(Debug, Clone)]
struct Running {
    worker: usize,
    dispatched_at: Instant,
    /// When the watchdog was last set: it is set again, for as long, when the process stalled
    /// since (a stall is no evidence that the engine hangs).
    armed: Instant,
    watchdog: Instant,
    rows: u32,
    /// (request, attempt) in batch order.
    members: Vec<(RequestId, u32)>,
    /// When this batch is a probe: the group held back until it ends.
    held: Option<u64>,
}

/// One model version's batcher state. See the module documentation.
#[derive(Debug, Clone)]
pub struct Ledger {
    scheduler: Scheduler,
    retry: RetryPolicy,
    requests: HashMap<RequestId, Entry>,
    /// Deadlines of unanswered requests that are not in the scheduler (running or held).
    outside: BTreeSet<(Instant, RequestId)>,
    running: HashMap<u64, Running>,
    watchdogs: BTreeSet<(Instant, u64)>,
    /// Groups held back behind a probe, by probe tag.
    held: HashMap<u64, Vec<RequestId>>,
    next_seq: u64,
}

impl Ledger {
    pub fn new(scheduler: Scheduler, retry: RetryPolicy) -> Self {
        Ledger {
            scheduler,
            retry,
            requests: HashMap::new(),
            outside: BTreeSet::new(),
            running: HashMap::new(),
            watchdogs: BTreeSet::new(),
            held: HashMap::new(),
            next_seq: 0,
        }
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Applies the events of instant `now` in the ledger's order (see the module documentation)
    /// and appends what must happen to `effects`.
    pub fn step(&mut self, now: Instant, events: Vec<Event>, effects: &mut Vec<Effect>) {
        // A late wake first: it may say that the process stalled while a batch that ended now
        // ran, and such a batch is not evidence.
        let (wakes, events): (Vec<Event>, Vec<Event>) = events.into_iter().partition(|e| matches!(e, Event::Woke(_)));
        for wake in wakes {
            if let Event::Woke(lateness) = wake {
                self.scheduler.observe_wake(now, lateness);
            }
        }
        let (mut finished, mut commands): (Vec<Event>, Vec<Event>) =
            events.into_iter().partition(|e| matches!(e, Event::Finished { .. }));
        finished.sort_by_key(|e| match e {
            Event::Finished { seq, .. } => *seq,
            _ => unreachable!("partitioned"),
        });
        for event in finished {
            if let Event::Finished { seq, result } = event {
                self.finish(seq, result, now, effects);
            }
        }
        self.watchdog(now, effects);
        self.expire(now, effects);
        for event in commands.drain(..) {
            match event {
                Event::Submit(ticket) => self.submit(ticket, now, effects),
                Event::Cancel(id) => self.cancel(id),
                Event::Calibrate(cost) => self.scheduler.calibrate(cost),
                Event::Trip(trip) => self.scheduler.observe_trip(now, trip),
                Event::Woke(_) | Event::Finished { .. } => unreachable!("partitioned"),
            }
        }
        self.dispatch(now, effects);
    }

    /// When the owner must call [`Ledger::step`] again even if no event comes: the scheduler's
    /// next timer, the next deadline outside it, or the next watchdog.
    pub fn next_wake(&self, now: Instant) -> Option<Instant> {
        [self.scheduler.next_wake(now), self.outside.first().map(|(d, _)| *d), self.watchdogs.first().map(|(w, _)| *w)]
            .into_iter()
            .flatten()
            .min()
    }

    /// Every admitted request has been answered (running batches may still return, late).
    pub fn is_idle(&self) -> bool {
        self.scheduler.queue_depth() == 0 && self.outside.is_empty()
    }

    /// Batches on the engine, including those whose requests were all answered meanwhile.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    fn submit(&mut self, ticket: Ticket, now: Instant, effects: &mut Vec<Effect>) {
        match self.scheduler.admit(ticket, now) {
            Ok(shed) => {
                for t in shed {
                    if self.requests.remove(&t.id).is_some() {
                        let message = if t.priority > ticket.priority {
                            "shed: this batch-tier request gave its place to interactive work (batch-tier work \
                             is shed first)"
                        } else {
                            "shed: this request's tenant is past its fair share, and its place went to a \
                             tenant within its share"
                        };
                        let refusal = Refusal::new(Outcome::QueueFull, message).retry_after(Duration::from_secs(1));
                        refuse(effects, &t, refusal);
                    }
                }
                let entry = Entry {
                    ticket,
                    place: Place::Waiting,
                    answered: false,
                    attempts: 0,
                    failures: 0,
                    last_error: None,
                };
                self.requests.insert(ticket.id, entry);
            }
            Err(refusal) => effects.push(Effect::Refuse { id: ticket.id, refusal, admitted: false }),
        }
    }

    /// The caller went away: nothing is sent to it; a running batch's result for it is dropped.
    fn cancel(&mut self, id: RequestId) {
        let Some(e) = self.requests.get_mut(&id) else { return };
        if e.answered {
            return;
        }
        e.answered = true;
        match e.place {
            Place::Waiting => {
                self.scheduler.cancel(id);
                self.requests.remove(&id);
            }
            Place::Held => {
                self.outside.remove(&(e.ticket.deadline, id));
                self.requests.remove(&id);
            }
            Place::Running => {
                self.outside.remove(&(e.ticket.deadline, id));
            }
        }
    }

    /// Gives up on batches that ran past their watchdog.
    fn watchdog(&mut self, now: Instant, effects: &mut Vec<Effect>) {
        while let Some(&(at, seq)) = self.watchdogs.first() {
            if at > now {
                break;
            }
            self.watchdogs.pop_first();
            let Some(mut run) = self.running.remove(&seq) else { continue };
            if !self.scheduler.evidence(run.armed, now) {
                run.watchdog = now + (run.watchdog - run.armed);
                run.armed = now;
                self.watchdogs.insert((run.watchdog, seq));
                self.running.insert(seq, run);
                continue;
            }
            self.scheduler.abandon(run.worker);
            let error = format!(
                "the batch did not finish within {} ms (the watchdog gives up at {}× the expected time)",
                (now - run.dispatched_at).as_millis(),
                self.retry.watchdog_factor
            );
            effects.push(Effect::GaveUp { seq, rows: run.rows, error: error.clone() });
            self.failed(run, error, effects);
        }
    }

    /// Answers 504 for requests whose deadline has come, wherever they are.
    fn expire(&mut self, now: Instant, effects: &mut Vec<Effect>) {
        for ticket in self.scheduler.expire(now) {
            if self.requests.remove(&ticket.id).is_some() {
                let message = format!(
                    "deadline passed: waited {} ms for a worker; the deadline was {} ms after arrival",
                    (now - ticket.arrival).as_millis(),
                    (ticket.deadline - ticket.arrival).as_millis()
                );
                refuse(effects, &ticket, Refusal::new(Outcome::Expired, message));
            }
        }
        while let Some(&(deadline, id)) = self.outside.first() {
            if deadline > now {
                break;
            }
            self.outside.pop_first();
            let Some(e) = self.requests.get_mut(&id) else { continue };
            let ticket = e.ticket;
            e.answered = true;
            let where_ = if e.place == Place::Held {
                self.requests.remove(&id);
                "while its batch was retried"
            } else {
                "while its batch was running"
            };
            let message = format!(
                "deadline passed {where_}: waited {} ms; the deadline was {} ms after arrival",
                (now - ticket.arrival).as_millis(),
                (deadline - ticket.arrival).as_millis()
            );
            refuse(effects, &ticket, Refusal::new(Outcome::Expired, message));
        }
    }

    fn dispatch(&mut self, now: Instant, effects: &mut Vec<Effect>) {
        while let Some(batch) = self.scheduler.take(now) {
            for ticket in &batch.doomed {
                if self.requests.remove(&ticket.id).is_some() {
                    let message = format!(
                        "deadline cannot be met any more: a batch leaving now would end in {} ms, the deadline is in {} ms",
                        self.scheduler.estimate(batch.shape).as_millis(),
                        ticket.deadline.saturating_duration_since(now).as_millis()
                    );
                    refuse(effects, ticket, Refusal::new(Outcome::Expired, message));
                }
            }
            let held = batch.probe.filter(|tag| self.held.contains_key(tag));
            if batch.tickets.is_empty() {
                // Nobody left to run: the probe proved nothing, so its held group is retried plainly.
                if let Some(tag) = held {
                    let group = self.held.remove(&tag).unwrap_or_default();
                    self.apply(Recovery { requeue: group, ..Recovery::default() }, effects);
                }
                continue;
            }
            let seq = self.next_seq;
            self.next_seq += 1;
            let mut members = Vec::with_capacity(batch.tickets.len());
            let mut first_waits = Vec::new();
            for ticket in &batch.tickets {
                let e = self.requests.get_mut(&ticket.id).expect("every waiting ticket has an entry");
                e.attempts += 1;
                e.place = Place::Running;
                if e.attempts == 1 {
                    first_waits.push(now - e.ticket.arrival);
                }
                self.outside.insert((e.ticket.deadline, ticket.id));
                members.push((ticket.id, e.attempts));
            }
            let expected = self.scheduler.estimate(batch.shape);
            let watchdog = now + expected.mul_f64(self.retry.watchdog_factor) + self.retry.watchdog_grace;
            self.watchdogs.insert((watchdog, seq));
            effects.push(Effect::Dispatch(Dispatch {
                seq,
                worker: batch.worker,
                trigger: batch.trigger,
                members: members.iter().map(|(id, _)| *id).collect(),
                rows: batch.rows,
                expected,
                first_waits,
            }));
            self.running.insert(
                seq,
                Running {
                    worker: batch.worker,
                    dispatched_at: now,
                    armed: now,
                    watchdog,
                    rows: batch.rows,
                    members,
                    held,
                },
            );
        }
    }

    fn finish(&mut self, seq: u64, result: Result<usize, String>, now: Instant, effects: &mut Vec<Effect>) {
        let Some(run) = self.running.remove(&seq) else {
            // The watchdog gave up on this batch and its requests moved on: every result is stale.
            if let Ok(outputs) = result {
                effects.push(Effect::Late(outputs as u64));
            }
            return;
        };
        self.watchdogs.remove(&(run.watchdog, seq));
        // Only batches that ran to the end teach the estimator: a failure's time says nothing
        // about how long a batch takes.
        if result.is_ok() {
            self.scheduler.finish(run.worker, now);
        } else {
            self.scheduler.abandon(run.worker);
        }
        effects.push(Effect::BatchEnded { seq, took: now - run.dispatched_at });
        match result {
            Ok(outputs) if outputs == run.members.len() => {}
            Ok(outputs) => {
                let error =
                    format!("the engine returned outputs for {outputs} requests of a batch of {}", run.members.len());
                return self.failed(run, error, effects);
            }
            Err(error) => return self.failed(run, error, effects),
        }
        let mut late = 0;
        for (index, &(id, attempt)) in run.members.iter().enumerate() {
            let Some(e) = self.requests.get(&id) else { continue };
            if e.attempts != attempt {
                late += 1;
                continue;
            }
            let e = self.requests.remove(&id).expect("just found");
            self.outside.remove(&(e.ticket.deadline, id));
            if e.answered {
                late += 1;
                continue;
            }
            effects.push(Effect::Answer {
                id,
                seq,
                index,
                batch_rows: run.rows,
                queued: run.dispatched_at - e.ticket.arrival,
                engine: now - run.dispatched_at,
            });
        }
        if late > 0 {
            effects.push(Effect::Late(late));
        }
        if let Some(tag) = run.held {
            let group = self.held.remove(&tag).unwrap_or_default();
            let members = self.members(&group);
            let recovery = recovery::on_probe_success(&members, self.retry.max_attempts);
            self.apply(recovery, effects);
        }
    }

    /// A batch failed or was given up on: its unanswered requests are retried or condemned.
    fn failed(&mut self, run: Running, error: String, effects: &mut Vec<Effect>) {
        let mut live = Vec::new();
        for &(id, attempt) in &run.members {
            let Some(e) = self.requests.get_mut(&id) else { continue };
            if e.attempts != attempt {
                continue;
            }
            if e.answered {
                // Answered at its deadline, or cancelled, while the batch ran: nothing to retry.
                self.requests.remove(&id);
                continue;
            }
            e.failures += 1;
            e.last_error = Some(error.clone());
            e.place = Place::Held;
            live.push(id);
        }
        let group = run.held.and_then(|tag| self.held.remove(&tag)).unwrap_or_default();
        let (failed, held) = (self.members(&live), self.members(&group));
        let recovery = recovery::on_failure(&failed, &held, self.retry.max_attempts);
        self.apply(recovery, effects);
    }

    fn members(&self, ids: &[RequestId]) -> Vec<Member> {
        ids.iter()
            .filter_map(|id| {
                self.requests.get(id).map(|e| Member { id: *id, attempts: e.attempts, failures: e.failures })
            })
            .collect()
    }

    fn apply(&mut self, mut recovery: Recovery, effects: &mut Vec<Effect>) {
        // Nobody runs more often than the attempt budget allows.
        let spent = |id: &RequestId| self.requests.get(id).is_some_and(|e| e.attempts >= self.retry.max_attempts);
        let mut over: Vec<RequestId> = recovery.requeue.extract_if(.., |id| spent(id)).collect();
        if let Some(probe) = &mut recovery.probe {
            over.extend(probe.run.extract_if(.., |id| spent(id)));
        }
        recovery.condemn.extend(over);
        for id in recovery.condemn {
            let Some(e) = self.requests.remove(&id) else { continue };
            self.outside.remove(&(e.ticket.deadline, id));
            let error = e.last_error.unwrap_or_else(|| "engine error".to_owned());
            let message = format!("{error} (failed {} of {} attempts; retries stopped)", e.failures, e.attempts);
            refuse(effects, &e.ticket, Refusal::new(Outcome::Failed, message));
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
                if let Some(e) = self.requests.get_mut(&id) {
                    e.place = Place::Held;
                }
            }
            self.held.insert(tag, probe.hold);
            self.scheduler.add_probe(tag, run);
        }
    }

    /// Moves an unanswered request from outside the scheduler back to `place`.
    fn leave_outside(&mut self, id: RequestId, place: Place) -> Option<Ticket> {
        let e = self.requests.get_mut(&id)?;
        self.outside.remove(&(e.ticket.deadline, id));
        e.place = place;
        Some(e.ticket)
    }
}

fn refuse(effects: &mut Vec<Effect>, ticket: &Ticket, refusal: Refusal) {
    effects.push(Effect::Refuse { id: ticket.id, refusal, admitted: true });
}
