//! Ferry's pure core: the parts that every binary shares and that take the time as an argument,
//! so that they can be tested to the millisecond and replayed in simulations. No HTTP, no
//! Kubernetes client, no model code: the sidecar, the operator and the load generator all link
//! it, and none of them links another.
//!
//! # Layout
//!
//! - [`ticket`], [`queue`], [`estimate`], [`scheduler`]: the request-level scheduler. A
//!   [`scheduler::Scheduler`] decides admission (queue bounds, deadline feasibility, its forecast)
//!   and dispatch (full, `maxWait`, deadline), per model version.
//! - [`generation`]: the token-level scheduler for LLM serving — the step rule, KV block
//!   accounting, the step-time estimator, generation admission, its ledger and replay.
//! - [`tenant`]: fair shares between tenants, the rule both schedulers compose batches and steps
//!   with; [`quota`]: a tenant's token buckets.
//! - [`margin`]: how early a deadline-driven batch leaves: a floor plus the measured lateness of
//!   the timer and overshoot of the engine.
//! - [`evidence`]: what admission may learn from, so that no learned figure locks it shut: stalls
//!   of the process are not evidence, tails are bounded by recent samples, probes when idle;
//!   [`lockout`]: whether a model version refuses every request while idle all the same.
//! - [`ledger`]: the batcher's whole state (waiters, attempts and fencing, held groups, deadlines
//!   of running requests, the watchdog) as a state machine: events in with `now`, effects out.
//! - [`recovery`]: the rule for failed batches: retries, and poison isolation by bisection.
//! - [`replay`]: the ledger in virtual time, for exact tests, property tests and simulations.
//! - [`hold`]: the holder's admission for a service at zero: refuse what its start-up would make
//!   late, hold the rest (bounded) in deadline order.
//! - [`outcome`]: how a request ended, its status code and its metric label.
//! - [`metric`]: the names of the sidecar's metrics (a contract: the operator reads them).
//! - [`duration`]: the Gateway API duration format.
//! - [`spec`]: the `InferenceService` resource's spec, which the sidecar's `--config` reads and
//!   the operator's CRD is generated from (feature `kube` adds the schema and the CRD derive).
//!
//! Every instant here is a `std::time::Instant` given by the caller; nothing in these modules
//! reads a clock or needs an async runtime. The one clock of the async crates is `clock`
//! (feature `clock`, which alone links tokio): tokio's, which their paused-clock tests move.

#[cfg(feature = "clock")]
pub mod clock;
pub mod duration;
pub mod estimate;
pub mod evidence;
pub mod generation;
pub mod hold;
pub mod ledger;
pub mod lockout;
pub mod margin;
pub mod metric;
pub mod outcome;
pub mod queue;
pub mod quota;
pub mod recovery;
pub mod replay;
pub mod scheduler;
pub mod spec;
pub mod tenant;
pub mod ticket;
