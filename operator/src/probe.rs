//! How long a worker pod may take from its container's start to serving before the kubelet
//! restarts it: the start-up probe's allowance. A fixed one fits no one — an LLM pod that reads
//! and uploads tens of gigabytes of weights needs minutes, a small model seconds — so it follows
//! the service's start-up: `spec.scaling.startupTime`, or the measured time-to-ready where that is
//! longer (the status' `measuredStartupTime`, the median of its latest pods). Changing a probe
//! rolls every pod of the service, so a running allowance is kept while it stays within a band
//! around what the start-up asks for (two to ten start-ups): the allowance moves only when the
//! start-up passes half of it or falls below a tenth of it, never with each measurement.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;

/// The probe's period; its failure threshold is the allowance in periods.
pub const PERIOD: Duration = Duration::from_secs(5);
/// Never less: a restart loop at a slow node's first pull is worse than a late restart.
const FLOOR: Duration = Duration::from_secs(120);
/// An allowance asked for is three start-ups, in whole minutes.
const FACTOR: u32 = 3;
/// A running allowance is kept between two and ten start-ups (the fixed 10 minutes of earlier
/// versions is kept for the default 60 s, so that an upgrade rolls no pod).
const KEEP_LOW: u32 = 2;
const KEEP_HIGH: u32 = 10;

/// The allowance for a service whose start-up is `declared` (`spec.scaling.startupTime`) and
/// `measured` (if any), with `running` the one its Deployment has now (if any).
pub fn allowance(declared: Duration, measured: Option<Duration>, running: Option<Duration>) -> Duration {
    let basis = measured.map_or(declared, |m| m.max(declared));
    if let Some(running) = running {
        if running >= (KEEP_LOW * basis).max(FLOOR) && running <= (KEEP_HIGH * basis).max(FLOOR) {
            return running;
        }
    }
    let minutes = (FACTOR * basis).max(FLOOR).as_secs().div_ceil(60);
    Duration::from_secs(minutes * 60)
}

/// The probe's failure threshold for `allowance`.
pub fn failures(allowance: Duration) -> i32 {
    i32::try_from(allowance.as_secs().div_ceil(PERIOD.as_secs())).unwrap_or(i32::MAX)
}

/// The allowance of the sidecar's start-up probe in `deployment`, as it runs.
pub fn running(deployment: &Deployment) -> Option<Duration> {
    let pod = deployment.spec.as_ref()?.template.spec.as_ref()?;
    let sidecar = pod.containers.iter().find(|c| c.name == crate::desired::SIDECAR)?;
    let probe = sidecar.startup_probe.as_ref()?;
    let (period, failures) = (probe.period_seconds.unwrap_or(10), probe.failure_threshold.unwrap_or(3));
    Some(Duration::from_secs(u64::try_from(period).ok()? * u64::try_from(failures).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn the_allowance_is_three_start_ups_in_whole_minutes_and_never_below_two_minutes() {
        assert_eq!(allowance(60 * S, None, None), 180 * S);
        assert_eq!(allowance(60 * S, Some(10 * S), None), 180 * S, "a quicker start-up than declared lowers nothing");
        assert_eq!(allowance(10 * S, Some(15 * S), None), 120 * S, "the floor");
        // LLM pods that load weights for minutes: the measured time-to-ready leads.
        assert_eq!(allowance(60 * S, Some(250 * S), None), 780 * S);
        assert_eq!(allowance(300 * S, None, None), 900 * S);
        assert_eq!(failures(780 * S), 156);
    }

    #[test]
    fn a_running_allowance_stays_while_the_start_up_moves_less_than_half_or_double() {
        // Earlier versions' fixed 10 minutes, on the default start-up: kept (no rollout at upgrade).
        assert_eq!(allowance(60 * S, None, Some(600 * S)), 600 * S);
        // Measurements that wander around 4 minutes do not move a 12-minute allowance...
        for measured in [200, 240, 290, 360] {
            assert_eq!(allowance(60 * S, Some(measured * S), Some(720 * S)), 720 * S, "{measured} s");
        }
        // ...a start-up past half of it does (the pods would be restarted mid-load), and one
        // that fell to a tenth of it does too.
        assert_eq!(allowance(60 * S, Some(400 * S), Some(720 * S)), 1200 * S);
        assert_eq!(allowance(30 * S, Some(40 * S), Some(720 * S)), 120 * S);
    }

    #[test]
    fn the_running_allowance_is_read_off_the_sidecars_probe() {
        let deployment: Deployment = serde_json::from_value(serde_json::json!({
            "spec": {"selector": {}, "template": {"spec": {"containers": [
                {"name": "engine", "startupProbe": {"periodSeconds": 1, "failureThreshold": 1}},
                {"name": "sidecar", "startupProbe": {"periodSeconds": 5, "failureThreshold": 120}},
            ]}}},
        }))
        .unwrap();
        assert_eq!(running(&deployment), Some(600 * S));
        assert_eq!(running(&Deployment::default()), None);
    }
}
