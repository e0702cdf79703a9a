//! The forward pass of a step written once as device operations — cuBLAS-style projections and
//! the kernels of `kernels.cu` — and run by any [`Ops`]: the GPU's (cudarc, `gpu.rs`, feature
//! `cuda`) and the host's ([`crate::host`]), which emulates the same operations element for
//! element so that the GPU's algorithm (its index arithmetic, its paged attention, the buffers'
//! flow) is tested on machines without a GPU, against the CPU path ([`crate::cpu`]).
//!
//! Layout: row-major throughout; `t` new tokens packed over the step's sequences; the KV cache
//! is one buffer of keys and one of values, `[layer][slot][kv_dim]`; each token's context is a
//! run of slots in one flat list (a sequence's slots for positions `0..=p`, shared by its
//! tokens), so attention reads the scheduler's blocks directly.

use crate::config::Config;
use crate::weights::Weights;
use crate::Seq;

/// The sizes the kernels index by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// New tokens in the step.
    pub t: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    /// Slots of the whole cache (every layer has this many).
    pub slots: usize,
}

impl Dims {
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Width of a row of the stacked Q/K/V projection.
    pub fn qkv_width(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }

    /// Offset of a layer's part of a cache buffer.
    pub fn layer_offset(&self, layer: usize) -> usize {
        layer * self.slots * self.kv_dim()
    }
}

/// Where each new token is: its position, its cache slot, and its context (a run of
/// `position + 1` slots starting at `context_start` in the flat context list).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepIndex {
    pub ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    pub context_start: Vec<u32>,
    pub context: Vec<u32>,
    /// Token rows after which a sequence samples.
    pub sample_rows: Vec<u32>,
    /// The longest context in the step.
    pub longest: usize,
}

impl StepIndex {
    /// The index of a step, checked against the vocabulary, the context and the cache: a bad
    /// step is refused before anything is written.
    pub fn of(
        seqs: &[Seq<'_>],
        config: &Config,
        positions: usize,
        block_size: usize,
        blocks: usize,
    ) -> Result<StepIndex, String> {
        let slot = |table: &[u32], p: usize| -> Result<u32, String> {
            let block = *table.get(p / block_size).ok_or_else(|| {
                format!("position {p} is beyond the block table ({} blocks of {block_size})", table.len())
            })? as usize;
            if block >= blocks {
                return Err(format!("block {block} is not in the cache ({blocks} blocks)"));
            }
            Ok((block * block_size + p % block_size) as u32)
        };
        let mut ix = StepIndex {
            ids: Vec::new(),
            positions: Vec::new(),
            slots: Vec::new(),
            context_start: Vec::new(),
            context: Vec::new(),
            sample_rows: Vec::new(),
            longest: 0,
        };
        for (s, seq) in seqs.iter().enumerate() {
            if seq.sample.is_some() && seq.tokens.is_empty() {
                return Err(format!("sequence {s} of the step samples after no new token"));
            }
            let start = ix.context.len() as u32;
            let end = seq.start as usize + seq.tokens.len();
            if end > positions {
                return Err(format!("position {} is past the model's context ({positions})", end - 1));
            }
            for p in 0..end {
                ix.context.push(slot(seq.blocks, p)?);
            }
            for (k, &id) in seq.tokens.iter().enumerate() {
                if id as usize >= config.vocab {
                    return Err(format!("token {id} is outside the vocabulary ({} tokens)", config.vocab));
                }
                let p = seq.start as usize + k;
                ix.ids.push(id);
                ix.positions.push(p as u32);
                ix.slots.push(ix.context[start as usize + p]);
                ix.context_start.push(start);
            }
            ix.longest = ix.longest.max(end);
            if seq.sample.is_some() {
                ix.sample_rows.push((ix.ids.len() - 1) as u32);
            }
        }
        Ok(ix)
    }
}

/// The weights on a device, in [`Weights`]' layout.
#[derive(Debug)]
pub struct DeviceWeights<F> {
    pub embed: F,
    pub layers: Vec<DeviceLayer<F>>,
    pub norm: F,
    /// `None` when tied to the embedding.
    pub output: Option<F>,
}

#[derive(Debug)]
pub struct DeviceLayer<F> {
    pub attn_norm: F,
    pub qkv: F,
    pub qkv_bias: Option<F>,
    pub out: F,
    pub ffn_norm: F,
    pub gate_up: F,
    pub down: F,
}

impl<F> DeviceWeights<F> {
    pub fn upload<O: Ops<F = F>>(ops: &O, w: &Weights) -> Result<DeviceWeights<F>, String> {
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            layers.push(DeviceLayer {
                attn_norm: ops.upload(&l.attn_norm)?,
                qkv: ops.upload(&l.qkv.to_f32())?,
                qkv_bias: l.qkv_bias.as_deref().map(|b| ops.upload(b)).transpose()?,
                out: ops.upload(&l.out.to_f32())?,
                ffn_norm: ops.upload(&l.ffn_norm)?,
                gate_up: ops.upload(&l.gate_up.to_f32())?,
                down: ops.upload(&l.down.to_f32())?,
            });
        }
        Ok(DeviceWeights {
            embed: ops.upload(&w.embed.to_f32())?,
            layers,
            norm: ops.upload(&w.norm)?,
            output: w.output.as_ref().map(|o| ops.upload(&o.to_f32())).transpose()?,
        })
    }
}

