//! Replays a trace of generation requests through the [`Ledger`] in virtual time, with an engine
//! whose step time is a plain function of the step's shape and whose "model" is `sim-llm`'s: it
//! answers with its own prompt, cycled, read back from the KV blocks the scheduler gave it. So a
//! replay checks more than timing: a block handed to two sequences at once, a table that lost a
//! block, a recompute that skipped a token — each shows as a sequence that received the wrong
//! tokens. Tests use it for exact step timestamps and property tests; the benchmark's policies
//! run on it.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use std::time::Instant;

use super::kv::BlockPool;
use super::ledger::{Effect, Event, Ledger, StepOutcome};
use super::prefix::Prefix;
use super::scheduler::{Policy, Scheduler, StepPlan};
use super::sequence::{End, FinishReason, Request, SeqId};
use super::step::{StepCost, StepEstimator, StepShape};
use crate::outcome::Refusal;
use crate::tenant::{TenantId, DEFAULT_TENANT};
use crate::ticket::Priority;

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    /// Since the start of the trace.
    pub at: Duration,
    pub prompt: u32,
    pub max_tokens: u32,
    /// Relative deadlines.
    pub ttft: Duration,
    pub itl: Duration,
    pub timeout: Duration,
    pub priority: Priority,
    pub tenant: TenantId,
    /// Its tenant's weight ([`crate::tenant`]).
    pub weight: u32,
    /// The caller goes away this long after arrival.
    pub cancel_after: Option<Duration>,
    /// Its prompt starts with the first `.1` tokens of shared prompt `.0` (a system prompt, a
    /// conversation so far), which the prefix cache may hold; else every token is its own.
    pub shared: Option<(u32, u32)>,
    /// It is one more sequence of request `.0`'s prompt (OpenAI's `n`), arriving with it and
    /// submitted in one group with it ([`Event::SubmitGroup`]).
    pub fork_of: Option<usize>,
}

impl Arrival {
    /// A request at `at_ms` with deadlines that never bind (an hour).
    pub fn new(at_ms: u64, prompt: u32, max_tokens: u32) -> Self {
        let hour = Duration::from_secs(3600);
        Arrival {
            at: Duration::from_millis(at_ms),
            prompt,
            max_tokens,
            ttft: hour,
            itl: hour,
            timeout: hour,
            priority: Priority::Interactive,
            tenant: DEFAULT_TENANT,
            weight: 1,
            cancel_after: None,
            shared: None,
            fork_of: None,
        }
    }

    pub fn ttft_ms(mut self, ms: u64) -> Self {
        self.ttft = Duration::from_millis(ms);
        self
    }

    pub fn itl_ms(mut self, ms: u64) -> Self {
        self.itl = Duration::from_millis(ms);
        self
    }

    pub fn timeout_ms(mut self, ms: u64) -> Self {
        self.timeout = Duration::from_millis(ms);
        self
    }

    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    pub fn tenant(mut self, tenant: TenantId) -> Self {
        self.tenant = tenant;
        self
    }

    pub fn weight(mut self, weight: u32) -> Self {
        self.weight = weight;
        self
    }

    pub fn cancel_after_ms(mut self, ms: u64) -> Self {
        self.cancel_after = Some(Duration::from_millis(ms));
        self
    }

    /// Its prompt starts with `tokens` tokens of shared prompt `group`; the prefix cache is
    /// asked for them.
    pub fn shared(mut self, group: u32, tokens: u32) -> Self {
        self.shared = Some((group, tokens));
        self
    }

    /// One more sequence of request `leader`'s prompt, in its group (give it the same `at`,
    /// prompt and sharing).
    pub fn fork_of(mut self, leader: usize) -> Self {
        self.fork_of = Some(leader);
        self
    }
}

/// How one request of the trace ended, with times since the start of the trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fate {
    /// When each token reached it.
    pub tokens: Vec<Duration>,
    /// The token ids it received.
    pub ids: Vec<u32>,
    /// The ids it should have received: its prompt, cycled.
    pub expected: Vec<u32>,
    pub end: Option<(Duration, Ending)>,
    /// Whether it was admitted.
    pub admitted: bool,
    pub preempted: u32,
}

