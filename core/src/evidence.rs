//! What admission may learn from, so that no learned figure can lock it shut.
//!
//! Admission says "no" on the strength of learned figures: the batch and step times, the deadline
//! margin's parts, the upstream's fits. A refused request teaches nothing, so a figure that became
//! too pessimistic would never be corrected: one stall would turn into refusing everything, for
//! ever. Three rules keep every figure correctable:
//!
//! 1. **A stall is not evidence.** When the process itself did not run (a SIGSTOP, CPU throttling, a
//!    page-cache stall), the shell's timer wakes late — it wakes at least every 50 ms, so a stall
//!    always shows as a late wake. A wake later than [`STALL_MIN`] and four times what the timer
//!    usually is late marks the time since its instant as a [`Stalls`] span; a batch, step, token
//!    gap or answer's trip that overlaps one says nothing about the engine and is not learned from.
//!    (A throttled process that is late every period raises the usual lateness, so its pauses are
//!    the timer's lateness, covered by the margin, and its batches are measured.)
//! 2. **A tail is bounded by what was shown recently** ([`tail`]): the high quantile of a window
//!    is never more than the largest of its recent samples (those of the last [`RECENT_SPAN`]
//!    before the newest, and at least the newest [`RECENT_MIN`]). Once the engine has run at its
//!    true speed for a second, a slow spell before it no longer counts, though the long window
//!    still remembers it should it come back. The price: an engine whose slow batches are rare
//!    (fewer than one a second) is covered by the margin's overshoot rather than the estimate.
//! 3. **A probe when nothing else can be risked** (in each admission path): a request refused only
//!    by learned figures — the prior that the engine was configured or timed with, and the
//!    margin's floor, would admit it — while nothing is queued or running is admitted alone (or
//!    with its group's own sequences: OpenAI's `n`, admitted all or none). It can only risk
//!    itself; it is run and learned from, and answered 504 at its deadline if it
//!    misses (never late). So a full lock, where no batch runs to bring evidence, lasts one batch.

use std::collections::VecDeque;
use std::time::Duration;

use std::time::Instant;

/// Samples within this span before the newest one are recent (rule 2).
pub const RECENT_SPAN: Duration = Duration::from_secs(1);
/// The newest samples that are recent however far apart they are (rule 2): a bound needs a few.
pub const RECENT_MIN: usize = 4;
/// The least lateness of a wake that marks a stall (rule 1): less is a busy runtime.
pub const STALL_MIN: Duration = Duration::from_millis(25);
/// How many stalls are remembered: enough to judge every batch or token gap still open.
const STALLS_KEPT: usize = 32;

/// How many of the newest of `measured` (instants, in the order measured) are recent (rule 2):
/// those within [`RECENT_SPAN`] of the newest, and at least the newest [`RECENT_MIN`].
pub fn recent<'a>(measured: impl IntoIterator<Item = &'a Instant, IntoIter: DoubleEndedIterator>) -> usize {
    let mut newest = None;
    measured
        .into_iter()
        .rev()
        .enumerate()
        .take_while(|&(i, at)| {
            let newest = *newest.get_or_insert(*at);
            i < RECENT_MIN || newest.saturating_duration_since(*at) <= RECENT_SPAN
        })
        .count()
}

/// The `quantile` of `samples` (instant, value), bounded by the largest recent one (rule 2).
/// `samples` are in the order they were measured. `None` when there are none.
pub fn tail(samples: &VecDeque<(Instant, f64)>, quantile: f64) -> Option<f64> {
    samples.back()?;
    let mut sorted: Vec<f64> = samples.iter().map(|s| s.1).collect();
    let rank = ((sorted.len() as f64 * quantile).ceil() as usize).clamp(1, sorted.len());
    let q = *sorted.select_nth_unstable_by(rank - 1, f64::total_cmp).1;
    let recent = recent(samples.iter().map(|s| &s.0).collect::<Vec<_>>());
    let largest = samples.iter().rev().take(recent).map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
    Some(q.min(largest))
}

/// The spans in which the process did not run, as its timer's late wakes showed them (rule 1).
#[derive(Debug, Clone, Default)]
pub struct Stalls {
    spans: VecDeque<(Instant, Instant)>,
}

