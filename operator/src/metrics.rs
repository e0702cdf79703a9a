//! The operator's own metrics: reconciles, failures by error label, reconcile duration, and the
//! autoscaler's decisions by reason and its failed scrapes.

use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry, TextEncoder};

#[derive(Clone)]
pub struct OperatorMetrics {
    registry: Registry,
    pub reconciles: IntCounter,
    pub failures: IntCounterVec,
    pub duration: Histogram,
    /// `ferry_operator_scale_decisions_total{reason}`: one per service per tick.
    pub decisions: IntCounterVec,
    pub scrape_failures: IntCounter,
}

impl OperatorMetrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let reconciles = IntCounter::new("ferry_operator_reconciles_total", "Reconciles started.").expect("valid");
        let failures = IntCounterVec::new(
            Opts::new("ferry_operator_reconcile_failures_total", "Reconciles that failed, by error."),
            &["error"],
        )
        .expect("valid");
        let duration = Histogram::with_opts(
            HistogramOpts::new("ferry_operator_reconcile_duration_seconds", "Time per reconcile.")
                .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
        )
        .expect("valid");
        let decisions = IntCounterVec::new(
            Opts::new("ferry_operator_scale_decisions_total", "Autoscaler decisions, by reason."),
            &["reason"],
        )
        .expect("valid");
        let scrape_failures =
            IntCounter::new("ferry_operator_scrape_failures_total", "Sidecar scrapes that failed or timed out.")
                .expect("valid");
        registry.register(Box::new(decisions.clone())).expect("unique");
        registry.register(Box::new(scrape_failures.clone())).expect("unique");
        registry.register(Box::new(reconciles.clone())).expect("unique");
        registry.register(Box::new(failures.clone())).expect("unique");
        registry.register(Box::new(duration.clone())).expect("unique");
        OperatorMetrics { registry, reconciles, failures, duration, decisions, scrape_failures }
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
