//! The real batcher (the async shell, the sim engine, tokio's paused clock) and the replay in
//! virtual time agree exactly: one random trace, priorities on, through both, gives the same fate
//! for every request — answered at the same instants in batches of the same size, refused at the
//! same instant for the same reason, expired at the same instant.

use std::sync::Arc;
use std::time::Duration;

use ferry_core::clock::sleep_until;
use ferry_core::estimate::Estimator;
use ferry_core::ledger::{Ledger, RetryPolicy};
use ferry_core::outcome::Outcome;
use ferry_core::replay::{replay_ledger, Arrival, Fate};
use ferry_core::scheduler::{Policy, Scheduler};
use ferry_core::ticket::{Priority, Tokens};
use ferry_sidecar::batcher::{Batcher, Submission};
use ferry_sidecar::engine::sim::SimEngine;
use ferry_sidecar::metrics::Metrics;
use ferry_sidecar::tally::Tally;
use ferry_sidecar::tensor::{DataType, Tensor, TensorData};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    policy: Policy,
    workers: usize,
    batch: Duration,
    per_row: Duration,
    arrivals: Vec<Arrival>,
}

fn case() -> impl Strategy<Value = Case> {
    (1u32..=8, 0u64..=30, 0u64..=3, 1usize..=3, 1u64..=100, 0u64..=3, 1usize..=32).prop_flat_map(
        |(cap, max_wait, margin, workers, batch, per_row, max_queue)| {
            // Arrivals at distinct instants: callers of one instant reach the batcher in an order
            // the runtime chooses, and replay takes them in trace order.
            let arrival = (1u64..=20, 1..=cap, 10u64..=400, any::<bool>());
            prop::collection::vec(arrival, 1..80).prop_map(move |raw| {
                let mut at = 0;
                let arrivals = raw
                    .into_iter()
                    .map(|(gap, rows, timeout, batch_tier)| {
                        at += gap;
                        let priority = if batch_tier { Priority::Batch } else { Priority::Interactive };
                        Arrival::new(at, timeout).rows(rows).priority(priority)
                    })
                    .collect();
                Case {
                    policy: Policy {
                        max_batch_rows: cap,
                        max_wait: Duration::from_millis(max_wait),
                        deadline_margin: Duration::from_millis(margin),
                        max_queue,
                        max_queue_bytes: u64::MAX,
                    },
                    workers,
                    batch: Duration::from_millis(batch),
                    per_row: Duration::from_millis(per_row),
                    arrivals,
                }
            })
        },
    )
}

fn scheduler(c: &Case) -> Scheduler {
    Scheduler::new(c.policy.clone(), c.workers, Estimator::new(c.batch, c.per_row))
}

/// The trace through the real batcher, on a paused clock, as each caller saw it.
fn through_the_batcher(c: &Case) -> Vec<Fate> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
    runtime.block_on(async {
        let engine = Arc::new(SimEngine::new(c.batch, c.per_row));
        let metrics = Metrics::new().model("m", "1");
        let batcher = Batcher::spawn(scheduler(c), engine, metrics.clone(), RetryPolicy::default());
        let start = ferry_core::clock::now();
        let calls: Vec<_> = c
            .arrivals
            .iter()
            .map(|a| {
                let (a, batcher) = (*a, batcher.clone());
                let tally = Tally::new(metrics.outcomes().clone());
                tokio::spawn(async move {
                    sleep_until(start + a.at).await;
                    let now = ferry_core::clock::now();
                    let submission = Submission {
                        inputs: vec![Tensor {
                            name: "INPUT0".into(),
                            datatype: DataType::Fp64,
                            shape: vec![u64::from(a.rows)],
                            data: TensorData::Float(vec![1.0; a.rows as usize]),
                        }],
                        rows: a.rows,
                        tokens: Tokens::default(),
                        bytes: a.bytes,
                        priority: a.priority,
                        tenant: a.tenant,
                        weight: a.weight,
                        arrival: now,
                        deadline: now + a.timeout,
                        tally,
                    };
                    let reply = batcher.submit(submission).reply().await;
                    let at = ferry_core::clock::now() - start;
                    match reply {
                        Ok(answer) => Fate::Done {
                            dispatched: a.at + answer.queued,
                            finished: a.at + answer.queued + answer.engine,
                            batch_rows: answer.batch_rows,
                        },
                        // Shed after admission (its place went to interactive work or to a tenant
                        // within its share): the same outcome as a full queue, said at once.
                        Err(r) if r.outcome == Outcome::QueueFull && r.message.starts_with("shed:") => {
                            Fate::Shed { at }
                        }
                        Err(r) if matches!(r.outcome, Outcome::QueueFull | Outcome::Infeasible) => {
                            Fate::Refused { at, outcome: r.outcome }
                        }
                        Err(r) if r.outcome == Outcome::Expired => Fate::Expired { at },
                        Err(r) => panic!("unexpected refusal {r:?}"),
                    }
                })
            })
            .collect();
        let mut fates = Vec::new();
        for call in calls {
            fates.push(call.await.unwrap());
        }
        fates
    })
}

/// 300 cases a run; `PROPTEST_CASES` asks for more (or fewer).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn the_batcher_does_what_replay_says(c in case()) {
        let (batch, per_row) = (c.batch, c.per_row);
        let ledger = Ledger::new(scheduler(&c), RetryPolicy::default());
        let replayed = replay_ledger(ledger, move |rows| batch + per_row * rows, &c.arrivals);
        let real = through_the_batcher(&c);
        for (i, fate) in real.iter().enumerate() {
            prop_assert_eq!(Some(fate), replayed.fates[i].as_ref(), "request {} of {:?}", i, c.arrivals[i]);
        }
    }
}
