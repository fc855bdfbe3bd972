//! AVX2 + FMA + F16C kernels (x86-64).
//!
//! Every kernel is generic over a block of `R` weight rows and `T` tokens.
//! Blocking only shares loads (weights decoded once for `T` tokens, `x` loaded
//! once for `R` rows); the arithmetic of one (row, token) pair is the same
//! instruction sequence for every `R` and `T`, so results never depend on the
//! blocking:
//!
//! * float weights: one 8-lane FMA chain over 8-element chunks, a fixed
//!   horizontal sum, then the `cols % 8` tail added in order (mul, add);
//! * affine weights: per group two 8-lane FMA chains of `q * x` started from
//!   zero, folded into the row accumulator with
//!   `acc = fma(scale, chain0 + chain1, acc)`; separately an 8-lane FMA chain
//!   of `bias[g] * X_g` over the groups; the result is
//!   `hsum(acc) + hsum(bias chain)` (see [`affine_block`]). 4-bit weights
//!   with groups of a multiple of 16 fold each chain into its own
//!   accumulator instead and sum the two at the end (see [`q4_block`]).
//!
//! Row blocks: float `R = 4`, affine `R = 2` for one token; `R = 1, T = 4`
//! when a batch has 4 or more tokens.
//!
//! These are the kernels of [`crate::Isa::Avx2`], and of
//! [`crate::Isa::Avx512`] for every layout [`crate::avx512`] has no form of.

use std::arch::x86_64::*;

use crate::scalar::AffineRow;
use crate::x86::{
    bias_term, block_loop, decode_q4_panel, hsum, ld_f32, ld_half8, params8, q4_finish,
    q4_group_walk, q4_rows_one_by_one, scales8, GEMM_COLS, GEMM_MIN_TOKENS, GEMM_ROWS,
};
use crate::Token;
use slipstream_core::{QuantType, ScaleType, TensorView};

const K_F32: u8 = 0;
const K_F16: u8 = 1;
const K_BF16: u8 = 2;

