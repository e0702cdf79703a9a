//! The forward pass on a GPU: cuBLAS for the GEMMs (the projections, and attention as strided
//! batched GEMMs over every sentence and head at once), NVRTC-compiled kernels (`kernels.cu`) for
//! the rest. Rows are padded to the batch's longest and padding is masked out of attention and
//! pooling, so one launch covers the whole batch.
//!
//! Everything is f32, as on the CPU, so the two agree to rounding. cudarc loads the CUDA
//! libraries at run time: [`libraries_present`] must be asked first, since a missing library
//! would otherwise panic inside cudarc.

// Kernel launches and cuBLAS calls are unsafe by nature (raw device pointers and sizes): each one
// here is sized from the buffers it is given, which are allocated right next to it.
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex};

use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::files::{Config, Pooling, Weights};
use super::TokenBatch;

/// The kernels' source, compiled by NVRTC when a model is loaded.
pub const KERNELS: &str = include_str!("kernels.cu");
const BLOCK: u32 = 256;

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
    cudarc::nvrtc::compile_ptx(KERNELS).map_err(|e| format!("NVRTC could not compile the kernels: {e}"))
}

struct Norm {
    gamma: CudaSlice<f32>,
    beta: CudaSlice<f32>,
}

struct Dense {
    weight: CudaSlice<f32>,
    bias: CudaSlice<f32>,
    out: usize,
    inp: usize,
}

