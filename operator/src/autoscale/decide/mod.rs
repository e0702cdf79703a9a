//! How many worker pods an InferenceService needs: a pure function of what the sidecars report,
//! the spec, and a little history, so that every rule is tested to the second and the same
//! function runs in simulation and in the operator.
//!
//! The rules, in order (DESIGN.md, "Autoscaling principle"):
//! 1. Capacity of one replica at full batches is `workers × maxBatchSize / batchTime` rows/s.
//! 2. The offered rate is looked ahead by the time-to-ready: a pod asked for now serves only once
//!    it is ready, so a rising rate is sized for where its trend (a rise both halves of the
//!    recent decisions' rates agree on) puts it one time-to-ready ahead — at most twice the rate
//!    now, and only when it adds a tenth at least (less is the rates' noise).
//!    A falling rate is not projected: scale-down has its own delay.
//! 3. Replicas for that rate at `targetUtilization`.
//! 4. Plus what drains, within one latency budget, the part of a backlog (whose oldest request
//!    waited longer than `maxWait + batchTime`) that the ready replicas cannot — while no pod is
//!    starting: pods that start now arrive long after this backlog is served or expired.
//! 5. Plus `warmReplicas`: replicas beyond what the load needs (the same meaning at creation,
//!    [`crate::desired::initial_replicas`], where the load is still nothing). For a generation
//!    service, warm capacity in the pods' own figure (tokens at the current shape): `warmReplicas`
//!    pods' worth ready beyond the load looked ahead, the headroom `targetUtilization` leaves
//!    counted towards it — replicas are the larger of rule 3's and
//!    `⌈rate / capacity⌉ + warmReplicas`, so the spare is a whole pod only where that headroom is
//!    less than one pod's.
//! 6. Deadline pressure (more than a tolerated share of requests infeasible or expired) scales up
//!    by at least one when it comes from too little capacity: a backlog, or ready replicas that are
//!    busy (offered at least half of what they serve at full batches). It then waits until the
//!    pods it asked for have been ready for one metrics window; if the pressure has not fallen to
//!    half by then, added replicas do not help: it is the service's structural floor (its shape,
//!    e.g. a wait for a busy worker plus a batch close to the budget), remembered with the rate it
//!    was seen at and ignored while the rate stays within a quarter of it. Pressure from capacity
//!    blocks scale-down; a structural floor does not.
//! 7. Scale-down follows the highest need over the last `scaleDownDelay` (a
//!    HorizontalPodAutoscaler's scale-down stabilization window), going down whenever that fits
//!    on fewer — a falling load is followed one delay behind, not in stairs one delay apart; a
//!    load that falls steadily ([`steady_fall`]), a minute behind: the delay is for dips that do
//!    not last. The need counted there is what the load seen needed at each decision, and what the look-ahead
//!    asked for over the last minute only: a newer look-ahead replaces an older one, and pods
//!    asked for a rise that stopped before they were needed go without waiting out a delay for
//!    a load that never came; a pressure probe's replica counts as load seen. Pods still
//!    starting go first, and may go then (not a probe's, nor during a rollout); a ready pod is
//!    not removed while one warms. Until the decisions watched span a whole delay (after a
//!    restart, or a raised delay), nothing goes.
//! 8. Bounded by `minReplicas` and `maxReplicas`, and one replica at least: a service at zero
//!    has no pod to show its load with.
//! 9. Except with `scaleToZeroAfter` (and `minReplicas: 0`): no offered load for that long goes
//!    to zero, and at zero the load the holder holds (its arrivals and the requests it holds,
//!    reported as a pod's) asks at once for the replicas rules 1 to 5 size it for.
//!
//! Every decision has a [`Reason`] and says why.
//!
//! Rule 2's reading of the rate over time (the jump, the trend) and rule 7's steady fall are in
//! `trend.rs`; the tests of every rule, side by side, in `tests.rs`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ferry_core::scheduler::capacity;

mod trend;
use trend::{look_ahead, Rate};
pub use trend::{steady_fall, trend};

