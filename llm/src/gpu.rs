//! The decoder on a GPU: [`device`]'s operations with cuBLAS for the projections and
//! NVRTC-compiled kernels (`kernels.cu`) for the rest — RMSNorm, RoPE with the KV write into
//! the paged cache, paged attention, SwiGLU, residual adds. Weights, KV cache and rotary tables
//! live on the device; a step uploads its index (ids, positions, slots, contexts) and downloads
//! the sampling rows' logits. Everything is f32, as on the CPU, so the two agree to rounding.
//!
//! cudarc loads the CUDA libraries at run time: [`libraries_present`] is asked first, since a
//! missing library would otherwise panic inside cudarc.

// Kernel launches and cuBLAS calls are unsafe by nature (raw device pointers and sizes): each
// one here is sized from the buffers and the step index it is given (see the SAFETY notes).
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex};

use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{CudaBlas, Gemm as _, GemmConfig};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use crate::config::Config;
use crate::device::{self, DeviceCache, DeviceIndex, DeviceWeights, Dims, Ops, StepIndex};
use crate::kv::KvCache;
use crate::weights::Weights;
use crate::{KvSize, Seq};

/// The kernels' source, compiled by NVRTC when a model is loaded.
pub const KERNELS: &str = include_str!("kernels.cu");
const BLOCK: u32 = 256;
/// Shared memory a block may use without opting in: bounds the attention kernel's context.
const SHARED_BYTES: usize = 48 << 10;

/// Whether the CUDA driver, cuBLAS and NVRTC libraries can be loaded; `Err` names the missing.
pub fn libraries_present() -> Result<(), String> {
    // SAFETY: each call only tries to dlopen the library by its usual names.
    let found = unsafe {
        [
            ("the CUDA driver (libcuda.so)", cudarc::driver::sys::is_culib_present()),
            ("cuBLAS (libcublas.so)", cudarc::cublas::sys::is_culib_present()),
            ("NVRTC (libnvrtc.so)", cudarc::nvrtc::sys::is_culib_present()),
        ]
    };
    let missing: Vec<&str> = found.iter().filter(|(_, ok)| !ok).map(|(name, _)| *name).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!("cannot load {}", missing.join(", ")))
    }
}

/// Whether NVRTC alone is present: enough to compile the kernels (a check that needs no GPU).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles the kernels to PTX.
pub fn compile() -> Result<cudarc::nvrtc::Ptx, String> {
    cudarc::nvrtc::compile_ptx(KERNELS).map_err(|e| format!("NVRTC could not compile the decoder's kernels: {e}"))
}

fn err(e: impl std::fmt::Debug) -> String {
    format!("{e:?}")
}

fn int(n: usize) -> i32 {
    n as i32
}

