//! The operator's own metrics: reconciles, failures by error label, reconcile duration, its failed
//! scrapes, and per InferenceService (labels `namespace`, `inferenceservice`) what the autoscaler
//! saw and decided — the figures the *Autoscaler* dashboard and the alerts read (DESIGN.md,
//! "Observability"). A service's series go when the service does.

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Label: the InferenceService's namespace.
pub const NAMESPACE: &str = "namespace";
/// Label: the InferenceService's name (not `service`: prometheus-operator gives every target a
/// `service` label of its own, the Kubernetes Service it was found through).
pub const INFERENCE_SERVICE: &str = "inferenceservice";

/// Counter: reconciles started.
pub const RECONCILES: &str = "ferry_operator_reconciles_total";
/// Counter: reconciles that failed, by `error`.
pub const RECONCILE_FAILURES: &str = "ferry_operator_reconcile_failures_total";
/// Histogram: seconds per reconcile.
pub const RECONCILE_DURATION: &str = "ferry_operator_reconcile_duration_seconds";
/// Counter: autoscaler decisions by service and `reason`.
pub const DECISIONS: &str = "ferry_operator_scale_decisions_total";
/// Counter: sidecar scrapes that failed or timed out.
pub const SCRAPE_FAILURES: &str = "ferry_operator_scrape_failures_total";
/// Gauge: worker pods by `state` ([`REPLICA_STATES`]).
pub const REPLICAS: &str = "ferry_operator_replicas";
/// Gauge: `spec.scaling`'s bounds by `bound` (`min`, `max`).
pub const REPLICA_LIMIT: &str = "ferry_operator_replica_limit";
/// Gauge: the offered requests a second the decision used.
pub const OFFERED: &str = "ferry_operator_offered_requests_per_second";
/// Gauge: the requests a second one pod serves, as the decision counted it.
pub const CAPACITY_PER_REPLICA: &str = "ferry_operator_capacity_per_replica";
/// Gauge: time-to-ready by `source` (`configured`, `measured`).
pub const STARTUP: &str = "ferry_operator_startup_seconds";

/// `state` values of `ferry_operator_replicas`.
pub const REPLICA_STATES: [&str; 4] = ["desired", "ready", "starting", "stuck"];

#[derive(Clone)]
pub struct OperatorMetrics {
    registry: Registry,
    pub reconciles: IntCounter,
    pub failures: IntCounterVec,
    pub duration: Histogram,
    /// `ferry_operator_scale_decisions_total{namespace, inferenceservice, reason}`: one per service per tick.
    pub decisions: IntCounterVec,
    pub scrape_failures: IntCounter,
    /// `ferry_operator_replicas{namespace, inferenceservice, state}`: [`REPLICA_STATES`].
    replicas: IntGaugeVec,
    /// `ferry_operator_replica_limit{namespace, inferenceservice, bound="min"|"max"}`.
    limits: IntGaugeVec,
    /// `ferry_operator_offered_requests_per_second`: the arrival rate the decision used.
    offered: GaugeVec,
    /// `ferry_operator_capacity_per_replica`: the requests a second one pod serves, as the decision counted it.
    capacity: GaugeVec,
    /// `ferry_operator_startup_seconds{source="configured"|"measured"}`: time from asking for a pod to its serving.
    startup: GaugeVec,
}

/// What one decision saw and chose, for the per-service gauges.
#[derive(Debug, Clone, PartialEq)]
pub struct Decided {
    pub desired: u32,
    pub ready: u32,
    pub starting: u32,
    pub stuck: u32,
    pub min: u32,
    pub max: u32,
    pub offered: f64,
    pub capacity_per_replica: f64,
    pub configured_startup: f64,
    pub measured_startup: Option<f64>,
}

