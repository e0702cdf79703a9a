//! The decoder's forward pass on the CPU over one engine step: every sequence's new tokens
//! packed into one matrix (prefill chunks and single decode tokens alike), so each projection is
//! one matrix product for the whole step; attention over each sequence's own KV blocks
//! ([`crate::attention`]); logits only for the sequences that sample. Activations are f32; weights are f32 or
//! the file's quantized blocks ([`crate::quant`]).
//!
//! Threads, all rayon's pool, on one of whose threads the whole pass runs ([`crate::Model::forward`]):
//! a quantized projection dots each weight row with every token's 8-bit activations in
//! integers, a tile of tokens at a time ([`crate::quant`]; past a portable build's decode
//! batches, dequantized panels and the GEMM); an f32 projection of a handful of tokens is a
//! matrix-vector product that reads each weight row once (decode is bound by memory), of more
//! the `gemm` crate's packed GEMM (bound by arithmetic); attention splits tiles of tokens ×
//! key-value heads.

use rayon::prelude::*;

use super::attention::{attend, Query, Shape};
use super::gguf::Kind;
use super::kv::{KvCache, LayerKv};
use super::quant::{self, Q8};
use super::weights::{Matrix, Store, Weights};
use crate::Seq;

/// Up to this many tokens, a projection reads each weight row once and dots it with every token
/// (memory-bound decode); past it, the packed GEMM's reuse wins.
const GEMV_TOKENS: usize = 4;
/// Weight rows per task of the matrix-vector and integer paths.
const ROWS_PER_TASK: usize = 32;
/// Most f32 bytes of a quantized matrix the panel path dequantizes at once (portable builds'
/// prefills; the whole of each of SmolLM2's layer matrices, 7281 rows of its 49152-row output).
const PANEL_BYTES: usize = 16 << 20;

/// Rotary embedding tables: `cos` and `sin` of `position × θ^(−2i/d)`, `[position][d/2]`.
#[derive(Debug)]
pub struct Rope {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    pub fn new(config: &crate::Config, positions: usize) -> Rope {
        let (cos, sin) = crate::device::rope_tables(config, positions);
        Rope { half: config.head_dim / 2, cos, sin }
    }

    pub fn positions(&self) -> usize {
        self.cos.len() / self.half
    }

    /// Rotates each head of `x` (heads × head_dim) for position `p`, pairing element `i` with
    /// element `i + d/2` (the Hugging Face layout the weights are in).
    fn apply(&self, x: &mut [f32], p: usize) {
        let (cos, sin) = (&self.cos[p * self.half..][..self.half], &self.sin[p * self.half..][..self.half]);
        for head in x.chunks_exact_mut(2 * self.half) {
            let (a, b) = head.split_at_mut(self.half);
            for i in 0..self.half {
                let (x0, x1) = (a[i], b[i]);
                a[i] = x0 * cos[i] - x1 * sin[i];
                b[i] = x1 * cos[i] + x0 * sin[i];
            }
        }
    }
}

