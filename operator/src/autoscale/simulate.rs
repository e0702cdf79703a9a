//! A deterministic simulation of an InferenceService under a changing load: replicas that run the
//! sidecar's own dispatch rule and admission ([`Scheduler`]), a fixed batch time, a pod start-up
//! delay, random routing across ready pods (as a Service does), and a scaling policy ticking every
//! 2 s — in virtual time, seeded, so every run of a scenario gives the same figures.
//!
//! Four policies on the same trace: Ferry's [`decide`]; an HPA-style policy on worker (GPU)
//! utilization (ratio with 0.1 tolerance, 300 s scale-down stabilization); fixed replicas sized
//! for the peak; and an oracle that knows the trace and starts exactly the pods each moment will
//! need, one start-up time ahead.

use std::collections::VecDeque;
use std::time::Duration;

use ferry_core::estimate::Estimator;
use ferry_core::scheduler::{Policy, Scheduler};
use ferry_core::ticket::{Priority, Ticket, Tokens};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::time::Instant;

use super::decide::{decide, History, Observed, Target};

/// The served model and the cluster, as the simulation sees them.
#[derive(Debug, Clone)]
pub struct World {
    pub target: Target,
    pub startup: Duration,
    pub tick: Duration,
    /// The span rates are taken over (the operator's `--metrics-window`).
    pub window: Duration,
    pub seed: u64,
}

impl World {
    /// The problem statement's service: 1 worker per pod, 32 rows per 100 ms batch, `maxWait`
    /// 10 ms, a 200 ms budget, pods that take 60 s to start; scaled at a target utilization of
    /// 0.65 with one warm spare and a 120 s scale-down delay.
    pub fn problem_statement() -> World {
        World {
            target: Target {
                workers: 1,
                max_batch_size: 32,
                max_wait: Duration::from_millis(10),
                latency_budget: Duration::from_millis(200),
                batch_time: Duration::from_millis(100),
                target_utilization: 0.65,
                min_replicas: 1,
                max_replicas: 30,
                warm_replicas: 1,
                scale_down_delay: Duration::from_secs(120),
                pressure_tolerance: super::decide::PRESSURE_TOLERANCE,
                startup: Duration::from_secs(60),
                ttft_budget: None,
                scale_to_zero_after: None,
            },
            startup: Duration::from_secs(60),
            tick: Duration::from_secs(2),
            window: Duration::from_secs(10),
            seed: 7,
        }
    }

    fn capacity(&self) -> f64 {
        super::decide::capacity_per_replica(&self.target, self.target.batch_time, 1.0)
    }
}

/// An arrival trace: requests per second over time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    /// 300 → 1000 req/s at t = 60 s.
    Step,
    /// 500 req/s with a 3× burst for 20 s.
    Spike,
    /// A slow sine between 200 and 1000 req/s.
    Diurnal,
    /// 1000 → 100 req/s at t = 120 s.
    Drop,
    /// A diurnal-style rise: 200 → 1200 req/s along half a cosine over 400 s, then steady.
    Ramp,
    /// 400 req/s with 10 s bursts to 1000 req/s every 100 s from t = 60 s.
    Burst,
}

