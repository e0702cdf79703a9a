//! Dot products on weights as their file stores them (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
//! Q6_K), the way llama.cpp computes them: the activations are quantized to 8 bits a value in
//! blocks of 32 ([`Q8`]: a scale and the sum of the block's integers), and each weight block's
//! integers are multiplied with them in integers, the two scales applied once a block. Decoding
//! reads every weight once a step: reading 4.5 or 8.5 bits a weight instead of 32 is most of the
//! speed.
//!
//! Written by hand: no maintained crate computes on GGUF's block formats outside a tensor
//! framework (candle, ggml's bindings). Each format unpacks a block of 32 weights to signed
//! bytes; the portable kernel multiplies them in plain Rust; on x86-64 (picked at run time) one
//! weight block is dotted with a tile of up to eight activation rows, 32 products an instruction
//! with AVX2 (`vpmaddubsw`, llama.cpp's method) or 64 with AVX-512 VNNI (`vpdpbusd`), the simple
//! formats unpacked in vector registers too. Tiles make the integer path faster than dequantizing
//! for the f32 GEMM at every batch size, prefills included.

use half::f16;

use crate::gguf::Kind;

/// Values a block of activations holds (and a block of the simple formats; a k-quant
/// super-block of 256 is eight of them).
pub const BLOCK: usize = 32;

/// Rows of activations quantized to 8 bits in blocks of [`BLOCK`]: `value ≈ d · q`, with the
/// block's `d · Σ q` kept for the formats whose weights carry an offset.
#[derive(Debug, Clone, PartialEq)]
pub struct Q8 {
    pub cols: usize,
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    /// Each block's `d · Σ q`: what a weight block's offset multiplies.
    pub ds: Vec<f32>,
    /// The same rows packed for this CPU's kernel; empty where it is the portable one.
    tiles: Tiles,
}

/// Activation rows packed as a kernel reads them: by tiles of rows that one weight block is
/// dotted with together, and within a tile by step (one block, or two for AVX-512), the tile's
/// rows side by side, so that the kernel's loads are one pointer and constant offsets (eight
/// pointers a tile had cost more than the arithmetic).
#[derive(Debug, Clone, PartialEq, Default)]
struct Tiles {
    /// Two blocks a step, biased by 128, for the AVX-512 kernel; one block, as signed bytes,
    /// for the AVX2 kernel.
    wide: bool,
    /// Where `bytes` and `scales` start: their first line of 64 bytes (a load split over two
    /// cache lines costs the AVX-512 kernel up to half its speed).
    start: (usize, usize),
    bytes: Vec<u8>,
    /// The step's scales: a block's `d` (AVX2), or `[d₀ × 8, d₁ × 8]` (AVX-512).
    scales: Vec<f32>,
    /// `ds` by block, the tile's rows side by side.
    ds: Vec<f32>,
}

impl Q8 {
    /// Quantizes `rows` rows of `cols` values (`cols` a multiple of [`BLOCK`]): each block's
    /// largest magnitude maps to 127, halfway values to the even integer (as llama.cpp's x86
    /// code rounds).
    pub fn quantize(x: &[f32], cols: usize) -> Q8 {
        #[cfg(target_arch = "x86_64")]
        return Q8::quantize_for(x, cols, x86::avx512());
        #[cfg(not(target_arch = "x86_64"))]
        Q8::quantize_for(x, cols, false)
    }

    /// [`Q8::quantize`], packed for the AVX-512 kernel if `wide` (where the CPU has it), else
    /// for the AVX2 kernel (where it has that): the tests run both.
    pub(crate) fn quantize_for(x: &[f32], cols: usize, wide: bool) -> Q8 {
        debug_assert!(cols.is_multiple_of(BLOCK) && x.len().is_multiple_of(cols));
        let mut out = Q8 { cols, q: Vec::new(), d: Vec::new(), ds: Vec::new(), tiles: Tiles::default() };
        #[cfg(target_arch = "x86_64")]
        if x86::available() {
            #[allow(unsafe_code)]
            // SAFETY: the CPU has the features (checked just above).
            unsafe {
                x86::quantize(x, &mut out)
            };
            out.tiles = x86::pack(&out, wide && x86::avx512());
            return out;
        }
        let _ = wide;
        quantize_into(x, &mut out);
        out
    }

    pub fn rows(&self) -> usize {
        self.q.len() / self.cols
    }
}

/// [`Q8::quantize`]'s arithmetic, into `out`'s empty vectors.
#[inline(always)]
fn quantize_into(x: &[f32], out: &mut Q8) {
    let blocks = x.len() / BLOCK;
    out.q = vec![0; x.len()];
    out.d = Vec::with_capacity(blocks);
    out.ds = Vec::with_capacity(blocks);
    for (x, q) in x.chunks_exact(BLOCK).zip(out.q.chunks_exact_mut(BLOCK)) {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        // A subnormal scale's inverse overflows: such a block is zeros.
        let inv = if d >= f32::MIN_POSITIVE { 1.0 / d } else { 0.0 };
        let mut sum = 0;
        for (q, v) in q.iter_mut().zip(x) {
            // Within ±127: the AVX2 kernel's sign trick cannot negate −128.
            *q = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
            sum += i32::from(*q);
        }
        out.d.push(d);
        out.ds.push(d * sum as f32);
    }
}

/// Whether `kind` is computed as stored (the others are converted to f32 at load).
pub fn computed(kind: Kind) -> bool {
    matches!(kind, Kind::Q8_0 | Kind::Q4_0 | Kind::Q4_1 | Kind::Q5_0 | Kind::Q5_1 | Kind::Q4K | Kind::Q5K | Kind::Q6K)
}

