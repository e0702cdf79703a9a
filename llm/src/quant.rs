//! Dot products on weights as their file stores them (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
//! Q6_K), the way llama.cpp computes them: the activations are quantized to 8 bits a value in
//! blocks of 32 ([`Q8`]: a scale and the sum of the block's integers), and each weight block's
//! integers are multiplied with them in integers, the two scales applied once a block. Decoding
//! reads every weight once a step: reading 4.5 or 8.5 bits a weight instead of 32 is most of the
//! speed.
//!
//! Written by hand: no maintained crate computes on GGUF's block formats outside a tensor
//! framework (candle, ggml's bindings). Each format unpacks a block of 32 weights to signed
//! bytes; the portable kernel multiplies them in plain Rust, and on x86-64 CPUs with AVX2 (picked
//! at run time) 32 products at once (`vpmaddubsw`, llama.cpp's method), the simple formats
//! unpacked in vector registers too.

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
}

impl Q8 {
    /// Quantizes `rows` rows of `cols` values (`cols` a multiple of [`BLOCK`]): each block's
    /// largest magnitude maps to 127.
    pub fn quantize(x: &[f32], cols: usize) -> Q8 {
        debug_assert!(cols.is_multiple_of(BLOCK) && x.len().is_multiple_of(cols));
        let blocks = x.len() / BLOCK;
        let mut out = Q8 { cols, q: vec![0; x.len()], d: Vec::with_capacity(blocks), ds: Vec::with_capacity(blocks) };
        for (x, q) in x.chunks_exact(BLOCK).zip(out.q.chunks_exact_mut(BLOCK)) {
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            // A subnormal scale's inverse overflows: such a block is zeros.
            let inv = if d >= f32::MIN_POSITIVE { 1.0 / d } else { 0.0 };
            let mut sum = 0;
            for (q, v) in q.iter_mut().zip(x) {
                // Within ±127: the kernels' sign trick cannot negate −128.
                *q = (v * inv).round().clamp(-127.0, 127.0) as i8;
                sum += i32::from(*q);
            }
            out.d.push(d);
            out.ds.push(d * sum as f32);
        }
        out
    }

    pub fn rows(&self) -> usize {
        self.q.len() / self.cols
    }
}

/// Whether `kind` is computed as stored (the others are converted to f32 at load).
pub fn computed(kind: Kind) -> bool {
    matches!(kind, Kind::Q8_0 | Kind::Q4_0 | Kind::Q4_1 | Kind::Q5_0 | Kind::Q5_1 | Kind::Q4K | Kind::Q5K | Kind::Q6K)
}

/// Most activation rows [`dot_rows`] takes at once.
pub const MAX_ROWS: usize = 32;

