//! The one async shell of generation serving: a task that owns a model version's state (the
//! step engine's [`Ledger`](ferry_core::generation::ledger::Ledger), or the relay's
//! [`Window`](ferry_core::generation::window::Window)) and whatever that state does not hold —
//! each request's caller, the engine's or the upstream's running work — gathers the events of an
//! instant (submissions, cancellations, what the engine or upstream reported, its own timer's
//! lateness), hands them to the state in one pass, and carries out the effects. What differs
//! between the step engine and the relay is a [`Backend`]; the loop, the handle callers hold, the
//! submission and a caller's timing are here once.
//!
//! One task owns all of this; callers talk to it over a channel. A caller holds a [`Stream`]:
//! dropping it (the client went away) cancels its request before the next pass.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use std::time::Instant;
use tokio::sync::{mpsc, oneshot, watch};

use super::stream::{Control, Deadlines, Finished, Piece, Sent, Stream};
use crate::metrics::GenerationMetrics;
use crate::tally::Tally;
use crate::task::{sleep_until, OldestArrival, Stopped};
use ferry_core::generation::capacity::{Capacity, RecentShape, RequestShape, Targets};
use ferry_core::generation::sequence::{End, FinishReason, Request, SeqId};
use ferry_core::lockout::Lockout;
use ferry_core::outcome::Outcome;
use ferry_core::tenant::TenantId;
use ferry_core::ticket::Priority;

/// A generation request for a shell: what admission needs, and the prompt as its backend takes
/// it (`P`: token ids for the step engine, an OpenAI body for the relay).
#[derive(Debug, Clone)]
pub struct Submission<P> {
    pub prompt: P,
    pub max_tokens: u32,
    pub priority: Priority,
    /// Whose it is, and the tenant's weight.
    pub tenant: TenantId,
    pub weight: u32,
    pub bytes: u64,
    pub arrival: Instant,
    pub ttft_deadline: Instant,
    pub itl: Duration,
    pub deadline: Instant,
}

/// A prompt's size in tokens, as admission counts it.
pub trait PromptTokens {
    fn prompt_tokens(&self) -> u32;
}

impl<P: PromptTokens> Submission<P> {
    /// What the ledger or window admits.
    pub fn request(&self, id: SeqId) -> Request {
        Request {
            id,
            arrival: self.arrival,
            priority: self.priority,
            tenant: self.tenant,
            weight: self.weight,
            prompt: self.prompt.prompt_tokens(),
            max_tokens: self.max_tokens,
            bytes: self.bytes,
            ttft_deadline: self.ttft_deadline,
            itl: self.itl,
            deadline: self.deadline,
        }
    }
}

impl<P> Deadlines for Submission<P> {
    fn arrival(&self) -> Instant {
        self.arrival
    }

    fn ttft_deadline(&self) -> Instant {
        self.ttft_deadline
    }

    fn deadline(&self) -> Instant {
        self.deadline
    }
}

/// What a shell's task hears from its handles.
pub(super) enum Command<P> {
    Submit {
        id: SeqId,
        submission: Submission<P>,
        stream: mpsc::UnboundedSender<Sent>,
    },
    /// `n` > 1 sequences of one prompt, admitted together.
    SubmitGroup(Vec<(SeqId, Submission<P>, mpsc::UnboundedSender<Sent>)>),
    Control(Control),
    Drain(oneshot::Sender<()>),
}

