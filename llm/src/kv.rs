//! The paged KV cache: the keys and values of every layer, in the blocks the generation
//! scheduler hands out. A sequence's position `p` lives in block
//! `table[p / block_size]`, slot `p % block_size`; the engine never decides where anything goes.
//!
//! The store is allocated zeroed in one piece per tensor, so the operating system maps pages only
//! as blocks are first written: a cache sized for the whole memory budget costs nothing until used.

#[derive(Debug)]
pub struct KvCache {
    pub blocks: usize,
    pub block_size: usize,
    kv_dim: usize,
    /// `[layer][block × block_size + slot][kv_dim]`, keys and values apart.
    keys: Vec<f32>,
    values: Vec<f32>,
    layer_stride: usize,
}

impl KvCache {
    /// Bytes one token's keys and values take over all layers.
    pub fn bytes_per_token(layers: usize, kv_dim: usize) -> usize {
        2 * layers * kv_dim * std::mem::size_of::<f32>()
    }

    pub fn new(layers: usize, kv_dim: usize, blocks: usize, block_size: usize) -> KvCache {
        let layer_stride = blocks * block_size * kv_dim;
        KvCache {
            blocks,
            block_size,
            kv_dim,
            keys: vec![0.0; layers * layer_stride],
            values: vec![0.0; layers * layer_stride],
            layer_stride,
        }
    }

    /// The cache slot of position `p` in a block table.
    pub fn slot(&self, table: &[u32], p: usize) -> Result<usize, String> {
        let b = self.block_size;
        let block = *table
            .get(p / b)
            .ok_or_else(|| format!("position {p} is beyond the block table ({} blocks of {b})", table.len()))?
            as usize;
        if block >= self.blocks {
            return Err(format!("block {block} is not in the cache ({} blocks)", self.blocks));
        }
        Ok(block * b + p % b)
    }

    /// One layer's keys and values, `[slot][kv_dim]`.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        let r = layer * self.layer_stride..(layer + 1) * self.layer_stride;
        (&self.keys[r.clone()], &self.values[r])
    }

    /// Writes one token's key and value at `slot` of `layer`.
    pub fn write(&mut self, layer: usize, slot: usize, key: &[f32], value: &[f32]) {
        let at = layer * self.layer_stride + slot * self.kv_dim;
        self.keys[at..at + self.kv_dim].copy_from_slice(key);
        self.values[at..at + self.kv_dim].copy_from_slice(value);
    }
}
