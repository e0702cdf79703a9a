//! Causal attention on the CPU: every new token's query heads over its sequence's cached keys and
//! values.
//!
//! A task takes a few consecutive tokens of the step and, for each run of them from one sequence
//! and each key-value head, converts the context's keys and values to f32 once for all of them
//! (a prompt's thousand tokens had each converted every key and value row again: half a
//! prefill's time). Scores are computed sixteen keys at a time from keys laid out by dimension,
//! so that the loop over a head's dimensions is one multiply-add a lane with no sum across lanes;
//! values are summed into the output a dimension a lane. Both go a block of sixteen keys at a
//! time over every query of the run, so that the block is read from the L1 cache, not a prompt's
//! whole context from L2 for each query.
//!
//! Each query's scores, softmax and weighted sum take the same operations in the same order
//! whatever the task's other tokens: a sequence's answer does not depend on its step's company,
//! nor on where a prefill's chunks (or a prefix cache's hit) cut its prompt.

use rayon::prelude::*;

use crate::kv::Row;

/// Consecutive tokens one task attends for (a run of one sequence among them shares the
/// conversions).
const TILE: usize = 64;
/// Keys whose scores one pass over a head's dimensions computes (two AVX2 registers).
const KEYS: usize = 16;
/// Most scores a task holds at once (4 MiB): a run of tokens deep in a long context is split.
const SCORES: usize = 1 << 20;

/// A new token: its sequence (an index into the slots) and position.
#[derive(Debug, Clone, Copy)]
pub struct Query {
    pub seq: usize,
    pub position: usize,
}

/// Heads, key-value heads (each shared by `heads / kv_heads` query heads) and their width.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// `out[t]` (`[tokens, heads · head_dim]`) is token `t`'s attention: its query heads, from `qkv`'s
/// rows of `width`, over the keys and values of its sequence's slots up to its position.
#[allow(clippy::too_many_arguments)]
pub fn attend<T: Row>(
    out: &mut [f32],
    qkv: &[f32],
    width: usize,
    queries: &[Query],
    slots: &[Vec<usize>],
    shape: Shape,
    keys: &[T],
    values: &[T],
) {
    // Small steps (decode) in smaller tiles, so that every thread has work.
    let tile = (queries.len() / (4 * rayon::current_num_threads())).clamp(1, TILE);
    attend_in(tile, out, qkv, width, queries, slots, shape, keys, values);
}

/// [`attend`] by tiles of `tile` tokens, each key-value head of a tile its own task (a lone
/// sequence's decode is as many tasks as heads).
#[allow(clippy::too_many_arguments)]
fn attend_in<T: Row>(
    tile: usize,
    out: &mut [f32],
    qkv: &[f32],
    width: usize,
    queries: &[Query],
    slots: &[Vec<usize>],
    shape: Shape,
    keys: &[T],
    values: &[T],
) {
    let (qd, span) = (shape.heads * shape.head_dim, shape.heads / shape.kv_heads * shape.head_dim);
    debug_assert_eq!(out.len(), queries.len() * qd);
    out.par_chunks_mut(tile * qd).enumerate().for_each(|(c, out)| {
        let first = c * tile;
        let task = Task { qkv, width, queries: &queries[first..first + out.len() / qd], first, slots, shape };
        // Each head's `[token][its query heads' span]`, into the tokens' rows.
        let heads: Vec<Vec<f32>> = (0..shape.kv_heads).into_par_iter().map(|kvh| task.run(kvh, keys, values)).collect();
        for (kvh, part) in heads.iter().enumerate() {
            for (row, part) in out.chunks_exact_mut(qd).zip(part.chunks_exact(span)) {
                row[kvh * span..(kvh + 1) * span].copy_from_slice(part);
            }
        }
    });
}

struct Task<'a> {
    qkv: &'a [f32],
    width: usize,
    queries: &'a [Query],
    /// The step's index of `queries[0]`.
    first: usize,
    slots: &'a [Vec<usize>],
    shape: Shape,
}