/// Runs one step: writes every new token's keys and values into the cache and returns the
/// logits (`[vocab]`) after the last token of each sequence that samples, in order.
pub fn forward(w: &Weights, rope: &Rope, cache: &mut KvCache, seqs: &[Seq<'_>]) -> Result<Vec<Vec<f32>>, String> {
    let c = &w.config;
    let (h, qd, kvd, hd) = (c.hidden, c.q_dim(), c.kv_dim(), c.head_dim);

    // Each new token: its sequence, its position and its cache slot, checked up front so that a
    // bad step writes nothing.
    let mut tokens = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        if seq.sample.is_some() && seq.tokens.is_empty() {
            return Err(format!("sequence {s} of the step samples after no new token"));
        }
        for (k, &id) in seq.tokens.iter().enumerate() {
            let p = seq.start as usize + k;
            if id as usize >= c.vocab {
                return Err(format!("token {id} is outside the vocabulary ({} tokens)", c.vocab));
            }
            if p >= rope.positions() {
                return Err(format!("position {p} is past the model's context ({})", rope.positions()));
            }
            tokens.push(Token { seq: s, position: p, slot: cache.slot(seq.blocks, p)?, id });
        }
    }
    // Each sequence's cache slots for positions 0 up to its last new token, shared by every layer.
    let slots: Vec<Vec<usize>> = seqs
        .iter()
        .map(|seq| (0..seq.start as usize + seq.tokens.len()).map(|p| cache.slot(seq.blocks, p)).collect())
        .collect::<Result<_, _>>()?;
    let t = tokens.len();
    let queries: Vec<Query> = tokens.iter().map(|tok| Query { seq: tok.seq, position: tok.position }).collect();
    let mut x = Vec::with_capacity(t * h);
    for tok in &tokens {
        w.embed.row_into(tok.id as usize, &mut x);
    }
    let mut normed = vec![0.0; t * h];
    for (l, layer) in w.layers.iter().enumerate() {
        rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut normed);
        let mut qkv = matmul(&normed, t, &layer.qkv);
        let width = qd + 2 * kvd;
        for (i, row) in qkv.chunks_exact_mut(width).enumerate() {
            if let Some(bias) = &layer.qkv_bias {
                row.iter_mut().zip(bias).for_each(|(x, b)| *x += b);
            }
            let p = tokens[i].position;
            let (q, kv) = row.split_at_mut(qd);
            rope.apply(q, p);
            rope.apply(&mut kv[..kvd], p);
            cache.write(l, tokens[i].slot, &kv[..kvd], &kv[kvd..]);
        }
        let mut attended = vec![0.0; t * qd];
        let shape = Shape { heads: c.heads, kv_heads: c.kv_heads, head_dim: hd };
        match cache.layer(l) {
            LayerKv::F16(keys, values) => attend(&mut attended, &qkv, width, &queries, &slots, shape, keys, values),
            LayerKv::F32(keys, values) => attend(&mut attended, &qkv, width, &queries, &slots, shape, keys, values),
        }
        let o = matmul(&attended, t, &layer.out);
        x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);

        rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut normed);
        let gate_up = matmul(&normed, t, &layer.gate_up);
        let f = c.ffn;
        let mut act = Vec::with_capacity(t * f);
        for row in gate_up.chunks_exact(2 * f) {
            let (g, u) = row.split_at(f);
            act.extend(g.iter().zip(u).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u));
        }
        let down = matmul(&act, t, &layer.down);
        x.iter_mut().zip(&down).for_each(|(x, d)| *x += d);
    }

    // The last new token of each sampling sequence.
    let mut last = Vec::new();
    let mut end = 0;
    for seq in seqs {
        end += seq.tokens.len();
        if seq.sample.is_some() {
            last.extend_from_slice(&x[(end - 1) * h..end * h]);
        }
    }
    let rows = last.len() / h;
    let mut final_norm = vec![0.0; last.len()];
    rms_norm(&last, &w.norm, c.rms_eps, &mut final_norm);
    let logits = matmul(&final_norm, rows, w.lm_head());
    Ok(logits.chunks_exact(c.vocab).map(<[f32]>::to_vec).collect())
}

struct Token {
    seq: usize,
    position: usize,
    slot: usize,
    id: u32,
}

/// `out = x / rms(x) × weight`, row by row.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let h = weight.len();
    for (row, o) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        let mean = row.iter().map(|v| v * v).sum::<f32>() / h as f32;
        let inv = 1.0 / (mean + eps).sqrt();
        o.iter_mut().zip(row).zip(weight).for_each(|((o, v), g)| *o = v * inv * g);
    }
}

