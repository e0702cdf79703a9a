//! An upstream server's own count of a prompt's tokens, for admission: the prompt is what the
//! server will prefill, through its own tokenizer and chat template (tools included), which
//! the relay cannot know. vLLM and SGLang take OpenAI's request at `POST /tokenize` and answer
//! `count`; llama.cpp's server renders a chat at `POST /apply-template` and tokenizes `content`
//! at `POST /tokenize`. The first that answers is remembered; a server with neither (a 404 from
//! both) is not asked again, and its prompts are estimated from their bytes. Each call is bounded
//! by [`TIMEOUT`]: a server too busy to tokenize at once leaves the estimate to stand.

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use serde_json::{json, Map, Value};

/// How long admission waits for the server's count.
pub const TIMEOUT: Duration = Duration::from_millis(250);

const UNKNOWN: u8 = 0;
const OPENAI_STYLE: u8 = 1;
const LLAMA_CPP: u8 = 2;
const NEITHER: u8 = 3;

/// The fields of a request that shape its prompt, as vLLM's `/tokenize` takes them.
const CHAT_FIELDS: [&str; 6] =
    ["messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools", "documents"];

pub struct UpstreamTokens {
    client: reqwest::Client,
    base: String,
    model: String,
    way: AtomicU8,
}

/// What one call got: an answer, or a 404 (the server has no such endpoint), or nothing usable.
enum Answer {
    Json(Value),
    Missing,
    Failed,
}

impl UpstreamTokens {
    pub fn new(client: reqwest::Client, base: String, model: String) -> UpstreamTokens {
        UpstreamTokens { client, base, model, way: AtomicU8::new(UNKNOWN) }
    }

    async fn post(&self, path: &str, body: &Value) -> Answer {
        let sent = self.client.post(format!("{}{path}", self.base)).json(body).timeout(TIMEOUT).send().await;
        match sent {
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => Answer::Missing,
            Ok(r) if r.status().is_success() => r.json().await.map_or(Answer::Failed, Answer::Json),
            _ => Answer::Failed,
        }
    }

    /// The prompt's tokens as the server counts them (`body` is the client's request to a chat
    /// endpoint when `chat`, else to completions, with a text prompt); `None` when it cannot say.
    pub async fn count(&self, chat: bool, body: &Value) -> Option<u32> {
        let way = self.way.load(Ordering::Relaxed);
        if way == NEITHER {
            return None;
        }
        let mut missing = 0;
        if way != LLAMA_CPP {
            let mut ask = Map::new();
            ask.insert("model".into(), Value::from(self.model.as_str()));
            let fields: &[&str] = if chat { &CHAT_FIELDS } else { &["prompt"] };
            for field in fields {
                if let Some(v) = body.get(*field) {
                    ask.insert((*field).into(), v.clone());
                }
            }
            match self.post("/tokenize", &Value::Object(ask)).await {
                Answer::Json(v) => {
                    if let Some(count) = v["count"].as_u64() {
                        self.way.store(OPENAI_STYLE, Ordering::Relaxed);
                        return u32::try_from(count).ok();
                    }
                }
                Answer::Missing => missing += 1,
                Answer::Failed => {}
            }
        }
        if way != OPENAI_STYLE {
            let text = if chat {
                match self.post("/apply-template", &json!({"messages": body["messages"]})).await {
                    Answer::Json(v) => v["prompt"].as_str().map(str::to_owned),
                    Answer::Missing => {
                        missing += 1;
                        None
                    }
                    Answer::Failed => None,
                }
            } else {
                body["prompt"].as_str().map(str::to_owned)
            };
            if let Some(text) = text {
                let ask = json!({"content": text, "add_special": true, "parse_special": true});
                if let Answer::Json(v) = self.post("/tokenize", &ask).await {
                    if let Some(tokens) = v["tokens"].as_array() {
                        self.way.store(LLAMA_CPP, Ordering::Relaxed);
                        return u32::try_from(tokens.len()).ok();
                    }
                }
            }
        }
        if way == UNKNOWN && missing == 2 {
            tracing::info!(upstream = %self.base, "the upstream has no /tokenize: prompts are estimated from their bytes");
            self.way.store(NEITHER, Ordering::Relaxed);
        }
        None
    }
}
