//! The open-loop driver: sends each request at its scheduled time, whether or not earlier ones
//! have returned, and measures each latency from that scheduled time, so a stalled server shows
//! up as latency instead of as a client that politely slowed down.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferry_core::clock::sleep_until;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinSet;

use crate::record::Sample;
use crate::schedule::{schedule, Arrivals};
use crate::tenants::{pick, LoadTenant};

/// One open-loop run.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// The infer endpoint, e.g. `http://127.0.0.1:8080/v2/models/m/infer`.
    pub url: String,
    /// Requests per second.
    pub rate: f64,
    pub duration: Duration,
    pub arrivals: Arrivals,
    /// The deadline each request is judged against.
    pub deadline: Duration,
    /// Whether to send that deadline as `x-ferry-timeout-ms` (otherwise the service's budget
    /// applies on the server).
    pub send_deadline: bool,
    /// Rows per request, and elements per row.
    pub rows: u32,
    pub width: u32,
    /// Share of requests sent as `x-ferry-priority: batch`.
    pub batch_share: f64,
    /// Callers, each sending its share with its own `authorization: Bearer` token (none: no header).
    pub tenants: Vec<LoadTenant>,
    pub seed: u64,
    /// HTTP/2 connections the requests are spread over.
    pub connections: usize,
    /// How long to wait for answers after the last request was sent.
    pub drain: Duration,
}

impl LoadSpec {
    pub fn new(url: impl Into<String>, rate: f64, duration: Duration) -> Self {
        LoadSpec {
            url: url.into(),
            rate,
            duration,
            arrivals: Arrivals::Poisson,
            deadline: Duration::from_millis(200),
            send_deadline: false,
            rows: 1,
            width: 4,
            batch_share: 0.0,
            tenants: Vec::new(),
            seed: 1,
            connections: 16,
            drain: Duration::from_secs(60),
        }
    }
}

/// HTTP/2 clients (prior knowledge: plain-text h2, as the sidecar and the echo server speak it),
/// so that thousands of requests in flight need a handful of connections.
pub fn clients(n: usize) -> anyhow::Result<Vec<reqwest::Client>> {
    (0..n.max(1))
        .map(|_| {
            reqwest::Client::builder()
                .http2_prior_knowledge()
                .timeout(Duration::from_secs(120))
                .build()
                .map_err(Into::into)
        })
        .collect()
}

/// Bodies for `rows` × `width` FP32 requests, a few variants so that rows differ.
pub fn bodies(rows: u32, width: u32, seed: u64) -> Vec<Bytes> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..16)
        .map(|_| {
            let data: Vec<Vec<f32>> =
                (0..rows).map(|_| (0..width).map(|_| (rng.random_range(-1000..1000) as f32) / 8.0).collect()).collect();
            let body = serde_json::json!({
                "inputs": [{"name": "INPUT0", "shape": [rows, width], "datatype": "FP32", "data": data}]
            });
            Bytes::from(serde_json::to_vec(&body).expect("serializable"))
        })
        .collect()
}

#[derive(Default)]
struct Progress {
    sent: AtomicU64,
    ok: AtomicU64,
    other: AtomicU64,
}

