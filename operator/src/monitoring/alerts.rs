//! The alerting rules: one group, each alert a measured quantity compared with its threshold,
//! labelled by the service (and pod where one pod is at fault), with a runbook section in the
//! README (heading = the alert's name). `promtool test rules` tests each one firing and not
//! firing (`tests/monitoring/alerts.test.yaml`).

use ferry_core::metric as m;
use serde_json::{json, Value};

use super::promql::{missed, offered, refused_for_capacity};
use crate::metrics as op;

/// One alert.
pub struct Alert {
    pub name: &'static str,
    pub expr: String,
    /// How long the condition must hold before the alert fires.
    pub hold: &'static str,
    pub severity: &'static str,
    pub summary: &'static str,
    pub description: &'static str,
}

const SERVICE: &str = "namespace, inferenceservice";
const POD: &str = "namespace, inferenceservice, pod";

/// Every alert, in the README's order.
pub fn alerts() -> Vec<Alert> {
    vec![
        Alert {
            name: "FerryDeadlineMisses",
            expr: format!(
                "sum by ({SERVICE}) (rate({r}{{{missed}}}[5m])) / sum by ({SERVICE}) (rate({r}{{outcome=~\"ok|expired|failed\"}}[5m])) > 0.01",
                r = m::REQUESTS,
                missed = missed(),
            ),
            hold: "10m",
            severity: "warning",
            summary: "More than 1 % of admitted requests miss their deadline.",
            description: "{{ $value | humanizePercentage }} of the requests {{ $labels.namespace }}/{{ $labels.inferenceservice }} admitted over 5 minutes expired at their deadline or failed.",
        },
        Alert {
            name: "FerryRefusingAtMaxReplicas",
            expr: format!(
                "(sum by ({SERVICE}) (rate({r}{{{refused}}}[5m])) / sum by ({SERVICE}) (rate({r}{{{offered}}}[5m])) > 0.05) \
                 and on ({SERVICE}) (max by ({SERVICE}) ({rep}{{state=\"desired\"}}) >= max by ({SERVICE}) ({lim}{{bound=\"max\"}}))",
                r = m::REQUESTS,
                refused = refused_for_capacity(),
                offered = offered(),
                rep = op::REPLICAS,
                lim = op::REPLICA_LIMIT,
            ),
            hold: "15m",
            severity: "warning",
            summary: "Requests are refused for capacity while the service is at maxReplicas.",
            description: "{{ $labels.namespace }}/{{ $labels.inferenceservice }} refuses {{ $value | humanizePercentage }} of its offered requests for want of capacity, and the autoscaler may not add pods: it is at spec.scaling.maxReplicas.",
        },
        Alert {
            name: "FerryKVCacheSaturated",
            expr: format!(
                "max by ({POD}) ({kv}) > 0.9 and on ({POD}) sum by ({POD}) (rate({p}[5m])) > 0",
                kv = m::KV_USAGE,
                p = m::PREEMPTIONS,
            ),
            hold: "10m",
            severity: "warning",
            summary: "A pod's KV cache is full and it preempts sequences.",
            description: "Pod {{ $labels.pod }} of {{ $labels.namespace }}/{{ $labels.inferenceservice }} has its KV cache over 90 % used and recomputes preempted sequences.",
        },
        Alert {
            name: "FerryAdmissionLocked",
            expr: format!("max by ({POD}, model, version) ({}) == 1", m::ADMISSION_LOCKED),
            hold: "1m",
            severity: "critical",
            summary: "A pod refuses every request while nothing is queued or running.",
            description: "Pod {{ $labels.pod }} of {{ $labels.namespace }}/{{ $labels.inferenceservice }} has refused every request for {{ $labels.model }} {{ $labels.version }} though idle: an estimate is locked shut.",
        },
        Alert {
            name: "FerryModelNotReady",
            expr: format!("min by ({POD}, model, version) ({}) == 0", m::READY),
            hold: "5m",
            severity: "critical",
            summary: "A pod's engine, batcher or step loop stopped.",
            description: "Pod {{ $labels.pod }} of {{ $labels.namespace }}/{{ $labels.inferenceservice }} has not taken requests for {{ $labels.model }} {{ $labels.version }} for 5 minutes.",
        },
        Alert {
            name: "FerryLateResults",
            expr: format!("sum by ({POD}) (increase({}[10m])) > 0", m::LATE_RESULTS),
            hold: "0m",
            severity: "warning",
            summary: "An engine returned results after their deadline or attempt had passed.",
            description: "Pod {{ $labels.pod }} of {{ $labels.namespace }}/{{ $labels.inferenceservice }} discarded {{ $value }} late engine results in 10 minutes: none reached a caller, but the engine ran past its estimates.",
        },
        Alert {
            name: "FerryPodsStuckStarting",
            expr: format!("max by ({SERVICE}) ({}{{state=\"stuck\"}}) > 0", op::REPLICAS),
            hold: "5m",
            severity: "warning",
            summary: "Worker pods have been unready for longer than twice their start-up time.",
            description: "{{ $value }} worker pods of {{ $labels.namespace }}/{{ $labels.inferenceservice }} are unready long after they were asked for (unschedulable, failing their image pull, or crash-looping).",
        },
        Alert {
            name: "FerryOperatorScrapesFailing",
            expr: format!("sum by (namespace, pod) (rate({}[5m])) > 0", op::SCRAPE_FAILURES),
            hold: "10m",
            severity: "warning",
            summary: "The operator cannot read its worker pods' metrics.",
            description: "The operator {{ $labels.pod }} failed {{ $value | humanize }} scrapes a second of worker pods for 10 minutes: their load is unknown to the autoscaler.",
        },
        Alert {
            name: "FerryTargetDown",
            expr: "up{job=~\".*ferry.*\"} == 0".to_owned(),
            hold: "5m",
            severity: "warning",
            summary: "Prometheus cannot scrape a Ferry pod.",
            description: "Target {{ $labels.instance }} of job {{ $labels.job }} has been down for 5 minutes.",
        },
    ]
}

/// The rules file (the plain form; the chart's PrometheusRule carries the same groups).
pub fn rules() -> Value {
    let rules: Vec<Value> = alerts()
        .into_iter()
        .map(|a| {
            json!({
                "alert": a.name, "expr": a.expr, "for": a.hold,
                "labels": {"severity": a.severity},
                "annotations": {
                    "summary": a.summary, "description": a.description,
                    "runbook": format!("README.md#{}", a.name.to_lowercase()),
                },
            })
        })
        .collect();
    json!({"groups": [{"name": "ferry", "rules": rules}]})
}

const HEADER: &str =
    "# Generated by `ferry-operator monitoring` from operator/src/monitoring/alerts.rs. Do not edit.\n";

pub fn rules_yaml() -> String {
    format!("{HEADER}{}", serde_saphyr::to_string(&rules()).expect("the rules serialize to YAML"))
}
