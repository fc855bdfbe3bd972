//! Softmax attention of the query heads that share one KV head, for one
//! token or a run of consecutive prompt tokens (SIMD by recompilation, as in [`crate::recurrence`]: the AVX2 + FMA
//! build runs the same per-element arithmetic, and `f32::mul_add` is one
//! rounding on every target, so both builds give the same bits).
//!
//! Per (query head, key) the score is an 8-lane fused multiply-add chain over
//! the head dimension, a fixed horizontal sum, the `hd % 8` tail added with
//! `mul_add` in order, then times `scale`; then [`crate::softmax`] (its
//! AVX2 form in the AVX2 build, the same bits); each
//! output element is a `mul_add` chain over the keys in order from zero.
//! Nothing depends on how many tokens or heads a call handles, so prefill
//! chunking and decode agree bit for bit.

use crate::Isa;

/// Keys per score tile.
const KEYS: usize = 2;
/// Output columns per pass of the weighted sum (4 vectors of 8).
const COLS: usize = 32;

/// One KV head's cached keys and values: position `j`'s rows at
/// `k[j * stride..][..hd]` and `v[j * stride..][..hd]` (`stride >= hd`, the
/// layout of a KV cache holding every KV head of a position).
#[derive(Clone, Copy)]
pub struct KvRows<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub stride: usize,
    pub hd: usize,
}

/// Attention of `group` query heads per token for `tokens` consecutive
/// tokens over one KV head, with the kernels of `isa` (the AVX2 + FMA build
/// for [`Isa::Avx2`] and [`Isa::Avx512`], the portable one otherwise; the
/// same bits either way). Token `g` sees the first `first_keys + g`
/// positions (causal prefill; `tokens = 1` is one decode step over
/// `first_keys` keys). Each key block is read from memory once for all the
/// tokens' heads instead of once per token; every output is bit-identical
/// to a call for its token alone. Panics if the CPU lacks `isa`.
///
/// * `q`: `[tokens, group, hd]` (already normed, rotated).
/// * `scale`: multiplies each dot product (usually `1 / sqrt(hd)`).
/// * `scores`: scratch of at least `tokens * group * (first_keys + tokens - 1)`.
/// * `out`: `[tokens, group, hd]`, overwritten (zeros for a token that sees
///   no keys).
#[allow(clippy::too_many_arguments)]
pub fn attend_tokens(
    isa: Isa,
    q: &[f32],
    kv: &KvRows,
    tokens: usize,
    first_keys: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) {
        // SAFETY: both ISAs include AVX2 and FMA, and the CPU supports
        // `isa` (checked above).
        return unsafe { attend_tokens_avx2(q, kv, tokens, first_keys, scale, scores, out) };
    }
    attend_tiles::<false>(q, kv, tokens, first_keys, scale, scores, out)
}

/// [`attend_tiles`] with AVX2 intrinsics, compiled for AVX2 + FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_tokens_avx2(
    q: &[f32],
    kv: &KvRows,
    tokens: usize,
    first_keys: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    attend_tiles::<true>(q, kv, tokens, first_keys, scale, scores, out)
}