struct Layer {
    qkv: Dense,
    attention_out: Dense,
    attention_norm: Norm,
    intermediate: Dense,
    output: Dense,
    output_norm: Norm,
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

struct Device {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
}

pub struct GpuModel {
    config: Config,
    ordinal: usize,
    word: CudaSlice<f32>,
    position: CudaSlice<f32>,
    token_type: CudaSlice<f32>,
    embedding_norm: Norm,
    layers: Vec<Layer>,
    /// One batch at a time per model: the stream and the cuBLAS handle are shared.
    device: Mutex<Device>,
}

/// A host array's elements in row-major order.
fn host<D: ndarray::Dimension>(a: &ndarray::Array<f32, D>) -> Vec<f32> {
    a.iter().copied().collect()
}

fn err(e: impl std::fmt::Debug) -> String {
    format!("{e:?}")
}

impl GpuModel {
    pub fn new(w: &Weights, ordinal: usize) -> Result<GpuModel, String> {
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
        let up = |a: &[f32]| stream.clone_htod(a).map_err(err);
        let norm = |n: &super::files::Norm| -> Result<Norm, String> {
            Ok(Norm { gamma: up(&host(&n.gamma))?, beta: up(&host(&n.beta))? })
        };
        let dense = |d: &super::files::Dense| -> Result<Dense, String> {
            Ok(Dense {
                weight: up(&host(&d.weight))?,
                bias: up(&host(&d.bias))?,
                out: d.weight.nrows(),
                inp: d.weight.ncols(),
            })
        };
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            layers.push(Layer {
                qkv: dense(&l.qkv)?,
                attention_out: dense(&l.attention_out)?,
                attention_norm: norm(&l.attention_norm)?,
                intermediate: dense(&l.intermediate)?,
                output: dense(&l.output)?,
                output_norm: norm(&l.output_norm)?,
            });
        }
        Ok(GpuModel {
            config: w.config.clone(),
            ordinal,
            word: up(&host(&w.word))?,
            position: up(&host(&w.position))?,
            token_type: up(&host(&w.token_type))?,
            embedding_norm: norm(&w.embedding_norm)?,
            layers,
            device: Mutex::new(Device { stream, blas, k }),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Embeddings of the batch, row-major `[rows, hidden]`.
    pub fn embed(&self, batch: &TokenBatch) -> Result<Vec<f32>, String> {
        let dev = self.device.lock().unwrap_or_else(|p| p.into_inner());
        self.forward(&dev, batch).map_err(|e| format!("GPU {}: {e}", self.ordinal))
    }

    fn forward(&self, dev: &Device, batch: &TokenBatch) -> Result<Vec<f32>, String> {
        let c = &self.config;
        let (s, k) = (&dev.stream, &dev.k);
        let (rows, len, h, heads) = (batch.rows, batch.len, c.hidden, c.heads);
        let (t, d) = (rows * len, h / heads);
        let (li, hi, hd) = (len as i32, h as i32, heads as i32);
        let eps = c.layer_norm_eps;
        let lengths: Vec<i32> = batch.lengths.iter().map(|&l| l as i32).collect();
        let ids = s.clone_htod(&batch.ids).map_err(err)?;
        let types = s.clone_htod(&batch.type_ids).map_err(err)?;
        let lengths = s.clone_htod(&lengths).map_err(err)?;

        let rows_of =
            |n: usize| LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        let mut x = s.alloc_zeros::<f32>(t * h).map_err(err)?;
        let mut a = s.alloc_zeros::<f32>(t * h).map_err(err)?;
        let mut qkv = s.alloc_zeros::<f32>(t * 3 * h).map_err(err)?;
        let mut ff = s.alloc_zeros::<f32>(t * c.intermediate).map_err(err)?;
        let mut q = s.alloc_zeros::<f32>(t * h).map_err(err)?;
        let mut kk = s.alloc_zeros::<f32>(t * h).map_err(err)?;
        let mut v = s.alloc_zeros::<f32>(t * h).map_err(err)?;
        let mut scores = s.alloc_zeros::<f32>(rows * heads * len * len).map_err(err)?;
        let mut ctx = s.alloc_zeros::<f32>(t * h).map_err(err)?;
        let mut out = s.alloc_zeros::<f32>(rows * h).map_err(err)?;
        // A null device pointer, for the layer norm's absent bias and residual.
        let null = 0u64;

        // SAFETY (every launch and GEMM below): the buffers were allocated above with the sizes
        // the kernels index (t·h, t·3h, t·intermediate, rows·heads·len², rows·h), and the
        // weights have the shapes config.json gave, checked when they were read.
        unsafe {
            s.launch_builder(&k.embed)
                .arg(&ids)
                .arg(&types)
                .arg(&self.word)
                .arg(&self.position)
                .arg(&self.token_type)
                .arg(&mut x)
                .arg(&li)
                .arg(&hi)
                .launch(rows_of(t))
                .map_err(err)?;
            s.launch_builder(&k.layer_norm)
                .arg(&mut a)
                .arg(&x)
                .arg(&null)
                .arg(&null)
                .arg(&self.embedding_norm.gamma)
                .arg(&self.embedding_norm.beta)
                .arg(&hi)
                .arg(&eps)
                .launch(rows_of(t))
                .map_err(err)?;
            std::mem::swap(&mut x, &mut a);

            for layer in &self.layers {
                linear(&dev.blas, &x, &layer.qkv, &mut qkv, t)?;
                s.launch_builder(&k.split_heads)
                    .arg(&qkv)
                    .arg(&layer.qkv.bias)
                    .arg(&mut q)
                    .arg(&mut kk)
                    .arg(&mut v)
                    .arg(&li)
                    .arg(&hi)
                    .arg(&hd)
                    .launch(rows_of(t))
                    .map_err(err)?;
                // scores[bh] = q[bh] · k[bh]ᵀ / √d, for every sentence and head at once.
                let (l32, d32) = (len as i32, d as i32);
                dev.blas
                    .gemm_strided_batched(
                        StridedBatchedConfig {
                            gemm: GemmConfig {
                                transa: CUBLAS_OP_T,
                                transb: CUBLAS_OP_N,
                                m: l32,
                                n: l32,
                                k: d32,
                                alpha: 1.0 / (d as f32).sqrt(),
                                lda: d32,
                                ldb: d32,
                                beta: 0.0,
                                ldc: l32,
                            },
                            batch_size: (rows * heads) as i32,
                            stride_a: (len * d) as i64,
                            stride_b: (len * d) as i64,
                            stride_c: (len * len) as i64,
                        },
                        &kk,
                        &q,
                        &mut scores,
                    )
                    .map_err(err)?;
                s.launch_builder(&k.masked_softmax)
                    .arg(&mut scores)
                    .arg(&lengths)
                    .arg(&li)
                    .arg(&hd)
                    .launch(rows_of(rows * heads * len))
                    .map_err(err)?;
                // ctx[bh] = p[bh] · v[bh]
                dev.blas
                    .gemm_strided_batched(
                        StridedBatchedConfig {
                            gemm: GemmConfig {
                                transa: CUBLAS_OP_N,
                                transb: CUBLAS_OP_N,
                                m: d32,
                                n: l32,
                                k: l32,
                                alpha: 1.0,
                                lda: d32,
                                ldb: l32,
                                beta: 0.0,
                                ldc: d32,
                            },
                            batch_size: (rows * heads) as i32,
                            stride_a: (len * d) as i64,
                            stride_b: (len * len) as i64,
                            stride_c: (len * d) as i64,
                        },
                        &v,
                        &scores,
                        &mut ctx,
                    )
                    .map_err(err)?;
                s.launch_builder(&k.merge_heads)
                    .arg(&ctx)
                    .arg(&mut q)
                    .arg(&li)
                    .arg(&hi)
                    .arg(&hd)
                    .launch(rows_of(t))
                    .map_err(err)?;
                linear(&dev.blas, &q, &layer.attention_out, &mut a, t)?;
                // a = LayerNorm(a + bias + x)
                s.launch_builder(&k.layer_norm)
                    .arg(&mut kk)
                    .arg(&a)
                    .arg(&layer.attention_out.bias)
                    .arg(&x)
                    .arg(&layer.attention_norm.gamma)
                    .arg(&layer.attention_norm.beta)
                    .arg(&hi)
                    .arg(&eps)
                    .launch(rows_of(t))
                    .map_err(err)?;
                std::mem::swap(&mut a, &mut kk);
                linear(&dev.blas, &a, &layer.intermediate, &mut ff, t)?;
                let n = (t * c.intermediate) as i32;
                let cols = c.intermediate as i32;
                s.launch_builder(&k.bias_gelu)
                    .arg(&mut ff)
                    .arg(&layer.intermediate.bias)
                    .arg(&n)
                    .arg(&cols)
                    .launch(LaunchConfig::for_num_elems(n as u32))
                    .map_err(err)?;
                linear(&dev.blas, &ff, &layer.output, &mut q, t)?;
                // x = LayerNorm(q + bias + a)
                s.launch_builder(&k.layer_norm)
                    .arg(&mut x)
                    .arg(&q)
                    .arg(&layer.output.bias)
                    .arg(&a)
                    .arg(&layer.output_norm.gamma)
                    .arg(&layer.output_norm.beta)
                    .arg(&hi)
                    .arg(&eps)
                    .launch(rows_of(t))
                    .map_err(err)?;
            }
            let cls = i32::from(c.pooling == Pooling::Cls);
            let normalize = i32::from(c.normalize);
            s.launch_builder(&k.pool)
                .arg(&x)
                .arg(&lengths)
                .arg(&mut out)
                .arg(&li)
                .arg(&hi)
                .arg(&cls)
                .arg(&normalize)
                .launch(rows_of(rows))
                .map_err(err)?;
        }
        s.clone_dtoh(&out).map_err(err)
    }
}

/// `y[t, out] = x[t, in] · weightᵀ` (row-major; the bias is added by the next kernel). In
/// cuBLAS's column-major terms: `yᵀ = weight · xᵀ`, with the stored weight read transposed.
fn linear(blas: &CudaBlas, x: &CudaSlice<f32>, d: &Dense, y: &mut CudaSlice<f32>, t: usize) -> Result<(), String> {
    let (out, inp) = (d.out as i32, d.inp as i32);
    let cfg = GemmConfig {
        transa: CUBLAS_OP_T,
        transb: CUBLAS_OP_N,
        m: out,
        n: t as i32,
        k: inp,
        alpha: 1.0f32,
        lda: inp,
        ldb: inp,
        beta: 0.0,
        ldc: out,
    };
    // SAFETY: x holds t·in floats, y t·out, the weight out·in, as allocated by the caller.
    unsafe { blas.gemm(cfg, &d.weight, x, y) }.map_err(err)
}
