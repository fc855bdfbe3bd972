//! AVX-512 (F + VL) forms of the 4-bit affine products (the GEMM path and
//! the matrix-vector blocks), the kernels of [`crate::Isa::Avx512`] for the
//! layouts [`handles`] accepts (every other layout runs [`crate::avx2`]'s
//! kernels): bit-identical results to the AVX2 forms, fewer instructions.
//!
//! The AVX2 path keeps, per (row, token) and group, two 8-lane FMA chains:
//! `a0` over the panel's low-nibble vectors times the input's even elements,
//! `a1` over the high-nibble vectors times the odd ones. The panel stores each
//! 16 elements as those 8 low then 8 high values and [`crate::Token::xp`]
//! stores the inputs in the same order, so one 16-lane FMA over 16 panel
//! values and 16 inputs computes both chains at once: lanes 0-7 are `a0`,
//! lanes 8-15 are `a1`, each lane the same sequence of fused multiply-adds.
//! The group's end folds both chains into their accumulators, `acc0` in
//! lanes 0-7 and `acc1` in lanes 8-15, with one 16-lane FMA by the
//! broadcast scale, as the AVX2 path's two 8-lane FMAs do; the end of the
//! row adds the halves and sums horizontally (`avx2::q4_finish`). With 32
//! vector registers a tile is 4 rows x 3 tokens (12 chains plus 12
//! accumulators).
//!
//! The matrix-vector blocks ([`q4_rows`], decode) decode 8 code bytes per
//! row and step straight into that order: the bytes duplicated into both
//! halves of a 128-bit register, widened to 16 dwords and masked with 0x0F
//! (lanes 0-7) and 0xF0 (lanes 8-15), so one widening, one mask, one
//! conversion and one FMA replace the AVX2 path's one, two, two and two.

use std::arch::x86_64::*;

use crate::scalar::AffineRow;
use crate::x86::{
    bias_term, block_loop, decode_q4_panel, q4_finish, q4_group_walk, q4_rows_one_by_one, scales8,
    GEMM_COLS, GEMM_MIN_TOKENS, GEMM_ROWS,
};
use crate::Token;
use slipstream_core::{QuantType, ScaleType, TensorView};

/// Rows per tile.
const TILE_ROWS: usize = 4;
/// Tokens per tile.
const TILE_TOKENS: usize = 3;
/// Tokens per block: with [`GEMM_COLS`] columns their inputs (12 x 512 f32 =
/// 24 KiB) stay in L1 while every row quad passes over them.
const BLOCK_TOKENS: usize = 4 * TILE_TOKENS;

/// Whether the AVX-512 forms cover products of `qtype`: 4-bit affine weights
/// with groups of a multiple of 16.
pub(crate) fn handles(qtype: QuantType) -> bool {
    matches!(qtype, QuantType::Affine { bits: 4, group, .. } if group.is_multiple_of(16))
}

/// Rows `r0..r1` of `w` (a layout [`handles`] accepts) for all tokens into
/// `out` (`[r1 - r0, toks.len()]`): the GEMM path from
/// [`GEMM_MIN_TOKENS`] tokens, the matrix-vector blocks below. Panics if the
/// CPU lacks AVX-512 F + VL, AVX2, FMA or F16C.
pub(crate) fn rows(w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    assert!(crate::Isa::Avx512.is_supported(), "CPU lacks AVX-512 F/VL");
    let QuantType::Affine {
        bits: 4,
        group,
        scale,
    } = w.qtype
    else {
        panic!("no AVX-512 form for {}", w.qtype.name())
    };
    let (group, bf16) = (group as usize, scale == ScaleType::Bf16);
    assert!(
        group.is_multiple_of(16),
        "no AVX-512 form for group {group}"
    );
    assert!(r0 <= r1 && r1 <= w.rows);
    assert_eq!(out.len(), (r1 - r0) * toks.len());
    // SAFETY: the CPU supports the features both kernels need (checked
    // above).
    unsafe {
        if toks.len() >= GEMM_MIN_TOKENS {
            q4_gemm_rows(w, r0, r1, toks, out, bf16, group)
        } else {
            q4_rows(w, r0, r1, toks, out, bf16, group)
        }
    }
}

