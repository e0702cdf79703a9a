//! Ferry's built-in LLM decoder: the Llama family (Llama 2/3, Mistral, SmolLM, TinyLlama,
//! Qwen2) from a GGUF file or a Hugging Face folder, run one engine step at a time over a paged
//! KV cache whose blocks the caller's scheduler hands out.
//!
//! A crate of its own so that its numeric code is compiled optimised in every profile (a
//! forward pass in an unoptimised test build would take seconds a token), and so that the
//! decoder knows nothing of serving: the sidecar's `llm` engine wraps [`Model`] behind its
//! step-engine trait.
//!
//! # Layout
//!
//! - [`gguf`]: llama.cpp's file, memory-mapped: metadata, tensor directory, block formats.
//! - [`quant`]: products on quantized blocks as stored, with 8-bit activations, by tiles.
//! - [`config`]: the decoder's shape from GGUF metadata or `config.json`.
//! - [`weights`]: the tensors of either format in one layout (Q/K un-permuted, QKV and gate/up
//!   stacked), quantized matrices kept as stored.
//! - [`text`]: tokenizer, incremental detokenization, end-of-turn tokens.
//! - [`template`]: the chat template, compiled once, and a request's controls over it.
//! - [`kv`]: the paged KV store the block tables index.
//! - [`cpu`]: the forward pass of a step on the CPU (the fast host path); [`attention`] its
//!   causal attention over the paged cache, by tiles of tokens.
//! - [`device`]: the same pass written once as device operations (projections and the kernels
//!   of `kernels.cu`), run by `gpu` (feature `cuda`: cuBLAS and NVRTC through cudarc) and by
//!   [`host`], which emulates them so that the GPU's algorithm is tested where there is no GPU.
//! - [`grammar`]: structured output: the tokens a JSON schema, regex or grammar allows next.
//! - [`sample`]: the next token from logits, drawn from (seed, position).
//! - [`Model`]: all of it loaded on a [`Device`], with its cache; [`read`] the files alone.

pub mod attention;
pub mod config;
pub mod cpu;
pub mod device;
pub mod gguf;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod grammar;
pub mod host;
pub mod kv;
pub mod quant;
pub mod sample;
pub mod template;
pub mod text;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

pub use config::{Config, Family};
pub use template::ChatOptions;
pub use text::{Message, Text, TextStream};

use cpu::Rope;
use kv::KvCache;
pub use kv::KvDtype;
use weights::Weights;

/// How the next token is drawn ([`sample::sample`]). Greedy at temperature 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling<'a> {
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
    /// Only the `top_k` most likely tokens may be drawn; 0 for all.
    pub top_k: u32,
    /// Only tokens at least `min_p` times as likely as the most likely one may be drawn.
    pub min_p: f32,
    /// Added to the logits of these tokens before anything else (greedy included).
    pub logit_bias: &'a [(u32, f32)],
    /// Subtracted from the logit of every token the answer holds already (vLLM's and OpenAI's
    /// `presence_penalty`).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once for every time the answer holds it.
    pub frequency_penalty: f32,
    /// Divides a positive logit, and multiplies a negative one, of every token in the prompt or
    /// the answer (vLLM's `repetition_penalty`; 1 for none).
    pub repetition_penalty: f32,
    /// The sequence so far, `prompt` tokens of prompt then the answer: what the penalties count.
    /// Empty where none is set.
    pub history: &'a [u32],
    pub prompt: u32,
    /// Tokens that may not be drawn: the end tokens while an answer is shorter than its
    /// `min_tokens`.
    pub suppress: &'a [u32],
    /// The only tokens that may be drawn, as bits (token `t` is bit `t % 32` of word `t / 32`):
    /// a structured output's next tokens ([`grammar::Constraint::mask`]). Where they are all
    /// suppressed, they are drawn from all the same (the format allows nothing else).
    pub allowed: Option<&'a [u32]>,
}

impl Sampling<'_> {
    pub const GREEDY: Sampling<'static> = Sampling {
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        top_k: 0,
        min_p: 0.0,
        logit_bias: &[],
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        repetition_penalty: 1.0,
        history: &[],
        prompt: 0,
        suppress: &[],
        allowed: None,
    };

    /// Whether a penalty is set (and the history must be passed).
    pub fn penalised(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || self.repetition_penalty != 1.0
    }
}

/// One sequence's part of a step: the tokens it feeds at positions `start..`, its block table
/// (covering every position up to its last new token), and whether to sample after them.
#[derive(Debug, Clone, PartialEq)]
pub struct Seq<'a> {
    pub tokens: &'a [u32],
    pub start: u32,
    pub blocks: &'a [u32],
    pub sample: Option<Sampling<'a>>,
}

