//! Where batches are cut: the one rule that dispatch (the batch that would leave now) and
//! admission's forecast (that batch and every one after it) share, so that what admission promises
//! is what dispatch does, priorities included.
//!
//! Interactive requests are taken in deadline order and never overtaken: a batch is full when it
//! holds `maxBatchSize` rows or when the next interactive request does not fit. Seats still empty
//! then go to batch-tier requests that fit, in deadline order, passing over those too large for
//! what is left (they head the batch tier for the next batch): an empty seat on a departing batch
//! is capacity that expires.

use std::collections::VecDeque;
use std::iter::Peekable;

use tokio::time::Instant;

use crate::estimate::Shape;
use crate::ticket::Ticket;

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
}

/// Cuts successive batches from the interactive and the batch-tier requests, each given in
/// deadline order.
pub(crate) struct Cutter<'a, I: Iterator<Item = &'a Ticket>, B: Iterator<Item = &'a Ticket>> {
    cap: u32,
    interactive: Peekable<I>,
    batch: B,
    /// Batch-tier requests passed over for size, in deadline order (all before what `batch` has left).
    passed: VecDeque<&'a Ticket>,
    /// Requests whose deadline is at or before this instant have left the queue (expired) by the
    /// time the next batch is cut, and are skipped.
    expired_by: Option<Instant>,
    /// The requests skipped so far as expired, for a forecast to account for.
    pub gone: Vec<&'a Ticket>,
}

impl<'a, I: Iterator<Item = &'a Ticket>, B: Iterator<Item = &'a Ticket>> Cutter<'a, I, B> {
    pub fn new(cap: u32, interactive: I, batch: B) -> Self {
        Cutter {
            cap,
            interactive: interactive.peekable(),
            batch,
            passed: VecDeque::new(),
            expired_by: None,
            gone: Vec::new(),
        }
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

    fn has_expired(&self, t: &Ticket) -> bool {
        self.expired_by.is_some_and(|at| t.deadline <= at)
    }

    fn next_interactive(&mut self) -> Option<&'a Ticket> {
        loop {
            let t: &'a Ticket = self.interactive.peek().copied()?;
            if !self.has_expired(t) {
                return Some(t);
            }
            self.gone.push(t);
            self.interactive.next();
        }
    }

    fn next_batch_tier(&mut self) -> Option<&'a Ticket> {
        loop {
            let t = self.batch.next()?;
            if !self.has_expired(t) {
                return Some(t);
            }
            self.gone.push(t);
        }
    }
}

impl<'a, I: Iterator<Item = &'a Ticket>, B: Iterator<Item = &'a Ticket>> Iterator for Cutter<'a, I, B> {
    type Item = Cut<'a>;

    fn next(&mut self) -> Option<Cut<'a>> {
        let cap = self.cap;
        let (mut tickets, mut shape) = (Vec::new(), Shape::default());
        let take = |tickets: &mut Vec<&'a Ticket>, shape: &mut Shape, t: &'a Ticket| {
            *shape = shape.join(t.shape());
            tickets.push(t);
        };
        while let Some(t) = self.next_interactive() {
            if shape.rows + t.rows > cap {
                return Some(self.cut(tickets, shape, true));
            }
            self.interactive.next();
            take(&mut tickets, &mut shape, t);
        }
        let mut passed_over = 0;
        let mut i = 0;
        while i < self.passed.len() && shape.rows < cap && passed_over <= FILL_LOOKAHEAD {
            if shape.rows + self.passed[i].rows <= cap {
                let t = self.passed.remove(i).expect("in range");
                take(&mut tickets, &mut shape, t);
            } else {
                passed_over += 1;
                i += 1;
            }
        }
        let mut exhausted = false;
        while shape.rows < cap && passed_over <= FILL_LOOKAHEAD {
            let Some(t) = self.next_batch_tier() else {
                exhausted = true;
                break;
            };
            if shape.rows + t.rows <= cap {
                take(&mut tickets, &mut shape, t);
            } else {
                self.passed.push_back(t);
                passed_over += 1;
            }
        }
        // A batch that looked past FILL_LOOKAHEAD requests too large for its last seats is as
        // full as it will get; otherwise it is full at `maxBatchSize` rows, and one that is not
        // has taken everything that fits: only the passed-over requests are left.
        let full = shape.rows == cap || !exhausted;
        (!tickets.is_empty()).then(|| self.cut(tickets, shape, full))
    }
}

impl<'a, I: Iterator<Item = &'a Ticket>, B: Iterator<Item = &'a Ticket>> Cutter<'a, I, B> {
    /// The cut of `tickets` (not empty), with its timers: of everything still waiting when it is
    /// not full (itself and the passed-over), of its own tickets when it is.
    fn cut(&self, tickets: Vec<&'a Ticket>, shape: Shape, full: bool) -> Cut<'a> {
        let passed = if full { None } else { Some(self.passed.iter()) };
        let waiting = || tickets.iter().chain(passed.clone().into_iter().flatten());
        let oldest = waiting().map(|t| t.arrival).min().expect("a cut holds a ticket");
        let earliest_deadline = waiting().map(|t| t.deadline).min().expect("a cut holds a ticket");
        Cut { tickets, shape, full, oldest, earliest_deadline }
    }
}
