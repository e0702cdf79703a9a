//! The `llm` engine: ferry-llm's decoder behind the step-engine contract, so the generation
//! shell, admission and the OpenAI front serve a real model exactly as they serve `sim-llm`.
//!
//! A step runs on tokio's blocking pool (the forward pass takes the CPU for milliseconds to
//! seconds); its future owns what it needs. The first step-time estimate comes from timing a
//! one-token decode and a 64-token prefill at load, before anything is admitted; the scheduler
//! learns the real costs from then on.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::generation::step::{attended, StepCost};
use ferry_llm::grammar::Grammars;
use ferry_llm::{KvSize, Model, Seq};

use super::engine::{
    ChatOptions, Detokenizer, Drawn, Format, Guide, KvLayout, LanguageModel, Logprobs, Message, Sampling, SeqInput,
    StepEngine, StepInput,
};
use crate::embed::Device;
use crate::engine::{BoxFuture, EngineError};

pub struct LlmEngine {
    model: Arc<Model>,
    /// The model's end tokens, masked while an answer is shorter than its `min_tokens`.
    ends: Arc<[u32]>,
    kv: KvLayout,
    cost: StepCost,
    /// Special tokens typed in messages read as tokens (`--special-tokens-in-messages`).
    message_specials: bool,
    /// The structured output compiler over the model's tokenizer, or why there is none.
    grammars: Result<Arc<Grammars>, String>,
}

/// The KV cache's share of the GPU memory left once the weights are loaded, when its size is
/// not given.
pub const DEFAULT_GPU_KV_FRACTION: f64 = 0.9;

impl LlmEngine {
    /// Loads the model onto its device and times it. The KV cache holds `kv_blocks` blocks,
    /// else what `kv_memory` bytes hold, else 1 GiB's worth on the CPU and 90 % of the GPU
    /// memory left free by the weights. `auto` takes GPU 0 when this build has the CUDA code
    /// and the GPU can be used, and says in one log line when it falls back to the CPU.
    /// `options` say how the weights and the KV cache are held.
    pub fn load(
        source: &Path,
        device: Device,
        kv_blocks: Option<u32>,
        kv_memory: Option<u64>,
        block_size: u32,
        options: ferry_llm::Options,
    ) -> Result<LlmEngine, String> {
        let load = |device, size| Model::load_with(source, device, size, block_size, options);
        let size = |gpu: bool| match (kv_blocks, kv_memory) {
            (Some(b), _) => KvSize::Blocks(b),
            (None, Some(bytes)) => KvSize::Bytes(bytes),
            (None, None) if gpu => KvSize::Fraction(DEFAULT_GPU_KV_FRACTION),
            (None, None) => KvSize::Bytes(DEFAULT_KV_CACHE_MEMORY),
        };
        let model = match device {
            Device::Cpu => load(ferry_llm::Device::Cpu, size(false))?,
            Device::Cuda(n) => load(ferry_llm::Device::Cuda(n), size(true))?,
            Device::Auto if !cfg!(feature = "cuda") => {
                tracing::info!("device auto: this build has no CUDA code (cargo feature 'cuda'); running on the CPU");
                load(ferry_llm::Device::Cpu, size(false))?
            }
            Device::Auto => match load(ferry_llm::Device::Cuda(0), size(true)) {
                Ok(m) => m,
                Err(e) => {
                    tracing::info!("device auto: the llm engine cannot use GPU 0 ({e}); running on the CPU");
                    load(ferry_llm::Device::Cpu, size(false))?
                }
            },
        };
        let model = Arc::new(model);
        let kv = KvLayout { blocks: model.kv_blocks(), block_size };
        let cost = calibrate(&model, block_size).map_err(|e| format!("the first steps failed: {e}"))?;
        let ends = model.text().end_tokens().into();
        let started = ferry_core::clock::now();
        let grammars = model.grammars().map(Arc::new);
        match &grammars {
            Ok(_) => tracing::debug!("structured output ready in {:?}", ferry_core::clock::elapsed(started)),
            Err(e) => tracing::info!("no structured output for this model: {e}"),
        }
        Ok(LlmEngine { model, ends, kv, cost, message_specials: false, grammars })
    }

    /// Reads special tokens typed in chat messages as the tokens they name.
    pub fn reading_message_specials(mut self, on: bool) -> Self {
        self.message_specials = on;
        self
    }
}

