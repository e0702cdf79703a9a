//! The contract between the generation shell and an engine that runs steps: the built-in
//! decoder, the `sim-llm` engine, or an upstream server's adapter implement it.
//!
//! A step takes, for each of its sequences, the token ids it feeds (a prefill chunk, or the last
//! token for a decode), their first position, the sequence's KV block table (the scheduler's
//! pages: the engine writes the new tokens' keys and values there and attends over every block
//! of the table) and, for the sequences whose chunk reaches their last known token, the sampling
//! parameters; it returns one sampled token for each of those, in member order.
//!
//! The text side belongs to the model, behind [`LanguageModel`]: tokenization, the chat
//! template, incremental detokenization that never splits a character, the end-of-sequence test.

use std::sync::Arc;

use ferry_core::generation::kv::Block;
use ferry_core::generation::sequence::SeqId;
use ferry_core::generation::step::{StepCost, StepShape};

use crate::engine::{BoxFuture, EngineError};

/// How a conversation is rendered: `add_generation_prompt`, `continue_final_message` and
/// `chat_template_kwargs`, as vLLM takes them.
pub use ferry_llm::ChatOptions;

/// What a structured output keeps to: a JSON schema, a regex, a choice, a grammar.
pub use ferry_llm::grammar::Format;

/// How a sequence's next token is drawn (vLLM's sampling parameters, as far as they are served).
/// Greedy at temperature 0. `sim-llm` answers with its prompt's words whatever they say: it has
/// no distribution to draw from.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    /// Draws are a function of the seed and the token's position, so that a sequence recomputed
    /// after a preemption draws the same tokens again.
    pub seed: u64,
    /// The most likely tokens drawn from; 0 for all.
    pub top_k: u32,
    /// The least likelihood, relative to the most likely token's, of a token drawn.
    pub min_p: f32,
    /// Added to the logits of these tokens (OpenAI's `logit_bias`); shared, since every step
    /// that samples the sequence passes it to the engine.
    pub logit_bias: Arc<[(u32, f32)]>,
    /// An end-of-sequence token does not end the answer (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// OpenAI's `presence_penalty` and `frequency_penalty` (over the answer) and vLLM's
    /// `repetition_penalty` (over prompt and answer; 1 for none).
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    /// The answer's least tokens: until then no end token is drawn and no `stop` string looked
    /// for (vLLM's `min_tokens`).
    pub min_tokens: u32,
    /// Each drawn token's log-probability is returned, with this many of the most likely
    /// tokens' (OpenAI's `logprobs` and `top_logprobs`); `None` for none.
    pub logprobs: Option<u32>,
    /// The structured output the answer keeps to (`response_format`, vLLM's `guided_*`).
    pub guide: Option<Guide>,
}

/// A sequence's structured output: its format, compiled once for the request, and the
/// sequence's own place in it. Clones are the same sequence's (each step's copy of its sampling
/// moves the one place); [`Guide::fresh`] starts another sequence at the beginning.
#[derive(Clone)]
pub struct Guide {
    format: Arc<ferry_llm::grammar::Guide>,
    place: Arc<std::sync::Mutex<ferry_llm::grammar::Constraint>>,
}

impl Guide {
    pub fn new(format: ferry_llm::grammar::Guide) -> Guide {
        let place = Arc::new(std::sync::Mutex::new(format.start()));
        Guide { format: Arc::new(format), place }
    }

    /// The same format for another sequence, at its beginning.
    pub fn fresh(&self) -> Guide {
        Guide { format: self.format.clone(), place: Arc::new(std::sync::Mutex::new(self.format.start())) }
    }

    /// The tokens allowed after `answered` tokens of answer ([`ferry_llm::grammar::Constraint::mask`]).
    pub fn mask(&self, answered: u32) -> Result<Vec<u32>, String> {
        self.place.lock().map_err(|_| "the structured output's lock is poisoned".to_owned())?.mask(answered)
    }

    /// Takes the token drawn after `answered` tokens of answer.
    pub fn take(&self, answered: u32, token: u32) -> Result<(), String> {
        self.place.lock().map_err(|_| "the structured output's lock is poisoned".to_owned())?.take(answered, token)
    }
}

impl PartialEq for Guide {
    fn eq(&self, other: &Guide) -> bool {
        Arc::ptr_eq(&self.place, &other.place)
    }
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Guide")
    }
}

impl Sampling {
    /// Whether the next token, after `answered` tokens of answer, is one of the answer's first
    /// `min_tokens`: not an end token, and no `stop` string is looked for in it (vLLM's rule).
    pub fn holds_ends(&self, answered: u32) -> bool {
        answered < self.min_tokens
    }

