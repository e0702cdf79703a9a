//! A tenant's quotas (DESIGN.md, "Tenants"): token buckets on requests and on tokens, with the
//! time passed in. Over quota is a 429 whose `Retry-After` is when the bucket will hold what the
//! request needs — honoured, the retry is admitted (unless other requests drained it meanwhile).

use std::time::Duration;

use std::time::Instant;

/// A token bucket: `rate` units a second, at most `burst` held; it starts full.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    rate: f64,
    burst: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    /// `rate` units per second, `burst` at most (both positive: validated by the tenants file).
    pub fn new(rate: f64, burst: f64, now: Instant) -> Self {
        debug_assert!(rate > 0.0 && burst > 0.0);
        Bucket { rate, burst, level: burst, at: now }
    }

    /// Keeps what is held when the limits change (a reloaded tenants file), capped by the new burst.
    pub fn reconfigure(&mut self, rate: f64, burst: f64, now: Instant) {
        self.refill(now);
        self.rate = rate;
        self.burst = burst;
        self.level = self.level.min(burst);
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + elapsed * self.rate).min(self.burst);
        self.at = self.at.max(now);
    }

    /// Whether `amount` can be taken now; `Err(wait)`: when it could be. An amount over the burst
    /// can never be taken (the caller refuses it as too large for the quota rather than saying
    /// "retry later").
    pub fn check(&mut self, amount: f64, now: Instant) -> Result<(), Duration> {
        self.refill(now);
        if amount <= self.level {
            return Ok(());
        }
        Err(Duration::from_secs_f64(((amount - self.level) / self.rate).min(1e9)))
    }

    /// Takes `amount` (after a successful [`Bucket::check`] of this and every other bucket the
    /// request draws on, so that a refusal by one takes nothing from another).
    pub fn take(&mut self, amount: f64, now: Instant) {
        self.refill(now);
        self.level -= amount;
    }

    /// Gives back what a request took and did not use (refused after the quota check).
    pub fn give_back(&mut self, amount: f64) {
        self.level = (self.level + amount).min(self.burst);
    }

    pub fn burst(&self) -> f64 {
        self.burst
    }

    pub fn rate(&self) -> f64 {
        self.rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_full_bucket_takes_its_burst_then_refills_at_its_rate() {
        let t0 = Instant::now();
        let mut b = Bucket::new(10.0, 3.0, t0);
        for _ in 0..3 {
            assert_eq!(b.check(1.0, t0), Ok(()));
            b.take(1.0, t0);
        }
        // Empty: one unit comes in 100 ms at 10/s.
        assert_eq!(b.check(1.0, t0), Err(100 * MS));
        assert!(b.check(1.0, t0 + 99 * MS).is_err());
        assert_eq!(b.check(1.0, t0 + 100 * MS), Ok(()));
        // It never holds more than its burst however long it waits.
        b.take(1.0, t0 + 100 * MS);
        assert!(b.check(3.0, t0 + 10_000 * MS).is_ok());
        assert_eq!(b.check(3.5, t0 + 10_000 * MS), Err(50 * MS));
    }

    #[test]
    fn a_check_takes_nothing_and_a_give_back_is_capped() {
        let t0 = Instant::now();
        let mut b = Bucket::new(1.0, 2.0, t0);
        assert!(b.check(2.0, t0).is_ok());
        assert!(b.check(2.0, t0).is_ok());
        b.take(2.0, t0);
        b.give_back(5.0);
        assert!(b.check(2.0, t0).is_ok());
        assert!(b.check(2.1, t0).is_err());
    }

    #[test]
    fn reconfiguring_keeps_the_level_within_the_new_burst() {
        let t0 = Instant::now();
        let mut b = Bucket::new(1.0, 10.0, t0);
        b.reconfigure(100.0, 4.0, t0);
        assert!(b.check(4.0, t0).is_ok());
        assert_eq!(b.check(5.0, t0), Err(10 * MS));
    }
}
