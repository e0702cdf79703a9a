//! Everything one model version's generation shell knows about its sequences, as a synchronous
//! state machine: events go in with `now`, effects come out (run this step, send this token,
//! end this sequence). The sidecar's generation task only moves data — token ids to the engine,
//! text to the callers — and [`super::replay`] drives this same ledger in virtual time.
//!
//! # The order of one instant
//! [`Ledger::step`] applies an instant's events in one order: the step that ended (its tokens,
//! then the sequences it finished), the margin's measurements, the deadlines that have come,
//! the callers' commands in the order given (submissions, cancellations), then, if the engine is
//! idle, the next step: sequences that can no longer finish in time end first (rule 4), then the
//! step rule composes the step. Where the commands hold submissions and the engine is idle, that
//! step is composed just before the first of them, from what was admitted before: admissions
//! cost forecasts, and a burst of them must not keep the running sequences' next token waiting.

use std::time::Duration;

use std::time::Instant;

use super::forecast::{self, InFlight};
use super::prefix::Prefix;
use super::scheduler::{Late, Progress, Scheduler, StepPlan};
use super::sequence::{End, Request, SeqId};
use super::step::StepCost;
use crate::margin::Margin;
use crate::outcome::{Outcome, Refusal};

/// What happened, for the ledger to take into account.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A request arrives, with the hashes of its prompt's full blocks for the prefix cache (empty
    /// where the cache is off).
    Submit(Request, Prefix),
    /// `n` > 1 sequences of one prompt arrive together (OpenAI's `n`, a list of prompts):
    /// admitted all or none, then scheduled each as its own sequence, in order (as vLLM fans out
    /// `n`: the prefix cache shares the prompt's blocks with those that start after the first
    /// has computed them). Admission's forecast of each is exact, as for any sequence; a fork
    /// that waited for its leader's prompt was not (it ran later than forecast).
    SubmitGroup(Vec<(Request, Prefix)>),
    /// Its caller went away.
    Cancel(SeqId),
    /// Step `step` ended, as `outcome` says.
    StepDone { step: u64, outcome: StepOutcome },
    /// The step-time estimator starts over from these costs (an engine that timed itself).
    Calibrate(StepCost),
    /// The shell's timer woke it this late (part of the deadline margin).
    Woke(Duration),
    /// A token took this long from the ledger's effect to its caller (part of the margin).
    Trip(Duration),
}

/// How an engine step ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepOutcome {
    /// It ran; `stopped` are the sequences the model ended with this step's token (an
    /// end-of-sequence token, or a `stop` string in its text).
    Ran { stopped: Vec<SeqId> },
    /// It failed, saying why.
    Failed(String),
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Run this step on the engine; report its end with [`Event::StepDone`] and this number.
    Step { step: u64, plan: StepPlan },
    /// Send the sequence the token this step sampled for it.
    Token { id: SeqId, first: bool },
    /// The sequence ended. `admitted` is false for a refusal at admission.
    End { id: SeqId, end: End, admitted: bool },
    /// A sequence started its first step after waiting this long.
    Started { id: SeqId, waited: Duration },
    /// A running sequence gave its KV blocks back, to be recomputed later.
    Preempted(SeqId),
    /// A step ended after `took`.
    StepEnded { step: u64, plan: StepPlan, took: Duration },
    /// Tokens computed for sequences already ended (cancelled, or past a deadline).
    Late(u64),
}

/// One model version's generation state. See the module documentation.
#[derive(Debug, Clone)]
pub struct Ledger {
    scheduler: Scheduler,
    margin: Margin,
    /// Runs a sequence may be part of a failed step before it fails.
    max_attempts: u32,
    failures: std::collections::BTreeMap<SeqId, u32>,
    running: Option<(u64, StepPlan, Instant)>,
    next_step: u64,
}

