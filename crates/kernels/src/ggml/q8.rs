//! GGML block products with 8-bit activations ([`crate::Activations::Int8`]),
//! llama.cpp's CPU scheme: each token's input is quantized once per block to
//! 8-bit codes, and every block product is an integer dot product, scaled.
//!
//! # Input quantization
//! * `Q4_0`, `Q8_0` weights: `q8_0` blocks of 32 ([`quantize_q8_0`]): the
//!   rounding of llama.cpp's `quantize_row_q8_0_ref` (`d = amax / 127`,
//!   `q = roundf(x * (1 / d))`, half away from zero; `d` stored as f16 and
//!   used as that f16).
//! * `Q4_K`, `Q5_K`, `Q6_K` weights: `q8_K` blocks of 256 ([`quantize_q8_k`]):
//!   the rounding of llama.cpp's `quantize_row_q8_K_ref` (`iscale = -127 /
//!   max` where `max` is the first element of largest magnitude,
//!   `q = nearest_int(iscale * x)`, ties to even, `d = 1 / iscale` in f32),
//!   with sums of the codes per 16 elements (`bsums`).
//!
//! Codes are in `-127..=127` (never -128, which the AVX2 sign trick could not
//! negate).
//!
//! # The product (the definition both kernels follow)
//! Per (row, token) eight f32 lanes `acc[l]`. Each block or super-block
//! gives eight exact integer lane sums `s[l]`, lane `l` covering elements
//! `4l..4l + 4` of every 32-element group of the block (the lanes of
//! `_mm256_madd_epi16(_mm256_maddubs_epi16(..))` over 32 bytes):
//! * `Q4_0` / `Q8_0`: `s[l] = sum (q_w - 8 | q_w) * q_x`; then
//!   `acc[l] = fma(d_w * d_x, s[l], acc[l])`;
//! * `Q4_K` / `Q5_K`: `s[l] = sum_j sc_j * sum q_w * q_x` over the 8
//!   sub-blocks `j`; `acc[l] = fma(d_x * d, s[l], acc[l])`; and per super-block
//!   one scalar `accm = fma(-d_x * dmin, sum_j m_j * X_j, accm)` (`X_j` the
//!   code sum of sub-block `j`, from `bsums`);
//! * `Q6_K`: `s[l] = sum_g sc * sum (q_w - 32) * q_x` over the 8 groups of 32
//!   (`sc` the scale of the 16 elements the lane's 4 fall in);
//!   `acc[l] = fma(d_x * d, s[l], acc[l])`.
//!
//! The result is `hsum(acc)` (`((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 +
//! a7))`, [`crate::x86::hsum`]'s order), plus `accm` for `Q4_K` / `Q5_K`.
//! Integer sums are exact and every f32 step is fixed, so the AVX2 kernel
//! (`q8_avx2`) is bit-identical to [`dot`], whatever the number of tokens per
//! call: prompt chunking, expert-slot counts and threads change no bit.
//!
//! # Error
//! Each input moves by at most half a code step (`amax / 254` per block), so
//! an output moves by at most `sum_j |w_j| * amax_block(j) / 254`.

use super::{f16_at, scale_min_k4, QK, QK_K};
use crate::Token;
use slipstream_core::{QuantType, TensorView};

/// Whether [`crate::Activations::Int8`] has kernels for `qtype` (others take
/// f32 inputs).
pub fn supports(qtype: QuantType) -> bool {
    matches!(
        qtype,
        QuantType::Q4_0 | QuantType::Q8_0 | QuantType::Q4K | QuantType::Q5K | QuantType::Q6K
    )
}

/// One token's input quantized to 8 bits for one weight type.
#[derive(Debug, Clone, PartialEq)]
pub struct Q8Row {
    /// Per block (`[cols / 32]` for `q8_0`, `[cols / 256]` for `q8_K`): the
    /// step of the codes (f32; for `q8_0` the stored f16 widened).
    pub d: Vec<f32>,
    /// `[cols]` codes, `-127..=127`.
    pub qs: Vec<i8>,
    /// `q8_K` only: `[cols / 16]` sums of the codes over 16 elements.
    pub bsums: Vec<i32>,
}

