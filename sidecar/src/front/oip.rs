//! The Open Inference Protocol v2 (KServe, Triton, Seldon): `POST /v2/models/{name}[/versions/{v}]/infer`
//! read into the shared pipeline ([`super::admit`]) and its answer written back, as JSON or, for
//! outputs asked for so, in Triton's binary tensor data extension ([`super::binary`]). Errors are
//! `{"error": "..."}`.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::admit::{admits, read_body, refuse, Encode, Incoming, Parsed};
use super::idempotent;
use super::{binary, Served, Shared};
use crate::tensor::{parse_inputs, InferRequest, InferResponse, Tensor};
use ferry_core::outcome::Refusal;

/// How an OIP answer is written: the request's `id` echoed, and which outputs go as binary data.
pub(super) struct AnswerForm {
    id: Option<String>,
    binary: Vec<String>,
}

pub(super) async fn infer(
    State(front): State<Shared>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    run(front, name, None, headers, body).await
}

pub(super) async fn infer_version(
    State(front): State<Shared>,
    Path((name, version)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    run(front, name, Some(version), headers, body).await
}

async fn run(front: Shared, name: String, version: Option<String>, headers: HeaderMap, body: Body) -> Response {
    let arrival = ferry_core::clock::now();
    let mut tally = front.tally();
    let served = match front.find(&name, version.as_deref()) {
        Ok(served) => served.clone(),
        Err(refusal) => return refuse(tally, refusal),
    };
    tally.model(served.batcher.metrics().outcomes());
    if let Err(refusal) = admits(&front, &served) {
        return refuse(tally, refusal);
    }
    let bytes = match read_body(&front, &headers, body).await {
        Ok(bytes) => bytes,
        Err(refusal) => return refuse(tally, refusal),
    };
    let path = match &version {
        Some(v) => format!("/v2/models/{name}/versions/{v}/infer"),
        None => format!("/v2/models/{name}/infer"),
    };
    idempotent::call(front, Incoming { served, parse, headers, bytes, arrival }, tally, &path).await
}

/// An infer request's body (JSON, with binary tensor data after it when the header says so).
pub(super) fn parse(served: &Served, headers: &HeaderMap, bytes: &[u8]) -> Result<Parsed, Refusal> {
    let (json, binary_part) = binary::split(headers, bytes)?;
    let mut request: InferRequest = serde_json::from_slice(json)
        .map_err(|e| Refusal::invalid(format!("the body is not a valid infer request: {e}")))?;
    binary::attach(&mut request.inputs, binary_part)?;
    let (inputs, rows) = parse_inputs(request.inputs, served.max_rows)?;
    let flag = |p: Option<&serde_json::Map<String, serde_json::Value>>, key: &str| {
        p.and_then(|p| p.get(key)).and_then(serde_json::Value::as_bool).unwrap_or(false)
    };
    let all_binary = flag(request.parameters.as_ref(), "binary_data_output");
    let binary = match &request.outputs {
        Some(outputs) => outputs
            .iter()
            .filter(|o| all_binary || flag(o.parameters.as_ref(), "binary_data"))
            .map(|o| o.name.clone())
            .collect(),
        None if all_binary => served.engine.signature().outputs.iter().map(|o| o.name.clone()).collect(),
        None => Vec::new(),
    };
    Ok(Parsed {
        inputs,
        rows,
        parameters: request.parameters,
        wanted: request.outputs.map(|o| o.into_iter().map(|o| o.name).collect()),
        answer: Box::new(AnswerForm { id: request.id, binary }),
    })
}

impl Encode for AnswerForm {
    fn encode(&self, served: &Served, outputs: &[Tensor], _tokens: u32) -> Response {
        encode(served, self, outputs)
    }
}

/// The infer response: JSON, or JSON followed by the binary outputs.
fn encode(served: &Served, form: &AnswerForm, outputs: &[Tensor]) -> Response {
    if form.binary.is_empty() {
        return Json(InferResponse {
            model_name: &served.name,
            model_version: &served.version,
            id: form.id.as_deref(),
            outputs,
        })
        .into_response();
    }
    binary_response(served, form.id.as_deref(), outputs, &form.binary)
}

/// An infer response whose `binary` outputs follow the JSON as raw bytes (Triton's extension).
fn binary_response(served: &Served, id: Option<&str>, outputs: &[Tensor], binary: &[String]) -> Response {
    let mut tail = Vec::new();
    let described: Vec<serde_json::Value> = outputs
        .iter()
        .map(|t| {
            if !binary.contains(&t.name) {
                return serde_json::to_value(t).expect("tensors serialize");
            }
            let bytes = binary::encode(t);
            let size = bytes.len();
            tail.extend(bytes);
            json!({ "name": t.name, "datatype": t.datatype.name(), "shape": t.shape, "parameters": { "binary_data_size": size } })
        })
        .collect();
    let mut head = json!({ "model_name": served.name, "model_version": served.version, "outputs": described });
    if let Some(id) = id {
        head["id"] = json!(id);
    }
    let head = serde_json::to_vec(&head).expect("JSON values serialize");
    let length = head.len();
    let mut body = head;
    body.extend(tail);
    let mut response = Response::new(Body::from(body));
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    h.insert(binary::HEADER, HeaderValue::from(length));
    response
}
