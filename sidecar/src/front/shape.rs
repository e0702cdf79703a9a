//! OpenAI's shapes of a generation's answer: the chunks of a stream and the whole answer, from
//! the built-in engines' pieces (text, with log-probabilities where asked) or from an upstream
//! server's own choice chunks, passed on as it sent them ([`super::relayed`]).

use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use serde_json::{json, Map, Value};

use super::calls::{Calls, Delta};
use super::prompt::Kind;
use super::relayed::Merged;
use super::tools::Mode;
use super::REQUEST_ID;
use crate::generation::stream::{Finished, Piece, TokenLogprob};

/// The least log-probability written (vLLM's): JSON has no -infinity.
const LEAST_LOGPROB: f32 = -9999.0;

/// What every chunk and answer of one request repeats, and what its stream has sent so far.
pub(super) struct Frame {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    /// Whether the request asked for log-probabilities.
    logprobs: bool,
    /// Characters of each choice's tokens shown so far: a completion's next `text_offset`.
    offsets: std::collections::BTreeMap<u64, usize>,
    /// Whether the first chunk went (a chat's carries the role).
    opened: bool,
    /// The choices an upstream's chunks have opened (each chat choice's first carries the role).
    opened_choices: std::collections::BTreeSet<u64>,
    /// An upstream's chunks ended their choices themselves: no finish chunk of ours.
    finished_upstream: bool,
    /// Choices of each prompt (`n`): a list's prompt `p` has choices `p × n` to `p × n + n - 1`,
    /// and each prompt counts once in the usage.
    per_prompt: usize,
    /// The tool call a chat's answer is forced to be: its text is read back into `tool_calls`.
    tools: Option<Mode>,
    /// Each choice's calls read so far, streamed.
    calls: std::collections::BTreeMap<u64, Calls>,
}

impl Frame {
    pub fn new(id: String, created: u64, model: String, kind: Kind, logprobs: bool) -> Frame {
        Frame {
            id,
            created,
            model,
            kind,
            logprobs,
            offsets: Default::default(),
            opened: false,
            opened_choices: Default::default(),
            finished_upstream: false,
            per_prompt: 1,
            tools: None,
            calls: Default::default(),
        }
    }

    /// The answer is a forced tool call: its text goes out as `tool_calls`.
    pub fn with_tools(mut self, tools: Option<Mode>) -> Frame {
        self.tools = tools;
        self
    }

    /// Choice `index`'s calls, read from its answer.
    fn calls_of(&self, index: u64) -> Option<Calls> {
        let id = format!("call_{}_{index}", self.id.trim_start_matches("chatcmpl-"));
        self.tools.clone().map(|mode| Calls::new(mode, id))
    }

    /// The frame of one request's answer: its id from the request's `x-request-id`, created now.
    pub fn for_request(headers: &HeaderMap, model: String, kind: Kind, logprobs: bool) -> Frame {
        let request_id = headers.get(&REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("0");
        Frame::new(
            format!("{}-{request_id}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }),
            SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            model,
            kind,
            logprobs,
        )
    }

    /// The answer's choices come `n` to a prompt.
    pub fn choices_per_prompt(mut self, n: u32) -> Frame {
        self.per_prompt = n.max(1) as usize;
        self
    }

    fn object(&self, whole: bool) -> &'static str {
        match (self.kind, whole) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion.chunk",
            (Kind::Chat, true) => "chat.completion",
        }
    }

