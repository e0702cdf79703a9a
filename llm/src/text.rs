//! The model's text side: its own tokenizer, its own chat template, incremental
//! detokenization, and which tokens end a turn.
//!
//! The tokenizer is Hugging Face's `tokenizers`, built from the model's `tokenizer.json` or, for
//! a GGUF file, from a `tokenizer.json` written from the file's vocabulary, merges, token types
//! and pre-tokenizer name (`tokenizer.ggml.*`), so both formats tokenize with the same code.
//! Chat templates are Jinja, compiled once at load ([`crate::template`]); a Hugging Face folder's
//! `chat_template.jinja` (where transformers now writes it) comes before `tokenizer_config.json`'s.
//!
//! Detokenization works on bytes: each token's bytes are known up front (byte-level BPE maps
//! bytes to printable characters one to one; SentencePiece vocabularies spell bytes `<0xNN>`
//! and spaces `▁`), and a sequence's text is released as far as it is valid UTF-8, so a
//! character split across tokens is sent whole with the token that completes it.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use serde_json::{json, Value as Json};
use tokenizers::Tokenizer;

use super::gguf::{Gguf, Value};
use super::template::{ChatOptions, Template};

/// Control tokens that end a turn, by their text, as llama.cpp recognises them.
const END_MARKERS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
    "</s>",
    "<|eom_id|>",
];

/// A message of a chat conversation.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// More of the message for the template, as OpenAI's and transformers' messages hold them:
    /// an assistant's `tool_calls` (their `arguments` as objects, as templates read them), a tool
    /// result's `tool_call_id`, a `name`.
    pub extra: serde_json::Map<String, Json>,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message { role: role.into(), content: content.into(), extra: serde_json::Map::new() }
    }
}

pub struct Text {
    tokenizer: Tokenizer,
    /// Each token's bytes as text output; empty for special tokens.
    bytes: Arc<Vec<Vec<u8>>>,
    ends: HashSet<u32>,
    bos: Option<(u32, String)>,
    add_bos: bool,
    /// The chat template, compiled, or why it does not compile (said to each chat request:
    /// completions still serve).
    template: Option<Result<Template, String>>,
    eos_text: String,
    /// The tokenizer with special tokens read as plain text, for what users wrote
    /// ([`Text::chat_tokens`]); made on first use.
    plain: OnceLock<Tokenizer>,
}

impl std::fmt::Debug for Text {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Text").field("vocab", &self.bytes.len()).field("ends", &self.ends).finish()
    }
}

/// How the vocabulary spells bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Spelling {
    /// GPT-2's byte-to-character map.
    ByteLevel,
    /// SentencePiece: `▁` for a space, `<0xNN>` for a byte.
    Pieces,
}

