//! Benchmark section 7's structured output rows: what keeping an answer to a JSON schema costs
//! in decode speed, on the built-in decoder (llguidance's masks) and on llama.cpp's server (its
//! JSON-schema-to-grammar sampler), the same file, the same client. Each server answers the same
//! chat with and without `response_format: json_schema`, one sequence and eight at once; the
//! speed is each sequence's tokens after its first over the time between them, so answers of
//! different lengths compare.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{json, Value};

use crate::generation::stream;
use crate::generation::summary::Sample;
use crate::servers::Server;

/// Tokens of each answer: without a schema the answer runs this long (`ignore_eos`); the schema
/// asks for a list long enough to take about as many.
const TOKENS: u32 = 96;

/// The schema: twelve short names, each at most 16 characters.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "fruits": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 12, "maxItems": 12},
            "season": {"enum": ["spring", "summer", "autumn", "winter"]},
        },
        "required": ["fruits", "season"],
        "additionalProperties": false,
    })
}

fn body(salt: u64, constrained: bool) -> Value {
    let mut body = json!({
        "model": "m",
        "messages": [{"role": "user", "content": format!("Run {salt}. List twelve fruits and their season as JSON.")}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if constrained {
        body["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "fruits", "schema": schema()}});
        // Room for the longest answer the schema allows, so that none is cut short.
        body["max_tokens"] = json!(4 * TOKENS);
    } else {
        body["ignore_eos"] = json!(true);
    }
    body
}

/// Tokens after each sequence's first over the time from the earliest first token to the last
/// token: the decode speed of `samples` together.
fn decode_rate(samples: &[Sample]) -> f64 {
    let tokens: usize = samples.iter().map(|s| s.gaps.len()).sum();
    let first = samples.iter().filter_map(|s| s.first).min().unwrap_or_default();
    let last =
        samples.iter().filter_map(|s| Some(s.first? + s.gaps.iter().sum::<Duration>())).max().unwrap_or_default();
    tokens as f64 / last.saturating_sub(first).as_secs_f64().max(f64::MIN_POSITIVE)
}

/// `n` chats sent at once to `base`; their samples, each checked to have answered.
async fn burst(base: &str, n: u32, salt: u64, constrained: bool) -> anyhow::Result<Vec<Sample>> {
    let client = reqwest::Client::builder().tcp_nodelay(true).timeout(Duration::from_secs(300)).build()?;
    let url = format!("{base}/v1/chat/completions");
    let started = ferry_core::clock::now();
    let request = crate::generation::trace::Request {
        at: Duration::ZERO,
        prompt: 0,
        max_tokens: TOKENS,
        ttft: Duration::from_secs(600),
        itl: Duration::from_secs(600),
        timeout: Duration::from_secs(600),
    };
    let mut runs = tokio::task::JoinSet::new();
    for i in 0..u64::from(n) {
        let (client, url) = (client.clone(), url.clone());
        runs.spawn(async move {
            let (sample, text) =
                stream::streamed(&client, &url, body(salt * 100 + i, constrained), false, request, started).await;
            if constrained {
                let value: Value = serde_json::from_str(&text)
                    .map_err(|e| anyhow::anyhow!("{url}: the answer under a schema is not JSON ({e}): {text}"))?;
                anyhow::ensure!(value["fruits"].as_array().is_some_and(|f| f.len() == 12), "{url}: {text}");
            }
            anyhow::ensure!(sample.completed && sample.gaps.len() > 8, "{url}: not answered ({:?})", sample.status);
            Ok(sample)
        });
    }
    let mut samples = Vec::new();
    while let Some(done) = runs.join_next().await {
        samples.push(done??);
    }
    Ok(samples)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Writes the rows for `llama` and `ferry`, both serving the same file; the ratios of each
/// server's speed with a schema to its speed without.
pub(crate) async fn rows(md: &mut String, llama: &Server, ferry: &Server) -> anyhow::Result<Vec<(String, f64)>> {
    let _ = writeln!(
        md,
        "Structured output: the same chat (\"List twelve fruits and their season as JSON\", greedy, a salted \
         prompt each run) with and without `response_format: json_schema` (twelve strings of at most 16 \
         characters and an enum; every constrained answer is checked to parse with its twelve items), {TOKENS} \
         tokens without (`ignore_eos`). Decode speed: tokens after each sequence's first over the time from the \
         earliest first token to the last token, one sequence and eight sent at once; medians of three. Ferry \
         computes llguidance's masks beside each step's forward pass; llama.cpp's server samples through the \
         grammar it makes of the schema.\n"
    );
    let _ = writeln!(
        md,
        "| server | sequences | tokens/s without | with a schema | with / without |\n|---|---|---|---|---|"
    );
    let mut ratios = Vec::new();
    let mut salt = 0;
    for (name, server) in [("llama.cpp", llama), ("Ferry", ferry)] {
        for n in [1, 8] {
            let mut figures = Vec::new();
            for constrained in [false, true] {
                let mut runs = Vec::new();
                for _ in 0..3 {
                    salt += 1;
                    runs.push(decode_rate(&burst(&server.base, n, salt, constrained).await?));
                }
                figures.push(median(runs));
            }
            let ratio = figures[1] / figures[0].max(f64::MIN_POSITIVE);
            let _ = writeln!(md, "| {name} | {n} | {:.1} | {:.1} | {ratio:.2} |", figures[0], figures[1]);
            ratios.push((format!("{name}, {n} sequence(s), with a schema / without"), ratio));
        }
    }
    let _ = writeln!(md);
    Ok(ratios)
}
