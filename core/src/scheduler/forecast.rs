//! Admission's look ahead: when would each queued request finish if nothing else arrived?
//!
//! The forecast replays the dispatch rule over the queue: batches are cut by the rule dispatch uses
//! ([`super::cut`]), each goes to the worker that frees up first (busy workers at their expected
//! end), and a batch that is not full leaves at its `maxWait` or deadline timer if that comes after
//! the worker is free. It is O(queue length); the forecast without the newcomer is computed only
//! when someone would miss with it.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::time::Duration;

use std::time::Instant;

use super::cut::Cutter;

/// The most admitted requests one newcomer may displace; past that it is refused.
const MAX_DISPLACED: usize = 16;
use super::{Scheduler, Worker};
use crate::outcome::{Outcome, Refusal};
use crate::ticket::{Priority, RequestId, Ticket};

/// Refuses `new` when it cannot finish before its deadline, or when admitting it would push an
/// already admitted request past a deadline it could otherwise meet (Clockwork's guarantee) —
/// unless that request is one `new` may displace: of a lower priority (batch-tier work only rides
/// in seats interactive work leaves empty), or of another tenant that fair shares put behind `new`
/// (that tenant is past its share; the promise of a seat was made while nobody else claimed it).
/// Those are returned, to be shed now rather than left to miss.
/// `baseline`: the forecast of the queue as it stood before room was made for `new` at a bound
/// ([`baseline`]); without it, the queue as it is.
pub(super) fn check_admission(
    s: &Scheduler,
    new: &Ticket,
    baseline: Option<&Completions>,
    now: Instant,
) -> Result<Vec<RequestId>, Refusal> {
    if baseline.is_none() && surely_admissible(s, new, now) {
        // Debug builds (every test) check the shortcut against the forecast it skips.
        debug_assert!(
            forecast_admission(s, new, None, now).is_ok_and(|shed| shed.is_empty()),
            "the shortcut admitted what the forecast refuses"
        );
        return Ok(Vec::new());
    }
    forecast_admission(s, new, baseline, now)
}

/// When each queued request would finish, by id ([`completions`] without a newcomer).
pub(super) type Completions = HashMap<RequestId, Option<Instant>>;

pub(super) fn baseline(s: &Scheduler, now: Instant) -> Completions {
    completions(s, None, None, now).into_iter().map(|(t, end)| (t.id, end)).collect()
}

/// The admission decision by the whole forecast, with and (when someone would miss) without `new`.
fn forecast_admission(
    s: &Scheduler,
    new: &Ticket,
    baseline: Option<&Completions>,
    now: Instant,
) -> Result<Vec<RequestId>, Refusal> {
    let with = completions(s, Some(new), None, now);
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

    // Everyone keeps their promise, or is displaced by right. Those behind it can be pushed to a
    // later batch; those ahead of it can share its batch, which then takes longer (perRow). Only
    // those that would miss with it are looked at again without it.
    let misses = |t: &Ticket, end: Option<Instant>| end.is_none_or(|end| end > t.deadline);
    if !with.iter().any(|&(t, end)| t.id != new.id && misses(t, end)) {
        return Ok(Vec::new());
    }
    let missed: Vec<(Ticket, Option<Instant>)> = with.into_iter().map(|(t, end)| (*t, end)).collect();
    let without = baseline.cloned().unwrap_or_else(|| self::baseline(s, now));
    // Who may be displaced, one at a time in forecast order, each time forecasting again: taking
    // one out may be enough for the rest (and changes how they are cut: a batch that was full
    // may now wait for its timers).
    let mut rank: Option<HashMap<RequestId, usize>> = None;
    let mut shed: HashSet<RequestId> = HashSet::new();
    let mut forecast = missed;
    for round in 0..=MAX_DISPLACED {
        let broken = forecast
            .into_iter()
            .find(|(t, end)| t.id != new.id && misses(t, *end) && !shed.contains(&t.id) && !misses(t, without[&t.id]));
        let Some((t, after)) = broken else { return Ok(shed.into_iter().collect()) };
        if round == MAX_DISPLACED {
            return Err(Refusal::new(
                Outcome::Infeasible,
                format!(
                    "deadline cannot be met without displacing more than {MAX_DISPLACED} admitted requests (the \
                     most one request may displace)"
                ),
            )
            .retry_after(drain_time(s, now)));
        }
        // Another tenant's request gives way only to fair shares: its tenant has had strictly
        // more service than the newcomer's, and fair order puts it behind the newcomer.
        let shares = &s.shares[new.priority.index()];
        let displaceable = t.priority > new.priority
            || (t.tenant != new.tenant
                && t.priority == new.priority
                && shares.served(t.tenant) > shares.served(new.tenant)
                && {
                    let rank = rank.get_or_insert_with(|| {
                        s.order(new.priority, Some(new), None).enumerate().map(|(i, t)| (t.id, i)).collect()
                    });
                    rank[&t.id] > rank[&new.id]
                });
        if !displaceable {
            return Err(broken_promise(s, &t, after, now));
        }
        shed.insert(t.id);
        forecast = completions(s, Some(new), Some(&shed), now).into_iter().map(|(t, end)| (*t, end)).collect();
        if let Some((_, end)) = forecast.iter().find(|(t, _)| t.id == new.id) {
            if end.is_none_or(|end| end + s.margin.get() > new.deadline) {
                return Err(broken_promise(s, &t, after, now));
            }
        }
    }
    unreachable!("the last round returns")
}

