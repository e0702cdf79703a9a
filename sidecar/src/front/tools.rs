//! OpenAI's tools on the built-in engines: `tools` and `tool_choice` read and checked, the tools
//! handed to the model's chat template, and a forced call (`tool_choice: "required"` or a named
//! function) decoded under a JSON schema, as vLLM does it: the named function's `parameters`, or
//! a list of `{"name": ..., "parameters": ...}` of any of the tools. The answer is then read back
//! into `tool_calls` — whole, or streamed as `delta.tool_calls` pieces that concatenate to the
//! same calls ([`Calls`]).
//!
//! `auto` needs a parser for the model's own way of writing a call in free text, which this
//! server does not have: like vLLM without `--enable-auto-tool-choice`, it is refused, naming
//! what to send instead. `none` renders no tools and answers in text.

use serde_json::{json, Value};

use crate::generation::engine::Format;
use ferry_core::outcome::Refusal;

/// How a call is forced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// One call of this function; the answer is its arguments.
    Named(String),
    /// One or more calls (one where `parallel_tool_calls` is false); the answer is their list.
    Required,
}

/// What a request's tools ask of the answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The tools for the chat template; `None` where `tool_choice` is `none`.
    pub listed: Option<Vec<Value>>,
    /// The forced call and the format that forces it.
    pub forced: Option<(Mode, Format)>,
}

