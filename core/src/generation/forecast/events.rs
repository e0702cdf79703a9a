//! The forecast driven by events, not steps: what [`super::simulate`] computes by running a copy
//! of the scheduler one step at a time, computed at the cost of the events that change a step's
//! members — a sequence starts, finishes its prefill, ends — instead of the steps between them.
//!
//! Between two events every step decodes the same sequences, one token further each
//! ([`crate::generation::decode_run`] adds such a run up in closed form). The decoders are held
//! lazily: each is stored as of the step it joined, and the step count says where it is now; the
//! shape of their decodes is kept as sums; the ends wait in a calendar by the step they fall on
//! ([`super::ends`]); each
//! step's (or run's) longest step goes on a stack that answers "the longest step since this
//! sequence began to decode" by binary search. A forecast of 2 000 sequences that ends every one
//! of them costs a few thousand events, not the hundreds of thousands of steps they take.
//!
//! Exactness: each step with a prefill in it is composed by the rule of
//! [`crate::generation::scheduler`] (mid-prefill sequences first, then waiting ones in order, each
//! chunk cut to the budget and the decodes' inter-token target by the same estimator calls), so
//! the answer is the step-by-step one's, to the nanosecond. Three things the step rule does that
//! this does not follow, it declines instead (`None`, and the caller runs the step-by-step
//! forecast): KV blocks that could run short (a preemption, a chunk cut by the room left), tenants
//! whose fair shares order the waiting sequences (two tenants waiting in one tier), and the
//! disciplines other than Ferry's.

use std::collections::btree_set;
use std::iter::Peekable;
use std::time::Duration;

use std::time::Instant;

use super::ends::Ends;
use super::{Fate, Fates, InFlight, MAX_STEPS};
use crate::generation::decode_run::DecodeRun;
use crate::generation::kv::blocks_for;
use crate::generation::scheduler::Scheduler;
use crate::generation::sequence::{Request, SeqId};
use crate::generation::step::StepShape;
use crate::tenant::TenantId;
use crate::ticket::Priority;

/// One sequence of the forecast, by its index in [`Fates`].
#[derive(Debug, Clone, Copy)]
struct Seq<'a> {
    request: &'a Request,
    /// Prompt and produced tokens; tokens whose KV is computed; tokens produced. For a decoder,
    /// as of the step it joined the decodes.
    known: u32,
    computed: u32,
    generated: u32,
    /// The most blocks it may hold: its prompt and every token it may produce.
    blocks: u32,
    /// For a decoder: the step count when it joined, and the first segment it decoded in.
    joined: u64,
    segment: usize,
    decoding: bool,
    /// Holds blocks (how many) in the scheduler; ended with the step in flight. A waiting
    /// sequence may hold blocks too: those the prefix cache had of its prompt (the newcomer's,
    /// which it takes at the start of the forecast).
    running: bool,
    held: u32,
    /// Of those, blocks another table holds too: they do not come back when it ends.
    shared: u32,
    ended: bool,
    /// It had its first token before the forecast (its TTFT promise is kept already).
    had_first: bool,
}

impl Seq<'_> {
    fn key(&self, i: usize) -> (Priority, Instant, SeqId, usize) {
        (self.request.priority, self.request.ttft_deadline, self.request.id, i)
    }
}

/// More sequences than the calendar of ends numbers ([`Ends`] keeps indices in `u32`).
const NONE_INDEX: usize = u32::MAX as usize;

/// Where a forecast that declined stopped: the step-by-step one is asked instead.
pub(super) struct Declined;

