//! Autoscaling: the pure decision of how many worker pods a service needs, and the capacity
//! planner that checks arithmetic against the sidecar's own dispatch rule in simulation.
//!
//! Not yet here (the autoscaler issue): the collector that scrapes the sidecars, the loop that
//! patches replicas (as the `ferry-autoscaler` field manager) and the policy simulation.

pub mod collect;
pub mod decide;
pub mod plan;
