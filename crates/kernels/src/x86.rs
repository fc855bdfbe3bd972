//! x86-64 pieces both vector widths use ([`crate::avx2`] and
//! [`crate::avx512`]): the row/token blocking, the 4-bit affine row walk,
//! fixed-order horizontal sums, scale and bias loads, the GEMM path's panel
//! decoding and its sizes. Everything here needs AVX2 + FMA + F16C, which
//! both instruction sets include; the AVX-512 kernels call it from code
//! compiled with a superset of these features.

use std::arch::x86_64::*;

use crate::scalar::AffineRow;

/// Tokens per block of a batch (a multiple of 4): 32 inputs of 2048 f32 are
/// 256 KiB.
pub(crate) const TOKEN_BLOCK: usize = 32;

/// How a row range is blocked: with 4+ tokens one row at a time for 4 tokens
/// at a time (weights decoded once per 4 tokens), otherwise `$rb` rows at a
/// time per token (independent chains in flight). Leftovers go one by one.
macro_rules! block_loop {
    ($rb:literal, $r0:expr, $r1:expr, $toks:expr, $out:expr, |$rows:ident, $tk:ident| $call:expr) => {{
        let ntok = $toks.len();
        if ntok >= 4 {
            // Blocks of TOKEN_BLOCK tokens outermost, so their inputs stay in
            // L2 while every row of the range passes over them.
            for tb in (0..ntok).step_by($crate::x86::TOKEN_BLOCK) {
                let te = (tb + $crate::x86::TOKEN_BLOCK).min(ntok);
                for r in $r0..$r1 {
                    let o = &mut $out[(r - $r0) * ntok..(r - $r0 + 1) * ntok];
                    let mut t = tb;
                    while t + 4 <= te {
                        let $rows = [r];
                        let $tk = [&$toks[t], &$toks[t + 1], &$toks[t + 2], &$toks[t + 3]];
                        let res: [[f32; 4]; 1] = $call;
                        o[t..t + 4].copy_from_slice(&res[0]);
                        t += 4;
                    }
                    while t < te {
                        let $rows = [r];
                        let $tk = [&$toks[t]];
                        let res: [[f32; 1]; 1] = $call;
                        o[t] = res[0][0];
                        t += 1;
                    }
                }
            }
        } else {
            for t in 0..ntok {
                let mut r = $r0;
                while r + $rb <= $r1 {
                    let $rows = std::array::from_fn::<usize, $rb, _>(|i| r + i);
                    let $tk = [&$toks[t]];
                    let res: [[f32; 1]; $rb] = $call;
                    for (i, v) in res.iter().enumerate() {
                        $out[(r - $r0 + i) * ntok + t] = v[0];
                    }
                    r += $rb;
                }
                while r < $r1 {
                    let $rows = [r];
                    let $tk = [&$toks[t]];
                    let res: [[f32; 1]; 1] = $call;
                    $out[(r - $r0) * ntok + t] = res[0][0];
                    r += 1;
                }
            }
        }
    }};
}
pub(crate) use block_loop;

/// Fixed-order horizontal sum of 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Eight f32 at `p` (unaligned).
///
/// # Safety
/// `p` must be valid for reading 32 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn ld_f32(p: *const f32) -> __m256 {
    // SAFETY: the caller guarantees 32 readable bytes; loadu has no alignment
    // requirement.
    unsafe { _mm256_loadu_ps(p) }
}

/// Eight little-endian 16-bit values at `p` (unaligned) widened to f32:
/// f16 (exact conversion) or bf16.
///
/// # Safety
/// `p` must be valid for reading 16 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn ld_half8(p: *const u8, bf16: bool) -> __m256 {
    // SAFETY: the caller guarantees 16 readable bytes; loadu has no alignment
    // requirement.
    let h = unsafe { _mm_loadu_si128(p.cast()) };
    if bf16 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    } else {
        _mm256_cvtph_ps(h)
    }
}

