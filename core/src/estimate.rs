//! How long a batch will take, as a function of its shape (rows, tokens, and rows × longest row
//! for engines that pad), learned online from what the engine measured.
//!
//! The model is linear in the shape's features, `fixed + perRow·rows + perToken·tokens +
//! perPadded·rows·longest`, fitted by least squares over the recent batches and pulled towards
//! the configured model (ridge regression: the configured model weighs a hundredth of a batch, so
//! it rules until there are measurements, and settles what a window of batches that all have the
//! same shape leaves open; its fixed cost weighs far less, so that a difference the batches' shapes
//! cannot place goes to the fixed cost, which every batch measures). Costs are kept non-negative.
//!
//! On top of the fit sits a tail-aware correction: the 90th percentile of recent residuals
//! (measured minus fitted), not their mean, because admission promises deadlines and a mean
//! estimate would break one promise in two whenever batch times vary. When every recent batch
//! had the same shape, the estimate for that shape is exactly the p90 of their times. It is
//! never more than what the last second's batches alone say (their own fit plus their largest
//! residual: [`crate::evidence`], rule 2), so a slow spell stops counting a second after the
//! engine is fast again; and the model keeps the prior it started from, for admission's probes
//! (rule 3).

use std::collections::VecDeque;
use std::time::Duration;

use std::time::Instant;

use crate::evidence;

/// How many recent batches the fit and the correction remember.
const WINDOW: usize = 64;
/// Which quantile of the residuals is added.
const QUANTILE: f64 = 0.9;
/// How many batches' worth the configured model weighs in the fit: little, so that the
/// measurements rule as soon as there are a few, but enough to settle what they leave open.
const PRIOR_WEIGHT: f64 = 0.01;
/// How much less the configured fixed cost weighs than the configured costs per unit (in each
/// feature's own scale): what the samples leave unexplained is the fixed cost's, which every
/// sample measures, as ridge regression leaves its intercept free. Weighed alike, one batch of
/// three tokens that ran faster than calibrated took a quarter of the difference off the cost
/// of its three tokens, a hundred microseconds a token, and a batch of 16 384 tokens was then
/// estimated at a few milliseconds: the per-unit costs move when the samples' shapes differ,
/// not when one shape ran fast.
const FIXED_PRIOR_SHARE: f64 = 1e-3;
/// What one measurement cannot resolve, in nanoseconds: the timer's millisecond grain. A configured
/// cost weighs at least as much as says that a sample whose part of that feature is below the
/// grain carries no news about it (a Bayesian prior that trusts the configured cost to within its
/// own size, against measurements a grain wide): decode steps of 6 400 context tokens at 20 ns a
/// slot add 128 us, which a millisecond timer rounds away, and with the configured cost weighing
/// a hundredth of a step they took the cost of attention from 20 ns to 0.3, so a 16 k prompt's
/// chunks were timed at a quarter of what they took. A sample where the feature adds milliseconds
/// outweighs it at once.
const GRAIN_NS: f64 = 1e6;

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

/// A tail-aware linear model of a duration over `N` features (the first is the constant 1):
/// the fit and its correction, shared by the batch-time [`Estimator`] (four features), the
/// generation step's estimator ([`crate::generation::step::StepEstimator`], five) and the
/// concurrency window's fits of an upstream server.
///
/// Two fits are kept: one over the whole window, corrected by its residuals' [`QUANTILE`], and
/// one over the recent samples alone ([`evidence::recent`]), corrected by their largest residual.
/// The estimate is the lesser: the long window's tail, as long as the last second has shown it;
/// what the last second has shown, once the engine has been faster than that for a second (a slow
/// spell over). `fitted` and `correction_ns` are the long window's, an upper bound of both.
#[derive(Debug, Clone)]
pub(crate) struct Linear<const N: usize = 4> {
    prior: [f64; N],
    /// The fitted costs, in nanoseconds per unit of each feature.
    fit: [f64; N],
    window: VecDeque<([f64; N], f64)>,
    /// When each sample of `window` was measured.
    measured: VecDeque<Instant>,
    correction_ns: f64,
    /// The long window's largest residual (its correction is a quantile of them).
    worst_ns: f64,
    /// The fit of the recent samples and their largest residual, when they are not the whole
    /// window.
    recent: Option<([f64; N], f64)>,
    /// [`Linear::estimate`]'s two lines in whole femtoseconds, for [`Linear::estimate_exact`];
    /// and those of [`Linear::ceiling_exact`].
    lines: Lines<N>,
    ceiling_lines: Lines<N>,
}