/// Same contract and results as `avx2::q4_gemm_rows`: rows `r0..r1` of a
/// 4-bit affine `w` (group a multiple of 16) for all `toks` into `out`
/// (`[r1 - r0, toks.len()]`).
///
/// # Safety
/// The CPU must support [`crate::Isa::Avx512`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub(crate) unsafe fn q4_gemm_rows(
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
    assert!(group.is_multiple_of(16) && cols.is_multiple_of(group));
    assert!(r0 <= r1 && r1 <= w.rows && out.len() == (r1 - r0) * ntok);
    let (c, s, b) = w.affine_parts();
    let row = |r: usize| AffineRow::from_parts(c, s, b, cols, 4, group, r);
    for t in toks {
        assert!(t.xp.len() >= cols && t.gsum.len() >= ng.next_multiple_of(8));
    }
    let kg = (GEMM_COLS / group).max(1);
    // 64-byte aligned so no 16-lane panel load splits a cache line.
    let mut panel_buf = vec![_mm512_setzero_ps(); GEMM_ROWS * cols / 16];
    // SAFETY: `panel_buf` holds GEMM_ROWS * cols / 16 vectors of 16 f32
    // (`cols` is a multiple of 16), all initialized; the slice borrows it
    // exclusively for this function.
    let panel: &mut [f32] = unsafe {
        std::slice::from_raw_parts_mut(panel_buf.as_mut_ptr().cast::<f32>(), GEMM_ROWS * cols)
    };
    let mut scales = vec![0f32; GEMM_ROWS * ng];
    let mut acc = vec![_mm512_setzero_ps(); GEMM_ROWS * BLOCK_TOKENS];
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
        for tb in (0..ntok).step_by(BLOCK_TOKENS) {
            let nt = (ntok - tb).min(BLOCK_TOKENS);
            acc.fill(_mm512_setzero_ps());
            for g0 in (0..ng).step_by(kg) {
                let gs = g0..(g0 + kg).min(ng);
                for i in (0..nr).step_by(TILE_ROWS) {
                    let ri = (nr - i).min(TILE_ROWS);
                    for t in (0..nt).step_by(TILE_TOKENS) {
                        let ti = (nt - t).min(TILE_TOKENS);
                        let tile = Tile {
                            panel,
                            scales: &scales,
                            toks: &toks[tb + t..tb + t + ti],
                            cols,
                            ng,
                            group,
                            gs: gs.clone(),
                        };
                        if group == 64 {
                            tile.run_all::<4>(i, t, ri, ti, &mut acc);
                        } else {
                            tile.run_all::<0>(i, t, ri, ti, &mut acc);
                        }
                    }
                }
            }
            for i in 0..nr {
                let biases = row(rc + i).biases;
                for t in 0..nt {
                    let bias = bias_term(biases, &toks[tb + t].gsum, ng, bf16);
                    out[(rc + i - r0) * ntok + tb + t] = finish(acc[i * BLOCK_TOKENS + t]) + bias;
                }
            }
        }
    }
}

/// The operands of one tile pass over the groups `gs`.
struct Tile<'a, 'b> {
    /// `[GEMM_ROWS, cols]` decoded rows.
    panel: &'a [f32],
    /// `[GEMM_ROWS, ng]` their scales.
    scales: &'a [f32],
    /// The tile's tokens (`T` of them).
    toks: &'a [Token<'b>],
    cols: usize,
    ng: usize,
    group: usize,
    gs: std::ops::Range<usize>,
}

impl Tile<'_, '_> {
    /// The tile at panel rows `i..i + ri`, block tokens `t..t + ti` (at most
    /// [`TILE_ROWS`] x [`TILE_TOKENS`]), with `S` steps per group (0: from
    /// `group`).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    #[inline]
    fn run_all<const S: usize>(
        &self,
        i: usize,
        t: usize,
        ri: usize,
        ti: usize,
        acc: &mut [__m512],
    ) {
        if ri == TILE_ROWS {
            match ti {
                3 => self.run::<4, 3, S>(i, t, acc),
                2 => self.run::<4, 2, S>(i, t, acc),
                _ => self.run::<4, 1, S>(i, t, acc),
            }
        } else {
            for k in i..i + ri {
                match ti {
                    3 => self.run::<1, 3, S>(k, t, acc),
                    2 => self.run::<1, 2, S>(k, t, acc),
                    _ => self.run::<1, 1, S>(k, t, acc),
                }
            }
        }
    }

