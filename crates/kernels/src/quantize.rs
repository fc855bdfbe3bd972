//! Conversions between f32 values and the stored layouts of [`QuantType`].

use slipstream_core::{QuantType, ScaleType, TensorView};

/// Quantizes `values` (`[rows, cols]`, row-major) to the MLX affine layout:
/// packed codes, then scales `[rows, cols / group]`, then biases (same shape).
///
/// Per group, MLX's algorithm: `mask = |w_min| > |w_max|`,
/// `scale = max((w_max - w_min) / (2^bits - 1), 1e-7)`, negated unless `mask`;
/// `edge = mask ? w_min : w_max`; `q0 = round(edge / scale)`; if `q0 != 0`
/// then `scale = edge / q0` and `bias = edge`, else `bias = 0`. Scale and bias
/// are rounded to `scale_type` first and the codes
/// `q = clamp(round((w - bias) / scale), 0, 2^bits - 1)` are computed against
/// the stored values (rounding is half to even, like `rint`).
///
/// Panics unless `bits` is 4 or 8, `group` is a positive multiple of 2 dividing
/// `cols`, and `values.len() == rows * cols`.
pub fn quantize_affine(
    values: &[f32],
    rows: usize,
    cols: usize,
    bits: u8,
    group: usize,
    scale_type: ScaleType,
) -> Vec<u8> {
    assert!(bits == 4 || bits == 8, "affine bits must be 4 or 8");
    assert!(
        group > 0 && group.is_multiple_of(2) && cols.is_multiple_of(group),
        "group {group} must be even and divide cols {cols}"
    );
    assert_eq!(values.len(), rows * cols, "values length != rows * cols");
    let n_bins = ((1u32 << bits) - 1) as f32;
    let ngroups = rows * cols / group;
    let code_bytes = rows * cols * bits as usize / 8;
    let mut out = vec![0u8; code_bytes + 4 * ngroups];
    let (codes, params) = out.split_at_mut(code_bytes);
    let (scales, biases) = params.split_at_mut(2 * ngroups);

    for (gi, w) in values.chunks_exact(group).enumerate() {
        let mut w_min = f32::INFINITY;
        let mut w_max = f32::NEG_INFINITY;
        for &v in w {
            w_max = w_max.max(v);
            w_min = w_min.min(v);
        }
        let mask = w_min.abs() > w_max.abs();
        let mut scale = ((w_max - w_min) / n_bins).max(1e-7);
        if !mask {
            scale = -scale;
        }
        let edge = if mask { w_min } else { w_max };
        let q0 = (edge / scale).round_ties_even();
        let mut bias = 0f32;
        if q0 != 0.0 {
            scale = edge / q0;
            bias = edge;
        }
        let (sbits, s) = round_param(scale, scale_type);
        let (bbits, b) = round_param(bias, scale_type);
        scales[2 * gi..2 * gi + 2].copy_from_slice(&sbits.to_le_bytes());
        biases[2 * gi..2 * gi + 2].copy_from_slice(&bbits.to_le_bytes());
        for (j, &v) in w.iter().enumerate() {
            let q = ((v - b) / s).round_ties_even();
            // NaN (e.g. a zero stored scale) maps to 0.
            let q = if q >= 0.0 { q.min(n_bins) as u8 } else { 0 };
            let e = gi * group + j;
            if bits == 4 {
                codes[e / 2] |= q << ((e & 1) * 4);
            } else {
                codes[e] = q;
            }
        }
    }
    out
}

/// Rounds a scale/bias to its storage type: (stored bits, value as f32).
fn round_param(v: f32, ty: ScaleType) -> (u16, f32) {
    match ty {
        ScaleType::F16 => {
            let h = half::f16::from_f32(v);
            (h.to_bits(), h.to_f32())
        }
        ScaleType::Bf16 => {
            let h = half::bf16::from_f32(v);
            (h.to_bits(), h.to_f32())
        }
    }
}

/// Dequantizes a whole tensor of any type to f32 (`[rows, cols]`).
/// Affine values are exactly `scale * q + bias` (multiply, then add).
pub fn to_f32(w: &TensorView) -> Vec<f32> {
    let mut out = vec![0f32; w.rows * w.cols];
    if w.cols > 0 {
        for (r, o) in out.chunks_exact_mut(w.cols).enumerate() {
            crate::scalar::dequantize_row(w, r, o);
        }
    }
    out
}

/// Stores `values` (`[rows, cols]`) in the layout of `qtype`: little-endian
/// f32, f16 / bf16 (round to nearest even), affine ([`quantize_affine`]) or
/// GGML blocks ([`crate::ggml::quantize`]: llama.cpp's bytes for `q4_0` and
/// `q8_0`, a simple fit for the K-quants; panics unless `cols` is a multiple
/// of the block).
pub fn from_f32(values: &[f32], rows: usize, cols: usize, qtype: QuantType) -> Vec<u8> {
    assert_eq!(values.len(), rows * cols, "values length != rows * cols");
    match qtype {
        QuantType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        QuantType::F16 => values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        QuantType::Bf16 => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        QuantType::Affine { bits, group, scale } => {
            quantize_affine(values, rows, cols, bits, group as usize, scale)
        }
        QuantType::Q4_0 | QuantType::Q8_0 | QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => {
            crate::ggml::quantize(values, qtype)
        }
    }
}