/// What the sidecars' metrics say, summed (or maxed) over the service's pods, over one window.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    /// Requests offered per second (admitted, or refused for want of capacity), over the window.
    pub arrival_rate: f64,
    /// The same over the latest scrape interval only: a step shows here a window before the
    /// window's mean has caught up.
    pub latest_rate: f64,
    /// How long the window and the latest interval were (s): a rate counted over `t` seconds
    /// strays by chance by about √(rate / t) (a Poisson count's spread), so a rise smaller than
    /// that is noise. Infinite for rates known exactly.
    pub window_seconds: f64,
    pub latest_seconds: f64,
    /// Mean rows per request.
    pub rows_per_request: f64,
    /// Measured mean engine time per batch, if any batch ran.
    pub batch_time: Option<Duration>,
    pub queue_depth: f64,
    /// The longest any queued request has waited, over all pods.
    pub oldest_queue_age: Duration,
    /// Share of the window's offered requests refused as infeasible or expired, or preempted
    /// while the KV cache was all but full (0 to 1).
    pub pressure: f64,
    /// Pods asked for but not ready yet: capacity to come.
    pub starting: u32,
    /// Ready pods that have not been ready for a whole window: the window's figures do not show
    /// their effect yet.
    pub settling: u32,
    /// Pods unready for far longer than a start-up: neither capacity nor capacity to come.
    pub stuck: u32,
    /// The Deployment is replacing its pods (a rollout): it spreads a scale-down over its old
    /// and new ReplicaSets, so a scale-down then may take a ready pod, not a starting one.
    pub rolling_out: bool,
    /// Ready pods that refuse every request while idle (`ferry_admission_locked`): capacity that
    /// admission does not use, which more replicas would not mend. Their refusals are not
    /// deadline pressure (the collector leaves them out); the decision's message names them.
    pub locked: u32,
    /// Requests a second one replica serves with its deadlines kept, by the pods' own account
    /// (`ferry_capacity_requests_per_second`, a generation pod's): `None` for request-level pods,
    /// whose capacity is the batch arithmetic.
    pub capacity: Option<f64>,
    /// Prompt tokens waiting to be prefilled, over all pods (`ferry_queue_tokens`).
    pub queue_tokens: f64,
    /// Prompt tokens a second one pod prefills (the inverse of its learned cost per prompt
    /// token, `ferry_step_cost_seconds{term="prefill_token"}`); `None` without a step engine.
    pub prefill_rate: Option<f64>,
    /// Generated tokens a second over the window, and the fullest pod's KV-cache usage (`None`
    /// without a step engine): for the status.
    pub tokens_rate: f64,
    pub kv_usage: Option<f64>,
}

/// The spec's numbers the decision uses.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub workers: u32,
    pub max_batch_size: u32,
    pub max_wait: Duration,
    pub latency_budget: Duration,
    /// The configured batch time, used until one is measured.
    pub batch_time: Duration,
    pub target_utilization: f64,
    pub min_replicas: u32,
    pub max_replicas: u32,
    pub warm_replicas: u32,
    pub scale_down_delay: Duration,
    /// Deadline pressure counts once more than this share of requests miss ([`PRESSURE_TOLERANCE`]
    /// in the operator).
    pub pressure_tolerance: f64,
    /// Time from asking for a pod to its serving: measured, or `startupTime` until measured.
    pub startup: Duration,
    /// A generation service's default first-token deadline (`spec.generation.ttftBudget`): the
    /// prompts waiting must be prefilled within it. `None` for request-level services.
    pub ttft_budget: Option<Duration>,
    /// `spec.scaling.scaleToZeroAfter` (with `minReplicas: 0`): no offered load for this long
    /// takes the service to zero pods. `None`: one pod at least.
    pub scale_to_zero_after: Option<Duration>,
}

