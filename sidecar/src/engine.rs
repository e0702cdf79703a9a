//! What runs a batch. The batcher hands an engine the inputs of every request in a batch, in
//! order, and gets back the outputs of each, in the same order.
//!
//! Engines: [`sim`] (a batch takes a configured time; outputs prove that rows were not mixed up),
//! [`remote`] (an Open Inference Protocol server beside the sidecar) and [`embedding`] (the local
//! model, kind `cuda`: sentence embeddings on a GPU, or on the CPU with the same weights).

pub mod embedding;
pub mod remote;
pub mod sim;
pub mod spell;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::Serialize;

use crate::tensor::Tensor;
pub use ferry_core::ticket::Tokens;

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// The inputs of one request of a batch; shared, so that a batch can be retried.
pub type Inputs = Arc<Vec<Tensor>>;

/// Outputs of each request of a batch, in batch order.
pub type BatchOutputs = Vec<Vec<Tensor>>;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("engine error: {0}")]
pub struct EngineError(pub String);

/// A tensor an engine takes or gives, as `GET /v2/models/{name}` shows it (`-1`: any size).
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
}

/// What an engine says about the model it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signature {
    /// OIP's `platform`, e.g. `ferry_sim`.
    pub platform: String,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
}

pub trait Engine: Send + Sync + 'static {
    fn signature(&self) -> &Signature;

    /// Whether the engine can take batches (a remote server may still be loading its model).
    fn ready(&self) -> bool {
        true
    }

    /// Engine-specific checks of one request's inputs (names, datatypes, inner dimensions),
    /// beyond the protocol's own, and what its rows weigh in tokens when the engine's batch time
    /// depends on them (admission prices the request with it). The message becomes a 400 body.
    fn check(&self, inputs: &[Tensor]) -> Result<Tokens, String>;

    /// Runs one batch. Its future must not borrow the engine: it may outlive the caller's turn.
    fn infer(&self, batch: Vec<Inputs>) -> BoxFuture<Result<BatchOutputs, EngineError>>;
}
