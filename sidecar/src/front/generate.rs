//! OpenAI's text generation endpoints on a generation model: `POST /v1/completions`,
//! `POST /v1/chat/completions` (streamed as server-sent events ending in `data: [DONE]`, or
//! whole), and `GET /v1/models`.
//!
//! The deadlines of DESIGN.md come from the headers: `x-ferry-ttft-ms` (or llm-d's
//! `x-llm-d-slo-ttft-ms`) for the first token, `x-ferry-itl-ms` (or `x-llm-d-slo-tpot-ms`) for
//! the inter-token target, `x-ferry-timeout-ms` for the whole answer. Nothing of the answer is
//! sent before its first token: a refusal, or a first token that missed its deadline, is an
//! error response with its status (503, 504). A stream that reaches its deadline ends with an
//! error event and no `[DONE]`; a whole answer not finished by then is a 504.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::time::Instant;

use super::admit::read_body;
use super::openai::error_body;
use super::prompt::{self, Call, Kind, DEFAULT_CHAT_MAX_TOKENS, DEFAULT_MAX_TOKENS};
use super::shape::{Frame, Gathered};
use super::{choices, format};
use super::{status_of, Backend, Front, Generating, Shared, SERVER_TIMING};
use crate::deadline::TIMEOUT_HEADER;
use crate::generation::engine::Guide;
use crate::generation::relay;
use crate::generation::shell::{PromptTokens, Submission};
use crate::generation::steps::Prompt;
use crate::generation::stream::{Finished, Piece, Stream};
use crate::tally::Tally;
use crate::tenants::{Held, Tenant};
use ferry_core::outcome::{Outcome, Refusal};

pub const COMPLETIONS: &str = "/v1/completions";
pub const CHAT: &str = "/v1/chat/completions";
pub const MODELS: &str = "/v1/models";

/// The deadline headers of a generation request, each with its alias from llm-d.
pub const TTFT_HEADERS: [&str; 2] = ["x-ferry-ttft-ms", "x-llm-d-slo-ttft-ms"];
pub const ITL_HEADERS: [&str; 2] = ["x-ferry-itl-ms", "x-llm-d-slo-tpot-ms"];

/// A 400 for a token id past the model's vocabulary: `what` names where it was.
fn unknown_token(model: &dyn crate::generation::engine::LanguageModel, what: &str) -> Refusal {
    Refusal::invalid(format!("{what}; this model's token ids are 0 to {}", model.vocab_size().saturating_sub(1)))
}

/// Prompts larger than this are tokenized on the blocking pool.
const OFFLOAD_BYTES: usize = 64 * 1024;

pub(super) async fn completions(State(front): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    generate(front, headers, body, Kind::Completion).await
}

pub(super) async fn chat(State(front): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    generate(front, headers, body, Kind::Chat).await
}