#[derive(Clone)]
struct Forecast<'a> {
    s: &'a Scheduler,
    margin: Duration,
    seqs: Vec<Seq<'a>>,
    fates: Fates,
    newcomer: Option<usize>,
    /// Steps completed (decodes advance one token a step), and steps planned (the horizon).
    k: u64,
    steps: usize,
    t: Instant,
    /// The decoders: how many, Σ (computed − joined) over them, their inter-token targets, and
    /// the step count at which each ends.
    decoders: u32,
    offset: i128,
    itls: Vec<(Duration, u32)>,
    ends: Ends,
    ended: Vec<usize>,
    /// Running sequences that still prefill, in the rule's order. (Sorted vectors, here and for
    /// the targets: a handful of entries each, where a tree's nodes cost more than a shift.)
    mid: Vec<(Priority, Instant, SeqId, usize)>,
    /// Waiting sequences in start order as far as resolved — each index is looked up only when
    /// the next step could start it, so a forecast that stops early looks up few — then the rest
    /// of the scheduler's queue, the newcomer until it is merged into the order (and where it
    /// stands there once it is), how many wait in all, and the next to start.
    waiting: Vec<usize>,
    queue: Peekable<btree_set::Iter<'a, (Priority, Instant, SeqId)>>,
    unmerged: Option<usize>,
    newcomer_at: Option<usize>,
    queued: usize,
    next: usize,
    /// Sequences holding blocks.
    running: u32,
    /// Free blocks beyond what every running sequence may still take: while it is not negative,
    /// no decode waits for a block and a mid-prefill chunk is never cut by the room left.
    slack: i64,
    /// Segments (a step with a prefill, or a run of decode steps) so far, and a stack of
    /// (segment, its longest step) whose steps decrease: the longest step since segment `j` is
    /// that of the first entry at or after `j`.
    segments: usize,
    peaks: Vec<(usize, Duration)>,
    /// The sequences that ended, in the order they did.
    finished: Vec<usize>,
}

/// The next step, composed: its decodes, its whole shape, how many waiting sequences it starts,
/// and whether the one after them was looked at and could not start (its chunk cut to nothing),
/// which stops those behind it.
#[derive(Debug, Clone, Copy)]
struct Next {
    decodes: StepShape,
    shape: StepShape,
    starts: usize,
    stopped: bool,
}

/// Whether a forecast goes on after a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Goes,
    Stops,
}

/// The forecast of [`super::simulate`] (with `newcomer` inserted and the early stop of
/// [`super::admit`]), or [`Declined`] where the step rule would do what this does not follow.
/// Fates carry `in_time` for the newcomer alone.
pub(super) fn run<'a>(
    s: &'a Scheduler,
    in_flight: Option<InFlight<'_>>,
    now: Instant,
    margin: Duration,
    newcomer: Option<&'a Request>,
    cached: u32,
) -> Result<Fates, Declined> {
    if !s.policy.discipline.keeps_deadlines() {
        return Err(Declined);
    }
    let mut f = Forecast::start(s, in_flight, now, margin, newcomer, cached)?;
    f.go()?;
    f.settle();
    Ok(f.fates)
}

/// What admission found from events.
#[derive(Debug, Clone, Copy)]
pub(super) enum Judged {
    /// The newcomer's own fate breaks one of its promises.
    Own(Fate),
    /// Taking it in would make an admitted sequence miss a promise it keeps without it.
    Harms,
    Keeps,
}

/// The forecast without the newcomer, where it forked from the one with it, and how it goes on.
type Fork<'a> = Option<(Forecast<'a>, Flow)>;

/// Where the forecasts with and without the newcomer part: the one without (if harm is to be
/// looked for), and how many sequences had ended by then (those ended alike in both).
struct Parted<'a> {
    without: Fork<'a>,
    ended: usize,
    flow: Flow,
}

