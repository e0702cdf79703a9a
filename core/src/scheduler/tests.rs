//! The dispatch rule to the millisecond: DESIGN.md's exercise table and the cases beyond it.

use std::time::Duration;

use std::time::Instant;

use super::*;
use crate::replay::{replay, Arrival, Fate, Trace};
use crate::tenant::TenantId;
use crate::ticket::{Priority, Tokens};

const MS: Duration = Duration::from_millis(1);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The exercise's service: cap 4, `maxWait` 10 ms, 100 ms per batch, 200 ms budget.
fn exercise(workers: usize) -> Scheduler {
    scheduler(4, 10, workers, 100)
}

fn scheduler(cap: u32, max_wait_ms: u64, workers: usize, batch_ms: u64) -> Scheduler {
    let policy = Policy {
        max_batch_rows: cap,
        max_wait: ms(max_wait_ms),
        deadline_margin: Duration::ZERO,
        max_queue: 1024,
        max_queue_bytes: 1 << 30,
    };
    Scheduler::new(policy, workers, Estimator::new(ms(batch_ms), Duration::ZERO))
}

fn fixed(batch_ms: u64) -> impl Fn(u32) -> Duration {
    move |_| ms(batch_ms)
}

fn done(dispatched: u64, finished: u64, batch_rows: u32) -> Fate {
    Fate::Done { dispatched: ms(dispatched), finished: ms(finished), batch_rows }
}

#[test]
fn sparse_arrivals_leave_when_the_oldest_has_waited_max_wait() {
    let trace = replay(exercise(1), fixed(100), &[Arrival::new(0, 200), Arrival::new(7, 200)]);
    assert_eq!(trace.batches.len(), 1);
    assert_eq!(trace.batches[0].trigger, Trigger::MaxWait);
    assert_eq!(trace.fate(0), &done(10, 110, 2)); // A waited 110
    assert_eq!(trace.fate(1), &done(10, 110, 2)); // B waited 103
}

#[test]
fn a_full_batch_leaves_at_once() {
    let trace = replay(exercise(1), fixed(100), &[Arrival::new(0, 200); 4]);
    assert_eq!(trace.batches.len(), 1);
    assert_eq!(trace.batches[0].trigger, Trigger::Full);
    for i in 0..4 {
        assert_eq!(trace.fate(i), &done(0, 100, 4));
    }
}

#[test]
fn max_wait_cannot_create_an_idle_worker() {
    let mut arrivals = vec![Arrival::new(0, 200); 4];
    arrivals.push(Arrival::new(1, 200));
    let trace = replay(exercise(1), fixed(100), &arrivals);
    assert_eq!(trace.fate(4), &done(100, 200, 1));
    // E's timer ran out at 11 while the worker was busy; it left the moment the worker freed up.
    assert_eq!(trace.batches[1].trigger, Trigger::MaxWait);
}

#[test]
fn a_deadline_that_cannot_be_met_is_refused_at_admission() {
    let mut arrivals = vec![Arrival::new(0, 200); 4];
    arrivals.push(Arrival::new(1, 149)); // deadline at 150; it could finish at 200 at best
    let trace = replay(exercise(1), fixed(100), &arrivals);
    assert_eq!(trace.fate(4), &Fate::Refused { at: ms(1), outcome: Outcome::Infeasible });
    assert_eq!(trace.batches.len(), 1);
}

#[test]
fn the_timer_is_not_restarted_when_a_worker_frees_up() {
    // B arrives while the worker is busy and has waited 90 ms when it frees up at 100: it leaves
    // at once, not at 100 + maxWait.
    let mut arrivals = vec![Arrival::new(0, 200); 4];
    arrivals.push(Arrival::new(10, 300));
    let mut s = exercise(1);
    s.policy.max_wait = ms(50);
    let trace = replay(s, fixed(100), &arrivals);
    assert_eq!(trace.fate(4), &done(100, 200, 1));
}

#[test]
fn a_batch_fills_while_every_worker_is_busy() {
    let mut arrivals = vec![Arrival::new(0, 250); 4];
    arrivals.extend((1..=5).map(|t| Arrival::new(t * 10, 300)));
    let trace = replay(exercise(1), fixed(100), &arrivals);
    // Four of the five that came while the worker was busy leave together at 100; the fifth waits.
    assert_eq!(trace.batches[1].dispatched, ms(100));
    assert_eq!(trace.batches[1].rows, 4);
    assert_eq!(trace.batches[1].trigger, Trigger::Full);
    assert_eq!(trace.fate(8), &done(200, 300, 1));
}

