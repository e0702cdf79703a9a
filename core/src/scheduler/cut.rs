//! Where batches are cut: the one rule that dispatch (the batch that would leave now) and
//! admission's forecast (that batch and every one after it) share, so that what admission promises
//! is what dispatch does, priorities included.
//!
//! Within a priority, seats go to tenants by their fair shares ([`crate::tenant`]), each tenant's
//! requests in deadline order. Interactive requests are never overtaken: a batch is full when it
//! holds `maxBatchSize` rows or when the next interactive request does not fit. Seats still empty
//! then go to batch-tier requests that fit, passing over those too large for what is left (they
//! head the batch tier for the next batch): an empty seat on a departing batch is capacity that
//! expires.

use std::collections::VecDeque;
use std::iter::Peekable;

use std::time::Instant;

use crate::estimate::Shape;
use crate::tenant::{Shares, TenantId};
use crate::ticket::{Priority, Ticket};

/// How many batch-tier requests a batch passes over (too large for its last seats) before it stops
/// looking for smaller ones, so that cutting stays cheap with a long batch-tier backlog.
pub(crate) const FILL_LOOKAHEAD: usize = 256;

/// One batch as cut.
#[derive(Debug, Clone)]
pub(crate) struct Cut<'a> {
    pub tickets: Vec<&'a Ticket>,
    pub shape: Shape,
    /// It leaves as soon as a worker is free: `maxBatchSize` rows, or the next interactive request
    /// does not fit.
    pub full: bool,
    /// For a batch that is not full, the earliest arrival and deadline among everything still
    /// waiting (its tickets and those passed over, which are all that is left): its `maxWait` and
    /// deadline timers. A full batch, which leaves at once, has its own tickets' here.
    pub oldest: Instant,
    pub earliest_deadline: Instant,
    /// It carries interactive requests (else only batch-tier ones).
    pub interactive: bool,
}

/// A lane's tickets: an iterator that can be cloned, so that a forecast can cut a batch again
/// from where it stood (see [`super::forecast`]) without collecting the queue.
pub(crate) type Tickets<'a> = Box<dyn LaneIter<'a> + 'a>;

pub(crate) trait LaneIter<'a>: Iterator<Item = &'a Ticket> {
    fn clone_box(&self) -> Tickets<'a>;
}

impl<'a, T: Iterator<Item = &'a Ticket> + Clone + 'a> LaneIter<'a> for T {
    fn clone_box(&self) -> Tickets<'a> {
        Box::new(self.clone())
    }
}

impl<'a> Clone for Tickets<'a> {
    fn clone(&self) -> Self {
        self.as_ref().clone_box()
    }
}

#[derive(Clone)]
struct Lane<'a> {
    tenant: TenantId,
    served: u64,
    /// Requests passed over by an earlier batch (too large for its last seats), back at the head
    /// of their lane in deadline order: the next batch ranks them as a fresh cut would.
    returned: VecDeque<&'a Ticket>,
    tickets: Peekable<Tickets<'a>>,
}

impl<'a> Lane<'a> {
    fn head(&mut self) -> Option<&'a Ticket> {
        self.returned.front().copied().or_else(|| self.tickets.peek().copied())
    }

    fn pop(&mut self) -> Option<&'a Ticket> {
        self.returned.pop_front().or_else(|| self.tickets.next())
    }
}

/// The requests of one priority, as seats go to them: each tenant's lane in deadline order, the
/// next seat to the tenant with the least service ([`crate::tenant`]), charged when its request
/// is taken into a batch — not when it is passed over or expires — exactly as dispatch charges.
#[derive(Clone)]
pub(crate) struct Tier<'a> {
    shares: Shares,
    lanes: Vec<Lane<'a>>,
}

impl<'a> Tier<'a> {
    /// `lanes` in tenant order, each in deadline order; `shares` as they stand now.
    pub fn new(shares: &Shares, lanes: Vec<(TenantId, Tickets<'a>)>) -> Self {
        let lanes = lanes
            .into_iter()
            .map(|(tenant, tickets)| Lane {
                tenant,
                served: shares.served(tenant),
                returned: VecDeque::new(),
                tickets: tickets.peekable(),
            })
            .collect();
        Tier { shares: shares.clone(), lanes }
    }

    /// The request whose turn it is, with its lane: the head of the lane with the least service,
    /// ties to the earlier lane (admission never sheds on a tie: [`super::forecast`] displaces
    /// only a tenant with strictly more service). Heads whose deadline is at or before
    /// `expired_by` are dropped into `gone` first.
    fn peek(&mut self, expired_by: Option<Instant>, gone: &mut Vec<&'a Ticket>) -> Option<(usize, &'a Ticket)> {
        let mut best: Option<(usize, u64)> = None;
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            while let Some(t) = lane.head() {
                if expired_by.is_some_and(|at| t.deadline <= at) {
                    gone.push(t);
                    lane.pop();
                } else {
                    break;
                }
            }
            if lane.head().is_some() && best.is_none_or(|(_, served)| lane.served < served) {
                best = Some((i, lane.served));
            }
        }
        let (i, _) = best?;
        Some((i, self.lanes[i].head().expect("peeked")))
    }