/// [`attend_tokens`] with its score and weighted-sum tiles in AVX2
/// intrinsics (`AVX`, only from [`attend_tokens_avx2`]) or portable code:
/// the same lanes and the same fused multiply-adds, so the same bits.
/// Score rows are `keys` (the last token's count) apart in `scores`.
#[inline(always)]
fn attend_tiles<const AVX: bool>(
    q: &[f32],
    kv: &KvRows,
    tokens: usize,
    first_keys: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let KvRows { k, v, stride, hd } = *kv;
    assert!(hd > 0 && stride >= hd && tokens > 0 && q.len().is_multiple_of(tokens * hd));
    let group = q.len() / (tokens * hd);
    assert_eq!(out.len(), q.len(), "out must be [tokens, group, hd]");
    let keys = first_keys + tokens - 1;
    assert!(
        scores.len() >= tokens * group * keys,
        "scores scratch too small"
    );
    // Keys token `g` sees.
    let keys_of = |g: usize| first_keys + g;
    if first_keys == 0 {
        out[..group * hd].fill(0.0);
    }
    if keys == 0 {
        return;
    }
    let last = (keys - 1) * stride + hd;
    assert!(
        k.len() >= last && v.len() >= last,
        "k/v shorter than keys rows"
    );
    let scores = &mut scores[..tokens * group * keys];
    // One token's query heads, scores and outputs.
    let tq = |g: usize| &q[g * group * hd..][..group * hd];

    // Scores: tiles of up to HEADS query heads x KEYS keys, so each load of
    // a query chunk serves KEYS keys and each key chunk HEADS heads (every
    // K row is read once per tile row of heads, not once per head).
    // Whether K and V come from memory rather than the caches (more than
    // PREFETCH_ABOVE bytes): then the next key block's rows are prefetched
    // while one is computed (measured: 16384 keys 6.1 -> 4.4 ms; below a few
    // thousand keys the prefetches only cost instructions).
    let from_memory = 2 * keys * hd * 4 > PREFETCH_ABOVE;
    // Blocks of KEY_BLOCK keys outermost, so a block's K rows are read from
    // memory once for all tiles of heads of all tokens.
    for kb in (0..keys).step_by(KEY_BLOCK) {
        if AVX {
            prefetch_rows(
                k,
                stride,
                hd,
                kb + KEY_BLOCK..(kb + 2 * KEY_BLOCK).min(keys),
            );
        }
        for g in 0..tokens {
            let ks = kb..(kb + KEY_BLOCK).min(keys_of(g));
            if ks.is_empty() {
                continue;
            }
            let (qg, sg) = (tq(g), &mut scores[g * group * keys..][..group * keys]);
            let mut h = 0;
            while h < group {
                let nh = (group - h).min(HEADS);
                let ks = ks.clone();
                match nh {
                    4 => score_heads::<4, AVX>(qg, k, stride, keys, ks, hd, scale, h, sg),
                    3 => score_heads::<3, AVX>(qg, k, stride, keys, ks, hd, scale, h, sg),
                    2 => score_heads::<2, AVX>(qg, k, stride, keys, ks, hd, scale, h, sg),
                    _ => score_heads::<1, AVX>(qg, k, stride, keys, ks, hd, scale, h, sg),
                }
                h += nh;
            }
        }
    }
    for (r, sc) in scores.chunks_exact_mut(keys).enumerate() {
        let kg = keys_of(r / group);
        if kg > 0 {
            softmax_row::<AVX>(&mut sc[..kg]);
        }
    }

    // Weighted sum, each output element a chain over the keys in order from
    // zero: blocks of KEY_BLOCK keys outermost (a block's V rows stay in L2
    // while every column tile of every token passes over them, so V is read
    // from memory once), then COLS columns x 2 heads in registers, carried
    // from one key block to the next through `out`.
    let full = hd / COLS * COLS;
    for kb in (0..keys).step_by(KEY_BLOCK) {
        let ke = (kb + KEY_BLOCK).min(keys);
        if AVX && from_memory {
            prefetch_rows(v, stride, hd, ke..(ke + KEY_BLOCK).min(keys));
        }
        for g in 0..tokens {
            let ks = kb..ke.min(keys_of(g));
            if ks.is_empty() {
                continue;
            }
            let sg = &scores[g * group * keys..][..group * keys];
            let og = &mut out[g * group * hd..][..group * hd];
            for c0 in (0..full).step_by(COLS) {
                let mut h = 0;
                while h < group {
                    let ks = ks.clone();
                    if h + 2 <= group {
                        weigh_cols::<2, AVX>(sg, v, stride, keys, hd, ks, c0, h, og);
                        h += 2;
                    } else {
                        weigh_cols::<1, AVX>(sg, v, stride, keys, hd, ks, c0, h, og);
                        h += 1;
                    }
                }
            }
            for (o, p) in og.chunks_exact_mut(hd).zip(sg.chunks_exact(keys)) {
                for c in full..hd {
                    let mut acc = if kb == 0 { 0.0 } else { o[c] };
                    for j in ks.clone() {
                        acc = p[j].mul_add(v[j * stride + c], acc);
                    }
                    o[c] = acc;
                }
            }
        }
    }
}

