//! Scale to zero in simulation: two days of a service used in office hours, idle at night but
//! for a trickle at dawn, under Ferry's decision with `scaleToZeroAfter` (the holder holding or
//! refusing what comes at zero, with [`ferry_core::hold`]'s rule) against the same decision kept
//! at `minReplicas: 1`. Virtual time, seeded: every run gives the same figures.
//!
//! What it measures: GPU-hours (pod lifetimes), and every request's fate — answered within its
//! deadline, refused at once with a `Retry-After` that was honest (a pod was ready by then), held
//! and answered 504 at its deadline, or answered late (never, by the holder's rule). Half the
//! requests ask for 2 s (an interactive caller: at zero, refused at once), half for 30 to 120 s
//! (batch callers, across the start-up's 64 s: some held through it, some refused). As in the
//! cluster, the holder learns of a ready pod at the next decision, and the traffic goes back to the
//! pods then. The load is far below one pod's capacity (at most 10 req/s against 320), so a ready
//! pod answers in one batch time: what is simulated is the way to and from zero, not batching
//! (`simulate` is for that); every start-up takes exactly its 60 s (a start-up longer than the
//! measured time-to-ready would make some `Retry-After`s too early, which this does not show).

use std::time::{Duration, Instant};

use ferry_core::hold::{Bounds, Held, Startup};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::decide::{decide, History, Observed, Target, PRESSURE_TOLERANCE};

const HOUR: f64 = 3600.0;

/// The service and the cluster, as this simulation sees them.
#[derive(Debug, Clone)]
pub struct World {
    pub target: Target,
    pub tick: Duration,
    pub window: Duration,
    pub days: u32,
    /// The two deadlines callers ask for, and the share asking for the long one.
    pub short: Duration,
    pub long: Duration,
    pub long_share: f64,
    pub seed: u64,
}

impl World {
    /// The request-level service of `simulate` (32 rows per 100 ms batch), pods that take 60 s to
    /// start, `scaleToZeroAfter` 15 minutes.
    pub fn office() -> World {
        World {
            target: Target {
                workers: 1,
                max_batch_size: 32,
                max_wait: Duration::from_millis(10),
                latency_budget: Duration::from_secs(2),
                batch_time: Duration::from_millis(100),
                target_utilization: 0.8,
                min_replicas: 0,
                max_replicas: 4,
                warm_replicas: 0,
                scale_down_delay: Duration::from_secs(300),
                pressure_tolerance: PRESSURE_TOLERANCE,
                startup: Duration::from_secs(60),
                ttft_budget: None,
                scale_to_zero_after: Some(Duration::from_secs(900)),
            },
            tick: Duration::from_secs(2),
            window: Duration::from_secs(10),
            days: 2,
            short: Duration::from_secs(2),
            long: Duration::from_secs(120),
            long_share: 0.5,
            seed: 11,
        }
    }
}

