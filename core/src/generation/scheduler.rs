//! The step rule (DESIGN.md, "The step rule"): which sequences one engine step runs, and how
//! much of each. A plain state machine over the sequences and the KV blocks, with the time passed
//! in; the generation [`super::ledger`] drives it for the sidecar, and admission's
//! [`super::forecast`] runs a copy of it forward in virtual time — one rule, two drivers.
//!
//! A step, while the engine is idle:
//! 1. every running sequence decodes one token, unless it is preempted: when a decode needs a KV
//!    block and none is free, the running sequence that costs least to redo relative to its slack
//!    (batch tier first, then most slack, then fewest computed tokens) gives its blocks back and
//!    waits again, to be recomputed (prompt and produced tokens) when it restarts;
//! 2. prefill gets the rest of the token budget, cut so that the step's estimated time stays
//!    within the tightest inter-token target of the decoding sequences;
//! 3. sequences mid-prefill continue first, then waiting ones start in order of priority, then
//!    of their tenants' fair shares of step tokens ([`crate::tenant`]), then TTFT deadline, each only when the blocks for its chunk (plus the watermark) are free and
//!    `maxSequences` allows; the first that cannot start stops the others (no overtaking, so that
//!    a long prompt is not starved by short ones), and a step that had to preempt starts none;
//! 4. before that, a sequence that can no longer meet its deadline even if every step it still
//!    needs were the shortest possible is ended at once ([`Scheduler::hopeless`]).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use std::time::Instant;

pub use super::discipline::Discipline;
use super::kv::{Block, BlockPool};
use super::prefix::Prefix;
use super::sequence::{FinishReason, Queued, Request, SeqId};
use super::step::{StepEstimator, StepShape};
use crate::outcome::{Outcome, Refusal};
use crate::tenant::{Shares, TenantId};
use crate::ticket::Priority;

/// The knobs of generation (DESIGN.md, "Generation knobs").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Tokens one step may feed the model (`maxBatchTokens`).
    pub max_batch_tokens: u32,
    /// Sequences holding KV blocks at once (`maxSequences`).
    pub max_sequences: u32,
    /// Waiting sequences, by count, payload bytes and tokens to prefill.
    pub max_queue: usize,
    pub max_queue_bytes: u64,
    pub max_queue_tokens: u64,
    /// The model's context: prompt plus produced tokens.
    pub max_context: u32,
    /// Blocks a new sequence leaves free for the decodes of the running ones.
    pub watermark: u32,
    pub discipline: Discipline,
}

/// One sequence's part of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub id: SeqId,
    /// Position of its first token in this step (the tokens before it are in its KV blocks).
    pub start: u32,
    /// Tokens it feeds: 1 for a decode, a chunk for a prefill.
    pub len: u32,
    /// Whether the step samples a token for it: its chunk reaches its last known token.
    pub sample: bool,
    /// Whether this is a decode (it has produced tokens and feeds its last one).
    pub decode: bool,
    /// Its prompt's length (an engine may need to tell prompt from produced tokens).
    pub prompt: u32,
    /// Its KV block table, in order, covering `start + len` tokens: empty as planned, filled in
    /// by [`Scheduler::fill_tables`] for the engine (a forecast plans steps no engine runs, and copying
    /// every member's table each simulated step made a forecast step O(blocks)).
    pub blocks: Vec<Block>,
}

/// What [`Scheduler::complete`] does with a sequence whose deadline has passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Late {
    /// It ends, expired (serving: no answer after its deadline).
    Ends,
    /// It runs on (a forecast, which reads when its tokens would come, however late).
    RunsOn,
}

/// One engine step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlan {
    pub members: Vec<Member>,
    pub shape: StepShape,
    pub expected: Duration,
}

/// What a finished step did to one of its sequences.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Its new token is to be sent to its caller; `first` for its first token.
    Token { id: SeqId, first: bool },
    /// Its last token has been sent.
    Finished { id: SeqId, reason: FinishReason },
    /// It ended without its token (a deadline passed during the step).
    Expired { id: SeqId, refusal: Refusal },
}

