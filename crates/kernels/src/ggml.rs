//! GGML block quantization types (llama.cpp's `Q4_0`, `Q8_0`, `Q4_K`, `Q5_K`,
//! `Q6_K`, layouts in [`slipstream_core::quant`]): scalar reference kernels,
//! row dequantization and quantizers.
//!
//! # Dequantization
//! [`dequantize_block`] gives, in f32, exactly what gguf-py's
//! `quants.dequantize` gives (checked against a committed fixture, see
//! `tests/fixtures/ggml_blocks/`, which llama.cpp's compiled C reproduces too:
//! `tools/reference/ggml_blocks_check.c`): the same products in the same order, never
//! fused (`Q4_0`: `d * (q - 8)`; `Q8_0`: `q * d`; `Q4_K`/`Q5_K`:
//! `(d * sc) * q - dmin * m`; `Q6_K`: `(d * sc) * (q - 32)`).
//!
//! # Products
//! The scalar reference ([`rows`]) dequantizes each block then accumulates
//! `w * x` sequentially (multiply, then add) for each (row, token). The SIMD
//! kernels (`avx2` submodule) keep the codes in registers and evaluate, per
//! block or sub-block, `scale * sum(q * x)` (minus `min * sum(x)` for the
//! K-quants with mins); they agree with the reference to rounding.
//! Activations are f32; [`crate::Activations::Int8`] instead quantizes them
//! to 8 bits per block and takes integer dot products ([`q8`]).
//!
//! # Quantizers
//! [`quantize_q4_0`] and [`quantize_q8_0`] match llama.cpp's
//! `quantize_row_q4_0_ref` / `quantize_row_q8_0_ref` (and gguf-py's
//! quantizers) bit for bit, with multiply and add never fused. The K-quant
//! quantizers ([`quantize_q4_k`], [`quantize_q5_k`], [`quantize_q6_k`]) are
//! simple min/max (or absmax) fits, correct and within about one code step,
//! but **not** llama.cpp's search-based `quantize_row_q*_K_ref`: their bytes
//! differ from what llama.cpp would write. Use them to build test data.

use crate::Token;
use slipstream_core::{QuantType, TensorView};

pub mod affine;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
pub mod check;
#[cfg(target_arch = "x86_64")]
mod gemm;
pub mod q8;
#[cfg(target_arch = "x86_64")]
pub(crate) mod q8_avx2;
#[cfg(test)]
mod tests;

/// Elements per `Q4_0` / `Q8_0` block.
pub const QK: usize = 32;
/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// Little-endian f16 at `b[i..i + 2]` as f32 (exact).
#[inline]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Unpacks the 12-byte 6-bit scales and mins of a `Q4_K` / `Q5_K` block
/// (llama.cpp's `get_scale_min_k4` for `j = 0..8`).
#[inline]
pub fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
    }
    for j in 4..8 {
        sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    (sc, m)
}

/// Packs 6-bit scales and mins (each `< 64`) into 12 bytes; inverse of
/// [`scale_min_k4`].
pub fn pack_scale_min_k4(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    s
}

