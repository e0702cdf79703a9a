//! One engine step's shape, and how long a step of that shape takes: the decode of one token for
//! each of `decodes` sequences, `prefill` prompt tokens of others, the `context` tokens of KV
//! cache they read, and the `attended` query-key pairs their attention computes. Learned online
//! like the batch time (least squares towards the configured costs, plus the 90th percentile of
//! recent residuals), because the step rule and admission promise inter-token times and deadlines
//! from it.
//!
//! Attention is its own feature because it is the one cost that is not linear in tokens: a
//! prefill chunk of n tokens after c computed ones attends c + 1, c + 2, …, c + n slots, about
//! n·(c + n/2) in all, so the same 256-token chunk costs far more at position 8 k than at 0. A
//! step cost linear in tokens and context would time a long prompt's late chunks as cheap, let
//! them stall the decodes beside them, and then inflate every estimate by the residuals.

use std::time::Duration;

use std::time::Instant;

use crate::estimate::{Linear, Lines};

/// What a step's time depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepShape {
    /// Sequences that decode one token.
    pub decodes: u32,
    /// Prompt (or recomputed) tokens of the sequences that prefill.
    pub prefill: u32,
    /// Tokens of KV cache the step attends over: for each sequence in it, every token up to and
    /// including its last new one.
    pub context: u64,
    /// Query-key pairs of the step's attention: for each sequence, [`attended`] of its part.
    pub attended: u64,
}

/// The query-key pairs of `len` new tokens after `start` computed ones (causal attention: the
/// token at position p attends p + 1 slots): `len·start + len(len+1)/2`; a decode (`len` 1)
/// attends its whole context.
pub fn attended(start: u32, len: u32) -> u64 {
    let (start, len) = (u64::from(start), u64::from(len));
    len * start + len * (len + 1) / 2
}

impl StepShape {
    /// The shape of one sequence's part alone: `len` tokens after `start` computed ones, a decode
    /// or a prefill chunk.
    pub fn part(start: u32, len: u32, decode: bool) -> StepShape {
        StepShape {
            decodes: u32::from(decode),
            prefill: if decode { 0 } else { len },
            context: u64::from(start) + u64::from(len),
            attended: attended(start, len),
        }
    }

    /// The shape of `self` and `other` in one step.
    pub fn join(self, other: StepShape) -> StepShape {
        StepShape {
            decodes: self.decodes + other.decodes,
            prefill: self.prefill + other.prefill,
            context: self.context + other.context,
            attended: self.attended + other.attended,
        }
    }

    /// Every token the step feeds the model (what `maxBatchTokens` bounds).
    pub fn tokens(&self) -> u32 {
        self.decodes + self.prefill
    }

    fn features(self) -> [f64; 5] {
        [1.0, f64::from(self.decodes), f64::from(self.prefill), self.context as f64, self.attended as f64]
    }

    /// The features as whole numbers, for the estimate's exact lines.
    pub(crate) fn units(self) -> [u64; 5] {
        [1, u64::from(self.decodes), u64::from(self.prefill), self.context, self.attended]
    }
}

/// The configured cost of a step before any is measured (the `sim-llm` engine's flags, or what a
/// real engine measured of itself while it loaded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepCost {
    pub fixed: Duration,
    pub per_decode: Duration,
    pub per_prefill_token: Duration,
    pub per_context_token: Duration,
    pub per_attended_slot: Duration,
}

impl StepCost {
    /// Its terms in the order of [`StepShape`]'s features: fixed, per decode, per prompt token,
    /// per context token, per attended slot.
    pub fn terms(&self) -> [Duration; 5] {
        [self.fixed, self.per_decode, self.per_prefill_token, self.per_context_token, self.per_attended_slot]
    }

    /// The time of a step of this shape under exactly these costs.
    pub fn time(&self, shape: StepShape) -> Duration {
        let per = |cost: Duration, units: u64| Duration::from_nanos((cost.as_nanos() as u64).saturating_mul(units));
        self.fixed
            + self.per_decode * shape.decodes
            + self.per_prefill_token * shape.prefill
            + per(self.per_context_token, shape.context)
            + per(self.per_attended_slot, shape.attended)
    }
}

#[derive(Debug, Clone)]
pub struct StepEstimator {
    model: Linear<5>,
}

impl StepEstimator {
    pub fn new(cost: StepCost) -> Self {
        let prior = cost.terms().map(|d| d.as_nanos() as f64);
        StepEstimator { model: Linear::new(prior) }
    }

    /// Expected time of a step of this shape, in exact integer arithmetic (so that a forecast
    /// adds a run of decode steps in closed form to exactly what it adds step by step:
    /// [`super::decode_run`]).
    pub fn estimate(&self, shape: StepShape) -> Duration {
        self.model.estimate_exact(shape.units())
    }

