//! What a run measured: one sample per request, summarised into outcome counts, goodput, latency
//! percentiles (HDR histograms) and batch fill, overall and per second.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// One request.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// When it was scheduled to be sent, from the start of the run.
    pub scheduled: Duration,
    /// From its scheduled send time to the end of its answer.
    pub latency: Duration,
    /// HTTP status; `None` when no answer came (connection error).
    pub status: Option<u16>,
    /// Its deadline, relative.
    pub deadline: Duration,
    /// `x-ferry-batch-size` of a 200.
    pub batch_rows: Option<u32>,
    /// `server-timing` total of a 200, in ms: the time the sidecar took.
    pub server_ms: Option<f64>,
    /// Which of the run's tenants sent it (`--tenants`).
    pub tenant: Option<usize>,
}

impl Sample {
    fn ok(&self) -> bool {
        self.status == Some(200)
    }

    /// Answered 200 within its deadline, as the client saw it.
    pub fn in_time(&self) -> bool {
        self.ok() && self.latency <= self.deadline
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Second {
    pub second: u64,
    pub sent: u64,
    pub ok: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Summary {
    pub sent: u64,
    pub duration_s: f64,
    /// Answers by status ("200", "503", ...; "error" when none came).
    pub statuses: BTreeMap<String, u64>,
    /// 200s within their deadline, per second.
    pub goodput_rps: f64,
    /// Share of all requests answered 200 within their deadline.
    pub within_deadline: f64,
    /// Share refused at admission (503).
    pub rejected: f64,
    /// 200s that the client received after their deadline.
    pub late_client: u64,
    /// 200s whose own server-timing passed their deadline (the sidecar's promise).
    pub late_server: u64,
    /// Latency of 200 answers, ms (from the scheduled send time).
    pub latency_ms: Option<Percentiles>,
    /// Mean rows of the batches 200 answers rode in, over the batch cap.
    pub batch_fill: Option<f64>,
    pub per_second: Vec<Second>,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds")
}

fn percentiles(h: &Histogram<u64>) -> Option<Percentiles> {
    (!h.is_empty()).then(|| {
        let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        Percentiles { p50: ms(0.5), p90: ms(0.9), p99: ms(0.99), p999: ms(0.999), max: h.max() as f64 / 1000.0 }
    })
}

impl Summary {
    pub fn of(samples: &[Sample], duration: Duration, max_batch_size: Option<u32>) -> Summary {
        let mut statuses = BTreeMap::new();
        let mut all = histogram();
        let mut per_second: BTreeMap<u64, (u64, u64, Histogram<u64>)> = BTreeMap::new();
        let (mut in_time, mut late_client, mut late_server, mut rejected) = (0u64, 0u64, 0u64, 0u64);
        let (mut rows, mut batches) = (0u64, 0u64);
        for s in samples {
            let key = s.status.map_or_else(|| "error".to_owned(), |c| c.to_string());
            *statuses.entry(key).or_insert(0) += 1;
            let second = per_second.entry(s.scheduled.as_secs()).or_insert_with(|| (0, 0, histogram()));
            second.0 += 1;
            if s.status == Some(503) {
                rejected += 1;
            }
            if !s.ok() {
                continue;
            }
            let us = (s.latency.as_micros() as u64).max(1);
            all.saturating_record(us);
            second.1 += 1;
            second.2.saturating_record(us);
            if s.in_time() {
                in_time += 1;
            } else {
                late_client += 1;
            }
            if s.server_ms.is_some_and(|ms| ms > s.deadline.as_secs_f64() * 1000.0) {
                late_server += 1;
            }
            if let Some(r) = s.batch_rows {
                rows += u64::from(r);
                batches += 1;
            }
        }
        let sent = samples.len() as u64;
        let share = |n: u64| if sent == 0 { 0.0 } else { n as f64 / sent as f64 };
        Summary {
            sent,
            duration_s: duration.as_secs_f64(),
            statuses,
            goodput_rps: in_time as f64 / duration.as_secs_f64(),
            within_deadline: share(in_time),
            rejected: share(rejected),
            late_client,
            late_server,
            latency_ms: percentiles(&all),
            batch_fill: max_batch_size.filter(|_| batches > 0).map(|cap| rows as f64 / batches as f64 / f64::from(cap)),
            per_second: per_second
                .into_iter()
                .map(|(second, (sent, ok, h))| {
                    let p = percentiles(&h);
                    Second {
                        second,
                        sent,
                        ok,
                        p50_ms: p.as_ref().map_or(0.0, |p| p.p50),
                        p99_ms: p.as_ref().map_or(0.0, |p| p.p99),
                    }
                })
                .collect(),
        }
    }

    pub fn count(&self, status: &str) -> u64 {
        self.statuses.get(status).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at_ms: u64, latency_ms: u64, status: u16, rows: u32) -> Sample {
        Sample {
            scheduled: Duration::from_millis(at_ms),
            latency: Duration::from_millis(latency_ms),
            status: Some(status),
            deadline: Duration::from_millis(200),
            batch_rows: (status == 200).then_some(rows),
            server_ms: (status == 200).then_some(latency_ms as f64 - 1.0),
            tenant: None,
        }
    }

    #[test]
    fn goodput_counts_only_answers_within_their_deadline() {
        let samples = [
            sample(0, 110, 200, 2),
            sample(100, 150, 200, 2),
            sample(500, 250, 200, 4), // late
            sample(900, 1, 503, 0),
            sample(1500, 120, 200, 4),
        ];
        let s = Summary::of(&samples, Duration::from_secs(2), Some(4));
        assert_eq!(s.sent, 5);
        assert_eq!(s.count("200"), 4);
        assert_eq!(s.count("503"), 1);
        assert_eq!(s.goodput_rps, 1.5);
        assert_eq!(s.within_deadline, 0.6);
        assert_eq!(s.rejected, 0.2);
        assert_eq!((s.late_client, s.late_server), (1, 1));
        assert_eq!(s.batch_fill, Some(0.75));
        assert_eq!(s.per_second.len(), 2);
        assert_eq!((s.per_second[0].sent, s.per_second[0].ok), (4, 3));
        let p = s.latency_ms.unwrap();
        assert!((p.p50 - 120.0).abs() < 0.2 && (p.max - 250.0).abs() < 0.3, "{p:?}");
    }
}
