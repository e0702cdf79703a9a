//! The model directory in the sentence-transformers layout (`all-MiniLM-L6-v2`'s): the BERT
//! `config.json`, `sentence_bert_config.json` (longest input), `1_Pooling/config.json` (how token
//! vectors become one), `modules.json` (whether a `Normalize` step follows), and
//! `model.safetensors`.

use std::path::Path;

use ndarray::{Array1, Array2};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use super::LoadError;

/// How token vectors become one sentence vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over the sentence's real tokens (padding excluded).
    Mean,
    /// The first token's (`[CLS]`).
    Cls,
}

/// The shape and settings of the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub hidden: usize,
    pub heads: usize,
    pub layers: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub max_positions: usize,
    pub type_vocab: usize,
    pub layer_norm_eps: f32,
    pub pooling: Pooling,
    /// Whether embeddings are scaled to unit length.
    pub normalize: bool,
    /// Longest input in tokens, `[CLS]` and `[SEP]` included.
    pub max_tokens: usize,
}

#[derive(Deserialize)]
struct BertConfig {
    hidden_size: usize,
    num_attention_heads: usize,
    num_hidden_layers: usize,
    intermediate_size: usize,
    vocab_size: usize,
    max_position_embeddings: usize,
    #[serde(default = "two")]
    type_vocab_size: usize,
    #[serde(default = "eps")]
    layer_norm_eps: f64,
    #[serde(default = "gelu")]
    hidden_act: String,
    #[serde(default = "absolute")]
    position_embedding_type: String,
}

fn two() -> usize {
    2
}
fn eps() -> f64 {
    1e-12
}
fn gelu() -> String {
    "gelu".into()
}
fn absolute() -> String {
    "absolute".into()
}

#[derive(Deserialize)]
struct SentenceConfig {
    max_seq_length: Option<usize>,
}

#[derive(Deserialize)]
struct PoolingConfig {
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
}

