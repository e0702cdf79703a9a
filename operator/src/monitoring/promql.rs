//! The PromQL pieces the dashboards and the alerts share: label selectors over the dashboards'
//! variables, and the outcome sets behind "offered", "admitted" and "refused for capacity".

use ferry_core::outcome::Outcome;

/// The labels a Ferry worker pod's series carry once scraped: the chart's PodMonitor adds
/// `namespace`, `pod` and `inferenceservice` (from the pod label `ferry.dev/inference-service`)
/// to the sidecar's own `model` and `version`.
pub const POD_LABELS: [&str; 3] = ["namespace", "inferenceservice", "pod"];

/// A selector over the dashboards' variables: `namespace`, `inferenceservice`, and for sidecar
/// series `model` and `version`; `extra` matchers are appended.
pub fn select(vars: &[&str], extra: &str) -> String {
    let mut matchers: Vec<String> = vars.iter().map(|v| format!("{v}=~\"${v}\"")).collect();
    if !extra.is_empty() {
        matchers.push(extra.to_owned());
    }
    format!("{{{}}}", matchers.join(", "))
}

/// The variables of a sidecar series.
pub const SIDECAR_VARS: [&str; 4] = ["namespace", "inferenceservice", "model", "version"];
/// The variables of an operator series.
pub const SERVICE_VARS: [&str; 2] = ["namespace", "inferenceservice"];

fn outcomes(keep: impl Fn(Outcome) -> bool) -> String {
    Outcome::ALL.into_iter().filter(|o| keep(*o)).map(Outcome::label).collect::<Vec<_>>().join("|")
}

/// `outcome=~"…"`: the requests the service was asked to carry ([`Outcome::is_offered_load`]).
pub fn offered() -> String {
    format!("outcome=~\"{}\"", outcomes(Outcome::is_offered_load))
}

/// The offered requests less those whose client went away first: what "within deadline" is a
/// share of (a disconnect is nobody's miss).
pub fn judged() -> String {
    format!("outcome=~\"{}\"", outcomes(|o| o.is_offered_load() && o != Outcome::Cancelled))
}

/// Admitted requests that ended without their answer in time: expired at their deadline, or
/// failed in the engine.
pub fn missed() -> String {
    format!("outcome=~\"{}|{}\"", Outcome::Expired.label(), Outcome::Failed.label())
}

/// Requests admission or the queue refused for want of capacity.
pub fn refused_for_capacity() -> String {
    format!("outcome=~\"{}|{}\"", Outcome::QueueFull.label(), Outcome::Infeasible.label())
}

/// `histogram_quantile(q, …)` of a histogram's buckets over `selector`, grouped by `by` (and `le`).
pub fn quantile(q: f64, histogram: &str, selector: &str, by: &str, range: &str) -> String {
    let by = if by.is_empty() { "le".to_owned() } else { format!("{by}, le") };
    format!("histogram_quantile({q}, sum by ({by}) (rate({histogram}_bucket{selector}[{range}])))")
}
