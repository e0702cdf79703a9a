//! The decoder's shape, read from a GGUF file's metadata or a Hugging Face `config.json`.
//!
//! The Llama family as the decoder runs it: Llama 2/3, Mistral, SmolLM, TinyLlama (all
//! `llama` in GGUF, `LlamaForCausalLM`/`MistralForCausalLM` in Hugging Face configs) and Qwen2
//! (the same block with biases on the Q, K and V projections). Anything else is refused naming
//! the file and the field.

use std::path::Path;

use serde::Deserialize;

use super::gguf::{Gguf, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen2,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub family: Family,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    /// Prompt plus produced tokens the model was trained for.
    pub context: usize,
    /// Biases on the Q, K and V projections (Qwen2).
    pub qkv_bias: bool,
}

impl Config {
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Checks the shape's internal consistency (a head count that does not divide, say).
    fn checked(self, file: &str) -> Result<Config, String> {
        let at = |field: &str, message: String| Err(format!("{file}: {field} {message}"));
        for (field, v) in [
            ("layers", self.layers),
            ("hidden size", self.hidden),
            ("head count", self.heads),
            ("key-value head count", self.kv_heads),
            ("head dimension", self.head_dim),
            ("feed-forward size", self.ffn),
            ("vocabulary size", self.vocab),
        ] {
            if v == 0 {
                return at(field, "is 0".into());
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return at(
                "key-value head count",
                format!("is {}; it must divide the head count ({})", self.kv_heads, self.heads),
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            return at("head dimension", format!("is {}; rotary embeddings need an even one", self.head_dim));
        }
        if !(self.rope_theta > 0.0 && self.rms_eps > 0.0) {
            return at(
                "rope theta / rms epsilon",
                format!("are {} / {}; both must be > 0", self.rope_theta, self.rms_eps),
            );
        }
        Ok(self)
    }

    /// From a GGUF file's `{architecture}.*` metadata.
    pub fn from_gguf(g: &Gguf, file: &str) -> Result<Config, String> {
        let arch = g
            .get("general.architecture")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("{file}: metadata 'general.architecture' is missing"))?;
        let family = match arch {
            "llama" | "mistral" => Family::Llama,
            "qwen2" => Family::Qwen2,
            other => {
                return Err(format!(
                    "{file}: general.architecture is '{other}'; the llm engine runs llama (Llama 2/3, Mistral, \
                     SmolLM, TinyLlama) and qwen2"
                ))
            }
        };
        let key = |name: &str| format!("{arch}.{name}");
        let uint = |name: &str| -> Result<usize, String> {
            let k = key(name);
            g.get(&k)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| format!("{file}: metadata '{k}' is missing or not an integer"))
        };
        let float = |name: &str, default: Option<f64>| -> Result<f32, String> {
            let k = key(name);
            match g.get(&k) {
                Some(v) => {
                    v.as_f64().map(|f| f as f32).ok_or_else(|| format!("{file}: metadata '{k}' is not a number"))
                }
                None => default.map(|d| d as f32).ok_or_else(|| format!("{file}: metadata '{k}' is missing")),
            }
        };
        let hidden = uint("embedding_length")?;
        let heads = uint("attention.head_count")?;
        let kv_heads = uint("attention.head_count_kv").unwrap_or(heads);
        let head_dim = uint("attention.key_length").unwrap_or(hidden.checked_div(heads).unwrap_or(0));
        let vocab = match uint("vocab_size") {
            Ok(v) => v,
            Err(_) => {
                g.get("tokenizer.ggml.tokens").and_then(Value::as_array).map(<[Value]>::len).ok_or_else(|| {
                    format!("{file}: neither '{arch}.vocab_size' nor 'tokenizer.ggml.tokens' is there")
                })?
            }
        };
        if let Some(kind) = g.get(&key("rope.scaling.type")).and_then(Value::as_str) {
            if kind != "none" && kind != "linear" {
                return Err(format!(
                    "{file}: {arch}.rope.scaling.type is '{kind}'; the llm engine applies none or linear"
                ));
            }
        }
        Config {
            family,
            layers: uint("block_count")?,
            hidden,
            heads,
            kv_heads,
            head_dim,
            ffn: uint("feed_forward_length")?,
            vocab,
            rope_theta: float("rope.freq_base", Some(10_000.0))?,
            rms_eps: float("attention.layer_norm_rms_epsilon", None)?,
            context: uint("context_length")?,
            qkv_bias: family == Family::Qwen2,
        }
        .checked(file)
    }

