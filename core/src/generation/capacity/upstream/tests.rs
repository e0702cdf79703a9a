//! The relaying pod's capacity against the window itself: Poisson arrivals replayed in virtual
//! time through the real [`Window`], in front of an upstream that answers exactly as its cost
//! says — the first token `ttft(prompt, running)` after it is sent, then a token every
//! `itl(running)`, `running` counted when each is due.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

use super::*;
use crate::generation::sequence::{End, FinishReason, Request, SeqId};
use crate::generation::window::{Effect, Event, UpstreamCost, Window, WindowPolicy};
use crate::ticket::Priority;

const MS: Duration = Duration::from_millis(1);
const US: Duration = Duration::from_micros(1);
/// Seconds of arrivals a trial replays: a few thousand requests, so that 1 % is tens of them.
const SECONDS: f64 = 900.0;

/// A server like llama.cpp's with 16 slots: 50 ms + 0.2 ms a prompt token + 5 ms a request in
/// flight to the first token, 20 ms + 2 ms a request in flight between tokens.
fn upstream() -> UpstreamCost {
    UpstreamCost {
        ttft_fixed: 50 * MS,
        ttft_per_prompt_token: 200 * US,
        ttft_per_running: 5 * MS,
        itl_fixed: 20 * MS,
        itl_per_running: 2 * MS,
    }
}

fn policy(max_in_flight: u32) -> WindowPolicy {
    WindowPolicy {
        max_in_flight,
        max_queue: 4096,
        max_queue_bytes: u64::MAX,
        max_queue_tokens: u64::MAX,
        max_context: 1 << 20,
        max_attempts: 1,
    }
}

/// What the client of one request saw: whether it was admitted and finished, and when its
/// tokens came.
#[derive(Default)]
struct Seen {
    admitted: bool,
    finished: bool,
    tokens: Vec<Instant>,
}

/// The share of requests arriving after the first 15 s of [`SECONDS`] of Poisson arrivals at `rate`
/// that kept all three promises.
fn kept(cost: UpstreamCost, shape: RequestShape, targets: Targets, max_in_flight: u32, rate: f64) -> f64 {
    let start = Instant::now();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (prompt, output) = (shape.prompt as u32, shape.output as u32);
    let mut arrivals = Vec::new();
    let mut t = 0.0;
    while t < SECONDS {
        t += -(1.0 - rng.random::<f64>()).ln() / rate;
        let arrival = start + Duration::from_secs_f64(t);
        arrivals.push(Request {
            id: arrivals.len() as SeqId,
            arrival,
            priority: Priority::Interactive,
            tenant: 0,
            weight: 1,
            prompt,
            max_tokens: output,
            bytes: 64,
            ttft_deadline: arrival + targets.ttft,
            itl: targets.itl,
            deadline: arrival + targets.timeout,
        });
    }
    let mut window = Window::new(policy(max_in_flight), cost, targets.margin);
    let model = UpstreamModel::new(cost);
    // The upstream: each request in flight, its tokens so far and when its next is due.
    let mut flying: BTreeMap<SeqId, u32> = BTreeMap::new();
    let mut due: BinaryHeap<Reverse<(Instant, SeqId)>> = BinaryHeap::new();
    let mut seen: Vec<Seen> = arrivals.iter().map(|_| Seen::default()).collect();
    let (mut next, mut effects) = (0, Vec::new());
    window.step(start, vec![Event::Ready(true)], &mut effects);
    loop {
        let candidates = [arrivals.get(next).map(|r| r.arrival), due.peek().map(|d| d.0 .0), window.next_wake()];
        let Some(now) = candidates.into_iter().flatten().min() else { break };
        let mut events = Vec::new();
        while let Some(r) = arrivals.get(next).filter(|r| r.arrival == now) {
            events.push(Event::Submit(*r));
            next += 1;
        }
        while let Some(Reverse((_, id))) = due.peek().copied().filter(|d| d.0 .0 == now) {
            due.pop();
            let Some(tokens) = flying.get_mut(&id) else { continue };
            *tokens += 1;
            seen[id as usize].tokens.push(now);
            events.push(if *tokens == 1 { Event::First(id) } else { Event::Token(id) });
            if *tokens == output {
                flying.remove(&id);
                events.push(Event::Done { id, reason: FinishReason::Length });
            } else {
                due.push(Reverse((now + model.itl(flying.len() as u32), id)));
            }
        }
        window.step(now, events, &mut effects);
        for effect in effects.drain(..) {
            match effect {
                Effect::Release { id } => {
                    flying.insert(id, 0);
                    due.push(Reverse((now + model.ttft(prompt, flying.len() as u32), id)));
                }
                Effect::Abort { id } => {
                    flying.remove(&id);
                }
                Effect::End { id, end, admitted } => {
                    let s = &mut seen[id as usize];
                    s.admitted = admitted;
                    s.finished = matches!(end, End::Finished(_));
                }
                Effect::Started { .. } => {}
            }
        }
    }
    let counted: Vec<(&Request, &Seen)> =
        arrivals.iter().zip(&seen).filter(|(r, _)| r.arrival >= start + Duration::from_secs(15)).collect();
    let in_time = counted
        .iter()
        .filter(|(r, s)| {
            s.admitted
                && s.finished
                && s.tokens.len() == output as usize
                && s.tokens[0] <= r.ttft_deadline
                && s.tokens.windows(2).all(|w| w[1] - w[0] <= r.itl)
                && *s.tokens.last().expect("tokens") <= r.deadline
        })
        .count();
    in_time as f64 / counted.len().max(1) as f64
}

/// At the rate the function returns, 99 % of requests keep all three promises; at 1.25 times
/// that rate they do not.
fn is_tight(shape: RequestShape, targets: Targets, max_in_flight: u32, bound: Bound) {
    let c = capacity(&UpstreamModel::new(upstream()), &shape, &targets, max_in_flight);
    assert_eq!(c.bound, bound, "{c:?}");
    let at = kept(upstream(), shape, targets, max_in_flight, c.requests_per_second);
    let over = kept(upstream(), shape, targets, max_in_flight, 1.25 * c.requests_per_second);
    assert!(at >= 0.99, "{c:?}: {:.1} % kept at capacity", 100.0 * at);
    assert!(over < 0.99, "{c:?}: {:.1} % kept at 1.25 x capacity", 100.0 * over);
}

#[test]
fn sixteen_slots_bound_a_server_whose_tokens_stay_in_time() {
    let targets = Targets { ttft: 2000 * MS, itl: 100 * MS, timeout: 20_000 * MS, margin: MS };
    is_tight(RequestShape { prompt: 100.0, output: 64.0 }, targets, 16, Bound::Sequences);
}

#[test]
fn a_tight_inter_token_target_keeps_fewer_in_flight() {
    // 40 ms between tokens: 10 in flight at most (20 + 2 × 10), of 32 slots.
    let targets = Targets { ttft: 2000 * MS, itl: 40 * MS, timeout: 20_000 * MS, margin: MS };
    is_tight(RequestShape { prompt: 100.0, output: 64.0 }, targets, 32, Bound::InterToken);
}

#[test]
fn a_server_too_slow_for_the_target_serves_nothing() {
    // 20 ms between tokens with one request in flight; the target is 15 ms.
    let targets = Targets { ttft: 2000 * MS, itl: 15 * MS, timeout: 20_000 * MS, margin: MS };
    let c = capacity(&UpstreamModel::new(upstream()), &RequestShape { prompt: 100.0, output: 64.0 }, &targets, 16);
    assert_eq!((c.requests_per_second, c.bound), (0.0, Bound::InterToken));
}
