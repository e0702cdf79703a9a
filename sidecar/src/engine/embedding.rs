//! The local model engine (`spec.engine.kind: cuda`): a BERT-family sentence-embedding model
//! ([`crate::embed`]) on a GPU through cudarc, or on the CPU with the same weights.
//!
//! Each request carries texts, one per row, as the BYTES input `text` (shape `[rows]` or
//! `[rows, 1]`, as Triton clients send strings); each gets back the FP32 output `embedding`,
//! `[rows, dim]`, unit length. Admission prices a request by its tokens, so the batch-time
//! estimate learns what long inputs cost.
//!
//! The model loads in the background: the sidecar answers health checks meanwhile (live, not
//! ready), as Kubernetes expects of a pod whose model takes a while to reach the GPU.

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::oneshot;

use super::{BatchOutputs, BoxFuture, Engine, EngineError, Inputs, Signature, TensorSpec, Tokens};
use crate::embed::{Config, Device, Model, Overflow, TokenBatch};
use crate::tensor::{DataType, Tensor, TensorData};
use ferry_core::estimate::CostModel;

pub const INPUT: &str = "text";
pub const OUTPUT: &str = "embedding";

pub struct EmbeddingEngine {
    model: OnceLock<Arc<Model>>,
    signature: Signature,
}

/// A model loaded and calibrated off the async runtime, to be installed with
/// [`EmbeddingEngine::install`].
pub type Loaded = Result<(Model, CostModel), String>;

impl EmbeddingEngine {
    /// Reads the model's configuration now, so that a wrong directory stops the sidecar at once,
    /// and loads the weights onto `device` on a thread of its own; `loaded` resolves when that is
    /// done (or failed). The engine is not ready until the model is installed.
    pub fn start(
        source: &Path,
        device: Device,
        overflow: Overflow,
    ) -> Result<(EmbeddingEngine, oneshot::Receiver<Loaded>), String> {
        let config = Config::load(source).map_err(|e| format!("cannot load the model: {e}"))?;
        let dim = config.hidden as i64;
        let engine = EmbeddingEngine {
            signature: Signature {
                platform: "ferry_bert".into(),
                inputs: vec![TensorSpec { name: INPUT.into(), datatype: "BYTES".into(), shape: vec![-1] }],
                outputs: vec![TensorSpec { name: OUTPUT.into(), datatype: "FP32".into(), shape: vec![-1, dim] }],
            },
            model: OnceLock::new(),
        };
        let (tx, rx) = oneshot::channel();
        let source = source.to_owned();
        std::thread::Builder::new()
            .name("model-loader".into())
            .spawn(move || {
                let loaded = Model::load_with(&source, config, device, overflow)
                    .map_err(|e| format!("cannot load the model: {e}"))
                    .and_then(|model| {
                        let cost = calibrate(&model).map_err(|e| format!("the model's first batches failed: {e}"))?;
                        Ok((model, cost))
                    });
                let _ = tx.send(loaded);
            })
            .map_err(|e| format!("cannot start the model loader: {e}"))?;
        Ok((engine, rx))
    }

    /// Makes a loaded model the one that runs batches: the engine is ready from now on.
    pub fn install(&self, model: Model) {
        let _ = self.model.set(Arc::new(model));
    }

    fn loaded(&self) -> Result<&Arc<Model>, String> {
        self.model.get().ok_or_else(|| "the model is still loading".to_owned())
    }
}