/// [`super::admit`]'s question from events. The forecasts with and without the newcomer are one
/// until the step rule first looks at it — it starts, or it cannot and so holds back those
/// queued behind it; from there they go on side by side, the one without only as far as a
/// sequence that ends broken with the newcomer needs it to tell whether it was broken anyway: the
/// first such harm ends the question. Once the newcomer's first token is sure to be late, no
/// harm is looked for: the forecast with it runs on only to say when that token comes.
/// [`Declined`] where either forecast declines.
pub(super) fn judge(
    s: &Scheduler,
    in_flight: Option<InFlight<'_>>,
    now: Instant,
    margin: Duration,
    r: &Request,
    cached: u32,
) -> Result<Judged, Declined> {
    if !s.policy.discipline.keeps_deadlines() {
        return Err(Declined);
    }
    let mut with = Forecast::start(s, in_flight, now, margin, Some(r), cached)?;
    let me = with.newcomer.expect("the newcomer is forecast");
    let mut members = Vec::new();
    let Parted { mut without, ended: mut seen, mut flow } = with.until_start(me, &mut members)?;
    while flow == Flow::Goes {
        flow = with.step(&mut members)?;
        if with.first_late() {
            seen = with.finished.len();
            continue;
        }
        for k in seen..with.finished.len() {
            let i = with.finished[k];
            if i == me || !with.breaks(i, &with.fates.fates[i]) {
                continue;
            }
            let (w, w_flow) = match &mut without {
                Some(w) => w,
                None => without.insert((Forecast::start(s, in_flight, now, margin, None, 0)?, Flow::Goes)),
            };
            if w.ends_in_time(with.fates.ids[i], w_flow, &mut members)? {
                return Ok(Judged::Harms);
            }
        }
        seen = with.finished.len();
    }
    with.settle_one(me);
    let fate = with.fates.fates[me];
    if super::broken(r, &fate, margin, false).is_some() {
        return Ok(Judged::Own(fate));
    }
    with.settle();
    let victims: Vec<usize> =
        (0..with.fates.fates.len()).filter(|&i| i != me && with.breaks(i, &with.fates.fates[i])).collect();
    if victims.is_empty() {
        return Ok(Judged::Keeps);
    }
    let mut w = match without {
        Some((w, _)) => w,
        None => Forecast::start(s, in_flight, now, margin, None, 0)?,
    };
    w.go()?;
    w.settle();
    let harms = victims.into_iter().any(|i| {
        let j = w.index(with.fates.ids[i]);
        !w.breaks(j, &w.fates.fates[j])
    });
    Ok(if harms { Judged::Harms } else { Judged::Keeps })
}

/// Every sequence in id order, the newcomer in its place; the most tokens one still produces
/// (no end falls further ahead); whether two tenants wait in one tier.
struct Gathered<'a> {
    ids: Vec<SeqId>,
    seqs: Vec<Seq<'a>>,
    fates: Vec<Fate>,
    newcomer: Option<usize>,
    horizon: u32,
    shared_tier: bool,
}

fn gather<'a>(s: &'a Scheduler, newcomer: Option<&'a Request>, cached: u32, count: usize) -> Gathered<'a> {
    let block = s.pool.block_size();
    // Tables share blocks (a cached prefix): each sequence's shared ones are counted.
    let sharing = s.pool.shared() > 0;
    let (mut ids, mut seqs, mut fates) =
        (Vec::with_capacity(count), Vec::with_capacity(count), Vec::with_capacity(count));
    let (mut horizon, mut shared_tier) = (0, false);
    let mut tenants: [Option<TenantId>; 2] = [None, None];
    let mut push = |request: &'a Request, q: Option<&'a crate::generation::scheduler::Seq>| {
        let (generated, computed) = q.map_or((0, cached), |q| (q.generated, q.computed));
        horizon = horizon.max(request.max_tokens - generated);
        if !q.is_some_and(|q| q.running) {
            let tier = &mut tenants[request.priority.index()];
            shared_tier |= tier.is_some_and(|t| t != request.tenant);
            *tier = Some(request.tenant);
        }
        ids.push(request.id);
        seqs.push(Seq {
            request,
            known: request.prompt + generated,
            computed,
            generated,
            blocks: blocks_for(request.prompt + request.max_tokens, block),
            joined: 0,
            segment: 0,
            decoding: false,
            running: q.is_some_and(|q| q.running),
            // The newcomer holds its cached blocks from the start (taken out of the slack
            // there): its first chunk needs only the rest, and all of them come back when it ends.
            held: q.map_or(cached / block, |q| q.table.len() as u32),
            shared: q
                .filter(|_| sharing)
                .map_or(0, |q| q.table.iter().filter(|b| s.pool.references(**b) > 1).count() as u32),
            ended: false,
            had_first: q.is_some_and(|q| q.first_token.is_some()),
        });
        fates.push(Fate { first: q.and_then(|q| q.first_token), ..Fate::default() });
        ids.len() - 1
    };
    let mut pending = newcomer;
    let mut at = None;
    for (id, q) in &s.seqs {
        if let Some(r) = pending.filter(|r| r.id < *id) {
            at = Some(push(r, None));
            pending = None;
        }
        push(&q.request, Some(q));
    }
    if let Some(r) = pending {
        at = Some(push(r, None));
    }
    Gathered { ids, seqs, fates, newcomer: at, horizon, shared_tier }
}

