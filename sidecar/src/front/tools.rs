//! OpenAI's tools on the built-in engines: `tools` and `tool_choice` read and checked, the tools
//! handed to the model's chat template, and a forced call (`tool_choice: "required"` or a named
//! function) decoded under a JSON schema, as vLLM does it: the named function's `parameters`, or
//! a list of `{"name": ..., "parameters": ...}` of any of the tools. The answer is then read back
//! into `tool_calls` — whole, or streamed as `delta.tool_calls` pieces that concatenate to the
//! same calls ([`super::calls`]).
//!
//! `auto` (the default where tools are given) needs a parser for the model's own way of writing
//! a call in free text, named at start (`--tool-call-parser`, as vLLM's); without one it is
//! refused, naming what to send instead, as vLLM refuses it without `--enable-auto-tool-choice`.
//! `none` renders no tools and answers in text.

use serde_json::{json, Value};

use crate::generation::engine::Format;
use ferry_core::outcome::Refusal;

/// How a model writes its calls in free text (`--tool-call-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parser {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: Hermes 2 Pro and Qwen 2.5/3
    /// (vLLM's `hermes`).
    Hermes,
}

impl std::str::FromStr for Parser {
    type Err = String;

    fn from_str(s: &str) -> Result<Parser, String> {
        match s {
            "hermes" => Ok(Parser::Hermes),
            other => Err(format!("--tool-call-parser is '{other}'; this server reads hermes")),
        }
    }
}

/// How an answer's tool calls are made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// One call of this function; the answer is its arguments.
    Named(String),
    /// One or more calls (one where `parallel_tool_calls` is false); the answer is their list.
    Required,
    /// Calls, if any, written in free text as the parser reads them, content around them.
    Auto(Parser),
}

