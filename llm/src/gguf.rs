//! GGUF, llama.cpp's model file (version 2 and 3): metadata, tensor directory, and the tensors
//! as stored ([`Gguf::raw`]) or dequantized to f32 ([`Gguf::tensor`]). A file on disk is
//! memory-mapped, not read: the decoder copies out the blocks it computes on, and the pages of
//! the rest are never brought in.
//!
//! Written by hand: the format is a short header of typed key-value pairs and a tensor table
//! (github.com/ggml-org/ggml/blob/master/docs/gguf.md), and no maintained Rust crate reads it
//! without pulling in a whole tensor framework (candle). The block formats decoded here are the
//! ones Llama-family files ship in: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and
//! Q6_K. A file with any other type in a tensor the decoder needs is refused at load, naming the
//! tensor and its type.

use std::collections::HashMap;
use std::path::Path;

use half::{bf16, f16};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Uint(u64),
    Int(i64),
    Float(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Uint(v) => Some(v),
            Value::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Float(v) => Some(v),
            Value::Uint(v) => Some(v as f64),
            Value::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// ggml's tensor element types this reader decodes (ggml.h's `ggml_type` numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    /// The k-quants: super-blocks of 256 values in 8 or 16 sub-blocks, each with its own scale.
    Q4K,
    Q5K,
    Q6K,
    Bf16,
    /// Any other ggml type, by number: listed, never decoded.
    Other(u32),
}

impl Kind {
    fn from_code(code: u32) -> Kind {
        match code {
            0 => Kind::F32,
            1 => Kind::F16,
            2 => Kind::Q4_0,
            3 => Kind::Q4_1,
            6 => Kind::Q5_0,
            7 => Kind::Q5_1,
            8 => Kind::Q8_0,
            12 => Kind::Q4K,
            13 => Kind::Q5K,
            14 => Kind::Q6K,
            30 => Kind::Bf16,
            other => Kind::Other(other),
        }
    }