/// Why a decision came out as it did: decisions are counted by reason in the operator's metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The offered rate (looked ahead) needs more replicas.
    Load,
    /// A backlog needs more replicas to drain within one latency budget.
    Backlog,
    /// Deadline pressure from too little capacity: one replica more at least.
    Pressure,
    /// Deadline pressure, but the pods asked for have not had a window to show their effect.
    Settling,
    /// Deadline pressure that is not for want of capacity: nothing to scale.
    Structural,
    /// The load needs what runs.
    Steady,
    /// The load needs fewer, but pods are starting: a ready pod is not removed while one warms,
    /// and the starting ones stay (still needed, a probe's, a rollout's, or the need not yet
    /// watched for a minute).
    Warming,
    /// The load needs fewer, but the decisions watched do not span a whole `scaleDownDelay` yet
    /// (the operator restarted, or the delay was raised): scale-down waits for them to.
    Cooling,
    /// The highest need over the delay does not fit on one replica fewer.
    Peak,
    /// Fewer replicas.
    ScaleDown,
    /// No load offered for `scaleToZeroAfter`: zero pods, the holder holds what comes.
    ToZero,
    /// At zero, the holder holds load: the replicas it needs, in one decision.
    FromZero,
}

impl Reason {
    pub const ALL: [Reason; 12] = [
        Reason::Load,
        Reason::Backlog,
        Reason::Pressure,
        Reason::Settling,
        Reason::Structural,
        Reason::Steady,
        Reason::Warming,
        Reason::Cooling,
        Reason::Peak,
        Reason::ScaleDown,
        Reason::ToZero,
        Reason::FromZero,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Reason::Load => "load",
            Reason::Backlog => "backlog",
            Reason::Pressure => "pressure",
            Reason::Settling => "settling",
            Reason::Structural => "structural",
            Reason::Steady => "steady",
            Reason::Warming => "warming",
            Reason::Cooling => "cooling",
            Reason::Peak => "peak",
            Reason::ScaleDown => "scale_down",
            Reason::ToZero => "to_zero",
            Reason::FromZero => "from_zero",
        }
    }
}

/// A scale-up for pressure (from `from` to `replicas`), to be judged once its pods have been
/// ready for a window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Probe {
    pub from: u32,
    pub replicas: u32,
    pub pressure: f64,
}

/// Pressure that added replicas did not relieve, the offered rate it was seen at, and the
/// replicas before the scale-up that did not help (kept while the floor holds: earlier ones
/// were added because they helped).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Floor {
    pub pressure: f64,
    pub rate: f64,
    pub replicas: u32,
}

/// What the decision remembers between ticks.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct History {
    /// Since when the need has been below the replicas (for rule 7's message).
    pub lower_since: Option<Instant>,
    /// The need at each decision over the last `scaleDownDelay` (rule 7's window).
    pub needs: VecDeque<Needed>,
    /// Since when decisions have been recorded in `needs` over the current `scaleDownDelay`
    /// (`window`): until one delay has passed, the window is not a whole one (the operator
    /// restarted, or the delay was raised).
    pub watched_since: Option<Instant>,
    pub window: Duration,
    /// The offered rate at recent decisions, over one time-to-ready: its trend.
    pub rates: VecDeque<(Instant, f64)>,
    pub probe: Option<Probe>,
    pub floor: Option<Floor>,
    /// Since when no load has been offered (rule 9).
    pub idle_since: Option<Instant>,
}

/// One decision's need, in replicas: for the rate looked ahead one time-to-ready (what it asked
/// for), and for the rate seen now (what the load needed then).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Needed {
    pub at: Instant,
    pub ahead: u32,
    pub seen: u32,
    /// The offered rate then: whether the window's load fell steadily ([`steady_fall`]).
    pub rate: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ScaleDecision {
    pub replicas: u32,
    pub reason: Reason,
    /// The arithmetic behind it, for people (the status and the Scaled event).
    pub message: String,
    pub history: History,
}

/// Deadline pressure counts once more than this share of offered requests miss: the operator's
/// and the simulation's tolerance. Low, because pressure that is not for want of capacity is
/// told apart (rule 6) rather than tolerated.
pub const PRESSURE_TOLERANCE: f64 = 0.002;
/// What the look-ahead asked for counts in rule 7's peak for this long, where the load seen counts
/// for the whole `scaleDownDelay`: a newer look-ahead, fitted to more of the rise, replaces an
/// older one. A Knative autoscaler's stable window: long enough that one reading's dip does not
/// give up a start-up the next reading asks for again.
const FORECAST_WINDOW: Duration = Duration::from_secs(60);
/// Ready replicas offered at least this share of their full-batch capacity are busy: pressure
/// there can be for want of capacity.
const BUSY: f64 = 0.5;
/// Pressure that did not fall below this share of what it was after a scale-up is structural.
const RELIEF: f64 = 0.5;
/// A floor holds while the rate stays within this share of the rate it was seen at.
const FLOOR_RATE_BAND: f64 = 0.25;

