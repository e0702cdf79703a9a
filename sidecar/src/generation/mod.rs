//! Generation (LLM) serving in the sidecar: the async shell around ferry-core's generation
//! ledger, the engine contract for steps, and the `sim-llm` engine.
//!
//! # Layout
//! - [`engine`]: the step-engine trait and the model's text side (tokenizer, chat template,
//!   incremental detokenizer) that every generation engine implements.
//! - [`shell`]: one task per model version that owns the ledger, runs one step at a time and
//!   streams each sequence's text to its caller.
//! - [`stop`]: `stop` strings, matched across token boundaries without ever sending one.
//! - [`sim`]: the `sim-llm` engine.
//! - [`llm`]: the `llm` engine: ferry-llm's decoder serving a real model.
//! - [`relay`]: the shell around ferry-core's concurrency window, in front of an
//!   OpenAI-compatible LLM server beside the sidecar (engine `openai`).
//! - [`stream`]: what a caller holds: text pieces and one end, checked against the deadlines.

pub mod engine;
pub mod llm;
pub mod relay;
pub mod shell;
pub mod sim;
pub mod stop;
pub mod stream;
