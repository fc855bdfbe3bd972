//! The Gated DeltaNet recurrence, one token on one head (SIMD by
//! recompilation: the AVX2 build runs the same per-element arithmetic).

use crate::Isa;

/// One token of the gated delta rule on one head's state `s` (`[dk, dv]`
/// row-major, `dk = k.len()`, `dv = v.len()`), in two passes over `s`:
///
/// 1. per row `i`: `S_i *= decay`, then `kv_mem += k_i * S_i`;
///    then `delta = (v - kv_mem) * beta`;
/// 2. per row `i`: `S_i += k_i * delta`, then `o += q_i * S_i`.
///
/// Every element sees the same operations in the same order as the
/// four-pass form (decay all, `S^T k`, `S += k delta^T`, `o = S^T q`), so
/// results are bit-identical to it; `o` is overwritten. Runs the AVX2 build
/// for [`Isa::Avx2`] and [`Isa::Avx512`], the portable one otherwise (the
/// same bits); panics if the CPU lacks `isa`.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_step(
    isa: Isa,
    s: &mut [f32],
    k: &[f32],
    q: &[f32],
    v: &[f32],
    decay: f32,
    beta: f32,
    delta: &mut [f32],
    o: &mut [f32],
) {
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) {
        // SAFETY: both ISAs include AVX2, and the CPU supports `isa`
        // (checked above).
        return unsafe { delta_rule_step_avx2(s, k, q, v, decay, beta, delta, o) };
    }
    delta_rule_step_impl(s, k, q, v, decay, beta, delta, o)
}

/// [`delta_rule_step_impl`] compiled for AVX2 (wider vectors, the same
/// per-element arithmetic: Rust never contracts a multiply and an add).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
fn delta_rule_step_avx2(
    s: &mut [f32],
    k: &[f32],
    q: &[f32],
    v: &[f32],
    decay: f32,
    beta: f32,
    delta: &mut [f32],
    o: &mut [f32],
) {
    delta_rule_step_impl(s, k, q, v, decay, beta, delta, o)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_step_impl(
    s: &mut [f32],
    k: &[f32],
    q: &[f32],
    v: &[f32],
    decay: f32,
    beta: f32,
    delta: &mut [f32],
    o: &mut [f32],
) {
    let dv = v.len();
    assert!(s.len() == k.len() * dv && q.len() == k.len());
    assert!(delta.len() == dv && o.len() == dv);
    // kv_mem accumulates in `o` (reused as scratch before pass 2).
    o.fill(0.0);
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        for (sv, m) in row.iter_mut().zip(o.iter_mut()) {
            *sv *= decay;
            *m += ki * *sv;
        }
    }
    for ((d, &vv), m) in delta.iter_mut().zip(v).zip(o.iter()) {
        *d = (vv - m) * beta;
    }
    o.fill(0.0);
    for ((row, &ki), &qi) in s.chunks_exact_mut(dv).zip(k).zip(q) {
        for ((sv, &d), oo) in row.iter_mut().zip(delta.iter()).zip(o.iter_mut()) {
            *sv += ki * d;
            *oo += qi * *sv;
        }
    }
}
