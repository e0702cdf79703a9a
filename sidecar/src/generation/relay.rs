//! The async shell around one model version's [`Window`]: requests to an OpenAI-compatible LLM
//! server beside the sidecar (vLLM, SGLang, TGI, llama.cpp's server), which batches by itself.
//! The window decides what is sent and when; this shell sends each released request upstream as
//! a streamed completion, forwards every token to its caller as it comes, tells the window about
//! first tokens, tokens, ends and failures, closes an upstream request when the window aborts it
//! (a deadline, a caller gone), and polls the upstream's health for readiness.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::stream::{Control, Deadlines, Finished, Piece, Sent, Stream};
use crate::metrics::GenerationMetrics;
use crate::tally::Tally;
use crate::task::{sleep_until, OldestArrival, Stopped};
use ferry_core::generation::sequence::{End, FinishReason, Request, SeqId};
use ferry_core::generation::window::{Effect, Event, Window};
use ferry_core::lockout::Lockout;
use ferry_core::outcome::{Outcome, Refusal};
use ferry_core::tenant::TenantId;
use ferry_core::ticket::Priority;

/// How often the upstream's health is checked.
const HEALTH_PERIOD: Duration = Duration::from_secs(1);

/// A request for the upstream: the body to send (already OpenAI's, streamed) and what the window
/// needs to know.
#[derive(Debug, Clone)]
pub struct Submission {
    /// `/v1/completions` or `/v1/chat/completions`.
    pub path: &'static str,
    pub body: Value,
    /// The prompt's tokens, estimated ([`Relay::estimate_tokens`]) from its bytes.
    pub prompt_tokens: u32,
    pub prompt_bytes: u32,
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

impl Deadlines for Submission {
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

enum Command {
    Submit { id: SeqId, submission: Submission, stream: mpsc::UnboundedSender<Sent> },
    Control(Control),
    Drain(oneshot::Sender<()>),
}

/// What an upstream request reports, for its attempt.
enum Report {
    Text(String),
    /// The tokens as the upstream counted them (its usage).
    Usage {
        prompt_tokens: u64,
        completion_tokens: Option<u64>,
    },
    Done(FinishReason),
    Failed(Refusal),
}

struct Upstream {
    id: SeqId,
    attempt: u32,
    report: Report,
}

/// A handle to one model version's relay. Cheap to clone.
#[derive(Clone)]
pub struct Relay {
    commands: mpsc::UnboundedSender<Command>,
    next_id: Arc<AtomicU64>,
    ready: Arc<AtomicBool>,
    /// Bytes of prompt per token, as f64 bits: learned from the upstream's usage.
    bytes_per_token: Arc<AtomicU64>,
    oldest: OldestArrival,
    metrics: GenerationMetrics,
    stopped: watch::Receiver<bool>,
    base: String,
    /// The model's name upstream (`model` of what is sent).
    model: String,
}

impl Relay {
    /// Starts the relay task and the health checks of `base` (e.g. `http://127.0.0.1:8000`),
    /// which serves the model as `model`.
    pub fn spawn(window: Window, base: &str, model: &str, metrics: GenerationMetrics) -> Relay {
        let base = base.trim_end_matches('/').to_owned();
        let client =
            reqwest::Client::builder().tcp_nodelay(true).pool_max_idle_per_host(256).build().expect("an HTTP client");
        let (commands, rx) = mpsc::unbounded_channel();
        let (up_tx, up_rx) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = mpsc::unbounded_channel();
        let ready = Arc::new(AtomicBool::new(false));
        let bytes_per_token = Arc::new(AtomicU64::new(4.0f64.to_bits()));
        let oldest = OldestArrival::new();
        tokio::spawn(health(client.clone(), base.clone(), ready.clone(), ready_tx, metrics.kv_usage.clone()));
        let task = Task {
            lockout: Lockout::default(),
            window,
            client,
            base: base.clone(),
            metrics: metrics.clone(),
            callers: HashMap::new(),
            upstream: up_tx,
            drains: Vec::new(),
            oldest: oldest.clone(),
            bytes_per_token: bytes_per_token.clone(),
        };
        let (stopped_tx, stopped) = watch::channel(false);
        tokio::spawn(async move {
            let _stopped = Stopped(stopped_tx);
            task.run(rx, up_rx, ready_rx).await;
        });
        Relay {
            commands,
            next_id: Arc::new(AtomicU64::new(0)),
            ready,
            bytes_per_token,
            oldest,
            metrics,
            stopped,
            base,
            model: model.to_owned(),
        }
    }

