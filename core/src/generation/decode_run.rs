//! A run of decode-only steps in closed form: between two events (a sequence ends, one starts),
//! every step decodes the same sequences, each one token further into its context, so step k's
//! shape is the first one's with k·D more context tokens and attended slots (D decodes). The
//! step estimate is the lesser of two integer lines over the shape ([`crate::estimate::Lines`]),
//! so step k takes `round(min(P₁ + Q₁·k, P₂ + Q₂·k))` — and a run of a thousand steps is added up,
//! searched for its first step over a target, or cut at a deadline in a few dozen operations,
//! to exactly the nanosecond that adding its steps one by one gives.

use super::step::{StepEstimator, StepShape};
use crate::estimate::{fs_to_ns, FS_PER_NS};

/// Steps `0..` of a run, from the shape of its first step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DecodeRun {
    /// Each line's value at step 0 and its growth per step, femtoseconds.
    lines: [(i128, i128); 2],
    /// How many of `lines` there are (the recent fit is not always there).
    count: usize,
}

impl DecodeRun {
    /// The run whose first step has shape `first`, `decodes` of its sequences decoding.
    pub(crate) fn new(estimator: &StepEstimator, first: StepShape, decodes: u32) -> DecodeRun {
        let lines = estimator.lines();
        let x = first.units();
        let line = |l: &crate::estimate::Line<5>| {
            let growth = i128::from(decodes) * (l.per[3] + l.per[4]);
            debug_assert!(growth >= 0, "costs are never negative");
            (l.at(x), growth)
        };
        let long = line(&lines.long);
        match &lines.recent {
            Some(recent) => DecodeRun { lines: [long, line(recent)], count: 2 },
            None => DecodeRun { lines: [long, long], count: 1 },
        }
    }

    /// Step `k`'s estimate, nanoseconds (what [`StepEstimator::estimate`] says of its shape).
    pub(crate) fn step(&self, k: u64) -> u64 {
        let k = i128::from(k);
        fs_to_ns(self.lines[..self.count].iter().map(|(p, q)| p + q * k).min().expect("a line"))
    }

    /// The first `n` steps' estimates added up, nanoseconds.
    pub(crate) fn sum(&self, n: u64) -> u64 {
        self.pieces(n).map(|((p, q), from, to)| line_sum(p, q, from, to)).sum::<i128>() as u64
    }