fn rows(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

struct Kernels {
    gather: CudaFunction,
    rms_norm: CudaFunction,
    rope_store: CudaFunction,
    attention: CudaFunction,
    silu_mul: CudaFunction,
    add: CudaFunction,
    _module: Arc<CudaModule>,
}

/// [`Ops`] on one GPU: a stream, a cuBLAS handle on it, and the compiled kernels.
pub struct Cuda {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
}

impl Cuda {
    fn new(ordinal: usize) -> Result<Cuda, String> {
        libraries_present()?;
        let ctx = CudaContext::new(ordinal).map_err(err)?;
        let stream = ctx.default_stream();
        let module = ctx.load_module(compile()?).map_err(err)?;
        let f = |name: &str| module.load_function(name).map_err(err);
        let k = Kernels {
            gather: f("gather")?,
            rms_norm: f("rms_norm")?,
            rope_store: f("rope_store")?,
            attention: f("attention")?,
            silu_mul: f("silu_mul")?,
            add: f("add")?,
            _module: module.clone(),
        };
        let blas = CudaBlas::new(stream.clone()).map_err(err)?;
        Ok(Cuda { stream, blas, k })
    }
}

/// The decoder on one GPU.
pub struct GpuDecoder {
    config: Config,
    ordinal: usize,
    weights: DeviceWeights<CudaSlice<f32>>,
    block_size: usize,
    blocks: usize,
    positions: usize,
    /// One step at a time: the stream, the cuBLAS handle and the cache are shared.
    state: Mutex<(Cuda, DeviceCache<CudaSlice<f32>>)>,
}

impl GpuDecoder {
    /// Uploads the weights, then sizes the KV cache (`size`; a fraction is of the memory left
    /// free once the weights are there) and allocates it with the rotary tables.
    pub fn new(
        w: &Weights,
        ordinal: usize,
        size: KvSize,
        block_size: u32,
        enough: impl Fn(u32) -> Result<u32, String>,
    ) -> Result<(GpuDecoder, u32), String> {
        let at = |e: String| format!("device cuda:{ordinal}: {e}");
        let cuda = Cuda::new(ordinal).map_err(at)?;
        let weights = DeviceWeights::upload(&cuda, w).map_err(at)?;
        let c = &w.config;
        let per_token = KvCache::bytes_per_token(c.layers, c.kv_dim(), crate::KvDtype::F32) as u64;
        let blocks = enough(match size {
            KvSize::Blocks(b) => b,
            KvSize::Bytes(bytes) => (bytes / (per_token * u64::from(block_size))).min(u64::from(u32::MAX)) as u32,
            KvSize::Fraction(f) => {
                let (free, _total) = cuda.stream.context().mem_get_info().map_err(|e| at(err(e)))?;
                ((free as f64 * f) as u64 / (per_token * u64::from(block_size))).min(u64::from(u32::MAX)) as u32
            }
        })?;
        // The attention kernel keeps a context's scores in shared memory.
        let positions = c.context.min(SHARED_BYTES / 4 - 32);
        if positions < c.context {
            tracing_note(ordinal, c.context, positions);
        }
        let slots = blocks as usize * block_size as usize;
        let (cos, sin) = device::rope_tables(c, positions);
        let cache = DeviceCache {
            keys: cuda.zeros(c.layers * slots * c.kv_dim()).map_err(at)?,
            values: cuda.zeros(c.layers * slots * c.kv_dim()).map_err(at)?,
            cos: cuda.upload(&cos).map_err(at)?,
            sin: cuda.upload(&sin).map_err(at)?,
        };
        let decoder = GpuDecoder {
            config: c.clone(),
            ordinal,
            weights,
            block_size: block_size as usize,
            blocks: blocks as usize,
            positions,
            state: Mutex::new((cuda, cache)),
        };
        Ok((decoder, blocks))
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn positions(&self) -> usize {
        self.positions
    }

    pub fn step(&self, seqs: &[Seq<'_>]) -> Result<Vec<Vec<f32>>, String> {
        let ix = StepIndex::of(seqs, &self.config, self.positions, self.block_size, self.blocks)?;
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (cuda, cache) = &mut *state;
        let slots = self.blocks * self.block_size;
        device::forward(&*cuda, &self.weights, &self.config, cache, &ix, slots)
            .map_err(|e| format!("GPU {}: {e}", self.ordinal))
    }
}

/// Says that the served context is shorter than the model's.
fn tracing_note(ordinal: usize, model: usize, served: usize) {
    tracing::warn!(
        "device cuda:{ordinal}: the model's context is {model} tokens; the GPU's attention kernel serves {served} \
         (its scores live in {} KiB of shared memory)",
        SHARED_BYTES >> 10
    );
}

// SAFETY (every launch and GEMM below): `device::forward` allocates each buffer with the size the
// kernel or GEMM indexes (t·hidden, t·qkv width, t·q_dim, t·2·ffn, t·ffn, samples·vocab), the
// weights have the shapes the model's metadata gave (checked when they were read), the step index
// was checked against the cache's blocks, the vocabulary and the served context by
// `StepIndex::of`, and the grid sizes are those rows.
impl Ops for Cuda {
    type F = CudaSlice<f32>;
    type U = CudaSlice<u32>;

    fn upload(&self, host: &[f32]) -> Result<Self::F, String> {
        self.stream.clone_htod(host).map_err(err)
    }
    fn upload_u32(&self, host: &[u32]) -> Result<Self::U, String> {
        self.stream.clone_htod(host).map_err(err)
    }
    fn zeros(&self, n: usize) -> Result<Self::F, String> {
        self.stream.alloc_zeros::<f32>(n.max(1)).map_err(err)
    }
    fn download(&self, buf: &Self::F) -> Result<Vec<f32>, String> {
        self.stream.clone_dtoh(buf).map_err(err)
    }

    fn linear(&self, x: &Self::F, rows: usize, w: &Self::F, n: usize, k: usize, y: &mut Self::F) -> Result<(), String> {
        // Row-major y = x · wᵀ is column-major yᵀ = w(T) · xᵀ(N).
        let cfg = GemmConfig {
            transa: CUBLAS_OP_T,
            transb: CUBLAS_OP_N,
            m: int(n),
            n: int(rows),
            k: int(k),
            alpha: 1.0f32,
            lda: int(k),
            ldb: int(k),
            beta: 0.0,
            ldc: int(n),
        };
        unsafe { self.blas.gemm(cfg, w, x, y) }.map_err(err)
    }

    fn gather(&self, ids: &Self::U, n: usize, table: &Self::F, width: usize, out: &mut Self::F) -> Result<(), String> {
        let width = int(width);
        let mut l = self.stream.launch_builder(&self.k.gather);
        l.arg(ids).arg(table).arg(out).arg(&width);
        unsafe { l.launch(rows(n)) }.map(drop).map_err(err)
    }

    fn rms_norm(
        &self,
        x: &Self::F,
        weight: &Self::F,
        n: usize,
        width: usize,
        eps: f32,
        out: &mut Self::F,
    ) -> Result<(), String> {
        let width = int(width);
        let mut l = self.stream.launch_builder(&self.k.rms_norm);
        l.arg(x).arg(weight).arg(out).arg(&width).arg(&eps);
        unsafe { l.launch(rows(n)) }.map(drop).map_err(err)
    }

    fn rope_store(
        &self,
        qkv: &mut Self::F,
        bias: Option<&Self::F>,
        ix: &DeviceIndex<Self::U>,
        cache: &mut DeviceCache<Self::F>,
        layer: usize,
        d: Dims,
    ) -> Result<(), String> {
        let null = 0u64; // a null device pointer: no bias
        let offset = d.layer_offset(layer) as i64;
        let (heads, kv_heads, hd) = (int(d.heads), int(d.kv_heads), int(d.head_dim));
        let mut l = self.stream.launch_builder(&self.k.rope_store);
        l.arg(qkv);
        match bias {
            Some(b) => l.arg(b),
            None => l.arg(&null),
        };
        l.arg(&ix.positions)
            .arg(&ix.slots)
            .arg(&cache.cos)
            .arg(&cache.sin)
            .arg(&mut cache.keys)
            .arg(&mut cache.values)
            .arg(&offset)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&hd);
        unsafe { l.launch(rows(ix.t)) }.map(drop).map_err(err)
    }

    fn attention(
        &self,
        qkv: &Self::F,
        ix: &DeviceIndex<Self::U>,
        cache: &DeviceCache<Self::F>,
        layer: usize,
        d: Dims,
        out: &mut Self::F,
    ) -> Result<(), String> {
        let offset = d.layer_offset(layer) as i64;
        let (heads, kv_heads, hd) = (int(d.heads), int(d.kv_heads), int(d.head_dim));
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        let shared = (32 + ix.longest) * 4;
        if shared > SHARED_BYTES {
            return Err(format!(
                "a context of {} tokens is past the attention kernel's {}",
                ix.longest,
                SHARED_BYTES / 4 - 32
            ));
        }
        let cfg = LaunchConfig {
            grid_dim: (ix.t as u32, d.heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let mut l = self.stream.launch_builder(&self.k.attention);
        l.arg(qkv)
            .arg(&ix.positions)
            .arg(&ix.context_start)
            .arg(&ix.context)
            .arg(&cache.keys)
            .arg(&cache.values)
            .arg(&offset)
            .arg(out)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&hd)
            .arg(&scale);
        unsafe { l.launch(cfg) }.map(drop).map_err(err)
    }

    fn silu_mul(&self, gate_up: &Self::F, n: usize, ffn: usize, out: &mut Self::F) -> Result<(), String> {
        let (n32, ffn32) = (int(n), int(ffn));
        let mut l = self.stream.launch_builder(&self.k.silu_mul);
        l.arg(gate_up).arg(out).arg(&n32).arg(&ffn32);
        unsafe { l.launch(LaunchConfig::for_num_elems((n * ffn) as u32)) }.map(drop).map_err(err)
    }

    fn add(&self, x: &mut Self::F, y: &Self::F, n: usize) -> Result<(), String> {
        let n64 = n as i64;
        let mut l = self.stream.launch_builder(&self.k.add);
        l.arg(x).arg(y).arg(&n64);
        unsafe { l.launch(LaunchConfig::for_num_elems(n as u32)) }.map(drop).map_err(err)
    }
}
