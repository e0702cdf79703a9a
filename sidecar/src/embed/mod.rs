//! A BERT-family sentence-embedding model (the layout of `all-MiniLM-L6-v2`): tokenizer, weights,
//! and the forward pass on the CPU or, with the `cuda` feature, on a GPU through cudarc.
//!
//! # Layout
//!
//! - [`files`]: the model directory: `config.json`, the sentence-transformers pooling and
//!   length settings, and the weights from `model.safetensors`.
//! - [`tokens`]: text to padded token batches with the model's own `tokenizer.json`, and the
//!   over-long-input policy (truncate or refuse).
//! - [`cpu`]: the forward pass with ndarray (matrixmultiply's GEMM): embeddings, encoder layers,
//!   mean pooling, L2 normalisation.
//! - [`padded`]: the pass over a padded, masked batch as device operations (GEMMs and kernels),
//!   written once for the GPU; [`host`] runs the same operations on the host, so that the GPU's
//!   algorithm is tested where there is no GPU.
//! - `gpu` (feature `cuda`): [`padded`]'s operations with cuBLAS and NVRTC-compiled kernels.
//! - [`Model`]: picks the device and runs batches of text to embeddings.
//!
//! The engine the sidecar serves is [`crate::engine::embedding`], on top of [`Model`].

pub mod cpu;
pub mod files;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod host;
pub mod padded;
pub mod tokens;

use std::path::Path;

pub use files::{Config, Weights};
pub use tokens::{Overflow, TextEncoder, TokenBatch};

/// Where the forward pass runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// A GPU if one can be used, else the CPU.
    Auto,
    Cpu,
    /// The GPU of this ordinal.
    Cuda(usize),
}

impl Device {
    /// `auto`, `cpu`, `cuda` or `cuda:N`.
    pub fn parse(text: &str) -> Option<Device> {
        match text {
            "auto" => Some(Device::Auto),
            "cpu" => Some(Device::Cpu),
            "cuda" => Some(Device::Cuda(0)),
            _ => text.strip_prefix("cuda:")?.parse().ok().map(Device::Cuda),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Auto => f.write_str("auto"),
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("{0}")]
    Model(String),
    #[error("device {device}: {message}")]
    Device { device: Device, message: String },
}

/// A loaded model on its device.
pub struct Model {
    pub config: Config,
    pub encoder: TextEncoder,
    backend: Backend,
}

enum Backend {
    Cpu(cpu::CpuModel),
    #[cfg(feature = "cuda")]
    Gpu(gpu::GpuModel),
}

impl Model {
    /// Loads the model in `dir` onto `device`. `Auto` takes GPU 0 when this build has the CUDA
    /// code and the CUDA libraries load, and says so in one log line when it falls back.
    pub fn load(dir: &Path, device: Device, overflow: Overflow) -> Result<Model, LoadError> {
        Model::load_with(dir, Config::load(dir)?, device, overflow)
    }

    /// [`Model::load`] with the configuration already read from `dir` (the engine reads it first,
    /// to fail fast and to publish the model's signature while the weights load).
    pub fn load_with(dir: &Path, config: Config, device: Device, overflow: Overflow) -> Result<Model, LoadError> {
        let encoder = TextEncoder::load(dir, config.max_tokens, overflow)?;
        let weights = Weights::load(dir, &config)?;
        let backend = match device {
            Device::Cpu => Backend::Cpu(cpu::CpuModel::new(weights)),
            Device::Auto => auto(weights)?,
            Device::Cuda(ordinal) => cuda(weights, ordinal)?,
        };
        Ok(Model { config, encoder, backend })
    }

    /// The device the forward pass runs on.
    pub fn device(&self) -> Device {
        match &self.backend {
            Backend::Cpu(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Backend::Gpu(g) => Device::Cuda(g.ordinal()),
        }
    }

    /// Width of an embedding.
    pub fn dim(&self) -> usize {
        self.config.hidden
    }

    /// Embeddings of a tokenized batch, row-major `[rows, dim]`, unit length each.
    pub fn embed(&self, batch: &TokenBatch) -> Result<Vec<f32>, String> {
        match &self.backend {
            Backend::Cpu(m) => Ok(m.embed(batch)),
            #[cfg(feature = "cuda")]
            Backend::Gpu(m) => m.embed(batch),
        }
    }

    /// Tokenizes and embeds.
    pub fn embed_texts(&self, texts: &[&str]) -> Result<Vec<f32>, String> {
        let batch = self.encoder.encode(texts).map_err(|e| e.to_string())?;
        self.embed(&batch)
    }
}

#[cfg(feature = "cuda")]
fn auto(weights: Weights) -> Result<Backend, LoadError> {
    if let Err(missing) = gpu::libraries_present() {
        tracing::info!("device auto: {missing} on this machine; running on the CPU");
        return Ok(Backend::Cpu(cpu::CpuModel::new(weights)));
    }
    match gpu::GpuModel::new(&weights, 0) {
        Ok(m) => Ok(Backend::Gpu(m)),
        Err(e) => {
            tracing::info!("device auto: GPU 0 cannot be used ({e}); running on the CPU");
            Ok(Backend::Cpu(cpu::CpuModel::new(weights)))
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn auto(weights: Weights) -> Result<Backend, LoadError> {
    tracing::info!("device auto: this build has no CUDA code (cargo feature 'cuda'); running on the CPU");
    Ok(Backend::Cpu(cpu::CpuModel::new(weights)))
}

#[cfg(feature = "cuda")]
fn cuda(weights: Weights, ordinal: usize) -> Result<Backend, LoadError> {
    let device = Device::Cuda(ordinal);
    gpu::GpuModel::new(&weights, ordinal).map(Backend::Gpu).map_err(|message| LoadError::Device { device, message })
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: Weights, ordinal: usize) -> Result<Backend, LoadError> {
    Err(LoadError::Device {
        device: Device::Cuda(ordinal),
        message: "this build of ferry-sidecar has no CUDA code; build it with `--features cuda`, or use --device cpu"
            .into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse() {
        assert_eq!(Device::parse("auto"), Some(Device::Auto));
        assert_eq!(Device::parse("cpu"), Some(Device::Cpu));
        assert_eq!(Device::parse("cuda"), Some(Device::Cuda(0)));
        assert_eq!(Device::parse("cuda:3"), Some(Device::Cuda(3)));
        assert_eq!(Device::parse("gpu"), None);
        assert_eq!(Device::parse("cuda:x"), None);
    }
}
