//! Property tests of the dispatch rule over random arrival traces, replayed in virtual time.

use std::time::Duration;

use ferry_core::estimate::Estimator;
use ferry_core::outcome::Outcome;
use ferry_core::replay::{replay, Arrival, Fate, Trace};
use ferry_core::scheduler::{Policy, Scheduler};
use ferry_core::ticket::Priority;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    cap: u32,
    max_wait: Duration,
    workers: usize,
    batch: Duration,
    per_row: Duration,
    max_queue: usize,
    /// Of tenants 0, 1 and 2.
    /// Of tenants 0, 1 and 2 (each arrival carries its own: this is for the report).
    #[allow(dead_code)]
    weights: [u32; 3],
    arrivals: Vec<Arrival>,
}

fn case(priorities: bool) -> impl Strategy<Value = Case> {
    traces(priorities, 20..=1000)
}

/// Long queues with generous deadlines: where admission's O(log n) shortcut decides (and debug
/// builds check it against the whole forecast).
fn long_queues() -> impl Strategy<Value = Case> {
    traces(true, 2000..=20_000)
}

fn traces(priorities: bool, timeouts: std::ops::RangeInclusive<u64>) -> impl Strategy<Value = Case> {
    (1u32..=16, 0u64..=50, 1usize..=4, 1u64..=200, 0u64..=5, 1usize..=64, [1u32..=3, 1u32..=3, 1u32..=3]).prop_flat_map(
        move |(cap, max_wait, workers, batch, per_row, max_queue, weights)| {
            let arrival = (0u64..=30, 1..=cap, timeouts.clone(), any::<bool>(), 0u16..=2);
            prop::collection::vec(arrival, 1..200).prop_map(move |raw| {
                let mut at = 0;
                let arrivals = raw
                    .into_iter()
                    .map(|(gap, rows, timeout, batch_tier, tenant)| {
                        at += gap;
                        let priority = if priorities && batch_tier { Priority::Batch } else { Priority::Interactive };
                        Arrival::new(at, timeout)
                            .rows(rows)
                            .priority(priority)
                            .tenant(tenant)
                            .weight(weights[usize::from(tenant)])
                    })
                    .collect();
                Case {
                    cap,
                    max_wait: Duration::from_millis(max_wait),
                    workers,
                    batch: Duration::from_millis(batch),
                    per_row: Duration::from_millis(per_row),
                    max_queue,
                    weights,
                    arrivals,
                }
            })
        },
    )
}

/// The engine takes `time_factor` × what the estimator believes (1: exact estimates).
fn run(c: &Case, time_factor: u32) -> Trace {
    let policy = Policy {
        max_batch_rows: c.cap,
        max_wait: c.max_wait,
        deadline_margin: Duration::ZERO,
        max_queue: c.max_queue,
        max_queue_bytes: u64::MAX,
    };
    let scheduler = Scheduler::new(policy, c.workers, Estimator::new(c.batch, c.per_row));
    let (batch, per_row) = (c.batch, c.per_row);
    replay(scheduler, move |rows| (batch + per_row * rows) * time_factor, &c.arrivals)
}