/// How a sequence ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    Finished(FinishReason),
    /// Refused at admission, past a deadline, or failed.
    Unfinished(Refusal),
    Cancelled,
}

/// One step the engine ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRecord {
    pub started: Duration,
    pub took: Duration,
    pub plan: StepPlan,
    /// Blocks in use when it started, and the blocks its members held.
    pub used_blocks: u32,
    pub held_blocks: u32,
}

/// What a replay saw.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    pub fates: Vec<Fate>,
    pub steps: Vec<StepRecord>,
    /// At each quiet point (after each instant's effects), (used blocks, blocks held by sequences).
    pub quiet: Vec<(u32, u32)>,
    /// Ends reported for a sequence that had already ended (a bug if ever more than zero).
    pub double_ends: u32,
    /// What the KV pool's audit found wrong at quiet points ([`BlockPool::audit`]; debug
    /// builds, traces whose prompts share blocks: it costs O(blocks)).
    pub pool_errors: Vec<String>,
}

/// The engine and the service being replayed.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub policy: Policy,
    pub blocks: u32,
    pub block_size: u32,
    /// What a step truly takes.
    pub cost: StepCost,
    /// What the estimator starts from (the same as `cost` for exact estimates).
    pub prior: StepCost,
    pub margin: Duration,
}

/// The token ids of request `i`'s prompt: those of its shared prompt, then its own, distinct
/// from every other request's.
fn prompt_ids(i: usize, a: &Arrival) -> Vec<u32> {
    let (group, shared) = a.shared.map_or((0, 0), |(g, n)| (g, n.min(a.prompt)));
    let own = |p: u32| (i as u32) * 100_000 + p;
    (0..a.prompt).map(|p| if p < shared { (1 << 31) + group * 100_000 + p } else { own(p) }).collect()
}

pub fn replay(setup: Setup, arrivals: &[Arrival]) -> Trace {
    replay_in(setup, arrivals, |_, shape| setup.cost.time(shape), &[])
}

/// [`replay`] in a world that changes over the trace: a step started at `at` (since the start)
/// takes `step_time(at, shape)` rather than `setup.cost`'s time, and the shell adds `events` at their
/// instants (timer wakes, calibrations; the rest are the replay's own). Every token's trip to its
/// caller takes no virtual time and is reported, as the sidecar's shell reports each, with the
/// next instant's events.
pub fn replay_in(
    setup: Setup,
    arrivals: &[Arrival],
    mut step_time: impl FnMut(Duration, StepShape) -> Duration,
    events: &[(Duration, Event)],
) -> Trace {
    let mut extra: Vec<&(Duration, Event)> = events.iter().collect();
    extra.sort_by_key(|e| e.0);
    let mut next_extra = 0;
    let mut order: Vec<usize> = (0..arrivals.len()).collect();
    order.sort_by_key(|&i| (arrivals[i].at, i));
    let mut next = 0;
    let mut shell = Shell::new(&setup, arrivals);
    let mut effects = Vec::new();
    loop {
        let candidates = [
            order.get(next).map(|&i| shell.start + arrivals[i].at),
            shell.engine.as_ref().map(|(_, end, _)| *end),
            shell.ledger.next_wake(),
            shell.cancels.iter().map(|(at, _)| *at).min(),
            extra.get(next_extra).map(|e| shell.start + e.0),
        ];
        let Some(now) = candidates.into_iter().flatten().min() else { break };
        let mut events: Vec<Event> = std::iter::repeat_n(Event::Trip(Duration::ZERO), shell.trips).collect();
        shell.trips = 0;
        while let Some((_, event)) = extra.get(next_extra).filter(|e| shell.start + e.0 <= now) {
            events.push(event.clone());
            next_extra += 1;
        }
        let sampled = shell.step_done(now, &mut events);
        while let Some(&i) = order.get(next).filter(|&&i| shell.start + arrivals[i].at == now) {
            shell.submit(i, &arrivals[i], now, &mut events);
            next += 1;
        }
        shell.cancels_due(now, &mut events);
        // A cancel is read after the step result that came with it: that step's token for the
        // sequence is still sent, so the sequence ends once the effects are in.
        let cancelled: Vec<SeqId> =
            events.iter().filter_map(|e| if let Event::Cancel(id) = e { Some(*id) } else { None }).collect();
        shell.ledger.step(now, events, &mut effects);
        for effect in effects.drain(..) {
            shell.carry_out(effect, now, &sampled, &mut step_time);
        }
        shell.cancelled(&cancelled, now);
    }
    shell.trace
}

