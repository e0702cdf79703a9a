//! How many requests a second one generation pod serves with its three promises kept: arithmetic
//! on the step cost the sidecar learns, the shape of the requests and the service's targets and
//! limits: the figure to size a generation service by, in requests and in tokens a second.
//!
//! At a steady `rate`, a request costs its prefill (its prompt's tokens, their context and the
//! query-key pairs of causal attention, `P(P+1)/2` however the prompt is cut into chunks) and one
//! decode in each of its `G − 1` decode steps (its first token comes with its prefill), reading a
//! context of `P + G/2` tokens on average. With `W` that work in seconds, each step also pays the
//! fixed cost, and a step of length `T` sees `rate × T` new prompts and `rate × (G − 1) × T`
//! decoding sequences (Little's law), so `T = fixed + rate × W × T`, that is
//! `T = fixed / (1 − rate × W)`: steps stretch as the load grows and the pod saturates at
//! `rate × W = 1`.
//!
//! Promises are kept in the tail, not on average: for 99 % of requests ([`TAIL`]). The sequences
//! decoding in a step and the prompts that arrived during the last one are Poisson-like counts,
//! read at their 99th percentile (mean plus [`Z`] standard deviations); waits are read off the
//! queues they are:
//! - **seats**: a sequence holds one from its start to its end, and there are as many as the
//!   fewest of `maxSequences`, the sequences the KV cache holds at their largest context (less
//!   the watermark: the scheduler starts a sequence on its prompt's blocks and preempts the one
//!   that outgrows the cache), and the decodes that fit a step cut to the inter-token target
//!   (past them a prompt's prefill gets no room). A newcomer waits for one as in an M/M/c queue
//!   (Erlang's C formula), which names the bound when it is this wait that breaks a promise;
//! - **prefill**: steps beside decodes are cut to the inter-token target less the reserve, the
//!   prefill taking what the decodes leave and the token budget allows, so once prompts queue
//!   they drain at that share of each step, one after another (an M/D/1 queue, its tail from the
//!   Cramér–Lundberg exponent);
//! - the first token comes after the seat wait, the step under way, the prefill queue and the
//!   prompt's own prefill, within the first-token deadline less the margin; the whole answer
//!   `G − 1` steps later, within the completion deadline; and the decodes of a step, at their
//!   99th percentile, fit `maxBatchTokens`.
//!
//! Each of these only gets harder as the rate grows, so the largest rate that keeps them all is
//! found by bisection, and the first to break names what bounds the pod. The prompts are taken
//! as one length (the mean): prompts of many lengths queue longer than M/D/1 says.

use std::time::Duration;

pub mod upstream;

use super::kv::BlockPool;
use super::scheduler::Policy;
use super::step::StepCost;

/// Standard deviations above the mean at which the load is read: a normal's 99th percentile.
const Z: f64 = 2.33;
/// The share of requests a promise may be broken for: what "in the tail" means here.
pub const TAIL: f64 = 0.01;

/// The requests, as the counters measure them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RequestShape {
    /// Mean prompt tokens.
    pub prompt: f64,
    /// Mean generated tokens.
    pub output: f64,
}

/// The service's promises (the InferenceService's generation targets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Targets {
    pub ttft: Duration,
    pub itl: Duration,
    pub timeout: Duration,
    /// What admission keeps free before each deadline and out of each step cut to the
    /// inter-token target (the deadline margin's floor).
    pub margin: Duration,
}

/// The pod's limits (the generation knobs and its KV cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub blocks: u32,
    pub block_size: u32,
    pub watermark: u32,
    pub max_sequences: u32,
    pub max_batch_tokens: u32,
}

impl Limits {
    /// A pod's limits as its scheduler holds them.
    pub fn of(policy: &Policy, pool: &BlockPool) -> Limits {
        Limits {
            blocks: pool.total(),
            block_size: pool.block_size(),
            watermark: policy.watermark,
            max_sequences: policy.max_sequences,
            max_batch_tokens: policy.max_batch_tokens,
        }
    }
}

