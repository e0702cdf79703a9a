//! Autoscaling: scale worker pods on queue age and deadline pressure, from the sidecars' own
//! metrics.
//!
//! - [`decide`]: the pure decision of how many worker pods a service needs, with its reason.
//! - [`collect`]: sidecar metrics parsed and turned into windowed rates.
//! - [`scale`]: the loop that scrapes, decides and patches replicas and status, from watches.
//! - [`startup`]: time-to-ready, measured on each service's pods.
//! - [`hold`]: scale to zero's part: the holder's metrics read as a pod's, what it is told of each
//!   service, and the EndpointSlice that switches a service at zero to it.
//! - [`plan`]: the capacity planner (arithmetic, then the dispatch rule in simulation).
//! - [`generation_plan`]: the same for a generation service (a pod's capacity in requests and
//!   tokens, then the generation ledger in simulation).
//! - [`simulate`]: the decision against an HPA-style policy, fixed replicas and an oracle, on
//!   arrival traces, in virtual time; [`generation_simulate`]: the same for a generation service,
//!   against the ways LLM services are scaled today, with start-ups of minutes;
//!   [`zero_simulate`]: two days of office hours, to zero at night and back, against
//!   `minReplicas: 1`.

pub mod collect;
pub mod decide;
pub mod generation_plan;
pub mod generation_simulate;
pub mod hold;
pub mod plan;
pub mod scale;
pub mod simulate;
pub mod startup;
pub mod zero_simulate;