/// Rows `r0..r1` for all tokens into `out` (`[r1 - r0, toks.len()]`).
/// Panics if the CPU lacks AVX2, FMA or F16C.
pub(crate) fn rows(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    assert!(crate::Isa::Avx2.is_supported(), "CPU lacks AVX2/FMA/F16C");
    assert!(r0 <= r1 && r1 <= w.rows);
    assert_eq!(out.len(), (r1 - r0) * toks.len());
    // SAFETY: the CPU supports avx2, fma and f16c (checked above).
    unsafe { rows_impl(w, r0, r1, toks, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn rows_impl(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    match w.qtype {
        QuantType::F32 => float_rows::<K_F32>(w, r0, r1, toks, out),
        QuantType::F16 => float_rows::<K_F16>(w, r0, r1, toks, out),
        QuantType::Bf16 => float_rows::<K_BF16>(w, r0, r1, toks, out),
        QuantType::Affine { bits: 4, .. } => affine_rows::<4>(w, r0, r1, toks, out),
        QuantType::Affine { bits: 8, .. } => affine_rows::<8>(w, r0, r1, toks, out),
        QuantType::Affine { bits, .. } => panic!("unsupported affine bits {bits}"),
        QuantType::Q4_0 | QuantType::Q8_0 | QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => {
            crate::ggml::avx2::rows(w, r0, r1, toks, out)
        }
    }
}

// ---------------------------------------------------------------------------
// Float weights
// ---------------------------------------------------------------------------

/// Element `i` of a float row as f32 (exact, like the vector conversion).
#[inline]
fn elem<const K: u8>(row: &[u8], i: usize) -> f32 {
    if K == K_F32 {
        let e = &row[i * 4..i * 4 + 4];
        f32::from_le_bytes([e[0], e[1], e[2], e[3]])
    } else if K == K_F16 {
        half::f16::from_le_bytes([row[i * 2], row[i * 2 + 1]]).to_f32()
    } else {
        half::bf16::from_le_bytes([row[i * 2], row[i * 2 + 1]]).to_f32()
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn float_rows<const K: u8>(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    let esz = if K == K_F32 { 4 } else { 2 };
    let rb = w.cols * esz;
    let row = |r: usize| &w.data[r * rb..(r + 1) * rb];
    block_loop!(4, r0, r1, toks, out, |rs, tk| float_block::<K, _, _>(
        rs.map(row),
        tk.map(|t| t.x),
        w.cols
    ));
}

/// Dot products of `R` float rows (`[cols]` each, raw bytes) with `T` tokens
/// (`[cols]` each). Per (row, token): one 8-lane FMA chain over the 8-element
/// chunks, [`hsum`], then the `cols % 8` tail added in order.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn float_block<const K: u8, const R: usize, const T: usize>(
    rows: [&[u8]; R],
    xs: [&[f32]; T],
    cols: usize,
) -> [[f32; T]; R] {
    let esz = if K == K_F32 { 4 } else { 2 };
    for r in rows {
        assert!(r.len() >= cols * esz);
    }
    for x in xs {
        assert!(x.len() >= cols);
    }
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let main = cols / 8 * 8;
    let mut c = 0;
    while c < main {
        let mut wv = [_mm256_setzero_ps(); R];
        for r in 0..R {
            // SAFETY: c + 8 <= cols and each row holds `cols` elements
            // (asserted above).
            wv[r] = unsafe {
                let p = rows[r].as_ptr().add(c * esz);
                if K == K_F32 {
                    ld_f32(p.cast())
                } else {
                    ld_half8(p, K == K_BF16)
                }
            };
        }
        for t in 0..T {
            // SAFETY: c + 8 <= cols <= xs[t].len() (asserted above).
            let xv = unsafe { ld_f32(xs[t].as_ptr().add(c)) };
            for r in 0..R {
                acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
            }
        }
        c += 8;
    }
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            let mut s = hsum(acc[r][t]);
            for (i, &xv) in xs[t].iter().enumerate().take(cols).skip(main) {
                s += elem::<K>(rows[r], i) * xv;
            }
            out[r][t] = s;
        }
    }
    out
}

// ---------------------------------------------------------------------------
// Affine weights
// ---------------------------------------------------------------------------

#[target_feature(enable = "avx2,fma,f16c")]
fn affine_rows<const BITS: u32>(
    w: &TensorView,
    r0: usize,
    r1: usize,
    toks: &[Token],
    out: &mut [f32],
) {
    let QuantType::Affine { group, scale, .. } = w.qtype else {
        unreachable!()
    };
    let bf16 = scale == ScaleType::Bf16;
    let group = group as usize;
    let (c, s, b) = w.affine_parts();
    let row = |r: usize| AffineRow::from_parts(c, s, b, w.cols, BITS as u8, group, r);
    if BITS == 4 && group.is_multiple_of(16) && toks.len() >= GEMM_MIN_TOKENS {
        q4_gemm_rows(w, r0, r1, toks, out, bf16, group);
    } else if BITS == 4 && group.is_multiple_of(16) {
        q4_rows(w, r0, r1, toks, out, bf16, group);
    } else {
        block_loop!(2, r0, r1, toks, out, |rs, tk| affine_block::<
            BITS,
            false,
            _,
            _,
        >(
            rs.map(row),
            tk.map(|t| (t.x, t.gsum.as_slice())),
            bf16,
            group,
            w.cols
        ));
    }
}

/// The matrix-vector blocks of 4-bit affine rows (group a multiple of 16):
/// rows `r0..r1` for `toks` into `out` (`[r1 - r0, toks.len()]`), 4 rows per
/// block for one token, 4 tokens per row otherwise.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn q4_rows(
    w: &TensorView,
    r0: usize,
    r1: usize,
    toks: &[Token],
    out: &mut [f32],
    bf16: bool,
    group: usize,
) {
    let cols = w.cols;
    let (c, s, b) = w.affine_parts();
    let row = |r: usize| AffineRow::from_parts(c, s, b, cols, 4, group, r);
    let ntok = toks.len();
    if ntok >= 4 {
        block_loop!(4, r0, r1, toks, out, |rs, tk| q4_block::<_, _>(
            rs.map(row),
            tk.map(|t| (&t.xp[..], t.gsum.as_slice())),
            bf16,
            group,
            cols
        ));
        return;
    }
    q4_rows_one_by_one!(r0, r1, toks, out, row, bf16, group, cols);
}

/// One row of [`q4_block`] for one token, with
/// [`ROW_GROUPS`](crate::x86::ROW_GROUPS) groups' chains in flight instead of
/// several rows': the same per-group chains, folded into the accumulators in
/// group order, so the bits are [`q4_block`]'s.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q4_row(row: &AffineRow, x: &[f32], gsum: &[f32], bf16: bool, group: usize, cols: usize) -> f32 {
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    q4_group_walk!(row, x, gsum, bf16, group, cols, |s, ch| {
        let [a0, a1] = ch;
        let s = _mm256_set1_ps(s);
        acc0 = _mm256_fmadd_ps(s, a0, acc0);
        acc1 = _mm256_fmadd_ps(s, a1, acc1);
    });
    q4_finish(acc0, acc1) + bias_term(row.biases, gsum, cols / group, bf16)
}