#[test]
fn a_batch_that_fills_before_max_wait_leaves_when_full() {
    let arrivals = [Arrival::new(0, 200), Arrival::new(3, 200), Arrival::new(5, 200), Arrival::new(8, 200)];
    let trace = replay(exercise(1), fixed(100), &arrivals);
    assert_eq!(trace.batches.len(), 1);
    assert_eq!(trace.batches[0].trigger, Trigger::Full);
    assert_eq!(trace.fate(0), &done(8, 108, 4));
}

#[test]
fn several_workers_take_batches_side_by_side() {
    let mut arrivals = vec![Arrival::new(0, 200); 4];
    arrivals.extend([Arrival::new(5, 200); 4]);
    arrivals.push(Arrival::new(6, 300));
    let trace = replay(exercise(2), fixed(100), &arrivals);
    assert_eq!(trace.fate(0), &done(0, 100, 4));
    assert_eq!(trace.fate(4), &done(5, 105, 4));
    assert_eq!((trace.batches[0].worker, trace.batches[1].worker), (0, 1));
    // Both workers busy: the ninth request waits for the first one to free up.
    assert_eq!(trace.fate(8), &done(100, 200, 1));
    assert_eq!(trace.batches[2].worker, 0);
}

#[test]
fn a_deadline_makes_a_batch_leave_before_max_wait() {
    // maxWait 50 ms, but A's deadline (120) only leaves room to start by 20.
    let trace = replay(scheduler(4, 50, 1, 100), fixed(100), &[Arrival::new(0, 120), Arrival::new(15, 200)]);
    assert_eq!(trace.batches[0].trigger, Trigger::Deadline);
    assert_eq!(trace.fate(0), &done(20, 120, 2));
    assert_eq!(trace.fate(1), &done(20, 120, 2));
}

fn with_margin(mut s: Scheduler, floor: Duration) -> Scheduler {
    s.policy.deadline_margin = floor;
    Scheduler::new(s.policy.clone(), s.workers(), s.estimator.clone())
}

#[test]
fn the_deadline_margin_moves_the_dispatch_earlier() {
    let s = with_margin(scheduler(4, 50, 1, 100), ms(5));
    let trace = replay(s, fixed(100), &[Arrival::new(0, 120)]);
    assert_eq!(trace.fate(0), &done(15, 115, 1));
}

#[test]
fn the_measured_timer_lateness_widens_the_margin_for_dispatch_and_admission_alike() {
    let mut s = with_margin(scheduler(4, 50, 1, 100), ms(2));
    s.observe_wake(Instant::now(), ms(3));
    // The floor, the timer's 3 ms, and (no batch measured yet) as much again for the engine.
    assert_eq!(s.margin(), ms(8));
    let trace = replay(s.clone(), fixed(100), &[Arrival::new(0, 120)]);
    assert_eq!(trace.fate(0), &done(12, 112, 1), "leaves 8 ms before the last moment");
    // Admission keeps the same margin: a request that would end 4 ms before its deadline is
    // refused when the margin is 8, and admitted on the floor alone. (A request queued ahead of
    // it, with time to spare, makes it no probe: see `evidence`, rule 3.)
    let t0 = Instant::now();
    let ticket = |id, deadline| Ticket {
        id,
        arrival: t0,
        deadline: t0 + ms(deadline),
        rows: 1,
        bytes: 1,
        priority: Priority::Interactive,
        tenant: 0,
        weight: 1,
        tokens: Tokens::default(),
    };
    let tight = |id| ticket(id, 104);
    let mut probe = s.clone();
    s.admit(ticket(0, 1000), t0).unwrap();
    let refused = s.admit(tight(1), t0).unwrap_err();
    assert_eq!(refused.outcome, Outcome::Infeasible, "{refused}");
    let mut floor_only = with_margin(scheduler(4, 50, 1, 100), ms(2));
    floor_only.admit(ticket(0, 1000), t0).unwrap();
    assert_eq!(floor_only.admit(tight(1), t0), Ok(Vec::new()));
    // Alone, it is refused only by what was measured: it is taken as a probe, and leaves at once.
    assert_eq!(probe.admit(tight(1), t0), Ok(Vec::new()));
    let batch = probe.take(t0).expect("the probe leaves at once");
    assert_eq!((batch.tickets.len(), batch.doomed.len()), (1, 0), "{batch:?}");
}