/// Quantizes `x` for products with `qtype` weights (a type [`supports`]
/// accepts; `x.len()` a multiple of its block).
pub fn quantize_input(qtype: QuantType, x: &[f32]) -> Q8Row {
    match qtype {
        QuantType::Q4_0 | QuantType::Q8_0 => quantize_q8_0(x),
        _ => quantize_q8_k(x),
    }
}

/// `q8_0` blocks of `x` (`x.len()` a multiple of 32), llama.cpp's
/// `quantize_row_q8_0_ref` rounding.
pub fn quantize_q8_0(x: &[f32]) -> Q8Row {
    assert!(x.len().is_multiple_of(QK), "q8_0 input length {}", x.len());
    let mut d = Vec::with_capacity(x.len() / QK);
    let mut qs = vec![0i8; x.len()];
    for (xb, qb) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)) {
        let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let step = amax / 127.0;
        let id = if step != 0.0 { 1.0 / step } else { 0.0 };
        for (q, &v) in qb.iter_mut().zip(xb) {
            // roundf (half away from zero); `as` saturates, NaN gives 0.
            *q = ((v * id).round() as i32).clamp(-127, 127) as i8;
        }
        d.push(half::f16::from_f32(step).to_f32());
    }
    Q8Row {
        d,
        qs,
        bsums: Vec::new(),
    }
}

/// `q8_K` blocks of `x` (`x.len()` a multiple of 256), llama.cpp's
/// `quantize_row_q8_K_ref` rounding.
pub fn quantize_q8_k(x: &[f32]) -> Q8Row {
    assert!(
        x.len().is_multiple_of(QK_K),
        "q8_K input length {}",
        x.len()
    );
    let mut d = Vec::with_capacity(x.len() / QK_K);
    let mut qs = vec![0i8; x.len()];
    let mut bsums = vec![0i32; x.len() / 16];
    for ((xb, qb), bs) in x
        .chunks_exact(QK_K)
        .zip(qs.chunks_exact_mut(QK_K))
        .zip(bsums.chunks_exact_mut(QK_K / 16))
    {
        // First element of largest magnitude (strictly greater wins).
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            d.push(0.0);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in qb.iter_mut().zip(xb) {
            // nearest_int: ties to even; MIN(127, .) as the C, and never
            // -128 (|iscale * x| <= 127 up to rounding).
            *q = ((iscale * v).round_ties_even() as i32).clamp(-127, 127) as i8;
        }
        for (s, c) in bs.iter_mut().zip(qb.chunks_exact(16)) {
            *s = c.iter().map(|&q| q as i32).sum();
        }
        d.push(1.0 / iscale);
    }
    Q8Row { d, qs, bsums }
}

