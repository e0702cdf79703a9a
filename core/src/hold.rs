//! The holder's admission (DESIGN.md, "Scale to zero"): while a service has no ready pod, its
//! requests wait in the holder — the ones that can still be served in time. A request whose
//! deadline falls before the service's pods are expected to be ready is refused at once, with
//! `Retry-After` the start-up left, rather than held to fail at its deadline; the rest is held,
//! bounded in count and bytes, and released in deadline order once a pod is ready.
//!
//! The expected readiness is an estimate, and like every estimate behind a "no" it must be able to
//! learn it was wrong: a start-up running past it holds what comes (readiness could be any moment
//! now) rather than refusing everything until a pod shows up. Held requests are still answered at
//! their deadlines, by the shell.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::outcome::{Outcome, Refusal};

/// What the operator tells the holder of one service it may hold for (`PUT
/// /services/{namespace}/{name}` on the holder's admin port, every autoscaler tick): a contract
/// between the two processes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceState {
    /// A generation service: the deadline held to is the first token's.
    pub generation: bool,
    /// The deadline of a request that names none, and the longest one may name
    /// (`batching.latencyBudget`, as its pods take it).
    pub latency_budget_ms: u64,
    /// A generation service's default first-token deadline (`generation.ttftBudget`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_budget_ms: Option<u64>,
    /// [`Startup::time_to_ready`].
    pub time_to_ready_ms: u64,
    /// How long its oldest unready pod had been starting when this was sent; `None`: none is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starting_for_ms: Option<u64>,
    /// Its ready pods' API addresses (`IP:PORT`): empty while it is at zero or starting.
    pub endpoints: Vec<String>,
}

/// When a service at zero will have a ready pod, as the operator last said.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Startup {
    /// The service's time from asking for a pod to its serving (measured, or its
    /// `startupTime`), and the autoscaler's reaction.
    pub time_to_ready: Duration,
    /// Since when its oldest unready pod has been starting; `None`: none is (the next decision
    /// asks for one: the whole start-up is ahead).
    pub starting_since: Option<Instant>,
}

impl Startup {
    /// The expected readiness: never before `now` (a start-up past its estimate may end at any moment).
    pub fn ready_at(&self, now: Instant) -> Instant {
        match self.starting_since {
            Some(since) => (since + self.time_to_ready).max(now),
            None => now + self.time_to_ready,
        }
    }
}

/// How much one service may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub requests: usize,
    pub bytes: usize,
}

/// Where a held request is: its deadline first, so that iteration is deadline order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key {
    deadline: Instant,
    seq: u64,
}

/// The requests one service holds, in deadline order.
#[derive(Debug)]
pub struct Held<T> {
    entries: BTreeMap<Key, (Instant, usize, T)>,
    bytes: usize,
    seq: u64,
}

impl<T> Default for Held<T> {
    fn default() -> Self {
        Held { entries: BTreeMap::new(), bytes: 0, seq: 0 }
    }
}

impl<T> Held<T> {
    /// Holds `item` (a request of `bytes` whose deadline — for a generation, its first token's — is
    /// `deadline`), or refuses it: `infeasible` when the deadline falls before the expected
    /// readiness, `queue_full` beyond the bounds; both with `Retry-After` the start-up left.
    pub fn admit(
        &mut self,
        now: Instant,
        deadline: Instant,
        bytes: usize,
        startup: &Startup,
        bounds: &Bounds,
        item: T,
    ) -> Result<Key, (Refusal, T)> {
        let ready_at = startup.ready_at(now);
        let left = ready_at - now;
        if deadline < ready_at {
            let message = format!(
                "the service is scaled to zero and its first pod is expected ready in {} ms, after this request's \
                 deadline (in {} ms)",
                left.as_millis(),
                deadline.saturating_duration_since(now).as_millis()
            );
            return Err((Refusal::new(Outcome::Infeasible, message).retry_after(left), item));
        }
        if self.entries.len() >= bounds.requests || self.bytes + bytes > bounds.bytes {
            let message = format!(
                "the service is scaled to zero and the holder holds {} requests ({} bytes) for it already, at most {} \
                 ({} bytes); its first pod is expected ready in {} ms",
                self.entries.len(),
                self.bytes,
                bounds.requests,
                bounds.bytes,
                left.as_millis()
            );
            return Err((Refusal::new(Outcome::QueueFull, message).retry_after(left), item));
        }
        self.seq += 1;
        let key = Key { deadline, seq: self.seq };
        self.entries.insert(key, (now, bytes, item));
        self.bytes += bytes;
        Ok(key)
    }

    /// Takes out one held request (its deadline passed, or its client left); `None` if it was
    /// released already.
    pub fn remove(&mut self, key: Key) -> Option<T> {
        let (_, bytes, item) = self.entries.remove(&key)?;
        self.bytes -= bytes;
        Some(item)
    }

