//! Generation load: traces of LLM requests with their three promises, an open-loop client of
//! OpenAI's streaming API, what a run measured, and the comparison of scheduling disciplines in
//! virtual time.
//!
//! - [`trace`]: when each request arrives, its prompt and output lengths, its deadlines.
//! - [`stream`]: the open-loop driver over HTTP (`POST /v1/completions`, `stream: true`).
//! - [`chat`]: closed-loop chat clients whose conversations share a system prompt and grow.
//! - [`summary`]: per-request samples and their summary: goodput, TTFT, inter-token times, tokens/s.
//! - [`policies`]: the same trace through each discipline of ferry-core's generation scheduler
//!   on the `sim-llm` engine, in virtual time.

pub mod chat;
pub mod policies;
pub mod stream;
pub mod summary;
pub mod trace;