/// Requests per second at `t` seconds: 1 → 10 → 1 req/s along half a sine from 09:00 to 18:00,
/// one request every 10 minutes from 06:00 to 09:00, none at night.
pub fn rate(t: f64) -> f64 {
    let h = (t / HOUR) % 24.0;
    if (9.0..18.0).contains(&h) {
        1.0 + 9.0 * (std::f64::consts::PI * (h - 9.0) / 9.0).sin()
    } else if (6.0..9.0).contains(&h) {
        1.0 / 600.0
    } else {
        0.0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// `minReplicas: 0`, `scaleToZeroAfter: 15m`, the holder at zero.
    ScaleToZero,
    /// `minReplicas: 1`.
    MinOne,
}

impl Policy {
    pub const ALL: [Policy; 2] = [Policy::ScaleToZero, Policy::MinOne];

    pub fn name(self) -> &'static str {
        match self {
            Policy::ScaleToZero => "scale to zero",
            Policy::MinOne => "minReplicas 1",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    pub policy: Policy,
    pub requests: u64,
    /// Answered within their deadline, and of those, the ones held through a start-up.
    pub in_time: u64,
    pub held: u64,
    /// Refused at once at zero (their deadline fell before the start-up), and of those, the ones
    /// whose `Retry-After` was honest: a pod was ready when it said to come back.
    pub refused: u64,
    pub honest_retry_after: u64,
    /// Held and answered 504 at their deadline (the start-up took longer than said).
    pub expired: u64,
    /// Answered after their deadline.
    pub late: u64,
    pub gpu_hours: f64,
    /// Hours with no pod.
    pub hours_at_zero: f64,
}

struct Pod {
    started: Instant,
    ready_at: Instant,
}

/// Knuth's method: a Poisson count for a small mean (at most 10 here).
fn poisson(rng: &mut StdRng, mean: f64) -> u32 {
    let limit = (-mean).exp();
    let (mut k, mut p) = (0, rng.random::<f64>());
    while p > limit {
        k += 1;
        p *= rng.random::<f64>();
    }
    k
}

/// Runs `policy` over the world's days.
pub fn run(world: &World, policy: Policy) -> Outcome {
    let t = match policy {
        Policy::ScaleToZero => world.target.clone(),
        Policy::MinOne => Target { min_replicas: 1, scale_to_zero_after: None, ..world.target.clone() },
    };
    let mut rng = StdRng::seed_from_u64(world.seed);
    let start = ferry_core::clock::now();
    let end = start + Duration::from_secs(u64::from(world.days) * 86_400);
    // The day starts at midnight with the pod a service is created with.
    let mut pods = vec![Pod { started: start, ready_at: start }];
    let mut gpu_seconds = 0.0;
    let mut at_zero_since: Option<Instant> = None;
    let mut zero_seconds = 0.0;
    let mut history = History::default();
    let mut held: Held<Instant> = Held::default();
    let bounds = Bounds { requests: 1024, bytes: usize::MAX };
    // Refusals' retry instants, judged when the next pod is ready.
    let mut retries: Vec<Instant> = Vec::new();
    let mut o = Outcome {
        policy,
        requests: 0,
        in_time: 0,
        held: 0,
        refused: 0,
        honest_retry_after: 0,
        expired: 0,
        late: 0,
        gpu_hours: 0.0,
        hours_at_zero: 0.0,
    };
    let mut recent: std::collections::VecDeque<(Instant, u64)> = Default::default();
    let mut tick_arrivals = 0u64;
    let mut reachable = true;
    let mut now = start;
    while now < end {
        let next = now + world.tick;
        // Arrivals in this tick, second by second, in order.
        let mut arrivals: Vec<Instant> = Vec::new();
        for s in 0..world.tick.as_secs() {
            let second = now + Duration::from_secs(s);
            let mean = rate((second - start).as_secs_f64());
            for _ in 0..poisson(&mut rng, mean) {
                arrivals.push(second + Duration::from_secs_f64(rng.random::<f64>()));
            }
        }
        arrivals.sort();
        for at in arrivals {
            o.requests += 1;
            tick_arrivals += 1;
            let deadline = at
                + if rng.random::<f64>() < world.long_share {
                    world.long.mul_f64(0.25 + 0.75 * rng.random::<f64>())
                } else {
                    world.short
                };
            // The traffic goes where the operator last pointed it: to the pods once a tick has
            // seen one ready, else to the holder.
            if reachable {
                // One batch time on a pod with room to spare.
                if at + t.batch_time <= deadline {
                    o.in_time += 1;
                } else {
                    o.late += 1;
                }
                continue;
            }
            // The holder, told as the operator tells it: the time-to-ready and two decisions'
            // waits (for the one that asks for pods, and the one that sees them ready), counted
            // from the oldest starting pod's start if one is starting.
            let startup = Startup {
                time_to_ready: t.startup + 2 * world.tick,
                starting_since: pods.iter().map(|p| p.started).min(),
            };
            if let Err((refusal, _)) = held.admit(at, deadline, 1, &startup, &bounds, deadline) {
                o.refused += 1;
                retries.push(at + refusal.retry_after.unwrap_or_default());
            }
        }
        now = next;
        // The tick sees a ready pod: the holder is told, releases what it holds, and the
        // service's traffic goes to the pods from now on.
        reachable = pods.iter().any(|p| p.ready_at <= now);
        if reachable {
            release(now, &mut held, &mut retries, world, &mut o);
        }
        // Held requests whose deadline passed: 504 at the deadline.
        o.expired += held.expire(now).len() as u64;
        // The decision, on what the pods (or the holder) report.
        recent.push_back((now, tick_arrivals));
        tick_arrivals = 0;
        while recent.front().is_some_and(|(at, _)| *at + world.window <= now) {
            recent.pop_front();
        }
        let span = recent.len() as f64 * world.tick.as_secs_f64();
        let observed = Observed {
            arrival_rate: recent.iter().map(|(_, n)| *n).sum::<u64>() as f64 / span,
            latest_rate: recent.back().map_or(0, |(_, n)| *n) as f64 / world.tick.as_secs_f64(),
            window_seconds: span,
            latest_seconds: world.tick.as_secs_f64(),
            rows_per_request: 1.0,
            batch_time: Some(t.batch_time),
            queue_depth: held.len() as f64,
            oldest_queue_age: held.oldest(now),
            pressure: 0.0,
            starting: pods.iter().filter(|p| p.ready_at > now).count() as u32,
            settling: 0,
            stuck: 0,
            rolling_out: false,
            locked: 0,
            capacity: None,
            queue_tokens: 0.0,
            prefill_rate: None,
            tokens_rate: 0.0,
            kv_usage: None,
        };
        let current = pods.len() as u32;
        let d = decide(&observed, &t, current, &history, now);
        history = d.history;
        if d.replicas > current {
            for _ in current..d.replicas {
                pods.push(Pod { started: now, ready_at: now + t.startup });
            }
        } else {
            // Idle pods leave at once; the newest (perhaps still starting) first.
            while pods.len() as u32 > d.replicas {
                let pod = pods.pop().expect("more pods than wanted");
                gpu_seconds += (now - pod.started).as_secs_f64();
            }
        }
        match (pods.is_empty(), at_zero_since) {
            (true, None) => at_zero_since = Some(now),
            (false, Some(since)) => {
                zero_seconds += (now - since).as_secs_f64();
                at_zero_since = None;
            }
            _ => {}
        }
    }
    gpu_seconds += pods.iter().map(|p| (end - p.started).as_secs_f64()).sum::<f64>();
    zero_seconds += at_zero_since.map_or(0.0, |since| (end - since).as_secs_f64());
    o.gpu_hours = (gpu_seconds / HOUR * 100.0).round() / 100.0;
    o.hours_at_zero = (zero_seconds / HOUR * 100.0).round() / 100.0;
    o
}

/// Once the holder learns of a ready pod (at `ready`, a tick): everything held is answered by it,
/// one batch time later, and the refusals told to come back by then were honest.
fn release(ready: Instant, held: &mut Held<Instant>, retries: &mut Vec<Instant>, world: &World, o: &mut Outcome) {
    for deadline in held.release() {
        if ready + world.target.batch_time <= deadline {
            o.in_time += 1;
            o.held += 1;
        } else {
            o.late += 1;
        }
    }
    for retry in retries.drain(..) {
        o.honest_retry_after += u64::from(retry >= ready);
    }
}

/// Both policies.
pub fn compare(world: &World) -> Vec<Outcome> {
    Policy::ALL.iter().map(|&p| run(world, p)).collect()
}

/// The README's rows (`simulate-zero --markdown`; a test checks the README against them).
pub fn markdown(outcomes: &[Outcome]) -> String {
    outcomes
        .iter()
        .map(|o| {
            format!(
                "| {} | {} | {} | {} | {} | {} of {} | {} | {} | {:.2} | {:.2} |\n",
                o.policy.name(),
                o.requests,
                o.in_time,
                o.held,
                o.refused,
                o.honest_retry_after,
                o.refused,
                o.expired,
                o.late,
                o.gpu_hours,
                o.hours_at_zero
            )
        })
        .collect()
}

/// A table for people.
pub fn table(outcomes: &[Outcome]) -> String {
    let mut out = String::from(
        "policy          requests  in time   held  refused at once  honest Retry-After  expired  late  GPU-hours  hours at zero\n",
    );
    for o in outcomes {
        let share = |n: u64| n as f64 / o.requests.max(1) as f64 * 100.0;
        out += &format!(
            "{:<14}  {:>8}  {:>6.2} %  {:>4}  {:>15}  {:>10} of {:<5}  {:>7}  {:>4}  {:>9.2}  {:>13.2}\n",
            o.policy.name(),
            o.requests,
            share(o.in_time),
            o.held,
            o.refused,
            o.honest_retry_after,
            o.refused,
            o.expired,
            o.late,
            o.gpu_hours,
            o.hours_at_zero
        );
    }
    if let [zero, one] = outcomes {
        out += &format!(
            "scale to zero: {:.0} % of minReplicas 1's GPU-hours\n",
            zero.gpu_hours / one.gpu_hours.max(f64::MIN_POSITIVE) * 100.0
        );
    }
    out
}
