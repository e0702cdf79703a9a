//! Admission settled by a bound, before any forecast: when even a pessimistic count of the steps
//! still to run, each as long as a step can be, ends before every deadline, the forecast can only
//! say yes — so the common case, a pod with room and deadlines far off, costs one pass over the
//! sequences instead of thousands of events.
//!
//! The bound holds where no KV block can run short (no preemption, no chunk cut by the room left)
//! and the decodes leave room for a chunk of at least `c` tokens under the tightest inter-token
//! target. Then every step with a sequence to prefill gives the first of them `c` tokens or the
//! rest of its prompt; every other step decodes every running sequence, and either every seat is
//! taken (it yields `maxSequences` tokens) or nothing is left to start (the last steps, at most the
//! longest answer's). So there are at most
//! `⌈prefill tokens / c⌉ + sequences prefilling + ⌈tokens to produce / maxSequences⌉ + longest answer`
//! steps. A step with a chunk beside decodes is cut to their target, one of decodes alone is at
//! most the largest decode step (all seats, every context at its longest), one without decodes at
//! most a full budget of prompt tokens at the longest position.

use std::time::Duration;

use std::time::Instant;

use super::{InFlight, MAX_STEPS};
use crate::generation::kv::blocks_for;
use crate::generation::scheduler::Scheduler;
use crate::generation::sequence::Request;
use crate::generation::step::StepShape;

/// Whether the forecast with `r` taken in (`cached` of its prompt's tokens in the prefix cache)
/// surely keeps every promise (`false`: it may or may not; ask the forecast).
pub(super) fn clearly_kept(
    s: &Scheduler,
    in_flight: Option<InFlight<'_>>,
    r: &Request,
    cached: u32,
    now: Instant,
    margin: Duration,
) -> bool {
    // The bound is no earlier than the newcomer's whole answer at its own inter-token target (no
    // step is shorter than the widest target): where that misses a deadline, skip the pass.
    let answer = r.itl.checked_mul(r.max_tokens).and_then(|a| a.checked_add(margin)).and_then(|a| now.checked_add(a));
    if answer.is_none_or(|end| end > r.deadline.min(r.ttft_deadline)) {
        return false;
    }
    let mut t = Totals::from(r);
    latest(s, in_flight, r, cached, now, &mut t).is_some_and(|last| {
        let end = last + margin;
        end <= t.deadline && t.ttft.is_none_or(|ttft| end <= ttft)
    })
}

/// A time by which the forecast with `r` taken in has given every sequence its first token and
/// its last, every decode step within the sequence's inter-token target; `None` where the bound
/// does not hold. `t` gets the sequences' totals. The newcomer's blocks are all counted as taken,
/// those it finds cached too (the cache's free blocks are free).
pub(super) fn latest(
    s: &Scheduler,
    in_flight: Option<InFlight<'_>>,
    r: &Request,
    cached: u32,
    now: Instant,
    t: &mut Totals,
) -> Option<Instant> {
    let policy = s.policy;
    if !policy.discipline.keeps_deadlines() || policy.max_sequences == 0 {
        return None;
    }
    let block = s.pool.block_size();
    // One pass over the sequences and the newcomer, as they stand before the step in flight (its
    // progress only shortens what is left).
    for q in s.seqs.values() {
        let decoding = q.decoding();
        t.add(
            &q.request,
            q.generated,
            if decoding { 0 } else { q.pending() },
            q.table.len() as u32,
            q.first_token.is_some(),
            block,
        );
    }
    t.add(r, 0, r.prompt - cached, 0, false, block);
    if u64::from(s.pool.free()) < u64::from(policy.watermark) + t.blocks {
        return None;
    }
    let e = &s.estimator;
    let seats = u64::from(policy.max_sequences).min(t.count);
    let context = t.lengths.min(seats * u64::from(t.longest));
    let decodes = StepShape { decodes: seats as u32, prefill: 0, context, attended: context };
    let decode_step = e.estimate(decodes);
    if decode_step > t.itl || in_flight.is_some_and(|f| f.plan.expected > t.itl) {
        return None;
    }
    let limit = policy.max_batch_tokens.checked_sub(seats as u32).filter(|l| *l > 0)?;
    let chunk = u64::from(e.prefill_within(decodes, t.longest, t.itl.saturating_sub(s.step_reserve), limit));
    if chunk == 0 {
        return None;
    }
    let budget = u64::from(policy.max_batch_tokens);
    let prefill_step = e.estimate(StepShape {
        decodes: 0,
        prefill: policy.max_batch_tokens,
        context,
        attended: budget * u64::from(t.longest),
    });
    let longest_step = t.widest.max(decode_step).max(prefill_step);
    let steps = t.prefill.div_ceil(chunk)
        + t.prefilling
        + t.to_produce.div_ceil(u64::from(policy.max_sequences))
        + u64::from(t.longest_answer);
    if steps > MAX_STEPS as u64 {
        return None;
    }
    let start = in_flight.map_or(now, |f| now.max(f.end));
    start.checked_add(longest_step.checked_mul(u32::try_from(steps).ok()?)?)
}

/// What the bound needs of the sequences, added up.
pub(super) struct Totals {
    count: u64,
    /// Blocks they may still take.
    blocks: u64,
    /// Prompt (or recompute) tokens still to prefill, and the sequences with any.
    prefill: u64,
    prefilling: u64,
    /// Tokens still to produce, and the most one sequence still produces.
    to_produce: u64,
    longest_answer: u32,
    /// Prompt plus `max_tokens`: the longest, and all added up.
    longest: u32,
    lengths: u64,
    /// The tightest and the widest inter-token target.
    itl: Duration,
    widest: Duration,
    /// The earliest deadline, and the earliest first-token deadline of those without one yet.
    pub deadline: Instant,
    pub ttft: Option<Instant>,
}

impl From<&Request> for Totals {
    /// Nothing added yet; the targets and deadlines start from `r`'s (which is added too).
    fn from(r: &Request) -> Totals {
        Totals {
            count: 0,
            blocks: 0,
            prefill: 0,
            prefilling: 0,
            to_produce: 0,
            longest_answer: 0,
            longest: 0,
            lengths: 0,
            itl: r.itl,
            widest: r.itl,
            deadline: r.deadline,
            ttft: None,
        }
    }
}

impl Totals {
    fn add(&mut self, r: &Request, generated: u32, pending: u32, held: u32, has_first: bool, block: u32) {
        let length = r.prompt + r.max_tokens;
        self.count += 1;
        self.blocks += u64::from(blocks_for(length, block).saturating_sub(held));
        self.prefill += u64::from(pending);
        self.prefilling += u64::from(pending > 0);
        let left = r.max_tokens - generated;
        self.to_produce += u64::from(left);
        self.longest_answer = self.longest_answer.max(left);
        self.longest = self.longest.max(length);
        self.lengths += u64::from(length);
        self.itl = self.itl.min(r.itl);
        self.widest = self.widest.max(r.itl);
        self.deadline = self.deadline.min(r.deadline);
        if !has_first {
            self.ttft = Some(self.ttft.map_or(r.ttft_deadline, |t| t.min(r.ttft_deadline)));
        }
    }
}