/// Times a short and a long batch, to start the batch-time estimate from this machine's figures
/// rather than a guess: `fixed` from the short one, the cost per token from the difference. The
/// estimator refines both from real batches.
pub fn calibrate(model: &Model) -> Result<CostModel, String> {
    let short = ["calibration"];
    let long_text = "the quick brown fox jumps over the lazy dog and keeps running through the field ".repeat(4);
    let long: Vec<&str> = (0..8).map(|_| long_text.as_str()).collect();
    // The least of three runs after a warm-up (first-touch allocations, GPU module loads):
    // a machine's noise only ever adds time.
    let time = |texts: &[&str]| -> Result<(Duration, usize), String> {
        let batch = model.encoder.encode(texts)?;
        model.embed(&batch)?;
        let mut least = Duration::MAX;
        for _ in 0..3 {
            let start = ferry_core::clock::now();
            model.embed(&batch)?;
            least = least.min(ferry_core::clock::elapsed(start));
        }
        Ok((least, batch.tokens()))
    };
    let (t_short, n_short) = time(&short)?;
    let (t_long, n_long) = time(&long)?;
    let per_token = t_long.saturating_sub(t_short) / (n_long - n_short).max(1) as u32;
    let fixed = t_short.saturating_sub(per_token * n_short as u32);
    Ok(CostModel { fixed, per_token, ..CostModel::default() })
}

/// The texts of one request's `text` input.
fn texts(inputs: &[Tensor]) -> Result<&[String], String> {
    let known = || format!("the model takes one input, '{INPUT}' (BYTES, one text per row)");
    let [input] = inputs else {
        return Err(format!("{} inputs given; {}", inputs.len(), known()));
    };
    if input.name != INPUT {
        return Err(format!("input '{}' is not an input of this model; {}", input.name, known()));
    }
    if input.datatype != DataType::Bytes {
        return Err(format!("input '{INPUT}' has datatype {}; it must be BYTES", input.datatype.name()));
    }
    if !(input.inner().is_empty() || input.inner() == [1]) {
        return Err(format!("input '{INPUT}' has shape {:?}; it must be [rows] or [rows, 1]", input.shape));
    }
    match &input.data {
        TensorData::Bytes(texts) => Ok(texts),
        _ => Err(format!("input '{INPUT}' must hold strings")),
    }
}

impl Engine for EmbeddingEngine {
    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn ready(&self) -> bool {
        self.model.get().is_some()
    }

    fn check(&self, inputs: &[Tensor]) -> Result<Tokens, String> {
        let texts: Vec<&str> = texts(inputs)?.iter().map(String::as_str).collect();
        let counts = self.loaded()?.encoder.count(&texts).map_err(|e| format!("input '{INPUT}': {e}"))?;
        Ok(Tokens {
            total: counts.iter().sum::<usize>() as u32,
            longest: counts.iter().copied().max().unwrap_or(0) as u32,
        })
    }

    fn infer(&self, batch: Vec<Inputs>) -> BoxFuture<Result<BatchOutputs, EngineError>> {
        let model = self.loaded().cloned();
        Box::pin(async move {
            let model = model.map_err(EngineError)?;
            // The forward pass is CPU-bound (or blocks on the GPU's stream): off the async workers.
            tokio::task::spawn_blocking(move || run(&model, &batch))
                .await
                .map_err(|e| EngineError(format!("the forward pass panicked: {e}")))?
        })
    }
}

fn run(model: &Model, batch: &[Inputs]) -> Result<BatchOutputs, EngineError> {
    let mut all: Vec<&str> = Vec::new();
    let mut rows = Vec::with_capacity(batch.len());
    for inputs in batch {
        let texts = texts(inputs).map_err(EngineError)?;
        rows.push(texts.len());
        all.extend(texts.iter().map(String::as_str));
    }
    let tokens: TokenBatch = model.encoder.encode(&all).map_err(EngineError)?;
    let flat = model.embed(&tokens).map_err(EngineError)?;
    let dim = model.dim();
    let mut out = Vec::with_capacity(batch.len());
    let mut at = 0;
    for r in rows {
        let data = flat[at * dim..(at + r) * dim].iter().map(|&x| f64::from(x)).collect();
        at += r;
        out.push(vec![Tensor {
            name: OUTPUT.into(),
            datatype: DataType::Fp32,
            shape: vec![r as u64, dim as u64],
            data: TensorData::Float(data),
        }]);
    }
    Ok(out)
}