    /// From a Hugging Face `config.json`.
    pub fn from_hf(dir: &Path) -> Result<Config, String> {
        let path = dir.join("config.json");
        let file = path.display().to_string();
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{file}: cannot read: {e}"))?;
        let c: HfConfig = serde_json::from_str(&text).map_err(|e| format!("{file}: {e}"))?;
        let family = match c.model_type.as_deref() {
            Some("llama" | "mistral") => Family::Llama,
            Some("qwen2") => Family::Qwen2,
            other => {
                return Err(format!(
                    "{file}: model_type is {}; the llm engine runs llama, mistral and qwen2",
                    other.map_or("missing".to_owned(), |o| format!("'{o}'"))
                ))
            }
        };
        if let Some(act) = c.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(format!("{file}: hidden_act is '{act}'; the Llama family's is silu"));
        }
        // transformers 5 writes rope_theta under rope_parameters; older and hub configs at the top.
        let rope = c.rope_parameters.as_ref();
        if let Some(kind) = rope.and_then(|r| r.rope_type.as_deref()).filter(|t| *t != "default") {
            return Err(format!("{file}: rope_parameters.rope_type is '{kind}'; the llm engine applies default"));
        }
        if let Some(s) = c.rope_scaling.as_ref().filter(|s| !s.is_null()) {
            return Err(format!("{file}: rope_scaling is {s}; the llm engine applies no rope scaling"));
        }
        let heads = c.num_attention_heads;
        Config {
            family,
            layers: c.num_hidden_layers,
            hidden: c.hidden_size,
            heads,
            kv_heads: c.num_key_value_heads.unwrap_or(heads),
            head_dim: c.head_dim.unwrap_or(c.hidden_size.checked_div(heads).unwrap_or(0)),
            ffn: c.intermediate_size,
            vocab: c.vocab_size,
            rope_theta: rope.and_then(|r| r.rope_theta).or(c.rope_theta).unwrap_or(10_000.0) as f32,
            rms_eps: c.rms_norm_eps.unwrap_or(1e-6) as f32,
            // Attention over a sliding window (Mistral 7B v0.1) is full attention up to the window:
            // the context served stops there rather than attend past what the model was made for.
            context: match (c.sliding_window, c.use_sliding_window) {
                (Some(w), Some(true) | None) if w > 0 => c.max_position_embeddings.min(w),
                _ => c.max_position_embeddings,
            },
            qkv_bias: family == Family::Qwen2 || c.attention_bias.unwrap_or(false),
        }
        .checked(&file)
    }
}

#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    intermediate_size: usize,
    vocab_size: usize,
    max_position_embeddings: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<RopeParameters>,
    rope_scaling: Option<serde_json::Value>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
}

#[derive(Deserialize)]
struct RopeParameters {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hf(name: &str, json: &str) -> Result<Config, String> {
        let dir = std::env::temp_dir().join(format!("ferry-llm-config-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), json).unwrap();
        let c = Config::from_hf(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        c
    }

    const MISTRAL: &str = r#"{"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "sliding_window": 4096, "hidden_act": "silu"}"#;

    #[test]
    fn hub_and_transformers_layouts_read_alike() {
        let m = hf("mistral", MISTRAL).unwrap();
        assert_eq!((m.family, m.kv_heads, m.head_dim, m.rope_theta), (Family::Llama, 8, 128, 10000.0));
        // A sliding window of 4096 serves a context of 4096.
        assert_eq!(m.context, 4096);
        let qwen = MISTRAL
            .replace("\"mistral\"", "\"qwen2\"")
            .replace("\"sliding_window\": 4096", "\"sliding_window\": 4096, \"use_sliding_window\": false");
        let q = hf("qwen", &qwen).unwrap();
        assert!(q.qkv_bias);
        assert_eq!(q.context, 32768);
        let nested = MISTRAL.replace(
            "\"rope_theta\": 10000.0",
            "\"rope_parameters\": {\"rope_theta\": 500000.0, \"rope_type\": \"default\"}",
        );
        assert_eq!(hf("nested", &nested).unwrap().rope_theta, 500000.0);
    }

    #[test]
    fn other_models_and_inconsistent_shapes_are_refused_naming_the_field() {
        let e = hf("neox", &MISTRAL.replace("\"mistral\"", "\"gpt_neox\"")).unwrap_err();
        assert!(e.contains("config.json") && e.contains("model_type is 'gpt_neox'"), "{e}");
        let e = hf("heads", &MISTRAL.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5")).unwrap_err();
        assert!(e.contains("key-value head count is 5"), "{e}");
        let e = hf("act", &MISTRAL.replace("\"silu\"", "\"gelu\"")).unwrap_err();
        assert!(e.contains("hidden_act is 'gelu'"), "{e}");
        let e = hf("scaling", &MISTRAL.replace("\"sliding_window\": 4096", "\"rope_scaling\": {\"type\": \"yarn\"}"))
            .unwrap_err();
        assert!(e.contains("rope_scaling"), "{e}");
    }
}