fn broken_promise(s: &Scheduler, t: &Ticket, after: Option<Instant>, now: Instant) -> Refusal {
    let after =
        after.map_or_else(|| "never (it would expire waiting)".to_owned(), |a| format!("in {} ms", ms(a - now)));
    Refusal::new(
        Outcome::Infeasible,
        format!(
            "deadline cannot be met without breaking an earlier promise: admitting this request would make a queued \
             one finish {after}, after its deadline in {} ms",
            ms(t.deadline.saturating_duration_since(now))
        ),
    )
    .retry_after(drain_time(s, now))
}

/// A shortcut that decides most admissions into a long queue in O(log n) rather than the
/// forecast's O(n): were every queued request and the newcomer to run one batch each, one after
/// another, after the last busy worker is free and every timer has run out, they would still be
/// done (with the margin) by the earliest queued deadline. Every batch of the
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
    let tightest = q.earliest_deadline().map_or(new.deadline, |d| d.min(new.deadline));
    start + work + s.margin.get() <= tightest
}

/// How long until everything queued now has finished: a hint for `Retry-After`.
pub(super) fn drain_time(s: &Scheduler, now: Instant) -> Duration {
    let last_queued = completions(s, None, None, now).into_iter().filter_map(|(_, end)| end).max();
    let last_busy = worker_free_times(s, now).into_iter().max();
    last_queued.max(last_busy).map_or(Duration::ZERO, |t| t - now)
}

/// The forecast completion of every queued ticket (and of `new`, as if it were queued), batch by
/// batch as [`Cutter`] cuts them: each batch goes to the worker that frees up first (busy workers
/// at their expected end), and one that is not full leaves at its `maxWait` or deadline timer if
/// that comes after the worker is free — as the dispatch rule would send it.
/// `None`: the ticket expires before a worker takes it; one that rides in a batch it cannot finish
/// in time (and so is expired when the batch leaves) gets the batch's end.
fn completions<'a>(
    s: &'a Scheduler,
    new: Option<&'a Ticket>,
    skip: Option<&'a HashSet<RequestId>>,
    now: Instant,
) -> Vec<(&'a Ticket, Option<Instant>)> {
    let (interactive, batch) = (s.order(Priority::Interactive, new, skip), s.order(Priority::Batch, new, skip));
    let mut cutter = Cutter::new(s.policy.max_batch_rows, interactive, batch);
    let mut free: BinaryHeap<Reverse<Instant>> = worker_free_times(s, now).into_iter().map(Reverse).collect();
    let mut out = Vec::with_capacity(s.queue.len() + 1);
    loop {
        let Reverse(worker_free) = free.pop().expect("at least one worker");
        // The batch is cut when this worker is free (what has expired by then is not cut); if it
        // waits longer (its timers, the reserved worker) and one of its requests expires first,
        // the dispatch rule cuts again at that moment: so does the forecast, from where it stood.
        let mut at = worker_free;
        let planned = loop {
            let before = cutter.clone();
            cutter.expire_by(at);
            let Some(cut) = cutter.next() else { break None };
            let took = s.estimator.estimate(cut.shape);
            let leaves = if cut.full {
                now
            } else {
                let must_leave = cut.earliest_deadline.checked_sub(s.margin.get() + took).unwrap_or(now);
                (cut.oldest + s.policy.max_wait).min(must_leave).max(now)
            };
            // A batch of batch-tier requests alone waits until a second worker is free as well
            // (one is kept for interactive work).
            let reserve = if cut.interactive || s.workers.len() < 2 { None } else { free.peek().map(|r| r.0) };
            let start = at.max(leaves).max(reserve.unwrap_or(at));
            let timed_by_passed = !cut.full && !cut.interactive;
            let expiring = cut
                .tickets
                .iter()
                .copied()
                .chain(cutter.passed.iter().copied().filter(|_| timed_by_passed))
                .map(|t| t.deadline)
                .filter(|d| *d > at && *d <= start)
                .min();
            match expiring {
                Some(d) => {
                    cutter = before;
                    at = d;
                }
                None => break Some((cut, took, start)),
            }
        };
        let Some((cut, took, start)) = planned else { break };
        out.extend(cutter.gone.drain(..).map(|t| (t, None)));
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
pub(super) fn with_new<'a>(
    tickets: impl Iterator<Item = &'a Ticket> + Clone,
    new: Option<&'a Ticket>,
) -> impl Iterator<Item = &'a Ticket> + Clone {
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
