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

pub mod engine;
pub mod shell;
pub mod sim;
pub mod stop;
pub mod stream;
