//! AVX2 + FMA + F16C products over GGML blocks (x86-64), f32 activations.
//!
//! Codes are widened to f32 in registers (never written to memory) and
//! multiplied with `x` by 8-lane FMAs. Per (row, token) the instruction
//! sequence is fixed, whatever the row/token blocking:
//!
//! * `Q4_0`, `Q8_0`: per block of 32, `a = q0 * x0` then three FMAs over the
//!   other 8-element chunks (codes already offset: `q - 8` for `Q4_0`), then
//!   `acc = fma(broadcast(d), a, acc)`; result `hsum(acc)`;
//! * `Q4_K`, `Q5_K`: per sub-block of 32 the same chain `a`, then
//!   `acc = fma(broadcast(d * sc_j), a, acc)`; per super-block
//!   `macc = fma(dmin * m[0..8], X[0..8], macc)` with `X` the sums of `x` over
//!   the 8 sub-blocks; result `hsum(acc) - hsum(macc)`;
//! * `Q6_K`: per sub-block of 16, `a = q0 * x0 + q1 * x1` (mul, FMA) with
//!   `q - 32`, then `acc = fma(broadcast(d * sc_k), a, acc)`; result
//!   `hsum(acc)`.
//!
//! Blocking: with 4 or more tokens one row for 4 tokens at a time (codes
//! decoded once per 4 tokens), in blocks of [`TOKEN_BLOCK`] tokens; otherwise
//! 2 rows at a time per token. Leftovers go one by one.

use std::arch::x86_64::*;

use super::{row_bytes, scale_min_k4, QK_K};
use crate::Token;
use slipstream_core::{QuantType, TensorView};

const K_Q4_0: u8 = 0;
const K_Q8_0: u8 = 1;
const K_Q4K: u8 = 2;
const K_Q5K: u8 = 3;
const K_Q6K: u8 = 4;

/// Tokens per block of a batch: 32 inputs of 2048 f32 are 256 KiB (L2).
const TOKEN_BLOCK: usize = 32;

/// Rows `r0..r1` of a GGML block tensor for all tokens into `out`
/// (`[r1 - r0, toks.len()]`). Callable from code compiled for the same
/// features (the AVX2 dispatch).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn rows(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    super::check_blocks(w);
    assert!(r0 <= r1 && r1 <= w.rows);
    assert_eq!(out.len(), (r1 - r0) * toks.len());
    match w.qtype {
        QuantType::Q4_0 => drive::<K_Q4_0>(w, r0, r1, toks, out),
        QuantType::Q8_0 => drive::<K_Q8_0>(w, r0, r1, toks, out),
        QuantType::Q4K => drive::<K_Q4K>(w, r0, r1, toks, out),
        QuantType::Q5K => drive::<K_Q5K>(w, r0, r1, toks, out),
        QuantType::Q6K => drive::<K_Q6K>(w, r0, r1, toks, out),
        q => panic!("{} is not a GGML block type", q.name()),
    }
}

/// Sums of `x` over consecutive 32-element sub-blocks, each summed by one
/// fixed sequence (8 lanes of 4 adds, then [`hsum`]).
#[target_feature(enable = "avx2,fma,f16c")]
fn sums32(x: &[f32]) -> Vec<f32> {
    x.chunks_exact(32)
        .map(|c| {
            // SAFETY: `c` holds 32 f32.
            unsafe {
                let p = c.as_ptr();
                let s = _mm256_add_ps(
                    _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))),
                    _mm256_add_ps(_mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))),
                );
                hsum(s)
            }
        })
        .collect()
}

#[target_feature(enable = "avx2,fma,f16c")]
fn drive<const K: u8>(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    let ntok = toks.len();
    let cols = w.cols;
    let mins = K == K_Q4K || K == K_Q5K;
    // Per token: x and (K-quants with mins) its 32-element sums.
    let sums: Vec<Vec<f32>> = if mins {
        toks.iter().map(|t| sums32(t.x)).collect()
    } else {
        vec![Vec::new(); ntok]
    };
    let xin = |t: usize| (toks[t].x, sums[t].as_slice());
    let row = |r: usize| row_bytes(w, r);
    if ntok >= 4 {
        for tb in (0..ntok).step_by(TOKEN_BLOCK) {
            let te = (tb + TOKEN_BLOCK).min(ntok);
            for r in r0..r1 {
                let o = &mut out[(r - r0) * ntok..(r - r0 + 1) * ntok];
                let mut t = tb;
                while t + 4 <= te {
                    let res = block::<K, 1, 4>(
                        [row(r)],
                        [xin(t), xin(t + 1), xin(t + 2), xin(t + 3)],
                        cols,
                    );
                    o[t..t + 4].copy_from_slice(&res[0]);
                    t += 4;
                }
                while t < te {
                    o[t] = block::<K, 1, 1>([row(r)], [xin(t)], cols)[0][0];
                    t += 1;
                }
            }
        }
    } else {
        for t in 0..ntok {
            let mut r = r0;
            while r + 2 <= r1 {
                let res = block::<K, 2, 1>([row(r), row(r + 1)], [xin(t)], cols);
                out[(r - r0) * ntok + t] = res[0][0];
                out[(r - r0 + 1) * ntok + t] = res[1][0];
                r += 2;
            }
            while r < r1 {
                out[(r - r0) * ntok + t] = block::<K, 1, 1>([row(r)], [xin(t)], cols)[0][0];
                r += 1;
            }
        }
    }
}

