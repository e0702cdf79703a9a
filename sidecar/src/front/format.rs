//! The structured output a request asks for, in OpenAI's words (`response_format`: `text`,
//! `json_object`, `json_schema`, and `grammar` with a Lark grammar) or vLLM's (`guided_json`,
//! `guided_regex`, `guided_choice`, `guided_grammar`, and their newer `structured_outputs`
//! object), read into one [`Format`]. At most one may be given; the model's engine compiles it,
//! and a format it cannot follow is a 400 naming the field and why.

use serde_json::{Map, Value};

use crate::generation::engine::Format;
use ferry_core::outcome::Refusal;

/// The fields that ask for a structured output, in the order they are read.
pub const FIELDS: [&str; 6] =
    ["response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"];

/// The longest value a refusal repeats.
const SHOWN: usize = 80;

/// `value` as a refusal repeats it: its JSON, cut at [`SHOWN`] bytes.
pub fn shown(value: &Value) -> String {
    let mut shown = value.to_string();
    if shown.len() > SHOWN {
        let cut = (0..=SHOWN).rev().find(|i| shown.is_char_boundary(*i)).unwrap_or(0);
        shown.truncate(cut);
        shown.push_str("...");
    }
    shown
}

/// The format the fields of `fields` (a body's, by name) ask for, and the field that asked;
/// `None` where none does (absent, null, or `response_format: {"type": "text"}`).
pub fn read(fields: &Map<String, Value>) -> Result<Option<(&'static str, Format)>, Refusal> {
    let mut asked: Option<(&'static str, Format)> = None;
    for field in FIELDS {
        let Some(value) = fields.get(field).filter(|v| !v.is_null()) else { continue };
        let Some(format) = one(field, value)? else { continue };
        if let Some((first, _)) = &asked {
            return Err(Refusal::invalid(format!(
                "'{first}' and '{field}' both ask for a structured output; send one of them"
            )));
        }
        asked = Some((field, format));
    }
    Ok(asked)
}

fn invalid(field: &str, value: &Value, why: &str) -> Refusal {
    Refusal::invalid(format!("'{field}' is {}; {why}", shown(value)))
}

fn one(field: &'static str, value: &Value) -> Result<Option<Format>, Refusal> {
    let string = |why: &str| value.as_str().map(str::to_owned).ok_or_else(|| invalid(field, value, why));
    Ok(Some(match field {
        "response_format" => return response_format(value),
        "guided_json" => Format::JsonSchema(schema(field, value)?),
        "guided_regex" => Format::Regex(string("it must be a regular expression, as a string")?),
        "guided_choice" => Format::Choice(choices(field, value)?),
        "guided_grammar" => Format::Lark(string("it must be a grammar in Lark syntax, as a string")?),
        _ => return structured_outputs(value),
    }))
}

/// A JSON schema, given as an object or as its JSON text (vLLM takes both).
fn schema(field: &str, value: &Value) -> Result<Value, Refusal> {
    match value {
        Value::Object(_) | Value::Bool(_) => Ok(value.clone()),
        Value::String(text) => serde_json::from_str(text)
            .map_err(|e| invalid(field, value, &format!("as a JSON schema's text it does not parse: {e}"))),
        _ => Err(invalid(field, value, "it must be a JSON schema (an object)")),
    }
}

fn choices(field: &str, value: &Value) -> Result<Vec<String>, Refusal> {
    let list = value
        .as_array()
        .and_then(|l| l.iter().map(|c| c.as_str().map(str::to_owned)).collect::<Option<Vec<_>>>())
        .ok_or_else(|| invalid(field, value, "it must be a list of strings"))?;
    if list.is_empty() {
        return Err(invalid(field, value, "it must hold at least one string"));
    }
    Ok(list)
}

fn response_format(value: &Value) -> Result<Option<Format>, Refusal> {
    const FIELD: &str = "response_format";
    let kind = value.get("type").and_then(Value::as_str);
    Ok(Some(match kind {
        Some("text") => return Ok(None),
        Some("json_object") => Format::JsonObject,
        Some("json_schema") => {
            let spec = value
                .get("json_schema")
                .filter(|s| s.is_object())
                .ok_or_else(|| invalid(FIELD, value, "a json_schema format needs 'json_schema', an object"))?;
            match spec.get("schema").filter(|s| !s.is_null()) {
                Some(s) => Format::JsonSchema(schema("response_format.json_schema.schema", s)?),
                // OpenAI's schema is optional: any JSON then.
                None => Format::JsonSchema(Value::Object(Map::new())),
            }
        }
        Some("grammar") => match value.get("grammar") {
            Some(Value::String(g)) => Format::Lark(g.clone()),
            _ => return Err(invalid(FIELD, value, "a grammar format needs 'grammar', a Lark grammar as a string")),
        },
        _ => return Err(invalid(FIELD, value, "its type must be text, json_object, json_schema or grammar")),
    }))
}

/// vLLM's `structured_outputs`: one of `json`, `regex`, `choice`, `grammar`, `json_object`.
fn structured_outputs(value: &Value) -> Result<Option<Format>, Refusal> {
    const FIELD: &str = "structured_outputs";
    let object = value.as_object().ok_or_else(|| invalid(FIELD, value, "it must be an object"))?;
    let mut asked = Vec::new();
    for (key, v) in object.iter().filter(|(_, v)| !v.is_null()) {
        let format = match key.as_str() {
            "json" => Format::JsonSchema(schema("structured_outputs.json", v)?),
            "regex" => Format::Regex(
                v.as_str().ok_or_else(|| invalid("structured_outputs.regex", v, "it must be a string"))?.to_owned(),
            ),
            "choice" => Format::Choice(choices("structured_outputs.choice", v)?),
            "grammar" => Format::Lark(
                v.as_str().ok_or_else(|| invalid("structured_outputs.grammar", v, "it must be a string"))?.to_owned(),
            ),
            "json_object" if v == &Value::Bool(false) => continue,
            "json_object" => Format::JsonObject,
            // Options of vLLM's backends (disable_fallback, whitespace_pattern, ...) do not ask.
            _ => continue,
        };
        asked.push((key.clone(), format));
    }
    match asked.len() {
        0 => Ok(None),
        1 => Ok(asked.pop().map(|a| a.1)),
        _ => Err(Refusal::invalid(format!(
            "'structured_outputs' asks for {}; send one of them",
            asked.iter().map(|a| a.0.as_str()).collect::<Vec<_>>().join(" and ")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read_one(body: Value) -> Result<Option<(&'static str, Format)>, String> {
        read(body.as_object().unwrap()).map_err(|r| r.message)
    }

    #[test]
    fn each_field_reads_into_its_format() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (json!({"response_format": {"type": "json_object"}}), "response_format", Format::JsonObject),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
                "response_format",
                Format::JsonSchema(schema.clone()),
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format",
                Format::JsonSchema(json!({})),
            ),
            (
                json!({"response_format": {"type": "grammar", "grammar": "start: \"a\""}}),
                "response_format",
                Format::Lark("start: \"a\"".into()),
            ),
            (json!({"guided_json": schema}), "guided_json", Format::JsonSchema(schema.clone())),
            (json!({"guided_json": schema.to_string()}), "guided_json", Format::JsonSchema(schema.clone())),
            (json!({"guided_regex": "a+"}), "guided_regex", Format::Regex("a+".into())),
            (json!({"guided_choice": ["a", "b"]}), "guided_choice", Format::Choice(vec!["a".into(), "b".into()])),
            (json!({"guided_grammar": "start: \"a\""}), "guided_grammar", Format::Lark("start: \"a\"".into())),
            (
                json!({"structured_outputs": {"choice": ["a"], "disable_fallback": true}}),
                "structured_outputs",
                Format::Choice(vec!["a".into()]),
            ),
            (json!({"structured_outputs": {"json_object": true}}), "structured_outputs", Format::JsonObject),
        ];
        for (body, field, format) in cases {
            assert_eq!(read_one(body.clone()), Ok(Some((field, format))), "{body}");
        }
        for none in [
            json!({}),
            json!({"response_format": {"type": "text"}}),
            json!({"response_format": null, "guided_json": null}),
            json!({"structured_outputs": {"json_object": false}}),
        ] {
            assert_eq!(read_one(none.clone()), Ok(None), "{none}");
        }
    }

    #[test]
    fn bad_formats_are_refused_naming_the_field_and_the_value() {
        let cases = [
            (json!({"response_format": {"type": "xml"}}), "'response_format' is {\"type\":\"xml\"}; its type must be"),
            (json!({"response_format": {"type": "json_schema"}}), "needs 'json_schema'"),
            (
                json!({"guided_json": "{not json"}),
                "'guided_json' is \"{not json\"; as a JSON schema's text it does not parse",
            ),
            (json!({"guided_json": 5}), "'guided_json' is 5; it must be a JSON schema"),
            (json!({"guided_regex": 5}), "'guided_regex' is 5; it must be a regular expression"),
            (json!({"guided_choice": []}), "'guided_choice' is []; it must hold at least one string"),
            (json!({"guided_choice": ["a", 1]}), "it must be a list of strings"),
            (json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}), "asks for regex and choice"),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "'response_format' and 'guided_regex' both ask for a structured output",
            ),
        ];
        for (body, said) in cases {
            let e = read_one(body.clone()).expect_err("refused");
            assert!(e.contains(said), "{body}: {e}");
        }
        let long = json!({"guided_regex": 5, "guided_json": "x".repeat(500)});
        assert!(read_one(long).unwrap_err().len() < 200);
    }
}