/// How many requests the measured shape follows: the plain mean of the first ones, then
/// an exponentially weighted mean over about this many, so that the capacity follows the traffic
/// a pod serves without one odd request moving it.
const RECENT_REQUESTS: u32 = 100;

/// The shape a pod assumes until its requests show their own: a chat turn of a few hundred
/// prompt tokens whose answer runs to the sidecar's default cap for a chat completion that names
/// no `max_tokens` (256). With it a fresh pod exports a capacity from the step costs it took at
/// load before its first request, so that the operator sizes a new service by the pods' own
/// arithmetic rather than by the request-level fallback; an answer is no longer than its cap, so
/// the prior errs towards more pods.
pub const PRIOR_SHAPE: RequestShape = RequestShape { prompt: 256.0, output: 256.0 };

/// The mean prompt of the requests a pod was asked to serve lately, and the mean output of those
/// it finished lately ([`RECENT_REQUESTS`] of each). A prompt's length is known when the request
/// arrives, so a shift to longer prompts lowers the capacity a pod exports at once, not a whole
/// answer later; how long an answer runs is known only at its end (`max_tokens` is a bound that
/// most answers stop short of). Each half is [`PRIOR_SHAPE`]'s until a request shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RecentShape {
    prompts: u32,
    outputs: u32,
    mean: RequestShape,
}

impl RecentShape {
    /// A request arrived (whether admitted or not: it is what the pod is asked for).
    pub fn arrived(&mut self, prompt: u32) {
        follow(&mut self.mean.prompt, &mut self.prompts, prompt);
    }

    /// A request finished after `output` generated tokens.
    pub fn finished(&mut self, output: u32) {
        follow(&mut self.mean.output, &mut self.outputs, output);
    }

    /// Whether a request has finished (the output is measured, not the prior's).
    pub fn has_finished(&self) -> bool {
        self.outputs > 0
    }

    /// The recent shape, each half [`PRIOR_SHAPE`]'s until a request has arrived (the prompt) or
    /// finished (the output).
    pub fn shape(&self) -> RequestShape {
        RequestShape {
            prompt: if self.prompts > 0 { self.mean.prompt } else { PRIOR_SHAPE.prompt },
            output: if self.outputs > 0 { self.mean.output } else { PRIOR_SHAPE.output },
        }
    }
}

/// Moves `mean` of `count` values towards `value`: the plain mean of the first
/// [`RECENT_REQUESTS`], then an exponentially weighted one.
fn follow(mean: &mut f64, count: &mut u32, value: u32) {
    *count = count.saturating_add(1);
    let weight = 1.0 / f64::from((*count).min(RECENT_REQUESTS));
    *mean += weight * (f64::from(value) - *mean);
}

/// What bounds a pod's rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Steps would outgrow the inter-token target.
    InterToken,
    /// First tokens would come too late.
    FirstToken,
    /// Answers would end too late.
    Completion,
    /// `maxSequences`.
    Sequences,
    /// The KV cache.
    Cache,
    /// `maxBatchTokens`.
    BatchTokens,
    /// The engine itself: no step is short enough for the targets even unloaded.
    Engine,
}

impl Bound {
    pub fn as_str(self) -> &'static str {
        match self {
            Bound::InterToken => "inter-token target",
            Bound::FirstToken => "first-token deadline",
            Bound::Completion => "completion deadline",
            Bound::Sequences => "maxSequences",
            Bound::Cache => "KV cache",
            Bound::BatchTokens => "maxBatchTokens",
            Bound::Engine => "step cost",
        }
    }
}

/// One pod's capacity, and the steady state it runs in there.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    pub requests_per_second: f64,
    /// Generated tokens a second.
    pub tokens_per_second: f64,
    /// Mean sequences decoding in a step.
    pub running: f64,
    /// Mean step time.
    pub step: Duration,
    pub bound: Bound,
}