/// What differs between the step engine's shell and the relay's: the state it drives, what its
/// running work reports, and how each effect is carried out.
pub(super) trait Backend: Send + 'static {
    type Prompt: PromptTokens + Send + 'static;
    /// What the engine's or the upstream's running work sends back to the task.
    type Report: Send + 'static;
    type Event: Send;
    type Effect: Send;
    /// Submissions one pass takes: each may cost an admission forecast, and work that ends
    /// meanwhile waits for the pass. The rest wait in the channel for the next pass.
    const ADMISSIONS_PER_PASS: usize;

    fn is_admission(event: &Self::Event) -> bool;
    /// The task's timer woke it `late` after it was due.
    fn woke(&mut self, now: Instant, late: Duration, events: &mut Vec<Self::Event>);
    /// A request arrives: its caller is `reply`.
    fn submit(&mut self, request: Request, prompt: Self::Prompt, reply: Reply, events: &mut Vec<Self::Event>);
    /// `n` > 1 sequences of one prompt arrive together; a backend that cannot admit them as one
    /// group takes each on its own.
    fn submit_group(&mut self, group: Vec<(Request, Self::Prompt, Reply)>, events: &mut Vec<Self::Event>) {
        for (request, prompt, reply) in group {
            self.submit(request, prompt, reply, events);
        }
    }
    fn control(&mut self, control: Control, events: &mut Vec<Self::Event>);
    fn report(&mut self, report: Self::Report, events: &mut Vec<Self::Event>);
    /// Why the backend can no longer serve, if it cannot (the task then ends, and with it the
    /// pod's readiness).
    fn broken(&self, _now: Instant) -> Option<String> {
        None
    }
    /// Fails every request, saying `why`.
    fn abandon(&mut self, _why: &str, _now: Instant) {}
    /// Hands the events of one instant to the state (the ledger, the window), which appends the
    /// effects to carry out.
    fn decide(&mut self, now: Instant, events: Vec<Self::Event>, effects: &mut Vec<Self::Effect>);
    fn carry_out(&mut self, effect: Self::Effect, now: Instant);
    /// After a pass's effects: drops what the pass left unused, publishes the gauges.
    fn settle(&mut self, now: Instant);
    fn is_idle(&self) -> bool;
    /// When the task must wake if nothing comes.
    fn next_wake(&self) -> Option<Instant>;
}

/// How often a backend computes the capacity it exports (a bisection over queueing formulas:
/// tens of microseconds, not for every pass).
const CAPACITY_PERIOD: Duration = Duration::from_secs(1);

/// The capacity a backend exports: for the service's default deadlines (`targets`), at the
/// shape of the requests it was asked for lately ([`RecentShape`]), once every [`CAPACITY_PERIOD`].
pub(super) struct CapacityExport {
    targets: Targets,
    shape: RecentShape,
    due: Option<Instant>,
    /// Whether the costs behind the figure are known before a request finishes: a step
    /// engine's are (configured, or timed at load); a relay's are guesses until its upstream has
    /// answered, so it exports nothing until then.
    prior: bool,
}

impl CapacityExport {
    pub(super) fn new(targets: Targets, prior: bool) -> CapacityExport {
        CapacityExport { targets, shape: RecentShape::default(), due: None, prior }
    }

    /// A request of these many prompt tokens arrived.
    pub(super) fn arrived(&mut self, prompt: u32) {
        self.shape.arrived(prompt);
    }

    /// A request finished with these many completion tokens.
    pub(super) fn finished(&mut self, completion: u32) {
        self.shape.finished(completion);
    }

    /// Sets the capacity gauges from `capacity` (of the shape and the targets) when it is due:
    /// from the first where the costs are known (at the prior shape until requests show theirs),
    /// else once a request has finished.
    pub(super) fn publish(
        &mut self,
        now: Instant,
        metrics: &GenerationMetrics,
        capacity: impl FnOnce(&RequestShape, &Targets) -> Capacity,
    ) {
        if self.due.is_some_and(|due| now < due) {
            return;
        }
        self.due = Some(now + CAPACITY_PERIOD);
        if !self.prior && !self.shape.has_finished() {
            return;
        }
        let c = capacity(&self.shape.shape(), &self.targets);
        metrics.capacity_requests.set(c.requests_per_second);
        metrics.capacity_tokens.set(c.tokens_per_second);
    }
}

/// The task wakes at least this often while it serves, so that its timer's lateness (part of the
/// deadline margin) is measured whatever the load.
const TIMER_PROBE: Duration = Duration::from_millis(50);

/// A handle to one model version's shell. Cheap to clone.
pub struct Handle<P> {
    commands: mpsc::UnboundedSender<Command<P>>,
    next_id: Arc<AtomicU64>,
    oldest: OldestArrival,
    metrics: GenerationMetrics,
    stopped: watch::Receiver<bool>,
}

impl<P> Clone for Handle<P> {
    fn clone(&self) -> Self {
        Handle {
            commands: self.commands.clone(),
            next_id: self.next_id.clone(),
            oldest: self.oldest.clone(),
            metrics: self.metrics.clone(),
            stopped: self.stopped.clone(),
        }
    }
}