impl Ledger {
    /// `margin` is the deadline margin's floor; steps cut to an inter-token target keep it free
    /// too ([`Scheduler::with_step_reserve`]).
    pub fn new(scheduler: Scheduler, margin: Duration, max_attempts: u32) -> Self {
        Ledger {
            scheduler: scheduler.with_step_reserve(margin),
            margin: Margin::new(margin),
            max_attempts: max_attempts.max(1),
            failures: Default::default(),
            running: None,
            next_step: 0,
        }
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    pub fn margin(&self) -> Duration {
        self.margin.get()
    }

    /// No sequence is held and no step runs.
    pub fn is_idle(&self) -> bool {
        self.scheduler.is_empty() && self.running.is_none()
    }

    pub fn step_running(&self) -> bool {
        self.running.is_some()
    }

    /// When the ledger wants to be woken with no event: the next deadline.
    pub fn next_wake(&self) -> Option<Instant> {
        if self.enforces_deadlines() {
            self.scheduler.next_due()
        } else {
            None
        }
    }

    /// Applies the events of one instant and appends the effects to carry out.
    pub fn step(&mut self, now: Instant, events: Vec<Event>, effects: &mut Vec<Effect>) {
        // A late wake first: it may say that the process stalled while the step that ended now
        // ran, and such a step is not evidence.
        let events = self.margin.wakes_first(now, events, |e| match e {
            Event::Woke(late) => Some(*late),
            _ => None,
        });
        let mut commands = Vec::new();
        for event in events {
            match event {
                Event::StepDone { step, outcome } => self.step_done(step, outcome, now, effects),
                Event::Calibrate(cost) => *self.scheduler.estimator_mut() = super::step::StepEstimator::new(cost),
                Event::Trip(trip) => self.margin.observe_trip(now, trip),
                command => commands.push(command),
            }
        }
        if self.enforces_deadlines() {
            for (id, refusal) in self.scheduler.due(now) {
                self.end(id, End::Unfinished(refusal), effects);
            }
        }
        let mut dispatched = false;
        for command in commands {
            // The next step leaves before the first newcomer is admitted: admission forecasts
            // with that step in flight, and a burst of arrivals never holds the engine idle for
            // the time its forecasts take (the newcomers join the step after).
            if matches!(command, Event::Submit(..) | Event::SubmitGroup(..)) && !dispatched {
                dispatched = true;
                if self.running.is_none() {
                    self.dispatch(now, effects);
                }
            }
            match command {
                Event::Submit(r, prefix) => self.submit(r, prefix, now, effects),
                Event::SubmitGroup(group) => self.submit_group(group, now, effects),
                Event::Cancel(id) => {
                    self.scheduler.remove(id);
                    self.failures.remove(&id);
                }
                _ => unreachable!("sorted above"),
            }
        }
        if self.running.is_none() {
            self.dispatch(now, effects);
        }
    }

    /// Whether deadlines are promised and kept (Ferry's discipline), or ignored (the others).
    fn enforces_deadlines(&self) -> bool {
        self.scheduler.policy().discipline.keeps_deadlines()
    }

    fn submit(&mut self, r: Request, prefix: Prefix, now: Instant, effects: &mut Vec<Effect>) {
        let in_flight = self.running.as_ref().map(|(_, plan, at)| InFlight { plan, end: *at + plan.expected });
        let admitted = self.scheduler.check_bounds(&r).and_then(|()| {
            if self.enforces_deadlines() {
                forecast::admit(&self.scheduler, in_flight, &r, &prefix, now, self.margin.get())
            } else {
                Ok(())
            }
        });
        match admitted {
            Ok(()) => self.scheduler.insert(r, prefix),
            Err(refusal)
                if refusal.outcome == Outcome::Infeasible
                    && self.running.is_none()
                    && self.scheduler.probe_fits(&r, &prefix, now, self.margin.floor()) =>
            {
                self.scheduler.insert_probe(r, prefix)
            }
            Err(refusal) => {
                let refusal = self.with_margin(refusal);
                effects.push(Effect::End { id: r.id, end: End::Unfinished(refusal), admitted: false })
            }
        }
    }

    /// An infeasible refusal says how much of it the deadline margin was, where it is above its
    /// floor.
    fn with_margin(&self, mut refusal: Refusal) -> Refusal {
        let margin = self.margin.get();
        if refusal.outcome == Outcome::Infeasible && margin > self.margin.floor() {
            let p = self.margin.parts();
            refusal.message += &format!(
                " (the {} ms margin: timers {} ms late, steps {} ms over their estimate, tokens {} ms on their way)",
                margin.as_millis(),
                p.lateness.as_millis(),
                p.overshoot.as_millis(),
                p.trip.as_millis()
            );
        }
        refusal
    }

    /// Admits `n` sequences of one prompt one after another, each forecast with those before it
    /// held; where one is refused, those taken are taken back and every one is refused with its
    /// reason. A group the queue's bounds could never hold together is refused as too large
    /// (waiting would not help); one found infeasible on an idle engine that holds nothing else
    /// is taken in as probes where the engine's starting costs say the whole group fits, as a
    /// single request would be ([`crate::evidence`], rule 3), so that a stall's estimates and
    /// margin learn again from groups too (refused, a group runs no step to learn from). Every
    /// member is then a probe, those the learned forecast passed too (all or none), so no member
    /// is ended early on the learned figures' word.
    fn submit_group(&mut self, group: Vec<(Request, Prefix)>, now: Instant, effects: &mut Vec<Effect>) {
        let refuse_all = |refusal: Refusal, effects: &mut Vec<Effect>| {
            for (r, _) in &group {
                effects.push(Effect::End { id: r.id, end: End::Unfinished(refusal.clone()), admitted: false });
            }
        };
        if let Some(refusal) = self.scheduler.group_beyond_bounds(group.iter().map(|(r, _)| r)) {
            return refuse_all(refusal, effects);
        }
        let mut taken: Vec<SeqId> = Vec::with_capacity(group.len());
        for (i, (r, prefix)) in group.iter().enumerate() {
            let in_flight = self.running.as_ref().map(|(_, plan, at)| InFlight { plan, end: *at + plan.expected });
            let admitted = self.scheduler.check_bounds(r).and_then(|()| {
                if self.enforces_deadlines() {
                    forecast::admit(&self.scheduler, in_flight, r, prefix, now, self.margin.get())
                } else {
                    Ok(())
                }
            });
            match admitted {
                Ok(()) => {
                    self.scheduler.insert(*r, prefix.clone());
                    taken.push(r.id);
                }
                // Infeasible on an idle engine that holds nothing but the group's own: taken in
                // as probes where the costs the engine started from say the whole group fits.
                Err(refusal)
                    if refusal.outcome == Outcome::Infeasible
                        && self.running.is_none()
                        && self.scheduler.waiting() + self.scheduler.running() == taken.len()
                        && {
                            for id in taken.drain(..) {
                                self.scheduler.remove(id);
                            }
                            self.scheduler.group_probe_fits(&group, now, self.margin.floor())
                        } =>
                {
                    for (r, prefix) in &group {
                        self.scheduler.insert_probe(*r, prefix.clone());
                    }
                    return;
                }
                Err(refusal) => {
                    for id in taken {
                        self.scheduler.remove(id);
                    }
                    let message = format!("choice {} of {}: {}", i + 1, group.len(), refusal.message);
                    return refuse_all(self.with_margin(Refusal { message, ..refusal }), effects);
                }
            }
        }
    }

    fn end(&mut self, id: SeqId, end: End, effects: &mut Vec<Effect>) {
        if self.scheduler.remove(id) {
            self.failures.remove(&id);
            effects.push(Effect::End { id, end, admitted: true });
        }
    }

    fn step_done(&mut self, step: u64, outcome: StepOutcome, now: Instant, effects: &mut Vec<Effect>) {
        let Some((running, plan, at)) = self.running.take() else { return };
        if running != step {
            self.running = Some((running, plan, at));
            return;
        }
        let took = now - at;
        // A step across a stall of the process is not evidence about the engine.
        let evidence = self.margin.evidence(at, now);
        self.margin.observe_batch(now, plan.expected, took);
        match outcome {
            StepOutcome::Ran { stopped } => {
                if evidence {
                    self.scheduler.estimator_mut().observe(plan.shape, took, now);
                }
                let (progress, late) = self.scheduler.complete(&plan, now, &|id| stopped.contains(&id), Late::Ends);
                for p in progress {
                    match p {
                        Progress::Token { id, first } => effects.push(Effect::Token { id, first }),
                        Progress::Finished { id, reason } => {
                            self.failures.remove(&id);
                            effects.push(Effect::End { id, end: End::Finished(reason), admitted: true })
                        }
                        Progress::Expired { id, refusal } => {
                            self.failures.remove(&id);
                            effects.push(Effect::End { id, end: End::Unfinished(refusal), admitted: true })
                        }
                    }
                }
                if late > 0 {
                    effects.push(Effect::Late(late));
                }
            }
            StepOutcome::Failed(error) => {
                self.scheduler.fail(&plan);
                for m in &plan.members {
                    if !self.scheduler.contains(m.id) {
                        continue;
                    }
                    let failures = self.failures.entry(m.id).or_insert(0);
                    *failures += 1;
                    if *failures >= self.max_attempts {
                        let refusal = Refusal::new(
                            Outcome::Failed,
                            format!(
                                "the engine failed {} step{} of this sequence: {error}",
                                failures,
                                if *failures == 1 { "" } else { "s" }
                            ),
                        );
                        self.end(m.id, End::Unfinished(refusal), effects);
                    }
                }
            }
        }
        effects.push(Effect::StepEnded { step, plan, took });
    }

    fn dispatch(&mut self, now: Instant, effects: &mut Vec<Effect>) {
        if self.enforces_deadlines() {
            for (id, refusal) in self.scheduler.hopeless(now) {
                self.end(id, End::Unfinished(refusal), effects);
            }
        }
        let starting: Vec<SeqId> =
            self.scheduler.seqs.values().filter(|s| s.started.is_none()).map(|s| s.request.id).collect();
        let (plan, preempted) = self.scheduler.plan(now);
        effects.extend(preempted.into_iter().map(Effect::Preempted));
        let Some(mut plan) = plan else { return };
        self.scheduler.fill_tables(&mut plan);
        for id in starting {
            if let Some(s) = self.scheduler.seqs.get(&id).filter(|s| s.started.is_some()) {
                effects.push(Effect::Started { id, waited: now - s.request.arrival });
            }
        }
        let step = self.next_step;
        self.next_step += 1;
        effects.push(Effect::Step { step, plan: plan.clone() });
        self.running = Some((step, plan, now));
    }
}
