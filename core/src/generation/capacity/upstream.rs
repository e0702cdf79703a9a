//! The capacity of a pod that relays to an LLM server beside it (`--engine openai`): the same
//! question as the module's, answered from the concurrency window's learned fits instead of a
//! step cost. The upstream is a black box whose first token takes `ttft(prompt, running)` and
//! whose tokens come every `itl(running)` with `running` requests in flight
//! ([`UpstreamModel`], both linear in `running`); the window keeps at most as many in flight as
//! keep `itl` within the inter-token target, and no more than `maxSequences`.
//!
//! At a steady `rate`, a request holds a slot for `ttft + (G − 1) × itl` at the concurrency it
//! runs in, so by Little's law the mean concurrency `N` solves `N = rate × hold(N)`: with
//! `hold(N) = a + b × N`, `N = rate × a / (1 − rate × b)`. The concurrency is read at its 99th
//! percentile (mean plus [`Z`] standard deviations, at most the slots); a newcomer waits for a
//! slot as in an M/M/c queue (Erlang's C formula); its first token comes after that wait and its
//! own time to first token at the high concurrency, its last `G − 1` tokens later, each within
//! its deadline less the margin. The largest rate that keeps them is found by bisection, and the
//! first promise to break names the bound.

use std::time::Duration;

use super::{largest, seat_wait, Bound, Capacity, RequestShape, Targets, Z};
use crate::generation::window::UpstreamModel;

/// The slots the window keeps open for `targets`: the most in flight (at most `max_in_flight`)
/// whose time between tokens is within the inter-token target; 0 where even one is not.
fn slots(model: &UpstreamModel, targets: &Targets, max_in_flight: u32) -> u32 {
    (1..=max_in_flight).rev().find(|n| model.itl(*n) <= targets.itl).unwrap_or(0)
}

/// A duration the model gives at `running` requests in flight, read at a fractional count (the
/// model is linear in it).
fn at(f: impl Fn(u32) -> Duration, running: f64) -> f64 {
    let (zero, one) = (f(0).as_secs_f64(), f(1).as_secs_f64());
    zero + running * (one - zero)
}

/// The most requests a second one relaying pod serves with 99 % of requests keeping all three
/// promises, from the window's learned `model`, at the requests' mean `shape`.
pub fn capacity(model: &UpstreamModel, shape: &RequestShape, targets: &Targets, max_in_flight: u32) -> Capacity {
    let slots = slots(model, targets, max_in_flight);
    let seat_bound = if slots < max_in_flight { Bound::InterToken } else { Bound::Sequences };
    let prompt = shape.prompt.max(0.0).round() as u32;
    let decodes = shape.output.max(1.0) - 1.0;
    let ttft = |running: f64| at(|n| model.ttft(prompt, n), running);
    let itl = |running: f64| at(|n| model.itl(n), running);
    let hold = |running: f64| ttft(running) + decodes * itl(running);
    let (a, b) = (hold(0.0), hold(1.0) - hold(0.0));
    let margin = targets.margin.as_secs_f64();
    // The mean concurrency at `rate`, or the promise `rate` breaks.
    let judge = |rate: f64| -> Result<f64, Bound> {
        if slots == 0 {
            return Err(Bound::InterToken);
        }
        let c = f64::from(slots);
        let running = if rate * b < 1.0 { rate * a / (1.0 - rate * b) } else { f64::INFINITY };
        if running >= c {
            return Err(seat_bound);
        }
        let high = (running + Z * running.sqrt()).clamp(1.0, c);
        let wait = seat_wait(rate, hold(running), c).ok_or(seat_bound)?;
        let first = wait + ttft(high);
        if first + margin > targets.ttft.as_secs_f64() {
            return Err(if wait > 0.0 { seat_bound } else { Bound::FirstToken });
        }
        if first + decodes * itl(high) + margin > targets.timeout.as_secs_f64() {
            return Err(Bound::Completion);
        }
        Ok(running)
    };
    if let Err(bound) = judge(f64::MIN_POSITIVE) {
        return Capacity::none(bound);
    }
    let (lo, hi) = largest(|rate| judge(rate).is_ok(), f64::from(slots) / a.max(1e-12));
    let running = judge(lo).expect("kept");
    Capacity {
        requests_per_second: lo,
        tokens_per_second: lo * shape.output.max(1.0),
        running,
        step: Duration::from_secs_f64(itl(running).max(0.0)),
        bound: judge(hi).err().unwrap_or(Bound::Engine),
    }
}

#[cfg(test)]
mod tests;