    /// The estimate's lines, femtoseconds per unit of each of [`StepShape::units`].
    pub(crate) fn lines(&self) -> &Lines<5> {
        self.model.lines()
    }

    /// Feeds one measured step, ended at `at`.
    pub fn observe(&mut self, shape: StepShape, took: Duration, at: Instant) {
        self.model.observe(shape.features(), took, at);
    }

    /// The costs as fitted now (the prior until steps are measured), the fixed cost carrying the
    /// tail correction every estimate adds: what the sidecar exports, and what a pod's capacity is
    /// computed from. Whole nanoseconds, as [`StepCost`] holds them.
    pub fn costs(&self) -> StepCost {
        let [fixed, per_decode, per_prefill_token, per_context_token, per_attended_slot] =
            self.model.fit().map(|ns| Duration::from_nanos(ns.max(0.0).round() as u64));
        let correction = Duration::from_nanos(self.model.correction_ns().max(0.0).round() as u64);
        StepCost { fixed: fixed + correction, per_decode, per_prefill_token, per_context_token, per_attended_slot }
    }

    /// The estimator as it started: the configured costs or those the engine timed at load, which
    /// admission's probes are judged by ([`crate::evidence`], rule 3).
    pub fn prior(&self) -> StepEstimator {
        StepEstimator { model: self.model.prior() }
    }

    /// What a step of this shape is not expected to exceed: the fit plus the largest recent
    /// error rather than its 90th percentile. A step cut to an inter-token target is cut by it,
    /// so that the one step in ten the percentile leaves over its estimate is not a token late.
    pub fn ceiling(&self, shape: StepShape) -> Duration {
        self.model.ceiling_exact(shape.units())
    }

