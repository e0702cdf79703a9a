//! A burst of arrivals beside hundreds of running streams, on the real binary: admission costs
//! each newcomer a forecast over every sequence held, on the task that also sends the engine its
//! steps, and no running stream's tokens may wait for those forecasts past its inter-token target.
//! Judged by the server's own inter-token histogram (its bucket at the target), not by the
//! client's clock, which these shared cores would blur. Alone in its binary: nothing else runs
//! beside it.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{metric_value, Sidecar};
use tokio::time::sleep;

/// The running streams, and the burst that arrives among them within 100 ms.
const RUNNING: usize = 500;
const BURST: usize = 500;

/// `ferry_inter_token_latency_seconds`: every gap so far, and those within `le` seconds.
fn gaps(text: &str, le: &str) -> (f64, f64) {
    let name = "ferry_inter_token_latency_seconds";
    (
        metric_value(text, &format!("{name}_count"), "model=\"m\""),
        metric_value(text, &format!("{name}_bucket"), &format!("le=\"{le}\"")),
    )
}

async fn complete(s: &Sidecar, prompt: &str, max_tokens: u32) -> Value {
    let response = s
        .http
        .post(s.url("/v1/completions"))
        .json(&json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens}))
        .send()
        .await
        .expect("the sidecar answers");
    let status = response.status();
    let body: Value = response.json().await.expect("a JSON body");
    json!({"status": status.as_u16(), "body": body})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_arrivals_does_not_stretch_running_streams_past_their_target() {
    // Steps of 10 ms + 30 µs a decode (25 ms with 500 decoding, 40 ms with 1000) and 20 µs a
    // prompt token; a 100 ms inter-token target.
    let args = "--engine sim-llm --model m --sim-step-time 10ms --sim-decode-per-seq 30us \
                --sim-prefill-per-token 20us --max-sequences 1024 --max-batch-tokens 4096 --kv-blocks 20000 \
                --max-queue 2048 --max-inter-token-latency 100ms --ttft-budget 5s --latency-budget 60s \
                --max-timeout 60s";
    let s = Sidecar::start(&args.split_whitespace().collect::<Vec<_>>()).await;
    let s = std::sync::Arc::new(s);
    // The running streams, 50 at a time, 100 ms apart; one refused (the pod's estimates still
    // settling on its first steps) asks again 200 ms later.
    let running: Vec<_> = (0..RUNNING)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move {
                sleep(Duration::from_millis(100 * (i / 50) as u64)).await;
                loop {
                    let answer = complete(&s, &format!("r{i} a b c d e f g"), 160).await;
                    if answer["status"] != 503 {
                        return answer;
                    }
                    sleep(Duration::from_millis(200)).await;
                }
            })
        })
        .collect();
    // Every one of them decoding, on the server's word.
    let waited = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let text = s.metrics().await;
            if metric_value(&text, "ferry_sequences", "state=\"running\"") as usize == RUNNING
                && gaps(&text, "0.1").0 >= RUNNING as f64
            {
                break;
            }
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    if waited.is_err() {
        let text = s.metrics().await;
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| {
                (l.starts_with("ferry_requests_total") && l.contains("model=\"m\""))
                    || l.starts_with("ferry_sequences")
                    || l.starts_with("ferry_step_cost")
                    || l.starts_with("ferry_step_seconds")
            })
            .collect();
        let mut refused = Vec::new();
        for h in running {
            let a = h.await.unwrap();
            if a["status"] != 200 && refused.len() < 3 {
                refused.push(a);
            }
        }
        panic!("the {RUNNING} streams never all ran: {lines:#?} {refused:#?}");
    }
    let (before, _) = gaps(&s.metrics().await, "0.1");
    // The burst: 500 requests within 100 ms.
    let start = ferry_core::clock::now();
    let burst: Vec<_> = (0..BURST)
        .map(|i| {
            let s = s.clone();
            let at = start + Duration::from_micros(200 * i as u64);
            tokio::spawn(async move {
                ferry_core::clock::sleep_until(at).await;
                complete(&s, &format!("b{i} h i j"), 40).await
            })
        })
        .collect();
    let mut served = 0;
    let mut refused = None;
    for answer in futures_join(burst).await {
        served += usize::from(answer["status"] == 200);
        if answer["status"] != 200 {
            refused.get_or_insert(answer);
        }
    }
    let text = s.metrics().await;
    let (all, within) = gaps(&text, "0.1");
    eprintln!(
        "burst: {served} of {BURST} served; {} of {all} gaps within 50 ms, {} within 75 ms, {within} within 100 ms",
        gaps(&text, "0.05").1,
        gaps(&text, "0.075").1
    );
    let mut finished = 0;
    for answer in futures_join(running).await {
        assert_eq!(answer["status"], 200, "a running stream ended early: {answer}");
        finished += usize::from(answer["body"]["choices"][0]["finish_reason"] == "length");
    }
    assert_eq!(finished, RUNNING, "every running stream got its 160 tokens");
    assert!(all - before > 20.0 * RUNNING as f64, "gaps were measured through the burst: {}", all - before);
    assert_eq!(all - within, 0.0, "{} of {all} gaps between tokens over the 100 ms target", all - within);
    // How many of the burst fit is admission's to say (its forecasts price 1000 streams against
    // the target); enough of them must have joined for the gaps above to have been at stake.
    assert!(
        served * 5 >= BURST,
        "a fifth of the burst at least was served: {served} of {BURST}; one refusal: {refused:?}"
    );
}

async fn futures_join(handles: Vec<tokio::task::JoinHandle<Value>>) -> Vec<Value> {
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.expect("the caller task ends"));
    }
    out
}