/// [`crate::softmax::softmax`], in its AVX2 form when `AVX` (same bits).
#[inline(always)]
fn softmax_row<const AVX: bool>(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if AVX {
        // SAFETY: `AVX` is only set by `attend_tokens_avx2`, whose callers
        // checked AVX2 and FMA.
        return unsafe { crate::softmax::softmax_avx2(x) };
    }
    crate::softmax::softmax(x)
}

/// Asks for the rows `js` of `m` (`hd` values each at `stride`) to be
/// brought into the caches while the current key block is computed: long
/// contexts read K and V from DRAM, and rows a head's width apart (the
/// other KV heads sit between them) defeat the hardware prefetcher. A hint
/// only; x86-64 (elsewhere nothing).
#[inline(always)]
fn prefetch_rows(m: &[f32], stride: usize, hd: usize, js: std::ops::Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    for j in js {
        let row = &m[j * stride..][..hd];
        for line in row.chunks(16) {
            // SAFETY: a prefetch of a valid address; it never faults and
            // changes no state a program can observe.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    line.as_ptr().cast(),
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (m, stride, hd, js);
}

/// Bytes of one KV head's keys and values above which [`attend_tokens`]
/// prefetches them (about twice a core's L2).
const PREFETCH_ABOVE: usize = 4 << 20;

/// Query heads per score tile.
const HEADS: usize = 4;
/// Keys per block of the weighted sum: 64 rows of a 256-wide head are 64 KiB.
const KEY_BLOCK: usize = 64;

/// Scores of query heads `h0..h0 + H` over the keys `ks` into `scores`
/// (`[group, keys]`), [`KEYS`] keys at a time (then one at a time).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn score_heads<const H: usize, const AVX: bool>(
    q: &[f32],
    k: &[f32],
    stride: usize,
    keys: usize,
    ks: std::ops::Range<usize>,
    hd: usize,
    scale: f32,
    h0: usize,
    scores: &mut [f32],
) {
    let mut qs: [&[f32]; H] = [&[]; H];
    for (i, qh) in qs.iter_mut().enumerate() {
        *qh = &q[(h0 + i) * hd..][..hd];
    }
    let mut j = ks.start;
    while j + KEYS <= ks.end {
        let mut rows: [&[f32]; KEYS] = [&[]; KEYS];
        for (m, r) in rows.iter_mut().enumerate() {
            *r = &k[(j + m) * stride..][..hd];
        }
        let d = dots_tile::<H, KEYS, AVX>(qs, rows);
        for i in 0..H {
            for m in 0..KEYS {
                scores[(h0 + i) * keys + j + m] = d[i][m] * scale;
            }
        }
        j += KEYS;
    }
    while j < ks.end {
        let d = dots_tile::<H, 1, AVX>(qs, [&k[j * stride..][..hd]]);
        for i in 0..H {
            scores[(h0 + i) * keys + j] = d[i][0] * scale;
        }
        j += 1;
    }
}

/// Continues output columns `c0..c0 + COLS` of heads `h0..h0 + H` over the
/// keys `ks` (from zero when `ks` starts at key 0, else from `out`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn weigh_cols<const H: usize, const AVX: bool>(
    scores: &[f32],
    v: &[f32],
    stride: usize,
    keys: usize,
    hd: usize,
    ks: std::ops::Range<usize>,
    c0: usize,
    h0: usize,
    out: &mut [f32],
) {
    let mut acc = [[0f32; COLS]; H];
    if ks.start > 0 {
        for i in 0..H {
            acc[i].copy_from_slice(&out[(h0 + i) * hd + c0..][..COLS]);
        }
    }
    let mut ps: [&[f32]; H] = [&[]; H];
    for (i, p) in ps.iter_mut().enumerate() {
        *p = &scores[(h0 + i) * keys..][..keys];
    }
    #[cfg(target_arch = "x86_64")]
    if AVX {
        // SAFETY: `AVX` is only set by `attend_tokens_avx2`, whose callers
        // checked AVX2 and FMA.
        unsafe { avx2::weigh(&ps, v, stride, ks, c0, &mut acc) };
        for i in 0..H {
            out[(h0 + i) * hd + c0..][..COLS].copy_from_slice(&acc[i]);
        }
        return;
    }
    for j in ks {
        let vr: &[f32; COLS] = v[j * stride + c0..][..COLS].try_into().unwrap();
        for i in 0..H {
            let pj = ps[i][j];
            for c in 0..COLS {
                acc[i][c] = pj.mul_add(vr[c], acc[i][c]);
            }
        }
    }
    for i in 0..H {
        out[(h0 + i) * hd + c0..][..COLS].copy_from_slice(&acc[i]);
    }
}