/// Up to how many activation rows [`dot_rows`] is the faster way to multiply a quantized
/// matrix; past it, dequantized panels and the f32 GEMM are. On an AMD EPYC with AVX-512, a
/// prefill of 256 rows: 140–180 GMAC/s for the AVX-512 VNNI kernel, 95–105 for the AVX2 one,
/// 117 for the GEMM with AVX-512 (with AVX2 alone it has half the width). So the integer path
/// at every size where the CPU has AVX-512 VNNI or no AVX-512 at all; for decode batches where
/// the GEMM has AVX-512 and the integers only AVX2, and for the portable kernel.
pub fn integer_rows() -> usize {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        return if x86::avx512() || !is_x86_feature_detected!("avx512f") { usize::MAX } else { 64 };
    }
    16
}

/// `out[r · n + j] = w_j · x_r` for the `n` weight rows in `w` (`row_bytes` each, of `kind`) and
/// every row `r` of `x`: each weight block is unpacked once for several of them.
pub fn dot_rows(kind: Kind, w: &[u8], row_bytes: usize, x: &Q8, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        #[allow(unsafe_code)]
        // SAFETY: the CPU has the features (checked just above).
        unsafe {
            x86::dot_rows(kind, w, row_bytes, x, out)
        };
        return;
    }
    dot_rows_portable(kind, w, row_bytes, x, out);
}

fn dot_rows_portable(kind: Kind, w: &[u8], row_bytes: usize, x: &Q8, out: &mut [f32]) {
    match kind {
        Kind::Q8_0 => rows_of(w, row_bytes, x, out, q8_0),
        Kind::Q4_0 => rows_of(w, row_bytes, x, out, q4_0),
        Kind::Q4_1 => rows_of(w, row_bytes, x, out, q4_1),
        Kind::Q5_0 => rows_of(w, row_bytes, x, out, q5_0),
        Kind::Q5_1 => rows_of(w, row_bytes, x, out, q5_1),
        Kind::Q4K => rows_of(w, row_bytes, x, out, q4_k),
        Kind::Q5K => rows_of(w, row_bytes, x, out, q5_k),
        Kind::Q6K => rows_of(w, row_bytes, x, out, q6_k),
        other => unreachable!("{other} is converted to f32 at load"),
    }
}

/// Weight rows of `kind` (`cols` values each; F16 and BF16 too) as f32, into `out`: the panels a
/// prefill multiplies by the f32 GEMM, and a 16-bit row a decode dots.
pub fn dequantize_rows(kind: Kind, w: &[u8], cols: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        #[allow(unsafe_code)]
        // SAFETY: the CPU has the features (checked just above).
        unsafe {
            x86::dequantize_rows(kind, w, cols, out)
        };
        return;
    }
    dequantize_portable(kind, w, cols, out);
}

#[inline(always)]
fn dequantize_portable(kind: Kind, w: &[u8], cols: usize, out: &mut [f32]) {
    match kind {
        Kind::F16 => {
            for (o, b) in out.iter_mut().zip(w.chunks_exact(2)) {
                *o = half(b);
            }
            return;
        }
        Kind::Bf16 => {
            // A bfloat16 is the high half of an f32.
            for (o, b) in out.iter_mut().zip(w.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
            return;
        }
        _ => {}
    }
    let row_bytes = crate::weights::Matrix::row_bytes(kind, cols);
    let mut u = Unpacked::default();
    for (wr, o) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(cols)) {
        for (b, o) in o.chunks_exact_mut(BLOCK).enumerate() {
            unpack_with(kind, wr, b, &mut u);
            for (half, (o, v)) in o.chunks_exact_mut(16).zip(u.v.chunks_exact(16)).enumerate() {
                let (scale, min) = (u.scale[half], u.min);
                for (o, v) in o.iter_mut().zip(v) {
                    *o = scale * f32::from(*v) + min;
                }
            }
        }
    }
}

/// Block `b` of a weight row of `kind`, unpacked.
#[inline(always)]
fn unpack_with(kind: Kind, row: &[u8], b: usize, u: &mut Unpacked) {
    match kind {
        Kind::Q8_0 => q8_0(row, b, u),
        Kind::Q4_0 => q4_0(row, b, u),
        Kind::Q4_1 => q4_1(row, b, u),
        Kind::Q5_0 => q5_0(row, b, u),
        Kind::Q5_1 => q5_1(row, b, u),
        Kind::Q4K => q4_k(row, b, u),
        Kind::Q5K => q5_k(row, b, u),
        Kind::Q6K => q6_k(row, b, u),
        other => unreachable!("{other} is converted to f32 at load"),
    }
}

/// One block of 32 weights unpacked: `value = scale[l / 16] · v[l] + min`.
#[derive(Default)]
struct Unpacked {
    v: [i8; BLOCK],
    scale: [f32; 2],
    min: f32,
}

/// The dot products of every weight row with every activation row, `unpack(row, b, block)`
/// giving a row's `b`-th block of 32.
#[inline(always)]
fn rows_of(w: &[u8], row_bytes: usize, x: &Q8, out: &mut [f32], unpack: impl Fn(&[u8], usize, &mut Unpacked)) {
    let blocks = x.cols / BLOCK;
    let n = w.len() / row_bytes;
    let mut u = Unpacked::default();
    out.fill(0.0);
    for (j, wr) in w.chunks_exact(row_bytes).enumerate() {
        for b in 0..blocks {
            unpack(wr, b, &mut u);
            let (lo, hi): (&[i8; 16], &[i8; 16]) =
                (u.v[..16].try_into().expect("16"), u.v[16..].try_into().expect("16"));
            for (r, o) in out.chunks_exact_mut(n).enumerate() {
                let at = r * blocks + b;
                let a = &x.q[at * BLOCK..][..BLOCK];
                let (s0, s1) = (sum16(lo, &a[..16]), sum16(hi, &a[16..]));
                o[j] += x.d[at] * (u.scale[0] * s0 as f32 + u.scale[1] * s1 as f32) + u.min * x.ds[at];
            }
        }
    }
}