/// The few-token (decode) form of `q4_rows` in both widths: one row at a
/// time per token, so the weights stream in address order (interleaving
/// rows halves what DRAM delivers per core). `$row(r)` gives row `r`'s
/// `AffineRow`; the calling module's `q4_row` computes each element.
macro_rules! q4_rows_one_by_one {
    ($r0:expr, $r1:expr, $toks:expr, $out:expr, $row:expr, $bf16:expr, $group:expr, $cols:expr) => {{
        let ntok = $toks.len();
        for (t, tok) in $toks.iter().enumerate() {
            for r in $r0..$r1 {
                $out[(r - $r0) * ntok + t] =
                    q4_row(&$row(r), &tok.xp, &tok.gsum, $bf16, $group, $cols);
            }
        }
    }};
}
pub(crate) use q4_rows_one_by_one;

/// The group walk of `q4_row` in both widths: the groups of one row,
/// [`ROW_GROUPS`] at a time (the calling module's `q4_chains`), then one at
/// a time, handing each group's scale and chains to `$fold` in group order.
/// Checks the row's and the input's lengths first.
macro_rules! q4_group_walk {
    ($row:expr, $x:expr, $gsum:expr, $bf16:expr, $group:expr, $cols:expr, |$s:ident, $ch:ident| $fold:block) => {{
        let (row, x, group) = ($row, $x, $group);
        let ng = $cols / group;
        let gbytes = group / 2;
        assert!(row.codes.len() >= ng * gbytes && row.scales.len() >= ng * 2);
        assert!(x.len() >= $cols && $gsum.len() >= ng.next_multiple_of(8));
        let mut gb = 0;
        while gb < ng {
            let sc = $crate::x86::scales8(row.scales, gb, ng, $bf16);
            let n = (ng - gb).min(8);
            let mut gi = 0;
            while gi < n {
                let g = gb + gi;
                let q = (n - gi).min($crate::x86::ROW_GROUPS);
                // SAFETY: groups g..g + q < ng lie inside the codes and
                // inputs (lengths asserted above).
                unsafe {
                    let cp = row.codes.as_ptr().add(g * gbytes);
                    let xp = x.as_ptr().add(g * group);
                    // The hardware prefetcher alone leaves one core at
                    // about 60 % of its DRAM read rate on this stream.
                    let mut o = 0;
                    while o < q * gbytes {
                        _mm_prefetch::<_MM_HINT_T0>(
                            cp.wrapping_add($crate::x86::ROW_PREFETCH_BYTES + o).cast(),
                        );
                        o += 64;
                    }
                    if q == $crate::x86::ROW_GROUPS {
                        let chains = q4_chains::<{ $crate::x86::ROW_GROUPS }>(cp, xp, group);
                        for (j, c) in chains.into_iter().enumerate() {
                            let ($s, $ch) = (sc[gi + j], c);
                            $fold
                        }
                    } else {
                        for j in 0..q {
                            let [c] = q4_chains::<1>(cp.add(j * gbytes), xp.add(j * group), group);
                            let ($s, $ch) = (sc[gi + j], c);
                            $fold
                        }
                    }
                }
                gi += q;
            }
            gb += 8;
        }
    }};
}
pub(crate) use q4_group_walk;

/// How far ahead of the codes `q4_row` reads it asks for them (bytes;
/// prefetches never fault, so running past a matrix's end is harmless).
/// Measured on the 4-layer 35B cut's decode: 512 -> 31.0 ms per token,
/// 1024 -> 28.6, 2048 -> 28.4, 4096 -> 29.3, none -> 42.6.
pub(crate) const ROW_PREFETCH_BYTES: usize = 2048;

/// Groups of one row in flight at a time in `q4_row`.
pub(crate) const ROW_GROUPS: usize = 4;

