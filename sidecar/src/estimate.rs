//! How long a batch will take: the configured model (`fixed + perRow × rows`), corrected online
//! by what the engine actually measured.
//!
//! The correction is tail-aware: it adds the 90th percentile of recent residuals (measured minus
//! modelled), not their mean, because admission promises deadlines and a mean estimate would
//! break one promise in two whenever batch times vary.

use std::collections::VecDeque;
use std::time::Duration;

/// How many recent batches the correction remembers.
const WINDOW: usize = 64;
/// Which quantile of the residuals is added.
const QUANTILE: f64 = 0.9;

#[derive(Debug, Clone)]
pub struct Estimator {
    fixed: Duration,
    per_row: Duration,
    residuals_ns: VecDeque<i64>,
    correction_ns: i64,
}

impl Estimator {
    pub fn new(fixed: Duration, per_row: Duration) -> Self {
        Estimator { fixed, per_row, residuals_ns: VecDeque::with_capacity(WINDOW), correction_ns: 0 }
    }

    fn model(&self, rows: u32) -> Duration {
        self.fixed + self.per_row * rows
    }

    /// Expected engine time for a batch of `rows` rows.
    pub fn estimate(&self, rows: u32) -> Duration {
        let model = self.model(rows).as_nanos() as i64;
        Duration::from_nanos((model + self.correction_ns).max(0) as u64)
    }

    /// Feeds one measured batch.
    pub fn observe(&mut self, rows: u32, elapsed: Duration) {
        let residual = elapsed.as_nanos() as i64 - self.model(rows).as_nanos() as i64;
        if self.residuals_ns.len() == WINDOW {
            self.residuals_ns.pop_front();
        }
        self.residuals_ns.push_back(residual);
        let mut sorted: Vec<i64> = self.residuals_ns.iter().copied().collect();
        sorted.sort_unstable();
        let rank = ((sorted.len() as f64 * QUANTILE).ceil() as usize).clamp(1, sorted.len());
        self.correction_ns = sorted[rank - 1];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn starts_from_the_configured_model() {
        let e = Estimator::new(100 * MS, 2 * MS);
        assert_eq!(e.estimate(1), 102 * MS);
        assert_eq!(e.estimate(32), 164 * MS);
    }

    #[test]
    fn exact_measurements_change_nothing() {
        let mut e = Estimator::new(100 * MS, Duration::ZERO);
        e.observe(4, 100 * MS);
        assert_eq!(e.estimate(4), 100 * MS);
    }

    #[test]
    fn learns_the_tail_not_the_mean() {
        let mut e = Estimator::new(100 * MS, Duration::ZERO);
        // Nine batches at 100 ms and one at 150 ms: the p90 residual is the slow one's 50 ms
        // only once it is more than a tenth of the window; here it is exactly a tenth.
        for _ in 0..9 {
            e.observe(1, 100 * MS);
        }
        e.observe(1, 150 * MS);
        assert_eq!(e.estimate(1), 100 * MS);
        e.observe(1, 150 * MS);
        assert_eq!(e.estimate(1), 150 * MS);
    }

    #[test]
    fn learns_a_faster_engine_and_forgets_old_batches() {
        let mut e = Estimator::new(100 * MS, Duration::ZERO);
        for _ in 0..WINDOW {
            e.observe(1, 300 * MS);
        }
        assert_eq!(e.estimate(1), 300 * MS);
        for _ in 0..WINDOW {
            e.observe(1, 40 * MS);
        }
        assert_eq!(e.estimate(1), 40 * MS);
    }
}