/// The KV cache and the rotary tables on a device.
#[derive(Debug)]
pub struct DeviceCache<F> {
    pub keys: F,
    pub values: F,
    /// `[position][head_dim / 2]`.
    pub cos: F,
    pub sin: F,
}

/// The operations of the forward pass. Buffers are device memory (or host vectors).
pub trait Ops {
    type F;
    type U;
    fn upload(&self, host: &[f32]) -> Result<Self::F, String>;
    fn upload_u32(&self, host: &[u32]) -> Result<Self::U, String>;
    fn zeros(&self, n: usize) -> Result<Self::F, String>;
    fn download(&self, buf: &Self::F) -> Result<Vec<f32>, String>;
    /// `y[rows, n] = x[rows, k] · w[n, k]ᵀ` (cuBLAS: `yᵀ = w · xᵀ` in column-major terms).
    #[allow(clippy::too_many_arguments)]
    fn linear(&self, x: &Self::F, rows: usize, w: &Self::F, n: usize, k: usize, y: &mut Self::F) -> Result<(), String>;
    /// `out[i] = table[ids[i]]`, rows of `width`.
    fn gather(&self, ids: &Self::U, n: usize, table: &Self::F, width: usize, out: &mut Self::F) -> Result<(), String>;
    /// `out = x / rms(x) × weight`, per row of `width`.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm(
        &self,
        x: &Self::F,
        weight: &Self::F,
        rows: usize,
        width: usize,
        eps: f32,
        out: &mut Self::F,
    ) -> Result<(), String>;
    /// Per token: adds the Q/K/V bias (if any), rotates its Q and K heads for its position, and
    /// writes its K and V into the cache at its slot, in `layer`'s part.
    #[allow(clippy::too_many_arguments)]
    fn rope_store(
        &self,
        qkv: &mut Self::F,
        bias: Option<&Self::F>,
        ix: &DeviceIndex<Self::U>,
        cache: &mut DeviceCache<Self::F>,
        layer: usize,
        dims: Dims,
    ) -> Result<(), String>;
    /// Per token and head: softmax(q · kᵀ / √d) · v over the token's context slots.
    fn attention(
        &self,
        qkv: &Self::F,
        ix: &DeviceIndex<Self::U>,
        cache: &DeviceCache<Self::F>,
        layer: usize,
        dims: Dims,
        out: &mut Self::F,
    ) -> Result<(), String>;
    /// `out[r, f] = silu(gu[r, f]) × gu[r, ffn + f]`.
    fn silu_mul(&self, gate_up: &Self::F, rows: usize, ffn: usize, out: &mut Self::F) -> Result<(), String>;
    /// `x += y` over `n` elements.
    fn add(&self, x: &mut Self::F, y: &Self::F, n: usize) -> Result<(), String>;
}

/// A step's index on the device.
#[derive(Debug)]
pub struct DeviceIndex<U> {
    pub ids: U,
    pub positions: U,
    pub slots: U,
    pub context_start: U,
    pub context: U,
    pub sample_rows: U,
    pub t: usize,
    pub samples: usize,
    pub longest: usize,
}

impl<U> DeviceIndex<U> {
    pub fn upload<O: Ops<U = U>>(ops: &O, ix: &StepIndex) -> Result<DeviceIndex<U>, String> {
        Ok(DeviceIndex {
            ids: ops.upload_u32(&ix.ids)?,
            positions: ops.upload_u32(&ix.positions)?,
            slots: ops.upload_u32(&ix.slots)?,
            context_start: ops.upload_u32(&ix.context_start)?,
            // A buffer is never empty (cudarc allocates none of 0 elements).
            context: ops.upload_u32(if ix.context.is_empty() { &[0] } else { &ix.context })?,
            sample_rows: ops.upload_u32(if ix.sample_rows.is_empty() { &[0] } else { &ix.sample_rows })?,
            t: ix.ids.len(),
            samples: ix.sample_rows.len(),
            longest: ix.longest,
        })
    }
}