    /// Continues the accumulators of panel rows `i..i + R` and block tokens
    /// `t..t + T` (`acc[row * BLOCK_TOKENS + token]`) over the groups `gs`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    #[inline]
    #[allow(clippy::needless_range_loop)]
    fn run<const R: usize, const T: usize, const S: usize>(
        &self,
        i: usize,
        t: usize,
        acc: &mut [__m512],
    ) {
        let (cols, ng) = (self.cols, self.ng);
        let end = self.gs.end * self.group;
        assert!((i + R) * cols <= self.panel.len() && (i + R) * ng <= self.scales.len());
        assert!(self.toks.len() == T && end <= cols && self.gs.end <= ng);
        assert!(S == 0 || S * 16 == self.group);
        assert!((i + R - 1) * BLOCK_TOKENS + t + T <= acc.len());
        let mut panels: [&[f32]; R] = [&[]; R];
        for r in 0..R {
            panels[r] = &self.panel[(i + r) * cols..][..cols];
        }
        let mut xs: [&[f32]; T] = [&[]; T];
        for k in 0..T {
            xs[k] = &self.toks[k].xp[..cols];
        }
        let mut a = [[_mm512_setzero_ps(); T]; R];
        for r in 0..R {
            for k in 0..T {
                a[r][k] = acc[(i + r) * BLOCK_TOKENS + t + k];
            }
        }
        // S > 0: the group's steps known at compile time, so the step loop
        // unrolls and the per-group overhead shrinks.
        let steps = if S > 0 { S } else { self.group / 16 };
        for g in self.gs.clone() {
            let mut ch = [[_mm512_setzero_ps(); T]; R];
            for k in 0..steps {
                let off = (g * steps + k) * 16;
                // SAFETY: off + 16 <= end <= cols, the length of every panel
                // row and input slice (asserted above).
                unsafe {
                    // A loop, not `array::from_fn`: its closure is a call
                    // compiled without AVX-512 when not inlined.
                    let mut p = [_mm512_setzero_ps(); R];
                    for r in 0..R {
                        p[r] = _mm512_loadu_ps(panels[r].as_ptr().add(off));
                    }
                    for j in 0..T {
                        let x = _mm512_loadu_ps(xs[j].as_ptr().add(off));
                        for r in 0..R {
                            ch[r][j] = _mm512_fmadd_ps(p[r], x, ch[r][j]);
                        }
                    }
                }
            }
            for r in 0..R {
                // SAFETY: g < gs.end <= ng and (i + R) * ng <= scales.len()
                // (asserted above).
                let s = _mm512_set1_ps(unsafe { *self.scales.as_ptr().add((i + r) * ng + g) });
                for j in 0..T {
                    a[r][j] = _mm512_fmadd_ps(s, ch[r][j], a[r][j]);
                }
            }
        }
        for r in 0..R {
            for k in 0..T {
                acc[(i + r) * BLOCK_TOKENS + t + k] = a[r][k];
            }
        }
    }
}

