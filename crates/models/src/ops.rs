//! Small element-wise steps of the forward pass (norms, activations,
//! softmax). Each is plain scalar code with one fixed evaluation order, so
//! results never depend on threading or batch size.

/// `out = x * rsqrt(mean(x^2) + eps) * w`, one row. `w` is multiplicative
/// (checkpoints with zero-centred weights are shifted at repack time).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = (xi * inv) * wi;
    }
}

/// In-place variant of [`rms_norm`].
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let inv = inv_rms(x, eps);
    for (xi, &wi) in x.iter_mut().zip(w) {
        *xi = (*xi * inv) * wi;
    }
}

/// `1 / sqrt(mean(x^2) + eps)`, accumulated in f64 for a stable mean.
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let mean = (ss / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// `x * rsqrt(sum(x^2) + eps)` in place.
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let inv = 1.0 / ((ss as f32) + eps).sqrt();
    for v in x {
        *v *= inv;
    }
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// torch's softplus (beta 1, threshold 20).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Numerically stable softmax in place.
pub use slipstream_kernels::softmax::softmax as softmax_inplace;

/// Plain dot product in f32 with a fixed order.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Four independent accumulators let the compiler vectorise without
    // changing the order between runs.
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for j in 0..8 {
            acc[j] += a[i * 8 + j] * b[i * 8 + j];
        }
    }
    let mut tail = 0.0f32;
    for i in chunks * 8..a.len() {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `y += a * x`
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

pub use slipstream_kernels::recurrence::delta_rule_step;
#[cfg(test)]
use slipstream_kernels::recurrence::delta_rule_step_impl;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_sums_to_one_and_orders() {
        let mut x = vec![1.0, 3.0, 2.0, -50.0];
        softmax_inplace(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[1] > x[2] && x[2] > x[0] && x[0] > x[3]);
    }

    #[test]
    fn dot_matches_f64_on_ragged_lengths() {
        for n in [0usize, 1, 7, 8, 9, 33, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "n={n}");
        }
    }

    #[test]
    fn rms_norm_unit_weights_gives_unit_rms() {
        let x: Vec<f32> = (0..64).map(|i| i as f32 - 20.0).collect();
        let mut out = vec![0.0; 64];
        rms_norm(&x, &[1.0; 64], 0.0, &mut out);
        let ms: f32 = out.iter().map(|v| v * v).sum::<f32>() / 64.0;
        assert!((ms - 1.0).abs() < 1e-5);
    }

    /// The fused two-pass delta rule equals the four-pass form bit for bit.
    #[test]
    fn delta_rule_step_matches_four_pass_form() {
        for (dk, dv) in [(4usize, 8usize), (16, 12), (128, 128), (3, 5)] {
            let f = |i: usize, m: f32| (i as f32 * m).sin() * 0.7;
            let s0: Vec<f32> = (0..dk * dv).map(|i| f(i, 0.37)).collect();
            let k: Vec<f32> = (0..dk).map(|i| f(i, 1.3)).collect();
            let q: Vec<f32> = (0..dk).map(|i| f(i, 2.1)).collect();
            let v: Vec<f32> = (0..dv).map(|i| f(i, 0.9)).collect();
            let (decay, beta) = (0.93f32, 0.61f32);
            // Reference: the four-pass form.
            let mut s = s0.clone();
            for x in s.iter_mut() {
                *x *= decay;
            }
            let mut kv = vec![0.0f32; dv];
            for i in 0..dk {
                axpy(k[i], &s[i * dv..][..dv], &mut kv);
            }
            let delta: Vec<f32> = v.iter().zip(&kv).map(|(a, b)| (a - b) * beta).collect();
            for i in 0..dk {
                axpy(k[i], &delta, &mut s[i * dv..][..dv]);
            }
            let mut o = vec![0.0f32; dv];
            for i in 0..dk {
                axpy(q[i], &s[i * dv..][..dv], &mut o);
            }
            let mut s2 = s0.clone();
            let mut d2 = vec![0.0f32; dv];
            let mut o2 = vec![1.0f32; dv];
            delta_rule_step(
                slipstream_kernels::Isa::detect(),
                &mut s2,
                &k,
                &q,
                &v,
                decay,
                beta,
                &mut d2,
                &mut o2,
            );
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&s2), bits(&s));
            assert_eq!(bits(&d2), bits(&delta));
            assert_eq!(bits(&o2), bits(&o));
            let mut s3 = s0.clone();
            let mut o3 = vec![0.0f32; dv];
            delta_rule_step_impl(&mut s3, &k, &q, &v, decay, beta, &mut d2, &mut o3);
            assert_eq!(bits(&o3), bits(&o));
        }
    }

    #[test]
    fn softplus_matches_definition() {
        for x in [-30.0f32, -1.0, 0.0, 0.5, 19.0, 25.0] {
            let want = if x > 20.0 { x } else { (1.0 + x.exp()).ln() };
            assert!((softplus(x) - want).abs() < 1e-5);
        }
    }
}
