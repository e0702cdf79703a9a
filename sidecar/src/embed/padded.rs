//! The forward pass over a padded batch, written once as a sequence of device operations —
//! cuBLAS-style GEMMs and the kernels of `kernels.cu` — and run by any [`Ops`]: the GPU's
//! (cudarc, `gpu.rs`) and the host's ([`super::host`]), which emulates the same operations so
//! that the GEMMs' transposes, leading dimensions and strides, the buffers' flow and the masking
//! are tested on machines without a GPU.
//!
//! Layout: row-major throughout; `t = rows × len` tokens (each row padded to the longest),
//! `h` hidden, `d = h / heads`. Attention runs as strided batched GEMMs over every sentence and
//! head at once, on q, k, v rearranged to `[rows · heads, len, d]`.

use super::files::{self, Config, Pooling};
use super::TokenBatch;

/// One (strided batched) GEMM in cuBLAS's column-major terms: `C = alpha · op(A) · op(B)`,
/// `op(A)` being `m × k`, `op(B)` `k × n`, for each of `batch` triples `stride_*` elements apart.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    pub batch: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
}

/// The sizes the operations index by: `rows` sentences, each padded to `len` tokens, `h` hidden
/// split into `heads` heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub rows: usize,
    pub len: usize,
    pub h: usize,
    pub heads: usize,
}

impl Dims {
    /// Tokens in the batch, padding included.
    pub fn t(&self) -> usize {
        self.rows * self.len
    }

    /// Width of one head.
    pub fn d(&self) -> usize {
        self.h / self.heads
    }
}

/// The operations of the forward pass. Buffers are device memory (or host vectors).
pub trait Ops {
    type F;
    type U;
    type I;
    fn f32s(&self, host: &[f32]) -> Result<Self::F, String>;
    fn u32s(&self, host: &[u32]) -> Result<Self::U, String>;
    fn i32s(&self, host: &[i32]) -> Result<Self::I, String>;
    fn zeros(&self, n: usize) -> Result<Self::F, String>;
    fn download(&self, buf: &Self::F) -> Result<Vec<f32>, String>;
    fn gemm(&self, g: &Gemm, a: &Self::F, b: &Self::F, c: &mut Self::F) -> Result<(), String>;
    /// `out[t] = word[ids[t]] + position[t % len] + token_type[types[t]]`.
    fn embed(
        &self,
        ids: &Self::U,
        types: &Self::U,
        w: &Weights<Self::F>,
        out: &mut Self::F,
        dims: Dims,
    ) -> Result<(), String>;
    /// `y = LayerNorm(x + bias + residual)` per token (a row of `h`).
    #[allow(clippy::too_many_arguments)]
    fn layer_norm(
        &self,
        y: &mut Self::F,
        x: &Self::F,
        bias: Option<&Self::F>,
        residual: Option<&Self::F>,
        norm: &Norm<Self::F>,
        dims: Dims,
        eps: f32,
    ) -> Result<(), String>;
    /// `x = gelu(x + bias)` (erf), `n` elements in rows of `cols`.
    fn bias_gelu(&self, x: &mut Self::F, bias: &Self::F, n: usize, cols: usize) -> Result<(), String>;
    /// `qkv [t, 3h]` + bias to q, k, v `[rows · heads, len, d]`.
    fn split_heads(
        &self,
        qkv: &Self::F,
        bias: &Self::F,
        q: &mut Self::F,
        k: &mut Self::F,
        v: &mut Self::F,
        dims: Dims,
    ) -> Result<(), String>;
    /// Softmax of each score row (`rows · heads · len` rows of `len`), keys at or past the
    /// sentence's length masked.
    fn masked_softmax(&self, s: &mut Self::F, lengths: &Self::I, dims: Dims) -> Result<(), String>;
    /// `[rows · heads, len, d]` back to `[t, h]`.
    fn merge_heads(&self, ctx: &Self::F, out: &mut Self::F, dims: Dims) -> Result<(), String>;
    /// Mean (or `[CLS]`) pooling per row, then unit length if asked.
    fn pool(
        &self,
        x: &Self::F,
        lengths: &Self::I,
        out: &mut Self::F,
        dims: Dims,
        cls: bool,
        normalize: bool,
    ) -> Result<(), String>;
}

pub struct Norm<F> {
    pub gamma: F,
    pub beta: F,
}

pub struct Dense<F> {
    pub weight: F,
    pub bias: F,
    pub out: usize,
    pub inp: usize,
}

pub struct Layer<F> {
    pub qkv: Dense<F>,
    pub attention_out: Dense<F>,
    pub attention_norm: Norm<F>,
    pub intermediate: Dense<F>,
    pub output: Dense<F>,
    pub output_norm: Norm<F>,
}

/// The weights on the device.
pub struct Weights<F> {
    pub word: F,
    pub position: F,
    pub token_type: F,
    pub embedding_norm: Norm<F>,
    pub layers: Vec<Layer<F>>,
}

/// A host array's elements in row-major order.
fn host<D: ndarray::Dimension>(a: &ndarray::Array<f32, D>) -> Vec<f32> {
    a.iter().copied().collect()
}

