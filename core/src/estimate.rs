//! How long a batch will take, as a function of its shape (rows, tokens, and rows × longest row
//! for engines that pad), learned online from what the engine measured.
//!
//! The model is linear in the shape's features, `fixed + perRow·rows + perToken·tokens +
//! perPadded·rows·longest`, fitted by least squares over the recent batches and pulled towards
//! the configured model (ridge regression: the configured model weighs a hundredth of a batch, so
//! it rules until there are measurements, and settles what a window of batches that all have the
//! same shape leaves open). Costs are kept non-negative.
//!
//! On top of the fit sits a tail-aware correction: the 90th percentile of recent residuals
//! (measured minus fitted), not their mean, because admission promises deadlines and a mean
//! estimate would break one promise in two whenever batch times vary. When every recent batch
//! had the same shape, the estimate for that shape is exactly the p90 of their times.

use std::collections::VecDeque;
use std::time::Duration;

/// How many recent batches the fit and the correction remember.
const WINDOW: usize = 64;
/// Which quantile of the residuals is added.
const QUANTILE: f64 = 0.9;
/// How many batches' worth the configured model weighs in the fit: little, so that the
/// measurements rule as soon as there are a few, but enough to settle what they leave open.
const PRIOR_WEIGHT: f64 = 0.01;

/// What a batch's time depends on. Engines without tokens leave `tokens` and `longest` at 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Shape {
    pub rows: u32,
    /// Real tokens of every row together.
    pub tokens: u32,
    /// The longest row in tokens: an engine that pads computes `rows × longest`.
    pub longest: u32,
}

impl Shape {
    pub fn rows(rows: u32) -> Shape {
        Shape { rows, tokens: 0, longest: 0 }
    }

    /// The shape of `self` and `other` in one batch.
    pub fn join(self, other: Shape) -> Shape {
        Shape {
            rows: self.rows + other.rows,
            tokens: self.tokens + other.tokens,
            longest: self.longest.max(other.longest),
        }
    }

    fn features(self) -> [f64; 4] {
        [1.0, f64::from(self.rows), f64::from(self.tokens), f64::from(self.rows) * f64::from(self.longest)]
    }
}

impl std::iter::Sum for Shape {
    fn sum<I: Iterator<Item = Shape>>(iter: I) -> Shape {
        iter.fold(Shape::default(), Shape::join)
    }
}

/// The configured (or calibrated) cost of a batch before anything is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CostModel {
    pub fixed: Duration,
    pub per_row: Duration,
    pub per_token: Duration,
    pub per_padded_token: Duration,
}

impl CostModel {
    fn coefficients(&self) -> [f64; 4] {
        [self.fixed, self.per_row, self.per_token, self.per_padded_token].map(|d| d.as_nanos() as f64)
    }
}

/// A tail-aware linear model of a duration over four features (the first is the constant 1):
/// the fit and its correction, shared by the batch-time [`Estimator`] and the generation step's
/// estimator ([`crate::generation::step::StepEstimator`]).
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    prior: [f64; 4],
    /// The fitted costs, in nanoseconds per unit of each feature.
    fit: [f64; 4],
    window: VecDeque<([f64; 4], f64)>,
    correction_ns: f64,
}

impl Linear {
    pub(crate) fn new(prior: [f64; 4]) -> Self {
        Linear { prior, fit: prior, window: VecDeque::with_capacity(WINDOW), correction_ns: 0.0 }
    }

    pub(crate) fn fitted(&self, x: [f64; 4]) -> f64 {
        self.fit.iter().zip(x).map(|(c, x)| c * x).sum()
    }

    /// The fit plus the correction, in whole nanoseconds.
    pub(crate) fn estimate(&self, x: [f64; 4]) -> Duration {
        Duration::from_nanos((self.fitted(x) + self.correction_ns).max(0.0).round() as u64)
    }

    pub(crate) fn correction_ns(&self) -> f64 {
        self.correction_ns
    }

