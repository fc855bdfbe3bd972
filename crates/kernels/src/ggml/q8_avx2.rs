//! AVX2 products of GGML blocks with 8-bit activations (see [`super::q8`] for
//! the definition they follow bit for bit): codes stay bytes, products are
//! `_mm256_maddubs_epi16` (u8 x i8 pairs to i16; `Q4_0` / `Q8_0` through the
//! sign trick, `|w|` times `x` carrying the sign of `w`) then
//! `_mm256_madd_epi16` (pairs to i32, by one or by the sub-block scale), so
//! each i32 lane is the exact lane sum of the reference.
//!
//! Blocking: per row, tokens 4 at a time (the weight codes unpacked once for
//! 4 tokens; 1 at a time for the rest), in blocks of [`TOKEN_BLOCK`] tokens
//! whose quantized inputs stay in L2 while every row passes over them.
//! Each (row, token) pair runs the same instruction sequence in either form.

use std::arch::x86_64::*;

use super::avx2::f16;
use super::q8::{inputs, Q8Row};
use super::{row_bytes, scale_min_k4, QK, QK_K};
use crate::x86::hsum;
use crate::Token;
use slipstream_core::{QuantType, TensorView};

const K_Q4_0: u8 = 0;
const K_Q8_0: u8 = 1;
const K_Q4K: u8 = 2;
const K_Q5K: u8 = 3;
const K_Q6K: u8 = 4;

/// Tokens per block: 32 quantized rows of 4096 codes are 128 KiB.
const TOKEN_BLOCK: usize = 32;