fn invalid(message: String) -> Refusal {
    Refusal::invalid(message)
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`; `None` where no tool is given.
pub fn read(tools: Option<&Value>, choice: Option<&Value>, parallel: Option<&Value>) -> Result<Option<Tools>, Refusal> {
    let tools = match tools.filter(|t| !t.is_null()) {
        None => {
            return match choice.filter(|c| !c.is_null() && *c != "none" && *c != "auto") {
                Some(c) => Err(invalid(format!("'tool_choice' is {}; it needs 'tools'", super::format::shown(c)))),
                None => Ok(None),
            }
        }
        Some(Value::Array(tools)) => tools,
        Some(other) => return Err(invalid(format!("'tools' is {}; it must be a list", super::format::shown(other)))),
    };
    if tools.is_empty() {
        return Ok(None);
    }
    // Each tool's name and parameters' schema.
    let mut named: Vec<(String, Value)> = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(invalid(format!("'tools'[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")));
        }
        let function = &tool["function"];
        let name = function.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
        let name = name.ok_or_else(|| invalid(format!("'tools'[{i}].function.name is missing")))?;
        if named.iter().any(|(n, _)| n == name) {
            return Err(invalid(format!("'tools'[{i}].function.name '{name}' names a tool twice")));
        }
        let parameters = match function.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(p) => {
                return Err(invalid(format!(
                    "'tools'[{i}].function.parameters is {}; it must be a JSON schema (an object)",
                    super::format::shown(p)
                )))
            }
        };
        named.push((name.to_owned(), parameters));
    }
    let one_at_a_time = parallel == Some(&Value::Bool(false));
    let forced = match choice.filter(|c| !c.is_null()) {
        Some(Value::String(c)) if c == "none" => return Ok(Some(Tools { listed: None, forced: None })),
        None => {
            return Err(auto(format!("'tools' is a list of {} and 'tool_choice' is \"auto\" by default", tools.len())))
        }
        Some(Value::String(c)) if c == "auto" => return Err(auto("'tool_choice' is \"auto\"".into())),
        Some(Value::String(c)) if c == "required" => {
            let each: Vec<Value> = named
                .iter()
                .map(|(name, parameters)| {
                    json!({
                        "type": "object",
                        "properties": {"name": {"const": name}, "parameters": parameters},
                        "required": ["name", "parameters"],
                        "additionalProperties": false,
                    })
                })
                .collect();
            let mut list = json!({"type": "array", "items": {"anyOf": each}, "minItems": 1});
            if one_at_a_time {
                list["maxItems"] = json!(1);
            }
            (Mode::Required, Format::JsonSchema(list))
        }
        Some(c @ Value::Object(_)) => {
            let name = c.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            let name = name.ok_or_else(|| {
                invalid(format!(
                    "'tool_choice' is {}; a named choice is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                    super::format::shown(c)
                ))
            })?;
            let (_, parameters) = named.iter().find(|(n, _)| n == name).ok_or_else(|| {
                invalid(format!("'tool_choice' names the function '{name}', which is not among 'tools'"))
            })?;
            (Mode::Named(name.to_owned()), Format::JsonSchema(parameters.clone()))
        }
        Some(c) => {
            return Err(invalid(format!(
                "'tool_choice' is {}; it must be \"none\", \"auto\", \"required\" or a named function",
                super::format::shown(c)
            )))
        }
    };
    Ok(Some(Tools { listed: Some(tools.clone()), forced: Some(forced) }))
}

fn auto(what: String) -> Refusal {
    invalid(format!(
        "{what}: this server does not read tool calls out of a model's free text; send 'tool_choice' \"required\" \
         or a named function (decoded under the tools' schemas), or \"none\""
    ))
}

/// A message's tool calls as a template reads them: each call's `arguments`, which OpenAI sends
/// as JSON text, as the object it holds (as vLLM hands them to transformers' templates).
pub fn calls_for_template(i: usize, calls: &Value) -> Result<Value, Refusal> {
    let list = calls.as_array().ok_or_else(|| invalid(format!("messages[{i}].tool_calls must be a list")))?;
    list.iter()
        .enumerate()
        .map(|(j, call)| {
            let mut call = call.clone();
            let function = call.get_mut("function").and_then(Value::as_object_mut);
            let function =
                function.ok_or_else(|| invalid(format!("messages[{i}].tool_calls[{j}].function is missing")))?;
            if !function.get("name").is_some_and(Value::is_string) {
                return Err(invalid(format!("messages[{i}].tool_calls[{j}].function.name is missing")));
            }
            if let Some(Value::String(text)) = function.get("arguments") {
                let parsed: Value = serde_json::from_str(text).map_err(|e| {
                    invalid(format!("messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}"))
                })?;
                function.insert("arguments".into(), parsed);
            }
            Ok(call)
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// One choice's tool calls read from its answer as it comes: the pieces of OpenAI's
/// `delta.tool_calls` each new text brings, and the calls whole.
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
        Calls { mode, id, calls: Vec::new(), opened: 0, scan: Scan::default() }
    }

    /// The `delta.tool_calls` pieces that `text`, the answer's next text, brings.
    pub fn push(&mut self, text: &str) -> Vec<Value> {
        let before: Vec<usize> = self.calls.iter().map(|c| c.1.len()).collect();
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
        }
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

    /// How the choice ended, as OpenAI says it: `tool_calls` for a required call that was made,
    /// `stop` for a named one (OpenAI's own), else as the engine said.
    pub fn reason<'a>(&self, engine: &'a str) -> &'a str {
        match (&self.mode, engine) {
            (Mode::Required, "stop") if !self.calls.is_empty() => "tool_calls",
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

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    fn time() -> Value {
        json!({"type": "function", "function": {"name": "time"}})
    }

    #[test]
    fn tool_choice_reads_into_a_forced_format_or_a_refusal() {
        let tools = json!([weather(), time()]);
        let t = read(Some(&tools), Some(&json!("required")), None).unwrap().unwrap();
        assert_eq!(t.listed.as_ref().map(Vec::len), Some(2));
        let Some((Mode::Required, Format::JsonSchema(schema))) = t.forced else { panic!("{t:?}") };
        assert_eq!(schema["items"]["anyOf"][0]["properties"]["name"], json!({"const": "weather"}));
        assert_eq!(schema["items"]["anyOf"][1]["properties"]["parameters"]["type"], "object");
        assert!(schema.get("maxItems").is_none());
        let one = read(Some(&tools), Some(&json!("required")), Some(&json!(false))).unwrap().unwrap();
        let Some((_, Format::JsonSchema(schema))) = one.forced else { panic!() };
        assert_eq!(schema["maxItems"], 1);
        let named = json!({"type": "function", "function": {"name": "weather"}});
        let t = read(Some(&tools), Some(&named), None).unwrap().unwrap();
        assert_eq!(
            t.forced,
            Some((Mode::Named("weather".into()), Format::JsonSchema(weather()["function"]["parameters"].clone())))
        );
        let none = read(Some(&tools), Some(&json!("none")), None).unwrap().unwrap();
        assert_eq!(none, Tools { listed: None, forced: None });
        assert_eq!(read(None, None, None).unwrap(), None);
        assert_eq!(read(Some(&json!([])), Some(&json!("auto")), None).unwrap(), None);

        let refused = |tools: Value, choice: Value| read(Some(&tools), Some(&choice), None).unwrap_err().message;
        assert!(refused(tools.clone(), json!("auto")).contains("'tool_choice' is \"auto\""));
        assert!(read(Some(&tools), None, None)
            .unwrap_err()
            .message
            .starts_with("'tools' is a list of 2 and 'tool_choice' is \"auto\" by default"));
        assert!(refused(tools.clone(), json!({"type": "function", "function": {"name": "nope"}})).contains("'nope'"));
        assert!(refused(tools.clone(), json!("sometimes")).contains("'tool_choice' is \"sometimes\""));
        assert!(refused(json!([{"type": "function", "function": {}}]), json!("required"))
            .contains("'tools'[0].function.name"));
        assert!(refused(json!([weather(), weather()]), json!("required")).contains("twice"));
        assert!(refused(json!([{"type": "code"}]), json!("required")).contains("'tools'[0] must be"));
        assert!(read(None, Some(&json!("required")), None).unwrap_err().message.contains("it needs 'tools'"));
    }

    #[test]
    fn a_required_answer_streams_pieces_that_make_the_whole_calls() {
        let answer = r#"[{"name":"weather","parameters":{"city":"Paris \"Ville\" {x}","days":[1,2]}},{"name":"time","parameters":{}}]"#;
        // Fed in every split of two pieces and one char at a time, the pieces concatenate to the calls.
        for cut in (0..answer.len()).step_by(7).chain([1, answer.len()]) {
            let mut calls = Calls::new(Mode::Required, "call-x".into());
            let mut pieces = calls.push(&answer[..cut]);
            pieces.extend(calls.push(&answer[cut..]));
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
        let first = calls.push("{\"ci");
        assert_eq!(
            first,
            vec![
                json!({"index": 0, "id": "c-0", "type": "function", "function": {"name": "weather", "arguments": "{\"ci"}})
            ]
        );
        assert_eq!(
            calls.push("ty\":\"Oslo\"}"),
            vec![json!({"index": 0, "function": {"arguments": "ty\":\"Oslo\"}"}})]
        );
        assert_eq!(calls.push(""), Vec::<Value>::new());
        assert_eq!(calls.whole()[0]["function"]["arguments"], "{\"city\":\"Oslo\"}");
        assert_eq!(calls.reason("stop"), "stop");
    }

    #[test]
    fn a_messages_tool_calls_reach_the_template_with_their_arguments_as_objects() {
        let calls = json!([{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}}]);
        let read = calls_for_template(1, &calls).unwrap();
        assert_eq!(read[0]["function"]["arguments"], json!({"city": "Oslo"}));
        let bad = json!([{"function": {"name": "w", "arguments": "{"}}]);
        assert!(calls_for_template(1, &bad)
            .unwrap_err()
            .message
            .starts_with("messages[1].tool_calls[0].function.arguments is not JSON"));
        assert!(calls_for_template(0, &json!([{}])).unwrap_err().message.contains("function is missing"));
    }
}