impl LlmEngine {
    /// Where the forward pass runs.
    pub fn device(&self) -> ferry_llm::Device {
        self.model.device()
    }
}

/// Times, on the idle cache, a prefill of 64 tokens (fewer if the cache or the context holds
/// less), a one-token decode after it, and the same 64 tokens as a chunk late in a long prompt
/// (after up to 2048 tokens: what those slots hold does not change the time); each the least of
/// three runs after a warm-up. The late chunk's extra time over the first is attention's, n·c
/// slots more, which a cost linear in tokens would miss ([`ferry_core::generation::step`]).
fn calibrate(model: &Model, block_size: u32) -> Result<StepCost, String> {
    let room =
        u64::from(model.kv_blocks()).saturating_mul(u64::from(block_size)).min(u64::from(model.context_length()));
    let prefill = 64u32.min(room.saturating_sub(1) as u32).max(1);
    let late = room.saturating_sub(u64::from(prefill) + 1).min(2048) as u32;
    let table = |tokens: u32| -> Vec<u32> { (0..tokens.div_ceil(block_size)).collect() };
    let (blocks, late_blocks) = (table(prefill + 1), table(late + prefill));
    let prompt = vec![0; prefill as usize];
    let greedy = Some(ferry_llm::Sampling::GREEDY);
    // The least of three runs after one that is not counted, as the embedding engine calibrates:
    // the first steps fault the weights' pages in and grow the heap, and a machine's noise only
    // ever adds time. A prior taken from one slow run is well above a step's cost (a fifth to
    // two fifths on SmolLM2 here), which refuses a fresh pod's long prompts at admission until
    // measured steps correct it.
    let timed = |seq: Seq<'_>| -> Result<Duration, String> {
        model.step(std::slice::from_ref(&seq))?;
        let mut least = Duration::MAX;
        for _ in 0..3 {
            let started = ferry_core::clock::now();
            model.step(std::slice::from_ref(&seq))?;
            least = least.min(ferry_core::clock::elapsed(started));
        }
        Ok(least)
    };
    let long = timed(Seq { tokens: &prompt, start: 0, blocks: &blocks, sample: greedy })?;
    let one = timed(Seq { tokens: &[0], start: prefill, blocks: &blocks, sample: greedy })?;
    let deep = timed(Seq { tokens: &prompt, start: late, blocks: &late_blocks, sample: greedy })?;
    let fixed = one.mul_f64(0.8);
    let slots = attended(late, prefill) - attended(0, prefill);
    let per_attended_slot = match slots {
        0 => Duration::ZERO,
        slots => Duration::from_nanos((deep.saturating_sub(long).as_nanos() / u128::from(slots)) as u64),
    };
    Ok(StepCost {
        fixed,
        per_decode: one - fixed,
        per_prefill_token: long.saturating_sub(fixed) / prefill.max(1),
        per_context_token: Duration::ZERO,
        per_attended_slot,
    })
}

impl LanguageModel for LlmEngine {
    fn context_length(&self) -> u32 {
        self.model.context_length()
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.model.text().encode(text)
    }

    fn vocab_size(&self) -> u32 {
        self.model.vocab_size()
    }

    fn chat(&self, messages: &[Message], options: &ChatOptions) -> Result<String, String> {
        self.model.text().chat(messages, options)
    }

    fn chat_tokens(&self, messages: &[Message], options: &ChatOptions) -> Result<Vec<u32>, String> {
        let text = self.model.text();
        if self.message_specials {
            return text.encode(&text.chat(messages, options)?);
        }
        text.chat_tokens(messages, options)
    }

    fn detokenizer(&self) -> Box<dyn Detokenizer> {
        Box::new(Text(self.model.text().stream()))
    }

    fn is_end(&self, token: u32) -> bool {
        self.model.text().is_end(token)
    }

    fn token_shown(&self, token: u32) -> Vec<u8> {
        self.model.text().token_shown(token)
    }

    fn guide(&self, format: &Format) -> Result<Guide, String> {
        let grammars = self.grammars.as_ref().map_err(String::clone)?;
        Ok(Guide::new(grammars.compile(format)?))
    }
}

struct Text(ferry_llm::TextStream);

impl Detokenizer for Text {
    fn push(&mut self, token: u32) -> String {
        self.0.push(token)
    }

    fn finish(&mut self) -> String {
        self.0.finish()
    }
}

impl StepEngine for LlmEngine {
    fn model(&self) -> &dyn LanguageModel {
        self
    }

