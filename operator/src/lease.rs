//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's timing rules, so that
//! two replicas never act at once:
//!
//! - A follower times a Lease by its own clock from when it *saw the record change* (a new holder
//!   or a new renew time), never by comparing the holder's `renewTime` with its own wall clock:
//!   clocks of two machines disagree, the monotonic time since an observation does not. A Lease
//!   seen for the first time is therefore waited out for its whole duration.
//! - The leader acts only until its *renew deadline* (shorter than the Lease duration) after the
//!   start of its last successful renewal. A leader that cannot renew — the API server is slow,
//!   down or partitioned away — stops acting before any follower may take over: the follower saw
//!   that renewal land after it started, and waits a whole duration from then.
//! - Every API step is bounded by a timeout (the retry period, and for the leader its renew
//!   deadline), so a hung request cannot keep a stale leader acting.
//! - On shutdown the leader releases the Lease (empty holder), so a follower takes over at once.
//!
//! Written here because kube-rs has no leader election of its own; the rules are a pure state
//! machine ([`Candidate`]), the loop is thin. Writes use the Lease's `resourceVersion`, so two
//! candidates that both see an expired Lease cannot both take it: the API server accepts only the
//! first replace.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::Api;
use std::time::Instant;
use tokio::sync::watch;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    pub name: String,
    pub identity: String,
    /// How long a Lease stays held without renewal.
    pub duration: Duration,
    /// How long the leader keeps acting without a successful renewal; below `duration`.
    pub renew_deadline: Duration,
    /// How often the holder renews, and a candidate looks.
    pub retry: Duration,
}