impl Text {
    pub fn from_gguf(g: &Gguf, file: &str) -> Result<Text, String> {
        let field = |k: &str| g.get(k).ok_or_else(|| format!("{file}: metadata '{k}' is missing"));
        let strings = |k: &str| -> Result<Vec<String>, String> {
            field(k)?
                .as_array()
                .and_then(|a| a.iter().map(|v| v.as_str().map(str::to_owned)).collect::<Option<Vec<_>>>())
                .ok_or_else(|| format!("{file}: metadata '{k}' is not an array of strings"))
        };
        let model = field("tokenizer.ggml.model")?.as_str().unwrap_or_default();
        if model != "gpt2" {
            return Err(format!(
                "{file}: tokenizer.ggml.model is '{model}'; from GGUF the llm engine builds byte-level BPE (gpt2) \
                 tokenizers — for a SentencePiece model use its Hugging Face folder (tokenizer.json)"
            ));
        }
        let pre = g.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
        let pre_tokenizer = pre_tokenizer(pre).ok_or_else(|| {
            format!(
                "{file}: tokenizer.ggml.pre is '{pre}'; the llm engine knows default, gpt2, smollm, llama-bpe, \
                 llama3, qwen2"
            )
        })?;
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<u64> = match g.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
            Some(a) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        // Control (3) and user-defined (4) tokens are matched whole in text, as special tokens.
        let special: Vec<(u32, &str)> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(types.get(*i), Some(3 | 4)))
            .map(|(i, t)| (i as u32, t.as_str()))
            .collect();
        let vocab: serde_json::Map<String, Json> =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
        let spec = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": special.iter().map(|(id, t)| json!({
                "id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": true,
            })).collect::<Vec<_>>(),
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                // Llama 3's tokenizer takes a word found whole in the vocabulary before merging.
                "ignore_merges": matches!(pre, "llama-bpe" | "llama3"),
                "vocab": vocab, "merges": merges,
            },
        });
        let tokenizer = Tokenizer::from_bytes(spec.to_string().as_bytes())
            .map_err(|e| format!("{file}: the tokenizer from its metadata does not build: {e}"))?;
        let id = |k: &str| g.get(k).and_then(Value::as_u64).map(|v| v as u32);
        // Control tokens (3) are not text; user-defined ones (4) are, stored as they read.
        let bytes = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| match types.get(i) {
                Some(3) => Vec::new(),
                Some(4) => t.as_bytes().to_vec(),
                _ => spell(t, Spelling::ByteLevel),
            })
            .collect();
        let mut ends: HashSet<u32> = special.iter().filter(|(_, t)| END_MARKERS.contains(t)).map(|s| s.0).collect();
        ends.extend(id("tokenizer.ggml.eos_token_id"));
        ends.extend(id("tokenizer.ggml.eot_token_id"));
        let bos = id("tokenizer.ggml.bos_token_id").and_then(|b| Some((b, tokens.get(b as usize)?.clone())));
        let eos_text = id("tokenizer.ggml.eos_token_id").and_then(|e| tokens.get(e as usize).cloned());
        Ok(Text {
            tokenizer,
            bytes: Arc::new(bytes),
            ends,
            // Llama 3 vocabularies begin every sequence with BOS unless the file says otherwise.
            add_bos: g
                .get("tokenizer.ggml.add_bos_token")
                .and_then(Value::as_bool)
                .unwrap_or(matches!(pre, "llama-bpe" | "llama3")),
            bos,
            template: g.get("tokenizer.chat_template").and_then(Value::as_str).map(|t| Template::new(t.to_owned())),
            eos_text: eos_text.unwrap_or_default(),
            plain: OnceLock::new(),
        })
    }

    /// From a Hugging Face folder: `tokenizer.json`, `chat_template.jinja` or else
    /// `tokenizer_config.json` for the chat template, and the latter for the special tokens' names.
    pub fn from_hf(dir: &Path) -> Result<Text, String> {
        let path = dir.join("tokenizer.json");
        let file = path.display().to_string();
        let raw = std::fs::read(&path).map_err(|e| format!("{file}: cannot read: {e}"))?;
        let tokenizer = Tokenizer::from_bytes(&raw).map_err(|e| format!("{file}: {e}"))?;
        let spec: Json = serde_json::from_slice(&raw).map_err(|e| format!("{file}: {e}"))?;
        let spelling =
            if spec["decoder"].to_string().contains("ByteLevel") { Spelling::ByteLevel } else { Spelling::Pieces };
        let special: HashSet<u32> = spec["added_tokens"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|t| t["special"].as_bool() == Some(true))
            .filter_map(|t| t["id"].as_u64().map(|i| i as u32))
            .collect();
        let size = tokenizer.get_vocab_size(true);
        let bytes = (0..size as u32)
            .map(|i| match tokenizer.id_to_token(i) {
                Some(t) if !special.contains(&i) => spell(&t, spelling),
                _ => Vec::new(),
            })
            .collect();

        let config_path = dir.join("tokenizer_config.json");
        let config: Json = match std::fs::read(&config_path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", config_path.display()))?,
            Err(_) => Json::Null,
        };
        let name = |v: &Json| v.as_str().map(str::to_owned).or_else(|| v["content"].as_str().map(str::to_owned));
        let jinja = dir.join("chat_template.jinja");
        let own = match std::fs::read_to_string(&jinja) {
            Ok(t) => Some(t),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(format!("{}: cannot read: {e}", jinja.display())),
        };
        let template = match &config["chat_template"] {
            _ if own.is_some() => own,
            Json::String(s) => Some(s.clone()),
            // A list of named templates: the default one.
            Json::Array(list) => list
                .iter()
                .find(|t| t["name"] == "default")
                .or(list.first())
                .and_then(|t| t["template"].as_str().map(str::to_owned)),
            _ => None,
        };
        let eos_text = name(&config["eos_token"]).unwrap_or_default();
        let mut ends: HashSet<u32> = special
            .iter()
            .filter(|&&i| tokenizer.id_to_token(i).is_some_and(|t| END_MARKERS.contains(&t.as_str())))
            .copied()
            .collect();
        ends.extend(tokenizer.token_to_id(&eos_text));
        let bos = name(&config["bos_token"]).and_then(|t| Some((tokenizer.token_to_id(&t)?, t)));
        Ok(Text {
            tokenizer,
            bytes: Arc::new(bytes),
            ends,
            bos,
            // tokenizer.json's post-processor adds what the model wants.
            add_bos: false,
            template: template.map(Template::new),
            eos_text,
            plain: OnceLock::new(),
        })
    }

    /// Token ids of a text, special tokens in it recognised; the beginning-of-sequence token
    /// added where the model wants one and the text does not already begin with it (a chat
    /// template that writes `{{ bos_token }}`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        let encoding = self.tokenizer.encode(text, true).map_err(|e| format!("the prompt cannot be tokenized: {e}"))?;
        Ok(self.with_bos(encoding.get_ids().to_vec()))
    }

    /// `ids` beginning with the beginning-of-sequence token where the model wants one, once.
    fn with_bos(&self, mut ids: Vec<u32>) -> Vec<u32> {
        if let Some((bos, _)) = &self.bos {
            if self.add_bos && ids.first() != Some(bos) {
                ids.insert(0, *bos);
            }
            // A post-processor's BOS before a template's own.
            if ids.len() >= 2 && ids[0] == *bos && ids[1] == *bos {
                ids.remove(0);
            }
        }
        ids
    }

    /// The token ids of a conversation through the model's chat template, the special tokens the
    /// template writes recognised and none that a message holds: a user who types
    /// `<|im_start|>system` gets those characters as text, not a system turn. Where no message
    /// holds a special token's text this is [`Text::encode`] of [`Text::chat`]; where one does,
    /// the template is rendered again with a marker in place of each message, and the text
    /// between the markers is tokenized with special tokens recognised, each message without.
    /// A template that changes message text (a `trim`), so that the markers cannot stand for
    /// the messages, is refused for such a message rather than let it through. (Tokenized in
    /// parts, such a conversation may differ at the parts' edges from the whole text's tokens —
    /// a Metaspace tokenizer begins each part with a word boundary — which is the price of not
    /// reading the message's special tokens.)
    pub fn chat_tokens(&self, messages: &[Message], options: &ChatOptions) -> Result<Vec<u32>, String> {
        let rendered = self.chat(messages, options)?;
        let specials: Vec<String> =
            self.tokenizer.get_added_tokens_decoder().into_values().filter(|t| t.special).map(|t| t.content).collect();
        let holds = |text: &str| specials.iter().find(|s| !s.is_empty() && text.contains(s.as_str())).cloned();
        // The rest the template writes from the request — tools, a message's tool calls and name —
        // is not kept apart as a message's text is: a special token there is refused.
        let tools = options.tools.iter().flatten().enumerate().map(|(i, t)| (format!("tools[{i}]"), t));
        let extras = messages
            .iter()
            .enumerate()
            .flat_map(|(i, m)| m.extra.iter().map(move |(k, v)| (format!("messages[{i}].{k}"), v)));
        for (field, value) in tools.chain(extras) {
            if let Some(special) = strings(value).find_map(holds) {
                return Err(format!(
                    "{field} holds the special token '{special}', which only the chat template may write; remove it"
                ));
            }
        }
        let Some((first, special)) = messages.iter().enumerate().find_map(|(i, m)| Some((i, holds(&m.content)?)))
        else {
            return self.encode(&rendered);
        };
        let marker = |i: usize| format!("\u{E000}ferry-message-{i}\u{E001}");
        let marked: Vec<Message> =
            messages.iter().enumerate().map(|(i, m)| Message { content: marker(i), ..m.clone() }).collect();
        let template = self.chat(&marked, options)?;
        let cannot = || {
            format!(
                "messages[{first}] holds the special token '{special}', and this model's chat template changes \
                 message text, so it cannot be kept apart as plain text; remove it"
            )
        };
        // The template's own text between the messages, and each message in order.
        let mut parts: Vec<(&str, bool)> = Vec::new();
        let mut rest = template.as_str();
        for (i, m) in messages.iter().enumerate() {
            let at = rest.find(&marker(i)).ok_or_else(cannot)?;
            parts.push((&rest[..at], true));
            parts.push((m.content.as_str(), false));
            rest = &rest[at + marker(i).len()..];
        }
        parts.push((rest, true));
        if parts.iter().map(|p| p.0).collect::<String>() != rendered {
            return Err(cannot());
        }
        let plain = self.plain.get_or_init(|| {
            let mut t = self.tokenizer.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let mut ids = Vec::new();
        for (text, template) in parts.into_iter().filter(|p| !p.0.is_empty()) {
            let tokenizer = if template { &self.tokenizer } else { plain };
            // The post-processor (a BOS) once, at the start.
            let encoding =
                tokenizer.encode(text, ids.is_empty()).map_err(|e| format!("the prompt cannot be tokenized: {e}"))?;
            ids.extend_from_slice(encoding.get_ids());
        }
        Ok(self.with_bos(ids))
    }

    /// The prompt of a conversation through the model's chat template.
    pub fn chat(&self, messages: &[Message], options: &ChatOptions) -> Result<String, String> {
        let template = self.template.as_ref().ok_or("this model has no chat template; use /v1/completions")?;
        template.as_ref().map_err(String::clone)?.render(
            messages,
            options,
            self.bos.as_ref().map_or("", |b| b.1.as_str()),
            &self.eos_text,
        )
    }

    /// The tokenizer, as built.
    pub(crate) fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// A fresh incremental detokenizer for one sequence's produced tokens.
    pub fn stream(&self) -> TextStream {
        TextStream { bytes: self.bytes.clone(), pending: Vec::new() }
    }

    pub fn is_end(&self, token: u32) -> bool {
        self.ends.contains(&token)
    }

    /// The tokens that end an answer, in order.
    pub fn end_tokens(&self) -> Vec<u32> {
        let mut ends: Vec<u32> = self.ends.iter().copied().collect();
        ends.sort_unstable();
        ends
    }

    /// A token's text as output (empty for special tokens).
    pub fn token_bytes(&self, token: u32) -> &[u8] {
        self.bytes.get(token as usize).map_or(&[], Vec::as_slice)
    }

    /// A token as a list of log-probabilities shows it: its output bytes, or a special token's
    /// name (which outputs nothing).
    pub fn token_shown(&self, token: u32) -> Vec<u8> {
        match self.token_bytes(token) {
            [] => self.tokenizer.id_to_token(token).unwrap_or_default().into_bytes(),
            bytes => bytes.to_vec(),
        }
    }
}

/// Every string in a JSON value, keys included.
fn strings(value: &Json) -> Box<dyn Iterator<Item = &str> + '_> {
    match value {
        Json::String(s) => Box::new(std::iter::once(s.as_str())),
        Json::Array(a) => Box::new(a.iter().flat_map(strings)),
        Json::Object(o) => Box::new(o.iter().flat_map(|(k, v)| std::iter::once(k.as_str()).chain(strings(v)))),
        _ => Box::new(std::iter::empty()),
    }
}

