//! The GEMM path of the GGML block products (AVX2 + FMA + F16C): products of
//! [`min_tokens`] or more tokens (prefill, busy experts), bit-identical
//! per (row, token) to the matrix-vector kernel of [`super::avx2`].
//!
//! Rows are decoded [`GEMM_ROWS`] at a time into a panel: each row's codes as
//! f32 in element order (raw codes, exactly what the matvec kernel widens in
//! registers: `Q4_0` `0..16`, `Q8_0` `-128..128`, `Q4_K` `0..16`, `Q5_K`
//! `0..32`, `Q6_K` `0..64`), the scale of each sub-block (`d` per `Q4_0` /
//! `Q8_0` block, `d * sc_j` per K-quant sub-block) and the vector the matvec
//! kernel folds the sums of `x` with (`d` per block for `Q4_0`,
//! `dmin * m_j` for `Q4_K` / `Q5_K`, `d * sc_k` for `Q6_K`). Then `R x T`
//! register tiles of (row, token) pairs run over blocks of [`TILE_TOKENS`]
//! tokens and [`BLOCK_COLS`] columns, so both operands come from L1, carrying
//! each pair's accumulator from one column block to the next.
//!
//! Per (row, token) the arithmetic is the matvec kernel's, in its order: per
//! sub-block an 8-lane chain (a multiply, then FMAs over the sub-block's
//! 8-element steps), folded as `acc = fma(broadcast(scale), chain, acc)` in
//! the order the matvec kernel folds them (sub-block order, except `Q6_K`,
//! which folds each 128 elements' sub-blocks as 0, 1, 4, 5, 2, 3, 6, 7);
//! then the 8-lane FMA chain of the fold vector times the sums of `x` over
//! 8-entry chunks, and the same end (`hsum(acc) - c * hsum(macc)`). So the
//! path is invisible in the numbers: prompt chunking, slot counts and the
//! token count of a call never change a bit.

use std::arch::x86_64::*;

use super::avx2::{block_size, chunk_sums, cvt, f16, ldx, sx8, zx8};
use super::avx2::{K_Q4K, K_Q4_0, K_Q5K, K_Q6K, K_Q8_0};
use super::{row_bytes, scale_min_k4, QK_K};
use crate::x86::hsum;
use crate::Token;
use slipstream_core::{QuantType, TensorView};

/// Tokens from which products of `qtype` take this path. Measured on the
/// 2-vCPU EPYC VM (docs/BENCHMARKS.md, issue 35): `Q6_K` (a fold per 16
/// weights, two code sources) gains from 8 tokens; for the others the
/// matvec kernel's 4-token blocks are as fast or faster up to 16 tokens,
/// and the panel only breaks even to ~10 % ahead from 64.
pub(crate) fn min_tokens(qtype: QuantType) -> usize {
    if qtype == QuantType::Q6K {
        8
    } else {
        32
    }
}

/// Rows decoded at a time: 32 rows of 2048 columns are a 256 KiB f32 panel
/// (L2), decoded once for all tokens.
const GEMM_ROWS: usize = 32;

/// Rows per register tile.
const TILE_ROWS: usize = 2;
/// Tokens per register tile: 2 x 3 chains and 2 x 3 accumulators, plus two
/// panel vectors and one input vector, fill the 16 registers.
const TILE_COLS: usize = 3;
/// Tokens per block: their inputs over [`BLOCK_COLS`] columns (12 KiB) stay
/// in L1 while every row pair of the panel passes over them.
const TILE_TOKENS: usize = 4 * TILE_COLS;
/// Columns per block: one K-quant super-block (a multiple of every block).
const BLOCK_COLS: usize = QK_K;

/// Elements per sub-block (one scale): 16 for `Q6_K`, 32 otherwise.
const fn sub_elems(k: u8) -> usize {
    if k == K_Q6K {
        16
    } else {
        32
    }
}

/// Entries of the fold vector (and of the sums of `x`) per row: the matvec
/// kernel's sum counts, zero-padded to a multiple of 8.
fn fold_len(k: u8, cols: usize) -> usize {
    match k {
        K_Q8_0 => 0,
        K_Q6K => (cols / 16).next_multiple_of(8),
        _ => (cols / 32).next_multiple_of(8),
    }
}

/// The sub-block the matvec kernel folds `f`-th into a row's accumulator.
#[inline(always)]
fn folded_sub<const K: u8>(f: usize) -> usize {
    if K == K_Q6K {
        // Per super-block of 16 sub-blocks: for each half h, pair 0 folds
        // sub-blocks 0, 1 (low nibbles) and 4, 5 (high), pair 1 folds 2, 3
        // and 6, 7 (see `avx2::kernel`).
        let (base, j) = (f / 16 * 16, f % 16);
        let (h, r) = (j / 8, j % 8);
        let (pair, c) = (r / 4, r % 4);
        base + 8 * h + 2 * (pair + 2 * (c / 2)) + c % 2
    } else {
        f
    }
}

