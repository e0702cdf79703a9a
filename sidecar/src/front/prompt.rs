//! The body of OpenAI's `POST /v1/completions` and `POST /v1/chat/completions`, read and checked:
//! the prompt (or the conversation, rendered with the model's own chat template), `max_tokens`
//! (or `max_completion_tokens`), sampling (`temperature`, `top_p`, `seed`, `top_k`, `min_p`,
//! `logit_bias`, `ignore_eos`: vLLM's ranges and meanings), `logprobs` (and chat's
//! `top_logprobs`), `stop`, `n` (up to 128), `stream` and `stream_options.include_usage`, and the
//! structured output asked for ([`super::format`], compiled by the model's engine). Fields
//! that would change the answer and that the built-in engines do not act on are refused, naming
//! them ([`super::unserved`]), rather than answered without what they ask for (a relay sends all
//! of them on, and passes back what its upstream answers); fields that do not
//! change it (`user`, `metadata`, ...) are accepted and ignored, as vLLM does. Whole numbers may
//! be written as floats (`610.0`) and seeds may be negative, as OpenAI's schema allows.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::{format, tools, unserved};
use crate::generation::engine::{ChatOptions, LanguageModel, Message, Sampling};
use ferry_core::outcome::Refusal;

/// Which endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// `max_tokens` when a completion names none (OpenAI's own default for completions).
pub const DEFAULT_MAX_TOKENS: u32 = 16;
/// `max_tokens` when a chat completion names none.
pub const DEFAULT_CHAT_MAX_TOKENS: u32 = 256;
/// `stop` strings a request may give (OpenAI's limit).
pub const MAX_STOPS: usize = 4;
/// Bytes of one `stop` string: each token's text is matched against every stop string's
/// beginnings on the step loop's task, so their length is what a token costs there; far longer
/// than any real stop sequence (`"\n\nHuman:"`, `"</answer>"`).
pub const MAX_STOP_BYTES: usize = 256;

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    One(String),
    Many(Vec<String>),
    /// Token ids, as OpenAI and vLLM take them.
    Ids(Vec<u32>),
    ManyIds(Vec<Vec<u32>>),
    Other(serde::de::IgnoredAny),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Option<Content>,
    /// An assistant's calls, a tool result's call id, a participant's name: for the template.
    #[serde(default)]
    tool_calls: Option<Value>,
    #[serde(default)]
    tool_call_id: Option<Value>,
    #[serde(default)]
    name: Option<Value>,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct Body {
    model: String,
    #[serde(default)]
    prompt: Option<Prompt>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    max_tokens: Option<Value>,
    #[serde(default)]
    max_completion_tokens: Option<Value>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    seed: Option<Value>,
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default)]
    n: Option<Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    top_logprobs: Option<Value>,
    #[serde(default)]
    top_k: Option<Value>,
    #[serde(default)]
    min_p: Option<f64>,
    #[serde(default)]
    logit_bias: Option<Map<String, Value>>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    presence_penalty: Option<f64>,
    #[serde(default)]
    frequency_penalty: Option<f64>,
    #[serde(default)]
    repetition_penalty: Option<f64>,
    #[serde(default)]
    min_tokens: Option<Value>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: Option<bool>,
    #[serde(default)]
    chat_template_kwargs: Option<Map<String, Value>>,
    /// Every other field, for [`unserved::check`].
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// The largest `repetition_penalty` (vLLM takes any positive value; past this a prompt's tokens
/// are all but banned, which no client means).
pub const MAX_REPETITION_PENALTY: f64 = 10.0;

/// The roles of OpenAI's chat messages.
pub const ROLES: [&str; 6] = ["system", "developer", "user", "assistant", "tool", "function"];

/// The most tokens a request's `top_logprobs` (chat) or `logprobs` (completions) may ask for
/// at each place (vLLM's default `max_logprobs`; OpenAI's chat limit).
pub const MAX_LOGPROBS: i128 = 20;

/// The most choices a request may ask for (OpenAI's limit for `n`).
pub const MAX_N: i128 = 128;

/// The most entries a `logit_bias` may have (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;