/// A sequence the scheduler holds.
#[derive(Debug, Clone)]
pub(crate) struct Seq {
    pub request: Request,
    pub generated: u32,
    /// Tokens whose KV is in its blocks.
    pub computed: u32,
    pub table: Vec<Block>,
    /// The hashes of its prompt's full blocks: those cached when it was admitted head its table,
    /// and those it computes are cached as they are.
    pub prefix: Prefix,
    /// Holds blocks (running, possibly mid-prefill), rather than waiting.
    pub running: bool,
    pub first_token: Option<Instant>,
    /// When it was first given a step (for the queue-wait metric).
    pub started: Option<Instant>,
    /// Admitted as a probe ([`crate::evidence`], rule 3): the learned step times said it would
    /// miss, so rule 4 does not end it on their word; its deadlines still end it when they come.
    pub probe: bool,
}

impl Seq {
    /// Prompt and produced tokens.
    pub fn known(&self) -> u32 {
        self.request.prompt + self.generated
    }

    pub fn pending(&self) -> u32 {
        self.known() - self.computed
    }

    /// It has produced tokens and only its last one is still to feed.
    pub fn decoding(&self) -> bool {
        self.running && self.generated > 0 && self.computed > 0 && self.pending() == 1
    }

    fn order(&self, discipline: Discipline) -> (Priority, Instant, SeqId) {
        discipline.order(&self.request)
    }
}

/// The generation scheduler of one model version: its sequences and its engine's KV blocks.
#[derive(Debug, Clone)]
pub struct Scheduler {
    pub(crate) policy: Policy,
    pub(crate) pool: BlockPool,
    pub(crate) estimator: StepEstimator,
    pub(crate) seqs: BTreeMap<SeqId, Seq>,
    /// Waiting sequences in start order: priority, then TTFT deadline.
    pub(crate) waiting: BTreeSet<(Priority, Instant, SeqId)>,
    /// Sequences holding blocks, in the order they started.
    pub(crate) running: Vec<SeqId>,
    queued_bytes: u64,
    queued_tokens: u64,
    /// The tenants' fair shares of step tokens, one per priority tier.
    pub(crate) shares: [Shares; 2],
    /// What a step cut to the decodes' inter-token target leaves of it unused.
    pub(crate) step_reserve: Duration,
    /// Prompt tokens of the sequences started with the prefix cache on, and those of them it
    /// held.
    prefix_queries: u64,
    prefix_hits: u64,
}

impl Scheduler {
    pub fn new(policy: Policy, pool: BlockPool, estimator: StepEstimator) -> Self {
        Scheduler {
            policy,
            pool,
            estimator,
            seqs: BTreeMap::new(),
            waiting: BTreeSet::new(),
            running: Vec::new(),
            queued_bytes: 0,
            queued_tokens: 0,
            shares: Default::default(),
            step_reserve: Duration::ZERO,
            prefix_queries: 0,
            prefix_hits: 0,
        }
    }

    /// Steps with decodes in them are cut to `reserve` less than the tightest inter-token target
    /// (the ledger gives the deadline margin's floor): a token's way to its caller, and what a
    /// timer with a millisecond's grain adds to a step, come out of the same gap.
    pub fn with_step_reserve(mut self, reserve: Duration) -> Self {
        self.step_reserve = reserve;
        self
    }

    /// Sets a tenant's weight: its share of step tokens against the other backlogged tenants.
    pub fn set_weight(&mut self, tenant: TenantId, weight: u32) {
        for shares in &mut self.shares {
            shares.set_weight(tenant, weight);
        }
    }

    /// Waiting sequences in the order they may start: by priority; within one, the tenants
    /// interleaved by their fair shares of step tokens (each charged its prompt), each tenant's
    /// own in TTFT-deadline order. The other disciplines know no tenants (as other servers).
    fn start_order(&self) -> Vec<SeqId> {
        let ids = |p: Priority| self.waiting.iter().filter(move |(q, _, _)| *q == p).map(|(_, _, id)| *id);
        if !self.policy.discipline.shares_tenants() {
            return self.waiting.iter().map(|(_, _, id)| *id).collect();
        }
        let mut order = Vec::with_capacity(self.waiting.len());
        for priority in [Priority::Interactive, Priority::Batch] {
            let mut lanes: BTreeMap<TenantId, Vec<SeqId>> = BTreeMap::new();
            for id in ids(priority) {
                lanes.entry(self.seqs[&id].request.tenant).or_default().push(id);
            }
            if lanes.len() <= 1 {
                order.extend(lanes.into_values().flatten());
                continue;
            }
            let seqs = &self.seqs;
            let lanes =
                lanes.into_iter().map(|(t, ids)| (t, Box::new(ids.into_iter()) as Box<dyn Iterator<Item = SeqId>>));
            order.extend(self.shares[priority.index()].merge(lanes, |id| u64::from(seqs[id].pending())));
        }
        order
    }

