//! The `remote` engine: an inference server beside the sidecar in the pod (Triton, MLServer, or
//! anything else that speaks the Open Inference Protocol), reached over HTTP on localhost. The
//! sidecar does the admission and batching; each batch goes upstream as one OIP request whose
//! inputs are the requests' rows stacked, and its outputs are split back by rows.
//!
//! The model's signature is read from the server's model metadata; until that succeeds (a server
//! can take minutes to load a model) the engine is not ready, and neither is the sidecar.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde_json::json;

use super::{BatchOutputs, BoxFuture, Engine, EngineError, Inputs, Signature, TensorSpec, Tokens};
use crate::tensor::{parse_tensor, RawTensor, Tensor};

#[derive(Debug)]
pub struct RemoteEngine {
    /// `http://127.0.0.1:8000/v2/models/NAME/versions/VERSION`
    model_url: String,
    model: String,
    client: reqwest::Client,
    signature: Arc<OnceLock<Signature>>,
    waiting: Signature,
}

impl RemoteEngine {
    /// Starts reading the model's metadata from `upstream` (retrying every `retry` until it
    /// answers) and returns the engine at once.
    pub fn start(upstream: &str, model: &str, version: &str, retry: Duration) -> Arc<RemoteEngine> {
        let model_url = format!("{}/v2/models/{model}/versions/{version}", upstream.trim_end_matches('/'));
        let client = reqwest::Client::builder().timeout(Duration::from_secs(300)).build().expect("an HTTP client");
        let signature = Arc::new(OnceLock::new());
        let waiting = Signature { platform: "remote (loading)".into(), inputs: Vec::new(), outputs: Vec::new() };
        let engine = Arc::new(RemoteEngine { model_url, model: model.to_owned(), client, signature, waiting });
        let (client, url, slot) = (engine.client.clone(), engine.model_url.clone(), engine.signature.clone());
        tokio::spawn(async move {
            loop {
                match metadata(&client, &url).await {
                    Ok(signature) => {
                        tracing::info!(%url, inputs = signature.inputs.len(), "the upstream model is ready");
                        let _ = slot.set(signature);
                        return;
                    }
                    Err(e) => tracing::info!(%url, error = %e, "waiting for the upstream model"),
                }
                tokio::time::sleep(retry).await;
            }
        });
        engine
    }
}

async fn metadata(client: &reqwest::Client, url: &str) -> Result<Signature, String> {
    let ready = client.get(format!("{url}/ready")).send().await.map_err(|e| e.to_string())?;
    if !ready.status().is_success() {
        return Err(format!("{url}/ready answered {}", ready.status()));
    }
    let meta: serde_json::Value =
        client.get(url).send().await.map_err(|e| e.to_string())?.json().await.map_err(|e| e.to_string())?;
    let specs = |key: &str| -> Result<Vec<TensorSpec>, String> {
        serde_json::from_value(meta.get(key).cloned().unwrap_or(json!([])))
            .map_err(|e| format!("the model metadata's '{key}' does not parse: {e}"))
    };
    let platform = meta.get("platform").and_then(|p| p.as_str()).unwrap_or("remote").to_owned();
    Ok(Signature { platform, inputs: specs("inputs")?, outputs: specs("outputs")? })
}

impl Engine for RemoteEngine {
    fn signature(&self) -> &Signature {
        self.signature.get().unwrap_or(&self.waiting)
    }

    fn ready(&self) -> bool {
        self.signature.get().is_some()
    }

    /// Every declared input present, with its datatype and the fixed inner dimensions.
    fn check(&self, inputs: &[Tensor]) -> Result<Tokens, String> {
        let sig = self.signature();
        for input in inputs {
            let Some(spec) = sig.inputs.iter().find(|s| s.name == input.name) else {
                let known: Vec<&str> = sig.inputs.iter().map(|s| s.name.as_str()).collect();
                return Err(format!(
                    "input '{}' is not an input of model '{}'; it has {}",
                    input.name,
                    self.model,
                    known.join(", ")
                ));
            };
            if spec.datatype != input.datatype.name() {
                return Err(format!(
                    "input '{}' has datatype {}; model '{}' takes {}",
                    input.name,
                    input.datatype.name(),
                    self.model,
                    spec.datatype
                ));
            }
            let fixed = spec.shape.get(1..).unwrap_or(&[]);
            let ok = fixed.len() == input.inner().len()
                && fixed.iter().zip(input.inner()).all(|(want, got)| *want < 0 || *want as u64 == *got);
            if !ok {
                return Err(format!(
                    "input '{}' has shape {:?}; model '{}' takes {:?} (-1: any size, the first dimension is rows)",
                    input.name, input.shape, self.model, spec.shape
                ));
            }
        }
        if let Some(missing) = sig.inputs.iter().find(|s| !inputs.iter().any(|i| i.name == s.name)) {
            return Err(format!("input '{}' of model '{}' is missing", missing.name, self.model));
        }
        Ok(Tokens::default())
    }