/// Pods more that a generation backlog needs: the prompt tokens waiting beyond what the `ready`
/// pods prefill within the first-token budget, at what one pod prefills in it (while no pod is
/// starting: those are capacity to come).
fn prompt_backlog(observed: &Observed, target: &Target, ready: u32) -> u32 {
    let (Some(ttft), Some(rate)) = (target.ttft_budget, observed.prefill_rate) else { return 0 };
    let per_pod = rate * ttft.as_secs_f64();
    if observed.starting > 0 || per_pod <= 0.0 {
        return 0;
    }
    ((observed.queue_tokens - f64::from(ready) * per_pod).max(0.0) / per_pod).ceil() as u32
}

/// Requests per second one replica serves at full batches ([`capacity::per_replica`]).
pub fn capacity_per_replica(target: &Target, batch_time: Duration, rows_per_request: f64) -> f64 {
    capacity::per_replica(target.workers, target.max_batch_size, batch_time, rows_per_request)
}

/// `current` is the Deployment's replica count: ready pods and pods still starting.
pub fn decide(observed: &Observed, target: &Target, current: u32, history: &History, now: Instant) -> ScaleDecision {
    let mut d = rule(observed, target, current, history, now);
    if observed.locked > 0 {
        d.message.push_str(&format!(
            "; {} pod(s) refuse every request while idle (ferry_admission_locked), not for want of capacity: see \
             their /v2/health/ready",
            observed.locked
        ));
    }
    d
}

/// The rules in order, each its own function below; the decision is the first that decides.
fn rule(observed: &Observed, target: &Target, current: u32, history: &History, now: Instant) -> ScaleDecision {
    let mut h = history.clone();
    let rate = look_ahead(observed, target, &mut h.rates, now);
    let batch_time = observed.batch_time.unwrap_or(target.batch_time);
    let (capacity, whose) = capacity(observed, target, batch_time);
    let ready = current.saturating_sub(observed.starting + observed.stuck);
    let need = need(observed, target, &rate, capacity, ready, batch_time);
    let t = Tick {
        observed,
        target,
        current,
        now,
        ready,
        rate: rate.now,
        capacity,
        why: explain(observed, target, &rate, capacity, whose, &need),
        pressured: observed.pressure > target.pressure_tolerance,
        relief_coming: observed.starting > 0 || observed.settling > 0,
    };
    let failed = judge_probe(&t, &mut h);
    let floor = h.floor.map_or(0, |f| t.bounded(f.replicas));
    let desired = t.bounded(need.total()).max(floor);
    let seen = Rate { ahead: rate.now, ..rate };
    let seen = t.bounded(self::need(observed, target, &seen, capacity, ready, batch_time).total()).max(floor);
    if h.watched_since.is_none() || target.scale_down_delay > h.window {
        h.watched_since = Some(now);
    }
    h.window = target.scale_down_delay;
    h.needs.push_back(Needed { at: now, ahead: desired, seen, rate: rate.now });
    while h.needs.front().is_some_and(|n| n.at + target.scale_down_delay < now) {
        h.needs.pop_front();
    }
    if let Some(d) = zero(&t, desired, &mut h) {
        return d;
    }
    // A count above `maxReplicas` (the spec was lowered) comes down to it at once.
    if current > target.max_replicas {
        h.lower_since = None;
        let message = format!("scale down: {current} is above maxReplicas ({}); {}", target.max_replicas, t.why);
        return decision(target.max_replicas, Reason::ScaleDown, message, h);
    }
    if t.pressured && (need.backlog || t.busy()) && h.floor.is_none() {
        return for_pressure(&t, desired, h);
    }
    if let (Some(probe), Some(_)) = (failed, h.floor) {
        if desired < current {
            return undo_probe(&t, probe, desired, h);
        }
    }
    follow_need(&t, desired, &need, h)
}

fn decision(replicas: u32, reason: Reason, message: String, history: History) -> ScaleDecision {
    ScaleDecision { replicas, reason, message, history }
}

