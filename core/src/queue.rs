//! The waiting line of one model version: tickets in dispatch order (priority, then deadline,
//! then arrival), with the running totals that admission bounds and metrics read.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use tokio::time::Instant;

use crate::ticket::{Priority, RequestId, Ticket};

type Key = (Instant, RequestId);

#[derive(Debug, Default, Clone)]
pub struct Queue {
    /// One ordered map per priority, keyed by (deadline, id): iteration is dispatch order.
    by_priority: [BTreeMap<Key, Ticket>; 2],
    /// Arrival order, for `maxWait`, which is measured from the oldest arrival.
    by_arrival: BTreeSet<Key>,
    /// Where each ticket sits, for cancellation by id.
    index: HashMap<RequestId, (Priority, Instant)>,
    bytes: u64,
    /// Rows and tokens of every queued ticket together, and how many have each longest row: what
    /// admission's shortcut bounds the queue's work with.
    rows: u64,
    tokens: u64,
    longest: BTreeMap<u32, usize>,
}

impl Queue {
    pub fn push(&mut self, ticket: Ticket) {
        self.by_priority[ticket.priority.index()].insert((ticket.deadline, ticket.id), ticket);
        self.by_arrival.insert((ticket.arrival, ticket.id));
        self.index.insert(ticket.id, (ticket.priority, ticket.deadline));
        self.bytes += ticket.bytes;
        self.rows += u64::from(ticket.rows);
        self.tokens += u64::from(ticket.tokens.total);
        *self.longest.entry(ticket.tokens.longest).or_default() += 1;
    }

    pub fn remove(&mut self, id: RequestId) -> Option<Ticket> {
        let (priority, deadline) = self.index.remove(&id)?;
        let ticket = self.by_priority[priority.index()].remove(&(deadline, id))?;
        self.by_arrival.remove(&(ticket.arrival, id));
        self.bytes -= ticket.bytes;
        self.rows -= u64::from(ticket.rows);
        self.tokens -= u64::from(ticket.tokens.total);
        if let Some(n) = self.longest.get_mut(&ticket.tokens.longest) {
            *n -= 1;
            if *n == 0 {
                self.longest.remove(&ticket.tokens.longest);
            }
        }
        Some(ticket)
    }

    /// Tickets in the order batches take them.
    pub fn iter(&self) -> impl Iterator<Item = &Ticket> {
        self.by_priority.iter().flat_map(|m| m.values())
    }

    /// Tickets of one priority, in deadline order.
    pub fn iter_priority(&self, priority: Priority) -> impl Iterator<Item = &Ticket> {
        self.by_priority[priority.index()].values()
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Rows of every queued ticket together.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Tokens of every queued ticket together.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The longest row of any queued ticket, in tokens.
    pub fn longest(&self) -> u32 {
        self.longest.last_key_value().map_or(0, |(l, _)| *l)
    }

    /// The earliest deadline among tickets of `priority` or a higher one.
    pub fn earliest_deadline_up_to(&self, priority: Priority) -> Option<Instant> {
        self.by_priority[..=priority.index()].iter().filter_map(|m| m.first_key_value().map(|(k, _)| k.0)).min()
    }

    pub fn oldest_arrival(&self) -> Option<Instant> {
        self.by_arrival.first().map(|(arrival, _)| *arrival)
    }

    pub fn earliest_deadline(&self) -> Option<Instant> {
        self.by_priority.iter().filter_map(|m| m.first_key_value().map(|(k, _)| k.0)).min()
    }

    /// Removes and returns every ticket whose deadline is at or before `now`.
    pub fn take_expired(&mut self, now: Instant) -> Vec<Ticket> {
        let mut expired = Vec::new();
        for map in &self.by_priority {
            expired.extend(map.range(..=(now, RequestId::MAX)).map(|(_, t)| t.id));
        }
        expired.into_iter().filter_map(|id| self.remove(id)).collect()
    }
}