/// An estimate as exact integer arithmetic: the lesser of two lines (the long window's fit plus
/// its correction, and the recent samples' fit plus their largest residual), each in whole
/// femtoseconds per unit of each feature. Along a run of steps whose features grow by a constant
/// each, each line grows by a constant, so a forecast can sum a thousand steps' estimates in
/// closed form and get exactly what adding them one by one gives
/// (`generation::decode_run`); f64 dot products, rounded each, do not add up that way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lines<const N: usize> {
    pub long: Line<N>,
    pub recent: Option<Line<N>>,
}

/// `plus + Σ per[i] · x[i]`, femtoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Line<const N: usize> {
    pub per: [i128; N],
    pub plus: i128,
}

/// Femtoseconds in a nanosecond: the lines' unit. Fine enough that a cost of 0.3 ns a slot keeps
/// three digits, and an estimate rounded from it to whole nanoseconds is the f64 one's.
pub(crate) const FS_PER_NS: i128 = 1_000_000;

impl<const N: usize> Line<N> {
    fn new(fit: [f64; N], plus_ns: f64) -> Self {
        let fs = |ns: f64| (ns * FS_PER_NS as f64).round() as i128;
        Line { per: fit.map(fs), plus: fs(plus_ns) }
    }

    pub(crate) fn at(&self, x: [u64; N]) -> i128 {
        self.per.iter().zip(x).map(|(c, x)| c * i128::from(x)).sum::<i128>() + self.plus
    }
}

impl<const N: usize> Lines<N> {
    /// The lesser line's value at `x`, femtoseconds.
    pub(crate) fn at(&self, x: [u64; N]) -> i128 {
        let long = self.long.at(x);
        self.recent.map_or(long, |r| long.min(r.at(x)))
    }
}

/// Femtoseconds to whole nanoseconds, rounded half up, never negative.
pub(crate) fn fs_to_ns(fs: i128) -> u64 {
    (fs + FS_PER_NS / 2).div_euclid(FS_PER_NS).max(0) as u64
}

impl<const N: usize> Linear<N> {
    pub(crate) fn new(prior: [f64; N]) -> Self {
        Linear {
            prior,
            fit: prior,
            window: VecDeque::with_capacity(WINDOW),
            measured: VecDeque::with_capacity(WINDOW),
            correction_ns: 0.0,
            worst_ns: 0.0,
            recent: None,
            lines: Lines { long: Line::new(prior, 0.0), recent: None },
            ceiling_lines: Lines { long: Line::new(prior, 0.0), recent: None },
        }
    }

    /// Like [`Linear::estimate_exact`], with the long window's largest residual in place of its
    /// quantile: what a duration of this shape is not expected to exceed, for a choice that must
    /// not overrun (a step cut to an inter-token target), where the estimate is what a forecast
    /// adds up. Never below the estimate: the same fits, a correction no smaller, in the same
    /// integers.
    pub(crate) fn ceiling_exact(&self, x: [u64; N]) -> Duration {
        Duration::from_nanos(fs_to_ns(self.ceiling_lines.at(x)))
    }

    /// [`Linear::estimate`] for whole-numbered features, in exact integer arithmetic (it may
    /// differ from the f64 one by a nanosecond's rounding).
    pub(crate) fn estimate_exact(&self, x: [u64; N]) -> Duration {
        Duration::from_nanos(fs_to_ns(self.lines.at(x)))
    }

