//! The concurrency window in front of an LLM server that batches by itself (vLLM, SGLang, TGI,
//! llama.cpp's server): the sidecar does not compose steps, it decides how many requests the
//! upstream has in flight — the most that keeps the measured inter-token time within the
//! tightest target of the requests running — and queues the rest under its own deadline rules.
//! A pure state machine like the other ledgers: events in with `now`, effects out.
//!
//! What it learns of the upstream, online and tail-aware (the same least-squares fit plus the
//! 90th percentile of recent errors as the step and batch estimators):
//! - time to first token as a function of the prompt's tokens and the requests in flight;
//! - time between tokens as a function of the requests in flight.
//!
//! The queue's order is priority, then, within one, the tenants interleaved by their fair shares of
//! the upstream's slots ([`crate::tenant`]: each request charges its tenant its prompt and
//! `max_tokens`, what it may hold a slot for), each tenant's own requests in TTFT-deadline order;
//! with one tenant, priority then TTFT deadline. Admission forecasts, in that order, when each
//! waiting request would get a slot (running requests taking all of their `max_tokens`), its first
//! token and its last; a request is refused at arrival when its promises would not hold, or when
//! taking it would break those of a waiting request that keeps them without it. Waiting requests
//! whose deadline passes are answered 504 and never sent; a running one is aborted upstream at its
//! deadline. Upstream errors before the first token are retried while time and attempts remain.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::time::Duration;

use std::time::Instant;

use super::forecast::infeasible;
use super::sequence::{End, FinishReason, Queued, Request, SeqId};
use crate::estimate::Linear;
use crate::margin::Margin;
use crate::outcome::{Outcome, Refusal};
use crate::tenant::{Shares, TenantId};
use crate::ticket::Priority;

/// The window's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowPolicy {
    /// Requests in flight upstream at most (its slots, e.g. llama.cpp's `n_parallel`).
    pub max_in_flight: u32,
    pub max_queue: usize,
    pub max_queue_bytes: u64,
    pub max_queue_tokens: u64,
    /// The upstream model's context: prompt plus produced tokens.
    pub max_context: u32,
    /// Sends a request may take when the upstream fails before its first token.
    pub max_attempts: u32,
}

/// What the upstream is taken to cost before anything is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpstreamCost {
    pub ttft_fixed: Duration,
    pub ttft_per_prompt_token: Duration,
    pub ttft_per_running: Duration,
    pub itl_fixed: Duration,
    pub itl_per_running: Duration,
}

impl Default for UpstreamCost {
    fn default() -> Self {
        UpstreamCost {
            ttft_fixed: Duration::from_millis(50),
            ttft_per_prompt_token: Duration::from_micros(200),
            ttft_per_running: Duration::from_millis(5),
            itl_fixed: Duration::from_millis(20),
            itl_per_running: Duration::from_millis(2),
        }
    }
}

/// The upstream's measured times.
#[derive(Debug, Clone)]
pub struct UpstreamModel {
    ttft: Linear,
    itl: Linear,
}

/// What a request charges its tenant's share of slots: its prompt and the most it may produce,
/// the tokens it may hold a slot for (and what a tenant's `tokensPerMinute` counts).
fn slot_cost(r: &Request) -> u64 {
    u64::from(r.prompt) + u64::from(r.max_tokens)
}

fn ns(d: Duration) -> f64 {
    d.as_nanos() as f64
}

impl UpstreamModel {
    pub fn new(cost: UpstreamCost) -> Self {
        UpstreamModel {
            ttft: Linear::new([ns(cost.ttft_fixed), ns(cost.ttft_per_prompt_token), ns(cost.ttft_per_running), 0.0]),
            itl: Linear::new([ns(cost.itl_fixed), ns(cost.itl_per_running), 0.0, 0.0]),
        }
    }

    /// Time to first token of a prompt of `prompt` tokens sent with `running` requests in flight
    /// (itself included).
    pub fn ttft(&self, prompt: u32, running: u32) -> Duration {
        self.ttft.estimate([1.0, f64::from(prompt), f64::from(running), 0.0])
    }

    /// Time between tokens with `running` requests in flight.
    pub fn itl(&self, running: u32) -> Duration {
        self.itl.estimate([1.0, f64::from(running), 0.0, 0.0])
    }

    /// The model as it started, before anything was measured (admission's probes are judged by
    /// it: [`crate::evidence`], rule 3).
    pub fn prior(&self) -> UpstreamModel {
        UpstreamModel { ttft: self.ttft.prior(), itl: self.itl.prior() }
    }