/// What a step produced: one token per sampling sequence, in order, and their logits.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub tokens: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
}

/// How large the KV cache is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvSize {
    /// Exactly this many blocks.
    Blocks(u32),
    /// As many blocks as fit in this many bytes.
    Bytes(u64),
    /// As many blocks as fit in this share of the device's memory left free once the weights
    /// are loaded (the GPU's; on the CPU, of the memory available).
    Fraction(f64),
}

/// How a model is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Options {
    /// Every matrix dequantized to f32 at load, rather than computed as stored.
    pub dequantize: bool,
    /// What the KV cache holds; `None` for f16 on the CPU (f32 with `dequantize`) and f32 on the
    /// GPU, whose path has no f16 cache yet.
    pub kv_dtype: Option<KvDtype>,
}

/// Where the forward pass runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// The GPU of this ordinal (feature `cuda`).
    Cuda(usize),
}

/// A loaded model and its KV cache.
pub struct Model {
    text: Text,
    config: Config,
    blocks: u32,
    positions: usize,
    backend: Backend,
    kv_dtype: KvDtype,
    source: PathBuf,
}

enum Backend {
    Cpu(Box<CpuDecoder>),
    #[cfg(feature = "cuda")]
    Gpu(Box<gpu::GpuDecoder>),
}

/// The decoder on the CPU: its weights, rotary tables and KV cache.
struct CpuDecoder {
    weights: Weights,
    rope: Rope,
    cache: Mutex<KvCache>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("source", &self.source).field("config", &self.config).finish()
    }
}

/// Blocks of `block_size` tokens that `bytes` hold at `per_token` bytes a token.
fn blocks_in(bytes: u64, per_token: u64, block_size: u32) -> u32 {
    (bytes / (per_token * u64::from(block_size))).min(u64::from(u32::MAX)) as u32
}

/// Bytes of memory available on this machine (`MemAvailable`), if the kernel says.
fn memory_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

impl Model {
    /// Loads the model at `source` (a `.gguf` file, a folder holding one, or a Hugging Face
    /// folder with `config.json`) onto `device` and allocates its KV cache. Every failure names
    /// the file and the field at fault.
    pub fn load(source: &Path, device: Device, size: KvSize, block_size: u32) -> Result<Model, String> {
        Model::load_with(source, device, size, block_size, Options::default())
    }

    /// [`Model::load`] with every matrix dequantized to f32 ([`Weights::dequantized`]) and the
    /// KV cache in f32: the exact path, slower and up to eight times larger, that the reference
    /// tests hold to transformers' f32 logits.
    pub fn load_dequantized(source: &Path, device: Device, size: KvSize, block_size: u32) -> Result<Model, String> {
        Model::load_with(source, device, size, block_size, Options { dequantize: true, kv_dtype: None })
    }

