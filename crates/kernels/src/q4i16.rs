//! 4-bit affine products with int16-quantized activations.
//!
//! With f32 inputs the 4-bit products are bound by instruction throughput,
//! not memory (per 16 weights: a widening load, two masks, two int->float
//! conversions, two FMAs). Quantizing the input once per product to int16,
//! one step per weight group, turns the inner loop into integer
//! multiply-adds (`vpmaddwd`, 16 weights per instruction, no conversions).
//!
//! For a row with scales `s_g` and biases `b_g`, input group `x_g` quantized
//! as `x_g ~ d_g * xi_g` (`xi` in `-32767..=32767`, `d_g = max|x_g| / 32767`):
//!
//! `y = sum_g (s_g * d_g) * sum_{j in g} q_j * xi_j  +  sum_g b_g * d_g * sum_{j in g} xi_j`
//!
//! i.e. the exact product of the weights with the quantized input. (Using
//! the exact f32 group sums in the bias term instead was measured worse:
//! biases are about `-8 s_g`, and the shared input error then no longer
//! cancels between the two terms.) The integer sums are exact; each input
//! moves by at most half a step, so an output moves by at most
//! `sum_j |w_j| * d_g / 2`. On the MLX 4-bit parity fixture that compounds
//! to 2e-3 relative logit error (int8 steps, as llama.cpp's Q8 activations:
//! 1e-2 and flipped greedy tokens), so f32 inputs stay the default.
//!
//! Layout of the quantized input: per 32 elements, the 16 even ones then the
//! 16 odd ones, matching the low and high nibbles of 16 code bytes. Requires
//! a group that is a multiple of 32 and at most [`MAX_GROUP`] (i32 sums).

use slipstream_core::tensor::scale_to_f32;
use slipstream_core::{QuantType, ScaleType, TensorView};

use crate::scalar::AffineRow;
use crate::Token;

/// An input vector quantized for [`rows`].
#[derive(Debug, Clone)]
pub(crate) struct QuantizedInput {
    /// `[cols]` int16 values in the pair-split order (see the module doc).
    pub xi: Vec<i16>,
    /// Per group, `d_g` (the f32 step), zero-padded to a multiple of 8.
    pub step: Vec<f32>,
    /// Per group, the sum of the quantized inputs `d_g * sum(xi_g)`,
    /// zero-padded to a multiple of 8 (see [`quantize_input`]).
    pub gsum: Vec<f32>,
}

/// Largest group whose integer sums fit in i32: 2^31 / (15 * 32767).
pub(crate) const MAX_GROUP: u32 = 4096;

/// Whether 4-bit weights of this type can use int16 activations.
pub(crate) fn supports(qtype: QuantType) -> bool {
    matches!(qtype, QuantType::Affine { bits: 4, group, .. } if group % 32 == 0 && group <= MAX_GROUP)
}

/// Quantizes `x` (`[cols]`, `cols` a multiple of `group`, `group` of 32).
///
/// `xi = round(x * 32767 / max|x_g|)` (ties to even), within `-32767..=32767`; a
/// group that is all zero, or holds an infinity, has step 0 and codes 0.
/// Non-finite inputs still reach the output: their group's sum is NaN,
/// which poisons the bias term.
pub(crate) fn quantize_input(x: &[f32], group: usize) -> QuantizedInput {
    debug_assert!(group.is_multiple_of(32) && x.len().is_multiple_of(group));
    let ng = x.len() / group;
    let mut xi = vec![0i16; x.len()];
    let mut step = vec![0f32; ng.next_multiple_of(8)];
    let mut gsum = vec![0f32; ng.next_multiple_of(8)];
    for (g, (xg, og)) in x
        .chunks_exact(group)
        .zip(xi.chunks_exact_mut(group))
        .enumerate()
    {
        // Largest magnitude in 8 lanes, so the loop vectorizes.
        let mut lanes = [0f32; 8];
        for c in xg.chunks_exact(8) {
            for i in 0..8 {
                let a = c[i].abs();
                lanes[i] = if a > lanes[i] { a } else { lanes[i] };
            }
        }
        let amax = lanes.iter().fold(0f32, |m, &a| if a > m { a } else { m });
        if !amax.is_finite() {
            // Keep the failure visible: a NaN sum poisons the bias term.
            gsum[g] = f32::NAN;
            continue;
        }
        if amax == 0.0 {
            continue;
        }
        let inv = 32767.0 / amax;
        step[g] = amax / 32767.0;
        for (xb, ob) in xg.chunks_exact(32).zip(og.chunks_exact_mut(32)) {
            for i in 0..16 {
                ob[i] = round_to_i16(xb[2 * i] * inv);
                ob[16 + i] = round_to_i16(xb[2 * i + 1] * inv);
            }
        }
        let isum: i32 = og.iter().map(|&v| v as i32).sum();
        gsum[g] = step[g] * isum as f32;
    }
    QuantizedInput { xi, step, gsum }
}