/// Runs `spec`; returns one sample per scheduled request. With `progress`, prints a live line to
/// a terminal on stderr.
pub async fn run(spec: &LoadSpec, progress: bool) -> anyhow::Result<Vec<Sample>> {
    let clients = clients(spec.connections)?;
    let bodies = bodies(spec.rows, spec.width, spec.seed);
    let offsets = schedule(spec.arrivals, spec.rate, spec.duration, spec.seed);
    let mut rng = StdRng::seed_from_u64(spec.seed ^ 0x5eed);
    let counters = Arc::new(Progress::default());
    let start = ferry_core::clock::now() + Duration::from_millis(50);
    let ticker = (progress && std::io::stderr().is_terminal()).then(|| {
        let (counters, total) = (counters.clone(), spec.duration);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let elapsed = ferry_core::clock::elapsed(start).min(total).as_secs();
                eprint!(
                    "\r[{elapsed:>3}/{} s] sent {:>7}  ok {:>7}  other {:>6}   ",
                    total.as_secs(),
                    counters.sent.load(Ordering::Relaxed),
                    counters.ok.load(Ordering::Relaxed),
                    counters.other.load(Ordering::Relaxed)
                );
            }
        })
    });

    let mut tasks = JoinSet::new();
    let mut sent_by: Vec<(Duration, usize)> = Vec::new();
    for (i, offset) in offsets.iter().enumerate() {
        let scheduled = start + *offset;
        sleep_until(scheduled).await;
        let mut request = clients[i % clients.len()].post(&spec.url).header("content-type", "application/json");
        if spec.send_deadline {
            request = request.header("x-ferry-timeout-ms", spec.deadline.as_millis().to_string());
        }
        if spec.batch_share > 0.0 && rng.random_bool(spec.batch_share.min(1.0)) {
            request = request.header("x-ferry-priority", "batch");
        }
        let tenant = (!spec.tenants.is_empty()).then(|| pick(&spec.tenants, &mut rng));
        if let Some(t) = tenant {
            sent_by.push((*offset, t));
            request = request.header("authorization", format!("Bearer {}", spec.tenants[t].token));
        }
        let request = request.body(bodies[i % bodies.len()].clone());
        let (deadline, offset, counters) = (spec.deadline, *offset, counters.clone());
        counters.sent.fetch_add(1, Ordering::Relaxed);
        tasks.spawn(async move {
            let sample = match request.send().await {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let header =
                        |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
                    let batch_rows = header("x-ferry-batch-size").and_then(|v| v.parse().ok());
                    let server_ms = header("server-timing").and_then(|t| total_ms(&t));
                    let answered = response.bytes().await.is_ok();
                    Sample {
                        scheduled: offset,
                        latency: ferry_core::clock::elapsed(scheduled),
                        status: answered.then_some(status),
                        deadline,
                        batch_rows,
                        server_ms,
                        tenant,
                    }
                }
                Err(_) => Sample {
                    scheduled: offset,
                    latency: ferry_core::clock::elapsed(scheduled),
                    status: None,
                    deadline,
                    batch_rows: None,
                    server_ms: None,
                    tenant,
                },
            };
            let counter = if sample.status == Some(200) { &counters.ok } else { &counters.other };
            counter.fetch_add(1, Ordering::Relaxed);
            sample
        });
    }
    let mut samples = Vec::with_capacity(offsets.len());
    let _ = tokio::time::timeout(spec.drain, async {
        while let Some(sample) = tasks.join_next().await {
            samples.push(sample.expect("a request task does not panic"));
        }
    })
    .await;
    // Whatever is still unanswered `drain` after the last send is long past its deadline: it
    // counts as a request without an answer.
    let answered: std::collections::HashSet<Duration> = samples.iter().map(|s| s.scheduled).collect();
    let tenant_of: std::collections::HashMap<Duration, usize> = sent_by.into_iter().collect();
    tasks.abort_all();
    for offset in &offsets {
        if !answered.contains(offset) {
            samples.push(Sample {
                scheduled: *offset,
                latency: spec.duration + spec.drain - *offset,
                status: None,
                deadline: spec.deadline,
                batch_rows: None,
                server_ms: None,
                tenant: tenant_of.get(offset).copied(),
            });
        }
    }
    if let Some(t) = ticker {
        t.abort();
        eprintln!();
    }
    samples.sort_by_key(|s| s.scheduled);
    Ok(samples)
}

/// The `total` of a `server-timing` header, in ms.
pub fn total_ms(header: &str) -> Option<f64> {
    header.split(',').find_map(|part| part.trim().strip_prefix("total;dur=")).and_then(|v| v.parse().ok())
}

/// Closed loop: `concurrency` callers send back to back for `duration`; returns answers (200)
/// per second. The most a server sustains, for the overhead comparison.
pub async fn max_throughput(url: &str, concurrency: usize, duration: Duration) -> anyhow::Result<f64> {
    let clients = clients(8)?;
    let body = bodies(1, 4, 3).remove(0);
    let end = ferry_core::clock::now() + duration;
    let mut tasks = JoinSet::new();
    for i in 0..concurrency {
        let (client, url, body) = (clients[i % clients.len()].clone(), url.to_owned(), body.clone());
        tasks.spawn(async move {
            let mut ok = 0u64;
            while ferry_core::clock::now() < end {
                if let Ok(r) =
                    client.post(&url).header("content-type", "application/json").body(body.clone()).send().await
                {
                    if r.status() == 200 && r.bytes().await.is_ok() {
                        ok += 1;
                    }
                }
            }
            ok
        });
    }
    let mut total = 0;
    while let Some(ok) = tasks.join_next().await {
        total += ok?;
    }
    Ok(total as f64 / duration.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_timing_total_is_read() {
        assert_eq!(total_ms("queue;dur=10.5, batch;dur=100.2, total;dur=110.9"), Some(110.9));
        assert_eq!(total_ms("queue;dur=1"), None);
    }
}
