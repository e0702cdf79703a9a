//! How early a deadline-driven batch must leave so that its answers reach their callers in time,
//! and how much of every deadline admission keeps back for the same reason.
//!
//! A batch that leaves at `deadline − estimate` is late as soon as anything is slower than
//! planned: the timer that wakes the batcher fires after its instant (tokio's wheel has a
//! millisecond's grain, and a loaded machine adds more), and the engine takes longer than the
//! estimate for some batches (the estimate is a high quantile, not the maximum). So the margin is
//! measured rather than fixed: the configured floor plus high quantiles of the timer's recent
//! lateness, of the engine's recent overshoot past its estimate, and of the recent trips of answers
//! //! from the batcher to their callers (a busy runtime can take milliseconds to wake a caller). The
//! windows are short, quantiles ignore a lone outlier, and each is bounded by its recent samples, so
//! a burst of slowness (a throttled GPU) raises the margin only while it lasts; and a measurement
//! across a stall of the process (a SIGSTOP) is not learned from at all ([`crate::evidence`]).

use std::collections::VecDeque;
use std::time::Duration;

use std::time::Instant;

use crate::evidence::{self, Stalls};

/// Samples each window remembers (the sidecar's batcher measures its timer 20 times a second:
/// about 6 s of history).
const WINDOW: usize = 128;
/// The quantile taken of each window: high enough to cover what happens every few seconds, low
/// enough that a lone outlier (or three) in the window does not move it.
const QUANTILE: f64 = 0.97;

/// A bounded window of recent durations and its quantile, bounded by the recent samples
/// ([`evidence::tail`]).
#[derive(Debug, Clone, Default)]
struct Window {
    samples: VecDeque<(Instant, f64)>,
    /// The quantile, recomputed when a sample comes (it is read far more often).
    quantile: Duration,
}

impl Window {
    fn push(&mut self, at: Instant, d: Duration) {
        if self.samples.len() == WINDOW {
            self.samples.pop_front();
        }
        self.samples.push_back((at, d.as_nanos() as f64));
        let ns = evidence::tail(&self.samples, QUANTILE).unwrap_or(0.0);
        self.quantile = Duration::from_nanos(ns.max(0.0) as u64);
    }

    /// The window's [`QUANTILE`] (the largest sample while there are few); zero when empty.
    fn quantile(&self) -> Duration {
        self.quantile
    }

    fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

/// The measured parts of the margin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parts {
    pub lateness: Duration,
    pub overshoot: Duration,
    pub trip: Duration,
}

/// The deadline margin: a floor plus what the timer, the engine and the way back were recently
/// measured to add.
#[derive(Debug, Clone)]
pub struct Margin {
    floor: Duration,
    lateness: Window,
    overshoot: Window,
    trip: Window,
    /// When the process did not run, as the timer's late wakes showed it.
    stalls: Stalls,
    /// The current value, kept up to date on every sample (it is read on every admission).
    value: Duration,
}

impl Margin {
    pub fn new(floor: Duration) -> Self {
        Margin {
            floor,
            lateness: Window::default(),
            overshoot: Window::default(),
            trip: Window::default(),
            stalls: Stalls::default(),
            value: floor,
        }
    }

    /// A timer woke its owner at `now`, this long after the instant it was set for. A wake far
    /// later than usual marks a stall ([`evidence`], rule 1).
    pub fn observe_wake(&mut self, now: Instant, lateness: Duration) {
        self.observe_wake_at(now, lateness);
    }

    /// An instant's events with the timer's wakes taken out and observed first (`lateness` says
    /// which are wakes): a late wake may say that the process stalled meanwhile, and what the
    /// other events measured over that stall is then not evidence.
    pub fn wakes_first<E>(
        &mut self,
        now: Instant,
        events: Vec<E>,
        lateness: impl Fn(&E) -> Option<Duration>,
    ) -> Vec<E> {
        let mut rest = Vec::with_capacity(events.len());
        for event in events {
            match lateness(&event) {
                Some(late) => self.observe_wake_at(now, late),
                None => rest.push(event),
            }
        }
        rest
    }

    fn observe_wake_at(&mut self, now: Instant, lateness: Duration) {
        self.stalls.observe_wake(now, lateness, self.lateness.quantile());
        self.lateness.push(now, lateness);
        self.update();
    }

    /// Whether a measurement from `from` to `to` is evidence: the process did not stall meanwhile.
    /// What is not evidence teaches neither the margin nor the estimators.
    pub fn evidence(&self, from: Instant, to: Instant) -> bool {
        !self.stalls.within(from, to)
    }

    /// A batch expected to take `expected` took `took`, ending at `now` (ignored if the process
    /// stalled meanwhile).
    pub fn observe_batch(&mut self, now: Instant, expected: Duration, took: Duration) {
        if !self.evidence(now.checked_sub(took).unwrap_or(now), now) {
            return;
        }
        self.overshoot.push(now, took.saturating_sub(expected));
        self.update();
    }

