//! Ferry's dashboards and alerts, generated from the metric names of the contract
//! ([`ferry_core::metric`] for the sidecars, [`crate::metrics`] for the operator) so that a
//! renamed metric cannot leave a panel silently empty. `ferry-operator monitoring` writes them
//! under `charts/ferry/monitoring/` (the chart ships them as ConfigMaps and a PrometheusRule;
//! `dashboards/` at the repository root is the same folder, for import by hand); a test checks
//! the checked-in files for drift, and another evaluates every query against a real Prometheus.
//!
//! - [`promql`]: the label selectors and the expressions both share (offered load, shares).
//! - [`grafana`]: a dashboard as Grafana's JSON model: variables, rows, a panel grid.
//! - [`dashboards`]: the *Service*, *Autoscaler* and *Tenants* dashboards.
//! - [`alerts`]: the alerting rules, each with a runbook section in the README.

pub mod alerts;
pub mod dashboards;
pub mod grafana;
pub mod promql;

/// Where the generated files live, relative to the repository root.
pub const DIR: &str = "charts/ferry/monitoring";

/// Every generated file: its name under [`DIR`] and its text.
pub fn files() -> Vec<(&'static str, String)> {
    let json = |v: serde_json::Value| serde_json::to_string_pretty(&v).expect("JSON") + "\n";
    vec![
        ("ferry-service.json", json(dashboards::service())),
        ("ferry-autoscaler.json", json(dashboards::autoscaler())),
        ("ferry-tenants.json", json(dashboards::tenants())),
        ("ferry-alerts.yaml", alerts::rules_yaml()),
    ]
}