/// Rows `r0..r1` of a GGML block tensor for all `toks` (at least
/// [`min_tokens`] for speed; any count gives the matvec kernel's bits)
/// into `out` (`[r1 - r0, toks.len()]`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn rows(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    super::check_blocks(w);
    match w.qtype {
        QuantType::Q4_0 => gemm_rows::<K_Q4_0>(w, r0, r1, toks, out),
        QuantType::Q8_0 => gemm_rows::<K_Q8_0>(w, r0, r1, toks, out),
        QuantType::Q4K => gemm_rows::<K_Q4K>(w, r0, r1, toks, out),
        QuantType::Q5K => gemm_rows::<K_Q5K>(w, r0, r1, toks, out),
        QuantType::Q6K => gemm_rows::<K_Q6K>(w, r0, r1, toks, out),
        q => panic!("{} is not a GGML block type", q.name()),
    }
}

/// [`rows`] for kind `K`.
#[target_feature(enable = "avx2,fma,f16c")]
fn gemm_rows<const K: u8>(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    let cols = w.cols;
    let ntok = toks.len();
    let (be, _) = block_size(K);
    assert!(cols.is_multiple_of(be) && r0 <= r1 && r1 <= w.rows);
    assert_eq!(out.len(), (r1 - r0) * ntok);
    let sb = sub_elems(K);
    let nsub = cols / sb;
    let nfold = fold_len(K, cols);
    let sums: Vec<Vec<f32>> = toks
        .iter()
        .map(|t| match K {
            K_Q8_0 => Vec::new(),
            K_Q6K => chunk_sums::<16>(t.x),
            _ => chunk_sums::<32>(t.x),
        })
        .collect();
    for (t, s) in toks.iter().zip(&sums) {
        assert!(t.x.len() >= cols && s.len() >= nfold);
    }
    // 32-byte aligned so no panel load splits a cache line.
    let mut panel_buf = vec![_mm256_setzero_ps(); GEMM_ROWS * cols / 8];
    // SAFETY: `panel_buf` holds GEMM_ROWS * cols / 8 vectors of 8 f32 (`cols`
    // is a multiple of 32), all initialized; the slice borrows it
    // exclusively for this function.
    let panel: &mut [f32] = unsafe {
        std::slice::from_raw_parts_mut(panel_buf.as_mut_ptr().cast::<f32>(), GEMM_ROWS * cols)
    };
    let mut scales = vec![0f32; GEMM_ROWS * nsub];
    let mut folds = vec![0f32; GEMM_ROWS * nfold];
    let mut acc = vec![_mm256_setzero_ps(); GEMM_ROWS * TILE_TOKENS];
    let slots = BLOCK_COLS / sb;
    for rc in (r0..r1).step_by(GEMM_ROWS) {
        let nr = (r1 - rc).min(GEMM_ROWS);
        for i in 0..nr {
            decode_row::<K>(
                row_bytes(w, rc + i),
                &mut panel[i * cols..(i + 1) * cols],
                &mut scales[i * nsub..(i + 1) * nsub],
                &mut folds[i * nfold..(i + 1) * nfold],
            );
        }
        for tb in (0..ntok).step_by(TILE_TOKENS) {
            let nt = (ntok - tb).min(TILE_TOKENS);
            acc.fill(_mm256_setzero_ps());
            for f0 in (0..nsub).step_by(slots) {
                let fs = f0..(f0 + slots).min(nsub);
                let mut i = 0;
                while i < nr {
                    let ri = (nr - i).min(TILE_ROWS);
                    let mut t = 0;
                    while t < nt {
                        let ti = (nt - t).min(TILE_COLS);
                        let tile = Tile {
                            panel,
                            scales: &scales,
                            toks: &toks[tb + t..tb + t + ti],
                            cols,
                            nsub,
                            fs: fs.clone(),
                        };
                        match (ri, ti) {
                            (2, 3) => tile.run::<K, 2, 3>(i, t, &mut acc),
                            (2, 2) => tile.run::<K, 2, 2>(i, t, &mut acc),
                            (2, _) => tile.run::<K, 2, 1>(i, t, &mut acc),
                            (_, 3) => tile.run::<K, 1, 3>(i, t, &mut acc),
                            (_, 2) => tile.run::<K, 1, 2>(i, t, &mut acc),
                            _ => tile.run::<K, 1, 1>(i, t, &mut acc),
                        }
                        t += ti;
                    }
                    i += ri;
                }
            }
            for i in 0..nr {
                let fold = &folds[i * nfold..(i + 1) * nfold];
                for t in 0..nt {
                    let a = hsum(acc[i * TILE_TOKENS + t]);
                    out[(rc + i - r0) * ntok + tb + t] = finish::<K>(a, fold, &sums[tb + t]);
                }
            }
        }
    }
}