/// What every rule of one decision reads: its inputs, and what the first rules made of them.
struct Tick<'a> {
    observed: &'a Observed,
    target: &'a Target,
    current: u32,
    now: Instant,
    /// Pods that serve now: neither starting nor stuck.
    ready: u32,
    /// The offered rate now (not looked ahead).
    rate: f64,
    /// Requests a second one replica serves.
    capacity: f64,
    /// The arithmetic, for the message.
    why: String,
    /// More than the tolerated share of requests missed.
    pressured: bool,
    /// Pods asked for have not had a window to show their effect.
    relief_coming: bool,
}

impl Tick<'_> {
    /// Rule 8. One replica at least: only rule 9 goes to zero.
    fn bounded(&self, n: u32) -> u32 {
        n.clamp(self.target.min_replicas.max(1), self.target.max_replicas)
    }

    /// The ready replicas are offered enough that pressure there can be for want of capacity.
    fn busy(&self) -> bool {
        self.rate >= BUSY * f64::from(self.ready) * self.capacity
    }

    fn pressure(&self) -> String {
        format!("{:.1} % of requests infeasible or expired", self.observed.pressure * 100.0)
    }

    /// Why pressure that scales nothing is not for want of capacity; empty without pressure.
    fn structural(&self, floor: Option<Floor>) -> String {
        if !self.pressured {
            return String::new();
        }
        let cause = match floor {
            Some(f) => format!("replicas added at {:.0} req/s did not relieve it; keeping {}", f.rate, f.replicas),
            None => format!(
                "the ready replicas are not busy ({:.0} of {:.0} req/s)",
                self.rate,
                f64::from(self.ready) * self.capacity
            ),
        };
        format!("; {}, not for want of capacity: {cause}", self.pressure())
    }
}

/// Rule 1: requests a second one replica serves, and whose figure it is (for the message).
fn capacity(observed: &Observed, target: &Target, batch_time: Duration) -> (f64, &'static str) {
    // A generation pod serves requests of many steps, not batches: its own figure (its learned
    // step cost, its requests' shape and its deadlines) is its capacity; `maxBatchSize` rows of
    // `batchTime` would make it 32 times what it is.
    match observed.capacity {
        Some(c) => (c, ", the pods' own figure,"),
        None => (capacity_per_replica(target, batch_time, observed.rows_per_request), ""),
    }
}

/// Replicas the load needs, by rule.
struct Need {
    /// Rule 3: for the rate looked ahead.
    for_rate: u32,
    /// Rule 5: for the rate looked ahead with the warm capacity beyond it ([`with_warm`]).
    with_warm: u32,
    /// Rule 4: for a backlog of requests, and of prompt tokens (a generation service's).
    for_requests: u32,
    for_prompts: u32,
    /// Requests have waited longer than a batch should.
    backlog: bool,
}

impl Need {
    fn for_backlog(&self) -> u32 {
        self.for_requests.max(self.for_prompts)
    }

    fn total(&self) -> u32 {
        self.for_rate.max(self.with_warm) + self.for_backlog()
    }
}

/// Rules 3 and 5 for `rate` requests a second at `capacity` a replica: replicas at
/// `utilization`, or the load's own replicas plus `warm` whole ones, whichever is more — the
/// utilization's headroom is warm capacity too (a pod at 0.8 of its capacity has a fifth of one
/// spare), and adding a spare pod on top of it would pay twice for the same burst.
pub fn with_warm(rate: f64, capacity: f64, utilization: f64, warm: u32) -> u32 {
    let for_rate = (rate / (capacity * utilization)).ceil() as u32;
    let busy = (rate / capacity).ceil() as u32;
    for_rate.max(busy.saturating_add(warm))
}

