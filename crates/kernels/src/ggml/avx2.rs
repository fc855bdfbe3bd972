//! AVX2 + FMA + F16C products over GGML blocks (x86-64), f32 activations.
//!
//! Codes are widened to f32 in registers (never written to memory): 8 code
//! bytes at a time are zero- or sign-extended to 32-bit lanes straight from
//! the weights (`vpmovzxbd`/`vpmovsxbd`), nibbles and high bits are split
//! with integer masks and shifts, converted and multiplied with `x` by 8-lane
//! FMAs. Code offsets (`- 8` for `Q4_0`, `- 32` for `Q6_K`) and the `Q4_K` /
//! `Q5_K` mins are applied through sums of `x` over the (sub-)blocks,
//! computed once per token. Per (row, token) the arithmetic is fixed whatever
//! the row/token blocking (only independent chains interleave):
//!
//! * `Q4_0`, `Q8_0`: per block of 32, `a = q0 * x0` then three FMAs over the
//!   other 8-element chunks (raw codes `0..16` / `-128..128`), then
//!   `acc = fma(broadcast(d), a, acc)`; `Q4_0` also, per 8 blocks,
//!   `macc = fma(d[8], X[8], macc)` (`X` the block sums of `x`); result
//!   `hsum(acc)`, minus `8 * hsum(macc)` for `Q4_0`;
//! * `Q4_K`, `Q5_K`: per sub-block of 32 the same chain `a`, then
//!   `acc = fma(broadcast(d * sc_j), a, acc)`; per super-block
//!   `macc = fma(dmin * m[0..8], X[0..8], macc)`; result
//!   `hsum(acc) - hsum(macc)`;
//! * `Q6_K`: per sub-block of 16, `a = q0 * x0 + q1 * x1` (mul, FMA, raw
//!   codes `0..64`), then `acc = fma(broadcast(d * sc_k), a, acc)`; per
//!   super-block `macc = fma(d * sc[0..8], X[0..8], macc)` and the same for
//!   `sc[8..16]` (`X` the 16-element sums); result
//!   `hsum(acc) - 32 * hsum(macc)`.
//!
//! Each row block software-prefetches the same bytes one row block ahead
//! (without it, streaming 18-byte blocks from DRAM ran at half the affine
//! kernel's rate; see docs/BENCHMARKS.md).
//!
//! Blocking: from [`super::gemm::min_tokens`] tokens (8 for `Q6_K`, 32
//! for the others) the GEMM path of
//! [`super::gemm`] (rows decoded once into a panel, the same arithmetic);
//! with 4 or more tokens one row for 4 tokens at a time (codes decoded once
//! per 4 tokens; 2 for `Q6_K`), in blocks of [`TOKEN_BLOCK`] tokens;
//! otherwise (decode) `Q4_0` and `Q8_0` one row at a time per token
//! ([`block32_row`]: the weights stream in address order, 15-35 % faster
//! than row pairs here), the K-quants 2 rows at a time per token (one row
//! at a time measured no faster). Leftovers go one by one.

use std::arch::x86_64::*;

use super::{row_bytes, QK_K};
use crate::x86::hsum;
use crate::Token;
use slipstream_core::{QuantType, TensorView};

pub(super) const K_Q4_0: u8 = 0;
pub(super) const K_Q8_0: u8 = 1;
pub(super) const K_Q4K: u8 = 2;
pub(super) const K_Q5K: u8 = 3;
pub(super) const K_Q6K: u8 = 4;

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
    if toks.len() >= super::gemm::min_tokens(w.qtype) {
        return super::gemm::rows(w, r0, r1, toks, out);
    }
    match w.qtype {
        QuantType::Q4_0 => drive::<K_Q4_0, 4>(w, r0, r1, toks, out),
        QuantType::Q8_0 => drive::<K_Q8_0, 4>(w, r0, r1, toks, out),
        QuantType::Q4K => drive::<K_Q4K, 4>(w, r0, r1, toks, out),
        QuantType::Q5K => drive::<K_Q5K, 4>(w, r0, r1, toks, out),
        QuantType::Q6K => drive::<K_Q6K, 2>(w, r0, r1, toks, out),
        q => panic!("{} is not a GGML block type", q.name()),
    }
}

