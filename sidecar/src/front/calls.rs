//! A choice's tool calls read back from its answer as it comes: the pieces of OpenAI's
//! `delta.tool_calls` (and the `content` around them) each new text brings, and the whole calls,
//! the same either way. A forced call's answer is JSON the format kept to ([`Mode::Required`]'s
//! list of `{"name", "parameters"}`, a [`Mode::Named`] function's arguments); under `auto` the
//! model writes its calls in free text, read by its parser ([`Parser::Hermes`]: Hermes' and
//! Qwen's `<tool_call>{"name": ..., "arguments": ...}</tool_call>`), and the text around them is
//! content.

use serde_json::{json, Value};

use super::tools::{Mode, Parser};

/// What a piece of the answer brings: text for `content`, pieces for `tool_calls`.
#[derive(Debug, Default, PartialEq)]
pub struct Delta {
    pub content: String,
    pub calls: Vec<Value>,
}

/// One choice's tool calls, read from its answer as it comes.
#[derive(Debug)]
pub struct Calls {
    mode: Mode,
    /// Each call's id is this and its index.
    id: String,
    /// Each call's name (once read) and arguments' text so far.
    calls: Vec<(Option<String>, String)>,
    /// Calls whose opening piece has gone.
    opened: usize,
    scan: Scan,
    /// Free text not yet given out: what may begin a call's opening tag (`auto`), or a call's
    /// text until its closing tag.
    pending: String,
    /// Whether `pending` is inside a call's tags.
    in_call: bool,
    /// Content given out, for the whole answer.
    content: String,
}

/// Where the reader is in a `required` answer: `[{"name": "...", "parameters": {...}}, ...]`.
#[derive(Debug, Default)]
struct Scan {
    /// Brackets open: 1 inside the list, 2 inside a call, more inside its parameters.
    depth: u32,
    in_string: bool,
    escape: bool,
    /// The raw text of a key or of the name being read, at depth 2.
    captured: Option<String>,
    /// The call's member being read, once its key is read.
    key: Option<String>,
    /// Whether the text is the parameters' value (streamed as the arguments).
    arguments: bool,
}

impl Calls {
    pub fn new(mode: Mode, id: String) -> Calls {
        Calls {
            mode,
            id,
            calls: Vec::new(),
            opened: 0,
            scan: Scan::default(),
            pending: String::new(),
            in_call: false,
            content: String::new(),
        }
    }

    /// What `text`, the answer's next text, brings.
    pub fn push(&mut self, text: &str) -> Delta {
        let before: Vec<usize> = self.calls.iter().map(|c| c.1.len()).collect();
        let mut content = String::new();
        match &self.mode {
            Mode::Named(name) => {
                if self.calls.is_empty() {
                    self.calls.push((Some(name.clone()), String::new()));
                }
                self.calls[0].1.push_str(text);
            }
            Mode::Required => {
                for c in text.chars() {
                    self.scan_char(c);
                }
            }
            Mode::Auto(Parser::Hermes) => {
                self.pending.push_str(text);
                content = self.hermes(false);
            }
        }
        self.content.push_str(&content);
        Delta { content, calls: self.pieces(&before) }
    }

    /// What is left when the answer ends: a call's text whose closing tag never came (read as a
    /// call where it is one), text held in case it opened one.
    pub fn finish(&mut self) -> Delta {
        let before: Vec<usize> = self.calls.iter().map(|c| c.1.len()).collect();
        let content = match self.mode {
            Mode::Auto(Parser::Hermes) => self.hermes(true),
            _ => String::new(),
        };
        self.content.push_str(&content);
        Delta { content, calls: self.pieces(&before) }
    }

    /// The pieces for the calls' text since `before` (each call's arguments' length then).
    fn pieces(&mut self, before: &[usize]) -> Vec<Value> {
        let mut pieces = Vec::new();
        for (k, (name, arguments)) in self.calls.iter().enumerate() {
            let Some(name) = name else { break };
            let new = &arguments[before.get(k).copied().filter(|_| k < self.opened).unwrap_or(0)..];
            if k >= self.opened {
                pieces.push(json!({
                    "index": k,
                    "id": format!("{}-{k}", self.id),
                    "type": "function",
                    "function": {"name": name, "arguments": new},
                }));
                self.opened = k + 1;
            } else if !new.is_empty() {
                pieces.push(json!({"index": k, "function": {"arguments": new}}));
            }
        }
        pieces
    }

