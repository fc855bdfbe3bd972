//! Portable reference kernels: plain Rust, single-threaded, no fused
//! multiply-add. These are the test oracle for the SIMD kernels and the
//! fallback on CPUs without them.

use crate::{check_weight, Activations, Token};
use slipstream_core::tensor::scale_to_f32;
use slipstream_core::{QuantType, TensorView};

/// `y[r] = sum_c W[r, c] * x[c]`; `x` is `[cols]`, `y` is `[rows]`.
/// Single-threaded, f32 activations; bit-identical to
/// `crate::matvec_with(Isa::Scalar, ..)`.
pub fn matvec(w: &TensorView, x: &[f32], y: &mut [f32]) {
    check_weight(w);
    assert_eq!(x.len(), w.cols, "matvec: x length != cols");
    assert_eq!(y.len(), w.rows, "matvec: y length != rows");
    let toks = [Token::new(w, x, Activations::Exact)];
    rows(w, 0, w.rows, &toks, y);
}

/// `y[t, r] = sum_c W[r, c] * x[t, c]`; `x` is `[n, cols]`, `y` is `[n, rows]`.
/// Row `t` of `y` is bit-identical to [`matvec`] of row `t` of `x`.
pub fn matmul(w: &TensorView, x: &[f32], n: usize, y: &mut [f32]) {
    check_weight(w);
    assert_eq!(x.len(), n * w.cols, "matmul: x length != n * cols");
    assert_eq!(y.len(), n * w.rows, "matmul: y length != n * rows");
    let (c, r) = (w.cols, w.rows);
    for t in 0..n {
        matvec(w, &x[t * c..(t + 1) * c], &mut y[t * r..(t + 1) * r]);
    }
}

/// Dequantizes row `row` of `w` into `out` (`[cols]`). Affine values are
/// `scale * q + bias` in f32, multiply then add (no FMA).
pub fn dequantize_row(w: &TensorView, row: usize, out: &mut [f32]) {
    check_weight(w);
    assert!(row < w.rows, "row {row} out of range ({} rows)", w.rows);
    assert_eq!(out.len(), w.cols, "dequantize_row: out length != cols");
    let cols = w.cols;
    match w.qtype {
        QuantType::F32 => {
            let b = &w.data[row * cols * 4..(row + 1) * cols * 4];
            for (o, e) in out.iter_mut().zip(b.chunks_exact(4)) {
                *o = f32::from_le_bytes([e[0], e[1], e[2], e[3]]);
            }
        }
        QuantType::F16 => {
            let b = &w.data[row * cols * 2..(row + 1) * cols * 2];
            for (o, e) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([e[0], e[1]]).to_f32();
            }
        }
        QuantType::Bf16 => {
            let b = &w.data[row * cols * 2..(row + 1) * cols * 2];
            for (o, e) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([e[0], e[1]]).to_f32();
            }
        }
        QuantType::Affine { bits, group, scale } => {
            let group = group as usize;
            let a = AffineRow::new(w, row);
            for (g, og) in out.chunks_exact_mut(group).enumerate() {
                let s = scale_to_f32(scale, [a.scales[2 * g], a.scales[2 * g + 1]]);
                let b = scale_to_f32(scale, [a.biases[2 * g], a.biases[2 * g + 1]]);
                for (i, o) in og.iter_mut().enumerate() {
                    let q = code(a.codes, bits, g * group + i) as f32;
                    *o = s * q + b;
                }
            }
        }
        QuantType::Q4_0 | QuantType::Q8_0 | QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => {
            crate::ggml::dequantize_row(w, row, out)
        }
    }
}

/// Code `j` of an affine row's packed codes.
#[inline]
pub(crate) fn code(codes: &[u8], bits: u8, j: usize) -> u8 {
    if bits == 4 {
        (codes[j / 2] >> ((j & 1) * 4)) & 0xF
    } else {
        codes[j]
    }
}

