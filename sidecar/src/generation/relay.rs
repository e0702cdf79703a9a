//! The async shell around one model version's [`Window`]: requests to an OpenAI-compatible LLM
//! server beside the sidecar (vLLM, SGLang, TGI, llama.cpp's server), which batches by itself.
//! The window decides what is sent and when; this shell sends each released request upstream as
//! a streamed completion, forwards every token to its caller as it comes, tells the window about
//! first tokens, tokens, ends and failures, closes an upstream request when the window aborts it
//! (a deadline, a caller gone), and polls the upstream's health for readiness.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use super::shell::{self, Backend, CapacityExport, Handle, PromptTokens, Reply};
use super::stream::{Control, Piece};
use super::tokenize::UpstreamTokens;
use crate::metrics::GenerationMetrics;
use crate::task::OldestArrival;
use ferry_core::generation::capacity::{upstream, Targets};
use ferry_core::generation::sequence::{End, FinishReason, Request, SeqId};
use ferry_core::generation::window::{Effect, Event, Window};
use ferry_core::lockout::Lockout;
use ferry_core::outcome::{Outcome, Refusal};

/// How often the upstream's health is checked.
const HEALTH_PERIOD: Duration = Duration::from_secs(1);

/// A request for the upstream: the body to send (already OpenAI's, streamed) and its prompt's
/// size.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// `/v1/completions` or `/v1/chat/completions`.
    pub path: &'static str,
    pub body: Value,
    /// The prompt's tokens, estimated ([`Relay::estimate_tokens`]) from its bytes.
    pub tokens: u32,
    pub bytes: u32,
}

impl PromptTokens for Upstream {
    fn prompt_tokens(&self) -> u32 {
        self.tokens
    }
}

/// What the relay's task hears besides its commands.
pub(super) enum Report {
    /// What an upstream request reported, for its attempt.
    Request { id: SeqId, attempt: u32, said: Said },
    /// Whether the upstream answers its health check.
    Ready(bool),
}

/// What an upstream request says.
pub(super) enum Said {
    /// One of its choice chunks that brings something (text, a tool call, reasoning, logprobs)
    /// or ends a choice; `counts` where it brings something, a token as far as deadlines go.
    Chunk {
        text: String,
        choice: Box<Value>,
        counts: bool,
    },
    /// The tokens as the upstream counted them (its usage).
    Usage {
        prompt_tokens: u64,
        completion_tokens: Option<u64>,
    },
    Done(FinishReason),
    Failed(Refusal),
}

/// A handle to one model version's relay. Cheap to clone; a [`Handle`] with what the front asks
/// of an upstream.
#[derive(Clone)]
pub struct Relay {
    handle: Handle<Upstream>,
    ready: Arc<AtomicBool>,
    /// Bytes of prompt per token, as f64 bits: learned from the upstream's usage.
    bytes_per_token: Arc<AtomicU64>,
    /// The upstream's context in tokens, as its `/v1/models` says (0 until it has).
    context: Arc<AtomicU32>,
    /// The upstream's own count of a prompt's tokens.
    tokens: Arc<UpstreamTokens>,
    base: String,
    /// The model's name upstream (`model` of what is sent).
    model: String,
}

impl Deref for Relay {
    type Target = Handle<Upstream>;

    fn deref(&self) -> &Handle<Upstream> {
        &self.handle
    }
}

impl Relay {
    /// Starts the relay task and the health checks of `base` (e.g. `http://127.0.0.1:8000`),
    /// which serves the model as `model`.
    /// Starts the relay's task; `targets` are the service's (its default deadlines), which the
    /// capacity it exports keeps.
    pub fn spawn(window: Window, base: &str, model: &str, metrics: GenerationMetrics, targets: Targets) -> Relay {
        let base = base.trim_end_matches('/').to_owned();
        let client =
            reqwest::Client::builder().tcp_nodelay(true).pool_max_idle_per_host(256).build().expect("an HTTP client");
        let (reports, reports_rx) = mpsc::unbounded_channel();
        let ready = Arc::new(AtomicBool::new(false));
        let bytes_per_token = Arc::new(AtomicU64::new(4.0f64.to_bits()));
        let oldest = OldestArrival::new();
        let context = Arc::new(AtomicU32::new(0));
        let tokens = Arc::new(UpstreamTokens::new(client.clone(), base.clone(), model.to_owned()));
        let checks =
            Checks { client: client.clone(), base: base.clone(), ready: ready.clone(), context: context.clone() };
        tokio::spawn(health(checks, reports.clone(), metrics.kv_usage.clone()));
        let relaying = Relaying {
            lockout: Lockout::default(),
            window,
            client,
            base: base.clone(),
            metrics: metrics.clone(),
            callers: HashMap::new(),
            reports,
            oldest: oldest.clone(),
            bytes_per_token: bytes_per_token.clone(),
            capacity: CapacityExport::new(targets, false),
        };
        let handle = Handle::spawn(relaying, reports_rx, oldest, metrics);
        Relay { handle, ready, bytes_per_token, context, tokens, base, model: model.to_owned() }
    }