/// The chains `[a0, a1]` of `Q` consecutive groups (see [`q4_block`]), steps
/// interleaved across the groups.
///
/// # Safety
/// `cp` must be valid for `Q * group / 2` code bytes and `xp` for
/// `Q * group` split inputs.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_chains<const Q: usize>(
    cp: *const u8,
    xp: *const f32,
    group: usize,
) -> [[__m256; 2]; Q] {
    let m_lo = _mm256_set1_epi32(0x0F);
    let m_hi = _mm256_set1_epi32(0xF0);
    let gbytes = group / 2;
    let mut ch = [[_mm256_setzero_ps(); 2]; Q];
    for k in 0..group / 16 {
        for (j, [a0, a1]) in ch.iter_mut().enumerate() {
            // SAFETY: step k of group j reads 8 code bytes and 16 inputs
            // inside the ranges the caller guarantees.
            unsafe {
                let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(cp.add(j * gbytes + k * 8).cast()));
                let lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, m_lo));
                let hi = _mm256_cvtepi32_ps(_mm256_and_si256(v, m_hi));
                let x = xp.add(j * group + k * 16);
                *a0 = _mm256_fmadd_ps(lo, ld_f32(x), *a0);
                *a1 = _mm256_fmadd_ps(hi, ld_f32(x.add(8)), *a1);
            }
        }
    }
    ch
}

