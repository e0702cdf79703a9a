//! Closed-loop chat clients, as people and agents talk to a model: each client holds one
//! conversation — a system prompt every client shares, then its own turns — and sends its next
//! turn (`POST /v1/chat/completions`, streamed, greedy) as soon as the answer to the last one has
//! come, the answer appended to its history. Every turn's prompt starts with the one before it,
//! which is what a prefix cache (vLLM's automatic prefix caching, llama.cpp's `cache_prompt`,
//! Ferry's `--prefix-cache`) can reuse.

use std::time::Duration;

use serde_json::{json, Value};
use tokio::task::JoinSet;

use super::stream::streamed;
use super::summary::Sample;
use super::trace::Request;

/// How long a client waits before it asks a refused or cut turn again.
const RETRY: Duration = Duration::from_millis(500);

/// The conversations, and what each turn promises.
#[derive(Debug, Clone)]
pub struct Chat {
    /// The chat completions endpoint, e.g. `http://127.0.0.1:8080/v1/chat/completions`.
    pub url: String,
    pub model: String,
    pub clients: usize,
    /// Turns are sent until this long after the start; the last one may end later.
    pub duration: Duration,
    /// The shared system prompt, and the words of each user turn.
    pub system: String,
    pub turn_words: u32,
    pub max_tokens: u32,
    /// Each turn's deadlines (sent as Ferry's headers).
    pub ttft: Duration,
    pub itl: Duration,
    pub timeout: Duration,
    /// Begins the system prompt, so that a server's cache from an earlier run is not reused.
    pub salt: u64,
}

/// A system prompt of about `words` words (English prose, so that its tokens are words, not bytes).
pub fn system_prompt(words: usize) -> String {
    const TEXT: &str = "You answer questions about a small orchard that grows apples pears plums and cherries \
        on forty rows of trees and sells them at a market every Saturday morning. Be brief and exact.";
    TEXT.split_whitespace().cycle().take(words).collect::<Vec<_>>().join(" ")
}

impl Chat {
    /// The conversation's first message: the shared system prompt, salted.
    pub fn system_message(&self) -> Value {
        json!({"role": "system", "content": format!("s{} {}", self.salt, self.system)})
    }

    /// Client `c`'s question of turn `turn`.
    fn question(&self, c: usize, turn: u32) -> Value {
        let words: Vec<String> = (0..self.turn_words).map(|w| format!("c{c}t{turn}w{w}")).collect();
        json!({"role": "user", "content": format!("Question {turn}: {}?", words.join(" "))})
    }
}

/// Sends one turn of `messages` (streamed, greedy, with the chat's deadlines) at `at` after the
/// start: its sample and the answer's text.
pub async fn turn(client: &reqwest::Client, chat: &Chat, messages: &[Value], at: Duration) -> (Sample, String) {
    let body = json!({
        "model": chat.model,
        "messages": messages,
        "max_tokens": chat.max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let request =
        Request { at, prompt: 0, max_tokens: chat.max_tokens, ttft: chat.ttft, itl: chat.itl, timeout: chat.timeout };
    streamed(client, &chat.url, body, true, request, ferry_core::clock::now()).await
}

/// A client for the chat's turns.
pub fn client(chat: &Chat) -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder().tcp_nodelay(true).timeout(chat.timeout + Duration::from_secs(60)).build()?)
}

/// Runs every client's conversation; one sample per turn, timed from when the turn was sent.
pub async fn run(chat: &Chat) -> anyhow::Result<Vec<Sample>> {
    let client = client(chat)?;
    let start = ferry_core::clock::now();
    let mut tasks = JoinSet::new();
    for c in 0..chat.clients {
        let (client, chat) = (client.clone(), chat.clone());
        tasks.spawn(async move {
            let mut messages = vec![chat.system_message()];
            let mut samples = Vec::new();
            let mut turns = 0;
            loop {
                let at = ferry_core::clock::now() - start;
                if at >= chat.duration {
                    break;
                }
                messages.push(chat.question(c, turns));
                let (sample, answer) = turn(&client, &chat, &messages, at).await;
                let answered = sample.completed;
                samples.push(sample);
                if !answered {
                    // Refused or cut: the turn is asked again a little later (Ferry's refusals
                    // say when with Retry-After; a client backs off), its question unanswered.
                    messages.pop();
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
                messages.push(json!({"role": "assistant", "content": answer}));
                turns += 1;
            }
            samples
        });
    }
    let mut samples = Vec::new();
    while let Some(done) = tasks.join_next().await {
        samples.extend(done?);
    }
    samples.sort_by_key(|s| s.request.at);
    Ok(samples)
}