#[inline(always)]
fn half(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// `Σ w·a` over 16 weights and 16 activations.
#[inline(always)]
fn sum16(w: &[i8; 16], a: &[i8]) -> i32 {
    let a: &[i8; 16] = a.try_into().expect("16 activations");
    let mut s = 0i32;
    for j in 0..16 {
        s += i32::from(w[j]) * i32::from(a[j]);
    }
    s
}

/// Q8_0: an f16 scale, 32 signed bytes.
#[inline(always)]
fn q8_0(row: &[u8], b: usize, u: &mut Unpacked) {
    let block = &row[b * 34..][..34];
    let d = half(block);
    u.scale = [d, d];
    u.min = 0.0;
    for (v, &q) in u.v.iter_mut().zip(&block[2..]) {
        *v = q as i8;
    }
}

/// The nibbles of Q4's 16 bytes: low nibbles are values 0..16, high nibbles 16..32, less `offset`.
#[inline(always)]
fn nibbles(qs: &[u8], offset: i8, v: &mut [i8; BLOCK]) {
    for j in 0..16 {
        v[j] = (qs[j] & 0x0f) as i8 - offset;
        v[j + 16] = (qs[j] >> 4) as i8 - offset;
    }
}

/// Q4_0: an f16 scale, 16 bytes of nibbles; `d·(q − 8)`.
#[inline(always)]
fn q4_0(row: &[u8], b: usize, u: &mut Unpacked) {
    let block = &row[b * 18..][..18];
    let d = half(block);
    u.scale = [d, d];
    u.min = 0.0;
    nibbles(&block[2..], 8, &mut u.v);
}

/// Q4_1: an f16 scale and minimum, 16 bytes of nibbles; `d·q + m`.
#[inline(always)]
fn q4_1(row: &[u8], b: usize, u: &mut Unpacked) {
    let block = &row[b * 20..][..20];
    let d = half(block);
    u.scale = [d, d];
    u.min = half(&block[2..]);
    nibbles(&block[4..], 0, &mut u.v);
}

/// Q5's 32 values: the nibbles topped by the fifth bits of `qh`, less `offset`.
#[inline(always)]
fn fifths(qh: &[u8], qs: &[u8], offset: i8, v: &mut [i8; BLOCK]) {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    for j in 0..16 {
        v[j] = ((qs[j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4)) as i8 - offset;
        v[j + 16] = ((qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4)) as i8 - offset;
    }
}

/// Q5_0: an f16 scale, 32 fifth bits, 16 bytes of nibbles; `d·(q − 16)`.
#[inline(always)]
fn q5_0(row: &[u8], b: usize, u: &mut Unpacked) {
    let block = &row[b * 22..][..22];
    let d = half(block);
    u.scale = [d, d];
    u.min = 0.0;
    fifths(&block[2..6], &block[6..], 16, &mut u.v);
}

/// Q5_1: an f16 scale and minimum, then as Q5_0; `d·q + m`.
#[inline(always)]
fn q5_1(row: &[u8], b: usize, u: &mut Unpacked) {
    let block = &row[b * 24..][..24];
    let d = half(block);
    u.scale = [d, d];
    u.min = half(&block[2..]);
    fifths(&block[4..8], &block[8..], 0, &mut u.v);
}

/// Q4_K and Q5_K: sub-block `b % 8` of super-block `b / 8` (256 values: an f16 `d` and `dmin`,
/// eight 6-bit scales and minimums, Q5_K's fifth bits, the nibbles); `d·scale·q − dmin·min`.
#[inline(always)]
fn k45(row: &[u8], b: usize, u: &mut Unpacked, five: bool) {
    let size = if five { 176 } else { 144 };
    let block = &row[(b / 8) * size..][..size];
    let sub = b % 8;
    let packed = &block[4..16];
    let (sc, m) = if sub < 4 {
        (packed[sub] & 63, packed[sub + 4] & 63)
    } else {
        ((packed[sub + 4] & 0x0f) | ((packed[sub - 4] >> 6) << 4), (packed[sub + 4] >> 4) | ((packed[sub] >> 6) << 4))
    };
    let scale = half(block) * f32::from(sc);
    u.scale = [scale, scale];
    u.min = -half(&block[2..]) * f32::from(m);
    let qs = &block[size - 128 + (sub / 2) * 32..][..32];
    let shift = 4 * (sub % 2);
    for (v, q) in u.v.iter_mut().zip(qs) {
        *v = ((q >> shift) & 0x0f) as i8;
    }
    if five {
        for (v, h) in u.v.iter_mut().zip(&block[16..48]) {
            *v |= (((h >> sub) & 1) << 4) as i8;
        }
    }
}

#[inline(always)]
fn q4_k(row: &[u8], b: usize, u: &mut Unpacked) {
    k45(row, b, u, false);
}

#[inline(always)]
fn q5_k(row: &[u8], b: usize, u: &mut Unpacked) {
    k45(row, b, u, true);
}

/// Q6_K: values `32k..32k + 32` of half `h` of super-block `b / 8` (256 values of 6 bits: low
/// nibbles, high pairs, a signed 8-bit scale per 16, an f16 `d`); `d·scale·(q − 32)`.
#[inline(always)]
fn q6_k(row: &[u8], b: usize, u: &mut Unpacked) {
    let block = &row[(b / 8) * 210..][..210];
    let (h, k) = ((b % 8) / 4, b % 4);
    let (ql, qh, scales) = (&block[h * 64..], &block[128 + h * 32..], &block[192 + h * 8..]);
    let d = half(&block[208..]);
    u.scale = [d * f32::from(scales[2 * k] as i8), d * f32::from(scales[2 * k + 1] as i8)];
    u.min = 0.0;
    let (shift, at) = (4 * (k / 2), 32 * (k % 2));
    for l in 0..32 {
        let low = (ql[l + at] >> shift) & 0x0f;
        let high = (qh[l] >> (2 * k)) & 3;
        u.v[l] = (low | (high << 4)) as i8 - 32;
    }
}

/// The AVX2 kernel: a block's 32 weight bytes in one register, dotted with an activation row's
/// 32 by `vpmaddubsw` (unsigned × signed bytes, pairs summed to 16 bits: the weights' magnitudes
/// times the activations carrying the weights' signs) and `vpmaddwd` (to 32 bits, four products
/// a lane: lanes 0–3 are values 0–15, lanes 4–7 values 16–31, so that Q6_K's two scales a block
/// apply lane by lane), scaled and summed in f32 with FMA. Where the CPU has AVX-512 VNNI, the
/// wide kernel takes two blocks a register and does the integer steps in one `vpdpbusd` on
/// activations biased by 128 (unsigned), less 128 · Σw (one more `vpdpbusd` a weight block): the
/// same integers, four instructions a pair of rows for 64 products. (`vpdpbusd` with the sign
/// trick, on 256 bits, measured slower than AVX2's two steps.)
///
/// One weight row against up to `TILE` activation rows at a time, their accumulators in
/// registers: each weight block is unpacked once for the tile, and each pair costs five or six
/// instructions (the one-loop-per-weight-row kernel this replaced spent about thirteen a block
/// and kept a batch's accumulators in memory, so a batch got no more from a weight than a lone
/// row did). Every pair of rows gets the same operations in the same order whatever its tile,
/// so a sequence's tokens do not depend on its step's company; and the AVX2 kernel sums even
/// and odd blocks apart as the AVX-512 one does, so neither do they on the x86 CPU that serves.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{unpack_with, Kind, Tiles, Unpacked, BLOCK, Q8};

    /// Activation rows a tile dots with each weight block: eight accumulators beside the
    /// block's registers fit AVX2's sixteen.
    const TILE: usize = 8;

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }

    /// The AVX-512 kernel's features: F, BW and VNNI (Ice Lake, Zen 4 and later).
    pub(super) fn avx512() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
    }

    /// The formats whose kernels are compiled with the format a constant (the block's unpacking
    /// then compiles to that format's few instructions, with no branch in the loop: twice as fast
    /// as one loop for every format); [`OTHER`]'s is read at run time.
    const Q8_0: u8 = 0;
    const Q4_0: u8 = 1;
    const Q4_1: u8 = 2;
    const OTHER: u8 = 3;

    #[inline(always)]
    fn kind_of(code: u8, kind: Kind) -> Kind {
        match code {
            Q8_0 => Kind::Q8_0,
            Q4_0 => Kind::Q4_0,
            Q4_1 => Kind::Q4_1,
            _ => kind,
        }
    }

    /// # Safety
    /// The CPU has AVX2, FMA and F16C ([`available`]).
    pub(super) unsafe fn dot_rows(kind: Kind, w: &[u8], row_bytes: usize, x: &Q8, out: &mut [f32]) {
        debug_assert!(available());
        let rows = x.rows();
        assert!(x.cols.is_multiple_of(BLOCK) && x.q.len() == rows * x.cols && x.d.len() == rows * x.cols / BLOCK);
        let steps = if x.tiles.wide { (x.cols / BLOCK).div_ceil(2) } else { x.cols / BLOCK };
        let (step_bytes, step_scales) = if x.tiles.wide { (2 * BLOCK, 16) } else { (BLOCK, 1) };
        let (bytes, scales) = (&x.tiles.bytes[x.tiles.start.0..], &x.tiles.scales[x.tiles.start.1..]);
        assert!(bytes.len() == rows * steps * step_bytes && scales.len() == rows * steps * step_scales);
        assert!(x.tiles.ds.len() == x.d.len() && row_bytes == crate::weights::Matrix::row_bytes(kind, x.cols));
        assert!(w.len().is_multiple_of(row_bytes) && out.len() == w.len() / row_bytes * rows);
        let code = match kind {
            Kind::Q8_0 => Q8_0,
            Kind::Q4_0 => Q4_0,
            Kind::Q4_1 => Q4_1,
            _ => OTHER,
        };
        let wide = x.tiles.wide;
        debug_assert!(!wide || avx512());
        let mut r0 = 0;
        while r0 < rows {
            let n = (rows - r0).min(TILE);
            // Every (format, tile size) pair is its own function, its loops unrolled.
            macro_rules! tile {
                ($f:ident, $code:expr) => {
                    match n {
                        1 => $f::<{ $code }, 1>(kind, w, row_bytes, x, r0, out),
                        2 => $f::<{ $code }, 2>(kind, w, row_bytes, x, r0, out),
                        3 => $f::<{ $code }, 3>(kind, w, row_bytes, x, r0, out),
                        4 => $f::<{ $code }, 4>(kind, w, row_bytes, x, r0, out),
                        5 => $f::<{ $code }, 5>(kind, w, row_bytes, x, r0, out),
                        6 => $f::<{ $code }, 6>(kind, w, row_bytes, x, r0, out),
                        7 => $f::<{ $code }, 7>(kind, w, row_bytes, x, r0, out),
                        _ => $f::<{ $code }, TILE>(kind, w, row_bytes, x, r0, out),
                    }
                };
            }
            // SAFETY: the caller found AVX2, FMA and F16C, and `x` was packed wide only where the
            // CPU has AVX-512 F, BW and VNNI (`pack`'s caller): the features each kernel is
            // compiled with; the sizes its pointers rely on are checked above, `r0` is a
            // multiple of TILE and `n` its tile's rows.
            unsafe {
                match (wide, code) {
                    (true, Q8_0) => tile!(tile512, Q8_0),
                    (true, Q4_0) => tile!(tile512, Q4_0),
                    (true, Q4_1) => tile!(tile512, Q4_1),
                    (true, _) => tile!(tile512, OTHER),
                    (false, Q8_0) => tile!(tile, Q8_0),
                    (false, Q4_0) => tile!(tile, Q4_0),
                    (false, Q4_1) => tile!(tile, Q4_1),
                    (false, _) => tile!(tile, OTHER),
                }
            }
            r0 += n;
        }
    }

    /// # Safety
    /// The CPU has AVX2, FMA and F16C ([`available`]).
    pub(super) unsafe fn quantize(x: &[f32], out: &mut Q8) {
        debug_assert!(available());
        // SAFETY: the caller found the features the function is compiled with; its loads and
        // stores are of whole blocks of slices cut to a block.
        unsafe { quantize_avx2(x, out) }
    }

    /// [`super::quantize_into`]'s arithmetic a block at a time in registers (compiled from the
    /// portable loop, it took as long as a small batch's products).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quantize_avx2(x: &[f32], out: &mut Q8) {
        let blocks = x.len() / BLOCK;
        out.q = vec![0; x.len()];
        out.d = Vec::with_capacity(blocks);
        out.ds = Vec::with_capacity(blocks);
        let sign = _mm256_set1_ps(-0.0);
        let (low, high) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
        for (x, q) in x.chunks_exact(BLOCK).zip(out.q.chunks_exact_mut(BLOCK)) {
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x[i * 8..][..8].as_ptr()));
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let d = amax / 127.0;
            // A subnormal scale's inverse overflows: such a block is zeros.
            let inv = _mm256_set1_ps(if d >= f32::MIN_POSITIVE { 1.0 / d } else { 0.0 });
            let i: [__m256i; 4] = std::array::from_fn(|k| {
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v[k], inv));
                _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(r), low), high)
            });
            let sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            let sum = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            let sum = _mm_add_epi32(sum, _mm_unpackhi_epi64(sum, sum));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 1)));
            // Packing to 16 then 8 bits interleaves the 128-bit halves; the permutation undoes it.
            let bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
            let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q[..BLOCK].as_mut_ptr().cast(), bytes);
            out.d.push(d);
            out.ds.push(d * sum as f32);
        }
    }

    /// `x`'s rows packed for the AVX-512 kernel if `wide`, else the AVX2 one ([`Tiles`]).
    pub(super) fn pack(x: &Q8, wide: bool) -> Tiles {
        let (rows, blocks) = (x.rows(), x.cols / BLOCK);
        let per_step = if wide { 2 } else { 1 };
        let steps = blocks.div_ceil(per_step);
        let mut t = Tiles {
            wide,
            start: (0, 0),
            bytes: Vec::with_capacity(rows * steps * per_step * BLOCK + 64),
            scales: Vec::with_capacity(rows * steps * if wide { 16 } else { 1 } + 16),
            ds: Vec::with_capacity(rows * blocks),
        };
        // Within the capacity reserved: the vectors never move.
        t.start = (t.bytes.as_ptr().align_offset(64), t.scales.as_ptr().align_offset(64));
        t.bytes.resize(t.start.0, 0);
        t.scales.resize(t.start.1, 0.0);
        for r0 in (0..rows).step_by(TILE) {
            let n = TILE.min(rows - r0);
            for s in 0..steps {
                for r in r0..r0 + n {
                    for b in s * per_step..(s + 1) * per_step {
                        let (q, d) = if b < blocks {
                            (&x.q[(r * blocks + b) * BLOCK..][..BLOCK], x.d[r * blocks + b])
                        } else {
                            (&[0; BLOCK][..], 0.0)
                        };
                        if wide {
                            t.bytes.extend(q.iter().map(|&v| (v as u8) ^ 0x80));
                            t.scales.extend([d; 8]);
                        } else {
                            t.bytes.extend(q.iter().map(|&v| v as u8));
                            t.scales.push(d);
                        }
                    }
                }
            }
            for b in 0..blocks {
                t.ds.extend((r0..r0 + n).map(|r| x.ds[r * blocks + b]));
            }
        }
        t
    }

    /// # Safety
    /// The CPU has AVX2, FMA and F16C ([`available`]).
    pub(super) unsafe fn dequantize_rows(kind: Kind, w: &[u8], cols: usize, out: &mut [f32]) {
        debug_assert!(available());
        // SAFETY: the caller found the features the function is compiled with; it is the
        // portable code (bounds-checked slices), compiled for them.
        unsafe { dequantize_rows_avx2(kind, w, cols, out) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dequantize_rows_avx2(kind: Kind, w: &[u8], cols: usize, out: &mut [f32]) {
        if kind == Kind::F16 {
            // Eight halves an instruction (`half`'s conversion goes a value at a time here).
            let (lanes, rest) = (w.chunks_exact(16), out.chunks_exact_mut(8));
            let done = (w.len() / 16) * 8;
            for (h, o) in lanes.zip(rest) {
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast())));
            }
            super::dequantize_portable(kind, &w[done * 2..], cols, &mut out[done..]);
            return;
        }
        super::dequantize_portable(kind, w, cols, out);
    }

    /// Block `$b` of weight row `$wr`: its weights as signed bytes, its scales (per half) and its
    /// offset; the simple formats unpacked in registers. A macro: a function would not be
    /// inlined into the kernels compiled with AVX2.
    macro_rules! block {
        ($kind:expr, $wr:expr, $b:expr, $u:expr) => {{
            let (kind, wr, b, u): (Kind, &[u8], usize, &mut Unpacked) = ($kind, $wr, $b, $u);
            match kind {
                Kind::Q8_0 => {
                    let block = &wr[b * 34..][..34];
                    let d = half(block);
                    (_mm256_loadu_si256(block[2..].as_ptr().cast()), d, d, 0.0)
                }
                Kind::Q4_0 | Kind::Q4_1 => {
                    let size = if kind == Kind::Q4_1 { 20 } else { 18 };
                    let block = &wr[b * size..][..size];
                    let qs = _mm_loadu_si128(block[size - 16..].as_ptr().cast());
                    let mask = _mm_set1_epi8(0x0f);
                    let lo = _mm_and_si128(qs, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                    let v = _mm256_set_m128i(hi, lo);
                    let d = half(block);
                    if kind == Kind::Q4_1 {
                        (v, d, d, half(&block[2..]))
                    } else {
                        (_mm256_sub_epi8(v, _mm256_set1_epi8(8)), d, d, 0.0)
                    }
                }
                _ => {
                    unpack_with(kind, wr, b, u);
                    (_mm256_loadu_si256(u.v.as_ptr().cast()), u.scale[0], u.scale[1], u.min)
                }
            }
        }};
    }

    /// `out[r · n + j] = w_j · x_r` for the `n` weight rows `j` in `w` and activation rows
    /// `r0..r0 + RN`.
    macro_rules! tile_kernel {
        ($code:expr, $rn:expr, $kind:expr, $w:expr, $row_bytes:expr, $x:expr, $r0:expr, $out:expr) => {{
            let (kind, w, row_bytes, x, r0, out): (Kind, &[u8], usize, &Q8, usize, &mut [f32]) =
                (kind_of($code, $kind), $w, $row_bytes, $x, $r0, $out);
            let blocks = x.cols / BLOCK;
            // Formats whose integers are never negative (Q4_1, Q5_1, Q4_K, Q5_K) need no sign
            // trick; they are exactly the formats with an offset.
            let unsigned = matches!(kind, Kind::Q4_1 | Kind::Q5_1 | Kind::Q4K | Kind::Q5K);
            // The tile's rows (the tiles before it whole), block by block ([`Tiles`]).
            let q = x.tiles.bytes.as_ptr().add(x.tiles.start.0 + r0 * blocks * BLOCK);
            let d = x.tiles.scales.as_ptr().add(x.tiles.start.1 + r0 * blocks);
            let ds = x.tiles.ds.as_ptr().add(r0 * blocks);
            let ones = _mm256_set1_epi16(1);
            let mut u = Unpacked::default();
            let n = w.len() / row_bytes;
            for (i, wr) in w.chunks_exact(row_bytes).enumerate() {
                // Even blocks' sums and odd blocks', as the AVX-512 kernel's two halves (sixteen
                // accumulators: some live on the stack; four rows at a time measured slower).
                let (mut even, mut odd) = ([_mm256_setzero_ps(); $rn], [_mm256_setzero_ps(); $rn]);
                let mut offsets = [0.0f32; $rn];
                // Block `$b` into `$acc`.
                macro_rules! step {
                    ($b:expr, $acc:ident) => {{
                        let b = $b;
                        let (v, s0, s1, min) = block!(kind, wr, b, &mut u);
                        let scales = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
                        let magnitude = if unsigned { v } else { _mm256_sign_epi8(v, v) };
                        for j in 0..$rn {
                            let at = b * $rn + j;
                            let a = _mm256_loadu_si256(q.add(at * BLOCK).cast());
                            let a = if unsigned { a } else { _mm256_sign_epi8(a, v) };
                            let products = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, a), ones);
                            let scale = _mm256_mul_ps(scales, _mm256_set1_ps(*d.add(at)));
                            $acc[j] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(products), $acc[j]);
                        }
                        if unsigned {
                            for j in 0..$rn {
                                offsets[j] += min * *ds.add(b * $rn + j);
                            }
                        }
                    }};
                }
                for b in (0..blocks).step_by(2) {
                    step!(b, even);
                    if b + 1 < blocks {
                        step!(b + 1, odd);
                    }
                }
                for j in 0..$rn {
                    let sum = sum8(_mm256_add_ps(even[j], odd[j]));
                    out[(r0 + j) * n + i] = if unsigned { sum + offsets[j] } else { sum };
                }
            }
        }};
    }

    /// The eight lanes' sum, in one order for both kernels.
    #[inline(always)]
    fn sum8(v: __m256) -> f32 {
        // SAFETY: called only from this module's kernels, compiled with AVX2.
        unsafe {
            let lanes = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let pairs = _mm_add_ps(lanes, _mm_movehl_ps(lanes, lanes));
            _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)))
        }
    }

    /// [`tile_kernel`] two blocks at a time in AVX-512's registers: lanes 0–7 sum the even
    /// blocks, 8–15 the odd ones, added at the end as the AVX2 kernel adds its two sums; a pair's
    /// integers are the same (from activations biased by 128 less 128 · Σw, AVX-512 having no
    /// sign trick), so both kernels give the same sums to the bit.
    macro_rules! tile512_kernel {
        ($code:expr, $rn:expr, $kind:expr, $w:expr, $row_bytes:expr, $x:expr, $r0:expr, $out:expr) => {{
            let (kind, w, row_bytes, x, r0, out): (Kind, &[u8], usize, &Q8, usize, &mut [f32]) =
                (kind_of($code, $kind), $w, $row_bytes, $x, $r0, $out);
            let blocks = x.cols / BLOCK;
            let pairs = blocks.div_ceil(2);
            let offset = matches!(kind, Kind::Q4_1 | Kind::Q5_1 | Kind::Q4K | Kind::Q5K);
            // The tile's rows (the tiles before it whole), two blocks a step, 128 added to each
            // value (the unsigned operand of `vpdpbusd`; an odd last block is followed by 32
            // bytes of 128, zeros biased, with scales of 0), and their scales spread over the two
            // halves ([`Tiles`]).
            let q = x.tiles.bytes.as_ptr().add(x.tiles.start.0 + r0 * pairs * 2 * BLOCK);
            let d = x.tiles.scales.as_ptr().add(x.tiles.start.1 + r0 * pairs * 16);
            let ds = x.tiles.ds.as_ptr().add(r0 * blocks);
            let (zero, bias) = (_mm512_setzero_si512(), _mm512_set1_epi8(-128));
            let mut u = Unpacked::default();
            let n = w.len() / row_bytes;
            for (i, wr) in w.chunks_exact(row_bytes).enumerate() {
                let mut acc = [_mm512_setzero_ps(); $rn];
                let mut offsets = [0.0f32; $rn];
                for p in 0..pairs {
                    let b = 2 * p;
                    let whole = b + 1 < blocks;
                    let (v0, s0, s1, min0) = block!(kind, wr, b, &mut u);
                    let (v1, t0, t1, min1) =
                        if whole { block!(kind, wr, b + 1, &mut u) } else { (_mm256_setzero_si256(), 0.0, 0.0, 0.0) };
                    let v = _mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1);
                    let scales = _mm512_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1, t0, t0, t0, t0, t1, t1, t1, t1);
                    // −128 · Σ w over each lane's four weights.
                    let correction = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, v));
                    for j in 0..$rn {
                        let at = q.add((p * $rn + j) * 2 * BLOCK);
                        let products = _mm512_dpbusd_epi32(correction, _mm512_loadu_si512(at.cast()), v);
                        let scale = _mm512_mul_ps(scales, _mm512_loadu_ps(d.add((p * $rn + j) * 16)));
                        acc[j] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(products), acc[j]);
                    }
                    if offset {
                        for j in 0..$rn {
                            offsets[j] += min0 * *ds.add(b * $rn + j);
                        }
                        if whole {
                            for j in 0..$rn {
                                offsets[j] += min1 * *ds.add((b + 1) * $rn + j);
                            }
                        }
                    }
                }
                for j in 0..$rn {
                    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1));
                    let sum = sum8(_mm256_add_ps(_mm512_castps512_ps256(acc[j]), high));
                    out[(r0 + j) * n + i] = if offset { sum + offsets[j] } else { sum };
                }
            }
        }};
    }

    /// # Safety
    /// As [`tile`], with `x` packed for this kernel (`x.tiles.wide`), and AVX-512 F, BW and VNNI.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn tile512<const CODE: u8, const RN: usize>(
        kind: Kind,
        w: &[u8],
        row_bytes: usize,
        x: &Q8,
        r0: usize,
        out: &mut [f32],
    ) {
        unsafe { tile512_kernel!(CODE, RN, kind, w, row_bytes, x, r0, out) }
    }

    /// # Safety
    /// AVX2, FMA and F16C; `x` packed for this kernel (not `x.tiles.wide`) with `r0` a multiple
    /// of `TILE` and `RN` the rows of its tile (`min(TILE, rows − r0)`: the layout's strides);
    /// `w` whole rows of `row_bytes` for `x.cols` values of `kind`; `out` `[x.rows()][w's rows]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const CODE: u8, const RN: usize>(
        kind: Kind,
        w: &[u8],
        row_bytes: usize,
        x: &Q8,
        r0: usize,
        out: &mut [f32],
    ) {
        unsafe { tile_kernel!(CODE, RN, kind, w, row_bytes, x, r0, out) }
    }

    /// An f16's value; inlined only into the kernels here, all compiled with F16C.
    #[inline(always)]
    fn half(b: &[u8]) -> f32 {
        // SAFETY: called only from this module's kernels, which have F16C enabled.
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes([b[0], b[1]]))))) }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::gguf::dequantize;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Random blocks of `kind` with scales of a trained model's size (the quantized integers
    /// and scale bits random).
    pub(crate) fn random_blocks(kind: Kind, blocks: usize, rng: &mut StdRng) -> Vec<u8> {
        let (_, size) = kind.block().unwrap();
        let mut out = Vec::with_capacity(blocks * size);
        for _ in 0..blocks {
            let mut b: Vec<u8> = (0..size).map(|_| rng.random()).collect();
            let scale = |rng: &mut StdRng| f16::from_f32(rng.random_range(0.001..0.02)).to_le_bytes();
            match kind {
                Kind::Q6K => b[208..].copy_from_slice(&scale(rng)),
                _ => {
                    b[..2].copy_from_slice(&scale(rng));
                    if matches!(kind, Kind::Q4_1 | Kind::Q5_1 | Kind::Q4K | Kind::Q5K) {
                        let m = f16::from_f32(rng.random_range(-0.05..0.05)).to_le_bytes();
                        b[2..4].copy_from_slice(&m);
                    }
                }
            }
            out.extend(b);
        }
        out
    }

    /// Every format's integer dot product equals the f32 dot product of its dequantized row
    /// (PyPI gguf's dequantizers are checked against [`dequantize`] in `tests/dequantize.rs`)
    /// with the activations, within what quantizing the activations to 8 bits costs: 1 % of
    /// the sum of the products' magnitudes. Both x86 packings (AVX-512's and AVX2's, each where
    /// the CPU has it), every tile size (2 to 7 rows, and 11: a whole tile and three; each
    /// row alone is the tile of one), and for the simple formats an odd number of blocks a row
    /// (AVX-512's last step half empty).
    #[test]
    fn every_format_computes_what_its_dequantized_values_do() {
        let mut rng = StdRng::seed_from_u64(7);
        let kinds = [Kind::Q8_0, Kind::Q4_0, Kind::Q4_1, Kind::Q5_0, Kind::Q5_1, Kind::Q4K, Kind::Q5K, Kind::Q6K];
        for (kind, cols) in kinds.iter().map(|&k| (k, 512)).chain([Kind::Q8_0, Kind::Q4_0, Kind::Q4_1].map(|k| (k, 96)))
        {
            let (per_block, size) = kind.block().unwrap();
            let row_bytes = cols / per_block * size;
            let n = 3;
            let w = random_blocks(kind, n * cols / per_block, &mut rng);
            for rows in [2, 3, 4, 5, 6, 7, 11] {
                let x: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
                let mut portable = vec![0.0; rows * n];
                dot_rows_portable(kind, &w, row_bytes, &Q8::quantize(&x, cols), &mut portable);
                let mut kernels = Vec::new();
                for wide in [true, false] {
                    let mut out = vec![0.0; rows * n];
                    dot_rows(kind, &w, row_bytes, &Q8::quantize_for(&x, cols, wide), &mut out);
                    kernels.push(out.clone());
                    // Each activation row alone (a lone sequence's kernel).
                    let alone: Vec<Vec<f32>> = (0..rows)
                        .map(|r| {
                            let mut out = vec![0.0; n];
                            dot_rows(
                                kind,
                                &w,
                                row_bytes,
                                &Q8::quantize_for(&x[r * cols..][..cols], cols, wide),
                                &mut out,
                            );
                            out
                        })
                        .collect();
                    for j in 0..n {
                        let wf = dequantize(kind, &w[j * row_bytes..][..row_bytes], cols);
                        for r in 0..rows {
                            let xr = &x[r * cols..][..cols];
                            let exact: f32 = wf.iter().zip(xr).map(|(a, b)| a * b).sum();
                            let scale: f32 = wf.iter().zip(xr).map(|(a, b)| (a * b).abs()).sum();
                            let got = out[r * n + j];
                            let what = format!("{kind}, {cols} columns, {rows} rows, wide {wide}: row {j}, x {r}");
                            assert!((got - exact).abs() <= 0.01 * scale, "{what}: {got} against {exact} (|·| {scale})");
                            assert!((got - portable[r * n + j]).abs() <= 1e-4 * scale, "{what}: the two copies differ");
                            // Bit for bit: a sequence's tokens must not depend on its step's company.
                            assert_eq!(got, alone[r][j], "{what}: a row alone differs");
                        }
                    }
                }
                // And whatever the CPU: the AVX-512 and AVX2 kernels sum in the same order.
                assert_eq!(kernels[0], kernels[1], "{kind}, {cols} columns, {rows} rows: the two kernels differ");
            }
        }
    }

    /// The activations quantize to the same integers, scales and sums on every path: halfway
    /// values to the even integer, the largest magnitude to ±127, a block of zeros (and one of
    /// subnormals, whose scale's inverse would overflow) to zeros.
    #[test]
    fn every_path_quantizes_alike() {
        let mut rng = StdRng::seed_from_u64(13);
        let mut x: Vec<f32> = (0..8 * 64).map(|_| rng.random_range(-3.0..3.0)).collect();
        // Block 1: 127 steps of 1, so that 0.5, 1.5, -2.5 … are exact halves.
        for (j, v) in x[32..64].iter_mut().enumerate() {
            *v = if j == 0 { 127.0 } else { j as f32 - 16.5 };
        }
        x[64..96].fill(0.0);
        x[96..128].fill(f32::MIN_POSITIVE / 4.0);
        let mut portable = Q8 { cols: 64, q: Vec::new(), d: Vec::new(), ds: Vec::new(), tiles: Tiles::default() };
        quantize_into(&x, &mut portable);
        let q = Q8::quantize(&x, 64);
        assert_eq!((&q.q, &q.d, &q.ds), (&portable.q, &portable.d, &portable.ds));
        assert_eq!(&q.q[32..36], &[127, -16, -14, -14], "ties to even: -15.5 → -16, -14.5 → -14");
        assert!(q.q[64..128].iter().all(|&v| v == 0));
    }

    /// A prefill's panels are the values the reader decodes.
    #[test]
    fn panels_dequantize_as_the_reader_does() {
        let mut rng = StdRng::seed_from_u64(11);
        let cols = 512;
        for kind in [Kind::Q8_0, Kind::Q4_0, Kind::Q4_1, Kind::Q5_0, Kind::Q5_1, Kind::Q4K, Kind::Q5K, Kind::Q6K] {
            let (per_block, _) = kind.block().unwrap();
            let w = random_blocks(kind, 3 * cols / per_block, &mut rng);
            let mut got = vec![0.0; 3 * cols];
            dequantize_rows(kind, &w, cols, &mut got);
            let mut portable = vec![0.0; 3 * cols];
            dequantize_portable(kind, &w, cols, &mut portable);
            let want = dequantize(kind, &w, 3 * cols);
            for (i, ((g, p), w)) in got.iter().zip(&portable).zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-6 * w.abs().max(1e-3) && g == p,
                    "{kind}: value {i}: {g} and {p} against {w}"
                );
            }
        }
    }

    /// Activations quantize to within half a step of their block's scale, and a block of zeros
    /// to zeros.
    #[test]
    fn activations_quantize_within_half_a_step() {
        let mut rng = StdRng::seed_from_u64(3);
        let mut x: Vec<f32> = (0..128).map(|_| rng.random_range(-3.0..3.0)).collect();
        x[32..64].fill(0.0);
        let q = Q8::quantize(&x, 64);
        assert_eq!(q.rows(), 2);
        for (b, block) in x.chunks_exact(BLOCK).enumerate() {
            let d = q.d[b];
            let mut sum = 0;
            for (j, v) in block.iter().enumerate() {
                let qv = q.q[b * BLOCK + j];
                assert!((f32::from(qv) * d - v).abs() <= d / 2.0 + 1e-6, "block {b} value {j}");
                sum += i32::from(qv);
            }
            assert_eq!(q.ds[b], d * sum as f32);
        }
        assert_eq!(q.d[1], 0.0);
        assert!(q.q[32..64].iter().all(|&v| v == 0));
    }
}
