//! The waiting line of one model version: tickets by priority, then tenant, each tenant's in
//! deadline order (then arrival) — the lanes that fair shares interleave into dispatch order —
//! with the running totals that admission bounds and metrics read.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use std::time::Instant;

use crate::tenant::TenantId;
use crate::ticket::{Priority, RequestId, Ticket};

type Key = (Instant, RequestId);

/// One tenant's tickets of one priority, keyed by (deadline, id): iteration is its own order.
type Lane = BTreeMap<Key, Ticket>;

#[derive(Debug, Default, Clone)]
pub struct Queue {
    /// One map of lanes per priority, a lane per tenant with tickets waiting.
    by_priority: [BTreeMap<TenantId, Lane>; 2],
    /// Arrival order, for `maxWait`, which is measured from the oldest arrival.
    by_arrival: BTreeSet<Key>,
    /// Where each ticket sits, for cancellation by id.
    index: HashMap<RequestId, (Priority, TenantId, Instant)>,
    bytes: u64,
    /// Rows and tokens of every queued ticket together, and how many have each longest row: what
    /// admission's shortcut bounds the queue's work with.
    rows: u64,
    tokens: u64,
    longest: BTreeMap<u32, usize>,
}

impl Queue {
    pub fn push(&mut self, ticket: Ticket) {
        let lanes = &mut self.by_priority[ticket.priority.index()];
        lanes.entry(ticket.tenant).or_default().insert((ticket.deadline, ticket.id), ticket);
        self.by_arrival.insert((ticket.arrival, ticket.id));
        self.index.insert(ticket.id, (ticket.priority, ticket.tenant, ticket.deadline));
        self.bytes += ticket.bytes;
        self.rows += u64::from(ticket.rows);
        self.tokens += u64::from(ticket.tokens.total);
        *self.longest.entry(ticket.tokens.longest).or_default() += 1;
    }

    pub fn remove(&mut self, id: RequestId) -> Option<Ticket> {
        let (priority, tenant, deadline) = self.index.remove(&id)?;
        let lanes = &mut self.by_priority[priority.index()];
        let lane = lanes.get_mut(&tenant)?;
        let ticket = lane.remove(&(deadline, id))?;
        if lane.is_empty() {
            lanes.remove(&tenant);
        }
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

    pub fn get(&self, id: RequestId) -> Option<&Ticket> {
        let (priority, tenant, deadline) = self.index.get(&id)?;
        self.by_priority[priority.index()].get(tenant)?.get(&(*deadline, id))
    }

    /// Every queued ticket, by priority and tenant (not in dispatch order).
    pub fn iter(&self) -> impl Iterator<Item = &Ticket> {
        self.by_priority.iter().flat_map(|lanes| lanes.values()).flat_map(|lane| lane.values())
    }

    /// The tenants with tickets of `priority` waiting, each with its tickets in deadline order:
    /// what [`crate::tenant::Shares::merge`] interleaves into dispatch order.
    pub fn lanes(&self, priority: Priority) -> impl Iterator<Item = (TenantId, &Lane)> {
        self.by_priority[priority.index()].iter().map(|(t, lane)| (*t, lane))
    }

    /// The tenants with tickets of `priority` waiting.
    pub fn backlogged(&self, priority: Priority) -> impl Iterator<Item = TenantId> + '_ {
        self.by_priority[priority.index()].keys().copied()
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
        self.by_priority[..=priority.index()].iter().flat_map(|lanes| lanes.values()).filter_map(first_deadline).min()
    }

    pub fn oldest_arrival(&self) -> Option<Instant> {
        self.by_arrival.first().map(|(arrival, _)| *arrival)
    }

    pub fn earliest_deadline(&self) -> Option<Instant> {
        self.earliest_deadline_up_to(Priority::Batch)
    }

    /// Removes and returns every ticket whose deadline is at or before `now`.
    pub fn take_expired(&mut self, now: Instant) -> Vec<Ticket> {
        let mut expired = Vec::new();
        for lane in self.by_priority.iter().flat_map(|lanes| lanes.values()) {
            expired.extend(lane.range(..=(now, RequestId::MAX)).map(|(_, t)| t.id));
        }
        expired.into_iter().filter_map(|id| self.remove(id)).collect()
    }
}

fn first_deadline(lane: &Lane) -> Option<Instant> {
    lane.first_key_value().map(|(k, _)| k.0)
}
