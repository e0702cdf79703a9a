//! An upstream server's answer passed on as it sent it (`--engine openai`): each of its choice
//! chunks is streamed under this sidecar's id, model and time, and a whole answer is its chunks
//! merged the way OpenAI's clients merge a stream — text appended, tool calls gathered by their
//! index with their arguments appended, log-probabilities appended — so that `n` > 1, tool
//! calls, reasoning and logprobs reach the client as the server gave them, fields Ferry does not
//! know included.
//!
//! Written by hand: the merge is a few rules over JSON values, and the clients' own (the `openai`
//! package's stream accumulator) are Python.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::prompt::Kind;

/// Fields that are set, not appended, when a later chunk repeats them.
const SET: [&str; 6] = ["index", "finish_reason", "role", "id", "type", "name"];

/// A whole answer's choices, gathered from an upstream's chunks.
#[derive(Debug, Default)]
pub struct Merged {
    choices: BTreeMap<u64, Value>,
}

impl Merged {
    /// Adds one choice chunk (`{"index", "delta" | "text", "logprobs", "finish_reason"}`).
    pub fn add(&mut self, chunk: &Value) {
        let index = chunk["index"].as_u64().unwrap_or(0);
        let into = self.choices.entry(index).or_insert_with(|| json!({"index": index}));
        merge(into, chunk);
    }

    pub fn is_empty(&self) -> bool {
        self.choices.is_empty()
    }

    /// The whole answer's choices, in index order: a chat's `delta` becomes its `message`, with
    /// what OpenAI's schema requires of one.
    pub fn choices(self, kind: Kind) -> Vec<Value> {
        self.choices
            .into_values()
            .map(|mut choice| {
                let fields = choice.as_object_mut().expect("a choice is an object");
                if kind == Kind::Chat {
                    let mut message = match fields.remove("delta") {
                        Some(Value::Object(m)) => m,
                        _ => Map::new(),
                    };
                    message.insert("role".into(), Value::from("assistant"));
                    message.entry("content").or_insert(Value::Null);
                    message.entry("refusal").or_insert(Value::Null);
                    // A whole answer's tool calls have no index: their place in the list is it.
                    if let Some(Value::Array(calls)) = message.get_mut("tool_calls") {
                        for call in calls.iter_mut().filter_map(Value::as_object_mut) {
                            call.remove("index");
                        }
                    }
                    fields.insert("message".into(), Value::Object(message));
                    // OpenAI's schema wants a chat's logprobs with both lists (vLLM's lack one).
                    if let Some(Value::Object(logprobs)) = fields.get_mut("logprobs") {
                        logprobs.entry("refusal").or_insert(Value::Null);
                    }
                } else {
                    fields.entry("text").or_insert(Value::from(""));
                }
                fields.entry("logprobs").or_insert(Value::Null);
                fields.entry("finish_reason").or_insert(Value::Null);
                choice
            })
            .collect()
    }
}

/// `from` merged into `into`: strings appended, lists appended (tool calls by their index),
/// objects merged field by field, numbers and booleans (and [`SET`]'s fields) replaced.
fn merge(into: &mut Value, from: &Value) {
    let (Value::Object(into), Value::Object(from)) = (into, from) else { return };
    for (key, value) in from {
        if value.is_null() {
            continue;
        }
        let slot = into.entry(key.clone()).or_insert(Value::Null);
        match (slot, value) {
            (slot, value) if SET.contains(&key.as_str()) => *slot = value.clone(),
            (slot, value) if key == "tool_calls" => {
                if !slot.is_array() {
                    *slot = Value::Array(Vec::new());
                }
                merge_calls(slot, value)
            }
            (slot @ Value::Null, value) => *slot = value.clone(),
            (Value::String(s), Value::String(more)) => s.push_str(more),
            (Value::Array(list), Value::Array(more)) => list.extend(more.iter().cloned()),
            (slot @ Value::Object(_), Value::Object(_)) => merge(slot, value),
            (slot, value) => *slot = value.clone(),
        }
    }
}

/// Streamed tool calls into the calls gathered so far, by their `index`.
fn merge_calls(calls: &mut Value, more: &Value) {
    let Value::Array(calls) = calls else { return };
    for call in more.as_array().into_iter().flatten() {
        let index = call["index"].as_u64().unwrap_or(calls.len() as u64);
        match calls.iter_mut().find(|c| c["index"].as_u64() == Some(index)) {
            Some(into) => merge(into, call),
            None => calls.push(call.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streamed_chat_merges_as_openais_clients_merge_it() {
        let mut m = Merged::default();
        for chunk in [
            json!({"index": 0, "delta": {"content": "Hel", "reasoning_content": "hm"}, "logprobs": {"content": [{"token": "Hel"}]}}),
            json!({"index": 1, "delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"ci"}}]}}),
            json!({"index": 0, "delta": {"content": "lo"}, "logprobs": {"content": [{"token": "lo"}]}}),
            json!({"index": 1, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "ty\": 1}"}}]}}),
            json!({"index": 1, "delta": {}, "finish_reason": "tool_calls"}),
            json!({"index": 0, "delta": {}, "finish_reason": "length", "x_vendor": 3}),
        ] {
            m.add(&chunk);
        }
        let choices = m.choices(Kind::Chat);
        assert_eq!(
            choices[0],
            json!({"index": 0, "message": {"role": "assistant", "content": "Hello", "reasoning_content": "hm", "refusal": null},
                   "logprobs": {"content": [{"token": "Hel"}, {"token": "lo"}], "refusal": null}, "finish_reason": "length", "x_vendor": 3})
        );
        assert_eq!(
            choices[1]["message"]["tool_calls"],
            json!([{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"city\": 1}"}}])
        );
        assert_eq!(
            (choices[1]["message"]["content"].clone(), choices[1]["finish_reason"].clone()),
            (Value::Null, json!("tool_calls"))
        );
    }

    #[test]
    fn a_streamed_completion_merges_its_text_and_lists() {
        let mut m = Merged::default();
        m.add(&json!({"index": 0, "text": " Paris", "logprobs": {"tokens": [" Paris"], "token_logprobs": [-0.2]}}));
        m.add(&json!({"index": 0, "text": ".", "logprobs": {"tokens": ["."], "token_logprobs": [-0.4]}}));
        m.add(&json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}));
        assert_eq!(
            m.choices(Kind::Completion),
            vec![
                json!({"index": 0, "text": " Paris.", "logprobs": {"tokens": [" Paris", "."], "token_logprobs": [-0.2, -0.4]}, "finish_reason": "length"})
            ]
        );
    }
}
