//! The status conditions an InferenceService reports, from what its Deployment says. A pure
//! function, so that each state of a rollout maps to a tested condition set.
//!
//! - `Ready`: every desired worker pod runs the current spec and passes its readiness probe.
//! - `Progressing`: a rollout or scale-up is under way.
//! - `Degraded`: something needs a person: the spec cannot be run, or the Deployment reports a
//!   failure (quota, image pull, progress deadline).

use ferry_core::spec::InferenceServiceStatus;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::Patch;

pub const READY: &str = "Ready";
pub const PROGRESSING: &str = "Progressing";
pub const DEGRADED: &str = "Degraded";
pub const ROUTED: &str = "Routed";

/// A merge patch of the status subresource that sets the fields `status` has and leaves the
/// others (the other writer's) alone.
pub fn patch(status: &InferenceServiceStatus) -> Patch<serde_json::Value> {
    Patch::Merge(serde_json::json!({ "status": status }))
}

/// What the status says about the workers.
#[derive(Debug, Clone, PartialEq)]
pub struct Workers {
    pub replicas: i32,
    pub ready: i32,
    pub conditions: Vec<Condition>,
}

fn condition(type_: &str, ok: bool, reason: &str, message: String, generation: Option<i64>, now: &Time) -> Condition {
    Condition {
        type_: type_.to_owned(),
        status: if ok { "True" } else { "False" }.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time: now.clone(),
    }
}

/// The `Routed` condition of a service with `spec.routing.inferencePool`: whether its
/// InferencePool is applied (and why not).
pub fn routed(ok: bool, reason: &str, message: String, generation: Option<i64>, now: &Time) -> Condition {
    condition(ROUTED, ok, reason, message, generation, now)
}

/// Conditions for an InferenceService whose Deployment is `deployment` (as last read or applied).
pub fn observe(deployment: &Deployment, generation: Option<i64>, now: &Time) -> Workers {
    let desired = deployment.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let status = deployment.status.clone().unwrap_or_default();
    let (replicas, ready) = (status.replicas.unwrap_or(0), status.ready_replicas.unwrap_or(0));
    let updated = status.updated_replicas.unwrap_or(0);
    let seen = status.observed_generation.unwrap_or(0) >= deployment.metadata.generation.unwrap_or(0);
    let rolled_out = seen && updated == desired && replicas == desired && ready == desired;

    let failure = status.conditions.iter().flatten().find(|c| {
        (c.type_ == "ReplicaFailure" && c.status == "True")
            || (c.type_ == "Progressing"
                && c.status == "False"
                && c.reason.as_deref() == Some("ProgressDeadlineExceeded"))
    });
    let degraded = match failure {
        Some(c) => condition(
            DEGRADED,
            true,
            c.reason.as_deref().unwrap_or("DeploymentFailed"),
            format!("worker Deployment: {}", c.message.as_deref().unwrap_or("reports a failure")),
            generation,
            now,
        ),
        None => condition(DEGRADED, false, "AsExpected", "no failure reported".into(), generation, now),
    };
    let ready_condition = if rolled_out && ready >= 1 {
        condition(READY, true, "WorkersReady", format!("{ready}/{desired} worker pods ready"), generation, now)
    } else {
        condition(READY, false, "WorkersNotReady", format!("{ready}/{desired} worker pods ready"), generation, now)
    };
    let progressing = if rolled_out {
        condition(
            PROGRESSING,
            false,
            "RolloutComplete",
            format!("{desired} worker pods run the current spec"),
            generation,
            now,
        )
    } else {
        condition(
            PROGRESSING,
            true,
            "RollingOut",
            format!("{updated}/{desired} worker pods updated, {ready} ready"),
            generation,
            now,
        )
    };
    Workers { replicas, ready, conditions: vec![ready_condition, progressing, degraded] }
}

