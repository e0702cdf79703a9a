//! The decision for a generation service in simulation: pods that run the generation ledger in
//! virtual time with `examples/generation.yaml`'s sim-llm costs and limits
//! ([`ferry_core::generation::fleet`]), requests of 100 prompt and 256 output tokens routed at
//! random across ready pods (as a Service does), pods that take 60, 180 or 300 s to start and drain
//! their streams when retired — seeded, so every run gives the same figures.
//!
//! Five policies on the same trace: Ferry's [`decide`], fed what the collector reads from the
//! sidecars (the pods' own capacity figure, waiting prompt tokens, pressure); and, as their
//! documented rules, the ways LLM services are scaled today:
//! - HPA on waiting requests (`vllm:num_requests_waiting`, an average of 5 per pod, 10 %
//!   tolerance, a 15 s sync period, scale-up by at most 4 pods or 100 % a period, 300 s
//!   scale-down stabilization);
//! - KV-cache saturation (llm-d's variant autoscaler: one replica more when a pod's KV cache is
//!   more than 80 % used or more than 5 requests wait on it, one replica a minute, only when every
//!   replica is ready; one fewer when the load would stay under both on one replica fewer);
//! - a profile-based planner (Dynamo's: every 180 s, the mean rate over the last 180 s over a
//!   capacity known exactly from an offline profile — here the capacity function's own figure);
//! - an oracle that knows the trace and starts the pods each moment will need one start-up ahead,
//!   sized as the spec sizes them (at `targetUtilization`, with its warm capacity): what Ferry's
//!   rules would run if they knew the load to come — so its figures measure what not knowing
//!   costs, not the headroom the spec asks for.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ferry_core::generation::capacity::{capacity, Limits, RequestShape, Targets};
use ferry_core::generation::fleet::Pod;
use ferry_core::generation::step::StepCost;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::decide::{decide, History, Observed, Target, PRESSURE_TOLERANCE};
use super::simulate::Scenario;

/// The served model, the requests and the cluster, as the simulation sees them.
#[derive(Debug, Clone)]
pub struct World {
    pub cost: StepCost,
    pub limits: Limits,
    pub targets: Targets,
    pub prompt: u32,
    pub output: u32,
    /// Ferry's spec.
    pub target: Target,
    pub tick: Duration,
    /// The span rates are taken over (the operator's `--metrics-window`).
    pub window: Duration,
    pub seed: u64,
}

impl World {
    /// `examples/generation.yaml`'s pods (sim-llm at 10 ms a step, 200 µs a decoding sequence,
    /// 50 µs a prompt token; 64 sequences, 2048 tokens a step, 4096 blocks of 16), a first token
    /// within 1 s and a token every 100 ms for 256-token answers (26.6 s in all), pods taking
    /// `startup` to start; the spec's defaults otherwise (target utilization 0.8, 5 min
    /// scale-down delay), one warm spare, at most 20 replicas.
    pub fn example(startup: Duration) -> World {
        let ms = Duration::from_millis;
        World {
            cost: StepCost {
                fixed: ms(10),
                per_decode: Duration::from_micros(200),
                per_prefill_token: Duration::from_micros(50),
                ..StepCost::default()
            },
            limits: Limits { blocks: 4096, block_size: 16, watermark: 40, max_sequences: 64, max_batch_tokens: 2048 },
            targets: Targets { ttft: ms(1000), itl: ms(100), timeout: ms(26_600), margin: ms(2) },
            prompt: 100,
            output: 256,
            target: Target {
                workers: 1,
                max_batch_size: 32,
                max_wait: ms(10),
                latency_budget: ms(26_600),
                batch_time: ms(100),
                target_utilization: 0.8,
                min_replicas: 1,
                max_replicas: 20,
                warm_replicas: 1,
                scale_down_delay: Duration::from_secs(300),
                pressure_tolerance: PRESSURE_TOLERANCE,
                startup,
                ttft_budget: Some(ms(1000)),
                scale_to_zero_after: None,
            },
            tick: Duration::from_secs(2),
            window: Duration::from_secs(10),
            seed: 7,
        }
    }

    /// Requests a second one pod serves with its deadlines kept: what every sidecar exports.
    pub fn capacity(&self) -> f64 {
        let shape = RequestShape { prompt: f64::from(self.prompt), output: f64::from(self.output) };
        capacity(&self.cost, &shape, &self.targets, &self.limits).requests_per_second
    }