/// `x · wᵀ`: `x` is `[rows, w.cols]`, the result `[rows, w.rows]`.
pub fn matmul(x: &[f32], rows: usize, w: &Matrix) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    debug_assert_eq!(x.len(), rows * k);
    if rows == 0 {
        return Vec::new();
    }
    match &w.store {
        Store::F32(data) => matmul_f32(x, rows, data, n, k),
        Store::Blocks { kind: kind @ (Kind::F16 | Kind::Bf16), bytes } => matmul_half(x, rows, *kind, bytes, n, k),
        Store::Blocks { kind, bytes } => matmul_blocks(x, rows, *kind, bytes, n, k),
        Store::Stacked(parts) => {
            let mut y = vec![0.0; rows * n];
            let mut at = 0;
            for p in parts {
                let part = matmul(x, rows, p);
                for (y, part) in y.chunks_exact_mut(n).zip(part.chunks_exact(p.rows)) {
                    y[at..at + p.rows].copy_from_slice(part);
                }
                at += p.rows;
            }
            y
        }
    }
}

fn matmul_f32(x: &[f32], rows: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    if rows <= GEMV_TOKENS {
        return gemv(rows, n, w, k, |wr, _, out| dots(x, k, wr, out));
    }
    let mut y = vec![0.0; rows * n];
    gemm_into(&mut y, n, x, rows, w, n, k);
    y
}

/// A product of `rows` tokens (a handful), output-major: each task reads its weight rows (of
/// `row_len` elements) once, and `dot_row` dots one with every token into `out` (given a scratch row of
/// the task's own, for a row it widens first).
fn gemv<T: Sync>(
    rows: usize,
    n: usize,
    w: &[T],
    row_len: usize,
    dot_row: impl Fn(&[T], &mut Vec<f32>, &mut [f32]) + Sync,
) -> Vec<f32> {
    let mut by_output = vec![0.0; n * rows];
    by_output.par_chunks_mut(ROWS_PER_TASK * rows).zip(w.par_chunks(ROWS_PER_TASK * row_len)).for_each(|(out, w)| {
        let mut scratch = Vec::new();
        for (o, wr) in out.chunks_exact_mut(rows).zip(w.chunks_exact(row_len)) {
            dot_row(wr, &mut scratch, o);
        }
    });
    transpose(&by_output, n, rows)
}

/// `out[r]` = token `r`'s row of `x` (rows of `k`) · `w_row`.
fn dots(x: &[f32], k: usize, w_row: &[f32], out: &mut [f32]) {
    for (r, o) in out.iter_mut().enumerate() {
        *o = dot(&x[r * k..(r + 1) * k], w_row);
    }
}

/// A matrix of F16 or BF16 values, kept in 16 bits (half the bytes a decode reads): for a
/// handful of tokens each row is widened to f32 and dotted with every token, as the f32 path
/// does (the same sums); for more, panels are widened for the GEMM.
fn matmul_half(x: &[f32], rows: usize, kind: Kind, bytes: &[u8], n: usize, k: usize) -> Vec<f32> {
    if rows <= GEMV_TOKENS {
        return gemv(rows, n, bytes, 2 * k, |wr, wf, out| {
            wf.resize(k, 0.0);
            quant::dequantize_rows(kind, wr, k, wf);
            dots(x, k, wf, out);
        });
    }
    matmul_blocks_in(x, rows, kind, bytes, n, k, Route { integer_rows: 0, panel_bytes: PANEL_BYTES })
}

/// A matrix of quantized blocks: the activations quantized to 8 bits and dotted in integers
/// with each weight row as stored ([`quant`]), for as many tokens as that is faster
/// ([`quant::integer_rows`]: all of them on x86); for more, panels of weight rows dequantized
/// to f32 and multiplied by the packed GEMM (the dequantizing paid once for every token).
fn matmul_blocks(x: &[f32], rows: usize, kind: Kind, bytes: &[u8], n: usize, k: usize) -> Vec<f32> {
    let route = Route { integer_rows: quant::integer_rows(), panel_bytes: PANEL_BYTES };
    matmul_blocks_in(x, rows, kind, bytes, n, k, route)
}

/// Which way a quantized product goes: in integers up to `integer_rows` tokens, else in f32
/// panels of at most `panel_bytes`.
#[derive(Debug, Clone, Copy)]
struct Route {
    integer_rows: usize,
    panel_bytes: usize,
}

