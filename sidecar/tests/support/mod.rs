//! Starts the real `ferry-sidecar` binary on 127.0.0.1 with ephemeral ports, for black-box tests.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// One worker, one row per batch, 600 ms batches, a 5 s budget: requests queue behind the one
/// running long enough for a test to look at them.
pub const ONE_SLOW_WORKER: &[&str] =
    &["--model", "m", "--sim-batch-time", "600ms", "--max-batch-size", "1", "--latency-budget", "5s"];

pub struct Sidecar {
    pub child: Child,
    pub api: SocketAddr,
    pub admin: SocketAddr,
    pub http: reqwest::Client,
}

impl Sidecar {
    /// Starts the binary with `args` (after the listen flags) and waits for its "listening" line.
    pub async fn start(args: &[&str]) -> Sidecar {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferry-sidecar"))
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("the sidecar binary starts");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the sidecar says where it listens within 30 s")
            .unwrap()
            .expect("a line on stdout");
        // "ferry-sidecar listening on http://A (metrics on http://B)"
        let addrs: Vec<SocketAddr> = line
            .split("http://")
            .skip(1)
            .map(|s| s.trim_end_matches(')').split_whitespace().next().unwrap().trim_end_matches(')').parse().unwrap())
            .collect();
        Sidecar { child, api: addrs[0], admin: addrs[1], http: reqwest::Client::new() }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.api, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// POSTs an infer request to `model` with `headers`.
    pub async fn infer(&self, model: &str, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
        let mut request = self.http.post(self.url(&format!("/v2/models/{model}/infer"))).json(body);
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        request.send().await.expect("the sidecar answers")
    }

    pub async fn metrics(&self) -> String {
        self.http.get(self.admin_url("/metrics")).send().await.unwrap().text().await.unwrap()
    }

    /// The value of `ferry_requests_total{outcome}` for the first model.
    pub async fn outcome(&self, outcome: &str) -> u64 {
        metric_value(&self.metrics().await, "ferry_requests_total", &format!("outcome=\"{outcome}\"")) as u64
    }

    pub fn terminate(&self) {
        let pid = self.child.id().expect("still running");
        let status = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
        assert!(status.success());
    }
}

/// The value of the first sample of `name` whose labels contain `label`, of a served model (not
/// the series of requests for no model, `model=""`).
pub fn metric_value(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{') && l.contains(label))
        .filter(|l| !l.contains("model=\"\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .next()
        .unwrap_or_else(|| panic!("no sample {name} with {label} in:\n{text}"))
}

/// A one-input FP32 request whose rows are `rows`.
pub fn body(rows: &[Vec<f32>]) -> Value {
    let width = rows.first().map_or(0, Vec::len);
    json!({
        "inputs": [{"name": "INPUT0", "shape": [rows.len(), width], "datatype": "FP32", "data": rows}]
    })
}

/// Milliseconds of one part of a `server-timing` header.
pub fn timing(response: &reqwest::Response, part: &str) -> f64 {
    let header = response.headers()["server-timing"].to_str().unwrap();
    header
        .split(", ")
        .find_map(|p| p.strip_prefix(&format!("{part};dur=")))
        .unwrap_or_else(|| panic!("no {part} in {header}"))
        .parse()
        .unwrap()
}
