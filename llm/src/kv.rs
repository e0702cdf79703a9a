//! The paged KV cache: the keys and values of every layer, in the blocks the generation
//! scheduler hands out. A sequence's position `p` lives in block
//! `table[p / block_size]`, slot `p % block_size`; the engine never decides where anything goes.
//!
//! Keys and values are held in f16 (the default: twice the tokens in the same memory, as vLLM's
//! and llama.cpp's caches hold them) or in f32 (exact); attention reads either into f32.
//!
//! The store is allocated zeroed in one piece per tensor, so the operating system maps pages only
//! as blocks are first written: a cache sized for the whole memory budget costs nothing until used.

use half::f16;
use half::slice::HalfFloatSliceExt;
use half::vec::HalfBitsVecExt;

/// What the cache holds its keys and values in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F16,
    F32,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        })
    }
}

#[derive(Debug)]
enum Store {
    F16 { keys: Vec<f16>, values: Vec<f16> },
    F32 { keys: Vec<f32>, values: Vec<f32> },
}

/// One layer's keys and values, `[slot][kv_dim]`, as held.
#[derive(Debug, Clone, Copy)]
pub enum LayerKv<'a> {
    F16(&'a [f16], &'a [f16]),
    F32(&'a [f32], &'a [f32]),
}

/// Cached rows read into f32: keys or values of one type.
pub trait Row: Copy + Send + Sync {
    /// `out` (f32) from `row`.
    fn read(row: &[Self], out: &mut [f32]);
    /// The row as halves, if it is (for kernels that convert them in registers).
    fn halves(_row: &[Self]) -> Option<&[f16]> {
        None
    }
}

impl Row for f32 {
    fn read(row: &[f32], out: &mut [f32]) {
        out.copy_from_slice(row);
    }
}

impl Row for f16 {
    fn read(row: &[f16], out: &mut [f32]) {
        // half converts with F16C where the CPU has it.
        row.convert_to_f32_slice(out);
    }

    fn halves(row: &[f16]) -> Option<&[f16]> {
        Some(row)
    }
}

#[derive(Debug)]
pub struct KvCache {
    pub blocks: usize,
    pub block_size: usize,
    kv_dim: usize,
    /// `[layer][block × block_size + slot][kv_dim]`, keys and values apart.
    store: Store,
    layer_stride: usize,
}

impl KvCache {
    /// Bytes one token's keys and values take over all layers.
    pub fn bytes_per_token(layers: usize, kv_dim: usize, dtype: KvDtype) -> usize {
        2 * layers * kv_dim * dtype.bytes()
    }

    pub fn new(layers: usize, kv_dim: usize, blocks: usize, block_size: usize, dtype: KvDtype) -> KvCache {
        let layer_stride = blocks * block_size * kv_dim;
        let n = layers * layer_stride;
        let store = match dtype {
            // Zeroed as u16 (a zeroed allocation, mapped as written), read as f16's bits.
            KvDtype::F16 => {
                Store::F16 { keys: vec![0u16; n].reinterpret_into(), values: vec![0u16; n].reinterpret_into() }
            }
            KvDtype::F32 => Store::F32 { keys: vec![0.0; n], values: vec![0.0; n] },
        };
        KvCache { blocks, block_size, kv_dim, store, layer_stride }
    }

    pub fn dtype(&self) -> KvDtype {
        match self.store {
            Store::F16 { .. } => KvDtype::F16,
            Store::F32 { .. } => KvDtype::F32,
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
    pub fn layer(&self, layer: usize) -> LayerKv<'_> {
        let r = layer * self.layer_stride..(layer + 1) * self.layer_stride;
        match &self.store {
            Store::F16 { keys, values } => LayerKv::F16(&keys[r.clone()], &values[r]),
            Store::F32 { keys, values } => LayerKv::F32(&keys[r.clone()], &values[r]),
        }
    }

    /// Writes one token's key and value at `slot` of `layer`.
    pub fn write(&mut self, layer: usize, slot: usize, key: &[f32], value: &[f32]) {
        let at = layer * self.layer_stride + slot * self.kv_dim;
        let d = self.kv_dim;
        match &mut self.store {
            Store::F16 { keys, values } => {
                keys[at..at + d].convert_from_f32_slice(key);
                values[at..at + d].convert_from_f32_slice(value);
            }
            Store::F32 { keys, values } => {
                keys[at..at + d].copy_from_slice(key);
                values[at..at + d].copy_from_slice(value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An f16 cache takes half the bytes a token of an f32 one and reads back what was written
    /// to f16's precision; the f32 one reads it back exactly.
    #[test]
    fn f16_holds_twice_the_tokens_and_reads_back_within_its_precision() {
        assert_eq!(
            KvCache::bytes_per_token(30, 192, KvDtype::F16) * 2,
            KvCache::bytes_per_token(30, 192, KvDtype::F32)
        );
        let key: Vec<f32> = (0..8).map(|i| (i as f32 - 3.5) * 0.731).collect();
        let value: Vec<f32> = key.iter().map(|k| k * 1e3).collect();
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let mut cache = KvCache::new(2, 8, 4, 2, dtype);
            assert_eq!(cache.dtype(), dtype);
            let slot = cache.slot(&[3, 1], 3).unwrap();
            assert_eq!(slot, 3);
            cache.write(1, slot, &key, &value);
            let (mut k, mut v) = (vec![0.0; 8], vec![0.0; 8]);
            match cache.layer(1) {
                LayerKv::F16(keys, values) => {
                    Row::read(&keys[slot * 8..][..8], &mut k);
                    Row::read(&values[slot * 8..][..8], &mut v);
                }
                LayerKv::F32(keys, values) => {
                    Row::read(&keys[slot * 8..][..8], &mut k);
                    Row::read(&values[slot * 8..][..8], &mut v);
                }
            }
            let tolerance = if dtype == KvDtype::F16 { 1.0 / 1024.0 } else { 0.0 };
            for (got, want) in k.iter().zip(&key).chain(v.iter().zip(&value)) {
                assert!((got - want).abs() <= tolerance * want.abs(), "{dtype}: {got} against {want}");
            }
            // Layer 0 and the other slots are untouched.
            match cache.layer(0) {
                LayerKv::F16(keys, _) => assert!(keys.iter().all(|x| x.to_f32() == 0.0)),
                LayerKv::F32(keys, _) => assert!(keys.iter().all(|x| *x == 0.0)),
            }
        }
    }
}