    pub(crate) fn lines(&self) -> &Lines<N> {
        &self.lines
    }

    /// The model it started from, before anything was measured.
    pub(crate) fn prior(&self) -> Linear<N> {
        Linear::new(self.prior)
    }

    pub(crate) fn fitted(&self, x: [f64; N]) -> f64 {
        dot(self.fit, x)
    }

    /// The lesser of the long window's and the recent samples' fit plus correction, in whole
    /// nanoseconds.
    pub(crate) fn estimate(&self, x: [f64; N]) -> Duration {
        let long = self.fitted(x) + self.correction_ns;
        let ns = self.recent.map_or(long, |(fit, correction)| long.min(dot(fit, x) + correction));
        Duration::from_nanos(ns.max(0.0).round() as u64)
    }

    /// The fitted costs, in nanoseconds per unit of each feature.
    pub(crate) fn fit(&self) -> [f64; N] {
        self.fit
    }

    pub(crate) fn correction_ns(&self) -> f64 {
        self.correction_ns
    }

    /// Feeds one measurement, taken at `at`.
    pub(crate) fn observe(&mut self, x: [f64; N], elapsed: Duration, at: Instant) {
        if self.window.len() == WINDOW {
            self.window.pop_front();
            self.measured.pop_front();
        }
        self.window.push_back((x, elapsed.as_nanos() as f64));
        self.measured.push_back(at);
        let all = self.window.len();
        (self.fit, self.correction_ns, self.worst_ns) = fit(self.prior, self.window.iter(), all, QUANTILE);
        let recent = evidence::recent(&self.measured);
        self.recent = (recent < all).then(|| {
            let (fit, _, worst) = fit(self.prior, self.window.iter().skip(all - recent), recent, 1.0);
            (fit, worst)
        });
        let recent = self.recent.map(|(fit, worst)| Line::new(fit, worst));
        self.lines = Lines { long: Line::new(self.fit, self.correction_ns), recent };
        self.ceiling_lines = Lines { long: Line::new(self.fit, self.worst_ns), recent };
    }
}

fn dot<const N: usize>(c: [f64; N], x: [f64; N]) -> f64 {
    c.iter().zip(x).map(|(c, x)| c * x).sum()
}

/// The fit of `n` samples, the `quantile` of its residuals and the largest.
fn fit<'a, const N: usize>(
    prior: [f64; N],
    samples: impl Iterator<Item = &'a ([f64; N], f64)> + Clone,
    n: usize,
    quantile: f64,
) -> ([f64; N], f64, f64) {
    let coef = refit(prior, samples.clone(), n);
    let mut residuals: Vec<f64> = samples.map(|(x, y)| y - dot(coef, *x)).collect();
    let worst = residuals.iter().copied().fold(f64::MIN, f64::max);
    let rank = ((residuals.len() as f64 * quantile).ceil() as usize).clamp(1, residuals.len());
    let correction = *residuals.select_nth_unstable_by(rank - 1, f64::total_cmp).1;
    (coef, correction, worst)
}