    /// The most prefill tokens, up to `limit`, of a chunk after `start` computed ones that a step
    /// of shape `base` can add and still not be expected to exceed `cap` ([`Self::ceiling`]: it
    /// grows with the chunk, whose costs are never negative, so a binary search finds it).
    pub fn prefill_within(&self, base: StepShape, start: u32, cap: Duration, limit: u32) -> u32 {
        let fits = |n: u32| self.ceiling(base.join(StepShape::part(start, n, false))) <= cap;
        if fits(limit) {
            return limit;
        }
        let (mut lo, mut hi) = (0, limit);
        if !fits(0) {
            return 0;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const US: Duration = Duration::from_micros(1);

    fn cost() -> StepCost {
        StepCost { fixed: 10 * MS, per_decode: MS, per_prefill_token: 100 * US, ..StepCost::default() }
    }

    #[test]
    fn a_step_costs_its_fixed_time_its_decodes_and_its_prefill() {
        let e = StepEstimator::new(cost());
        let shape = StepShape { decodes: 4, prefill: 100, context: 900, attended: 40_000 };
        assert_eq!(e.estimate(shape), 24 * MS);
        assert_eq!(cost().time(shape), 24 * MS);
    }

    #[test]
    fn prefill_is_cut_to_what_the_cap_allows() {
        let e = StepEstimator::new(cost());
        let base = StepShape { decodes: 4, prefill: 0, context: 400, attended: 400 };
        // 14 ms for the decodes; 6 ms more is 60 prefill tokens.
        assert_eq!(e.prefill_within(base, 0, 20 * MS, 2048), 60);
        assert_eq!(e.prefill_within(base, 5000, 20 * MS, 2048), 60, "no attention cost: position is free");
        assert_eq!(e.prefill_within(base, 0, 20 * MS, 30), 30);
        assert_eq!(e.prefill_within(base, 0, 13 * MS, 2048), 0, "the decodes alone exceed the cap");
    }

    #[test]
    fn a_chunk_attends_every_slot_before_each_of_its_tokens() {
        // Counted by brute force: the token at position p attends p + 1 slots.
        for (start, len) in [(0, 1), (0, 7), (5, 1), (100, 37), (8191, 256)] {
            let slots: u64 = (start..start + len).map(|p| u64::from(p) + 1).sum();
            assert_eq!(attended(start, len), slots, "{len} tokens after {start}");
        }
        let decode = StepShape::part(41, 1, true);
        assert_eq!((decode.decodes, decode.prefill, decode.context, decode.attended), (1, 0, 42, 42));
    }

    #[test]
    fn a_chunk_late_in_a_long_prompt_is_cut_shorter() {
        // 10 ns per attended slot: at 8 k tokens in, each new token costs 82 us more than at 0.
        let e = StepEstimator::new(StepCost { per_attended_slot: Duration::from_nanos(10), ..cost() });
        let base = StepShape { decodes: 4, prefill: 0, context: 400, attended: 400 };
        let early = e.prefill_within(base, 0, 20 * MS, 2048);
        let late = e.prefill_within(base, 8192, 20 * MS, 2048);
        // Checked against the arithmetic, not the search: the largest n whose step fits.
        let time = |start, n| e.estimate(base.join(StepShape::part(start, n, false)));
        for (start, n) in [(0, early), (8192, late)] {
            assert!(time(start, n) <= 20 * MS && time(start, n + 1) > 20 * MS, "{n} tokens after {start}");
        }
        // 6 ms left: 100 us a token at the start, 182 us (and rising) 8 k tokens in.
        assert!((59..=60).contains(&early) && (31..=33).contains(&late), "{late} tokens at 8 k, {early} at 0");
    }

    #[test]
    fn learns_the_cost_of_context_and_of_attention() {
        let truth = |s: StepShape| {
            5 * MS
                + 200 * US * s.decodes
                + 50 * US * s.prefill
                + Duration::from_nanos(2_000 * s.context + 30 * s.attended)
        };
        let mut e = StepEstimator::new(cost());
        for i in 0..64u32 {
            let context = u64::from(100 + (i * 311) % 5000);
            let decodes = StepShape { decodes: 1 + i % 17, context, attended: context, ..Default::default() };
            let s = decodes.join(StepShape::part((i * 997) % 6000, (i * 37) % 300, false));
            e.observe(s, truth(s), Instant::now());
        }
        let s = StepShape { decodes: 30, context: 8000, attended: 8000, ..Default::default() }
            .join(StepShape::part(12_000, 200, false));
        let (want, got) = (truth(s).as_secs_f64(), e.estimate(s).as_secs_f64());
        assert!((got - want).abs() / want < 0.05, "estimated {got}, truly {want}");
    }

    /// One sequence decoding alone on a fresh pod busy with its other callers: its steps come a
    /// millisecond late more often as its context grows (the timer, not the engine). That is a
    /// slope of 0.5 ms over 160 context tokens, below what the timer resolves: not learned, so a
    /// step of 500 sequences is not timed at hundreds of milliseconds (it was: 2.7 us a context
    /// token, and a burst of 500 was refused for inter-token time).
    #[test]
    fn a_slope_below_the_timer_grain_over_a_narrow_range_is_not_extrapolated() {
        let cost = StepCost {
            fixed: 10 * MS,
            per_decode: 30 * US,
            per_prefill_token: 20 * US,
            per_context_token: Duration::ZERO,
            per_attended_slot: Duration::ZERO,
        };
        let mut e = StepEstimator::new(cost);
        let t0 = Instant::now();
        for k in 0..150u32 {
            let context = u64::from(10 + k);
            let shape = StepShape { decodes: 1, prefill: 0, context, attended: context };
            // 10.03 ms on a millisecond timer, one more millisecond in a growing share of steps.
            let late = (k * 7919) % 150 < k;
            let took = Duration::from_millis(11 + u64::from(late));
            e.observe(shape, took, t0 + 12 * MS * k);
        }
        let costs = e.costs();
        assert_eq!((costs.per_context_token, costs.per_attended_slot), (Duration::ZERO, Duration::ZERO));
        let burst = StepShape { decodes: 500, prefill: 0, context: 500 * 170, attended: 500 * 170 };
        let step = e.estimate(burst);
        assert!(step < 30 * MS, "500 decodes estimated at {step:?}; they cost 25 ms and the timer's lateness");
    }

    /// 32 streams decoding, their steps measured on a millisecond timer: attention adds 128 us
    /// to a step at most, which the timer rounds away. The configured 20 ns a slot stands (the
    /// samples carry no news of it), so a chunk late in a 16 k prompt is still cut to what it
    /// costs: the step it joins stays within its cap by the engine's own costs.
    #[test]
    fn decode_steps_below_the_timer_grain_keep_the_cost_of_attention() {
        let cost = StepCost {
            fixed: 10 * MS,
            per_decode: 200 * US,
            per_prefill_token: 50 * US,
            per_context_token: Duration::ZERO,
            per_attended_slot: Duration::from_nanos(20),
        };
        let mut e = StepEstimator::new(cost);
        let t0 = Instant::now();
        for k in 0..200u64 {
            let context = 32 * (9 + k);
            let shape = StepShape { decodes: 32, prefill: 0, context, attended: context };
            let took = Duration::from_millis((cost.time(shape).as_nanos() as u64).div_ceil(1_000_000));
            e.observe(shape, took, t0 + 17 * MS * k as u32);
        }
        let base = StepShape { decodes: 32, prefill: 0, context: 32 * 209, attended: 32 * 209 };
        let cap = 48 * MS;
        for start in [0, 4096, 8192, 14_000] {
            let n = e.prefill_within(base, start, cap, 2048);
            let took = cost.time(base.join(StepShape::part(start, n, false)));
            assert!(n > 0 && took <= cap, "{n} tokens after {start} take {took:?}");
        }
    }
}