/// Dot products of `H` vectors with `N` rows of their length: per (vector,
/// row) an 8-lane `mul_add` chain, the fixed horizontal sum, then the tail in
/// order.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn dots<const H: usize, const N: usize>(a: [&[f32]; H], rows: [&[f32]; N]) -> [[f32; N]; H] {
    let len = a[0].len();
    let full = len / 8 * 8;
    let mut acc = [[[0f32; 8]; N]; H];
    for i in (0..full).step_by(8) {
        let mut bv: [&[f32; 8]; N] = [&[0f32; 8]; N];
        for m in 0..N {
            bv[m] = rows[m][i..i + 8].try_into().unwrap();
        }
        for h in 0..H {
            let av: &[f32; 8] = a[h][i..i + 8].try_into().unwrap();
            for m in 0..N {
                for l in 0..8 {
                    acc[h][m][l] = av[l].mul_add(bv[m][l], acc[h][m][l]);
                }
            }
        }
    }
    // Loops rather than `array::from_fn` or iterator closures, which would
    // not be compiled with the caller's target features.
    let mut out = [[0f32; N]; H];
    for h in 0..H {
        for m in 0..N {
            let mut s = hsum8(&acc[h][m]);
            for i in full..len {
                s = a[h][i].mul_add(rows[m][i], s);
            }
            out[h][m] = s;
        }
    }
    out
}

/// [`dots`], in AVX2 intrinsics when `AVX` (same lanes, same bits).
#[inline(always)]
fn dots_tile<const H: usize, const N: usize, const AVX: bool>(
    a: [&[f32]; H],
    rows: [&[f32]; N],
) -> [[f32; N]; H] {
    #[cfg(target_arch = "x86_64")]
    if AVX {
        // SAFETY: `AVX` is only set by `attend_tokens_avx2`, whose callers
        // checked AVX2 and FMA.
        return unsafe { avx2::dots(a, rows) };
    }
    dots(a, rows)
}

