//! Pods of one generation service over hours of virtual time, for the operator's simulation: each
//! runs the generation ledger with an engine whose steps take exactly the step cost, takes the
//! requests the caller routes to it, and judges each request against its three promises as it
//! ends. Unlike [`super::replay`], nothing is kept per token or per step (a simulation runs
//! millions of both), and a pod is driven instant by instant rather than over a trace known in
//! advance: the caller adds and retires pods as its scaling policy decides.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::capacity::{Limits, Targets};
use super::ledger::{Effect, Event, Ledger, StepOutcome};
use super::prefix::Prefix;
use super::replay::Setup;
use super::scheduler::Scheduler;
use super::sequence::{End, Request, SeqId};
use super::step::StepCost;
use crate::outcome::Outcome;
use crate::tenant::DEFAULT_TENANT;
use crate::ticket::Priority;

/// KV-cache usage from which a preemption counts as capacity pressure (as the operator's
/// collector counts it).
pub const FULL_KV: f64 = 0.9;

/// How one request ended, judged by the pod that served it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub arrival: Instant,
    pub admitted: bool,
    /// Every token it asked for, the first by its TTFT deadline, each next within its
    /// inter-token target of the one before, the last by its completion deadline.
    pub kept: bool,
    /// Refused as infeasible or ended past a deadline: what the sidecar counts as deadline
    /// pressure (`ferry_requests_total{outcome=~"infeasible|expired"}`).
    pub pressure: bool,
}

/// A request's promises, as a stream of tokens is judged against them.
#[derive(Debug)]
struct Stream {
    arrival: Instant,
    ttft_deadline: Instant,
    itl: Duration,
    deadline: Instant,
    max_tokens: u32,
    tokens: u32,
    last: Option<Instant>,
    in_time: bool,
}

/// One pod: its ledger, the step on its engine, the streams it sends.
#[derive(Debug)]
pub struct Pod {
    ledger: Ledger,
    cost: StepCost,
    targets: Targets,
    /// The step on the engine and when it ends.
    engine: Option<(u64, Instant)>,
    streams: HashMap<SeqId, Stream>,
    next_id: SeqId,
    effects: Vec<Effect>,
    /// Requests ended since the caller last took them.
    pub ended: Vec<Verdict>,
    /// Sequences preempted while the KV cache was at least [`FULL_KV`] full, since last taken.
    pub full_preemptions: u32,
}

impl Pod {
    /// A pod of `limits` whose steps cost `cost`, known to its estimator from the start (a pod
    /// starts with the prior it measured at load), serving requests with `targets`' deadlines.
    pub fn new(cost: StepCost, targets: Targets, limits: &Limits) -> Pod {
        let setup: Setup = super::trial::pod(cost, &targets, limits);
        let scheduler = Scheduler::new(
            setup.policy,
            super::kv::BlockPool::new(setup.blocks, setup.block_size),
            super::step::StepEstimator::new(setup.prior),
        );
        Pod {
            ledger: Ledger::new(scheduler, setup.margin, 3),
            cost,
            targets,
            engine: None,
            streams: HashMap::new(),
            next_id: 0,
            effects: Vec::new(),
            ended: Vec::new(),
            full_preemptions: 0,
        }
    }

    pub fn scheduler(&self) -> &Scheduler {
        self.ledger.scheduler()
    }

    /// Nothing waiting, running or on the engine: a retired pod may go.
    pub fn is_idle(&self) -> bool {
        self.engine.is_none() && self.ledger.is_idle()
    }

    /// Share of the KV cache in use.
    pub fn kv_usage(&self) -> f64 {
        let pool = self.scheduler().pool();
        f64::from(pool.used()) / f64::from(pool.total().max(1))
    }

    /// Its next instant: a step ends, or the ledger wakes.
    pub fn next_instant(&self) -> Option<Instant> {
        [self.engine.map(|(_, end)| end), self.ledger.next_wake()].into_iter().flatten().min()
    }

    /// Runs every instant before `until`.
    pub fn run_until(&mut self, until: Instant) {
        while let Some(now) = self.next_instant().filter(|at| *at < until) {
            self.instant(now, None);
        }
    }