impl Task<'_> {
    /// Key-value head `kvh`'s query heads for the task's tokens: `[token][group · head_dim]`.
    fn run<T: Row>(&self, kvh: usize, keys: &[T], values: &[T]) -> Vec<f32> {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
            #[allow(unsafe_code)]
            // SAFETY: the CPU has the features the function is compiled with (checked just
            // above).
            return unsafe { self.run_avx512(kvh, keys, values) };
        }
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
            #[allow(unsafe_code)]
            // SAFETY: the CPU has the features the function is compiled with (checked just
            // above).
            return unsafe { self.run_avx2(kvh, keys, values) };
        }
        #[allow(unsafe_code)]
        // SAFETY: without F16C's instruction.
        unsafe {
            self.run_portable::<T, false>(kvh, keys, values)
        }
    }

    /// Sixteen keys or dimensions a register.
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    #[target_feature(enable = "avx512f,avx2,f16c")]
    unsafe fn run_avx512<T: Row>(&self, kvh: usize, keys: &[T], values: &[T]) -> Vec<f32> {
        // SAFETY: compiled with F16C, which the caller found.
        unsafe { self.run_portable::<T, true>(kvh, keys, values) }
    }

    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn run_avx2<T: Row>(&self, kvh: usize, keys: &[T], values: &[T]) -> Vec<f32> {
        // SAFETY: compiled with F16C, which the caller found.
        unsafe { self.run_portable::<T, true>(kvh, keys, values) }
    }

    /// Plain Rust that the compiler vectorizes: separate multiplies and adds (never fused), so
    /// the AVX-512, AVX2 and portable builds compute the same values.
    ///
    /// # Safety
    /// With `F16C`, halves are widened by F16C's instruction: the CPU has it.
    #[allow(unsafe_code)]
    #[inline(always)]
    unsafe fn run_portable<T: Row, const F16C: bool>(&self, kvh: usize, keys: &[T], values: &[T]) -> Vec<f32> {
        let Shape { heads, kv_heads, head_dim: hd } = self.shape;
        let (group, kvd) = (heads / kv_heads, kv_heads * hd);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut result = vec![0.0f32; self.queries.len() * group * hd];
        let (mut kt, mut v, mut row, mut scores) = (Vec::new(), Vec::new(), vec![0.0f32; hd], Vec::new());
        let mut start = 0;
        while start < self.queries.len() {
            // A run of one sequence's tokens (consecutive in the step, positions ascending), at
            // most as many as keep its scores within SCORES.
            let seq = self.queries[start].seq;
            let same = self.queries[start..].iter().take_while(|q| q.seq == seq).count();
            let last = self.queries[start + same - 1].position + 1;
            let most = (SCORES / (group * last.div_ceil(KEYS) * KEYS)).max(1);
            let end = start + same.min(most);
            let run = &self.queries[start..end];
            let n = run.iter().map(|q| q.position + 1).max().unwrap_or(0);
            let padded = n.div_ceil(KEYS) * KEYS;
            let context = &self.slots[seq][..n];
            // Query head `h` of the run is token `h / group`'s head `kvh · group + h % group`.
            let position = |h: usize| run[h / group].position;
            let query = |h: usize| {
                let t = self.first + start + h / group;
                &self.qkv[t * self.width + (kvh * group + h % group) * hd..][..hd]
            };
            // Keys by block of sixteen, then dimension (`kt[(j / 16 · hd + d) · 16 + j % 16]`,
            // zeros past n); values by key.
            kt.clear();
            kt.resize(hd * padded, 0.0);
            v.clear();
            v.resize(n * hd, 0.0);
            for (j, &slot) in context.iter().enumerate() {
                // SAFETY: the caller's (F16C only where the CPU has it).
                unsafe { widen::<T, F16C>(&keys[slot * kvd + kvh * hd..][..hd], &mut row) };
                let block = &mut kt[j / KEYS * hd * KEYS..][..hd * KEYS];
                for (d, k) in row.iter().enumerate() {
                    block[d * KEYS + j % KEYS] = *k;
                }
                // SAFETY: as above.
                unsafe { widen::<T, F16C>(&values[slot * kvd + kvh * hd..][..hd], &mut v[j * hd..(j + 1) * hd]) };
            }
            // Scores `[query head][key]`: a block of sixteen keys at a time for every query
            // head that sees any of them, four heads together (the block, 4 KiB, read from
            // the L1 cache).
            let count = run.len() * group;
            scores.clear();
            scores.resize(count * padded, 0.0);
            for j0 in (0..n).step_by(KEYS) {
                let block = &kt[j0 * hd..][..hd * KEYS];
                let mut h = run.partition_point(|q| q.position < j0) * group;
                while h < count {
                    let q = (count - h).min(4);
                    let qs: [&[f32]; 4] = std::array::from_fn(|i| query(h + i.min(q - 1)));
                    let got = match q {
                        4 => score_block::<4>(&qs, block, hd),
                        3 => pad(score_block::<3>(&qs, block, hd)),
                        2 => pad(score_block::<2>(&qs, block, hd)),
                        _ => pad(score_block::<1>(&qs, block, hd)),
                    };
                    for (i, s) in got.iter().take(q).enumerate() {
                        scores[(h + i) * padded + j0..][..KEYS].copy_from_slice(s);
                    }
                    h += q;
                }
            }
            for h in 0..count {
                let p = &mut scores[h * padded..][..position(h) + 1];
                p.iter_mut().for_each(|s| *s *= scale);
                softmax(p);
            }
            // The weighted values into the run's rows of the result (`[query head][hd]`), a
            // block of sixteen values at a time: four heads together over a block they see
            // whole, one at a time over their last.
            let sums = &mut result[start * group * hd..end * group * hd];
            for j0 in (0..n).step_by(KEYS) {
                let block = &v[j0 * hd..(j0 + KEYS).min(n) * hd];
                let first = run.partition_point(|q| q.position < j0) * group;
                let whole = run.partition_point(|q| q.position + 1 < j0 + KEYS) * group;
                for h in first..whole.max(first) {
                    let m = position(h) + 1 - j0;
                    weigh_block::<1>([&scores[h * padded + j0..][..m]], block, hd, &mut sums[h * hd..][..hd]);
                }
                let mut h = whole.max(first);
                while h < count {
                    let q = (count - h).min(4);
                    let ps: [&[f32]; 4] = std::array::from_fn(|i| &scores[(h + i.min(q - 1)) * padded + j0..][..KEYS]);
                    let outs = &mut sums[h * hd..(h + q) * hd];
                    match q {
                        4 => weigh_block::<4>(ps, block, hd, outs),
                        3 => weigh_block::<3>([ps[0], ps[1], ps[2]], block, hd, outs),
                        2 => weigh_block::<2>([ps[0], ps[1]], block, hd, outs),
                        _ => weigh_block::<1>([ps[0]], block, hd, outs),
                    }
                    h += q;
                }
            }
            start = end;
        }
        result
    }
}