impl Scenario {
    pub const ALL: [Scenario; 6] =
        [Scenario::Step, Scenario::Spike, Scenario::Diurnal, Scenario::Drop, Scenario::Ramp, Scenario::Burst];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Step => "step",
            Scenario::Spike => "spike",
            Scenario::Diurnal => "diurnal",
            Scenario::Drop => "drop",
            Scenario::Ramp => "ramp",
            Scenario::Burst => "burst",
        }
    }

    pub fn duration(self) -> Duration {
        Duration::from_secs(match self {
            Scenario::Step | Scenario::Spike => 300,
            Scenario::Diurnal | Scenario::Drop | Scenario::Ramp | Scenario::Burst => 600,
        })
    }

    /// Requests per second at `t` seconds.
    pub fn rate(self, t: f64) -> f64 {
        match self {
            Scenario::Step => {
                if t < 60.0 {
                    300.0
                } else {
                    1000.0
                }
            }
            Scenario::Spike => {
                if (150.0..170.0).contains(&t) {
                    1500.0
                } else {
                    500.0
                }
            }
            Scenario::Diurnal => 600.0 - 400.0 * (2.0 * std::f64::consts::PI * t / 600.0).cos(),
            Scenario::Drop => {
                if t < 120.0 {
                    1000.0
                } else {
                    100.0
                }
            }
            Scenario::Ramp => 200.0 + 500.0 * (1.0 - (std::f64::consts::PI * t.min(400.0) / 400.0).cos()),
            Scenario::Burst => {
                if t >= 60.0 && (t - 60.0) % 100.0 < 10.0 {
                    1000.0
                } else {
                    400.0
                }
            }
        }
    }

    /// When the measured part begins: after the start-up time that follows the change.
    pub fn settled_after(self, startup: Duration) -> f64 {
        let change = match self {
            Scenario::Step => 60.0,
            Scenario::Spike => 150.0,
            Scenario::Diurnal | Scenario::Ramp => 0.0,
            Scenario::Drop => 120.0,
            Scenario::Burst => 60.0,
        };
        change + startup.as_secs_f64()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    Ferry,
    Hpa,
    Fixed,
    Oracle,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 4] = [PolicyKind::Ferry, PolicyKind::Hpa, PolicyKind::Fixed, PolicyKind::Oracle];
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Outcome {
    pub name: PolicyKind,
    /// Share of all requests answered within their deadline.
    pub within_deadline: f64,
    /// The same, for requests after the change plus one start-up time.
    pub within_deadline_settled: f64,
    /// Share refused (infeasible at admission, or no ready pod).
    pub rejected: f64,
    pub gpu_seconds: f64,
    pub peak_replicas: u32,
}

struct Pod {
    scheduler: Scheduler,
    running: Vec<(Instant, usize, Vec<Ticket>)>,
    started: Instant,
    ready_at: Instant,
    retiring: bool,
    /// Worker busy time, for the HPA-style policy.
    busy: Duration,
}

struct Counters {
    total: u64,
    ok: u64,
    settled_total: u64,
    settled_ok: u64,
    refused: u64,
}