/// Sums of `x` over consecutive `N`-element chunks (`N` 16 or 32), each by
/// one fixed sequence (8-lane adds, then [`hsum`]), zero-padded to a
/// multiple of 8 entries.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn chunk_sums<const N: usize>(x: &[f32]) -> Vec<f32> {
    let mut out: Vec<f32> = x
        .chunks_exact(N)
        .map(|c| {
            // SAFETY: `c` holds N (16 or 32) f32.
            unsafe {
                let p = c.as_ptr();
                let mut s = _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)));
                if N == 32 {
                    s = _mm256_add_ps(
                        s,
                        _mm256_add_ps(_mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))),
                    );
                }
                hsum(s)
            }
        })
        .collect();
    out.resize(out.len().next_multiple_of(8), 0.0);
    out
}

/// A token as the kernels take it: `x` (`[cols]`) and its chunk sums (32
/// elements for `Q4_0`, `Q4_K`, `Q5_K`; 16 for `Q6_K`; none for `Q8_0`).
type Input<'a> = (&'a [f32], &'a [f32]);

#[target_feature(enable = "avx2,fma,f16c")]
fn drive<const K: u8, const TB: usize>(
    w: &TensorView,
    r0: usize,
    r1: usize,
    toks: &[Token],
    out: &mut [f32],
) {
    let ntok = toks.len();
    let sums: Vec<Vec<f32>> = toks
        .iter()
        .map(|t| match K {
            K_Q8_0 => Vec::new(),
            K_Q6K => chunk_sums::<16>(t.x),
            _ => chunk_sums::<32>(t.x),
        })
        .collect();
    let xin = |t: usize| -> Input { (toks[t].x, sums[t].as_slice()) };
    if ntok >= TB {
        for tb in (0..ntok).step_by(TOKEN_BLOCK) {
            let te = (tb + TOKEN_BLOCK).min(ntok);
            for r in r0..r1 {
                let o = &mut out[(r - r0) * ntok..(r - r0 + 1) * ntok];
                let mut t = tb;
                while t + TB <= te {
                    let ins: [Input; TB] = std::array::from_fn(|i| xin(t + i));
                    call::<K>(w, &[r], &ins, &mut o[t..t + TB]);
                    t += TB;
                }
                while t < te {
                    call::<K>(w, &[r], &[xin(t)], &mut o[t..t + 1]);
                    t += 1;
                }
            }
        }
    } else if K == K_Q4_0 || K == K_Q8_0 {
        for (t, tok) in toks.iter().enumerate() {
            let (x, xs) = (tok.x, sums[t].as_slice());
            for r in r0..r1 {
                out[(r - r0) * ntok + t] = block32_row::<K>(row_bytes(w, r), x, xs, w.cols);
            }
        }
    } else {
        for t in 0..ntok {
            let mut r = r0;
            while r + 2 <= r1 {
                let mut res = [0f32; 2];
                call::<K>(w, &[r, r + 1], &[xin(t)], &mut res);
                out[(r - r0) * ntok + t] = res[0];
                out[(r - r0 + 1) * ntok + t] = res[1];
                r += 2;
            }
            while r < r1 {
                call::<K>(w, &[r], &[xin(t)], &mut out[(r - r0) * ntok + t..][..1]);
                r += 1;
            }
        }
    }
}

