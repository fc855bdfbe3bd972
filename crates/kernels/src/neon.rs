//! NEON kernels (aarch64): 4-bit affine weights (group a multiple of 16) and
//! f32 / bf16 dense weights. Other layouts run the scalar code, which is then
//! also what [`crate::Isa::Neon`] computes for them.
//!
//! As in the AVX2 module, blocking over tokens only shares weight decoding;
//! the arithmetic of one (row, token) pair is one fixed instruction sequence:
//!
//! * float weights: four 4-lane FMA chains over 16-element steps, combined as
//!   `(c0 + c1) + (c2 + c3)`, a pairwise horizontal sum, then the `cols % 16`
//!   tail added in order (mul, add);
//! * 4-bit affine weights, input in the pair-split order of
//!   [`crate::Token::xp`]: per group four 4-lane FMA chains from zero (low
//!   nibbles of the first and last 4 code bytes of each 8, then the high
//!   nibbles, used in place as `b & 0xF0` against `x_odd / 16`), folded as
//!   `acc = fma((c0 + c1) + (c2 + c3), scale, acc)`; the bias term is a scalar
//!   chain of `bias[g] * gsum[g]` over the groups in order; the result is
//!   `hsum(acc) + bias chain`.

use std::arch::aarch64::*;

use crate::scalar::AffineRow;
use crate::Token;
use slipstream_core::tensor::scale_to_f32;
use slipstream_core::{QuantType, ScaleType, TensorView};

/// Rows `r0..r1` for all tokens into `out` (`[r1 - r0, toks.len()]`).
pub(crate) fn rows(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    assert!(r0 <= r1 && r1 <= w.rows);
    assert_eq!(out.len(), (r1 - r0) * toks.len());
    match w.qtype {
        QuantType::F32 | QuantType::Bf16 => float_rows(w, r0, r1, toks, out),
        QuantType::Affine {
            bits: 4,
            group,
            scale,
        } if group % 16 == 0 && toks.iter().all(|t| t.xp.len() >= w.cols) => {
            q4_rows(w, r0, r1, toks, out, group as usize, scale)
        }
        _ => crate::scalar::rows(w, r0, r1, toks, out),
    }
}

/// Pairwise horizontal sum `(v0 + v1) + (v2 + v3)`.
#[inline]
fn hsum(v: float32x4_t) -> f32 {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { vaddvq_f32(v) }
}

fn float_rows(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    let cols = w.cols;
    let esize = if w.qtype == QuantType::F32 { 4 } else { 2 };
    let ntok = toks.len();
    for r in r0..r1 {
        let row = &w.data[r * cols * esize..(r + 1) * cols * esize];
        for (t, tok) in toks.iter().enumerate() {
            out[(r - r0) * ntok + t] = if esize == 4 {
                dot_f32(row, tok.x)
            } else {
                dot_bf16(row, tok.x)
            };
        }
    }
}

/// 4 weights from `p` (f32 little-endian bytes).
#[inline]
fn ld_w_f32(p: &[u8]) -> float32x4_t {
    assert!(p.len() >= 16);
    // SAFETY: 16 readable bytes (asserted); unaligned loads are allowed.
    unsafe { vreinterpretq_f32_u8(vld1q_u8(p.as_ptr())) }
}

/// 4 weights from `p` (bf16 little-endian bytes): the upper halves of f32.
#[inline]
fn ld_w_bf16(p: &[u8]) -> float32x4_t {
    assert!(p.len() >= 8);
    // SAFETY: 8 readable bytes (asserted); unaligned loads are allowed.
    unsafe {
        let h = vreinterpret_u16_u8(vld1_u8(p.as_ptr()));
        vreinterpretq_f32_u32(vshll_n_u16::<16>(h))
    }
}

#[inline]
fn ld_x(x: &[f32]) -> float32x4_t {
    assert!(x.len() >= 4);
    // SAFETY: 4 readable f32 (asserted).
    unsafe { vld1q_f32(x.as_ptr()) }
}

macro_rules! float_dot {
    ($name:ident, $esize:literal, $ld:ident, $elem:expr) => {
        fn $name(row: &[u8], x: &[f32]) -> f32 {
            let cols = x.len();
            let main = cols / 16 * 16;
            // SAFETY: NEON is part of the aarch64 baseline.
            let mut c = unsafe { [vdupq_n_f32(0.0); 4] };
            let mut j = 0;
            while j < main {
                for (i, ci) in c.iter_mut().enumerate() {
                    let wv = $ld(&row[(j + 4 * i) * $esize..]);
                    // SAFETY: NEON is part of the aarch64 baseline.
                    *ci = unsafe { vfmaq_f32(*ci, wv, ld_x(&x[j + 4 * i..])) };
                }
                j += 16;
            }
            // SAFETY: NEON is part of the aarch64 baseline.
            let mut s = hsum(unsafe { vaddq_f32(vaddq_f32(c[0], c[1]), vaddq_f32(c[2], c[3])) });
            let elem: fn(&[u8], usize) -> f32 = $elem;
            for (i, &xv) in x.iter().enumerate().skip(main) {
                s += elem(row, i) * xv;
            }
            s
        }
    };
}