/// What a request's tools ask of the answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The tools for the chat template; `None` where `tool_choice` is `none`.
    pub listed: Option<Vec<Value>>,
    /// How the answer's calls are read; `None` for none.
    pub mode: Option<Mode>,
    /// The format a forced call is decoded under.
    pub format: Option<Format>,
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`; `None` where no tool is given.
/// `parser` reads calls in free text, for `auto`.
pub fn read(
    tools: Option<&Value>,
    choice: Option<&Value>,
    parallel: Option<&Value>,
    parser: Option<Parser>,
) -> Result<Option<Tools>, Refusal> {
    let tools = match tools.filter(|t| !t.is_null()) {
        None => {
            return match choice.filter(|c| !c.is_null() && *c != "none" && *c != "auto") {
                Some(c) => {
                    Err(Refusal::invalid(format!("'tool_choice' is {}; it needs 'tools'", super::format::shown(c))))
                }
                None => Ok(None),
            }
        }
        Some(Value::Array(tools)) => tools,
        Some(other) => {
            return Err(Refusal::invalid(format!("'tools' is {}; it must be a list", super::format::shown(other))))
        }
    };
    if tools.is_empty() {
        return Ok(None);
    }
    // Each tool's name and parameters' schema.
    let mut named: Vec<(String, Value)> = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(Refusal::invalid(format!(
                "'tools'[{i}] is {}; it must be {{\"type\": \"function\", \"function\": {{...}}}}",
                super::format::shown(tool)
            )));
        }
        let function = &tool["function"];
        let name = function.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
        let name =
            name.ok_or_else(|| Refusal::invalid(format!("'tools'[{i}].function.name must be a name (a string)")))?;
        if named.iter().any(|(n, _)| n == name) {
            return Err(Refusal::invalid(format!("'tools'[{i}].function.name '{name}' names a tool twice")));
        }
        let mut parameters = match function.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(p) => {
                return Err(Refusal::invalid(format!(
                    "'tools'[{i}].function.parameters is {}; it must be a JSON schema (an object)",
                    super::format::shown(p)
                )))
            }
        };
        // A call's arguments are an object (OpenAI's): said where the schema leaves it open.
        match parameters.get("type") {
            None => {
                parameters["type"] = json!("object");
            }
            Some(t) if t == "object" => {}
            Some(t) => {
                return Err(Refusal::invalid(format!(
                    "'tools'[{i}].function.parameters has the type {t}; a call's arguments are an object"
                )))
            }
        }
        named.push((name.to_owned(), parameters));
    }
    let one_at_a_time = parallel == Some(&Value::Bool(false));
    let auto = |what: String| match parser {
        Some(parser) => Ok(Some(Tools { listed: Some(tools.clone()), mode: Some(Mode::Auto(parser)), format: None })),
        None => Err(no_parser(what)),
    };
    let forced = match choice.filter(|c| !c.is_null()) {
        Some(Value::String(c)) if c == "none" => return Ok(Some(Tools { listed: None, mode: None, format: None })),
        None => return auto(format!("'tools' is a list of {} and 'tool_choice' is \"auto\" by default", tools.len())),
        Some(Value::String(c)) if c == "auto" => return auto("'tool_choice' is \"auto\"".into()),
        Some(Value::String(c)) if c == "required" => {
            // Each tool's definitions move to the list's root, where its `$ref`s (`#/$defs/X`)
            // look for them once its schema is nested (as vLLM does); a name two tools define
            // differently cannot be shared.
            let mut defs = serde_json::Map::new();
            let mut each = Vec::with_capacity(named.len());
            for (i, (name, parameters)) in named.iter().enumerate() {
                let mut parameters = parameters.clone();
                for key in ["$defs", "definitions"] {
                    let Some(Value::Object(own)) = parameters.as_object_mut().and_then(|p| p.remove(key)) else {
                        continue;
                    };
                    let shared = defs.entry(key).or_insert_with(|| json!({}));
                    for (def, schema) in own {
                        match shared.get(&def) {
                            Some(other) if *other != schema => {
                                return Err(Refusal::invalid(format!(
                                    "'tools'[{i}].function.parameters defines {key}/{def} unlike another tool; \
                                     under tool_choice \"required\" the tools' definitions are shared: rename it"
                                )))
                            }
                            _ => {
                                shared[def.as_str()] = schema;
                            }
                        }
                    }
                }
                each.push(json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": parameters},
                    "required": ["name", "parameters"],
                    "additionalProperties": false,
                }));
            }
            let mut list = json!({"type": "array", "items": {"anyOf": each}, "minItems": 1});
            if one_at_a_time {
                list["maxItems"] = json!(1);
            }
            for (key, shared) in defs {
                list[key.as_str()] = shared;
            }
            (Mode::Required, Format::JsonSchema(list))
        }
        Some(c @ Value::Object(_)) => {
            let name = c.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            let name = name.ok_or_else(|| {
                Refusal::invalid(format!(
                    "'tool_choice' is {}; a named choice is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                    super::format::shown(c)
                ))
            })?;
            let (_, parameters) = named.iter().find(|(n, _)| n == name).ok_or_else(|| {
                Refusal::invalid(format!("'tool_choice' names the function '{name}', which is not among 'tools'"))
            })?;
            (Mode::Named(name.to_owned()), Format::JsonSchema(parameters.clone()))
        }
        Some(c) => {
            return Err(Refusal::invalid(format!(
                "'tool_choice' is {}; it must be \"none\", \"auto\", \"required\" or a named function",
                super::format::shown(c)
            )))
        }
    };
    let (mode, format) = forced;
    Ok(Some(Tools { listed: Some(tools.clone()), mode: Some(mode), format: Some(format) }))
}

fn no_parser(what: String) -> Refusal {
    Refusal::invalid(format!(
        "{what}: this server was started without --tool-call-parser, so it does not read tool calls out of the \
         model's free text; send 'tool_choice' \"required\" or a named function (decoded under the tools' \
         schemas), or \"none\""
    ))
}

