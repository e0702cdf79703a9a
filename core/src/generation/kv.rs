//! KV-cache blocks, as the scheduler accounts for them: the engine's cache is `blocks` pages of
//! `block_size` tokens each (vLLM's paged attention); a sequence holds a table of pages, in
//! order, that grows as its tokens are computed and is given back whole when it finishes, is
//! cancelled or preempted. The engine is told each sequence's table with every step, so the pages
//! the scheduler hands out are the very pages the engine writes.
//!
//! With the prefix cache ([`super::prefix`]) a full block whose tokens are known is also named by
//! its [`super::prefix::Prefix`] hash: a table may then hold, read-only, a block another table
//! holds (counted by references), and a block no table holds any more keeps its KV, cached, until
//! the pool needs it for a new block — the least recently given back first. A cached block that
//! no table holds is free: it counts as free for the watermark and the forecasts, and is handed
//! out (its hash forgotten) once no empty block is left.

use std::collections::{BTreeMap, HashMap};

/// A block of the engine's KV cache, by index.
pub type Block = u32;

/// How many blocks hold `tokens` tokens.
pub fn blocks_for(tokens: u32, block_size: u32) -> u32 {
    tokens.div_ceil(block_size)
}

/// The blocks a new sequence must leave free for the running decodes (the scheduler's
/// `watermark`): 1 % of a cache of `blocks`, at least one, never all.
pub fn watermark(blocks: u32) -> u32 {
    (blocks / 100).max(1).min(blocks.saturating_sub(1))
}

/// The blocks of one engine's cache: who holds each, which are cached, which are free. Empty
/// blocks are handed out lowest first, so that a short trace uses the first pages and a test can
/// read the tables.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: u32,
    total: u32,
    /// Tables holding each block.
    refs: Vec<u32>,
    /// All references, for the forecasts (a block held twice comes back once).
    references: u64,
    /// Free blocks that hold nothing cached, the next to hand out last.
    empty: Vec<Block>,
    /// The hash each cached block holds the KV of, and the block of each hash.
    hashes: Vec<Option<u64>>,
    index: HashMap<u64, Block>,
    /// Cached blocks no table holds, by when they were given back (the least recent first), and
    /// the stamp each sits under.
    idle: BTreeMap<u64, Block>,
    stamps: Vec<u64>,
    clock: u64,
}