    /// Whether a penalty is set: the engine is then given the sequence's tokens so far.
    pub fn penalised(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || self.repetition_penalty != 1.0
    }
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 1.0,
            top_p: 1.0,
            seed: 0,
            top_k: 0,
            min_p: 0.0,
            logit_bias: Arc::new([]),
            ignore_eos: false,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_tokens: 0,
            logprobs: None,
            guide: None,
        }
    }
}

/// A token drawn for a sequence, with its log-probabilities where its sampling asks.
#[derive(Debug, Clone, PartialEq)]
pub struct Drawn {
    pub token: u32,
    pub logprobs: Option<Logprobs>,
}

impl Drawn {
    pub fn token(token: u32) -> Drawn {
        Drawn { token, logprobs: None }
    }
}

/// A drawn token's log-probability under the model (before bias, penalties and temperature:
/// vLLM's default), and the most likely tokens', most likely first.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// One sequence's part of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqInput {
    pub id: SeqId,
    /// The tokens it feeds, at positions `start..start + tokens.len()`.
    pub tokens: Vec<u32>,
    pub start: u32,
    /// Its prompt's length: positions at and after it hold tokens the model produced.
    pub prompt: u32,
    /// Its KV block table, covering every position up to its last new token.
    pub blocks: Vec<Block>,
    /// Sample a token after the last one (its chunk reaches its last known token).
    pub sample: Option<Sampling>,
    /// Its tokens so far (prompt, then answer) when it samples with a penalty, which counts them;
    /// empty otherwise (copying every sequence's tokens into every step would cost more than
    /// the step at thousands of streams).
    pub history: Arc<[u32]>,
}

/// One engine step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepInput {
    pub shape: StepShape,
    pub sequences: Vec<SeqInput>,
}

/// A message of a chat conversation.
pub use ferry_llm::Message;

/// The model's text side.
pub trait LanguageModel: Send + Sync + 'static {
    /// Prompt plus produced tokens the model can attend over.
    fn context_length(&self) -> u32;

    /// The token ids of a text. The message (a 400 body) says what cannot be tokenized.
    fn encode(&self, text: &str) -> Result<Vec<u32>, String>;

    /// Token ids the model knows, `0..vocab_size` (a prompt given as ids is checked against it).
    fn vocab_size(&self) -> u32;

    /// The prompt of a conversation, rendered with the model's own chat template.
    fn chat(&self, messages: &[Message], options: &ChatOptions) -> Result<String, String>;

    /// The token ids of a conversation through the chat template, with no special token read
    /// from the messages' own text (where the model has special tokens: a user must not be able
    /// to type a turn of another role).
    fn chat_tokens(&self, messages: &[Message], options: &ChatOptions) -> Result<Vec<u32>, String> {
        self.encode(&self.chat(messages, options)?)
    }

    /// A fresh incremental detokenizer for one sequence's produced tokens.
    fn detokenizer(&self) -> Box<dyn Detokenizer>;

    /// Whether the token ends the sequence (end of sequence, end of turn).
    fn is_end(&self, token: u32) -> bool;

    /// A token as a list of log-probabilities shows it: its bytes (a special token by its name).
    fn token_shown(&self, token: u32) -> Vec<u8>;

    /// `format` compiled for this model's tokens, or why it cannot be followed (a 400's reason).
    fn guide(&self, format: &Format) -> Result<Guide, String> {
        let _ = format;
        Err("this model's engine does not act on it".into())
    }
}

/// Turns one sequence's produced tokens into text as they come, never splitting a UTF-8
/// character (a token that ends mid-character gives its bytes with the next).
pub trait Detokenizer: Send {
    /// The text that token completes.
    fn push(&mut self, token: u32) -> String;

    /// What is still held when the sequence ends (bytes of a character its last token left
    /// unfinished, shown as U+FFFD as a lossy decode would).
    fn finish(&mut self) -> String {
        String::new()
    }
}

/// KV cache layout the engine offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub blocks: u32,
    pub block_size: u32,
}

pub trait StepEngine: Send + Sync + 'static {
    fn model(&self) -> &dyn LanguageModel;

    fn kv(&self) -> KvLayout;

    /// What a step costs before any is measured.
    fn cost(&self) -> StepCost;

    /// Whether the engine can take steps.
    fn ready(&self) -> bool {
        true
    }

    /// OpenAI's `owned_by` and OIP's `platform`: what serves the model.
    fn platform(&self) -> &str;

    /// Runs one step: one drawn token per sequence with `sample`, in order. Its future must
    /// not borrow the engine.
    fn step(&self, step: StepInput) -> BoxFuture<Result<Vec<Drawn>, EngineError>>;
}