    /// [`Model::load`] with `options`.
    pub fn load_with(
        source: &Path,
        device: Device,
        size: KvSize,
        block_size: u32,
        options: Options,
    ) -> Result<Model, String> {
        if block_size == 0 {
            return Err("the KV block size is 0; it must be at least 1".into());
        }
        let kv_dtype = match (device, options.kv_dtype) {
            (Device::Cuda(_), Some(KvDtype::F16)) => {
                return Err("--kv-cache-dtype f16: the GPU path holds its KV cache in f32 only, for now".into())
            }
            (Device::Cuda(_), _) => KvDtype::F32,
            (Device::Cpu, Some(dtype)) => dtype,
            (Device::Cpu, None) if options.dequantize => KvDtype::F32,
            (Device::Cpu, None) => KvDtype::F16,
        };
        let (weights, text) = read(source)?;
        let weights = if options.dequantize { weights.dequantized() } else { weights };
        let config = weights.config.clone();
        let per_token = KvCache::bytes_per_token(config.layers, config.kv_dim(), kv_dtype) as u64;
        let enough = |blocks: u32| -> Result<u32, String> {
            if blocks < 2 {
                return Err(format!(
                    "the KV cache holds {blocks} blocks of {block_size} tokens ({per_token} bytes a token for this \
                     model); it needs at least 2"
                ));
            }
            Ok(blocks)
        };
        let (backend, blocks, positions) = match device {
            Device::Cpu => {
                let blocks = enough(match size {
                    KvSize::Blocks(b) => b,
                    KvSize::Bytes(bytes) => blocks_in(bytes, per_token, block_size),
                    KvSize::Fraction(f) => {
                        let free = memory_available()
                            .ok_or("the memory available is unknown (no /proc/meminfo); give the KV cache's size")?;
                        blocks_in((free as f64 * f) as u64, per_token, block_size)
                    }
                })?;
                let rope = Rope::new(&config, config.context);
                let cache =
                    KvCache::new(config.layers, config.kv_dim(), blocks as usize, block_size as usize, kv_dtype);
                (Backend::Cpu(Box::new(CpuDecoder { weights, rope, cache: Mutex::new(cache) })), blocks, config.context)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                let (decoder, blocks) = gpu::GpuDecoder::new(&weights, ordinal, size, block_size, enough)?;
                let positions = decoder.positions();
                (Backend::Gpu(Box::new(decoder)), blocks, positions)
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(ordinal) => {
                return Err(format!(
                    "device cuda:{ordinal}: this build of the decoder has no CUDA code (cargo feature `cuda`)"
                ))
            }
        };
        Ok(Model { text, config, blocks, positions, backend, kv_dtype, source: source.to_owned() })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn text(&self) -> &Text {
        &self.text
    }

    /// Where the forward pass runs.
    pub fn device(&self) -> Device {
        match &self.backend {
            Backend::Cpu(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Backend::Gpu(g) => Device::Cuda(g.ordinal()),
        }
    }

    /// Blocks of the KV cache.
    pub fn kv_blocks(&self) -> u32 {
        self.blocks
    }

    /// Bytes the KV cache takes a token.
    pub fn kv_bytes_per_token(&self) -> usize {
        KvCache::bytes_per_token(self.config.layers, self.config.kv_dim(), self.kv_dtype)
    }

    /// Token ids the model knows: `0..vocab_size`.
    pub fn vocab_size(&self) -> u32 {
        self.config.vocab as u32
    }

    /// Prompt plus produced tokens a sequence may hold.
    pub fn context_length(&self) -> u32 {
        self.positions as u32
    }

    /// Runs one step: writes the new tokens' keys and values into their blocks, and samples
    /// one token after the last new token of each sequence that asks.
    pub fn step(&self, seqs: &[Seq<'_>]) -> Result<Sampled, String> {
        let logits = self.forward(seqs)?;
        let sampling = seqs.iter().filter_map(|s| s.sample.map(|m| (m, s.start + s.tokens.len() as u32)));
        let tokens = sampling.zip(&logits).map(|((m, position), l)| sample::sample(l, &m, position)).collect();
        Ok(Sampled { tokens, logits })
    }

    /// The forward pass of a step: writes the new tokens' keys and values into their blocks and
    /// returns the logits after the last new token of each sequence that samples, in order
    /// (drawn from with [`sample::sample`]; [`Model::step`] does both).
    pub fn forward(&self, seqs: &[Seq<'_>]) -> Result<Vec<Vec<f32>>, String> {
        Ok(match &self.backend {
            Backend::Cpu(d) => {
                let mut cache = d.cache.lock().map_err(|_| "the KV cache lock is poisoned".to_owned())?;
                // The whole pass on one of rayon's threads: each of its ~150 parallel regions a
                // token (five a layer) is then a push onto that thread's own queue, which the
                // other threads steal from while they spin between regions — called from outside
                // the pool, each region would hand its work over and park the caller until it is
                // done, two thread wake-ups a region.
                let cache: &mut kv::KvCache = &mut cache;
                rayon::scope(|_| cpu::forward(&d.weights, &d.rope, cache, seqs))?
            }
            #[cfg(feature = "cuda")]
            Backend::Gpu(g) => g.step(seqs)?,
        })
    }

    /// The compiler of structured output formats over this model's tokenizer ([`grammar`]).
    pub fn grammars(&self) -> Result<grammar::Grammars, String> {
        grammar::Grammars::new(&self.text, self.config.vocab)
    }
}

/// Reads weights and text side from either format.
pub fn read(source: &Path) -> Result<(Weights, Text), String> {
    let shown = source.display().to_string();
    let file = if source.is_dir() {
        if source.join("config.json").is_file() {
            let config = Config::from_hf(source)?;
            let text = Text::from_hf(source)?;
            let weights = Weights::from_hf(source, config)?;
            return Ok((weights, text));
        }
        let ggufs: Vec<PathBuf> = std::fs::read_dir(source)
            .map_err(|e| format!("{shown}: {e}"))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        match ggufs.as_slice() {
            [one] => one.clone(),
            [] => {
                return Err(format!("{shown}: neither config.json (a Hugging Face folder) nor a .gguf file is there"))
            }
            many => return Err(format!("{shown}: {} .gguf files; name the one to serve", many.len())),
        }
    } else {
        source.to_owned()
    };
    let name = file.display().to_string();
    let g = gguf::Gguf::open(&file).map_err(|e| format!("{name}: {e}"))?;
    let config = Config::from_gguf(&g, &name)?;
    let text = Text::from_gguf(&g, &name)?;
    let weights = Weights::from_gguf(&g, config, &name)?;
    Ok((weights, text))
}