#[test]
fn an_engine_slower_than_its_estimate_widens_the_margin() {
    // The estimate says 100 ms; the engine takes 104: the first batch overshoots by 4 ms, and the
    // next deadline-driven batch leaves 5 + 4 ms before the last moment (the estimator has learned
    // 104 by then, too).
    let s = with_margin(scheduler(4, 1000, 1, 100), ms(5));
    let trace = replay(s, fixed(104), &[Arrival::new(0, 400), Arrival::new(500, 220)]);
    assert_eq!(trace.fate(0), &done(400 - 100 - 5, 399, 1));
    assert_eq!(trace.fate(1), &done(720 - 104 - 9, 720 - 9, 1));
}

#[test]
fn rows_are_counted_and_a_request_that_does_not_fit_waits_for_the_next_batch() {
    let arrivals = [Arrival::new(0, 200).rows(3), Arrival::new(1, 200).rows(2), Arrival::new(2, 300).rows(1)];
    let trace = replay(exercise(1), fixed(100), &arrivals);
    // B (2 rows) does not fit beside A (3 rows): A's batch is full and leaves when B arrives.
    assert_eq!(trace.batches[0].trigger, Trigger::Full);
    assert_eq!(trace.fate(0), &done(1, 101, 3));
    // B and C leave together when the worker frees up; B's timer ran out at 11.
    assert_eq!(trace.fate(1), &done(101, 201, 3));
    assert_eq!(trace.fate(2), &done(101, 201, 3));
}

#[test]
fn within_a_priority_batches_take_the_earliest_deadline_first() {
    let mut arrivals = vec![Arrival::new(0, 500); 4];
    arrivals.extend((0..4).map(|_| Arrival::new(1, 450)));
    arrivals.push(Arrival::new(2, 250));
    let trace = replay(exercise(1), fixed(100), &arrivals);
    // At 100 the worker frees: the request due at 252 rides first, with three due at 451.
    assert_eq!(trace.fate(8), &done(100, 200, 4));
    assert_eq!(trace.batches[1].requests, vec![8, 4, 5, 6]);
    assert_eq!(trace.fate(7), &done(200, 300, 1));
}

#[test]
fn batch_tier_work_fills_the_seats_interactive_work_leaves() {
    let arrivals = [
        Arrival::new(0, 200).rows(2),
        Arrival::new(0, 1000).priority(Priority::Batch),
        Arrival::new(1, 200),
        Arrival::new(1, 900).priority(Priority::Batch).rows(2),
    ];
    let trace = replay(exercise(1), fixed(100), &arrivals);
    // Interactive A (2 rows) and C (1 row) go first. One seat is left: the batch-tier request
    // due first needs two, so the one-row batch-tier request takes it. The batch leaves when its
    // interactive part would have (A's maxWait at 10 ms): a rider does not make it full.
    assert_eq!(trace.batches[0].requests, vec![0, 2, 1]);
    assert_eq!(trace.batches[0].trigger, Trigger::MaxWait);
    assert_eq!(trace.fate(0), &done(10, 110, 4));
    assert_eq!(trace.fate(3), &done(110, 210, 2));
}

/// Seats per tenant in each batch of `trace`.
fn seats(trace: &Trace, arrivals: &[Arrival]) -> Vec<[u32; 3]> {
    trace
        .batches
        .iter()
        .map(|b| {
            let mut seats = [0; 3];
            for &i in &b.requests {
                seats[usize::from(arrivals[i].tenant)] += arrivals[i].rows;
            }
            seats
        })
        .collect()
}

/// Tenant `tenant` sends one row every `every_ms` for `for_ms`, each with `timeout_ms`.
fn stream(tenant: TenantId, every_ms: u64, for_ms: u64, timeout_ms: u64) -> impl Iterator<Item = Arrival> {
    (0..for_ms / every_ms).map(move |k| Arrival::new(k * every_ms, timeout_ms).tenant(tenant))
}

