//! The scheduler's hot path with a long queue: admitting a request into 10 000 queued ones (its
//! forecast walks the queue), and dispatching a batch from them.
//!
//! `cargo bench -p ferry-core --bench scheduler`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use ferry_core::estimate::Estimator;
use ferry_core::scheduler::{Policy, Scheduler};
use ferry_core::ticket::{Priority, Ticket, Tokens};
use tokio::time::Instant;

const QUEUED: u64 = 10_000;

fn ticket(id: u64, t0: Instant) -> Ticket {
    Ticket {
        id,
        arrival: t0,
        // Deadlines far enough that everyone is feasible, spread so that inserts land mid-queue.
        deadline: t0 + Duration::from_secs(3600) + Duration::from_micros((id * 7919) % 1_000_000),
        rows: 1 + (id % 4) as u32,
        bytes: 256,
        priority: if id.is_multiple_of(10) { Priority::Batch } else { Priority::Interactive },
        tokens: Tokens::default(),
    }
}

/// 10 000 queued requests; all but one of 4 workers busy.
fn loaded(t0: Instant) -> Scheduler {
    let policy = Policy {
        max_batch_rows: 32,
        max_wait: Duration::from_millis(10),
        deadline_margin: Duration::from_millis(2),
        max_queue: 100_000,
        max_queue_bytes: u64::MAX,
    };
    let mut s = Scheduler::new(policy, 4, Estimator::new(Duration::from_millis(100), Duration::ZERO));
    for id in 0..3 {
        s.admit(ticket(id, t0), t0).unwrap();
        s.take(t0 + Duration::from_millis(10)).unwrap();
    }
    for id in 3..QUEUED + 3 {
        s.admit(ticket(id, t0), t0).unwrap();
    }
    s
}

fn hot_path(c: &mut Criterion) {
    let t0 = Instant::now();
    let base = loaded(t0);
    let now = t0 + Duration::from_millis(11);
    c.bench_function("admit into 10k queued", |b| {
        b.iter_batched(|| base.clone(), |mut s| black_box(s.admit(ticket(QUEUED + 10, t0), now)), BatchSize::LargeInput)
    });
    c.bench_function("next with 10k queued", |b| b.iter(|| black_box(base.next(now))));
    c.bench_function("take a batch from 10k queued", |b| {
        b.iter_batched(
            || base.clone(),
            |mut s| {
                black_box(s.take(now)).unwrap();
                s
            },
            BatchSize::LargeInput,
        )
    });
}

criterion_group!(benches, hot_path);
criterion_main!(benches);
