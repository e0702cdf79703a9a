//! Admission for generation: would this request, and every one already admitted, keep its
//! promises if it were taken in? Answered by running a copy of the scheduler forward in virtual
//! time — the very step rule the engine will follow, with steps that take what the estimator
//! says and sequences that run to `max_tokens` (the most they may take) — and reading off when
//! each sequence gets its first token, how long the steps it decodes in are, and when it ends.
//!
//! With exact estimates the forecast is the future, except for what arrives later, and a later
//! arrival is admitted only if the forecast with it keeps every promise: so no admitted sequence
//! misses a deadline (the property tests check it). A sequence already admitted that would miss
//! anyway (the estimates grew since it was admitted) does not count against the newcomer: the
//! forecast without the newcomer is run to tell.
//!
//! The forecast is computed from events ([`events`]: a sequence starts, ends its prefill, ends)
//! wherever it can be, which costs microseconds where the steps cost seconds; the step-by-step
//! [`simulate`] is the reference it is tested against, and what runs where the event-driven one
//! declines (KV blocks that may run short, tenants sharing a tier's queue). Before either, a
//! bound ([`bound`]) admits at the cost of one pass where even the slowest future the rule allows
//! keeps every deadline.

use std::collections::BTreeMap;
use std::time::Duration;

use std::time::Instant;

use super::prefix::Prefix;
use super::scheduler::{Late, Progress, Scheduler, StepPlan};
use super::sequence::{Request, SeqId};
use crate::outcome::{Outcome, Refusal};

mod bound;
mod ends;
mod events;
#[cfg(test)]
mod tests;

/// Steps a forecast may simulate; a future longer than this is not promised.
const MAX_STEPS: usize = 200_000;

/// Every sequence's fate, in the order of their ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fates {
    ids: Vec<SeqId>,
    fates: Vec<Fate>,
}

impl Fates {
    pub fn get(&self, id: SeqId) -> Option<&Fate> {
        self.ids.binary_search(&id).ok().map(|i| &self.fates[i])
    }

    pub fn iter(&self) -> impl Iterator<Item = (SeqId, &Fate)> {
        self.ids.iter().copied().zip(&self.fates)
    }
}

impl From<BTreeMap<SeqId, Fate>> for Fates {
    fn from(map: BTreeMap<SeqId, Fate>) -> Fates {
        let (ids, fates) = map.into_iter().unzip();
        Fates { ids, fates }
    }
}

/// How a forecast is computed: from events where it can be (admission), or step by step (the
/// reference the other is tested against).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Method {
    Events,
    Steps,
}

/// The forecast from `now` with `newcomer` taken in (stopping once its promise is lost), its
/// prompt's full blocks named by `prefix`, by `method`; from events falls back to steps where it
/// declines.
fn forecast(
    s: &Scheduler,
    in_flight: Option<InFlight<'_>>,
    now: Instant,
    margin: Duration,
    (newcomer, prefix): (Option<&Request>, &Prefix),
    method: Method,
) -> Fates {
    if method == Method::Events {
        let cached = newcomer.map_or(0, |r| s.cached_tokens(r, prefix));
        if let Ok(fates) = events::run(s, in_flight, now, margin, newcomer, cached) {
            return fates;
        }
    }
    let mut sim = s.clone();
    if let Some(r) = newcomer {
        sim.insert(*r, prefix.clone());
    }
    run(sim, in_flight, now, margin, newcomer).into()
}

/// What the forecast says of one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fate {
    /// When its first token comes (already came, for a sequence that has one).
    pub first: Option<Instant>,
    /// When its last token comes; `None` when it does not finish (expired, or beyond the horizon).
    pub end: Option<Instant>,
    /// The longest step it decodes in.
    pub longest_step: Duration,
    /// Tokens it gets with the margin to spare before its deadline.
    pub in_time: u32,
}

/// The step running on the engine, as the forecast continues it.
#[derive(Debug, Clone, Copy)]
pub struct InFlight<'a> {
    pub plan: &'a StepPlan,
    /// When it is expected to end.
    pub end: Instant,
}

/// Runs the scheduler forward from `now` with nothing more arriving, step by step: the
/// reference the event-driven forecast is tested against.
pub fn simulate(s: &Scheduler, in_flight: Option<InFlight<'_>>, now: Instant, margin: Duration) -> Fates {
    forecast(s, in_flight, now, margin, (None, &Prefix::default()), Method::Steps)
}