impl LeaseConfig {
    /// The timing rules hold only with `retry < renew_deadline < duration`.
    pub fn check(&self) -> Result<(), String> {
        if self.renew_deadline >= self.duration {
            return Err(format!(
                "the lease renew deadline ({:?}) must be shorter than the lease duration ({:?}): a leader that cannot renew must stop before another may take over",
                self.renew_deadline, self.duration
            ));
        }
        if self.retry.is_zero() || self.retry >= self.renew_deadline {
            return Err(format!(
                "the lease retry period ({:?}) must be more than 0 and shorter than the renew deadline ({:?})",
                self.retry, self.renew_deadline
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nobody holds it, or its holder has not renewed for a whole duration since we saw it: take it.
    Acquire,
    /// We hold it: renew it.
    Renew,
    /// Someone else holds it.
    Follow { holder: String },
}

/// The parts of a Lease record that change when its holder renews or changes.
#[derive(Debug, Clone, PartialEq)]
struct Record {
    holder: String,
    renew: Option<MicroTime>,
    acquire: Option<MicroTime>,
    transitions: Option<i32>,
    duration: Duration,
}

impl Record {
    fn of(spec: &LeaseSpec) -> Record {
        Record {
            holder: spec.holder_identity.clone().unwrap_or_default(),
            renew: spec.renew_time.clone(),
            acquire: spec.acquire_time.clone(),
            transitions: spec.lease_transitions,
            duration: Duration::from_secs(spec.lease_duration_seconds.unwrap_or(15).max(0) as u64),
        }
    }
}

/// One replica's view of the election, by its own monotonic clock.
#[derive(Debug, Clone)]
pub struct Candidate {
    config: LeaseConfig,
    /// The record last read, and when it was first seen as it is.
    seen: Option<(Record, Instant)>,
    /// When our last successful write (acquire or renew) started.
    renewed: Option<Instant>,
}

impl Candidate {
    pub fn new(config: LeaseConfig) -> Candidate {
        Candidate { config, seen: None, renewed: None }
    }

    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// Records the Lease as read at `now` (`None`: there is none). An unchanged record keeps the
    /// time it was first seen.
    pub fn observe(&mut self, lease: Option<&LeaseSpec>, now: Instant) {
        let record = lease.map(Record::of);
        match (record, &self.seen) {
            (None, _) => self.seen = None,
            (Some(record), Some((seen, _))) if *seen == record => {}
            (Some(record), _) => self.seen = Some((record, now)),
        }
    }

    /// What to do about the Lease last observed.
    pub fn decide(&self, now: Instant) -> Decision {
        let Some((record, at)) = &self.seen else { return Decision::Acquire };
        if record.holder.is_empty() {
            return Decision::Acquire;
        }
        if record.holder == self.config.identity {
            return Decision::Renew;
        }
        if *at + record.duration <= now {
            Decision::Acquire
        } else {
            Decision::Follow { holder: record.holder.clone() }
        }
    }

    /// Our write that started at `started` succeeded: we lead until the renew deadline from then.
    pub fn renewed(&mut self, started: Instant) {
        self.renewed = Some(started);
    }

    /// Someone else holds the Lease: we do not lead.
    pub fn lost(&mut self) {
        self.renewed = None;
    }

    /// Until when we may act, if we lead.
    pub fn deadline(&self) -> Option<Instant> {
        self.renewed.map(|t| t + self.config.renew_deadline)
    }

    pub fn leading(&self, now: Instant) -> bool {
        self.deadline().is_some_and(|d| now < d)
    }
}

/// The Lease as `me` writes it when acquiring (`acquire`) or renewing.
pub fn next_spec(current: Option<&LeaseSpec>, config: &LeaseConfig, now: Timestamp, acquire: bool) -> LeaseSpec {
    let current = current.cloned().unwrap_or_default();
    let transitions = current.lease_transitions.unwrap_or(0);
    let had_holder = current.holder_identity.as_deref().is_some_and(|h| !h.is_empty());
    LeaseSpec {
        holder_identity: Some(config.identity.clone()),
        lease_duration_seconds: Some(config.duration.as_secs() as i32),
        acquire_time: if acquire { Some(MicroTime(now)) } else { current.acquire_time },
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(if acquire && had_holder { transitions + 1 } else { transitions }),
        ..current
    }
}

/// One look at the Lease: acquires or renews it if it may, and says whether we lead now.
pub async fn step(api: &Api<Lease>, candidate: &mut Candidate) -> Result<bool, kube::Error> {
    let started = ferry_core::clock::now();
    let config = candidate.config().clone();
    let current = api.get_opt(&config.name).await?;
    candidate.observe(current.as_ref().and_then(|l| l.spec.as_ref()), ferry_core::clock::now());
    let acquire = match candidate.decide(ferry_core::clock::now()) {
        Decision::Follow { .. } => {
            candidate.lost();
            return Ok(false);
        }
        Decision::Acquire => true,
        Decision::Renew => false,
    };
    let spec = next_spec(current.as_ref().and_then(|l| l.spec.as_ref()), &config, Timestamp::now(), acquire);
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
        Ok(lease) => {
            candidate.renewed(started);
            candidate.observe(lease.spec.as_ref(), ferry_core::clock::now());
            Ok(true)
        }
        // Someone else wrote first (409 Conflict, or 409 AlreadyExists on create).
        Err(kube::Error::Api(status)) if status.code == 409 => {
            candidate.lost();
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Keeps trying to lead; publishes whether we lead. Leadership ends when someone else holds the
/// Lease, or at the renew deadline when renewals fail or hang.
pub async fn hold(api: Api<Lease>, config: LeaseConfig, leading: watch::Sender<bool>) {
    let retry = config.retry;
    let mut candidate = Candidate::new(config);
    loop {
        let now = ferry_core::clock::now();
        // A leader's look may not outlast its deadline; anyone's, the retry period.
        let limit = candidate.deadline().filter(|d| *d > now).map_or(retry, |d| (d - now).min(retry));
        let limit = limit.max(Duration::from_millis(1));
        match tokio::time::timeout(limit, step(&api, &mut candidate)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "could not read or write the leader Lease"),
            Err(_) => tracing::warn!(timeout = ?limit, "the leader Lease did not answer in time"),
        }
        let lead = candidate.leading(ferry_core::clock::now());
        if lead && !*leading.borrow() {
            let c = candidate.config();
            tracing::info!(lease = %c.name, identity = %c.identity, "became the leader");
        }
        if *leading.borrow() != lead {
            let _ = leading.send(lead);
        }
        // Look again after the retry period, or at the deadline if it comes first, so that a
        // leader that could not renew stops acting on time.
        let mut wake = now + retry;
        if let Some(deadline) = candidate.deadline().filter(|_| lead) {
            wake = wake.min(deadline);
        }
        ferry_core::clock::sleep_until(wake).await;
        if !candidate.leading(ferry_core::clock::now()) && *leading.borrow() {
            let _ = leading.send(false);
        }
    }
}

/// Gives the Lease up if we hold it (an empty holder, a duration of 1 s), so that a follower
/// takes over at its next look instead of waiting the duration out.
pub async fn release(api: &Api<Lease>, config: &LeaseConfig) -> Result<(), kube::Error> {
    let Some(mut lease) = api.get_opt(&config.name).await? else { return Ok(()) };
    let Some(spec) = lease.spec.as_mut() else { return Ok(()) };
    if spec.holder_identity.as_deref() != Some(config.identity.as_str()) {
        return Ok(());
    }
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(MicroTime(Timestamp::now()));
    api.replace(&config.name, &PostParams::default(), &lease).await?;
    tracing::info!(lease = %config.name, "released the leader Lease");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn config(identity: &str) -> LeaseConfig {
        LeaseConfig {
            name: "ferry-operator".into(),
            identity: identity.into(),
            duration: 15 * S,
            renew_deadline: 10 * S,
            retry: 2 * S,
        }
    }

    fn held_by(holder: &str, renewed: &str) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(renewed.parse().unwrap())),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn a_missing_or_empty_lease_is_acquired() {
        let now = ferry_core::clock::now();
        let mut c = Candidate::new(config("a"));
        c.observe(None, now);
        assert_eq!(c.decide(now), Decision::Acquire);
        c.observe(Some(&LeaseSpec::default()), now);
        assert_eq!(c.decide(now), Decision::Acquire);
    }

    #[test]
    fn a_lease_is_timed_from_when_it_was_seen_not_by_its_renew_time() {
        let t0 = ferry_core::clock::now();
        let mut c = Candidate::new(config("a"));
        // Renewed an hour ago by the holder's clock: a follower whose clock runs an hour ahead
        // would take it at once. Seen for the first time now, it is waited out.
        c.observe(Some(&held_by("b", "2026-12-02T07:00:00Z")), t0);
        assert_eq!(c.decide(t0 + 14 * S), Decision::Follow { holder: "b".into() });
        // The same record still at 14 s: still the time it was first seen.
        c.observe(Some(&held_by("b", "2026-12-02T07:00:00Z")), t0 + 14 * S);
        assert_eq!(c.decide(t0 + 15 * S), Decision::Acquire);
        // A renewal seen at 12 s restarts the count.
        let mut c = Candidate::new(config("a"));
        c.observe(Some(&held_by("b", "2026-12-02T07:00:00Z")), t0);
        c.observe(Some(&held_by("b", "2026-12-02T07:00:12Z")), t0 + 12 * S);
        assert_eq!(c.decide(t0 + 26 * S), Decision::Follow { holder: "b".into() });
        assert_eq!(c.decide(t0 + 27 * S), Decision::Acquire);
    }

    #[test]
    fn a_leader_that_cannot_renew_stops_before_a_follower_may_take_over() {
        let t0 = ferry_core::clock::now();
        let mut leader = Candidate::new(config("a"));
        let mut follower = Candidate::new(config("b"));
        // The leader's renewal starts at 0 and lands at 0.3 s, where the follower sees it.
        leader.renewed(t0);
        follower.observe(Some(&held_by("a", "2026-12-02T08:00:00Z")), t0 + Duration::from_millis(300));
        // Then every renewal fails.
        for ms in (0..20_000).step_by(100) {
            let now = t0 + Duration::from_millis(ms);
            if follower.decide(now) == Decision::Acquire {
                assert!(!leader.leading(now), "both would act at {ms} ms");
            }
        }
        assert!(leader.leading(t0 + Duration::from_millis(9_999)));
        assert!(!leader.leading(t0 + 10 * S), "the renew deadline");
        assert_eq!(follower.decide(t0 + Duration::from_millis(15_299)), Decision::Follow { holder: "a".into() });
        assert_eq!(follower.decide(t0 + Duration::from_millis(15_300)), Decision::Acquire);
        // Someone else's record takes leadership away at once.
        leader.renewed(t0 + 20 * S);
        leader.lost();
        assert!(!leader.leading(t0 + 21 * S));
    }

    #[test]
    fn the_timing_rules_are_checked() {
        assert_eq!(config("a").check(), Ok(()));
        let late = LeaseConfig { renew_deadline: 15 * S, ..config("a") };
        assert!(late
            .check()
            .unwrap_err()
            .contains("renew deadline (15s) must be shorter than the lease duration (15s)"));
        let slow = LeaseConfig { retry: 10 * S, ..config("a") };
        assert!(slow.check().unwrap_err().contains("retry period (10s)"));
    }

    #[test]
    fn taking_over_counts_a_transition_and_renewing_does_not() {
        let config = config("a");
        let old = LeaseSpec { lease_transitions: Some(3), ..held_by("b", "2026-11-29T08:00:00Z") };
        let now: Timestamp = "2026-11-29T08:01:00Z".parse().unwrap();
        let taken = next_spec(Some(&old), &config, now, true);
        assert_eq!(taken.holder_identity.as_deref(), Some("a"));
        assert_eq!(taken.lease_transitions, Some(4));
        assert_eq!(taken.acquire_time, Some(MicroTime(now)));
        let later: Timestamp = "2026-11-29T08:01:05Z".parse().unwrap();
        let renewed = next_spec(Some(&taken), &config, later, false);
        assert_eq!(renewed.lease_transitions, Some(4));
        assert_eq!(renewed.acquire_time, Some(MicroTime(now)));
        assert_eq!(renewed.renew_time, Some(MicroTime(later)));
        // Taking a released Lease (no holder) is no transition.
        let released = LeaseSpec { holder_identity: None, ..taken };
        assert_eq!(next_spec(Some(&released), &config, later, true).lease_transitions, Some(4));
    }
}
