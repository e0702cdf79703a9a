//! When each request of an open-loop run is sent: a schedule fixed before the run starts, so that
//! a slow server cannot slow the client down and hide its own latency (coordinated omission).

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arrivals {
    /// Evenly spaced.
    Constant,
    /// Exponential gaps: independent users.
    Poisson,
}

/// Send offsets from the start of the run, for `rate` requests per second over `duration`.
pub fn schedule(arrivals: Arrivals, rate: f64, duration: Duration, seed: u64) -> Vec<Duration> {
    assert!(rate > 0.0, "the rate is positive");
    let end = duration.as_secs_f64();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = 0.0;
    let mut out = Vec::with_capacity((rate * end) as usize + 16);
    for i in 1u64.. {
        t = match arrivals {
            // Computed, not accumulated, so that rounding cannot add or drop a request.
            Arrivals::Constant => i as f64 / rate,
            // Inverse transform sampling of the exponential distribution.
            Arrivals::Poisson => t - (1.0 - rng.random::<f64>()).ln() / rate,
        };
        if t >= end {
            break;
        }
        out.push(Duration::from_secs_f64(t));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_arrivals_are_evenly_spaced() {
        let s = schedule(Arrivals::Constant, 100.0, Duration::from_secs(2), 0);
        assert_eq!(s.len(), 199);
        assert!((s[1] - s[0]).abs_diff(Duration::from_millis(10)) < Duration::from_micros(1));
    }

    #[test]
    fn poisson_arrivals_have_the_rate_on_average_and_vary() {
        let s = schedule(Arrivals::Poisson, 1000.0, Duration::from_secs(20), 7);
        let rate = s.len() as f64 / 20.0;
        assert!((rate - 1000.0).abs() < 30.0, "{rate}");
        let gaps: Vec<f64> = s.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        // An exponential's standard deviation equals its mean.
        assert!((var.sqrt() / mean - 1.0).abs() < 0.05, "cv {}", var.sqrt() / mean);
        assert_eq!(s, schedule(Arrivals::Poisson, 1000.0, Duration::from_secs(20), 7), "seeded");
    }
}
