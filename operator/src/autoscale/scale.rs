//! The autoscaler's loop: every tick, scrape each ready worker pod's sidecar by pod IP (as
//! Knative's autoscaler scrapes its queue-proxies), run [`decide`] for each InferenceService, and
//! act: patch the worker Deployment's replicas as the `ferry-autoscaler` field manager (the
//! owner of that one field), write the observed figures and the decision's reason into the
//! status, and record an Event when the count changes.

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tokio::time::Instant;

use super::collect::{scrape, Collector};
use super::decide::{decide, History, Observed, ScaleDecision, Target};
use crate::desired::{self, LABEL_SERVICE, METRICS_PORT, REPLICAS_MANAGER};
use ferry_core::spec::InferenceService;

pub struct Autoscaler {
    client: Client,
    recorder: Recorder,
    http: reqwest::Client,
    collector: Collector,
    histories: HashMap<String, History>,
    /// Port of the sidecars' metrics (9090 in worker pods).
    pub metrics_port: u16,
}

fn key(isvc: &InferenceService) -> String {
    format!("{}/{}", isvc.namespace().unwrap_or_default(), isvc.name_any())
}

/// The spec's numbers for [`decide`]; `None` for a spec the reconciler reports as invalid.
pub fn target(isvc: &InferenceService) -> Option<Target> {
    let checked = desired::check(&isvc.spec).ok()?;
    let s = &isvc.spec;
    Some(Target {
        workers: 1,
        max_batch_size: s.batching.max_batch_size,
        max_wait: checked.max_wait,
        latency_budget: checked.latency_budget,
        batch_time: checked.batch_time,
        target_utilization: s.scaling.target_utilization,
        min_replicas: s.scaling.min_replicas,
        max_replicas: s.scaling.max_replicas,
        warm_replicas: s.scaling.warm_replicas,
        scale_down_delay: checked.scale_down_delay,
        pressure_tolerance: super::decide::PRESSURE_TOLERANCE,
        startup: checked.startup_time,
    })
}

impl Autoscaler {
    /// `window`: the span rates are taken over.
    pub fn new(client: Client, recorder: Recorder, window: Duration) -> Self {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(1)).build().expect("an HTTP client");
        Autoscaler {
            client,
            recorder,
            http,
            collector: Collector::new(window),
            histories: HashMap::new(),
            metrics_port: METRICS_PORT as u16,
        }
    }

    /// Runs a tick every `interval`, forever; a failed tick is logged and the next one tries again.
    pub async fn run(mut self, interval: Duration) {
        loop {
            if let Err(e) = self.tick(Instant::now()).await {
                tracing::warn!(error = %e, "autoscaler tick failed");
            }
            tokio::time::sleep(interval).await;
        }
    }

    /// One round: scrape, decide and act for every InferenceService.
    pub async fn tick(&mut self, now: Instant) -> Result<(), kube::Error> {
        let isvcs = Api::<InferenceService>::all(self.client.clone()).list(&ListParams::default()).await?;
        let pods = Api::<Pod>::all(self.client.clone()).list(&ListParams::default().labels(LABEL_SERVICE)).await?;
        let mut alive = Vec::new();
        for isvc in &isvcs {
            let mine: Vec<&Pod> = pods
                .iter()
                .filter(|p| {
                    p.namespace() == isvc.namespace() && p.labels().get(LABEL_SERVICE) == Some(&isvc.name_any())
                })
                .collect();
            let mut uids = Vec::new();
            for pod in mine.iter().filter(|p| is_ready(p)) {
                let (Some(uid), Some(ip)) = (pod.uid(), pod.status.as_ref().and_then(|s| s.pod_ip.clone())) else {
                    continue;
                };
                let url = format!("http://{ip}:{}/metrics", self.metrics_port);
                match scrape(&self.http, &url).await {
                    Ok(sample) => self.collector.observe(&uid, now, sample),
                    Err(e) => tracing::debug!(pod = %pod.name_any(), error = %e, "scrape failed"),
                }
                uids.push(uid);
            }
            alive.extend(uids.iter().cloned());
            let observed = self.collector.observed(&uids, now);
            let fill = self
                .collector
                .rows_per_batch(&uids, now)
                .map(|rows| rows / f64::from(isvc.spec.batching.max_batch_size));
            if let Err(e) = self.scale(isvc, &observed, fill, now).await {
                tracing::warn!(object = %key(isvc), error = %e, "could not scale");
            }
        }
        self.collector.retain(&alive);
        Ok(())
    }

    /// Decides for one InferenceService and acts. `None` when there is nothing to scale yet (no
    /// worker Deployment, or a spec the reconciler reports as invalid).
    pub async fn scale(
        &mut self,
        isvc: &InferenceService,
        observed: &Observed,
        batch_fill: Option<f64>,
        now: Instant,
    ) -> Result<Option<ScaleDecision>, kube::Error> {
        let Some(target) = target(isvc) else { return Ok(None) };
        let namespace = isvc.namespace().unwrap_or_default();
        let name = isvc.name_any();
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), &namespace);
        let Some(deployment) = deployments.get_opt(&name).await? else { return Ok(None) };
        let current = deployment.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1).max(0) as u32;
        let ready = deployment.status.as_ref().and_then(|s| s.ready_replicas).unwrap_or(0).max(0) as u32;
        let observed = &Observed { starting: current.saturating_sub(ready), ..observed.clone() };
        let history = self.histories.get(&key(isvc)).cloned().unwrap_or_default();
        let decision = decide(observed, &target, current, &history, now);
        self.histories.insert(key(isvc), decision.history.clone());

        let changed = decision.replicas != current;
        if changed {
            let patch = desired::replicas_patch(isvc, decision.replicas as i32);
            deployments.patch(&name, &PatchParams::apply(REPLICAS_MANAGER).force(), &Patch::Apply(&patch)).await?;
        }
        let mut status = json!({
            "desiredReplicas": decision.replicas,
            "arrivalRate": round(observed.arrival_rate),
            "queueDepth": observed.queue_depth,
            "oldestQueueAge": round(observed.oldest_queue_age.as_secs_f64()),
        });
        if let Some(fill) = batch_fill {
            status["batchFill"] = json!(round(fill));
        }
        if changed {
            status["lastScaleTime"] = json!(Time(Timestamp::now()));
            status["lastScaleReason"] = json!(decision.message);
        }
        let isvcs: Api<InferenceService> = Api::namespaced(self.client.clone(), &namespace);
        isvcs.patch_status(&name, &PatchParams::default(), &Patch::Merge(&json!({ "status": status }))).await?;
        if changed {
            tracing::info!(object = %key(isvc), from = current, to = decision.replicas, reason = %decision.message, "scaled");
            let event = Event {
                type_: EventType::Normal,
                reason: "Scaled".into(),
                note: Some(format!("{current} → {} replicas: {}", decision.replicas, decision.message)),
                action: "Scale".into(),
                secondary: None,
            };
            if let Err(e) = self.recorder.publish(&event, &isvc.object_ref(&())).await {
                tracing::warn!(object = %key(isvc), error = %e, "could not publish an event");
            }
        }
        Ok(Some(decision))
    }
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