    /// Reads `pending` as Hermes' tagged calls: the content it gives out, calls read into
    /// `calls`. Text that may be the start of an opening tag is held, unless the answer `ended`.
    fn hermes(&mut self, ended: bool) -> String {
        const OPEN: &str = "<tool_call>";
        const CLOSE: &str = "</tool_call>";
        let mut content = String::new();
        loop {
            if self.in_call {
                let Some(end) = self.pending.find(CLOSE) else {
                    if ended {
                        let inner = std::mem::take(&mut self.pending);
                        if !self.read_call(&inner) {
                            content.push_str(OPEN);
                            content.push_str(&inner);
                        }
                        self.in_call = false;
                    }
                    return content;
                };
                let inner: String = self.pending.drain(..end + CLOSE.len()).collect();
                let inner = &inner[..end];
                if !self.read_call(inner) {
                    // Not a call after all: the text as the model wrote it.
                    content.push_str(OPEN);
                    content.push_str(inner);
                    content.push_str(CLOSE);
                }
                self.in_call = false;
                continue;
            }
            if let Some(at) = self.pending.find(OPEN) {
                content.extend(self.pending.drain(..at));
                self.pending.drain(..OPEN.len());
                self.in_call = true;
                continue;
            }
            // Held back: the longest end of the text that begins the opening tag.
            let held = if ended {
                0
            } else {
                (1..OPEN.len().min(self.pending.len() + 1))
                    .rev()
                    .find(|n| {
                        self.pending.is_char_boundary(self.pending.len() - n)
                            && OPEN.starts_with(&self.pending[self.pending.len() - n..])
                    })
                    .unwrap_or(0)
            };
            content.extend(self.pending.drain(..self.pending.len() - held));
            return content;
        }
    }

    /// Takes `inner`, a tagged call's text, as a call if it is one: `{"name": ..., "arguments": ...}`.
    fn read_call(&mut self, inner: &str) -> bool {
        let Ok(Value::Object(call)) = serde_json::from_str::<Value>(inner.trim()) else { return false };
        let Some(name) = call.get("name").and_then(Value::as_str) else { return false };
        let arguments = match call.get("arguments").or_else(|| call.get("parameters")) {
            Some(Value::String(text)) => text.clone(),
            Some(v @ Value::Object(_)) => v.to_string(),
            None => "{}".into(),
            Some(_) => return false,
        };
        self.calls.push((Some(name.to_owned()), arguments));
        true
    }

    /// The content read, as a whole answer's `message.content` (`None` where there is none).
    pub fn content(&self) -> Option<&str> {
        Some(self.content.as_str()).filter(|c| !c.is_empty())
    }

    /// The calls read, as a whole answer's `message.tool_calls`.
    pub fn whole(&self) -> Vec<Value> {
        (0..)
            .zip(&self.calls)
            .filter_map(|(k, (name, arguments))| {
                Some(json!({
                    "id": format!("{}-{k}", self.id),
                    "type": "function",
                    "function": {"name": name.as_ref()?, "arguments": arguments},
                }))
            })
            .collect()
    }