impl Capacity {
    /// Nothing served, for want of `bound`.
    fn none(bound: Bound) -> Capacity {
        Capacity { requests_per_second: 0.0, tokens_per_second: 0.0, running: 0.0, step: Duration::ZERO, bound }
    }
}

/// The largest rate below `hi` that `keeps`, by bisection (the promises only get harder as the
/// rate grows): the last rate kept, and the first broken.
fn largest(keeps: impl Fn(f64) -> bool, mut hi: f64) -> (f64, f64) {
    let mut lo = 0.0;
    for _ in 0..64 {
        let mid = (lo + hi) / 2.0;
        if keeps(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    (lo, hi)
}

/// The steady state at one rate, with the load read at its 99th percentile.
#[derive(Debug, Clone, Copy)]
struct Point {
    rate: f64,
    /// Mean step time.
    step: f64,
    /// Sequences decoding in a step: the mean, and at the high load.
    running: f64,
    running_high: f64,
    /// Prompts that arrive during a step, at the high load.
    arrivals_high: f64,
}

/// Seconds of engine time of one request, split as the step rule spends them.
#[derive(Debug, Clone, Copy)]
struct Work {
    fixed: f64,
    /// One decode at the mean context.
    decode: f64,
    /// A whole prompt's prefill.
    prefill: f64,
    /// Decode steps of one request.
    decodes: f64,
}

impl Work {
    fn new(cost: &StepCost, shape: &RequestShape) -> Work {
        let s = |d: Duration| d.as_secs_f64();
        let (p, g) = (shape.prompt.max(1.0), shape.output.max(1.0));
        let context = s(cost.per_context_token) + s(cost.per_attended_slot);
        Work {
            fixed: s(cost.fixed),
            decode: s(cost.per_decode) + context * (p + g / 2.0),
            prefill: (s(cost.per_prefill_token) + s(cost.per_context_token)) * p
                + s(cost.per_attended_slot) * p * (p + 1.0) / 2.0,
            decodes: g - 1.0,
        }
    }

    fn per_request(&self) -> f64 {
        self.decodes * self.decode + self.prefill
    }

    /// The steady state at `rate` requests a second; `None` past saturation.
    fn at(&self, rate: f64) -> Option<Point> {
        let load = rate * self.per_request();
        if load >= 1.0 {
            return None;
        }
        let step = self.fixed / (1.0 - load);
        let running = rate * self.decodes * step;
        let arrivals = rate * step;
        let high = |mean: f64| mean + Z * mean.sqrt();
        Some(Point { rate, step, running, running_high: high(running), arrivals_high: high(arrivals) })
    }
}

/// The p99 wait of a prompt for the prefill of those ahead of it: prompts arrive at `rate` and
/// each holds the prefill for `service` seconds, one after another (an M/D/1 queue). Its tail is
/// `P(wait > t) ≈ ρ·e^(−θt)`, θ the positive root of `rate·(e^(θ·service) − 1) = θ` (the
/// Cramér–Lundberg exponent), so the wait that 1 % exceed is `ln(100ρ)/θ`; `None` when the
/// prefill is saturated.
fn prefill_wait(rate: f64, service: f64) -> Option<f64> {
    let rho = rate * service;
    if rho >= 1.0 {
        return None;
    }
    if rho <= TAIL {
        return Some(0.0);
    }
    let excess = |theta: f64| rate * (theta * service).exp_m1() - theta;
    let mut hi = 1.0 / service;
    while excess(hi) < 0.0 {
        hi *= 2.0;
    }
    let mut lo = 0.0;
    for _ in 0..64 {
        let mid = (lo + hi) / 2.0;
        if excess(mid) < 0.0 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some((rho / TAIL).ln() / hi)
}

/// The p99 wait for one of `servers` seats, each held `hold` seconds, at `rate` arrivals a
/// second (an M/M/c queue: Erlang's C formula gives the chance to wait at all, and a wait
/// beyond `t` has the chance `C·e^(−(c − a)·t/hold)`); `None` when the seats are saturated.
fn seat_wait(rate: f64, hold: f64, servers: f64) -> Option<f64> {
    let offered = rate * hold;
    let c = servers.floor();
    if offered >= c {
        return None;
    }
    // Erlang B by its recursion, then C from B.
    let mut b = 1.0;
    for k in 1..=c as u64 {
        b = offered * b / (k as f64 + offered * b);
    }
    let wait = c * b / (c - offered * (1.0 - b));
    Some(if wait <= TAIL { 0.0 } else { hold / (c - offered) * (wait / TAIL).ln() })
}

/// How many sequences can hold a seat at once, and what bounds them: `maxSequences`, the KV cache
/// (each at its largest footprint, half a block wasted on average), or the decodes a step cut to
/// the inter-token target `cap` holds (past them, a prompt waits, its prefill given no room,
/// until a sequence ends).
fn seats(shape: &RequestShape, limits: &Limits, work: &Work, cap: f64) -> (f64, Bound) {
    let block = f64::from(limits.block_size.max(1));
    let footprint = shape.prompt.max(1.0) + shape.output.max(1.0) + block / 2.0;
    let cache = f64::from(limits.blocks.saturating_sub(limits.watermark)) * block / footprint;
    let decodes =
        if work.decodes > 0.0 && work.decode > 0.0 { (cap - work.fixed) / work.decode } else { f64::INFINITY };
    [(f64::from(limits.max_sequences), Bound::Sequences), (cache, Bound::Cache), (decodes.max(0.0), Bound::InterToken)]
        .into_iter()
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .expect("three")
}

/// The first promise or limit that `point` breaks.
fn broken(point: &Point, shape: &RequestShape, targets: &Targets, limits: &Limits, work: &Work) -> Option<Bound> {
    let s = |d: Duration| d.as_secs_f64();
    let margin = s(targets.margin);
    let p = shape.prompt.max(1.0);
    let budget = f64::from(limits.max_batch_tokens);
    // Steps beside decodes are cut to the inter-token target less the reserve; the decodes alone
    // must fit, at the high load.
    let cap = if work.decodes > 0.0 { s(targets.itl) - margin } else { f64::INFINITY };
    let decoding = work.fixed + point.running_high * work.decode;
    if point.running_high + 1.0 > budget {
        return Some(Bound::BatchTokens);
    }
    // Once prompts queue, each step gives the prefill what the decodes leave under the cap and
    // of the token budget: it drains at `throughput` seconds of prefill a second.
    let per_token = work.prefill / p;
    let room = (cap - work.fixed - point.running * work.decode).min((budget - point.running) * per_token);
    if room <= 0.0 {
        return Some(Bound::InterToken);
    }
    let busy = work.fixed + point.running * work.decode + room;
    let throughput = room / busy;
    let prefill = work.prefill / throughput;
    // A prompt's own prefill: its share of busy steps, and at least the one step it rides in.
    let service = prefill.max(decoding + work.prefill.min(room));
    let Some(queued) = prefill_wait(point.rate, prefill) else {
        return Some(Bound::FirstToken);
    };
    // A seat, and the blocks of the sequence's whole context (half a block wasted on average),
    // are held from its start to its end: the scheduler starts a sequence on the blocks its
    // prompt needs then, so the cache overcommits, and one that outgrows it is preempted and
    // recomputed; a seat of the cache is counted at a sequence's largest footprint.
    let hold = service + work.decodes * point.step;
    let (servers, seat_bound) = seats(shape, limits, work, cap);
    let Some(seated) = seat_wait(point.rate, hold, servers) else {
        return Some(seat_bound);
    };
    // The step under way when it arrives: the decodes and the prompts that came during the last.
    let current = (decoding + point.arrivals_high * work.prefill).min(cap);
    let first = seated + current + queued + service;
    let end = first + work.decodes * current;
    if first + margin > s(targets.ttft) {
        Some(if seated > queued { seat_bound } else { Bound::FirstToken })
    } else if end + margin > s(targets.timeout) {
        Some(Bound::Completion)
    } else {
        None
    }
}

/// The most requests a second one pod serves with every promise kept (see the module
/// documentation), with the steady state it runs in at that rate and what bounds it.
pub fn capacity(cost: &StepCost, shape: &RequestShape, targets: &Targets, limits: &Limits) -> Capacity {
    let work = Work::new(cost, shape);
    let keeps = |rate: f64| work.at(rate).filter(|p| broken(p, shape, targets, limits, &work).is_none());
    if keeps(f64::MIN_POSITIVE).is_none() {
        let bound = work.at(0.0).and_then(|p| broken(&p, shape, targets, limits, &work)).unwrap_or(Bound::Engine);
        return Capacity::none(bound);
    }
    let (lo, hi) = largest(|rate| keeps(rate).is_some(), 1.0 / work.per_request().max(1e-12));
    let point = work.at(lo).expect("kept");
    let bound = work.at(hi).and_then(|p| broken(&p, shape, targets, limits, &work)).unwrap_or(Bound::Engine);
    Capacity {
        requests_per_second: lo,
        tokens_per_second: lo * shape.output.max(1.0),
        running: point.running,
        step: Duration::from_secs_f64(point.step),
        bound,
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::generation::trial::trial;

    const MS: Duration = Duration::from_millis(1);
    const US: Duration = Duration::from_micros(1);

    /// `examples/generation.yaml`: sim-llm at 10 ms a step, 200 µs a decoding sequence and
    /// 50 µs a prompt token; 64 sequences, 2048 tokens a step, 4096 blocks of 16.
    fn example() -> (StepCost, Targets, Limits) {
        let cost = StepCost { fixed: 10 * MS, per_decode: 200 * US, per_prefill_token: 50 * US, ..StepCost::default() };
        let targets = Targets { ttft: 1000 * MS, itl: 100 * MS, timeout: 30_000 * MS, margin: MS };
        let limits = Limits { blocks: 4096, block_size: 16, watermark: 40, max_sequences: 64, max_batch_tokens: 2048 };
        (cost, targets, limits)
    }

    /// The share of requests arriving after the first 15 s that kept all three promises, over
    /// 90 s of Poisson arrivals at `rate`, replayed through the ledger with steps that take exactly
    /// `cost`.
    fn kept(cost: StepCost, shape: RequestShape, targets: Targets, limits: Limits, rate: f64) -> f64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (mut at, mut times) = (0.0, Vec::new());
        while at < 90.0 {
            at += -(1.0 - rng.random::<f64>()).ln() / rate;
            times.push(Duration::from_secs_f64(at));
        }
        let shape = (shape.prompt as u32, shape.output as u32);
        trial(cost, shape, &targets, &limits, &times, Duration::from_secs(15)).kept
    }

    /// At the rate the function returns, 99 % of requests keep all three promises; at 1.25 times
    /// that rate they do not: the figure is the pod's capacity, not a safe guess below it.
    fn is_tight(cost: StepCost, shape: RequestShape, targets: Targets, limits: Limits, bound: Bound) {
        let c = capacity(&cost, &shape, &targets, &limits);
        assert_eq!(c.bound, bound, "{c:?}");
        let at = kept(cost, shape, targets, limits, c.requests_per_second);
        let over = kept(cost, shape, targets, limits, 1.25 * c.requests_per_second);
        assert!(at >= 0.99, "{c:?}: {:.1} % kept at capacity", 100.0 * at);
        assert!(over < 0.99, "{c:?}: {:.1} % kept at 1.25 x capacity", 100.0 * over);
    }

    #[test]
    fn the_example_service_is_bounded_by_its_seats() {
        let (cost, targets, limits) = example();
        is_tight(cost, RequestShape { prompt: 100.0, output: 256.0 }, targets, limits, Bound::Sequences);
    }

    #[test]
    fn many_seats_leave_the_inter_token_target_to_bound_it() {
        let (mut cost, mut targets, mut limits) = example();
        // A millisecond a decoding sequence: a few dozen fill a step (and the test stays quick).
        cost.per_decode = MS;
        limits.max_sequences = 1024;
        limits.blocks = 65_536;
        targets.itl = 40 * MS;
        targets.ttft = 10_000 * MS;
        is_tight(cost, RequestShape { prompt: 100.0, output: 128.0 }, targets, limits, Bound::InterToken);
    }

    #[test]
    fn a_small_cache_bounds_it() {
        let (cost, targets, mut limits) = example();
        limits.blocks = 600;
        limits.watermark = 6;
        is_tight(cost, RequestShape { prompt: 200.0, output: 200.0 }, targets, limits, Bound::Cache);
    }

    #[test]
    fn long_prompts_with_attention_are_bounded_by_their_first_token() {
        // 2000-token prompts at 20 ns an attended slot: a prefill takes 140 ms of engine time,
        // 40 of them attention, and prompts that arrive close together wait for each other.
        let (mut cost, targets, mut limits) = example();
        cost.per_attended_slot = Duration::from_nanos(20);
        limits.max_sequences = 256;
        limits.blocks = 65_536;
        is_tight(cost, RequestShape { prompt: 2000.0, output: 32.0 }, targets, limits, Bound::FirstToken);
    }

    #[test]
    fn capacity_falls_as_prompts_grow() {
        let (cost, targets, limits) = example();
        let rate = |prompt| capacity(&cost, &RequestShape { prompt, output: 256.0 }, &targets, &limits);
        let (short, long) = (rate(100.0), rate(1500.0));
        assert!(long.requests_per_second < short.requests_per_second, "{short:?} {long:?}");
        assert_eq!(long.tokens_per_second, 256.0 * long.requests_per_second);
    }

    #[test]
    fn the_shape_is_the_mean_of_the_first_requests_then_follows_the_recent_ones() {
        let mut recent = RecentShape::default();
        assert_eq!(recent.shape(), RequestShape { prompt: 256.0, output: 256.0 }, "nothing seen: the prior");
        recent.arrived(100);
        assert_eq!(recent.shape(), RequestShape { prompt: 100.0, output: 256.0 }, "nothing finished: its output");
        recent.arrived(300);
        for output in [10, 30] {
            recent.finished(output);
        }
        assert_eq!(recent.shape(), RequestShape { prompt: 200.0, output: 20.0 });
        // Traffic changes: 1000 requests of 50 prompt tokens and 500 output tokens.
        for _ in 0..1000 {
            recent.arrived(50);
            recent.finished(500);
        }
        let now = recent.shape();
        assert!((now.prompt - 50.0).abs() < 0.01 && (now.output - 500.0).abs() < 0.01, "{now:?}");
        // Prompts grow to 2000 tokens: the shape follows as they arrive, before any finishes.
        for _ in 0..1000 {
            recent.arrived(2000);
        }
        let now = recent.shape();
        assert!((now.prompt - 2000.0).abs() < 1.0 && (now.output - 500.0).abs() < 0.01, "{now:?}");
    }

    #[test]
    fn an_engine_too_slow_for_the_target_serves_nothing() {
        let (mut cost, targets, limits) = example();
        cost.fixed = 150 * MS;
        let c = capacity(&cost, &RequestShape { prompt: 100.0, output: 256.0 }, &targets, &limits);
        assert_eq!((c.requests_per_second, c.bound), (0.0, Bound::InterToken));
    }
}