impl<F> Weights<F> {
    pub fn upload<O: Ops<F = F>>(ops: &O, w: &files::Weights) -> Result<Weights<F>, String> {
        let norm = |n: &files::Norm| -> Result<Norm<F>, String> {
            Ok(Norm { gamma: ops.f32s(&host(&n.gamma))?, beta: ops.f32s(&host(&n.beta))? })
        };
        let dense = |d: &files::Dense| -> Result<Dense<F>, String> {
            Ok(Dense {
                weight: ops.f32s(&host(&d.weight))?,
                bias: ops.f32s(&host(&d.bias))?,
                out: d.weight.nrows(),
                inp: d.weight.ncols(),
            })
        };
        let layers = w
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    qkv: dense(&l.qkv)?,
                    attention_out: dense(&l.attention_out)?,
                    attention_norm: norm(&l.attention_norm)?,
                    intermediate: dense(&l.intermediate)?,
                    output: dense(&l.output)?,
                    output_norm: norm(&l.output_norm)?,
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Weights {
            word: ops.f32s(&host(&w.word))?,
            position: ops.f32s(&host(&w.position))?,
            token_type: ops.f32s(&host(&w.token_type))?,
            embedding_norm: norm(&w.embedding_norm)?,
            layers,
        })
    }
}

/// `y[t, out] = x[t, in] · weightᵀ` (row-major; the bias is added by the next step). In
/// column-major terms: `yᵀ = weight · xᵀ`, the stored `[out, in]` weight read transposed.
fn linear<O: Ops>(ops: &O, x: &O::F, d: &Dense<O::F>, y: &mut O::F, t: usize) -> Result<(), String> {
    let g = Gemm {
        trans_a: true,
        trans_b: false,
        m: d.out,
        n: t,
        k: d.inp,
        alpha: 1.0,
        lda: d.inp,
        ldb: d.inp,
        ldc: d.out,
        batch: 1,
        stride_a: 0,
        stride_b: 0,
        stride_c: 0,
    };
    ops.gemm(&g, &d.weight, x, y)
}

/// Embeddings of the batch, row-major `[rows, hidden]`.
pub fn forward<O: Ops>(ops: &O, w: &Weights<O::F>, c: &Config, batch: &TokenBatch) -> Result<Vec<f32>, String> {
    let dims = Dims { rows: batch.rows, len: batch.len, h: c.hidden, heads: c.heads };
    let Dims { rows, len, h, heads } = dims;
    let (t, d) = (dims.t(), dims.d());
    let eps = c.layer_norm_eps;
    let lengths: Vec<i32> = batch.lengths.iter().map(|&l| l as i32).collect();
    let ids = ops.u32s(&batch.ids)?;
    let types = ops.u32s(&batch.type_ids)?;
    let lengths = ops.i32s(&lengths)?;

    let mut x = ops.zeros(t * h)?;
    let mut a = ops.zeros(t * h)?;
    let mut scratch = ops.zeros(t * h)?;
    let mut qkv = ops.zeros(t * 3 * h)?;
    let mut ff = ops.zeros(t * c.intermediate)?;
    let mut q = ops.zeros(t * h)?;
    let mut k = ops.zeros(t * h)?;
    let mut v = ops.zeros(t * h)?;
    let mut scores = ops.zeros(rows * heads * len * len)?;
    let mut ctx = ops.zeros(t * h)?;
    let mut out = ops.zeros(rows * h)?;

    ops.embed(&ids, &types, w, &mut a, dims)?;
    ops.layer_norm(&mut x, &a, None, None, &w.embedding_norm, dims, eps)?;
    // scores[bh] = q[bh] · k[bh]ᵀ / √d; column-major: scoresᵀ = k · qᵀ, k read transposed.
    let scores_gemm = Gemm {
        trans_a: true,
        trans_b: false,
        m: len,
        n: len,
        k: d,
        alpha: 1.0 / (d as f32).sqrt(),
        lda: d,
        ldb: d,
        ldc: len,
        batch: rows * heads,
        stride_a: len * d,
        stride_b: len * d,
        stride_c: len * len,
    };
    // ctx[bh] = p[bh] · v[bh]; column-major: ctxᵀ = vᵀ · pᵀ, both as stored.
    let context_gemm = Gemm {
        trans_a: false,
        trans_b: false,
        m: d,
        n: len,
        k: len,
        alpha: 1.0,
        lda: d,
        ldb: len,
        ldc: d,
        batch: rows * heads,
        stride_a: len * d,
        stride_b: len * len,
        stride_c: len * d,
    };
    for layer in &w.layers {
        linear(ops, &x, &layer.qkv, &mut qkv, t)?;
        ops.split_heads(&qkv, &layer.qkv.bias, &mut q, &mut k, &mut v, dims)?;
        ops.gemm(&scores_gemm, &k, &q, &mut scores)?;
        ops.masked_softmax(&mut scores, &lengths, dims)?;
        ops.gemm(&context_gemm, &v, &scores, &mut ctx)?;
        ops.merge_heads(&ctx, &mut scratch, dims)?;
        linear(ops, &scratch, &layer.attention_out, &mut q, t)?;
        // a = LayerNorm(attention + bias + x)
        ops.layer_norm(&mut a, &q, Some(&layer.attention_out.bias), Some(&x), &layer.attention_norm, dims, eps)?;
        linear(ops, &a, &layer.intermediate, &mut ff, t)?;
        ops.bias_gelu(&mut ff, &layer.intermediate.bias, t * c.intermediate, c.intermediate)?;
        linear(ops, &ff, &layer.output, &mut q, t)?;
        // x = LayerNorm(output + bias + a)
        ops.layer_norm(&mut x, &q, Some(&layer.output.bias), Some(&a), &layer.output_norm, dims, eps)?;
    }
    ops.pool(&x, &lengths, &mut out, dims, c.pooling == Pooling::Cls, c.normalize)?;
    ops.download(&out)
}