    fn observe_ttft(&mut self, prompt: u32, running: u32, took: Duration, at: Instant) {
        self.ttft.observe([1.0, f64::from(prompt), f64::from(running), 0.0], took, at);
    }

    fn observe_itl(&mut self, running: u32, gap: Duration, at: Instant) {
        self.itl.observe([1.0, f64::from(running), 0.0, 0.0], gap, at);
    }
}

/// What happened.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Submit(Request),
    /// Its caller went away.
    Cancel(SeqId),
    /// The upstream sent a request's first token.
    First(SeqId),
    /// The upstream sent another token.
    Token(SeqId),
    /// The upstream finished the request.
    Done {
        id: SeqId,
        reason: FinishReason,
    },
    /// The upstream request failed: a refusal of the upstream's own (429, 503: with its outcome
    /// and `Retry-After`), or an error (`outcome` `Failed`).
    Failed {
        id: SeqId,
        refusal: Refusal,
    },
    /// Whether the upstream answers its health check.
    Ready(bool),
    /// The shell's timer woke it this late (part of the deadline margin).
    Woke(Duration),
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Send the request upstream.
    Release { id: SeqId },
    /// Close its upstream request (its deadline came, or its caller left).
    Abort { id: SeqId },
    /// It ended; `admitted` is false for a refusal at admission.
    End { id: SeqId, end: End, admitted: bool },
    /// It was sent upstream after waiting this long.
    Started { id: SeqId, waited: Duration },
}

#[derive(Debug, Clone, Copy)]
struct Flight {
    sent: Instant,
    /// In flight when it was sent, itself included.
    running_at_send: u32,
    first: Option<Instant>,
    last: Instant,
    /// In flight when its last token came: what its next gap is learned at. The gap is the time
    /// of the steps of the batch in flight when it began: a request that ends at its end took
    /// part in them, and one sent during it joins the steps after (counting it, as the more of
    /// the two counts did, taught the window that more in flight cost less than they do).
    running_at_last: u32,
    tokens: u32,
}

#[derive(Debug, Clone)]
struct Entry {
    request: Request,
    flight: Option<Flight>,
    attempts: u32,
}

impl Entry {
    fn order(&self) -> (Priority, Instant, SeqId) {
        (self.request.priority, self.request.ttft_deadline, self.request.id)
    }
}

/// One model version's window. See the module documentation.
#[derive(Debug, Clone)]
pub struct Window {
    policy: WindowPolicy,
    model: UpstreamModel,
    margin: Margin,
    entries: BTreeMap<SeqId, Entry>,
    waiting: BTreeSet<(Priority, Instant, SeqId)>,
    running: BTreeSet<SeqId>,
    queued_bytes: u64,
    queued_tokens: u64,
    ready: bool,
    /// The tenants' fair shares of upstream slots, one per priority tier.
    shares: [Shares; 2],
}

impl Window {
    pub fn new(policy: WindowPolicy, cost: UpstreamCost, margin: Duration) -> Self {
        Window {
            policy,
            model: UpstreamModel::new(cost),
            margin: Margin::new(margin),
            entries: BTreeMap::new(),
            waiting: BTreeSet::new(),
            running: BTreeSet::new(),
            queued_bytes: 0,
            queued_tokens: 0,
            ready: false,
            shares: Default::default(),
        }
    }

    pub fn policy(&self) -> &WindowPolicy {
        &self.policy
    }