    fn startup(&self) -> Duration {
        self.target.startup
    }
}

/// The load of `scenario` at `t` seconds, in pods' capacities: the request-level scenarios'
/// shapes at the scale of a few generation pods, but for the day, which takes 30 minutes here
/// (10 in the request-level simulation): a day is far longer than a start-up, and a start-up of
/// 5 minutes is a sixth of this one.
pub fn load(scenario: Scenario, t: f64) -> f64 {
    use std::f64::consts::PI;
    match scenario {
        Scenario::Step => {
            if t < 60.0 {
                1.0
            } else {
                3.5
            }
        }
        Scenario::Spike => {
            if (150.0..170.0).contains(&t) {
                6.0
            } else {
                2.0
            }
        }
        Scenario::Diurnal => 2.5 - 1.5 * (2.0 * PI * t / DAY).cos(),
        Scenario::Drop => {
            if t < 120.0 {
                3.5
            } else {
                0.5
            }
        }
        Scenario::Ramp => 1.0 + 1.5 * (1.0 - (PI * t.min(400.0) / 400.0).cos()),
        Scenario::Burst => {
            if t >= 60.0 && (t - 60.0) % 100.0 < 10.0 {
                4.0
            } else {
                1.5
            }
        }
    }
}

const DAY: f64 = 1800.0;

/// The load a run offers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Trace {
    /// A scenario's shape ([`load`]).
    Scenario(Scenario),
    /// A steady rate, requests a second, for `seconds`: the plan's check.
    Steady { rate: f64, seconds: u64 },
}

impl Trace {
    /// Requests a second at `t` seconds, for pods of `capacity` requests a second.
    fn rate(self, t: f64, capacity: f64) -> f64 {
        match self {
            Trace::Scenario(s) => load(s, t) * capacity,
            Trace::Steady { rate, .. } => rate,
        }
    }

    /// When the counted part begins: once the change has ended and a pod asked for in reaction
    /// could be ready (for the day, which changes all along, one start-up in: the look-ahead has
    /// a start-up's history); for a steady load, once the pods have filled.
    pub fn settled_after(self, startup: Duration) -> f64 {
        match self {
            Trace::Scenario(Scenario::Ramp) => 400.0 + startup.as_secs_f64(),
            Trace::Scenario(s) => s.settled_after(startup),
            Trace::Steady { .. } => 30.0,
        }
    }

    /// Five minutes of counted part, a whole day for the day.
    pub fn duration(self, startup: Duration) -> Duration {
        let tail = match self {
            Trace::Scenario(Scenario::Diurnal) => DAY,
            Trace::Scenario(_) => 300.0,
            Trace::Steady { seconds, .. } => return Duration::from_secs(seconds),
        };
        Duration::from_secs_f64(self.settled_after(startup) + tail)
    }
}

/// The start-ups every scenario runs with: LLM pods load their weights for minutes.
pub const STARTUPS: [Duration; 3] = [Duration::from_secs(60), Duration::from_secs(180), Duration::from_secs(300)];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    Ferry,
    HpaWaiting,
    KvSaturation,
    Profile,
    Oracle,
    /// This many replicas throughout (the plan's check).
    Fixed(u32),
}

impl Policy {
    pub const COMPARED: [Policy; 5] =
        [Policy::Ferry, Policy::HpaWaiting, Policy::KvSaturation, Policy::Profile, Policy::Oracle];