/// Runs one step on the device: writes the new tokens' keys and values into the cache and
/// returns the logits after each sampling sequence's last new token (`[samples][vocab]`).
pub fn forward<O: Ops>(
    ops: &O,
    w: &DeviceWeights<O::F>,
    config: &Config,
    cache: &mut DeviceCache<O::F>,
    ix: &StepIndex,
    slots: usize,
) -> Result<Vec<Vec<f32>>, String> {
    let t = ix.ids.len();
    if t == 0 {
        return Ok(Vec::new());
    }
    let dims = Dims {
        t,
        hidden: config.hidden,
        heads: config.heads,
        kv_heads: config.kv_heads,
        head_dim: config.head_dim,
        ffn: config.ffn,
        slots,
    };
    let (h, qd, width, f) = (dims.hidden, dims.q_dim(), dims.qkv_width(), dims.ffn);
    let dix = DeviceIndex::upload(ops, ix)?;
    let mut x = ops.zeros(t * h)?;
    ops.gather(&dix.ids, t, &w.embed, h, &mut x)?;
    let mut normed = ops.zeros(t * h)?;
    let mut qkv = ops.zeros(t * width)?;
    let mut attended = ops.zeros(t * qd)?;
    let mut projected = ops.zeros(t * h)?;
    let mut gate_up = ops.zeros(t * 2 * f)?;
    let mut act = ops.zeros(t * f)?;
    for (l, layer) in w.layers.iter().enumerate() {
        ops.rms_norm(&x, &layer.attn_norm, t, h, config.rms_eps, &mut normed)?;
        ops.linear(&normed, t, &layer.qkv, width, h, &mut qkv)?;
        ops.rope_store(&mut qkv, layer.qkv_bias.as_ref(), &dix, cache, l, dims)?;
        ops.attention(&qkv, &dix, cache, l, dims, &mut attended)?;
        ops.linear(&attended, t, &layer.out, h, qd, &mut projected)?;
        ops.add(&mut x, &projected, t * h)?;
        ops.rms_norm(&x, &layer.ffn_norm, t, h, config.rms_eps, &mut normed)?;
        ops.linear(&normed, t, &layer.gate_up, 2 * f, h, &mut gate_up)?;
        ops.silu_mul(&gate_up, t, f, &mut act)?;
        ops.linear(&act, t, &layer.down, h, f, &mut projected)?;
        ops.add(&mut x, &projected, t * h)?;
    }
    let s = dix.samples;
    if s == 0 {
        return Ok(Vec::new());
    }
    let mut last = ops.zeros(s * h)?;
    ops.gather(&dix.sample_rows, s, &x, h, &mut last)?;
    let mut last_normed = ops.zeros(s * h)?;
    ops.rms_norm(&last, &w.norm, s, h, config.rms_eps, &mut last_normed)?;
    let mut logits = ops.zeros(s * config.vocab)?;
    ops.linear(&last_normed, s, w.output.as_ref().unwrap_or(&w.embed), config.vocab, h, &mut logits)?;
    Ok(ops.download(&logits)?.chunks_exact(config.vocab).map(<[f32]>::to_vec).collect())
}

/// The rotary tables, `[position][head_dim / 2]`: cos and sin of `position × θ^(−2i/d)`, each
/// frequency divided by its factor when the model scales them (Llama 3.1).
pub fn rope_tables(config: &Config, positions: usize) -> (Vec<f32>, Vec<f32>) {
    let (head_dim, theta) = (config.head_dim, config.rope_theta);
    let half = head_dim / 2;
    let factor = |i: usize| config.rope_factors.as_ref().map_or(1.0, |f| f64::from(f[i]));
    let (mut cos, mut sin) = (Vec::with_capacity(positions * half), Vec::with_capacity(positions * half));
    for p in 0..positions {
        for i in 0..half {
            let inv = (theta as f64).powf(-((2 * i) as f64) / head_dim as f64) / factor(i);
            let (s, c) = (p as f64 * inv).sin_cos();
            cos.push(c as f32);
            sin.push(s as f32);
        }
    }
    (cos, sin)
}