    pub(crate) fn observe(&mut self, x: [f64; 4], elapsed: Duration) {
        if self.window.len() == WINDOW {
            self.window.pop_front();
        }
        self.window.push_back((x, elapsed.as_nanos() as f64));
        self.fit = self.refit();
        let mut residuals: Vec<f64> = self.window.iter().map(|(x, y)| y - self.fitted(*x)).collect();
        residuals.sort_by(f64::total_cmp);
        let rank = ((residuals.len() as f64 * QUANTILE).ceil() as usize).clamp(1, residuals.len());
        self.correction_ns = residuals[rank - 1];
    }

    /// Ridge least squares towards the prior, with costs kept non-negative: a cost that comes out
    /// negative is pinned at zero and the rest refitted (at most once per feature).
    fn refit(&self) -> [f64; 4] {
        let n = self.window.len() as f64;
        let mut scale = [0.0; 4];
        for (x, _) in &self.window {
            for (acc, x) in scale.iter_mut().zip(x) {
                *acc += x * x / n;
            }
        }
        let mut pinned = [false; 4];
        loop {
            let mut a = [[0.0; 4]; 4];
            let mut b = [0.0; 4];
            for (x, y) in &self.window {
                for i in 0..4 {
                    b[i] += x[i] * y;
                    for j in 0..4 {
                        a[i][j] += x[i] * x[j];
                    }
                }
            }
            for i in 0..4 {
                let lambda = PRIOR_WEIGHT * scale[i].max(1.0);
                a[i][i] += lambda;
                b[i] += lambda * self.prior[i];
            }
            // A pinned cost is zero: its row says so, and its column contributes nothing.
            for i in (0..4).filter(|&i| pinned[i]) {
                for (r, row) in a.iter_mut().enumerate() {
                    row[i] = if r == i { 1.0 } else { 0.0 };
                }
                a[i] = [0.0; 4];
                a[i][i] = 1.0;
                b[i] = 0.0;
            }
            let fit = solve(a, b);
            let negative: Vec<usize> = (0..4).filter(|&i| !pinned[i] && fit[i] < 0.0).collect();
            if negative.is_empty() {
                return fit.map(|c| c.max(0.0));
            }
            for i in negative {
                pinned[i] = true;
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct Estimator {
    model: Linear,
}

impl Estimator {
    /// `fixed + perRow × rows`, for engines whose time does not depend on tokens.
    pub fn new(fixed: Duration, per_row: Duration) -> Self {
        Estimator::with_model(CostModel { fixed, per_row, ..CostModel::default() })
    }

    pub fn with_model(model: CostModel) -> Self {
        Estimator { model: Linear::new(model.coefficients()) }
    }

    /// Expected engine time for a batch of this shape.
    pub fn estimate(&self, shape: Shape) -> Duration {
        self.model.estimate(shape.features())
    }

    /// An upper bound on the estimated time of `batches` batches that hold `rows` rows and
    /// `tokens` tokens in all, none with a row of more than `longest` tokens: a batch's estimate is
    /// its fitted cost (linear, with costs that are never negative) plus the correction, which is
    /// never more than its positive part; rounding adds at most a nanosecond a batch.
    pub fn bound(&self, batches: u64, rows: u64, tokens: u64, longest: u32) -> Duration {
        let features = [batches as f64, rows as f64, tokens as f64, rows as f64 * f64::from(longest)];
        let ns = self.model.fitted(features) + batches as f64 * (self.model.correction_ns().max(0.0) + 1.0);
        Duration::from_nanos(ns.ceil().min(u64::MAX as f64) as u64)
    }

    /// Feeds one measured batch.
    pub fn observe(&mut self, shape: Shape, elapsed: Duration) {
        self.model.observe(shape.features(), elapsed);
    }
}

/// Solves `a · x = b` by Gaussian elimination with partial pivoting (`a` is symmetric positive
/// definite here: the ridge term sees to that).
fn solve(mut a: [[f64; 4]; 4], mut b: [f64; 4]) -> [f64; 4] {
    for col in 0..4 {
        let pivot = (col..4).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs())).expect("rows");
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..4 {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (x, p) in a[row].iter_mut().zip(pivot_row).skip(col) {
                *x -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; 4];
    for row in (0..4).rev() {
        let rest: f64 = (row + 1..4).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - rest) / a[row][row];
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const US: Duration = Duration::from_micros(1);

    fn rows(n: u32) -> Shape {
        Shape::rows(n)
    }

    #[test]
    fn starts_from_the_configured_model() {
        let e = Estimator::new(100 * MS, 2 * MS);
        assert_eq!(e.estimate(rows(1)), 102 * MS);
        assert_eq!(e.estimate(rows(32)), 164 * MS);
    }

    #[test]
    fn exact_measurements_change_nothing() {
        let mut e = Estimator::new(100 * MS, Duration::ZERO);
        e.observe(rows(4), 100 * MS);
        assert_eq!(e.estimate(rows(4)), 100 * MS);
        assert_eq!(e.estimate(rows(1)), 100 * MS);
    }

    #[test]
    fn learns_the_tail_not_the_mean() {
        let mut e = Estimator::new(100 * MS, Duration::ZERO);
        // Nine batches at 100 ms and one at 150 ms: the p90 residual is the slow one's 50 ms
        // only once it is more than a tenth of the window; here it is exactly a tenth.
        for _ in 0..9 {
            e.observe(rows(1), 100 * MS);
        }
        e.observe(rows(1), 150 * MS);
        assert_eq!(e.estimate(rows(1)), 100 * MS);
        e.observe(rows(1), 150 * MS);
        assert_eq!(e.estimate(rows(1)), 150 * MS);
    }

    #[test]
    fn learns_a_faster_engine_and_forgets_old_batches() {
        let mut e = Estimator::new(100 * MS, Duration::ZERO);
        for _ in 0..WINDOW {
            e.observe(rows(1), 300 * MS);
        }
        assert_eq!(e.estimate(rows(1)), 300 * MS);
        for _ in 0..WINDOW {
            e.observe(rows(1), 40 * MS);
        }
        assert_eq!(e.estimate(rows(1)), 40 * MS);
    }

    /// An engine whose time is 3 ms + 20 µs per real token + 5 µs per padded token, fed batches
    /// of varied shapes, predicts a shape it has never seen to within a few percent, though the
    /// configured model knew nothing of tokens.
    #[test]
    fn learns_the_cost_of_tokens_and_of_padding() {
        let truth = |s: Shape| 3 * MS + 20 * US * s.tokens + 5 * US * (s.rows * s.longest);
        let mut e = Estimator::new(2 * MS, Duration::ZERO);
        let mut seed = 7u32;
        for _ in 0..WINDOW {
            seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let rows = 1 + (seed >> 8) % 32;
            let longest = 8 + (seed >> 16) % 120;
            let tokens = rows * longest - (seed >> 4) % (rows * longest / 2 + 1);
            let s = Shape { rows, tokens, longest };
            e.observe(s, truth(s));
        }
        for s in [Shape { rows: 64, tokens: 4000, longest: 200 }, Shape { rows: 1, tokens: 5, longest: 5 }] {
            let (want, got) = (truth(s).as_secs_f64(), e.estimate(s).as_secs_f64());
            assert!(
                (got - want).abs() / want < 0.05,
                "{s:?}: estimated {got:.6} s, truly {want:.6} s; fit {:?}, correction {}",
                e.model.fit,
                e.model.correction_ns
            );
        }
    }

    #[test]
    fn costs_stay_non_negative() {
        // Times that fall with more rows would fit a negative per-row cost; it is pinned at zero.
        let mut e = Estimator::new(10 * MS, MS);
        for r in 1..=20 {
            e.observe(rows(r), Duration::from_millis(u64::from(40 - r)));
        }
        assert!(e.estimate(rows(1000)) >= e.estimate(rows(1)) - 20 * MS, "no large negative slope");
        assert!(e.model.fit.iter().all(|c| *c >= 0.0), "{:?}", e.model.fit);
    }
}
