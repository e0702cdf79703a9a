//! The same trace through each discipline of ferry-core's generation scheduler, on the `sim-llm`
//! engine, in virtual time: Ferry's step rule; the same continuous batching with deadlines
//! ignored and first-come-first-served admission (what vLLM does); and static batching (a batch
//! runs until its longest sequence ends). The replay is the very ledger the sidecar runs, with
//! steps that take exactly the sim engine's time, so the comparison is of the rules alone.

use std::time::Duration;

use ferry_core::generation::capacity::{capacity, Capacity, Limits, RequestShape, Targets};
use ferry_core::generation::kv::BlockPool;
use ferry_core::generation::replay::{replay, Arrival, Ending, Setup};
use ferry_core::generation::scheduler::{Discipline, Policy};
use ferry_core::generation::step::StepCost;
use ferry_core::ticket::Priority;

use super::summary::Sample;
use super::trace::{Request, Shape};

/// The engine and the service's knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Service {
    pub cost: StepCost,
    pub blocks: u32,
    pub block_size: u32,
    pub max_batch_tokens: u32,
    pub max_sequences: u32,
    pub max_queue: usize,
}

impl Service {
    fn setup(&self, discipline: Discipline) -> Setup {
        Setup {
            policy: Policy {
                max_batch_tokens: self.max_batch_tokens,
                max_sequences: self.max_sequences,
                max_queue: self.max_queue,
                max_queue_bytes: u64::MAX,
                max_queue_tokens: u64::MAX,
                max_context: 1 << 20,
                watermark: (self.blocks / 100).max(1),
                discipline,
            },
            blocks: self.blocks,
            block_size: self.block_size,
            cost: self.cost,
            prior: self.cost,
            margin: Duration::ZERO,
        }
    }

    /// What one replica serves of `shape`'s requests with 99 % of them keeping all three
    /// deadlines: ferry-core's capacity function, the figure the sidecar exports and the operator
    /// scales by, at the trace's mean prompt and output (and the completion deadline of the mean
    /// output).
    pub fn capacity(&self, shape: &Shape) -> Capacity {
        let request = RequestShape { prompt: shape.mean_prompt(), output: shape.mean_output() };
        let targets = Targets {
            ttft: shape.ttft,
            itl: shape.tpot,
            timeout: shape.ttft + shape.tpot.mul_f64(shape.mean_output()),
            margin: Duration::ZERO,
        };
        let setup = self.setup(Discipline::Deadlines);
        let limits = Limits::of(&setup.policy, &BlockPool::new(setup.blocks, setup.block_size));
        capacity(&self.cost, &request, &targets, &limits)
    }
}

/// Replays `trace` under `discipline`; one sample per request, as a client would have seen it.
pub fn run(service: &Service, discipline: Discipline, trace: &[Request]) -> Vec<Sample> {
    let arrivals: Vec<Arrival> = trace
        .iter()
        .map(|r| Arrival {
            at: r.at,
            prompt: r.prompt,
            max_tokens: r.max_tokens,
            ttft: r.ttft,
            itl: r.itl,
            timeout: r.timeout,
            priority: Priority::Interactive,
            tenant: ferry_core::tenant::DEFAULT_TENANT,
            weight: 1,
            cancel_after: None,
            shared: None,
            fork_of: None,
        })
        .collect();
    let replayed = replay(service.setup(discipline), &arrivals);
    trace
        .iter()
        .zip(replayed.fates)
        .map(|(r, fate)| {
            let since = |t: Duration| t.saturating_sub(r.at);
            let (end, completed) = match &fate.end {
                Some((at, Ending::Finished(_))) => (Some(since(*at)), true),
                Some((at, _)) => (Some(since(*at)), false),
                None => (None, false),
            };
            Sample {
                request: *r,
                status: Some(if fate.admitted { 200 } else { 503 }),
                first: fate.tokens.first().map(|t| since(*t)),
                gaps: fate.tokens.windows(2).map(|w| w[1] - w[0]).collect(),
                end,
                tokens: fate.tokens.len() as u32,
                prompt_tokens: r.prompt,
                completed,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::summary::Summary;
    use crate::generation::trace::trace;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn under_overload_ferry_keeps_its_promises_and_the_others_miss_theirs() {
        let service = Service {
            cost: StepCost {
                fixed: 10 * MS,
                per_decode: MS / 5,
                per_prefill_token: MS / 20,
                per_context_token: Duration::ZERO,
                per_attended_slot: Duration::ZERO,
            },
            blocks: 2048,
            block_size: 16,
            max_batch_tokens: 2048,
            max_sequences: 16,
            max_queue: 256,
        };
        let mut shape = Shape {
            rate: 0.0,
            duration: Duration::from_secs(10),
            prompt: (16, 256),
            output: (8, 64),
            ttft: Duration::from_millis(500),
            tpot: Duration::from_millis(60),
            seed: 5,
        };
        shape.rate = 2.0 * service.capacity(&shape).requests_per_second;
        let t = trace(&shape);
        let ferry = Summary::of(&run(&service, Discipline::Deadlines, &t), shape.duration);
        let fcfs = Summary::of(&run(&service, Discipline::Fcfs, &t), shape.duration);
        let fixed = Summary::of(&run(&service, Discipline::Static, &t), shape.duration);
        // Ferry refuses what it cannot serve, and what it admits meets its deadlines.
        assert!(ferry.refused > 0);
        assert_eq!(ferry.cut, 0, "exact estimates: nothing admitted misses");
        assert_eq!(ferry.completed as f64, ferry.good_share * ferry.sent as f64);
        assert!(ferry.goodput_rps > 1.5 * fcfs.goodput_rps, "ferry {ferry:?}\nfcfs {fcfs:?}");
        assert!(ferry.goodput_rps > 1.5 * fixed.goodput_rps, "ferry {ferry:?}\nstatic {fixed:?}");
        let answered_late = fcfs.completed as f64 - fcfs.good_share * fcfs.sent as f64;
        assert!(answered_late > 0.0, "without deadlines, answers come after them: {fcfs:?}");
    }
}