fn check_invariants(c: &Case, t: &Trace) -> Result<(), TestCaseError> {
    // A batch never exceeds the cap, and its rows are its requests' rows.
    for b in &t.batches {
        prop_assert!(b.rows <= c.cap, "batch of {} rows over cap {}", b.rows, c.cap);
        let sum: u32 = b.requests.iter().map(|&i| c.arrivals[i].rows).sum();
        prop_assert_eq!(sum, b.rows);
        prop_assert!(!b.requests.is_empty());
    }
    // No dispatch while no worker is idle: a worker's batches never overlap.
    for w in 0..c.workers {
        let mut mine: Vec<_> = t.batches.iter().filter(|b| b.worker == w).collect();
        mine.sort_by_key(|b| b.dispatched);
        for pair in mine.windows(2) {
            prop_assert!(pair[1].dispatched >= pair[0].finished, "worker {} overlapped", w);
        }
    }
    // Every request ends exactly once; a request rides in at most one batch, and an answered one
    // in exactly one; no 200 after a deadline.
    let mut rides = vec![0; c.arrivals.len()];
    for b in &t.batches {
        for &i in &b.requests {
            rides[i] += 1;
        }
    }
    for (i, a) in c.arrivals.iter().enumerate() {
        let fate = t.fates[i].as_ref();
        // Conservation: the ledger ended every request once, neither twice nor never.
        prop_assert_eq!(t.ends[i], 1, "request {} ended {} times", i, t.ends[i]);
        prop_assert!(rides[i] <= 1);
        match fate.unwrap() {
            Fate::Done { finished, .. } => {
                prop_assert_eq!(rides[i], 1);
                prop_assert!(*finished <= a.at + a.timeout, "request {} answered 200 after its deadline", i);
            }
            Fate::Expired { at } => {
                prop_assert!(*at <= a.at + a.timeout, "request {} answered 504 after its deadline", i);
            }
            Fate::Refused { outcome, .. } => {
                prop_assert!(matches!(outcome, Outcome::QueueFull | Outcome::Infeasible));
                prop_assert_eq!(rides[i], 0);
            }
            Fate::Failed { .. } => prop_assert!(false, "request {} failed, with an engine that never fails", i),
            Fate::Shed { at } => {
                prop_assert!(*at <= a.at + a.timeout, "request {} shed after its deadline", i);
                prop_assert_eq!(rides[i], 0);
            }
        }
    }
    // No request waits past maxWait while a worker sits idle: from the moment its timer ran out
    // until it left, every worker was busy. A batch of batch-tier requests alone keeps one idle
    // worker for interactive work: a batch-tier request waits only while fewer than two are idle.
    // One that rides with interactive requests leaves when their timers say.
    let interactive_waits: Vec<(Duration, Duration)> = (0..c.arrivals.len())
        .filter(|&i| c.arrivals[i].priority == Priority::Interactive)
        .filter_map(|i| {
            let left = match t.fates[i].as_ref()? {
                Fate::Done { dispatched, .. } => *dispatched,
                Fate::Expired { at } | Fate::Shed { at } | Fate::Failed { at } => *at,
                Fate::Refused { .. } => return None,
            };
            Some((c.arrivals[i].at, left))
        })
        .collect();
    for b in &t.batches {
        let mixed = b.requests.iter().any(|&i| c.arrivals[i].priority == Priority::Interactive);
        for &i in &b.requests {
            let due = c.arrivals[i].at + c.max_wait;
            // A batch-tier rider leaves with the interactive requests, when their timers say.
            if b.dispatched <= due || (mixed && c.arrivals[i].priority == Priority::Batch) {
                continue;
            }
            if c.arrivals[i].priority == Priority::Batch {
                // While interactive requests wait, their timers govern the next batch (a batch-tier
                // batch alone would hold them up): only the idle time outside those spans counts.
                let idle: Vec<Vec<(Duration, Duration)>> = (0..c.workers)
                    .map(|w| uncovered(idle_spans(t, w, due, b.dispatched), &interactive_waits))
                    .collect();
                if c.workers == 1 {
                    prop_assert!(
                        idle[0].is_empty(),
                        "batch-tier request {} waited past its maxWait at {:?} while the worker was idle: {:?}",
                        i,
                        due,
                        idle[0]
                    );
                }
                for (w1, w2) in (0..c.workers).flat_map(|a| (a + 1..c.workers).map(move |b| (a, b))) {
                    let together = idle[w1].iter().any(|x| idle[w2].iter().any(|y| x.0.max(y.0) < x.1.min(y.1)));
                    prop_assert!(
                        !together,
                        "batch-tier request {} waited until {:?} past its maxWait at {:?} while workers {} and {} were idle",
                        i,
                        b.dispatched,
                        due,
                        w1,
                        w2
                    );
                }
                continue;
            }
            for w in 0..c.workers {
                prop_assert!(
                    idle_spans(t, w, due, b.dispatched).is_empty(),
                    "request {} waited until {:?} past its maxWait at {:?} while worker {} was idle",
                    i,
                    b.dispatched,
                    due,
                    w
                );
            }
        }
    }
    Ok(())
}