    /// The prompt's tokens as the upstream counts them, where it says (`body` is the client's
    /// request; `chat` for the chat endpoint); `None` leaves them to [`Relay::estimate_tokens`].
    pub async fn count_tokens(&self, chat: bool, body: &Value) -> Option<u32> {
        self.tokens.count(chat, body).await
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

    /// Prompt and answer tokens the upstream's model takes, once its `/v1/models` has said.
    pub fn context_length(&self) -> Option<u32> {
        Some(self.context.load(Ordering::Relaxed)).filter(|c| *c > 0)
    }

    /// The upstream answered its last health check.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
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

/// The model's context in tokens in an upstream's `/v1/models`: vLLM's `max_model_len`, or
/// llama.cpp's `meta.n_ctx` (a slot's).
pub fn context_of(models: &Value) -> Option<u32> {
    let model = &models["data"][0];
    let context = model["max_model_len"].as_u64().or_else(|| model["meta"]["n_ctx"].as_u64())?;
    u32::try_from(context).ok().filter(|c| *c > 0)
}

/// What the health checks read and set.
struct Checks {
    client: reqwest::Client,
    base: String,
    ready: Arc<AtomicBool>,
    context: Arc<AtomicU32>,
}

/// Polls `/health` (llama.cpp, vLLM, SGLang, TGI), or `/v1/models` where there is none, and,
/// while the upstream is healthy, its `/metrics` for its KV-cache usage; once healthy, reads
/// its model's context from `/v1/models`.
async fn health(checks: Checks, tx: mpsc::UnboundedSender<Report>, kv: prometheus::Gauge) {
    let Checks { client, base, ready, context } = checks;
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
            if tx.send(Report::Ready(ok)).is_err() {
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
            if context.load(Ordering::Relaxed) == 0 {
                if let Ok(r) = check("/v1/models").await.and_then(|r| r.error_for_status()) {
                    if let Some(c) = r.json::<Value>().await.ok().as_ref().and_then(context_of) {
                        context.store(c, Ordering::Relaxed);
                    }
                }
            }
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
    reply: Reply,
    upstream: Upstream,
    attempt: u32,
    task: Option<AbortHandle>,
    tokens: u32,
    /// The upstream's own count, once its usage came: (prompt, completion).
    usage: Option<(u32, Option<u32>)>,
}

struct Relaying {
    window: Window,
    client: reqwest::Client,
    base: String,
    metrics: GenerationMetrics,
    callers: HashMap<SeqId, Caller>,
    reports: mpsc::UnboundedSender<Report>,
    oldest: OldestArrival,
    bytes_per_token: Arc<AtomicU64>,
    /// Whether it refuses every request while idle ([`ferry_core::lockout`]).
    lockout: Lockout,
    /// The capacity it exports, from the window's fits.
    capacity: CapacityExport,
}

impl Backend for Relaying {
    type Prompt = Upstream;
    type Report = Report;
    type Event = Event;
    type Effect = Effect;
    /// An admission here is a few comparisons: everything waiting is taken at once.
    const ADMISSIONS_PER_PASS: usize = usize::MAX;

    fn is_admission(event: &Event) -> bool {
        matches!(event, Event::Submit(_))
    }

    fn woke(&mut self, _now: Instant, late: Duration, events: &mut Vec<Event>) {
        events.push(Event::Woke(late));
    }

    fn submit(&mut self, request: Request, upstream: Upstream, reply: Reply, events: &mut Vec<Event>) {
        let caller = Caller { reply, upstream, attempt: 0, task: None, tokens: 0, usage: None };
        self.callers.insert(request.id, caller);
        self.capacity.arrived(request.prompt);
        events.push(Event::Submit(request));
    }

    fn control(&mut self, control: Control, events: &mut Vec<Event>) {
        match control {
            Control::Cancel(id) => {
                if let Some(task) = self.callers.remove(&id).and_then(|c| c.task) {
                    task.abort();
                }
                events.push(Event::Cancel(id));
            }
            // An upstream's tokens come from its own server: the window learns their gaps
            // as they arrive, not a trip.
            Control::Trip(_) => {}
        }
    }

    /// A report of an upstream request: tokens go to the caller at once; the window hears of
    /// each.
    fn report(&mut self, report: Report, events: &mut Vec<Event>) {
        let (id, attempt, said) = match report {
            Report::Ready(ok) => return events.push(Event::Ready(ok)),
            Report::Request { id, attempt, said } => (id, attempt, said),
        };
        let Some(caller) = self.callers.get_mut(&id).filter(|c| c.attempt == attempt) else { return };
        match said {
            // A chunk that brings part of the answer is a token; so is the first chunk of any
            // kind (a choice ended empty): once the client has something, the request has begun
            // and is never sent again.
            Said::Chunk { text, choice, counts } if counts || !caller.reply.has_first_token() => {
                events.push(if caller.reply.has_first_token() { Event::Token(id) } else { Event::First(id) });
                caller.tokens += u32::from(counts);
                caller.reply.token(Piece::Relayed { text, choice }, ferry_core::clock::now(), &self.metrics);
            }
            // A choice's end alone: passed on, no token.
            Said::Chunk { text, choice, .. } => {
                caller.reply.send(Piece::Relayed { text, choice }, ferry_core::clock::now())
            }
            Said::Usage { prompt_tokens, completion_tokens } => {
                caller.usage = Some((prompt_tokens as u32, completion_tokens.map(|c| c as u32)));
                // A prompt sent as token ids has no bytes to learn the ratio from.
                if prompt_tokens > 0 && caller.upstream.bytes > 0 {
                    let bytes = f64::from(caller.upstream.bytes);
                    let observed = bytes / prompt_tokens as f64;
                    let old = f64::from_bits(self.bytes_per_token.load(Ordering::Relaxed));
                    self.bytes_per_token.store((0.9 * old + 0.1 * observed).to_bits(), Ordering::Relaxed);
                }
            }
            Said::Done(reason) => events.push(Event::Done { id, reason }),
            Said::Failed(refusal) => events.push(Event::Failed { id, refusal }),
        }
    }

    fn decide(&mut self, now: Instant, events: Vec<Event>, effects: &mut Vec<Effect>) {
        self.window.step(now, events, effects);
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
                let caller = self.callers.get_mut(&id);
                let prompt = caller.as_ref().map_or(0, |c| c.upstream.tokens);
                shell::started(&self.metrics, caller.map(|c| &mut c.reply), prompt, waited, now);
            }
            Effect::End { id, end, admitted } => {
                let (caller, idle) = (self.callers.remove(&id), self.window.is_idle());
                let reply = caller.as_ref().map(|c| &c.reply);
                shell::ended(&mut self.lockout, &self.metrics, (&end, admitted, idle), reply, now);
                let Some(caller) = caller else { return };
                if let Some(task) = caller.task {
                    task.abort();
                }
                let piece = match end {
                    End::Finished(reason) => {
                        let prompt = caller.usage.map_or(caller.upstream.tokens, |u| u.0);
                        let completion = caller.usage.and_then(|u| u.1).unwrap_or(caller.tokens);
                        self.capacity.finished(completion);
                        Piece::End(Ok(caller.reply.finished(reason, prompt, completion)))
                    }
                    End::Unfinished(refusal) => Piece::End(Err(refusal)),
                };
                caller.reply.send(piece, now);
            }
        }
    }

    fn settle(&mut self, now: Instant) {
        self.publish();
        self.metrics.lockout.show(self.lockout.locked(now));
        let window = &self.window;
        self.capacity.publish(now, &self.metrics, |shape, targets| {
            upstream::capacity(window.model(), shape, targets, window.policy().max_in_flight)
        });
    }

    fn is_idle(&self) -> bool {
        self.window.is_idle()
    }

    fn next_wake(&self) -> Option<Instant> {
        self.window.next_wake()
    }
}

impl Relaying {
    /// Sends a released request upstream, as a new attempt.
    fn send(&mut self, id: SeqId) {
        let Some(caller) = self.callers.get_mut(&id) else { return };
        caller.attempt += 1;
        let (attempt, client, reports) = (caller.attempt, self.client.clone(), self.reports.clone());
        let url = format!("{}{}", self.base, caller.upstream.path);
        let body = caller.upstream.body.clone();
        let handle = tokio::spawn(async move {
            let report = |said| {
                let _ = reports.send(Report::Request { id, attempt, said });
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
async fn stream_upstream(client: &reqwest::Client, url: &str, body: &Value, report: impl Fn(Said)) {
    let fail = |outcome: Outcome, message: String| Refusal::new(outcome, message);
    let mut response = match client.post(url).json(body).send().await {
        Ok(r) => r,
        Err(e) => {
            return report(Said::Failed(fail(Outcome::Failed, format!("the upstream at {url} cannot be reached: {e}"))))
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
        return report(Said::Failed(refused(status.as_u16(), &message, retry_after)));
    }
    let mut buffer: Vec<u8> = Vec::new();
    let mut reason = None;
    loop {
        let chunk = match response.chunk().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(e) => return report(Said::Failed(fail(Outcome::Failed, format!("the upstream's stream broke: {e}")))),
        };
        buffer.extend_from_slice(&chunk);
        while let Some(at) = find_event_end(&buffer) {
            let event: Vec<u8> = buffer.drain(..at).collect();
            let Ok(text) = std::str::from_utf8(&event) else { continue };
            for line in text.lines() {
                let Some(data) = line.strip_prefix("data:").map(str::trim) else { continue };
                if data == "[DONE]" {
                    return report(Said::Done(reason.unwrap_or(FinishReason::Length)));
                }
                let Ok(value) = serde_json::from_str::<Value>(data) else { continue };
                if let Some(error) = value.get("error") {
                    let message = error["message"].as_str().map_or_else(|| error.to_string(), str::to_owned);
                    return report(Said::Failed(fail(Outcome::Failed, format!("the upstream failed: {message}"))));
                }
                if let Some(prompt_tokens) = value["usage"]["prompt_tokens"].as_u64() {
                    report(Said::Usage {
                        prompt_tokens,
                        completion_tokens: value["usage"]["completion_tokens"].as_u64(),
                    });
                }
                for choice in value["choices"].as_array().into_iter().flatten() {
                    let ends = choice["finish_reason"].as_str();
                    if let Some(said) = ends {
                        match finish(said) {
                            Ok(r) => reason = Some(r),
                            Err(failed) => return report(Said::Failed(failed)),
                        }
                    }
                    let counts = brings(choice);
                    if counts || ends.is_some() {
                        let text = choice["text"].as_str().or_else(|| choice["delta"]["content"].as_str());
                        let text = text.unwrap_or_default().to_owned();
                        report(Said::Chunk { text, choice: Box::new(choice.clone()), counts });
                    }
                }
            }
        }
    }
    report(Said::Failed(fail(Outcome::Failed, "the upstream closed its stream before the end".to_owned())))
}

/// Whether an upstream's choice chunk brings part of the answer: text, a tool call, reasoning, a
/// refusal or log-probabilities — any of them is a first token, as far as the TTFT deadline
/// goes (a reasoning model thinks before it writes). A chunk that only opens the turn (`role`)
/// brings nothing.
fn brings(choice: &Value) -> bool {
    let given = |v: &Value| match v {
        Value::Null => false,
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        _ => true,
    };
    let (delta, logprobs) = (&choice["delta"], &choice["logprobs"]);
    given(&choice["text"])
        || ["content", "reasoning_content", "reasoning", "tool_calls", "function_call", "refusal"]
            .iter()
            .any(|field| given(&delta[*field]))
        || ["content", "refusal", "tokens"].iter().any(|field| given(&logprobs[*field]))
}

/// What the client is answered for an upstream's refusal: its overload as the sidecar's own
/// (503 / 429 with their `Retry-After`); a request the upstream found malformed as the client's
/// 400; but an upstream that does not know its model or this sidecar's credentials (401, 403,
/// 404: a wrong `--upstream-model` or key) is no fault of the client's: a failure, saying so.
fn refused(status: u16, message: &str, retry_after: Option<Duration>) -> Refusal {
    let message = format!("the upstream answered {status}: {message}");
    let again = retry_after.unwrap_or(Duration::from_secs(1));
    match status {
        429 => Refusal::new(Outcome::QueueFull, message).retry_after(again),
        503 => Refusal::new(Outcome::Unavailable, message).retry_after(again),
        401 | 403 | 404 => Refusal::new(
            Outcome::Failed,
            format!("{message} (the sidecar's --upstream-model or credentials do not match the upstream server)"),
        ),
        400..=499 => Refusal::invalid(message),
        _ => Refusal::new(Outcome::Failed, message),
    }
}

/// An upstream's `finish_reason`, as OpenAI's values say it; one that says the answer did not
/// succeed (vLLM's `abort`, an `error`) is the request's failure rather than a `stop`; any other a
/// server writes (TGI's `eos_token`, `stop_sequence`) is a `stop`.
fn finish(reason: &str) -> Result<FinishReason, Refusal> {
    match reason {
        "length" => Ok(FinishReason::Length),
        "tool_calls" | "function_call" => Ok(FinishReason::ToolCalls),
        "content_filter" => Ok(FinishReason::ContentFilter),
        "abort" | "error" => {
            Err(Refusal::new(Outcome::Failed, format!("the upstream ended the answer with finish_reason '{reason}'")))
        }
        _ => Ok(FinishReason::Stop),
    }
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
    fn an_upstreams_refusal_is_the_clients_only_when_the_request_was_at_fault() {
        let r = refused(404, "model 'x' not found", None);
        assert_eq!(r.outcome, Outcome::Failed);
        assert!(r
            .message
            .starts_with("the upstream answered 404: model 'x' not found (the sidecar's --upstream-model"));
        assert_eq!(refused(401, "bad key", None).outcome, Outcome::Failed);
        assert_eq!(refused(400, "bad field", None).outcome, Outcome::Invalid);
        let busy = refused(429, "busy", Some(Duration::from_secs(3)));
        assert_eq!((busy.outcome, busy.retry_after), (Outcome::QueueFull, Some(Duration::from_secs(3))));
        assert_eq!(refused(502, "x", None).outcome, Outcome::Failed);
    }

    #[test]
    fn any_part_of_an_answer_is_a_token_but_the_opening_of_a_turn_is_not() {
        let chunk = |delta: Value| serde_json::json!({"index": 0, "delta": delta, "finish_reason": null});
        assert!(!brings(&chunk(serde_json::json!({"role": "assistant", "content": null}))));
        assert!(!brings(&chunk(serde_json::json!({"content": ""}))));
        assert!(brings(&chunk(serde_json::json!({"content": "Hi"}))));
        assert!(brings(&chunk(serde_json::json!({"reasoning_content": "First,"}))), "a reasoning model's thinking");
        assert!(brings(&chunk(serde_json::json!({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}))));
        assert!(brings(&serde_json::json!({"index": 0, "text": " Paris", "finish_reason": null})));
        assert!(!brings(&serde_json::json!({"index": 1, "text": "", "logprobs": null, "finish_reason": "length"})));
        let empty = serde_json::json!({"index": 0, "delta": {}, "logprobs": {"content": [], "refusal": null}});
        assert!(!brings(&empty), "no token in its log-probabilities");
    }

    #[test]
    fn finish_reasons_pass_through_and_an_abort_is_a_failure() {
        assert_eq!(finish("length").unwrap(), FinishReason::Length);
        assert_eq!(finish("stop").unwrap(), FinishReason::Stop);
        assert_eq!(finish("eos_token").unwrap(), FinishReason::Stop, "TGI's");
        assert_eq!(finish("error").unwrap_err().outcome, Outcome::Failed);
        assert_eq!(finish("tool_calls").unwrap().as_str(), "tool_calls");
        assert_eq!(finish("content_filter").unwrap().as_str(), "content_filter");
        let aborted = finish("abort").unwrap_err();
        assert_eq!(aborted.outcome, Outcome::Failed);
        assert_eq!(aborted.message, "the upstream ended the answer with finish_reason 'abort'");
    }

    #[test]
    fn the_upstreams_context_is_read_as_vllm_and_llama_cpp_list_it() {
        let vllm = serde_json::json!({"data": [{"id": "m", "max_model_len": 32768}]});
        let llama = serde_json::json!({"data": [{"id": "m", "meta": {"n_ctx": 2048, "n_ctx_train": 8192}}]});
        assert_eq!((context_of(&vllm), context_of(&llama)), (Some(32768), Some(2048)));
        assert_eq!(context_of(&serde_json::json!({"data": [{"id": "m"}]})), None, "TGI lists none");
    }

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
