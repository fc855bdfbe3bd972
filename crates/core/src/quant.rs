//! Weight storage types and their byte layouts.
//!
//! A 2-D weight `[rows, cols]` is stored row-major. Affine-quantized weights
//! (the MLX layout) hold three regions back to back:
//! 1. packed codes, `rows * cols * bits / 8` bytes; element `j` of a row is in
//!    byte `j * bits / 8`, for 4 bits the low nibble holds the even element
//!    (identical to MLX's little-endian u32 words, least significant nibble first);
//! 2. scales, `rows * cols / group` values of [`ScaleType`];
//! 3. biases, same shape and type as the scales.
//!
//! The value of element `j` of row `r` is `scale[r, j / group] * q + bias[r, j / group]`.

use serde::{Deserialize, Serialize};

/// Element type of affine scales and biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleType {
    F16,
    Bf16,
}

/// How a tensor's elements are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum QuantType {
    F32,
    F16,
    Bf16,
    /// Affine (MLX-style) quantization: `bits` in {4, 8}, `group` elements per scale.
    Affine {
        bits: u8,
        group: u32,
        scale: ScaleType,
    },
}

impl QuantType {
    /// MLX-style 4-bit, group 64, with f16 scales: the default for float sources.
    pub const Q4: QuantType = QuantType::Affine {
        bits: 4,
        group: 64,
        scale: ScaleType::F16,
    };
    /// MLX-style 8-bit, group 64, f16 scales.
    pub const Q8: QuantType = QuantType::Affine {
        bits: 8,
        group: 64,
        scale: ScaleType::F16,
    };

    /// Bytes needed for a `[rows, cols]` tensor of this type.
    pub fn nbytes(&self, rows: usize, cols: usize) -> usize {
        match *self {
            QuantType::F32 => rows * cols * 4,
            QuantType::F16 | QuantType::Bf16 => rows * cols * 2,
            QuantType::Affine { bits, group, .. } => {
                let codes = rows * cols * bits as usize / 8;
                let groups = rows * (cols / group as usize);
                codes + 2 * groups * 2
            }
        }
    }

    /// Checks that `cols` is a legal row length for this type.
    pub fn check_cols(&self, cols: usize) -> Result<(), crate::CoreError> {
        if let QuantType::Affine { bits, group, .. } = *self {
            if bits != 4 && bits != 8 {
                return Err(crate::CoreError::Invalid(format!(
                    "affine quantization with {bits} bits is not supported (4 or 8)"
                )));
            }
            if group == 0 || !cols.is_multiple_of(group as usize) || group % 8 != 0 {
                return Err(crate::CoreError::Invalid(format!(
                    "row length {cols} is not a multiple of the quantization group {group}"
                )));
            }
        }
        Ok(())
    }

    /// Short human name: `f32`, `bf16`, `q4g64`, ...
    pub fn name(&self) -> String {
        match *self {
            QuantType::F32 => "f32".into(),
            QuantType::F16 => "f16".into(),
            QuantType::Bf16 => "bf16".into(),
            QuantType::Affine { bits, group, .. } => format!("q{bits}g{group}"),
        }
    }
}
