//! `ferry-load`: an open-loop load generator for Ferry's sidecar (and any OIP endpoint), and the
//! benchmark suite that regenerates BENCHMARKS.md.
//!
//! # Layout
//!
//! - [`schedule`]: when each request is sent (constant or Poisson), fixed before the run.
//! - [`run`]: the open-loop driver, and a closed-loop throughput probe.
//! - [`record`]: samples and their summary (HDR histograms, goodput, batch fill, per second).
//! - [`tenants`]: `--tenants`, callers with their own bearer tokens and shares of the load.
//! - [`report`], [`plot`]: the summary as a table, and as an SVG over time.
//! - [`dashboard`]: a Grafana dashboard drawn as an SVG from a Prometheus server's live answers.
//! - [`echo`]: a bare hyper echo server, the floor for the overhead comparison.
//! - [`generation`]: generation load — traces of LLM requests, the OpenAI streaming client,
//!   their summary, and the scheduling disciplines compared in virtual time.
//! - [`bench`](mod@bench): the benchmark suite: real sidecar processes on 127.0.0.1, side by side.
//! - `servers`: the sidecar (or llama.cpp's server) processes a benchmark starts.
//! - [`decoder`]: its section on the built-in decoder against llama.cpp's server; `prefix`: that
//!   section's prefix-cache rows (a long system prompt's second question, chat clients).

pub mod bench;
pub mod dashboard;
pub mod decoder;
pub mod echo;
pub mod generation;
pub mod plot;
mod prefix;
pub mod record;
pub mod report;
pub mod run;
pub mod schedule;
mod servers;
mod structured;
pub mod tenants;