    fn infer(&self, batch: Vec<Inputs>) -> BoxFuture<Result<BatchOutputs, EngineError>> {
        let (client, url) = (self.client.clone(), format!("{}/infer", self.model_url));
        Box::pin(async move {
            // Requests whose inner shapes differ (variable sizes) cannot share one tensor: each
            // group of equal shapes goes up as one request.
            let mut groups: Vec<(Vec<Vec<u64>>, Vec<usize>)> = Vec::new();
            for (i, inputs) in batch.iter().enumerate() {
                let key: Vec<Vec<u64>> = inputs.iter().map(|t| t.inner().to_vec()).collect();
                match groups.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, members)) => members.push(i),
                    None => groups.push((key, vec![i])),
                }
            }
            let mut outputs: Vec<Option<Vec<Tensor>>> = vec![None; batch.len()];
            for (_, members) in groups {
                let parts: Vec<&Inputs> = members.iter().map(|&i| &batch[i]).collect();
                for (&i, split) in members.iter().zip(infer_group(&client, &url, &parts).await?) {
                    outputs[i] = Some(split);
                }
            }
            Ok(outputs.into_iter().map(|o| o.expect("every request is in a group")).collect())
        })
    }
}

/// One upstream request for requests of equal inner shapes; returns each request's outputs.
async fn infer_group(client: &reqwest::Client, url: &str, parts: &[&Inputs]) -> Result<Vec<Vec<Tensor>>, EngineError> {
    let rows: Vec<u64> = parts.iter().map(|inputs| inputs[0].rows()).collect();
    let mut stacked = Vec::new();
    for (k, first) in parts[0].iter().enumerate() {
        let same: Vec<&Tensor> =
            parts.iter().filter_map(|inputs| inputs.iter().find(|t| t.name == first.name)).collect();
        let tensor = Tensor::concat_rows(&same).filter(|_| same.len() == parts.len()).ok_or_else(|| {
            EngineError(format!("input {k} ('{}') differs between the requests of a batch", first.name))
        })?;
        stacked.push(tensor);
    }
    let response = client
        .post(url)
        .json(&json!({ "inputs": stacked }))
        .send()
        .await
        .map_err(|e| EngineError(format!("upstream {url}: {e}")))?;
    let status = response.status();
    let body: serde_json::Value = response
        .json()
        .await
        .map_err(|e| EngineError(format!("upstream {url} answered {status} with no JSON: {e}")))?;
    if !status.is_success() {
        let error = body.get("error").and_then(|e| e.as_str()).unwrap_or("no error message");
        return Err(EngineError(format!("upstream answered {status}: {error}")));
    }
    let raw: Vec<RawTensor> = serde_json::from_value(body.get("outputs").cloned().unwrap_or(json!([])))
        .map_err(|e| EngineError(format!("upstream outputs do not parse: {e}")))?;
    let mut per_request: Vec<Vec<Tensor>> = vec![Vec::new(); parts.len()];
    for (i, raw) in raw.into_iter().enumerate() {
        let output = parse_tensor(i, raw).map_err(|e| EngineError(format!("upstream output: {e}")))?;
        let split = output.split_rows(&rows).ok_or_else(|| {
            EngineError(format!(
                "upstream output '{}' has {} rows for a batch of {}",
                output.name,
                output.rows(),
                rows.iter().sum::<u64>()
            ))
        })?;
        for (mine, part) in per_request.iter_mut().zip(split) {
            mine.push(part);
        }
    }
    Ok(per_request)
}