/// Dot products of `R` affine rows with `T` tokens.
///
/// Each token is `(x, gsum)`: `x` is `[cols]`, in the pair-split order of
/// [`Token::xp`] when `SPLIT` (4-bit, group a multiple of 16), natural order
/// otherwise; `gsum` holds the group sums of `x` padded to a multiple of 8.
///
/// Per (row, token) and group: two 8-lane FMA chains `a0`, `a1` of `q * x`
/// from zero (`SPLIT`: per 16 elements the even ones into `a0`, the odd ones
/// into `a1`; otherwise alternate 8-element steps), then
/// `acc = fma(scale, a0 + a1, acc)`. The
/// bias term is an 8-lane FMA chain of `bias[g] * gsum[g]` over blocks of 8
/// groups. Result: `hsum(acc) + hsum(bias chain)`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn affine_block<const BITS: u32, const SPLIT: bool, const R: usize, const T: usize>(
    rows: [AffineRow; R],
    xs: [(&[f32], &[f32]); T],
    bf16: bool,
    group: usize,
    cols: usize,
) -> [[f32; T]; R] {
    let ng = cols / group;
    let gbytes = group * BITS as usize / 8;
    for r in &rows {
        assert!(r.codes.len() >= ng * gbytes);
    }
    for (x, gs) in xs {
        assert!(x.len() >= cols && gs.len() >= ng.next_multiple_of(8));
    }
    let mask4 = _mm256_set1_epi32(0xF);
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut gb = 0;
    while gb < ng {
        let mut sc = [_mm256_setzero_ps(); R];
        for r in 0..R {
            sc[r] = params8(rows[r].scales, gb, ng, bf16);
        }
        for gi in 0..(ng - gb).min(8) {
            let g = gb + gi;
            let mut a0 = [[_mm256_setzero_ps(); T]; R];
            let mut a1 = [[_mm256_setzero_ps(); T]; R];
            let mut cp = [std::ptr::null::<u8>(); R];
            for r in 0..R {
                cp[r] = rows[r].codes[g * gbytes..].as_ptr();
            }
            let mut xp = [std::ptr::null::<f32>(); T];
            for t in 0..T {
                xp[t] = xs[t].0[g * group..].as_ptr();
            }
            if SPLIT {
                // 16 elements per step: 8 code bytes widened to dwords; the
                // low nibbles are the even elements, the high nibbles the odd.
                for k in 0..group / 16 {
                    for r in 0..R {
                        // SAFETY: k * 8 + 8 <= group / 2 = gbytes bytes remain
                        // at cp[r] (codes length asserted above).
                        let v = unsafe {
                            _mm256_cvtepu8_epi32(_mm_loadl_epi64(cp[r].add(k * 8).cast()))
                        };
                        let lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask4));
                        let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v));
                        for t in 0..T {
                            // SAFETY: k * 16 + 16 <= group elements remain at
                            // xp[t] (x length asserted above).
                            let (xl, xh) = unsafe {
                                (ld_f32(xp[t].add(k * 16)), ld_f32(xp[t].add(k * 16 + 8)))
                            };
                            a0[r][t] = _mm256_fmadd_ps(lo, xl, a0[r][t]);
                            a1[r][t] = _mm256_fmadd_ps(hi, xh, a1[r][t]);
                        }
                    }
                }
            } else {
                // 8 elements per step, even steps into a0, odd into a1.
                let decode = |r: usize, k: usize| {
                    if BITS == 4 {
                        // SAFETY: k * 4 + 4 <= gbytes bytes remain at cp[r].
                        let v = unsafe { cp[r].add(k * 4).cast::<i32>().read_unaligned() };
                        let v = _mm256_srlv_epi32(_mm256_set1_epi32(v), shifts);
                        _mm256_cvtepi32_ps(_mm256_and_si256(v, mask4))
                    } else {
                        // SAFETY: k * 8 + 8 <= gbytes bytes remain at cp[r].
                        let v = unsafe { _mm_loadl_epi64(cp[r].add(k * 8).cast()) };
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
                    }
                };
                let nch = group / 8;
                let mut k = 0;
                while k < nch {
                    for r in 0..R {
                        let q0 = decode(r, k);
                        for t in 0..T {
                            // SAFETY: k * 8 + 8 <= group elements remain at xp[t].
                            let xv = unsafe { ld_f32(xp[t].add(k * 8)) };
                            a0[r][t] = _mm256_fmadd_ps(q0, xv, a0[r][t]);
                        }
                        if k + 1 < nch {
                            let q1 = decode(r, k + 1);
                            for t in 0..T {
                                // SAFETY: (k + 1) * 8 + 8 <= group elements
                                // remain at xp[t].
                                let xv = unsafe { ld_f32(xp[t].add(k * 8 + 8)) };
                                a1[r][t] = _mm256_fmadd_ps(q1, xv, a1[r][t]);
                            }
                        }
                    }
                    k += 2;
                }
            }
            let lane = _mm256_set1_epi32(gi as i32);
            for r in 0..R {
                let s = _mm256_permutevar8x32_ps(sc[r], lane);
                for t in 0..T {
                    let qx = _mm256_add_ps(a0[r][t], a1[r][t]);
                    acc[r][t] = _mm256_fmadd_ps(s, qx, acc[r][t]);
                }
            }
        }
        gb += 8;
    }
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum(acc[r][t]) + bias_term(rows[r].biases, xs[t].1, ng, bf16);
        }
    }
    out
}