    /// Elements per block and bytes per block.
    pub fn block(self) -> Option<(usize, usize)> {
        match self {
            Kind::F32 => Some((1, 4)),
            Kind::F16 | Kind::Bf16 => Some((1, 2)),
            Kind::Q4_0 => Some((32, 18)),
            Kind::Q4_1 => Some((32, 20)),
            Kind::Q5_0 => Some((32, 22)),
            Kind::Q5_1 => Some((32, 24)),
            Kind::Q8_0 => Some((32, 34)),
            Kind::Q4K => Some((256, 144)),
            Kind::Q5K => Some((256, 176)),
            Kind::Q6K => Some((256, 210)),
            Kind::Other(_) => None,
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kind::F32 => f.write_str("F32"),
            Kind::F16 => f.write_str("F16"),
            Kind::Q4_0 => f.write_str("Q4_0"),
            Kind::Q4_1 => f.write_str("Q4_1"),
            Kind::Q5_0 => f.write_str("Q5_0"),
            Kind::Q5_1 => f.write_str("Q5_1"),
            Kind::Q8_0 => f.write_str("Q8_0"),
            Kind::Q4K => f.write_str("Q4_K"),
            Kind::Q5K => f.write_str("Q5_K"),
            Kind::Q6K => f.write_str("Q6_K"),
            Kind::Bf16 => f.write_str("BF16"),
            Kind::Other(n) => {
                write!(f, "ggml type {n} (not one of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)")
            }
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// ggml's order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    pub kind: Kind,
    /// From the start of the data section.
    offset: u64,
}

impl TensorInfo {
    /// Its element count (the directory check refuses a file where this overflows).
    pub fn elements(&self) -> u64 {
        self.dims.iter().try_fold(1u64, |n, d| n.checked_mul(*d)).unwrap_or(u64::MAX)
    }
}

/// A parsed GGUF file, its bytes kept for the tensors.
pub struct Gguf {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    bytes: Bytes,
    data: usize,
}

/// The file's bytes: mapped from a regular file, or read (a pipe, or a file built in memory).
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

const MAGIC: &[u8; 4] = b"GGUF";
/// Keys, strings and arrays longer than this are a damaged file, not a model.
const MAX_LENGTH: u64 = 1 << 30;

impl Gguf {
    /// Maps a regular file (reads anything else, a named pipe say, whole).
    pub fn open(path: &Path) -> Result<Gguf, String> {
        let file = std::fs::File::open(path).map_err(|e| format!("cannot read: {e}"))?;
        let regular = file.metadata().map_err(|e| format!("cannot read: {e}"))?.is_file();
        if !regular {
            let bytes = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
            return Gguf::parse(bytes);
        }
        Gguf::from_bytes(Bytes::Mapped(map(&file)?))
    }

    /// Parses a file held in memory.
    pub fn parse(bytes: Vec<u8>) -> Result<Gguf, String> {
        Gguf::from_bytes(Bytes::Owned(bytes))
    }

    /// Parses the header and the tensor directory; every tensor's extent is checked against the
    /// file's length here, so that reading one later cannot run past the end.
    fn from_bytes(bytes: Bytes) -> Result<Gguf, String> {
        let mut r = Reader { bytes: &bytes, at: 0, depth: 0 };
        if r.take(4)? != MAGIC {
            return Err("not a GGUF file (its first four bytes are not 'GGUF')".into());
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(format!("GGUF version {version}; this reader takes versions 2 and 3"));
        }
        let tensor_count = r.u64()?;
        let kv_count = r.u64()?;
        let mut metadata = HashMap::new();
        for _ in 0..kv_count {
            let key = r.string()?;
            let kind = r.u32()?;
            let value = r.value(kind).map_err(|e| format!("metadata '{key}': {e}"))?;
            metadata.insert(key, value);
        }
        let mut tensors = HashMap::new();
        for _ in 0..tensor_count {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims > 4 {
                return Err(format!("tensor '{name}' has {n_dims} dimensions; GGUF allows at most 4"));
            }
            let dims = (0..n_dims).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
            let kind = Kind::from_code(r.u32()?);
            let offset = r.u64()?;
            tensors.insert(name, TensorInfo { dims, kind, offset });
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => v.as_u64().filter(|a| *a > 0).ok_or("metadata 'general.alignment' is not a positive integer")?,
        } as usize;
        let data = r.at.div_ceil(alignment) * alignment;
        for (name, t) in &tensors {
            if let Some((per_block, block_bytes)) = t.kind.block() {
                let n = t.dims.iter().try_fold(1u64, |n, d| n.checked_mul(*d)).ok_or_else(|| {
                    format!("tensor '{name}' has dims {:?}, more elements than any file holds", t.dims)
                })?;
                if n % per_block as u64 != 0 {
                    return Err(format!("tensor '{name}': {n} elements is not a whole number of {} blocks", t.kind));
                }
                let end = (n / per_block as u64)
                    .checked_mul(block_bytes as u64)
                    .and_then(|size| size.checked_add(t.offset))
                    .and_then(|e| e.checked_add(data as u64))
                    .unwrap_or(u64::MAX);
                if end > bytes.len() as u64 {
                    return Err(format!(
                        "tensor '{name}' ends at byte {end}, past the end of the file ({} bytes): the file is truncated",
                        bytes.len()
                    ));
                }
            }
        }
        Ok(Gguf { version, metadata, tensors, bytes, data })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A tensor's elements as f32, in ggml's order (row-major with `dims[0]` innermost).
    pub fn tensor(&self, name: &str) -> Result<Vec<f32>, String> {
        let (kind, raw) = self.raw(name)?;
        Ok(dequantize(kind, raw, self.tensors[name].elements() as usize))
    }

    /// A tensor's blocks as the file stores them, and their format.
    pub fn raw(&self, name: &str) -> Result<(Kind, &[u8]), String> {
        let t = self.tensors.get(name).ok_or_else(|| format!("tensor '{name}' is missing"))?;
        let (per_block, block_bytes) =
            t.kind.block().ok_or_else(|| format!("tensor '{name}' is of {}; it cannot be read", t.kind))?;
        let n = t.elements() as usize;
        let start = self.data + t.offset as usize;
        Ok((t.kind, &self.bytes[start..start + n / per_block * block_bytes]))
    }
}

/// Maps `file` read-only.
#[allow(unsafe_code)]
fn map(file: &std::fs::File) -> Result<memmap2::Mmap, String> {
    // SAFETY: the map is read-only and private to this process; what memmap2 cannot rule out is
    // another process truncating or rewriting the model file while it is mapped, which would
    // change or fault the bytes read. A model file is replaced, not edited in place, and Ferry
    // copies out what it computes on while loading, as llama.cpp's mmap does.
    unsafe { memmap2::Mmap::map(file) }.map_err(|e| format!("cannot map: {e}"))
}

/// Decodes `n` elements of `kind` from `raw` (whose length the directory check guarantees).
pub(crate) fn dequantize(kind: Kind, raw: &[u8], n: usize) -> Vec<f32> {
    let half = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
    let mut out = Vec::with_capacity(n);
    match kind {
        Kind::F32 => out.extend(raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        Kind::F16 => out.extend(raw.chunks_exact(2).map(half)),
        Kind::Bf16 => out.extend(raw.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())),
        // 32 values: an f16 scale, then 32 signed bytes.
        Kind::Q8_0 => {
            for block in raw.chunks_exact(34) {
                let d = half(&block[..2]);
                out.extend(block[2..].iter().map(|&q| f32::from(q as i8) * d));
            }
        }
        // 32 values: an f16 scale, then 16 bytes whose low nibbles are values 0..16 and high
        // nibbles values 16..32, each offset by 8.
        Kind::Q4_0 => {
            for block in raw.chunks_exact(18) {
                let d = half(&block[..2]);
                let qs = &block[2..];
                out.extend(qs.iter().map(|&q| (f32::from(q & 0x0f) - 8.0) * d));
                out.extend(qs.iter().map(|&q| (f32::from(q >> 4) - 8.0) * d));
            }
        }
        // 32 values: an f16 scale and an f16 minimum, then the nibbles as for Q4_0, unsigned.
        Kind::Q4_1 => {
            for block in raw.chunks_exact(20) {
                let (d, m) = (half(&block[..2]), half(&block[2..4]));
                let qs = &block[4..];
                out.extend(qs.iter().map(|&q| f32::from(q & 0x0f) * d + m));
                out.extend(qs.iter().map(|&q| f32::from(q >> 4) * d + m));
            }
        }
        // 32 values: an f16 scale, 32 fifth bits, then the low nibbles as for Q4_0; offset by 16.
        Kind::Q5_0 => {
            for block in raw.chunks_exact(22) {
                let d = half(&block[..2]);
                let five = fifth_bits(&block[2..6], &block[6..]);
                out.extend(five.iter().map(|&q| (f32::from(q) - 16.0) * d));
            }
        }
        // 32 values: an f16 scale and an f16 minimum, then as Q5_0, unsigned.
        Kind::Q5_1 => {
            for block in raw.chunks_exact(24) {
                let (d, m) = (half(&block[..2]), half(&block[2..4]));
                let five = fifth_bits(&block[4..8], &block[8..]);
                out.extend(five.iter().map(|&q| f32::from(q) * d + m));
            }
        }
        Kind::Q4K | Kind::Q5K => {
            let five = kind == Kind::Q5K;
            for block in raw.chunks_exact(if five { 176 } else { 144 }) {
                super_block_45(block, five, &mut out);
            }
        }
        Kind::Q6K => {
            for block in raw.chunks_exact(210) {
                super_block_6(block, &mut out);
            }
        }
        Kind::Other(_) => unreachable!("refused before decoding"),
    }
    out
}

/// Q5_0's and Q5_1's 32 values of 5 bits: bit `j` of the little-endian `qh` tops value `j`;
/// `qs`' low nibbles are values 0..16, its high nibbles values 16..32.
fn fifth_bits(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut v = [0u8; 32];
    for (j, &q) in qs.iter().enumerate() {
        v[j] = (q & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        v[j + 16] = (q >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    v
}

/// One Q4_K or Q5_K super-block of 256 values: an f16 scale `d` and minimum `dmin`, 12 bytes
/// holding eight 6-bit scales and eight 6-bit minimums (one pair per 32 values), then (Q5_K) 32
/// bytes of fifth bits, then 128 bytes of nibbles — each 32 bytes giving 64 values, low nibbles
/// first. A value is `d·scale·q − dmin·min`.
fn super_block_45(block: &[u8], five: bool, out: &mut Vec<f32>) {
    let half = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
    let (d, dmin) = (half(&block[..2]), half(&block[2..4]));
    let packed = &block[4..16];
    let (qh, qs) = if five { (&block[16..48], &block[48..]) } else { (&[][..], &block[16..]) };
    // ggml's get_scale_min_k4: the first four pairs are the low 6 bits of bytes 0..4 and 4..8;
    // the last four take their low 4 bits from bytes 8..12 and their top 2 from the first eight.
    let scale_min = |j: usize| -> (f32, f32) {
        let (sc, m) = if j < 4 {
            (packed[j] & 63, packed[j + 4] & 63)
        } else {
            ((packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4), (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4))
        };
        (f32::from(sc), f32::from(m))
    };
    for chunk in 0..4 {
        let q = &qs[chunk * 32..(chunk + 1) * 32];
        for (sub, shift) in [(2 * chunk, 0), (2 * chunk + 1, 4)] {
            let (sc, m) = scale_min(sub);
            let (scale, min) = (d * sc, dmin * m);
            for (l, &byte) in q.iter().enumerate() {
                let mut v = (byte >> shift) & 0x0f;
                if five && qh[l] & (1 << sub) != 0 {
                    v += 16;
                }
                out.push(scale * f32::from(v) - min);
            }
        }
    }
}

/// One Q6_K super-block of 256 values: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs,
/// sixteen signed 8-bit scales (one per 16 values), then an f16 scale `d`. A value is
/// `d·scale·(q − 32)`. Each half of 128 values takes 64 low-nibble bytes and 32 high bytes: value
/// `l + 32k` (l < 32, k < 4) is nibble `k / 2` of byte `l + 32·(k % 2)`, topped by bits `2k`.
fn super_block_6(block: &[u8], out: &mut Vec<f32>) {
    let (ql, qh, scales) = (&block[..128], &block[128..192], &block[192..208]);
    let d = f16::from_le_bytes([block[208], block[209]]).to_f32();
    for half in 0..2 {
        let (ql, qh, scales) = (&ql[half * 64..], &qh[half * 32..], &scales[half * 8..]);
        for k in 0..4 {
            for l in 0..32 {
                let low = (ql[l + 32 * (k % 2)] >> (4 * (k / 2))) & 0x0f;
                let high = (qh[l] >> (2 * k)) & 3;
                let q = i32::from(low | (high << 4)) - 32;
                let scale = f32::from(scales[l / 16 + 2 * k] as i8);
                out.push(d * scale * q as f32);
            }
        }
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    depth: u32,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.bytes.len()).ok_or_else(|| {
            format!("the header runs past the end of the file (byte {} of {})", self.at, self.bytes.len())
        })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.take(N)?.try_into().expect("took N bytes"))
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn length(&mut self) -> Result<usize, String> {
        let n = self.u64()?;
        if n > MAX_LENGTH {
            return Err(format!("a length of {n} (at byte {}) is past any real file's", self.at - 8));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String, String> {
        let n = self.length()?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| format!("a string at byte {} is not UTF-8", self.at - n))
    }

    fn value(&mut self, kind: u32) -> Result<Value, String> {
        Ok(match kind {
            0 => Value::Uint(self.array::<1>()?[0].into()),
            1 => Value::Int((self.array::<1>()?[0] as i8).into()),
            2 => Value::Uint(u16::from_le_bytes(self.array()?).into()),
            3 => Value::Int(i16::from_le_bytes(self.array()?).into()),
            4 => Value::Uint(self.u32()?.into()),
            5 => Value::Int(i32::from_le_bytes(self.array()?).into()),
            6 => Value::Float(f32::from_le_bytes(self.array()?).into()),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                // Arrays of arrays nest one level in real files; a deep nest is damage.
                self.depth += 1;
                if self.depth > 4 {
                    return Err("arrays nested more than 4 deep".into());
                }
                let inner = self.u32()?;
                let n = self.length()?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(inner)?);
                }
                self.depth -= 1;
                Value::Array(items)
            }
            10 => Value::Uint(self.u64()?),
            11 => Value::Int(i64::from_le_bytes(self.array()?)),
            12 => Value::Float(f64::from_le_bytes(self.array()?)),
            other => return Err(format!("value type {other} is not one of GGUF's (0 to 12)")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF file written byte by byte, from the format's description.
    fn file(tensors: &[(&str, &[u64], u32, Vec<u8>)]) -> Vec<u8> {
        fn string(out: &mut Vec<u8>, s: &str) {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        }
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend(2u64.to_le_bytes());
        string(&mut out, "general.architecture");
        out.extend(8u32.to_le_bytes());
        string(&mut out, "llama");
        string(&mut out, "llama.rope.freq_base");
        out.extend(6u32.to_le_bytes());
        out.extend(10000.0f32.to_le_bytes());
        let mut offset = 0u64;
        for (name, dims, kind, data) in tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in *dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(kind.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        for (_, _, _, data) in tensors {
            out.extend(data);
            while !out.len().is_multiple_of(32) {
                out.push(0);
            }
        }
        out
    }

    #[test]
    fn reads_metadata_and_decodes_every_block_format() {
        let h = |x: f32| f16::from_f32(x).to_le_bytes();
        // Q8_0: scale 0.5, values -64..-32.
        let mut q8 = h(0.5).to_vec();
        q8.extend((0..32).map(|i| (i as i8 - 64) as u8));
        // Q4_0: scale 2, nibbles: low = i % 16, high = 15 - i % 16.
        let mut q40 = h(2.0).to_vec();
        q40.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        // Q4_1: scale 0.25, minimum -1.
        let mut q41 = h(0.25).to_vec();
        q41.extend(h(-1.0));
        q41.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        let f32s: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        let f16s: Vec<u8> = [0.5f32, 3.0].iter().flat_map(|&x| h(x)).collect();
        let bf16s: Vec<u8> = [0.5f32, -8.0].iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect();
        let bytes = file(&[
            ("q8", &[32], 8, q8),
            ("q40", &[16, 2], 2, q40),
            ("q41", &[32], 3, q41),
            ("f32", &[2], 0, f32s),
            ("f16", &[2], 1, f16s),
            ("bf16", &[2], 30, bf16s),
        ]);
        let g = Gguf::parse(bytes).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.get("general.architecture").and_then(Value::as_str), Some("llama"));
        assert_eq!(g.get("llama.rope.freq_base").and_then(Value::as_f64), Some(10000.0));
        assert_eq!(g.tensors["q40"].dims, vec![16, 2]);

        let q8 = g.tensor("q8").unwrap();
        assert_eq!(q8[0], -32.0);
        assert_eq!(q8[31], -16.5);
        let q40 = g.tensor("q40").unwrap();
        assert_eq!(q40.len(), 32);
        assert_eq!((q40[0], q40[1], q40[15]), ((0.0 - 8.0) * 2.0, (1.0 - 8.0) * 2.0, (15.0 - 8.0) * 2.0));
        assert_eq!((q40[16], q40[31]), ((15.0 - 8.0) * 2.0, (0.0 - 8.0) * 2.0));
        let q41 = g.tensor("q41").unwrap();
        assert_eq!((q41[0], q41[15], q41[16], q41[31]), (-1.0, 2.75, 2.75, -1.0));
        assert_eq!(g.tensor("f32").unwrap(), vec![1.5, -2.0]);
        assert_eq!(g.tensor("f16").unwrap(), vec![0.5, 3.0]);
        assert_eq!(g.tensor("bf16").unwrap(), vec![0.5, -8.0]);
    }

    #[test]
    fn damaged_files_are_refused_with_the_reason() {
        assert!(Gguf::parse(b"GGML\x03\0\0\0".to_vec()).unwrap_err().contains("not a GGUF file"));
        let mut v1 = b"GGUF".to_vec();
        v1.extend(1u32.to_le_bytes());
        assert!(Gguf::parse(v1).unwrap_err().contains("version 1"));
        // A tensor that claims more bytes than the file holds.
        let mut truncated = file(&[("t", &[64], 0, vec![0; 256])]);
        truncated.truncate(truncated.len() - 100);
        let e = Gguf::parse(truncated).unwrap_err();
        assert!(e.contains("tensor 't'") && e.contains("truncated"), "{e}");
        // A type this reader does not decode (IQ2_XXS) is listed, and refused when read.
        let g = Gguf::parse(file(&[("k", &[256], 16, vec![0; 66])])).unwrap();
        let e = g.tensor("k").unwrap_err();
        assert!(e.contains("tensor 'k'") && e.contains("ggml type 16") && e.contains("Q6_K"), "{e}");
        assert!(g.tensor("absent").unwrap_err().contains("missing"));
    }
}
