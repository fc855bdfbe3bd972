//! AVX-512 (F + VL) form of the 4-bit affine GEMM path, used in place of
//! [`crate::avx2`]'s when the CPU has it: bit-identical results, fewer
//! instructions.
//!
//! The AVX2 path keeps, per (row, token) and group, two 8-lane FMA chains:
//! `a0` over the panel's low-nibble vectors times the input's even elements,
//! `a1` over the high-nibble vectors times the odd ones. The panel stores each
//! 16 elements as those 8 low then 8 high values and [`crate::Token::xp`]
//! stores the inputs in the same order, so one 16-lane FMA over 16 panel
//! values and 16 inputs computes both chains at once: lanes 0-7 are `a0`,
//! lanes 8-15 are `a1`, each lane the same sequence of fused multiply-adds.
//! The group's end then does what the AVX2 path does: `a0 + a1` in 8 lanes
//! and `acc = fma(scale, a0 + a1, acc)`. With 32 vector registers a tile is
//! 4 rows x 3 tokens (12 chains plus 12 accumulators).

use std::arch::x86_64::*;

use crate::avx2::{bias_term, decode_q4_panel, hsum, GEMM_COLS, GEMM_ROWS};
use crate::scalar::AffineRow;
use crate::Token;
use slipstream_core::TensorView;

/// Rows per tile.
const TILE_ROWS: usize = 4;
/// Tokens per tile.
const TILE_TOKENS: usize = 3;
/// Tokens per block: with [`GEMM_COLS`] columns their inputs (12 x 512 f32 =
/// 24 KiB) stay in L1 while every row quad passes over them.
const BLOCK_TOKENS: usize = 4 * TILE_TOKENS;

/// Whether this CPU runs [`q4_gemm_rows`] (AVX-512 F and VL on top of AVX2,
/// FMA and F16C).
pub(crate) fn supported() -> bool {
    crate::Isa::Avx2.is_supported()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512vl")
}

/// Same contract and results as `avx2::q4_gemm_rows`: rows `r0..r1` of a
/// 4-bit affine `w` (group a multiple of 16) for all `toks` into `out`
/// (`[r1 - r0, toks.len()]`).
///
/// # Safety
/// The CPU must support the features [`supported`] checks.
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
    let mut acc = vec![_mm256_setzero_ps(); GEMM_ROWS * BLOCK_TOKENS];
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
            acc.fill(_mm256_setzero_ps());
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
                        if ri == TILE_ROWS {
                            match ti {
                                3 => tile.run::<4, 3>(i, t, &mut acc),
                                2 => tile.run::<4, 2>(i, t, &mut acc),
                                _ => tile.run::<4, 1>(i, t, &mut acc),
                            }
                        } else {
                            for k in i..i + ri {
                                match ti {
                                    3 => tile.run::<1, 3>(k, t, &mut acc),
                                    2 => tile.run::<1, 2>(k, t, &mut acc),
                                    _ => tile.run::<1, 1>(k, t, &mut acc),
                                }
                            }
                        }
                    }
                }
            }
            for i in 0..nr {
                let biases = row(rc + i).biases;
                for t in 0..nt {
                    let bias = bias_term(biases, &toks[tb + t].gsum, ng, bf16);
                    out[(rc + i - r0) * ntok + tb + t] = hsum(acc[i * BLOCK_TOKENS + t]) + bias;
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
    /// Continues the accumulators of panel rows `i..i + R` and block tokens
    /// `t..t + T` (`acc[row * BLOCK_TOKENS + token]`) over the groups `gs`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    #[inline]
    #[allow(clippy::needless_range_loop)]
    fn run<const R: usize, const T: usize>(&self, i: usize, t: usize, acc: &mut [__m256]) {
        let (cols, ng) = (self.cols, self.ng);
        let end = self.gs.end * self.group;
        assert!((i + R) * cols <= self.panel.len() && (i + R) * ng <= self.scales.len());
        assert!(self.toks.len() == T && end <= cols);
        assert!((i + R - 1) * BLOCK_TOKENS + t + T <= acc.len());
        let panels: [&[f32]; R] = std::array::from_fn(|r| &self.panel[(i + r) * cols..][..cols]);
        let xs: [&[f32]; T] = std::array::from_fn(|k| &self.toks[k].xp[..cols]);
        let mut a: [[__m256; T]; R] =
            std::array::from_fn(|r| std::array::from_fn(|k| acc[(i + r) * BLOCK_TOKENS + t + k]));
        let steps = self.group / 16;
        for g in self.gs.clone() {
            let mut ch = [[_mm512_setzero_ps(); T]; R];
            for k in 0..steps {
                let off = (g * steps + k) * 16;
                // SAFETY: off + 16 <= end <= cols, the length of every panel
                // row and input slice (asserted above).
                unsafe {
                    let p: [__m512; R] =
                        std::array::from_fn(|r| _mm512_loadu_ps(panels[r].as_ptr().add(off)));
                    for j in 0..T {
                        let x = _mm512_loadu_ps(xs[j].as_ptr().add(off));
                        for r in 0..R {
                            ch[r][j] = _mm512_fmadd_ps(p[r], x, ch[r][j]);
                        }
                    }
                }
            }
            for r in 0..R {
                let s = _mm256_set1_ps(self.scales[(i + r) * ng + g]);
                for j in 0..T {
                    let lo = _mm512_castps512_ps256(ch[r][j]);
                    let hi =
                        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(ch[r][j])));
                    a[r][j] = _mm256_fmadd_ps(s, _mm256_add_ps(lo, hi), a[r][j]);
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