/// Fixed-order horizontal sum of 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The f16 at `b[i..i + 2]` as f32 (exact).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    let h = u16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// The low 8 signed bytes of `v` as 8 f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn cvt8(v: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
}

/// 32 signed bytes as 4 vectors of 8 f32, in element order.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn widen32(v: __m256i) -> [__m256; 4] {
    let lo = _mm256_castsi256_si128(v);
    let hi = _mm256_extracti128_si256::<1>(v);
    [
        cvt8(lo),
        cvt8(_mm_unpackhi_epi64(lo, lo)),
        cvt8(hi),
        cvt8(_mm_unpackhi_epi64(hi, hi)),
    ]
}

/// 32 bytes at `p` (unaligned).
///
/// # Safety
/// `p` must be valid for reading 32 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn ld32(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes; loadu is unaligned.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// Eight f32 at `p` (unaligned).
///
/// # Safety
/// `p` must be valid for reading 8 f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn ldx(p: *const f32) -> __m256 {
    // SAFETY: the caller guarantees 32 readable bytes; loadu is unaligned.
    unsafe { _mm256_loadu_ps(p) }
}

/// `sum q * x` over 32 elements: `q0 * x0`, then FMAs in chunk order.
///
/// # Safety
/// `x` must be valid for reading 32 f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot32(q: &[__m256; 4], x: *const f32) -> __m256 {
    // SAFETY: 32 readable f32 at `x` (caller).
    unsafe {
        let mut a = _mm256_mul_ps(q[0], ldx(x));
        a = _mm256_fmadd_ps(q[1], ldx(x.add(8)), a);
        a = _mm256_fmadd_ps(q[2], ldx(x.add(16)), a);
        _mm256_fmadd_ps(q[3], ldx(x.add(24)), a)
    }
}