/// Same contract and results as the AVX2 matrix-vector blocks of 4-bit
/// rows: rows `r0..r1` of a 4-bit affine `w` (group a multiple of 16) for
/// `toks` (fewer than the GEMM path's minimum) into `out`
/// (`[r1 - r0, toks.len()]`). With one combined chain per (row, token)
/// instead of two, 8 rows per block keep 8 FMA chains in flight.
///
/// # Safety
/// The CPU must support [`crate::Isa::Avx512`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub(crate) unsafe fn q4_rows(
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
        block_loop!(8, r0, r1, toks, out, |rs, tk| q4_block::<_, _>(
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
/// several rows': the same per-group chains, folded into the accumulator in
/// group order, so the bits are [`q4_block`]'s.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
#[inline]
fn q4_row(row: &AffineRow, x: &[f32], gsum: &[f32], bf16: bool, group: usize, cols: usize) -> f32 {
    let mut acc = _mm512_setzero_ps();
    q4_group_walk!(row, x, gsum, bf16, group, cols, |s, ch| {
        acc = _mm512_fmadd_ps(_mm512_set1_ps(s), ch, acc);
    });
    finish(acc) + bias_term(row.biases, gsum, cols / group, bf16)
}

/// The 16-lane chains of `Q` consecutive groups (see [`q4_block`]), steps
/// interleaved across the groups.
///
/// # Safety
/// `cp` must be valid for `Q * group / 2` code bytes and `xp` for
/// `Q * group` split inputs.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
#[inline]
unsafe fn q4_chains<const Q: usize>(cp: *const u8, xp: *const f32, group: usize) -> [__m512; Q] {
    let mask = _mm512_setr_epi32(
        0x0F, 0x0F, 0x0F, 0x0F, 0x0F, 0x0F, 0x0F, 0x0F, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0,
        0xF0,
    );
    let gbytes = group / 2;
    let mut ch = [_mm512_setzero_ps(); Q];
    for k in 0..group / 16 {
        for (j, c) in ch.iter_mut().enumerate() {
            // SAFETY: step k of group j reads 8 code bytes and 16 inputs
            // inside the ranges the caller guarantees.
            unsafe {
                let b = _mm_castpd_si128(_mm_loaddup_pd(cp.add(j * gbytes + k * 8).cast()));
                let w = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_cvtepu8_epi32(b), mask));
                let xv = _mm512_loadu_ps(xp.add(j * group + k * 16));
                *c = _mm512_fmadd_ps(w, xv, *c);
            }
        }
    }
    ch
}

/// `avx2::q4_block` with each (row, token)'s two 8-lane chains in one
/// 16-lane register (see the module doc): per group, 16-lane FMAs of the
/// decoded `[low nibbles | 16 x high nibbles]` with the input's 16
/// `Token::xp` values, then `acc = fma(broadcast(scale), chains, acc)` in
/// 16 lanes (`[acc0 | acc1]`), and the same end and bias term.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
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
    let mask = _mm512_setr_epi32(
        0x0F, 0x0F, 0x0F, 0x0F, 0x0F, 0x0F, 0x0F, 0x0F, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0,
        0xF0,
    );
    let mut acc = [[_mm512_setzero_ps(); T]; R];
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
            // Software prefetch of the same group R rows ahead, as in the
            // AVX2 blocks (prefetches never fault).
            for p in cp {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(R * cols / 2).cast());
            }
            let mut ch = [[_mm512_setzero_ps(); T]; R];
            for k in 0..steps {
                for r in 0..R {
                    // SAFETY: k * 8 + 8 <= gbytes bytes remain at cp[r]
                    // (codes length asserted above); `_mm_loaddup_pd` reads
                    // 8 bytes unaligned.
                    let q = unsafe {
                        let b = _mm_castpd_si128(_mm_loaddup_pd(cp[r].add(k * 8).cast()));
                        _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_cvtepu8_epi32(b), mask))
                    };
                    for t in 0..T {
                        // SAFETY: k * 16 + 16 <= group elements remain at
                        // xp[t] (x length asserted above).
                        let x = unsafe { _mm512_loadu_ps(xp[t].add(k * 16)) };
                        ch[r][t] = _mm512_fmadd_ps(q, x, ch[r][t]);
                    }
                }
            }
            for r in 0..R {
                let s = _mm512_set1_ps(sc[r][gi]);
                for t in 0..T {
                    acc[r][t] = _mm512_fmadd_ps(s, ch[r][t], acc[r][t]);
                }
            }
        }
        gb += 8;
    }
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = finish(acc[r][t]) + bias_term(rows[r].biases, xs[t].1, ng, bf16);
        }
    }
    out
}

/// `avx2::q4_finish` of a `[acc0 | acc1]` register.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
#[inline]
fn finish(acc: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(acc);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
    q4_finish(lo, hi)
}