/// Tokens per block of the GEMM path: with [`GEMM_COLS`] columns their inputs
/// (8 x 512 f32 = 16 KiB) stay in L1 while every row pair passes over them.
const GEMM_TOKENS: usize = 8;

/// 4-bit affine rows `r0..r1` (group a multiple of 16) for many tokens, as a
/// small GEMM: rows are decoded [`GEMM_ROWS`] at a time into an f32 panel
/// (the `lo`/`hi` vectors of [`q4_block`], in [`Token::xp`]'s order) with
/// their scales, then 2x2 (row, token) tiles run over blocks of
/// [`GEMM_TOKENS`] tokens and [`GEMM_COLS`] columns (so both operands come
/// from L1), carrying each (row, token) accumulator from one column block to
/// the next. Per (row, token) the arithmetic is exactly [`q4_block`]'s,
/// group by group in order, so results are bit-identical to the matvec path.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn q4_gemm_rows(
    w: &TensorView,
    r0: usize,
    r1: usize,
    toks: &[Token],
    out: &mut [f32],
    bf16: bool,
    group: usize,
) {
    let cols = w.cols;
    let ng = cols / group;
    let ntok = toks.len();
    let (c, s, b) = w.affine_parts();
    let row = |r: usize| AffineRow::from_parts(c, s, b, cols, 4, group, r);
    for t in toks {
        assert!(t.xp.len() >= cols && t.gsum.len() >= ng.next_multiple_of(8));
    }
    let kg = (GEMM_COLS / group).max(1);
    // 32-byte aligned so no panel load splits a cache line.
    let mut panel_buf = vec![_mm256_setzero_ps(); GEMM_ROWS * cols / 8];
    // SAFETY: `panel_buf` holds GEMM_ROWS * cols / 8 vectors of 8 f32
    // (`cols` is a multiple of 16), all initialized; the slice borrows it
    // exclusively for this function.
    let panel: &mut [f32] = unsafe {
        std::slice::from_raw_parts_mut(panel_buf.as_mut_ptr().cast::<f32>(), GEMM_ROWS * cols)
    };
    let mut scales = vec![0f32; GEMM_ROWS * ng];
    let mut acc = vec![[_mm256_setzero_ps(); 2]; GEMM_ROWS * GEMM_TOKENS];
    for rc in (r0..r1).step_by(GEMM_ROWS) {
        let nr = (r1 - rc).min(GEMM_ROWS);
        for i in 0..nr {
            decode_q4_panel(
                &row(rc + i),
                bf16,
                ng,
                &mut panel[i * cols..(i + 1) * cols],
                &mut scales[i * ng..(i + 1) * ng],
            );
        }
        for tb in (0..ntok).step_by(GEMM_TOKENS) {
            let nt = (ntok - tb).min(GEMM_TOKENS);
            acc.fill([_mm256_setzero_ps(); 2]);
            for g0 in (0..ng).step_by(kg) {
                let gs = g0..(g0 + kg).min(ng);
                let mut i = 0;
                while i < nr {
                    let ri = (nr - i).min(2);
                    let mut t = 0;
                    while t < nt {
                        let ti = (nt - t).min(2);
                        let x = |k: usize| &toks[tb + t + k].xp[..];
                        let p = |k: usize| &panel[(i + k) * cols..(i + k + 1) * cols];
                        let sc = |k: usize| &scales[(i + k) * ng..(i + k + 1) * ng];
                        let a = |k: usize, j: usize| (i + k) * GEMM_TOKENS + t + j;
                        let g = gs.clone();
                        match (ri, ti) {
                            (2, 2) => {
                                let mut v =
                                    [[acc[a(0, 0)], acc[a(0, 1)]], [acc[a(1, 0)], acc[a(1, 1)]]];
                                q4_tile::<2, 2>(
                                    [p(0), p(1)],
                                    [sc(0), sc(1)],
                                    [x(0), x(1)],
                                    group,
                                    g,
                                    &mut v,
                                );
                                [acc[a(0, 0)], acc[a(0, 1)]] = v[0];
                                [acc[a(1, 0)], acc[a(1, 1)]] = v[1];
                            }
                            (2, _) => {
                                let mut v = [[acc[a(0, 0)]], [acc[a(1, 0)]]];
                                q4_tile::<2, 1>(
                                    [p(0), p(1)],
                                    [sc(0), sc(1)],
                                    [x(0)],
                                    group,
                                    g,
                                    &mut v,
                                );
                                [[acc[a(0, 0)]], [acc[a(1, 0)]]] = v;
                            }
                            (_, 2) => {
                                let mut v = [[acc[a(0, 0)], acc[a(0, 1)]]];
                                q4_tile::<1, 2>([p(0)], [sc(0)], [x(0), x(1)], group, g, &mut v);
                                [[acc[a(0, 0)], acc[a(0, 1)]]] = v;
                            }
                            _ => {
                                let mut v = [[acc[a(0, 0)]]];
                                q4_tile::<1, 1>([p(0)], [sc(0)], [x(0)], group, g, &mut v);
                                [[acc[a(0, 0)]]] = v;
                            }
                        }
                        t += ti;
                    }
                    i += ri;
                }
            }
            for i in 0..nr {
                let biases = row(rc + i).biases;
                for t in 0..nt {
                    let bias = bias_term(biases, &toks[tb + t].gsum, ng, bf16);
                    let [a0, a1] = acc[i * GEMM_TOKENS + t];
                    out[(rc + i - r0) * ntok + tb + t] = q4_finish(a0, a1) + bias;
                }
            }
        }
    }
}