/// Dequantizes one block of `qtype` (`block` is its bytes) into `out`
/// (`[block elements]`), bit-identical to gguf-py's `dequantize`.
///
/// Panics if `qtype` is not a GGML block type or the lengths are wrong.
pub fn dequantize_block(qtype: QuantType, block: &[u8], out: &mut [f32]) {
    let (be, bb) = qtype
        .ggml_block()
        .unwrap_or_else(|| panic!("{} is not a GGML block type", qtype.name()));
    assert_eq!(block.len(), bb, "{} block length", qtype.name());
    assert_eq!(out.len(), be, "{} block elements", qtype.name());
    let b = block;
    match qtype {
        QuantType::Q4_0 => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                out[j] = d * ((b[2 + j] & 0xF) as i32 - 8) as f32;
                out[j + 16] = d * ((b[2 + j] >> 4) as i32 - 8) as f32;
            }
        }
        QuantType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                out[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        QuantType::Q4K | QuantType::Q5K => {
            let five = qtype == QuantType::Q5K;
            let d = f16_at(b, 0);
            let dmin = f16_at(b, 2);
            let (sc, m) = scale_min_k4(&b[4..16]);
            let (qh, qs) = if five {
                (&b[16..48], &b[48..176])
            } else {
                (&b[0..0], &b[16..144])
            };
            for j in 0..8 {
                let dj = d * sc[j] as f32;
                let mj = dmin * m[j] as f32;
                let ql = &qs[32 * (j / 2)..32 * (j / 2) + 32];
                let shift = 4 * (j % 2);
                for l in 0..32 {
                    let mut q = (ql[l] >> shift) & 0xF;
                    if five {
                        q |= ((qh[l] >> j) & 1) << 4;
                    }
                    out[32 * j + l] = dj * q as f32 - mj;
                }
            }
        }
        QuantType::Q6K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            for h in 0..2 {
                for k in 0..4 {
                    for l in 0..32 {
                        let nib = (ql[h * 64 + (k % 2) * 32 + l] >> (4 * (k / 2))) & 0xF;
                        let hb = (qh[h * 32 + l] >> (2 * k)) & 3;
                        let q = (nib | (hb << 4)) as i32 - 32;
                        let e = h * 128 + k * 32 + l;
                        let s = d * (sc[e / 16] as i8) as f32;
                        out[e] = s * q as f32;
                    }
                }
            }
        }
        _ => unreachable!(),
    }
}

/// Panics unless `w` is a GGML block tensor whose rows are whole blocks.
pub(crate) fn check_blocks(w: &TensorView) {
    let (be, _) = w
        .qtype
        .ggml_block()
        .unwrap_or_else(|| panic!("{} is not a GGML block type", w.qtype.name()));
    assert!(
        w.cols.is_multiple_of(be),
        "{} row length {} is not a multiple of {be}",
        w.qtype.name(),
        w.cols
    );
    assert_eq!(
        w.data.len(),
        w.qtype.nbytes(w.rows, w.cols),
        "{} data length",
        w.qtype.name()
    );
}

/// Bytes of row `row` of a GGML block tensor.
#[inline]
pub(crate) fn row_bytes<'a>(w: &TensorView<'a>, row: usize) -> &'a [u8] {
    let (be, bb) = w.qtype.ggml_block().expect("GGML block type");
    let rb = w.cols / be * bb;
    &w.data[row * rb..(row + 1) * rb]
}

/// Dequantizes row `row` of a GGML block tensor into `out` (`[cols]`),
/// bit-identical to gguf-py's `dequantize`.
pub fn dequantize_row(w: &TensorView, row: usize, out: &mut [f32]) {
    check_blocks(w);
    let (be, bb) = w.qtype.ggml_block().expect("GGML block type");
    assert!(row < w.rows, "row {row} out of range ({} rows)", w.rows);
    assert_eq!(out.len(), w.cols, "dequantize_row: out length != cols");
    for (o, b) in out
        .chunks_exact_mut(be)
        .zip(row_bytes(w, row).chunks_exact(bb))
    {
        dequantize_block(w.qtype, b, o);
    }
}

