//! Benchmark section 7's prefix-cache rows: what reusing a prompt's computed KV is worth, on the
//! built-in decoder (`--prefix-cache`, on and off) and on llama.cpp's server (`cache_prompt`,
//! its default), same F32 weights, same threads, same client. First, two questions one after
//! the other behind one system prompt of about 1500 tokens: the second's first token against the
//! first's. Then 16 chat clients share a shorter system prompt and grow their own histories, each
//! sending its next turn when the last is answered: the tokens a second of the answers that kept
//! their deadlines.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::json;

use crate::generation::chat::{self, Chat};
use crate::generation::summary::{self, Summary};
use crate::servers::Server;

/// Chat clients, and the seconds they talk.
const CLIENTS: usize = 16;
const SECONDS: u64 = 60;

/// Ferry's sidecar on the llm engine with `slots` sequences, the prefix cache on or off.
pub(crate) async fn ferry(model: &str, slots: u32, prefix_cache: bool) -> anyhow::Result<Server> {
    let slots = slots.to_string();
    let cache = format!("--prefix-cache={prefix_cache}");
    let mut args = vec!["--engine", "llm", "--model-source", model, "--device", "cpu", "--max-sequences", &slots];
    args.extend(["--max-batch-tokens", "2048", "--kv-cache-memory", "2Gi", &cache]);
    args.extend(["--latency-budget", "600s", "--max-timeout", "600s", "--ttft-budget", "600s"]);
    args.extend(["--max-inter-token-latency", "600s"]);
    crate::servers::sidecar(&args).await
}

/// The chat of the benchmark on `base`: `clients` conversations behind a system prompt of
/// `words` words, 6-word questions, 24-token answers, each asked for within 3 s, 400 ms a token
/// and 20 s in all.
fn chat(base: &str, clients: usize, words: usize, salt: u64) -> Chat {
    Chat {
        url: format!("{base}/v1/chat/completions"),
        model: "m".into(),
        clients,
        duration: Duration::from_secs(SECONDS),
        system: chat::system_prompt(words),
        turn_words: 6,
        max_tokens: 24,
        ttft: Duration::from_secs(3),
        itl: Duration::from_millis(400),
        timeout: Duration::from_secs(20),
        salt,
    }
}

/// Two questions, one after the other, behind a system prompt of about 1500 tokens that nothing
/// has cached yet: the first token of each, ms.
async fn two_questions(base: &str, salt: u64) -> anyhow::Result<(f64, f64)> {
    let long = Chat { ttft: Duration::from_secs(600), timeout: Duration::from_secs(600), ..chat(base, 1, 1150, salt) };
    let client = chat::client(&long)?;
    let mut firsts = Vec::new();
    for question in ["Which fruits grow in the orchard?", "On which day is the market?"] {
        let messages = [long.system_message(), json!({"role": "user", "content": question})];
        let (sample, _) = chat::turn(&client, &long, &messages, Duration::ZERO).await;
        let first = sample.first.filter(|_| sample.completed);
        let first =
            first.ok_or_else(|| anyhow::anyhow!("{base}: a question was not answered ({:?})", sample.status))?;
        firsts.push(first.as_secs_f64() * 1e3);
    }
    Ok((firsts[0], firsts[1]))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Writes the rows, against `llama` (already serving `model`), starting Ferry's sidecar with the
/// cache on, then off.
pub(crate) async fn rows(md: &mut String, llama: &Server, model: &str, slots: u32) -> anyhow::Result<()> {
    let _ = writeln!(
        md,
        "The prefix cache: llama.cpp's server (`cache_prompt`, on by default: a slot keeps its last prompt's KV) \
         and Ferry's sidecar with `--prefix-cache` on and off. Two questions one after the other behind a system \
         prompt of about 1500 tokens that nothing has cached (salted), through the chat template: the first token \
         of each (medians of three). Then {CLIENTS} chat clients, {SECONDS} s: a shared system prompt of about 500 \
         tokens, each client's own 6-word questions and the answers so far (24 tokens each, greedy), each turn \
         sent when the last is answered and asked for within 3 s, 400 ms a token and 20 s in all (a refused or \
         cut turn is asked again 0.5 s later); tokens a second in time count the answers that kept all three.\n"
    );
    let mut servers = vec![("llama.cpp".to_owned(), None)];
    for on in [true, false] {
        servers.push((format!("Ferry, --prefix-cache={on}"), Some(on)));
    }
    let (mut ttft_rows, mut chat_rows, mut in_time) = (Vec::new(), Vec::new(), Vec::new());
    for (k, (name, cache)) in servers.iter().enumerate() {
        let started = match cache {
            Some(on) => Some(ferry(model, slots, *on).await?),
            None => None,
        };
        let base = started.as_ref().map_or(&llama.base, |s| &s.base);
        let salt = 1000 * (k as u64 + 1);
        let mut pairs = Vec::new();
        for run in 0..3 {
            pairs.push(two_questions(base, salt + run).await?);
        }
        let (first, second) =
            (median(pairs.iter().map(|p| p.0).collect()), median(pairs.iter().map(|p| p.1).collect()));
        ttft_rows.push(format!("| {name} | {first:.0} | {second:.0} | {:.2} |", second / first.max(f64::MIN_POSITIVE)));
        let samples = chat::run(&chat(base, CLIENTS, 400, salt + 10)).await?;
        let answered = samples.iter().filter(|s| s.completed).count();
        let s = Summary::of(&samples, Duration::from_secs(SECONDS));
        in_time.push(s.good_tokens_per_s);
        chat_rows.push(format!("| {name} | {} | {answered} | {} |", samples.len(), summary::cells(&s)));
    }
    let _ = writeln!(md, "| server | first question's TTFT ms | second's | second / first |\n|---|---|---|---|");
    for row in ttft_rows {
        let _ = writeln!(md, "{row}");
    }
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "| server | turns sent | answered | {} |\n|---|---|---|---|---|---|---|---|---|---|",
        summary::HEADER
    );
    for row in chat_rows {
        let _ = writeln!(md, "{row}");
    }
    let ratio = |a: f64, b: f64| a / b.max(f64::MIN_POSITIVE);
    let _ = writeln!(
        md,
        "\nTokens a second in time, Ferry with the cache: {:.2}× Ferry without it, {:.2}× llama.cpp.\n",
        ratio(in_time[1], in_time[2]),
        ratio(in_time[1], in_time[0])
    );
    Ok(())
}
