//! The prefix cache's names for KV blocks (vLLM's automatic prefix caching): the `i`-th full
//! block of a prompt is named by a hash chained over every token up to its end — the hash of the
//! block before, and its own tokens — seeded with the model version, so that two prompts share a
//! block only when they agree on every token before it, under the same weights. A sequence whose
//! prompt starts with cached blocks takes them read-only ([`super::kv::BlockPool::share`]) when
//! it is admitted, and computes from the first token after them.
//!
//! The hash is 64 bits (SipHash, Rust's own keyed hash with fixed keys): two different prefixes
//! of one model collide with odds of about one in 2⁶⁴ per pair, as in vLLM's default.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// The chained hashes of a prompt's full blocks, first block first; the default (`None`) for a
/// sequence that neither uses nor fills the cache (the cache is off).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prefix(Option<Arc<[u64]>>);

/// What a model version's hashes start from: its name and version (the KV of one model never
/// serves another's prompt).
pub fn seed(model: &str, version: &str) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    (model, version).hash(&mut h);
    h.finish()
}

impl Prefix {
    /// The hashes of the full blocks of `tokens`, `block_size` tokens each, chained from `seed`.
    pub fn of(seed: u64, tokens: &[u32], block_size: u32) -> Prefix {
        let mut last = seed;
        let hashes = tokens
            .chunks_exact(block_size.max(1) as usize)
            .map(|block| {
                let mut h = std::hash::DefaultHasher::new();
                last.hash(&mut h);
                block.hash(&mut h);
                last = h.finish();
                last
            })
            .collect();
        Prefix(Some(hashes))
    }

    pub fn blocks(&self) -> &[u64] {
        self.0.as_deref().unwrap_or_default()
    }

    /// Whether the cache is asked (a prompt shorter than a block is asked, and has no blocks).
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_named_by_every_token_up_to_its_end() {
        let a = Prefix::of(1, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
        assert_eq!(a.blocks().len(), 2, "the partial last block has no name");
        let b = Prefix::of(1, &[1, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(a, b, "the same full blocks, the same names");
        let c = Prefix::of(1, &[0, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_ne!(a.blocks()[0], c.blocks()[0]);
        assert_ne!(a.blocks()[1], c.blocks()[1], "a block after a different one is different");
        let d = Prefix::of(1, &[5, 6, 7, 8, 1, 2, 3, 4], 4);
        assert_ne!(a.blocks()[1], d.blocks()[0], "the same tokens at another place are another block");
        let e = Prefix::of(2, &[1, 2, 3, 4], 4);
        assert_ne!(a.blocks()[0], e.blocks()[0], "another model version's blocks are its own");
        assert_ne!(seed("m", "v1"), seed("m", "v2"));
        let short = Prefix::of(1, &[1, 2, 3], 4);
        assert!(short.blocks().is_empty() && short.is_on(), "a short prompt is asked, and has no full block");
        assert!(!Prefix::default().is_on());
    }
}