impl BlockPool {
    /// A cache of `total` blocks of `block_size` tokens.
    ///
    /// # Panics
    /// When `block_size` is 0.
    pub fn new(total: u32, block_size: u32) -> Self {
        assert!(block_size > 0, "a KV block holds at least one token");
        BlockPool {
            block_size,
            total,
            refs: vec![0; total as usize],
            references: 0,
            empty: (0..total).rev().collect(),
            hashes: vec![None; total as usize],
            index: HashMap::new(),
            idle: BTreeMap::new(),
            stamps: vec![0; total as usize],
            clock: 0,
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    /// Blocks no table holds: empty ones and cached ones.
    pub fn free(&self) -> u32 {
        (self.empty.len() + self.idle.len()) as u32
    }

    /// Blocks some table holds.
    pub fn used(&self) -> u32 {
        self.total - self.free()
    }

    /// Free blocks that keep a cached prefix's KV.
    pub fn cached_free(&self) -> u32 {
        self.idle.len() as u32
    }

    /// References beyond the first to the blocks in use: blocks that come back to the pool only
    /// when the last of several tables that hold them is given back.
    pub fn shared(&self) -> u64 {
        self.references - u64::from(self.used())
    }

    /// Tables that hold `block`.
    pub fn references(&self, block: Block) -> u32 {
        self.refs[block as usize]
    }

    /// Blocks a table of `held` blocks still needs to hold `tokens` tokens.
    pub fn needed(&self, held: usize, tokens: u32) -> u32 {
        blocks_for(tokens, self.block_size).saturating_sub(held as u32)
    }

    /// Grows `table` to hold `tokens` tokens; false (and nothing taken) when too few are free.
    /// Empty blocks go first; then the cached block given back longest ago loses its hash.
    pub fn grow(&mut self, table: &mut Vec<Block>, tokens: u32) -> bool {
        let needed = self.needed(table.len(), tokens);
        if needed > self.free() {
            return false;
        }
        for _ in 0..needed {
            let block = match self.empty.pop() {
                Some(block) => block,
                None => self.evict(),
            };
            self.hold(block);
            table.push(block);
        }
        true
    }

    /// The least recently given back cached block, its hash forgotten.
    fn evict(&mut self) -> Block {
        let (_, block) = self.idle.pop_first().expect("a free block when none is empty");
        let hash = self.hashes[block as usize].take().expect("an idle block is cached");
        self.index.remove(&hash);
        block
    }

    fn hold(&mut self, block: Block) {
        let refs = &mut self.refs[block as usize];
        if *refs == 0 && self.hashes[block as usize].is_some() {
            self.idle.remove(&self.stamps[block as usize]);
        }
        *refs += 1;
        self.references += 1;
    }

    /// Gives a whole table back. Its last blocks go first, so that of a cached prompt the tail,
    /// which fewer prompts share, is evicted before its head.
    ///
    /// # Panics
    /// When a block of the table is not held (given back twice).
    pub fn release(&mut self, table: &mut Vec<Block>) {
        for block in table.drain(..).rev() {
            let refs = &mut self.refs[block as usize];
            assert!(*refs > 0, "block {block} freed twice");
            *refs -= 1;
            self.references -= 1;
            if *refs > 0 {
                continue;
            }
            if self.hashes[block as usize].is_some() {
                self.clock += 1;
                self.stamps[block as usize] = self.clock;
                self.idle.insert(self.clock, block);
            } else {
                self.empty.push(block);
            }
        }
    }

    /// How many of the leading blocks of `prefix` are cached, at most `most`.
    pub fn hits(&self, prefix: &[u64], most: usize) -> usize {
        prefix.iter().take(most).take_while(|h| self.index.contains_key(h)).count()
    }

    /// Appends to `table` the cached blocks of the leading hashes of `prefix` (at most `most`),
    /// each now held by one more table; returns how many.
    pub fn share(&mut self, table: &mut Vec<Block>, prefix: &[u64], most: usize) -> usize {
        let mut taken = 0;
        for hash in prefix.iter().take(most) {
            let Some(&block) = self.index.get(hash) else { break };
            self.hold(block);
            table.push(block);
            taken += 1;
        }
        taken
    }

    /// Names a held, full block by the hash of its tokens, so that later prompts that start with
    /// them find it. A hash cached already (two sequences computed the same tokens side by side)
    /// keeps its block; this one stays unnamed.
    pub fn cache(&mut self, block: Block, hash: u64) {
        debug_assert!(self.refs[block as usize] > 0, "only a held block is named");
        if self.hashes[block as usize].is_none() && !self.index.contains_key(&hash) {
            self.index.insert(hash, block);
            self.hashes[block as usize] = Some(hash);
        }
    }

    /// Checks the pool against the tables that hold its blocks: each block's references are the
    /// tables that hold it; each block is held, empty or cached-free, exactly one of them; a
    /// cached block is its hash's. For tests: it costs O(blocks).
    pub fn audit<'a>(&self, tables: impl Iterator<Item = &'a [Block]>) -> Result<(), String> {
        let mut refs = vec![0u32; self.total as usize];
        for table in tables {
            for &b in table {
                *refs.get_mut(b as usize).ok_or(format!("block {b} is not in the pool"))? += 1;
            }
        }
        if refs != self.refs {
            return Err("a block's references are not the tables that hold it".into());
        }
        if self.references != refs.iter().map(|r| u64::from(*r)).sum::<u64>() {
            return Err("the references do not add up".into());
        }
        // Where each free block is: 1 empty, 2 cached.
        let mut free = vec![0u8; self.total as usize];
        for (&b, place) in self.empty.iter().map(|b| (b, 1)).chain(self.idle.values().map(|b| (b, 2))) {
            if std::mem::replace(&mut free[b as usize], place) != 0 {
                return Err(format!("block {b} is free twice"));
            }
            if self.refs[b as usize] > 0 {
                return Err(format!("block {b} is both free and held"));
            }
        }
        for (b, ((place, refs), hash)) in free.iter().zip(&self.refs).zip(&self.hashes).enumerate() {
            if *place == 0 && *refs == 0 {
                return Err(format!("block {b} is neither held nor free"));
            }
            if *place == 1 && hash.is_some() {
                return Err(format!("empty block {b} is cached"));
            }
            if hash.is_some_and(|h| self.index.get(&h) != Some(&(b as Block))) {
                return Err(format!("cached block {b} is not its hash's"));
            }
        }
        if self.idle.iter().any(|(stamp, b)| self.stamps[*b as usize] != *stamp || self.hashes[*b as usize].is_none()) {
            return Err("an idle block is uncached or out of its place".into());
        }
        if self.index.len() != self.hashes.iter().flatten().count() {
            return Err("the index names blocks that are not cached".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_grow_by_whole_blocks_and_come_back_whole() {
        let mut pool = BlockPool::new(4, 16);
        let mut a = Vec::new();
        assert!(pool.grow(&mut a, 17));
        assert_eq!(a, vec![0, 1]);
        assert!(pool.grow(&mut a, 32), "32 tokens still fit in two blocks");
        assert_eq!((a.len(), pool.free()), (2, 2));
        let mut b = Vec::new();
        assert!(!pool.grow(&mut b, 49), "four blocks are needed, two are free");
        assert!(b.is_empty() && pool.free() == 2, "a refused growth takes nothing");
        assert!(pool.grow(&mut b, 20));
        assert_eq!(b, vec![2, 3]);
        pool.release(&mut a);
        assert!(a.is_empty());
        assert_eq!((pool.free(), pool.used()), (2, 2));
        assert!(pool.grow(&mut a, 1));
        assert_eq!(a, vec![0], "freed blocks are handed out again");
        pool.audit([a.as_slice(), b.as_slice()].into_iter()).unwrap();
    }

    #[test]
    fn a_cached_block_is_shared_then_kept_free_until_the_pool_needs_it() {
        let mut pool = BlockPool::new(4, 16);
        let mut a = Vec::new();
        assert!(pool.grow(&mut a, 40));
        pool.cache(a[0], 7);
        pool.cache(a[1], 8);
        let mut b = Vec::new();
        assert_eq!(pool.hits(&[7, 8, 9], 3), 2);
        assert_eq!(pool.hits(&[7, 8, 9], 1), 1, "no more than asked for");
        assert_eq!(pool.share(&mut b, &[7, 8, 9], 3), 2);
        assert_eq!(b, vec![0, 1]);
        assert_eq!((pool.used(), pool.shared()), (3, 2), "two blocks held twice count once as used");
        pool.audit([a.as_slice(), b.as_slice()].into_iter()).unwrap();
        pool.release(&mut a);
        assert_eq!((pool.used(), pool.free(), pool.cached_free()), (2, 2, 0), "b still holds the cached two");
        pool.release(&mut b);
        assert_eq!((pool.free(), pool.cached_free()), (4, 2), "cached blocks no table holds are free");
        pool.audit(std::iter::empty()).unwrap();
        let mut c = Vec::new();
        assert!(pool.grow(&mut c, 16 * 2));
        assert_eq!(c, vec![2, 3], "empty blocks go before cached ones");
        assert_eq!(pool.hits(&[7, 8], 2), 2);
        assert!(pool.grow(&mut c, 16 * 3));
        assert_eq!(c[2], 1, "then the one given back longest ago: the tail of the table went first");
        assert_eq!(pool.hits(&[7, 8], 2), 1, "its hash is forgotten");
        assert_eq!(pool.share(&mut c, &[7], 1), 1, "an idle cached block is held again");
        assert_eq!((pool.free(), pool.cached_free()), (0, 0));
        pool.audit([c.as_slice()].into_iter()).unwrap();
        pool.release(&mut c);
        pool.audit(std::iter::empty()).unwrap();
        assert_eq!(pool.free(), 4);
    }

    #[test]
    fn a_hash_cached_twice_keeps_its_first_block() {
        let mut pool = BlockPool::new(2, 4);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        assert!(pool.grow(&mut a, 4) && pool.grow(&mut b, 4));
        pool.cache(a[0], 1);
        pool.cache(b[0], 1);
        pool.release(&mut b);
        assert_eq!((pool.cached_free(), pool.free()), (0, 1), "b's block was never named: it is empty again");
        pool.audit([a.as_slice()].into_iter()).unwrap();
    }

    #[test]
    #[should_panic(expected = "freed twice")]
    fn a_block_given_back_twice_is_a_bug() {
        let mut pool = BlockPool::new(2, 4);
        let mut a = Vec::new();
        assert!(pool.grow(&mut a, 4));
        let mut copy = a.clone();
        pool.release(&mut a);
        pool.release(&mut copy);
    }
}