/// Dot products of `R` rows (raw bytes of `cols / block` blocks each) with
/// `T` tokens (`(x [cols], 32-element sums of x)`), for GGML kind `K`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::needless_range_loop)]
fn block<const K: u8, const R: usize, const T: usize>(
    rows: [&[u8]; R],
    xs: [(&[f32], &[f32]); T],
    cols: usize,
) -> [[f32; T]; R] {
    let (be, bb) = match K {
        K_Q4_0 => (32, 18),
        K_Q8_0 => (32, 34),
        K_Q4K => (QK_K, 144),
        K_Q5K => (QK_K, 176),
        _ => (QK_K, 210),
    };
    let nb = cols / be;
    for r in &rows {
        assert!(r.len() >= nb * bb);
    }
    let mins = K == K_Q4K || K == K_Q5K;
    for (x, s) in &xs {
        assert!(x.len() >= cols && (!mins || s.len() >= cols / 32));
    }
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut macc = [[_mm256_setzero_ps(); T]; R];
    for i in 0..nb {
        let xp: [*const f32; T] = std::array::from_fn(|t| xs[t].0[i * be..].as_ptr());
        for r in 0..R {
            let b = &rows[r][i * bb..(i + 1) * bb];
            let bp = b.as_ptr();
            match K {
                K_Q4_0 => {
                    let d = _mm256_set1_ps(f16_at(b, 0));
                    // SAFETY: the block has 16 code bytes at offset 2.
                    let v = unsafe { _mm_loadu_si128(bp.add(2).cast()) };
                    let m = _mm_set1_epi8(0x0F);
                    let lo = _mm_and_si128(v, m);
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m);
                    let q = _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
                    let qf = widen32(q);
                    for t in 0..T {
                        // SAFETY: 32 elements of block i remain at xp[t].
                        let a = unsafe { dot32(&qf, xp[t]) };
                        acc[r][t] = _mm256_fmadd_ps(d, a, acc[r][t]);
                    }
                }
                K_Q8_0 => {
                    let d = _mm256_set1_ps(f16_at(b, 0));
                    // SAFETY: the block has 32 code bytes at offset 2.
                    let qf: [__m256; 4] = std::array::from_fn(|k| unsafe {
                        cvt8(_mm_loadl_epi64(bp.add(2 + 8 * k).cast()))
                    });
                    for t in 0..T {
                        // SAFETY: 32 elements of block i remain at xp[t].
                        let a = unsafe { dot32(&qf, xp[t]) };
                        acc[r][t] = _mm256_fmadd_ps(d, a, acc[r][t]);
                    }
                }
                K_Q4K | K_Q5K => {
                    let five = K == K_Q5K;
                    let d = f16_at(b, 0);
                    let dmin = f16_at(b, 2);
                    let (sc, m) = scale_min_k4(&b[4..16]);
                    let ds: [f32; 8] = std::array::from_fn(|j| d * sc[j] as f32);
                    let mv: [f32; 8] = std::array::from_fn(|j| dmin * m[j] as f32);
                    // SAFETY: `mv` is 8 f32.
                    let mv = unsafe { _mm256_loadu_ps(mv.as_ptr()) };
                    for t in 0..T {
                        let s = &xs[t].1[i * 8..i * 8 + 8];
                        // SAFETY: `s` is 8 f32.
                        macc[r][t] = _mm256_fmadd_ps(mv, unsafe { ldx(s.as_ptr()) }, macc[r][t]);
                    }
                    let qs_off = if five { 48 } else { 16 };
                    // SAFETY: a Q5_K block has 32 high-bit bytes at 16.
                    let qh = if five {
                        unsafe { ld32(bp.add(16)) }
                    } else {
                        _mm256_setzero_si256()
                    };
                    for p in 0..4 {
                        // SAFETY: 128 code bytes at qs_off; p * 32 + 32 <= 128.
                        let v = unsafe { ld32(bp.add(qs_off + 32 * p)) };
                        let nibs = [
                            _mm256_and_si256(v, m4),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
                        ];
                        for (h, &nib) in nibs.iter().enumerate() {
                            let j = 2 * p + h;
                            let mut q = nib;
                            if five {
                                let bit = _mm256_set1_epi8(1 << j);
                                let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                                q = _mm256_or_si256(
                                    q,
                                    _mm256_and_si256(set, _mm256_set1_epi8(0x10)),
                                );
                            }
                            let qf = widen32(q);
                            let s = _mm256_set1_ps(ds[j]);
                            for t in 0..T {
                                // SAFETY: sub-block j of block i (32 elements)
                                // lies within x.
                                let a = unsafe { dot32(&qf, xp[t].add(32 * j)) };
                                acc[r][t] = _mm256_fmadd_ps(s, a, acc[r][t]);
                            }
                        }
                    }
                }
                _ => {
                    // Q6_K.
                    let d = f16_at(b, 208);
                    let ds: [f32; 16] = std::array::from_fn(|k| d * (b[192 + k] as i8) as f32);
                    let m30 = _mm256_set1_epi8(0x30);
                    let off = _mm256_set1_epi8(32);
                    for h in 0..2 {
                        // SAFETY: ql is 128 bytes at 0, qh 64 bytes at 128.
                        let (ql0, ql1, qh) = unsafe {
                            (
                                ld32(bp.add(64 * h)),
                                ld32(bp.add(64 * h + 32)),
                                ld32(bp.add(128 + 32 * h)),
                            )
                        };
                        let q = [
                            _mm256_or_si256(
                                _mm256_and_si256(ql0, m4),
                                _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m30),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(ql1, m4),
                                _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m30),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                                _mm256_and_si256(qh, m30),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                                _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30),
                            ),
                        ];
                        for (k, &qk) in q.iter().enumerate() {
                            let qf = widen32(_mm256_sub_epi8(qk, off));
                            let e = h * 128 + k * 32;
                            let s0 = _mm256_set1_ps(ds[e / 16]);
                            let s1 = _mm256_set1_ps(ds[e / 16 + 1]);
                            for t in 0..T {
                                // SAFETY: elements e..e + 32 of block i lie
                                // within x.
                                let (a0, a1) = unsafe {
                                    let x = xp[t].add(e);
                                    (
                                        _mm256_fmadd_ps(
                                            qf[1],
                                            ldx(x.add(8)),
                                            _mm256_mul_ps(qf[0], ldx(x)),
                                        ),
                                        _mm256_fmadd_ps(
                                            qf[3],
                                            ldx(x.add(24)),
                                            _mm256_mul_ps(qf[2], ldx(x.add(16))),
                                        ),
                                    )
                                };
                                acc[r][t] = _mm256_fmadd_ps(s0, a0, acc[r][t]);
                                acc[r][t] = _mm256_fmadd_ps(s1, a1, acc[r][t]);
                            }
                        }
                    }
                }
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = if mins {
                hsum(acc[r][t]) - hsum(macc[r][t])
            } else {
                hsum(acc[r][t])
            };
        }
    }
    out
}
