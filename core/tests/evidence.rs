//! No learned figure can lock admission shut ([`ferry_core::evidence`]): property tests, one per
//! admission path, in virtual time.
//!
//! Each starts from an arbitrary learned state — a history of up to 5 s in which the engine (or
//! the upstream) ran up to 40 times slower than it truly does, the process stalled for up to 2 s
//! (a timer's late wake) and answers took up to a second to reach their callers — and then lets
//! the engine run at its true speed, the timer wake on time, and sends *pairs* of feasible
//! requests: two at once, each of which the true engine finishes in time with the other beside
//! it. The first of a pair may be admitted as a probe (rule 3); the second only if the figures
//! are right again. The bound, for each path: from `clear` — when nothing of the history is left
//! in flight or queued (its last batch, step or upstream request ended, or its last deadline
//! passed) — every pair that arrives after `clear + 3 × (RECENT_SPAN + (RECENT_MIN + 1) × period)`
//! is admitted whole and answered in time, where `period` is the pairs' spacing (each pair finds
//! the engine idle): see [`recovery`].

use std::cell::RefCell;
use std::time::Duration;

use ferry_core::estimate::Estimator;
use ferry_core::evidence::{RECENT_MIN, RECENT_SPAN};
use ferry_core::generation::ledger::Event as StepEvent;
use ferry_core::generation::replay::{self as step_replay, Ending, Setup};
use ferry_core::generation::scheduler::{Discipline, Policy as StepPolicy};
use ferry_core::generation::sequence::FinishReason;
use ferry_core::generation::sequence::{End, Request, SeqId};
use ferry_core::generation::step::{StepCost, StepShape};
use ferry_core::generation::window::{
    Effect as WindowEffect, Event as WindowEvent, UpstreamCost, Window, WindowPolicy,
};
use ferry_core::ledger::{Event, Ledger, RetryPolicy};
use ferry_core::replay::{replay_in, Arrival, Fate};
use ferry_core::scheduler::{Policy, Scheduler};
use ferry_core::ticket::Priority;
use proptest::prelude::*;

const MS: Duration = Duration::from_millis(1);
/// The shell's timer wakes at least this often (the sidecar's batcher and step loop do).
const TICK_MS: u64 = 50;