/// The pre-tokenizer of llama.cpp's pre-tokenizer names, as `tokenizer.json` writes it.
fn pre_tokenizer(name: &str) -> Option<Json> {
    let byte_level =
        |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
    let split = |pattern: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]})
    };
    Some(match name {
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true),
        ]}),
        "llama-bpe" | "llama3" => split(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        "qwen2" => split(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        _ => return None,
    })
}

/// A vocabulary entry's bytes.
fn spell(token: &str, spelling: Spelling) -> Vec<u8> {
    match spelling {
        Spelling::ByteLevel => {
            let map = unicode_to_byte();
            // Every character of a byte-level token is one byte; one that is not keeps its UTF-8.
            let mut out = Vec::with_capacity(token.len());
            for ch in token.chars() {
                match map.get(&ch) {
                    Some(b) => out.push(*b),
                    None => out.extend(ch.to_string().as_bytes()),
                }
            }
            out
        }
        Spelling::Pieces => {
            if let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>')) {
                if let Ok(b) = u8::from_str_radix(hex, 16) {
                    return vec![b];
                }
            }
            token.replace('\u{2581}', " ").into_bytes()
        }
    }
}

/// GPT-2's map from its printable characters back to bytes: the printable Latin-1 bytes stand
/// for themselves, the other 68 bytes are spelled from U+0100 up, in order.
fn unicode_to_byte() -> &'static std::collections::HashMap<char, u8> {
    static MAP: std::sync::OnceLock<std::collections::HashMap<char, u8>> = std::sync::OnceLock::new();
    MAP.get_or_init(|| {
        let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        let mut map = std::collections::HashMap::new();
        let mut next = 256u32;
        for b in 0..=255u8 {
            let ch = if printable(b) {
                char::from(b)
            } else {
                let c = char::from_u32(next).expect("below the surrogates");
                next += 1;
                c
            };
            map.insert(ch, b);
        }
        map
    })
}

