//! Generation (LLM) serving in the sidecar: the async shell around ferry-core's generation
//! ledger, the engine contract for steps, and the `sim-llm` engine.
//!
//! # Layout
//! - [`engine`]: the step-engine trait and the model's text side (tokenizer, chat template,
//!   incremental detokenizer) that every generation engine implements.
//! - [`shell`]: the one task per model version that owns its state (a ledger or a window), takes
//!   submissions and cancellations, hands them to the state in passes and carries out its
//!   effects; the handle callers hold, the submission, a caller's timings. What differs between
//!   the step engine and the relay is a `Backend`.
//! - [`steps`]: the step engine's backend: runs one step at a time, streams each sequence's text
//!   to its caller, watches for a stalled or failing engine.
//! - [`stop`]: `stop` strings, matched across token boundaries without ever sending one.
//! - [`sim`]: the `sim-llm` engine.
//! - [`llm`]: the `llm` engine: ferry-llm's decoder serving a real model.
//! - [`relay`]: the backend around ferry-core's concurrency window, in front of an
//!   OpenAI-compatible LLM server beside the sidecar (engine `openai`); [`tokenize`] asks that
//!   server for a prompt's tokens.
//! - [`stream`]: what a caller holds: text pieces and one end, checked against the deadlines.

pub mod engine;
pub mod llm;
pub mod relay;
pub mod shell;
pub mod sim;
pub mod steps;
pub mod stop;
pub mod stream;
pub mod tokenize;