/// [`simulate`] on a copy the caller made; with `newcomer`, it stops as soon as that request's
/// fate breaks its first-token or inter-token promise (the rest of the future cannot mend it),
/// its fate then holding what broke it.
fn run(
    mut sim: Scheduler,
    in_flight: Option<InFlight<'_>>,
    now: Instant,
    margin: Duration,
    newcomer: Option<&Request>,
) -> BTreeMap<SeqId, Fate> {
    let mut fates: BTreeMap<SeqId, Fate> =
        sim.seqs.iter().map(|(id, q)| (*id, Fate { first: q.first_token, ..Fate::default() })).collect();
    let deadlines: BTreeMap<SeqId, Instant> = sim.seqs.iter().map(|(id, q)| (*id, q.request.deadline)).collect();
    let mut t = now;
    let apply = |sim: &mut Scheduler, plan: &StepPlan, t: Instant, fates: &mut BTreeMap<SeqId, Fate>| {
        for m in plan.members.iter().filter(|m| m.decode) {
            if let Some(f) = fates.get_mut(&m.id) {
                f.longest_step = f.longest_step.max(plan.expected);
            }
        }
        let (progress, _) = sim.complete(plan, t, &|_| false, Late::RunsOn);
        for p in progress {
            match p {
                Progress::Token { id, first } => {
                    let f = fates.get_mut(&id).expect("a fate per sequence");
                    if first {
                        f.first = Some(t);
                    }
                    if t + margin <= deadlines[&id] {
                        f.in_time += 1;
                    }
                }
                Progress::Finished { id, .. } => fates.get_mut(&id).expect("a fate per sequence").end = Some(t),
                Progress::Expired { .. } => {}
            }
        }
    };
    // Broken past mending: its first token came late (once it has come: the refusal says when),
    // or it decoded in a step longer than its inter-token target.
    let lost = |fates: &BTreeMap<SeqId, Fate>| {
        newcomer.is_some_and(|r| {
            let f = &fates[&r.id];
            f.first.is_some_and(|first| first + margin > r.ttft_deadline) || f.longest_step > r.itl
        })
    };
    if let Some(f) = in_flight {
        t = t.max(f.end);
        apply(&mut sim, f.plan, t, &mut fates);
    }
    for _ in 0..MAX_STEPS {
        if sim.is_empty() || lost(&fates) {
            break;
        }
        let (plan, _) = sim.plan(t);
        let Some(plan) = plan else { break };
        t += plan.expected;
        apply(&mut sim, &plan, t, &mut fates);
    }
    fates
}

/// Which promise a fate breaks, if any.
fn broken(r: &Request, f: &Fate, margin: Duration, had_first: bool) -> Option<Broken> {
    if !had_first {
        match f.first {
            Some(first) if first + margin <= r.ttft_deadline => {}
            first => return Some(Broken::Ttft(first)),
        }
    }
    if f.longest_step > r.itl {
        return Some(Broken::Itl(f.longest_step));
    }
    match f.end {
        Some(end) if end + margin <= r.deadline => None,
        end => Some(Broken::Deadline(end)),
    }
}

#[derive(Debug, Clone, Copy)]
enum Broken {
    Ttft(Option<Instant>),
    Itl(Duration),
    Deadline(Option<Instant>),
}

/// Admits `r` if the forecast with it keeps its promises and those of every admitted sequence
/// (that keeps them without it); otherwise says which promise breaks, with the numbers. The
/// blocks of its prompt that the prefix cache holds (`prefix` names them) are not prefilled.
pub fn admit(
    s: &Scheduler,
    in_flight: Option<InFlight<'_>>,
    r: &Request,
    prefix: &Prefix,
    now: Instant,
    margin: Duration,
) -> Result<(), Refusal> {
    admit_by(s, in_flight, (r, prefix), now, margin, Method::Events)
}

