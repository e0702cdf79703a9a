//! Text to token ids with the model's own `tokenizer.json` (Hugging Face `tokenizers`, so that
//! normalisation, word pieces and special tokens are exactly the model's), padded to the longest
//! row of a batch.

use std::path::Path;

use tokenizers::{Tokenizer, TruncationParams};

use super::LoadError;

/// Texts are cut to this many bytes per token of the model's limit before they are tokenized
/// (16 KiB for 256 tokens; prose takes 4 to 6): tokenizing costs time in proportion to the text,
/// and a 16 MiB text would otherwise hold a thread for seconds to keep its first 256 tokens.
pub const BYTES_PER_TOKEN: usize = 64;

/// What happens to an input longer than the model takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overflow {
    /// Keep the first tokens (as sentence-transformers does), `[SEP]` still last.
    #[default]
    Truncate,
    /// Refuse the request with 400, naming the input, its length and the limit.
    Refuse,
}

impl Overflow {
    pub fn parse(text: &str) -> Option<Overflow> {
        match text {
            "truncate" => Some(Overflow::Truncate),
            "refuse" => Some(Overflow::Refuse),
            _ => None,
        }
    }
}

/// Token ids of a batch, row-major `[rows, len]`, right-padded with id 0 to the longest row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBatch {
    pub rows: usize,
    /// The longest row, in tokens: every row is padded to it.
    pub len: usize,
    pub ids: Vec<u32>,
    pub type_ids: Vec<u32>,
    /// Real tokens per row; the rest of the row is padding, masked out of attention and pooling.
    pub lengths: Vec<usize>,
}

impl TokenBatch {
    /// Real tokens in the batch (padding excluded).
    pub fn tokens(&self) -> usize {
        self.lengths.iter().sum()
    }
}

/// The tokenizer, with the model's longest input and what to do beyond it.
pub struct TextEncoder {
    whole: Tokenizer,
    truncating: Tokenizer,
    max_tokens: usize,
    overflow: Overflow,
}

impl TextEncoder {
    pub fn load(dir: &Path, max_tokens: usize, overflow: Overflow) -> Result<TextEncoder, LoadError> {
        let path = dir.join("tokenizer.json");
        let error = |message: String| LoadError::File { path: path.display().to_string(), message };
        let mut whole = Tokenizer::from_file(&path).map_err(|e| error(e.to_string()))?;
        // Padding is ours (to the batch's longest row); the file's own settings (all-MiniLM's pads
        // every row to 128) would waste work.
        whole.with_padding(None);
        whole.with_truncation(None).map_err(|e| error(e.to_string()))?;
        let mut truncating = whole.clone();
        truncating
            .with_truncation(Some(TruncationParams { max_length: max_tokens, ..TruncationParams::default() }))
            .map_err(|e| error(e.to_string()))?;
        Ok(TextEncoder { whole, truncating, max_tokens, overflow })
    }

    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The most bytes of one text that are tokenized.
    pub fn max_bytes(&self) -> usize {
        self.max_tokens * BYTES_PER_TOKEN
    }

    /// `text`, or, when it is longer than [`TextEncoder::max_bytes`], its beginning cut at the last
    /// whitespace of the final 256 bytes (else at a character boundary), so that no word is split
    /// unless it is too long to be one word piece anyway. Refused under `Refuse`.
    fn bounded<'t>(&self, i: usize, text: &'t str) -> Result<&'t str, String> {
        let limit = self.max_bytes();
        if text.len() <= limit {
            return Ok(text);
        }
        if self.overflow == Overflow::Refuse {
            return Err(format!(
                "text[{i}] is {} bytes; with --long-inputs refuse this model takes at most {limit} bytes ({} tokens)",
                text.len(),
                self.max_tokens
            ));
        }
        let mut end = limit;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let floor = end.saturating_sub(256);
        let cut = text[floor..end].rfind(char::is_whitespace).map_or(end, |at| floor + at);
        Ok(&text[..cut])
    }

    /// Tokens each text becomes (after truncation, when that is the policy), or why one is
    /// refused. Admission uses this to price a request before it is queued.
    pub fn count(&self, texts: &[&str]) -> Result<Vec<usize>, String> {
        texts
            .iter()
            .enumerate()
            .map(|(i, text)| {
                let text = self.bounded(i, text)?;
                let n = self.whole.encode(text, true).map_err(|e| format!("text[{i}] cannot be tokenized: {e}"))?.len();
                self.fit(i, n)
            })
            .collect()
    }

    fn fit(&self, i: usize, n: usize) -> Result<usize, String> {
        match self.overflow {
            _ if n <= self.max_tokens => Ok(n),
            Overflow::Truncate => Ok(self.max_tokens),
            Overflow::Refuse => Err(format!(
                "text[{i}] is {n} tokens; this model takes at most {} (--long-inputs is refuse; 'truncate' would keep the first {})",
                self.max_tokens, self.max_tokens
            )),
        }
    }

    /// Tokenizes a batch and pads it to its longest row.
    pub fn encode(&self, texts: &[&str]) -> Result<TokenBatch, String> {
        let tokenizer = match self.overflow {
            Overflow::Truncate => &self.truncating,
            Overflow::Refuse => &self.whole,
        };
        let bounded: Vec<&str> =
            texts.iter().enumerate().map(|(i, text)| self.bounded(i, text)).collect::<Result<_, _>>()?;
        let encodings = tokenizer.encode_batch(bounded, true).map_err(|e| format!("tokenizing failed: {e}"))?;
        let lengths: Vec<usize> =
            encodings.iter().enumerate().map(|(i, e)| self.fit(i, e.len())).collect::<Result<_, _>>()?;
        let rows = texts.len();
        let len = lengths.iter().copied().max().unwrap_or(0);
        let mut ids = vec![0u32; rows * len];
        let mut type_ids = vec![0u32; rows * len];
        for (r, e) in encodings.iter().enumerate() {
            ids[r * len..r * len + e.len()].copy_from_slice(e.get_ids());
            type_ids[r * len..r * len + e.len()].copy_from_slice(e.get_type_ids());
        }
        Ok(TokenBatch { rows, len, ids, type_ids, lengths })
    }
}
