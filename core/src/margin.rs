//! How early a deadline-driven batch must leave so that its answers reach their callers in time,
//! and how much of every deadline admission keeps back for the same reason.
//!
//! A batch that leaves at `deadline − estimate` is late as soon as anything is slower than
//! planned: the timer that wakes the batcher fires after its instant (tokio's wheel has a
//! millisecond's grain, and a loaded machine adds more), and the engine takes longer than the
//! estimate for some batches (the estimate is a high quantile, not the maximum). So the margin is
//! measured rather than fixed: the configured floor (the answer's trip back to its caller) plus a
//! high quantile of the timer's recent lateness plus a high quantile of the engine's recent
//! overshoot past its estimate. Both windows are short and quantiles ignore a lone outlier, so a
//! burst of slowness (a paused process, a throttled GPU) raises the margin only while it lasts.

use std::collections::VecDeque;
use std::time::Duration;

/// Samples each window remembers (the sidecar's batcher measures its timer 20 times a second:
/// about 6 s of history).
const WINDOW: usize = 128;
/// The quantile taken of each window: high enough to cover what happens every few seconds, low
/// enough that a lone outlier (or three) in the window does not move it.
const QUANTILE: f64 = 0.97;

/// A bounded window of recent durations and its quantile.
#[derive(Debug, Clone, Default)]
struct Window {
    samples: VecDeque<Duration>,
}

impl Window {
    fn push(&mut self, d: Duration) {
        if self.samples.len() == WINDOW {
            self.samples.pop_front();
        }
        self.samples.push_back(d);
    }

    /// The window's [`QUANTILE`] (the largest sample while there are few); zero when empty.
    fn quantile(&self) -> Duration {
        if self.samples.is_empty() {
            return Duration::ZERO;
        }
        let mut sorted: Vec<Duration> = self.samples.iter().copied().collect();
        sorted.sort_unstable();
        let rank = ((sorted.len() as f64 * QUANTILE).ceil() as usize).clamp(1, sorted.len());
        sorted[rank - 1]
    }
}

/// The deadline margin: a floor plus what the timer and the engine were recently measured to add.
#[derive(Debug, Clone)]
pub struct Margin {
    floor: Duration,
    lateness: Window,
    overshoot: Window,
    /// The current value, kept up to date on every sample (it is read on every admission).
    value: Duration,
}

impl Margin {
    pub fn new(floor: Duration) -> Self {
        Margin { floor, lateness: Window::default(), overshoot: Window::default(), value: floor }
    }

    /// A timer woke its owner this long after the instant it was set for.
    pub fn observe_wake(&mut self, lateness: Duration) {
        self.lateness.push(lateness);
        self.update();
    }

    /// A batch expected to take `expected` took `took`.
    pub fn observe_batch(&mut self, expected: Duration, took: Duration) {
        self.overshoot.push(took.saturating_sub(expected));
        self.update();
    }

    fn update(&mut self) {
        let (lateness, overshoot) = self.parts();
        self.value = self.floor + lateness + overshoot;
    }

    /// How long before the last possible instant a deadline-driven batch leaves, and how much of
    /// a deadline admission keeps back.
    pub fn get(&self) -> Duration {
        self.value
    }

    /// What the margin is made of: the timer's lateness and the engine's overshoot (the floor
    /// is the rest), for messages that explain a refusal.
    ///
    /// Until a batch has been measured, the engine is taken to overshoot by as much as the timer
    /// is late: the first batch ends when the runtime wakes its owner for it, and its estimate is
    /// only the configured (or calibrated) guess.
    pub fn parts(&self) -> (Duration, Duration) {
        let lateness = self.lateness.quantile();
        let overshoot = if self.overshoot.samples.is_empty() { lateness } else { self.overshoot.quantile() };
        (lateness, overshoot)
    }

    /// The configured part.
    pub fn floor(&self) -> Duration {
        self.floor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn without_measurements_the_margin_is_its_floor() {
        assert_eq!(Margin::new(2 * MS).get(), 2 * MS);
    }

    #[test]
    fn the_margin_covers_the_timer_and_the_engine() {
        let mut m = Margin::new(2 * MS);
        m.observe_wake(MS);
        assert_eq!(m.get(), 4 * MS, "before any batch, the engine is taken to be as late as the timer");
        m.observe_batch(100 * MS, 100 * MS);
        assert_eq!(m.get(), 3 * MS, "a batch on time");
        m.observe_batch(100 * MS, 102 * MS);
        assert_eq!(m.get(), 5 * MS, "2 ms over the estimate");
        m.observe_batch(100 * MS, 90 * MS);
        assert_eq!(m.get(), 5 * MS, "a fast batch does not shrink it below what a slow one needed");
    }

    #[test]
    fn a_lone_outlier_is_forgotten_quickly_and_a_burst_lasts_only_as_long_as_the_window() {
        let mut m = Margin::new(2 * MS);
        m.observe_batch(100 * MS, 100 * MS);
        for _ in 0..40 {
            m.observe_wake(MS);
        }
        m.observe_wake(300 * MS);
        assert_eq!(m.get(), 3 * MS, "one stop of 300 ms among 41 wakes is past the 97th percentile");
        for _ in 0..10 {
            m.observe_wake(300 * MS);
        }
        assert_eq!(m.get(), 302 * MS, "a burst raises it");
        for _ in 0..WINDOW {
            m.observe_wake(MS);
        }
        assert_eq!(m.get(), 3 * MS, "and it passes once the window has moved on");
    }
}
