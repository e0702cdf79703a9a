//! What every async shell's task shares (the batcher, the generation shell, the relay): the flag
//! that says it has stopped, its timer, and the arrival of its oldest queued request, which
//! `/metrics` turns into an age at scrape time without asking the task.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use std::time::Instant;
use tokio::sync::watch;

/// Marks a task stopped when it ends, however it ends (a panic included).
pub(crate) struct Stopped(pub(crate) watch::Sender<bool>);

impl Drop for Stopped {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

/// Sleeps until `wake`, or forever when there is nothing to wake for.
pub(crate) async fn sleep_until(wake: Option<Instant>) {
    match wake {
        Some(at) => ferry_core::clock::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The arrival of the oldest queued request, shared between a task (which sets it) and its
/// handles (which read it). Cheap to clone.
#[derive(Clone)]
pub(crate) struct OldestArrival {
    /// Nanoseconds since `epoch`; `u64::MAX` when the queue is empty.
    ns: Arc<AtomicU64>,
    epoch: Instant,
}

impl OldestArrival {
    pub(crate) fn new() -> Self {
        OldestArrival { ns: Arc::new(AtomicU64::new(u64::MAX)), epoch: ferry_core::clock::now() }
    }

    pub(crate) fn set(&self, oldest: Option<Instant>) {
        let ns = oldest.map_or(u64::MAX, |a| a.saturating_duration_since(self.epoch).as_nanos() as u64);
        self.ns.store(ns, Ordering::Relaxed);
    }

    /// Seconds the oldest queued request has waited by now (0 when empty).
    pub(crate) fn age(&self) -> f64 {
        match self.ns.load(Ordering::Relaxed) {
            u64::MAX => 0.0,
            ns => {
                ferry_core::clock::now().saturating_duration_since(self.epoch + Duration::from_nanos(ns)).as_secs_f64()
            }
        }
    }
}
