//! What a generation run measured, one sample per request, and its summary: goodput (requests
//! that met all their deadlines — first token by its TTFT deadline, the whole answer by its
//! completion deadline), TTFT and inter-token percentiles, tokens per second.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

use super::trace::Request;

/// One request.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub request: Request,
    /// HTTP status of the answer; `None` when none came (connection error).
    pub status: Option<u16>,
    /// From the request's scheduled arrival to its first token.
    pub first: Option<Duration>,
    /// Between consecutive tokens.
    pub gaps: Vec<Duration>,
    /// From its scheduled arrival to its end (the last token, the error, or the refusal).
    pub end: Option<Duration>,
    pub tokens: u32,
    /// Its prompt's tokens, as the server's `usage` counted them (0 when it sent none).
    pub prompt_tokens: u32,
    /// It finished (`finish_reason`, and `[DONE]` for a stream).
    pub completed: bool,
}

impl Sample {
    /// Finished, with its first token and its whole answer in time.
    pub fn good(&self) -> bool {
        self.completed
            && self.first.is_some_and(|f| f <= self.request.ttft)
            && self.end.is_some_and(|e| e <= self.request.timeout)
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Summary {
    pub sent: u64,
    pub completed: u64,
    /// Refused before any token (503).
    pub refused: u64,
    /// Admitted but not finished (cut at a deadline, or failed).
    pub cut: u64,
    /// No answer at all: the connection was refused or dropped before any status came (a
    /// server that was not there, or went away).
    pub unanswered: u64,
    /// Finished, but with the first token or the last after its deadline.
    pub late: u64,
    pub goodput_rps: f64,
    /// Share of all requests that met all their deadlines.
    pub good_share: f64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    /// Tokens delivered per second, and those of requests that met their deadlines.
    pub tokens_per_s: f64,
    pub good_tokens_per_s: f64,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds")
}

fn quantile_ms(h: &Histogram<u64>, q: f64) -> Option<f64> {
    (!h.is_empty()).then(|| h.value_at_quantile(q) as f64 / 1000.0)
}

impl Summary {
    pub fn of(samples: &[Sample], duration: Duration) -> Summary {
        let (mut ttft, mut itl) = (histogram(), histogram());
        let secs = duration.as_secs_f64();
        let mut s = Summary {
            sent: samples.len() as u64,
            completed: 0,
            refused: 0,
            cut: 0,
            unanswered: 0,
            late: 0,
            goodput_rps: 0.0,
            good_share: 0.0,
            ttft_p50_ms: None,
            ttft_p99_ms: None,
            itl_p99_ms: None,
            tokens_per_s: 0.0,
            good_tokens_per_s: 0.0,
        };
        let (mut tokens, mut good_tokens, mut good) = (0u64, 0u64, 0u64);
        for sample in samples {
            if let Some(first) = sample.first {
                ttft.saturating_record(first.as_micros().max(1) as u64);
            }
            for gap in &sample.gaps {
                itl.saturating_record(gap.as_micros().max(1) as u64);
            }
            tokens += u64::from(sample.tokens);
            if sample.completed {
                s.completed += 1;
            } else if sample.tokens == 0 && sample.status == Some(503) {
                s.refused += 1;
            } else if sample.status.is_none() {
                s.unanswered += 1;
            } else {
                s.cut += 1;
            }
            if sample.good() {
                good += 1;
                good_tokens += u64::from(sample.tokens);
            } else if sample.completed {
                s.late += 1;
            }
        }
        s.goodput_rps = good as f64 / secs;
        s.good_share = if samples.is_empty() { 0.0 } else { good as f64 / samples.len() as f64 };
        s.ttft_p50_ms = quantile_ms(&ttft, 0.5);
        s.ttft_p99_ms = quantile_ms(&ttft, 0.99);
        s.itl_p99_ms = quantile_ms(&itl, 0.99);
        s.tokens_per_s = tokens as f64 / secs;
        s.good_tokens_per_s = good_tokens as f64 / secs;
        s
    }
}

/// The summary as Markdown table rows' cells: goodput, share, TTFT p50/p99, ITL p99, tokens/s.
pub fn cells(s: &Summary) -> String {
    let ms = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.0}"));
    format!(
        "{:.2} | {:.1} % | {:.1} % | {} / {} | {} | {:.0} | {:.0}",
        s.goodput_rps,
        s.good_share * 100.0,
        s.refused as f64 * 100.0 / s.sent.max(1) as f64,
        ms(s.ttft_p50_ms),
        ms(s.ttft_p99_ms),
        s.itl_p99_ms.map_or("–".to_owned(), |v| format!("{v:.1}")),
        s.tokens_per_s,
        s.good_tokens_per_s
    )
}

/// The header matching [`cells`].
pub const HEADER: &str = "goodput (req/s) | met all deadlines | refused early | TTFT p50 / p99 ms | ITL p99 ms | tokens/s | tokens/s in time";

#[cfg(test)]
mod tests {
    use super::*;

    fn request(ttft_ms: u64, timeout_ms: u64) -> Request {
        Request {
            at: Duration::ZERO,
            prompt: 4,
            max_tokens: 3,
            ttft: Duration::from_millis(ttft_ms),
            itl: Duration::from_millis(50),
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    fn sample(first_ms: u64, end_ms: u64, completed: bool) -> Sample {
        Sample {
            request: request(100, 300),
            status: Some(200),
            first: Some(Duration::from_millis(first_ms)),
            gaps: vec![Duration::from_millis(10); 2],
            end: Some(Duration::from_millis(end_ms)),
            tokens: 3,
            prompt_tokens: 8,
            completed,
        }
    }

    #[test]
    fn goodput_counts_only_requests_that_met_every_deadline() {
        let refused =
            Sample { status: Some(503), first: None, gaps: vec![], end: None, tokens: 0, ..sample(0, 0, false) };
        let gone = Sample { status: None, first: None, gaps: vec![], end: None, tokens: 0, ..sample(0, 0, false) };
        let samples = vec![
            sample(50, 200, true),
            sample(150, 200, true),
            sample(50, 400, true),
            sample(50, 200, false),
            refused,
            gone,
        ];
        let s = Summary::of(&samples, Duration::from_secs(1));
        assert_eq!((s.sent, s.completed, s.refused, s.cut, s.unanswered, s.late), (6, 3, 1, 1, 1, 2));
        assert_eq!(s.goodput_rps, 1.0, "a late first token, a late end and an unfinished one are not good");
        assert_eq!(s.tokens_per_s, 12.0);
        assert_eq!(s.good_tokens_per_s, 3.0);
        let itl = s.itl_p99_ms.unwrap();
        assert!((itl - 10.0).abs() < 0.02, "{itl}");
    }
}