/// The byte regions of one affine row.
pub(crate) struct AffineRow<'a> {
    /// `cols * bits / 8` bytes.
    pub codes: &'a [u8],
    /// `cols / group` little-endian 2-byte values.
    pub scales: &'a [u8],
    /// Same shape as `scales`.
    pub biases: &'a [u8],
}

impl<'a> AffineRow<'a> {
    pub fn new(w: &TensorView<'a>, row: usize) -> AffineRow<'a> {
        let QuantType::Affine { bits, group, .. } = w.qtype else {
            unreachable!("AffineRow on a non-affine tensor");
        };
        let (c, s, b) = w.affine_parts();
        AffineRow::from_parts(c, s, b, w.cols, bits, group as usize, row)
    }

    /// Row `row` of the regions returned by `TensorView::affine_parts`.
    #[inline]
    pub fn from_parts(
        c: &'a [u8],
        s: &'a [u8],
        b: &'a [u8],
        cols: usize,
        bits: u8,
        group: usize,
        row: usize,
    ) -> AffineRow<'a> {
        let cb = cols * bits as usize / 8;
        let sb = cols / group * 2;
        AffineRow {
            codes: &c[row * cb..(row + 1) * cb],
            scales: &s[row * sb..(row + 1) * sb],
            biases: &b[row * sb..(row + 1) * sb],
        }
    }
}

/// Rows `r0..r1` for all tokens into `out` (`[r1 - r0, toks.len()]`).
pub(crate) fn rows(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    if w.qtype.is_ggml() {
        return crate::ggml::rows(w, r0, r1, toks, out);
    }
    let ntok = toks.len();
    assert_eq!(out.len(), (r1 - r0) * ntok);
    let cols = w.cols;
    for (r, o) in (r0..r1).zip(out.chunks_exact_mut(ntok.max(1))) {
        match w.qtype {
            QuantType::F32 => {
                let b = &w.data[r * cols * 4..(r + 1) * cols * 4];
                for (ot, t) in o.iter_mut().zip(toks) {
                    let mut s = 0f32;
                    for (e, &xv) in b.chunks_exact(4).zip(t.x) {
                        s += f32::from_le_bytes([e[0], e[1], e[2], e[3]]) * xv;
                    }
                    *ot = s;
                }
            }
            QuantType::F16 => {
                let b = &w.data[r * cols * 2..(r + 1) * cols * 2];
                for (ot, t) in o.iter_mut().zip(toks) {
                    let mut s = 0f32;
                    for (e, &xv) in b.chunks_exact(2).zip(t.x) {
                        s += half::f16::from_le_bytes([e[0], e[1]]).to_f32() * xv;
                    }
                    *ot = s;
                }
            }
            QuantType::Bf16 => {
                let b = &w.data[r * cols * 2..(r + 1) * cols * 2];
                for (ot, t) in o.iter_mut().zip(toks) {
                    let mut s = 0f32;
                    for (e, &xv) in b.chunks_exact(2).zip(t.x) {
                        s += half::bf16::from_le_bytes([e[0], e[1]]).to_f32() * xv;
                    }
                    *ot = s;
                }
            }
            QuantType::Affine { bits, group, scale } => {
                let group = group as usize;
                let a = AffineRow::new(w, r);
                for (ot, t) in o.iter_mut().zip(toks) {
                    let mut acc = 0f32;
                    for (g, xg) in t.x.chunks_exact(group).enumerate() {
                        let s = scale_to_f32(scale, [a.scales[2 * g], a.scales[2 * g + 1]]);
                        let b = scale_to_f32(scale, [a.biases[2 * g], a.biases[2 * g + 1]]);
                        let mut qx = 0f32;
                        for (i, &xv) in xg.iter().enumerate() {
                            qx += code(a.codes, bits, g * group + i) as f32 * xv;
                        }
                        acc += s * qx + b * t.gsum[g];
                    }
                    *ot = acc;
                }
            }
            QuantType::Q4_0
            | QuantType::Q8_0
            | QuantType::Q4K
            | QuantType::Q5K
            | QuantType::Q6K => unreachable!("GGML block types are handled above"),
        }
    }
}
