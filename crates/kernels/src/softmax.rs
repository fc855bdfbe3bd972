//! The softmax of the CPU model code (attention scores, router logits), in
//! a portable form and an AVX2 + FMA form that give the same bits.
//!
//! `exp` is a fixed sequence of IEEE operations rather than libm's (whose
//! bits are the C library's business and which runs one element at a
//! time): `n = round_ties_even(t * log2 e)`, `r = t - n ln2` in two fused
//! steps (ln 2 split high/low), the Cephes degree-6 polynomial in Horner
//! form with fused multiply-adds (about 1 ulp on `[-ln2/2, ln2/2]`), times
//! `2^n` built from its bits; `t < -87` (below f32's normal range) gives 0.
//! The sum of the exponentials is taken in f64 over eight lanes (element
//! `i` into lane `i % 8`), reduced in a fixed order; then every element is
//! multiplied by the f32 reciprocal of the sum. Each step is the same
//! operation in both forms, so the lanes of the AVX2 form give the portable
//! form's bits and a row's result does not depend on how it is reached
//! (decode and prefill share it).

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split so that `n * LN2_HI` is exact for the `n` an f32 exponent
/// takes (Cephes' split).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes `expf` coefficients, highest order first (its last, 5.0000001e-1,
/// is 0.5 in f32).
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];
/// Below this `exp` is under f32's normal range: the result is 0.
const UNDERFLOW: f32 = -87.0;

/// `exp(t)` for `t <= 0` (the softmax's shifted scores), as described in
/// the module documentation.
#[inline(always)]
pub fn exp_nonpositive(t: f32) -> f32 {
    let n = (t * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, t);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = P[0];
    for &c in &P[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    if t < UNDERFLOW {
        return 0.0;
    }
    // n is in [-126, 0] here: a normal power of two.
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// The fixed reduction of the eight f64 lanes.
#[inline(always)]
fn reduce_lanes(l: [f64; 8]) -> f64 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// Numerically stable in-place softmax (portable form): `exp(x - max)`,
/// then times the reciprocal of the sum. An empty slice is left alone.
#[inline(always)]
pub fn softmax(x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut lanes = [0.0f64; 8];
    for (i, v) in x.iter_mut().enumerate() {
        *v = exp_nonpositive(*v - max);
        lanes[i % 8] += *v as f64;
    }
    let inv = (1.0 / reduce_lanes(lanes)) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// [`softmax`] with the kernels of `isa` (the AVX2 + FMA form for
/// [`Isa::Avx2`] and [`Isa::Avx512`]); the same bits either way. Panics if
/// the CPU lacks `isa`.
pub fn softmax_on(isa: crate::Isa, x: &mut [f32]) {
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, crate::Isa::Avx2 | crate::Isa::Avx512) {
        // SAFETY: both ISAs include AVX2 and FMA, and the CPU supports
        // `isa` (checked above).
        return unsafe { softmax_avx2(x) };
    }
    softmax(x)
}

/// [`softmax`] in AVX2 + FMA intrinsics, the same bits.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn softmax_avx2(x: &mut [f32]) {
    use std::arch::x86_64::*;
    if x.is_empty() {
        return;
    }
    let len = x.len();
    let full = len / 8 * 8;
    let p = x.as_mut_ptr();
    // SAFETY (whole block): every pointer below is `p + i` with
    // `i + 8 <= full <= len`, inside `x`; the caller guarantees the ISA.
    unsafe {
        let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
        for i in (0..full).step_by(8) {
            mv = _mm256_max_ps(mv, _mm256_loadu_ps(p.add(i)));
        }
        let mut m = [0f32; 8];
        _mm256_storeu_ps(m.as_mut_ptr(), mv);
        // Max is exact in any order.
        let max = m
            .iter()
            .chain(&x[full..])
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        let maxv = _mm256_set1_ps(max);
        let (log2e, ln2_hi, ln2_lo) = (
            _mm256_set1_ps(LOG2E),
            _mm256_set1_ps(LN2_HI),
            _mm256_set1_ps(LN2_LO),
        );
        let (one, under, bias) = (
            _mm256_set1_ps(1.0),
            _mm256_set1_ps(UNDERFLOW),
            _mm256_set1_epi32(127),
        );
        let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        for i in (0..full).step_by(8) {
            let t = _mm256_sub_ps(_mm256_loadu_ps(p.add(i)), maxv);
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(t, log2e),
            );
            let r = _mm256_fnmadd_ps(n, ln2_hi, t);
            let r = _mm256_fnmadd_ps(n, ln2_lo, r);
            let mut y = _mm256_set1_ps(P[0]);
            for &c in &P[1..] {
                y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
            }
            let y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), one);
            let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                bias,
            )));
            let e = _mm256_andnot_ps(
                _mm256_cmp_ps::<_CMP_LT_OQ>(t, under),
                _mm256_mul_ps(y, pow2),
            );
            _mm256_storeu_ps(p.add(i), e);
            lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
        }
        let mut lanes = [0f64; 8];
        _mm256_storeu_pd(lanes.as_mut_ptr(), lo);
        _mm256_storeu_pd(lanes.as_mut_ptr().add(4), hi);
        for (i, v) in x.iter_mut().enumerate().skip(full) {
            *v = exp_nonpositive(*v - max);
            lanes[i % 8] += *v as f64;
        }
        let inv = (1.0 / reduce_lanes(lanes)) as f32;
        let invv = _mm256_set1_ps(inv);
        for i in (0..full).step_by(8) {
            _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), invv));
        }
        for v in &mut x[full..] {
            *v *= inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn exp_is_within_two_ulp_of_f64_and_zero_below_the_normal_range() {
        let mut t = 0.0f32;
        while t > -87.0 {
            let want = (t as f64).exp();
            let got = exp_nonpositive(t) as f64;
            assert!(
                (got - want).abs() <= 2.0 * f32::EPSILON as f64 * want,
                "exp({t}) = {got}, want {want}"
            );
            t -= 0.0137;
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-87.5), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// The AVX2 form gives the portable bits, and both sum to one
        /// within f32 rounding and match f64 softmax, for ragged lengths
        /// and spreads that reach the underflow cut.
        #[test]
        fn avx2_matches_portable_and_f64(
            xs in prop::collection::vec(-120.0f32..30.0, 0..150),
        ) {
            let mut portable = xs.clone();
            softmax(&mut portable);
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                let mut fast = xs.clone();
                // SAFETY: AVX2 and FMA were detected just above.
                unsafe { softmax_avx2(&mut fast) };
                prop_assert_eq!(bits(&fast), bits(&portable));
            }
            if !xs.is_empty() {
                // The shifted scores as the softmax computes them (exact
                // differences are not the point here).
                let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f64> = xs.iter().map(|&v| ((v - max) as f64).exp()).collect();
                let z: f64 = e.iter().sum();
                for (i, (&got, w)) in portable.iter().zip(&e).enumerate() {
                    let want = w / z;
                    prop_assert!((got as f64 - want).abs() <= 4e-7 * want + 1e-37,
                        "i={} got={} want={}", i, got, want);
                }
            }
        }
    }
}
