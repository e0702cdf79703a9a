//! Ferry's sidecar: admits inference requests, batches them under deadlines and feeds each batch
//! to the local engine.
//!
//! # Layout
//!
//! The pure core (tickets, queue, scheduler and admission forecast, estimator, recovery, replay,
//! outcomes, durations, metric names, the spec types) is the `ferry_core` crate: synchronous, the
//! time passed in. This crate is the thin async shell that feeds it clocks and events, and the
//! HTTP front and engines around it.
//!
//! - [`batcher`]: the async shell around one scheduler: waiting callers, timers, engine calls,
//!   deadlines of running requests, retries, the watchdog, attempt fencing, metrics.
//! - [`engine`]: the trait engines implement, and the `sim` engine.
//! - [`tensor`]: Open Inference Protocol tensors, parsed and validated.
//! - [`deadline`]: a request's absolute deadline from its headers and body.
//! - [`front`]: the HTTP API — the router, one module per protocol (OIP JSON with Triton's binary
//!   extension, OpenAI embeddings), the idempotency path, the admission pipeline, and the one
//!   place that counts every request's outcome — and the admin listener (`/metrics`).
//! - [`holder`]: `ferry-holder`, which holds the requests of services at zero until a pod is
//!   ready, built from the front's deadline parsing and error shapes.
//! - [`idempotency`]: the bounded store behind `idempotency-key` (replay, join, conflict).
//! - [`metrics`]: the Prometheus metrics whose names DESIGN.md fixes.
//! - [`tally`]: the one place that counts how each request ended.
//! - `task`: what every shell's task shares (its stopped flag, its timer, its oldest arrival).
//! - [`server`]: wires the parts together and drains on shutdown.
//! - [`config`]: command line, environment and InferenceService manifest.
//! - [`heap`]: glibc's heap told to keep what a step frees for the next one (the binaries set it:
//!   `ferry-sidecar`, and `ferry-embed` so that its bench times what the sidecar serves).

pub mod batcher;
pub mod config;
pub mod deadline;
pub mod embed;
pub mod engine;
pub mod front;
pub mod generation;
pub mod heap;
pub mod holder;
pub mod idempotency;
pub mod metrics;
pub mod server;
pub mod tally;
mod task;
pub mod tenants;
pub mod tensor;
