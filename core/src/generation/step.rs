//! One engine step's shape, and how long a step of that shape takes: the decode of one token for
//! each of `decodes` sequences, `prefill` prompt tokens of others, and the attention over
//! `context` tokens of KV cache in all. Learned online like the batch time (least squares towards
//! the configured costs, plus the 90th percentile of recent residuals), because the step rule and
//! admission promise inter-token times and deadlines from it.

use std::time::Duration;

use tokio::time::Instant;

use crate::estimate::Linear;

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
}

impl StepShape {
    /// Every token the step feeds the model (what `maxBatchTokens` bounds).
    pub fn tokens(&self) -> u32 {
        self.decodes + self.prefill
    }

    fn features(self) -> [f64; 4] {
        [1.0, f64::from(self.decodes), f64::from(self.prefill), self.context as f64]
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
}

impl StepCost {
    /// The time of a step of this shape under exactly these costs.
    pub fn time(&self, shape: StepShape) -> Duration {
        self.fixed
            + self.per_decode * shape.decodes
            + self.per_prefill_token * shape.prefill
            + Duration::from_nanos(self.per_context_token.as_nanos() as u64 * shape.context)
    }
}

#[derive(Debug, Clone)]
pub struct StepEstimator {
    model: Linear,
}

impl StepEstimator {
    pub fn new(cost: StepCost) -> Self {
        let prior =
            [cost.fixed, cost.per_decode, cost.per_prefill_token, cost.per_context_token].map(|d| d.as_nanos() as f64);
        StepEstimator { model: Linear::new(prior) }
    }

    /// Expected time of a step of this shape.
    pub fn estimate(&self, shape: StepShape) -> Duration {
        self.model.estimate(shape.features())
    }

    /// Feeds one measured step, ended at `at`.
    pub fn observe(&mut self, shape: StepShape, took: Duration, at: Instant) {
        self.model.observe(shape.features(), took, at);
    }

    /// The estimator as it started: the configured costs or those the engine timed at load, which
    /// admission's probes are judged by ([`crate::evidence`], rule 3).
    pub fn prior(&self) -> StepEstimator {
        StepEstimator { model: self.model.prior() }
    }

    /// The most prefill tokens, up to `limit`, that a step of shape `base` can add and still be
    /// expected to take at most `cap` (the estimate grows with prefill tokens, so a binary search
    /// finds it); each prefill token also adds at least one token of context.
    pub fn prefill_within(&self, base: StepShape, cap: Duration, limit: u32) -> u32 {
        let fits = |n: u32| {
            self.estimate(StepShape { prefill: base.prefill + n, context: base.context + u64::from(n), ..base }) <= cap
        };
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
        StepCost { fixed: 10 * MS, per_decode: MS, per_prefill_token: 100 * US, per_context_token: Duration::ZERO }
    }

    #[test]
    fn a_step_costs_its_fixed_time_its_decodes_and_its_prefill() {
        let e = StepEstimator::new(cost());
        let shape = StepShape { decodes: 4, prefill: 100, context: 900 };
        assert_eq!(e.estimate(shape), 24 * MS);
        assert_eq!(cost().time(shape), 24 * MS);
    }

    #[test]
    fn prefill_is_cut_to_what_the_cap_allows() {
        let e = StepEstimator::new(cost());
        let base = StepShape { decodes: 4, prefill: 0, context: 400 };
        // 14 ms for the decodes; 6 ms more is 60 prefill tokens.
        assert_eq!(e.prefill_within(base, 20 * MS, 2048), 60);
        assert_eq!(e.prefill_within(base, 20 * MS, 30), 30);
        assert_eq!(e.prefill_within(base, 13 * MS, 2048), 0, "the decodes alone exceed the cap");
    }

    #[test]
    fn learns_the_cost_of_context() {
        let truth = |s: StepShape| {
            5 * MS + 200 * US * s.decodes + 50 * US * s.prefill + Duration::from_nanos(2_000 * s.context)
        };
        let mut e = StepEstimator::new(cost());
        for i in 0..64u32 {
            let s =
                StepShape { decodes: 1 + i % 17, prefill: (i * 37) % 300, context: u64::from(100 + (i * 311) % 5000) };
            e.observe(s, truth(s), Instant::now());
        }
        let s = StepShape { decodes: 30, prefill: 50, context: 8000 };
        let (want, got) = (truth(s).as_secs_f64(), e.estimate(s).as_secs_f64());
        assert!((got - want).abs() / want < 0.05, "estimated {got}, truly {want}");
    }
}