/// [`crate::x86::hsum`]'s order over eight lanes.
#[inline]
pub(crate) fn hsum8(a: &[f32; 8]) -> f32 {
    let s: [f32; 4] = std::array::from_fn(|i| a[i] + a[i + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}

/// Lane sums of one 32-element group: `s[l] += f * sum_{i in 4l..4l+4}
/// w[i] * q[i]`.
#[inline]
fn lanes32(s: &mut [i32; 8], f: i32, w: &[i32; 32], q: &[i8]) {
    for (l, sl) in s.iter_mut().enumerate() {
        let mut v = 0i32;
        for i in 4 * l..4 * l + 4 {
            v += w[i] * q[i] as i32;
        }
        *sl += f * v;
    }
}

/// The reference product of one weight row (`row`, its block bytes) with a
/// quantized input (see the module doc).
pub fn dot(qtype: QuantType, row: &[u8], x: &Q8Row) -> f32 {
    let (be, bb) = qtype.ggml_block().expect("GGML block type");
    let nb = row.len() / bb;
    assert!(
        x.qs.len() >= nb * be,
        "quantized input shorter than the row"
    );
    let mut acc = [0f32; 8];
    let mut accm = 0f32;
    let mut w = [0i32; 32];
    for (i, blk) in row.chunks_exact(bb).enumerate() {
        let q = &x.qs[i * be..(i + 1) * be];
        let mut s = [0i32; 8];
        let d = match qtype {
            QuantType::Q4_0 | QuantType::Q8_0 => {
                for (e, v) in w.iter_mut().enumerate() {
                    *v = if qtype == QuantType::Q8_0 {
                        blk[2 + e] as i8 as i32
                    } else if e < 16 {
                        (blk[2 + e] & 0xF) as i32 - 8
                    } else {
                        (blk[2 + e - 16] >> 4) as i32 - 8
                    };
                }
                lanes32(&mut s, 1, &w, q);
                f16_at(blk, 0) * x.d[i]
            }
            QuantType::Q4K | QuantType::Q5K => {
                let five = qtype == QuantType::Q5K;
                let (sc, m) = scale_min_k4(&blk[4..16]);
                let qs_off = if five { 48 } else { 16 };
                for j in 0..8 {
                    for (l, v) in w.iter_mut().enumerate() {
                        let mut c = (blk[qs_off + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF;
                        if five {
                            c |= ((blk[16 + l] >> j) & 1) << 4;
                        }
                        *v = c as i32;
                    }
                    lanes32(&mut s, sc[j] as i32, &w, &q[32 * j..32 * j + 32]);
                }
                let bs = &x.bsums[16 * i..16 * i + 16];
                let msum: i32 = (0..8)
                    .map(|j| m[j] as i32 * (bs[2 * j] + bs[2 * j + 1]))
                    .sum();
                let dmin = -x.d[i] * f16_at(blk, 2);
                accm = dmin.mul_add(msum as f32, accm);
                x.d[i] * f16_at(blk, 0)
            }
            QuantType::Q6K => {
                let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
                for h in 0..2 {
                    for k in 0..4 {
                        let e0 = 128 * h + 32 * k;
                        for (l, v) in w.iter_mut().enumerate() {
                            let nib = (ql[h * 64 + (k % 2) * 32 + l] >> (4 * (k / 2))) & 0xF;
                            let hb = (qh[h * 32 + l] >> (2 * k)) & 3;
                            *v = (nib | (hb << 4)) as i32 - 32;
                        }
                        // Lanes 0..4 lie in the group's first 16 elements,
                        // lanes 4..8 in its second.
                        let (s_lo, s_hi) = (sc[e0 / 16] as i8 as i32, sc[e0 / 16 + 1] as i8 as i32);
                        let mut g = [0i32; 8];
                        lanes32(&mut g, 1, &w, &q[e0..e0 + 32]);
                        for (l, sl) in s.iter_mut().enumerate() {
                            *sl += if l < 4 { s_lo } else { s_hi } * g[l];
                        }
                    }
                }
                x.d[i] * f16_at(blk, 208)
            }
            q => panic!("{} has no 8-bit activation kernel", q.name()),
        };
        for (a, &v) in acc.iter_mut().zip(&s) {
            *a = d.mul_add(v as f32, *a);
        }
    }
    let r = hsum8(&acc);
    if matches!(qtype, QuantType::Q4K | QuantType::Q5K) {
        r + accm
    } else {
        r
    }
}

/// The quantized inputs of `toks` (each built by [`Token::new`] with
/// [`crate::Activations::Int8`]).
pub(crate) fn inputs<'a>(toks: &'a [Token]) -> Vec<&'a Q8Row> {
    toks.iter()
        .map(|t| t.q8.as_ref().expect("token quantized to 8 bits"))
        .collect()
}

/// Scalar reference: rows `r0..r1` of `w` for all tokens into `out`
/// (`[r1 - r0, toks.len()]`), each element by [`dot`].
pub(crate) fn scalar_rows(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    super::check_blocks(w);
    let ins = inputs(toks);
    let ntok = ins.len();
    assert_eq!(out.len(), (r1 - r0) * ntok);
    for (r, o) in (r0..r1).zip(out.chunks_exact_mut(ntok.max(1))) {
        let row = super::row_bytes(w, r);
        for (ot, x) in o.iter_mut().zip(&ins) {
            *ot = dot(w.qtype, row, x);
        }
    }
}