fn matmul_blocks_in(x: &[f32], rows: usize, kind: Kind, bytes: &[u8], n: usize, k: usize, route: Route) -> Vec<f32> {
    let row_bytes = Matrix::row_bytes(kind, k);
    if rows <= route.integer_rows {
        let q = Q8::quantize(x, k);
        // Each task's result is `[rows][its weight rows]`; a single row is already the whole.
        let mut by_task = vec![0.0; n * rows];
        by_task
            .par_chunks_mut(ROWS_PER_TASK * rows)
            .zip(bytes.par_chunks(ROWS_PER_TASK * row_bytes))
            .for_each(|(out, w)| quant::dot_rows(kind, w, row_bytes, &q, out));
        if rows == 1 {
            return by_task;
        }
        let mut y = vec![0.0; rows * n];
        y.par_chunks_mut(n).enumerate().for_each(|(r, y)| {
            for (y, task) in y.chunks_mut(ROWS_PER_TASK).zip(by_task.chunks(ROWS_PER_TASK * rows)) {
                y.copy_from_slice(&task[r * y.len()..][..y.len()]);
            }
        });
        return y;
    }
    // Panels of at most PANEL_BYTES of f32, each dequantized by every thread and multiplied
    // by the threaded GEMM straight into its columns of the result.
    let panel_rows = (route.panel_bytes / (k * 4)).clamp(1, n);
    let mut y = vec![0.0; rows * n];
    let mut panel = Vec::new();
    for start in (0..n).step_by(panel_rows) {
        let p = panel_rows.min(n - start);
        panel.resize(p * k, 0.0);
        let w = &bytes[start * row_bytes..(start + p) * row_bytes];
        panel
            .par_chunks_mut(ROWS_PER_TASK * k)
            .zip(w.par_chunks(ROWS_PER_TASK * row_bytes))
            .for_each(|(out, w)| quant::dequantize_rows(kind, w, k, out));
        gemm_into(&mut y[start..], n, x, rows, &panel, p, k);
    }
    y
}

/// `[n, rows]` to `[rows, n]`.
fn transpose(by_output: &[f32], n: usize, rows: usize) -> Vec<f32> {
    let mut y = vec![0.0; rows * n];
    for (j, o) in by_output.chunks_exact(rows).enumerate() {
        for (r, v) in o.iter().enumerate() {
            y[r * n + j] = *v;
        }
    }
    y
}

/// `y = x · wᵀ` with the `gemm` crate (runtime-dispatched AVX2/AVX-512 kernels, threaded on
/// rayon's pool), `w` `[n, k]`, into the first `n` columns of `y`'s rows of `stride`.
#[allow(unsafe_code)]
fn gemm_into(y: &mut [f32], stride: usize, x: &[f32], rows: usize, w: &[f32], n: usize, k: usize) {
    assert!(n <= stride && y.len() >= (rows - 1) * stride + n, "GEMM result's size");
    assert!(x.len() == rows * k && w.len() == n * k, "GEMM operands' sizes");
    let threads = rayon::current_num_threads();
    // SAFETY: the three pointers come from slices of at least the sizes the strides address
    // (checked above): y is rows × n with row stride `stride`, x rows × k row-major, and wᵀ is
    // read as a k × n matrix with column stride k over w's n × k elements; y is written only,
    // and it aliases neither input (a `&mut` beside two `&`).
    unsafe {
        gemm::gemm(
            rows,
            n,
            k,
            y.as_mut_ptr(),
            1,
            stride as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None },
        );
    }
}