/// The replay's side of the ledger, as the sidecar's shell and engine: each live sequence's known
/// tokens, the engine's KV store, the step on the engine (its number, when it ends, the token it
/// samples for each member), the cancels to come, the tokens on their way, and the trace so far.
struct Shell<'a> {
    setup: &'a Setup,
    start: Instant,
    ledger: Ledger,
    known: HashMap<SeqId, Vec<u32>>,
    kv: Vec<u32>,
    engine: Option<(u64, Instant, BTreeMap<SeqId, u32>)>,
    cancels: Vec<(Instant, SeqId)>,
    trips: usize,
    trace: Trace,
    /// Whether the pool is audited at each quiet point: where prompts share blocks.
    audits: bool,
}

impl<'a> Shell<'a> {
    fn new(setup: &'a Setup, arrivals: &[Arrival]) -> Shell<'a> {
        let scheduler = Scheduler::new(
            setup.policy,
            BlockPool::new(setup.blocks, setup.block_size),
            StepEstimator::new(setup.prior),
        );
        let fates = arrivals
            .iter()
            .enumerate()
            .map(|(i, a)| Fate {
                tokens: Vec::new(),
                ids: Vec::new(),
                expected: (0..a.max_tokens).map(|k| prompt_ids(i, a)[(k % a.prompt) as usize]).collect(),
                end: None,
                admitted: true,
                preempted: 0,
            })
            .collect();
        Shell {
            setup,
            start: Instant::now(),
            ledger: Ledger::new(scheduler, setup.margin, 3),
            known: HashMap::new(),
            kv: vec![u32::MAX; (setup.blocks * setup.block_size) as usize],
            engine: None,
            cancels: Vec::new(),
            trips: 0,
            trace: Trace { fates, ..Trace::default() },
            audits: arrivals.iter().any(|a| a.shared.is_some()),
        }
    }

    /// The step on the engine, if it ends at `now`: its result for the ledger, and the tokens it
    /// sampled.
    fn step_done(&mut self, now: Instant, events: &mut Vec<Event>) -> BTreeMap<SeqId, u32> {
        match self.engine.take_if(|(_, end, _)| *end == now) {
            Some((step, _, sampled)) => {
                events.push(Event::StepDone { step, outcome: StepOutcome::Ran { stopped: Vec::new() } });
                sampled
            }
            None => BTreeMap::new(),
        }
    }

    /// Request `i` of the trace arrives.
    fn submit(&mut self, i: usize, a: &Arrival, now: Instant, events: &mut Vec<Event>) {
        let id = i as SeqId;
        let ids = prompt_ids(i, a);
        let prefix = match a.shared {
            Some(_) => Prefix::of(0, &ids, self.setup.block_size),
            None => Prefix::default(),
        };
        let request = Request {
            id,
            arrival: now,
            priority: a.priority,
            tenant: a.tenant,
            weight: a.weight,
            prompt: a.prompt,
            max_tokens: a.max_tokens,
            bytes: 64,
            ttft_deadline: now + a.ttft,
            itl: a.itl,
            deadline: now + a.timeout,
        };
        match a.fork_of.map(|k| k as SeqId) {
            // Into its leader's submission, made a group.
            Some(leader) => {
                let at = events.iter().position(|e| match e {
                    Event::Submit(r, _) => r.id == leader,
                    Event::SubmitGroup(g) => g[0].0.id == leader,
                    _ => false,
                });
                match at.map(|at| &mut events[at]) {
                    Some(Event::SubmitGroup(g)) => g.push((request, prefix)),
                    Some(e) => {
                        let Event::Submit(r, first) = e.clone() else { unreachable!("found as a submission") };
                        *e = Event::SubmitGroup(vec![(r, first), (request, prefix)]);
                    }
                    None => panic!("fork {i} arrives without its leader {leader}"),
                }
            }
            None => events.push(Event::Submit(request, prefix)),
        }
        self.known.insert(id, ids);
        if let Some(after) = a.cancel_after {
            self.cancels.push((now + after, id));
        }
    }

    fn cancels_due(&mut self, now: Instant, events: &mut Vec<Event>) {
        self.cancels.retain(|(at, id)| {
            if *at == now {
                events.push(Event::Cancel(*id));
                false
            } else {
                true
            }
        });
    }

    fn carry_out(
        &mut self,
        effect: Effect,
        now: Instant,
        sampled: &BTreeMap<SeqId, u32>,
        step_time: &mut impl FnMut(Duration, StepShape) -> Duration,
    ) {
        match effect {
            Effect::Step { step, plan } => self.run(step, plan, now, step_time),
            Effect::Token { id, .. } => {
                self.trips += 1;
                let token = sampled[&id];
                self.known.get_mut(&id).expect("a live sequence").push(token);
                let fate = &mut self.trace.fates[id as usize];
                fate.tokens.push(now - self.start);
                fate.ids.push(token);
            }
            Effect::End { id, end, admitted } => {
                self.known.remove(&id);
                let fate = &mut self.trace.fates[id as usize];
                if fate.end.is_some() {
                    self.trace.double_ends += 1;
                }
                fate.admitted = admitted;
                let ending = match end {
                    End::Finished(reason) => Ending::Finished(reason),
                    End::Unfinished(refusal) => Ending::Unfinished(refusal),
                };
                fate.end = Some((now - self.start, ending));
            }
            Effect::Preempted(id) => self.trace.fates[id as usize].preempted += 1,
            Effect::Started { .. } | Effect::StepEnded { .. } | Effect::Late(_) => {}
        }
    }

    /// The engine runs `plan`: it writes each member's new tokens into its blocks, then samples
    /// the cycled prompt from what the blocks hold.
    fn run(
        &mut self,
        step: u64,
        plan: StepPlan,
        now: Instant,
        step_time: &mut impl FnMut(Duration, StepShape) -> Duration,
    ) {
        let b = self.setup.block_size as usize;
        let mut out = BTreeMap::new();
        for m in &plan.members {
            let tokens = &self.known[&m.id];
            for pos in m.start..m.start + m.len {
                let p = pos as usize;
                self.kv[m.blocks[p / b] as usize * b + p % b] = tokens[p];
            }
            if m.sample {
                let p = (m.start + m.len - m.prompt) as usize;
                out.insert(m.id, self.kv[m.blocks[p / b] as usize * b + p % b]);
            }
        }
        let took = step_time(now - self.start, plan.shape);
        self.trace.steps.push(StepRecord {
            started: now - self.start,
            took,
            used_blocks: self.ledger.scheduler().pool().used(),
            held_blocks: {
                let mut held: Vec<u32> = plan.members.iter().flat_map(|m| m.blocks.iter().copied()).collect();
                held.sort_unstable();
                held.dedup();
                held.len() as u32
            },
            plan,
        });
        self.engine = Some((step, now + took, out));
    }

    /// Sequences whose callers went away at `now` end, cancelled, once the instant's effects are in;
    /// then the quiet point's blocks are recorded.
    fn cancelled(&mut self, cancelled: &[SeqId], now: Instant) {
        for id in cancelled {
            let fate = &mut self.trace.fates[*id as usize];
            if fate.end.is_none() && self.known.remove(id).is_some() {
                fate.end = Some((now - self.start, Ending::Cancelled));
            }
        }
        let s = self.ledger.scheduler();
        self.trace.quiet.push((s.pool().used(), s.held_blocks()));
        if cfg!(debug_assertions) && self.audits {
            if let Err(e) = s.pool().audit(s.tables().map(|(_, t)| t)) {
                self.trace.pool_errors.push(format!("at {:?}: {e}", now - self.start));
            }
        }
    }
}