    /// A request of `prompt` tokens asking for `max_tokens` arrives at `now` (after
    /// [`Pod::run_until`] `now`): the pod's own events of that instant are taken with it.
    pub fn submit(&mut self, now: Instant, prompt: u32, max_tokens: u32) {
        let id = self.next_id;
        self.next_id += 1;
        let t = &self.targets;
        let request = Request {
            id,
            arrival: now,
            priority: Priority::Interactive,
            tenant: DEFAULT_TENANT,
            weight: 1,
            prompt,
            max_tokens,
            bytes: 64,
            ttft_deadline: now + t.ttft,
            itl: t.itl,
            deadline: now + t.timeout,
        };
        self.streams.insert(
            id,
            Stream {
                arrival: now,
                ttft_deadline: request.ttft_deadline,
                itl: request.itl,
                deadline: request.deadline,
                max_tokens,
                tokens: 0,
                last: None,
                in_time: true,
            },
        );
        self.instant(now, Some(request));
    }

    fn instant(&mut self, now: Instant, request: Option<Request>) {
        let mut events = Vec::with_capacity(2);
        if let Some((step, _)) = self.engine.take_if(|(_, end)| *end == now) {
            events.push(Event::StepDone { step, outcome: StepOutcome::Ran { stopped: Vec::new() } });
        }
        events.extend(request.map(|r| Event::Submit(r, Prefix::default())));
        let mut effects = std::mem::take(&mut self.effects);
        self.ledger.step(now, events, &mut effects);
        for effect in effects.drain(..) {
            self.carry_out(effect, now);
        }
        self.effects = effects;
    }

    fn carry_out(&mut self, effect: Effect, now: Instant) {
        match effect {
            Effect::Step { step, plan } => self.engine = Some((step, now + self.cost.time(plan.shape))),
            Effect::Token { id, .. } => {
                let s = self.streams.get_mut(&id).expect("a live stream");
                s.in_time &= match s.last {
                    None => now <= s.ttft_deadline,
                    Some(last) => now - last <= s.itl,
                };
                s.tokens += 1;
                s.last = Some(now);
            }
            Effect::End { id, end, admitted } => {
                let s = self.streams.remove(&id).expect("a live stream");
                let (kept, pressure) = match end {
                    End::Finished(_) => {
                        (s.in_time && s.tokens == s.max_tokens && s.last.is_some_and(|l| l <= s.deadline), false)
                    }
                    End::Unfinished(r) => (false, matches!(r.outcome, Outcome::Infeasible | Outcome::Expired)),
                };
                self.ended.push(Verdict { arrival: s.arrival, admitted, kept, pressure });
            }
            Effect::Preempted(_) => {
                if self.kv_usage() >= FULL_KV {
                    self.full_preemptions += 1;
                }
            }
            Effect::Started { .. } | Effect::StepEnded { .. } | Effect::Late(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn limits() -> Limits {
        Limits { blocks: 4096, block_size: 16, watermark: 40, max_sequences: 64, max_batch_tokens: 2048 }
    }

    fn cost() -> StepCost {
        StepCost { fixed: 10 * MS, per_decode: Duration::from_micros(200), ..StepCost::default() }
    }

    #[test]
    fn a_lone_request_streams_every_token_in_time() {
        let targets = Targets { ttft: 1000 * MS, itl: 100 * MS, timeout: 10_000 * MS, margin: 2 * MS };
        let mut pod = Pod::new(cost(), targets, &limits());
        let t0 = Instant::now();
        pod.submit(t0, 100, 8);
        pod.run_until(t0 + Duration::from_secs(60));
        assert!(pod.is_idle());
        assert_eq!(pod.ended, [Verdict { arrival: t0, admitted: true, kept: true, pressure: false }]);
    }

    #[test]
    fn a_request_that_cannot_keep_its_first_token_is_refused_as_pressure() {
        // Eight 1000-token prompts prefill in 2048-token steps of 10 ms + 2048 x 50 us: the
        // ninth's first token cannot come within 300 ms.
        let cost = StepCost { per_prefill_token: Duration::from_micros(50), ..cost() };
        let targets = Targets { ttft: 300 * MS, itl: 1000 * MS, timeout: 10_000 * MS, margin: 2 * MS };
        let mut pod = Pod::new(cost, targets, &limits());
        let t0 = Instant::now();
        for _ in 0..9 {
            pod.submit(t0, 1000, 4);
        }
        pod.run_until(t0 + Duration::from_secs(60));
        let refused: Vec<&Verdict> = pod.ended.iter().filter(|v| !v.admitted).collect();
        assert!(!refused.is_empty() && refused.iter().all(|v| v.pressure && !v.kept), "{:?}", pod.ended);
        assert!(pod.ended.iter().filter(|v| v.admitted).all(|v| v.kept), "{:?}", pod.ended);
        assert_eq!(pod.ended.len(), 9);
    }
}