    /// A step was composed: each member's tenant is charged the tokens it feeds, and the shares
    /// advance to where the step started (or level out when nobody waits).
    fn charge(&mut self, members: &[Member]) {
        for priority in [Priority::Interactive, Priority::Batch] {
            let shares = &mut self.shares[priority.index()];
            let fed: Vec<(TenantId, u32)> = members
                .iter()
                .map(|m| (self.seqs[&m.id].request, m.len))
                .filter(|(r, _)| r.priority == priority)
                .map(|(r, len)| (r.tenant, len))
                .collect();
            let start = fed.iter().map(|(t, _)| shares.served(*t)).min();
            for (tenant, len) in fed {
                shares.charge(tenant, u64::from(len));
            }
            if !self.waiting.iter().any(|(p, _, _)| *p == priority) {
                shares.advance(None);
            } else if start.is_some() {
                shares.advance(start);
            }
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn estimator(&self) -> &StepEstimator {
        &self.estimator
    }

    /// Whether a request that admission's forecast refused is taken as a probe
    /// ([`crate::evidence`], rule 3): nothing is held (and no step runs, the caller says), so it
    /// can only risk itself, and the forecast with the step costs the engine started from, and
    /// the margin's floor, keeps its promises.
    pub fn probe_fits(&self, r: &Request, prefix: &Prefix, now: Instant, floor: Duration) -> bool {
        if !self.is_empty() {
            return false;
        }
        let mut prior = self.clone();
        prior.estimator = self.estimator.prior();
        super::forecast::admit(&prior, None, r, prefix, now, floor).is_ok()
    }

    /// [`Scheduler::probe_fits`] for a group admitted together: every member, each forecast with
    /// those before it held, with the starting step costs.
    pub fn group_probe_fits(&self, group: &[(Request, Prefix)], now: Instant, floor: Duration) -> bool {
        if !self.is_empty() {
            return false;
        }
        let mut prior = self.clone();
        prior.estimator = self.estimator.prior();
        for (r, prefix) in group {
            if prior.check_bounds(r).is_err() || super::forecast::admit(&prior, None, r, prefix, now, floor).is_err() {
                return false;
            }
            prior.insert(*r, prefix.clone());
        }
        true
    }

    pub(crate) fn estimator_mut(&mut self) -> &mut StepEstimator {
        &mut self.estimator
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn queued_bytes(&self) -> u64 {
        self.queued_bytes
    }

    pub fn queued_tokens(&self) -> u64 {
        self.queued_tokens
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// Tokens produced so far by a held sequence.
    pub fn generated(&self, id: SeqId) -> Option<u32> {
        self.seqs.get(&id).map(|s| s.generated)
    }

    /// The earliest arrival among waiting sequences.
    pub fn oldest_waiting(&self) -> Option<Instant> {
        self.waiting.iter().map(|(_, _, id)| self.seqs[id].request.arrival).min()
    }

    /// Distinct blocks the sequences' tables hold; equal to the pool's used blocks at every quiet
    /// point. For tests: where tables share blocks it costs O(blocks held).
    pub fn held_blocks(&self) -> u32 {
        let tables: u32 = self.seqs.values().map(|s| s.table.len() as u32).sum();
        if self.pool.shared() == 0 {
            return tables;
        }
        let mut held: Vec<Block> = self.seqs.values().flat_map(|s| s.table.iter().copied()).collect();
        held.sort_unstable();
        held.dedup();
        held.len() as u32
    }

    /// Prompt tokens of the sequences started so far with the prefix cache on, and how many of
    /// them it held when they started (vLLM's `prefix_cache_queries` and `prefix_cache_hits`).
    pub fn prefix_stats(&self) -> (u64, u64) {
        (self.prefix_queries, self.prefix_hits)
    }

    /// The prompt tokens of `r` (with the hashes `prefix`) that the prefix cache holds now: its
    /// leading cached blocks, short of its last token, which is computed to sample the first
    /// token from.
    pub fn cached_tokens(&self, r: &Request, prefix: &Prefix) -> u32 {
        self.pool.hits(prefix.blocks(), self.most_cached(r)) as u32 * self.pool.block_size()
    }

    /// The most blocks of a prompt the cache may give: those before its last token.
    fn most_cached(&self, r: &Request) -> usize {
        (r.prompt.saturating_sub(1) / self.pool.block_size()) as usize
    }

    /// Every held sequence's block table.
    pub fn tables(&self) -> impl Iterator<Item = (SeqId, &[Block])> {
        self.seqs.iter().map(|(id, s)| (*id, s.table.as_slice()))
    }

    /// The checks of a request's size against the model and the queue's bounds, before any
    /// forecast: what can never fit (400 / 413), and what does not fit now (503 `queue_full`).
    pub fn check_bounds(&self, r: &Request) -> Result<(), Refusal> {
        let p = &self.policy;
        let total = u64::from(r.prompt) + u64::from(r.max_tokens);
        if total > u64::from(p.max_context) {
            return Err(Refusal::invalid(format!(
                "the prompt has {} tokens and max_tokens is {}: {total} tokens; this model's context holds {}",
                r.prompt, r.max_tokens, p.max_context
            )));
        }
        let blocks = total.div_ceil(u64::from(self.pool.block_size()));
        if blocks > u64::from(self.pool.total()) {
            return Err(Refusal::new(
                Outcome::TooLarge,
                format!(
                    "the prompt and max_tokens need {total} tokens of KV cache ({blocks} blocks of {}); the whole cache holds {} blocks",
                    self.pool.block_size(),
                    self.pool.total()
                ),
            ));
        }
        let queued = Queued {
            requests: self.waiting.len(),
            bytes: self.queued_bytes,
            tokens: self.queued_tokens,
            estimated: false,
        };
        queued.room_for(r, (p.max_queue, p.max_queue_bytes, p.max_queue_tokens))
    }

    /// Whether a group of sequences (OpenAI's `n`, a list of prompts) is beyond what the queue
    /// may ever hold at once — more sequences, bytes or prompt tokens than its bounds — so that
    /// no wait would let it in: refused as too large, naming the bound.
    pub fn group_beyond_bounds<'a>(&self, group: impl Iterator<Item = &'a Request>) -> Option<Refusal> {
        let p = &self.policy;
        let (mut n, mut bytes, mut tokens) = (0usize, 0u64, 0u64);
        for r in group {
            n += 1;
            bytes += r.bytes;
            tokens += u64::from(r.prompt);
        }
        let over = |what: &str, have: u64, most: u64| {
            Refusal::new(
                Outcome::TooLarge,
                format!("the request's {n} sequences (n choices of each prompt) hold {have} {what}; the queue holds at most {most}: ask for fewer choices"),
            )
        };
        if n > p.max_queue {
            Some(over("sequences", n as u64, p.max_queue as u64))
        } else if bytes > p.max_queue_bytes {
            Some(over("bytes", bytes, p.max_queue_bytes))
        } else if tokens > p.max_queue_tokens {
            Some(over("prompt tokens", tokens, p.max_queue_tokens))
        } else {
            None
        }
    }

    /// Takes a request in as a probe ([`crate::evidence`], rule 3): it waits for its first step,
    /// and is not ended early on the word of the learned step times.
    pub fn insert_probe(&mut self, request: Request, prefix: Prefix) {
        self.insert(request, prefix);
        if let Some(seq) = self.seqs.get_mut(&request.id) {
            seq.probe = true;
        }
    }

    /// Takes an admitted request in: it waits for its first step, holding the cached blocks its
    /// prompt starts with (`prefix` names its full blocks). They are taken now, not when it
    /// starts, so that the hit admission's forecast counted on cannot be evicted meanwhile; a hit
    /// that appears later (a twin prompt computed meanwhile) is not taken, so that the sequence
    /// runs as forecast.
    pub fn insert(&mut self, request: Request, prefix: Prefix) {
        self.set_weight(request.tenant, request.weight);
        let mut table = Vec::new();
        let hits = self.pool.share(&mut table, prefix.blocks(), self.most_cached(&request)) as u32;
        let computed = hits * self.pool.block_size();
        let seq = Seq {
            request,
            generated: 0,
            computed,
            table,
            prefix,
            running: false,
            first_token: None,
            started: None,
            probe: false,
        };
        self.enqueue(&seq);
        self.seqs.insert(request.id, seq);
    }

    fn enqueue(&mut self, seq: &Seq) {
        self.waiting.insert(seq.order(self.policy.discipline));
        self.queued_bytes += seq.request.bytes;
        self.queued_tokens += u64::from(seq.known());
    }

    fn dequeue(&mut self, id: SeqId) {
        let seq = &self.seqs[&id];
        if self.waiting.remove(&seq.order(self.policy.discipline)) {
            self.queued_bytes -= seq.request.bytes;
            self.queued_tokens -= u64::from(seq.known());
        }
    }

    /// Takes a sequence out (it ended, or its caller went away) and frees its blocks. False when
    /// it was not held.
    pub fn remove(&mut self, id: SeqId) -> bool {
        if !self.seqs.contains_key(&id) {
            return false;
        }
        self.dequeue(id);
        let mut seq = self.seqs.remove(&id).expect("checked");
        self.pool.release(&mut seq.table);
        self.running.retain(|r| *r != id);
        true
    }

    /// Gives a running sequence's blocks back; it waits again, to be recomputed.
    pub(crate) fn preempt(&mut self, id: SeqId) {
        let seq = self.seqs.get_mut(&id).expect("a held sequence");
        debug_assert!(seq.running);
        self.pool.release(&mut seq.table);
        seq.computed = 0;
        seq.running = false;
        self.running.retain(|r| *r != id);
        let seq = self.seqs[&id].clone();
        self.enqueue(&seq);
    }

    /// Waiting sequences give back the blocks they hold from the prefix cache, the latest in the
    /// queue first, until a block is free; each then computes its prompt whole. False, and none
    /// gives any back, when that would free no block (every one is also a running sequence's).
    /// Running sequences short of blocks take these before any of them is preempted: a waiting
    /// sequence loses no work, and the whole cache holds any one admitted sequence, but not beside
    /// blocks others hold while they wait.
    fn unshare_waiting(&mut self) -> bool {
        let holders: Vec<SeqId> =
            self.waiting.iter().rev().map(|(_, _, id)| *id).filter(|id| !self.seqs[id].table.is_empty()).collect();
        // A block comes free only when every table that holds it is a waiting one.
        let mut waiting_refs: BTreeMap<Block, u32> = BTreeMap::new();
        for id in &holders {
            for b in &self.seqs[id].table {
                *waiting_refs.entry(*b).or_default() += 1;
            }
        }
        if !waiting_refs.iter().any(|(b, n)| self.pool.references(*b) == *n) {
            return false;
        }
        let free = self.pool.free();
        for id in holders {
            let seq = self.seqs.get_mut(&id).expect("a held sequence");
            self.pool.release(&mut seq.table);
            seq.computed = 0;
            if self.pool.free() > free {
                break;
            }
        }
        true
    }

    /// The sequences whose deadline (or, before their first token, TTFT deadline) has come.
    pub fn due(&self, now: Instant) -> Vec<(SeqId, Refusal)> {
        self.seqs
            .values()
            .filter_map(|s| {
                let r = &s.request;
                if now >= r.deadline {
                    Some((r.id, deadline_passed(s, now)))
                } else if s.first_token.is_none() && now >= r.ttft_deadline {
                    Some((r.id, ttft_passed(s, now)))
                } else {
                    None
                }
            })
            .collect()
    }

    /// The earliest instant at which [`Scheduler::due`] will name a sequence.
    pub fn next_due(&self) -> Option<Instant> {
        self.seqs
            .values()
            .map(|s| {
                if s.first_token.is_none() {
                    s.request.ttft_deadline.min(s.request.deadline)
                } else {
                    s.request.deadline
                }
            })
            .min()
    }

    /// The shortest time a sequence still needs: its prefill (or recompute) in one step of its
    /// own, then one decode step of its own per token left.
    pub(crate) fn least_remaining(&self, s: &Seq) -> (Duration, Duration) {
        let e = &self.estimator;
        let left = s.request.max_tokens - s.generated;
        let decode = e.estimate(StepShape::part(s.known().saturating_sub(1), 1, true));
        if s.decoding() {
            return (Duration::ZERO, decode * left);
        }
        let prefill = e.estimate(StepShape::part(s.computed, s.pending(), false));
        (prefill, prefill + decode * (left - 1))
    }

    /// Rule 4: sequences that cannot meet their deadline (or first-token deadline) even if every
    /// step they still need were as short as a step can be.
    pub fn hopeless(&self, now: Instant) -> Vec<(SeqId, Refusal)> {
        self.seqs
            .values()
            .filter(|s| !s.probe)
            .filter_map(|s| {
                let (first, all) = self.least_remaining(s);
                let r = &s.request;
                let ms = |d: Duration| d.as_millis();
                if now + all > r.deadline {
                    Some((
                        r.id,
                        Refusal::new(
                            Outcome::Expired,
                            format!(
                                "deadline cannot be met: after {} of {} tokens and {} ms, the rest needs at least {} ms; the deadline is {} ms",
                                s.generated,
                                r.max_tokens,
                                ms(now - r.arrival),
                                ms(all),
                                ms(r.deadline - r.arrival)
                            ),
                        ),
                    ))
                } else if s.first_token.is_none() && now + first > r.ttft_deadline {
                    Some((
                        r.id,
                        Refusal::new(
                            Outcome::Expired,
                            format!(
                                "first-token deadline cannot be met: after {} ms, the prefill needs at least {} ms; the TTFT deadline is {} ms",
                                ms(now - r.arrival),
                                ms(first),
                                ms(r.ttft_deadline - r.arrival)
                            ),
                        ),
                    ))
                } else {
                    None
                }
            })
            .collect()
    }

    /// The preemption victim among the running sequences: batch tier first, then the most slack,
    /// then the fewest computed tokens (the least work lost).
    fn victim(&self, now: Instant) -> Option<SeqId> {
        if !self.policy.discipline.keeps_deadlines() {
            // The latest arrival, as vLLM preempts.
            return self.running.iter().copied().max_by_key(|id| (self.seqs[id].request.arrival, *id));
        }
        self.running.iter().copied().max_by_key(|id| {
            let s = &self.seqs[id];
            let slack = s.request.deadline.saturating_duration_since(now).saturating_sub(self.least_remaining(s).1);
            (s.request.priority, slack, Reverse(s.computed), *id)
        })
    }

    /// The next step under the rule, with the sequences preempted for it, or `None` when there is
    /// nothing to run. Allocates the blocks the step needs.
    pub fn plan(&mut self, now: Instant) -> (Option<StepPlan>, Vec<SeqId>) {
        let mut preempted = Vec::new();
        loop {
            if let Some(plan) = self.compose(now, &mut preempted) {
                return (Some(plan), preempted);
            }
            // Nothing could run although sequences hold blocks: each is mid-prefill and waits for
            // blocks another holds. Preempt one and try again (a lone sequence always fits: the
            // whole cache holds any admitted one).
            if self.unshare_waiting() {
                continue;
            }
            if self.running.len() <= 1 {
                return (None, preempted);
            }
            let victim = self.victim(now).expect("running sequences");
            self.preempt(victim);
            preempted.push(victim);
        }
    }

    /// One step under the rule, or `None` when nothing can run; `preempted` gets the sequences
    /// that gave their blocks back for it.
    fn compose(&mut self, now: Instant, preempted: &mut Vec<SeqId>) -> Option<StepPlan> {
        let decodes = self.grow_decodes(now, preempted);
        // A discipline of whole batches forms one only when the last has left the engine, and
        // the batch is all it takes then: up to `maxSequences` waiting sequences, prefilled over
        // as many steps as their prompts need.
        let whole = self.policy.discipline.batches_whole();
        let batch_open = !whole || self.running.is_empty();
        if whole && self.running.is_empty() {
            self.start_static_batch(now);
        }
        let (mut members, shape, cap) = self.decode_members(&decodes);
        // A step that had to preempt starts nothing new: the blocks it freed are for the decodes,
        // and the victim must not be restarted (recomputed) in the very step that evicted it.
        let may_start = preempted.is_empty() && batch_open;
        let shape = self.prefill(now, may_start, cap, shape, &mut members);
        if members.is_empty() {
            return None;
        }
        self.charge(&members);
        let expected = self.estimator.estimate(shape);
        Some(StepPlan { members, shape, expected })
    }

    /// Rule 1: every decoding sequence gets its block for one more token, the cheapest to redo
    /// preempted while none is free. Returns the decoding sequences left.
    fn grow_decodes(&mut self, now: Instant, preempted: &mut Vec<SeqId>) -> Vec<SeqId> {
        let mut decodes: Vec<SeqId> = self.running.iter().copied().filter(|id| self.seqs[id].decoding()).collect();
        let mut i = 0;
        while i < decodes.len() {
            let id = decodes[i];
            let seq = &self.seqs[&id];
            let needed = self.pool.needed(seq.table.len(), seq.computed + 1);
            if needed <= self.pool.free() {
                let seq = self.seqs.get_mut(&id).expect("held");
                let grown = self.pool.grow(&mut seq.table, seq.computed + 1);
                debug_assert!(grown);
                i += 1;
                continue;
            }
            if self.unshare_waiting() {
                continue;
            }
            let victim = self.victim(now).expect("the decoding sequence itself runs");
            self.preempt(victim);
            preempted.push(victim);
            if let Some(at) = decodes.iter().position(|d| *d == victim) {
                decodes.remove(at);
                if at < i {
                    i -= 1;
                }
            }
        }
        decodes
    }

    /// The benchmark's static batching: up to `maxSequences` waiting sequences start at once.
    fn start_static_batch(&mut self, now: Instant) {
        let batch: Vec<SeqId> =
            self.waiting.iter().map(|(_, _, id)| *id).take(self.policy.max_sequences as usize).collect();
        for id in batch {
            self.dequeue(id);
            self.running.push(id);
            self.seqs.get_mut(&id).expect("held").running = true;
            self.started(id, now);
        }
    }

    /// The decodes' members, their shape, and the step's cap: the tightest inter-token target
    /// among them (Ferry's discipline only).
    fn decode_members(&self, decodes: &[SeqId]) -> (Vec<Member>, StepShape, Option<Duration>) {
        let mut members = Vec::with_capacity(decodes.len() + 1);
        let mut shape = StepShape::default();
        let mut cap: Option<Duration> = None;
        for id in decodes {
            let s = &self.seqs[id];
            members.push(Member {
                id: *id,
                start: s.computed,
                len: 1,
                sample: true,
                decode: true,
                prompt: s.request.prompt,
                blocks: Vec::new(),
            });
            shape = shape.join(StepShape::part(s.computed, 1, true));
            if self.policy.discipline.keeps_deadlines() {
                cap = Some(cap.map_or(s.request.itl, |c| c.min(s.request.itl)));
            }
        }
        (members, shape, cap)
    }

    /// Running sequences still prefilling (or recomputing), in the rule's order.
    fn mid_prefill(&self) -> Vec<SeqId> {
        let mut mid: Vec<SeqId> = self
            .running
            .iter()
            .copied()
            .filter(|id| self.seqs[id].pending() > 0 && !self.seqs[id].decoding())
            .collect();
        mid.sort_by_key(|id| self.seqs[id].order(self.policy.discipline));
        mid
    }

    /// Rules 2 and 3: the rest of the token budget to prefill — sequences mid-prefill first, then
    /// waiting ones in order (when `may_start`), each chunk cut to the cap and to the blocks free;
    /// the first waiting one that cannot start stops the others. Returns the step's shape.
    fn prefill(
        &mut self,
        now: Instant,
        may_start: bool,
        cap: Option<Duration>,
        mut shape: StepShape,
        members: &mut Vec<Member>,
    ) -> StepShape {
        let block_size = self.pool.block_size();
        let mut budget = self.policy.max_batch_tokens.saturating_sub(shape.decodes);
        let mid = self.mid_prefill();
        let seats = self.policy.max_sequences as usize;
        // The order costs O(waiting): built only when one of them may start.
        let waiting = if may_start && self.running.len() < seats { self.start_order() } else { Vec::new() };
        for (id, new) in mid.into_iter().map(|id| (id, false)).chain(waiting.into_iter().map(|id| (id, true))) {
            if budget == 0 || (new && self.running.len() >= seats) {
                break;
            }
            let s = &self.seqs[&id];
            let (computed, held) = (s.computed, s.table.len() as u32);
            let mut n = s.pending().min(budget);
            if let Some(cap) = cap {
                n = self.estimator.prefill_within(shape, computed, cap.saturating_sub(self.step_reserve), n);
            }
            let reserve = if new { self.policy.watermark } else { 0 };
            let room = (held + self.pool.free().saturating_sub(reserve)) * block_size;
            n = n.min(room.saturating_sub(computed));
            if n == 0 {
                if new {
                    break;
                }
                continue;
            }
            if new {
                self.dequeue(id);
                self.running.push(id);
            }
            self.started(id, now);
            let seq = self.seqs.get_mut(&id).expect("held");
            seq.running = true;
            let grown = self.pool.grow(&mut seq.table, computed + n);
            debug_assert!(grown, "room was checked");
            members.push(Member {
                id,
                start: computed,
                len: n,
                sample: computed + n == seq.known(),
                decode: false,
                prompt: seq.request.prompt,
                blocks: Vec::new(),
            });
            shape = shape.join(StepShape::part(computed, n, false));
            budget -= n;
        }
        shape
    }

    /// A sequence is given a step: the first time, its prompt counts for the prefix cache's
    /// metrics, with the tokens the cache held for it (none after it gave them back).
    fn started(&mut self, id: SeqId, now: Instant) {
        let seq = self.seqs.get_mut(&id).expect("held");
        if seq.started.is_none() && seq.prefix.is_on() {
            self.prefix_queries += u64::from(seq.request.prompt);
            self.prefix_hits += u64::from(seq.computed);
        }
        seq.started.get_or_insert(now);
    }

    /// Fills in each member's block table, for the engine that runs `plan`. The blocks a member
    /// writes (from its first new token's) are its own: shared ones are only read.
    pub fn fill_tables(&self, plan: &mut StepPlan) {
        for m in &mut plan.members {
            let table = &self.seqs[&m.id].table;
            m.blocks.clone_from(table);
            let written = &table[(m.start / self.pool.block_size()) as usize..];
            debug_assert!(written.iter().all(|b| self.pool.references(*b) == 1), "a step writes a shared block");
        }
    }

    /// Applies a step that ended at `now`: each member's tokens are computed, those that sampled
    /// have a new token; `stopped` says which the model ended (end-of-sequence, `stop` string);
    /// `late` what becomes of one whose deadline passed. Members no longer held (cancelled, or
    /// ended at a deadline during the step) are skipped and counted in the returned number of
    /// late results.
    pub fn complete(
        &mut self,
        plan: &StepPlan,
        now: Instant,
        stopped: &dyn Fn(SeqId) -> bool,
        late: Late,
    ) -> (Vec<Progress>, u64) {
        let mut progress = Vec::new();
        let mut skipped = 0;
        let block_size = self.pool.block_size();
        for m in &plan.members {
            let Some(seq) = self.seqs.get_mut(&m.id) else {
                skipped += u64::from(m.sample);
                continue;
            };
            debug_assert!(seq.running && seq.computed == m.start, "a member runs as planned");
            seq.computed += m.len;
            // The prompt's blocks this step filled are cached: later prompts may start with them.
            let named = seq.prefix.blocks();
            let filled = (m.start / block_size) as usize..((seq.computed / block_size) as usize).min(named.len());
            for i in filled {
                self.pool.cache(seq.table[i], named[i]);
            }
            if !m.sample {
                continue;
            }
            seq.generated += 1;
            let first = seq.first_token.is_none();
            let r = seq.request;
            let refusal = if late == Late::RunsOn || !self.policy.discipline.keeps_deadlines() {
                None
            } else if first && now > r.ttft_deadline {
                Some(ttft_passed(seq, now))
            } else if now > r.deadline {
                Some(deadline_passed(seq, now))
            } else {
                None
            };
            if let Some(refusal) = refusal {
                skipped += 1;
                self.remove(m.id);
                progress.push(Progress::Expired { id: m.id, refusal });
                continue;
            }
            seq.first_token.get_or_insert(now);
            progress.push(Progress::Token { id: m.id, first });
            let reason = if stopped(m.id) {
                Some(FinishReason::Stop)
            } else if seq.generated == r.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                self.remove(m.id);
                progress.push(Progress::Finished { id: m.id, reason });
            }
        }
        (progress, skipped)
    }

    /// A step failed: its members' KV is in an unknown state, so each gives its blocks back and
    /// waits to be recomputed (the tokens it produced are kept). Their blocks cached before the
    /// step stay cached: an engine writes only the slots of a step's new tokens, which are never
    /// in a cached block (only full ones are, and only after the step that filled them ended).
    pub fn fail(&mut self, plan: &StepPlan) {
        for m in &plan.members {
            if self.seqs.get(&m.id).is_some_and(|s| s.running) {
                self.preempt(m.id);
            }
        }
    }
}

fn deadline_passed(s: &Seq, now: Instant) -> Refusal {
    let r = &s.request;
    Refusal::new(
        Outcome::Expired,
        format!(
            "deadline passed after {} of {} tokens: {} ms after arrival; the deadline was {} ms",
            s.generated,
            r.max_tokens,
            (now - r.arrival).as_millis(),
            (r.deadline - r.arrival).as_millis()
        ),
    )
}

fn ttft_passed(s: &Seq, now: Instant) -> Refusal {
    let r = &s.request;
    Refusal::new(
        Outcome::Expired,
        format!(
            "no first token by the TTFT deadline: {} ms after arrival; the TTFT deadline was {} ms",
            (now - r.arrival).as_millis(),
            (r.ttft_deadline - r.arrival).as_millis()
        ),
    )
}
