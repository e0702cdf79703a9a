//! The event-driven forecast against the step-by-step one, on random small schedulers: the same
//! fates (first token, end and longest step of every sequence; the newcomer's tokens in time) and
//! the same admission decisions, word for word. Some prompts start with a shared one, so that
//! the prefix cache holds part of them.

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::time::Instant;

use super::{admit_by, bound, events, forecast, InFlight, Method};
use crate::generation::kv::BlockPool;
use crate::generation::prefix::Prefix;
use crate::generation::scheduler::{Discipline, Late, Policy, Scheduler};
use crate::generation::sequence::Request;
use crate::generation::step::{StepCost, StepEstimator, StepShape};
use crate::ticket::Priority;

/// A request: prompt, max_tokens, TTFT ms, inter-token ms, deadline ms, batch tier, tenant,
/// and how many of its prompt's first tokens are the shared prompt's.
type Ask = (u32, u32, u64, u64, u64, bool, u16, u32);

/// The block size of the cases.
const BLOCK: u32 = 4;

#[derive(Debug, Clone)]
struct Case {
    policy: Policy,
    blocks: u32,
    cost: StepCost,
    /// Measured steps (decodes, context, took in µs), some a second apart, for both fits.
    measured: Vec<(u32, u64, u64)>,
    /// Requests and their arrivals, ms.
    requests: Vec<(u64, Ask)>,
    /// Steps run before the forecast, and whether one more is in flight.
    steps: usize,
    in_flight: bool,
    newcomer: Ask,
    margin_ms: u64,
}

fn case() -> impl Strategy<Value = Case> {
    let policy = (16u32..400, 1u32..8, 0u32..3).prop_map(|(tokens, seqs, watermark)| Policy {
        max_batch_tokens: tokens,
        max_sequences: seqs,
        max_queue: 64,
        max_queue_bytes: u64::MAX,
        max_queue_tokens: u64::MAX,
        max_context: 4096,
        watermark,
        discipline: Discipline::Deadlines,
    });
    let cost = (1u64..10_000, 0u64..2_000, 1u64..300, 0u64..2_000, 0u64..80).prop_map(|(f, d, p, c, a)| StepCost {
        fixed: Duration::from_micros(f),
        per_decode: Duration::from_micros(d),
        per_prefill_token: Duration::from_micros(p),
        per_context_token: Duration::from_nanos(c),
        per_attended_slot: Duration::from_nanos(a),
    });
    let request = || {
        (
            1u32..80,
            1u32..40,
            20u64..3_000,
            5u64..300,
            50u64..20_000,
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.1),
            prop::sample::select(vec![0u32, 0, 0, 5, 12, 40, 80]),
        )
    };
    (
        policy,
        30u32..600,
        cost,
        prop::collection::vec((1u32..10, 0u64..2_000, 100u64..40_000), 0..10),
        prop::collection::vec((0u64..300, request()), 0..10),
        0usize..30,
        any::<bool>(),
        request(),
        0u64..5,
    )
        .prop_map(|(policy, blocks, cost, measured, requests, steps, in_flight, newcomer, margin_ms)| Case {
            policy,
            blocks,
            cost,
            measured,
            requests: requests
                .into_iter()
                .map(|(at, (p, m, ttft, itl, dl, batch, t, sh))| (at, (p, m, ttft, itl, dl, batch, u16::from(t), sh)))
                .collect(),
            steps,
            in_flight,
            newcomer: (
                newcomer.0,
                newcomer.1,
                newcomer.2,
                newcomer.3,
                newcomer.4,
                newcomer.5,
                u16::from(newcomer.6),
                newcomer.7,
            ),
            margin_ms,
        })
}

/// The names of the full blocks of request `id`'s prompt: the shared prompt's tokens, then its own.
fn prefix(id: u64, ask: Ask) -> Prefix {
    let (prompt, shared) = (ask.0, ask.7.min(ask.0));
    let tokens: Vec<u32> = (0..prompt).map(|p| if p < shared { 1 << 31 | p } else { id as u32 * 10_000 + p }).collect();
    Prefix::of(0, &tokens, BLOCK)
}

fn request(id: u64, at: Instant, (prompt, max_tokens, ttft, itl, deadline, batch, tenant, _): Ask) -> Request {
    let ms = Duration::from_millis;
    Request {
        id,
        arrival: at,
        priority: if batch { Priority::Batch } else { Priority::Interactive },
        tenant,
        weight: 1,
        prompt,
        max_tokens,
        bytes: 0,
        ttft_deadline: at + ms(ttft),
        itl: ms(itl),
        deadline: at + ms(deadline.max(ttft)),
    }
}