    /// How the choice ended, as OpenAI says it: `tool_calls` where a required or free call was
    /// made, `stop` for a named one (OpenAI's own), else as the engine said.
    pub fn reason<'a>(&self, engine: &'a str) -> &'a str {
        match (&self.mode, engine) {
            (Mode::Required | Mode::Auto(_), "stop") if !self.calls.is_empty() => "tool_calls",
            _ => engine,
        }
    }

    fn scan_char(&mut self, c: char) {
        let s = &mut self.scan;
        if s.arguments {
            if let Some(call) = self.calls.last_mut() {
                call.1.push(c);
            }
        }
        if s.in_string {
            if let Some(captured) = s.captured.as_mut() {
                captured.push(c);
            }
            if s.escape {
                s.escape = false;
            } else if c == '\\' {
                s.escape = true;
            } else if c == '"' {
                s.in_string = false;
                if let Some(raw) = s.captured.take() {
                    let text: String = serde_json::from_str(&raw).unwrap_or_default();
                    match s.key.take() {
                        None => s.key = Some(text),
                        Some(key) if key == "name" => {
                            if let Some(call) = self.calls.last_mut() {
                                call.0 = Some(text);
                            }
                        }
                        Some(_) => {}
                    }
                }
            }
            return;
        }
        match c {
            '"' => {
                s.in_string = true;
                if s.depth == 2 && !s.arguments {
                    s.captured = Some("\"".into());
                }
            }
            '{' | '[' => {
                s.depth += 1;
                if s.depth == 2 && c == '{' {
                    self.calls.push((None, String::new()));
                    s.key = None;
                }
            }
            '}' | ']' => {
                s.depth = s.depth.saturating_sub(1);
                if s.arguments && s.depth == 2 {
                    s.arguments = false;
                    s.key = None;
                }
            }
            ':' if s.depth == 2 && !s.arguments && s.key.as_deref() == Some("parameters") => {
                s.arguments = true;
            }
            ',' if s.depth == 2 => {
                s.key = None;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_required_answer_streams_pieces_that_make_the_whole_calls() {
        let answer = r#"[{"name":"weather","parameters":{"city":"Paris \"Ville\" {x}","days":[1,2]}},{"name":"time","parameters":{}}]"#;
        // Fed in every split of two pieces and one char at a time, the pieces concatenate to the calls.
        for cut in (0..answer.len()).step_by(7).chain([1, answer.len()]) {
            let mut calls = Calls::new(Mode::Required, "call-x".into());
            let mut pieces = calls.push(&answer[..cut]).calls;
            pieces.extend(calls.push(&answer[cut..]).calls);
            assert_eq!(calls.finish(), Delta::default());
            let whole = calls.whole();
            assert_eq!(whole.len(), 2, "{cut}");
            assert_eq!(whole[0]["function"]["name"], "weather");
            assert_eq!(whole[0]["function"]["arguments"], r#"{"city":"Paris \"Ville\" {x}","days":[1,2]}"#);
            assert_eq!(
                whole[1],
                json!({"id": "call-x-1", "type": "function", "function": {"name": "time", "arguments": "{}"}})
            );
            let mut gathered: Vec<(String, String)> = Vec::new();
            for p in pieces {
                let k = p["index"].as_u64().unwrap() as usize;
                if let Some(name) = p["function"]["name"].as_str() {
                    assert_eq!(k, gathered.len(), "a call opens once, in order");
                    assert_eq!(p["id"], format!("call-x-{k}"));
                    gathered.push((name.into(), String::new()));
                }
                gathered[k].1.push_str(p["function"]["arguments"].as_str().unwrap());
            }
            let expected: Vec<(String, String)> = whole
                .iter()
                .map(|c| {
                    (
                        c["function"]["name"].as_str().unwrap().into(),
                        c["function"]["arguments"].as_str().unwrap().into(),
                    )
                })
                .collect();
            assert_eq!(gathered, expected, "{cut}");
            assert_eq!(calls.reason("stop"), "tool_calls");
            assert_eq!(calls.reason("length"), "length");
        }
    }

    #[test]
    fn a_named_answer_is_the_arguments_of_one_call() {
        let mut calls = Calls::new(Mode::Named("weather".into()), "c".into());
        let first = calls.push("{\"ci").calls;
        assert_eq!(
            first,
            vec![
                json!({"index": 0, "id": "c-0", "type": "function", "function": {"name": "weather", "arguments": "{\"ci"}})
            ]
        );
        assert_eq!(
            calls.push("ty\":\"Oslo\"}").calls,
            vec![json!({"index": 0, "function": {"arguments": "ty\":\"Oslo\"}"}})]
        );
        assert_eq!(calls.push(""), Delta::default());
        assert_eq!((calls.finish(), calls.content()), (Delta::default(), None));
        assert_eq!(calls.whole()[0]["function"]["arguments"], "{\"city\":\"Oslo\"}");
        assert_eq!(calls.reason("stop"), "stop");
    }

    #[test]
    fn free_text_calls_are_read_out_of_the_content_however_the_text_is_cut() {
        let answer = "Let me look. <tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n\
                      <tool_call>{\"name\": \"time\", \"arguments\": \"{}\"}</tool_call> a < b <tool_call>not json</tool_call> <tool";
        let chars: Vec<char> = answer.chars().collect();
        for size in [1, 2, 3, 5, 11, answer.len()] {
            let mut calls = Calls::new(Mode::Auto(Parser::Hermes), "c".into());
            let (mut content, mut pieces) = (String::new(), Vec::new());
            for chunk in chars.chunks(size) {
                let d = calls.push(&chunk.iter().collect::<String>());
                assert!(!d.content.contains("<tool_call>{"), "a call never reaches the content: {size}");
                content.push_str(&d.content);
                pieces.extend(d.calls);
            }
            let d = calls.finish();
            content.push_str(&d.content);
            pieces.extend(d.calls);
            assert_eq!(content, "Let me look. \n a < b <tool_call>not json</tool_call> <tool", "{size}");
            assert_eq!(calls.content(), Some(content.as_str()));
            let whole = calls.whole();
            assert_eq!(whole[0]["function"], json!({"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}));
            assert_eq!(whole[1]["function"], json!({"name": "time", "arguments": "{}"}));
            assert_eq!(pieces.len(), 2, "each call whole in one piece: {pieces:?}");
            assert_eq!(calls.reason("stop"), "tool_calls");
        }
        // No call: all content, and the answer ends as the engine said.
        let mut calls = Calls::new(Mode::Auto(Parser::Hermes), "c".into());
        assert_eq!(calls.push("Just text <").content, "Just text ");
        assert_eq!(calls.finish().content, "<");
        assert_eq!((calls.whole(), calls.reason("stop")), (vec![], "stop"));
        // A call whose closing tag never came is read where it is one.
        let mut calls = Calls::new(Mode::Auto(Parser::Hermes), "c".into());
        calls.push("<tool_call>{\"name\": \"time\"}");
        assert_eq!(calls.finish().calls.len(), 1);
        assert_eq!(calls.content(), None);
    }
}
