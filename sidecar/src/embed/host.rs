//! The GPU's operations ([`super::padded::Ops`]) emulated on the host, element by element, with
//! cuBLAS's column-major GEMM semantics and the kernels of `kernels.cu` translated line for line.
//! Slow, and meant to be: it exists so that the GPU path's algorithm — padding, masking, the
//! GEMMs' transposes and strides — is tested against the CPU path on machines without a GPU.

use super::padded::{Dims, Gemm, Norm, Ops, Weights};

#[derive(Debug, Default)]
pub struct HostOps;

impl Ops for HostOps {
    type F = Vec<f32>;
    type U = Vec<u32>;
    type I = Vec<i32>;

    fn f32s(&self, host: &[f32]) -> Result<Vec<f32>, String> {
        Ok(host.to_vec())
    }
    fn u32s(&self, host: &[u32]) -> Result<Vec<u32>, String> {
        Ok(host.to_vec())
    }
    fn i32s(&self, host: &[i32]) -> Result<Vec<i32>, String> {
        Ok(host.to_vec())
    }
    fn zeros(&self, n: usize) -> Result<Vec<f32>, String> {
        Ok(vec![0.0; n])
    }
    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>, String> {
        Ok(buf.clone())
    }

    fn gemm(&self, g: &Gemm, a: &Vec<f32>, b: &Vec<f32>, c: &mut Vec<f32>) -> Result<(), String> {
        for batch in 0..g.batch {
            let (a, b) = (&a[batch * g.stride_a..], &b[batch * g.stride_b..]);
            let c = &mut c[batch * g.stride_c..];
            for j in 0..g.n {
                for i in 0..g.m {
                    let mut acc = 0.0f32;
                    for p in 0..g.k {
                        let x = if g.trans_a { a[p + i * g.lda] } else { a[i + p * g.lda] };
                        let y = if g.trans_b { b[j + p * g.ldb] } else { b[p + j * g.ldb] };
                        acc += x * y;
                    }
                    c[i + j * g.ldc] = g.alpha * acc;
                }
            }
        }
        Ok(())
    }

    fn embed(
        &self,
        ids: &Vec<u32>,
        types: &Vec<u32>,
        w: &Weights<Vec<f32>>,
        out: &mut Vec<f32>,
        dims: Dims,
    ) -> Result<(), String> {
        let Dims { len, h, .. } = dims;
        for tok in 0..dims.t() {
            let (id, ty, pos) = (ids[tok] as usize, types[tok] as usize, tok % len);
            for e in 0..h {
                out[tok * h + e] = w.word[id * h + e] + w.position[pos * h + e] + w.token_type[ty * h + e];
            }
        }
        Ok(())
    }

    fn layer_norm(
        &self,
        y: &mut Vec<f32>,
        x: &Vec<f32>,
        bias: Option<&Vec<f32>>,
        residual: Option<&Vec<f32>>,
        norm: &Norm<Vec<f32>>,
        dims: Dims,
        eps: f32,
    ) -> Result<(), String> {
        let h = dims.h;
        for r in 0..dims.t() {
            let v: Vec<f32> = (0..h)
                .map(|e| x[r * h + e] + bias.map_or(0.0, |b| b[e]) + residual.map_or(0.0, |res| res[r * h + e]))
                .collect();
            let mean = v.iter().sum::<f32>() / h as f32;
            let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / h as f32;
            let inv = 1.0 / (var + eps).sqrt();
            for e in 0..h {
                y[r * h + e] = (v[e] - mean) * inv * norm.gamma[e] + norm.beta[e];
            }
        }
        Ok(())
    }

    fn bias_gelu(&self, x: &mut Vec<f32>, bias: &Vec<f32>, n: usize, cols: usize) -> Result<(), String> {
        for i in 0..n {
            let v = x[i] + bias[i % cols];
            x[i] = 0.5 * v * (1.0 + libm::erff(v * std::f32::consts::FRAC_1_SQRT_2));
        }
        Ok(())
    }

    fn split_heads(
        &self,
        qkv: &Vec<f32>,
        bias: &Vec<f32>,
        q: &mut Vec<f32>,
        k: &mut Vec<f32>,
        v: &mut Vec<f32>,
        dims: Dims,
    ) -> Result<(), String> {
        let (Dims { len, h, heads, .. }, d) = (dims, dims.d());
        for tok in 0..dims.t() {
            let (b, l) = (tok / len, tok % len);
            for j in 0..3 * h {
                let (which, head, e) = (j / h, (j % h) / d, j % d);
                let dst = match which {
                    0 => &mut *q,
                    1 => &mut *k,
                    _ => &mut *v,
                };
                dst[((b * heads + head) * len + l) * d + e] = qkv[tok * 3 * h + j] + bias[j];
            }
        }
        Ok(())
    }

    fn masked_softmax(&self, s: &mut Vec<f32>, lengths: &Vec<i32>, dims: Dims) -> Result<(), String> {
        let Dims { rows, len, heads, .. } = dims;
        for r in 0..rows * heads * len {
            let valid = lengths[r / len / heads] as usize;
            let row = &mut s[r * len..(r + 1) * len];
            let max = row[..valid].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            for (j, x) in row.iter_mut().enumerate() {
                *x = if j < valid { (*x - max).exp() } else { 0.0 };
            }
            let sum: f32 = row.iter().sum();
            row.iter_mut().for_each(|x| *x /= sum);
        }
        Ok(())
    }

    fn merge_heads(&self, ctx: &Vec<f32>, out: &mut Vec<f32>, dims: Dims) -> Result<(), String> {
        let (Dims { len, h, heads, .. }, d) = (dims, dims.d());
        for tok in 0..dims.t() {
            let (b, l) = (tok / len, tok % len);
            for j in 0..h {
                let (head, e) = (j / d, j % d);
                out[tok * h + j] = ctx[((b * heads + head) * len + l) * d + e];
            }
        }
        Ok(())
    }

    fn pool(
        &self,
        x: &Vec<f32>,
        lengths: &Vec<i32>,
        out: &mut Vec<f32>,
        dims: Dims,
        cls: bool,
        normalize: bool,
    ) -> Result<(), String> {
        let Dims { rows, len, h, .. } = dims;
        for b in 0..rows {
            let n = if cls { 1 } else { lengths[b] as usize };
            for e in 0..h {
                out[b * h + e] = (0..n).map(|l| x[(b * len + l) * h + e]).sum::<f32>() / n as f32;
            }
            if normalize {
                let norm = out[b * h..(b + 1) * h].iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
                out[b * h..(b + 1) * h].iter_mut().for_each(|x| *x /= norm);
            }
        }
        Ok(())
    }
}