/// Runs `policy` on `scenario`.
pub fn run(world: &World, scenario: Scenario, policy: PolicyKind) -> Outcome {
    let t = &world.target;
    let start = ferry_core::clock::now();
    let end = start + scenario.duration();
    let secs = |at: Instant| (at - start).as_secs_f64();
    let capacity = world.capacity();
    let usable = capacity * t.target_utilization;
    let peak = (0..scenario.duration().as_secs()).map(|s| scenario.rate(s as f64)).fold(0.0, f64::max);
    let need_at = |time: f64| (scenario.rate(time) / usable).ceil().max(1.0) as u32;
    let new_pod = |now: Instant, ready_at: Instant| Pod {
        scheduler: Scheduler::new(
            Policy {
                max_batch_rows: t.max_batch_size,
                max_wait: t.max_wait,
                deadline_margin: Duration::ZERO,
                max_queue: 4096,
                max_queue_bytes: u64::MAX,
            },
            t.workers as usize,
            Estimator::new(t.batch_time, Duration::ZERO),
        ),
        running: Vec::new(),
        started: now,
        ready_at,
        retiring: false,
        busy: Duration::ZERO,
    };
    // Every policy starts where its own rule puts it for the first second's load, ready.
    let initial = match policy {
        PolicyKind::Fixed => (peak / usable).ceil() as u32,
        _ => need_at(0.0) + t.warm_replicas,
    }
    .clamp(t.min_replicas.max(1), t.max_replicas);
    let mut pods: Vec<Pod> = (0..initial).map(|_| new_pod(start, start)).collect();
    let mut gpu_seconds = 0.0;
    let mut peak_replicas = initial;
    let mut rng = StdRng::seed_from_u64(world.seed);
    let mut route = StdRng::seed_from_u64(world.seed ^ 0xfeed);
    let mut next_arrival = start + Duration::from_secs_f64(-(1.0 - rng.random::<f64>()).ln() / scenario.rate(0.0));
    let mut next_tick = start + world.tick;
    let mut id = 0u64;
    let mut c = Counters { total: 0, ok: 0, settled_total: 0, settled_ok: 0, refused: 0 };
    let settled = scenario.settled_after(world.startup);
    // Per-tick window figures.
    let (mut window_arrivals, mut window_pressure) = (0u64, 0u64);
    let mut history = History::default();
    let mut hpa_recommendations: VecDeque<(Instant, u32)> = VecDeque::new();
    // Arrivals and pressure per tick over the rate window.
    let mut recent: VecDeque<(Instant, u64, u64)> = VecDeque::new();

    let mut clock = start;
    loop {
        // The next event of any pod.
        let pod_next = pods
            .iter()
            .flat_map(|p| [p.running.iter().map(|r| r.0).min(), p.scheduler.next_wake(clock)])
            .flatten()
            .min();
        let now = [Some(next_arrival), Some(next_tick), pod_next].into_iter().flatten().min().expect("events");
        if now >= end {
            break;
        }
        clock = now;
        // Finished batches.
        for pod in &mut pods {
            let mut i = 0;
            while i < pod.running.len() {
                if pod.running[i].0 <= now {
                    let (done, worker, tickets) = pod.running.swap_remove(i);
                    pod.scheduler.finish(worker, now);
                    for ticket in tickets {
                        if done <= ticket.deadline && ticket.deadline <= end {
                            c.ok += 1;
                            if secs(ticket.arrival) >= settled {
                                c.settled_ok += 1;
                            }
                        }
                    }
                } else {
                    i += 1;
                }
            }
            for _ in pod.scheduler.expire(now) {
                window_pressure += 1;
            }
            while let Some(batch) = pod.scheduler.take(now) {
                window_pressure += batch.doomed.len() as u64;
                if !batch.tickets.is_empty() {
                    pod.busy += t.batch_time;
                    pod.running.push((now + t.batch_time, batch.worker, batch.tickets));
                }
            }
        }
        // An arrival: to a random ready pod.
        if now == next_arrival {
            // Only requests whose deadline falls within the run are counted: the fate of the
            // others is not known when it ends.
            let counted = u64::from(now + t.latency_budget <= end);
            c.total += counted;
            window_arrivals += 1;
            let settled_request = secs(now) >= settled;
            c.settled_total += u64::from(settled_request) * counted;
            let ready: Vec<usize> = (0..pods.len()).filter(|&i| pods[i].ready_at <= now && !pods[i].retiring).collect();
            if ready.is_empty() {
                c.refused += counted;
                window_pressure += 1;
            } else {
                let pod = &mut pods[ready[route.random_range(0..ready.len())]];
                id += 1;
                let ticket = Ticket {
                    id,
                    arrival: now,
                    deadline: now + t.latency_budget,
                    rows: 1,
                    bytes: 1,
                    priority: Priority::Interactive,
                    tenant: 0,
                    weight: 1,
                    tokens: Tokens::default(),
                };
                if pod.scheduler.admit(ticket, now).is_err() {
                    c.refused += counted;
                    window_pressure += 1;
                }
                while let Some(batch) = pod.scheduler.take(now) {
                    if !batch.tickets.is_empty() {
                        pod.busy += t.batch_time;
                        pod.running.push((now + t.batch_time, batch.worker, batch.tickets));
                    }
                }
            }
            let rate = scenario.rate(secs(now));
            next_arrival = now + Duration::from_secs_f64(-(1.0 - rng.random::<f64>()).ln() / rate);
        }
        // A policy tick.
        if now == next_tick {
            let active: Vec<&Pod> = pods.iter().filter(|p| !p.retiring).collect();
            let current = active.len() as u32;
            let desired = match policy {
                PolicyKind::Fixed => current,
                PolicyKind::Oracle => {
                    // What any moment until a pod started now is ready will need: it starts pods
                    // one start-up time ahead, and keeps them while they are still needed.
                    let from = secs(now);
                    let until = from + world.startup.as_secs_f64() + world.tick.as_secs_f64();
                    (from as u64..=until as u64)
                        .map(|s| need_at(s as f64))
                        .max()
                        .unwrap_or(1)
                        .clamp(t.min_replicas.max(1), t.max_replicas)
                }
                PolicyKind::Ferry => {
                    recent.push_back((now, window_arrivals, window_pressure));
                    while recent.front().is_some_and(|(at, _, _)| *at + world.window <= now) {
                        recent.pop_front();
                    }
                    let span = (recent.len() as f64 * world.tick.as_secs_f64()).max(world.tick.as_secs_f64());
                    let arrivals = recent.iter().map(|(_, n, _)| *n).sum::<u64>();
                    let observed = Observed {
                        arrival_rate: arrivals as f64 / span,
                        latest_rate: window_arrivals as f64 / world.tick.as_secs_f64(),
                        window_seconds: span,
                        latest_seconds: world.tick.as_secs_f64(),
                        rows_per_request: 1.0,
                        batch_time: Some(t.batch_time),
                        queue_depth: pods.iter().map(|p| p.scheduler.queue_depth() as f64).sum(),
                        oldest_queue_age: pods
                            .iter()
                            .filter_map(|p| p.scheduler.oldest_arrival())
                            .map(|a| now - a)
                            .max()
                            .unwrap_or(Duration::ZERO),
                        pressure: recent.iter().map(|(_, _, p)| *p).sum::<u64>() as f64 / arrivals.max(1) as f64,
                        starting: active.iter().filter(|p| p.ready_at > now).count() as u32,
                        // Ready too recently for the window to show their effect.
                        settling: active.iter().filter(|p| p.ready_at <= now && p.ready_at + world.window > now).count()
                            as u32,
                        stuck: 0,
                        rolling_out: false,
                        locked: 0,
                        // Request-level pods: their capacity is the batch arithmetic.
                        capacity: None,
                        queue_tokens: 0.0,
                        prefill_rate: None,
                        tokens_rate: 0.0,
                        kv_usage: None,
                    };
                    let d = decide(&observed, t, current, &history, now);
                    history = d.history;
                    d.replicas
                }
                PolicyKind::Hpa => {
                    let ready: Vec<&&Pod> = active.iter().filter(|p| p.ready_at <= now).collect();
                    let capacity_s = ready.len() as f64 * f64::from(t.workers) * world.tick.as_secs_f64();
                    let busy: f64 = ready.iter().map(|p| p.busy.as_secs_f64()).sum();
                    let utilization = if capacity_s > 0.0 { (busy / capacity_s).min(1.0) } else { 1.0 };
                    let ratio = utilization / t.target_utilization;
                    let recommended = if (ratio - 1.0).abs() <= 0.1 {
                        current
                    } else {
                        ((ready.len().max(1) as f64) * ratio).ceil() as u32
                    }
                    .clamp(t.min_replicas.max(1), t.max_replicas);
                    hpa_recommendations.push_back((now, recommended));
                    while hpa_recommendations.front().is_some_and(|(at, _)| *at + Duration::from_secs(300) < now) {
                        hpa_recommendations.pop_front();
                    }
                    let stable = hpa_recommendations.iter().map(|(_, r)| *r).max().unwrap_or(recommended);
                    if recommended > current {
                        recommended
                    } else {
                        stable.min(current)
                    }
                }
            };
            for pod in &mut pods {
                pod.busy = Duration::ZERO;
            }
            if desired > current {
                for _ in current..desired {
                    pods.push(new_pod(now, now + world.startup));
                }
            } else if desired < current {
                // Retire the pods still starting first, then the least loaded ready ones.
                let mut order: Vec<usize> = (0..pods.len()).filter(|&i| !pods[i].retiring).collect();
                order.sort_by_key(|&i| (pods[i].ready_at <= now, pods[i].scheduler.queue_depth()));
                for &i in order.iter().take((current - desired) as usize) {
                    pods[i].retiring = true;
                }
            }
            peak_replicas = peak_replicas.max(pods.iter().filter(|p| !p.retiring).count() as u32);
            window_arrivals = 0;
            window_pressure = 0;
            next_tick = now + world.tick;
        }
        // Retired pods leave once idle; their GPU time is counted until then.
        pods.retain(|p| {
            let gone = p.retiring && p.running.is_empty() && p.scheduler.queue_depth() == 0;
            if gone {
                gpu_seconds += (now - p.started).as_secs_f64();
            }
            !gone
        });
    }
    gpu_seconds += pods.iter().map(|p| (end - p.started).as_secs_f64()).sum::<f64>();
    let share = |a: u64, b: u64| if b == 0 { 1.0 } else { a as f64 / b as f64 };
    Outcome {
        name: policy,
        within_deadline: share(c.ok, c.total),
        within_deadline_settled: share(c.settled_ok, c.settled_total),
        rejected: share(c.refused, c.total),
        gpu_seconds: gpu_seconds.round(),
        peak_replicas,
    }
}

