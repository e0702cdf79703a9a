//! The `sim-llm` engine (DESIGN.md, "The sim engine for generation"): for tests, demos,
//! benchmarks and the autoscaler's simulation. A token is a whitespace-separated word; the
//! engine answers with the words of its own prompt, cycled (`"a b c"` → `"a b c a b c …"`), for
//! exactly `max_tokens` tokens unless a `stop` string ends it first. A step takes
//! `stepTime + prefillPerToken × prefill tokens + decodePerSeq × decoding sequences +
//! attentionPerSlot × attended slots` (the last off by default: with it on, a long prompt's late
//! chunks cost what attention makes them cost on a real engine).
//!
//! Its KV cache is real in the one way that matters to the scheduler: a store of `blocks ×
//! blockSize` token slots, written at the positions of each step's block tables and read back to
//! answer. The next token of a sequence at position `p` is the one its own table holds at
//! `p − prompt`, so a block given to two sequences, or a table that lost one, shows as a wrong
//! answer rather than passing unnoticed. Sampling parameters do not change its answers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::engine::spell::SlowSpell;

use ferry_core::generation::step::StepCost;

use super::engine::{
    ChatOptions, Detokenizer, Drawn, KvLayout, LanguageModel, Logprobs, Message, StepEngine, StepInput,
};
use crate::engine::{BoxFuture, EngineError};

/// Distinct words the vocabulary holds.
const MAX_VOCABULARY: usize = 1 << 20;
/// Prompt plus produced tokens of one sequence.
const CONTEXT: u32 = 32_768;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimLlmTimes {
    pub step_time: Duration,
    pub prefill_per_token: Duration,
    pub decode_per_seq: Duration,
    /// Per query-key pair of attention ([`ferry_core::generation::step::attended`]).
    pub attention_per_slot: Duration,
}

impl SimLlmTimes {
    fn cost(&self) -> StepCost {
        StepCost {
            fixed: self.step_time,
            per_decode: self.decode_per_seq,
            per_prefill_token: self.prefill_per_token,
            per_context_token: Duration::ZERO,
            per_attended_slot: self.attention_per_slot,
        }
    }
}

/// Words and their ids, in the order they were first seen.
#[derive(Debug, Default)]
struct Vocabulary {
    ids: HashMap<String, u32>,
    words: Vec<String>,
}

pub struct SimLlm {
    times: SimLlmTimes,
    /// Steps that start within this spell are slower (fault injection), timed from `start`.
    slow: Option<SlowSpell>,
    start: std::time::Instant,
    kv: KvLayout,
    vocabulary: Arc<Mutex<Vocabulary>>,
    cache: Arc<Mutex<Vec<u32>>>,
}

impl SimLlm {
    pub fn new(times: SimLlmTimes, kv: KvLayout) -> Self {
        SimLlm {
            times,
            slow: None,
            start: ferry_core::clock::now(),
            kv,
            vocabulary: Arc::default(),
            cache: Arc::new(Mutex::new(vec![u32::MAX; (kv.blocks as usize) * (kv.block_size as usize)])),
        }
    }
}

impl SimLlm {
    /// Makes the steps that start within `spell` slower (fault injection).
    pub fn with_slow_spell(mut self, spell: Option<SlowSpell>) -> Self {
        self.slow = spell;
        self
    }
}

impl LanguageModel for SimLlm {
    fn context_length(&self) -> u32 {
        CONTEXT
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        let mut v = self.vocabulary.lock().expect("vocabulary lock");
        let mut ids = Vec::new();
        for word in text.split_whitespace() {
            let id = match v.ids.get(word) {
                Some(id) => *id,
                None if v.words.len() >= MAX_VOCABULARY => {
                    return Err(format!(
                        "the sim-llm engine's vocabulary is full ({MAX_VOCABULARY} distinct words); '{word}' is new"
                    ))
                }
                None => {
                    let id = v.words.len() as u32;
                    v.words.push(word.to_owned());
                    v.ids.insert(word.to_owned(), id);
                    id
                }
            };
            ids.push(id);
        }
        Ok(ids)
    }

    /// The words seen so far: an id names one of them.
    fn vocab_size(&self) -> u32 {
        self.vocabulary.lock().expect("vocabulary lock").words.len() as u32
    }

    /// The messages' words: sim-llm has no turns to open or close.
    fn chat(&self, messages: &[Message], _options: &ChatOptions) -> Result<String, String> {
        Ok(messages.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join(" "))
    }

    fn detokenizer(&self) -> Box<dyn Detokenizer> {
        Box::new(Words { vocabulary: self.vocabulary.clone(), first: true })
    }

    fn is_end(&self, _token: u32) -> bool {
        false
    }

    /// The word alone (its text puts a space before every word but the first).
    fn token_shown(&self, token: u32) -> Vec<u8> {
        let v = self.vocabulary.lock().expect("vocabulary lock");
        v.words.get(token as usize).map_or_else(Vec::new, |w| w.as_bytes().to_vec())
    }
}

/// Words joined by single spaces.
struct Words {
    vocabulary: Arc<Mutex<Vocabulary>>,
    first: bool,
}

impl Detokenizer for Words {
    fn push(&mut self, token: u32) -> String {
        let v = self.vocabulary.lock().expect("vocabulary lock");
        let word = v.words.get(token as usize).map_or("", String::as_str);
        let text = if self.first { word.to_owned() } else { format!(" {word}") };
        self.first = false;
        text
    }
}

impl StepEngine for SimLlm {
    fn model(&self) -> &dyn LanguageModel {
        self
    }

    fn kv(&self) -> KvLayout {
        self.kv
    }

    fn cost(&self) -> StepCost {
        self.times.cost()
    }

    fn platform(&self) -> &str {
        "ferry_sim_llm"
    }

    /// Its answer is certain: a drawn token's log-probability is 0, and it has no alternative.
    fn step(&self, step: StepInput) -> BoxFuture<Result<Vec<Drawn>, EngineError>> {
        let took = self.times.cost().time(step.shape);
        let took = SlowSpell::time(self.slow.as_ref(), self.start, ferry_core::clock::now(), took);
        let (cache, b) = (self.cache.clone(), self.kv.block_size as usize);
        let slot = move |blocks: &[u32], p: usize| -> Result<usize, EngineError> {
            let block = blocks.get(p / b).ok_or_else(|| {
                EngineError(format!("position {p} is beyond the block table ({} blocks of {b})", blocks.len()))
            })?;
            Ok(*block as usize * b + p % b)
        };
        let result = (|| {
            let mut cache = cache.lock().expect("cache lock");
            let mut sampled = Vec::new();
            for s in &step.sequences {
                for (k, token) in s.tokens.iter().enumerate() {
                    let at = slot(&s.blocks, s.start as usize + k)?;
                    *cache.get_mut(at).ok_or_else(|| EngineError(format!("block {} is not in the cache", at / b)))? =
                        *token;
                }
                if let Some(sampling) = &s.sample {
                    let next = s.start as usize + s.tokens.len();
                    let source = next - s.prompt as usize;
                    let token = cache[slot(&s.blocks, source)?];
                    let logprobs = sampling.logprobs.map(|top| Logprobs {
                        logprob: 0.0,
                        top: if top > 0 { vec![(token, 0.0)] } else { Vec::new() },
                    });
                    sampled.push(Drawn { token, logprobs });
                }
            }
            Ok(sampled)
        })();
        Box::pin(async move {
            tokio::time::sleep(took).await;
            result
        })
    }
}