/// One `R x T` tile of the GEMM path over groups `gs`: per (row, token)
/// continues the accumulators `[acc0, acc1]` of [`q4_block`] (before the
/// horizontal sum and the bias term), from decoded panels (`[cols]` each),
/// scales (`[ng]` each) and split inputs.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::needless_range_loop)]
fn q4_tile<const R: usize, const T: usize>(
    panels: [&[f32]; R],
    scales: [&[f32]; R],
    xs: [&[f32]; T],
    group: usize,
    gs: std::ops::Range<usize>,
    acc: &mut [[[__m256; 2]; T]; R],
) {
    let end = gs.end * group;
    for r in 0..R {
        assert!(panels[r].len() >= end && scales[r].len() >= gs.end);
    }
    for x in xs {
        assert!(x.len() >= end);
    }
    let steps = group / 16;
    for g in gs {
        let mut a0 = [[_mm256_setzero_ps(); T]; R];
        let mut a1 = [[_mm256_setzero_ps(); T]; R];
        for k in 0..steps {
            let off = (g * steps + k) * 16;
            // SAFETY: off + 16 <= end <= every panel's and input's length
            // (asserted above).
            unsafe {
                let mut lo = [_mm256_setzero_ps(); R];
                let mut hi = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    lo[r] = ld_f32(panels[r].as_ptr().add(off));
                    hi[r] = ld_f32(panels[r].as_ptr().add(off + 8));
                }
                for t in 0..T {
                    let xl = ld_f32(xs[t].as_ptr().add(off));
                    let xh = ld_f32(xs[t].as_ptr().add(off + 8));
                    for r in 0..R {
                        a0[r][t] = _mm256_fmadd_ps(lo[r], xl, a0[r][t]);
                        a1[r][t] = _mm256_fmadd_ps(hi[r], xh, a1[r][t]);
                    }
                }
            }
        }
        for r in 0..R {
            let s = _mm256_set1_ps(scales[r][g]);
            for t in 0..T {
                acc[r][t][0] = _mm256_fmadd_ps(s, a0[r][t], acc[r][t][0]);
                acc[r][t][1] = _mm256_fmadd_ps(s, a1[r][t], acc[r][t][1]);
            }
        }
    }
}