    fn wrap(&self, choices: Vec<Value>, usage: bool) -> Value {
        let mut chunk = json!({"id": self.id, "object": self.object(false), "created": self.created, "model": self.model, "choices": choices});
        if usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// OpenAI's `logprobs` of a choice that brings `tokens`: chat's list of tokens with their
    /// bytes and alternatives, or a completion's four lists (`text_offset` counts characters of
    /// the tokens from the answer's start, as vLLM counts them); `null` where none were asked.
    fn logprobs(&mut self, index: u64, tokens: &[TokenLogprob]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        let logprob = |l: f32| l.max(LEAST_LOGPROB);
        match self.kind {
            Kind::Chat => {
                let entry = |bytes: &[u8], l: f32| json!({"token": text(bytes), "logprob": logprob(l), "bytes": bytes});
                let content: Vec<Value> = tokens
                    .iter()
                    .map(|t| {
                        let mut e = entry(&t.token, t.logprob);
                        e["top_logprobs"] = t.top.iter().map(|(b, l)| entry(b, *l)).collect();
                        e
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Kind::Completion => {
                let mut offsets = Vec::with_capacity(tokens.len());
                let offset = self.offsets.entry(index).or_default();
                for t in tokens {
                    offsets.push(*offset);
                    *offset += text(&t.token).chars().count();
                }
                // The drawn token among them, as vLLM and OpenAI write a completion's (one more
                // than asked where it is not among the most likely).
                let top: Vec<Value> = tokens
                    .iter()
                    .map(|t| {
                        let mut top: Map<_, _> = t.top.iter().map(|(b, l)| (text(b), json!(logprob(*l)))).collect();
                        top.entry(text(&t.token)).or_insert(json!(logprob(t.logprob)));
                        top.into()
                    })
                    .collect();
                json!({
                    "tokens": tokens.iter().map(|t| text(&t.token)).collect::<Vec<_>>(),
                    "token_logprobs": tokens.iter().map(|t| logprob(t.logprob)).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": offsets,
                })
            }
        }
    }

    /// The chunk a piece of the answer makes; none for a token that brings nothing yet (one that
    /// ends mid-character, its log-probability not asked for), but the first, which opens the
    /// stream.
    pub fn chunk(&mut self, piece: Piece, usage: bool) -> Option<Value> {
        self.chunk_at(0, piece, usage)
    }

    /// [`Frame::chunk`] for choice `index` of the built-in engines' `n`.
    pub fn chunk_at(&mut self, index: u64, piece: Piece, usage: bool) -> Option<Value> {
        let first = !self.opened;
        let choice = match piece {
            Piece::Text(text, logprob) => {
                if text.is_empty() && logprob.is_none() && !first {
                    return None;
                }
                let logprobs = self.logprobs(index, Vec::from_iter(logprob.map(|l| *l)).as_slice());
                match self.kind {
                    Kind::Completion => {
                        json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": null})
                    }
                    Kind::Chat => {
                        let opening = !self.opened_choices.contains(&index);
                        let mut delta = match self.tools.is_some() {
                            false => json!({"content": text}),
                            true => {
                                if let (false, Some(calls)) = (self.calls.contains_key(&index), self.calls_of(index)) {
                                    self.calls.insert(index, calls);
                                }
                                let brought = self.calls.get_mut(&index).map(|c| c.push(&text)).unwrap_or_default();
                                if brought == Delta::default() && logprobs.is_null() && !first && !opening {
                                    return None;
                                }
                                delta_of(brought)
                            }
                        };
                        if opening {
                            self.opened_choices.insert(index);
                            delta["role"] = Value::from("assistant");
                        }
                        json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": null})
                    }
                }
            }
            Piece::Relayed { choice, .. } => {
                let mut choice = *choice;
                self.finished_upstream |= !choice["finish_reason"].is_null();
                let opens = self.opened_choices.insert(choice["index"].as_u64().unwrap_or(0));
                if let Some(Value::Object(delta)) = choice.get_mut("delta").filter(|_| opens && self.kind == Kind::Chat)
                {
                    delta.entry("role").or_insert(Value::from("assistant"));
                }
                choice
            }
            Piece::End(_) => return None,
        };
        self.opened = true;
        Some(self.wrap(vec![choice], usage))
    }

    /// The chunk that ends the stream's choice with its reason, unless an upstream's own chunks
    /// ended their choices.
    pub fn finish(&mut self, f: &Finished, usage: bool) -> Option<Value> {
        if self.finished_upstream {
            return None;
        }
        Some(self.finish_at(0, f, usage))
    }

    /// The chunk that ends choice `index` of the built-in engines' `n`.
    pub fn finish_at(&mut self, index: u64, f: &Finished, usage: bool) -> Value {
        // What a call reader held back, in the last chunk.
        let left = self.calls.get_mut(&index).map(Calls::finish).unwrap_or_default();
        let reason = self.calls.get(&index).map_or(f.reason.as_str(), |c| c.reason(f.reason.as_str()));
        let choice = match self.kind {
            Kind::Completion => json!({"index": index, "text": "", "logprobs": null, "finish_reason": reason}),
            Kind::Chat => {
                let mut delta = delta_of(left);
                // A choice that ends before any text still says whose turn it was.
                if self.opened_choices.insert(index) {
                    delta["role"] = Value::from("assistant");
                }
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": reason})
            }
        };
        self.wrap(vec![choice], usage)
    }

    /// The chunk with the usage of choices that ended as `ends` say (each prompt counted once).
    pub fn usage_chunk(&self, ends: &[Finished]) -> Value {
        json!({"id": self.id, "object": self.object(false), "created": self.created, "model": self.model, "choices": [], "usage": usage(ends, self.per_prompt)})
    }

    /// A whole answer: the built-in engines' text and log-probabilities, or an upstream's chunks
    /// merged.
    pub fn whole(&mut self, gathered: Gathered, f: &Finished) -> Value {
        self.whole_of(vec![(gathered, *f)])
    }

    /// A whole answer of the built-in engines' `n` choices, in order (or of an upstream's one
    /// stream).
    pub fn whole_of(&mut self, choices: Vec<(Gathered, Finished)>) -> Value {
        let ends: Vec<Finished> = choices.iter().map(|c| c.1).collect();
        let mut all = Vec::with_capacity(choices.len());
        for (index, (gathered, f)) in (0u64..).zip(choices) {
            if !gathered.relayed.is_empty() {
                all.extend(gathered.relayed.choices(self.kind));
                continue;
            }
            let logprobs = self.logprobs(index, &gathered.tokens);
            let (text, reason) = (gathered.text, f.reason.as_str());
            if let (Kind::Chat, Some(mut calls)) = (self.kind, self.calls_of(index)) {
                calls.push(&text);
                calls.finish();
                let mut message = json!({"role": "assistant", "content": calls.content(), "refusal": null});
                let made = calls.whole();
                if !made.is_empty() {
                    message["tool_calls"] = Value::Array(made);
                }
                all.push(json!({
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": calls.reason(reason),
                }));
                continue;
            }
            all.push(match self.kind {
                Kind::Completion => {
                    json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})
                }
                Kind::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": text, "refusal": null},
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }),
            });
        }
        json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": all, "usage": usage(&ends, self.per_prompt)})
    }
}