    /// The prompt's tokens, estimated from its bytes at the ratio the upstream's usage showed.
    pub fn estimate_tokens(&self, bytes: usize) -> u32 {
        let ratio = f64::from_bits(self.bytes_per_token.load(Ordering::Relaxed)).max(0.5);
        ((bytes as f64 / ratio).ceil() as u32).max(1)
    }

    pub fn upstream(&self) -> &str {
        &self.base
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    pub fn submit(&self, submission: Submission, tally: Tally) -> Stream {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let commands = self.commands.clone();
        let control = Box::new(move |c: Control| {
            let _ = commands.send(Command::Control(c));
        });
        let mut stream = Stream::new(id, rx, control, tally, self.metrics.late_results.clone(), &submission);
        if self.commands.send(Command::Submit { id, submission, stream: tx }).is_err() {
            stream.fail_now();
        }
        stream
    }

    /// The upstream answered its last health check.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

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

    pub async fn stopped(&self) {
        let mut stopped = self.stopped.clone();
        let _ = stopped.wait_for(|s| *s).await;
    }

    pub fn refresh_age(&self) {
        self.metrics.oldest_age.set(self.oldest.age());
    }
}

/// The upstream's KV-cache usage (0 to 1) in its Prometheus exposition, under the names vLLM,
/// SGLang and llama.cpp use, so that the autoscaler sees an upstream's memory pressure as it sees
/// the built-in engines'.
pub fn kv_usage(exposition: &str) -> Option<f64> {
    const NAMES: [&str; 4] = [
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
        "llamacpp:kv_cache_usage_ratio",
    ];
    let values: Vec<f64> = exposition
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let name = series.split('{').next()?;
            NAMES.contains(&name).then(|| value.trim().parse::<f64>().ok()).flatten()
        })
        .collect();
    // Several series (one per engine of a server): the fullest is the pressure.
    values.into_iter().filter(|v| v.is_finite()).reduce(f64::max)
}

/// Polls `/health` (llama.cpp, vLLM, SGLang, TGI), or `/v1/models` where there is none, and,
/// while the upstream is healthy, its `/metrics` for its KV-cache usage.
async fn health(
    client: reqwest::Client,
    base: String,
    ready: Arc<AtomicBool>,
    tx: mpsc::UnboundedSender<bool>,
    kv: prometheus::Gauge,
) {
    let mut last = None;
    loop {
        let check = |path: &str| client.get(format!("{base}{path}")).timeout(HEALTH_PERIOD).send();
        let ok = match check("/health").await {
            Ok(r) if r.status().is_success() => true,
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {
                matches!(check("/v1/models").await, Ok(r) if r.status().is_success())
            }
            _ => false,
        };
        ready.store(ok, Ordering::Relaxed);
        if last != Some(ok) {
            if tx.send(ok).is_err() {
                return;
            }
            if ok {
                tracing::info!(upstream = %base, "upstream ready");
            } else {
                tracing::warn!(upstream = %base, "upstream not ready");
            }
            last = Some(ok);
        }
        if ok {
            let scraped = client.get(format!("{base}/metrics")).timeout(HEALTH_PERIOD).send().await;
            if let Ok(r) = scraped.and_then(|r| r.error_for_status()) {
                if let Some(usage) = r.text().await.ok().as_deref().and_then(kv_usage) {
                    kv.set(usage);
                }
            }
        }
        tokio::time::sleep(HEALTH_PERIOD).await;
    }
}

struct Caller {
    stream: mpsc::UnboundedSender<Sent>,
    submission: Submission,
    attempt: u32,
    task: Option<AbortHandle>,
    started: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    tokens: u32,
    /// The upstream's own count, once its usage came: (prompt, completion).
    usage: Option<(u32, Option<u32>)>,
}

struct Task {
    window: Window,
    client: reqwest::Client,
    base: String,
    metrics: GenerationMetrics,
    callers: HashMap<SeqId, Caller>,
    upstream: mpsc::UnboundedSender<Upstream>,
    drains: Vec<oneshot::Sender<()>>,
    oldest: OldestArrival,
    bytes_per_token: Arc<AtomicU64>,
    /// Whether it refuses every request while idle ([`ferry_core::lockout`]).
    lockout: Lockout,
}

const TIMER_PROBE: Duration = Duration::from_millis(50);

impl Task {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut upstream: mpsc::UnboundedReceiver<Upstream>,
        mut ready: mpsc::UnboundedReceiver<bool>,
    ) {
        let mut open = true;
        let mut probe = Instant::now() + TIMER_PROBE;
        let mut waiting_for: Option<Instant> = None;
        let mut events = Vec::new();
        let mut effects = Vec::new();
        loop {
            let now = Instant::now();
            if let Some(due) = waiting_for.filter(|due| *due <= now) {
                events.push(Event::Woke(now - due));
            }
            if now >= probe {
                probe = now + TIMER_PROBE;
            }
            self.window.step(now, std::mem::take(&mut events), &mut effects);
            for effect in effects.drain(..) {
                self.carry_out(effect, now);
            }
            self.publish();
            self.metrics.lockout.show(self.lockout.locked(now));
            if self.window.is_idle() {
                self.drains.drain(..).for_each(|d| {
                    let _ = d.send(());
                });
                if !open {
                    return;
                }
            }
            let wake = [self.window.next_wake(), open.then_some(probe)].into_iter().flatten().min();
            waiting_for = wake;
            tokio::select! {
                biased;
                Some(report) = upstream.recv() => self.report(report, &mut events),
                Some(ok) = ready.recv() => events.push(Event::Ready(ok)),
                command = commands.recv(), if open => match command {
                    Some(command) => self.command(command, &mut events),
                    None => open = false,
                },
                () = sleep_until(wake) => {}
            }
            for _ in 0..64 {
                tokio::task::yield_now().await;
                let before = events.len();
                while let Ok(report) = upstream.try_recv() {
                    self.report(report, &mut events);
                }
                while open {
                    match commands.try_recv() {
                        Ok(command) => self.command(command, &mut events),
                        Err(mpsc::error::TryRecvError::Empty) => break,
                        Err(mpsc::error::TryRecvError::Disconnected) => open = false,
                    }
                }
                if events.len() == before || Instant::now() != now {
                    break;
                }
            }
        }
    }

