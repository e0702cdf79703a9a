//! [`Ops`] on the host: each GPU kernel of `kernels.cu` and each cuBLAS call emulated element
//! for element over `Vec`s, single-threaded and plain, so that [`crate::device::forward`] — the
//! GPU's algorithm — runs and is checked against the CPU path where there is no GPU.
//! Not a fast path: the CPU path is [`crate::cpu`].

use crate::device::{DeviceCache, DeviceIndex, Dims, Ops};

#[derive(Debug, Default)]
pub struct Host;

fn check(what: &str, len: usize, need: usize) -> Result<(), String> {
    if len < need {
        return Err(format!("{what}: a buffer of {len} elements where {need} are indexed"));
    }
    Ok(())
}

impl Ops for Host {
    type F = Vec<f32>;
    type U = Vec<u32>;

    fn upload(&self, host: &[f32]) -> Result<Vec<f32>, String> {
        Ok(host.to_vec())
    }

    fn upload_u32(&self, host: &[u32]) -> Result<Vec<u32>, String> {
        Ok(host.to_vec())
    }

    fn zeros(&self, n: usize) -> Result<Vec<f32>, String> {
        Ok(vec![0.0; n])
    }

    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>, String> {
        Ok(buf.clone())
    }

    /// cuBLAS `sgemm(T, N, m = n, n = rows, k, w, lda = k, x, ldb = k, y, ldc = n)`: column `r`
    /// of the column-major result (row `r` of y) is `w · x[r]`.
    fn linear(
        &self,
        x: &Vec<f32>,
        rows: usize,
        w: &Vec<f32>,
        n: usize,
        k: usize,
        y: &mut Vec<f32>,
    ) -> Result<(), String> {
        check("linear x", x.len(), rows * k)?;
        check("linear w", w.len(), n * k)?;
        check("linear y", y.len(), rows * n)?;
        for r in 0..rows {
            for j in 0..n {
                let mut acc = 0.0f32;
                for i in 0..k {
                    acc += w[j * k + i] * x[r * k + i];
                }
                y[r * n + j] = acc;
            }
        }
        Ok(())
    }

    fn gather(
        &self,
        ids: &Vec<u32>,
        n: usize,
        table: &Vec<f32>,
        width: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), String> {
        check("gather out", out.len(), n * width)?;
        for i in 0..n {
            let at = ids[i] as usize * width;
            check("gather table", table.len(), at + width)?;
            out[i * width..(i + 1) * width].copy_from_slice(&table[at..at + width]);
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        rows: usize,
        width: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), String> {
        check("rms_norm", x.len().min(out.len()), rows * width)?;
        for r in 0..rows {
            let row = &x[r * width..(r + 1) * width];
            let ss: f32 = row.iter().map(|v| v * v).sum();
            let inv = 1.0 / (ss / width as f32 + eps).sqrt();
            for c in 0..width {
                out[r * width + c] = row[c] * inv * weight[c];
            }
        }
        Ok(())
    }

    fn rope_store(
        &self,
        qkv: &mut Vec<f32>,
        bias: Option<&Vec<f32>>,
        ix: &DeviceIndex<Vec<u32>>,
        cache: &mut DeviceCache<Vec<f32>>,
        layer: usize,
        d: Dims,
    ) -> Result<(), String> {
        let (qd, kvd, width, half) = (d.q_dim(), d.kv_dim(), d.qkv_width(), d.head_dim / 2);
        check("rope_store qkv", qkv.len(), ix.t * width)?;
        for t in 0..ix.t {
            let row = &mut qkv[t * width..(t + 1) * width];
            if let Some(b) = bias {
                row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
            }
            let p = ix.positions[t] as usize;
            let (cs, sn) = (&cache.cos[p * half..(p + 1) * half], &cache.sin[p * half..(p + 1) * half]);
            for e in 0..(d.heads + d.kv_heads) * half {
                let (head, i) = (e / half, e % half);
                let x = &mut row[head * d.head_dim..(head + 1) * d.head_dim];
                let (x0, x1) = (x[i], x[i + half]);
                x[i] = x0 * cs[i] - x1 * sn[i];
                x[i + half] = x1 * cs[i] + x0 * sn[i];
            }
            let at = d.layer_offset(layer) + ix.slots[t] as usize * kvd;
            check("rope_store cache", cache.keys.len().min(cache.values.len()), at + kvd)?;
            cache.keys[at..at + kvd].copy_from_slice(&row[qd..qd + kvd]);
            cache.values[at..at + kvd].copy_from_slice(&row[qd + kvd..qd + 2 * kvd]);
        }
        Ok(())
    }

    fn attention(
        &self,
        qkv: &Vec<f32>,
        ix: &DeviceIndex<Vec<u32>>,
        cache: &DeviceCache<Vec<f32>>,
        layer: usize,
        d: Dims,
        out: &mut Vec<f32>,
    ) -> Result<(), String> {
        let (qd, kvd, width, hd) = (d.q_dim(), d.kv_dim(), d.qkv_width(), d.head_dim);
        let offset = d.layer_offset(layer);
        let scale = 1.0 / (hd as f32).sqrt();
        check("attention out", out.len(), ix.t * qd)?;
        for t in 0..ix.t {
            let n = ix.positions[t] as usize + 1;
            let start = ix.context_start[t] as usize;
            let slots = &ix.context[start..start + n];
            for h in 0..d.heads {
                let kvh = h / (d.heads / d.kv_heads);
                let q = &qkv[t * width + h * hd..][..hd];
                let mut scores = vec![0.0f32; n];
                let mut m = f32::NEG_INFINITY;
                for (j, &slot) in slots.iter().enumerate() {
                    let k = &cache.keys[offset + slot as usize * kvd + kvh * hd..][..hd];
                    let mut dot = 0.0f32;
                    for i in 0..hd {
                        dot += q[i] * k[i];
                    }
                    scores[j] = dot * scale;
                    m = m.max(scores[j]);
                }
                let mut sum = 0.0f32;
                for s in &mut scores {
                    *s = (*s - m).exp();
                    sum += *s;
                }
                let inv = 1.0 / sum;
                for i in 0..hd {
                    let mut acc = 0.0f32;
                    for (j, &slot) in slots.iter().enumerate() {
                        acc += scores[j] * cache.values[offset + slot as usize * kvd + kvh * hd + i];
                    }
                    out[t * qd + h * hd + i] = acc * inv;
                }
            }
        }
        Ok(())
    }

    fn silu_mul(&self, gate_up: &Vec<f32>, rows: usize, ffn: usize, out: &mut Vec<f32>) -> Result<(), String> {
        check("silu_mul", gate_up.len(), rows * 2 * ffn)?;
        for r in 0..rows {
            for f in 0..ffn {
                let (g, u) = (gate_up[r * 2 * ffn + f], gate_up[r * 2 * ffn + ffn + f]);
                out[r * ffn + f] = g / (1.0 + (-g).exp()) * u;
            }
        }
        Ok(())
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, n: usize) -> Result<(), String> {
        check("add", x.len().min(y.len()), n)?;
        x[..n].iter_mut().zip(&y[..n]).for_each(|(x, y)| *x += y);
        Ok(())
    }
}