/// The scheduler the case describes, the instant of the forecast, the step in flight (if any).
fn build(c: &Case, t0: Instant) -> (Scheduler, Instant, Option<(super::StepPlan, Instant)>) {
    let mut estimator = StepEstimator::new(c.cost);
    for (i, (decodes, context, us)) in c.measured.iter().enumerate() {
        let shape = StepShape { decodes: *decodes, prefill: 0, context: *context, attended: *context };
        estimator.observe(shape, Duration::from_micros(*us), t0 + Duration::from_millis(300 * i as u64));
    }
    let mut s = Scheduler::new(c.policy, BlockPool::new(c.blocks, BLOCK), estimator)
        .with_step_reserve(Duration::from_micros(500));
    let mut arrivals: Vec<_> = c.requests.iter().enumerate().collect();
    arrivals.sort_by_key(|(i, r)| (r.0, *i));
    let mut now = t0;
    let mut next = 0;
    for _ in 0..c.steps {
        while next < arrivals.len() && t0 + Duration::from_millis(arrivals[next].1 .0) <= now {
            let (i, (_, ask)) = arrivals[next];
            let req = request(i as u64, now, *ask);
            if s.check_bounds(&req).is_ok() {
                s.insert(req, prefix(i as u64, *ask));
            }
            next += 1;
        }
        let (plan, _) = s.plan(now);
        match plan {
            Some(plan) => {
                now += plan.expected;
                s.complete(&plan, now, &|_| false, Late::Ends);
            }
            None => now += Duration::from_millis(7),
        }
    }
    let in_flight = if c.in_flight {
        let (plan, _) = s.plan(now);
        plan.map(|p| {
            let end = now + p.expected;
            (p, end)
        })
    } else {
        None
    };
    (s, now, in_flight)
}

/// Runs every case: the fates agree field by field where the event-driven forecast runs, the
/// decisions agree always; it must run (not decline) in most cases, or the test proves little.
#[test]
fn the_forecast_from_events_is_the_forecast_step_by_step() {
    let mut runner = TestRunner::new(Config { cases: 600, ..Config::default() });
    let ran = std::cell::Cell::new(0u32);
    let bounded = std::cell::Cell::new(0u32);
    let harms = std::cell::Cell::new(0u32);
    runner
        .run(&case(), |c| {
            let t0 = Instant::now();
            let (s, now, in_flight) = build(&c, t0);
            let flight = in_flight.as_ref().map(|(plan, end)| InFlight { plan, end: *end });
            let margin = Duration::from_millis(c.margin_ms);
            let r = request(1000, now, c.newcomer);
            let named = prefix(1000, c.newcomer);
            if s.check_bounds(&r).is_err() {
                return Ok(());
            }
            let cached = s.cached_tokens(&r, &named);
            for newcomer in [Some(&r), None] {
                let Ok(fast) = events::run(&s, flight, now, margin, newcomer, cached) else { continue };
                ran.set(ran.get() + 1);
                let slow = forecast(&s, flight, now, margin, (newcomer, &named), Method::Steps);
                prop_assert_eq!(fast.ids.clone(), slow.ids.clone());
                for ((id, f), (_, g)) in fast.iter().zip(slow.iter()) {
                    prop_assert_eq!(
                        (f.first, f.end, f.longest_step),
                        (g.first, g.end, g.longest_step),
                        "sequence {}",
                        id
                    );
                }
                if newcomer.is_some() {
                    prop_assert_eq!(fast.get(r.id).unwrap().in_time, slow.get(r.id).unwrap().in_time);
                }
            }
            let by_steps = admit_by(&s, flight, (&r, &named), now, margin, Method::Steps);
            if let Some(last) = bound::latest(&s, flight, &r, cached, now, &mut bound::Totals::from(&r)) {
                // Every first token and every end by then, every decode step within its target.
                let mut with = s.clone();
                with.insert(r, named.clone());
                let slow = forecast(&with, flight, now, Duration::ZERO, (None, &named), Method::Steps);
                for (id, f) in slow.iter() {
                    let itl = s.seqs.get(&id).map_or(r.itl, |q| q.request.itl);
                    prop_assert!(
                        f.first.is_some_and(|t| t <= last) && f.end.is_some_and(|t| t <= last),
                        "sequence {}: {:?}, the bound {:?}",
                        id,
                        f,
                        last - now
                    );
                    prop_assert!(
                        f.longest_step <= itl,
                        "sequence {}: {:?} steps, target {:?}",
                        id,
                        f.longest_step,
                        itl
                    );
                }
            }
            if bound::clearly_kept(&s, flight, &r, cached, now, margin) {
                bounded.set(bounded.get() + 1);
                prop_assert_eq!(&by_steps, &Ok(()), "the bound admitted what the forecast refuses");
            }
            // The same decision; the same refusal, except where the forecasts side by side found
            // an admitted sequence harmed before the newcomer's own end (the step-by-step one
            // reports the newcomer's own broken promise first, when it has one too).
            let by_events = admit_by(&s, flight, (&r, &named), now, margin, Method::Events);
            prop_assert_eq!(by_events.is_ok(), by_steps.is_ok(), "{:?} by events, {:?} by steps", by_events, by_steps);
            // A newcomer whose own promises are loose and whose prompt is long: what decides is
            // whether it harms the others (the forecasts side by side, and their fork).
            let (prompt, max_tokens, .., batch, tenant, shared) = c.newcomer;
            let ask = (prompt * 4 + 64, max_tokens, 1 << 30, 1 << 30, 1 << 30, batch, tenant, shared);
            let (loose, loose_named) = (request(1001, now, ask), prefix(1001, ask));
            // The others' deadlines just met without it (0 to 24 ms to spare, each its own),
            // so that whether it harms them is the question.
            let mut tight = s.clone();
            for (id, fate) in forecast(&s, flight, now, margin, (None, &named), Method::Steps).iter() {
                if let (Some(end), Some(q)) = (fate.end, tight.seqs.get_mut(&id)) {
                    q.request.deadline = end + margin + Duration::from_millis(id * 7 % 25);
                }
            }
            for s in [&s, &tight] {
                if s.check_bounds(&loose).is_err() {
                    continue;
                }
                let by_events = admit_by(s, flight, (&loose, &loose_named), now, margin, Method::Events);
                let by_steps = admit_by(s, flight, (&loose, &loose_named), now, margin, Method::Steps);
                prop_assert_eq!(
                    by_events.is_ok(),
                    by_steps.is_ok(),
                    "{:?} by events, {:?} by steps",
                    by_events,
                    by_steps
                );
                let judged = events::judge(s, flight, now, margin, &loose, s.cached_tokens(&loose, &loose_named));
                harms.set(harms.get() + u32::from(matches!(judged, Ok(events::Judged::Harms))));
            }
            if let Err(refusal) = &by_events {
                if refusal.message.starts_with("admitting it would make") {
                    harms.set(harms.get() + 1);
                } else {
                    prop_assert_eq!(&by_events, &by_steps);
                }
            }
            Ok(())
        })
        .unwrap();
    assert!(ran.get() >= 600, "the event-driven forecast ran {} times in 600 cases (two forecasts each)", ran.get());
    assert!(bounded.get() >= 30, "the bound settled {} of 600 cases", bounded.get());
    assert!(harms.get() >= 100, "the forecasts side by side found a harm in {} of 600 cases", harms.get());
}