/// Dot products of `R` 4-bit affine rows (group a multiple of 16) with `T`
/// tokens in the layout of [`Token::xp`]: per 16 elements the 8 even ones
/// `xe`, then the 8 odd ones divided by 16 (exact), so a code byte's high
/// nibble is used in place (`b & 0xF0` is 16 times it) without a shift.
/// (Folding the low-nibble mask away as `b * xe + (b & 0xF0) * (xo/16 - xe)`
/// saves one more instruction but costs precision: the MLX 4-bit parity
/// fixture then misses 1e-4.)
///
/// Per (row, token) and group: two 8-lane FMA chains `a0` (low nibbles) and
/// `a1` (high nibbles) from zero over the group's 16-element steps, then
/// `acc0 = fma(broadcast(scale), a0, acc0)` and the same for `a1` into
/// `acc1` (so a 16-lane machine folds both in one FMA); the bias term is an
/// 8-lane FMA chain of `bias[g] * gsum[g]` over blocks of 8 groups. Result:
/// `hsum(acc0 + acc1) + hsum(bias chain)`. The sequence is the same for
/// every `R` and `T`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::needless_range_loop)]
fn q4_block<const R: usize, const T: usize>(
    rows: [AffineRow; R],
    xs: [(&[f32], &[f32]); T],
    bf16: bool,
    group: usize,
    cols: usize,
) -> [[f32; T]; R] {
    let ng = cols / group;
    let gbytes = group / 2;
    let steps = group / 16;
    for r in &rows {
        assert!(r.codes.len() >= ng * gbytes && r.scales.len() >= ng * 2);
    }
    for (x, gs) in xs {
        assert!(x.len() >= cols && gs.len() >= ng.next_multiple_of(8));
    }
    let m_lo = _mm256_set1_epi32(0x0F);
    let m_hi = _mm256_set1_epi32(0xF0);
    let mut acc0 = [[_mm256_setzero_ps(); T]; R];
    let mut acc1 = [[_mm256_setzero_ps(); T]; R];
    let mut gb = 0;
    while gb < ng {
        let mut sc = [[0f32; 8]; R];
        for r in 0..R {
            sc[r] = scales8(rows[r].scales, gb, ng, bf16);
        }
        for gi in 0..(ng - gb).min(8) {
            let g = gb + gi;
            let mut cp = [std::ptr::null::<u8>(); R];
            for r in 0..R {
                cp[r] = rows[r].codes[g * gbytes..].as_ptr();
            }
            let mut xp = [std::ptr::null::<f32>(); T];
            for t in 0..T {
                xp[t] = xs[t].0[g * group..].as_ptr();
            }
            // Software prefetch of the same group R rows ahead (the next
            // row block); prefetches never fault, so running past the end
            // is harmless.
            for p in cp {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(R * cols / 2).cast());
            }
            let mut a0 = [[_mm256_setzero_ps(); T]; R];
            let mut a1 = [[_mm256_setzero_ps(); T]; R];
            for k in 0..steps {
                for r in 0..R {
                    // SAFETY: k * 8 + 8 <= gbytes bytes remain at cp[r]
                    // (codes length asserted above).
                    let v =
                        unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(cp[r].add(k * 8).cast())) };
                    let lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, m_lo));
                    let hi = _mm256_cvtepi32_ps(_mm256_and_si256(v, m_hi));
                    for t in 0..T {
                        // SAFETY: k * 16 + 16 <= group elements remain at
                        // xp[t] (x length asserted above).
                        let (xl, xh) =
                            unsafe { (ld_f32(xp[t].add(k * 16)), ld_f32(xp[t].add(k * 16 + 8))) };
                        a0[r][t] = _mm256_fmadd_ps(lo, xl, a0[r][t]);
                        a1[r][t] = _mm256_fmadd_ps(hi, xh, a1[r][t]);
                    }
                }
            }
            for r in 0..R {
                let s = _mm256_set1_ps(sc[r][gi]);
                for t in 0..T {
                    acc0[r][t] = _mm256_fmadd_ps(s, a0[r][t], acc0[r][t]);
                    acc1[r][t] = _mm256_fmadd_ps(s, a1[r][t], acc1[r][t]);
                }
            }
        }
        gb += 8;
    }
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] =
                q4_finish(acc0[r][t], acc1[r][t]) + bias_term(rows[r].biases, xs[t].1, ng, bf16);
        }
    }
    out
}
