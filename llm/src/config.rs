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
    /// Per-frequency divisors of the rotary embedding (Llama 3.1's scaling): frequency `i` is
    /// `θ^(−2i/d) / factors[i]`. `None`: unscaled.
    pub rope_factors: Option<Vec<f32>>,
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
        // Linear scaling divides every frequency by the factor (positions by it, in effect).
        let linear = match g.get(&key("rope.scaling.type")).and_then(Value::as_str) {
            None | Some("none") => None,
            Some("linear") => match g.get(&key("rope.scaling.factor")).and_then(Value::as_f64) {
                Some(f) if f > 0.0 => Some(f as f32),
                _ => {
                    return Err(format!(
                        "{file}: {arch}.rope.scaling.type is linear without a positive {arch}.rope.scaling.factor"
                    ))
                }
            },
            Some(kind) => {
                return Err(format!(
                    "{file}: {arch}.rope.scaling.type is '{kind}'; the llm engine applies none or linear"
                ))
            }
        };
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
            // Llama 3.1 files carry their scaling as a tensor of divisors (read with the weights).
            rope_factors: linear.map(|f| vec![f; head_dim / 2]),
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
        // Llama's attention_bias also biases o_proj, and mlp_bias gate/up/down: neither is read.
        if family == Family::Llama && c.attention_bias == Some(true) {
            return Err(format!("{file}: attention_bias is true; the llm engine runs Llama without attention biases"));
        }
        if c.mlp_bias == Some(true) {
            return Err(format!("{file}: mlp_bias is true; the llm engine runs the MLP without biases"));
        }
        // transformers 5 writes rope_theta and the scaling under rope_parameters; older and hub
        // configs put rope_theta at the top and the scaling in rope_scaling.
        let rope = c.rope_parameters.as_ref();
        let scaling = match (rope, c.rope_scaling.as_ref().filter(|s| !s.is_null())) {
            (Some(r), _) if r.rope_type.as_deref().is_some_and(|t| t != "default") => {
                Some(("rope_parameters", serde_json::to_value(r).unwrap_or_default()))
            }
            (_, Some(s)) => Some(("rope_scaling", s.clone())),
            _ => None,
        };
        let heads = c.num_attention_heads;
        let head_dim = c.head_dim.unwrap_or(c.hidden_size.checked_div(heads).unwrap_or(0));
        let rope_theta = rope.and_then(|r| r.rope_theta).or(c.rope_theta).unwrap_or(10_000.0) as f32;
        let rope_factors = match scaling {
            None => None,
            Some((field, s)) => {
                Some(rope_scaling_factors(&s, head_dim, rope_theta).map_err(|e| format!("{file}: {field} {e}"))?)
            }
        };
        Config {
            family,
            layers: c.num_hidden_layers,
            hidden: c.hidden_size,
            heads,
            kv_heads: c.num_key_value_heads.unwrap_or(heads),
            head_dim,
            ffn: c.intermediate_size,
            vocab: c.vocab_size,
            rope_theta,
            rope_factors,
            rms_eps: c.rms_norm_eps.unwrap_or(1e-6) as f32,
            // Attention over a sliding window (Mistral 7B v0.1) is full attention up to the window:
            // the context served stops there rather than attend past what the model was made for.
            context: match (c.sliding_window, c.use_sliding_window) {
                (Some(w), Some(true) | None) if w > 0 => c.max_position_embeddings.min(w),
                _ => c.max_position_embeddings,
            },
            qkv_bias: family == Family::Qwen2,
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
    mlp_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
}

#[derive(Deserialize, serde::Serialize)]
struct RopeParameters {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
    #[serde(flatten)]
    rest: serde_json::Map<String, serde_json::Value>,
}

/// Rotary scaling as per-frequency divisors: `linear` divides all by `factor`; Llama 3.1's
/// (`rope_type: llama3`) keeps wavelengths
/// shorter than `original / high_freq_factor`, divides those longer than
/// `original / low_freq_factor` by `factor`, and blends those between — transformers'
/// `_compute_llama3_parameters`. Any other kind of scaling is refused.
fn rope_scaling_factors(s: &serde_json::Value, head_dim: usize, theta: f32) -> Result<Vec<f32>, String> {
    let kind = s["rope_type"].as_str().or(s["type"].as_str()).unwrap_or("missing");
    let number = |k: &str| s[k].as_f64().ok_or_else(|| format!("has no number '{k}'"));
    if kind == "linear" {
        let factor = number("factor")?;
        if factor <= 0.0 {
            return Err(format!("has factor {factor}; it must be > 0"));
        }
        return Ok(vec![factor as f32; head_dim / 2]);
    }
    if kind != "llama3" {
        return Err(format!("is of type '{kind}'; the llm engine applies linear or llama3 scaling, or none"));
    }
    let (factor, low, high) = (number("factor")?, number("low_freq_factor")?, number("high_freq_factor")?);
    let original = number("original_max_position_embeddings")?;
    if !(factor > 0.0 && high > low && low > 0.0) {
        return Err(format!(
            "has factor {factor}, low_freq_factor {low}, high_freq_factor {high}: need factor > 0 and high > low > 0"
        ));
    }
    let (low_wavelen, high_wavelen) = (original / low, original / high);
    Ok((0..head_dim / 2)
        .map(|i| {
            let inv = f64::from(theta).powf(-((2 * i) as f64) / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / inv;
            let scaled = if wavelen < high_wavelen {
                inv
            } else if wavelen > low_wavelen {
                inv / factor
            } else {
                let smooth = (original / wavelen - low) / (high - low);
                (1.0 - smooth) * inv / factor + smooth * inv
            };
            (inv / scaled) as f32
        })
        .collect())
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
        let linear =
            MISTRAL.replace("\"sliding_window\": 4096", "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 4.0}");
        assert_eq!(hf("linear", &linear).unwrap().rope_factors, Some(vec![4.0; 64]));
        let biased = MISTRAL.replace("\"sliding_window\": 4096", "\"attention_bias\": true");
        assert!(hf("biased", &biased).unwrap_err().contains("attention_bias is true"));
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