    pub fn model(&self) -> &UpstreamModel {
        &self.model
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

    pub fn is_ready(&self) -> bool {
        self.ready
    }

    pub fn is_idle(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn oldest_waiting(&self) -> Option<Instant> {
        self.waiting.iter().map(|(_, _, id)| self.entries[id].request.arrival).min()
    }

    /// The most requests in flight that keep the estimated inter-token time within the tightest
    /// target of those running and of the next to go (one-token requests have none); at least one.
    pub fn window(&self) -> u32 {
        self.window_with(None)
    }

    /// [`Self::window`] with a newcomer in the queue: the next to go is the first of
    /// [`Self::queue_order`], which may be the newcomer or another tenant's request.
    fn window_with(&self, extra: Option<&Request>) -> u32 {
        self.window_for(self.queue_order(extra).first().map(|(_, r)| r))
    }

    /// The window with those running and `next` to go; without `next`, the most any next
    /// request allows.
    fn window_for(&self, next: Option<&Request>) -> u32 {
        let targets = self.running.iter().map(|id| &self.entries[id].request).chain(next);
        let Some(tightest) = targets.filter_map(|r| r.itl_target()).min() else {
            return self.policy.max_in_flight;
        };
        (1..=self.policy.max_in_flight).rev().find(|n| self.model.itl(*n) <= tightest).unwrap_or(1)
    }

    /// The next instant a deadline comes.
    pub fn next_wake(&self) -> Option<Instant> {
        self.entries
            .values()
            .map(|e| {
                let first_pending = e.flight.is_none_or(|f| f.first.is_none());
                if first_pending {
                    e.request.ttft_deadline.min(e.request.deadline)
                } else {
                    e.request.deadline
                }
            })
            .min()
    }

    pub fn step(&mut self, now: Instant, events: Vec<Event>, effects: &mut Vec<Effect>) {
        // A late wake first: it may say that the process stalled while a token was on its way,
        // and such a gap is not evidence about the upstream.
        let events = self.margin.wakes_first(now, events, |e| match e {
            Event::Woke(late) => Some(*late),
            _ => None,
        });
        let mut commands = Vec::new();
        for event in events {
            match event {
                Event::First(id) => self.first(id, now),
                Event::Token(id) => self.token(id, now),
                Event::Done { id, reason } => {
                    if self.running.contains(&id) {
                        self.remove(id);
                        effects.push(Effect::End { id, end: End::Finished(reason), admitted: true });
                    }
                }
                Event::Failed { id, refusal } => self.failed(id, refusal, now, effects),
                Event::Ready(ready) => self.ready = ready,
                command => commands.push(command),
            }
        }
        self.expire(now, effects);
        for command in commands {
            match command {
                Event::Submit(r) => self.submit(r, now, effects),
                Event::Cancel(id) => {
                    if self.running.contains(&id) {
                        effects.push(Effect::Abort { id });
                    }
                    self.remove(id);
                }
                _ => unreachable!("sorted above"),
            }
        }
        self.release(now, effects);
    }

    fn first(&mut self, id: SeqId, now: Instant) {
        let Some(entry) = self.entries.get_mut(&id) else { return };
        let Some(flight) = entry.flight.as_mut() else { return };
        if flight.first.is_none() {
            flight.first = Some(now);
            flight.last = now;
            flight.running_at_last = self.running.len() as u32;
            flight.tokens = 1;
            let (prompt, running, took) = (entry.request.prompt, flight.running_at_send, now - flight.sent);
            if self.margin.evidence(flight.sent, now) {
                self.model.observe_ttft(prompt, running, took, now);
            }
        }
    }

    fn token(&mut self, id: SeqId, now: Instant) {
        let running = self.running.len() as u32;
        let Some(flight) = self.entries.get_mut(&id).and_then(|e| e.flight.as_mut()) else { return };
        let (gap, since) = (now - flight.last, flight.last);
        let during = flight.running_at_last;
        flight.last = now;
        flight.running_at_last = running;
        flight.tokens += 1;
        if self.margin.evidence(since, now) {
            self.model.observe_itl(during, gap, now);
        }
    }

    fn failed(&mut self, id: SeqId, refusal: Refusal, now: Instant, effects: &mut Vec<Effect>) {
        let Some(entry) = self.entries.get(&id) else { return };
        let started = entry.flight.is_some_and(|f| f.first.is_some());
        let r = entry.request;
        let retry = refusal.outcome == Outcome::Failed
            && !started
            && entry.attempts < self.policy.max_attempts
            && now + self.model.ttft(r.prompt, self.running.len() as u32) + self.margin.get() <= r.ttft_deadline;
        if retry {
            // Back in the queue by its TTFT deadline among its tenant's own (with one tenant, the
            // front of its priority), charged nothing more ([`Self::queue_order`]).
            self.running.remove(&id);
            let entry = self.entries.get_mut(&id).expect("held");
            entry.flight = None;
            let order = entry.order();
            self.waiting.insert(order);
            self.queued_bytes += r.bytes;
            self.queued_tokens += u64::from(r.prompt);
            return;
        }
        self.remove(id);
        effects.push(Effect::End { id, end: End::Unfinished(refusal), admitted: true });
    }

    fn remove(&mut self, id: SeqId) {
        let Some(entry) = self.entries.remove(&id) else { return };
        if self.waiting.remove(&entry.order()) {
            self.queued_bytes -= entry.request.bytes;
            self.queued_tokens -= u64::from(entry.request.prompt);
        }
        self.running.remove(&id);
    }

    fn expire(&mut self, now: Instant, effects: &mut Vec<Effect>) {
        let due: Vec<(SeqId, bool, Refusal)> = self
            .entries
            .values()
            .filter_map(|e| {
                let r = &e.request;
                let first = e.flight.and_then(|f| f.first);
                let ms = |t: Instant| (t - r.arrival).as_millis();
                let refusal = if now >= r.deadline {
                    Refusal::new(
                        Outcome::Expired,
                        format!("deadline passed after {} ms; the deadline was {} ms", ms(now), ms(r.deadline)),
                    )
                } else if first.is_none() && now >= r.ttft_deadline {
                    Refusal::new(
                        Outcome::Expired,
                        format!(
                            "no first token by the TTFT deadline: {} ms after arrival; the TTFT deadline was {} ms",
                            ms(now),
                            ms(r.ttft_deadline)
                        ),
                    )
                } else {
                    return None;
                };
                Some((r.id, e.flight.is_some(), refusal))
            })
            .collect();
        for (id, sent, refusal) in due {
            if sent {
                effects.push(Effect::Abort { id });
            }
            self.remove(id);
            effects.push(Effect::End { id, end: End::Unfinished(refusal), admitted: true });
        }
    }

    fn release(&mut self, now: Instant, effects: &mut Vec<Effect>) {
        if !self.ready {
            return;
        }
        if self.waiting.is_empty() || self.running.len() as u32 >= self.window_for(None) {
            return;
        }
        // The queue's order already counts each release's charge (the merge's), so its prefix is
        // what goes, as far as the window with each next one allows.
        for (id, request) in self.queue_order(None) {
            if self.running.len() as u32 >= self.window_for(Some(&request)) {
                break;
            }
            self.waiting.remove(&(request.priority, request.ttft_deadline, id));
            // A retry (its upstream failed before the first token) is not charged again.
            if self.entries[&id].attempts == 0 {
                self.charge(&request);
            }
            let running_at_send = self.running.len() as u32 + 1;
            let entry = self.entries.get_mut(&id).expect("held");
            self.queued_bytes -= entry.request.bytes;
            self.queued_tokens -= u64::from(entry.request.prompt);
            entry.attempts += 1;
            entry.flight = Some(Flight {
                sent: now,
                running_at_send,
                first: None,
                last: now,
                running_at_last: running_at_send,
                tokens: 0,
            });
            self.running.insert(id);
            effects.push(Effect::Release { id });
            if entry.attempts == 1 {
                effects.push(Effect::Started { id, waited: now - entry.request.arrival });
            }
        }
    }

    /// Waiting requests (and `extra`, a newcomer) in the order they are sent: by priority; within
    /// one, the tenants interleaved by their fair shares of slots, each tenant's own in
    /// TTFT-deadline order.
    fn queue_order(&self, extra: Option<&Request>) -> Vec<(SeqId, Request)> {
        let mut order = Vec::with_capacity(self.waiting.len() + usize::from(extra.is_some()));
        for priority in [Priority::Interactive, Priority::Batch] {
            let mut lanes: BTreeMap<TenantId, Vec<(SeqId, Request)>> = BTreeMap::new();
            let waiting = self.waiting.iter().filter(|(p, _, _)| *p == priority).map(|(_, _, id)| &self.entries[id]);
            for r in waiting.map(|e| e.request).chain(extra.copied().filter(|r| r.priority == priority)) {
                lanes.entry(r.tenant).or_default().push((r.id, r));
            }
            for lane in lanes.values_mut() {
                lane.sort_by_key(|(id, r)| (r.ttft_deadline, *id));
            }
            if lanes.len() <= 1 {
                order.extend(lanes.into_values().flatten());
                continue;
            }
            let lanes = lanes.into_iter().map(|(tenant, requests)| {
                (tenant, Box::new(requests.into_iter()) as Box<dyn Iterator<Item = (SeqId, Request)>>)
            });
            let shares = self.shares_with(priority, extra);
            // A retry (its upstream failed before its first token) was charged when first sent.
            let cost = |(id, r): &(SeqId, Request)| match self.entries.get(id) {
                Some(e) if e.attempts > 0 => 0,
                _ => slot_cost(r),
            };
            order.extend(shares.merge(lanes, cost).collect::<Vec<_>>());
        }
        order
    }

    /// A tier's shares, with a newcomer's weight as its request states it.
    fn shares_with(&self, priority: Priority, extra: Option<&Request>) -> Shares {
        let mut shares = self.shares[priority.index()].clone();
        if let Some(r) = extra {
            shares.set_weight(r.tenant, r.weight);
        }
        shares
    }

    /// A request was sent: its tenant is charged, and its tier's shares advance to where it
    /// started (or level out when nobody of that tier waits).
    fn charge(&mut self, r: &Request) {
        let waits = self.waiting.iter().any(|(p, _, _)| *p == r.priority);
        let shares = &mut self.shares[r.priority.index()];
        let start = shares.served(r.tenant);
        shares.charge(r.tenant, slot_cost(r));
        shares.advance(waits.then_some(start));
    }

    fn submit(&mut self, r: Request, now: Instant, effects: &mut Vec<Effect>) {
        match self.check(&r).and_then(|()| self.admissible(&r, now)) {
            Err(refusal) if refusal.outcome != Outcome::Infeasible || !self.probe_fits(&r, now) => {
                effects.push(Effect::End { id: r.id, end: End::Unfinished(refusal), admitted: false })
            }
            _ => {
                for shares in &mut self.shares {
                    shares.set_weight(r.tenant, r.weight);
                }
                let entry = Entry { request: r, flight: None, attempts: 0 };
                self.waiting.insert(entry.order());
                self.queued_bytes += r.bytes;
                self.queued_tokens += u64::from(r.prompt);
                self.entries.insert(r.id, entry);
            }
        }
    }

    /// Whether a request refused for what the window learned is sent as a probe
    /// ([`crate::evidence`], rule 3): nothing is in flight or waiting, so it can only risk itself,
    /// and the upstream's starting costs, with the margin's floor, would keep its promises. Its
    /// first token and its tokens' gaps, at one in flight, are what the fits lacked to tell an
    /// idle upstream from a slow one.
    fn probe_fits(&self, r: &Request, now: Instant) -> bool {
        if !self.entries.is_empty() {
            return false;
        }
        let prior = Window {
            policy: self.policy,
            model: self.model.prior(),
            margin: Margin::new(self.margin.floor()),
            entries: BTreeMap::new(),
            waiting: BTreeSet::new(),
            running: BTreeSet::new(),
            queued_bytes: 0,
            queued_tokens: 0,
            ready: self.ready,
            shares: Default::default(),
        };
        prior.check(r).and_then(|()| prior.admissible(r, now)).is_ok()
    }

    fn check(&self, r: &Request) -> Result<(), Refusal> {
        let p = &self.policy;
        let total = u64::from(r.prompt) + u64::from(r.max_tokens);
        if total > u64::from(p.max_context) {
            return Err(Refusal::invalid(format!(
                "the prompt has about {} tokens and max_tokens is {}: {total} tokens; the upstream's context holds {}",
                r.prompt, r.max_tokens, p.max_context
            )));
        }
        let queued = Queued {
            requests: self.waiting.len(),
            bytes: self.queued_bytes,
            tokens: self.queued_tokens,
            estimated: true,
        };
        queued.room_for(r, (p.max_queue, p.max_queue_bytes, p.max_queue_tokens))?;
        if r.itl_target().is_some_and(|target| self.model.itl(1) > target) {
            return Err(Refusal::new(
                Outcome::Infeasible,
                format!(
                    "the upstream's inter-token time is {:.1} ms even alone; the inter-token target is {} ms",
                    self.model.itl(1).as_secs_f64() * 1e3,
                    r.itl.as_millis()
                ),
            )
            .retry_after(Duration::from_secs(1)));
        }
        Ok(())
    }

    /// How many requests the forecast takes to be in flight while it lasts: those running, waiting
    /// and `extra`, up to the window. Tokens are forecast at this concurrency, not at the window's
    /// most: a fit extrapolated to a concurrency the upstream has not been seen at (and, refused,
    /// never would be) must not refuse what it serves at the concurrency it runs. A later arrival
    /// that raises it is refused if it would make a running or waiting request miss
    /// ([`Window::admissible`]), so the promise holds.
    fn concurrency(&self, extra: bool, window: u32) -> u32 {
        let wanted = self.running.len() + self.waiting.len() + usize::from(extra);
        (wanted.clamp(1, window.max(1) as usize)) as u32
    }

    /// When each running and waiting request (and `extra`) would get its first and last token,
    /// waiting ones in queue order.
    fn forecast(&self, extra: Option<&Request>, now: Instant) -> BTreeMap<SeqId, (Instant, Instant)> {
        let order = self.queue_order(extra);
        let n = self.window_for(order.first().map(|(_, r)| r)).max(1);
        let itl = self.model.itl(self.concurrency(extra.is_some(), n));
        let mut out = BTreeMap::new();
        // When each of the `n` slots frees: running requests take all of their max_tokens.
        let mut slots: BinaryHeap<Reverse<Instant>> = self
            .running
            .iter()
            .map(|id| {
                let e = &self.entries[id];
                let f = e.flight.expect("running requests are in flight");
                let first = f.first.unwrap_or(f.sent + self.model.ttft(e.request.prompt, f.running_at_send));
                // Its last token comes the tokens it has still to get after its latest (or its
                // first, to come) — counted from that token, not from its first.
                let latest = if f.tokens > 0 { f.last } else { first };
                let left = e.request.max_tokens.saturating_sub(f.tokens.max(1));
                let end = (latest + itl * left).max(now);
                out.insert(*id, (first, end));
                Reverse(end)
            })
            .collect();
        while slots.len() < n as usize {
            slots.push(Reverse(now));
        }
        for (id, r) in order {
            let Reverse(free) = slots.pop().expect("at least one slot");
            let send = free.max(now);
            // Its first token comes at the concurrency it is sent into (itself included), not at
            // the window's: an idle upstream answers at its idle speed.
            let running = 1 + slots.iter().filter(|Reverse(s)| *s > send).count() as u32;
            let first = send + self.model.ttft(r.prompt, running);
            let end = first + itl * r.max_tokens.saturating_sub(1);
            slots.push(Reverse(end));
            out.insert(id, (first, end));
        }
        out
    }

    fn keeps(r: &Request, (first, end): (Instant, Instant), margin: Duration) -> bool {
        first + margin <= r.ttft_deadline && end + margin <= r.deadline
    }

    fn admissible(&self, r: &Request, now: Instant) -> Result<(), Refusal> {
        let margin = self.margin.get();
        let with = self.forecast(Some(r), now);
        self.own_promises(r, with[&r.id], margin)?;
        // Running requests are judged by their deadline alone (their first token is behind them
        // or already on its way); waiting ones by both promises.
        let keeps = |id: &SeqId, fate: (Instant, Instant)| {
            let q = &self.entries[id].request;
            if self.running.contains(id) {
                fate.1 + margin <= q.deadline
            } else {
                Self::keeps(q, fate, margin)
            }
        };
        let others = || self.running.iter().chain(self.waiting.iter().map(|(_, _, id)| id));
        if others().any(|id| !keeps(id, with[id])) {
            let without = self.forecast(None, now);
            let n = others().filter(|id| !keeps(id, with[id]) && keeps(id, without[id])).count();
            if n > 0 {
                return Err(infeasible(
                    format!(
                        "admitting it would make {n} running or waiting request(s) miss a deadline ({} in flight upstream, {} waiting)",
                        self.running.len(),
                        self.waiting.len()
                    ),
                    Duration::ZERO,
                ));
            }
        }
        Ok(())
    }

    /// Whether the newcomer's forecast first token and end keep its promises; if not, which
    /// breaks, with the numbers.
    fn own_promises(&self, r: &Request, (first, end): (Instant, Instant), margin: Duration) -> Result<(), Refusal> {
        let ms = |t: Instant| (t.saturating_duration_since(r.arrival)).as_millis();
        if first + margin > r.ttft_deadline {
            return Err(infeasible(
                format!(
                    "the first token is forecast {} ms after arrival ({} in flight upstream, {} waiting); the TTFT deadline is {} ms",
                    ms(first),
                    self.running.len(),
                    self.waiting.len(),
                    ms(r.ttft_deadline)
                ),
                first.saturating_duration_since(r.ttft_deadline),
            ));
        }
        if end + margin > r.deadline {
            let itl = self.model.itl(self.concurrency(true, self.window_with(Some(r))));
            let room = r.deadline.saturating_duration_since(first + margin);
            let fit = 1 + (room.as_nanos() / itl.as_nanos().max(1)) as u64;
            return Err(infeasible(
                format!(
                    "max_tokens {} is forecast to finish {} ms after arrival (about {:.1} ms a token upstream); the deadline is {} ms: a max_tokens of {fit} would fit",
                    r.max_tokens,
                    ms(end),
                    itl.as_secs_f64() * 1e3,
                    ms(r.deadline)
                ),
                end.saturating_duration_since(r.deadline),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
