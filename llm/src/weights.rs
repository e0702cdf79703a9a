//! The decoder's weights from a GGUF file or Hugging Face safetensors, in one layout: matrices
//! `[out, in]` row-major, Q and K rows in Hugging Face's order (rotary embeddings on the two
//! halves of each head), Q/K/V stacked into one matrix and gate/up into another, so that a layer
//! runs four projections instead of seven.
//!
//! A GGUF matrix of a quantized format is kept as its file stores it and computed on so
//! ([`crate::quant`]): a Q4_1 file takes its own size in memory, not eight times it. F16 and BF16
//! matrices (GGUF's or safetensors') stay in 16 bits, widened to f32 a row or a panel at a time as
//! they are multiplied; F32 matrices and every vector are f32. [`Weights::dequantized`] turns
//! every matrix to f32.
//!
//! GGUF's converter permutes the Q and K rows of `llama` models for llama.cpp's rotary layout
//! (adjacent pairs): row `h·d + 2j + t` of the file is row `h·d + t·d/2 + j` of the original.
//! The permutation is undone here (whole rows, so quantized rows move as they are). Qwen2 files
//! are not permuted. Tied models (SmolLM2) have no output matrix: the token embedding serves as
//! both.

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use super::config::{Config, Family};
use super::gguf::{self, Gguf, Kind};

/// `[rows, cols]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub store: Store,
}

/// How a matrix's values are held.
#[derive(Debug, Clone, PartialEq)]
pub enum Store {
    F32(Vec<f32>),
    /// Rows of blocks of a format [`crate::quant`] computes on, as the file stores them; or of
    /// F16 or BF16 values (blocks of one).
    Blocks {
        kind: Kind,
        bytes: Vec<u8>,
    },
    /// Matrices of one width and different formats, their rows one after the other (Q4_K_M
    /// files store V in Q6_K beside Q and K in Q4_K).
    Stacked(Vec<Matrix>),
}

impl Matrix {
    pub fn f32(rows: usize, cols: usize, data: Vec<f32>) -> Matrix {
        debug_assert_eq!(data.len(), rows * cols);
        Matrix { rows, cols, store: Store::F32(data) }
    }

    /// Bytes a row of blocks takes (`kind` computed on: `cols` a whole number of its blocks).
    pub fn row_bytes(kind: Kind, cols: usize) -> usize {
        let (per_block, size) = kind.block().expect("a block format");
        cols / per_block * size
    }

    /// Row `r` as f32, into `out`.
    pub fn row_into(&self, r: usize, out: &mut Vec<f32>) {
        match &self.store {
            Store::F32(data) => out.extend_from_slice(&data[r * self.cols..(r + 1) * self.cols]),
            Store::Blocks { kind, bytes } => {
                let n = Matrix::row_bytes(*kind, self.cols);
                out.extend(gguf::dequantize(*kind, &bytes[r * n..(r + 1) * n], self.cols));
            }
            Store::Stacked(parts) => {
                let mut r = r;
                for p in parts {
                    if r < p.rows {
                        return p.row_into(r, out);
                    }
                    r -= p.rows;
                }
                unreachable!("row past the matrix");
            }
        }
    }

    /// Rows `from..to` as f32, row-major.
    fn rows_f32(&self, from: usize, to: usize) -> Vec<f32> {
        match &self.store {
            Store::F32(data) => data[from * self.cols..to * self.cols].to_vec(),
            Store::Blocks { kind, bytes } => {
                let n = Matrix::row_bytes(*kind, self.cols);
                gguf::dequantize(*kind, &bytes[from * n..to * n], (to - from) * self.cols)
            }
            Store::Stacked(_) => {
                let mut out = Vec::with_capacity((to - from) * self.cols);
                (from..to).for_each(|r| self.row_into(r, &mut out));
                out
            }
        }
    }

    /// Every value as f32, row-major (what the GPU path uploads).
    pub fn to_f32(&self) -> Vec<f32> {
        self.rows_f32(0, self.rows)
    }

    /// The same matrix held in f32.
    pub fn dequantized(self) -> Matrix {
        match self.store {
            Store::F32(_) => self,
            _ => Matrix::f32(self.rows, self.cols, self.to_f32()),
        }
    }