    fn command(&mut self, command: Command, events: &mut Vec<Event>) {
        match command {
            Command::Submit { id, submission: s, stream } => {
                let request = Request {
                    id,
                    arrival: s.arrival,
                    priority: s.priority,
                    tenant: s.tenant,
                    weight: s.weight,
                    prompt: s.prompt_tokens,
                    max_tokens: s.max_tokens,
                    bytes: s.bytes,
                    ttft_deadline: s.ttft_deadline,
                    itl: s.itl,
                    deadline: s.deadline,
                };
                let caller = Caller {
                    stream,
                    submission: s,
                    attempt: 0,
                    task: None,
                    started: None,
                    first_token: None,
                    last_token: None,
                    tokens: 0,
                    usage: None,
                };
                self.callers.insert(id, caller);
                events.push(Event::Submit(request));
            }
            Command::Control(Control::Cancel(id)) => {
                if let Some(task) = self.callers.remove(&id).and_then(|c| c.task) {
                    task.abort();
                }
                events.push(Event::Cancel(id));
            }
            Command::Control(Control::Trip(_)) => {}
            Command::Drain(tx) => self.drains.push(tx),
        }
    }

    /// A report of an upstream request: tokens go to the caller at once; the window hears of
    /// each.
    fn report(&mut self, up: Upstream, events: &mut Vec<Event>) {
        let Some(caller) = self.callers.get_mut(&up.id).filter(|c| c.attempt == up.attempt) else { return };
        let now = Instant::now();
        match up.report {
            Report::Text(text) => {
                let first = caller.first_token.is_none();
                caller.tokens += 1;
                self.metrics.generation_tokens.inc();
                if first {
                    caller.first_token = Some(now);
                    self.metrics.ttft.observe((now - caller.submission.arrival).as_secs_f64());
                    events.push(Event::First(up.id));
                } else {
                    if let Some(last) = caller.last_token {
                        self.metrics.itl.observe((now - last).as_secs_f64());
                    }
                    events.push(Event::Token(up.id));
                }
                caller.last_token = Some(now);
                let queued = first.then(|| caller.started.map_or(Duration::ZERO, |s| s - caller.submission.arrival));
                let _ = caller.stream.send(Sent { piece: Piece::Text(text), at: now, queued });
            }
            Report::Usage { prompt_tokens, completion_tokens } => {
                caller.usage = Some((prompt_tokens as u32, completion_tokens.map(|c| c as u32)));
                if prompt_tokens > 0 {
                    let bytes = f64::from(caller.submission.prompt_bytes);
                    let observed = bytes / prompt_tokens as f64;
                    let old = f64::from_bits(self.bytes_per_token.load(Ordering::Relaxed));
                    self.bytes_per_token.store((0.9 * old + 0.1 * observed).to_bits(), Ordering::Relaxed);
                }
            }
            Report::Done(reason) => events.push(Event::Done { id: up.id, reason }),
            Report::Failed(refusal) => events.push(Event::Failed { id: up.id, refusal }),
        }
    }

