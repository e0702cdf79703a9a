//! The dispatch rule, as a plain state machine: no I/O, no clock of its own, `now` passed in.
//!
//! When a worker is idle, the queue head leaves **now** if the batch is full, if the oldest
//! request has waited `maxWait` (from its arrival, never restarted), or if waiting longer would
//! make a queued request miss its deadline. While every worker is busy nothing leaves, whatever
//! the timers say — a timer cannot create an idle worker — and the batch keeps growing; when a
//! worker frees up, an overdue batch leaves at once.
//!
//! Admission lives here too, because whether a request can still finish in time depends on the
//! same state: the queue ahead of it, the busy workers and the measured batch time
//! (the `forecast` module).

pub mod capacity;
mod cut;
mod forecast;
#[cfg(test)]
mod tests;

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use std::time::Instant;

use crate::estimate::{CostModel, Estimator, Shape};
use crate::margin::Margin;
use crate::outcome::{Outcome, Refusal};
use crate::queue::Queue;
use crate::tenant::{Shares, TenantId};
use crate::ticket::{Priority, RequestId, Ticket};

/// The knobs of the dispatch rule and the queue bounds of one model version.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Rows per batch (`maxBatchSize`).
    pub max_batch_rows: u32,
    /// Longest voluntary wait of the oldest request (`maxWait`).
    pub max_wait: Duration,
    /// The floor of the deadline margin ([`Margin`]): a deadline-driven dispatch leaves at least
    /// this much before the last possible moment, and admission keeps at least this much of each
    /// deadline for the answer's trip back to its caller; the measured lateness of the timer and
    /// overshoot of the engine come on top.
    pub deadline_margin: Duration,
    /// Queue bound by count (`maxQueue`).
    pub max_queue: usize,
    /// Queue bound by payload bytes (`--max-queue-bytes`).
    pub max_queue_bytes: u64,
}

/// Why a batch left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// `maxBatchSize` rows, or the next request would not fit.
    Full,
    /// The oldest request has waited `maxWait`.
    MaxWait,
    /// Waiting longer would make a queued request miss its deadline.
    Deadline,
    /// A probe of the failure recovery ([`crate::recovery`]): a group that must run alone.
    Retry,
}

/// What the scheduler wants to happen next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// A worker is idle and a batch should leave now.
    Dispatch(Trigger),
    /// A worker is idle; the batch leaves at this instant unless something changes first.
    At(Instant),
    /// Requests are waiting but every worker is busy.
    WaitForWorker,
    /// Nothing is queued.
    Empty,
}

/// A batch handed to a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub worker: usize,
    pub trigger: Trigger,
    pub dispatched_at: Instant,
    pub rows: u32,
    /// Rows and tokens of the tickets that ride, as the estimator priced them.
    pub shape: Shape,
    pub tickets: Vec<Ticket>,
    /// Tickets that were due to ride but can no longer finish before their deadline; they are
    /// taken out of the queue and must be answered as expired rather than run.
    pub doomed: Vec<Ticket>,
    /// The tag given to [`Scheduler::add_probe`] when this batch is a probe.
    pub probe: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Worker {
    Idle,
    Busy { since: Instant, shape: Shape, expected_end: Instant },
}

#[derive(Debug, Clone)]
pub struct Scheduler {
    policy: Policy,
    queue: Queue,
    /// Groups that must run alone, before the queue, as soon as a worker is idle.
    probes: VecDeque<(u64, Vec<Ticket>)>,
    workers: Vec<Worker>,
    estimator: Estimator,
    margin: Margin,
    /// The tenants' fair shares of seats, one per priority tier.
    shares: [Shares; 2],
    /// The request admitted as a probe ([`crate::evidence`], rule 3), until its batch leaves: it
    /// rides even where the learned estimate says it is doomed.
    probing: Option<RequestId>,
}

impl Scheduler {
    pub fn new(policy: Policy, workers: usize, estimator: Estimator) -> Self {
        assert!(workers >= 1 && policy.max_batch_rows >= 1, "validated by the configuration");
        Scheduler {
            margin: Margin::new(policy.deadline_margin),
            policy,
            queue: Queue::default(),
            probes: VecDeque::new(),
            workers: vec![Worker::Idle; workers],
            estimator,
            shares: Default::default(),
            probing: None,
        }
    }

