//! The one clock of the async crates (sidecar, operator, load): tokio's, so that tests on its
//! paused clock move it, read as a `std::time::Instant`, the type this crate's pure functions
//! take. Nothing else reads a clock: the workspace's clippy.toml forbids
//! `std::time::Instant::now()` and `elapsed()`. Feature `clock`, so that the pure core alone
//! needs no tokio.

use std::time::{Duration, Instant};

/// Now, on tokio's clock.
#[allow(clippy::disallowed_types)] // the one place tokio's instant is read
pub fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Time since `since`, on tokio's clock (zero if `since` is later).
pub fn elapsed(since: Instant) -> Duration {
    now().saturating_duration_since(since)
}

/// Sleeps until `at` on tokio's clock.
pub async fn sleep_until(at: Instant) {
    tokio::time::sleep_until(at.into()).await
}