    /// Rows of several matrices of one width, one after the other: one store where they share
    /// a format, [`Store::Stacked`] where they do not.
    pub(crate) fn stack(parts: Vec<Matrix>) -> Matrix {
        let cols = parts[0].cols;
        let rows = parts.iter().map(|p| p.rows).sum();
        debug_assert!(parts.iter().all(|p| p.cols == cols));
        let store = match parts.iter().map(|p| &p.store).collect::<Vec<_>>().as_slice() {
            all if all.iter().all(|s| matches!(s, Store::F32(_))) => {
                let mut data = Vec::with_capacity(rows * cols);
                for p in parts {
                    let Store::F32(d) = p.store else { unreachable!() };
                    data.extend(d);
                }
                Store::F32(data)
            }
            [Store::Blocks { kind, .. }, rest @ ..]
                if rest.iter().all(|s| matches!(s, Store::Blocks { kind: k, .. } if k == kind)) =>
            {
                let kind = *kind;
                let mut bytes = Vec::new();
                for p in parts {
                    let Store::Blocks { bytes: b, .. } = p.store else { unreachable!() };
                    bytes.extend(b);
                }
                Store::Blocks { kind, bytes }
            }
            _ => Store::Stacked(parts),
        };
        Matrix { rows, cols, store }
    }

