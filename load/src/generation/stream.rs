//! The open-loop driver for OpenAI's streaming API: each request of a trace is sent at its
//! scheduled time (`POST /v1/completions`, `stream: true`, usage included), whether or not
//! earlier ones have returned, with its deadlines in Ferry's headers (`x-ferry-ttft-ms`,
//! `x-ferry-itl-ms`, `x-ferry-timeout-ms`; servers without deadlines ignore them). Every time is
//! measured from the scheduled send time, as the request-level driver does.

use std::time::Duration;

use ferry_core::clock::sleep_until;
use serde_json::{json, Value};
use std::time::Instant;
use tokio::task::JoinSet;

use super::summary::Sample;
use super::trace::{prompt_text, Request};

/// Where to send, and what.
#[derive(Debug, Clone)]
pub struct Target {
    /// The completions endpoint, e.g. `http://127.0.0.1:8080/v1/completions`.
    pub url: String,
    pub model: String,
    /// Send the deadlines as headers.
    pub send_deadlines: bool,
    /// Begin each prompt with a word of its own (`s{salt}-{index}`), so that a server that caches
    /// prompt prefixes across requests (llama.cpp's slots do) prefills every prompt anew.
    pub salt: Option<u64>,
}

/// Sends the whole trace and waits for every answer (at most `drain` after the last was sent).
pub async fn run(target: &Target, trace: &[Request], drain: Duration) -> anyhow::Result<Vec<Sample>> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .tcp_nodelay(true)
        .timeout(trace.iter().map(|r| r.timeout).max().unwrap_or_default() + drain)
        .build()?;
    let start = ferry_core::clock::now();
    let mut tasks = JoinSet::new();
    for (i, request) in trace.iter().copied().enumerate() {
        sleep_until(start + request.at).await;
        let (client, target) = (client.clone(), target.clone());
        tasks.spawn(async move { (i, one(&client, &target, i, request, start + request.at).await) });
    }
    let mut samples: Vec<Option<Sample>> = vec![None; trace.len()];
    while let Some(done) = tasks.join_next().await {
        let (i, sample) = done?;
        samples[i] = Some(sample);
    }
    Ok(samples.into_iter().map(|s| s.expect("every request has its sample")).collect())
}

async fn one(client: &reqwest::Client, target: &Target, index: usize, request: Request, scheduled: Instant) -> Sample {
    let body = json!({
        "model": target.model,
        "prompt": match target.salt {
            Some(salt) => format!("s{salt}-{index} {}", prompt_text(request.prompt)),
            None => prompt_text(request.prompt),
        },
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    streamed(client, &target.url, body, target.send_deadlines, request, scheduled).await.0
}

/// Posts `body` (a streamed completion or chat completion) to `url` and reads its events: the
/// sample, timed from `scheduled`, and the answer's text.
pub async fn streamed(
    client: &reqwest::Client,
    url: &str,
    body: Value,
    send_deadlines: bool,
    request: Request,
    scheduled: Instant,
) -> (Sample, String) {
    let mut sample = Sample {
        request,
        status: None,
        first: None,
        gaps: Vec::new(),
        end: None,
        tokens: 0,
        prompt_tokens: 0,
        completed: false,
    };
    let mut answer = String::new();
    let mut post = client.post(url).json(&body);
    if send_deadlines {
        post = post
            .header("x-ferry-ttft-ms", request.ttft.as_millis().to_string())
            .header("x-ferry-itl-ms", request.itl.as_millis().to_string())
            .header("x-ferry-timeout-ms", request.timeout.as_millis().to_string());
    }
    let Ok(mut response) = post.send().await else {
        return (sample, answer);
    };
    sample.status = Some(response.status().as_u16());
    if !response.status().is_success() {
        sample.end = Some(ferry_core::clock::elapsed(scheduled));
        return (sample, answer);
    }
    let (mut buffer, mut last, mut finished, mut usage) = (Vec::<u8>::new(), None::<Instant>, false, None);
    'read: while let Ok(Some(chunk)) = response.chunk().await {
        buffer.extend_from_slice(&chunk);
        while let Some(at) = buffer.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buffer.drain(..at + 2).collect();
            let Some(data) = std::str::from_utf8(&event).ok().and_then(|e| e.trim().strip_prefix("data:")) else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                sample.completed = finished;
                break 'read;
            }
            let Ok(value) = serde_json::from_str::<Value>(data) else { continue };
            if value.get("error").is_some() {
                break 'read;
            }
            if let Some(u) = value.get("usage").and_then(|u| u["completion_tokens"].as_u64()) {
                usage = Some(u as u32);
            }
            if let Some(p) = value.get("usage").and_then(|u| u["prompt_tokens"].as_u64()) {
                sample.prompt_tokens = p as u32;
            }
            let choice = &value["choices"][0];
            let text = choice["text"].as_str().or_else(|| choice["delta"]["content"].as_str()).unwrap_or("");
            if !text.is_empty() {
                answer.push_str(text);
                let now = ferry_core::clock::now();
                match last {
                    None => sample.first = Some(now - scheduled),
                    Some(prev) => sample.gaps.push(now - prev),
                }
                last = Some(now);
                sample.tokens += 1;
            }
            finished |= !choice["finish_reason"].is_null();
        }
    }
    sample.end = Some(ferry_core::clock::elapsed(scheduled));
    if let Some(u) = usage {
        sample.tokens = u;
    }
    (sample, answer)
}
