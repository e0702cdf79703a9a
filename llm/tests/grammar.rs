//! Structured output on the real SmolLM2 file: answers drawn under each kind of format keep to
//! it (checked by parsing them here, not by the library that made the mask), a constraint that
//! steps back allows what it allowed before, and formats that cannot compile are refused with
//! the reason.

use ferry_llm::grammar::{Constraint, Format, Grammars};
use ferry_llm::{ChatOptions, Device, KvSize, Message, Model, Sampling, Seq};
use serde_json::{json, Value};

mod common;
use common::smollm_path;

const BLOCK: u32 = 16;

fn load() -> (Model, Grammars) {
    let model = Model::load(&smollm_path(), Device::Cpu, KvSize::Blocks(64), BLOCK).expect("model");
    let grammars = model.grammars().expect("grammars");
    (model, grammars)
}

fn chat(model: &Model, ask: &str) -> Vec<u32> {
    let messages = [Message::new("user", ask)];
    model.text().chat_tokens(&messages, &ChatOptions::default()).expect("prompt")
}

/// An answer drawn under `constraint` (temperature `t`, seed 7), up to `max` tokens or an end
/// token; its text and whether it ended.
fn answer(model: &Model, constraint: &mut Constraint, prompt: &[u32], t: f32, max: usize) -> (String, bool) {
    let blocks: Vec<u32> = (0..(prompt.len() + max).div_ceil(BLOCK as usize) as u32).collect();
    let mut tokens: Vec<u32> = Vec::new();
    let mut fed: Vec<u32> = prompt.to_vec();
    let mut start = 0;
    while tokens.len() < max {
        let mask = constraint.mask(tokens.len() as u32).expect("mask");
        let sampling = Sampling { temperature: t, seed: 7, allowed: Some(&mask), ..Sampling::GREEDY };
        let out = model.step(&[Seq { tokens: &fed, start, blocks: &blocks, sample: Some(sampling) }]).expect("step");
        let token = out.tokens[0];
        assert!(mask[token as usize / 32] >> (token % 32) & 1 == 1, "token {token} drawn though the mask forbids it");
        constraint.take(tokens.len() as u32, token).expect("take");
        start += fed.len() as u32;
        fed = vec![token];
        if model.text().is_end(token) {
            return (text(model, &tokens), true);
        }
        tokens.push(token);
    }
    (text(model, &tokens), false)
}

fn text(model: &Model, tokens: &[u32]) -> String {
    let mut stream = model.text().stream();
    let mut s: String = tokens.iter().map(|t| stream.push(*t)).collect();
    s.push_str(&stream.finish());
    s
}

#[test]
fn answers_keep_to_a_schema_a_regex_a_choice_and_a_grammar() {
    let (model, grammars) = load();
    let schema = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer"},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "population", "capital"],
        "additionalProperties": false,
    });
    let prompt = chat(&model, "Describe Paris as JSON with city, population and capital.");
    for t in [0.0, 1.0] {
        let mut c = grammars.compile(&Format::JsonSchema(schema.clone())).expect("schema").start();
        let (text, ended) = answer(&model, &mut c, &prompt, t, 60);
        assert!(ended, "no end within 60 tokens at temperature {t}: {text:?}");
        let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
        let object = value.as_object().expect("an object");
        assert_eq!(object.len(), 3, "{text}");
        assert!(object["city"].as_str().is_some_and(|c| c.chars().count() <= 20), "{text}");
        assert!(object["population"].is_i64() || object["population"].is_u64(), "{text}");
        assert!(object["capital"].is_boolean(), "{text}");
        assert!(!text.contains(' ') || object["city"].as_str().unwrap().contains(' '), "compact JSON: {text}");
    }

    let mut c = grammars.compile(&Format::JsonObject).expect("json_object").start();
    let (text, _) = answer(&model, &mut c, &chat(&model, "Give me a JSON object about cats."), 0.0, 80);
    if let Ok(v) = serde_json::from_str::<Value>(&text) {
        assert!(v.is_object(), "{text}");
    } else {
        // Cut by the token limit: still the beginning of an object.
        assert!(text.starts_with('{'), "{text}");
    }

    let mut c = grammars.compile(&Format::Regex(r"[0-9]{3}-[0-9]{4}".into())).expect("regex").start();
    let (text, ended) = answer(&model, &mut c, &chat(&model, "Make up a phone number."), 1.0, 20);
    assert!(ended, "{text}");
    assert!(
        text.len() == 8 && text.chars().enumerate().all(|(i, c)| if i == 3 { c == '-' } else { c.is_ascii_digit() }),
        "{text}"
    );

    let choices = vec!["yes".to_string(), "no".into(), "it says \"maybe\"".into()];
    for t in [0.0, 1.0] {
        let mut c = grammars.compile(&Format::Choice(choices.clone())).expect("choice").start();
        let (text, ended) = answer(&model, &mut c, &chat(&model, "Is the sky blue?"), t, 20);
        assert!(ended && choices.contains(&text), "{text:?}");
    }

    let lark = r#"start: "The answer is " NUMBER "."