/// One sequence's output text, released as far as it is valid UTF-8.
#[derive(Debug)]
pub struct TextStream {
    bytes: Arc<Vec<Vec<u8>>>,
    pending: Vec<u8>,
}

impl TextStream {
    /// What is left when the sequence ends: bytes of an unfinished character, as U+FFFD.
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }

    /// The text that token completes.
    pub fn push(&mut self, token: u32) -> String {
        if let Some(b) = self.bytes.get(token as usize) {
            self.pending.extend_from_slice(b);
        }
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).expect("valid prefix"));
                    match e.error_len() {
                        // Incomplete at the end: wait for the bytes that complete it.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        // Bytes no character can start with: shown as U+FFFD, as a lossy decode does.
                        Some(n) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + n);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_map_is_a_bijection_and_spells_space_as_g_dot() {
        let map = unicode_to_byte();
        assert_eq!(map.len(), 256);
        assert_eq!(map.values().collect::<HashSet<_>>().len(), 256);
        assert_eq!(spell("Ġhello", Spelling::ByteLevel), b" hello");
        assert_eq!(spell("Ċ", Spelling::ByteLevel), b"\n");
        assert_eq!(spell("\u{2581}the", Spelling::Pieces), b" the");
        assert_eq!(spell("<0xE2>", Spelling::Pieces), vec![0xE2]);
    }

    #[test]
    fn a_character_split_across_tokens_is_released_whole() {
        // "é€" as bytes split 1 | 2 | 2 over three tokens, then an invalid byte.
        let parts: Vec<Vec<u8>> = vec![vec![0xC3], vec![0xA9, 0xE2], vec![0x82, 0xAC], vec![0xFF, b'a']];
        let mut d = TextStream { bytes: Arc::new(parts), pending: Vec::new() };
        assert_eq!(d.push(0), "");
        assert_eq!(d.push(1), "é");
        assert_eq!(d.push(2), "€");
        assert_eq!(d.push(3), "\u{FFFD}a");
        assert_eq!(d.push(99), "");
        // A sequence that ends inside a character gives it as U+FFFD, once.
        assert_eq!(d.push(0), "");
        assert_eq!(d.finish(), "\u{FFFD}");
        assert_eq!(d.finish(), "");
    }
}