/// Rules 3 and 4.
fn need(observed: &Observed, target: &Target, rate: &Rate, capacity: f64, ready: u32, batch_time: Duration) -> Need {
    let usable = capacity * target.target_utilization;
    let for_rate = (rate.ahead / usable).ceil() as u32;
    // A generation pod's own figure is its capacity in tokens at the current shape: warm capacity
    // in the same units, the headroom counted. A request-level service keeps whole warm replicas
    // beyond rule 3: its batches fill in steps, and the simulation's sudden steps (300 → 1000
    // req/s) missed more deadlines with the headroom counted (91 % kept over the run, against 98 %).
    let with_warm = match observed.capacity {
        Some(_) => with_warm(rate.ahead, capacity, target.target_utilization, target.warm_replicas),
        None => for_rate + target.warm_replicas,
    };
    let backlog = observed.queue_depth > 0.0 && observed.oldest_queue_age > target.max_wait + batch_time;
    // What the ready replicas cannot drain within one latency budget needs more of them. With
    // none ready (at zero: a backlog the holder holds), the replicas asked for the rate drain it.
    let budget = target.latency_budget.as_secs_f64();
    let drainers = if ready == 0 { for_rate } else { ready };
    let drained = f64::from(drainers) * capacity * budget;
    let for_requests = if backlog && observed.starting == 0 {
        ((observed.queue_depth - drained).max(0.0) / (capacity * budget)).ceil() as u32
    } else {
        0
    };
    Need { for_rate, with_warm, for_requests, for_prompts: prompt_backlog(observed, target, ready), backlog }
}

/// The arithmetic of rules 1 to 5, for people.
fn explain(observed: &Observed, target: &Target, rate: &Rate, capacity: f64, whose: &str, need: &Need) -> String {
    let mut why = format!("{:.0} req/s", rate.now);
    if rate.ahead > rate.now + 0.5 {
        why += &format!(" (rising {:.1} req/s per s: {:.0} in {} s)", rate.slope, rate.ahead, target.startup.as_secs());
    }
    why += &format!(
        " at {} req/s per replica{whose} (×{:.2} utilization) needs {}",
        if capacity < 10.0 { format!("{capacity:.1}") } else { format!("{capacity:.0}") },
        target.target_utilization,
        need.for_rate
    );
    // Rule 5 before the backlog's replicas, which come on top of it.
    let w = target.warm_replicas;
    if need.with_warm > need.for_rate {
        why += &format!(", {} with {w} replica(s) of warm capacity beyond the load", need.with_warm);
    } else if w > 0 {
        why += &format!(", its utilization headroom covering {w} replica(s) of warm capacity");
    }
    if need.for_prompts > need.for_requests {
        why += &format!(
            ", {:.0} prompt tokens waiting, more than the ready pods prefill within the {} ms first-token budget, need {} more",
            observed.queue_tokens,
            target.ttft_budget.unwrap_or_default().as_millis(),
            need.for_prompts
        );
    } else if need.for_backlog() > 0 {
        why += &format!(
            ", a backlog of {:.0} (oldest waited {} ms) needs {} more",
            observed.queue_depth,
            observed.oldest_queue_age.as_millis(),
            need.for_backlog()
        );
    }
    why
}

/// Rule 6, its memory: judges a pressure probe whose pods have had their window (a probe that
/// did not relieve the pressure becomes a floor, and is returned), and lets a floor go once the
/// rate moved, the pressure went, or it doubled.
fn judge_probe(t: &Tick, h: &mut History) -> Option<Probe> {
    let observed = t.observed;
    let mut failed = None;
    if let Some(probe) = h.probe.filter(|_| !t.relief_coming) {
        h.probe = None;
        if t.pressured && t.current >= probe.replicas && observed.pressure > probe.pressure * RELIEF {
            h.floor = Some(Floor { pressure: observed.pressure, rate: t.rate, replicas: probe.from });
            failed = Some(probe);
        }
    }
    if let Some(floor) = h.floor {
        let moved = (t.rate - floor.rate).abs() > FLOOR_RATE_BAND * floor.rate;
        if moved || !t.pressured || observed.pressure > 2.0 * floor.pressure + t.target.pressure_tolerance {
            h.floor = None;
        }
    }
    failed
}