/// Rounds `v` (|v| <= 32767 plus rounding) to the nearest integer, ties to
/// even: adding 1.5 * 2^23 leaves no fraction bits. Plain arithmetic, so it
/// vectorizes and never calls libm (`f32::round` does without SSE4.1).
#[inline]
fn round_to_i16(v: f32) -> i16 {
    const MAGIC: f32 = 12_582_912.0;
    ((v + MAGIC) - MAGIC) as i16
}

/// Scalar reference: rows `r0..r1` for all tokens into `out`
/// (`[r1 - r0, toks.len()]`). Every token must carry a [`QuantizedInput`].
pub(crate) fn scalar_rows(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    let QuantType::Affine { group, scale, .. } = w.qtype else {
        unreachable!("int16 activations on a non-affine tensor")
    };
    let group = group as usize;
    let ng = w.cols / group;
    let ntok = toks.len();
    for (r, o) in (r0..r1).zip(out.chunks_exact_mut(ntok.max(1))) {
        let row = AffineRow::new(w, r);
        for (ot, t) in o.iter_mut().zip(toks) {
            let q = t.qx.as_ref().expect("token without int16 input");
            let mut acc = 0f32;
            let mut bias = 0f32;
            for g in 0..ng {
                let s = param(scale, row.scales, g);
                let b = param(scale, row.biases, g);
                let codes = &row.codes[g * group / 2..(g + 1) * group / 2];
                let xi = &q.xi[g * group..(g + 1) * group];
                let mut isum = 0i32;
                for (cb, xb) in codes.chunks_exact(16).zip(xi.chunks_exact(32)) {
                    for i in 0..16 {
                        isum += (cb[i] & 0xF) as i32 * xb[i] as i32;
                        isum += (cb[i] >> 4) as i32 * xb[16 + i] as i32;
                    }
                }
                acc += s * q.step[g] * isum as f32;
                bias += b * q.gsum[g];
            }
            *ot = acc + bias;
        }
    }
}