    /// The values of a vector (a one-row matrix) as f32.
    fn into_vector(self) -> Vec<f32> {
        match self.store {
            Store::F32(data) => data,
            _ => self.to_f32(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    /// Q, K and V rows stacked: `[q_dim + 2·kv_dim, hidden]`.
    pub qkv: Matrix,
    pub qkv_bias: Option<Vec<f32>>,
    pub out: Matrix,
    pub ffn_norm: Vec<f32>,
    /// Gate and up rows stacked: `[2·ffn, hidden]`.
    pub gate_up: Matrix,
    pub down: Matrix,
}

#[derive(Debug, Clone)]
pub struct Weights {
    pub config: Config,
    pub embed: Matrix,
    pub layers: Vec<Layer>,
    pub norm: Vec<f32>,
    /// `None` when tied to the embedding.
    pub output: Option<Matrix>,
}

impl Weights {
    /// The output projection: its own, or the embedding's.
    pub fn lm_head(&self) -> &Matrix {
        self.output.as_ref().unwrap_or(&self.embed)
    }

    /// Every matrix held in f32: the exact path, which the reference tests hold to transformers'
    /// f32 logits.
    pub fn dequantized(self) -> Weights {
        Weights {
            embed: self.embed.dequantized(),
            layers: self
                .layers
                .into_iter()
                .map(|l| Layer {
                    qkv: l.qkv.dequantized(),
                    out: l.out.dequantized(),
                    gate_up: l.gate_up.dequantized(),
                    down: l.down.dequantized(),
                    ..l
                })
                .collect(),
            output: self.output.map(Matrix::dequantized),
            ..self
        }
    }

    pub fn from_gguf(g: &Gguf, config: Config, file: &str) -> Result<Weights, String> {
        let read = |name: &str, rows: usize, cols: usize| -> Result<Matrix, String> {
            let t = g.tensors.get(name).ok_or_else(|| format!("{file}: tensor '{name}' is missing"))?;
            // ggml's dims are innermost first: [cols, rows] (a vector is [cols]).
            let want: Vec<u64> = if rows == 1 { vec![cols as u64] } else { vec![cols as u64, rows as u64] };
            if t.dims != want {
                return Err(format!(
                    "{file}: tensor '{name}' has dims {:?}; the model's metadata implies {want:?}",
                    t.dims
                ));
            }
            let (kind, raw) = g.raw(name).map_err(|e| format!("{file}: {e}"))?;
            if rows > 1 && matches!(kind, Kind::F16 | Kind::Bf16) {
                return Ok(Matrix { rows, cols, store: Store::Blocks { kind, bytes: raw.to_vec() } });
            }
            if rows > 1 && crate::quant::computed(kind) {
                let (per_block, _) = kind.block().expect("a block format");
                if !cols.is_multiple_of(per_block.max(crate::quant::BLOCK)) {
                    return Err(format!(
                        "{file}: tensor '{name}' is {kind} with rows of {cols} values, not a whole number of \
                         {per_block}-value blocks"
                    ));
                }
                return Ok(Matrix { rows, cols, store: Store::Blocks { kind, bytes: raw.to_vec() } });
            }
            Ok(Matrix::f32(rows, cols, g.tensor(name).map_err(|e| format!("{file}: {e}"))?))
        };
        let permuted = config.family == Family::Llama;
        let head_dim = config.head_dim;
        let mut config = config;
        if permuted {
            for extra in ["blk.0.attn_q.bias", "blk.0.attn_output.bias", "blk.0.ffn_up.bias"] {
                if g.tensors.contains_key(extra) {
                    return Err(format!("{file}: tensor '{extra}': the llm engine runs llama without biases"));
                }
            }
        }
        // Llama 3.1's rotary scaling, as llama.cpp's converter writes it: one divisor a frequency.
        if let Some(t) = g.tensors.get("rope_freqs.weight") {
            if t.dims != [head_dim as u64 / 2] {
                return Err(format!(
                    "{file}: tensor 'rope_freqs.weight' has dims {:?}; the head dimension implies [{}]",
                    t.dims,
                    head_dim / 2
                ));
            }
            config.rope_factors = Some(g.tensor("rope_freqs.weight").map_err(|e| format!("{file}: {e}"))?);
        }
        Weights::assemble(config, |tensor, rows, cols| {
            let name = gguf_name(tensor);
            if matches!(tensor, Tensor::Output) && !g.tensors.contains_key(&name) {
                return Ok(None);
            }
            let mut m = read(&name, rows, cols)?;
            if permuted {
                if let Tensor::Q(_) | Tensor::QBias(_) | Tensor::K(_) | Tensor::KBias(_) = tensor {
                    unpermute(&mut m, head_dim);
                }
            }
            Ok(Some(m))
        })
    }

    /// From every `*.safetensors` file in `dir` (sharded checkpoints included).
    pub fn from_hf(dir: &Path, config: Config) -> Result<Weights, String> {
        let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        shards.sort();
        if shards.is_empty() {
            return Err(format!("{}: no *.safetensors file", dir.display()));
        }
        let bytes = shards
            .iter()
            .map(|p| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display())))
            .collect::<Result<Vec<_>, _>>()?;
        let files = bytes
            .iter()
            .zip(&shards)
            .map(|(b, p)| SafeTensors::deserialize(b).map_err(|e| format!("{}: {e}", p.display())))
            .collect::<Result<Vec<_>, _>>()?;
        let find = |name: &str| files.iter().zip(&shards).find_map(|(f, p)| f.tensor(name).ok().map(|t| (t, p)));
        Weights::assemble(config, |tensor, rows, cols| {
            let name = hf_name(tensor);
            let Some((view, path)) = find(&name) else {
                if matches!(tensor, Tensor::Output) {
                    return Ok(None);
                }
                return Err(format!("{}: tensor '{name}' is missing", dir.display()));
            };
            let want: Vec<usize> = if rows == 1 { vec![cols] } else { vec![rows, cols] };
            if view.shape() != want {
                return Err(format!(
                    "{}: tensor '{name}' has shape {:?}; config.json implies {want:?}",
                    path.display(),
                    view.shape()
                ));
            }
            let b = view.data();
            if rows > 1 {
                // A matrix in 16 bits stays so (computed on widened to f32, a row or panel at a time).
                let kind = match view.dtype() {
                    Dtype::F16 => Some(Kind::F16),
                    Dtype::BF16 => Some(Kind::Bf16),
                    _ => None,
                };
                if let Some(kind) = kind {
                    return Ok(Some(Matrix { rows, cols, store: Store::Blocks { kind, bytes: b.to_vec() } }));
                }
            }
            let data = match view.dtype() {
                Dtype::F32 => b.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
                Dtype::F16 => b.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
                Dtype::BF16 => b.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
                other => {
                    return Err(format!(
                        "{}: tensor '{name}' is {other:?}; the llm engine reads F32, F16 and BF16",
                        path.display()
                    ))
                }
            };
            Ok(Some(Matrix::f32(rows, cols, data)))
        })
    }

    /// Reads every tensor through `read(tensor, rows, cols)` (a vector is one row) and stacks
    /// the layer's matrices.
    fn assemble(
        config: Config,
        read: impl Fn(Tensor, usize, usize) -> Result<Option<Matrix>, String>,
    ) -> Result<Weights, String> {
        let c = &config;
        let need = |t: Tensor, rows: usize, cols: usize| -> Result<Matrix, String> {
            Ok(read(t, rows, cols)?.expect("only the output matrix may be absent"))
        };
        let vector = |t: Tensor, len: usize| -> Result<Vec<f32>, String> { Ok(need(t, 1, len)?.into_vector()) };
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let qkv = Matrix::stack(vec![
                need(Tensor::Q(i), c.q_dim(), c.hidden)?,
                need(Tensor::K(i), c.kv_dim(), c.hidden)?,
                need(Tensor::V(i), c.kv_dim(), c.hidden)?,
            ]);
            let qkv_bias = if c.qkv_bias {
                let mut b = vector(Tensor::QBias(i), c.q_dim())?;
                b.extend(vector(Tensor::KBias(i), c.kv_dim())?);
                b.extend(vector(Tensor::VBias(i), c.kv_dim())?);
                Some(b)
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: vector(Tensor::AttnNorm(i), c.hidden)?,
                qkv,
                qkv_bias,
                out: need(Tensor::Out(i), c.hidden, c.q_dim())?,
                ffn_norm: vector(Tensor::FfnNorm(i), c.hidden)?,
                gate_up: Matrix::stack(vec![
                    need(Tensor::Gate(i), c.ffn, c.hidden)?,
                    need(Tensor::Up(i), c.ffn, c.hidden)?,
                ]),
                down: need(Tensor::Down(i), c.hidden, c.ffn)?,
            });
        }
        Ok(Weights {
            embed: need(Tensor::Embed, c.vocab, c.hidden)?,
            norm: vector(Tensor::Norm, c.hidden)?,
            output: read(Tensor::Output, c.vocab, c.hidden)?,
            layers,
            config,
        })
    }
}