/// Rule 6, pressure for want of capacity: the need if it is more, else one replica more (a
/// probe, judged later) once the pods asked for have had their window.
fn for_pressure(t: &Tick, desired: u32, mut h: History) -> ScaleDecision {
    let (current, pressure, why) = (t.current, t.pressure(), &t.why);
    h.lower_since = None;
    if desired > current {
        return decision(desired, Reason::Load, format!("scale up: {why}; {pressure}"), h);
    }
    if t.relief_coming {
        let message = format!(
            "holding {current}: {pressure}, and {} pods asked for have not had a window to relieve it yet; {why}",
            t.observed.starting + t.observed.settling
        );
        return decision(current, Reason::Settling, message, h);
    }
    let replicas = t.bounded(current + 1);
    if replicas == current {
        // At maxReplicas: nothing to try, so nothing to judge later.
        let message = format!("deadline pressure: {pressure}, at maxReplicas ({current}); {why}");
        return decision(current, Reason::Pressure, message, h);
    }
    h.probe = Some(Probe { from: current, replicas, pressure: t.observed.pressure });
    // Pressure from want of capacity is load seen: if the probe relieves it, rule 7 keeps its
    // replica for a whole window, as it would the need of a higher rate.
    if let Some(n) = h.needs.back_mut() {
        n.seen = n.seen.max(replicas);
    }
    decision(replicas, Reason::Pressure, format!("deadline pressure: {pressure}; {why}"), h)
}

/// Rule 6, a failed probe: the replicas added for pressure that did not relieve it go again, at
/// once — they were no answer to a load that lasts, which is what the scale-down delay waits for.
fn undo_probe(t: &Tick, probe: Probe, desired: u32, mut h: History) -> ScaleDecision {
    h.lower_since = None;
    let message = format!(
        "scale down: {} after the scale-up from {} to {} for {:.1} %, not for want of capacity: back to {desired}; {}",
        t.pressure(),
        probe.from,
        probe.replicas,
        probe.pressure * 100.0,
        t.why
    );
    debug_assert!(h.floor.is_some_and(|f| f.replicas < t.current), "the probe's replica goes");
    decision(desired, Reason::Structural, message, h)
}

/// Rules 3 to 5 and 7: up to the need at once, down to it only after the delay and a peak check.
fn follow_need(t: &Tick, desired: u32, need: &Need, mut h: History) -> ScaleDecision {
    let (current, why, structural) = (t.current, &t.why, t.structural(h.floor));
    if desired > current {
        h.lower_since = None;
        let for_load = t.bounded(need.for_rate.max(need.with_warm)) > current;
        let reason = if for_load { Reason::Load } else { Reason::Backlog };
        return decision(desired, reason, format!("scale up: {why}{structural}"), h);
    }
    if desired == current {
        h.lower_since = None;
        let reason = if t.pressured { Reason::Structural } else { Reason::Steady };
        return decision(current, reason, format!("steady: {why}{structural}"), h);
    }
    scale_down(t, desired, &structural, h)
}

/// Rule 9, scale to zero (with `scaleToZeroAfter`): at zero, load the holder holds (offered
/// requests, held ones) asks at once for all the replicas the other rules size it for — not one
/// to wait on — and no load stays at zero; above zero, no offered load for `scaleToZeroAfter`
/// (no request arriving, none queued, no stream generating) goes to zero, though never while a
/// pod is starting.
/// `None`: the other rules decide.
fn zero(t: &Tick, desired: u32, h: &mut History) -> Option<ScaleDecision> {
    let after = t.target.scale_to_zero_after.filter(|_| t.target.min_replicas == 0)?;
    let o = t.observed;
    // Tokens generated over the window: a stream still running, which zero pods would cut.
    let offered = o.arrival_rate > 0.0
        || o.latest_rate > 0.0
        || o.queue_depth > 0.0
        || o.queue_tokens > 0.0
        || o.tokens_rate > 0.0;
    if offered {
        h.idle_since = None;
    }
    if t.current == 0 {
        h.lower_since = None;
        if !offered {
            return Some(decision(0, Reason::Steady, "steady at zero: no load offered".into(), h.clone()));
        }
        let message = format!(
            "scale from zero: {:.0} requests held, the oldest for {} ms; {}",
            o.queue_depth,
            o.oldest_queue_age.as_millis(),
            t.why
        );
        return Some(decision(desired, Reason::FromZero, message, h.clone()));
    }
    if offered || o.starting > 0 {
        return None;
    }
    let since = *h.idle_since.get_or_insert(t.now);
    let idle = t.now - since;
    if idle < after {
        return None;
    }
    h.idle_since = None;
    h.lower_since = None;
    let message = format!(
        "scale to zero: no load offered for {} s (scaleToZeroAfter {} s); the holder holds requests while pods start",
        idle.as_secs(),
        after.as_secs()
    );
    Some(decision(0, Reason::ToZero, message, h.clone()))
}

