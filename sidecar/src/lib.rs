//! Ferry's sidecar: admits inference requests, batches them under deadlines and feeds each batch
//! to the local engine.
//!
//! # Layout
//!
//! The core is synchronous and takes the time as an argument, so that it can be tested to the
//! millisecond and replayed in simulations; a thin async shell feeds it clocks and events.
//!
//! - [`ticket`], [`queue`], [`estimate`], [`scheduler`]: the pure core. A [`scheduler::Scheduler`]
//!   decides admission (queue bounds, deadline feasibility) and dispatch (full, `maxWait`,
//!   deadline), per model version.
//! - [`recovery`]: the pure rule for failed batches: retries, and poison isolation by bisection.
//! - [`replay`]: the core in virtual time, for exact tests, property tests and simulations.
//! - [`batcher`]: the async shell around one scheduler: waiting callers, timers, engine calls,
//!   deadlines of running requests, retries, the watchdog, attempt fencing, metrics.
//! - [`engine`]: the trait engines implement, and the `sim` engine.
//! - [`tensor`]: Open Inference Protocol tensors, parsed and validated.
//! - [`deadline`]: a request's absolute deadline from its headers and body.
//! - [`front`]: the HTTP API (OIP v2 REST) and the admin listener (`/metrics`).
//! - [`idempotency`]: the bounded store behind `idempotency-key` (replay, join, conflict).
//! - [`metrics`]: the Prometheus metrics whose names DESIGN.md fixes.
//! - [`server`]: wires the parts together and drains on shutdown.
//! - [`config`]: command line, environment and InferenceService manifest.
//! - [`outcome`]: how a request ended, its status code and metric label.
//! - [`duration`]: the Gateway API duration format.

pub mod batcher;
pub mod binary;
pub mod config;
pub mod deadline;
pub mod duration;
pub mod embed;
pub mod engine;
pub mod estimate;
pub mod front;
pub mod idempotency;
pub mod metrics;
pub mod openai;
pub mod outcome;
pub mod queue;
pub mod recovery;
pub mod replay;
pub mod scheduler;
pub mod server;
pub mod tensor;
pub mod ticket;
