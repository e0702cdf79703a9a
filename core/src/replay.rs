//! Replays an arrival trace through the [`Scheduler`] in virtual time, with an engine whose batch
//! time is a plain function of rows: a discrete-event simulation of one sidecar.
//!
//! The async shell ([`crate::batcher`]) and this replay feed the scheduler the same events in the
//! same order at each instant (finished batches, then expiries, then arrivals, then dispatches),
//! so a trace replayed here is what the real sidecar does on a paused clock. Tests use it to
//! check the dispatch rule to the millisecond and to run property tests over random traces.

use std::time::Duration;

use tokio::time::Instant;

use crate::outcome::Outcome;
use crate::scheduler::{Scheduler, Trigger};
use crate::ticket::{Priority, RequestId, Ticket, Tokens};

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    /// Since the start of the trace.
    pub at: Duration,
    pub rows: u32,
    /// Relative deadline.
    pub timeout: Duration,
    pub bytes: u64,
    pub priority: Priority,
}

impl Arrival {
    pub fn new(at_ms: u64, timeout_ms: u64) -> Self {
        Arrival {
            at: Duration::from_millis(at_ms),
            rows: 1,
            timeout: Duration::from_millis(timeout_ms),
            bytes: 64,
            priority: Priority::Interactive,
        }
    }

    pub fn rows(mut self, rows: u32) -> Self {
        self.rows = rows;
        self
    }

    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }
}

/// How one request of the trace ended, with times since the start of the trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Answered 200.
    Done { dispatched: Duration, finished: Duration, batch_rows: u32 },
    /// Refused at admission (queue full or infeasible).
    Refused { at: Duration, outcome: Outcome },
    /// Answered 504 at `at`.
    Expired { at: Duration },
}

/// One batch that ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchRecord {
    pub worker: usize,
    pub trigger: Trigger,
    pub dispatched: Duration,
    pub finished: Duration,
    pub rows: u32,
    pub requests: Vec<usize>,
}

#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// Indexed like the arrivals.
    pub fates: Vec<Option<Fate>>,
    pub batches: Vec<BatchRecord>,
}

impl Trace {
    pub fn fate(&self, request: usize) -> &Fate {
        self.fates[request].as_ref().expect("every request of a replay ends")
    }
}

struct Running {
    end: Instant,
    worker: usize,
    batch: usize,
    tickets: Vec<Ticket>,
}

/// Runs `arrivals` (in any order) through `scheduler`, each batch taking `engine(rows)`.
pub fn replay(mut scheduler: Scheduler, engine: impl Fn(u32) -> Duration, arrivals: &[Arrival]) -> Trace {
    let start = Instant::now();
    let since = |t: Instant| t - start;
    let mut order: Vec<usize> = (0..arrivals.len()).collect();
    order.sort_by_key(|&i| (arrivals[i].at, i));
    let mut next_arrival = 0;
    let mut running: Vec<Running> = Vec::new();
    let mut trace = Trace { fates: vec![None; arrivals.len()], batches: Vec::new() };

    let mut clock = start;
    loop {
        let next = [
            order.get(next_arrival).map(|&i| start + arrivals[i].at),
            running.iter().map(|r| r.end).min(),
            scheduler.next_wake(clock),
        ];
        let Some(now) = next.into_iter().flatten().min() else { break };
        clock = now;

        // 1. Finished batches free their workers.
        running.sort_by_key(|r| (r.end, r.worker));
        while running.first().is_some_and(|r| r.end <= now) {
            let r = running.remove(0);
            scheduler.finish(r.worker, now);
            for t in r.tickets {
                let i = t.id as usize;
                trace.fates[i] = Some(if now <= t.deadline {
                    let b = &trace.batches[r.batch];
                    Fate::Done { dispatched: b.dispatched, finished: since(now), batch_rows: b.rows }
                } else {
                    Fate::Expired { at: since(t.deadline) }
                });
            }
        }
        // 2. Queued deadlines that have come.
        for t in scheduler.expire(now) {
            trace.fates[t.id as usize] = Some(Fate::Expired { at: since(now) });
        }
        // 3. Arrivals.
        while let Some(&i) = order.get(next_arrival) {
            let a = arrivals[i];
            if start + a.at > now {
                break;
            }
            next_arrival += 1;
            let ticket = Ticket {
                id: i as RequestId,
                arrival: now,
                deadline: now + a.timeout,
                rows: a.rows,
                bytes: a.bytes,
                priority: a.priority,
                tokens: Tokens::default(),
            };
            if let Err(refusal) = scheduler.admit(ticket, now) {
                trace.fates[i] = Some(Fate::Refused { at: since(now), outcome: refusal.outcome });
            }
        }
        // 4. Dispatches.
        while let Some(batch) = scheduler.take(now) {
            for t in &batch.doomed {
                trace.fates[t.id as usize] = Some(Fate::Expired { at: since(now) });
            }
            if batch.tickets.is_empty() {
                continue;
            }
            let end = now + engine(batch.rows);
            trace.batches.push(BatchRecord {
                worker: batch.worker,
                trigger: batch.trigger,
                dispatched: since(now),
                finished: since(end),
                rows: batch.rows,
                requests: batch.tickets.iter().map(|t| t.id as usize).collect(),
            });
            running.push(Running { end, worker: batch.worker, batch: trace.batches.len() - 1, tickets: batch.tickets });
        }
    }
    trace
}