    /// Everything held, in deadline order (the earliest first), emptying the holder.
    pub fn release(&mut self) -> Vec<T> {
        self.bytes = 0;
        std::mem::take(&mut self.entries).into_values().map(|(_, _, item)| item).collect()
    }

    /// Takes out what is held past its deadline (before `now`), in deadline order.
    pub fn expire(&mut self, now: Instant) -> Vec<T> {
        let mut expired = Vec::new();
        while let Some(entry) = self.entries.first_entry().filter(|e| e.key().deadline < now) {
            let (_, bytes, item) = entry.remove();
            self.bytes -= bytes;
            expired.push(item);
        }
        expired
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// How long the longest-held request has waited (zero when none is).
    pub fn oldest(&self, now: Instant) -> Duration {
        self.entries.values().map(|(at, _, _)| now.saturating_duration_since(*at)).max().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const BOUNDS: Bounds = Bounds { requests: 3, bytes: 100 };

    #[test]
    fn a_deadline_before_the_start_up_is_refused_at_once_with_the_start_up_left() {
        let t0 = Instant::now();
        let startup = Startup { time_to_ready: 5000 * MS, starting_since: None };
        let mut held = Held::default();
        let (refusal, item) = held.admit(t0, t0 + 4999 * MS, 10, &startup, &BOUNDS, "short").unwrap_err();
        assert_eq!((refusal.outcome, item), (Outcome::Infeasible, "short"));
        assert_eq!(refusal.retry_after, Some(5000 * MS));
        assert!(
            refusal.message.contains("in 5000 ms") && refusal.message.contains("(in 4999 ms)"),
            "{}",
            refusal.message
        );
        assert!(held.admit(t0, t0 + 5000 * MS, 10, &startup, &BOUNDS, "long").is_ok());
        // A pod starting for 2 s: 3 s left, and Retry-After says so.
        let starting = Startup { time_to_ready: 5000 * MS, starting_since: Some(t0) };
        let now = t0 + 2000 * MS;
        let (refusal, _) = held.admit(now, now + 2999 * MS, 10, &starting, &BOUNDS, "x").unwrap_err();
        assert_eq!((refusal.retry_after, refusal.retry_after_secs()), (Some(3000 * MS), Some(3)));
        assert!(held.admit(now, now + 3000 * MS, 10, &starting, &BOUNDS, "y").is_ok());
    }

    #[test]
    fn a_start_up_past_its_estimate_holds_rather_than_refuses() {
        let t0 = Instant::now();
        let late = Startup { time_to_ready: 5000 * MS, starting_since: Some(t0) };
        let now = t0 + 9000 * MS;
        assert_eq!(late.ready_at(now), now);
        let mut held = Held::default();
        assert!(held.admit(now, now + MS, 1, &late, &BOUNDS, ()).is_ok());
    }

    #[test]
    fn holding_is_bounded_in_count_and_bytes_and_released_in_deadline_order() {
        let t0 = Instant::now();
        let ready = Startup { time_to_ready: Duration::ZERO, starting_since: None };
        let mut held = Held::default();
        let late = held.admit(t0, t0 + 900 * MS, 40, &ready, &BOUNDS, "late").unwrap();
        held.admit(t0 + MS, t0 + 300 * MS, 40, &ready, &BOUNDS, "soon").unwrap();
        // 80 + 30 bytes is over 100: refused, nothing else lost.
        let (refusal, _) = held.admit(t0, t0 + 500 * MS, 30, &ready, &BOUNDS, "big").unwrap_err();
        assert_eq!(refusal.outcome, Outcome::QueueFull);
        assert!(refusal.message.contains("holds 2 requests (80 bytes)"), "{}", refusal.message);
        held.admit(t0 + 2 * MS, t0 + 600 * MS, 20, &ready, &BOUNDS, "middle").unwrap();
        let (refusal, _) = held.admit(t0, t0 + 500 * MS, 0, &ready, &BOUNDS, "fourth").unwrap_err();
        assert_eq!(refusal.outcome, Outcome::QueueFull);
        assert_eq!((held.len(), held.bytes(), held.oldest(t0 + 10 * MS)), (3, 100, 10 * MS));
        // The latest deadline's client left: out, its bytes with it.
        assert_eq!(held.remove(late), Some("late"));
        assert_eq!(held.remove(late), None);
        assert_eq!(held.bytes(), 60);
        assert_eq!(held.expire(t0 + 300 * MS), Vec::<&str>::new(), "a deadline at `now` is not past");
        assert_eq!(held.expire(t0 + 301 * MS), vec!["soon"]);
        assert_eq!(held.bytes(), 20);
        held.admit(t0 + 2 * MS, t0 + 300 * MS, 40, &ready, &BOUNDS, "soon").unwrap();
        assert_eq!(held.release(), vec!["soon", "middle"]);
        assert!(held.is_empty() && held.bytes() == 0);
    }
}