    fn kv(&self) -> KvLayout {
        self.kv
    }

    fn cost(&self) -> StepCost {
        self.cost
    }

    fn platform(&self) -> &str {
        "ferry_llm"
    }

    fn step(&self, step: StepInput) -> BoxFuture<Result<Vec<Drawn>, EngineError>> {
        let (model, ends) = (self.model.clone(), self.ends.clone());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || run(&model, &ends, &step))
                .await
                .map_err(|e| EngineError(format!("the step's thread failed: {e}")))?
        })
    }
}

/// Tokens of answer before the one a sequence's part of a step draws.
fn answered(seq: &SeqInput) -> u32 {
    (seq.start + seq.tokens.len() as u32).saturating_sub(seq.prompt)
}

/// One step on the blocking pool: the forward pass, with the masks of the sequences that keep
/// to a structured output computed beside it (on a thread of their own: on a GPU the CPU would
/// otherwise wait on the pass), then each sampling sequence's draw.
fn run(model: &Model, ends: &[u32], step: &StepInput) -> Result<Vec<Drawn>, EngineError> {
    let seqs: Vec<Seq> = step
        .sequences
        .iter()
        .map(|s| Seq {
            tokens: &s.tokens,
            start: s.start,
            blocks: &s.blocks,
            sample: s.sample.as_ref().map(|_| ferry_llm::Sampling::GREEDY),
        })
        .collect();
    let sampling: Vec<(&SeqInput, &Sampling)> =
        step.sequences.iter().filter_map(|s| Some((s, s.sample.as_ref()?))).collect();
    let guided = sampling.iter().any(|(_, m)| m.guide.is_some());
    let masks = |sampling: &[(&SeqInput, &Sampling)]| -> Vec<Option<Vec<u32>>> {
        sampling.iter().map(|(seq, m)| m.guide.as_ref().map(|g| mask(g, answered(seq), ends))).collect()
    };
    let (logits, masks) = if guided {
        std::thread::scope(|scope| {
            let masks = scope.spawn(|| masks(&sampling));
            let logits = model.forward(&seqs);
            (logits, masks.join())
        })
    } else {
        (model.forward(&seqs), Ok(vec![None; sampling.len()]))
    };
    let logits = logits.map_err(EngineError)?;
    let masks = masks.map_err(|_| EngineError("the structured output's thread failed".into()))?;
    Ok(sampling
        .iter()
        .zip(&logits)
        .zip(&masks)
        .map(|(((seq, m), logits), mask)| {
            let answered = answered(seq);
            let draw = ferry_llm::Sampling {
                temperature: m.temperature,
                top_p: m.top_p,
                seed: m.seed,
                top_k: m.top_k,
                min_p: m.min_p,
                logit_bias: &m.logit_bias,
                presence_penalty: m.presence_penalty,
                frequency_penalty: m.frequency_penalty,
                repetition_penalty: m.repetition_penalty,
                history: &seq.history,
                prompt: seq.prompt,
                suppress: if m.holds_ends(answered) { ends } else { &[] },
                allowed: mask.as_deref(),
            };
            let token = ferry_llm::sample::sample(logits, &draw, seq.start + seq.tokens.len() as u32);
            if let Some(guide) = &m.guide {
                if let Err(e) = guide.take(answered, token) {
                    tracing::warn!("structured output: {e}");
                }
            }
            Drawn {
                token,
                logprobs: m.logprobs.map(|top| {
                    let l = ferry_llm::sample::logprobs(logits, token, top as usize);
                    Logprobs { logprob: l.logprob, top: l.top }
                }),
            }
        })
        .collect())
}

/// A sequence's mask; where its format cannot say (an internal error of the matcher), only the
/// end tokens, so that the answer ends rather than leaves its format.
fn mask(guide: &Guide, answered: u32, ends: &[u32]) -> Vec<u32> {
    guide.mask(answered).unwrap_or_else(|e| {
        tracing::warn!("structured output: {e}; the answer ends here");
        let mut bits = vec![0u32; ends.iter().max().map_or(1, |m| *m as usize / 32 + 1)];
        for &t in ends {
            bits[t as usize / 32] |= 1 << (t % 32);
        }
        bits
    })
}

/// The KV cache's budget on the CPU when neither `--kv-blocks` nor `--kv-cache-memory` is given.
pub const DEFAULT_KV_CACHE_MEMORY: u64 = 1 << 30;