#[test]
fn backlogged_tenants_of_equal_weight_get_equal_seats_whatever_they_send() {
    // Cap 8, 100 ms a batch: 80 rows/s. Tenant 1 sends 500 rows/s, tenant 2 a tenth of that
    // (50/s): both more than their half (40/s), so both are backlogged.
    let s = scheduler(8, 10, 1, 100);
    let arrivals: Vec<Arrival> = stream(1, 2, 3000, 60_000).chain(stream(2, 20, 3000, 60_000)).collect();
    let trace = replay(s, fixed(100), &arrivals);
    let seats = seats(&trace, &arrivals);
    // Once both are backlogged (from the third batch on) every batch is split 4 and 4.
    assert!(seats.len() > 25, "{} batches", seats.len());
    for (i, batch) in seats.iter().enumerate().skip(2).take(25) {
        assert_eq!(batch, &[0, 4, 4], "batch {i}");
    }
    // Without tenants, the same trace goes in deadline (here arrival) order: tenant 1 takes
    // about ten seats in eleven.
    let single: Vec<Arrival> = arrivals.iter().map(|a| a.tenant(0)).collect();
    let plain = replay(scheduler(8, 10, 1, 100), fixed(100), &single);
    let light: u32 =
        plain.batches[2..27].iter().flat_map(|b| &b.requests).filter(|&&i| arrivals[i].tenant == 2).count() as u32;
    assert!(light < 25, "{light} seats of 200 for the light caller without fair shares");
}

#[test]
fn a_light_tenant_waits_at_most_one_batch_behind_a_flood() {
    // Tenant 1 floods (500 rows/s against 80 of capacity); tenant 2 sends one row every 250 ms.
    let s = scheduler(8, 10, 1, 100);
    let arrivals: Vec<Arrival> = stream(1, 2, 3000, 60_000).chain(stream(2, 250, 3000, 60_000)).collect();
    let trace = replay(s, fixed(100), &arrivals);
    let mut light = 0;
    for (i, a) in arrivals.iter().enumerate().filter(|(_, a)| a.tenant == 2) {
        let Fate::Done { dispatched, .. } = trace.fate(i) else { panic!("light request {i}: {:?}", trace.fate(i)) };
        // It rides in the batch that leaves when the running one ends.
        assert!(*dispatched - a.at <= ms(100), "light request {i} waited {:?}", *dispatched - a.at);
        light += 1;
    }
    assert_eq!(light, 12);
    // The flood is refused at admission once its share is promised, never answered late.
    assert!((0..arrivals.len()).any(|i| matches!(trace.fate(i), Fate::Refused { .. })));
    assert!((0..arrivals.len()).all(|i| !matches!(trace.fate(i), Fate::Expired { .. })));
}

#[test]
fn weights_three_to_one_give_seats_three_to_one() {
    let s = scheduler(8, 10, 1, 100);
    let arrivals: Vec<Arrival> =
        stream(1, 2, 3000, 60_000).map(|a| a.weight(3)).chain(stream(2, 2, 3000, 60_000)).collect();
    let trace = replay(s, fixed(100), &arrivals);
    let seats = seats(&trace, &arrivals);
    assert!(seats.len() > 25);
    for (i, batch) in seats.iter().enumerate().skip(1).take(25) {
        assert_eq!(batch, &[0, 6, 2], "batch {i}");
    }
}

#[test]
fn a_tenant_past_its_share_gives_up_its_seat_to_one_within_it_and_hears_so_at_once() {
    // One row a batch. Tenant 1 queued three requests that each just fit; tenant 2's request is
    // owed the next seat: tenant 1's second would miss for it, and is shed (503) now; its third
    // then takes the second's place.
    let trace = replay(
        scheduler(1, 0, 1, 100),
        fixed(100),
        &[
            Arrival::new(0, 150).tenant(1),
            Arrival::new(0, 250).tenant(1),
            Arrival::new(0, 350).tenant(1),
            Arrival::new(1, 340).tenant(2),
        ],
    );
    assert_eq!(trace.fate(0), &done(0, 100, 1));
    assert_eq!(trace.fate(3), &done(100, 200, 1));
    assert_eq!(trace.fate(1), &Fate::Shed { at: ms(1) });
    assert_eq!(trace.fate(2), &done(200, 300, 1));
    // Within one tenant an earlier promise still wins: the same request from tenant 1 is refused.
    let trace = replay(
        scheduler(1, 0, 1, 100),
        fixed(100),
        &[Arrival::new(0, 150), Arrival::new(0, 250), Arrival::new(0, 350), Arrival::new(1, 340)],
    );
    assert!(matches!(trace.fate(3), Fate::Refused { outcome: Outcome::Infeasible, .. }), "{:?}", trace.fate(3));
    assert_eq!(trace.fate(2), &done(200, 300, 1));
}

