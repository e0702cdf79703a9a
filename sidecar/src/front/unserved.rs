//! Fields of OpenAI's (and vLLM's) completion requests that change the answer but that the
//! built-in engines do not act on yet. A client that sends one expects a different answer — a
//! function call for the legacy `functions`, the prompt echoed for `echo` — so it is refused
//! with a 400 naming the field, rather than answered with free prose and a 200. Each is accepted
//! at its neutral value (what sending nothing means), since clients and SDKs fill some of them in
//! by default. Fields that do not change the answer (`user`, `metadata`, `store`, `service_tier`,
//! vendor extensions) stay accepted and ignored, as vLLM does. A relay's upstream gets the body as
//! sent, so this check is the built-in engines' alone.

use serde_json::{Map, Value};

use ferry_core::outcome::Refusal;

/// A field's neutral values: what the field means when it is absent.
enum Neutral {
    /// A number equal to one of these.
    Numbers(&'static [f64]),
    Bool(bool),
    /// An empty object or list, or an empty string.
    Empty,
    /// One of these strings.
    Strings(&'static [&'static str]),
    /// A list of `"text"` alone (`modalities`).
    TextOnly,
    /// Only `null`.
    Null,
}

impl Neutral {
    fn holds(&self, value: &Value) -> bool {
        if value.is_null() {
            return true;
        }
        match self {
            Neutral::Numbers(neutral) => value.as_f64().is_some_and(|v| neutral.contains(&v)),
            Neutral::Bool(neutral) => value.as_bool() == Some(*neutral),
            Neutral::Empty => match value {
                Value::Object(o) => o.is_empty(),
                Value::Array(a) => a.is_empty(),
                Value::String(s) => s.is_empty(),
                _ => false,
            },
            Neutral::Strings(neutral) => value.as_str().is_some_and(|v| neutral.contains(&v)),
            Neutral::TextOnly => value.as_array().is_some_and(|m| m.iter().all(|m| m == "text")),
            Neutral::Null => false,
        }
    }

    /// What to send instead, for the refusal.
    fn describe(&self) -> String {
        match self {
            Neutral::Numbers(n) => {
                format!("leave it out or send {}", n.iter().map(f64::to_string).collect::<Vec<_>>().join(" or "))
            }
            Neutral::Bool(b) => format!("leave it out or send {b}"),
            Neutral::Empty => "leave it out or send it empty".into(),
            Neutral::Strings(s) => format!(
                "leave it out or send {}",
                s.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(" or ")
            ),
            Neutral::TextOnly => "leave it out or send [\"text\"]".into(),
            Neutral::Null => "leave it out".into(),
        }
    }
}

/// The fields, in the order a refusal names the first one sent.
const UNSERVED: &[(&str, Neutral)] = &[
    ("stop_token_ids", Neutral::Empty),
    ("include_stop_str_in_output", Neutral::Bool(false)),
    ("prompt_logprobs", Neutral::Null),
    ("echo", Neutral::Bool(false)),
    ("best_of", Neutral::Numbers(&[1.0])),
    ("use_beam_search", Neutral::Bool(false)),
    ("suffix", Neutral::Empty),
    ("functions", Neutral::Empty),
    ("function_call", Neutral::Strings(&["none", "auto"])),
    ("modalities", Neutral::TextOnly),
    ("audio", Neutral::Null),
    ("web_search_options", Neutral::Null),
    // A reasoning model's effort and a model's length of answer: none of the built-in engines'
    // models takes either, so neither can be honoured.
    ("reasoning_effort", Neutral::Null),
    ("verbosity", Neutral::Strings(&["medium"])),
    ("chat_template", Neutral::Null),
    ("allowed_token_ids", Neutral::Empty),
    ("bad_words", Neutral::Empty),
    ("truncate_prompt_tokens", Neutral::Null),
    ("skip_special_tokens", Neutral::Bool(true)),
    ("length_penalty", Neutral::Numbers(&[1.0])),
];

/// `Err` naming the first field of `rest` (the body's fields this server does not read itself)
/// that the built-in engines would not honour.
pub fn check(rest: &Map<String, Value>) -> Result<(), Refusal> {
    check_fields(rest, |_| true)
}

fn check_fields(rest: &Map<String, Value>, which: impl Fn(&str) -> bool) -> Result<(), Refusal> {
    for (field, neutral) in UNSERVED.iter().filter(|(field, _)| which(field)) {
        let Some(value) = rest.get(*field) else { continue };
        if !neutral.holds(value) {
            return Err(Refusal::invalid(format!(
                "'{field}' is {}; this model's engine does not act on it yet ({})",
                super::format::shown(value),
                neutral.describe()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(body: Value) -> Option<String> {
        check(body.as_object().unwrap()).err().map(|r| r.message)
    }

    #[test]
    fn a_field_that_would_change_the_answer_is_named_with_its_value_and_what_to_send() {
        assert_eq!(
            refused(json!({"best_of": 5})).unwrap(),
            "'best_of' is 5; this model's engine does not act on it yet (leave it out or send 1)"
        );
        assert_eq!(
            refused(json!({"echo": true})).unwrap(),
            "'echo' is true; this model's engine does not act on it yet (leave it out or send false)"
        );
        assert!(refused(json!({"functions": [{"name": "f"}]})).unwrap().starts_with("'functions' is"));
        assert!(refused(json!({"best_of": 3})).unwrap().contains("send 1"));
        assert!(refused(json!({"function_call": "f"})).unwrap().contains("\"none\" or \"auto\""));
        assert!(refused(json!({"modalities": ["text", "audio"]})).unwrap().starts_with("'modalities'"));
        let long = refused(json!({"functions": (0..100).map(|i| json!({"n": i})).collect::<Vec<_>>()})).unwrap();
        assert!(long.contains("...;") && long.len() < 200, "{long}");
    }

    #[test]
    fn neutral_values_and_fields_that_do_not_change_the_answer_pass() {
        let neutral = json!({
            "stop_token_ids": [], "prompt_logprobs": null,
            "echo": false, "best_of": 1, "suffix": "", "tools": [],
            "tool_choice": "none", "modalities": ["text"], "add_generation_prompt": true,
            "user": "u", "metadata": {"a": "b"}, "store": false, "service_tier": "auto", "x_vendor": 1
        });
        assert_eq!(refused(neutral), None);
    }
}