    fn carry_out(&mut self, effect: Effect, now: Instant) {
        match effect {
            Effect::Release { id } => {
                self.lockout.ran();
                self.send(id)
            }
            Effect::Abort { id } => {
                if let Some(task) = self.callers.get_mut(&id).and_then(|c| c.task.take()) {
                    task.abort();
                }
            }
            Effect::Started { id, waited } => {
                self.metrics.queue_wait.observe(waited.as_secs_f64());
                if let Some(caller) = self.callers.get_mut(&id) {
                    caller.started = Some(now);
                    self.metrics.prompt_tokens.inc_by(u64::from(caller.submission.prompt_tokens));
                }
            }
            Effect::End { id, end, admitted } => {
                if let (false, End::Refused(refusal)) = (admitted, &end) {
                    if refusal.outcome == Outcome::Infeasible {
                        self.lockout.refused(now, self.window.is_idle(), &refusal.message);
                    }
                }
                let Some(caller) = self.callers.remove(&id) else { return };
                if let Some(task) = caller.task {
                    task.abort();
                }
                if admitted {
                    self.metrics.request_duration.observe((now - caller.submission.arrival).as_secs_f64());
                }
                let piece = match end {
                    End::Finished(reason) => Piece::End(Ok(Finished {
                        reason,
                        prompt_tokens: caller.usage.map_or(caller.submission.prompt_tokens, |u| u.0),
                        completion_tokens: caller.usage.and_then(|u| u.1).unwrap_or(caller.tokens),
                        queued: caller.started.map_or(Duration::ZERO, |s| s - caller.submission.arrival),
                        ttft: caller.first_token.map_or(Duration::ZERO, |f| f - caller.submission.arrival),
                    })),
                    End::Refused(refusal) => Piece::End(Err(refusal)),
                };
                let _ = caller.stream.send(Sent { piece, at: now, queued: None });
            }
        }
    }

    /// Sends a released request upstream, as a new attempt.
    fn send(&mut self, id: SeqId) {
        let Some(caller) = self.callers.get_mut(&id) else { return };
        caller.attempt += 1;
        let (attempt, client, reports) = (caller.attempt, self.client.clone(), self.upstream.clone());
        let url = format!("{}{}", self.base, caller.submission.path);
        let body = caller.submission.body.clone();
        let handle = tokio::spawn(async move {
            let report = |report| {
                let _ = reports.send(Upstream { id, attempt, report });
            };
            stream_upstream(&client, &url, &body, report).await;
        });
        caller.task = Some(handle.abort_handle());
    }