/// A message's tool calls as a template reads them: each call's `arguments`, which OpenAI sends
/// as JSON text, as the object it holds (as vLLM hands them to transformers' templates).
pub fn calls_for_template(i: usize, calls: &Value) -> Result<Value, Refusal> {
    let list = calls.as_array().ok_or_else(|| Refusal::invalid(format!("messages[{i}].tool_calls must be a list")))?;
    list.iter()
        .enumerate()
        .map(|(j, call)| {
            let mut call = call.clone();
            let function = call.get_mut("function").and_then(Value::as_object_mut);
            let function = function
                .ok_or_else(|| Refusal::invalid(format!("messages[{i}].tool_calls[{j}].function is missing")))?;
            if !function.get("name").is_some_and(Value::is_string) {
                return Err(Refusal::invalid(format!("messages[{i}].tool_calls[{j}].function.name is missing")));
            }
            if let Some(Value::String(text)) = function.get("arguments") {
                let parsed: Value = serde_json::from_str(text).map_err(|e| {
                    Refusal::invalid(format!("messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}"))
                })?;
                function.insert("arguments".into(), parsed);
            }
            Ok(call)
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
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
        let t = read(Some(&tools), Some(&json!("required")), None, None).unwrap().unwrap();
        assert_eq!(t.listed.as_ref().map(Vec::len), Some(2));
        let (Some(Mode::Required), Some(Format::JsonSchema(schema))) = (&t.mode, &t.format) else { panic!("{t:?}") };
        assert_eq!(schema["items"]["anyOf"][0]["properties"]["name"], json!({"const": "weather"}));
        assert_eq!(schema["items"]["anyOf"][1]["properties"]["parameters"]["type"], "object");
        assert!(schema.get("maxItems").is_none());
        let one = read(Some(&tools), Some(&json!("required")), Some(&json!(false)), None).unwrap().unwrap();
        let Some(Format::JsonSchema(schema)) = one.format else { panic!() };
        assert_eq!(schema["maxItems"], 1);
        let named = json!({"type": "function", "function": {"name": "weather"}});
        let t = read(Some(&tools), Some(&named), None, None).unwrap().unwrap();
        assert_eq!(t.mode, Some(Mode::Named("weather".into())));
        assert_eq!(t.format, Some(Format::JsonSchema(weather()["function"]["parameters"].clone())));
        let none = read(Some(&tools), Some(&json!("none")), None, None).unwrap().unwrap();
        assert_eq!(none, Tools { listed: None, mode: None, format: None });
        // With a parser, auto (and no choice) reads free text; without one, it is refused.
        for choice in [Some(json!("auto")), None] {
            let auto = read(Some(&tools), choice.as_ref(), None, Some(Parser::Hermes)).unwrap().unwrap();
            assert_eq!(auto.mode, Some(Mode::Auto(Parser::Hermes)));
            assert_eq!((auto.format, auto.listed.map(|l| l.len())), (None, Some(2)));
        }
        assert_eq!("hermes".parse::<Parser>(), Ok(Parser::Hermes));
        assert!("mistral".parse::<Parser>().unwrap_err().contains("'mistral'"));
        assert_eq!(read(None, None, None, None).unwrap(), None);
        assert_eq!(read(Some(&json!([])), Some(&json!("auto")), None, None).unwrap(), None);

        // Definitions move to the list's root; a name defined twice differently is refused.
        let with_defs = |unit: &str| {
            json!({"type": "function", "function": {"name": format!("f{unit}"), "parameters": {
                "type": "object", "properties": {"t": {"$ref": "#/$defs/Temp"}},
                "$defs": {"Temp": {"type": "number", "description": unit}}}}})
        };
        let t = read(Some(&json!([with_defs("c")])), Some(&json!("required")), None, None).unwrap().unwrap();
        let Some(Format::JsonSchema(schema)) = t.format else { panic!() };
        assert_eq!(schema["$defs"]["Temp"]["description"], "c");
        assert!(schema["items"]["anyOf"][0]["properties"]["parameters"].get("$defs").is_none());
        let twice = json!([with_defs("c"), with_defs("f")]);
        let e = read(Some(&twice), Some(&json!("required")), None, None).unwrap_err().message;
        assert!(e.starts_with("'tools'[1].function.parameters defines $defs/Temp unlike another tool"), "{e}");
        // Arguments are an object: an open schema says so, another type is refused.
        let open = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        let named = json!({"type": "function", "function": {"name": "f"}});
        let t = read(Some(&open), Some(&named), None, None).unwrap().unwrap();
        assert_eq!(t.format, Some(Format::JsonSchema(json!({"type": "object"}))));
        let number = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "number"}}}]);
        let e = read(Some(&number), Some(&named), None, None).unwrap_err().message;
        assert!(e.contains("has the type \"number\"; a call's arguments are an object"), "{e}");

        let refused = |tools: Value, choice: Value| read(Some(&tools), Some(&choice), None, None).unwrap_err().message;
        assert!(refused(tools.clone(), json!("auto")).contains("'tool_choice' is \"auto\""));
        assert!(read(Some(&tools), None, None, None)
            .unwrap_err()
            .message
            .starts_with("'tools' is a list of 2 and 'tool_choice' is \"auto\" by default"));
        assert!(refused(tools.clone(), json!({"type": "function", "function": {"name": "nope"}})).contains("'nope'"));
        assert!(refused(tools.clone(), json!("sometimes")).contains("'tool_choice' is \"sometimes\""));
        assert!(refused(json!([{"type": "function", "function": {}}]), json!("required"))
            .contains("'tools'[0].function.name"));
        assert!(refused(json!([weather(), weather()]), json!("required")).contains("twice"));
        assert!(refused(json!([{"type": "code"}]), json!("required"))
            .contains("'tools'[0] is {\"type\":\"code\"}; it must be"));
        assert!(read(None, Some(&json!("required")), None, None).unwrap_err().message.contains("it needs 'tools'"));
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
