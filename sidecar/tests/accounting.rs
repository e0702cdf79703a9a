//! Every request the API receives for inference is counted once in `ferry_requests_total`, under
//! the outcome its caller got: valid, malformed, unknown-model, oversized, too many rows, an
//! idempotency conflict and a replay, an unknown path. A request for a model (or version) this
//! sidecar does not serve counts in the series of no model (`model=""`), never against one it does.

mod support;

use support::{body, Sidecar};

/// `(model label, outcome label) -> value` of every `ferry_requests_total` sample.
fn requests(text: &str) -> Vec<(String, String, f64)> {
    text.lines()
        .filter(|l| l.starts_with("ferry_requests_total{"))
        .map(|l| {
            let label = |name: &str| {
                let start = l.find(&format!("{name}=\"")).map(|i| i + name.len() + 2).unwrap();
                l[start..].split('"').next().unwrap().to_owned()
            };
            (label("model"), label("outcome"), l.rsplit(' ').next().unwrap().parse().unwrap())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_is_counted_once_under_the_outcome_its_caller_got() {
    let s = Sidecar::start(&[
        "--model",
        "m",
        "--sim-batch-time",
        "5ms",
        "--max-batch-size",
        "4",
        "--max-request-bytes",
        "2000",
        "--latency-budget",
        "2s",
    ])
    .await;
    let post =
        |path: &str, body: String| s.http.post(s.url(path)).header("content-type", "application/json").body(body);
    let mut sent = 0;
    let mut statuses = Vec::new();
    let mut expect = |status: u16, got: reqwest::StatusCode| {
        sent += 1;
        statuses.push((status, got.as_u16()));
    };
    for i in 0..5 {
        expect(200, s.infer("m", &body(&[vec![i as f32]]), &[]).await.status());
    }
    for bad in ["{", "{\"inputs\": 3}", "[]"] {
        expect(400, post("/v2/models/m/infer", bad.to_owned()).send().await.unwrap().status());
    }
    for unknown in ["nope", "other"] {
        expect(404, s.infer(unknown, &body(&[vec![1.0]]), &[]).await.status());
    }
    expect(404, post("/v2/models/m/versions/9/infer", body(&[vec![1.0]]).to_string()).send().await.unwrap().status());
    let big = body(&[vec![1.5; 1000]]).to_string();
    assert!(big.len() > 2000);
    expect(413, post("/v2/models/m/infer", big.clone()).send().await.unwrap().status());
    expect(413, post("/v1/embeddings", big).send().await.unwrap().status());
    expect(413, s.infer("m", &body(&vec![vec![1.0]; 5]), &[]).await.status());
    let a = body(&[vec![7.0]]);
    expect(200, s.infer("m", &a, &[("idempotency-key", "k")]).await.status());
    expect(409, s.infer("m", &body(&[vec![8.0]]), &[("idempotency-key", "k")]).await.status());
    expect(200, s.infer("m", &a, &[("idempotency-key", "k")]).await.status());
    expect(400, s.infer("m", &a, &[("idempotency-key", "")]).await.status());
    expect(404, post("/v2/nothing/here", "{}".to_owned()).send().await.unwrap().status());
    for (want, got) in &statuses {
        assert_eq!(want, got, "{statuses:?}");
    }

    let counted = requests(&s.metrics().await);
    let total: f64 = counted.iter().map(|(_, _, v)| v).sum();
    assert_eq!(total, f64::from(sent), "{counted:?}");
    let of = |model: &str, outcome: &str| {
        counted.iter().filter(|(m, o, _)| m == model && o == outcome).map(|(_, _, v)| v).sum::<f64>()
    };
    assert_eq!(of("m", "ok"), 6.0);
    assert_eq!(of("m", "invalid"), 4.0);
    assert_eq!(of("m", "too_large"), 2.0);
    assert_eq!(of("m", "conflict"), 1.0);
    assert_eq!(of("m", "replayed"), 1.0);
    // Unknown models, an unknown version and an unknown path count for no model.
    assert_eq!(of("m", "not_found"), 0.0);
    assert_eq!(of("", "not_found"), 4.0);
    assert_eq!(of("", "too_large"), 1.0, "an oversized body whose model was never read");
}