    fn publish(&self) {
        self.metrics.running.set(self.window.running() as i64);
        self.metrics.waiting.set(self.window.waiting() as i64);
        self.metrics.queue_depth.set(self.window.waiting() as i64);
        self.metrics.queue_bytes.set(self.window.queued_bytes() as i64);
        self.oldest.set(self.window.oldest_waiting());
    }
}

/// One streamed completion upstream: each token's text, the usage, the end or the failure.
async fn stream_upstream(client: &reqwest::Client, url: &str, body: &Value, report: impl Fn(Report)) {
    let fail = |outcome: Outcome, message: String| Refusal::new(outcome, message);
    let mut response = match client.post(url).json(body).send().await {
        Ok(r) => r,
        Err(e) => {
            return report(Report::Failed(fail(
                Outcome::Failed,
                format!("the upstream at {url} cannot be reached: {e}"),
            )))
        }
    };
    let status = response.status();
    if !status.is_success() {
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let text = response.text().await.unwrap_or_default();
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().or_else(|| v["error"].as_str()).map(str::to_owned))
            .unwrap_or(text);
        let message = format!("the upstream answered {}: {message}", status.as_u16());
        let refusal = match status.as_u16() {
            429 => fail(Outcome::QueueFull, message).retry_after(retry_after.unwrap_or(Duration::from_secs(1))),
            503 => fail(Outcome::Unavailable, message).retry_after(retry_after.unwrap_or(Duration::from_secs(1))),
            400..=499 => fail(Outcome::Invalid, message),
            _ => fail(Outcome::Failed, message),
        };
        return report(Report::Failed(refusal));
    }
    let mut buffer: Vec<u8> = Vec::new();
    let mut reason = None;
    loop {
        let chunk = match response.chunk().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(e) => {
                return report(Report::Failed(fail(Outcome::Failed, format!("the upstream's stream broke: {e}"))))
            }
        };
        buffer.extend_from_slice(&chunk);
        while let Some(at) = find_event_end(&buffer) {
            let event: Vec<u8> = buffer.drain(..at).collect();
            let Ok(text) = std::str::from_utf8(&event) else { continue };
            for line in text.lines() {
                let Some(data) = line.strip_prefix("data:").map(str::trim) else { continue };
                if data == "[DONE]" {
                    return report(Report::Done(reason.unwrap_or(FinishReason::Length)));
                }
                let Ok(value) = serde_json::from_str::<Value>(data) else { continue };
                if let Some(error) = value.get("error") {
                    let message = error["message"].as_str().map_or_else(|| error.to_string(), str::to_owned);
                    return report(Report::Failed(fail(Outcome::Failed, format!("the upstream failed: {message}"))));
                }
                if let Some(prompt_tokens) = value["usage"]["prompt_tokens"].as_u64() {
                    report(Report::Usage {
                        prompt_tokens,
                        completion_tokens: value["usage"]["completion_tokens"].as_u64(),
                    });
                }
                let choice = &value["choices"][0];
                let piece = choice["text"].as_str().or_else(|| choice["delta"]["content"].as_str());
                if let Some(piece) = piece.filter(|p| !p.is_empty()) {
                    report(Report::Text(piece.to_owned()));
                }
                match choice["finish_reason"].as_str() {
                    Some("length") => reason = Some(FinishReason::Length),
                    Some(_) => reason = Some(FinishReason::Stop),
                    None => {}
                }
            }
        }
    }
    report(Report::Failed(fail(Outcome::Failed, "the upstream closed its stream before the end".to_owned())))
}

/// The end of the first complete server-sent event in `buffer` (after its blank line).
fn find_event_end(buffer: &[u8]) -> Option<usize> {
    let lf = buffer.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buffer.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upstreams_kv_usage_is_read_under_the_names_servers_use() {
        let vllm = "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
                    # TYPE vllm:kv_cache_usage_perc gauge\n\
                    vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
                    vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n";
        assert_eq!(kv_usage(vllm), Some(0.5));
        assert_eq!(kv_usage("sglang:token_usage{model_name=\"m\"} 0.125\n"), Some(0.125));
        assert_eq!(kv_usage("llamacpp:requests_processing 0\n"), None, "llama.cpp's server may not export it");
    }
}