/// How long after nothing of the history is left every feasible pair is admitted, for pairs
/// `period` ms apart: three times a second of the true engine's figures, and enough of them that the
/// newest few are all true ([`ferry_core::evidence::recent`]) — once for the estimates to be
/// true, and once more for the margin's overshoot, measured against those estimates (an estimate
/// that a stale fit made too low shows as overshoot until it is corrected) — and once more, as a
/// rare trace (kept in evidence.proptest-regressions) showed overshoot learned while the
/// estimates were still settling outlive two rounds by a few ms.
fn recovery(period: u64) -> u64 {
    3 * (ms(RECENT_SPAN) + (RECENT_MIN as u64 + 1) * period)
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// A learned history: what happened in the first `length` of the trace.
#[derive(Debug, Clone)]
struct History {
    length: u64,
    /// (gap since the previous arrival, rows, timeout), all in ms.
    arrivals: Vec<(u64, u32, u64)>,
    /// How many times slower than true each batch (or step) of the history ran, in turn.
    slowness: Vec<u32>,
    /// Timer wakes of the history: (at, lateness) in ms. Most are on time; some are stalls.
    wakes: Vec<(u64, u64)>,
    /// Answers' trips to their callers: (at, took) in ms.
    trips: Vec<(u64, u64)>,
}

impl History {
    /// Its arrivals as (at, rows, timeout) in ms: those that fall within its length.
    fn arrivals(&self) -> Vec<(u64, u32, u64)> {
        let mut at = 0;
        self.arrivals
            .iter()
            .map(|&(gap, rows, timeout)| {
                at += gap;
                (at, rows, timeout)
            })
            .take_while(|a| a.0 <= self.length)
            .collect()
    }

    /// The timer's wakes as (at, lateness) in ms: the history's, then on time every tick from its
    /// end to `until`.
    fn wakes(&self, until: u64) -> Vec<(u64, u64)> {
        let on_time = (self.length..=until).step_by(TICK_MS as usize).map(|at| (at, 0));
        self.wakes.iter().copied().chain(on_time).collect()
    }
}

fn history() -> impl Strategy<Value = History> {
    (
        0u64..=5000,
        prop::collection::vec((0u64..=40, 1u32..=16, 20u64..=3000), 0..150),
        prop::collection::vec(1u32..=40, 1..20),
        prop::collection::vec((0u64..=5000, prop_oneof![3 => 0u64..=30, 1 => 0u64..=2000]), 0..60),
        prop::collection::vec((0u64..=5000, 0u64..=1000), 0..30),
    )
        .prop_map(|(length, arrivals, slowness, wakes, trips)| History {
            length,
            wakes: wakes.into_iter().filter(|w| w.0 <= length).collect(),
            trips: trips.into_iter().filter(|t| t.0 <= length).collect(),
            arrivals,
            slowness,
        })
}

#[derive(Debug, Clone)]
struct RequestCase {
    cap: u32,
    workers: usize,
    max_wait: u64,
    fixed: u64,
    per_row: u64,
    floor: u64,
    /// What a pair's deadline leaves beyond the true time of their batch and the margin's floor.
    slack: u64,
    /// Between pairs, beyond what a pair takes.
    spacing: u64,
    history: History,
}

fn request_case() -> impl Strategy<Value = RequestCase> {
    (2u32..=16, 1usize..=3, 0u64..=50, 5u64..=100, 0u64..=5, 0u64..=5, 1u64..=50, 0u64..=200, history()).prop_map(
        |(cap, workers, max_wait, fixed, per_row, floor, slack, spacing, history)| RequestCase {
            cap,
            workers,
            max_wait,
            fixed,
            per_row,
            floor,
            slack,
            spacing,
            history,
        },
    )
}

/// The request-level batcher (`sim`, and every request-level engine).
fn request_level(c: &RequestCase) -> Result<(), TestCaseError> {
    let true_time = |rows: u32| MS * (c.fixed + c.per_row * u64::from(rows)) as u32;
    let policy = Policy {
        max_batch_rows: c.cap,
        max_wait: MS * c.max_wait as u32,
        deadline_margin: MS * c.floor as u32,
        max_queue: 64,
        max_queue_bytes: u64::MAX,
    };
    let scheduler = Scheduler::new(policy, c.workers, Estimator::new(MS * c.fixed as u32, MS * c.per_row as u32));
    let ledger = Ledger::new(scheduler, RetryPolicy::default());

    let h = &c.history;
    let mut arrivals: Vec<Arrival> =
        h.arrivals().into_iter().map(|(at, rows, timeout)| Arrival::new(at, timeout).rows(rows.min(c.cap))).collect();
    let historic = arrivals.len();
    let last_deadline = arrivals.iter().map(|a| ms(a.at + a.timeout)).max().unwrap_or(0);
    // The pairs: each needs one batch of two rows (or two of one), and its deadline allows that
    // plus the margin's floor and the slack.
    let timeout = ms(true_time(2)) + c.floor + c.slack;
    let period = timeout + c.max_wait + c.spacing + 1;
    let horizon = h.length.max(last_deadline) + 40 * ms(true_time(c.cap)) + recovery(0) + 18 * period;
    let first_pair = arrivals.len();
    let mut t = h.length;
    while t <= horizon {
        arrivals.push(Arrival::new(t, timeout));
        arrivals.push(Arrival::new(t, timeout));
        t += period;
    }
    let mut events: Vec<(Duration, Event)> = h
        .wakes(horizon + period)
        .into_iter()
        .map(|(at, late)| (MS * at as u32, Event::Woke(MS * late as u32)))
        .collect();
    events.extend(h.trips.iter().map(|&(at, took)| (MS * at as u32, Event::Trip(MS * took as u32))));
    let turn = RefCell::new(0usize);
    let engine = |at: Duration, rows: u32| {
        if ms(at) < h.length {
            let mut turn = turn.borrow_mut();
            *turn += 1;
            true_time(rows) * h.slowness[*turn % h.slowness.len()]
        } else {
            true_time(rows)
        }
    };
    let trace = replay_in(ledger, engine, &arrivals, &events);

    // Nothing of the history is left: its batches ended, its deadlines passed.
    let history_batches = trace.batches.iter().filter(|b| b.requests.iter().any(|&r| r < historic));
    let clear = history_batches.map(|b| ms(b.finished)).chain([h.length, last_deadline]).max().unwrap_or(0);
    let bound = clear + recovery(period);
    let mut judged = 0;
    for pair in (first_pair..arrivals.len()).step_by(2) {
        let arrival = ms(arrivals[pair].at);
        if arrival < bound {
            continue;
        }
        judged += 1;
        for r in [pair, pair + 1] {
            match trace.fate(r) {
                Fate::Done { finished, .. } => prop_assert!(
                    ms(*finished) <= arrival + timeout,
                    "request {r} (arrived {arrival} ms) answered at {finished:?}, past its deadline"
                ),
                other => prop_assert!(
                    false,
                    "request {r}, arriving at {arrival} ms, {} ms after nothing of the history was left ({clear} ms; \
                     the bound {bound} ms): {other:?}",
                    arrival - clear
                ),
            }
        }
    }
    prop_assert!(judged >= 2, "the trace judges pairs past the bound");
    Ok(())
}

#[derive(Debug, Clone)]
struct StepCase {
    fixed: u64,
    per_decode_us: u64,
    per_prefill_us: u64,
    prompt: u32,
    max_tokens: u32,
    floor: u64,
    slack: u64,
    spacing: u64,
    history: History,
    /// Each pair is one request's two choices (OpenAI's n = 2), admitted together, rather than
    /// two requests.
    grouped: bool,
}

fn step_case() -> impl Strategy<Value = StepCase> {
    let costs = (5u64..=30, 0u64..=2000, 0u64..=100, 1u32..=256, 1u32..=16, 0u64..=5, 1u64..=50, 0u64..=200);
    (costs, history(), any::<bool>()).prop_map(
        |((fixed, per_decode_us, per_prefill_us, prompt, max_tokens, floor, slack, spacing), history, grouped)| {
            StepCase {
                fixed,
                per_decode_us,
                per_prefill_us,
                prompt,
                max_tokens,
                floor,
                slack,
                spacing,
                history,
                grouped,
            }
        },
    )
}

/// The generation step scheduler (`sim-llm`, `llm`).
fn generation(c: &StepCase) -> Result<(), TestCaseError> {
    let us = Duration::from_micros(1);
    let cost = StepCost {
        fixed: MS * c.fixed as u32,
        per_decode: us * c.per_decode_us as u32,
        per_prefill_token: us * c.per_prefill_us as u32,
        per_context_token: Duration::ZERO,
        per_attended_slot: Duration::ZERO,
    };
    let policy = StepPolicy {
        max_batch_tokens: 2048,
        max_sequences: 64,
        max_queue: 256,
        max_queue_bytes: 1 << 30,
        max_queue_tokens: 1 << 30,
        max_context: 100_000,
        watermark: 0,
        discipline: Discipline::Deadlines,
    };
    let setup = Setup { policy, blocks: 10_000, block_size: 16, cost, prior: cost, margin: MS * c.floor as u32 };

    let h = &c.history;
    let mut arrivals = Vec::new();
    for (at, rows, timeout) in h.arrivals() {
        // A history request: `rows` sets its prompt (× 32 tokens) and its output, its timeout its
        // first-token deadline, inter-token target and completion.
        let ttft = timeout.min(2000);
        arrivals.push(
            step_replay::Arrival::new(at, rows * 32, rows * 4)
                .ttft_ms(ttft)
                .itl_ms(ttft / 4 + 10)
                .timeout_ms(timeout + 3000),
        );
    }
    let historic = arrivals.len();
    let last_deadline = arrivals.iter().map(|a| ms(a.at + a.timeout)).max().unwrap_or(0);
    // The pairs: both prompts prefill in one step, then they decode side by side; each deadline
    // allows the true steps plus the margin's floor and the slack.
    let prefill = cost.time(StepShape { prefill: 2 * c.prompt, ..StepShape::default() });
    let decode = cost.time(StepShape { decodes: 2, ..StepShape::default() });
    let ttft = ms(prefill) + 1 + c.floor + c.slack;
    let itl = ms(decode) + 1 + c.floor + c.slack;
    let timeout = ttft + u64::from(c.max_tokens) * itl;
    let period = timeout + c.spacing + 1;
    // A history step that started just before its end may run 40 times the longest step.
    let longest = cost.time(StepShape {
        decodes: policy.max_sequences,
        prefill: policy.max_batch_tokens,
        ..StepShape::default()
    });
    let horizon = h.length.max(last_deadline) + 40 * ms(longest) + recovery(0) + 18 * period;
    let first_pair = arrivals.len();
    let mut t = h.length;
    while t <= horizon {
        // A pair of requests, or one request's two choices: a group recovers as two requests do.
        let a = step_replay::Arrival::new(t, c.prompt, c.max_tokens).ttft_ms(ttft).itl_ms(itl).timeout_ms(timeout);
        let leader = arrivals.len();
        arrivals.push(a);
        arrivals.push(if c.grouped { a.fork_of(leader) } else { a });
        t += period;
    }
    let mut events: Vec<(Duration, StepEvent)> = h
        .wakes(horizon + period)
        .into_iter()
        .map(|(at, late)| (MS * at as u32, StepEvent::Woke(MS * late as u32)))
        .collect();
    events.extend(h.trips.iter().map(|&(at, took)| (MS * at as u32, StepEvent::Trip(MS * took as u32))));
    let turn = RefCell::new(0usize);
    let step_time = |at: Duration, shape: StepShape| {
        if ms(at) < h.length {
            let mut turn = turn.borrow_mut();
            *turn += 1;
            cost.time(shape) * h.slowness[*turn % h.slowness.len()]
        } else {
            cost.time(shape)
        }
    };
    let trace = step_replay::replay_in(setup, &arrivals, step_time, &events);

    let history_steps = trace.steps.iter().filter(|s| s.plan.members.iter().any(|m| (m.id as usize) < historic));
    let history_ends = trace.fates[..historic].iter().filter_map(|f| f.end.as_ref().map(|e| ms(e.0)));
    let clear = history_steps.map(|s| ms(s.started + s.took)).chain(history_ends).chain([h.length]).max().unwrap_or(0);
    let bound = clear + recovery(period);
    let mut judged = 0;
    for pair in (first_pair..arrivals.len()).step_by(2) {
        let arrival = ms(arrivals[pair].at);
        if arrival < bound {
            continue;
        }
        judged += 1;
        for r in [pair, pair + 1] {
            let fate = &trace.fates[r];
            let whole = matches!(fate.end, Some((_, Ending::Finished(FinishReason::Length))));
            prop_assert!(
                whole && fate.tokens.len() == c.max_tokens as usize,
                "request {r}, arriving at {arrival} ms, {} ms after nothing of the history was left ({clear} ms; the \
                 bound {bound} ms): {:?} after {} tokens",
                arrival - clear,
                fate.end,
                fate.tokens.len()
            );
            let first = ms(fate.tokens[0]);
            let last = ms(*fate.tokens.last().expect("tokens"));
            prop_assert!(
                first <= arrival + ttft,
                "request {r}'s first token at {first} ms, its deadline {} ms",
                arrival + ttft
            );
            prop_assert!(
                last <= arrival + timeout,
                "request {r} ended at {last} ms, its deadline {} ms",
                arrival + timeout
            );
        }
    }
    prop_assert!(judged >= 2, "the trace judges pairs past the bound");
    Ok(())
}

#[derive(Debug, Clone)]
struct WindowCase {
    /// The upstream's true costs, in ms (ttft: fixed, per running) and µs (ttft per prompt token;
    /// itl: fixed, per running).
    ttft_fixed: u64,
    ttft_per_prompt_us: u64,
    ttft_per_running: u64,
    itl_fixed_us: u64,
    itl_per_running_us: u64,
    prompt: u32,
    max_tokens: u32,
    floor: u64,
    slack: u64,
    spacing: u64,
    history: History,
}

fn window_case() -> impl Strategy<Value = WindowCase> {
    (
        (5u64..=100, 0u64..=500, 0u64..=20, 2000u64..=50_000, 0u64..=10_000),
        (1u32..=512, 1u32..=16, 0u64..=5, 1u64..=50, 0u64..=200),
        history(),
    )
        .prop_map(
            |(
                (ttft_fixed, ttft_per_prompt_us, ttft_per_running, itl_fixed_us, itl_per_running_us),
                (prompt, max_tokens, floor, slack, spacing),
                history,
            )| WindowCase {
                ttft_fixed,
                ttft_per_prompt_us,
                ttft_per_running,
                itl_fixed_us,
                itl_per_running_us,
                prompt,
                max_tokens,
                floor,
                slack,
                spacing,
                history,
            },
        )
}

/// How one request through the window went.
#[derive(Debug, Clone, Default)]
struct Flow {
    tokens: Vec<u64>,
    end: Option<(u64, End)>,
}

/// The relay's window in front of a virtual LLM server: a request sent with `n` in flight
/// (itself included) has its first token after the true TTFT for `n`, then a token every true
/// inter-token time for what is in flight then, up to its `max_tokens`; an aborted request stops.
/// Before the history's end every one of those times is its slowness times as long.
fn window(c: &WindowCase) -> Result<(), TestCaseError> {
    let us = Duration::from_micros(1);
    let cost = UpstreamCost {
        ttft_fixed: MS * c.ttft_fixed as u32,
        ttft_per_prompt_token: us * c.ttft_per_prompt_us as u32,
        ttft_per_running: MS * c.ttft_per_running as u32,
        itl_fixed: us * c.itl_fixed_us as u32,
        itl_per_running: us * c.itl_per_running_us as u32,
    };
    let true_ttft =
        |prompt: u32, n: u32| cost.ttft_fixed + cost.ttft_per_prompt_token * prompt + cost.ttft_per_running * n;
    let true_itl = |n: u32| cost.itl_fixed + cost.itl_per_running * n;
    let policy = WindowPolicy {
        max_in_flight: 4,
        max_queue: 64,
        max_queue_bytes: 1 << 30,
        max_queue_tokens: 1 << 30,
        max_context: 100_000,
        max_attempts: 2,
    };
    let mut w = Window::new(policy, cost, MS * c.floor as u32);
    let h = &c.history;

    // (at ms, prompt, max_tokens, ttft ms, itl ms, timeout ms)
    let mut arrivals: Vec<(u64, u32, u32, u64, u64, u64)> = Vec::new();
    for (at, rows, timeout) in h.arrivals() {
        let ttft = timeout.min(2000);
        arrivals.push((at, rows * 32, rows * 4, ttft, ttft / 4 + 10, timeout + 3000));
    }
    let historic = arrivals.len();
    let last_deadline = arrivals.iter().map(|a| a.0 + a.5).max().unwrap_or(0);
    // The pairs: sent together, the second with two in flight; each deadline allows the true
    // times with both in flight plus the margin's floor and the slack.
    let ttft = ms(true_ttft(c.prompt, 2)) + 1 + c.floor + c.slack;
    let itl = ms(true_itl(2)) + 1 + c.floor + c.slack;
    let timeout = ttft + u64::from(c.max_tokens) * itl;
    let period = timeout + c.spacing + 1;
    // A history request sent just before its end may take 40 times its time.
    let longest = true_ttft(16 * 32, 4) + true_itl(4) * 64;
    let horizon = h.length.max(last_deadline) + 40 * ms(longest) + recovery(0) + 18 * period;
    let first_pair = arrivals.len();
    let mut t = h.length;
    while t <= horizon {
        arrivals.push((t, c.prompt, c.max_tokens, ttft, itl, timeout));
        arrivals.push((t, c.prompt, c.max_tokens, ttft, itl, timeout));
        t += period;
    }
    let mut wakes = h.wakes(horizon + period);
    wakes.sort();

    let start = std::time::Instant::now();
    let at_ms = |ms: u64| start + MS * ms as u32;
    let mut turn = 0usize;
    let mut slowed = |at: u64, d: Duration| {
        if at < h.length {
            turn += 1;
            d * h.slowness[turn % h.slowness.len()]
        } else {
            d
        }
    };
    // The virtual upstream: per request in flight, (its next token's instant in µs, tokens sent).
    let mut upstream: std::collections::BTreeMap<SeqId, (u64, u32)> = Default::default();
    let mut flows = vec![Flow::default(); arrivals.len()];
    let (mut next_arrival, mut next_wake) = (0, 0);
    let mut effects = Vec::new();
    let micros = |d: Duration| d.as_micros() as u64;
    w.step(start, vec![WindowEvent::Ready(true)], &mut effects);
    loop {
        let candidates = [
            arrivals.get(next_arrival).map(|a| a.0 * 1000),
            wakes.get(next_wake).map(|w| w.0 * 1000),
            upstream.values().map(|u| u.0).min(),
            w.next_wake().map(|t| micros(t - start)),
        ];
        let Some(now_us) = candidates.into_iter().flatten().min() else { break };
        let now = start + us * now_us as u32;
        let now_ms = now_us / 1000;
        let mut events = Vec::new();
        while let Some(&(_, late)) = wakes.get(next_wake).filter(|w| w.0 * 1000 <= now_us) {
            events.push(WindowEvent::Woke(MS * late as u32));
            next_wake += 1;
        }
        let in_flight = upstream.len() as u32;
        for (&id, (next, sent)) in upstream.iter_mut().filter(|(_, u)| u.0 == now_us) {
            let max_tokens = arrivals[id as usize].2;
            *sent += 1;
            events.push(if *sent == 1 { WindowEvent::First(id) } else { WindowEvent::Token(id) });
            // The relay passes each token to its caller as it comes.
            flows[id as usize].tokens.push(now_ms);
            if *sent == max_tokens {
                events.push(WindowEvent::Done { id, reason: FinishReason::Length });
                *next = u64::MAX;
            } else {
                *next = now_us + micros(slowed(now_ms, true_itl(in_flight))).max(1);
            }
        }
        upstream.retain(|_, u| u.0 != u64::MAX);
        while let Some(&(a_ms, prompt, max_tokens, ttft, itl, timeout)) =
            arrivals.get(next_arrival).filter(|a| a.0 * 1000 <= now_us)
        {
            let arrival = at_ms(a_ms);
            events.push(WindowEvent::Submit(Request {
                id: next_arrival as SeqId,
                arrival,
                priority: Priority::Interactive,
                tenant: 0,
                weight: 1,
                prompt,
                max_tokens,
                bytes: 64,
                ttft_deadline: arrival + MS * ttft as u32,
                itl: MS * itl as u32,
                deadline: arrival + MS * timeout as u32,
            }));
            next_arrival += 1;
        }
        w.step(now, events, &mut effects);
        for effect in effects.drain(..) {
            match effect {
                WindowEffect::Release { id } => {
                    let n = upstream.len() as u32 + 1;
                    let (_, prompt, ..) = arrivals[id as usize];
                    upstream.insert(id, (now_us + micros(slowed(now_ms, true_ttft(prompt, n))).max(1), 0));
                }
                WindowEffect::Abort { id } => {
                    upstream.remove(&id);
                }
                WindowEffect::End { id, end, .. } => {
                    upstream.remove(&id);
                    flows[id as usize].end = Some((now_ms, end));
                }
                WindowEffect::Started { .. } => {}
            }
        }
    }

    let clear =
        flows[..historic].iter().filter_map(|f| f.end.as_ref().map(|e| e.0)).chain([h.length]).max().unwrap_or(0);
    let bound = clear + recovery(period);
    let mut judged = 0;
    for pair in (first_pair..arrivals.len()).step_by(2) {
        let arrival = arrivals[pair].0;
        if arrival < bound {
            continue;
        }
        judged += 1;
        for r in [pair, pair + 1] {
            let flow = &flows[r];
            let whole = matches!(flow.end, Some((_, End::Finished(FinishReason::Length))));
            prop_assert!(
                whole && flow.tokens.len() == c.max_tokens as usize,
                "request {r}, arriving at {arrival} ms, {} ms after nothing of the history was left ({clear} ms; the \
                 bound {bound} ms): {:?} after {} tokens",
                arrival - clear,
                flow.end,
                flow.tokens.len()
            );
            let (first, last) = (flow.tokens[0], *flow.tokens.last().expect("tokens"));
            prop_assert!(
                first <= arrival + ttft,
                "request {r}'s first token at {first} ms, its deadline {} ms",
                arrival + ttft
            );
            prop_assert!(
                last <= arrival + timeout,
                "request {r} ended at {last} ms, its deadline {} ms",
                arrival + timeout
            );
        }
    }
    prop_assert!(judged >= 2, "the trace judges pairs past the bound");
    Ok(())
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(128)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn request_level_admission_recovers_from_any_learned_state(c in request_case()) {
        request_level(&c)?;
    }

    #[test]
    fn generation_admission_recovers_from_any_learned_state(c in step_case()) {
        generation(&c)?;
    }

    #[test]
    fn the_relays_window_recovers_from_any_learned_state(c in window_case()) {
        window(&c)?;
    }
}