/// One kernel call for `rows` (1 or 2) and `ins` (1, 2 or 4 tokens; more
/// than one token only with one row) into `res` (`[rows.len() * ins.len()]`).
#[target_feature(enable = "avx2,fma,f16c")]
fn call<const K: u8>(w: &TensorView, rows: &[usize], ins: &[Input], res: &mut [f32]) {
    let row = |r: usize| row_bytes(w, r);
    match (rows.len(), ins.len()) {
        (1, 4) => {
            let v = kernel::<K, 1, 4>([row(rows[0])], [ins[0], ins[1], ins[2], ins[3]], w.cols);
            res.copy_from_slice(&v[0]);
        }
        (1, 2) => {
            let v = kernel::<K, 1, 2>([row(rows[0])], [ins[0], ins[1]], w.cols);
            res.copy_from_slice(&v[0]);
        }
        (2, 1) => {
            let v = kernel::<K, 2, 1>([row(rows[0]), row(rows[1])], [ins[0]], w.cols);
            res[0] = v[0][0];
            res[1] = v[1][0];
        }
        (1, 1) => res[0] = kernel::<K, 1, 1>([row(rows[0])], [ins[0]], w.cols)[0][0],
        (r, t) => unreachable!("no kernel for {r} rows x {t} tokens"),
    }
}

/// The little-endian f16 at `b[i..i + 2]` as f32 (exact, F16C).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn f16(b: &[u8], i: usize) -> f32 {
    let h = u16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// Eight little-endian f16 at byte offsets `off + k * stride` (`k < n`,
/// zero past `n`) of `b`, as f32 (exact).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn f16x8(b: &[u8], off: usize, stride: usize, n: usize) -> [f32; 8] {
    let mut h = [0u16; 8];
    for (k, v) in h.iter_mut().enumerate().take(n.min(8)) {
        let i = off + k * stride;
        *v = u16::from_le_bytes([b[i], b[i + 1]]);
    }
    let mut o = [0f32; 8];
    // SAFETY: `h` is 16 readable bytes, `o` 32 writable ones.
    unsafe {
        let v = _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast()));
        _mm256_storeu_ps(o.as_mut_ptr(), v);
    }
    o
}

/// Eight f32 at `p` (unaligned).
///
/// # Safety
/// `p` must be valid for reading 8 f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn ldx(p: *const f32) -> __m256 {
    // SAFETY: the caller guarantees 32 readable bytes; loadu is unaligned.
    unsafe { _mm256_loadu_ps(p) }
}

/// Eight bytes at `p` zero-extended to 32-bit lanes.
///
/// # Safety
/// `p` must be valid for reading 8 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn zx8(p: *const u8) -> __m256i {
    // SAFETY: 8 readable bytes at `p` (caller).
    unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())) }
}