/// Admission's promise: no admitted request of priority `up_to` or a higher one expired.
fn no_admitted_request_expired(c: &Case, t: &Trace, up_to: Priority) -> Result<(), TestCaseError> {
    for (i, fate) in t.fates.iter().enumerate() {
        prop_assert!(
            c.arrivals[i].priority > up_to || !matches!(fate, Some(Fate::Expired { .. })),
            "request {} ({:?}) was admitted but expired: {:?}",
            i,
            c.arrivals[i],
            fate
        );
    }
    Ok(())
}

/// What of `spans` no span of `covers` covers.
fn uncovered(spans: Vec<(Duration, Duration)>, covers: &[(Duration, Duration)]) -> Vec<(Duration, Duration)> {
    let mut out = spans;
    for &(a, b) in covers {
        out = out
            .into_iter()
            .flat_map(|(x, y)| {
                if b <= x || y <= a {
                    vec![(x, y)]
                } else {
                    [(x, a.max(x)), (b.min(y), y)].into_iter().filter(|s| s.0 < s.1).collect()
                }
            })
            .collect();
    }
    out
}

/// The spans of `[from, to)` in which worker `w` ran no batch.
fn idle_spans(t: &Trace, w: usize, from: Duration, to: Duration) -> Vec<(Duration, Duration)> {
    let mut mine: Vec<(Duration, Duration)> =
        t.batches.iter().filter(|b| b.worker == w).map(|b| (b.dispatched, b.finished)).collect();
    mine.sort();
    let mut spans = Vec::new();
    let mut at = from;
    for (start, end) in mine {
        if end <= at {
            continue;
        }
        if start > at {
            spans.push((at, start.min(to)));
        }
        at = at.max(end);
        if at >= to {
            break;
        }
    }
    if at < to {
        spans.push((at, to));
    }
    spans.retain(|s| s.0 < s.1);
    spans
}

/// 300 cases a run; `PROPTEST_CASES` asks for more (or fewer).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn the_dispatch_rule_holds_on_random_traces(c in case(true), slow in 1u32..=3) {
        let trace = run(&c, slow);
        check_invariants(&c, &trace)?;
    }

    /// With exact estimates, admission's promise holds: no request that was admitted misses its
    /// deadline.
    #[test]
    fn with_exact_estimates_admitted_requests_meet_their_deadlines(c in case(false)) {
        let trace = run(&c, 1);
        check_invariants(&c, &trace)?;
        no_admitted_request_expired(&c, &trace, Priority::Batch)?;
    }

    /// Where the shortcut admits (every admission then also runs the whole forecast, in debug
    /// builds, and must agree), the dispatch rule and the promise still hold.
    #[test]
    fn admission_into_long_queues_keeps_the_rule_and_the_promise(c in long_queues()) {
        let trace = run(&c, 1);
        check_invariants(&c, &trace)?;
        no_admitted_request_expired(&c, &trace, Priority::Interactive)?;
    }

    /// With priorities, the promise is kept to every interactive request: neither a batch-tier
    /// request nor a later interactive one makes an admitted interactive request miss. (Batch-tier
    /// requests only ride in seats interactive ones leave, so an interactive arrival may still
    /// push them out.)
    #[test]
    fn with_priorities_admitted_interactive_requests_meet_their_deadlines(c in case(true)) {
        let trace = run(&c, 1);
        check_invariants(&c, &trace)?;
        no_admitted_request_expired(&c, &trace, Priority::Interactive)?;
    }
}
