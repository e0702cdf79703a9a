//! Generation (LLM) serving, scheduled per engine step: each step decodes one token for every
//! running sequence and prefills chunks of waiting prompts; sequences join and leave between
//! steps (continuous batching), KV-cache memory is paged, and the first token, the time between
//! tokens and the whole answer are three promises (DESIGN.md, "Generation (LLM) serving").
//!
//! # Layout
//! - [`sequence`]: what the scheduler knows of a request (sizes, deadlines, priority).
//! - [`kv`]: KV-cache blocks: the pool and the sequences' block tables, shared where the prefix
//!   cache finds a prompt's blocks computed already; [`prefix`]: the hashes that name them.
//! - [`step`]: a step's shape and the step-time estimator learned online.
//! - [`scheduler`]: the step rule — which sequences a step runs, and how much of each;
//!   preemption by recompute; sequences that can no longer finish in time. [`discipline`]: where
//!   the benchmark's other disciplines (first come first served, static batching) differ.
//! - [`forecast`]: admission — the scheduler run forward in virtual time to see whether every
//!   promise holds with the newcomer, from event to event; [`decode_run`]: the steps between two
//!   events in closed form.
//! - [`ledger`]: the state machine the sidecar's shell drives: events in with `now`, effects out.
//! - [`capacity`]: how many requests a second one pod serves with its promises kept, from the
//!   step cost, the requests' shape and the service's targets and limits; [`trial`]: that figure
//!   checked, a load of one shape replayed through the ledger.
//! - [`window`]: the concurrency window in front of an LLM server that batches by itself: how
//!   many requests are in flight upstream, its admission, its learned model of the upstream.
//! - [`replay`]: the ledger in virtual time with the `sim-llm` model, for exact tests, property
//!   tests and the benchmark; [`fleet`]: pods driven instant by instant, judged per request, for
//!   the operator's simulation.

pub mod capacity;
mod decode_run;
pub mod discipline;
pub mod fleet;
pub mod forecast;
pub mod kv;
pub mod ledger;
pub mod prefix;
pub mod replay;
pub mod scheduler;
pub mod sequence;
pub mod step;
pub mod trial;
pub mod window;

#[cfg(test)]
mod tests;
