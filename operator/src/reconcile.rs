//! The reconciler: for each InferenceService, server-side apply of its worker Deployment and
//! Service, then an honest status. Replicas are the autoscaler's: the reconciler sets them once,
//! when it creates the Deployment, and never again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Api, Client, Resource, ResourceExt};

use crate::desired::{self, Images, FIELD_MANAGER, REPLICAS_MANAGER};
use crate::metrics::OperatorMetrics;
use crate::{routing, status};
use ferry_core::spec::{InferenceService, InferenceServiceStatus};

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub images: Images,
    pub metrics: OperatorMetrics,
    pub recorder: Recorder,
    /// Consecutive failures per object, for the retry backoff.
    failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    pub fn new(client: Client, images: Images, metrics: OperatorMetrics, recorder: Recorder) -> Self {
        Context { client, images, metrics, recorder, failures: Mutex::new(HashMap::new()) }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading the worker Deployment: {0}")]
    GetDeployment(#[source] kube::Error),
    #[error("applying the worker Deployment: {0}")]
    ApplyDeployment(#[source] kube::Error),
    #[error("setting the initial replicas: {0}")]
    ApplyReplicas(#[source] kube::Error),
    #[error("applying the Service: {0}")]
    ApplyService(#[source] kube::Error),
    #[error("updating the status: {0}")]
    PatchStatus(#[source] kube::Error),
    #[error("the InferenceService has no namespace")]
    NoNamespace,
}

impl Error {
    /// The `error` label of `ferry_operator_reconcile_failures_total`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::GetDeployment(_) => "get_deployment",
            Error::ApplyDeployment(_) => "apply_deployment",
            Error::ApplyReplicas(_) => "apply_replicas",
            Error::ApplyService(_) => "apply_service",
            Error::PatchStatus(_) => "patch_status",
            Error::NoNamespace => "no_namespace",
        }
    }
}

/// How long to wait before retrying an object after its `failures`-th consecutive failure:
/// 1 s, 2 s, 4 s, ... up to 5 minutes.
pub fn backoff(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(9)).min(Duration::from_secs(300))
}

fn key(isvc: &InferenceService) -> String {
    format!("{}/{}", isvc.namespace().unwrap_or_default(), isvc.name_any())
}

pub async fn reconcile(isvc: Arc<InferenceService>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = ferry_core::clock::now();
    ctx.metrics.reconciles.inc();
    let result = apply(&isvc, &ctx).await;
    ctx.metrics.duration.observe(ferry_core::clock::elapsed(started).as_secs_f64());
    match &result {
        Ok(_) => {
            ctx.failures.lock().unwrap_or_else(|p| p.into_inner()).remove(&key(&isvc));
        }
        // Tell the user on the object itself; repeats of the same failure become one event series.
        Err(error) => publish(&ctx, &isvc, EventType::Warning, "ReconcileFailed", "Reconcile", error.to_string()).await,
    }
    result
}

/// Counts the failure and retries the object with exponential backoff.
pub fn error_policy(isvc: Arc<InferenceService>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.failures.with_label_values(&[error.metric_label()]).inc();
    let mut failures = ctx.failures.lock().unwrap_or_else(|p| p.into_inner());
    let n = failures.entry(key(&isvc)).or_insert(0);
    *n += 1;
    let wait = backoff(*n);
    tracing::warn!(object = %key(&isvc), %error, retry_in = ?wait, "reconcile failed");
    Action::requeue(wait)
}

async fn apply(isvc: &InferenceService, ctx: &Context) -> Result<Action, Error> {
    let namespace = isvc.namespace().ok_or(Error::NoNamespace)?;
    let name = isvc.name_any();
    let generation = isvc.metadata.generation;
    let now = Time(Timestamp::now());
    let previous = isvc.status.clone().unwrap_or_default();
    let isvcs: Api<InferenceService> = Api::namespaced(ctx.client.clone(), &namespace);

    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &namespace);
    let existing = deployments.get_opt(&name).await.map_err(Error::GetDeployment)?;
    let deployment = match desired::deployment(isvc, &ctx.images, existing.as_ref()) {
        Ok(deployment) => deployment,
        Err(invalid) => {
            let conditions =
                status::carry_transitions(status::invalid(&invalid.message, generation, &now), &previous.conditions);
            let patch = InferenceServiceStatus { observed_generation: generation, conditions, ..Default::default() };
            isvcs
                .patch_status(&name, &PatchParams::default(), &status::patch(&patch))
                .await
                .map_err(Error::PatchStatus)?;
            if previous.observed_generation != generation {
                publish(ctx, isvc, EventType::Warning, "InvalidSpec", "Validate", invalid.message.clone()).await;
            }
            tracing::warn!(object = %key(isvc), reason = %invalid, "invalid spec");
            return Ok(Action::await_change());
        }
    };

    let services: Api<Service> = Api::namespaced(ctx.client.clone(), &namespace);
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    let mut applied =
        deployments.patch(&name, &apply, &Patch::Apply(&deployment)).await.map_err(Error::ApplyDeployment)?;
    let created = existing.is_none();
    let mut desired_replicas = None;
    if created {
        let replicas = desired::initial_replicas(&isvc.spec);
        let patch = desired::replicas_patch(isvc, replicas);
        applied = deployments
            .patch(&name, &PatchParams::apply(REPLICAS_MANAGER), &Patch::Apply(&patch))
            .await
            .map_err(Error::ApplyReplicas)?;
        desired_replicas = Some(replicas);
    }
    services.patch(&name, &apply, &Patch::Apply(&desired::service(isvc))).await.map_err(Error::ApplyService)?;
    let (pool, routed) = route(isvc, ctx, &namespace, &previous).await;
    // A pool that could not be applied (or deleted) is tried again within the minute, not at the
    // periodic requeue: the Inference Extension's CRDs or the RBAC may come soon after.
    let retry_routing = routed.as_ref().is_some_and(|(ok, _, _)| !ok);

    let workers = status::observe(&applied, generation, &now);
    let mut conditions = workers.conditions;
    conditions.extend(routed.map(|(ok, reason, message)| status::routed(ok, reason, message, generation, &now)));
    let conditions = status::carry_transitions(conditions, &previous.conditions);
    let patch = InferenceServiceStatus {
        inference_pool: pool,
        observed_generation: generation,
        replicas: Some(workers.replicas),
        ready_replicas: Some(workers.ready),
        conditions,
        // After the create, desiredReplicas is the autoscaler's to write.
        desired_replicas,
        ..Default::default()
    };
    let mut body = serde_json::json!({ "status": patch });
    if patch.inference_pool.is_none() && previous.inference_pool.is_some() {
        // A merge patch leaves out what is unset: the pool that is gone is cleared by a null.
        body["status"]["inferencePool"] = serde_json::Value::Null;
    }
    isvcs.patch_status(&name, &PatchParams::default(), &Patch::Merge(body)).await.map_err(Error::PatchStatus)?;

    if created {
        let note =
            format!("created worker Deployment and Service {name} with {} replicas", desired_replicas.unwrap_or(1));
        publish(ctx, isvc, EventType::Normal, "Created", "Apply", note).await;
    } else if previous.observed_generation != generation {
        let note = format!("applied generation {} to worker Deployment and Service {name}", generation.unwrap_or(0));
        publish(ctx, isvc, EventType::Normal, "Updated", "Apply", note).await;
    }
    Ok(Action::requeue(Duration::from_secs(if retry_routing { 30 } else { 300 })))
}

/// Applies the service's InferencePool where it asks for one, and deletes the one it had where
/// it no longer does. Returns the pool's name for the status and the `Routed` condition. A pool
/// that cannot be applied (the Inference Extension's CRD not installed, no RBAC for it) fails
/// the condition, not the reconcile: the pods serve through their Service all the same.
async fn route(
    isvc: &InferenceService,
    ctx: &Context,
    namespace: &str,
    previous: &InferenceServiceStatus,
) -> (Option<String>, Option<(bool, &'static str, String)>) {
    let name = isvc.name_any();
    let pools: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), namespace, &routing::pool_resource());
    match routing::inference_pool(isvc) {
        Some(pool) => {
            match pools.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&pool)).await {
                Ok(_) => (
                    Some(name.clone()),
                    Some((true, "InferencePoolApplied", format!("InferencePool {name} selects the worker pods"))),
                ),
                Err(e) => {
                    tracing::warn!(object = %key(isvc), error = %e, "could not apply the InferencePool");
                    let message = format!("applying InferencePool {name} (inference.networking.k8s.io/v1): {e}");
                    // One applied before may still be there: the status keeps it, so that turning
                    // routing off still deletes it.
                    (previous.inference_pool.clone(), Some((false, "InferencePoolNotApplied", message)))
                }
            }
        }
        // One is recorded, or was asked for (a status write lost after the apply leaves only the
        // condition): delete it, a pool already gone being no failure.
        None if previous.inference_pool.is_some() || previous.conditions.iter().any(|c| c.type_ == status::ROUTED) => {
            match pools.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => {
                    tracing::warn!(object = %key(isvc), error = %e, "could not delete the InferencePool");
                    let message = format!("deleting InferencePool {name}, which routing no longer asks for: {e}");
                    return (Some(name), Some((false, "InferencePoolNotDeleted", message)));
                }
            }
            (None, None)
        }
        None => (None, None),
    }
}

/// Events are for people; failing to publish one must not fail the reconcile.
async fn publish(ctx: &Context, isvc: &InferenceService, type_: EventType, reason: &str, action: &str, note: String) {
    let event = Event { type_, reason: reason.into(), note: Some(note), action: action.into(), secondary: None };
    if let Err(e) = ctx.recorder.publish(&event, &isvc.object_ref(&())).await {
        tracing::warn!(object = %key(isvc), error = %e, "could not publish an event");
    }
}