float_dot!(dot_f32, 4, ld_w_f32, |row, i| {
    f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]])
});
float_dot!(dot_bf16, 2, ld_w_bf16, |row, i| {
    scale_to_f32(ScaleType::Bf16, [row[2 * i], row[2 * i + 1]])
});

fn q4_rows(
    w: &TensorView,
    r0: usize,
    r1: usize,
    toks: &[Token],
    out: &mut [f32],
    group: usize,
    scale: ScaleType,
) {
    let (c, s, b) = w.affine_parts();
    let ntok = toks.len();
    for r in r0..r1 {
        let row = AffineRow::from_parts(c, s, b, w.cols, 4, group, r);
        let mut t = 0;
        while t + 4 <= ntok {
            let xs: [&Token; 4] = [&toks[t], &toks[t + 1], &toks[t + 2], &toks[t + 3]];
            let res = q4_block::<4>(&row, xs, group, w.cols, scale);
            for (i, v) in res.iter().enumerate() {
                out[(r - r0) * ntok + t + i] = *v;
            }
            t += 4;
        }
        while t < ntok {
            let res = q4_block::<1>(&row, [&toks[t]], group, w.cols, scale);
            out[(r - r0) * ntok + t] = res[0];
            t += 1;
        }
    }
}

/// One 4-bit row against `T` tokens (see the module doc for the sequence).
#[allow(clippy::needless_range_loop)]
fn q4_block<const T: usize>(
    row: &AffineRow,
    xs: [&Token; T],
    group: usize,
    cols: usize,
    scale: ScaleType,
) -> [f32; T] {
    let ng = cols / group;
    let gbytes = group / 2;
    assert!(row.codes.len() >= ng * gbytes && row.scales.len() >= ng * 2);
    for t in &xs {
        assert!(t.xp.len() >= cols && t.gsum.len() >= ng);
    }
    // SAFETY (whole body): NEON is part of the aarch64 baseline; every load
    // reads 8 code bytes or 4 f32 inside the lengths asserted above.
    unsafe {
        let m_lo = vdup_n_u8(0x0F);
        let m_hi = vdup_n_u8(0xF0);
        let mut acc = [vdupq_n_f32(0.0); T];
        for g in 0..ng {
            let mut ch = [[vdupq_n_f32(0.0); 4]; T];
            for k in 0..group / 16 {
                let bytes = vld1_u8(row.codes[g * gbytes + k * 8..].as_ptr());
                let lo = vmovl_u8(vand_u8(bytes, m_lo));
                let hi = vmovl_u8(vand_u8(bytes, m_hi));
                let w = [
                    vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))),
                    vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo))),
                    vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))),
                    vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi))),
                ];
                for t in 0..T {
                    let xp = &xs[t].xp[g * group + k * 16..];
                    for i in 0..4 {
                        ch[t][i] = vfmaq_f32(ch[t][i], w[i], ld_x(&xp[4 * i..]));
                    }
                }
            }
            let sc = vdupq_n_f32(scale_to_f32(
                scale,
                [row.scales[2 * g], row.scales[2 * g + 1]],
            ));
            for t in 0..T {
                let sum = vaddq_f32(vaddq_f32(ch[t][0], ch[t][1]), vaddq_f32(ch[t][2], ch[t][3]));
                acc[t] = vfmaq_f32(acc[t], sum, sc);
            }
        }
        let mut out = [0f32; T];
        for t in 0..T {
            let mut bias = 0f32;
            for g in 0..ng {
                let bv = scale_to_f32(scale, [row.biases[2 * g], row.biases[2 * g + 1]]);
                bias += bv * xs[t].gsum[g];
            }
            out[t] = hsum(acc[t]) + bias;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    /// The property tests of `crate::tests` and `crate::q4i16` cover every
    /// [`crate::Isa::available`]; make sure NEON is among them here.
    #[test]
    fn neon_is_detected_and_used() {
        assert_eq!(crate::Isa::detect(), crate::Isa::Neon);
        assert!(crate::Isa::available().contains(&crate::Isa::Neon));
    }
}