/// Rows `r0..r1` of `w` for all `toks` (quantized by [`super::q8`]) into
/// `out` (`[r1 - r0, toks.len()]`). Panics if the CPU lacks AVX2, FMA or
/// F16C.
pub(crate) fn rows(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    assert!(crate::Isa::Avx2.is_supported(), "CPU lacks AVX2/FMA/F16C");
    // SAFETY: the CPU supports avx2, fma and f16c (checked above).
    unsafe { rows_impl(w, r0, r1, toks, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn rows_impl(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    super::check_blocks(w);
    assert!(r0 <= r1 && r1 <= w.rows);
    assert_eq!(out.len(), (r1 - r0) * toks.len());
    let ins = inputs(toks);
    let (be, _) = w.qtype.ggml_block().expect("GGML block type");
    for x in &ins {
        assert!(x.qs.len() >= w.cols && x.d.len() >= w.cols / be);
        if be == QK_K {
            assert!(x.bsums.len() >= w.cols / 16);
        }
    }
    match w.qtype {
        QuantType::Q4_0 => drive::<K_Q4_0>(w, r0, r1, &ins, out),
        QuantType::Q8_0 => drive::<K_Q8_0>(w, r0, r1, &ins, out),
        QuantType::Q4K => drive::<K_Q4K>(w, r0, r1, &ins, out),
        QuantType::Q5K => drive::<K_Q5K>(w, r0, r1, &ins, out),
        QuantType::Q6K => drive::<K_Q6K>(w, r0, r1, &ins, out),
        q => panic!("{} has no 8-bit activation kernel", q.name()),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn drive<const K: u8>(w: &TensorView, r0: usize, r1: usize, ins: &[&Q8Row], out: &mut [f32]) {
    let ntok = ins.len();
    for tb in (0..ntok).step_by(TOKEN_BLOCK) {
        let te = (tb + TOKEN_BLOCK).min(ntok);
        for r in r0..r1 {
            let row = row_bytes(w, r);
            let o = &mut out[(r - r0) * ntok..(r - r0 + 1) * ntok];
            let mut t = tb;
            while t + 4 <= te {
                let x = [ins[t], ins[t + 1], ins[t + 2], ins[t + 3]];
                o[t..t + 4].copy_from_slice(&dot::<K, 4>(row, x));
                t += 4;
            }
            while t < te {
                o[t] = dot::<K, 1>(row, [ins[t]])[0];
                t += 1;
            }
        }
    }
}

/// One row (`row`, its block bytes) times `T` quantized inputs (each at
/// least as long as the row, checked by [`rows`]).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn dot<const K: u8, const T: usize>(row: &[u8], x: [&Q8Row; T]) -> [f32; T] {
    match K {
        K_Q4_0 | K_Q8_0 => dot_b32::<K, T>(row, x),
        K_Q4K | K_Q5K => dot_q45k::<K, T>(row, x),
        _ => dot_q6k::<T>(row, x),
    }
}

/// 32 bytes at `p` (unaligned).
///
/// # Safety
/// `p` must be valid for reading 32 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn ld(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// How far ahead of the block being read the kernels ask for weight bytes
/// (prefetches never fault, so running past a matrix's end is harmless):
/// as the f32 kernels' `ROW_PREFETCH_BYTES`, without it rows streaming from
/// beyond L2 run well below the memory rate.
const PREFETCH_BYTES: usize = 2048;

/// Asks for the `lines` cache lines from `PREFETCH_BYTES` past `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn prefetch(p: *const u8, lines: usize) {
    for l in 0..lines {
        // A prefetch never faults: the address is only computed (wrapping).
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES + 64 * l).cast());
    }
}

/// Per token: its codes' and block steps' base pointers, after checking
/// that they cover a row of `nb` blocks of `be` elements.
fn bases<const T: usize>(
    x: [&Q8Row; T],
    nb: usize,
    be: usize,
) -> ([*const u8; T], [*const f32; T]) {
    for v in x {
        assert!(
            v.qs.len() >= nb * be && v.d.len() >= nb,
            "quantized input shorter than the row"
        );
    }
    (
        std::array::from_fn(|t| x[t].qs.as_ptr().cast::<u8>()),
        std::array::from_fn(|t| x[t].d.as_ptr()),
    )
}

/// `Q4_0` / `Q8_0`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn dot_b32<const K: u8, const T: usize>(row: &[u8], x: [&Q8Row; T]) -> [f32; T] {
    let bb = if K == K_Q4_0 { 18 } else { 34 };
    let ones = _mm256_set1_epi16(1);
    let m4 = _mm_set1_epi8(0x0F);
    let eight = _mm256_set1_epi8(8);
    let mut acc = [_mm256_setzero_ps(); T];
    let (xq, xd) = bases(x, row.len() / bb, QK);
    for (i, blk) in row.chunks_exact(bb).enumerate() {
        prefetch(blk.as_ptr(), 1);
        let dw = f16(blk, 0);
        // SAFETY: a block is 18 (`Q4_0`: 16 code bytes at 2) or 34 (`Q8_0`:
        // 32 at 2) bytes.
        let w = unsafe {
            if K == K_Q4_0 {
                let raw = _mm_loadu_si128(blk.as_ptr().add(2).cast());
                let lo = _mm_and_si128(raw, m4);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), m4);
                _mm256_sub_epi8(_mm256_set_m128i(hi, lo), eight)
            } else {
                ld(blk.as_ptr().add(2))
            }
        };
        let aw = _mm256_sign_epi8(w, w);
        for t in 0..T {
            // SAFETY: block i < nb of every token's codes and steps
            // (`bases`).
            let (y, dx) = unsafe { (ld(xq[t].add(i * QK)), *xd[t].add(i)) };
            let s = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(y, w)), ones);
            let d = _mm256_set1_ps(dw * dx);
            acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc[t]);
        }
    }
    std::array::from_fn(|t| hsum(acc[t]))
}