/// Undoes GGUF's rotary permutation of a Q or K matrix (or bias, as one row): within each head
/// of `head_dim` rows, file row `2j + t` goes back to row `t·head_dim/2 + j`. Rows move whole, in
/// whatever format they are stored.
pub fn unpermute(m: &mut Matrix, head_dim: usize) {
    fn shuffle<T: Copy + Default>(data: &[T], rows: usize, width: usize, head_dim: usize) -> Vec<T> {
        let half = head_dim / 2;
        let mut out = vec![T::default(); data.len()];
        for head in 0..rows / head_dim {
            for j in 0..half {
                for t in 0..2 {
                    let from = (head * head_dim + 2 * j + t) * width;
                    let to = (head * head_dim + t * half + j) * width;
                    out[to..to + width].copy_from_slice(&data[from..from + width]);
                }
            }
        }
        out
    }
    let cols = m.cols;
    match &mut m.store {
        // A bias is a single row whose elements are the "rows".
        Store::F32(data) if m.rows == 1 => *data = shuffle(data, cols, 1, head_dim),
        Store::F32(data) => *data = shuffle(data, m.rows, cols, head_dim),
        Store::Blocks { kind, bytes } => *bytes = shuffle(bytes, m.rows, Matrix::row_bytes(*kind, cols), head_dim),
        Store::Stacked(_) => unreachable!("a file's tensor is one store"),
    }
}

/// The tensors of the Llama block, by role.
#[derive(Debug, Clone, Copy)]
enum Tensor {
    Embed,
    Norm,
    Output,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    QBias(usize),
    KBias(usize),
    VBias(usize),
    Out(usize),
    FfnNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
}

fn gguf_name(t: Tensor) -> String {
    match t {
        Tensor::Embed => "token_embd.weight".into(),
        Tensor::Norm => "output_norm.weight".into(),
        Tensor::Output => "output.weight".into(),
        Tensor::AttnNorm(i) => format!("blk.{i}.attn_norm.weight"),
        Tensor::Q(i) => format!("blk.{i}.attn_q.weight"),
        Tensor::K(i) => format!("blk.{i}.attn_k.weight"),
        Tensor::V(i) => format!("blk.{i}.attn_v.weight"),
        Tensor::QBias(i) => format!("blk.{i}.attn_q.bias"),
        Tensor::KBias(i) => format!("blk.{i}.attn_k.bias"),
        Tensor::VBias(i) => format!("blk.{i}.attn_v.bias"),
        Tensor::Out(i) => format!("blk.{i}.attn_output.weight"),
        Tensor::FfnNorm(i) => format!("blk.{i}.ffn_norm.weight"),
        Tensor::Gate(i) => format!("blk.{i}.ffn_gate.weight"),
        Tensor::Up(i) => format!("blk.{i}.ffn_up.weight"),
        Tensor::Down(i) => format!("blk.{i}.ffn_down.weight"),
    }
}

fn hf_name(t: Tensor) -> String {
    match t {
        Tensor::Embed => "model.embed_tokens.weight".into(),
        Tensor::Norm => "model.norm.weight".into(),
        Tensor::Output => "lm_head.weight".into(),
        Tensor::AttnNorm(i) => format!("model.layers.{i}.input_layernorm.weight"),
        Tensor::Q(i) => format!("model.layers.{i}.self_attn.q_proj.weight"),
        Tensor::K(i) => format!("model.layers.{i}.self_attn.k_proj.weight"),
        Tensor::V(i) => format!("model.layers.{i}.self_attn.v_proj.weight"),
        Tensor::QBias(i) => format!("model.layers.{i}.self_attn.q_proj.bias"),
        Tensor::KBias(i) => format!("model.layers.{i}.self_attn.k_proj.bias"),
        Tensor::VBias(i) => format!("model.layers.{i}.self_attn.v_proj.bias"),
        Tensor::Out(i) => format!("model.layers.{i}.self_attn.o_proj.weight"),
        Tensor::FfnNorm(i) => format!("model.layers.{i}.post_attention_layernorm.weight"),
        Tensor::Gate(i) => format!("model.layers.{i}.mlp.gate_proj.weight"),
        Tensor::Up(i) => format!("model.layers.{i}.mlp.up_proj.weight"),
        Tensor::Down(i) => format!("model.layers.{i}.mlp.down_proj.weight"),
    }
}