impl<P: PromptTokens + Send + 'static> Handle<P> {
    /// Starts `backend`'s task on the current tokio runtime; its running work reports on
    /// `reports`.
    pub(super) fn spawn<B: Backend<Prompt = P>>(
        backend: B,
        reports: mpsc::UnboundedReceiver<B::Report>,
        oldest: OldestArrival,
        metrics: GenerationMetrics,
    ) -> Handle<P> {
        let (commands, rx) = mpsc::unbounded_channel();
        let (stopped_tx, stopped) = watch::channel(false);
        tokio::spawn(async move {
            let _stopped = Stopped(stopped_tx);
            run(backend, rx, reports).await;
        });
        Handle { commands, next_id: Arc::new(AtomicU64::new(0)), oldest, metrics, stopped }
    }

    /// Hands a request to the shell; the [`Stream`] gives its text and its end, and counts how it
    /// ended in `tally` (`cancelled` if it is dropped before).
    pub fn submit(&self, submission: Submission<P>, tally: Tally) -> Stream {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let commands = self.commands.clone();
        let control = Box::new(move |c: Control| {
            let _ = commands.send(Command::Control(c));
        });
        let mut stream = Stream::new(id, rx, control, Some(tally), self.metrics.late_results.clone(), &submission);
        if self.commands.send(Command::Submit { id, submission, stream: tx }).is_err() {
            // The task is gone (its backend broke): the request fails here.
            stream.fail_now();
        }
        stream
    }

    /// Hands `n` > 1 sequences of one request to the shell, admitted all or none: a stream each,
    /// none counting the request's outcome (its caller counts it once, for all of them).
    pub fn submit_group(&self, submissions: Vec<Submission<P>>) -> Vec<Stream> {
        let (mut group, mut streams) = (Vec::new(), Vec::new());
        for submission in submissions {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let (tx, rx) = mpsc::unbounded_channel();
            let commands = self.commands.clone();
            let control = Box::new(move |c: Control| {
                let _ = commands.send(Command::Control(c));
            });
            streams.push(Stream::new(id, rx, control, None, self.metrics.late_results.clone(), &submission));
            group.push((id, submission, tx));
        }
        if self.commands.send(Command::SubmitGroup(group)).is_err() {
            streams.iter_mut().for_each(Stream::fail_now);
        }
        streams
    }

    /// Resolves once every request has ended.
    pub async fn drain(&self) {
        let (tx, rx) = oneshot::channel();
        if self.commands.send(Command::Drain(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    pub fn metrics(&self) -> &GenerationMetrics {
        &self.metrics
    }

    pub fn is_alive(&self) -> bool {
        !*self.stopped.borrow()
    }

    /// Resolves when the task has stopped.
    pub async fn stopped(&self) {
        let mut stopped = self.stopped.clone();
        let _ = stopped.wait_for(|s| *s).await;
    }

    /// Sets `ferry_queue_oldest_age_seconds` from the current time.
    pub fn refresh_age(&self) {
        self.metrics.oldest_age.set(self.oldest.age());
    }
}

/// The task: one pass per instant, then wait for a report, a command or the next wake.
async fn run<B: Backend>(
    mut backend: B,
    mut commands: mpsc::UnboundedReceiver<Command<B::Prompt>>,
    mut reports: mpsc::UnboundedReceiver<B::Report>,
) {
    let mut open = true;
    let mut drains: Vec<oneshot::Sender<()>> = Vec::new();
    let mut probe = ferry_core::clock::now() + TIMER_PROBE;
    let mut waiting_for: Option<Instant> = None;
    let (mut events, mut effects) = (Vec::new(), Vec::new());
    loop {
        let now = ferry_core::clock::now();
        if let Some(due) = waiting_for.filter(|due| *due <= now) {
            backend.woke(now, now - due, &mut events);
        }
        if now >= probe {
            probe = now + TIMER_PROBE;
        }
        if let Some(why) = backend.broken(now) {
            backend.abandon(&why, now);
            drains.drain(..).for_each(|d| {
                let _ = d.send(());
            });
            return;
        }
        backend.decide(now, std::mem::take(&mut events), &mut effects);
        for effect in effects.drain(..) {
            backend.carry_out(effect, now);
        }
        backend.settle(now);
        if backend.is_idle() {
            drains.drain(..).for_each(|d| {
                let _ = d.send(());
            });
            if !open {
                return;
            }
        }
        let wake = [backend.next_wake(), open.then_some(probe)].into_iter().flatten().min();
        waiting_for = wake;
        let mut command = |backend: &mut B, command, events: &mut Vec<B::Event>| match command {
            Command::Submit { id, submission, stream } => {
                let (request, reply) = (submission.request(id), Reply::new(stream, submission.arrival));
                backend.submit(request, submission.prompt, reply, events)
            }
            Command::SubmitGroup(group) => {
                let group = group
                    .into_iter()
                    .map(|(id, s, stream)| (s.request(id), s.prompt, Reply::new(stream, s.arrival)))
                    .collect();
                backend.submit_group(group, events)
            }
            Command::Control(control) => backend.control(control, events),
            Command::Drain(tx) => drains.push(tx),
        };
        tokio::select! {
            biased;
            Some(report) = reports.recv() => backend.report(report, &mut events),
            received = commands.recv(), if open => match received {
                Some(c) => command(&mut backend, c, &mut events),
                None => open = false,
            },
            () = sleep_until(wake) => {}
        }
        // Everything else ready at this instant joins the same pass (as in the batcher).
        let mut admissions = events.iter().filter(|e| B::is_admission(e)).count();
        for _ in 0..64 {
            tokio::task::yield_now().await;
            let before = events.len();
            while let Ok(report) = reports.try_recv() {
                backend.report(report, &mut events);
            }
            while open && admissions < B::ADMISSIONS_PER_PASS {
                match commands.try_recv() {
                    Ok(c) => {
                        let from = events.len();
                        command(&mut backend, c, &mut events);
                        admissions += events[from..].iter().filter(|e| B::is_admission(e)).count();
                    }
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => open = false,
                }
            }
            if events.len() == before || ferry_core::clock::now() != now {
                break;
            }
        }
    }
}

/// A caller as every backend keeps it: its stream and the instants its timings are measured
/// from.
pub(super) struct Reply {
    stream: mpsc::UnboundedSender<Sent>,
    pub arrival: Instant,
    started: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

impl Reply {
    pub fn new(stream: mpsc::UnboundedSender<Sent>, arrival: Instant) -> Reply {
        Reply { stream, arrival, started: None, first_token: None, last_token: None }
    }

    pub fn send(&self, piece: Piece, now: Instant) {
        let _ = self.stream.send(Sent { piece, at: now, queued: None });
    }

    pub fn has_first_token(&self) -> bool {
        self.first_token.is_some()
    }

    /// Its first step, or its release upstream.
    pub fn started(&mut self, now: Instant) {
        self.started = Some(now);
    }

    /// A token's piece, sent even when its text is empty (a token that ends mid-character): the
    /// caller checks each token against its deadlines, the first against the TTFT deadline.
    pub fn token(&mut self, piece: Piece, now: Instant, metrics: &GenerationMetrics) {
        metrics.generation_tokens.inc();
        let first = self.first_token.is_none();
        if first {
            metrics.ttft.observe((now - self.arrival).as_secs_f64());
            self.first_token = Some(now);
        } else if let Some(last) = self.last_token {
            metrics.itl.observe((now - last).as_secs_f64());
        }
        self.last_token = Some(now);
        let queued = first.then(|| self.queued());
        let _ = self.stream.send(Sent { piece, at: now, queued });
    }

    fn queued(&self) -> Duration {
        self.started.map_or(Duration::ZERO, |s| s - self.arrival)
    }

    /// How it finished, with its timings.
    pub fn finished(&self, reason: FinishReason, prompt_tokens: u32, completion_tokens: u32) -> Finished {
        Finished {
            reason,
            prompt_tokens,
            completion_tokens,
            queued: self.queued(),
            ttft: self.first_token.map_or(Duration::ZERO, |f| f - self.arrival),
        }
    }
}

/// What every backend does when a request ends (`admitted`: or was refused at admission, while
/// the state was `idle` or not), before its caller hears: a refusal at admission as infeasible
/// teaches the lockout, an admitted request's duration is observed.
pub(super) fn ended(
    lockout: &mut Lockout,
    metrics: &GenerationMetrics,
    (end, admitted, idle): (&End, bool, bool),
    reply: Option<&Reply>,
    now: Instant,
) {
    if let (false, End::Unfinished(refusal)) = (admitted, end) {
        if refusal.outcome == Outcome::Infeasible {
            lockout.refused(now, idle, &refusal.message);
        }
    }
    if let Some(reply) = reply.filter(|_| admitted) {
        metrics.request_duration.observe((now - reply.arrival).as_secs_f64());
    }
}

/// A request's start: how long it waited, and the prompt tokens it brings.
pub(super) fn started(
    metrics: &GenerationMetrics,
    reply: Option<&mut Reply>,
    prompt: u32,
    waited: Duration,
    now: Instant,
) {
    metrics.queue_wait.observe(waited.as_secs_f64());
    if let Some(reply) = reply {
        reply.started(now);
        metrics.prompt_tokens.inc_by(u64::from(prompt));
    }
}