NUMBER: /[1-9][0-9]?/"#;
    let mut c = grammars.compile(&Format::Lark(lark.into())).expect("lark").start();
    let (text, ended) = answer(&model, &mut c, &chat(&model, "What is 6 times 7?"), 0.0, 20);
    let number = text.strip_prefix("The answer is ").and_then(|r| r.strip_suffix('.')).expect(&text);
    assert!(ended && number.parse::<u32>().is_ok_and(|n| (1..100).contains(&n)), "{text}");
}

#[test]
fn a_constraint_that_steps_back_allows_what_it_allowed_there() {
    let (model, grammars) = load();
    let guide = grammars.compile(&Format::JsonSchema(json!({"type": "array", "items": {"type": "integer"}}))).unwrap();
    let tokens = model.text().encode("[12,345,6]").unwrap();
    let mut fresh = guide.start();
    let masks: Vec<Vec<u32>> = tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let m = fresh.mask(i as u32).unwrap();
            fresh.take(i as u32, t).unwrap();
            m
        })
        .collect();
    assert!(fresh.complete());
    // Back to each place, from the end: the same mask.
    for i in (0..tokens.len()).rev() {
        assert_eq!(fresh.mask(i as u32).unwrap(), masks[i], "at token {i}");
    }
    // A place not reached yet is an error, not a guess.
    let mut c = guide.start();
    assert!(c.mask(2).unwrap_err().contains("at token 0 of the answer, asked for token 2"));
    // Past the end, only the end tokens, and a taken end counts.
    let ends = model.text().end_tokens();
    for (i, &t) in tokens.iter().enumerate() {
        c.take(i as u32, t).unwrap();
    }
    let at_end = c.mask(tokens.len() as u32).unwrap();
    let allowed: Vec<u32> = (0..model.vocab_size()).filter(|t| at_end[*t as usize / 32] >> (t % 32) & 1 == 1).collect();
    assert!(!allowed.is_empty() && allowed.iter().all(|t| ends.contains(t)), "{allowed:?} vs ends {ends:?}");
}

#[test]
fn an_end_token_that_ends_an_open_lexeme_steps_back_as_one_token() {
    // A bare number's last lexeme is open until an end token closes it: llguidance takes that
    // end token without counting it, so the constraint must not count it either, or stepping back
    // over it would undo a digit too.
    let (model, grammars) = load();
    let guide = grammars.compile(&Format::Regex("[0-9]+".into())).unwrap();
    let digits = model.text().encode("123").unwrap();
    let end = model.text().end_tokens()[0];
    let mut c = guide.start();
    let mut masks = Vec::new();
    for (i, &t) in digits.iter().enumerate() {
        masks.push(c.mask(i as u32).unwrap());
        c.take(i as u32, t).unwrap();
    }
    let before_end = c.mask(digits.len() as u32).unwrap();
    assert!(before_end[end as usize / 32] >> (end % 32) & 1 == 1, "the number may end");
    c.take(digits.len() as u32, end).unwrap();
    // Back over the end token alone, then over the digits: each place allows what it did.
    assert_eq!(c.mask(digits.len() as u32).unwrap(), before_end);
    for i in (0..digits.len()).rev() {
        assert_eq!(c.mask(i as u32).unwrap(), masks[i], "at token {i}");
    }
}

#[test]
fn formats_that_cannot_compile_are_refused_with_the_reason() {
    let (_, grammars) = load();
    let refused = |f: Format| grammars.compile(&f).expect_err("refused");
    assert!(refused(Format::JsonSchema(json!(5))).contains("a JSON schema is an object"));
    assert!(refused(Format::JsonSchema(json!(false))).contains("no value keeps to"));
    assert!(grammars.compile(&Format::JsonSchema(json!(true))).is_ok());
    let e = refused(Format::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 2})));
    assert!(!e.is_empty() && !e.contains('\n'), "{e}");
    let e = refused(Format::Regex("[a-".into()));
    assert!(!e.is_empty(), "{e}");
    assert!(refused(Format::Choice(vec![])).contains("empty"));
    let e = refused(Format::Lark("start: undefined_rule".into()));
    assert!(e.contains("undefined_rule"), "{e}");
}