/// The usage of choices that ended as `ends` say, `per_prompt` to a prompt: each prompt once,
/// every answer's tokens.
fn usage(ends: &[Finished], per_prompt: usize) -> Value {
    let prompt: u32 = ends.iter().step_by(per_prompt).map(|f| f.prompt_tokens).sum();
    let completion: u32 = ends.iter().map(|f| f.completion_tokens).sum();
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// A chat delta of what a call reader gave out: `content`, `tool_calls`, each where there is some.
fn delta_of(brought: Delta) -> Value {
    let mut delta = json!({});
    if !brought.content.is_empty() {
        delta["content"] = Value::from(brought.content);
    }
    if !brought.calls.is_empty() {
        delta["tool_calls"] = Value::Array(brought.calls);
    }
    delta
}

/// What a whole answer gathers from its pieces.
#[derive(Debug, Default)]
pub(super) struct Gathered {
    text: String,
    tokens: Vec<TokenLogprob>,
    relayed: Merged,
}

impl Gathered {
    pub fn add(&mut self, piece: Piece) {
        match piece {
            Piece::Text(text, logprob) => {
                self.text.push_str(&text);
                self.tokens.extend(logprob.map(|l| *l));
            }
            Piece::Relayed { choice, .. } => self.relayed.add(&choice),
            Piece::End(_) => {}
        }
    }
}