    /// An answer took this long from the batcher to its caller, arriving at `now` (ignored if the
    /// process stalled meanwhile).
    pub fn observe_trip(&mut self, now: Instant, trip: Duration) {
        if !self.evidence(now.checked_sub(trip).unwrap_or(now), now) {
            return;
        }
        self.trip.push(now, trip);
        self.update();
    }

    fn update(&mut self) {
        let parts = self.parts();
        self.value = self.floor + parts.lateness + parts.overshoot + parts.trip;
    }

    /// How long before the last possible instant a deadline-driven batch leaves, and how much of
    /// a deadline admission keeps back.
    pub fn get(&self) -> Duration {
        self.value
    }

    /// What the margin is made of besides the floor, for messages that explain a refusal.
    ///
    /// Until a batch has been measured, the engine is taken to overshoot by as much as the timer
    /// is late: the first batch ends when the runtime wakes its owner for it, and its estimate is
    /// only the configured (or calibrated) guess.
    pub fn parts(&self) -> Parts {
        let lateness = self.lateness.quantile();
        let overshoot = if self.overshoot.is_empty() { lateness } else { self.overshoot.quantile() };
        Parts { lateness, overshoot, trip: self.trip.quantile() }
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
        let t = Instant::now();
        let mut m = Margin::new(2 * MS);
        m.observe_wake(t, MS);
        assert_eq!(m.get(), 4 * MS, "before any batch, the engine is taken to be as late as the timer");
        m.observe_batch(t, 100 * MS, 100 * MS);
        assert_eq!(m.get(), 3 * MS, "a batch on time");
        m.observe_batch(t, 100 * MS, 102 * MS);
        assert_eq!(m.get(), 5 * MS, "2 ms over the estimate");
        m.observe_batch(t, 100 * MS, 90 * MS);
        assert_eq!(m.get(), 5 * MS, "a fast batch does not shrink it below what a slow one needed");
        m.observe_trip(t, MS);
        assert_eq!(m.get(), 6 * MS, "the answer's way back to its caller");
    }

    #[test]
    fn a_lone_outlier_is_forgotten_quickly_and_a_burst_lasts_only_as_long_as_the_window() {
        let mut t = Instant::now();
        let mut m = Margin::new(2 * MS);
        m.observe_batch(t, 100 * MS, 100 * MS);
        let mut wake = |m: &mut Margin, late: Duration| {
            t += 50 * MS;
            m.observe_wake(t, late);
        };
        for _ in 0..40 {
            wake(&mut m, MS);
        }
        wake(&mut m, 300 * MS);
        assert_eq!(m.get(), 3 * MS, "one stop of 300 ms among 41 wakes is past the 97th percentile");
        for _ in 0..10 {
            wake(&mut m, 300 * MS);
        }
        assert_eq!(m.get(), 302 * MS, "a burst raises it");
        for _ in 0..WINDOW {
            wake(&mut m, MS);
        }
        assert_eq!(m.get(), 3 * MS, "and it passes once the window has moved on");
    }

    /// Early in the process' life the windows hold few samples, and their quantile is their
    /// largest: a stall then would set the margin for as long as the window remembers it. A stall
    /// is not evidence of the engine, and the timer's one late wake stops counting after a second.
    #[test]
    fn a_stall_early_in_life_neither_teaches_the_engines_overshoot_nor_outlives_a_second() {
        let t0 = Instant::now();
        let mut m = Margin::new(2 * MS);
        let mut t = t0;
        for _ in 0..8 {
            t += 50 * MS;
            m.observe_wake(t, MS);
        }
        m.observe_batch(t, 100 * MS, 100 * MS);
        // Stopped for 650 ms while a batch ran: the batch and its answers' trips end after it.
        t += 700 * MS;
        m.observe_wake(t, 650 * MS);
        m.observe_batch(t, 100 * MS, 700 * MS);
        m.observe_trip(t + MS, 651 * MS);
        assert_eq!(m.parts().overshoot, Duration::ZERO, "the stalled batch is not evidence");
        assert_eq!(m.parts().trip, Duration::ZERO, "nor are the trips of answers held up by the stall");
        assert_eq!(m.parts().lateness, 650 * MS, "the timer was that late, and among few wakes it counts");
        let resumed = t;
        while t < resumed + evidence::RECENT_SPAN + 50 * MS {
            t += 50 * MS;
            m.observe_wake(t, MS);
        }
        assert_eq!(m.get(), 3 * MS, "a second of wakes on time bounds it again");
        // A batch measured after the stall is evidence again.
        m.observe_batch(t, 100 * MS, 104 * MS);
        assert_eq!(m.parts().overshoot, 4 * MS);
    }
}
