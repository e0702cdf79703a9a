//! Replays an arrival trace through the [`Ledger`] in virtual time, with an engine whose batch
//! time is a plain function of rows: a discrete-event simulation of one sidecar.
//!
//! The sidecar's batcher is a thin shell around the same ledger, and both hand it the events of
//! an instant together ([`Ledger::step`] orders them), so a trace replayed here is what the real
//! sidecar does on a paused clock. Tests use it to check the dispatch rule to the millisecond and
//! to run property tests over random traces; the operator's planner and simulation use it too.

use std::collections::HashMap;
use std::time::Duration;

use std::time::Instant;

use crate::ledger::{Effect, Event, Ledger, RetryPolicy};
use crate::outcome::Outcome;
use crate::scheduler::{Scheduler, Trigger};
use crate::tenant::{TenantId, DEFAULT_TENANT};
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
    pub tenant: TenantId,
    /// Its tenant's weight ([`crate::tenant`]).
    pub weight: u32,
}

impl Arrival {
    pub fn new(at_ms: u64, timeout_ms: u64) -> Self {
        Arrival {
            at: Duration::from_millis(at_ms),
            rows: 1,
            timeout: Duration::from_millis(timeout_ms),
            bytes: 64,
            priority: Priority::Interactive,
            tenant: DEFAULT_TENANT,
            weight: 1,
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

    pub fn tenant(mut self, tenant: TenantId) -> Self {
        self.tenant = tenant;
        self
    }

    pub fn weight(mut self, weight: u32) -> Self {
        self.weight = weight;
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
    /// Answered 500 at `at` (the engine failed it).
    Failed { at: Duration },
    /// Admitted, then refused 503 at `at` to make way (shed): a batch-tier request for
    /// interactive work, or a tenant past its fair share for one within it.
    Shed { at: Duration },
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
    /// How many ends (answers and refusals) the ledger gave each request: exactly one, always.
    pub ends: Vec<u32>,
    pub batches: Vec<BatchRecord>,
}

impl Trace {
    pub fn fate(&self, request: usize) -> &Fate {
        self.fates[request].as_ref().expect("every request of a replay ends")
    }
}

/// Runs `arrivals` (in any order) through `scheduler` with the default retry policy, each batch
/// taking `engine(rows)`.
pub fn replay(scheduler: Scheduler, engine: impl Fn(u32) -> Duration, arrivals: &[Arrival]) -> Trace {
    replay_ledger(Ledger::new(scheduler, RetryPolicy::default()), engine, arrivals)
}

/// Runs `arrivals` through `ledger`: request `i` of the trace has id `i`; arrivals of one instant
/// are submitted in trace order.
pub fn replay_ledger(ledger: Ledger, engine: impl Fn(u32) -> Duration, arrivals: &[Arrival]) -> Trace {
    replay_in(ledger, |_, rows| engine(rows), arrivals, &[])
}

/// [`replay_ledger`] in a world that changes over the trace: a batch dispatched at `at` (since the
/// start) takes `engine(at, rows)`, and the shell adds `events` at their instants (timer wakes,
/// calibrations; submissions, cancellations and batch ends are the replay's own). Every answer's
/// trip to its caller takes no virtual time and is reported, as the sidecar's batcher reports
/// each, with the next instant's events.
pub fn replay_in(
    mut ledger: Ledger,
    mut engine: impl FnMut(Duration, u32) -> Duration,
    arrivals: &[Arrival],
    events: &[(Duration, Event)],
) -> Trace {
    let mut extra: Vec<&(Duration, Event)> = events.iter().collect();
    extra.sort_by_key(|e| e.0);
    let mut next_extra = 0;
    let mut trips = 0;
    let start = Instant::now();
    let since = |t: Instant| t - start;
    let mut order: Vec<usize> = (0..arrivals.len()).collect();
    order.sort_by_key(|&i| (arrivals[i].at, i));
    let mut next_arrival = 0;
    // (end, seq, outputs) of the batches on the virtual engine, and where each is in the trace.
    let mut running: Vec<(Instant, u64, usize)> = Vec::new();
    let mut batch_of: HashMap<u64, usize> = HashMap::new();
    let mut trace = Trace { fates: vec![None; arrivals.len()], ends: vec![0; arrivals.len()], batches: Vec::new() };
    let mut effects = Vec::new();
    let mut clock = start;
    loop {
        let next = [
            order.get(next_arrival).map(|&i| start + arrivals[i].at),
            running.iter().map(|r| r.0).min(),
            ledger.next_wake(clock),
            extra.get(next_extra).map(|e| start + e.0),
        ];
        let Some(now) = next.into_iter().flatten().min() else { break };
        clock = now;

        let mut events: Vec<Event> = std::iter::repeat_n(Event::Trip(Duration::ZERO), trips).collect();
        trips = 0;
        while let Some((_, event)) = extra.get(next_extra).filter(|e| start + e.0 <= now) {
            events.push(event.clone());
            next_extra += 1;
        }
        running.retain(|&(end, seq, outputs)| {
            let done = end <= now;
            if done {
                events.push(Event::Finished { seq, result: Ok(outputs) });
            }
            !done
        });
        while let Some(&i) = order.get(next_arrival) {
            let a = arrivals[i];
            if start + a.at > now {
                break;
            }
            next_arrival += 1;
            events.push(Event::Submit(Ticket {
                id: i as RequestId,
                arrival: now,
                deadline: now + a.timeout,
                rows: a.rows,
                bytes: a.bytes,
                priority: a.priority,
                tenant: a.tenant,
                weight: a.weight,
                tokens: Tokens::default(),
            }));
        }
        ledger.step(now, events, &mut effects);
        for effect in effects.drain(..) {
            match effect {
                Effect::Dispatch(d) => {
                    let end = now + engine(since(now), d.rows);
                    trace.batches.push(BatchRecord {
                        worker: d.worker,
                        trigger: d.trigger,
                        dispatched: since(now),
                        finished: since(end),
                        rows: d.rows,
                        requests: d.members.iter().map(|&id| id as usize).collect(),
                    });
                    running.push((end, d.seq, d.members.len()));
                    batch_of.insert(d.seq, trace.batches.len() - 1);
                }
                Effect::Answer { id, seq, batch_rows, .. } => {
                    trips += 1;
                    trace.ends[id as usize] += 1;
                    let dispatched = trace.batches[batch_of[&seq]].dispatched;
                    trace.fates[id as usize] = Some(Fate::Done { dispatched, finished: since(now), batch_rows });
                }
                Effect::Refuse { id, refusal, admitted, .. } => {
                    trace.ends[id as usize] += 1;
                    let at = since(now);
                    trace.fates[id as usize] = Some(match (admitted, refusal.outcome) {
                        (false, outcome) => Fate::Refused { at, outcome },
                        (true, Outcome::Failed) => Fate::Failed { at },
                        (true, Outcome::QueueFull) => Fate::Shed { at },
                        (true, _) => Fate::Expired { at },
                    });
                }
                Effect::Late(_) | Effect::BatchEnded { .. } | Effect::GaveUp { .. } => {}
            }
        }
    }
    trace
}