/// Eight bytes at `p` sign-extended to 32-bit lanes.
///
/// # Safety
/// `p` must be valid for reading 8 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn sx8(p: *const u8) -> __m256i {
    // SAFETY: 8 readable bytes at `p` (caller).
    unsafe { _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn cvt(v: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(v)
}

/// How far ahead of the blocks [`block32_row`] reads it asks for them (bytes;
/// prefetches never fault, so running past a matrix's end is harmless).
const ROW_PREFETCH_BYTES: usize = 2048;

/// One `Q4_0` or `Q8_0` row (`b`, its blocks) times one token (`x`, `[cols]`,
/// and its block sums `xs`): the kernel's arithmetic for one (row, token)
/// (see the module doc), one row streaming in address order with the codes
/// asked for [`ROW_PREFETCH_BYTES`] ahead, so the bits are [`kernel`]'s.
#[target_feature(enable = "avx2,fma,f16c")]
fn block32_row<const K: u8>(b: &[u8], x: &[f32], xs: &[f32], cols: usize) -> f32 {
    let (_, bb) = block_size(K);
    let nb = cols / 32;
    assert!(b.len() >= nb * bb && x.len() >= cols);
    assert!(K == K_Q8_0 || xs.len() >= nb.next_multiple_of(8));
    let m4 = _mm256_set1_epi32(0x0F);
    let mut acc = _mm256_setzero_ps();
    let mut macc = _mm256_setzero_ps();
    let (bp, xp) = (b.as_ptr(), x.as_ptr());
    let mut g = 0;
    while g < nb {
        let n = (nb - g).min(8);
        let mut h = [0u16; 8];
        for (j, v) in h.iter_mut().enumerate().take(n) {
            // SAFETY: block g + j < nb starts with its f16 scale.
            *v = unsafe { bp.add((g + j) * bb).cast::<u16>().read_unaligned() };
        }
        // SAFETY: `h` is 16 readable bytes.
        let dv = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(h.as_ptr().cast()) });
        let mut d = [0f32; 8];
        // SAFETY: `d` is 8 writable f32.
        unsafe { _mm256_storeu_ps(d.as_mut_ptr(), dv) };
        for (j, &dj) in d.iter().enumerate().take(n) {
            let i = g + j;
            // SAFETY: block i < nb: 16 (Q4_0) or 32 (Q8_0) code bytes at
            // offset 2; elements 32i..32i + 32 < cols of x.
            unsafe {
                let p = bp.add(i * bb + 2);
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ROW_PREFETCH_BYTES).cast());
                let q: [__m256; 4] = if K == K_Q4_0 {
                    let v0 = zx8(p);
                    let v1 = zx8(p.add(8));
                    [
                        cvt(_mm256_and_si256(v0, m4)),
                        cvt(_mm256_and_si256(v1, m4)),
                        cvt(_mm256_srli_epi32::<4>(v0)),
                        cvt(_mm256_srli_epi32::<4>(v1)),
                    ]
                } else {
                    [
                        cvt(sx8(p)),
                        cvt(sx8(p.add(8))),
                        cvt(sx8(p.add(16))),
                        cvt(sx8(p.add(24))),
                    ]
                };
                let xi = xp.add(i * 32);
                let a = _mm256_mul_ps(q[0], ldx(xi));
                let a = _mm256_fmadd_ps(q[1], ldx(xi.add(8)), a);
                let a = _mm256_fmadd_ps(q[2], ldx(xi.add(16)), a);
                let a = _mm256_fmadd_ps(q[3], ldx(xi.add(24)), a);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(dj), a, acc);
            }
        }
        if K == K_Q4_0 {
            // SAFETY: the sums are padded to a multiple of 8, g + 8 <= their
            // length (asserted above).
            macc = _mm256_fmadd_ps(dv, unsafe { ldx(xs.as_ptr().add(g)) }, macc);
        }
        g += 8;
    }
    if K == K_Q4_0 {
        hsum(acc) - 8.0 * hsum(macc)
    } else {
        hsum(acc)
    }
}

/// The sub-block scales `d * sc_j` and mins `dmin * m_j` (`j < 8`) of a
/// `Q4_K` / `Q5_K` block `b` (at least 16 bytes), as f32 vectors: the 6-bit
/// fields of [`super::scale_min_k4`] unpacked four at a time in 32-bit words,
/// widened and multiplied in 8 lanes (the same products as the scalar
/// `d * sc as f32`, IEEE in either form).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn k4_scales(b: &[u8]) -> (__m256, __m256) {
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let (d, dmin) = (f16(b, 0), f16(b, 2));
    let (u0, u1, u2) = (word(4), word(8), word(12));
    // sc[0..4] = s[0..4] & 63, sc[4..8] = (s[8..12] & 15) | (s[0..4] >> 6) << 4;
    // m[0..4] = s[4..8] & 63, m[4..8] = (s[8..12] >> 4) | (s[4..8] >> 6) << 4.
    let sc = (u0 & LOW6) as u64 | (((u2 & LOW4) | (((u0 >> 6) & LOW2) << 4)) as u64) << 32;
    let m = (u1 & LOW6) as u64 | ((((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4)) as u64) << 32;
    let widen = |v: u64| cvt(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)));
    (
        _mm256_mul_ps(_mm256_set1_ps(d), widen(sc)),
        _mm256_mul_ps(_mm256_set1_ps(dmin), widen(m)),
    )
}

/// Expected lengths: (elements, bytes) per block of kind `K`.
pub(super) const fn block_size(k: u8) -> (usize, usize) {
    match k {
        K_Q4_0 => (32, 18),
        K_Q8_0 => (32, 34),
        K_Q4K => (QK_K, 144),
        K_Q5K => (QK_K, 176),
        _ => (QK_K, 210),
    }
}