impl OperatorMetrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let per_service = |extra: &'static str| -> Vec<&'static str> {
            [NAMESPACE, INFERENCE_SERVICE].into_iter().chain((!extra.is_empty()).then_some(extra)).collect()
        };
        let reconciles = IntCounter::new(RECONCILES, "Reconciles started.").expect("valid");
        let failures =
            IntCounterVec::new(Opts::new(RECONCILE_FAILURES, "Reconciles that failed, by error."), &["error"])
                .expect("valid");
        let duration = Histogram::with_opts(
            HistogramOpts::new(RECONCILE_DURATION, "Time per reconcile.")
                .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
        )
        .expect("valid");
        let decisions = IntCounterVec::new(
            Opts::new(DECISIONS, "Autoscaler decisions, by service and reason."),
            &per_service("reason"),
        )
        .expect("valid");
        let scrape_failures =
            IntCounter::new(SCRAPE_FAILURES, "Sidecar scrapes that failed or timed out.").expect("valid");
        let replicas = IntGaugeVec::new(
            Opts::new(
                REPLICAS,
                "Worker pods by state: desired (the decision), ready, starting (asked for or on their way), stuck (unready too long).",
            ),
            &per_service("state"),
        )
        .expect("valid");
        let limits = IntGaugeVec::new(
            Opts::new(REPLICA_LIMIT, "spec.scaling's bounds: minReplicas and maxReplicas."),
            &per_service("bound"),
        )
        .expect("valid");
        let offered = GaugeVec::new(
            Opts::new(
                OFFERED,
                "Requests a second offered to the service (admitted or refused for capacity), as the decision saw them.",
            ),
            &per_service(""),
        )
        .expect("valid");
        let capacity = GaugeVec::new(
            Opts::new(
                CAPACITY_PER_REPLICA,
                "Requests a second one pod serves within its deadlines, as the decision counted it.",
            ),
            &per_service(""),
        )
        .expect("valid");
        let startup = GaugeVec::new(
            Opts::new(
                STARTUP,
                "Time from asking for a pod to its serving: spec.scaling.startupTime (configured) and the median measured.",
            ),
            &per_service("source"),
        )
        .expect("valid");
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(decisions.clone()),
            Box::new(scrape_failures.clone()),
            Box::new(reconciles.clone()),
            Box::new(failures.clone()),
            Box::new(duration.clone()),
            Box::new(replicas.clone()),
            Box::new(limits.clone()),
            Box::new(offered.clone()),
            Box::new(capacity.clone()),
            Box::new(startup.clone()),
        ];
        for c in collectors {
            registry.register(c).expect("unique");
        }
        OperatorMetrics {
            registry,
            reconciles,
            failures,
            duration,
            decisions,
            scrape_failures,
            replicas,
            limits,
            offered,
            capacity,
            startup,
        }
    }

    /// Records one decision for the service `name` in `namespace`.
    pub fn decided(&self, namespace: &str, name: &str, reason: &str, d: &Decided) {
        self.decisions.with_label_values(&[namespace, name, reason]).inc();
        for (state, n) in REPLICA_STATES.into_iter().zip([d.desired, d.ready, d.starting, d.stuck]) {
            self.replicas.with_label_values(&[namespace, name, state]).set(i64::from(n));
        }
        self.limits.with_label_values(&[namespace, name, "min"]).set(i64::from(d.min));
        self.limits.with_label_values(&[namespace, name, "max"]).set(i64::from(d.max));
        self.offered.with_label_values(&[namespace, name]).set(d.offered);
        self.capacity.with_label_values(&[namespace, name]).set(d.capacity_per_replica);
        self.startup.with_label_values(&[namespace, name, "configured"]).set(d.configured_startup);
        match d.measured_startup {
            Some(s) => self.startup.with_label_values(&[namespace, name, "measured"]).set(s),
            None => {
                let _ = self.startup.remove_label_values(&[namespace, name, "measured"]);
            }
        }
    }

    /// Removes every series of a service that is gone (`reasons`: every decision reason): a
    /// deleted service must not keep firing alerts or drawing lines.
    pub fn forget(&self, namespace: &str, name: &str, reasons: &[&str]) {
        for reason in reasons {
            let _ = self.decisions.remove_label_values(&[namespace, name, reason]);
        }
        for state in REPLICA_STATES {
            let _ = self.replicas.remove_label_values(&[namespace, name, state]);
        }
        for bound in ["min", "max"] {
            let _ = self.limits.remove_label_values(&[namespace, name, bound]);
        }
        let _ = self.offered.remove_label_values(&[namespace, name]);
        let _ = self.capacity.remove_label_values(&[namespace, name]);
        for source in ["configured", "measured"] {
            let _ = self.startup.remove_label_values(&[namespace, name, source]);
        }
    }

    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut out).expect("text encoding cannot fail");
        String::from_utf8(out).expect("UTF-8")
    }
}

impl Default for OperatorMetrics {
    fn default() -> Self {
        OperatorMetrics::new()
    }
}