impl Stalls {
    /// A wake at `now`, `lateness` after the instant it was set for. `usual` is the timer's usual
    /// lateness (its quantile before this wake).
    pub fn observe_wake(&mut self, now: Instant, lateness: Duration, usual: Duration) {
        if lateness < STALL_MIN.max(usual * 4) {
            return;
        }
        if self.spans.len() == STALLS_KEPT {
            self.spans.pop_front();
        }
        self.spans.push_back((now.checked_sub(lateness).unwrap_or(now), now));
    }

    /// Whether the process stalled at some point between `from` and `to`: a measurement over that
    /// time is not evidence about the engine.
    pub fn within(&self, from: Instant, to: Instant) -> bool {
        self.spans.iter().any(|&(start, end)| start < to && end > from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn window(t0: Instant, samples: &[(u64, f64)]) -> VecDeque<(Instant, f64)> {
        samples.iter().map(|&(ms, v)| (t0 + MS * ms as u32, v)).collect()
    }

    #[test]
    fn the_tail_is_the_quantile_while_recent_samples_reach_it() {
        let t0 = Instant::now();
        // Nine fast and one slow, all within a second: the 90th percentile is a fast one, and a
        // second slow one makes it the slow one.
        let mut w = window(t0, &(0..9).map(|i| (i * 10, 1.0)).collect::<Vec<_>>());
        w.push_back((t0 + 90 * MS, 5.0));
        assert_eq!(tail(&w, 0.9), Some(1.0));
        w.push_back((t0 + 100 * MS, 5.0));
        assert_eq!(tail(&w, 0.9), Some(5.0));
        assert_eq!(tail(&VecDeque::new(), 0.9), None);
    }

    #[test]
    fn a_slow_spell_stops_counting_once_a_second_of_fast_samples_follows_it() {
        let t0 = Instant::now();
        // Twenty slow samples, then fast ones every 100 ms.
        let mut w = window(t0, &(0..20).map(|i| (i * 50, 9.0)).collect::<Vec<_>>());
        let spell_end = t0 + 950 * MS;
        let mut at = spell_end;
        for _ in 0..RECENT_MIN {
            at += 100 * MS;
            w.push_back((at, 1.0));
        }
        assert_eq!(tail(&w, 0.9), Some(9.0), "the slow samples are still within a second of the newest");
        while at < spell_end + RECENT_SPAN + 100 * MS {
            at += 100 * MS;
            w.push_back((at, 1.0));
        }
        assert_eq!(tail(&w, 0.9), Some(1.0), "a second of fast samples bounds the tail");
    }

    #[test]
    fn the_newest_few_count_however_far_apart() {
        let t0 = Instant::now();
        // Samples a minute apart: the newest RECENT_MIN bound the tail, older ones do not.
        let w = window(t0, &[(0, 9.0), (60_000, 9.0), (120_000, 2.0), (180_000, 1.0), (240_000, 1.0), (300_000, 1.0)]);
        assert_eq!(tail(&w, 0.9), Some(2.0));
    }

    #[test]
    fn a_late_wake_marks_a_stall_but_the_usual_lateness_does_not() {
        let t0 = Instant::now();
        let mut s = Stalls::default();
        s.observe_wake(t0 + 100 * MS, 20 * MS, MS);
        assert!(!s.within(t0, t0 + 200 * MS), "20 ms late is a busy runtime, not a stall");
        s.observe_wake(t0 + 1000 * MS, 300 * MS, 10 * MS);
        assert!(s.within(t0 + 500 * MS, t0 + 800 * MS), "a batch running across the stall");
        assert!(s.within(t0 + 900 * MS, t0 + 1000 * MS), "a batch that ended as it was seen");
        assert!(!s.within(t0 + 200 * MS, t0 + 700 * MS), "a batch that ended before it");
        assert!(!s.within(t0 + 1000 * MS, t0 + 1100 * MS), "a batch that started after it");
        s.observe_wake(t0 + 2000 * MS, 40 * MS, 15 * MS);
        assert!(!s.within(t0 + 1900 * MS, t0 + 2000 * MS), "a throttled timer's usual lateness is no stall");
    }
}
