//! The seeded draw of the CUDA backend, defined on integers.
//!
//! The GPU cannot sum a vocabulary's probabilities in the host sampler's
//! order at any speed, and a float sum in another order changes which token
//! a draw lands on. So this draw fixes every step that a parallel sum could
//! reorder: each kept token's weight `exp((logit - max) / temperature)` is
//! computed by one fixed sequence of IEEE operations ([`exp_nonpositive`])
//! and truncated to a multiple of 2^-44 ([`WEIGHT_ONE`] is the most likely
//! token's weight), and from there on every sum is an integer sum, whose
//! value no order changes. The CUDA kernels (`samp_*` in crates/cuda/src/kernels/sample.cu) and
//! [`draw`] therefore pick the same token for the same logits and `u`.
//!
//! The kept set follows the host sampler (`slipstream_engine::Sampler`):
//! finite logits only; top-k keeps the k most likely (ties to the lower
//! id); min-p drops weights below `min_p` (the most likely token stays);
//! top-p keeps the shortest most-likely-first prefix whose mass reaches
//! `top_p` times the top-k set's mass. The draw walks the kept tokens in id
//! order. Weights below 2^-44 of the most likely token's (logits more than
//! about 30 temperatures below it) become 0 and are never drawn.

/// The most likely token's fixed-point weight (2^44): with at most
/// [`MAX_VOCAB`] tokens every sum fits in a `u64`.
pub const WEIGHT_ONE: f64 = (1u64 << 44) as f64;

/// The largest vocabulary the integer sums are sized for (2^19).
pub const MAX_VOCAB: usize = 1 << 19;

/// Sampling settings of one draw (the engine's `SamplingParams` without the
/// seed; `temperature > 0`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrawParams {
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 disables.
    pub top_k: u32,
    /// Keep the shortest most-likely-first prefix reaching this mass; 1 disables.
    pub top_p: f32,
    /// Drop tokens weighing less than this (the most likely weighs 1); 0 disables.
    pub min_p: f32,
}

/// The order of a logit as a `u32`: larger means more likely, in
/// `f32::total_cmp`'s order (+0 above -0). Only finite logits are compared.
pub fn order_key(v: f32) -> u32 {
    let b = v.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The logit whose [`order_key`] is `k`.
pub fn logit_of_key(k: u32) -> f32 {
    f32::from_bits(if k & 0x8000_0000 != 0 {
        k & 0x7fff_ffff
    } else {
        !k
    })
}

// Taylor coefficients 1/n! (n = 2..=13), ln 2 in two parts and log2(e), as
// bit patterns so that the CUDA sampling kernels hold exactly the same constants.
const INV_FACT: [u64; 12] = [
    0x3fe0_0000_0000_0000,
    0x3fc5_5555_5555_5555,
    0x3fa5_5555_5555_5555,
    0x3f81_1111_1111_1111,
    0x3f56_c16c_16c1_6c17,
    0x3f2a_01a0_1a01_a01a,
    0x3efa_01a0_1a01_a01a,
    0x3ec7_1de3_a556_c734,
    0x3e92_7e4f_b778_9f5c,
    0x3e5a_e645_67f5_44e4,
    0x3e21_eed8_eff8_d898,
    0x3de6_1246_13a8_6d09,
];
const LN2_HI: u64 = 0x3fe6_2e42_fee0_0000;
const LN2_LO: u64 = 0x3dea_39ef_3579_3c76;
const LOG2E: u64 = 0x3ff7_1547_652b_82fe;

/// `e^x` for `x <= 0`, by a fixed sequence of correctly rounded IEEE
/// operations (round-to-nearest products and sums, fused multiply-adds),
/// so the GPU's copy gives the same bits: `x = k ln 2 + r` with `|r| <=
/// ln 2 / 2`, a degree-13 Taylor polynomial for `e^r` (relative error below
/// 3e-16), times `2^k`. Returns 0 below -40 (and for NaN).
pub fn exp_nonpositive(x: f64) -> f64 {
    if x.is_nan() || x < -40.0 {
        return 0.0;
    }
    let k = (x * f64::from_bits(LOG2E)).round_ties_even();
    let r = (-k).mul_add(f64::from_bits(LN2_HI), x);
    let r = (-k).mul_add(f64::from_bits(LN2_LO), r);
    let mut p = f64::from_bits(INV_FACT[11]);
    for c in INV_FACT[..11].iter().rev() {
        p = p.mul_add(r, f64::from_bits(*c));
    }
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // k is in [-58, 1]: 2^k is a normal number and the product exact.
    p * f64::from_bits(((1023 + k as i64) as u64) << 52)
}

/// A kept token's fixed-point weight and its real weight (`e^x`, for the
/// min-p test): `logit <= max`, both finite.
pub fn weight(logit: f32, max: f32, temperature: f32) -> (u64, f64) {
    let x = (logit as f64 - max as f64) / temperature as f64;
    let w = exp_nonpositive(x);
    ((w * WEIGHT_ONE) as u64, w)
}

/// The top-p goal: `ceil(top_p * total)`, at least 1.
pub fn mass_goal(top_p: f32, total: u64) -> u64 {
    ((top_p as f64 * total as f64).ceil() as u64).max(1)
}

/// The fixed-point weight of every id (`[logits.len()]`, 0 outside the kept
/// set); `None` when no logit is finite. `logits.len()` must be at most
/// [`MAX_VOCAB`].
pub fn kept_weights(logits: &[f32], p: &DrawParams) -> Option<Vec<u64>> {
    assert!(logits.len() <= MAX_VOCAB, "vocabulary over {MAX_VOCAB}");
    // (key, id), most likely first.
    let mut cand: Vec<(u32, u32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, &v)| (order_key(v), i as u32))
        .collect();
    cand.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let &(top_key, top_id) = cand.first()?;
    if p.top_k > 0 && (p.top_k as usize) < cand.len() {
        cand.truncate(p.top_k as usize);
    }
    let max = logit_of_key(top_key);
    let mut total = 0u64;
    let mut kept: Vec<u64> = cand
        .iter()
        .map(|&(key, id)| {
            let (fixed, w) = weight(logit_of_key(key), max, p.temperature);
            total += fixed;
            if p.min_p > 0.0 && w < p.min_p as f64 && id != top_id {
                0
            } else {
                fixed
            }
        })
        .collect();
    if p.top_p < 1.0 {
        let goal = mass_goal(p.top_p, total);
        let mut acc = 0u64;
        if let Some(last) = kept.iter().position(|&w| {
            acc += w;
            acc >= goal
        }) {
            kept.truncate(last + 1);
        }
    }
    let mut by_id = vec![0u64; logits.len()];
    for (&(_, id), &w) in cand.iter().zip(&kept) {
        by_id[id as usize] = w;
    }
    Some(by_id)
}

