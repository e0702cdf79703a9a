//! The metrics exposition checked by Prometheus' own tools: `promtool check metrics` lints it,
//! and a real Prometheus server (Debian's package) scrapes the sidecar and answers queries.

mod support;

use std::io::Write;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use support::{body, Sidecar};
use tokio::process::Command;

fn tool(name: &str) -> String {
    let path = format!("/usr/bin/{name}");
    assert!(
        std::path::Path::new(&path).exists(),
        "{path} is missing: install Debian's 'prometheus' package (scripts/test.sh does)"
    );
    path
}

#[tokio::test]
async fn promtool_finds_no_problem_in_the_exposition() {
    let s = Sidecar::start(&["--model", "m", "--sim-batch-time", "5ms"]).await;
    for _ in 0..3 {
        assert_eq!(s.infer("m", &body(&[vec![1.0]]), &[]).await.status(), 200);
    }
    let text = s.metrics().await;
    let mut child = std::process::Command::new(tool("promtool"))
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && said.trim().is_empty(), "promtool: {said}");
}

#[tokio::test]
async fn a_real_prometheus_scrapes_the_sidecar() {
    let s = Sidecar::start(&["--model", "m", "--sim-batch-time", "5ms"]).await;
    for _ in 0..5 {
        assert_eq!(s.infer("m", &body(&[vec![1.0]]), &[]).await.status(), 200);
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global: {{scrape_interval: 1s}}\nscrape_configs:\n  - job_name: ferry\n    static_configs: [{{targets: ['{}']}}]\n",
            s.admin
        ),
    )
    .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let _prometheus = Command::new(tool("prometheus"))
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let query =
        format!("http://127.0.0.1:{port}/api/v1/query?query=ferry_requests_total{{outcome=\"ok\",model=\"m\"}}");
    let found = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Ok(r) = s.http.get(&query).send().await {
                if let Ok(v) = r.json::<Value>().await {
                    if let Some(sample) = v["data"]["result"].as_array().and_then(|r| r.first()) {
                        return sample.clone();
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("Prometheus scraped the sidecar within 60 s");
    assert_eq!(sample_value(&found), "5");
    assert_eq!(found["metric"]["version"], "1");
}

fn sample_value(sample: &Value) -> &str {
    sample["value"][1].as_str().unwrap()
}