/// The end of one (row, token) product: `acc_sum` minus the fold term, as
/// the matvec kernel ends it (`fold` and `sums` are `[fold_len]`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn finish<const K: u8>(acc_sum: f32, fold: &[f32], sums: &[f32]) -> f32 {
    if K == K_Q8_0 {
        return acc_sum;
    }
    assert!(sums.len() >= fold.len() && fold.len().is_multiple_of(8));
    let mut m = _mm256_setzero_ps();
    for c in (0..fold.len()).step_by(8) {
        // SAFETY: c + 8 <= fold.len() <= sums.len() (asserted above).
        m = unsafe { _mm256_fmadd_ps(ldx(fold.as_ptr().add(c)), ldx(sums.as_ptr().add(c)), m) };
    }
    match K {
        K_Q4_0 => acc_sum - 8.0 * hsum(m),
        K_Q6K => acc_sum - 32.0 * hsum(m),
        _ => acc_sum - hsum(m),
    }
}

/// The operands of one tile pass over the fold slots `fs`.
struct Tile<'a, 'b> {
    /// `[GEMM_ROWS, cols]` decoded codes.
    panel: &'a [f32],
    /// `[GEMM_ROWS, nsub]` their sub-block scales.
    scales: &'a [f32],
    /// The tile's tokens.
    toks: &'a [Token<'b>],
    cols: usize,
    nsub: usize,
    fs: std::ops::Range<usize>,
}

impl Tile<'_, '_> {
    /// Continues the accumulators of panel rows `i..i + R` and block tokens
    /// `t..t + T` (`acc[row * TILE_TOKENS + token]`) over the fold slots
    /// `fs`: per slot the sub-block's chain, then its fold.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    #[allow(clippy::needless_range_loop)]
    fn run<const K: u8, const R: usize, const T: usize>(
        &self,
        i: usize,
        t: usize,
        acc: &mut [__m256],
    ) {
        let (cols, nsub) = (self.cols, self.nsub);
        let sb = sub_elems(K);
        assert!((i + R) * cols <= self.panel.len() && (i + R) * nsub <= self.scales.len());
        assert!(self.toks.len() == T && self.fs.end <= nsub && nsub * sb == cols);
        assert!((i + R - 1) * TILE_TOKENS + t + T <= acc.len());
        for k in 0..T {
            assert!(self.toks[k].x.len() >= cols);
        }
        let pp: [*const f32; R] = std::array::from_fn(|r| self.panel[(i + r) * cols..].as_ptr());
        let xp: [*const f32; T] = std::array::from_fn(|k| self.toks[k].x.as_ptr());
        let mut a = [[_mm256_setzero_ps(); T]; R];
        for r in 0..R {
            for k in 0..T {
                a[r][k] = acc[(i + r) * TILE_TOKENS + t + k];
            }
        }
        for f in self.fs.clone() {
            // Sub-blocks of a `Q6_K` super-block fold out of order, but
            // `fs` covers whole super-blocks, so `sub < fs.end` too.
            let sub = folded_sub::<K>(f);
            let off = sub * sb;
            let mut ch = [[_mm256_setzero_ps(); T]; R];
            for s in 0..sb / 8 {
                // SAFETY: off + 8s + 8 <= (sub + 1) * sb <= cols, inside
                // every panel row and input (asserted above).
                unsafe {
                    let mut p = [_mm256_setzero_ps(); R];
                    for r in 0..R {
                        p[r] = ldx(pp[r].add(off + 8 * s));
                    }
                    for k in 0..T {
                        let x = ldx(xp[k].add(off + 8 * s));
                        for r in 0..R {
                            ch[r][k] = if s == 0 {
                                _mm256_mul_ps(p[r], x)
                            } else {
                                _mm256_fmadd_ps(p[r], x, ch[r][k])
                            };
                        }
                    }
                }
            }
            for r in 0..R {
                // SAFETY: sub < nsub and (i + R) * nsub <= scales.len()
                // (asserted above).
                let s = _mm256_set1_ps(unsafe { *self.scales.as_ptr().add((i + r) * nsub + sub) });
                for k in 0..T {
                    a[r][k] = _mm256_fmadd_ps(s, ch[r][k], a[r][k]);
                }
            }
        }
        for r in 0..R {
            for k in 0..T {
                acc[(i + r) * TILE_TOKENS + t + k] = a[r][k];
            }
        }
    }
}

