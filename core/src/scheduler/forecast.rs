//! Admission's look ahead: when would each queued request finish if nothing else arrived?
//!
//! The forecast replays the dispatch rule over the queue in dispatch order: batches are cut at
//! `maxBatchSize` rows, each goes to the worker that frees up first (busy workers at their
//! expected end), and a batch that is not full leaves at its `maxWait` or deadline timer if that
//! comes after the worker is free. It is O(queue length) and allocation-light, so it runs on
//! every admission.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use tokio::time::Instant;

use super::{Scheduler, Worker};
use crate::estimate::Shape;
use crate::outcome::{Outcome, Refusal};
use crate::ticket::Ticket;

/// Refuses `new` when it cannot finish before its deadline, or when admitting it would push an
/// already admitted request of the same or a higher priority past a deadline it could otherwise
/// meet (Clockwork's guarantee). Lower priorities are not protected from higher ones: batch-tier
/// work only rides in seats interactive work leaves empty.
pub(super) fn check_admission(s: &Scheduler, new: &Ticket, now: Instant) -> Result<(), Refusal> {
    let key = |t: &Ticket| (t.priority, t.deadline, t.id);
    let queued: Vec<&Ticket> = s.queue.iter().collect();
    let pos = queued.partition_point(|t| key(t) < key(new));
    let mut with = Vec::with_capacity(queued.len() + 1);
    with.extend_from_slice(&queued[..pos]);
    with.push(new);
    with.extend_from_slice(&queued[pos..]);
    let done_with = completions(s, &with, now);

    // The margin leaves room for the answer's trip back to the caller.
    let finish = done_with[pos];
    if finish + s.margin.get() > new.deadline {
        return Err(Refusal::new(
            Outcome::Infeasible,
            format!(
                "deadline cannot be met: estimated completion in {} ms, the deadline allows {} ms{}",
                ms(finish - now),
                ms(new.deadline.saturating_duration_since(now)),
                match (s.margin.get(), s.margin.parts()) {
                    (m, (late, over)) if m >= Duration::from_millis(1) => format!(
                        " less a {} ms margin (timers {} ms late, the engine {} ms over its estimate)",
                        ms(m),
                        ms(late),
                        ms(over)
                    ),
                    _ => String::new(),
                }
            ),
        )
        .retry_after(drain_time(s, now)));
    }

    // Everyone of the same or a higher priority keeps their promise. Those behind it can be pushed
    // to a later batch; those ahead of it can share its batch, which then takes longer (perRow).
    if queued.iter().any(|t| t.priority <= new.priority) {
        let done_without = completions(s, &queued, now);
        for (i, t) in queued.iter().enumerate().filter(|(_, t)| t.priority <= new.priority) {
            let (before, after) = (done_without[i], done_with[if i < pos { i } else { i + 1 }]);
            if before <= t.deadline && after > t.deadline {
                return Err(Refusal::new(
                    Outcome::Infeasible,
                    format!(
                        "deadline cannot be met without breaking an earlier promise: admitting this request would make a \
                         queued one finish in {} ms, after its deadline in {} ms",
                        ms(after - now),
                        ms(t.deadline.saturating_duration_since(now))
                    ),
                )
                .retry_after(drain_time(s, now)));
            }
        }
    }
    Ok(())
}

/// How long until everything queued now has finished: a hint for `Retry-After`.
pub(super) fn drain_time(s: &Scheduler, now: Instant) -> Duration {
    let queued: Vec<&Ticket> = s.queue.iter().collect();
    let last_queued = completions(s, &queued, now).into_iter().max();
    let last_busy = worker_free_times(s, now).into_iter().max();
    last_queued.max(last_busy).map_or(Duration::ZERO, |t| t - now)
}

/// Forecast completion instant of each ticket, in the order given (which must be dispatch order).
fn completions(s: &Scheduler, tickets: &[&Ticket], now: Instant) -> Vec<Instant> {
    let policy = &s.policy;
    let mut free: BinaryHeap<Reverse<Instant>> = worker_free_times(s, now).into_iter().map(Reverse).collect();
    let mut out = Vec::with_capacity(tickets.len());
    let mut i = 0;
    while i < tickets.len() {
        let (mut j, mut shape) = (i, Shape::default());
        let (mut oldest, mut earliest_deadline) = (tickets[i].arrival, tickets[i].deadline);
        while j < tickets.len() && (j == i || shape.rows + tickets[j].rows <= policy.max_batch_rows) {
            shape = shape.join(tickets[j].shape());
            oldest = oldest.min(tickets[j].arrival);
            earliest_deadline = earliest_deadline.min(tickets[j].deadline);
            j += 1;
        }
        let full = j < tickets.len() || shape.rows >= policy.max_batch_rows;
        let took = s.estimator.estimate(shape);
        let leaves = if full {
            now
        } else {
            let must_leave = earliest_deadline.checked_sub(s.margin.get() + took).unwrap_or(now);
            (oldest + policy.max_wait).min(must_leave).max(now)
        };
        let Reverse(worker_free) = free.pop().expect("at least one worker");
        let end = worker_free.max(leaves) + took;
        free.push(Reverse(end));
        out.extend(std::iter::repeat_n(end, j - i));
        i = j;
    }
    out
}

fn worker_free_times(s: &Scheduler, now: Instant) -> Vec<Instant> {
    s.workers
        .iter()
        .map(|w| match w {
            Worker::Idle => now,
            Worker::Busy { expected_end, .. } => (*expected_end).max(now),
        })
        .collect()
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}