    /// The first of the first `n` steps whose estimate exceeds `limit_ns` (steps never get
    /// shorter along a run).
    pub(crate) fn first_over(&self, n: u64, limit_ns: u64) -> Option<u64> {
        if n == 0 || self.step(n - 1) <= limit_ns {
            return None;
        }
        let (mut lo, mut hi) = (0, n - 1); // step(hi) > limit
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.step(mid) > limit_ns {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Some(lo)
    }

    /// How many of the first `n` steps end within `budget_ns` of the run's start.
    pub(crate) fn within(&self, n: u64, budget_ns: u64) -> u64 {
        if self.sum(n) <= budget_ns {
            return n;
        }
        let (mut lo, mut hi) = (0, n); // sum(lo) <= budget < sum(hi)
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.sum(mid) <= budget_ns {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// `0..n` cut where the lesser line changes: at most two pieces, each with its line.
    fn pieces(&self, n: u64) -> impl Iterator<Item = ((i128, i128), u64, u64)> {
        let n128 = i128::from(n);
        let [a, b] = self.lines;
        let (first, second, cut) = if self.count == 1 || a.1 == b.1 {
            let lesser = if a.0 <= b.0 { a } else { b };
            (lesser, lesser, n128)
        } else {
            // The line that grows faster is the lesser up to where it crosses the other.
            let (fast, slow) = if a.1 > b.1 { (a, b) } else { (b, a) };
            // Largest k with fast(k) <= slow(k), plus one.
            let cut = (slow.0 - fast.0).div_euclid(fast.1 - slow.1) + 1;
            (fast, slow, cut.clamp(0, n128))
        };
        let cut = cut as u64;
        [(first, 0, cut), (second, cut, n)].into_iter().filter(|(_, from, to)| from < to)
    }
}

/// `Σ_{k=from}^{to-1} round_ns(p + q·k)`, each term as [`fs_to_ns`] rounds it (never negative).
fn line_sum(p: i128, q: i128, from: u64, to: u64) -> i128 {
    let half = FS_PER_NS / 2;
    // Terms are floor((p + half + q·k) / FS_PER_NS), clamped at 0: the clamped ones are a prefix.
    let b = p + half;
    let start = i128::from(from);
    let first_positive = if b + q * start >= 0 {
        start
    } else if q == 0 {
        return 0;
    } else {
        (-b + q - 1).div_euclid(q)
    };
    let to = i128::from(to);
    if first_positive >= to {
        return 0;
    }
    if q % FS_PER_NS == 0 {
        // Whole nanoseconds a step more (costs that were never refitted): an arithmetic series.
        let (n, first) = (to - first_positive, (b + q * first_positive).div_euclid(FS_PER_NS));
        return n * first + q / FS_PER_NS * n * (n - 1) / 2;
    }
    floor_sum(to - first_positive, FS_PER_NS, q, b + q * first_positive)
}

/// `Σ_{i=0}^{n-1} floor((a·i + b) / m)` for a, b ≥ 0 and m > 0, in O(log m) steps — the
/// Euclid-like reduction of competitive programming's `floor_sum`. Written here because it is
/// a dozen lines and no maintained crate offers it alone.
fn floor_sum(mut n: i128, mut m: i128, mut a: i128, mut b: i128) -> i128 {
    debug_assert!(n >= 0 && m > 0 && a >= 0 && b >= 0);
    let mut sum = 0;
    loop {
        if a >= m {
            sum += n * (n - 1) / 2 * (a / m);
            a %= m;
        }
        if b >= m {
            sum += n * (b / m);
            b %= m;
        }
        let top = a * n + b;
        if top < m {
            return sum;
        }
        n = top / m;
        b = top % m;
        std::mem::swap(&mut m, &mut a);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;
    use std::time::Instant;

    use super::*;
    use crate::generation::step::StepCost;

    #[test]
    fn floor_sum_adds_what_a_loop_adds() {
        for (n, m, a, b) in
            [(0, 7, 3, 2), (1, 7, 3, 2), (10, 7, 3, 2), (1000, 1_000_000, 123_456_789, 999_999), (37, 5, 0, 4)]
        {
            let by_loop: i128 = (0..n).map(|i| (a * i + b) / m).sum();
            assert_eq!(floor_sum(n, m, a, b), by_loop, "n {n} m {m} a {a} b {b}");
        }
    }

    fn decodes(d: u32, context: u64) -> StepShape {
        StepShape { decodes: d, prefill: 0, context, attended: context }
    }

    proptest! {
        /// A run's sum, its first step over a limit and its cut at a budget are what the
        /// estimator says step by step, with and without a recent fit, whichever line is lower.
        #[test]
        fn a_run_in_closed_form_is_its_steps_one_by_one(
            fixed in 0u64..20_000_000, per_decode in 0u64..100_000, per_context in 0u64..50,
            per_slot in 0u64..30, d in 1u32..300, context in 0u64..1_000_000, n in 1u64..400,
            samples in prop::collection::vec((1u32..300, 0u64..2_000_000, 1u64..80_000_000), 0..12),
        ) {
            let cost = StepCost {
                fixed: Duration::from_nanos(fixed),
                per_decode: Duration::from_nanos(per_decode),
                per_prefill_token: Duration::from_micros(30),
                per_context_token: Duration::from_nanos(per_context),
                per_attended_slot: Duration::from_nanos(per_slot),
            };
            let mut e = StepEstimator::new(cost);
            let t0 = Instant::now();
            for (i, (sd, sc, took)) in samples.into_iter().enumerate() {
                // Spread over more than the recent span, so that both fits are there.
                e.observe(decodes(sd, sc), Duration::from_nanos(took), t0 + Duration::from_millis(150 * i as u64));
            }
            let first = decodes(d, context);
            let run = DecodeRun::new(&e, first, d);
            let steps: Vec<u64> =
                (0..n).map(|k| e.estimate(decodes(d, context + k * u64::from(d))).as_nanos() as u64).collect();
            for (k, step) in steps.iter().enumerate() {
                prop_assert_eq!(run.step(k as u64), *step, "step {}", k);
            }
            let mut total = 0;
            for m in 0..=n {
                prop_assert_eq!(run.sum(m), total, "the first {} steps", m);
                total += steps.get(m as usize).copied().unwrap_or(0);
            }
            let limit = steps[(n / 2) as usize];
            prop_assert_eq!(run.first_over(n, limit), steps.iter().position(|s| *s > limit).map(|k| k as u64));
            let budget = run.sum(n) / 3 + 1;
            let mut within = 0;
            let mut t = 0;
            for s in &steps {
                t += s;
                within += u64::from(t <= budget);
            }
            prop_assert_eq!(run.within(n, budget), within);
        }
    }
}