    /// Sets a tenant's weight: its share of seats against the other backlogged tenants.
    pub fn set_weight(&mut self, tenant: TenantId, weight: u32) {
        for shares in &mut self.shares {
            shares.set_weight(tenant, weight);
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Admits `ticket` into the queue, or refuses it: queue full (count or bytes), or its
    /// deadline cannot be met, or admitting it would make an admitted request of its priority and
    /// tenant (or of a tenant that fairness does not put behind it) miss a deadline it could
    /// otherwise meet. Returns the admitted requests it displaces, which must be refused now
    /// (shed) rather than left to miss their deadlines: batch-tier ones an interactive newcomer
    /// needs the room or the seats of, and those of tenants past their fair share whose seats the
    /// newcomer's tenant is owed.
    pub fn admit(&mut self, ticket: Ticket, now: Instant) -> Result<Vec<Ticket>, Refusal> {
        self.set_weight(ticket.tenant, ticket.weight);
        // Room made at a bound changes how the rest are cut: their promises are judged against
        // the forecast of the queue as it stood.
        let over = self.queue.len() >= self.policy.max_queue
            || self.queue.bytes() + ticket.bytes > self.policy.max_queue_bytes;
        let baseline = over.then(|| forecast::baseline(self, now));
        let mut shed = self.make_room(&ticket);
        let (max_queue, max_queue_bytes) = (self.policy.max_queue, self.policy.max_queue_bytes);
        if self.queue.len() >= max_queue {
            let refusal = Refusal::new(
                Outcome::QueueFull,
                format!("queue full: {} requests waiting, the bound (maxQueue) is {max_queue}", self.queue.len()),
            );
            self.restore(shed);
            return Err(refusal.retry_after(self.drain_time(now)));
        }
        if self.queue.bytes() + ticket.bytes > max_queue_bytes {
            let refusal = Refusal::new(
                Outcome::QueueFull,
                format!(
                    "queue full: {} bytes waiting plus this request's {} would pass the bound (--max-queue-bytes) of \
                     {max_queue_bytes}",
                    self.queue.bytes(),
                    ticket.bytes,
                ),
            );
            self.restore(shed);
            return Err(refusal.retry_after(self.drain_time(now)));
        }
        match forecast::check_admission(self, &ticket, baseline.as_ref(), now) {
            Ok(displaced) => {
                shed.extend(displaced.into_iter().filter_map(|id| self.queue.remove(id)));
                self.queue.push(ticket);
                Ok(shed)
            }
            Err(refusal) if refusal.outcome == Outcome::Infeasible && self.probe_fits(&ticket, now) => {
                self.restore(shed);
                self.probing = Some(ticket.id);
                self.queue.push(ticket);
                Ok(Vec::new())
            }
            Err(refusal) => {
                self.restore(shed);
                Err(refusal)
            }
        }
    }

    /// Whether a request refused by the forecast is admitted as a probe ([`crate::evidence`],
    /// rule 3): nothing is queued or running, so it can only risk itself, and the refusal came of
    /// what was learned alone — the batch time the engine was configured or timed with, plus the
    /// margin's floor, would finish it in time. It leaves at once and is learned from; one that
    /// misses is answered 504 at its deadline.
    fn probe_fits(&self, ticket: &Ticket, now: Instant) -> bool {
        self.queue.is_empty()
            && self.probes.is_empty()
            && self.workers.iter().all(|w| *w == Worker::Idle)
            && now + self.estimator.prior().estimate(ticket.shape()) + self.margin.floor() <= ticket.deadline
    }

    /// At a queue bound, the room a newcomer may take from others: batch-tier requests for an
    /// interactive one (latest deadline first), so that batch-tier work is shed before any
    /// interactive request is refused; then, within its priority, the latest request of the
    /// tenant holding the most of the waiting room for its weight, while that is more than the
    /// newcomer's tenant would hold with it (one eager caller does not keep the whole waiting
    /// room). Taken out of the queue; [`Scheduler::restore`] puts them back if the newcomer is
    /// refused anyway.
    fn make_room(&mut self, new: &Ticket) -> Vec<Ticket> {
        let (max_queue, max_bytes) = (self.policy.max_queue, self.policy.max_queue_bytes);
        let over = |q: &Queue| q.len() >= max_queue || q.bytes() + new.bytes > max_bytes;
        let mut shed = Vec::new();
        if !over(&self.queue) {
            return shed;
        }
        if new.priority == Priority::Interactive {
            let mut batch: Vec<(Instant, RequestId)> = self
                .queue
                .lanes(Priority::Batch)
                .flat_map(|(_, lane)| lane.values().map(|t| (t.deadline, t.id)))
                .collect();
            batch.sort_unstable();
            while over(&self.queue) {
                let Some((_, id)) = batch.pop() else { break };
                shed.extend(self.queue.remove(id));
            }
        }
        let shares = &self.shares[new.priority.index()];
        // Rows held per unit of weight, compared across tenants as rows × the other's weight.
        let held = |rows: u64, tenant: TenantId| (rows, u64::from(shares.weight(tenant)));
        while over(&self.queue) {
            let lanes: Vec<(TenantId, u64, RequestId)> = self
                .queue
                .lanes(new.priority)
                .filter_map(|(t, lane)| {
                    let last = lane.values().next_back()?;
                    Some((t, lane.values().map(|t| u64::from(t.rows)).sum(), last.id))
                })
                .collect();
            let mine = lanes.iter().find(|l| l.0 == new.tenant).map_or(0, |l| l.1) + u64::from(new.rows);
            let (mine, my_weight) = held(mine, new.tenant);
            let most = lanes
                .iter()
                .filter(|l| l.0 != new.tenant)
                .max_by_key(|l| {
                    let (rows, weight) = held(l.1, l.0);
                    // rows / weight, as an exact fraction key: compare by cross-multiplying.
                    (u128::from(rows) << 32) / u128::from(weight)
                })
                .copied();
            let Some((tenant, rows, last)) = most else { break };
            let (rows, weight) = held(rows, tenant);
            if u128::from(rows) * u128::from(my_weight) <= u128::from(mine) * u128::from(weight) {
                break;
            }
            shed.extend(self.queue.remove(last));
        }
        shed
    }

    fn restore(&mut self, shed: Vec<Ticket>) {
        for ticket in shed {
            self.queue.push(ticket);
        }
    }

    /// Puts an admitted request back in the queue (its batch failed and it is retried), with its
    /// original arrival and deadline, and without admission's checks: it was admitted already.
    pub fn requeue(&mut self, ticket: Ticket) {
        self.queue.push(ticket);
    }

    /// Adds a group that must run alone, ahead of the queue, as soon as a worker is idle. A group
    /// that is (or becomes) empty is still taken, as an empty batch with its tag, so that its owner
    /// learns that the probe proved nothing.
    pub fn add_probe(&mut self, tag: u64, tickets: Vec<Ticket>) {
        self.probes.push_back((tag, tickets));
    }

    /// Removes a waiting request (its caller went away). `None` if it is not waiting here.
    pub fn cancel(&mut self, id: RequestId) -> Option<Ticket> {
        if let Some(ticket) = self.queue.remove(id) {
            return Some(ticket);
        }
        for (_, group) in &mut self.probes {
            if let Some(i) = group.iter().position(|t| t.id == id) {
                // An emptied probe stays: taking it tells the owner to release its held group.
                return Some(group.remove(i));
            }
        }
        None
    }

    /// Removes and returns the waiting requests whose deadline has come.
    pub fn expire(&mut self, now: Instant) -> Vec<Ticket> {
        let mut expired = self.queue.take_expired(now);
        for (_, group) in &mut self.probes {
            expired.extend(group.extract_if(.., |t| t.deadline <= now));
        }
        expired
    }

    /// The dispatch rule.
    pub fn next(&self, now: Instant) -> Next {
        if self.queue.is_empty() && self.probes.is_empty() {
            return Next::Empty;
        }
        if !self.workers.contains(&Worker::Idle) {
            return Next::WaitForWorker;
        }
        if !self.probes.is_empty() {
            return Next::Dispatch(Trigger::Retry);
        }
        let Some(cut) = self.plan() else { return Next::Empty };
        if !cut.interactive && self.reserved() {
            return Next::WaitForWorker;
        }
        if cut.full {
            return Next::Dispatch(Trigger::Full);
        }
        let wait_over = cut.oldest + self.policy.max_wait;
        if now >= wait_over {
            return Next::Dispatch(Trigger::MaxWait);
        }
        let must_leave = self.latest_start(&cut).unwrap_or(now);
        if now >= must_leave {
            return Next::Dispatch(Trigger::Deadline);
        }
        Next::At(wait_over.min(must_leave))
    }

    /// Whether the one idle worker is kept for interactive work: a batch of batch-tier requests
    /// alone takes a worker only while another stays idle, so that it never holds up an
    /// interactive dispatch (with a single worker it takes it: nothing else would run it).
    fn reserved(&self) -> bool {
        self.workers.len() > 1 && self.workers.iter().filter(|w| **w == Worker::Idle).count() < 2
    }

    /// When the owner of this scheduler must call in again even if nothing else happens: the next
    /// dispatch timer or the next queued deadline.
    pub fn next_wake(&self, now: Instant) -> Option<Instant> {
        let timer = match self.next(now) {
            Next::Dispatch(_) => Some(now),
            Next::At(at) => Some(at),
            Next::WaitForWorker | Next::Empty => None,
        };
        let probe_deadline = self.probes.iter().flat_map(|(_, g)| g.iter().map(|t| t.deadline)).min();
        [timer, self.queue.earliest_deadline(), probe_deadline].into_iter().flatten().min()
    }

    /// Takes the batch that [`Scheduler::next`] says should leave, and marks a worker busy.
    pub fn take(&mut self, now: Instant) -> Option<Batch> {
        let Next::Dispatch(trigger) = self.next(now) else { return None };
        let worker = self.workers.iter().position(|w| *w == Worker::Idle)?;
        let (chosen, probe) = if trigger == Trigger::Retry {
            let (tag, group) = self.probes.pop_front()?;
            (group, Some(tag))
        } else {
            let ids: Vec<RequestId> =
                self.plan().map(|cut| cut.tickets.iter().map(|t| t.id).collect()).unwrap_or_default();
            (ids.into_iter().filter_map(|id| self.queue.remove(id)).collect(), None)
        };
        let planned: Shape = chosen.iter().map(Ticket::shape).sum();
        let finish = now + self.estimator.estimate(planned);
        let probing = self.probing.take();
        let (tickets, doomed): (Vec<Ticket>, Vec<Ticket>) =
            chosen.into_iter().partition(|t| t.deadline >= finish || Some(t.id) == probing);
        let shape: Shape = tickets.iter().map(Ticket::shape).sum();
        if probe.is_none() {
            // Every ticket the cut took holds a seat, the doomed too (as the forecast counts).
            for priority in [Priority::Interactive, Priority::Batch] {
                let shares = &mut self.shares[priority.index()];
                let seated = || tickets.iter().chain(&doomed).filter(|t| t.priority == priority);
                let start = seated().map(|t| shares.served(t.tenant)).min();
                for t in seated() {
                    shares.charge(t.tenant, u64::from(t.rows));
                }
                if self.queue.backlogged(priority).next().is_none() {
                    shares.advance(None);
                } else if start.is_some() {
                    shares.advance(start);
                }
            }
        }
        if !tickets.is_empty() {
            let expected_end = now + self.estimator.estimate(shape);
            self.workers[worker] = Worker::Busy { since: now, shape, expected_end };
        }
        Some(Batch { worker, trigger, dispatched_at: now, rows: shape.rows, shape, tickets, doomed, probe })
    }

    /// A worker finished its batch: it is idle again, and its measured time teaches the
    /// estimator and the margin — unless the process stalled while it ran (not evidence).
    pub fn finish(&mut self, worker: usize, now: Instant) {
        if let Worker::Busy { since, shape, expected_end } = self.workers[worker] {
            if self.margin.evidence(since, now) {
                self.margin.observe_batch(now, expected_end - since, now - since);
                self.estimator.observe(shape, now - since, now);
            }
        }
        self.workers[worker] = Worker::Idle;
    }

    /// Whether the process ran throughout `from`..`to` (no stall its timer saw).
    pub fn evidence(&self, from: Instant, to: Instant) -> bool {
        self.margin.evidence(from, to)
    }

    /// A worker's batch failed, or the watchdog gave up on it: its slot is free again (a
    /// replacement takes it), and the estimator learns nothing from a batch that did not run to
    /// its end.
    pub fn abandon(&mut self, worker: usize) {
        self.workers[worker] = Worker::Idle;
    }

    /// The owner's timer, set for the scheduler's next instant, woke it at `now`, `lateness`
    /// after it.
    pub fn observe_wake(&mut self, now: Instant, lateness: Duration) {
        self.margin.observe_wake(now, lateness);
    }

    /// An answer took `trip` from its batch's end to its caller, told at `now`.
    pub fn observe_trip(&mut self, now: Instant, trip: Duration) {
        self.margin.observe_trip(now, trip);
    }

    /// The deadline margin now: the configured floor plus what was measured.
    pub fn margin(&self) -> Duration {
        self.margin.get()
    }

    /// Starts the estimator over from `cost` (what it learned so far is dropped).
    pub fn calibrate(&mut self, cost: CostModel) {
        self.estimator = Estimator::with_model(cost);
    }

    pub fn estimate(&self, shape: Shape) -> Duration {
        self.estimator.estimate(shape)
    }

    /// Requests waiting for a worker: the queue and the probes.
    pub fn queue_depth(&self) -> usize {
        self.queue.len() + self.probes.iter().map(|(_, g)| g.len()).sum::<usize>()
    }

    pub fn queue_bytes(&self) -> u64 {
        self.queue.bytes() + self.probes.iter().flat_map(|(_, g)| g.iter().map(|t| t.bytes)).sum::<u64>()
    }

    pub fn oldest_arrival(&self) -> Option<Instant> {
        let probes = self.probes.iter().flat_map(|(_, g)| g.iter().map(|t| t.arrival)).min();
        [self.queue.oldest_arrival(), probes].into_iter().flatten().min()
    }

    pub fn busy_workers(&self) -> usize {
        self.workers.iter().filter(|w| **w != Worker::Idle).count()
    }

    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// The batch that would leave now ([`cut`]: the rule admission's forecast uses too).
    fn plan(&self) -> Option<cut::Cut<'_>> {
        let (interactive, batch) =
            (self.order(Priority::Interactive, None, None), self.order(Priority::Batch, None, None));
        cut::Cutter::new(self.policy.max_batch_rows, interactive, batch).next()
    }

    /// The tickets of one priority in the order seats go to them: each tenant's in deadline
    /// order, the tenants interleaved by their fair shares (of rows). `new`, when given, is
    /// placed as if it were queued, and those in `skip` as if they were not.
    fn order<'a>(
        &'a self,
        priority: Priority,
        new: Option<&'a Ticket>,
        skip: Option<&'a HashSet<RequestId>>,
    ) -> cut::Tier<'a> {
        let new = new.filter(|t| t.priority == priority);
        let mut lanes: Vec<(TenantId, cut::Tickets<'a>)> = self
            .queue
            .lanes(priority)
            .map(|(tenant, lane)| {
                let queued = lane.values().filter(move |t| skip.is_none_or(|skip| !skip.contains(&t.id)));
                let tickets: cut::Tickets<'a> =
                    Box::new(forecast::with_new(queued, new.filter(|n| n.tenant == tenant)));
                (tenant, tickets)
            })
            .collect();
        if let Some(n) = new.filter(|n| !lanes.iter().any(|(t, _)| *t == n.tenant)) {
            let at = lanes.partition_point(|(t, _)| *t < n.tenant);
            lanes.insert(at, (n.tenant, Box::new(std::iter::once(n))));
        }
        cut::Tier::new(&self.shares[priority.index()], lanes)
    }

    /// The last instant this batch can start and still meet its tickets' deadlines (less the
    /// margin). `None` when that instant is before the clock's origin.
    fn latest_start(&self, cut: &cut::Cut<'_>) -> Option<Instant> {
        cut.earliest_deadline.checked_sub(self.margin.get() + self.estimator.estimate(cut.shape))
    }

    /// Roughly how long until the queue ahead has drained, for `Retry-After`.
    fn drain_time(&self, now: Instant) -> Duration {
        forecast::drain_time(self, now)
    }
}