/// Dot products of `R` rows (raw bytes of `cols / block` blocks each) with
/// `T` tokens, for GGML kind `K` (see the module doc for the arithmetic).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::needless_range_loop)]
fn kernel<const K: u8, const R: usize, const T: usize>(
    rows: [&[u8]; R],
    xs: [Input; T],
    cols: usize,
) -> [[f32; T]; R] {
    let (be, bb) = block_size(K);
    let nb = cols / be;
    for r in &rows {
        assert!(r.len() >= nb * bb);
    }
    let nsums = match K {
        K_Q8_0 => 0,
        K_Q6K => (cols / 16).next_multiple_of(8),
        _ => (cols / 32).next_multiple_of(8),
    };
    for (x, s) in &xs {
        assert!(x.len() >= cols && s.len() >= nsums);
    }
    let m4 = _mm256_set1_epi32(0x0F);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut macc = [[_mm256_setzero_ps(); T]; R];
    // Base pointers: every offset below stays inside the lengths asserted
    // above (block i < nb, element < cols, sum < nsums).
    let rp: [*const u8; R] = std::array::from_fn(|r| rows[r].as_ptr());
    let xb: [*const f32; T] = std::array::from_fn(|t| xs[t].0.as_ptr());
    let sb: [*const f32; T] = std::array::from_fn(|t| xs[t].1.as_ptr());
    // Prefetch distance: one row block (R rows) ahead.
    let ahead = R * nb * bb;
    if K == K_Q4_0 || K == K_Q8_0 {
        // Groups of 8 blocks: their scales converted at once.
        let mut g = 0;
        while g < nb {
            let n = (nb - g).min(8);
            let d: [[f32; 8]; R] = std::array::from_fn(|r| f16x8(rows[r], g * bb, bb, n));
            for j in 0..n {
                let i = g + j;
                for r in 0..R {
                    // Software prefetch of the same block R rows ahead (the
                    // next row block); prefetches never fault, so running
                    // past the end is harmless.
                    _mm_prefetch::<_MM_HINT_T0>(rp[r].wrapping_add(i * bb + ahead).cast());
                    // SAFETY: block i < nb of row r: 16 (Q4_0) or 32 (Q8_0)
                    // code bytes at offset 2.
                    let q: [__m256; 4] = unsafe {
                        let p = rp[r].add(i * bb + 2);
                        if K == K_Q4_0 {
                            let v0 = zx8(p);
                            let v1 = zx8(p.add(8));
                            [
                                cvt(_mm256_and_si256(v0, m4)),
                                cvt(_mm256_and_si256(v1, m4)),
                                cvt(_mm256_srli_epi32::<4>(v0)),
                                cvt(_mm256_srli_epi32::<4>(v1)),
                            ]
                        } else {
                            [
                                cvt(sx8(p)),
                                cvt(sx8(p.add(8))),
                                cvt(sx8(p.add(16))),
                                cvt(sx8(p.add(24))),
                            ]
                        }
                    };
                    let s = _mm256_set1_ps(d[r][j & 7]);
                    for t in 0..T {
                        // SAFETY: elements 32i..32i + 32 < cols of x.
                        let a = unsafe {
                            let x = xb[t].add(i * 32);
                            let a = _mm256_mul_ps(q[0], ldx(x));
                            let a = _mm256_fmadd_ps(q[1], ldx(x.add(8)), a);
                            let a = _mm256_fmadd_ps(q[2], ldx(x.add(16)), a);
                            _mm256_fmadd_ps(q[3], ldx(x.add(24)), a)
                        };
                        acc[r][t] = _mm256_fmadd_ps(s, a, acc[r][t]);
                    }
                }
            }
            if K == K_Q4_0 {
                for r in 0..R {
                    // SAFETY: `d[r]` is 8 f32; the sums are padded to a
                    // multiple of 8, g + 8 <= nsums.
                    unsafe {
                        let dv = ldx(d[r].as_ptr());
                        for t in 0..T {
                            macc[r][t] = _mm256_fmadd_ps(dv, ldx(sb[t].add(g)), macc[r][t]);
                        }
                    }
                }
            }
            g += 8;
        }
    } else if K == K_Q4K || K == K_Q5K {
        let five = K == K_Q5K;
        let qs_off = if five { 48 } else { 16 };
        let bit4 = _mm256_set1_epi32(0x10);
        for i in 0..nb {
            for r in 0..R {
                let b = &rows[r][i * bb..(i + 1) * bb];
                let (dsv, mv) = k4_scales(b);
                let mut ds = [0f32; 8];
                // SAFETY: `ds` is 8 writable f32.
                unsafe { _mm256_storeu_ps(ds.as_mut_ptr(), dsv) };
                // SAFETY: the sums hold 8 per super-block.
                unsafe {
                    for t in 0..T {
                        macc[r][t] = _mm256_fmadd_ps(mv, ldx(sb[t].add(i * 8)), macc[r][t]);
                    }
                }
                let bp = b.as_ptr();
                for l in (0..bb).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(bp.wrapping_add(ahead + l).cast());
                }
                for p in 0..4 {
                    // Sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles)
                    // of code bytes 32p..32p + 32; chains over 8-lane steps k.
                    let mut alo = [_mm256_setzero_ps(); T];
                    let mut ahi = [_mm256_setzero_ps(); T];
                    let sh = _mm_cvtsi32_si128(2 * p as i32);
                    for k in 0..4 {
                        // SAFETY: 128 code bytes at qs_off (32p + 8k + 8 <=
                        // 128); Q5_K has 32 high-bit bytes at 16.
                        let (mut lo, mut hi) = unsafe {
                            let v = zx8(bp.add(qs_off + 32 * p + 8 * k));
                            (_mm256_and_si256(v, m4), _mm256_srli_epi32::<4>(v))
                        };
                        if five {
                            // Bit 2p of qh to bit 4 of lo, bit 2p + 1 to hi.
                            // SAFETY: as above.
                            let h = _mm256_srl_epi32(unsafe { zx8(bp.add(16 + 8 * k)) }, sh);
                            lo = _mm256_or_si256(
                                lo,
                                _mm256_and_si256(_mm256_slli_epi32::<4>(h), bit4),
                            );
                            hi = _mm256_or_si256(
                                hi,
                                _mm256_and_si256(_mm256_slli_epi32::<3>(h), bit4),
                            );
                        }
                        let (lo, hi) = (cvt(lo), cvt(hi));
                        for t in 0..T {
                            // SAFETY: elements 256i + 64p + 8k (+ 32) + 8
                            // <= cols of x.
                            unsafe {
                                let x = xb[t].add(i * QK_K + 64 * p + 8 * k);
                                if k == 0 {
                                    alo[t] = _mm256_mul_ps(lo, ldx(x));
                                    ahi[t] = _mm256_mul_ps(hi, ldx(x.add(32)));
                                } else {
                                    alo[t] = _mm256_fmadd_ps(lo, ldx(x), alo[t]);
                                    ahi[t] = _mm256_fmadd_ps(hi, ldx(x.add(32)), ahi[t]);
                                }
                            }
                        }
                    }
                    let (s0, s1) = (_mm256_set1_ps(ds[2 * p]), _mm256_set1_ps(ds[2 * p + 1]));
                    for t in 0..T {
                        acc[r][t] = _mm256_fmadd_ps(s0, alo[t], acc[r][t]);
                        acc[r][t] = _mm256_fmadd_ps(s1, ahi[t], acc[r][t]);
                    }
                }
            }
        }
    } else {
        // Q6_K.
        let m30 = _mm256_set1_epi32(0x30);
        for i in 0..nb {
            for r in 0..R {
                let b = &rows[r][i * bb..(i + 1) * bb];
                let d = f16(b, 208);
                let ds: [f32; 16] = std::array::from_fn(|k| d * (b[192 + k] as i8) as f32);
                // SAFETY: `ds` is 16 f32; the sums hold 16 per super-block.
                unsafe {
                    let (d0, d1) = (ldx(ds.as_ptr()), ldx(ds.as_ptr().add(8)));
                    for t in 0..T {
                        let s = sb[t].add(i * 16);
                        let m = _mm256_fmadd_ps(d0, ldx(s), macc[r][t]);
                        macc[r][t] = _mm256_fmadd_ps(d1, ldx(s.add(8)), m);
                    }
                }
                let bp = b.as_ptr();
                for l in (0..bb).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(bp.wrapping_add(ahead + l).cast());
                }
                for h in 0..2 {
                    // Pair 0: ql[0..32] -> groups 0 (low nibbles, qh bits 0-1)
                    // and 2 (high, bits 4-5); pair 1: ql[32..64] -> groups 1
                    // (bits 2-3) and 3 (bits 6-7). Group g = elements
                    // 128h + 32g ..+ 32, sub-blocks 8h + 2g and + 1; chains
                    // over the two 8-lane steps of each sub-block.
                    for pair in 0..2 {
                        let mut ch = [[_mm256_setzero_ps(); T]; 4];
                        for k in 0..4 {
                            // SAFETY: ql is 128 bytes at 0 and qh 64 at 128;
                            // 64h + 32 pair + 8k + 8 <= 128, 32h + 8k + 8 <= 64.
                            let (a, c) = unsafe {
                                (
                                    zx8(bp.add(64 * h + 32 * pair + 8 * k)),
                                    zx8(bp.add(128 + 32 * h + 8 * k)),
                                )
                            };
                            let (clo, chi) = if pair == 0 {
                                (_mm256_slli_epi32::<4>(c), c)
                            } else {
                                (_mm256_slli_epi32::<2>(c), _mm256_srli_epi32::<2>(c))
                            };
                            let lo = cvt(_mm256_or_si256(
                                _mm256_and_si256(a, m4),
                                _mm256_and_si256(clo, m30),
                            ));
                            let hi = cvt(_mm256_or_si256(
                                _mm256_srli_epi32::<4>(a),
                                _mm256_and_si256(chi, m30),
                            ));
                            // Chains: [lo sub 0, lo sub 1, hi sub 0, hi sub 1].
                            let (cl, chh) = (k / 2, 2 + k / 2);
                            for t in 0..T {
                                // SAFETY: elements 256i + 128h + 32g + 8k + 8
                                // <= cols of x.
                                unsafe {
                                    let x = xb[t].add(i * QK_K + 128 * h + 32 * pair + 8 * k);
                                    let (xl, xh) = (ldx(x), ldx(x.add(64)));
                                    if k % 2 == 0 {
                                        ch[cl][t] = _mm256_mul_ps(lo, xl);
                                        ch[chh][t] = _mm256_mul_ps(hi, xh);
                                    } else {
                                        ch[cl][t] = _mm256_fmadd_ps(lo, xl, ch[cl][t]);
                                        ch[chh][t] = _mm256_fmadd_ps(hi, xh, ch[chh][t]);
                                    }
                                }
                            }
                        }
                        for (c, chain) in ch.iter().enumerate() {
                            let g = pair + 2 * (c / 2);
                            let s = _mm256_set1_ps(ds[8 * h + 2 * g + c % 2]);
                            for t in 0..T {
                                acc[r][t] = _mm256_fmadd_ps(s, chain[t], acc[r][t]);
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
            out[r][t] = match K {
                K_Q8_0 => hsum(acc[r][t]),
                K_Q4_0 => hsum(acc[r][t]) - 8.0 * hsum(macc[r][t]),
                K_Q6K => hsum(acc[r][t]) - 32.0 * hsum(macc[r][t]),
                _ => hsum(acc[r][t]) - hsum(macc[r][t]),
            };
        }
    }
    out
}