/// [`admit`], its forecasts computed by `method`.
pub(crate) fn admit_by(
    s: &Scheduler,
    in_flight: Option<InFlight<'_>>,
    (r, prefix): (&Request, &Prefix),
    now: Instant,
    margin: Duration,
    method: Method,
) -> Result<(), Refusal> {
    if method == Method::Events {
        let cached = s.cached_tokens(r, prefix);
        if bound::clearly_kept(s, in_flight, r, cached, now, margin) {
            return Ok(());
        }
        match events::judge(s, in_flight, now, margin, r, cached) {
            Ok(events::Judged::Keeps) => return Ok(()),
            Ok(events::Judged::Harms) => return Err(harms(s)),
            Ok(events::Judged::Own(fate)) => return Err(own(s, r, &fate, margin)),
            Err(events::Declined) => {}
        }
    }
    let fates = forecast(s, in_flight, now, margin, (Some(r), prefix), Method::Steps);
    let fate = *fates.get(r.id).expect("the newcomer's fate");
    if broken(r, &fate, margin, false).is_some() {
        return Err(own(s, r, &fate, margin));
    }
    // Both in id order: the held sequences, and their fates less the newcomer's.
    let victims: Vec<SeqId> = s
        .seqs
        .iter()
        .zip(fates.iter().filter(|(id, _)| *id != r.id))
        .filter(|((id, q), (of, fate))| {
            debug_assert_eq!(*id, of);
            broken(&q.request, fate, margin, q.first_token.is_some()).is_some()
        })
        .map(|((id, _), _)| *id)
        .collect();
    if victims.is_empty() {
        return Ok(());
    }
    // Would they keep their promises without it?
    let without = forecast(s, in_flight, now, margin, (None, prefix), Method::Steps);
    let harmed: Vec<SeqId> = victims
        .into_iter()
        .filter(|id| {
            let q = &s.seqs[id];
            broken(&q.request, without.get(*id).expect("a fate each"), margin, q.first_token.is_some()).is_none()
        })
        .collect();
    if harmed.is_empty() {
        return Ok(());
    }
    Err(harms(s))
}

/// The refusal for a newcomer whose own `fate` breaks a promise, with the numbers.
fn own(s: &Scheduler, r: &Request, fate: &Fate, margin: Duration) -> Refusal {
    let ms = |d: Duration| d.as_millis();
    let after = |t: Option<Instant>| {
        t.map_or("never (beyond the forecast)".to_owned(), |t| format!("{} ms", ms(t - r.arrival)))
    };
    match broken(r, fate, margin, false).expect("a broken promise") {
        Broken::Ttft(first) => infeasible(
            format!(
                "the first token is forecast {} after arrival ({} sequences running, {} waiting ahead, {} prompt tokens queued); the TTFT deadline is {} ms{}",
                after(first),
                s.running(),
                s.waiting(),
                s.queued_tokens(),
                ms(r.ttft_deadline - r.arrival),
                if margin.is_zero() { String::new() } else { format!(" less a margin of {} ms", ms(margin)) }
            ),
            first.map_or(Duration::ZERO, |f| f.saturating_duration_since(r.ttft_deadline)),
        ),
        Broken::Itl(step) => infeasible(
            format!(
                "steps are forecast to take {:.1} ms while it decodes; its inter-token target is {} ms",
                step.as_secs_f64() * 1e3,
                ms(r.itl)
            ),
            Duration::ZERO,
        ),
        Broken::Deadline(end) => infeasible(
            format!(
                "max_tokens {} is forecast to finish {} after arrival; the deadline is {} ms{}: a max_tokens of {} would fit",
                r.max_tokens,
                after(end),
                ms(r.deadline - r.arrival),
                if margin.is_zero() { String::new() } else { format!(" less a margin of {} ms", ms(margin)) },
                fate.in_time
            ),
            end.map_or(Duration::ZERO, |e| e.saturating_duration_since(r.deadline)),
        ),
    }
}

/// A refusal as infeasible, to be retried once it might fit (`over`: how much it misses by).
pub(crate) fn infeasible(message: String, over: Duration) -> Refusal {
    Refusal::new(Outcome::Infeasible, message).retry_after(over.max(Duration::from_secs(1)))
}

/// The refusal for a newcomer that would make an admitted sequence miss a promise it keeps
/// without it.
fn harms(s: &Scheduler) -> Refusal {
    infeasible(
        format!(
            "admitting it would make an admitted sequence miss a deadline or inter-token target ({} running, {} waiting)",
            s.running(),
            s.waiting()
        ),
        Duration::ZERO,
    )
}
