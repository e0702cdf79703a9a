//! Readiness that tells the truth: whether a model version has refused every request for a while
//! though nothing was queued or running — the state [`crate::evidence`] exists to prevent, which
//! an operator must be able to see should anything bring it back.
//!
//! Every shell (request-level batcher, generation step loop, the relay) keeps one [`Lockout`]:
//! it reports each refusal at admission for infeasibility, saying whether the ledger was idle
//! after it, and each time something runs (a batch dispatched, a step started, a request sent
//! upstream). A probe admitted by [`crate::evidence`]'s rule 3 runs, so a lock the probes can
//! break never lasts long enough to show; one that shows is a lock they cannot break (deadlines
//! no configured figure meets, an upstream that never answers a probe in time).

use std::time::Duration;

use std::time::Instant;

/// How long every request must have been refused while idle before it shows.
pub const LOCKED_AFTER: Duration = Duration::from_secs(5);

/// Refusals while idle since something last ran. See the module documentation.
#[derive(Debug, Clone, Default)]
pub struct Lockout {
    /// The first refusal while idle since something last ran.
    since: Option<Instant>,
    /// The latest one, and what it said.
    last: Option<(Instant, String)>,
    refused: u64,
}

impl Lockout {
    /// A request was refused at admission as infeasible; `idle` says whether nothing was queued
    /// or running after it (a refusal beside admitted work is load, not a lock).
    pub fn refused(&mut self, now: Instant, idle: bool, message: &str) {
        if !idle {
            return;
        }
        self.since.get_or_insert(now);
        self.last = Some((now, message.to_string()));
        self.refused += 1;
    }

    /// Something was admitted and ran: whatever was refused before is no lock.
    pub fn ran(&mut self) {
        *self = Lockout::default();
    }

    /// Why it is locked at `now`, if it is: every request of at least [`LOCKED_AFTER`] was refused
    /// while idle, the latest within the last [`LOCKED_AFTER`] (a lock nobody asks past is over).
    pub fn locked(&self, now: Instant) -> Option<String> {
        let (since, (last, message)) = (self.since?, self.last.as_ref()?);
        let locked = self.refused >= 2
            && now.saturating_duration_since(since) >= LOCKED_AFTER
            && now.saturating_duration_since(*last) <= LOCKED_AFTER;
        locked.then(|| {
            format!(
                "refusing every request while idle: {} in the last {:.1} s, none run; the latest: {message}",
                self.refused,
                now.saturating_duration_since(since).as_secs_f64()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn refusals_while_idle_for_five_seconds_are_a_lock_until_something_runs() {
        let t0 = Instant::now();
        let mut l = Lockout::default();
        for i in 0..=50 {
            l.refused(t0 + 100 * MS * i, true, "deadline cannot be met");
        }
        assert_eq!(l.locked(t0 + 4999 * MS), None, "under five seconds");
        let why = l.locked(t0 + 5000 * MS).expect("five seconds of refusals while idle");
        assert!(why.contains("51 in the last 5.0 s") && why.ends_with("the latest: deadline cannot be met"), "{why}");
        assert_eq!(l.locked(t0 + 10_001 * MS), None, "nobody asked for more than five seconds");
        l.ran();
        assert_eq!(l.locked(t0 + 5000 * MS), None, "a probe ran");
    }

    #[test]
    fn refusals_beside_running_work_are_load_not_a_lock() {
        let t0 = Instant::now();
        let mut l = Lockout::default();
        for i in 0..=60 {
            l.refused(t0 + 100 * MS * i, false, "busy");
        }
        assert_eq!(l.locked(t0 + 6000 * MS), None);
        l.refused(t0, true, "one");
        assert_eq!(l.locked(t0 + 5000 * MS), None, "one refusal is no pattern");
    }
}