    /// Takes the head of lane `i` into a batch: its tenant is charged its rows.
    fn seat(&mut self, i: usize) -> &'a Ticket {
        let t = self.lanes[i].pop().expect("peeked");
        self.charge(t);
        t
    }

    /// Takes the head of lane `i` out, uncharged: passed over for this batch.
    fn pass(&mut self, i: usize) -> &'a Ticket {
        self.lanes[i].pop().expect("peeked")
    }

    /// Puts a request passed over by the last batch back at the head of its lane.
    fn unpass(&mut self, t: &'a Ticket) {
        if let Some(lane) = self.lanes.iter_mut().find(|l| l.tenant == t.tenant) {
            let at = lane.returned.partition_point(|r| (r.deadline, r.id) < (t.deadline, t.id));
            lane.returned.insert(at, t);
        }
    }

    fn charge(&mut self, t: &Ticket) {
        if let Some(lane) = self.lanes.iter_mut().find(|l| l.tenant == t.tenant) {
            lane.served = lane.served.saturating_add(self.shares.cost(t.tenant, u64::from(t.rows)));
        }
    }
}

/// The order seats would go in if every request fitted: for ranking, not for cutting.
impl<'a> Iterator for Tier<'a> {
    type Item = &'a Ticket;

    fn next(&mut self) -> Option<&'a Ticket> {
        let (i, _) = self.peek(None, &mut Vec::new())?;
        Some(self.seat(i))
    }
}

/// Cuts successive batches from the interactive and the batch-tier requests.
#[derive(Clone)]
pub(crate) struct Cutter<'a> {
    cap: u32,
    interactive: Tier<'a>,
    batch: Tier<'a>,
    /// Batch-tier requests passed over for size by the last batch, in the order they were passed
    /// (not charged).
    pub passed: VecDeque<&'a Ticket>,
    /// Requests whose deadline is at or before this instant have left the queue (expired) by the
    /// time the next batch is cut, and are skipped.
    expired_by: Option<Instant>,
    /// The requests skipped so far as expired, for a forecast to account for.
    pub gone: Vec<&'a Ticket>,
}

impl<'a> Cutter<'a> {
    /// `interactive` and `batch` as [`Scheduler::order`](super::Scheduler) builds them.
    pub fn new(cap: u32, interactive: Tier<'a>, batch: Tier<'a>) -> Self {
        Cutter { cap, interactive, batch, passed: VecDeque::new(), expired_by: None, gone: Vec::new() }
    }

    /// The next batch is cut at `at`: requests whose deadline has come by then are gone.
    pub fn expire_by(&mut self, at: Instant) {
        self.expired_by = Some(at);
        let gone = &mut self.gone;
        self.passed.retain(|t| {
            let keep = t.deadline > at;
            if !keep {
                gone.push(t);
            }
            keep
        });
    }
}

impl<'a> Iterator for Cutter<'a> {
    type Item = Cut<'a>;

    fn next(&mut self) -> Option<Cut<'a>> {
        let cap = self.cap;
        let (mut tickets, mut shape) = (Vec::new(), Shape::default());
        let take = |tickets: &mut Vec<&'a Ticket>, shape: &mut Shape, t: &'a Ticket| {
            *shape = shape.join(t.shape());
            tickets.push(t);
        };
        while let Some((lane, t)) = self.interactive.peek(self.expired_by, &mut self.gone) {
            if shape.rows + t.rows > cap {
                let n = tickets.len();
                return Some(self.cut(tickets, shape, true, n));
            }
            take(&mut tickets, &mut shape, self.interactive.seat(lane));
        }
        let (interactive, interactive_rows) = (tickets.len(), shape.rows);
        // What the last batch passed over heads its lane again (as a fresh cut would see it).
        for t in std::mem::take(&mut self.passed) {
            self.batch.unpass(t);
        }
        let mut passed_over = 0;
        let mut exhausted = false;
        while shape.rows < cap && passed_over <= FILL_LOOKAHEAD {
            let Some((lane, t)) = self.batch.peek(self.expired_by, &mut self.gone) else {
                exhausted = true;
                break;
            };
            if shape.rows + t.rows <= cap {
                take(&mut tickets, &mut shape, self.batch.seat(lane));
            } else {
                self.passed.push_back(self.batch.pass(lane));
                passed_over += 1;
            }
        }
        if interactive > 0 {
            // Batch-tier riders take empty seats and change nothing else: the batch leaves when
            // its interactive part would have left alone.
            return Some(self.cut(tickets, shape, interactive_rows == cap, interactive));
        }
        // A batch that looked past FILL_LOOKAHEAD requests too large for its last seats is as
        // full as it will get; otherwise it is full at `maxBatchSize` rows, and one that is not
        // has taken everything that fits: only the passed-over requests are left.
        let full = shape.rows == cap || !exhausted;
        let n = tickets.len();
        (n > 0).then(|| self.cut(tickets, shape, full, n))
    }
}

impl<'a> Cutter<'a> {
    /// The cut of `tickets` (not empty), with its timers, set by its first `timed` tickets: its
    /// interactive ones when it has any; otherwise all of them, and when it is not full the
    /// passed-over too (they are all that is left).
    fn cut(&self, tickets: Vec<&'a Ticket>, shape: Shape, full: bool, timed: usize) -> Cut<'a> {
        // Interactive requests are taken first: a cut has some exactly when its first is one.
        let interactive = tickets[0].priority == Priority::Interactive;
        let passed = if full || interactive { None } else { Some(self.passed.iter()) };
        let waiting = || tickets[..timed].iter().chain(passed.clone().into_iter().flatten());
        let oldest = waiting().map(|t| t.arrival).min().expect("a cut holds a ticket");
        let earliest_deadline = waiting().map(|t| t.deadline).min().expect("a cut holds a ticket");
        Cut { tickets, shape, full, oldest, earliest_deadline, interactive }
    }
}