#[test]
fn batch_tier_work_fills_empty_seats_and_moves_no_interactive_timestamp() {
    // Two workers; interactive requests of 1–3 rows at irregular times, never needing both
    // workers at once (one is kept for them); a batch-tier backlog with long deadlines beside.
    let interactive: Vec<Arrival> = [0u64, 137, 260, 390, 515, 640, 800, 930, 1050, 1200, 1330, 1460]
        .iter()
        .enumerate()
        .map(|(k, &at)| Arrival::new(at, 300).rows(1 + (k as u32 % 3)))
        .collect();
    let batch: Vec<Arrival> =
        (0..200).map(|k| Arrival::new(k * 7, 20_000).priority(Priority::Batch).tenant(1)).collect();
    let alone = replay(exercise(2), fixed(100), &interactive);
    let all: Vec<Arrival> = interactive.iter().copied().chain(batch.iter().copied()).collect();
    let mixed = replay(exercise(2), fixed(100), &all);
    let times = |f: &Fate| match f {
        Fate::Done { dispatched, finished, .. } => (*dispatched, *finished),
        other => panic!("an interactive request ended {other:?}"),
    };
    for i in 0..interactive.len() {
        assert_eq!(times(mixed.fate(i)), times(alone.fate(i)), "interactive request {i}");
    }
    // The batch tier rode: in the interactive batches' empty seats and on the spare worker.
    let riders = mixed
        .batches
        .iter()
        .filter(|b| b.requests.iter().any(|&i| i < interactive.len()))
        .map(|b| b.requests.iter().filter(|&&i| i >= interactive.len()).count());
    assert!(riders.sum::<usize>() > 0);
    let served = (interactive.len()..all.len()).filter(|&i| matches!(mixed.fate(i), Fate::Done { .. })).count();
    assert!(served > 150, "{served} of 200 batch-tier requests served");
}

#[test]
fn admission_never_breaks_an_earlier_promise() {
    // One row per batch: every request is its own batch.
    let mut s = scheduler(1, 10, 1, 100);
    let t0 = Instant::now();
    let ticket = |id, at: u64, deadline: u64| Ticket {
        id,
        arrival: t0 + ms(at),
        deadline: t0 + ms(deadline),
        rows: 1,
        bytes: 1,
        priority: Priority::Interactive,
        tenant: 0,
        weight: 1,
        tokens: Tokens::default(),
    };
    s.admit(ticket(0, 0, 500), t0).unwrap();
    assert!(s.take(t0).is_some()); // running 0..100
    s.admit(ticket(1, 1, 301), t0 + ms(1)).unwrap(); // forecast 200
    s.admit(ticket(2, 2, 252), t0 + ms(2)).unwrap(); // goes ahead of 1: 200, and 1 moves to 300
    let refusal = s.admit(ticket(3, 3, 243), t0 + ms(3)).unwrap_err(); // would push 2 to 300 > 252
    assert_eq!(refusal.outcome, Outcome::Infeasible);
    assert!(refusal.message.contains("earlier promise"), "{}", refusal.message);
    assert_eq!(s.queue_depth(), 2);
}

#[test]
fn the_queue_is_bounded_by_count_and_by_bytes() {
    let mut s = exercise(1);
    s.policy.max_queue = 2;
    s.policy.max_queue_bytes = 100;
    let t0 = Instant::now();
    let ticket = |id, bytes| Ticket {
        id,
        arrival: t0,
        deadline: t0 + ms(10_000),
        rows: 1,
        bytes,
        priority: Priority::Interactive,
        tenant: 0,
        weight: 1,
        tokens: Tokens::default(),
    };
    s.admit(ticket(0, 60), t0).unwrap();
    let by_bytes = s.admit(ticket(1, 41), t0).unwrap_err();
    assert_eq!(by_bytes.outcome, Outcome::QueueFull);
    assert!(by_bytes.message.contains("--max-queue-bytes) of 100"), "{}", by_bytes.message);
    s.admit(ticket(2, 40), t0).unwrap();
    let by_count = s.admit(ticket(3, 1), t0).unwrap_err();
    assert!(by_count.message.contains("maxQueue) is 2"), "{}", by_count.message);
    assert!(by_count.retry_after_secs().unwrap() >= 1);
}

