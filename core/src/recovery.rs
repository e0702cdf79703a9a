//! What to do with the requests of a batch that failed: retry the unfinished ones that still have
//! time and attempts left, and find the poison row — the one that makes every batch it rides in
//! fail — by bisection, so that the healthy rows that shared its batch still succeed.
//!
//! A plain function of what is known, like the scheduler. After a multi-request batch fails, its
//! first half runs alone as a *probe* while the second half is held back. If the probe fails, the
//! poison is in it: the held half goes back to the queue and the probe is split again. If the
//! probe succeeds, the poison must be in the held half, which is split in turn without being run
//! whole. A request is condemned (500) when it fails alone a second time, or when it has failed
//! twice and everyone else in its last failing group has since succeeded, or when it has used up
//! its attempts. With one poison row among `n`, the engine runs at most ⌈log2 n⌉ + 1 extra
//! batches; a random failure (not poison) only costs retries, because one failure never condemns.

use crate::ticket::RequestId;

/// A request of a failed batch or of a held group, with its history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    pub id: RequestId,
    /// Runs it has ridden in, the failed one included.
    pub attempts: u32,
    /// Runs of it that failed, the failed one included.
    pub failures: u32,
}

/// A group to run alone, with the group held back until it ends.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Probe {
    pub run: Vec<RequestId>,
    pub hold: Vec<RequestId>,
}

/// The decision.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Recovery {
    /// Back to the queue: they batch with anyone again.
    pub requeue: Vec<RequestId>,
    /// Fail with 500: isolated as poison, or out of attempts.
    pub condemn: Vec<RequestId>,
    pub probe: Option<Probe>,
}

/// A run of `failed` members failed (members already answered are left out by the caller).
/// `held` is the group that was held back behind it, if it was a probe.
pub fn on_failure(failed: &[Member], held: &[Member], max_attempts: u32) -> Recovery {
    let mut r = Recovery { requeue: held.iter().map(|m| m.id).collect(), ..Recovery::default() };
    let (spent, live): (Vec<&Member>, Vec<&Member>) = failed.iter().partition(|m| m.attempts >= max_attempts);
    r.condemn.extend(spent.iter().map(|m| m.id));
    match live.as_slice() {
        [] => {}
        [alone] if failed.len() == 1 => {
            if alone.failures >= 2 {
                r.condemn.push(alone.id);
            } else {
                r.requeue.push(alone.id);
            }
        }
        [alone] => r.requeue.push(alone.id),
        group => r.probe = Some(split(group.iter().map(|m| m.id).collect())),
    }
    r
}

/// A probe succeeded, so the failure it was looking for is in `held`.
pub fn on_probe_success(held: &[Member], max_attempts: u32) -> Recovery {
    let mut r = Recovery::default();
    match held {
        [] => {}
        [suspect] if suspect.failures >= 2 || suspect.attempts >= max_attempts => r.condemn.push(suspect.id),
        [suspect] => r.probe = Some(Probe { run: vec![suspect.id], hold: Vec::new() }),
        group => {
            let (spent, live): (Vec<&Member>, Vec<&Member>) = group.iter().partition(|m| m.attempts >= max_attempts);
            r.condemn.extend(spent.iter().map(|m| m.id));
            match live.as_slice() {
                [] => {}
                [one] => r.probe = Some(Probe { run: vec![one.id], hold: Vec::new() }),
                _ => r.probe = Some(split(live.iter().map(|m| m.id).collect())),
            }
        }
    }
    r
}

fn split(mut ids: Vec<RequestId>) -> Probe {
    let hold = ids.split_off(ids.len() / 2);
    Probe { run: ids, hold }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// Drives the recovery of one failed batch of `n` requests against an engine that fails any
    /// run containing `poison` (requeued requests run together as one batch), and returns the
    /// extra runs and who was condemned.
    fn isolate(n: u64, poison: RequestId, max_attempts: u32) -> (usize, Vec<RequestId>) {
        let mut history: HashMap<RequestId, (u32, u32)> = (0..n).map(|id| (id, (1, 1))).collect();
        let member =
            |h: &HashMap<RequestId, (u32, u32)>, id: RequestId| Member { id, attempts: h[&id].0, failures: h[&id].1 };
        let all: Vec<Member> = (0..n).map(|id| member(&history, id)).collect();
        let mut pending = vec![on_failure(&all, &[], max_attempts)];
        let (mut runs, mut condemned, mut queue) = (0, Vec::new(), Vec::new());
        while let Some(r) = pending.pop() {
            condemned.extend(r.condemn);
            queue.extend(r.requeue);
            let probe = match r.probe {
                Some(p) => Some((p.run, p.hold)),
                None if !queue.is_empty() => Some((std::mem::take(&mut queue), Vec::new())),
                None => None,
            };
            let Some((run, hold)) = probe else { continue };
            runs += 1;
            let fails = run.contains(&poison);
            for id in &run {
                let h = history.get_mut(id).unwrap();
                h.0 += 1;
                h.1 += u32::from(fails);
            }
            let held: Vec<Member> = hold.iter().map(|&id| member(&history, id)).collect();
            pending.push(if fails {
                let failed: Vec<Member> = run.iter().map(|&id| member(&history, id)).collect();
                on_failure(&failed, &held, max_attempts)
            } else {
                on_probe_success(&held, max_attempts)
            });
        }
        condemned.sort_unstable();
        (runs, condemned)
    }

    #[test]
    fn a_poison_row_among_four_is_isolated_in_at_most_three_extra_batches() {
        for poison in 0..4 {
            let (runs, condemned) = isolate(4, poison, 3);
            assert_eq!(condemned, vec![poison], "poison at {poison}");
            assert!(runs <= 3, "poison at {poison}: {runs} extra batches");
        }
    }

    #[test]
    fn a_poison_row_among_many_is_isolated_with_enough_attempts() {
        for n in [2, 3, 5, 8, 16] {
            for poison in 0..n {
                let bound = (n as f64).log2().ceil() as usize + 1;
                let (runs, condemned) = isolate(n, poison, bound as u32 + 1);
                assert_eq!(condemned, vec![poison], "n {n}, poison at {poison}");
                assert!(runs <= bound + 1, "n {n}, poison at {poison}: {runs} extra batches");
            }
        }
    }

    #[test]
    fn one_failure_alone_is_retried_not_condemned() {
        let r = on_failure(&[Member { id: 7, attempts: 1, failures: 1 }], &[], 3);
        assert_eq!(r, Recovery { requeue: vec![7], ..Recovery::default() });
        let r = on_failure(&[Member { id: 7, attempts: 2, failures: 2 }], &[], 3);
        assert_eq!(r.condemn, vec![7]);
    }

    #[test]
    fn the_attempt_budget_is_never_exceeded() {
        let failed = [Member { id: 1, attempts: 3, failures: 1 }, Member { id: 2, attempts: 2, failures: 1 }];
        let r = on_failure(&failed, &[Member { id: 9, attempts: 1, failures: 1 }], 3);
        assert_eq!(r.condemn, vec![1]);
        assert_eq!(r.requeue, vec![9, 2]);
        assert_eq!(r.probe, None);
    }

    #[test]
    fn a_held_suspect_that_failed_twice_is_condemned_without_running() {
        let r = on_probe_success(&[Member { id: 4, attempts: 2, failures: 2 }], 3);
        assert_eq!(r.condemn, vec![4]);
        let r = on_probe_success(&[Member { id: 4, attempts: 1, failures: 1 }], 3);
        assert_eq!(r.probe, Some(Probe { run: vec![4], hold: vec![] }));
    }
}
