//! Time-to-ready, measured per service: from a worker pod's creation to its `Ready` condition, as
//! the pods the operator watches report them. It replaces `spec.scaling.startupTime` (a first
//! guess) in the decision's look-ahead once a pod has been measured: the time an image pull, a
//! model load and a warm-up really take on this cluster.

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

/// How long `pod` took from creation to Ready, if it is ready and this was its start: a pod
/// whose containers restarted became ready again after a crash, not after starting.
pub fn time_to_ready(pod: &Pod) -> Option<Duration> {
    let created = pod.metadata.creation_timestamp.as_ref()?.0;
    let status = pod.status.as_ref()?;
    if status.container_statuses.iter().flatten().any(|c| c.restart_count > 0) {
        return None;
    }
    let ready = status.conditions.iter().flatten().find(|c| c.type_ == "Ready" && c.status == "True")?;
    let at = ready.last_transition_time.as_ref()?.0;
    let ms = at.as_millisecond() - created.as_millisecond();
    u64::try_from(ms).ok().map(Duration::from_millis)
}

/// The latest measurements of one service.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StartupTimes {
    /// Pods (UIDs) already measured, so each counts once.
    seen: HashSet<String>,
    /// Pods seen before they were ready: their Ready is their start-up's end.
    unready: HashSet<String>,
    recent: VecDeque<Duration>,
}

/// A pod first seen already ready is measured only if it became ready this recently: a Ready
/// from long ago (an operator that just took over) may be a recovery's, after a probe failed.
const RECENT: Duration = Duration::from_secs(300);

impl StartupTimes {
    /// Measurements kept; the figure is their median.
    pub const KEEP: usize = 5;

    /// Measures `pod` if it has become ready and was not measured before; `wall` is now.
    pub fn observe(&mut self, pod: &Pod, wall: Timestamp) {
        let Some(uid) = pod.uid() else { return };
        if self.seen.contains(&uid) {
            return;
        }
        let created = pod.metadata.creation_timestamp.as_ref().map_or(wall, |t| t.0);
        let age = wall.as_millisecond() - created.as_millisecond();
        let Some(took) = time_to_ready(pod) else {
            // Unready and young: starting, so its Ready will end a start-up. (An old unready pod
            // may be one whose probe failed after it had served.)
            if age < RECENT.as_millis() as i64 {
                self.unready.insert(uid);
            }
            return;
        };
        let since_ready = age - took.as_millis() as i64;
        let measured = self.unready.remove(&uid) || since_ready < RECENT.as_millis() as i64;
        // Either way it is judged once: a pod first seen long ready is never measured later.
        self.seen.insert(uid);
        if measured {
            self.recent.push_back(took);
            if self.recent.len() > Self::KEEP {
                self.recent.pop_front();
            }
        }
    }

    /// Forgets pods that are gone (their measurement stays among the recent ones).
    pub fn retain(&mut self, alive: &HashSet<String>) {
        self.seen.retain(|uid| alive.contains(uid));
        self.unready.retain(|uid| alive.contains(uid));
    }

    /// The median of the latest measurements; `None` before the first.
    pub fn measured(&self) -> Option<Duration> {
        let mut sorted: Vec<Duration> = self.recent.iter().copied().collect();
        sorted.sort();
        sorted.get(sorted.len() / 2).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(uid: &str, created: &str, ready: Option<&str>, restarts: i32) -> Pod {
        let conditions = match ready {
            Some(at) => json!([{"type": "Ready", "status": "True", "lastTransitionTime": at}]),
            None => json!([{"type": "Ready", "status": "False", "lastTransitionTime": created}]),
        };
        serde_json::from_value(json!({
            "metadata": {"name": uid, "uid": uid, "creationTimestamp": created},
            "status": {"conditions": conditions, "containerStatuses": [{
                "name": "sidecar", "image": "i", "imageID": "", "ready": ready.is_some(),
                "restartCount": restarts}]},
        }))
        .unwrap()
    }

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn a_pod_is_measured_from_creation_to_ready_once() {
        let mut times = StartupTimes::default();
        assert_eq!(times.measured(), None);
        times.observe(&pod("a", "2026-12-02T08:00:00Z", None, 0), at("2026-12-02T08:00:10Z"));
        assert_eq!(times.measured(), None, "not ready yet");
        times.observe(&pod("a", "2026-12-02T08:00:00Z", Some("2026-12-02T08:01:30Z"), 0), at("2026-12-02T08:01:31Z"));
        assert_eq!(times.measured(), Some(Duration::from_secs(90)));
        // Seen again later (say its Ready flapped): still one measurement.
        times.observe(&pod("a", "2026-12-02T08:00:00Z", Some("2026-12-02T08:09:00Z"), 0), at("2026-12-02T08:09:01Z"));
        assert_eq!(times.measured(), Some(Duration::from_secs(90)));
        // A restarted pod's Ready is a recovery, not a start-up.
        times.observe(&pod("b", "2026-12-02T08:00:00Z", Some("2026-12-02T08:30:00Z"), 1), at("2026-12-02T08:30:01Z"));
        assert_eq!(times.measured(), Some(Duration::from_secs(90)));
        // A pod first seen ready long after its Ready (an operator that just took over): its Ready
        // may be a recovery's, after a probe failed; not measured.
        times.observe(&pod("c", "2026-12-02T08:00:00Z", Some("2026-12-02T09:00:00Z"), 0), at("2026-12-02T11:00:00Z"));
        assert_eq!(times.measured(), Some(Duration::from_secs(90)));
    }

    #[test]
    fn the_figure_is_the_median_of_the_latest_five() {
        let mut times = StartupTimes::default();
        for (i, secs) in [30u64, 40, 50, 45, 200, 35, 38].into_iter().enumerate() {
            let ready = format!("2026-12-02T08:{:02}:{:02}Z", secs / 60, secs % 60);
            times.observe(&pod(&format!("p{i}"), "2026-12-02T08:00:00Z", Some(&ready), 0), at("2026-12-02T08:05:00Z"));
        }
        // The latest five: 50, 45, 200, 35, 38; one slow pull does not move the median far.
        assert_eq!(times.measured(), Some(Duration::from_secs(45)));
        times.retain(&HashSet::from(["p6".to_owned()]));
        assert_eq!(times.seen.len(), 1);
    }
}