/// OpenAI's `logit_bias`: token ids (as strings) to a bias from -100 to 100, added to their
/// logits. Whether the ids are in the vocabulary is the model's to say.
fn logit_bias(map: Map<String, Value>) -> Result<std::sync::Arc<[(u32, f32)]>, Refusal> {
    if map.len() > MAX_LOGIT_BIAS {
        return Err(Refusal::invalid(format!(
            "'logit_bias' has {} entries; at most {MAX_LOGIT_BIAS} are allowed",
            map.len()
        )));
    }
    let mut seen = std::collections::HashSet::new();
    map.into_iter()
        .map(|(key, value)| {
            let token = key.parse::<u32>().map_err(|_| {
                Refusal::invalid(format!(
                    "'logit_bias' has the key \"{key}\"; keys are token ids (whole numbers from 0)"
                ))
            })?;
            if !seen.insert(token) {
                return Err(Refusal::invalid(format!("'logit_bias' names token {token} twice (\"{key}\")")));
            }
            match value.as_f64() {
                Some(bias) if (-100.0..=100.0).contains(&bias) => Ok((token, bias as f32)),
                _ => Err(Refusal::invalid(format!(
                    "'logit_bias'[\"{key}\"] is {value}; it must be a number from -100 to 100"
                ))),
            }
        })
        .collect()
}

/// A whole number written as JSON's integer or as a float with no fraction (`610.0`: clients
/// that keep every number as a double send those, and OpenAI accepts them), in `[min, max]`;
/// `None` when absent or null.
fn whole(field: &str, value: Option<Value>, min: i128, max: i128) -> Result<Option<i128>, Refusal> {
    let Some(value) = value.filter(|v| !v.is_null()) else { return Ok(None) };
    let n = match &value {
        Value::Number(n) => n
            .as_i64()
            .map(i128::from)
            .or_else(|| n.as_u64().map(i128::from))
            .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 2f64.powi(64)).map(|f| f as i128)),
        _ => None,
    };
    let n = n.ok_or_else(|| Refusal::invalid(format!("'{field}' is {value}; it must be a whole number")))?;
    if n < min {
        return Err(Refusal::invalid(format!("'{field}' is {value}; it must be at least {min}")));
    }
    if n > max {
        return Err(Refusal::invalid(format!("'{field}' is {value}; it must be at most {max}")));
    }
    Ok(Some(n))
}

/// How many of the most likely tokens to return at each place, where log-probabilities are
/// asked for: chat's `logprobs: true` with `top_logprobs`, or completions' `logprobs` (the
/// number itself; `false` from clients that send it as a flag).
fn logprobs(kind: Kind, asked: Option<Value>, top: Option<Value>, most: i128) -> Result<Option<u32>, Refusal> {
    let asked = asked.filter(|v| !v.is_null() && *v != Value::Bool(false));
    match kind {
        Kind::Chat => {
            let top = whole("top_logprobs", top, 0, most)?;
            match asked {
                None if top.unwrap_or(0) > 0 => {
                    Err(Refusal::invalid(format!("'top_logprobs' is {}; it needs 'logprobs': true", top.unwrap_or(0))))
                }
                None => Ok(None),
                Some(Value::Bool(true)) => Ok(Some(top.unwrap_or(0) as u32)),
                Some(other) => Err(Refusal::invalid(format!("'logprobs' is {other}; it must be true or false"))),
            }
        }
        Kind::Completion => {
            // 0, which clients fill in, asks for nothing.
            if let Some(top) = whole("top_logprobs", top, 0, most)?.filter(|n| *n > 0) {
                return Err(Refusal::invalid(format!(
                    "'top_logprobs' is {top}; a completion asks with 'logprobs', the number of most likely tokens"
                )));
            }
            Ok(whole("logprobs", asked, 0, most)?.map(|n| n as u32))
        }
    }
}

/// A request ready for the generator (its prompt still as text: tokenizing is the model's).
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub model: String,
    /// The prompt's text (empty when it came as token ids).
    pub prompt: String,
    /// The prompt as token ids, when it came so (checked against the vocabulary by the caller,
    /// which knows the model).
    pub ids: Option<Vec<u32>>,
    pub max_tokens: Option<u32>,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Choices asked for (`n`): sequences of each prompt, each drawn with its own seed.
    pub n: u32,
    /// A completion's prompts after the first, where `prompt` is a list (text, or token ids):
    /// `n` choices each, indexed after the first's, as vLLM and OpenAI answer a list.
    pub more: Vec<(String, Option<Vec<u32>>)>,
    /// The tool call the answer is forced to be, read back into `tool_calls`.
    pub tools: Option<tools::Mode>,
}

