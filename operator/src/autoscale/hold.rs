//! The autoscaler's side of scale to zero (DESIGN.md, "Scale to zero"), pure: what the holder's
//! metrics say of each service (read as one more pod of it: its arrivals are offered load, what
//! it holds is a queue), what the holder is told of each service that scales to zero, and the
//! EndpointSlice that sends a service's traffic to the holder while it has no ready pod.
//!
//! The traffic switch is an EndpointSlice beside the ones Kubernetes keeps for the service's own
//! selector: the same `kubernetes.io/service-name`, the holder pods' addresses, ready only while
//! no worker pod is. The Service itself never changes (its ClusterIP, its selector, the
//! reconciler's fields), and kube-proxy sends its traffic to whichever endpoints are ready — the
//! holder's at zero, the workers' once one is up. Knative switches its activator in and out the
//! same way, through endpoints.

use std::collections::HashMap;
use std::time::Duration;

use ferry_core::hold::ServiceState;
use ferry_core::metric;
use prometheus_parse::{Scrape, Value};
use serde_json::json;

use super::collect::PodSample;
use super::scale::WorkerPod;
use crate::desired::{HTTP_PORT, LABEL_SERVICE};
use ferry_core::spec::InferenceService;
use kube::{Resource, ResourceExt};

/// The label of the slice's manager, as the EndpointSlice API asks of controllers other than its own.
pub const MANAGED_BY: &str = "ferry.dev/operator";

/// The holder outcomes that are a service's offered load: held, or refused for the start-up or
/// for want of room.
const OFFERED: [&str; 3] = ["held", "infeasible", "queue_full"];

/// A holder's `/metrics`, per service ("namespace", "name"), each as a pod's sample: `requests`
/// its offered load, `queue_depth` and `oldest_age` what it holds. Its refusals for the start-up
/// are no deadline pressure: more replicas would not have made the start-up shorter.
pub fn parse(text: &str) -> Result<HashMap<(String, String), PodSample>, String> {
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).map_err(|e| e.to_string())?;
    let mut services: HashMap<(String, String), PodSample> = HashMap::new();
    let mut seen = false;
    for sample in &scrape.samples {
        let x = match sample.value {
            Value::Counter(x) | Value::Gauge(x) | Value::Untyped(x) => x,
            _ => continue,
        };
        let (Some(namespace), Some(name)) = (sample.labels.get(metric::NAMESPACE), sample.labels.get(metric::SERVICE))
        else {
            continue;
        };
        let entry = || (namespace.to_owned(), name.to_owned());
        match sample.metric.as_str() {
            metric::HOLDER_REQUESTS => {
                seen = true;
                if namespace.is_empty() {
                    continue;
                }
                let s = services.entry(entry()).or_default();
                if sample.labels.get(metric::OUTCOME).is_some_and(|o| OFFERED.contains(&o)) {
                    s.requests += x;
                }
            }
            metric::HOLDER_HELD => services.entry(entry()).or_default().queue_depth += x,
            metric::HOLDER_OLDEST_AGE => {
                let s = services.entry(entry()).or_default();
                s.oldest_age = s.oldest_age.max(x);
            }
            _ => {}
        }
    }
    if !seen && !scrape.samples.iter().any(|s| s.metric == metric::HOLDER_SERVICES) {
        return Err(format!("no {}: not a Ferry holder", metric::HOLDER_REQUESTS));
    }
    Ok(services)
}

/// What the holder is told of a service that scales to zero: its deadline defaults, when its
/// pods should be ready (`time_to_ready`: its measured time-to-ready and two autoscaler
/// intervals — the wait for the decision that asks for them, and for the tick that tells the
/// holder they are ready), and its ready pods.
pub fn state(
    isvc: &InferenceService,
    latency_budget: Duration,
    ttft_budget: Option<Duration>,
    time_to_ready: Duration,
    stuck_after: Duration,
    workers: &[WorkerPod],
) -> ServiceState {
    // A pod unready for longer than `stuck_after` is stuck, not starting: its age says nothing
    // of when the service will be ready.
    let starting = workers.iter().filter(|w| w.ip.is_none()).filter_map(|w| w.age).filter(|a| *a < stuck_after).max();
    ServiceState {
        generation: isvc.spec.engine.kind.generates(),
        latency_budget_ms: latency_budget.as_millis() as u64,
        ttft_budget_ms: ttft_budget.map(|d| d.as_millis() as u64),
        time_to_ready_ms: time_to_ready.as_millis() as u64,
        starting_for_ms: starting.map(|d| d.as_millis() as u64),
        endpoints: workers.iter().filter_map(|w| w.ip.as_ref()).map(|ip| format!("{ip}:{HTTP_PORT}")).collect(),
    }
}

/// The service's EndpointSlice of holder pods (`holders`: their IPs, sorted), ready while the
/// service has no ready pod (`at_zero`).
pub fn endpoint_slice(isvc: &InferenceService, holders: &[String], at_zero: bool) -> serde_json::Value {
    let name = isvc.name_any();
    let owner = isvc.controller_owner_ref(&()).map(|o| serde_json::to_value(o).expect("an owner reference serializes"));
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": slice_name(&name),
            "namespace": isvc.namespace(),
            "labels": {
                "kubernetes.io/service-name": name,
                "endpointslice.kubernetes.io/managed-by": MANAGED_BY,
                LABEL_SERVICE: name,
            },
            "ownerReferences": owner.into_iter().collect::<Vec<_>>(),
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": HTTP_PORT, "protocol": "TCP"}],
        "endpoints": holders.iter().map(|ip| json!({
            "addresses": [ip],
            "conditions": {"ready": at_zero, "serving": at_zero, "terminating": false},
        })).collect::<Vec<_>>(),
    })
}

/// The slice's name: the service's, and `-holder`.
pub fn slice_name(service: &str) -> String {
    format!("{service}-holder")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holders_metrics_are_each_services_offered_load_and_queue() {
        let text = "\
# TYPE ferry_holder_requests_total counter
ferry_holder_requests_total{namespace=\"ml\",outcome=\"held\",service=\"chat\"} 7
ferry_holder_requests_total{namespace=\"ml\",outcome=\"infeasible\",service=\"chat\"} 2
ferry_holder_requests_total{namespace=\"ml\",outcome=\"relayed\",service=\"chat\"} 40
ferry_holder_requests_total{namespace=\"ml\",outcome=\"held\",service=\"embed\"} 0
ferry_holder_requests_total{namespace=\"\",outcome=\"not_found\",service=\"\"} 3
# TYPE ferry_holder_held gauge
ferry_holder_held{namespace=\"ml\",service=\"chat\"} 5
# TYPE ferry_holder_oldest_held_seconds gauge
ferry_holder_oldest_held_seconds{namespace=\"ml\",service=\"chat\"} 1.5
";
        let services = parse(text).unwrap();
        let chat = &services[&("ml".to_owned(), "chat".to_owned())];
        // Held and refused for the start-up are offered; relayed ones the pods count themselves.
        assert_eq!((chat.requests, chat.queue_depth, chat.oldest_age, chat.pressure), (9.0, 5.0, 1.5, 0.0));
        assert_eq!(services[&("ml".to_owned(), "embed".to_owned())].requests, 0.0);
        assert_eq!(services.len(), 2);
        assert!(parse("ferry_requests_total{outcome=\"ok\"} 1\n").is_err());
        // A holder told of no service yet: no service, and no failed scrape.
        let empty = parse("# TYPE ferry_holder_services gauge\nferry_holder_services 0\n").unwrap();
        assert!(empty.is_empty());
    }
}
