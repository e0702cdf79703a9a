//! Leader election on a `coordination.k8s.io/v1` Lease, the way client-go's leaderelection and
//! controller-runtime do it: the holder renews the Lease every few seconds; anyone may take it
//! over once it has gone unrenewed for its whole duration. Written here because kube-rs has no
//! leader election of its own; the decision is a pure function, the loop is thin.
//!
//! Writes use the Lease's `resourceVersion`, so two candidates that both see an expired Lease
//! cannot both take it: the API server accepts only the first replace.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::PostParams;
use kube::Api;
use tokio::sync::watch;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    pub name: String,
    pub identity: String,
    /// How long a Lease stays held without renewal.
    pub duration: Duration,
    /// How often the holder renews, and a candidate looks.
    pub retry: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nobody holds it, or the holder let it expire: take it.
    Acquire,
    /// We hold it: renew it.
    Renew,
    /// Someone else holds it.
    Follow { holder: String },
}

/// What to do about `lease` (as read now) as candidate `me`.
pub fn decide(lease: Option<&LeaseSpec>, me: &str, now: Timestamp) -> Decision {
    let Some(spec) = lease else { return Decision::Acquire };
    let holder = spec.holder_identity.clone().unwrap_or_default();
    if holder.is_empty() {
        return Decision::Acquire;
    }
    if holder == me {
        return Decision::Renew;
    }
    let last = spec.renew_time.as_ref().or(spec.acquire_time.as_ref()).map(|t| t.0);
    let duration = SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(15)));
    match last {
        Some(last) if last + duration > now => Decision::Follow { holder },
        _ => Decision::Acquire,
    }
}

/// The Lease as `me` writes it when acquiring (`acquire`) or renewing.
pub fn next_spec(current: Option<&LeaseSpec>, config: &LeaseConfig, now: Timestamp, acquire: bool) -> LeaseSpec {
    let current = current.cloned().unwrap_or_default();
    let transitions = current.lease_transitions.unwrap_or(0);
    LeaseSpec {
        holder_identity: Some(config.identity.clone()),
        lease_duration_seconds: Some(config.duration.as_secs() as i32),
        acquire_time: if acquire { Some(MicroTime(now)) } else { current.acquire_time },
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(if acquire && current.holder_identity.is_some() {
            transitions + 1
        } else {
            transitions
        }),
        ..current
    }
}

/// One look at the Lease: acquires or renews it if it may, and says whether we lead now.
pub async fn step(api: &Api<Lease>, config: &LeaseConfig) -> Result<bool, kube::Error> {
    let now = Timestamp::now();
    let current = api.get_opt(&config.name).await?;
    let decision = decide(current.as_ref().and_then(|l| l.spec.as_ref()), &config.identity, now);
    let acquire = match decision {
        Decision::Follow { .. } => return Ok(false),
        Decision::Acquire => true,
        Decision::Renew => false,
    };
    let spec = next_spec(current.as_ref().and_then(|l| l.spec.as_ref()), config, now, acquire);
    let written = match current {
        None => {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(config.name.clone()), ..ObjectMeta::default() },
                spec: Some(spec),
            };
            api.create(&PostParams::default(), &lease).await
        }
        Some(mut lease) => {
            lease.spec = Some(spec);
            api.replace(&config.name, &PostParams::default(), &lease).await
        }
    };
    match written {
        Ok(_) => Ok(true),
        // Someone else wrote first (409 Conflict, or 409 AlreadyExists on create).
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Keeps trying to lead; publishes whether we lead. Leadership is lost when a renewal has not
/// succeeded for the Lease's whole duration.
pub async fn hold(api: Api<Lease>, config: LeaseConfig, leading: watch::Sender<bool>) {
    let mut last_success: Option<tokio::time::Instant> = None;
    loop {
        match step(&api, &config).await {
            Ok(true) => {
                if !*leading.borrow() {
                    tracing::info!(lease = %config.name, identity = %config.identity, "became the leader");
                }
                last_success = Some(tokio::time::Instant::now());
                let _ = leading.send(true);
            }
            Ok(false) => {
                last_success = None;
                let _ = leading.send(false);
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not read or write the leader Lease");
                if last_success.is_none_or(|t| t.elapsed() >= config.duration) {
                    let _ = leading.send(false);
                }
            }
        }
        tokio::time::sleep(config.retry).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn held_by(holder: &str, renewed: &str) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(at(renewed))),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn a_missing_or_empty_lease_is_acquired() {
        assert_eq!(decide(None, "a", at("2026-11-29T08:00:00Z")), Decision::Acquire);
        assert_eq!(decide(Some(&LeaseSpec::default()), "a", at("2026-11-29T08:00:00Z")), Decision::Acquire);
    }

    #[test]
    fn the_holder_renews_and_others_follow_until_it_expires() {
        let lease = held_by("b", "2026-11-29T08:00:00Z");
        assert_eq!(decide(Some(&lease), "b", at("2026-11-29T08:00:05Z")), Decision::Renew);
        assert_eq!(decide(Some(&lease), "a", at("2026-11-29T08:00:14Z")), Decision::Follow { holder: "b".into() });
        assert_eq!(decide(Some(&lease), "a", at("2026-11-29T08:00:15Z")), Decision::Acquire);
    }

    #[test]
    fn taking_over_counts_a_transition_and_renewing_does_not() {
        let config = LeaseConfig {
            name: "ferry-operator".into(),
            identity: "a".into(),
            duration: Duration::from_secs(15),
            retry: Duration::from_secs(5),
        };
        let old = LeaseSpec { lease_transitions: Some(3), ..held_by("b", "2026-11-29T08:00:00Z") };
        let now = at("2026-11-29T08:01:00Z");
        let taken = next_spec(Some(&old), &config, now, true);
        assert_eq!(taken.holder_identity.as_deref(), Some("a"));
        assert_eq!(taken.lease_transitions, Some(4));
        assert_eq!(taken.acquire_time, Some(MicroTime(now)));
        let renewed = next_spec(Some(&taken), &config, at("2026-11-29T08:01:05Z"), false);
        assert_eq!(renewed.lease_transitions, Some(4));
        assert_eq!(renewed.acquire_time, Some(MicroTime(now)));
        assert_eq!(renewed.renew_time, Some(MicroTime(at("2026-11-29T08:01:05Z"))));
    }
}