/// Rule 7: once the decisions watched span a whole delay, the replicas go to the highest need over the
/// last `scaleDownDelay` whenever it fits on fewer — over the last [`FORECAST_WINDOW`] only while
/// the load falls steadily ([`steady_fall`]; with a delay longer than that window). The need
/// counted there is what the load seen
/// needed at each decision, and what the look-ahead asks for now or asked for within the last
/// [`FORECAST_WINDOW`]: replicas asked for a rise that stopped before they were needed are not
/// load to wait a delay out for. Pods still starting go first, and may go then; a ready pod is
/// not removed while one warms. A scale-down does not start a new wait: as the window's older,
/// higher needs age out, the next decision may go lower still.
fn scale_down(t: &Tick, desired: u32, structural: &str, mut h: History) -> ScaleDecision {
    let (current, why, delay) = (t.current, &t.why, t.target.scale_down_delay);
    let since = *h.lower_since.get_or_insert(t.now);
    let forecast = h.needs.iter().filter(|n| n.at + FORECAST_WINDOW >= t.now).map(|n| n.ahead).max();
    // A load that falls steadily is followed a forecast window behind, not a delay: the delay is
    // for a load that wavers, whose dips do not last.
    let falling = delay > FORECAST_WINDOW && steady_fall(&h.needs, t.rate, t.observed.window_seconds);
    let (held, over) = if falling {
        let over = format!(
            "the load fell steadily over the last {} s: the highest need over the last {} s",
            delay.as_secs(),
            FORECAST_WINDOW.as_secs()
        );
        (FORECAST_WINDOW, over)
    } else {
        (delay, format!("the highest need over the last {} s", delay.as_secs()))
    };
    let seen = h.needs.iter().filter(|n| n.at + held >= t.now).map(|n| n.seen).max();
    let peak = desired.max(forecast.unwrap_or(0)).max(seen.unwrap_or(0));
    let watched = |span: Duration| h.watched_since.is_some_and(|at| t.now - at >= span);
    let starting = t.observed.starting;
    if starting > 0 {
        // Pods still starting serve no one yet: those the need no longer covers go (a
        // ReplicaSet removes pods that are not ready first) once the window has watched a
        // forecast window — never a probe's pod, which is there to be judged, and never during a
        // rollout, which the Deployment would spread over ready pods of the old ReplicaSet.
        let ready = current.saturating_sub(starting);
        let keep = peak.max(ready);
        let rolling = t.observed.rolling_out;
        if keep < current && h.probe.is_none() && !rolling && watched(FORECAST_WINDOW) {
            let message = format!(
                "scale down: {} of {starting} pods still starting are no longer needed: {over} is {peak} (the \
                 look-ahead's over the last {} s){}; {why}{structural}",
                current - keep,
                FORECAST_WINDOW.as_secs(),
                if keep > peak { format!(", and the {ready} ready stay while one warms") } else { String::new() }
            );
            return decision(keep, Reason::ScaleDown, message, h);
        }
        let message = format!(
            "holding {current}: need fell to {desired}, but {starting} pods are starting and a ready pod is not \
             removed while one warms; {why}"
        );
        return decision(current, Reason::Warming, message, h);
    }
    // Until the window has watched a whole delay (the operator restarted, or the delay was
    // raised), it may not hold the need that came before: the delay is waited out first.
    if !watched(delay) {
        let message = format!(
            "holding {current}: need fell to {desired} {} s ago, scale-down waits {} s; {why}{structural}",
            (t.now - since).as_secs(),
            delay.as_secs()
        );
        return decision(current, Reason::Cooling, message, h);
    }
    if peak > current - 1 {
        let message = format!("holding {current}: {over} ({peak}) does not fit on {}", current - 1);
        return decision(current, Reason::Peak, message, h);
    }
    let message = format!("scale down: {over} is {peak}; {why}{structural}");
    decision(peak, Reason::ScaleDown, message, h)
}

#[cfg(test)]
mod tests;