/// The tiles of [`attend_tiles`] in AVX2 intrinsics: one 8-lane
/// register per chain of the portable code.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::COLS;
    use std::arch::x86_64::*;

    /// [`super::dots`]: chains in registers, then [`super::hsum8`]'s order.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    #[allow(clippy::needless_range_loop)]
    pub(super) fn dots<const H: usize, const N: usize>(
        a: [&[f32]; H],
        rows: [&[f32]; N],
    ) -> [[f32; N]; H] {
        let len = a[0].len();
        for h in 0..H {
            assert_eq!(a[h].len(), len);
        }
        for m in 0..N {
            assert_eq!(rows[m].len(), len);
        }
        let full = len / 8 * 8;
        let mut acc = [[_mm256_setzero_ps(); N]; H];
        for i in (0..full).step_by(8) {
            // SAFETY: i + 8 <= full <= len, the length of every slice
            // (asserted above).
            unsafe {
                let mut b = [_mm256_setzero_ps(); N];
                for m in 0..N {
                    b[m] = _mm256_loadu_ps(rows[m].as_ptr().add(i));
                }
                for h in 0..H {
                    let av = _mm256_loadu_ps(a[h].as_ptr().add(i));
                    for m in 0..N {
                        acc[h][m] = _mm256_fmadd_ps(av, b[m], acc[h][m]);
                    }
                }
            }
        }
        let mut out = [[0f32; N]; H];
        for h in 0..H {
            for m in 0..N {
                let mut s = hsum(acc[h][m]);
                for i in full..len {
                    s = a[h][i].mul_add(rows[m][i], s);
                }
                out[h][m] = s;
            }
        }
        out
    }

    /// `hsum8`: lanes `l` and `l + 4`, then pairs two apart, then the last
    /// two.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// The weighted-sum tile of [`super::weigh_cols`]: `acc[i][c] =
    /// p_i[j] * v[j * stride + c0 + c] + acc[i][c]` for `j` in `ks`, in order.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    #[allow(clippy::needless_range_loop)]
    pub(super) fn weigh<const H: usize>(
        ps: &[&[f32]; H],
        v: &[f32],
        stride: usize,
        ks: std::ops::Range<usize>,
        c0: usize,
        acc: &mut [[f32; COLS]; H],
    ) {
        const V: usize = COLS / 8;
        if ks.is_empty() {
            return;
        }
        assert!((ks.end - 1) * stride + c0 + COLS <= v.len());
        for p in ps {
            assert!(p.len() >= ks.end);
        }
        let mut a = [[_mm256_setzero_ps(); V]; H];
        // SAFETY: every load below reads inside `acc`, `v` (asserted above)
        // or the score rows (length asserted above).
        unsafe {
            for i in 0..H {
                for c in 0..V {
                    a[i][c] = _mm256_loadu_ps(acc[i].as_ptr().add(8 * c));
                }
            }
            for j in ks {
                let vr = v.as_ptr().add(j * stride + c0);
                let mut vv = [_mm256_setzero_ps(); V];
                for c in 0..V {
                    vv[c] = _mm256_loadu_ps(vr.add(8 * c));
                }
                for i in 0..H {
                    let p = _mm256_set1_ps(*ps[i].get_unchecked(j));
                    for c in 0..V {
                        a[i][c] = _mm256_fmadd_ps(p, vv[c], a[i][c]);
                    }
                }
            }
            for i in 0..H {
                for c in 0..V {
                    _mm256_storeu_ps(acc[i].as_mut_ptr().add(8 * c), a[i][c]);
                }
            }
        }
    }
}

