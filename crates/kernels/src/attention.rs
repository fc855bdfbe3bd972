//! Softmax attention of the query heads that share one KV head, for one
//! token (SIMD by recompilation, as in [`crate::recurrence`]: the AVX2 + FMA
//! build runs the same per-element arithmetic, and `f32::mul_add` is one
//! rounding on every target, so both builds give the same bits).
//!
//! Per (query head, key) the score is an 8-lane fused multiply-add chain over
//! the head dimension, a fixed horizontal sum, the `hd % 8` tail added with
//! `mul_add` in order, then times `scale`; softmax subtracts the maximum,
//! exponentiates and multiplies by the reciprocal of the (f64) sum; each
//! output element is a `mul_add` chain over the keys in order from zero.
//! Nothing depends on how many tokens or heads a call handles, so prefill
//! chunking and decode agree bit for bit.

/// Keys whose dot products run side by side (independent chains).
const KEYS: usize = 4;
/// Output columns per pass of the weighted sum (4 vectors of 8).
const COLS: usize = 32;

/// Attention of `group` query heads over `keys` positions of one KV head.
///
/// * `q`: `[group, hd]` (already normed, rotated).
/// * `k`, `v`: position `j`'s row at `[j * stride..][..hd]` (`stride >= hd`,
///   the layout of a KV cache holding every KV head of a position).
/// * `scale`: multiplies each dot product (usually `1 / sqrt(hd)`).
/// * `scores`: scratch of at least `group * keys`.
/// * `out`: `[group, hd]`, overwritten.
#[allow(clippy::too_many_arguments)]
pub fn attend_group(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    stride: usize,
    keys: usize,
    hd: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { attend_group_avx2(q, k, v, stride, keys, hd, scale, scores, out) };
    }
    attend_group_impl(q, k, v, stride, keys, hd, scale, scores, out)
}

/// [`attend_group_impl`] compiled for AVX2 + FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn attend_group_avx2(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    stride: usize,
    keys: usize,
    hd: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    attend_group_impl(q, k, v, stride, keys, hd, scale, scores, out)
}

/// The portable body of [`attend_group`] (also its reference).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn attend_group_impl(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    stride: usize,
    keys: usize,
    hd: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    assert!(hd > 0 && stride >= hd && q.len().is_multiple_of(hd));
    let group = q.len() / hd;
    assert_eq!(out.len(), group * hd, "out must be [group, hd]");
    assert!(scores.len() >= group * keys, "scores scratch too small");
    if keys == 0 {
        out.fill(0.0);
        return;
    }
    let last = (keys - 1) * stride + hd;
    assert!(
        k.len() >= last && v.len() >= last,
        "k/v shorter than keys rows"
    );
    let scores = &mut scores[..group * keys];

    // Scores: KEYS keys at a time share each load of the query.
    for (qh, sc) in q.chunks_exact(hd).zip(scores.chunks_exact_mut(keys)) {
        let mut j = 0;
        while j + KEYS <= keys {
            let mut rows: [&[f32]; KEYS] = [&[]; KEYS];
            for (m, r) in rows.iter_mut().enumerate() {
                *r = &k[(j + m) * stride..][..hd];
            }
            let d = dots::<KEYS>(qh, rows);
            for m in 0..KEYS {
                sc[j + m] = d[m] * scale;
            }
            j += KEYS;
        }
        while j < keys {
            sc[j] = dots::<1>(qh, [&k[j * stride..][..hd]])[0] * scale;
            j += 1;
        }
    }
    for sc in scores.chunks_exact_mut(keys) {
        softmax(sc);
    }

    // Weighted sum: COLS output columns at a time, a chain over keys each.
    for (o, p) in out.chunks_exact_mut(hd).zip(scores.chunks_exact(keys)) {
        let mut c0 = 0;
        while c0 + COLS <= hd {
            let mut acc = [0f32; COLS];
            for (j, &pj) in p.iter().enumerate() {
                let vr: &[f32; COLS] = v[j * stride + c0..][..COLS].try_into().unwrap();
                for c in 0..COLS {
                    acc[c] = pj.mul_add(vr[c], acc[c]);
                }
            }
            o[c0..c0 + COLS].copy_from_slice(&acc);
            c0 += COLS;
        }
        for c in c0..hd {
            let mut acc = 0f32;
            for (j, &pj) in p.iter().enumerate() {
                acc = pj.mul_add(v[j * stride + c], acc);
            }
            o[c] = acc;
        }
    }
}

/// Dot products of `a` with `N` rows of its length: per row an 8-lane
/// `mul_add` chain, the fixed horizontal sum, then the tail in order.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn dots<const N: usize>(a: &[f32], rows: [&[f32]; N]) -> [f32; N] {
    let full = a.len() / 8 * 8;
    let mut acc = [[0f32; 8]; N];
    for i in (0..full).step_by(8) {
        let av: &[f32; 8] = a[i..i + 8].try_into().unwrap();
        for m in 0..N {
            let bv: &[f32; 8] = rows[m][i..i + 8].try_into().unwrap();
            for l in 0..8 {
                acc[m][l] = av[l].mul_add(bv[l], acc[m][l]);
            }
        }
    }
    // Loops rather than `array::from_fn` or iterator closures, which would
    // not be compiled with the caller's target features.
    let mut out = [0f32; N];
    for m in 0..N {
        let mut s = hsum8(&acc[m]);
        for i in full..a.len() {
            s = a[i].mul_add(rows[m][i], s);
        }
        out[m] = s;
    }
    out
}

/// The horizontal sum order of the AVX2 kernels: lanes `l` and `l + 4`,
/// then pairs two apart, then the last two.
#[inline(always)]
fn hsum8(a: &[f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// Numerically stable in-place softmax: `exp(x - max)` times the reciprocal
/// of the sum (summed in f64). The one softmax of the CPU model code.
#[inline(always)]
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
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
            let mut vals = |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-2.0f32..2.0)).collect() };
            let (q, k, v) = (vals(group * hd), vals(n), vals(n));
            let scale = 1.0 / (hd as f32).sqrt();
            let mut s1 = vec![0f32; group * keys];
            let mut s2 = vec![0f32; group * keys];
            let mut o1 = vec![0f32; group * hd];
            let mut o2 = vec![7f32; group * hd];
            attend_group(&q, &k, &v, stride, keys, hd, scale, &mut s1, &mut o1);
            attend_group_impl(&q, &k, &v, stride, keys, hd, scale, &mut s2, &mut o2);
            prop_assert_eq!(
                o1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                o2.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
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
    }
}
