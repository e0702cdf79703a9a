//! The forward pass on the CPU, in f32, with ndarray (whose GEMM is matrixmultiply's, threaded).
//!
//! Rows are packed rather than padded: token-wise work (the projections, layer norms, GELU) runs
//! on real tokens only, and attention runs per sentence over that sentence's own tokens. This is
//! exactly what padding to the longest row with masked keys computes (a masked key's weight is
//! `exp(-inf) = 0`, and padded queries are pooled away), without the padding's cost.

use ndarray::linalg::general_mat_mul;
use ndarray::{s, Array2, ArrayView1, ArrayViewMut1, Axis};

use super::files::{Dense, Norm, Pooling, Weights};
use super::TokenBatch;

pub struct CpuModel {
    w: Weights,
}

impl CpuModel {
    pub fn new(w: Weights) -> CpuModel {
        CpuModel { w }
    }

    /// Embeddings of the batch, row-major `[rows, hidden]`.
    pub fn embed(&self, batch: &TokenBatch) -> Vec<f32> {
        let c = &self.w.config;
        let h = c.hidden;
        let mut offsets = Vec::with_capacity(batch.rows + 1);
        offsets.push(0);
        for &l in &batch.lengths {
            offsets.push(offsets.last().copied().unwrap_or(0) + l);
        }
        let total = batch.tokens();

        // Embeddings: word + position + token type, then a layer norm.
        let mut x = Array2::<f32>::zeros((total, h));
        for (r, (&length, &offset)) in batch.lengths.iter().zip(&offsets).enumerate() {
            for p in 0..length {
                let at = r * batch.len + p;
                let mut row = x.row_mut(offset + p);
                row += &self.w.word.row(batch.ids[at] as usize);
                row += &self.w.position.row(p);
                row += &self.w.token_type.row(batch.type_ids[at] as usize);
            }
        }
        layer_norm(&mut x, &self.w.embedding_norm, c.layer_norm_eps);

        for layer in &self.w.layers {
            let qkv = linear(&x, &layer.qkv);
            let ctx = attention(&qkv, &offsets, c.heads, h);
            let mut a = linear(&ctx, &layer.attention_out);
            a += &x;
            layer_norm(&mut a, &layer.attention_norm, c.layer_norm_eps);
            let mut f = linear(&a, &layer.intermediate);
            f.mapv_inplace(gelu);
            let mut o = linear(&f, &layer.output);
            o += &a;
            layer_norm(&mut o, &layer.output_norm, c.layer_norm_eps);
            x = o;
        }

        let mut out = Vec::with_capacity(batch.rows * h);
        for r in 0..batch.rows {
            let tokens = x.slice(s![offsets[r]..offsets[r + 1], ..]);
            let mut v = match c.pooling {
                Pooling::Mean => tokens.mean_axis(Axis(0)).expect("every row has [CLS] and [SEP]"),
                Pooling::Cls => tokens.row(0).to_owned(),
            };
            if c.normalize {
                let norm = v.dot(&v).sqrt().max(1e-12);
                v /= norm;
            }
            out.extend(v.iter());
        }
        out
    }
}

/// `x · weightᵀ + bias`, computed as `yᵀ = weight · xᵀ` into a transposed view of `y`: the
/// GEMM splits its first dimension across threads, and that is the weight's (hundreds of
/// outputs), not the batch's tokens (a handful for one short sentence, which would leave every
/// thread but one idle).
fn linear(x: &Array2<f32>, d: &Dense) -> Array2<f32> {
    let mut y = d.bias.broadcast((x.nrows(), d.bias.len())).expect("bias is 1-d").to_owned();
    general_mat_mul(1.0, &d.weight, &x.t(), 1.0, &mut y.view_mut().reversed_axes());
    y
}

/// Multi-head self-attention per sentence: `qkv` holds each token's query, key and value side by
/// side; the result is each token's context, heads side by side.
fn attention(qkv: &Array2<f32>, offsets: &[usize], heads: usize, hidden: usize) -> Array2<f32> {
    let d = hidden / heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut ctx = Array2::<f32>::zeros((qkv.nrows(), hidden));
    for w in offsets.windows(2) {
        let (from, to) = (w[0], w[1]);
        let l = to - from;
        let mut scores = Array2::<f32>::zeros((l, l));
        for head in 0..heads {
            let cols = head * d..(head + 1) * d;
            let q = qkv.slice(s![from..to, cols.clone()]);
            let k = qkv.slice(s![from..to, hidden + cols.start..hidden + cols.end]);
            let v = qkv.slice(s![from..to, 2 * hidden + cols.start..2 * hidden + cols.end]);
            general_mat_mul(scale, &q, &k.t(), 0.0, &mut scores);
            for row in scores.rows_mut() {
                softmax(row);
            }
            general_mat_mul(1.0, &scores, &v, 0.0, &mut ctx.slice_mut(s![from..to, cols]));
        }
    }
    ctx
}

fn softmax(mut row: ArrayViewMut1<f32>) {
    let max = row.fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    row.mapv_inplace(|x| (x - max).exp());
    let sum = row.sum();
    row /= sum;
}

fn layer_norm(x: &mut Array2<f32>, norm: &Norm, eps: f32) {
    for mut row in x.rows_mut() {
        normalize_row(&mut row, norm.gamma.view(), norm.beta.view(), eps);
    }
}

fn normalize_row(row: &mut ArrayViewMut1<f32>, gamma: ArrayView1<f32>, beta: ArrayView1<f32>, eps: f32) {
    let n = row.len() as f32;
    let mean = row.sum() / n;
    let var = row.fold(0.0, |acc, &x| acc + (x - mean) * (x - mean)) / n;
    let inv = 1.0 / (var + eps).sqrt();
    ndarray::Zip::from(row).and(gamma).and(beta).for_each(|x, &g, &b| *x = (*x - mean) * inv * g + b);
}

/// BERT's GELU, the exact one (with erf), as `hidden_act: gelu` means in PyTorch.
fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}