impl<'a> Forecast<'a> {
    fn start(
        s: &'a Scheduler,
        in_flight: Option<InFlight<'_>>,
        now: Instant,
        margin: Duration,
        newcomer: Option<&'a Request>,
        cached: u32,
    ) -> Result<Forecast<'a>, Declined> {
        let count = s.seqs.len() + usize::from(newcomer.is_some());
        if count >= NONE_INDEX {
            return Err(Declined);
        }
        let Gathered { ids, seqs, fates, newcomer: newcomer_at, horizon, shared_tier } =
            gather(s, newcomer, cached, count);
        // Two tenants waiting in one tier: their fair shares order them (not followed here).
        if shared_tier {
            return Err(Declined);
        }
        let mut f = Forecast {
            s,
            margin,
            seqs,
            fates: Fates { ids, fates },
            newcomer: newcomer_at,
            k: 0,
            steps: 0,
            t: now,
            decoders: 0,
            offset: 0,
            itls: Vec::new(),
            ends: Ends::new(count, u64::from(horizon)),
            ended: Vec::new(),
            mid: Vec::new(),
            waiting: Vec::new(),
            queue: s.waiting.iter().peekable(),
            unmerged: newcomer_at,
            newcomer_at: None,
            queued: s.waiting.len() + usize::from(newcomer.is_some()),
            next: 0,
            running: 0,
            // The newcomer takes its cached blocks at once: free ones, or ones another table
            // holds — which the forecast gives back when that table ends (its `shared` counted
            // them as its own), though the newcomer holds them still: taken here, they balance.
            slack: i64::from(s.pool.free()) - i64::from(cached / s.pool.block_size()),
            segments: 0,
            peaks: Vec::new(),
            finished: Vec::new(),
        };
        if let Some(step) = in_flight {
            f.apply(step);
        }
        f.hold_running()?;
        f.resolve();
        Ok(f)
    }

    /// The step in flight ends first: its members' tokens are computed, those that sampled have a
    /// token, those that reached `max_tokens` end.
    fn apply(&mut self, step: InFlight<'_>) {
        self.t = self.t.max(step.end);
        for m in &step.plan.members {
            let Ok(i) = self.fates.ids.binary_search(&m.id) else { continue };
            if self.newcomer == Some(i) {
                continue;
            }
            if m.decode {
                self.fates.fates[i].longest_step = self.fates.fates[i].longest_step.max(step.plan.expected);
            }
            let q = &mut self.seqs[i];
            q.computed += m.len;
            if m.sample {
                q.generated += 1;
                q.known += 1;
                q.ended = q.generated == q.request.max_tokens;
                self.token(i);
            }
        }
    }

    /// The running sequences become decoders or mid-prefill ones, each taking what it may still
    /// hold out of the slack; declines where blocks may already run short.
    fn hold_running(&mut self) -> Result<(), Declined> {
        for i in 0..self.seqs.len() {
            let q = self.seqs[i];
            if q.ended {
                self.fates.fates[i].end = Some(self.t);
                self.finished.push(i);
                self.slack += i64::from(q.held - q.shared);
            } else if q.running {
                self.running += 1;
                self.slack -= i64::from(q.blocks.saturating_sub(q.held));
                if q.generated > 0 && q.computed > 0 && q.known - q.computed == 1 {
                    self.join(i);
                } else {
                    self.insert_mid(q.key(i));
                }
            }
        }
        if self.slack < 0 {
            return Err(Declined);
        }
        Ok(())
    }

    /// Resolves the start order as far as the next step could reach (every free seat filled),
    /// the newcomer merged in its place: priority, then first-token deadline, then id.
    fn resolve(&mut self) {
        let seats = self.s.policy.max_sequences.saturating_sub(self.running) as usize;
        let want = (self.next + seats).min(self.queued);
        while self.waiting.len() < want {
            let head = self.queue.peek().map(|k| **k);
            let newcomer = self.unmerged.filter(|i| {
                let r = self.seqs[*i].request;
                head.is_none_or(|k| (r.priority, r.ttft_deadline, r.id) < k)
            });
            let i = match (newcomer, head) {
                (Some(i), _) => {
                    self.unmerged = None;
                    self.newcomer_at = Some(self.waiting.len());
                    i
                }
                (None, Some((.., id))) => {
                    self.queue.next();
                    self.index(id)
                }
                (None, None) => unreachable!("{} sequences wait", self.queued),
            };
            self.waiting.push(i);
        }
    }

    fn insert_mid(&mut self, key: (Priority, Instant, SeqId, usize)) {
        let at = self.mid.partition_point(|k| *k < key);
        self.mid.insert(at, key);
    }

    /// Sequence `i` has a token at `self.t`.
    fn token(&mut self, i: usize) {
        let fate = &mut self.fates.fates[i];
        fate.first.get_or_insert(self.t);
        if self.newcomer == Some(i) && self.t + self.margin <= self.seqs[i].request.deadline {
            fate.in_time += 1;
        }
    }

    /// Sequence `i` (running, its prefill done) decodes from the next step on.
    fn join(&mut self, i: usize) {
        let q = &mut self.seqs[i];
        q.joined = self.k;
        q.segment = self.segments;
        q.decoding = true;
        self.decoders += 1;
        self.offset += i128::from(q.computed) - i128::from(self.k);
        let itl = q.request.itl;
        match self.itls.binary_search_by_key(&itl, |(d, _)| *d) {
            Ok(at) => self.itls[at].1 += 1,
            Err(at) => self.itls.insert(at, (itl, 1)),
        }
        let end = self.k + u64::from(q.request.max_tokens - q.generated);
        self.ends.put(end, i);
    }

    /// The longest step since segment `from`.
    fn longest_since(&self, from: usize) -> Duration {
        let at = self.peaks.partition_point(|(j, _)| *j < from);
        self.peaks.get(at).map_or(Duration::ZERO, |(_, d)| *d)
    }

    fn segment(&mut self, longest: Duration) {
        while self.peaks.last().is_some_and(|(_, d)| *d <= longest) {
            self.peaks.pop();
        }
        self.peaks.push((self.segments, longest));
        self.segments += 1;
        if let Some(i) = self.newcomer.filter(|i| self.is_decoding(*i)) {
            let fate = &mut self.fates.fates[i];
            fate.longest_step = fate.longest_step.max(longest);
        }
    }

    fn is_decoding(&self, i: usize) -> bool {
        self.seqs[i].decoding
    }

    /// The decodes of the next step, as one shape.
    fn decode_shape(&self) -> StepShape {
        let d = i128::from(self.decoders);
        // Each decoder's part: its computed tokens now, plus the one it feeds.
        let context = (self.offset + d * i128::from(self.k) + d) as u64;
        StepShape { decodes: self.decoders, prefill: 0, context, attended: context }
    }

    /// Runs until the newcomer `me` starts (or the forecast stops first), and returns the
    /// forecast without it — this one as it stood before the first step whose rule looked at the
    /// newcomer (started it, or found it could not start, which holds back every sequence queued
    /// behind it: without it, the next in line might have started), the newcomer taken out of the
    /// queue: the one copy an admission makes — unless the newcomer's first token is sure to be
    /// late by then (no harm is looked for); with how many had ended by then and how this one
    /// goes on.
    fn until_start(&mut self, me: usize, members: &mut Vec<(usize, u32)>) -> Result<Parted<'a>, Declined> {
        debug_assert_eq!(self.newcomer, Some(me));
        let (mut parted, mut flow) = (None, Flow::Goes);
        while self.newcomer_at.is_none_or(|at| self.next <= at) {
            let Some(next) = self.compose(members)? else {
                flow = Flow::Stops;
                break;
            };
            let looked_at = self
                .newcomer_at
                .filter(|at| self.next + next.starts > *at || (next.stopped && self.next + next.starts == *at));
            if let (Some(at), None) = (looked_at, &parted) {
                let without = (!self.first_late()).then(|| {
                    let mut without = self.clone();
                    without.waiting.remove(at);
                    without.queued -= 1;
                    (without.newcomer, without.newcomer_at) = (None, None);
                    without.resolve();
                    (without, Flow::Goes)
                });
                parted = Some((without, self.finished.len()));
            }
            self.commit(next, members);
        }
        let (without, ended) = parted.unwrap_or((None, self.finished.len()));
        Ok(Parted { without, ended, flow })
    }

    /// The newcomer's first token came late, or has not come and cannot come in time: the
    /// earliest it could is the end of the next step, later than now.
    fn first_late(&self) -> bool {
        self.newcomer.is_some_and(|i| {
            let first = self.fates.fates[i].first.unwrap_or(self.t);
            first + self.margin > self.seqs[i].request.ttft_deadline
        })
    }

    /// Whether sequence `id` ends keeping its promises in this forecast, run (going as `flow`
    /// says) until it ends.
    fn ends_in_time(&mut self, id: SeqId, flow: &mut Flow, members: &mut Vec<(usize, u32)>) -> Result<bool, Declined> {
        let j = self.index(id);
        while self.fates.fates[j].end.is_none() && *flow == Flow::Goes {
            *flow = self.step(members)?;
        }
        Ok(self.fates.fates[j].end.is_some() && !self.breaks(j, &self.fates.fates[j]))
    }

    /// Where sequence `id` is in this forecast.
    fn index(&self, id: SeqId) -> usize {
        self.fates.ids.binary_search(&id).expect("every held sequence is forecast")
    }

    /// Whether `fate` breaks one of sequence `i`'s promises.
    fn breaks(&self, i: usize, fate: &Fate) -> bool {
        let q = &self.seqs[i];
        super::broken(q.request, fate, self.margin, q.had_first).is_some()
    }

    /// The newcomer's promise is broken past mending ([`super::run`]'s `lost`).
    fn lost(&self) -> bool {
        self.newcomer.is_some_and(|i| {
            let (f, r) = (&self.fates.fates[i], &self.seqs[i].request);
            f.first.is_some_and(|first| first + self.margin > r.ttft_deadline) || f.longest_step > r.itl
        })
    }

    fn go(&mut self) -> Result<(), Declined> {
        let mut members = Vec::new();
        while self.step(&mut members)? == Flow::Goes {}
        Ok(())
    }

    /// The next step (or run of decode steps), as the rule composes it: decodes, then chunks of
    /// mid-prefill sequences in order, then of waiting ones; [`Flow::Stops`] when nothing is left,
    /// the newcomer's promise is lost, or the horizon is reached.
    fn step(&mut self, members: &mut Vec<(usize, u32)>) -> Result<Flow, Declined> {
        Ok(match self.compose(members)? {
            Some(next) => {
                self.commit(next, members);
                Flow::Goes
            }
            None => Flow::Stops,
        })
    }

    /// The next step composed, its chunks in `members` (the waiting sequences it starts last),
    /// the forecast not yet moved; `None` where the forecast stops.
    fn compose(&self, members: &mut Vec<(usize, u32)>) -> Result<Option<Next>, Declined> {
        let policy = self.s.policy;
        let empty = self.decoders == 0 && self.mid.is_empty() && self.next == self.queued;
        if empty || self.lost() || self.steps >= MAX_STEPS {
            return Ok(None);
        }
        let decodes = self.decode_shape();
        let cap = self.itls.first().map(|(itl, _)| itl.saturating_sub(self.s.step_reserve));
        let mut shape = decodes;
        let mut budget = policy.max_batch_tokens.saturating_sub(self.decoders);
        members.clear();
        for &(.., i) in &self.mid {
            if budget == 0 {
                break;
            }
            let q = &self.seqs[i];
            let n = self.chunk(cap, shape, q, budget);
            if n > 0 {
                shape = shape.join(StepShape::part(q.computed, n, false));
                budget -= n;
                members.push((i, n));
            }
        }
        let (starts, stopped) = self.starting(cap, &mut shape, &mut budget, members)?;
        if members.is_empty() && self.decoders == 0 {
            // Nothing could run: the rule would preempt (not followed) or stop.
            return if self.running > 1 { Err(Declined) } else { Ok(None) };
        }
        Ok(Some(Next { decodes, shape, starts, stopped }))
    }

    /// Moves the forecast over the step `next` composed with `members`.
    fn commit(&mut self, next: Next, members: &[(usize, u32)]) {
        for &(i, _) in &members[members.len() - next.starts..] {
            let q = self.seqs[i];
            self.slack -= i64::from(q.blocks.saturating_sub(q.held));
            self.running += 1;
            self.insert_mid(q.key(i));
        }
        self.next += next.starts;
        if members.is_empty() {
            self.decode_run(next.decodes);
        } else {
            self.prefill_step(next.shape, members);
        }
        self.resolve();
    }

    /// How many waiting sequences start with the step, in order while seats, budget and the cap
    /// allow, each with its first chunk, and whether the next one was looked at and stopped them
    /// (its chunk cut to nothing); declines where its blocks might not be free.
    fn starting(
        &self,
        cap: Option<Duration>,
        shape: &mut StepShape,
        budget: &mut u32,
        members: &mut Vec<(usize, u32)>,
    ) -> Result<(usize, bool), Declined> {
        let policy = self.s.policy;
        let (mut next, mut slack, mut running) = (self.next, self.slack, self.running);
        while next < self.queued && *budget > 0 && running < policy.max_sequences {
            // Resolved: fewer start than there are free seats.
            let i = self.waiting[next];
            let q = &self.seqs[i];
            let n = self.chunk(cap, *shape, q, *budget);
            if n == 0 {
                return Ok((next - self.next, true));
            }
            // Room for all it may ever hold, beyond the watermark, or the rule's room check
            // may bind: not followed here.
            if slack < i64::from(policy.watermark) + i64::from(q.blocks.saturating_sub(q.held)) {
                return Err(Declined);
            }
            slack -= i64::from(q.blocks.saturating_sub(q.held));
            running += 1;
            next += 1;
            *shape = shape.join(StepShape::part(q.computed, n, false));
            *budget -= n;
            members.push((i, n));
        }
        Ok((next - self.next, false))
    }

    /// The chunk of `q` a step of `shape` so far takes: the rest of its prompt within the budget,
    /// cut to the cap.
    fn chunk(&self, cap: Option<Duration>, shape: StepShape, q: &Seq<'_>, budget: u32) -> u32 {
        let n = (q.known - q.computed).min(budget);
        cap.map_or(n, |cap| self.s.estimator.prefill_within(shape, q.computed, cap, n))
    }

    /// Steps that decode and nothing else, up to the next end (no prefill can join before one:
    /// the decodes only grow, and with them the steps a chunk would join).
    fn decode_run(&mut self, first: StepShape) {
        let end = self.ends.after(self.k).expect("decoders end");
        let mut n = (end - self.k).min((MAX_STEPS - self.steps) as u64);
        let run = DecodeRun::new(&self.s.estimator, first, self.decoders);
        let newcomer = self.newcomer.filter(|i| self.is_decoding(*i));
        if let Some(i) = newcomer {
            let itl = self.seqs[i].request.itl.as_nanos() as u64;
            if let Some(over) = run.first_over(n, itl) {
                n = over + 1;
            }
            let deadline = self.seqs[i].request.deadline;
            let budget = deadline.checked_duration_since(self.t + self.margin).map_or(0, |d| d.as_nanos() as u64);
            if self.t + self.margin <= deadline {
                self.fates.fates[i].in_time += run.within(n, budget) as u32;
            }
        }
        self.t += Duration::from_nanos(run.sum(n));
        self.k += n;
        self.steps += n as usize;
        self.segment(Duration::from_nanos(run.step(n - 1)));
        self.take_ends();
    }

    fn prefill_step(&mut self, shape: StepShape, members: &[(usize, u32)]) {
        let expected = self.s.estimator.estimate(shape);
        self.t += expected;
        self.k += 1;
        self.steps += 1;
        self.segment(expected);
        if let Some(i) = self.newcomer.filter(|i| self.is_decoding(*i)) {
            if self.t + self.margin <= self.seqs[i].request.deadline {
                self.fates.fates[i].in_time += 1;
            }
        }
        for &(i, n) in members {
            let q = &mut self.seqs[i];
            q.computed += n;
            if q.computed < q.known {
                continue;
            }
            q.generated += 1;
            q.known += 1;
            let q = *q;
            if let Ok(at) = self.mid.binary_search(&q.key(i)) {
                self.mid.remove(at);
            }
            self.token(i);
            if q.generated == q.request.max_tokens {
                self.fates.fates[i].end = Some(self.t);
                self.finished.push(i);
                self.running -= 1;
                self.slack += i64::from(q.blocks - q.shared);
            } else {
                self.join(i);
            }
        }
        self.take_ends();
    }

    /// Decoders whose last token came with the step just done.
    fn take_ends(&mut self) {
        let mut ended = std::mem::take(&mut self.ended);
        self.ends.take(self.k, &mut ended);
        for i in ended.drain(..) {
            let q = self.seqs[i];
            self.fates.fates[i].end = Some(self.t);
            self.finished.push(i);
            self.leave(i, q);
        }
        self.ended = ended;
    }

    fn leave(&mut self, i: usize, q: Seq<'_>) {
        self.seqs[i].decoding = false;
        let longest = self.longest_since(q.segment);
        let fate = &mut self.fates.fates[i];
        fate.longest_step = fate.longest_step.max(longest);
        self.decoders -= 1;
        self.offset -= i128::from(q.computed) - i128::from(q.joined);
        if let Ok(at) = self.itls.binary_search_by_key(&q.request.itl, |(d, _)| *d) {
            self.itls[at].1 -= 1;
            if self.itls[at].1 == 0 {
                self.itls.remove(at);
            }
        }
        self.running -= 1;
        self.slack += i64::from(q.blocks - q.shared);
    }

    /// Brings every sequence still decoding at the stop its longest step, so that the fates are
    /// complete.
    fn settle(&mut self) {
        for i in 0..self.seqs.len() {
            self.settle_one(i);
        }
    }

    /// [`Self::settle`] for sequence `i` alone.
    fn settle_one(&mut self, i: usize) {
        if self.seqs[i].decoding {
            let longest = self.longest_since(self.seqs[i].segment);
            let fate = &mut self.fates.fates[i];
            fate.longest_step = fate.longest_step.max(longest);
        }
    }
}