/// The horizontal sum order of the AVX2 kernels: lanes `l` and `l + 4`,
/// then pairs two apart, then the last two.
#[inline(always)]
fn hsum8(a: &[f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};

    /// Plain f64 attention, for the accuracy bound.
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        stride: usize,
        keys: usize,
        hd: usize,
    ) -> Vec<f64> {
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = Vec::new();
        for qh in q.chunks_exact(hd) {
            let s: Vec<f64> = (0..keys)
                .map(|j| {
                    let kr = &k[j * stride..][..hd];
                    qh.iter()
                        .zip(kr)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
            let z: f64 = e.iter().sum();
            for c in 0..hd {
                out.push((0..keys).map(|j| e[j] / z * v[j * stride + c] as f64).sum());
            }
        }
        out
    }

    /// The bits of [`attend_tokens`] with `isa` (scratch and output made
    /// here; the output starts as a sentinel so untouched lanes show).
    fn attend_bits(
        isa: Isa,
        q: &[f32],
        kv: &KvRows,
        tokens: usize,
        first_keys: usize,
        scale: f32,
    ) -> Vec<u32> {
        let group_hd = q.len() / tokens;
        let keys = first_keys + tokens - 1;
        let mut scores = vec![0f32; tokens * (group_hd / kv.hd) * keys];
        let mut out = vec![9f32; tokens * group_hd];
        attend_tokens(isa, q, kv, tokens, first_keys, scale, &mut scores, &mut out);
        out.iter().map(|x| x.to_bits()).collect()
    }

    /// `len` values uniform in [-2, 2).
    fn uniform(rng: &mut rand::rngs::StdRng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-2.0f32..2.0)).collect()
    }

    /// A long context (K and V past `PREFETCH_ABOVE`, so the dispatched
    /// build prefetches the next key blocks) gives the portable bits too.
    #[test]
    fn long_context_matches_portable() {
        let (hd, group, keys, stride) = (256usize, 2usize, 2100usize, 512usize);
        assert!(2 * keys * hd * 4 > PREFETCH_ABOVE);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (q, k, v) = (
            uniform(&mut rng, group * hd),
            uniform(&mut rng, keys * stride),
            uniform(&mut rng, keys * stride),
        );
        let kv = KvRows {
            k: &k,
            v: &v,
            stride,
            hd,
        };
        assert_eq!(
            attend_bits(Isa::detect(), &q, &kv, 1, keys, 0.0625),
            attend_bits(Isa::Scalar, &q, &kv, 1, keys, 0.0625)
        );
    }

    /// Each token of a multi-token call, against a call for that token
    /// alone (bits), in the dispatched and the portable build.
    fn check_tokens_match_one_by_one(
        hd: usize,
        group: usize,
        tokens: usize,
        first_keys: usize,
        stride: usize,
        seed: u64,
    ) -> Result<(), TestCaseError> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let keys = first_keys + tokens - 1;
        let n = keys.max(1) * stride;
        let (q, k, v) = (
            uniform(&mut rng, tokens * group * hd),
            uniform(&mut rng, n),
            uniform(&mut rng, n),
        );
        let scale = 1.0 / (hd as f32).sqrt();
        let kv = KvRows {
            k: &k,
            v: &v,
            stride,
            hd,
        };
        let fast = attend_bits(Isa::detect(), &q, &kv, tokens, first_keys, scale);
        let portable = attend_bits(Isa::Scalar, &q, &kv, tokens, first_keys, scale);
        prop_assert_eq!(&fast, &portable);
        for g in 0..tokens {
            let kg = first_keys + g;
            let qg = &q[g * group * hd..][..group * hd];
            let alone = attend_bits(Isa::detect(), qg, &kv, 1, kg, scale);
            prop_assert_eq!(
                &fast[g * group * hd..][..group * hd],
                &alone[..],
                "token {} of {} ({} keys)",
                g,
                tokens,
                kg
            );
        }
        Ok(())
    }

    /// A block of prompt tokens across several key blocks (the model's
    /// shape: 8 heads of 256 per KV head, two KV heads in the cache).
    #[test]
    fn token_block_matches_one_by_one_at_model_shape() {
        check_tokens_match_one_by_one(256, 8, 8, 130, 512, 3).unwrap();
        check_tokens_match_one_by_one(256, 8, 5, 60, 512, 4).unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// The dispatched build gives the portable build's bits, close to
        /// f64 attention, for ragged head sizes, groups, key counts and strides.
        #[test]
        fn dispatch_matches_portable_and_f64(
            hd in prop_oneof![1usize..40, Just(64usize), Just(128), Just(256)],
            group in 1usize..9,
            keys in 0usize..70,
            pad in 0usize..3,
            seed in any::<u64>(),
        ) {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let stride = hd * (1 + pad) + pad;
            let n = keys.max(1) * stride;
            let (q, k, v) = (uniform(&mut rng, group * hd), uniform(&mut rng, n), uniform(&mut rng, n));
            let scale = 1.0 / (hd as f32).sqrt();
            let kv = KvRows { k: &k, v: &v, stride, hd };
            let fast = attend_bits(Isa::detect(), &q, &kv, 1, keys, scale);
            prop_assert_eq!(&fast, &attend_bits(Isa::Scalar, &q, &kv, 1, keys, scale));
            let o1: Vec<f32> = fast.iter().map(|&b| f32::from_bits(b)).collect();
            if keys > 0 {
                let want = reference(&q, &k, &v, stride, keys, hd);
                for (i, (&got, &w)) in o1.iter().zip(&want).enumerate() {
                    prop_assert!((got as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()) * (keys as f64).sqrt(),
                        "i={} got={} want={}", i, got, w);
                }
            } else {
                prop_assert!(o1.iter().all(|&x| x == 0.0));
            }
        }

        /// Multi-token calls give each token's one-token bits, for ragged
        /// head sizes, groups, token counts and key counts (first token
        /// with no keys included).
        #[test]
        fn tokens_match_one_by_one(
            hd in prop_oneof![1usize..40, Just(64usize), Just(256)],
            group in 1usize..9,
            tokens in 1usize..11,
            first_keys in 0usize..140,
            pad in 0usize..3,
            seed in any::<u64>(),
        ) {
            check_tokens_match_one_by_one(hd, group, tokens, first_keys, hd * (1 + pad) + pad, seed)?;
        }
    }
}
