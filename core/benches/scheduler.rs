//! The scheduler's hot path with a long queue: admitting a request into 10 000 queued ones (by
//! admission's shortcut when deadlines leave room, else by the forecast, which walks the queue),
//! and dispatching a batch from them.
//!
//! `cargo bench -p ferry-core --bench scheduler`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use ferry_core::estimate::Estimator;
use ferry_core::scheduler::{Policy, Scheduler};
use ferry_core::ticket::{Priority, Ticket, Tokens};
use std::time::Instant;

const QUEUED: u64 = 10_000;

fn ticket(id: u64, t0: Instant) -> Ticket {
    ticket_within(id, t0, Duration::from_secs(3600))
}

/// A ticket whose deadline is `horizon` away (spread over a second, so that inserts land
/// mid-queue).
fn ticket_within(id: u64, t0: Instant, horizon: Duration) -> Ticket {
    Ticket {
        id,
        arrival: t0,
        deadline: t0 + horizon + Duration::from_micros((id * 7919) % 1_000_000),
        rows: 1 + (id % 4) as u32,
        bytes: 256,
        priority: if id.is_multiple_of(10) { Priority::Batch } else { Priority::Interactive },
        tenant: 0,
        weight: 1,
        tokens: Tokens::default(),
    }
}

/// 10 000 queued requests; all but one of 4 workers busy.
fn loaded(t0: Instant) -> Scheduler {
    loaded_within(t0, Duration::from_secs(3600))
}

fn loaded_within(t0: Instant, horizon: Duration) -> Scheduler {
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
        s.admit(ticket_within(id, t0, horizon), t0).unwrap();
    }
    s
}

fn hot_path(c: &mut Criterion) {
    let t0 = Instant::now();
    let base = loaded(t0);
    let now = t0 + Duration::from_millis(11);
    c.bench_function("admit into 10k queued", |b| {
        // The scheduler is handed back, so that dropping it is not timed.
        b.iter_batched(
            || base.clone(),
            |mut s| {
                black_box(s.admit(ticket(QUEUED + 10, t0), now)).unwrap();
                s
            },
            BatchSize::LargeInput,
        )
    });
    // Deadlines 60 s away: every request fits (the queue drains in about 25 s), but not with the
    // room admission's shortcut needs, so the whole forecast runs.
    let tight = loaded_within(t0, Duration::from_secs(60));
    c.bench_function("admit into 10k queued, whole forecast", |b| {
        b.iter_batched(
            || tight.clone(),
            |mut s| {
                black_box(s.admit(ticket_within(QUEUED + 10, t0, Duration::from_secs(60)), now)).unwrap();
                s
            },
            BatchSize::LargeInput,
        )
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