/// `x` to its softmax: `e^(x − max)` by [`exp`], summed in sixteen lanes (a fixed order for a
/// given length, and no chain of dependent adds), each divided by the sum.
#[inline(always)]
fn softmax(x: &mut [f32]) {
    let mut lanes = [f32::NEG_INFINITY; KEYS];
    let chunks = x.chunks_exact(KEYS);
    let rest = chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for l in 0..KEYS {
            lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
        }
    }
    let max = lanes.iter().copied().fold(rest, f32::max);
    x.iter_mut().for_each(|v| *v = exp(*v - max));
    let mut lanes = [0.0f32; KEYS];
    let chunks = x.chunks_exact(KEYS);
    let rest: f32 = chunks.remainder().iter().fold(0.0, |s, v| s + v);
    for c in chunks {
        for l in 0..KEYS {
            lanes[l] += c[l];
        }
    }
    let sum = lanes.iter().fold(rest, |s, v| s + v);
    x.iter_mut().for_each(|v| *v /= sum);
}

/// `e^x` for `x ≤ 0` (a softmax's exponents; below −87, `e^−87`), within 2 ulp: `2^n · e^r` with
/// `n` the nearest integer to `x / ln 2`, `r` what remains (Cody and Waite's two-part ln 2), and
/// `e^r` by Cephes's polynomial for `expf`. Written out because libm's `expf`, called a score at a
/// time, was a third of a prefill's attention; in plain operations the loop vectorizes.
#[inline(always)]
fn exp(x: f32) -> f32 {
    // 1.5 · 2²³: added and taken away, rounds to an integer, which its low bits then hold.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 0.0);
    let t = x * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 0.166_666_65) * r
        + 0.5;
    let e = p * r * r + r + 1.0;
    let n = t.to_bits() as i32 - ROUND.to_bits() as i32;
    e * f32::from_bits(((n + 127) << 23) as u32)
}