/// Decodes one row (`b`, its block bytes) of kind `K` into `codes`
/// (`[cols]`, raw codes as f32 in element order), `scales` (`[cols / sub]`)
/// and `folds` (`[fold_len]`, zero-padded), with the matvec kernel's values.
#[target_feature(enable = "avx2,fma,f16c")]
fn decode_row<const K: u8>(b: &[u8], codes: &mut [f32], scales: &mut [f32], folds: &mut [f32]) {
    let (be, bb) = block_size(K);
    let cols = codes.len();
    let nb = cols / be;
    assert!(b.len() >= nb * bb && scales.len() * sub_elems(K) == cols);
    assert_eq!(folds.len(), fold_len(K, cols));
    folds.fill(0.0);
    let m4 = _mm256_set1_epi32(0x0F);
    let cp = codes.as_mut_ptr();
    for i in 0..nb {
        let blk = &b[i * bb..(i + 1) * bb];
        let bp = blk.as_ptr();
        let base = i * be;
        // SAFETY (every store below): element offsets stay inside block i,
        // base + be <= cols = codes.len(); every load stays inside `blk`
        // (offsets from the block layout, as in `avx2::kernel`).
        unsafe {
            match K {
                K_Q4_0 | K_Q8_0 => {
                    let d = f16(blk, 0);
                    scales[i] = d;
                    if K == K_Q4_0 {
                        folds[i] = d;
                        let v0 = zx8(bp.add(2));
                        let v1 = zx8(bp.add(10));
                        _mm256_storeu_ps(cp.add(base), cvt(_mm256_and_si256(v0, m4)));
                        _mm256_storeu_ps(cp.add(base + 8), cvt(_mm256_and_si256(v1, m4)));
                        _mm256_storeu_ps(cp.add(base + 16), cvt(_mm256_srli_epi32::<4>(v0)));
                        _mm256_storeu_ps(cp.add(base + 24), cvt(_mm256_srli_epi32::<4>(v1)));
                    } else {
                        for k in 0..4 {
                            _mm256_storeu_ps(cp.add(base + 8 * k), cvt(sx8(bp.add(2 + 8 * k))));
                        }
                    }
                }
                K_Q4K | K_Q5K => {
                    let five = K == K_Q5K;
                    let qs_off = if five { 48 } else { 16 };
                    let bit4 = _mm256_set1_epi32(0x10);
                    let (d, dmin) = (f16(blk, 0), f16(blk, 2));
                    let (sc, m) = scale_min_k4(&blk[4..16]);
                    for j in 0..8 {
                        scales[8 * i + j] = d * sc[j] as f32;
                        folds[8 * i + j] = dmin * m[j] as f32;
                    }
                    for p in 0..4 {
                        let sh = _mm_cvtsi32_si128(2 * p as i32);
                        for k in 0..4 {
                            let v = zx8(bp.add(qs_off + 32 * p + 8 * k));
                            let (mut lo, mut hi) =
                                (_mm256_and_si256(v, m4), _mm256_srli_epi32::<4>(v));
                            if five {
                                let h = _mm256_srl_epi32(zx8(bp.add(16 + 8 * k)), sh);
                                lo = _mm256_or_si256(
                                    lo,
                                    _mm256_and_si256(_mm256_slli_epi32::<4>(h), bit4),
                                );
                                hi = _mm256_or_si256(
                                    hi,
                                    _mm256_and_si256(_mm256_slli_epi32::<3>(h), bit4),
                                );
                            }
                            let e = base + 64 * p + 8 * k;
                            _mm256_storeu_ps(cp.add(e), cvt(lo));
                            _mm256_storeu_ps(cp.add(e + 32), cvt(hi));
                        }
                    }
                }
                _ => {
                    // Q6_K.
                    let m30 = _mm256_set1_epi32(0x30);
                    let d = f16(blk, 208);
                    for k in 0..16 {
                        let s = d * (blk[192 + k] as i8) as f32;
                        scales[16 * i + k] = s;
                        folds[16 * i + k] = s;
                    }
                    for h in 0..2 {
                        for pair in 0..2 {
                            for k in 0..4 {
                                let a = zx8(bp.add(64 * h + 32 * pair + 8 * k));
                                let c = zx8(bp.add(128 + 32 * h + 8 * k));
                                let (clo, chi) = if pair == 0 {
                                    (_mm256_slli_epi32::<4>(c), c)
                                } else {
                                    (_mm256_slli_epi32::<2>(c), _mm256_srli_epi32::<2>(c))
                                };
                                let lo = _mm256_or_si256(
                                    _mm256_and_si256(a, m4),
                                    _mm256_and_si256(clo, m30),
                                );
                                let hi = _mm256_or_si256(
                                    _mm256_srli_epi32::<4>(a),
                                    _mm256_and_si256(chi, m30),
                                );
                                let e = base + 128 * h + 32 * pair + 8 * k;
                                _mm256_storeu_ps(cp.add(e), cvt(lo));
                                _mm256_storeu_ps(cp.add(e + 64), cvt(hi));
                            }
                        }
                    }
                }
            }
        }
    }
}