/// Conditions for a spec that cannot be run.
pub fn invalid(message: &str, generation: Option<i64>, now: &Time) -> Vec<Condition> {
    vec![
        condition(READY, false, "InvalidSpec", "the spec cannot be run; see Degraded".into(), generation, now),
        condition(
            PROGRESSING,
            false,
            "InvalidSpec",
            "nothing is rolled out until the spec is fixed".into(),
            generation,
            now,
        ),
        condition(DEGRADED, true, "InvalidSpec", message.to_owned(), generation, now),
    ]
}

/// Keeps each condition's `lastTransitionTime` when its status did not change.
pub fn carry_transitions(mut next: Vec<Condition>, previous: &[Condition]) -> Vec<Condition> {
    for c in &mut next {
        if let Some(p) = previous.iter().find(|p| p.type_ == c.type_ && p.status == c.status) {
            c.last_transition_time = p.last_transition_time.clone();
        }
    }
    next
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::apps::v1::{DeploymentCondition, DeploymentSpec, DeploymentStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn now() -> Time {
        Time("2026-11-29T08:00:00Z".parse().unwrap())
    }

    fn deployment(desired: i32, updated: i32, ready: i32) -> Deployment {
        Deployment {
            metadata: ObjectMeta { generation: Some(2), ..ObjectMeta::default() },
            spec: Some(DeploymentSpec { replicas: Some(desired), ..DeploymentSpec::default() }),
            status: Some(DeploymentStatus {
                observed_generation: Some(2),
                replicas: Some(desired),
                updated_replicas: Some(updated),
                ready_replicas: Some(ready),
                ..DeploymentStatus::default()
            }),
        }
    }

    fn get<'a>(w: &'a Workers, t: &str) -> &'a Condition {
        w.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn a_finished_rollout_is_ready() {
        let w = observe(&deployment(2, 2, 2), Some(5), &now());
        assert_eq!(get(&w, READY).status, "True");
        assert_eq!(get(&w, READY).message, "2/2 worker pods ready");
        assert_eq!(get(&w, PROGRESSING).status, "False");
        assert_eq!(get(&w, DEGRADED).status, "False");
        assert_eq!(get(&w, READY).observed_generation, Some(5));
        assert_eq!((w.replicas, w.ready), (2, 2));
    }

    #[test]
    fn pods_not_yet_ready_are_progressing() {
        let w = observe(&deployment(3, 3, 1), Some(1), &now());
        assert_eq!(get(&w, READY).status, "False");
        assert_eq!(get(&w, PROGRESSING).status, "True");
        assert_eq!(get(&w, PROGRESSING).message, "3/3 worker pods updated, 1 ready");
    }

    #[test]
    fn a_deployment_failure_is_degraded_with_its_reason() {
        let mut d = deployment(2, 1, 1);
        d.status.as_mut().unwrap().conditions = Some(vec![DeploymentCondition {
            type_: "ReplicaFailure".into(),
            status: "True".into(),
            reason: Some("FailedCreate".into()),
            message: Some("exceeded quota: gpu".into()),
            ..DeploymentCondition::default()
        }]);
        let w = observe(&d, Some(1), &now());
        assert_eq!(get(&w, DEGRADED).status, "True");
        assert_eq!(get(&w, DEGRADED).reason, "FailedCreate");
        assert_eq!(get(&w, DEGRADED).message, "worker Deployment: exceeded quota: gpu");
    }

    #[test]
    fn transition_times_move_only_when_the_status_changes() {
        let earlier = Time("2026-11-29T07:00:00Z".parse().unwrap());
        let before = observe(&deployment(2, 2, 1), Some(1), &earlier).conditions;
        let after = carry_transitions(observe(&deployment(2, 2, 2), Some(1), &now()).conditions, &before);
        let ready = after.iter().find(|c| c.type_ == READY).unwrap();
        let degraded = after.iter().find(|c| c.type_ == DEGRADED).unwrap();
        assert_eq!(ready.last_transition_time, now(), "Ready flipped to True");
        assert_eq!(degraded.last_transition_time, earlier, "Degraded stayed False");
    }
}