/// All four policies on one scenario.
pub fn compare(world: &World, scenario: Scenario) -> Vec<Outcome> {
    PolicyKind::ALL.iter().map(|&p| run(world, scenario, p)).collect()
}

/// The README's rows for `scenario` (`simulate --markdown`; a test checks the README against them).
pub fn markdown(scenario: Scenario, outcomes: &[Outcome]) -> String {
    outcomes
        .iter()
        .map(|o| {
            format!(
                "| {} | {} | {:.2} % | {:.2} % | {:.2} % | {:.0} | {} |\n",
                scenario.name(),
                format!("{:?}", o.name).to_lowercase(),
                o.within_deadline * 100.0,
                o.within_deadline_settled * 100.0,
                o.rejected * 100.0,
                o.gpu_seconds,
                o.peak_replicas
            )
        })
        .collect()
}

/// A table for people, with the verdicts the issue asks for.
pub fn table(scenario: Scenario, outcomes: &[Outcome]) -> String {
    let mut out = format!(
        "scenario {}\npolicy   within deadline  after change+start-up  rejected  GPU-seconds  peak replicas\n",
        scenario.name()
    );
    for o in outcomes {
        out += &format!(
            "{:<7}  {:>13.2} %  {:>19.2} %  {:>6.2} %  {:>11.0}  {:>13}\n",
            format!("{:?}", o.name).to_lowercase(),
            o.within_deadline * 100.0,
            o.within_deadline_settled * 100.0,
            o.rejected * 100.0,
            o.gpu_seconds,
            o.peak_replicas
        );
    }
    let get = |k: PolicyKind| outcomes.iter().find(|o| o.name == k);
    if let (Some(f), Some(h), Some(o)) = (get(PolicyKind::Ferry), get(PolicyKind::Hpa), get(PolicyKind::Oracle)) {
        let (fm, hm) = ((1.0 - f.within_deadline) * 100.0, (1.0 - h.within_deadline) * 100.0);
        out += &format!(
            "ferry: {:.2}× the oracle's GPU-seconds, {:.2}× the HPA-style policy's; {fm:.2} % missed against its {hm:.2} %\n",
            f.gpu_seconds / o.gpu_seconds,
            f.gpu_seconds / h.gpu_seconds,
        );
        if fm > hm && f.gpu_seconds < h.gpu_seconds {
            out += &format!(
                "why the HPA-style policy misses fewer here: it ran {:.1}× the GPUs. Under batching a worker is busy \
                 most of the time whatever the load, so utilization reads high and it over-provisions; its extra \
                 pods absorb what Ferry's leaner count misses{}.\n",
                h.gpu_seconds / f.gpu_seconds,
                if scenario == Scenario::Spike {
                    " (a 20 s burst is shorter than the 60 s start-up: only pods already running can take it)"
                } else {
                    ""
                }
            );
        }
    }
    out
}