/// A dot product in sixteen lanes, which the compiler turns into SIMD.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::tests::random_blocks;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// `x · wᵀ` in f64 from the dequantized values, and the sum of the products' magnitudes.
    fn reference(x: &[f32], rows: usize, w: &[f32], n: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
        let mut exact = vec![0.0; rows * n];
        let mut scale = vec![0.0; rows * n];
        for r in 0..rows {
            for j in 0..n {
                let (xr, wr) = (&x[r * k..][..k], &w[j * k..][..k]);
                exact[r * n + j] = xr.iter().zip(wr).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>() as f32;
                scale[r * n + j] = xr.iter().zip(wr).map(|(a, b)| (a * b).abs()).sum();
            }
        }
        (exact, scale)
    }

    fn check(got: &[f32], exact: &[f32], scale: &[f32], tolerance: f32, what: &str) {
        for (i, ((g, e), s)) in got.iter().zip(exact).zip(scale).enumerate() {
            assert!((g - e).abs() <= tolerance * s, "{what}: value {i}: {g} against {e} (|·| {s})");
        }
    }

    /// A prefill's panels cover the matrix, each into its own columns: three panels of a Q8_0
    /// matrix give the dequantized product; and so do the integer path's three tasks.
    #[test]
    fn a_prefill_over_several_panels_is_the_dequantized_product() {
        let mut rng = StdRng::seed_from_u64(5);
        let (n, k, rows) = (70, 256, 20);
        let bytes = random_blocks(Kind::Q8_0, n * k / 32, &mut rng);
        let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let wf = crate::gguf::dequantize(Kind::Q8_0, &bytes, n * k);
        let (exact, scale) = reference(&x, rows, &wf, n, k);
        // Panels of 32 rows: 32, 32 and 6.
        let got =
            matmul_blocks_in(&x, rows, Kind::Q8_0, &bytes, n, k, Route { integer_rows: 0, panel_bytes: 32 * k * 4 });
        check(&got, &exact, &scale, 1e-5, "three panels");
        // The integer path's tasks (32 weight rows, 32 and 6) each into their own columns.
        let route = Route { integer_rows: usize::MAX, panel_bytes: 0 };
        check(&matmul_blocks_in(&x, rows, Kind::Q8_0, &bytes, n, k, route), &exact, &scale, 0.01, "three tasks");
    }

    /// F16 and BF16 matrices, held in 16 bits, compute as their values do: a decode's rows and
    /// a prefill's panels widened to f32.
    #[test]
    fn a_16_bit_matrix_is_the_product_of_its_values() {
        let mut rng = StdRng::seed_from_u64(17);
        let (n, k) = (70, 96);
        let values: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        for kind in [Kind::F16, Kind::Bf16] {
            let bytes: Vec<u8> = values
                .iter()
                .flat_map(|&v| match kind {
                    Kind::F16 => half::f16::from_f32(v).to_le_bytes(),
                    _ => half::bf16::from_f32(v).to_le_bytes(),
                })
                .collect();
            let m = Matrix { rows: n, cols: k, store: Store::Blocks { kind, bytes } };
            let wf = m.to_f32();
            for rows in [1, 3, 20] {
                let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let (exact, scale) = reference(&x, rows, &wf, n, k);
                check(&matmul(&x, rows, &m), &exact, &scale, 1e-5, &format!("{kind}, {rows} rows"));
            }
        }
    }

    /// Q4_K, Q4_K and Q6_K matrices stacked (a Q4_K_M file's Q, K and V) compute as their
    /// dequantized values do, for a decode batch and a prefill (the integer path for both on
    /// x86; the GEMM's for the prefill in a portable build).
    #[test]
    fn a_stack_of_formats_is_the_dequantized_product() {
        let mut rng = StdRng::seed_from_u64(9);
        let k = 512;
        let parts: Vec<Matrix> = [(Kind::Q4K, 8), (Kind::Q4K, 4), (Kind::Q6K, 4)]
            .iter()
            .map(|&(kind, rows)| Matrix {
                rows,
                cols: k,
                store: Store::Blocks { kind, bytes: random_blocks(kind, rows * k / 256, &mut rng) },
            })
            .collect();
        let m = Matrix::stack(parts);
        assert!(matches!(m.store, Store::Stacked(_)) && m.rows == 16);
        let wf = m.to_f32();
        for rows in [3, 20] {
            let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let (exact, scale) = reference(&x, rows, &wf, m.rows, k);
            let tolerance = if rows <= quant::integer_rows() { 0.01 } else { 1e-5 };
            check(&matmul(&x, rows, &m), &exact, &scale, tolerance, &format!("{rows} rows"));
        }
    }
}
