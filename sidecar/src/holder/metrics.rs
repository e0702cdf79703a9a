//! The holder's metrics, one series per service (labels `namespace`, `service`): what reached it
//! and what it did at once, how held requests ended, and what it holds now — the service's
//! offered load while it has no pod, which the operator's collector reads as a pod's.

use std::time::Duration;

use prometheus::{Encoder, GaugeVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};

use ferry_core::metric::{
    HOLDER_FINISHED, HOLDER_HELD, HOLDER_OLDEST_AGE, HOLDER_REQUESTS, HOLDER_SERVICES, NAMESPACE, OUTCOME, SERVICE,
};

/// What the holder did with a request at once (`ferry_holder_requests_total{outcome}`).
pub const HELD: &str = "held";
pub const RELAYED: &str = "relayed";
/// How a held request ended (`ferry_holder_finished_total{outcome}`).
pub const RELEASED: &str = "released";

#[derive(Clone)]
pub struct HolderMetrics {
    registry: Registry,
    requests: IntCounterVec,
    finished: IntCounterVec,
    held: IntGaugeVec,
    oldest: GaugeVec,
    services: IntGauge,
}

impl Default for HolderMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl HolderMetrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let labels = [NAMESPACE, SERVICE, OUTCOME];
        let requests = IntCounterVec::new(
            Opts::new(HOLDER_REQUESTS, "Requests that reached the holder, by what it did at once"),
            &labels,
        )
        .expect("valid metric");
        let finished =
            IntCounterVec::new(Opts::new(HOLDER_FINISHED, "How held requests ended"), &labels).expect("valid metric");
        let held =
            IntGaugeVec::new(Opts::new(HOLDER_HELD, "Requests held now"), &[NAMESPACE, SERVICE]).expect("valid metric");
        let oldest = GaugeVec::new(
            Opts::new(HOLDER_OLDEST_AGE, "Seconds the longest-held request has waited (0 when none is)"),
            &[NAMESPACE, SERVICE],
        )
        .expect("valid metric");
        let services = IntGauge::new(HOLDER_SERVICES, "Services the holder was told of").expect("valid metric");
        for collector in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(finished.clone()),
            Box::new(held.clone()),
            Box::new(oldest.clone()),
            Box::new(services.clone()),
        ] {
            registry.register(collector).expect("registered once");
        }
        HolderMetrics { registry, requests, finished, held, oldest, services }
    }

    /// A service the operator named: its offered-load series start at zero now, so that the
    /// first requests held for it count as growth, not as the baseline of a new series.
    pub fn known(&self, namespace: &str, service: &str) {
        for outcome in [HELD, "infeasible", "queue_full"] {
            self.requests.with_label_values(&[namespace, service, outcome]);
        }
        self.held.with_label_values(&[namespace, service]);
        self.oldest.with_label_values(&[namespace, service]);
    }

    pub fn forget(&self, namespace: &str, service: &str) {
        for vec in [&self.requests, &self.finished] {
            for outcome in
                [HELD, RELAYED, "infeasible", "queue_full", "invalid", "too_large", RELEASED, "expired", "cancelled"]
            {
                let _ = vec.remove_label_values(&[namespace, service, outcome]);
            }
        }
        let _ = self.held.remove_label_values(&[namespace, service]);
        let _ = self.oldest.remove_label_values(&[namespace, service]);
    }

    pub fn request(&self, namespace: &str, service: &str, outcome: &str) {
        self.requests.with_label_values(&[namespace, service, outcome]).inc();
    }

    pub fn finished(&self, namespace: &str, service: &str, outcome: &str) {
        self.finished.with_label_values(&[namespace, service, outcome]).inc();
    }

    /// The text exposition, with the held gauges set from `figures` (namespace, service, held,
    /// oldest) first.
    pub fn render(&self, figures: &[(String, String, usize, Duration)]) -> String {
        self.services.set(figures.len() as i64);
        for (namespace, service, held, oldest) in figures {
            self.held.with_label_values(&[namespace.as_str(), service.as_str()]).set(*held as i64);
            self.oldest.with_label_values(&[namespace.as_str(), service.as_str()]).set(oldest.as_secs_f64());
        }
        let mut out = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut out).expect("text encoding");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}
