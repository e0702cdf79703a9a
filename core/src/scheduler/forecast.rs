//! Admission's look ahead: when would each queued request finish if nothing else arrived?
//!
//! The forecast replays the dispatch rule over the queue: batches are cut by the rule dispatch uses
//! ([`super::cut`]), each goes to the worker that frees up first (busy workers at their expected
//! end), and a batch that is not full leaves at its `maxWait` or deadline timer if that comes after
//! the worker is free. It is O(queue length); the forecast without the newcomer is computed only
//! when someone would miss with it.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Duration;

use tokio::time::Instant;

use super::cut::Cutter;
use super::{Scheduler, Worker};
use crate::outcome::{Outcome, Refusal};
use crate::ticket::{Priority, RequestId, Ticket};

/// Refuses `new` when it cannot finish before its deadline, or when admitting it would push an
/// already admitted request of the same or a higher priority past a deadline it could otherwise
/// meet (Clockwork's guarantee). Lower priorities are not protected from higher ones: batch-tier
/// work only rides in seats interactive work leaves empty.
pub(super) fn check_admission(s: &Scheduler, new: &Ticket, now: Instant) -> Result<(), Refusal> {
    if surely_admissible(s, new, now) {
        // Debug builds (every test) check the shortcut against the forecast it skips.
        debug_assert!(forecast_admission(s, new, now).is_ok(), "the shortcut admitted what the forecast refuses");
        return Ok(());
    }
    forecast_admission(s, new, now)
}

/// The admission decision by the whole forecast, with and (when someone would miss) without `new`.
fn forecast_admission(s: &Scheduler, new: &Ticket, now: Instant) -> Result<(), Refusal> {
    let with = completions(s, Some(new), now);
    let finish = with.iter().find(|(t, _)| t.id == new.id).and_then(|(_, end)| *end);
    let Some(finish) = finish else {
        return Err(Refusal::new(
            Outcome::Infeasible,
            format!(
                "deadline cannot be met: no worker would be free for it before its deadline in {} ms",
                ms(new.deadline.saturating_duration_since(now))
            ),
        )
        .retry_after(drain_time(s, now)));
    };

    // The margin leaves room for the answer's trip back to the caller.
    if finish + s.margin.get() > new.deadline {
        return Err(Refusal::new(
            Outcome::Infeasible,
            format!(
                "deadline cannot be met: estimated completion in {} ms, the deadline allows {} ms{}",
                ms(finish - now),
                ms(new.deadline.saturating_duration_since(now)),
                match (s.margin.get(), s.margin.parts()) {
                    (m, p) if m >= Duration::from_millis(1) => format!(
                        " less a {} ms margin (timers {} ms late, the engine {} ms over its estimate, answers {} ms \
                         on their way back)",
                        ms(m),
                        ms(p.lateness),
                        ms(p.overshoot),
                        ms(p.trip)
                    ),
                    _ => String::new(),
                }
            ),
        )
        .retry_after(drain_time(s, now)));
    }

    // Everyone of the same or a higher priority keeps their promise. Those behind it can be pushed
    // to a later batch; those ahead of it can share its batch, which then takes longer (perRow).
    // Only those that would miss with it are looked at again without it.
    let misses = |t: &Ticket, end: Option<Instant>| end.is_none_or(|end| end > t.deadline);
    let missed: Vec<(&Ticket, Option<Instant>)> =
        with.into_iter().filter(|&(t, end)| t.id != new.id && t.priority <= new.priority && misses(t, end)).collect();
    if missed.is_empty() {
        return Ok(());
    }
    let without: HashMap<RequestId, Option<Instant>> =
        completions(s, None, now).into_iter().map(|(t, end)| (t.id, end)).collect();
    for (t, after) in missed {
        if !misses(t, without[&t.id]) {
            let after = after
                .map_or_else(|| "never (it would expire waiting)".to_owned(), |a| format!("in {} ms", ms(a - now)));
            return Err(Refusal::new(
                Outcome::Infeasible,
                format!(
                    "deadline cannot be met without breaking an earlier promise: admitting this request would make a \
                     queued one finish {after}, after its deadline in {} ms",
                    ms(t.deadline.saturating_duration_since(now))
                ),
            )
            .retry_after(drain_time(s, now)));
        }
    }
    Ok(())
}