#[derive(Deserialize)]
struct Module {
    #[serde(rename = "type")]
    kind: String,
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, LoadError> {
    let file_error = |message: String| LoadError::File { path: path.display().to_string(), message };
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| file_error(e.to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(file_error(e.to_string())),
    }
}

impl Config {
    pub fn load(dir: &Path) -> Result<Config, LoadError> {
        let path = dir.join("config.json");
        let bert: BertConfig = read_json(&path)?.ok_or_else(|| LoadError::File {
            path: path.display().to_string(),
            message: "not found; the model directory needs a BERT config.json".into(),
        })?;
        let unsupported = |field: &str, value: &str, supported: &str| {
            Err(LoadError::Model(format!("{}: {field} is '{value}'; this engine supports {supported}", path.display())))
        };
        if bert.hidden_act != "gelu" {
            return unsupported("hidden_act", &bert.hidden_act, "'gelu'");
        }
        if bert.position_embedding_type != "absolute" {
            return unsupported("position_embedding_type", &bert.position_embedding_type, "'absolute'");
        }
        if bert.num_attention_heads == 0 || !bert.hidden_size.is_multiple_of(bert.num_attention_heads) {
            return Err(LoadError::Model(format!(
                "{}: hidden_size {} is not a multiple of num_attention_heads {}",
                path.display(),
                bert.hidden_size,
                bert.num_attention_heads
            )));
        }

        let pooling_path = dir.join("1_Pooling/config.json");
        let pooling = match read_json::<PoolingConfig>(&pooling_path)? {
            None => Pooling::Mean,
            Some(p) if p.pooling_mode_max_tokens || p.pooling_mode_mean_sqrt_len_tokens => {
                return Err(LoadError::Model(format!(
                    "{}: max and mean-sqrt-len pooling are not supported; this engine pools by mean or [CLS]",
                    pooling_path.display()
                )))
            }
            Some(p) if p.pooling_mode_cls_token && !p.pooling_mode_mean_tokens => Pooling::Cls,
            Some(_) => Pooling::Mean,
        };
        let modules: Option<Vec<Module>> = read_json(&dir.join("modules.json"))?;
        // Without modules.json the directory is a bare BERT; sentence embeddings are compared by
        // cosine, so unit length is the useful default.
        let normalize = modules.is_none_or(|m| m.iter().any(|m| m.kind.ends_with(".Normalize")));
        let sentence: Option<SentenceConfig> = read_json(&dir.join("sentence_bert_config.json"))?;
        let max_tokens = sentence
            .and_then(|s| s.max_seq_length)
            .unwrap_or(bert.max_position_embeddings)
            .min(bert.max_position_embeddings);

        Ok(Config {
            hidden: bert.hidden_size,
            heads: bert.num_attention_heads,
            layers: bert.num_hidden_layers,
            intermediate: bert.intermediate_size,
            vocab: bert.vocab_size,
            max_positions: bert.max_position_embeddings,
            type_vocab: bert.type_vocab_size,
            layer_norm_eps: bert.layer_norm_eps as f32,
            pooling,
            normalize,
            max_tokens,
        })
    }
}

/// A layer norm's scale and shift.
#[derive(Debug, Clone)]
pub struct Norm {
    pub gamma: Array1<f32>,
    pub beta: Array1<f32>,
}

/// A dense layer, `y = x · weightᵀ + bias`, with `weight` as `[out, in]` (PyTorch's layout).
#[derive(Debug, Clone)]
pub struct Dense {
    pub weight: Array2<f32>,
    pub bias: Array1<f32>,
}

/// One encoder layer.
#[derive(Debug, Clone)]
pub struct Layer {
    /// Query, key and value stacked into one `[3·hidden, hidden]` projection: one GEMM, not three.
    pub qkv: Dense,
    pub attention_out: Dense,
    pub attention_norm: Norm,
    pub intermediate: Dense,
    pub output: Dense,
    pub output_norm: Norm,
}

/// All weights, as f32 on the host.
#[derive(Debug, Clone)]
pub struct Weights {
    pub config: Config,
    pub word: Array2<f32>,
    pub position: Array2<f32>,
    pub token_type: Array2<f32>,
    pub embedding_norm: Norm,
    pub layers: Vec<Layer>,
}

impl Weights {
    pub fn load(dir: &Path, config: &Config) -> Result<Weights, LoadError> {
        let path = dir.join("model.safetensors");
        let file_error = |message: String| LoadError::File { path: path.display().to_string(), message };
        let bytes = std::fs::read(&path).map_err(|e| file_error(e.to_string()))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| file_error(e.to_string()))?;
        let r = Reader { st: &st, path: &path };
        let h = config.hidden;
        let norm = |prefix: &str| -> Result<Norm, LoadError> {
            Ok(Norm { gamma: r.vector(&format!("{prefix}.weight"), h)?, beta: r.vector(&format!("{prefix}.bias"), h)? })
        };
        let dense = |prefix: &str, out: usize, inp: usize| -> Result<Dense, LoadError> {
            Ok(Dense {
                weight: r.matrix(&format!("{prefix}.weight"), out, inp)?,
                bias: r.vector(&format!("{prefix}.bias"), out)?,
            })
        };
        let mut layers = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let p = format!("encoder.layer.{i}");
            let (q, k, v) = (
                dense(&format!("{p}.attention.self.query"), h, h)?,
                dense(&format!("{p}.attention.self.key"), h, h)?,
                dense(&format!("{p}.attention.self.value"), h, h)?,
            );
            let weight = ndarray::concatenate(ndarray::Axis(0), &[q.weight.view(), k.weight.view(), v.weight.view()])
                .expect("same widths");
            let bias =
                ndarray::concatenate(ndarray::Axis(0), &[q.bias.view(), k.bias.view(), v.bias.view()]).expect("1-d");
            layers.push(Layer {
                qkv: Dense { weight, bias },
                attention_out: dense(&format!("{p}.attention.output.dense"), h, h)?,
                attention_norm: norm(&format!("{p}.attention.output.LayerNorm"))?,
                intermediate: dense(&format!("{p}.intermediate.dense"), config.intermediate, h)?,
                output: dense(&format!("{p}.output.dense"), h, config.intermediate)?,
                output_norm: norm(&format!("{p}.output.LayerNorm"))?,
            });
        }
        Ok(Weights {
            config: config.clone(),
            word: r.matrix("embeddings.word_embeddings.weight", config.vocab, h)?,
            position: r.matrix("embeddings.position_embeddings.weight", config.max_positions, h)?,
            token_type: r.matrix("embeddings.token_type_embeddings.weight", config.type_vocab, h)?,
            embedding_norm: norm("embeddings.LayerNorm")?,
            layers,
        })
    }
}

/// Reads named tensors as f32, whatever their stored float type, with or without the `bert.`
/// prefix that `BertForX` checkpoints put on the encoder's names.
struct Reader<'a> {
    st: &'a SafeTensors<'a>,
    path: &'a Path,
}

impl Reader<'_> {
    fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let error = |message: String| LoadError::File { path: self.path.display().to_string(), message };
        let view = self
            .st
            .tensor(name)
            .or_else(|_| self.st.tensor(&format!("bert.{name}")))
            .map_err(|_| error(format!("tensor '{name}' is missing")))?;
        if view.shape() != shape {
            return Err(error(format!("tensor '{name}' has shape {:?}; config.json implies {shape:?}", view.shape())));
        }
        let data = view.data();
        Ok(match view.dtype() {
            Dtype::F32 => data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::F16 => data.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Dtype::BF16 => data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => return Err(error(format!("tensor '{name}' is {other:?}; this engine reads F32, F16 and BF16"))),
        })
    }

    fn vector(&self, name: &str, len: usize) -> Result<Array1<f32>, LoadError> {
        Ok(Array1::from_vec(self.floats(name, &[len])?))
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Array2<f32>, LoadError> {
        let data = self.floats(name, &[rows, cols])?;
        Ok(Array2::from_shape_vec((rows, cols), data).expect("length checked against the shape"))
    }
}