/// A key or value row into f32: with `F16C`, halves eight at a time by `vcvtph2ps` (the `half`
/// crate's conversion, called a row at a time, took as long as the scores).
///
/// # Safety
/// With `F16C`, the CPU has F16C (and this is inlined into a function compiled with it).
#[allow(unsafe_code)]
#[inline(always)]
unsafe fn widen<T: Row, const F16C: bool>(row: &[T], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let (true, Some(h)) = (F16C, T::halves(row)) {
        use std::arch::x86_64::{_mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
        let (lanes, rest) = (h.chunks_exact(8), out.chunks_exact_mut(8));
        for (h, o) in lanes.clone().zip(rest) {
            // SAFETY: the caller's: the CPU has F16C; eight halves are read and eight floats
            // written, within `h` and `o`.
            unsafe {
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast())));
            }
        }
        let done = h.len() - lanes.remainder().len();
        for (o, h) in out[done..].iter_mut().zip(lanes.remainder()) {
            *o = h.to_f32();
        }
        return;
    }
    T::read(row, out);
}

/// Scores of `Q` queries (the first `Q` of `qs`) against a block of [`KEYS`] keys laid out by
/// dimension (`block[d · 16 + l]`): one multiply and add a lane per dimension, in the dimensions'
/// order, each key's load shared by the `Q` queries.
#[inline(always)]
fn score_block<const Q: usize>(qs: &[&[f32]; 4], block: &[f32], hd: usize) -> [[f32; KEYS]; Q] {
    let mut acc = [[0.0f32; KEYS]; Q];
    for d in 0..hd {
        let k: &[f32; KEYS] = block[d * KEYS..][..KEYS].try_into().expect("KEYS keys");
        for (a, q) in acc.iter_mut().zip(qs) {
            let x = q[d];
            for l in 0..KEYS {
                a[l] += x * k[l];
            }
        }
    }
    acc
}

fn pad<const Q: usize>(s: [[f32; KEYS]; Q]) -> [[f32; KEYS]; 4] {
    std::array::from_fn(|i| if i < Q { s[i] } else { [0.0; KEYS] })
}