/// `out[j · rows + r] = w_j · x_r` for the weight rows in `w` (`row_bytes` each, of `kind`) and
/// every row `r` of `x` (at most [`MAX_ROWS`]): each weight block is unpacked once for all of
/// them.
pub fn dot_rows(kind: Kind, w: &[u8], row_bytes: usize, x: &Q8, out: &mut [f32]) {
    assert!(x.rows() <= MAX_ROWS, "{} activation rows; at most {MAX_ROWS} at once", x.rows());
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

/// Weight rows of `kind` (`cols` values each) as f32, into `out`: the panels a prefill
/// multiplies by the f32 GEMM.
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
    let rows = x.rows();
    let blocks = x.cols / BLOCK;
    let mut u = Unpacked::default();
    for (wr, o) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(rows)) {
        o.fill(0.0);
        for b in 0..blocks {
            unpack(wr, b, &mut u);
            let (lo, hi): (&[i8; 16], &[i8; 16]) =
                (u.v[..16].try_into().expect("16"), u.v[16..].try_into().expect("16"));
            for (r, o) in o.iter_mut().enumerate() {
                let at = r * blocks + b;
                let a = &x.q[at * BLOCK..][..BLOCK];
                let (s0, s1) = (sum16(lo, &a[..16]), sum16(hi, &a[16..]));
                *o += x.d[at] * (u.scale[0] * s0 as f32 + u.scale[1] * s1 as f32) + u.min * x.ds[at];
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

/// The AVX2 kernel: a block's 32 weight bytes in one register, dotted with each activation
/// row's 32 by `vpmaddubsw` (unsigned × signed bytes, pairs summed to 16 bits: the weights'
/// magnitudes times the activations carrying the weights' signs) and `vpmaddwd` (to 32 bits,
/// four products a lane: lanes 0–3 are values 0–15, lanes 4–7 values 16–31, so that Q6_K's two
/// scales a block apply lane by lane), scaled and summed in f32 with FMA.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{unpack_with, Kind, Unpacked, BLOCK, MAX_ROWS, Q8};

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }

    /// # Safety
    /// The CPU has AVX2, FMA and F16C ([`available`]).
    pub(super) unsafe fn dot_rows(kind: Kind, w: &[u8], row_bytes: usize, x: &Q8, out: &mut [f32]) {
        debug_assert!(available());
        assert!(x.rows() <= MAX_ROWS && x.q.len() == x.rows() * x.cols && x.cols.is_multiple_of(BLOCK));
        assert!(w.len().is_multiple_of(row_bytes) && out.len() == w.len() / row_bytes * x.rows());
        // SAFETY: the caller found AVX2, FMA and F16C, the features the function is compiled
        // with; its loads stay within the slices, whose sizes are checked above.
        unsafe {
            match (x.rows(), kind) {
                (1, Kind::Q4_1) => one_row_q4_1(w, row_bytes, x, out),
                (1, Kind::Q8_0) => one_row_q8_0(w, row_bytes, x, out),
                (1, Kind::Q4_0) => one_row_q4_0(w, row_bytes, x, out),
                (1, _) => one_row(kind, w, row_bytes, x, out),
                _ => rows(kind, w, row_bytes, x, out),
            }
        }
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

    /// One activation row (a lone sequence's decode): its accumulator in a register. The sums
    /// are taken in the order [`rows`] takes them, so that a sequence's tokens do not depend on
    /// whether it decodes alone. A macro, expanded once for each common format with its kind a
    /// constant (the block's unpacking then compiles to that format's few instructions, with no
    /// branch or spilled registers in the loop: twice as fast as one loop for every format) and
    /// once for the rest.
    macro_rules! one_row_kernel {
        ($kind:expr, $w:expr, $row_bytes:expr, $x:expr, $out:expr) => {{
            let (kind, w, row_bytes, x, out): (Kind, &[u8], usize, &Q8, &mut [f32]) = ($kind, $w, $row_bytes, $x, $out);
            let blocks = x.cols / BLOCK;
            let ones = _mm256_set1_epi16(1);
            let mut u = Unpacked::default();
            let q = &x.q[..blocks * BLOCK];
            for (wr, o) in w.chunks_exact(row_bytes).zip(out.iter_mut()) {
                let mut acc = _mm256_setzero_ps();
                let mut offset = 0.0f32;
                for b in 0..blocks {
                    let (v, s0, s1, min) = block!(kind, wr, b, &mut u);
                    let a = _mm256_loadu_si256(q[b * BLOCK..][..BLOCK].as_ptr().cast());
                    let products =
                        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(a, v)), ones);
                    let scales = _mm256_mul_ps(_mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1), _mm256_set1_ps(x.d[b]));
                    acc = _mm256_fmadd_ps(scales, _mm256_cvtepi32_ps(products), acc);
                    offset += min * x.ds[b];
                }
                let lanes = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
                let pairs = _mm_add_ps(lanes, _mm_movehl_ps(lanes, lanes));
                let one = _mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1));
                *o = _mm_cvtss_f32(one) + offset;
            }
        }};
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn one_row(kind: Kind, w: &[u8], row_bytes: usize, x: &Q8, out: &mut [f32]) {
        one_row_kernel!(kind, w, row_bytes, x, out)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn one_row_q8_0(w: &[u8], row_bytes: usize, x: &Q8, out: &mut [f32]) {
        one_row_kernel!(Kind::Q8_0, w, row_bytes, x, out)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn one_row_q4_0(w: &[u8], row_bytes: usize, x: &Q8, out: &mut [f32]) {
        one_row_kernel!(Kind::Q4_0, w, row_bytes, x, out)
    }

    /// [`one_row`] for Q4_1, SmolLM2's published format, whose weights (0 to 15, the offset apart)
    /// are unsigned already: `vpmaddubsw` takes them as they are, without the sign trick, and
    /// both scales are one. The same integer products and the same f32 operations in the same
    /// order as [`rows`] (`d_w · d_a` is one rounding either way): the same sums to the bit.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn one_row_q4_1(w: &[u8], row_bytes: usize, x: &Q8, out: &mut [f32]) {
        const SIZE: usize = 20;
        let blocks = x.cols / BLOCK;
        let (ones, mask) = (_mm256_set1_epi16(1), _mm_set1_epi8(0x0f));
        let q = &x.q[..blocks * BLOCK];
        for (wr, o) in w.chunks_exact(row_bytes).zip(out.iter_mut()) {
            let mut acc = _mm256_setzero_ps();
            let mut offset = 0.0f32;
            for (b, block) in wr[..blocks * SIZE].chunks_exact(SIZE).enumerate() {
                let qs = _mm_loadu_si128(block[4..].as_ptr().cast());
                let v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), _mm_and_si128(qs, mask));
                let a = _mm256_loadu_si256(q[b * BLOCK..][..BLOCK].as_ptr().cast());
                let products = _mm256_madd_epi16(_mm256_maddubs_epi16(v, a), ones);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(half(block) * x.d[b]), _mm256_cvtepi32_ps(products), acc);
                offset += half(&block[2..]) * x.ds[b];
            }
            let lanes = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            let pairs = _mm_add_ps(lanes, _mm_movehl_ps(lanes, lanes));
            let one = _mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1));
            *o = _mm_cvtss_f32(one) + offset;
        }
    }

    /// An f16's value; inlined only into the kernels here, all compiled with F16C.
    #[inline(always)]
    fn half(b: &[u8]) -> f32 {
        // SAFETY: called only from this module's kernels, which have F16C enabled.
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes([b[0], b[1]]))))) }
    }

    /// Up to [`MAX_ROWS`] activation rows (a decode batch): each weight block unpacked once for
    /// every row. Expanded like [`one_row_kernel`].
    macro_rules! rows_kernel {
        ($kind:expr, $w:expr, $row_bytes:expr, $x:expr, $out:expr) => {{
            let (kind, w, row_bytes, x, out): (Kind, &[u8], usize, &Q8, &mut [f32]) = ($kind, $w, $row_bytes, $x, $out);
            let n = x.rows();
            let blocks = x.cols / BLOCK;
            let ones = _mm256_set1_epi16(1);
            let mut u = Unpacked::default();
            for (wr, o) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(n)) {
                let mut acc = [_mm256_setzero_ps(); MAX_ROWS];
                let mut offsets = [0.0f32; MAX_ROWS];
                for b in 0..blocks {
                    // The block's weights as signed bytes, its scales (per half) and its offset.
                    let (v, s0, s1, min) = block!(kind, wr, b, &mut u);
                    let magnitude = _mm256_sign_epi8(v, v);
                    let scales = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
                    for r in 0..n {
                        let at = r * blocks + b;
                        let a = _mm256_loadu_si256(x.q[at * BLOCK..][..BLOCK].as_ptr().cast());
                        let products = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(a, v)), ones);
                        let da = x.d[at];
                        acc[r] = _mm256_fmadd_ps(
                            _mm256_mul_ps(scales, _mm256_set1_ps(da)),
                            _mm256_cvtepi32_ps(products),
                            acc[r],
                        );
                        offsets[r] += min * x.ds[at];
                    }
                }
                for r in 0..n {
                    let lanes = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
                    let pairs = _mm_add_ps(lanes, _mm_movehl_ps(lanes, lanes));
                    let one = _mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1));
                    o[r] = _mm_cvtss_f32(one) + offsets[r];
                }
            }
        }};
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows(kind: Kind, w: &[u8], row_bytes: usize, x: &Q8, out: &mut [f32]) {
        match kind {
            Kind::Q8_0 => rows_kernel!(Kind::Q8_0, w, row_bytes, x, out),
            Kind::Q4_0 => rows_kernel!(Kind::Q4_0, w, row_bytes, x, out),
            Kind::Q4_1 => rows_kernel!(Kind::Q4_1, w, row_bytes, x, out),
            _ => rows_kernel!(kind, w, row_bytes, x, out),
        }
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
    /// the sum of the products' magnitudes.
    #[test]
    fn every_format_computes_what_its_dequantized_values_do() {
        let mut rng = StdRng::seed_from_u64(7);
        let cols = 512;
        for kind in [Kind::Q8_0, Kind::Q4_0, Kind::Q4_1, Kind::Q5_0, Kind::Q5_1, Kind::Q4K, Kind::Q5K, Kind::Q6K] {
            let (per_block, size) = kind.block().unwrap();
            let row_bytes = cols / per_block * size;
            let rows = 3;
            let w = random_blocks(kind, rows * cols / per_block, &mut rng);
            let x: Vec<f32> = (0..2 * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let q = Q8::quantize(&x, cols);
            let mut out = vec![0.0; rows * 2];
            dot_rows(kind, &w, row_bytes, &q, &mut out);
            let mut portable = vec![0.0; rows * 2];
            dot_rows_portable(kind, &w, row_bytes, &q, &mut portable);
            // Each activation row alone (a lone sequence's kernel).
            let alone: Vec<Vec<f32>> = (0..2)
                .map(|r| {
                    let mut out = vec![0.0; rows];
                    dot_rows(kind, &w, row_bytes, &Q8::quantize(&x[r * cols..][..cols], cols), &mut out);
                    out
                })
                .collect();
            for j in 0..rows {
                let wf = dequantize(kind, &w[j * row_bytes..][..row_bytes], cols);
                for r in 0..2 {
                    let xr = &x[r * cols..][..cols];
                    let exact: f32 = wf.iter().zip(xr).map(|(a, b)| a * b).sum();
                    let scale: f32 = wf.iter().zip(xr).map(|(a, b)| (a * b).abs()).sum();
                    let got = out[j * 2 + r];
                    assert!(
                        (got - exact).abs() <= 0.01 * scale,
                        "{kind}: row {j}, x {r}: {got} against {exact} (|·| {scale})"
                    );
                    assert!((got - portable[j * 2 + r]).abs() <= 1e-4 * scale, "{kind}: the two copies differ");
                    // Bit for bit: a sequence's tokens must not depend on its step's company.
                    assert_eq!(got, alone[r][j], "{kind}: a row alone differs");
                }
            }
        }
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