/// The `model` field, read first so that the request can be routed.
pub fn model_of(bytes: &[u8]) -> Result<String, Refusal> {
    #[derive(Deserialize)]
    struct Model {
        model: String,
    }
    serde_json::from_slice::<Model>(bytes)
        .map(|m| m.model)
        .map_err(|e| Refusal::invalid(format!("the body is not a valid completion request: {e}")))
}

/// Reads and checks the body of `kind`'s endpoint; `model` renders a conversation (without one,
/// the upstream renders it, and the prompt is the messages' text, for its size); `tool_parser`
/// reads a model's calls out of its free text, for `tool_choice: "auto"`.
pub fn parse(
    bytes: &[u8],
    kind: Kind,
    model: Option<&dyn LanguageModel>,
    tool_parser: Option<tools::Parser>,
) -> Result<Call, Refusal> {
    let mut body: Body = serde_json::from_slice(bytes)
        .map_err(|e| Refusal::invalid(format!("the body is not a valid completion request: {e}")))?;
    let empty = || Refusal::invalid("'prompt' is an empty list; send at least one prompt");
    // (An upstream server judges its own fields.)
    if kind == Kind::Completion && model.is_some() {
        let templated = [
            ("add_generation_prompt", body.add_generation_prompt == Some(false)),
            ("continue_final_message", body.continue_final_message == Some(true)),
            ("chat_template_kwargs", body.chat_template_kwargs.as_ref().is_some_and(|k| !k.is_empty())),
        ];
        if let Some((field, _)) = templated.iter().find(|t| t.1) {
            return Err(Refusal::invalid(format!(
                "'{field}' is for chat completions: a completion's prompt is not rendered through a template"
            )));
        }
    }
    // The tools, on the built-in engines' chats (an upstream server reads them itself).
    let tools = match (kind, model) {
        (_, None) => None,
        (Kind::Chat, Some(_)) => {
            let (tools, choice, parallel) =
                (body.rest.get("tools"), body.rest.get("tool_choice"), body.rest.get("parallel_tool_calls"));
            tools::read(tools, choice, parallel, tool_parser)?
        }
        (Kind::Completion, Some(_)) => {
            // At their neutral values (no tools, "none" or "auto") they ask nothing.
            let neutral = |v: &Value| v.is_null() || *v == Value::Array(vec![]) || *v == "none" || *v == "auto";
            for field in ["tools", "tool_choice"] {
                if let Some(v) = body.rest.get(field).filter(|v| !neutral(v)) {
                    return Err(Refusal::invalid(format!(
                        "'{field}' is {}; tools are for chat completions",
                        format::shown(v)
                    )));
                }
            }
            None
        }
    };
    let mut ids = None;
    let mut more = Vec::new();
    let prompt = match kind {
        Kind::Completion => match body.prompt {
            Some(Prompt::One(text)) => text,
            Some(Prompt::Many(texts)) => {
                let mut texts = texts.into_iter();
                let first = texts.next().ok_or_else(empty)?;
                more = texts.map(|t| (t, None)).collect();
                first
            }
            Some(Prompt::Ids(list)) => {
                ids = Some(list);
                String::new()
            }
            Some(Prompt::ManyIds(lists)) => {
                let mut lists = lists.into_iter();
                ids = Some(lists.next().ok_or_else(empty)?);
                more = lists.map(|l| (String::new(), Some(l))).collect();
                String::new()
            }
            Some(Prompt::Other(_)) => {
                return Err(Refusal::invalid(
                    "'prompt' must be a string, token ids (whole numbers from 0), or a list of either",
                ))
            }
            None => return Err(Refusal::invalid("'prompt' is missing")),
        },
        Kind::Chat => {
            let messages = body.messages.ok_or_else(|| Refusal::invalid("'messages' is missing"))?;
            if messages.is_empty() {
                return Err(Refusal::invalid("'messages' is empty; send at least one message"));
            }
            let messages = messages
                .into_iter()
                .enumerate()
                .map(|(i, m)| {
                    let content = match m.content {
                        None => String::new(),
                        Some(Content::Text(text)) => text,
                        Some(Content::Parts(parts)) => {
                            let mut text = String::new();
                            for (j, part) in parts.into_iter().enumerate() {
                                match (part.kind.as_str(), part.text) {
                                    // vLLM joins a message's text parts with newlines.
                                    ("text", Some(t)) => {
                                        if j > 0 {
                                            text.push('\n');
                                        }
                                        text.push_str(&t)
                                    }
                                    // An upstream server takes what it takes (images, audio):
                                    // the body goes to it as sent.
                                    _ if model.is_none() => {}
                                    (other, _) => {
                                        return Err(Refusal::invalid(format!(
                                            "messages[{i}].content[{j}] is of type '{other}'; this model takes text parts only"
                                        )))
                                    }
                                }
                            }
                            text
                        }
                    };
                    // The template writes the role into its own text, where special tokens are
                    // read: only OpenAI's roles, so that none can open a turn of its own.
                    if model.is_some() && !ROLES.contains(&m.role.as_str()) {
                        return Err(Refusal::invalid(format!(
                            "messages[{i}].role is '{}'; it must be one of {}",
                            m.role.chars().take(40).collect::<String>(),
                            ROLES.join(", ")
                        )));
                    }
                    let mut extra = Map::new();
                    // (An upstream server renders and judges its own messages.)
                    if let Some(calls) = m.tool_calls.filter(|c| !c.is_null() && model.is_some()) {
                        extra.insert("tool_calls".into(), tools::calls_for_template(i, &calls)?);
                    }
                    for (field, value) in [("tool_call_id", m.tool_call_id), ("name", m.name)] {
                        if let Some(value) = value.filter(|v| !v.is_null()) {
                            extra.insert(field.into(), value);
                        }
                    }
                    Ok(Message { role: m.role, content, extra })
                })
                .collect::<Result<Vec<_>, Refusal>>()?;
            let options = ChatOptions {
                add_generation_prompt: body.add_generation_prompt.unwrap_or(true),
                continue_final_message: body.continue_final_message.unwrap_or(false),
                kwargs: body.chat_template_kwargs.take().unwrap_or_default(),
                tools: tools.as_ref().and_then(|t| t.listed.clone()),
            };
            match model {
                Some(model) => {
                    ids = Some(
                        model
                            .chat_tokens(&messages, &options)
                            .map_err(|e| Refusal::invalid(format!("'messages' cannot be rendered: {e}")))?,
                    );
                    String::new()
                }
                None => messages.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n"),
            }
        }
    };
    let max_tokens = match (body.max_completion_tokens, body.max_tokens) {
        (Some(n), _) if !n.is_null() => whole("max_completion_tokens", Some(n), 1, i128::from(u32::MAX))?,
        (_, n) => whole("max_tokens", n, 1, i128::from(u32::MAX))?,
    }
    .map(|n| n as u32);
    let temperature = body.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(Refusal::invalid(format!("'temperature' is {temperature}; it must be between 0 and 2")));
    }
    let top_p = body.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(Refusal::invalid(format!("'top_p' is {top_p}; it must be more than 0 and at most 1")));
    }
    // An upstream server answers n choices itself, within its own limits.
    let most = if model.is_some() { MAX_N } else { i128::from(u32::MAX) };
    let n = whole("n", body.n, 1, most)?.unwrap_or(1) as u32;
    let prompts = 1 + more.len() as u32;
    if model.is_some() && i128::from(prompts * n.min(MAX_N as u32)) > MAX_N {
        return Err(Refusal::invalid(format!(
            "'prompt' is a list of {prompts} prompts and 'n' is {n}: {} choices; at most {MAX_N} a request",
            u64::from(prompts) * u64::from(n)
        )));
    }
    // OpenAI's seed is a signed 64-bit integer; a negative one draws as its two's complement.
    let seed = whole("seed", body.seed, i128::from(i64::MIN), i128::from(u64::MAX))?.map(|s| s as u64);
    let guide = match model {
        Some(model) => {
            unserved::check(&body.rest)?;
            let forced = tools.as_ref().and_then(|t| t.format.as_ref());
            match (format::read(&body.rest)?, forced) {
                (Some((field, _)), Some(_)) => {
                    return Err(Refusal::invalid(format!(
                        "'{field}' and 'tool_choice' both ask for a structured output; send one of them"
                    )))
                }
                (Some((field, asked)), None) => Some(model.guide(&asked).map_err(|e| {
                    Refusal::invalid(format!("'{field}' is {}: {e}", format::shown(&body.rest[field])))
                })?),
                (None, Some(asked)) => Some(model.guide(asked).map_err(|e| {
                    Refusal::invalid(format!("'tool_choice' is {}: {e}", format::shown(&body.rest["tool_choice"])))
                })?),
                (None, None) => None,
            }
        }
        // An upstream server follows (or refuses) the fields itself.
        None => None,
    };
    // An upstream server has its own limit (vLLM's --max-logprobs).
    let most = if model.is_some() { MAX_LOGPROBS } else { i128::from(u32::MAX) };
    let logprobs = logprobs(kind, body.logprobs, body.top_logprobs, most)?;
    let stop = match body.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(list)) if list.len() > MAX_STOPS => {
            return Err(Refusal::invalid(format!("'stop' has {} strings; at most {MAX_STOPS} are allowed", list.len())))
        }
        Some(Stop::Many(list)) => list,
    };
    if let Some((i, long)) = stop.iter().enumerate().find(|(_, s)| s.len() > MAX_STOP_BYTES) {
        return Err(Refusal::invalid(format!(
            "'stop'[{i}] is {} bytes long; at most {MAX_STOP_BYTES} are allowed",
            long.len()
        )));
    }
    // vLLM's: -1 (or 0) for every token.
    let top_k = whole("top_k", body.top_k, -1, i128::from(u32::MAX))?.map_or(0, |k| k.max(0) as u32);
    let min_p = body.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(Refusal::invalid(format!("'min_p' is {min_p}; it must be between 0 and 1")));
    }
    let logit_bias = logit_bias(body.logit_bias.unwrap_or_default())?;
    let mut penalties = [0.0f32; 2];
    for (value, (field, given)) in penalties
        .iter_mut()
        .zip([("presence_penalty", body.presence_penalty), ("frequency_penalty", body.frequency_penalty)])
    {
        let p = given.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&p) {
            return Err(Refusal::invalid(format!("'{field}' is {p}; it must be between -2 and 2")));
        }
        *value = p as f32;
    }
    let min_tokens = whole("min_tokens", body.min_tokens, 0, i128::from(u32::MAX))?.unwrap_or(0) as u32;
    if let Some(max) = max_tokens.filter(|max| min_tokens > *max) {
        return Err(Refusal::invalid(format!("'min_tokens' is {min_tokens}; it must be at most max_tokens ({max})")));
    }
    let repetition_penalty = body.repetition_penalty.unwrap_or(1.0);
    if !(repetition_penalty > 0.0 && repetition_penalty <= MAX_REPETITION_PENALTY) {
        return Err(Refusal::invalid(format!(
            "'repetition_penalty' is {repetition_penalty}; it must be more than 0 and at most {MAX_REPETITION_PENALTY}"
        )));
    }
    let stream = body.stream.unwrap_or(false);
    Ok(Call {
        model: body.model,
        prompt,
        ids,
        more,
        max_tokens,
        sampling: Sampling {
            temperature: temperature as f32,
            top_p: top_p as f32,
            seed: seed.unwrap_or_else(rand::random),
            top_k,
            min_p: min_p as f32,
            logit_bias,
            ignore_eos: body.ignore_eos.unwrap_or(false),
            presence_penalty: penalties[0],
            frequency_penalty: penalties[1],
            repetition_penalty: repetition_penalty as f32,
            min_tokens,
            logprobs,
            guide,
        },
        stop,
        stream,
        include_usage: stream && body.stream_options.unwrap_or_default().include_usage,
        n,
        tools: tools.and_then(|t| t.mode),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::engine::KvLayout;
    use crate::generation::sim::{SimLlm, SimLlmTimes};
    use serde_json::json;
    use std::time::Duration;

    fn model() -> SimLlm {
        let t = Duration::from_millis(1);
        SimLlm::new(
            SimLlmTimes { step_time: t, prefill_per_token: t, decode_per_seq: t, attention_per_slot: Duration::ZERO },
            KvLayout { blocks: 4, block_size: 4 },
        )
    }

    fn call(kind: Kind, body: serde_json::Value) -> Result<Call, Refusal> {
        parse(body.to_string().as_bytes(), kind, Some(&model()), None)
    }

    #[test]
    fn a_completion_and_a_chat_read_their_fields() {
        let c = call(
            Kind::Completion,
            json!({"model": "m", "prompt": ["a b"], "max_tokens": 5, "temperature": 0, "seed": 7, "stop": "x",
                   "stream": true, "stream_options": {"include_usage": true}, "user": "ignored"}),
        )
        .unwrap();
        assert_eq!((c.prompt.as_str(), c.max_tokens, c.stop.clone()), ("a b", Some(5), vec!["x".to_owned()]));
        assert_eq!((c.sampling.temperature, c.sampling.seed, c.stream, c.include_usage), (0.0, 7, true, true));
        let c = call(
            Kind::Chat,
            json!({"model": "m", "messages": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
                   "max_completion_tokens": 3}),
        )
        .unwrap();
        let rendered = model().encode("be brief hi there").unwrap();
        assert_eq!((c.ids, c.max_tokens, c.stream), (Some(rendered), Some(3), false));
        // A message's text parts are joined by newlines, as vLLM joins them (seen here where no
        // template renders them: an upstream's prompt, for its size).
        let body = json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                          {"type": "text", "text": "there"}]}]});
        let c = parse(body.to_string().as_bytes(), Kind::Chat, None, None).unwrap();
        assert_eq!(c.prompt, "hi\nthere");
    }

    #[test]
    fn vllms_sampling_controls_are_read_with_its_ranges() {
        let c = call(
            Kind::Completion,
            json!({"model": "m", "prompt": "a", "top_k": 40, "min_p": 0.05, "logit_bias": {"7": -100, "3": 2.5},
                   "ignore_eos": true}),
        )
        .unwrap();
        let mut bias = c.sampling.logit_bias.to_vec();
        bias.sort_by_key(|b| b.0);
        assert_eq!((c.sampling.top_k, c.sampling.min_p, c.sampling.ignore_eos), (40, 0.05, true));
        assert_eq!(bias, vec![(3, 2.5), (7, -100.0)]);
        let c = call(
            Kind::Completion,
            json!({"model": "m", "prompt": "a", "presence_penalty": -2, "frequency_penalty": 0.5,
                   "repetition_penalty": 1.2}),
        )
        .unwrap();
        let s = &c.sampling;
        assert_eq!((s.presence_penalty, s.frequency_penalty, s.repetition_penalty), (-2.0, 0.5, 1.2));
        assert!(s.penalised());
        assert_eq!(
            call(Kind::Completion, json!({"model": "m", "prompt": "a", "frequency_penalty": 2.5})).unwrap_err().message,
            "'frequency_penalty' is 2.5; it must be between -2 and 2"
        );
        assert_eq!(
            call(Kind::Completion, json!({"model": "m", "prompt": "a", "repetition_penalty": 0})).unwrap_err().message,
            "'repetition_penalty' is 0; it must be more than 0 and at most 10"
        );
        let c = call(Kind::Completion, json!({"model": "m", "prompt": "a", "top_k": -1})).unwrap();
        assert!(!c.sampling.penalised());
        assert_eq!(c.sampling.min_tokens, 0);
        let c = call(Kind::Completion, json!({"model": "m", "prompt": "a", "min_tokens": 4, "max_tokens": 4})).unwrap();
        assert_eq!(c.sampling.min_tokens, 4);
        assert_eq!(
            call(Kind::Completion, json!({"model": "m", "prompt": "a", "min_tokens": 5, "max_tokens": 4}))
                .unwrap_err()
                .message,
            "'min_tokens' is 5; it must be at most max_tokens (4)"
        );
        assert_eq!((c.sampling.top_k, c.sampling.min_p, c.sampling.ignore_eos), (0, 0.0, false));
        let err = |body| call(Kind::Completion, body).unwrap_err().message;
        assert_eq!(err(json!({"model": "m", "prompt": "a", "top_k": -2})), "'top_k' is -2; it must be at least -1");
        assert_eq!(
            err(json!({"model": "m", "prompt": "a", "min_p": 1.5})),
            "'min_p' is 1.5; it must be between 0 and 1"
        );
        assert_eq!(
            err(json!({"model": "m", "prompt": "a", "logit_bias": {"x": 1}})),
            "'logit_bias' has the key \"x\"; keys are token ids (whole numbers from 0)"
        );
        assert_eq!(
            err(json!({"model": "m", "prompt": "a", "logit_bias": {"5": 101}})),
            "'logit_bias'[\"5\"] is 101; it must be a number from -100 to 100"
        );
        assert_eq!(
            err(json!({"model": "m", "prompt": "a", "logit_bias": {"7": 1, "07": 2}})),
            "'logit_bias' names token 7 twice (\"07\")"
        );
        let many: Map<String, Value> = (0..301).map(|i| (i.to_string(), json!(1))).collect();
        assert_eq!(
            err(json!({"model": "m", "prompt": "a", "logit_bias": many})),
            "'logit_bias' has 301 entries; at most 300 are allowed"
        );
    }

    #[test]
    fn a_prompt_may_come_as_token_ids() {
        for prompt in [json!([5, 0, 7]), json!([[5, 0, 7]])] {
            let c = call(Kind::Completion, json!({"model": "m", "prompt": prompt})).unwrap();
            assert_eq!((c.prompt.as_str(), c.ids), ("", Some(vec![5, 0, 7])));
        }
    }

    #[test]
    fn whole_numbers_written_as_floats_and_negative_seeds_are_read_as_openai_reads_them() {
        let c = call(Kind::Completion, json!({"model": "m", "prompt": "a", "max_tokens": 610.0, "n": 1.0, "seed": -1}))
            .unwrap();
        assert_eq!((c.max_tokens, c.sampling.seed), (Some(610), u64::MAX));
        let c = call(Kind::Completion, json!({"model": "m", "prompt": "a", "seed": 7.0, "max_tokens": null})).unwrap();
        assert_eq!((c.max_tokens, c.sampling.seed), (None, 7));
        let err = |body| call(Kind::Completion, body).unwrap_err().message;
        assert_eq!(
            err(json!({"model": "m", "prompt": "a", "max_tokens": 5.5})),
            "'max_tokens' is 5.5; it must be a whole number"
        );
        assert_eq!(
            err(json!({"model": "m", "prompt": "a", "max_tokens": -3})),
            "'max_tokens' is -3; it must be at least 1"
        );
        assert_eq!(
            err(json!({"model": "m", "prompt": "a", "max_completion_tokens": "9"})),
            "'max_completion_tokens' is \"9\"; it must be a whole number"
        );
    }

    #[test]
    fn a_field_the_engine_would_ignore_is_refused_but_a_relay_sends_it_on() {
        let body = json!({"model": "m", "prompt": "a", "response_format": {"type": "json_object"}, "user": "u"});
        let refused = call(Kind::Completion, body.clone()).unwrap_err();
        assert_eq!(refused.outcome, ferry_core::outcome::Outcome::Invalid);
        assert!(refused.message.starts_with("'response_format' is {"), "{}", refused.message);
        // Without a model here, an upstream server answers: it reads the field itself.
        assert!(parse(body.to_string().as_bytes(), Kind::Completion, None, None).is_ok());
    }

    #[test]
    fn bad_fields_are_named_with_their_value_and_limit() {
        let err = |kind, body| call(kind, body).unwrap_err().message;
        assert_eq!(
            err(Kind::Completion, json!({"model": "m", "prompt": "a", "n": 129})),
            "'n' is 129; it must be at most 128"
        );
        assert_eq!(call(Kind::Completion, json!({"model": "m", "prompt": "a", "n": 3.0})).unwrap().n, 3);
        assert_eq!(
            err(Kind::Completion, json!({"model": "m", "prompt": "a", "max_tokens": 0})),
            "'max_tokens' is 0; it must be at least 1"
        );
        assert!(err(Kind::Completion, json!({"model": "m", "prompt": "a", "temperature": 3}))
            .contains("'temperature' is 3"));
        assert!(err(Kind::Completion, json!({"model": "m", "prompt": "a", "top_p": 0})).contains("'top_p' is 0"));
        assert!(err(Kind::Completion, json!({"model": "m", "prompt": [1, -2]})).contains("a list of either"));
        let listed = call(Kind::Completion, json!({"model": "m", "prompt": ["a", "b", "c"], "n": 2})).unwrap();
        assert_eq!((listed.prompt.as_str(), listed.more.len(), listed.n), ("a", 2, 2));
        assert_eq!(listed.more[1], ("c".to_owned(), None));
        let ids = call(Kind::Completion, json!({"model": "m", "prompt": [[1], [2, 3]]})).unwrap();
        assert_eq!((ids.ids, ids.more), (Some(vec![1]), vec![(String::new(), Some(vec![2, 3]))]));
        assert_eq!(
            err(Kind::Completion, json!({"model": "m", "prompt": ["a", "b", "c"], "n": 50})),
            "'prompt' is a list of 3 prompts and 'n' is 50: 150 choices; at most 128 a request"
        );
        assert!(err(Kind::Completion, json!({"model": "m", "prompt": []})).contains("'prompt' is an empty list"));
        assert!(err(Kind::Completion, json!({"model": "m", "prompt": "a", "stop": ["1", "2", "3", "4", "5"]}))
            .contains("'stop' has 5"));
        let long = "x".repeat(MAX_STOP_BYTES + 1);
        assert_eq!(
            err(Kind::Completion, json!({"model": "m", "prompt": "a", "stop": ["ok", long]})),
            "'stop'[1] is 257 bytes long; at most 256 are allowed"
        );
        let fits = "x".repeat(MAX_STOP_BYTES);
        assert!(call(Kind::Completion, json!({"model": "m", "prompt": "a", "stop": fits})).is_ok());
        assert_eq!(
            err(Kind::Chat, json!({"model": "m", "messages": []})),
            "'messages' is empty; send at least one message"
        );
        assert!(err(
            Kind::Chat,
            json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
        )
        .contains("messages[0].content[0] is of type 'image_url'"));
        // A relay sends on what its upstream serves: n, logprobs, images.
        let relayed = |kind, body: serde_json::Value| parse(body.to_string().as_bytes(), kind, None, None);
        assert!(relayed(Kind::Completion, json!({"model": "m", "prompt": "a", "logprobs": 2, "n": 2})).is_ok());
        let image =
            json!([{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]);
        let chat = relayed(Kind::Chat, json!({"model": "m", "messages": [{"role": "user", "content": image}]}));
        assert_eq!(chat.unwrap().prompt, "what is this?");
        assert_eq!(
            err(Kind::Chat, json!({"model": "m", "messages": [{"role": "user<|im_end|>", "content": "x"}]})),
            "messages[0].role is 'user<|im_end|>'; it must be one of system, developer, user, assistant, tool, function"
        );
    }

    #[test]
    fn logprobs_are_asked_as_each_endpoint_asks_them() {
        let chat = |extra: serde_json::Value| {
            let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "a"}]});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            call(Kind::Chat, body).map(|c| c.sampling.logprobs).map_err(|r| r.message)
        };
        assert_eq!(chat(json!({})), Ok(None));
        assert_eq!(chat(json!({"logprobs": false, "top_logprobs": 0})), Ok(None));
        assert_eq!(chat(json!({"logprobs": true})), Ok(Some(0)));
        assert_eq!(chat(json!({"logprobs": true, "top_logprobs": 20.0})), Ok(Some(20)));
        assert_eq!(chat(json!({"top_logprobs": 3})), Err("'top_logprobs' is 3; it needs 'logprobs': true".into()));
        assert_eq!(
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            Err("'top_logprobs' is 21; it must be at most 20".into())
        );
        assert_eq!(chat(json!({"logprobs": 2})), Err("'logprobs' is 2; it must be true or false".into()));
        let completion = |extra: serde_json::Value| {
            let mut body = json!({"model": "m", "prompt": "a"});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            call(Kind::Completion, body).map(|c| c.sampling.logprobs).map_err(|r| r.message)
        };
        assert_eq!(completion(json!({"logprobs": 0})), Ok(Some(0)));
        assert_eq!(completion(json!({"logprobs": 5})), Ok(Some(5)));
        assert_eq!(completion(json!({"logprobs": null})), Ok(None));
        assert_eq!(completion(json!({"logprobs": -1})), Err("'logprobs' is -1; it must be at least 0".into()));
        assert!(completion(json!({"top_logprobs": 2})).unwrap_err().contains("a completion asks with 'logprobs'"));
        assert_eq!(completion(json!({"top_logprobs": 0})), Ok(None));
    }
}