/// `outs[i] += Σ_j ps[i][j] · v_j` for the block's keys in order (`outs` the `Q` sums, `hd`
/// each; every `ps[i]` as long as the block): a dimension a lane, sixteen dimensions at a time
/// held in registers, each value's load shared by the `Q` sums. Each lane's sum is taken in the
/// keys' order however they are split into blocks.
#[inline(always)]
fn weigh_block<const Q: usize>(ps: [&[f32]; Q], block: &[f32], hd: usize, outs: &mut [f32]) {
    let m = ps[0].len();
    debug_assert!(ps.iter().all(|p| p.len() == m) && block.len() >= m * hd && outs.len() == Q * hd);
    let mut c = 0;
    while c + KEYS <= hd {
        let mut acc: [[f32; KEYS]; Q] =
            std::array::from_fn(|i| outs[i * hd + c..][..KEYS].try_into().expect("KEYS sums"));
        for j in 0..m {
            let v: &[f32; KEYS] = block[j * hd + c..][..KEYS].try_into().expect("KEYS values");
            for (a, p) in acc.iter_mut().zip(&ps) {
                let x = p[j];
                for l in 0..KEYS {
                    a[l] += x * v[l];
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            outs[i * hd + c..][..KEYS].copy_from_slice(a);
        }
        c += KEYS;
    }
    // A head width that is not a multiple of sixteen: its last dimensions.
    for (i, p) in ps.iter().enumerate() {
        for (j, x) in p.iter().enumerate() {
            for (o, v) in outs[i * hd + c..(i + 1) * hd].iter_mut().zip(&block[j * hd + c..(j + 1) * hd]) {
                *o += x * v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The vectorized exponential against f64's, over a softmax's range.
    #[test]
    fn exp_is_within_two_ulp() {
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let (got, want) = (f64::from(exp(x)), f64::from(x).exp());
            assert!((got - want).abs() <= 2.0 * f64::from(f32::EPSILON) * want, "e^{x}: {got} against {want}");
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-1000.0), exp(-87.0));
    }

    /// Two sequences' queries in one step (a prefill of 37 tokens after 5 cached, and one
    /// decode token at position 20), against attention computed plainly in f64; each token's
    /// result the same to the bit when it is attended alone and whatever the tiles (1, 3, 16 and
    /// 64 tokens: runs cut anywhere, one sequence's and two's), and with f16 keys and values as
    /// with their f32 values.
    #[test]
    fn every_token_attends_its_own_context_whatever_its_company() {
        let mut rng = StdRng::seed_from_u64(4);
        let shape = Shape { heads: 6, kv_heads: 2, head_dim: 40 };
        let (hd, kvd, qd) = (shape.head_dim, shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim);
        let width = qd + 2 * kvd;
        // Slots: sequence 0 at 0..42, sequence 1 at 100..121 (its own, scattered by the cache).
        let slots = vec![(0..42).collect::<Vec<_>>(), (0..21).map(|j| 100 + (5 * j) % 21).collect()];
        let cache: Vec<f32> = (0..121 * kvd).map(|_| rng.random_range(-1.0..1.0)).collect();
        let (keys, values): (Vec<f16>, Vec<f16>) = (
            cache.iter().map(|v| f16::from_f32(*v)).collect(),
            cache.iter().map(|v| f16::from_f32(v * 0.5 - 0.1)).collect(),
        );
        let mut queries: Vec<Query> = (5..42).map(|p| Query { seq: 0, position: p }).collect();
        queries.push(Query { seq: 1, position: 20 });
        let t = queries.len();
        let qkv: Vec<f32> = (0..t * width).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut out = vec![0.0; t * qd];
        attend(&mut out, &qkv, width, &queries, &slots, shape, &keys, &values);
        for tile in [1, 3, 16, 64] {
            let mut tiled = vec![0.0; t * qd];
            attend_in(tile, &mut tiled, &qkv, width, &queries, &slots, shape, &keys, &values);
            assert_eq!(tiled, out, "tiles of {tile}");
        }

        let (kf, vf): (Vec<f32>, Vec<f32>) =
            (keys.iter().map(|v| v.to_f32()).collect(), values.iter().map(|v| v.to_f32()).collect());
        let mut from_f32 = vec![0.0; t * qd];
        attend(&mut from_f32, &qkv, width, &queries, &slots, shape, &kf, &vf);
        assert_eq!(out, from_f32, "f16 keys and values read as their f32 values");

        for (i, query) in queries.iter().enumerate() {
            for head in 0..shape.heads {
                let kvh = head / (shape.heads / shape.kv_heads);
                let q = &qkv[i * width + head * hd..][..hd];
                let context = &slots[query.seq][..=query.position];
                let scores: Vec<f64> = context
                    .iter()
                    .map(|&s| {
                        let k = &kf[s * kvd + kvh * hd..][..hd];
                        q.iter().zip(k).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..hd {
                    let want: f64 =
                        context.iter().zip(&e).map(|(&s, e)| e / sum * f64::from(vf[s * kvd + kvh * hd + d])).sum();
                    let got = out[i * qd + head * hd + d];
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-5,
                        "token {i}, head {head}, dim {d}: {got} against {want}"
                    );
                }
            }
            // Alone: the same bits.
            let mut alone = vec![0.0; qd];
            let row = &qkv[i * width..(i + 1) * width];
            attend(&mut alone, row, width, &[*query], &slots, shape, &keys, &values);
            assert_eq!(alone, out[i * qd..(i + 1) * qd], "token {i} alone");
        }
    }
}