/// Scalar reference product: rows `r0..r1` for all tokens into `out`
/// (`[r1 - r0, toks.len()]`). Per (row, token): each block dequantized as
/// [`dequantize_block`], then `s += w * x` in element order.
pub(crate) fn rows(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    check_blocks(w);
    let (be, bb) = w.qtype.ggml_block().expect("GGML block type");
    let ntok = toks.len();
    assert_eq!(out.len(), (r1 - r0) * ntok);
    let mut buf = vec![0f32; be];
    for (r, o) in (r0..r1).zip(out.chunks_exact_mut(ntok.max(1))) {
        let rb = row_bytes(w, r);
        o.fill(0.0);
        for (bi, b) in rb.chunks_exact(bb).enumerate() {
            dequantize_block(w.qtype, b, &mut buf);
            for (ot, t) in o.iter_mut().zip(toks) {
                let mut s = *ot;
                for (&v, &xv) in buf.iter().zip(&t.x[bi * be..(bi + 1) * be]) {
                    s += v * xv;
                }
                *ot = s;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Quantizers
// ---------------------------------------------------------------------------

/// Quantizes `values` (a multiple of the block size of `qtype`, any number of
/// rows back to back) to GGML blocks of `qtype`. See the module doc for which
/// quantizers match llama.cpp's bytes.
///
/// Panics if `qtype` is not a GGML type or the length is not a multiple of
/// its block.
pub fn quantize(values: &[f32], qtype: QuantType) -> Vec<u8> {
    let (be, bb) = qtype
        .ggml_block()
        .unwrap_or_else(|| panic!("{} is not a GGML block type", qtype.name()));
    assert!(
        values.len().is_multiple_of(be),
        "{} values: length {} is not a multiple of {be}",
        qtype.name(),
        values.len()
    );
    let mut out = vec![0u8; values.len() / be * bb];
    for (x, o) in values.chunks_exact(be).zip(out.chunks_exact_mut(bb)) {
        match qtype {
            QuantType::Q4_0 => quantize_block_q4_0(x, o),
            QuantType::Q8_0 => quantize_block_q8_0(x, o),
            QuantType::Q4K => quantize_block_q45_k(x, o, false),
            QuantType::Q5K => quantize_block_q45_k(x, o, true),
            QuantType::Q6K => quantize_block_q6_k(x, o),
            _ => unreachable!(),
        }
    }
    out
}

/// `Q4_0` blocks, bit-identical to llama.cpp's `quantize_row_q4_0_ref`.
pub fn quantize_q4_0(values: &[f32]) -> Vec<u8> {
    quantize(values, QuantType::Q4_0)
}

/// `Q8_0` blocks, bit-identical to llama.cpp's `quantize_row_q8_0_ref`.
pub fn quantize_q8_0(values: &[f32]) -> Vec<u8> {
    quantize(values, QuantType::Q8_0)
}

/// `Q4_K` blocks from a simple min/max fit (not llama.cpp's bytes).
pub fn quantize_q4_k(values: &[f32]) -> Vec<u8> {
    quantize(values, QuantType::Q4K)
}

/// `Q5_K` blocks from a simple min/max fit (not llama.cpp's bytes).
pub fn quantize_q5_k(values: &[f32]) -> Vec<u8> {
    quantize(values, QuantType::Q5K)
}

/// `Q6_K` blocks from a simple absmax fit (not llama.cpp's bytes).
pub fn quantize_q6_k(values: &[f32]) -> Vec<u8> {
    quantize(values, QuantType::Q6K)
}

fn quantize_block_q4_0(x: &[f32], o: &mut [u8]) {
    // First element of largest magnitude (strictly greater wins), as the C.
    let mut amax = 0f32;
    let mut max = 0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    o[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
    for j in 0..16 {
        let x0 = x[j] * id;
        let x1 = x[16 + j] * id;
        // `(int8_t)(x + 8.5f)` truncates toward zero; then MIN(15, .).
        let q0 = ((x0 + 8.5) as i8).min(15) as u8;
        let q1 = ((x1 + 8.5) as i8).min(15) as u8;
        o[2 + j] = q0 | (q1 << 4);
    }
}

fn quantize_block_q8_0(x: &[f32], o: &mut [u8]) {
    let mut amax = 0f32;
    for &v in x {
        amax = amax.max(v.abs());
    }
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    o[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
    for j in 0..32 {
        // roundf: half away from zero.
        o[2 + j] = ((x[j] * id).round() as i8) as u8;
    }
}

/// Rounds `v >= 0` up to an f16 (so that codes computed against it never
/// exceed their range): (stored value, as f32).
fn f16_round(v: f32) -> (half::f16, f32) {
    let mut h = half::f16::from_f32(v);
    if h.to_f32() < v && h.is_finite() {
        h = half::f16::from_bits(h.to_bits() + 1);
    }
    (h, h.to_f32())
}

/// `v / s` rounded and clamped to `0..=max` (0 when `s` is 0 or the
/// quotient is NaN).
fn code(v: f32, s: f32, max: i32) -> i32 {
    if s == 0.0 {
        return 0;
    }
    let q = (v / s).round();
    if q.is_nan() {
        0
    } else {
        (q as i32).clamp(0, max)
    }
}

fn quantize_block_q45_k(x: &[f32], o: &mut [u8], five: bool) {
    let nmax = if five { 31 } else { 15 };
    let mut scale = [0f32; 8];
    let mut mins = [0f32; 8];
    for j in 0..8 {
        let sub = &x[32 * j..32 * j + 32];
        let mn = sub.iter().fold(0f32, |a, &v| a.min(v));
        let mx = sub.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
        scale[j] = (mx - mn) / nmax as f32;
        mins[j] = -mn;
    }
    let max_scale = scale.iter().fold(0f32, |a, &v| a.max(v));
    let max_min = mins.iter().fold(0f32, |a, &v| a.max(v));
    let (dh, d) = f16_round(max_scale / 63.0);
    let (mh, dmin) = f16_round(max_min / 63.0);
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = code(scale[j], d, 63) as u8;
        lm[j] = code(mins[j], dmin, 63) as u8;
        // A scale rounded to zero would lose its sub-block: round up instead.
        if ls[j] == 0 && scale[j] > 0.0 && d > 0.0 {
            ls[j] = 1;
        }
    }
    o[0..2].copy_from_slice(&dh.to_le_bytes());
    o[2..4].copy_from_slice(&mh.to_le_bytes());
    o[4..16].copy_from_slice(&pack_scale_min_k4(&ls, &lm));
    let (qh, qs) = if five {
        let (a, b) = o[16..176].split_at_mut(32);
        (Some(a), b)
    } else {
        (None, &mut o[16..144])
    };
    qs.fill(0);
    let mut qh = qh;
    if let Some(h) = qh.as_deref_mut() {
        h.fill(0);
    }
    for j in 0..8 {
        // The values dequantization will use.
        let dj = d * ls[j] as f32;
        let mj = dmin * lm[j] as f32;
        for l in 0..32 {
            let q = code(x[32 * j + l] + mj, dj, nmax) as u8;
            qs[32 * (j / 2) + l] |= (q & 0xF) << (4 * (j % 2));
            if let Some(h) = qh.as_deref_mut() {
                h[l] |= ((q >> 4) & 1) << j;
            }
        }
    }
}

fn quantize_block_q6_k(x: &[f32], o: &mut [u8]) {
    let mut sub = [0f32; 16];
    for (k, s) in sub.iter_mut().enumerate() {
        let amax = x[16 * k..16 * k + 16]
            .iter()
            .fold(0f32, |a, &v| a.max(v.abs()));
        *s = amax / 31.0;
    }
    let max_sub = sub.iter().fold(0f32, |a, &v| a.max(v));
    let (dh, d) = f16_round(max_sub / 127.0);
    o.fill(0);
    let mut sc = [0i8; 16];
    for k in 0..16 {
        let mut s = code(sub[k], d, 127);
        if s == 0 && sub[k] > 0.0 && d > 0.0 {
            s = 1;
        }
        sc[k] = s as i8;
        o[192 + k] = sc[k] as u8;
    }
    o[208..210].copy_from_slice(&dh.to_le_bytes());
    for (e, &v) in x.iter().enumerate().take(QK_K) {
        let s = d * sc[e / 16] as f32;
        // Codes -32..=31 stored with an offset of 32.
        let q = if s == 0.0 {
            32
        } else {
            code(v + 32.0 * s, s, 63) as u8
        };
        let (h, rest) = (e / 128, e % 128);
        let (k, l) = (rest / 32, rest % 32);
        o[h * 64 + (k % 2) * 32 + l] |= (q & 0xF) << (4 * (k / 2));
        o[128 + h * 32 + l] |= (q >> 4) << (2 * k);
    }
}