/// Ridge least squares towards the prior, with costs kept non-negative: a cost that comes out
/// negative is pinned at zero and the rest refitted (at most once per feature). A cost per unit
/// that moves from its prior by less than the timer's grain over the largest amount of its
/// feature measured is pinned at its prior likewise: the samples cannot resolve it, and a slope
/// fitted to noise over a narrow range is not to be extrapolated. (One sequence decoding alone
/// on a busy fresh pod, its steps a millisecond late more often as its context grew, gave a
/// context cost of 2.7 us a token: 0.5 ms over its 170 tokens, half a second a step with 500
/// sequences — and 499 of a burst of 500 were refused.)
fn refit<'a, const N: usize>(
    prior: [f64; N],
    samples: impl Iterator<Item = &'a ([f64; N], f64)>,
    n: usize,
) -> [f64; N] {
    let n = n as f64;
    // One pass gathers what every round of pinning starts from: the features' mean squares and
    // largest magnitudes, and the normal equations' sums (each round copies them rather than
    // summing the window again: a refit runs after every step a pod takes).
    let mut scale = [0.0; N];
    let mut largest = [0.0f64; N];
    let mut sums = [[0.0; N]; N];
    let mut sums_y = [0.0; N];
    for (x, y) in samples {
        for i in 0..N {
            scale[i] += x[i] * x[i] / n;
            largest[i] = largest[i].max(x[i].abs());
            sums_y[i] += x[i] * y;
            for j in 0..N {
                sums[i][j] += x[i] * x[j];
            }
        }
    }
    // The value each pinned cost is held at.
    let mut pinned: [Option<f64>; N] = [None; N];
    loop {
        let mut a = sums;
        let mut b = sums_y;
        for i in 0..N {
            let share = if i == 0 { FIXED_PRIOR_SHARE } else { 1.0 };
            let resolvable = if prior[i] > 0.0 { (GRAIN_NS / prior[i]).powi(2) } else { 0.0 };
            let lambda = share * (PRIOR_WEIGHT * scale[i].max(1.0)).max(resolvable);
            a[i][i] += lambda;
            b[i] += lambda * prior[i];
        }
        // A pinned cost is known: its row says so, and its column moves to the right-hand side.
        for (i, value) in pinned.iter().enumerate().filter_map(|(i, v)| v.map(|v| (i, v))) {
            for (r, row) in a.iter_mut().enumerate() {
                b[r] -= row[i] * value;
                row[i] = 0.0;
            }
            a[i] = [0.0; N];
            a[i][i] = 1.0;
            b[i] = value;
        }
        let fit = solve(a, b);
        let mut more = false;
        for i in 0..N {
            if pinned[i].is_some() {
                continue;
            }
            if fit[i] < 0.0 {
                pinned[i] = Some(0.0);
                more = true;
            } else if i > 0 && (fit[i] - prior[i]).abs() * largest[i] < GRAIN_NS {
                pinned[i] = Some(prior[i]);
                more = true;
            }
        }
        if !more {
            return fit.map(|c| c.max(0.0));
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

    /// The estimator as it started, before anything was measured: the configured or calibrated
    /// model, which admission's probes are judged by ([`crate::evidence`], rule 3).
    pub fn prior(&self) -> Estimator {
        Estimator { model: self.model.prior() }
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

    /// Feeds one measured batch, ended at `at`.
    pub fn observe(&mut self, shape: Shape, elapsed: Duration, at: Instant) {
        self.model.observe(shape.features(), elapsed, at);
    }
}

/// Solves `a · x = b` by Gaussian elimination with partial pivoting (`a` is symmetric positive
/// definite here: the ridge term sees to that).
fn solve<const N: usize>(mut a: [[f64; N]; N], mut b: [f64; N]) -> [f64; N] {
    for col in 0..N {
        let pivot = (col..N).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs())).expect("rows");
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..N {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (x, p) in a[row].iter_mut().zip(pivot_row).skip(col) {
                *x -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; N];
    for row in (0..N).rev() {
        let rest: f64 = (row + 1..N).map(|k| a[row][k] * x[k]).sum();
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
        e.observe(rows(4), 100 * MS, Instant::now());
        assert_eq!(e.estimate(rows(4)), 100 * MS);
        assert_eq!(e.estimate(rows(1)), 100 * MS);
    }

    #[test]
    fn learns_the_tail_not_the_mean() {
        let mut e = Estimator::new(100 * MS, Duration::ZERO);
        // Nine batches at 100 ms and one at 150 ms: the p90 residual is the slow one's 50 ms
        // only once it is more than a tenth of the window; here it is exactly a tenth.
        for _ in 0..9 {
            e.observe(rows(1), 100 * MS, Instant::now());
        }
        e.observe(rows(1), 150 * MS, Instant::now());
        assert_eq!(e.estimate(rows(1)), 100 * MS);
        e.observe(rows(1), 150 * MS, Instant::now());
        assert_eq!(e.estimate(rows(1)), 150 * MS);
    }

    #[test]
    fn learns_a_faster_engine_and_forgets_old_batches() {
        let mut e = Estimator::new(100 * MS, Duration::ZERO);
        for _ in 0..WINDOW {
            e.observe(rows(1), 300 * MS, Instant::now());
        }
        assert_eq!(e.estimate(rows(1)), 300 * MS);
        for _ in 0..WINDOW {
            e.observe(rows(1), 40 * MS, Instant::now());
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
            e.observe(s, truth(s), Instant::now());
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

    /// An engine slow for a while (a throttled GPU) and then fast again: the slow batches stop
    /// counting once a second of fast ones follows, though they fill most of the window — their
    /// costs per row too, for shapes the last second did not show.
    #[test]
    fn a_slow_spell_stops_counting_a_second_after_it_ends() {
        let truth = |r: u32| 100 * MS + 2 * MS * r;
        let mut e = Estimator::new(100 * MS, 2 * MS);
        let mut t = Instant::now();
        for i in 0..40 {
            t += 100 * MS;
            e.observe(rows(1 + i % 16), 3 * truth(1 + i % 16), t);
        }
        assert!(e.estimate(rows(32)) > 2 * truth(32), "{:?}", e.estimate(rows(32)));
        let fast_from = t;
        for i in 0..5 {
            t += 100 * MS;
            e.observe(rows(1 + i % 8), truth(1 + i % 8), t);
        }
        assert!(e.estimate(rows(32)) > 2 * truth(32), "half a second of fast batches proves little");
        let mut i = 0;
        while t <= fast_from + crate::evidence::RECENT_SPAN {
            t += 100 * MS;
            e.observe(rows(1 + i % 8), truth(1 + i % 8), t);
            i += 1;
        }
        for r in [1, 8, 32] {
            let est = e.estimate(rows(r)).as_secs_f64();
            let want = truth(r).as_secs_f64();
            assert!((est - want).abs() / want < 0.05, "{r} rows: estimated {est}, truly {want}");
        }
        assert_eq!(e.prior().estimate(rows(1)), 102 * MS, "the prior is kept");
    }

    /// A calibrated model (4 ms + 100 µs a token) and a first batch of one short text that ran
    /// 1.5 ms faster than calibrated (a calibration taken on a busy machine): the difference is the
    /// fixed cost's, which that batch measured, not the per-token cost's, which three tokens say
    /// almost nothing about. A batch of 16 384 tokens keeps its estimate.
    #[test]
    fn one_short_batch_does_not_unlearn_the_cost_of_a_long_one() {
        let model = CostModel { fixed: 4 * MS, per_token: 100 * US, ..CostModel::default() };
        let mut e = Estimator::with_model(model);
        let long = Shape { rows: 64, tokens: 64 * 256, longest: 256 };
        let before = e.estimate(long);
        e.observe(Shape { rows: 1, tokens: 3, longest: 3 }, 2600 * US, Instant::now());
        assert_eq!(e.estimate(Shape { rows: 1, tokens: 3, longest: 3 }), 2600 * US, "the batch it measured");
        let after = e.estimate(long);
        assert!(
            after.as_secs_f64() > 0.99 * before.as_secs_f64(),
            "{before:?} became {after:?}; fit {:?}",
            e.model.fit
        );
    }

    #[test]
    fn costs_stay_non_negative() {
        // Times that fall with more rows would fit a negative per-row cost; it is pinned at zero.
        let mut e = Estimator::new(10 * MS, MS);
        for r in 1..=20 {
            e.observe(rows(r), Duration::from_millis(u64::from(40 - r)), Instant::now());
        }
        assert!(e.estimate(rows(1000)) >= e.estimate(rows(1)) - 20 * MS, "no large negative slope");
        assert!(e.model.fit.iter().all(|c| *c >= 0.0), "{:?}", e.model.fit);
    }
}
