//! KV-cache blocks, as the scheduler accounts for them: the engine's cache is `blocks` pages of
//! `block_size` tokens each (vLLM's paged attention); a sequence holds a table of pages, in
//! order, that grows as its tokens are computed and is given back whole when it finishes, is
//! cancelled or preempted. The engine is told each sequence's table with every step, so the pages
//! the scheduler hands out are the very pages the engine writes.

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

/// The free blocks of one engine's cache. Blocks are handed out lowest first, so that a short
/// trace uses the first pages and a test can read the tables.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: u32,
    total: u32,
    /// Free blocks, the next to hand out last.
    free: Vec<Block>,
    /// Which blocks some table holds, for the debug check that none is freed twice (searching
    /// `free` for each block given back made that check quadratic, and the simulations slow).
    #[cfg(debug_assertions)]
    held: Vec<bool>,
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
            free: (0..total).rev().collect(),
            #[cfg(debug_assertions)]
            held: vec![false; total as usize],
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    pub fn free(&self) -> u32 {
        self.free.len() as u32
    }

    pub fn used(&self) -> u32 {
        self.total - self.free()
    }

    /// Blocks a table of `held` blocks still needs to hold `tokens` tokens.
    pub fn needed(&self, held: usize, tokens: u32) -> u32 {
        blocks_for(tokens, self.block_size).saturating_sub(held as u32)
    }

    /// Grows `table` to hold `tokens` tokens; false (and nothing taken) when too few are free.
    pub fn grow(&mut self, table: &mut Vec<Block>, tokens: u32) -> bool {
        let needed = self.needed(table.len(), tokens) as usize;
        if needed > self.free.len() {
            return false;
        }
        let at = self.free.len() - needed;
        #[cfg(debug_assertions)]
        for &b in &self.free[at..] {
            self.held[b as usize] = true;
        }
        table.extend(self.free.drain(at..).rev());
        true
    }

    /// Gives a whole table back.
    pub fn release(&mut self, table: &mut Vec<Block>) {
        #[cfg(debug_assertions)]
        for &b in table.iter() {
            assert!(b < self.total && std::mem::take(&mut self.held[b as usize]), "block {b} freed twice");
        }
        self.free.extend(table.drain(..).rev());
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
    }
}
