//! Ferry's operator: the `InferenceService` resource and the controller that runs worker pods
//! for it.
//!
//! # Layout
//!
//! The resource's Rust types are `ferry_core::spec` (feature `kube`), shared with the sidecar's
//! `--config`; the CRD schema is generated from them.
//!
//! - [`autoscale`]: the scaling decision (pure) and the capacity planner.
//! - [`crdgen`]: writes the CRD YAML (`crds/`), checked for drift by a test.
//! - [`desired`]: the worker Deployment and Service an InferenceService should have (pure).
//! - [`routing`]: the InferencePool a routed service has, for the Gateway API Inference Extension (pure).
//! - [`probe`]: the worker pods' start-up allowance, from the measured time-to-ready (pure).
//! - [`status`]: the conditions it reports, from its Deployment (pure).
//! - [`reconcile`]: applies the desired objects and the status; backoff on failure.
//! - [`lease`]: leader election on a `coordination.k8s.io` Lease, so two replicas never both act.
//! - [`rbac`]: every API call the operator makes, as RBAC rules (the chart must grant exactly these).
//! - [`metrics`]: the operator's own metrics.
//! - [`monitoring`]: the dashboards and alerts (`charts/ferry/monitoring/`), generated, checked for drift.
//! - [`run`]: the controller, the leader election and the metrics/health server, together.

pub mod autoscale;
pub mod crdgen;
pub mod desired;
pub mod lease;
pub mod metrics;
pub mod monitoring;
pub mod probe;
pub mod rbac;
pub mod reconcile;
pub mod routing;
pub mod run;
pub mod status;