/// The bias term of an affine row, `sum_g bias[g] * gsum[g]`: an 8-lane FMA
/// chain over blocks of 8 groups, then a fixed horizontal sum. `gsum` holds
/// at least `ng` rounded up to 8 entries (zero-padded).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn bias_term(biases: &[u8], gsum: &[f32], ng: usize, bf16: bool) -> f32 {
    let mut bv = _mm256_setzero_ps();
    let mut g = 0;
    while g < ng {
        let b = params8(biases, g, ng, bf16);
        let gs = &gsum[g..g + 8];
        // SAFETY: `gs` is 8 valid f32.
        bv = _mm256_fmadd_ps(b, unsafe { ld_f32(gs.as_ptr()) }, bv);
        g += 8;
    }
    hsum(bv)
}

/// Scales (or biases) of groups `g..g + 8` as f32, zero past `ng` groups.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn params8(p: &[u8], g: usize, ng: usize, bf16: bool) -> __m256 {
    let mut buf = [0u8; 16];
    let src = if g + 8 <= ng {
        &p[g * 2..g * 2 + 16]
    } else {
        buf[..(ng - g) * 2].copy_from_slice(&p[g * 2..ng * 2]);
        &buf[..]
    };
    // SAFETY: `src` is 16 valid bytes.
    unsafe { ld_half8(src.as_ptr(), bf16) }
}

/// Tokens from which 4-bit products take the GEMM path (`q4_gemm_rows` of both widths).
pub(crate) const GEMM_MIN_TOKENS: usize = 8;

/// Rows decoded at a time by the GEMM path: 32 rows of 2048 columns are a
/// 256 KiB f32 panel (L2), decoded once for all tokens.
pub(crate) const GEMM_ROWS: usize = 32;

/// Columns per block of the GEMM path (rounded to whole groups).
pub(crate) const GEMM_COLS: usize = 512;

/// Decodes one 4-bit row into `panel` (`[cols]` f32: per 16 elements the 8
/// low nibbles then the 8 high nibbles times 16, as `avx2::q4_block` widens
/// them) and its scales into `scales` (`[ng]`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn decode_q4_panel(
    row: &AffineRow,
    bf16: bool,
    ng: usize,
    panel: &mut [f32],
    scales: &mut [f32],
) {
    let m_lo = _mm256_set1_epi32(0x0F);
    let m_hi = _mm256_set1_epi32(0xF0);
    assert!(row.codes.len() >= panel.len() / 2 && scales.len() == ng);
    for (k, dst) in panel.chunks_exact_mut(16).enumerate() {
        // SAFETY: chunk k reads code bytes k*8..k*8+8 < panel.len()/2 <=
        // codes.len() (asserted), and writes 16 f32 into `dst`.
        unsafe {
            let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.codes.as_ptr().add(k * 8).cast()));
            _mm256_storeu_ps(
                dst.as_mut_ptr(),
                _mm256_cvtepi32_ps(_mm256_and_si256(v, m_lo)),
            );
            let hi = _mm256_cvtepi32_ps(_mm256_and_si256(v, m_hi));
            _mm256_storeu_ps(dst.as_mut_ptr().add(8), hi);
        }
    }
    for gb in (0..ng).step_by(8) {
        let sc = scales8(row.scales, gb, ng, bf16);
        let n = (ng - gb).min(8);
        scales[gb..gb + n].copy_from_slice(&sc[..n]);
    }
}

/// Scales of groups `g..g + 8` of one row as f32 (zero past `ng`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn scales8(p: &[u8], g: usize, ng: usize, bf16: bool) -> [f32; 8] {
    let mut o = [0f32; 8];
    // SAFETY: `o` is 8 writable f32.
    unsafe { _mm256_storeu_ps(o.as_mut_ptr(), params8(p, g, ng, bf16)) };
    o
}

/// The end of a 4-bit split product's weight term: `hsum(acc0 + acc1)`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn q4_finish(acc0: __m256, acc1: __m256) -> f32 {
    hsum(_mm256_add_ps(acc0, acc1))
}