#[test]
fn a_queued_request_expires_exactly_at_its_deadline() {
    // The estimator believes 100 ms; the engine takes 300. E was admitted for 200 and is still
    // queued at its deadline.
    let mut arrivals = vec![Arrival::new(0, 1000); 4];
    arrivals.push(Arrival::new(1, 200));
    let trace = replay(exercise(1), fixed(300), &arrivals);
    assert_eq!(trace.fate(4), &Fate::Expired { at: ms(201) });
}

#[test]
fn a_request_that_can_no_longer_finish_is_not_given_a_seat() {
    // Engine 150 ms against an estimate of 100: at 150 the estimator has learnt, and E (due at
    // 201) cannot finish by 300; it is answered at once instead of riding.
    let mut arrivals = vec![Arrival::new(0, 1000); 4];
    arrivals.push(Arrival::new(1, 200));
    arrivals.push(Arrival::new(2, 1000));
    let trace = replay(exercise(1), fixed(150), &arrivals);
    assert_eq!(trace.fate(4), &Fate::Expired { at: ms(150) });
    assert_eq!(trace.fate(5), &done(150, 300, 1));
}

#[test]
fn next_names_the_timer_it_waits_for() {
    let mut s = exercise(1);
    let t0 = Instant::now();
    assert_eq!(s.next(t0), Next::Empty);
    let t = Ticket {
        id: 0,
        arrival: t0,
        deadline: t0 + ms(200),
        rows: 1,
        bytes: 1,
        priority: Priority::Interactive,
        tenant: 0,
        weight: 1,
        tokens: Tokens::default(),
    };
    s.admit(t, t0).unwrap();
    assert_eq!(s.next(t0), Next::At(t0 + 10 * MS));
    assert_eq!(s.next_wake(t0), Some(t0 + 10 * MS));
    assert_eq!(s.next(t0 + 10 * MS), Next::Dispatch(Trigger::MaxWait));
    let batch = s.take(t0 + 10 * MS).unwrap();
    assert_eq!((batch.rows, batch.worker), (1, 0));
    assert_eq!(s.busy_workers(), 1);
    s.admit(Ticket { id: 1, deadline: t0 + 300 * MS, ..t }, t0 + 11 * MS).unwrap();
    assert_eq!(s.next(t0 + 50 * MS), Next::WaitForWorker);
    s.finish(0, t0 + 110 * MS);
    assert_eq!(s.next(t0 + 110 * MS), Next::Dispatch(Trigger::MaxWait));
}

/// Admission prices a request by its tokens: with 2 ms per batch and 1 ms per token, a 300-token
/// text cannot finish inside a 200 ms budget and is refused at once (the estimate is named),
/// while a 20-token text arriving after it is admitted and rides in a batch whose expected end is
/// exactly 2 + 20 ms away. A third text joining the queue is priced with the batch it would share.
#[test]
fn admission_prices_tokens() {
    let policy = Policy {
        max_batch_rows: 8,
        max_wait: ms(10),
        deadline_margin: Duration::ZERO,
        max_queue: 1024,
        max_queue_bytes: 1 << 30,
    };
    let cost = CostModel { fixed: ms(2), per_token: ms(1), ..CostModel::default() };
    let mut s = Scheduler::new(policy, 1, Estimator::with_model(cost));
    let t0 = Instant::now();
    let text = |id, tokens: u32| Ticket {
        id,
        arrival: t0,
        deadline: t0 + ms(200),
        rows: 1,
        bytes: 1,
        priority: Priority::Interactive,
        tenant: 0,
        weight: 1,
        tokens: Tokens { total: tokens, longest: tokens },
    };
    let refused = s.admit(text(0, 300), t0).unwrap_err();
    assert_eq!(refused.outcome, Outcome::Infeasible);
    assert!(refused.message.contains("estimated completion in 302 ms, the deadline allows 200 ms"), "{refused}");
    s.admit(text(1, 20), t0).unwrap();
    // 20 + 150 tokens together: 172 ms after the 10 ms wait, within 200.
    s.admit(text(2, 150), t0).unwrap();
    // 40 more would make the shared batch 212 ms long: too long even if it left at once.
    let late = s.admit(text(3, 40), t0).unwrap_err();
    assert!(late.message.contains("estimated completion in 212 ms"), "{late}");
    assert_eq!(s.next(t0), Next::At(t0 + ms(10)));
    let batch = s.take(t0 + ms(10)).unwrap();
    assert_eq!(batch.shape, Shape { rows: 2, tokens: 170, longest: 150 });
    assert_eq!(s.estimate(batch.shape), ms(172));
}