fn param(ty: ScaleType, p: &[u8], g: usize) -> f32 {
    scale_to_f32(ty, [p[2 * g], p[2 * g + 1]])
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::rows as avx2_rows;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{AffineRow, QuantizedInput, MAX_GROUP};
    use crate::x86::{bias_term, hsum, params8};
    use crate::Token;
    use slipstream_core::{QuantType, ScaleType, TensorView};

    /// Rows `r0..r1` for all tokens into `out` (`[r1 - r0, toks.len()]`).
    /// Every token must carry a [`QuantizedInput`]. Panics if the CPU lacks
    /// AVX2, FMA or F16C.
    pub(crate) fn rows(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
        assert!(crate::Isa::Avx2.is_supported(), "CPU lacks AVX2/FMA/F16C");
        assert!(r0 <= r1 && r1 <= w.rows);
        assert_eq!(out.len(), (r1 - r0) * toks.len());
        let QuantType::Affine {
            bits: 4,
            group,
            scale,
        } = w.qtype
        else {
            panic!("int16 activations need 4-bit affine weights")
        };
        let group = group as usize;
        assert!(
            group.is_multiple_of(32) && group <= MAX_GROUP as usize && w.cols.is_multiple_of(group)
        );
        let ng = w.cols / group;
        for t in toks {
            let q = t.qx.as_ref().expect("token without int16 input");
            assert!(q.xi.len() >= w.cols && q.step.len() >= ng.next_multiple_of(8));
            assert!(q.gsum.len() >= ng.next_multiple_of(8));
        }
        // SAFETY: the CPU supports avx2, fma and f16c (checked above); the
        // lengths the kernel reads were asserted above and in `AffineRow`.
        unsafe { rows_impl(w, r0, r1, toks, out, group, scale == ScaleType::Bf16) }
    }

    /// Rows per block for one token (measured on the 2-core dev box: 2 beats 1 and 4).
    const DECODE_ROWS: usize = 2;

    #[target_feature(enable = "avx2,fma,f16c")]
    fn rows_impl(
        w: &TensorView,
        r0: usize,
        r1: usize,
        toks: &[Token],
        out: &mut [f32],
        group: usize,
        bf16: bool,
    ) {
        let (c, s, b) = w.affine_parts();
        let row = |r: usize| AffineRow::from_parts(c, s, b, w.cols, 4, group, r);
        fn inp<'t>(t: &'t Token<'_>) -> &'t QuantizedInput {
            t.qx.as_ref().expect("checked")
        }
        let ntok = toks.len();
        let cols = w.cols;
        if ntok >= 4 {
            for r in r0..r1 {
                let o = &mut out[(r - r0) * ntok..(r - r0 + 1) * ntok];
                let mut t = 0;
                while t + 4 <= ntok {
                    let tk: [_; 4] = std::array::from_fn(|i| inp(&toks[t + i]));
                    let res = block::<1, 4>([row(r)], tk, bf16, group, cols);
                    o[t..t + 4].copy_from_slice(&res[0]);
                    t += 4;
                }
                while t < ntok {
                    let res = block::<1, 1>([row(r)], [inp(&toks[t])], bf16, group, cols);
                    o[t] = res[0][0];
                    t += 1;
                }
            }
        } else {
            for (ti, tok) in toks.iter().enumerate() {
                let mut r = r0;
                while r + DECODE_ROWS <= r1 {
                    let rs: [_; DECODE_ROWS] = std::array::from_fn(|i| row(r + i));
                    let res = block::<DECODE_ROWS, 1>(rs, [inp(tok)], bf16, group, cols);
                    for (i, v) in res.iter().enumerate() {
                        out[(r - r0 + i) * ntok + ti] = v[0];
                    }
                    r += DECODE_ROWS;
                }
                while r < r1 {
                    let res = block::<1, 1>([row(r)], [inp(tok)], bf16, group, cols);
                    out[(r - r0) * ntok + ti] = res[0][0];
                    r += 1;
                }
            }
        }
    }

    /// Dot products of `R` rows with `T` quantized tokens.
    ///
    /// Per (row, token) and group: per 32 elements the 16 low and 16 high
    /// nibbles widened to i16 and multiplied with the inputs by `vpmaddwd`
    /// into an i32 accumulator (exact: at most 4096 x 15 x 32767 < 2^31),
    /// converted to f32 and folded as `acc = fma(isum, s_g * d_g, acc)`.
    /// Bias term: an 8-lane FMA chain of `b_g * gsum_g`. Result
    /// `hsum(acc) + hsum(bias chain)`. The sequence is the same for every `R`
    /// and `T`, so blocking never changes a result.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    #[allow(clippy::needless_range_loop)]
    fn block<const R: usize, const T: usize>(
        rows: [AffineRow; R],
        xs: [&QuantizedInput; T],
        bf16: bool,
        group: usize,
        cols: usize,
    ) -> [[f32; T]; R] {
        let ng = cols / group;
        let gbytes = group / 2;
        let steps = group / 32;
        for r in &rows {
            assert!(r.codes.len() >= ng * gbytes && r.scales.len() >= ng * 2);
        }
        let nib = _mm_set1_epi8(0x0F);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut gb = 0;
        while gb < ng {
            // Combined scales s_g * d_g of groups gb..gb+8 for each pair.
            let mut comb = [[[0f32; 8]; T]; R];
            for r in 0..R {
                let sv = params8(rows[r].scales, gb, ng, bf16);
                for t in 0..T {
                    // SAFETY: `step` holds a multiple of 8 entries >= ng.
                    let dv = unsafe { _mm256_loadu_ps(xs[t].step.as_ptr().add(gb)) };
                    // SAFETY: `comb[r][t]` is 8 writable f32.
                    unsafe { _mm256_storeu_ps(comb[r][t].as_mut_ptr(), _mm256_mul_ps(sv, dv)) };
                }
            }
            for gi in 0..(ng - gb).min(8) {
                let g = gb + gi;
                // Plain loops, not `array::from_fn`: its iterator machinery
                // is not inlined into this hot path.
                let mut cp = [std::ptr::null::<u8>(); R];
                for r in 0..R {
                    cp[r] = rows[r].codes[g * gbytes..].as_ptr();
                }
                let mut xp = [std::ptr::null::<i16>(); T];
                for t in 0..T {
                    xp[t] = xs[t].xi[g * group..].as_ptr();
                }
                for p in cp {
                    // Next row block's same group; prefetches never fault.
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(R * cols / 2).cast());
                }
                for r in 0..R {
                    let mut isum = [_mm256_setzero_si256(); T];
                    for k in 0..steps {
                        // SAFETY: k * 16 + 16 <= gbytes bytes remain at cp[r].
                        let b = unsafe { _mm_loadu_si128(cp[r].add(k * 16).cast()) };
                        let lo = _mm256_cvtepu8_epi16(_mm_and_si128(b, nib));
                        let hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(b), nib));
                        for t in 0..T {
                            // SAFETY: k * 32 + 32 <= group inputs remain at xp[t].
                            let (xe, xo) = unsafe {
                                (
                                    _mm256_loadu_si256(xp[t].add(k * 32).cast()),
                                    _mm256_loadu_si256(xp[t].add(k * 32 + 16).cast()),
                                )
                            };
                            let p = _mm256_add_epi32(
                                _mm256_madd_epi16(lo, xe),
                                _mm256_madd_epi16(hi, xo),
                            );
                            isum[t] = _mm256_add_epi32(isum[t], p);
                        }
                    }
                    for t in 0..T {
                        let f = _mm256_cvtepi32_ps(isum[t]);
                        let c = _mm256_set1_ps(comb[r][t][gi]);
                        acc[r][t] = _mm256_fmadd_ps(f, c, acc[r][t]);
                    }
                }
            }
            gb += 8;
        }
        let mut out = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                out[r][t] = hsum(acc[r][t]) + bias_term(rows[r].biases, &xs[t].gsum, ng, bf16);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize::{from_f32, to_f32};
    use crate::{matmul_act, matvec_act, Activations, Isa};
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};

    /// Random 4-bit weights (f16 or bf16 params) with groups of very
    /// different magnitude, at an unaligned byte offset.
    fn weights(
        rows: usize,
        cols: usize,
        group: u32,
        bf16: bool,
        seed: u64,
    ) -> (QuantType, Vec<u8>) {
        let q = QuantType::Affine {
            bits: 4,
            group,
            scale: if bf16 {
                ScaleType::Bf16
            } else {
                ScaleType::F16
            },
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let vals: Vec<f32> = (0..rows * cols)
            .map(|i| rng.random_range(-1.0f32..1.0) * (1.0 + (i / 32 % 5) as f32 * 3.0))
            .collect();
        let mut bytes = from_f32(&vals, rows, cols, q);
        // Negative scales and biases occur in real MLX files: flip signs.
        for p in bytes[rows * cols / 2..].chunks_exact_mut(2) {
            if rng.random_bool(0.5) {
                p[1] ^= 0x80;
            }
        }
        (q, bytes)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// SIMD equals the scalar int16 reference to rounding, matmul rows are
        /// bit-identical to matvec, and the int16 product stays within the
        /// input quantization's bound of the exact product.
        #[test]
        fn int16_matches_reference_and_bound(
            rows in 1usize..37,
            ngroups in 1usize..5,
            group in proptest::sample::select(vec![32u32, 64, 96, 128, 512]),
            bf16 in any::<bool>(),
            n in 1usize..10,
            zero_group in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let cols = group as usize * ngroups;
            let (q, bytes) = weights(rows, cols, group, bf16, seed);
            let mut buf = vec![0u8; 3];
            buf.extend(&bytes);
            let w = TensorView::new(q, rows, cols, &buf[3..]).unwrap();
            let dense = to_f32(&w);
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 7);
            let mut x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            if zero_group {
                x[..group as usize].fill(0.0);
            }
            let mut reference = vec![0f32; n * rows];
            matmul_act(Isa::Scalar, Activations::Int16, &w, &x, n, &mut reference);
            for isa in Isa::available() {
                let mut yb = vec![0f32; n * rows];
                matmul_act(isa, Activations::Int16, &w, &x, n, &mut yb);
                for t in 0..n {
                    let xt = &x[t * cols..(t + 1) * cols];
                    let mut y = vec![0f32; rows];
                    matvec_act(isa, Activations::Int16, &w, xt, &mut y);
                    let qi = quantize_input(xt, group as usize);
                    for r in 0..rows {
                        prop_assert_eq!(y[r].to_bits(), yb[t * rows + r].to_bits());
                        let wr = &dense[r * cols..(r + 1) * cols];
                        let mag: f32 = wr.iter().zip(xt).map(|(a, b)| (a * b).abs()).sum();
                        let refv = reference[t * rows + r];
                        prop_assert!((y[r] - refv).abs() <= 1e-5 * mag + 1e-6,
                            "{:?} r={} t={} simd={} scalar={}", isa, r, t, y[r], refv);
                        // |x - d*xi| <= d/2 per element: bound the weight part.
                        let exact: f64 = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                        // Each input moves by at most half its group's step.
                        let mut bound = 0f64;
                        for (g, wg) in wr.chunks_exact(group as usize).enumerate() {
                            let l1: f64 = wg.iter().map(|v| v.abs() as f64).sum();
                            bound += l1 * qi.step[g] as f64 / 2.0;
                        }
                        prop_assert!((refv as f64 - exact).abs() <= bound * 1.001 + 1e-5 * mag as f64 + 1e-6,
                            "r={} int16={} exact={} bound={}", r, refv, exact, bound);
                    }
                }
            }
        }
    }

    #[test]
    fn quantize_input_round_trip_and_layout() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) * 0.37).collect();
        let q = quantize_input(&x, 64);
        let d = q.step[0];
        assert_eq!(d, x.iter().fold(0f32, |m, v| m.max(v.abs())) / 32767.0);
        for blk in 0..2 {
            for i in 0..16 {
                let (even, odd) = (x[blk * 32 + 2 * i], x[blk * 32 + 2 * i + 1]);
                assert!((q.xi[blk * 32 + i] as f32 * d - even).abs() <= d / 2.0 + 1e-6);
                assert!((q.xi[blk * 32 + 16 + i] as f32 * d - odd).abs() <= d / 2.0 + 1e-6);
            }
        }
        assert!(q.xi.iter().any(|&v| v == 32767 || v == -32767));
        assert_eq!(
            [
                round_to_i16(2.5),
                round_to_i16(-2.5),
                round_to_i16(3.5),
                round_to_i16(-126.7)
            ],
            [2, -2, 4, -127]
        );
        let z = quantize_input(&[0f32; 32], 32);
        assert_eq!(z.step[0], 0.0);
        assert!(z.xi.iter().all(|&v| v == 0));
    }

    #[test]
    fn non_finite_input_is_not_hidden() {
        let (q, bytes) = weights(3, 64, 64, false, 1);
        let w = TensorView::new(q, 3, 64, &bytes).unwrap();
        let mut x = vec![0.5f32; 64];
        x[5] = f32::INFINITY;
        for isa in Isa::available() {
            let mut y = vec![0f32; 3];
            matvec_act(isa, Activations::Int16, &w, &x, &mut y);
            assert!(y.iter().all(|v| !v.is_finite()), "{isa:?}: {y:?}");
        }
    }

    #[test]
    fn unsupported_groups_fall_back_to_exact() {
        let (q, bytes) = weights(5, 48, 16, false, 3);
        let w = TensorView::new(q, 5, 48, &bytes).unwrap();
        let x: Vec<f32> = (0..48).map(|i| i as f32 * 0.1 - 2.0).collect();
        let (mut a, mut b) = (vec![0f32; 5], vec![0f32; 5]);
        matvec_act(Isa::detect(), Activations::Int16, &w, &x, &mut a);
        matvec_act(Isa::detect(), Activations::Exact, &w, &x, &mut b);
        assert_eq!(a, b);
    }
}
