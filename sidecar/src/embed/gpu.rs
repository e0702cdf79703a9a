//! The forward pass on a GPU: [`padded`]'s operations with cuBLAS for the GEMMs (the
//! projections, and attention as strided batched GEMMs over every sentence and head at once) and
//! NVRTC-compiled kernels (`kernels.cu`) for the rest. Rows are padded to the batch's longest and
//! padding is masked out of attention and pooling, so one launch covers the whole batch.
//!
//! Everything is f32, as on the CPU, so the two agree to rounding. cudarc loads the CUDA
//! libraries at run time: [`libraries_present`] must be asked first, since a missing library
//! would otherwise panic inside cudarc.

// Kernel launches and cuBLAS calls are unsafe by nature (raw device pointers and sizes): each one
// here is sized from the buffers it is given, which are allocated right next to it.
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex};

use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{CudaBlas, Gemm as _, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::files::{self, Config};
use super::padded::{self, Dims, Gemm, Norm, Ops, Weights};
use super::TokenBatch;

// The same libraries as the decoder's GPU path, asked the same way.
pub use ferry_llm::gpu::{libraries_present, nvrtc_present};

/// The kernels' source, compiled by NVRTC when a model is loaded.
pub const KERNELS: &str = include_str!("kernels.cu");
const BLOCK: u32 = 256;

/// Compiles the kernels to PTX.
pub fn compile() -> Result<cudarc::nvrtc::Ptx, String> {
    cudarc::nvrtc::compile_ptx(KERNELS).map_err(|e| format!("NVRTC could not compile the kernels: {e}"))
}

struct Kernels {
    embed: CudaFunction,
    layer_norm: CudaFunction,
    bias_gelu: CudaFunction,
    split_heads: CudaFunction,
    masked_softmax: CudaFunction,
    merge_heads: CudaFunction,
    pool: CudaFunction,
    _module: Arc<CudaModule>,
}

/// [`Ops`] on one GPU: a stream, a cuBLAS handle on it, and the compiled kernels.
pub struct Cuda {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
}

pub struct GpuModel {
    config: Config,
    ordinal: usize,
    weights: Weights<CudaSlice<f32>>,
    /// One batch at a time per model: the stream and the cuBLAS handle are shared.
    device: Mutex<Cuda>,
}

fn err(e: impl std::fmt::Debug) -> String {
    format!("{e:?}")
}

/// One block of [`BLOCK`] threads per row.
fn per_row(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

fn int(n: usize) -> i32 {
    n as i32
}

impl Cuda {
    fn new(ordinal: usize) -> Result<Cuda, String> {
        libraries_present()?;
        let ctx = CudaContext::new(ordinal).map_err(err)?;
        let stream = ctx.default_stream();
        let module = ctx.load_module(compile()?).map_err(err)?;
        let f = |name: &str| module.load_function(name).map_err(err);
        let k = Kernels {
            embed: f("embed")?,
            layer_norm: f("layer_norm")?,
            bias_gelu: f("bias_gelu")?,
            split_heads: f("split_heads")?,
            masked_softmax: f("masked_softmax")?,
            merge_heads: f("merge_heads")?,
            pool: f("pool")?,
            _module: module.clone(),
        };
        let blas = CudaBlas::new(stream.clone()).map_err(err)?;
        Ok(Cuda { stream, blas, k })
    }
}

impl GpuModel {
    pub fn new(w: &files::Weights, ordinal: usize) -> Result<GpuModel, String> {
        let cuda = Cuda::new(ordinal)?;
        let weights = Weights::upload(&cuda, w)?;
        Ok(GpuModel { config: w.config.clone(), ordinal, weights, device: Mutex::new(cuda) })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Embeddings of the batch, row-major `[rows, hidden]`.
    pub fn embed(&self, batch: &TokenBatch) -> Result<Vec<f32>, String> {
        let cuda = self.device.lock().unwrap_or_else(|p| p.into_inner());
        padded::forward(&*cuda, &self.weights, &self.config, batch).map_err(|e| format!("GPU {}: {e}", self.ordinal))
    }
}

// SAFETY (every launch and GEMM below): `padded::forward` allocates each buffer with the size the
// kernel or GEMM indexes (t·h, t·3h, t·intermediate, rows·heads·len², rows·h), the weights have
// the shapes config.json gave (checked when they were read), and the grid sizes are those rows.
impl Ops for Cuda {
    type F = CudaSlice<f32>;
    type U = CudaSlice<u32>;
    type I = CudaSlice<i32>;

    fn f32s(&self, host: &[f32]) -> Result<Self::F, String> {
        self.stream.clone_htod(host).map_err(err)
    }
    fn u32s(&self, host: &[u32]) -> Result<Self::U, String> {
        self.stream.clone_htod(host).map_err(err)
    }
    fn i32s(&self, host: &[i32]) -> Result<Self::I, String> {
        self.stream.clone_htod(host).map_err(err)
    }
    fn zeros(&self, n: usize) -> Result<Self::F, String> {
        self.stream.alloc_zeros::<f32>(n).map_err(err)
    }
    fn download(&self, buf: &Self::F) -> Result<Vec<f32>, String> {
        self.stream.clone_dtoh(buf).map_err(err)
    }

    fn gemm(&self, g: &Gemm, a: &Self::F, b: &Self::F, c: &mut Self::F) -> Result<(), String> {
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        let gemm = GemmConfig {
            transa: op(g.trans_a),
            transb: op(g.trans_b),
            m: int(g.m),
            n: int(g.n),
            k: int(g.k),
            alpha: g.alpha,
            lda: int(g.lda),
            ldb: int(g.ldb),
            beta: 0.0,
            ldc: int(g.ldc),
        };
        unsafe {
            if g.batch == 1 {
                self.blas.gemm(gemm, a, b, c)
            } else {
                let cfg = StridedBatchedConfig {
                    gemm,
                    batch_size: int(g.batch),
                    stride_a: g.stride_a as i64,
                    stride_b: g.stride_b as i64,
                    stride_c: g.stride_c as i64,
                };
                self.blas.gemm_strided_batched(cfg, a, b, c)
            }
        }
        .map_err(err)
    }

    fn embed(
        &self,
        ids: &Self::U,
        types: &Self::U,
        w: &Weights<Self::F>,
        out: &mut Self::F,
        dims: Dims,
    ) -> Result<(), String> {
        let (len, h) = (int(dims.len), int(dims.h));
        let mut l = self.stream.launch_builder(&self.k.embed);
        l.arg(ids).arg(types).arg(&w.word).arg(&w.position).arg(&w.token_type).arg(out).arg(&len).arg(&h);
        unsafe { l.launch(per_row(dims.t())) }.map(drop).map_err(err)
    }

    fn layer_norm(
        &self,
        y: &mut Self::F,
        x: &Self::F,
        bias: Option<&Self::F>,
        residual: Option<&Self::F>,
        norm: &Norm<Self::F>,
        dims: Dims,
        eps: f32,
    ) -> Result<(), String> {
        let null = 0u64; // a null device pointer: no bias, no residual
        let h = int(dims.h);
        let mut l = self.stream.launch_builder(&self.k.layer_norm);
        l.arg(y).arg(x);
        match bias {
            Some(b) => l.arg(b),
            None => l.arg(&null),
        };
        match residual {
            Some(r) => l.arg(r),
            None => l.arg(&null),
        };
        l.arg(&norm.gamma).arg(&norm.beta).arg(&h).arg(&eps);
        unsafe { l.launch(per_row(dims.t())) }.map(drop).map_err(err)
    }

    fn bias_gelu(&self, x: &mut Self::F, bias: &Self::F, n: usize, cols: usize) -> Result<(), String> {
        let (n, cols) = (int(n), int(cols));
        let mut l = self.stream.launch_builder(&self.k.bias_gelu);
        l.arg(x).arg(bias).arg(&n).arg(&cols);
        unsafe { l.launch(LaunchConfig::for_num_elems(n as u32)) }.map(drop).map_err(err)
    }

    fn split_heads(
        &self,
        qkv: &Self::F,
        bias: &Self::F,
        q: &mut Self::F,
        k: &mut Self::F,
        v: &mut Self::F,
        dims: Dims,
    ) -> Result<(), String> {
        let (len, h, heads) = (int(dims.len), int(dims.h), int(dims.heads));
        let mut l = self.stream.launch_builder(&self.k.split_heads);
        l.arg(qkv).arg(bias).arg(q).arg(k).arg(v).arg(&len).arg(&h).arg(&heads);
        unsafe { l.launch(per_row(dims.t())) }.map(drop).map_err(err)
    }

    fn masked_softmax(&self, s: &mut Self::F, lengths: &Self::I, dims: Dims) -> Result<(), String> {
        let (len, heads) = (int(dims.len), int(dims.heads));
        let mut l = self.stream.launch_builder(&self.k.masked_softmax);
        l.arg(s).arg(lengths).arg(&len).arg(&heads);
        unsafe { l.launch(per_row(dims.rows * dims.heads * dims.len)) }.map(drop).map_err(err)
    }

    fn merge_heads(&self, ctx: &Self::F, out: &mut Self::F, dims: Dims) -> Result<(), String> {
        let (len, h, heads) = (int(dims.len), int(dims.h), int(dims.heads));
        let mut l = self.stream.launch_builder(&self.k.merge_heads);
        l.arg(ctx).arg(out).arg(&len).arg(&h).arg(&heads);
        unsafe { l.launch(per_row(dims.t())) }.map(drop).map_err(err)
    }

    fn pool(
        &self,
        x: &Self::F,
        lengths: &Self::I,
        out: &mut Self::F,
        dims: Dims,
        cls: bool,
        normalize: bool,
    ) -> Result<(), String> {
        let (len, h, cls, normalize) = (int(dims.len), int(dims.h), i32::from(cls), i32::from(normalize));
        let mut l = self.stream.launch_builder(&self.k.pool);
        l.arg(x).arg(lengths).arg(out).arg(&len).arg(&h).arg(&cls).arg(&normalize);
        unsafe { l.launch(per_row(dims.rows)) }.map(drop).map_err(err)
    }
}