/// The drawn id for `u` in `[0, 1)` (the seeded generator's next value):
/// `r = trunc(u * mass)`, then the first id, in id order, where the kept
/// mass passes `r`. `None` when no logit is finite (the caller falls back
/// to the argmax).
pub fn draw(logits: &[f32], p: &DrawParams, u: f64) -> Option<u32> {
    let by_id = kept_weights(logits, p)?;
    // The most likely token weighs WEIGHT_ONE and is always kept.
    let mass: u64 = by_id.iter().sum();
    let mut r = ((u * mass as f64) as u64).min(mass - 1);
    by_id
        .iter()
        .position(|&w| {
            if r < w {
                true
            } else {
                r -= w;
                false
            }
        })
        .map(|i| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_the_library_to_rounding() {
        let mut x = 0.0f64;
        while x > -40.0 {
            let (a, b) = (exp_nonpositive(x), x.exp());
            assert!(((a - b) / b).abs() < 1e-15, "exp({x}) = {a}, std {b}");
            x -= 0.0137;
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-0.0), 1.0);
        assert_eq!(exp_nonpositive(-41.0), 0.0);
        assert_eq!(exp_nonpositive(f64::NAN), 0.0);
    }

    #[test]
    fn keys_order_like_total_cmp() {
        let vals = [f32::MIN, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, f32::MAX];
        for w in vals.windows(2) {
            assert!(order_key(w[0]) < order_key(w[1]), "{w:?}");
        }
        for v in vals {
            assert_eq!(logit_of_key(order_key(v)).to_bits(), v.to_bits());
        }
    }

    #[test]
    fn draws_respect_the_cuts() {
        let logits = [1.0f32, 3.0, 3.0, f32::NAN, 2.0, f32::INFINITY, -1.0];
        let p = |top_k, top_p, min_p| DrawParams {
            temperature: 1.0,
            top_k,
            top_p,
            min_p,
        };
        let ids = |q: DrawParams| {
            let mut s: Vec<u32> = (0..200)
                .filter_map(|i| draw(&logits, &q, i as f64 / 200.0))
                .collect();
            s.sort_unstable();
            s.dedup();
            s
        };
        assert_eq!(ids(p(0, 1.0, 0.0)), vec![0, 1, 2, 4, 6]);
        // Top-2: the tie at 3.0 fills it.
        assert_eq!(ids(p(2, 1.0, 0.0)), vec![1, 2]);
        // Top-1 of a tie: the lower id.
        assert_eq!(ids(p(1, 1.0, 0.0)), vec![1]);
        // e^-1 = 0.37 stays, e^-2 = 0.14 goes.
        assert_eq!(ids(p(0, 1.0, 0.2)), vec![1, 2, 4]);
        // Mass: 1, 1, 0.37, 0.14, 0.02 over 2.52; 0.5 of it needs two.
        assert_eq!(ids(p(0, 0.5, 0.0)), vec![1, 2]);
        assert_eq!(ids(p(0, 0.0, 0.0)), vec![1]);
        assert_eq!(
            draw(&[f32::NAN, f32::NEG_INFINITY], &p(0, 1.0, 0.0), 0.5),
            None
        );
    }
}
