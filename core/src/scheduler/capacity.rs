//! What one replica of a request-level (batching) service serves: every worker running full
//! batches back to back. The figure the operator scales such a service by, and `plan` starts
//! from; a generation service's is [`crate::generation::capacity`]'s.

use std::time::Duration;

/// Requests a second one replica serves: `workers` running batches of `max_batch_size` rows every
/// `batch_time`, each request taking `rows_per_request` rows (at least one).
pub fn per_replica(workers: u32, max_batch_size: u32, batch_time: Duration, rows_per_request: f64) -> f64 {
    let secs = batch_time.as_secs_f64().max(1e-6);
    f64::from(workers * max_batch_size) / secs / rows_per_request.max(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_batches_of_whole_requests() {
        // 2 workers × 32 rows every 100 ms.
        assert_eq!(per_replica(2, 32, Duration::from_millis(100), 1.0), 640.0);
        // Requests of 4 rows each: a quarter as many.
        assert_eq!(per_replica(2, 32, Duration::from_millis(100), 4.0), 160.0);
        // A request is never less than a row.
        assert_eq!(per_replica(1, 32, Duration::from_millis(100), 0.5), 320.0);
    }
}
