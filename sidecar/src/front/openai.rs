//! The OpenAI-compatible embeddings API, `POST /v1/embeddings`, on top of the same admission,
//! batching and engine as the Open Inference Protocol: a request's `input` becomes the rows of
//! the BYTES tensor `text`, its embeddings come back as `data[].embedding`.
//!
//! As OpenAI's API does: `input` is a string or a list of strings, `encoding_format` is `float`
//! (the default) or `base64` (little-endian f32, which the official Python client asks for),
//! `dimensions` may only repeat the model's width (these embeddings are not truncatable), `usage`
//! counts the tokens the model read. Errors have OpenAI's shape: `{"error": {"message", "type",
//! "param", "code"}}`.

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response as HttpResponse};
use axum::Json;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::admit::{admits, read_body, refuse, Encode, Incoming, Parsed};
use super::idempotent;
use super::{Served, Shared};
use crate::engine::embedding::{INPUT, OUTPUT};
use crate::tensor::{DataType, Tensor, TensorData};
use ferry_core::outcome::{Outcome, Refusal};

pub const PATH: &str = "/v1/embeddings";

/// How embeddings are written in the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Float,
    Base64,
}

/// `input`: one text or several. Token-id arrays (which OpenAI also takes) are refused with a
/// clear message: the tokenizer is the model's own, and ids from another would be meaningless.
#[derive(Deserialize)]
#[serde(untagged)]
enum Input {
    One(String),
    Many(Vec<String>),
    Other(serde::de::IgnoredAny),
}

#[derive(Deserialize)]
pub struct EmbeddingsRequest {
    pub model: String,
    input: Input,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<u64>,
    /// OpenAI's end-user tag; accepted and ignored.
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
}

/// A parsed request: its texts as the `text` tensor, its rows and how to write the answer.
pub struct Call {
    pub inputs: Vec<Tensor>,
    pub rows: u32,
    pub encoding: Encoding,
}

/// The `model` field, read before anything else so that the request can be routed.
pub fn model_of(bytes: &[u8]) -> Result<String, Refusal> {
    #[derive(Deserialize)]
    struct Model {
        model: String,
    }
    serde_json::from_slice::<Model>(bytes)
        .map(|m| m.model)
        .map_err(|e| Refusal::invalid(format!("the body is not a valid embeddings request: {e}")))
}

impl EmbeddingsRequest {
    pub fn parse(bytes: &[u8]) -> Result<EmbeddingsRequest, Refusal> {
        serde_json::from_slice(bytes)
            .map_err(|e| Refusal::invalid(format!("the body is not a valid embeddings request: {e}")))
    }

    /// Checks the fields against the model (`dim` wide, at most `max_rows` texts per request).
    pub fn into_call(self, dim: usize, max_rows: u32) -> Result<Call, Refusal> {
        let texts = match self.input {
            Input::One(text) => vec![text],
            Input::Many(texts) if texts.is_empty() => {
                return Err(Refusal::invalid("'input' is an empty list; send at least one text"))
            }
            Input::Many(texts) => texts,
            Input::Other(_) => {
                return Err(Refusal::invalid(
                    "'input' must be a string or a list of strings; token ids are not accepted (the model tokenizes its own text)",
                ))
            }
        };
        if texts.len() > max_rows as usize {
            return Err(Refusal::new(
                Outcome::TooLarge,
                format!(
                    "'input' has {} texts; this service accepts at most {max_rows} per request (maxBatchSize)",
                    texts.len()
                ),
            ));
        }
        let encoding = match self.encoding_format.as_deref() {
            None | Some("float") => Encoding::Float,
            Some("base64") => Encoding::Base64,
            Some(other) => {
                return Err(Refusal::invalid(format!("'encoding_format' is '{other}'; it must be 'float' or 'base64'")))
            }
        };
        if let Some(d) = self.dimensions.filter(|&d| d != dim as u64) {
            return Err(Refusal::invalid(format!(
                "'dimensions' is {d}; this model's embeddings have {dim} dimensions and cannot be shortened"
            )));
        }
        let rows = texts.len() as u32;
        let text = Tensor {
            name: INPUT.into(),
            datatype: DataType::Bytes,
            shape: vec![u64::from(rows)],
            data: TensorData::Bytes(texts),
        };
        Ok(Call { inputs: vec![text], rows, encoding })
    }
}

/// The response body: one `data` entry per text, in order.
#[derive(Debug, Serialize)]
pub struct Response<'a> {
    object: &'static str,
    data: Vec<Item>,
    model: &'a str,
    usage: Usage,
}

#[derive(Debug, Serialize)]
struct Item {
    object: &'static str,
    index: usize,
    embedding: Embedding,
}

/// Floats as f32, so that JSON carries the shortest text that reads back the same f32.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Embedding {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Debug, Serialize)]
struct Usage {
    prompt_tokens: u32,
    total_tokens: u32,
}

pub fn response<'a>(model: &'a str, outputs: &[Tensor], prompt_tokens: u32, encoding: Encoding) -> Response<'a> {
    let mut data = Vec::new();
    if let Some(Tensor { data: TensorData::Float(values), shape, .. }) = outputs.iter().find(|t| t.name == OUTPUT) {
        let dim = shape.get(1).copied().unwrap_or(1).max(1) as usize;
        for (index, row) in values.chunks(dim).enumerate() {
            let floats = row.iter().map(|&x| x as f32);
            let embedding = match encoding {
                Encoding::Float => Embedding::Float(floats.collect()),
                Encoding::Base64 => {
                    let bytes: Vec<u8> = floats.flat_map(f32::to_le_bytes).collect();
                    Embedding::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
            };
            data.push(Item { object: "embedding", index, embedding });
        }
    }
    Response { object: "list", data, model, usage: Usage { prompt_tokens, total_tokens: prompt_tokens } }
}