    pub fn name(self) -> String {
        match self {
            Policy::Ferry => "ferry".into(),
            Policy::HpaWaiting => "hpa-waiting".into(),
            Policy::KvSaturation => "kv-saturation".into(),
            Policy::Profile => "profile".into(),
            Policy::Oracle => "oracle".into(),
            Policy::Fixed(n) => format!("fixed-{n}"),
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Outcome {
    pub policy: Policy,
    pub startup_seconds: u64,
    /// Share of the requests counted (their completion deadline within the run) that received
    /// every token with all three deadlines kept.
    pub kept: f64,
    /// The same, for requests arriving once a pod started in reaction to the change could be
    /// ready.
    pub kept_settled: f64,
    /// Share refused at admission, or for want of a ready pod.
    pub refused: f64,
    pub gpu_seconds: f64,
    pub peak_replicas: u32,
}

/// One worker pod of the simulation.
struct SimPod {
    pod: Pod,
    started: Instant,
    ready_at: Instant,
    retiring: bool,
}

impl SimPod {
    fn ready(&self, now: Instant) -> bool {
        self.ready_at <= now
    }

    fn serves(&self, now: Instant) -> bool {
        self.ready(now) && !self.retiring
    }
}

/// What a run counts.
#[derive(Default)]
struct Tally {
    total: u64,
    kept: u64,
    settled_total: u64,
    settled_kept: u64,
    refused: u64,
}

/// What the scaling policies remember between ticks.
#[derive(Default)]
struct Memory {
    /// Per tick: (when, requests offered, pressure), over the metrics window (Ferry's collector).
    recent: VecDeque<(Instant, u64, u64)>,
    /// Offered requests since the last tick and pressure since the last tick.
    arrivals: u64,
    pressure: u64,
    history: History,
    /// HPA's recommendations over its stabilization window, and its last sync.
    recommendations: VecDeque<(Instant, u32)>,
    /// The last scale of the policies that scale at most once a period, and the last sync of
    /// those that look only every period.
    last_change: Option<Instant>,
    last_sync: Option<Instant>,
    /// Per tick offered requests over the profile planner's interval.
    offered: VecDeque<(Instant, u64)>,
}

struct Sim<'a> {
    world: &'a World,
    trace: Trace,
    policy: Policy,
    start: Instant,
    end: Instant,
    settled: Instant,
    capacity: f64,
    pods: Vec<SimPod>,
    tally: Tally,
    memory: Memory,
    gpu_seconds: f64,
    peak: u32,
    route: StdRng,
}

/// Runs `policy` on `scenario` with `world`'s pods.
pub fn run(world: &World, scenario: Scenario, policy: Policy) -> Outcome {
    run_trace(world, Trace::Scenario(scenario), policy)
}

/// Runs `policy` on `trace` with `world`'s pods.
pub fn run_trace(world: &World, trace: Trace, policy: Policy) -> Outcome {
    let mut sim = Sim::new(world, trace, policy);
    let mut arrivals = StdRng::seed_from_u64(world.seed);
    let gap = |sim: &Sim, rng: &mut StdRng, at: Instant| {
        Duration::from_secs_f64(-(1.0 - rng.random::<f64>()).ln() / sim.rate(at).max(1e-9))
    };
    let mut next_arrival = sim.start + gap(&sim, &mut arrivals, sim.start);
    let mut next_tick = sim.start + world.tick;
    loop {
        let now = next_arrival.min(next_tick);
        if now >= sim.end {
            break;
        }
        for p in &mut sim.pods {
            p.pod.run_until(now);
        }
        if now == next_arrival {
            sim.arrive(now);
            next_arrival = now + gap(&sim, &mut arrivals, now);
        }
        if now == next_tick {
            sim.tick(now);
            next_tick = now + world.tick;
        }
    }
    sim.finish()
}

impl<'a> Sim<'a> {
    fn new(world: &'a World, trace: Trace, policy: Policy) -> Sim<'a> {
        let start = ferry_core::clock::now();
        let mut sim = Sim {
            world,
            trace,
            policy,
            start,
            end: start + trace.duration(world.startup()),
            settled: start + Duration::from_secs_f64(trace.settled_after(world.startup())),
            capacity: world.capacity(),
            pods: Vec::new(),
            tally: Tally::default(),
            memory: Memory::default(),
            gpu_seconds: 0.0,
            peak: 0,
            route: StdRng::seed_from_u64(world.seed ^ 0xfeed),
        };
        // Every policy starts where its own rule puts it for the first second's load, ready.
        let t = &world.target;
        let initial = match policy {
            Policy::Fixed(n) => n,
            Policy::Ferry | Policy::Oracle => sim.sized(0.0),
            Policy::Profile => sim.need(0.0, 1.0),
            _ => sim.need(0.0, t.target_utilization),
        };
        for _ in 0..initial.clamp(t.min_replicas.max(1), t.max_replicas) {
            sim.add(start, start);
        }
        sim
    }

    fn secs(&self, at: Instant) -> f64 {
        (at - self.start).as_secs_f64()
    }

    /// Requests a second at `at`.
    fn rate(&self, at: Instant) -> f64 {
        self.trace.rate(self.secs(at), self.capacity)
    }

    /// Pods the load at `t` seconds needs at `utilization` of their capacity.
    fn need(&self, t: f64, utilization: f64) -> u32 {
        (self.trace.rate(t, self.capacity) / (self.capacity * utilization)).ceil().max(1.0) as u32
    }

    /// Pods the spec sizes the load at `t` seconds for, known exactly: at `targetUtilization`,
    /// with its warm capacity ([`super::decide::with_warm`], Ferry's rules 3 and 5).
    fn sized(&self, t: f64) -> u32 {
        let s = &self.world.target;
        let rate = self.trace.rate(t, self.capacity);
        super::decide::with_warm(rate, self.capacity, s.target_utilization, s.warm_replicas).max(1)
    }

    fn add(&mut self, now: Instant, ready_at: Instant) {
        let w = self.world;
        self.pods.push(SimPod { pod: Pod::new(w.cost, w.targets, &w.limits), started: now, ready_at, retiring: false });
    }

    /// A request arrives: to a ready pod at random; refused without one.
    fn arrive(&mut self, now: Instant) {
        self.memory.arrivals += 1;
        let ready: Vec<usize> = (0..self.pods.len()).filter(|&i| self.pods[i].serves(now)).collect();
        if ready.is_empty() {
            self.memory.pressure += 1;
            if now + self.world.targets.timeout <= self.end {
                self.tally.total += 1;
                self.tally.refused += 1;
                self.tally.settled_total += u64::from(now >= self.settled);
            }
            return;
        }
        let i = ready[self.route.random_range(0..ready.len())];
        self.pods[i].pod.submit(now, self.world.prompt, self.world.output);
    }

    /// Counts the requests that ended since the last tick, and pressure.
    fn count(&mut self) {
        let (end, settled, timeout) = (self.end, self.settled, self.world.targets.timeout);
        for p in &mut self.pods {
            self.memory.pressure += u64::from(std::mem::take(&mut p.pod.full_preemptions));
            for v in p.pod.ended.drain(..) {
                self.memory.pressure += u64::from(v.pressure);
                if v.arrival + timeout > end {
                    continue;
                }
                let s = u64::from(v.arrival >= settled);
                self.tally.total += 1;
                self.tally.kept += u64::from(v.kept);
                self.tally.refused += u64::from(!v.admitted);
                self.tally.settled_total += s;
                self.tally.settled_kept += s * u64::from(v.kept);
            }
        }
    }

    fn tick(&mut self, now: Instant) {
        self.count();
        let current = self.pods.iter().filter(|p| !p.retiring).count() as u32;
        let desired =
            self.desired(now, current).clamp(self.world.target.min_replicas.max(1), self.world.target.max_replicas);
        if desired > current {
            for _ in current..desired {
                self.add(now, now + self.world.startup());
            }
        } else if desired < current {
            self.retire(now, current - desired);
        }
        if desired != current {
            self.memory.last_change = Some(now);
        }
        self.peak = self.peak.max(desired);
        self.memory.arrivals = 0;
        self.memory.pressure = 0;
        // Retired pods leave once their streams are sent; their GPU time is counted until then.
        let mut gone = 0.0;
        self.pods.retain(|p| {
            let leaves = p.retiring && p.pod.is_idle();
            if leaves {
                gone += (now - p.started).as_secs_f64();
            }
            !leaves
        });
        self.gpu_seconds += gone;
    }

    /// Pods still starting go first, then the ready pods with the fewest streams (the
    /// pod-deletion-cost Ferry sets; the ReplicaSet's choice for the others is no better).
    fn retire(&mut self, now: Instant, n: u32) {
        let mut order: Vec<usize> = (0..self.pods.len()).filter(|&i| !self.pods[i].retiring).collect();
        order.sort_by_key(|&i| {
            let s = self.pods[i].pod.scheduler();
            (self.pods[i].ready(now), s.running() + s.waiting())
        });
        for &i in order.iter().take(n as usize) {
            self.pods[i].retiring = true;
        }
    }

    fn desired(&mut self, now: Instant, current: u32) -> u32 {
        match self.policy {
            Policy::Fixed(n) => n,
            Policy::Ferry => self.ferry(now, current),
            Policy::HpaWaiting => self.hpa_waiting(now, current),
            Policy::KvSaturation => self.kv_saturation(now, current),
            Policy::Profile => self.profile(now, current),
            Policy::Oracle => {
                let from = self.secs(now);
                let until = from + (self.world.startup() + self.world.tick).as_secs_f64();
                (from as u64..=until as u64).map(|s| self.sized(s as f64)).max().unwrap_or(1)
            }
        }
    }

    /// What the operator's collector reads from the sidecars, over one window.
    fn observed(&mut self, now: Instant) -> Observed {
        let (w, m) = (self.world, &mut self.memory);
        m.recent.push_back((now, m.arrivals, m.pressure));
        while m.recent.front().is_some_and(|(at, _, _)| *at + w.window <= now) {
            m.recent.pop_front();
        }
        let tick = w.tick.as_secs_f64();
        let span = (m.recent.len() as f64 * tick).max(tick);
        let offered = m.recent.iter().map(|r| r.1).sum::<u64>();
        let active: Vec<&SimPod> = self.pods.iter().filter(|p| !p.retiring).collect();
        let ready: Vec<&SimPod> = active.iter().copied().filter(|p| p.ready(now)).collect();
        let oldest = ready.iter().filter_map(|p| p.pod.scheduler().oldest_waiting()).min();
        Observed {
            arrival_rate: offered as f64 / span,
            latest_rate: m.arrivals as f64 / tick,
            window_seconds: span,
            latest_seconds: tick,
            rows_per_request: 1.0,
            batch_time: None,
            queue_depth: ready.iter().map(|p| p.pod.scheduler().waiting() as f64).sum(),
            oldest_queue_age: oldest.map_or(Duration::ZERO, |at| now - at),
            pressure: m.recent.iter().map(|r| r.2).sum::<u64>() as f64 / offered.max(1) as f64,
            starting: (active.len() - ready.len()) as u32,
            settling: ready.iter().filter(|p| p.ready_at + w.window > now).count() as u32,
            stuck: 0,
            rolling_out: false,
            locked: 0,
            // Each pod's own figure: its step cost is known exactly (the prior it measured at
            // load), and the requests are of one shape.
            capacity: Some(self.capacity),
            queue_tokens: ready.iter().map(|p| p.pod.scheduler().queued_tokens() as f64).sum(),
            prefill_rate: Some(1.0 / w.cost.per_prefill_token.as_secs_f64()),
            tokens_rate: 0.0,
            kv_usage: ready.iter().map(|p| p.pod.kv_usage()).reduce(f64::max),
        }
    }

    fn ferry(&mut self, now: Instant, current: u32) -> u32 {
        let observed = self.observed(now);
        let d = decide(&observed, &self.world.target, current, &self.memory.history, now);
        self.memory.history = d.history;
        d.replicas
    }

    /// HPA on the average of waiting requests per pod (a Pods metric; pods not ready count 0):
    /// every 15 s, `ceil(current × average / 5)` unless within 10 % of `current`; up at most
    /// `max(4, current)` a period; down to the highest recommendation of the last 300 s.
    fn hpa_waiting(&mut self, now: Instant, current: u32) -> u32 {
        const TARGET: f64 = 5.0;
        if self.memory.last_sync.is_some_and(|at| now < at + Duration::from_secs(15)) {
            return current;
        }
        self.memory.last_sync = Some(now);
        let waiting: usize = self.pods.iter().filter(|p| p.serves(now)).map(|p| p.pod.scheduler().waiting()).sum();
        let ratio = waiting as f64 / (TARGET * f64::from(current.max(1)));
        let recommended =
            if (ratio - 1.0).abs() <= 0.1 { current } else { (f64::from(current) * ratio).ceil() as u32 }.max(1);
        let m = &mut self.memory;
        m.recommendations.push_back((now, recommended));
        while m.recommendations.front().is_some_and(|(at, _)| *at + Duration::from_secs(300) < now) {
            m.recommendations.pop_front();
        }
        if recommended > current {
            recommended.min(current + current.max(4))
        } else {
            m.recommendations.iter().map(|r| r.1).max().unwrap_or(recommended).min(current)
        }
    }

    /// One replica more when a pod's KV cache is more than 80 % used or more than 5 requests wait
    /// on it; one fewer when nothing waits and the fullest pod's KV usage, spread over one
    /// replica fewer, stays under 80 %; at most one change a minute, and none while a pod starts.
    fn kv_saturation(&mut self, now: Instant, current: u32) -> u32 {
        let starting = self.pods.iter().any(|p| !p.retiring && !p.ready(now));
        if starting || self.memory.last_change.is_some_and(|at| now < at + Duration::from_secs(60)) {
            return current;
        }
        let ready: Vec<&SimPod> = self.pods.iter().filter(|p| p.serves(now)).collect();
        let kv = ready.iter().map(|p| p.pod.kv_usage()).fold(0.0, f64::max);
        let waiting = ready.iter().map(|p| p.pod.scheduler().waiting()).max().unwrap_or(0) as f64;
        if kv > 0.8 || waiting > 5.0 {
            return current + 1;
        }
        let shrink = f64::from(current) / f64::from(current.saturating_sub(1).max(1));
        if current > 1 && waiting == 0.0 && kv * shrink <= 0.8 {
            current - 1
        } else {
            current
        }
    }

    /// Every 180 s, the mean offered rate of the last 180 s over one pod's exact capacity.
    fn profile(&mut self, now: Instant, current: u32) -> u32 {
        const INTERVAL: Duration = Duration::from_secs(180);
        let m = &mut self.memory;
        m.offered.push_back((now, m.arrivals));
        while m.offered.front().is_some_and(|(at, _)| *at + INTERVAL <= now) {
            m.offered.pop_front();
        }
        if m.last_sync.is_some_and(|at| now < at + INTERVAL) {
            return current;
        }
        m.last_sync = Some(now);
        let span = (m.offered.len() as f64 * self.world.tick.as_secs_f64()).max(1.0);
        let rate = m.offered.iter().map(|o| o.1).sum::<u64>() as f64 / span;
        (rate / self.capacity).ceil().max(1.0) as u32
    }

    fn finish(mut self) -> Outcome {
        for p in &mut self.pods {
            p.pod.run_until(self.end);
        }
        self.count();
        let end = self.end;
        self.gpu_seconds += self.pods.iter().map(|p| (end - p.started).as_secs_f64()).sum::<f64>();
        let share = |a: u64, b: u64| if b == 0 { 1.0 } else { a as f64 / b as f64 };
        let t = &self.tally;
        Outcome {
            policy: self.policy,
            startup_seconds: self.world.startup().as_secs(),
            kept: share(t.kept, t.total),
            kept_settled: share(t.settled_kept, t.settled_total),
            refused: share(t.refused, t.total),
            gpu_seconds: self.gpu_seconds.round(),
            peak_replicas: self.peak,
        }
    }
}

/// Every compared policy on one scenario.
pub fn compare(world: &World, scenario: Scenario) -> Vec<Outcome> {
    Policy::COMPARED.iter().map(|&p| run(world, scenario, p)).collect()
}

/// The README's row for `scenario` at the start-up of `outcomes` (`simulate-generation
/// --markdown`; a test checks the README against them): per policy, the share of requests
/// keeping all three deadlines after the change and a start-up, and GPU-seconds.
pub fn markdown(scenario: Scenario, outcomes: &[Outcome]) -> String {
    let startup = outcomes.first().map_or(0, |o| o.startup_seconds);
    let cells: Vec<String> =
        outcomes.iter().map(|o| format!("{:.2} % / {:.0}", o.kept_settled * 100.0, o.gpu_seconds)).collect();
    format!("| {} | {startup} s | {} |\n", scenario.name(), cells.join(" | "))
}

/// A table for people.
pub fn table(scenario: Scenario, outcomes: &[Outcome]) -> String {
    let startup = outcomes.first().map_or(0, |o| o.startup_seconds);
    let mut out = format!(
        "scenario {}, pods ready {startup} s after asked for\n\
         policy         all deadlines kept  after change+start-up  refused  GPU-seconds  peak replicas\n",
        scenario.name()
    );
    for o in outcomes {
        out += &format!(
            "{:<13}  {:>16.2} %  {:>19.2} %  {:>5.2} %  {:>11.0}  {:>13}\n",
            o.policy.name(),
            o.kept * 100.0,
            o.kept_settled * 100.0,
            o.refused * 100.0,
            o.gpu_seconds,
            o.peak_replicas
        );
    }
    out
}