/// A shortcut that decides most admissions into a long queue in O(log n) rather than the
/// forecast's O(n): were every queued request and the newcomer to run one batch each, one after
/// another, after the last busy worker is free and every timer has run out, they would still be
/// done (with the margin) by the earliest deadline that admission protects. Every batch of the
/// forecast starts no later than that and takes no longer than the estimator's bound, so the
/// forecast would admit the newcomer too: this only skips the work, never changes the answer.
fn surely_admissible(s: &Scheduler, new: &Ticket, now: Instant) -> bool {
    let q = &s.queue;
    let batches = q.len() as u64 + 1;
    let rows = q.rows() + u64::from(new.rows);
    let tokens = q.tokens() + u64::from(new.tokens.total);
    let longest = q.longest().max(new.tokens.longest);
    let work = s.estimator.bound(batches, rows, tokens, longest);
    let start = worker_free_times(s, now).into_iter().max().unwrap_or(now).max(now + s.policy.max_wait);
    let tightest = q.earliest_deadline_up_to(new.priority).map_or(new.deadline, |d| d.min(new.deadline));
    start + work + s.margin.get() <= tightest
}

/// How long until everything queued now has finished: a hint for `Retry-After`.
pub(super) fn drain_time(s: &Scheduler, now: Instant) -> Duration {
    let last_queued = completions(s, None, now).into_iter().filter_map(|(_, end)| end).max();
    let last_busy = worker_free_times(s, now).into_iter().max();
    last_queued.max(last_busy).map_or(Duration::ZERO, |t| t - now)
}

/// The forecast completion of every queued ticket (and of `new`, as if it were queued), batch by
/// batch as [`Cutter`] cuts them: each batch goes to the worker that frees up first (busy workers
/// at their expected end), and one that is not full leaves at its `maxWait` or deadline timer if
/// that comes after the worker is free — as the dispatch rule would send it.
/// `None`: the ticket expires before a worker takes it; one that rides in a batch it cannot finish
/// in time (and so is expired when the batch leaves) gets the batch's end.
fn completions<'a>(s: &'a Scheduler, new: Option<&'a Ticket>, now: Instant) -> Vec<(&'a Ticket, Option<Instant>)> {
    let of = |p: Priority| with_new(s.queue.iter_priority(p), new.filter(|t| t.priority == p));
    let mut cutter = Cutter::new(s.policy.max_batch_rows, of(Priority::Interactive), of(Priority::Batch));
    let mut free: BinaryHeap<Reverse<Instant>> = worker_free_times(s, now).into_iter().map(Reverse).collect();
    let mut out = Vec::with_capacity(s.queue.len() + 1);
    loop {
        let Reverse(worker_free) = free.pop().expect("at least one worker");
        // What waits in the queue until this worker is free and has expired by then is not cut.
        cutter.expire_by(worker_free);
        let Some(cut) = cutter.next() else { break };
        out.extend(cutter.gone.drain(..).map(|t| (t, None)));
        let took = s.estimator.estimate(cut.shape);
        let leaves = if cut.full {
            now
        } else {
            let must_leave = cut.earliest_deadline.checked_sub(s.margin.get() + took).unwrap_or(now);
            (cut.oldest + s.policy.max_wait).min(must_leave).max(now)
        };
        let start = worker_free.max(leaves);
        // As at dispatch: who cannot finish in time leaves the batch (expired), and the seat stays empty.
        let rides = |t: &Ticket| t.deadline >= start + took;
        let mut shape = cut.shape;
        if !cut.tickets.iter().all(|t| rides(t)) {
            shape = cut.tickets.iter().filter(|t| rides(t)).map(|t| t.shape()).sum();
            out.extend(cut.tickets.iter().filter(|t| !rides(t)).map(|&t| (t, Some(start + took))));
        }
        if shape.rows == 0 {
            free.push(Reverse(worker_free));
            continue;
        }
        let end = start + s.estimator.estimate(shape);
        free.push(Reverse(end));
        out.extend(cut.tickets.iter().filter(|t| rides(t)).map(|&t| (t, Some(end))));
    }
    out.extend(cutter.gone.drain(..).map(|t| (t, None)));
    out
}

/// `tickets` (in deadline order) with `new` in its place among them.
fn with_new<'a>(
    tickets: impl Iterator<Item = &'a Ticket>,
    new: Option<&'a Ticket>,
) -> impl Iterator<Item = &'a Ticket> {
    let key = |t: &Ticket| (t.deadline, t.id);
    let mut tickets = tickets.peekable();
    let mut new = new;
    std::iter::from_fn(move || match (new, tickets.peek()) {
        (Some(n), Some(t)) if key(n) < key(t) => new.take(),
        (Some(_), None) => new.take(),
        _ => tickets.next(),
    })
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