/// An error body in OpenAI's shape, from Ferry's status and message.
pub fn error_body(status: StatusCode, message: &str) -> Value {
    let kind = match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    };
    json!({ "error": { "message": message, "type": kind, "param": null, "code": status.as_u16().to_string() } })
}

/// `POST /v1/embeddings`: the model is named in the body, so the body is read first. Errors are
/// rewritten into OpenAI's shape at the end, replays included.
pub(super) async fn embeddings(State(front): State<Shared>, headers: HeaderMap, body: Body) -> HttpResponse {
    let arrival = ferry_core::clock::now();
    let mut tally = front.tally();
    let response = async {
        let bytes = match read_body(&front, &headers, body).await {
            Ok(bytes) => bytes,
            Err(refusal) => return refuse(tally, refusal),
        };
        let served = match model_of(&bytes).and_then(|model| front.find(&model, None).cloned()) {
            Ok(served) => served,
            Err(refusal) => return refuse(tally, refusal),
        };
        tally.model(served.batcher.metrics().outcomes());
        if let Err(refusal) = admits(&front, &served) {
            return refuse(tally, refusal);
        }
        idempotent::call(front.clone(), Incoming { served, parse, headers, bytes, arrival }, tally, PATH).await
    }
    .await;
    if response.status().is_success() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let body = error_body(parts.status, &message).to_string();
    HttpResponse::from_parts(parts, Body::from(body))
}

/// An embeddings request read into the shared pipeline, for an embedding model only.
pub(super) fn parse(served: &Served, _headers: &HeaderMap, bytes: &[u8]) -> Result<Parsed, Refusal> {
    let signature = served.engine.signature();
    let embeds = signature.inputs.iter().any(|i| i.name == INPUT && i.datatype == "BYTES")
        && signature.outputs.iter().any(|o| o.name == OUTPUT);
    if !embeds {
        return Err(Refusal::new(
            Outcome::NotFound,
            format!(
                "model '{}' is not an embedding model (engine {}); {PATH} serves the cuda engine's models",
                served.name, signature.platform,
            ),
        ));
    }
    let dim = signature.outputs[0].shape.get(1).copied().unwrap_or(0).max(0) as usize;
    let call = EmbeddingsRequest::parse(bytes)?.into_call(dim, served.max_rows)?;
    Ok(Parsed { inputs: call.inputs, rows: call.rows, parameters: None, wanted: None, answer: Box::new(call.encoding) })
}

/// The embeddings response.
impl Encode for Encoding {
    fn encode(&self, served: &Served, outputs: &[Tensor], tokens: u32) -> HttpResponse {
        encode(served, outputs, tokens, *self)
    }
}

fn encode(served: &Served, outputs: &[Tensor], prompt_tokens: u32, encoding: Encoding) -> HttpResponse {
    Json(response(&served.name, outputs, prompt_tokens, encoding)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(body: Value) -> Result<Call, Refusal> {
        EmbeddingsRequest::parse(body.to_string().as_bytes())?.into_call(384, 4)
    }

    #[test]
    fn one_text_or_several() {
        let one = call(json!({"model": "m", "input": "hello"})).unwrap();
        assert_eq!((one.rows, one.encoding), (1, Encoding::Float));
        assert_eq!(one.inputs[0].data, TensorData::Bytes(vec!["hello".into()]));
        let many = call(json!({"model": "m", "input": ["a", "b"], "encoding_format": "base64"})).unwrap();
        assert_eq!((many.rows, many.encoding), (2, Encoding::Base64));
        assert_eq!(many.inputs[0].shape, vec![2]);
    }

    #[test]
    fn bad_fields_are_named() {
        let cases = [
            (json!({"model": "m", "input": []}), "'input' is an empty list"),
            (json!({"model": "m", "input": [[101, 102]]}), "token ids are not accepted"),
            (json!({"model": "m", "input": "x", "encoding_format": "int8"}), "'encoding_format' is 'int8'"),
            (
                json!({"model": "m", "input": "x", "dimensions": 128}),
                "'dimensions' is 128; this model's embeddings have 384",
            ),
            (
                json!({"model": "m", "input": ["a", "b", "c", "d", "e"]}),
                "'input' has 5 texts; this service accepts at most 4",
            ),
        ];
        for (body, want) in cases {
            let err = call(body.clone()).err().unwrap_or_else(|| panic!("{body} accepted"));
            assert!(err.message.contains(want), "{body}: {}", err.message);
        }
        assert!(call(json!({"input": "x"})).is_err(), "model is required");
    }

    #[test]
    fn base64_is_little_endian_f32() {
        let out = Tensor {
            name: OUTPUT.into(),
            datatype: DataType::Fp32,
            shape: vec![1, 2],
            data: TensorData::Float(vec![1.0, -0.5]),
        };
        let body = serde_json::to_value(response("m", &[out], 3, Encoding::Base64)).unwrap();
        let text = body["data"][0]["embedding"].as_str().unwrap();
        let bytes = base64::engine::general_purpose::STANDARD.decode(text).unwrap();
        assert_eq!(bytes, [1.0f32.to_le_bytes(), (-0.5f32).to_le_bytes()].concat());
        assert_eq!(body["usage"]["prompt_tokens"], 3);
    }

    #[test]
    fn floats_are_written_as_f32() {
        let out = Tensor {
            name: OUTPUT.into(),
            datatype: DataType::Fp32,
            shape: vec![1, 1],
            data: TensorData::Float(vec![f64::from(0.1f32)]),
        };
        let text = serde_json::to_string(&response("m", &[out], 1, Encoding::Float)).unwrap();
        assert!(text.contains(r#""embedding":[0.1]"#), "{text}");
    }
}