/// `GET /v1/models`: every model this sidecar serves, with the fields vLLM adds (`root`, and
/// `max_model_len` where this sidecar runs the model).
pub(super) async fn models(State(front): State<Shared>) -> Json<Value> {
    let created = front.started_unix;
    let data: Vec<Value> = front
        .generators
        .iter()
        .map(|g| (g.name.as_str(), g.platform(), g.context_length()))
        .chain(front.models.iter().map(|m| (m.name.as_str(), m.engine.signature().platform.as_str(), None)))
        .map(|(id, owner, context)| {
            let mut model = json!({"id": id, "object": "model", "created": created, "owned_by": owner, "root": id});
            if let Some(context) = context {
                model["max_model_len"] = json!(context);
            }
            model
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// An error in OpenAI's shape, with `Retry-After` where the refusal has one.
pub(super) fn error(refusal: &Refusal) -> Response {
    let status = status_of(refusal.outcome);
    let mut response = (status, Json(error_body(status, &refusal.message))).into_response();
    if let Some(secs) = refusal.retry_after_secs() {
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

fn refuse(tally: Tally, refusal: Refusal) -> Response {
    tally.count(refusal.outcome);
    error(&refusal)
}

/// A header's whole milliseconds, more than zero.
pub fn millis_header(headers: &HeaderMap, names: &[&str]) -> Result<Option<Duration>, Refusal> {
    for name in names {
        if let Some(value) = headers.get(*name) {
            let text = value.to_str().map_err(|_| Refusal::invalid(format!("header {name} is not readable text")))?;
            let ms: u64 = text.trim().parse().map_err(|_| {
                Refusal::invalid(format!("{name} is '{text}'; it must be a whole number of milliseconds"))
            })?;
            if ms == 0 {
                return Err(Refusal::invalid(format!("{name} is 0; a deadline must be in the future")));
            }
            return Ok(Some(Duration::from_millis(ms)));
        }
    }
    Ok(None)
}

async fn generate(front: Shared, headers: HeaderMap, body: Body, kind: Kind) -> Response {
    let arrival = ferry_core::clock::now();
    let mut tally = front.tally();
    let bytes = match read_body(&front, &headers, body).await {
        Ok(bytes) => bytes,
        Err(refusal) => return refuse(tally, refusal),
    };
    let served = match prompt::model_of(&bytes).and_then(|model| front.find_generating(&model).cloned()) {
        Ok(served) => served,
        Err(refusal) => return refuse(tally, refusal),
    };
    tally.model(served.metrics().outcomes());
    let tenant = match front.authenticate(&headers, &mut tally) {
        Ok(tenant) => tenant,
        Err(refusal) => return refuse(tally, refusal),
    };
    match admit(&front, &served, &headers, &tenant, bytes, kind, arrival).await {
        Ok((Admitted::Choices(submissions), call, held)) => {
            let Backend::Steps(steps) = &served.backend else { unreachable!("admitted for its own backend") };
            let streams = steps.get().expect("admitted only once loaded").1.submit_group(submissions);
            choices::answer(&served, &headers, call, kind, streams, held, tally, arrival).await
        }
        Ok((admitted, call, held)) => {
            let stream = match admitted {
                Admitted::Choices(_) => unreachable!("answered above"),
                Admitted::Steps(submission) => match &served.backend {
                    Backend::Steps(steps) => {
                        steps.get().expect("admitted only once loaded").1.submit(submission, tally)
                    }
                    Backend::Relay(_) => unreachable!("admitted for its own backend"),
                },
                Admitted::Relay(submission) => match &served.backend {
                    Backend::Relay(relay) => relay.submit(submission, tally),
                    Backend::Steps(_) => unreachable!("admitted for its own backend"),
                },
            };
            answer(&served, &headers, call, kind, stream, held, arrival).await
        }
        Err(refusal) => refuse(tally, refusal),
    }
}

/// A request ready for its backend.
enum Admitted {
    Steps(Submission<Prompt>),
    /// `n` > 1 sequences of one prompt, each with its own seed.
    Choices(Vec<Submission<Prompt>>),
    Relay(Submission<relay::Upstream>),
}

/// Everything checked before the request reaches the generator.
async fn admit(
    front: &Front,
    served: &Generating,
    headers: &HeaderMap,
    tenant: &Tenant,
    bytes: Bytes,
    kind: Kind,
    arrival: Instant,
) -> Result<(Admitted, Call, Held), Refusal> {
    if front.is_draining() {
        return Err(Refusal::new(
            Outcome::Draining,
            "draining: this sidecar is shutting down and admits no new requests",
        ));
    }
    if !served.is_ready() {
        let why = match served.backend {
            Backend::Steps(_) => "its engine is still loading",
            Backend::Relay(_) => "its upstream server does not answer its health check",
        };
        return Err(Refusal::new(Outcome::Unavailable, format!("model '{}' is not ready: {why}", served.name))
            .retry_after(Duration::from_secs(1)));
    }
    let size = bytes.len() as u64;
    // The prompt: tokenized by the model (on the blocking pool when it is large: tokenizing takes
    // a while, and the runtime's threads serve every other request), or, for an upstream server,
    // its size in tokens estimated from its bytes.
    let (call, tokens, body) = match &served.backend {
        Backend::Steps(steps) => {
            let engine = steps.get().expect("ready: loaded").0.clone();
            let tool_parser = served.tool_parser;
            // A structured output's format is compiled while the body is read: milliseconds, more
            // for a large schema, whatever the body's size.
            let offload = size as usize > OFFLOAD_BYTES
                || format::FIELDS.iter().chain(&["tools"]).any(|field| {
                    let quoted = format!("\"{field}\"");
                    bytes.windows(quoted.len()).any(|w| w == quoted.as_bytes())
                });
            let read = move || -> Result<(Call, Vec<Vec<u32>>), Refusal> {
                let model = engine.model();
                let mut call = prompt::parse(&bytes, kind, Some(model), tool_parser)?;
                let listed = !call.more.is_empty();
                let first = (std::mem::take(&mut call.prompt), call.ids.take());
                let mut prompts = Vec::with_capacity(1 + call.more.len());
                for (p, (text, ids)) in std::iter::once(first).chain(std::mem::take(&mut call.more)).enumerate() {
                    // Where the prompt is a list, its errors name the prompt: 'prompt'[1][4].
                    let at = if listed { format!("'prompt'[{p}]") } else { "'prompt'".to_owned() };
                    let tokens = match ids {
                        Some(ids) => {
                            if let Some((i, id)) = ids.iter().enumerate().find(|(_, id)| **id >= model.vocab_size()) {
                                return Err(unknown_token(model, &format!("{at}[{i}] is token {id}")));
                            }
                            ids
                        }
                        None => model.encode(&text).map_err(Refusal::invalid)?,
                    };
                    if tokens.is_empty() {
                        let which =
                            if listed { format!("{at} has no tokens") } else { "the prompt has no tokens".into() };
                        return Err(Refusal::invalid(which));
                    }
                    if p == 0 {
                        call.prompt = text;
                    }
                    prompts.push(tokens);
                }
                if let Some((token, _)) = call.sampling.logit_bias.iter().find(|(t, _)| *t >= model.vocab_size()) {
                    return Err(unknown_token(model, &format!("'logit_bias' names token {token}")));
                }
                Ok((call, prompts))
            };
            let (call, tokens) = if offload {
                tokio::task::spawn_blocking(read)
                    .await
                    .map_err(|e| Refusal::new(Outcome::Failed, format!("reading the request failed: {e}")))??
            } else {
                read()?
            };
            (call, Tokens::Ids(tokens), None)
        }
        Backend::Relay(relay) => {
            let call = prompt::parse(&bytes, kind, None, None)?;
            let body: Value = serde_json::from_slice(&bytes).map_err(|e| Refusal::invalid(e.to_string()))?;
            // Token ids are counted; a text is counted by the upstream where it says, else
            // estimated from its bytes. A list of prompts is planned by its longest (the
            // upstream runs them side by side; tokenizers take one prompt), from its bytes.
            let estimate = if !call.more.is_empty() {
                let first = (call.prompt.len(), call.ids.as_ref().map(Vec::len));
                std::iter::once(first)
                    .chain(call.more.iter().map(|(text, ids)| (text.len(), ids.as_ref().map(Vec::len))))
                    .map(|(bytes, ids)| ids.map_or_else(|| relay.estimate_tokens(bytes), |n| n as u32).max(1))
                    .max()
                    .unwrap_or(1)
            } else {
                match &call.ids {
                    Some(ids) => (ids.len() as u32).max(1),
                    None => match relay.count_tokens(kind == Kind::Chat, &body).await {
                        Some(counted) => counted.max(1),
                        None => relay.estimate_tokens(call.prompt.len()),
                    },
                }
            };
            (call, Tokens::Estimated(estimate), Some(body))
        }
    };
    let text = |name: &str| -> Result<Option<&str>, Refusal> {
        headers
            .get(name)
            .map(|v| v.to_str().map_err(|_| Refusal::invalid(format!("header {name} is not readable text"))))
            .transpose()
    };
    let priority = tenant.tier(front.tenants.asked_tier(headers)?)?;
    let timeout = front.deadlines.timeout(priority, text(TIMEOUT_HEADER)?, None)?;
    let ttft = millis_header(headers, &TTFT_HEADERS)?.unwrap_or(served.ttft_budget).min(timeout);
    let itl = millis_header(headers, &ITL_HEADERS)?.unwrap_or(served.itl);
    let default = match kind {
        Kind::Completion => DEFAULT_MAX_TOKENS,
        Kind::Chat => DEFAULT_CHAT_MAX_TOKENS,
    };
    let admitted = match (&served.backend, tokens, body) {
        (Backend::Steps(steps), Tokens::Ids(mut prompts), _) => {
            let context = steps.get().expect("ready: loaded").0.model().context_length();
            let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) as u32;
            let max_tokens = call.max_tokens.unwrap_or_else(|| default.min(context.saturating_sub(longest).max(1)));
            if call.sampling.min_tokens > max_tokens {
                return Err(Refusal::invalid(format!(
                    "'min_tokens' is {}; it must be at most max_tokens ({max_tokens}, {})",
                    call.sampling.min_tokens,
                    if call.max_tokens.is_some() { "as asked" } else { "the default" }
                )));
            }
            let more = prompts.split_off(1);
            let tokens = prompts.pop().expect("one prompt at least");
            let submission = Submission {
                prompt: Prompt { tokens, sampling: call.sampling.clone(), stop: call.stop.clone() },
                max_tokens,
                priority,
                tenant: tenant.id,
                weight: tenant.weight,
                bytes: size,
                arrival,
                ttft_deadline: arrival + ttft,
                itl,
                deadline: arrival + timeout,
            };
            if call.n == 1 && more.is_empty() {
                Admitted::Steps(submission)
            } else {
                // Prompt p's choice i is choice p × n + i, drawn with seed + i, as vLLM seeds the
                // n sequences of each prompt of a list.
                let prompts = std::iter::once(submission.prompt.tokens.clone()).chain(more);
                let mut choices: Vec<Submission<Prompt>> = prompts
                    .flat_map(|tokens| {
                        let submission = &submission;
                        (0..call.n).map(move |i| {
                            let mut s = submission.clone();
                            s.prompt.tokens = tokens.clone();
                            s.prompt.sampling.seed = s.prompt.sampling.seed.wrapping_add(u64::from(i));
                            // Each choice walks its own structured output.
                            s.prompt.sampling.guide = s.prompt.sampling.guide.as_ref().map(Guide::fresh);
                            s
                        })
                    })
                    .collect();
                // The body's bytes shared among its sequences: the queue's byte bound counts the
                // request once.
                let share = size.div_ceil(choices.len() as u64);
                for c in &mut choices {
                    c.bytes = share;
                }
                Admitted::Choices(choices)
            }
        }
        (Backend::Relay(relay), Tokens::Estimated(prompt_tokens), Some(mut body)) => {
            // Without a max_tokens the upstream answers until its model ends or its context is
            // full: admission plans for the context's remainder (its default where the upstream
            // does not say its context), and a refusal says so.
            let max_tokens = call.max_tokens.unwrap_or_else(|| match relay.context_length() {
                Some(context) => context.saturating_sub(prompt_tokens).max(1),
                None => default,
            });
            // What the upstream is asked: this request as it came, streamed (with usage, which
            // teaches the relay the prompt's size in tokens), with the client's max_tokens.
            if let Some(fields) = body.as_object_mut() {
                if let Some(max_tokens) = call.max_tokens {
                    fields.remove("max_completion_tokens");
                    fields.insert("max_tokens".into(), Value::from(max_tokens));
                }
                fields.insert("stream".into(), Value::Bool(true));
                fields.insert("stream_options".into(), json!({"include_usage": true}));
                fields.insert("model".into(), Value::from(relay.model()));
            }
            Admitted::Relay(Submission {
                prompt: relay::Upstream {
                    path: match kind {
                        Kind::Completion => COMPLETIONS,
                        Kind::Chat => CHAT,
                    },
                    body,
                    tokens: prompt_tokens,
                    bytes: call.prompt.len() as u32,
                },
                max_tokens,
                priority,
                tenant: tenant.id,
                weight: tenant.weight,
                bytes: size,
                arrival,
                ttft_deadline: arrival + ttft,
                itl,
                deadline: arrival + timeout,
            })
        }
        _ => unreachable!("the prompt was read for this backend"),
    };
    // The tenant's quotas: this request, its prompt and the most it may produce, and one row (a
    // sequence) held until its answer has begun.
    let (rows, tokens) = match &admitted {
        Admitted::Steps(s) => (1, u64::from(s.prompt.prompt_tokens()) + u64::from(s.max_tokens)),
        Admitted::Choices(c) => {
            let prompts: u64 = c.iter().step_by(call.n as usize).map(|s| u64::from(s.prompt.prompt_tokens())).sum();
            (c.len() as u64, prompts + c.len() as u64 * u64::from(c[0].max_tokens))
        }
        Admitted::Relay(s) => (1, u64::from(s.prompt.prompt_tokens()) + u64::from(s.max_tokens)),
    };
    let held = tenant.take(rows, tokens, ferry_core::clock::now())?;
    Ok((admitted, call, held))
}

/// A prompt as its backend needs it.
enum Tokens {
    /// Each prompt's (one, or a list's).
    Ids(Vec<Vec<u32>>),
    Estimated(u32),
}

/// An SSE event carrying `value`.
pub(super) fn event(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// The event that ends a stream cut short: OpenAI's error shape, `deadline_exceeded` for a
/// deadline; no `[DONE]` follows.
pub fn error_event(refusal: &Refusal) -> Bytes {
    let status = status_of(refusal.outcome);
    let mut body = error_body(status, &refusal.message);
    if refusal.outcome == Outcome::Expired {
        body["error"]["type"] = Value::from("deadline_exceeded");
    }
    event(&body)
}

fn millis(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

async fn answer(
    served: &Generating,
    headers: &HeaderMap,
    call: Call,
    kind: Kind,
    mut stream: Stream,
    mut held: Held,
    arrival: Instant,
) -> Response {
    let mut frame = Frame::for_request(headers, served.name.clone(), kind, call.sampling.logprobs.is_some())
        .with_tools(call.tools.clone());
    // Nothing is sent before the first token (or the end).
    let first = match stream.next().await {
        Some(piece) if piece.is_token() => piece,
        Some(Piece::End(Ok(f))) => return whole(&mut frame, Gathered::default(), &f, &stream, arrival),
        Some(Piece::End(Err(mut refusal))) => {
            // Refused at admission for want of capacity: no work done, its quota given back.
            if matches!(refusal.outcome, Outcome::QueueFull | Outcome::Infeasible) {
                held.refund();
            }
            if refusal.outcome == Outcome::Infeasible
                && call.max_tokens.is_none()
                && matches!(served.backend, Backend::Relay(_))
            {
                refusal.message.push_str(
                    " (no max_tokens was given, so the upstream may answer until its context is full: admission \
                     planned for the rest of its context; give max_tokens)",
                );
            }
            return error(&refusal);
        }
        Some(_) | None => {
            return error(&Refusal::new(Outcome::Failed, "the generator ended the stream without an answer"))
        }
    };
    if !call.stream {
        let mut gathered = Gathered::default();
        gathered.add(first);
        loop {
            match stream.next().await {
                Some(Piece::End(Ok(f))) => return whole(&mut frame, gathered, &f, &stream, arrival),
                Some(Piece::End(Err(refusal))) => return error(&refusal),
                Some(piece) => gathered.add(piece),
                None => {
                    return error(&Refusal::new(Outcome::Failed, "the generator ended the stream without an answer"))
                }
            }
        }
    }
    let timing = format!(
        "queue;dur={}, ttft;dur={}",
        millis(stream.queued().unwrap_or_default()),
        millis(stream.first_token_at().map_or(Duration::ZERO, |t| t - arrival))
    );
    let include_usage = call.include_usage;
    let opening = event(&frame.chunk(first, include_usage).expect("the first token opens the stream"));
    // The tenant's held row travels with the body: it is given back when the stream ends.
    let state = (stream, frame, false, held);
    let rest = futures::stream::unfold(state, move |(mut stream, mut frame, done, held)| async move {
        if done {
            return None;
        }
        loop {
            let (bytes, done) = match stream.next().await? {
                Piece::End(Ok(f)) => {
                    let mut out = Vec::new();
                    if let Some(finish) = frame.finish(&f, include_usage) {
                        out.extend_from_slice(&event(&finish));
                    }
                    if include_usage {
                        out.extend_from_slice(&event(&frame.usage_chunk(&[f])));
                    }
                    out.extend_from_slice(b"data: [DONE]\n\n");
                    (Bytes::from(out), true)
                }
                Piece::End(Err(refusal)) => (error_event(&refusal), true),
                // A token that ends mid-character says nothing yet (unless its log-probability
                // was asked for).
                piece => match frame.chunk(piece, include_usage) {
                    Some(chunk) => (event(&chunk), false),
                    None => continue,
                },
            };
            return Some((Ok::<Bytes, std::io::Error>(bytes), (stream, frame, done, held)));
        }
    });
    let body = futures::stream::once(async move { Ok::<Bytes, std::io::Error>(opening) });
    let body = Body::from_stream(futures::StreamExt::chain(body, rest));
    let mut response = Response::new(body);
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(SERVER_TIMING, HeaderValue::from_str(&timing).expect("ASCII"));
    response
}

/// A whole (not streamed) answer.
fn whole(frame: &mut Frame, gathered: Gathered, f: &Finished, stream: &Stream, arrival: Instant) -> Response {
    let mut response = (StatusCode::OK, Json(frame.whole(gathered, f))).into_response();
    let timing = format!(
        "queue;dur={}, ttft;dur={}, total;dur={}",
        millis(f.queued),
        millis(stream.first_token_at().map_or(f.ttft, |t| t - arrival)),
        millis(ferry_core::clock::elapsed(arrival))
    );
    response.headers_mut().insert(SERVER_TIMING, HeaderValue::from_str(&timing).expect("ASCII"));
    response
}
