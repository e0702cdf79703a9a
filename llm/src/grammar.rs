//! Structured output: the tokens a sequence may draw next so that its answer keeps to a JSON
//! schema, a regular expression, one of a list of strings or a Lark grammar, computed by
//! `llguidance` (the constrained decoding library vLLM, SGLang and llama.cpp use) over the model's
//! own tokenizer.
//!
//! [`Grammars`] is built once per model: llguidance's token trie over every token's bytes (special
//! tokens apart, so that no grammar can spell one), the model's end tokens as its end of text.
//! A request's [`Format`] is compiled once ([`Grammars::compile`]: a schema it cannot compile is
//! the client's error, said before anything is admitted); each sequence then walks its own
//! [`Constraint`]: before a draw, the mask of the tokens allowed after the answer so far; after
//! it, the token taken. Once the grammar is complete only the end tokens are allowed, so the
//! answer ends as a complete value.
//!
//! A constraint knows how many of the answer's tokens it has taken, and steps back when asked for
//! an earlier place: a draw the caller threw away (a failed step retried, a sequence recomputed
//! from its start) leaves it where the answer is.

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use crate::text::Text;

/// What an answer must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Format {
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// A value of this JSON schema (OpenAI's `json_schema`, vLLM's `guided_json`).
    JsonSchema(Value),
    /// A match of this regular expression (Rust's `regex` syntax; vLLM's `guided_regex`).
    Regex(String),
    /// One of these strings exactly (vLLM's `guided_choice`).
    Choice(Vec<String>),
    /// A sentence of this grammar, in llguidance's Lark syntax (vLLM's `guided_grammar` with its
    /// `guidance` backend).
    Lark(String),
}

/// The grammar compiler of one model's tokenizer.
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("vocab", &self.factory.tok_env().tok_trie().vocab_size()).finish()
    }
}

impl Grammars {
    /// Builds the token trie over `text`'s tokenizer; `vocab` is the model's vocabulary (its
    /// logits), at least the tokenizer's, the rest never allowed.
    pub fn new(text: &Text, vocab: usize) -> Result<Grammars, String> {
        let mut tokenizer = toktrie_hf_tokenizers::ByteTokenizer::from_tokenizer(text.tokenizer().clone())
            .map_err(|e| format!("the tokenizer cannot be used for structured output: {e}"))?;
        let ends = text.end_tokens();
        if !ends.is_empty() {
            tokenizer.set_eos_tokens(&ends);
        }
        let env = tokenizer
            .into_tok_env(Some(vocab))
            .map_err(|e| format!("the tokenizer cannot be used for structured output: {e}"))?;
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| format!("structured output: {e}"))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// The format compiled, ready for each sequence to [`Guide::start`]. The error names what is
    /// wrong with it.
    pub fn compile(&self, format: &Format) -> Result<Guide, String> {
        let grammar = match format {
            Format::JsonObject => TopLevelGrammar::from_json_schema(compact(json!({"type": "object"}))),
            Format::JsonSchema(Value::Bool(true)) => TopLevelGrammar::from_json_schema(compact(json!({}))),
            Format::JsonSchema(Value::Bool(false)) => return Err("the schema is false, which no value keeps to".into()),
            Format::JsonSchema(schema) => {
                if !schema.is_object() {
                    return Err(format!("the schema is {}; a JSON schema is an object", kind(schema)));
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            Format::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Format::Choice(choices) => {
                if choices.is_empty() {
                    return Err("the list of choices is empty".into());
                }
                // Lark's string literals are written as JSON writes strings.
                let literals: Vec<String> = choices.iter().map(|c| Value::from(c.as_str()).to_string()).collect();
                TopLevelGrammar::from_lark(format!("start: {}", literals.join(" | ")))
            }
            Format::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| first_line(&e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(first_line(&e));
        }
        Ok(Guide { start: matcher })
    }
}

/// JSON without whitespace between its tokens, unless the schema says otherwise (`x-guidance`):
/// with any whitespace allowed, a small model can spend its whole answer on newlines.
fn compact(mut schema: Value) -> Value {
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| json!({"whitespace_flexible": false}));
    }
    schema
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// llguidance's errors can run to many lines of context; a refusal says the first.
fn first_line(e: &str) -> String {
    e.lines().find(|l| !l.trim().is_empty()).unwrap_or(e).trim().to_owned()
}

/// A compiled format, from which each sequence starts its own [`Constraint`].
pub struct Guide {
    start: Matcher,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Guide")
    }
}

impl Guide {
    /// A constraint at the start of an answer.
    pub fn start(&self) -> Constraint {
        Constraint { matcher: self.start.deep_clone(), fed: Vec::new() }
    }
}

/// One sequence's place in its format.
pub struct Constraint {
    matcher: Matcher,
    /// For each token of the answer so far, whether the matcher took it: end tokens are not
    /// given to it (the matcher does not count one that ends a pending lexeme, so stepping back
    /// over it would step back one token too many), nor tokens drawn after the format ended
    /// (an `ignore_eos` answer's).
    fed: Vec<bool>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("answered", &self.fed.len()).finish()
    }
}

impl Constraint {
    /// The tokens allowed after the answer's first `answered` tokens, as bits (token `t` is bit
    /// `t % 32` of word `t / 32`): the format's next tokens, or only the end tokens once it is
    /// complete. Steps back first where more than `answered` tokens were taken.
    pub fn mask(&mut self, answered: u32) -> Result<Vec<u32>, String> {
        self.back_to(answered)?;
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| e.to_string())?;
        Ok(mask.as_slice().to_vec())
    }

    /// Takes the token drawn after the answer's first `answered` tokens (as [`Constraint::mask`]
    /// allowed).
    pub fn take(&mut self, answered: u32, token: u32) -> Result<(), String> {
        self.back_to(answered)?;
        let end = self.matcher.tok_env().is_ok_and(|env| env.tok_trie().eos_tokens().contains(&token));
        let feed = !end && !self.matcher.is_stopped();
        if feed {
            self.matcher.consume_token(token).map_err(|e| e.to_string())?;
        }
        self.fed.push(feed);
        Ok(())
    }

    /// Whether the answer so far is a complete sentence of the format.
    pub fn complete(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }

    /// Steps back to the place after `answered` tokens of the answer.
    fn back_to(&mut self, answered: u32) -> Result<(), String> {
        let at = self.fed.len();
        if answered as usize > at {
            return Err(format!(
                "the structured output's state is at token {at} of the answer, asked for token {answered}"
            ));
        }
        let back = self.fed.drain(answered as usize..).filter(|fed| *fed).count();
        if back > 0 {
            self.matcher.rollback(back).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}