/// A newcomer whose prompt the prefix cache holds takes those blocks at once: its first chunk
/// needs only the rest. Where the pool holds what it needs but not its cached blocks twice over,
/// the forecast from events still runs (it counted them twice, declined, and left the question
/// to the step-by-step forecast), and it says what that one says.
#[test]
fn a_newcomers_cached_blocks_are_counted_once() {
    let t0 = Instant::now();
    let policy = Policy {
        max_batch_tokens: 256,
        max_sequences: 4,
        max_queue: 64,
        max_queue_bytes: u64::MAX,
        max_queue_tokens: u64::MAX,
        max_context: 4096,
        watermark: 0,
        discipline: Discipline::Deadlines,
    };
    let cost = StepCost {
        fixed: Duration::from_millis(5),
        per_decode: Duration::from_micros(100),
        per_prefill_token: Duration::from_micros(20),
        per_context_token: Duration::ZERO,
        per_attended_slot: Duration::ZERO,
    };
    // 14 blocks of 4. A 40-token prompt, all of it the shared one, runs to its end: its 10 full
    // blocks stay in the cache, free.
    let mut s = Scheduler::new(policy, BlockPool::new(14, BLOCK), StepEstimator::new(cost));
    let first: Ask = (40, 1, 3_000, 300, 20_000, false, 0, 40);
    s.insert(request(1, t0, first), prefix(1, first));
    let mut now = t0;
    while let (Some(plan), _) = s.plan(now) {
        now += plan.expected;
        s.complete(&plan, now, &|_| false, Late::Ends);
    }
    assert!(s.seqs.is_empty());
    // The newcomer: the same 40 tokens and one more, 7 to produce — 12 blocks, 10 of them cached.
    let ask: Ask = (41, 7, 3_000, 300, 20_000, false, 0, 40);
    let (r, named) = (request(2, now, ask), prefix(2, ask));
    let cached = s.cached_tokens(&r, &named);
    assert_eq!(cached, 40);
    let Ok(fast) = events::run(&s, None, now, Duration::ZERO, Some(&r), cached) else {
        panic!("the forecast from events declined")
    };
    let slow = forecast(&s, None, now, Duration::ZERO, (Some(&r), &named), Method::Steps);
    let (f, g) = (fast.get(2).unwrap(), slow.get(2).unwrap());
    assert_eq!((f.first, f.end, f.longest_step, f.in_time), (g.first, g.end, g.longest_step, g.in_time));
    assert!(g.end.is_some() && g.in_time == 7, "{g:?}");
}