/// `Q4_K` / `Q5_K`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn dot_q45k<const K: u8, const T: usize>(row: &[u8], x: [&Q8Row; T]) -> [f32; T] {
    let five = K == K_Q5K;
    let (bb, qs_off) = if five { (176, 48) } else { (144, 16) };
    let m4 = _mm256_set1_epi8(0x0F);
    let one8 = _mm256_set1_epi8(1);
    let mut acc = [_mm256_setzero_ps(); T];
    let mut accm = [0f32; T];
    let (xq, _) = bases(x, row.len() / bb, QK_K);
    for (i, blk) in row.chunks_exact(bb).enumerate() {
        let (sc, m) = scale_min_k4(&blk[4..16]);
        let bp = blk.as_ptr();
        prefetch(bp, bb.div_ceil(64));
        let qh = if five {
            // SAFETY: `Q5_K` blocks hold 32 high-bit bytes at 16.
            unsafe { ld(bp.add(16)) }
        } else {
            _mm256_setzero_si256()
        };
        let mut sumi = [_mm256_setzero_si256(); T];
        for p in 0..4 {
            // SAFETY: 32 code bytes at qs_off + 32p, inside the block.
            let raw = unsafe { ld(bp.add(qs_off + 32 * p)) };
            let mut lo = _mm256_and_si256(raw, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
            if five {
                // Bit 2p (low sub-block) and 2p + 1 (high) of each byte of
                // `qh`, as bit 4 of the code.
                let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * p as i32));
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(h, one8)));
                let h = _mm256_srli_epi16::<1>(h);
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(_mm256_and_si256(h, one8)));
            }
            let s_lo = _mm256_set1_epi16(sc[2 * p] as i16);
            let s_hi = _mm256_set1_epi16(sc[2 * p + 1] as i16);
            for t in 0..T {
                // SAFETY: elements of super-block i < nb (`bases`).
                let (ya, yb) = unsafe {
                    let e = xq[t].add(i * QK_K + 64 * p);
                    (ld(e), ld(e.add(32)))
                };
                let a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, ya), s_lo);
                let b = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, yb), s_hi);
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(a, b));
            }
        }
        let (dw, dmw) = (f16(blk, 0), f16(blk, 2));
        for t in 0..T {
            let bs = &x[t].bsums[16 * i..16 * i + 16];
            let msum: i32 = (0..8)
                .map(|j| m[j] as i32 * (bs[2 * j] + bs[2 * j + 1]))
                .sum();
            let dx = x[t].d[i];
            let dmin = -dx * dmw;
            accm[t] = dmin.mul_add(msum as f32, accm[t]);
            let d = _mm256_set1_ps(dx * dw);
            acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    std::array::from_fn(|t| hsum(acc[t]) + accm[t])
}

/// `Q6_K`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn dot_q6k<const T: usize>(row: &[u8], x: [&Q8Row; T]) -> [f32; T] {
    let m4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    let m32 = _mm256_set1_epi8(32);
    let mut acc = [_mm256_setzero_ps(); T];
    let (xq, _) = bases(x, row.len() / 210, QK_K);
    for (i, blk) in row.chunks_exact(210).enumerate() {
        let bp = blk.as_ptr();
        prefetch(bp, 4);
        let sc = &blk[192..208];
        let mut sumi = [_mm256_setzero_si256(); T];
        for h in 0..2 {
            // SAFETY: 32 high-bit bytes at 128 + 32h, inside the 210-byte block.
            let c = unsafe { ld(bp.add(128 + 32 * h)) };
            for pair in 0..2 {
                // SAFETY: 32 low-nibble bytes at 64h + 32pair, inside the block.
                let a = unsafe { ld(bp.add(64 * h + 32 * pair)) };
                let (clo, chi) = if pair == 0 {
                    (_mm256_slli_epi16::<4>(c), c)
                } else {
                    (_mm256_slli_epi16::<2>(c), _mm256_srli_epi16::<2>(c))
                };
                let lo = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(clo, m30));
                let hi = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(a), m4),
                    _mm256_and_si256(chi, m30),
                );
                for (k, q) in [(pair, lo), (pair + 2, hi)] {
                    let e0 = 128 * h + 32 * k;
                    let scale = _mm256_set_m128i(
                        _mm_set1_epi16(sc[e0 / 16 + 1] as i8 as i16),
                        _mm_set1_epi16(sc[e0 / 16] as i8 as i16),
                    );
                    for t in 0..T {
                        // SAFETY: elements of super-block i < nb (`bases`).
                        let y = unsafe { ld(xq[t].add(i * QK_K + e0)) };
                        let p = _mm256_sub_epi16(
                            _mm256_maddubs_epi16(q, y),
                            _mm256_maddubs_epi16(m32, y),
                        );
                        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p, scale));
                    }
                }
            }
        }
        let dw = f16(blk, 208);
        for t in 0..T {
            let d = _mm256_set1_ps(x[t].d[i] * dw);
            acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    std::array::from_fn(|t| hsum(acc[t]))
}
