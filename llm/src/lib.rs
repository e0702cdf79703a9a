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
//! - [`gguf`]: llama.cpp's file: metadata, tensor directory, block formats to f32.
//! - [`config`]: the decoder's shape from GGUF metadata or `config.json`.
//! - [`weights`]: the tensors of either format in one layout (Q/K un-permuted, QKV and gate/up
//!   stacked).
//! - [`text`]: tokenizer, chat template, incremental detokenization, end-of-turn tokens.
//! - [`kv`]: the paged KV store the block tables index.
//! - [`cpu`]: the forward pass of a step on the CPU.
//! - [`sample`]: the next token from logits, drawn from (seed, position).
//! - [`Model`]: all of it loaded, with its cache.

pub mod config;
pub mod cpu;
pub mod gguf;
pub mod kv;
pub mod sample;
pub mod text;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

pub use config::{Config, Family};
pub use text::{Message, Text, TextStream};

use cpu::Rope;
use kv::KvCache;
use weights::Weights;

/// How the next token is drawn. Greedy at temperature 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling { temperature: 0.0, top_p: 1.0, seed: 0 };
}

/// One sequence's part of a step: the tokens it feeds at positions `start..`, its block table
/// (covering every position up to its last new token), and whether to sample after them.
#[derive(Debug, Clone, PartialEq)]
pub struct Seq<'a> {
    pub tokens: &'a [u32],
    pub start: u32,
    pub blocks: &'a [u32],
    pub sample: Option<Sampling>,
}

/// What a step produced: one token per sampling sequence, in order, and their logits.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub tokens: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
}

/// How large the KV cache is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSize {
    /// Exactly this many blocks.
    Blocks(u32),
    /// As many blocks as fit in this many bytes.
    Bytes(u64),
}

/// A loaded model and its KV cache.
pub struct Model {
    weights: Weights,
    rope: Rope,
    text: Text,
    cache: Mutex<KvCache>,
    source: PathBuf,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("source", &self.source).field("config", &self.weights.config).finish()
    }
}

impl Model {
    /// Loads the model at `source` (a `.gguf` file, a folder holding one, or a Hugging Face
    /// folder with `config.json`) and allocates its KV cache. Every failure names the file and
    /// the field at fault.
    pub fn load(source: &Path, size: KvSize, block_size: u32) -> Result<Model, String> {
        if block_size == 0 {
            return Err("the KV block size is 0; it must be at least 1".into());
        }
        let (weights, text) = read(source)?;
        let c = &weights.config;
        let per_token = KvCache::bytes_per_token(c.layers, c.kv_dim()) as u64;
        let blocks = match size {
            KvSize::Blocks(b) => b,
            KvSize::Bytes(bytes) => (bytes / (per_token * block_size as u64)).min(u32::MAX as u64) as u32,
        };
        if blocks < 2 {
            return Err(format!(
                "the KV cache holds {blocks} blocks of {block_size} tokens ({per_token} bytes a token for this \
                 model); it needs at least 2"
            ));
        }
        let rope = Rope::new(c.head_dim, c.rope_theta, c.context);
        let cache = KvCache::new(c.layers, c.kv_dim(), blocks as usize, block_size as usize);
        Ok(Model { weights, rope, text, cache: Mutex::new(cache), source: source.to_owned() })
    }

    pub fn config(&self) -> &Config {
        &self.weights.config
    }

    pub fn text(&self) -> &Text {
        &self.text
    }

    /// Blocks of the KV cache.
    pub fn kv_blocks(&self) -> u32 {
        self.cache.lock().map_or(0, |c| c.blocks as u32)
    }

    /// Bytes the KV cache takes a token.
    pub fn kv_bytes_per_token(&self) -> usize {
        KvCache::bytes_per_token(self.weights.config.layers, self.weights.config.kv_dim())
    }

    /// Prompt plus produced tokens a sequence may hold.
    pub fn context_length(&self) -> u32 {
        self.rope.positions() as u32
    }

    /// Runs one step: writes the new tokens' keys and values into their blocks, and samples
    /// one token after the last new token of each sequence that asks.
    pub fn step(&self, seqs: &[Seq<'_>]) -> Result<Sampled, String> {
        let logits = {
            let mut cache = self.cache.lock().map_err(|_| "the KV cache lock is poisoned".to_owned())?;
            cpu::forward(&self.weights, &self.rope, &mut cache, seqs)?
        };
        let sampling = seqs.iter().filter_map(|s| s.sample.map(|m| (m, s.start + s.tokens.len() as u32)));
        let tokens = sampling.zip(&logits).map(|((m, position), l)| sample::sample(l, &m, position)).collect();
        Ok(Sampled { tokens, logits })
    }
}

/// Reads weights and text side from either format.
fn read(source: &Path) -> Result<(Weights, Text), String> {
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
