//! Generation admission at scale: one request admitted (or refused) into 1000 running and 1000
//! waiting sequences that may produce 256 to 4096 tokens each — the forecast that runs the step
//! rule forward to see every promise, on the task that also composes the engine's steps.
//!
//! Cases: deadlines an hour away (the newcomer is admitted); the newcomer's first-token deadline
//! in 200 ms while every seat is taken (refused); the running sequences' deadlines just met, so
//! that the newcomer's forecast breaks some of them and the forecast without it is asked too.
//!
//! `cargo bench -p ferry-core --bench generation`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use ferry_core::generation::forecast;
use ferry_core::generation::kv::BlockPool;
use ferry_core::generation::prefix::Prefix;
use ferry_core::generation::scheduler::{Discipline, Late, Policy, Scheduler};
use ferry_core::generation::sequence::Request;
use ferry_core::generation::step::{StepCost, StepEstimator};
use ferry_core::ticket::Priority;
use std::time::Instant;

const RUNNING: u64 = 1000;
const WAITING: u64 = 1000;
const PROMPT: u32 = 128;
const BLOCK: u32 = 16;
const HOUR: Duration = Duration::from_secs(3600);

fn cost() -> StepCost {
    StepCost {
        fixed: Duration::from_millis(5),
        per_decode: Duration::from_micros(20),
        per_prefill_token: Duration::from_micros(50),
        per_context_token: Duration::from_nanos(5),
        per_attended_slot: Duration::ZERO,
    }
}

/// Output tokens of sequence `id`: spread over 256–4096.
fn max_tokens(id: u64) -> u32 {
    256 + ((id * 7919) % 3841) as u32
}

fn request(id: u64, at: Instant, ttft: Duration, deadline: Duration) -> Request {
    Request {
        id,
        arrival: at,
        priority: Priority::Interactive,
        tenant: 0,
        weight: 1,
        prompt: PROMPT,
        max_tokens: max_tokens(id),
        bytes: 512,
        ttft_deadline: at + ttft,
        itl: Duration::from_millis(100),
        deadline: at + deadline,
    }
}

/// 1000 sequences decoding (their prompts prefilled, a few tokens out), 1000 waiting for a seat;
/// the running ones' deadlines are `deadline` after `t0`. Returns the scheduler and the instant
/// the forecast starts from (the same for the same `t0`: the steps are the estimator's).
fn loaded(t0: Instant, deadline: impl Fn(u64) -> Duration) -> (Scheduler, Instant) {
    let policy = Policy {
        max_batch_tokens: 2048,
        max_sequences: RUNNING as u32,
        max_queue: 4 * WAITING as usize,
        max_queue_bytes: u64::MAX,
        max_queue_tokens: u64::MAX,
        max_context: 8192,
        watermark: 0,
        discipline: Discipline::Deadlines,
    };
    let blocks = (RUNNING + WAITING) as u32 * (PROMPT + 4096).div_ceil(BLOCK);
    let mut s = Scheduler::new(policy, BlockPool::new(blocks, BLOCK), StepEstimator::new(cost()));
    for id in 0..RUNNING {
        s.insert(request(id, t0, HOUR, deadline(id)), Prefix::default());
    }
    let mut now = t0;
    // Prefill them all (chunks cut to the decodes' 100 ms), then a few tokens each.
    let mut decoding_steps = 0;
    while decoding_steps < 4 {
        let (plan, _) = s.plan(now);
        let plan = plan.expect("work to do");
        decoding_steps += u32::from(plan.shape.prefill == 0);
        now += plan.expected;
        s.complete(&plan, now, &|_| false, Late::Ends);
    }
    assert_eq!(s.running(), RUNNING as usize, "every seat taken");
    for id in RUNNING..RUNNING + WAITING {
        s.insert(request(id, now, HOUR, HOUR), Prefix::default());
    }
    assert_eq!(s.waiting(), WAITING as usize);
    (s, now)
}

fn admission(c: &mut Criterion) {
    let mut group = c.benchmark_group("generation admission, 1000 running + 1000 waiting");
    group.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(10));
    let newcomer = RUNNING + WAITING;

    let t0 = Instant::now();
    let margin = Duration::from_millis(2);
    let (generous, now) = loaded(t0, |_| HOUR);
    let r = request(newcomer, now, HOUR, HOUR);
    assert!(forecast::admit(&generous, None, &r, &Prefix::default(), now, margin).is_ok(), "admitted");
    group.bench_function("generous deadlines: admitted", |b| {
        b.iter(|| black_box(forecast::admit(&generous, None, &r, &Prefix::default(), now, margin)))
    });

    let r = request(newcomer, now, Duration::from_millis(200), HOUR);
    assert!(forecast::admit(&generous, None, &r, &Prefix::default(), now, margin).is_err(), "refused");
    group.bench_function("tight first-token deadline: refused", |b| {
        b.iter(|| black_box(forecast::admit(&generous, None, &r, &Prefix::default(), now, margin)))
    });

    // Each running sequence's deadline 20 ms after its forecast end without the newcomer: the
    // newcomer, whose prompt joins the steps, makes some of them late, and the forecast without
    // it is asked whether they were late anyway.
    let fates = forecast::simulate(&generous, None, now, Duration::ZERO);
    let (tight, at) =
        loaded(t0, |id| fates.get(id).and_then(|f| f.end).expect("finishes") - t0 + Duration::from_millis(20));
    assert_eq!(at, now);
    let r = request(newcomer, now, HOUR, HOUR);
    assert!(forecast::admit(&tight, None, &r, &Prefix::default(), now, margin).is_err(), "it would make some late");
    group.bench_function("running deadlines just met: refused", |b| {
        b.iter(|| black_box(forecast::admit(&tight, None, &r, &Prefix::default(), now, margin)))
    });
    group.finish();
}

criterion_group!(benches, admission);
criterion_main!(benches);
