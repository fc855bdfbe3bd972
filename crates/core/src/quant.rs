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
//!
//! GGML block types ([`QuantType::Q4_0`], [`QuantType::Q8_0`], [`QuantType::Q4K`],
//! [`QuantType::Q5K`], [`QuantType::Q6K`]) hold exactly the bytes llama.cpp stores:
//! each row is `cols / block_elems` consecutive blocks, rows back to back, no
//! padding. Block layouts (little-endian; `d`, `dmin` are f16):
//! * `q4_0`: 32 elements, 18 bytes: `d`, then 16 bytes whose low nibbles are
//!   elements 0..16 and high nibbles elements 16..32; value `d * (q - 8)`;
//! * `q8_0`: 32 elements, 34 bytes: `d`, then 32 `i8`; value `d * q`;
//! * `q4_k`: 256 elements, 144 bytes: `d`, `dmin`, 12 bytes of 6-bit scales and
//!   mins for 8 sub-blocks of 32, 128 bytes of nibbles;
//! * `q5_k`: 256 elements, 176 bytes: as `q4_k` plus 32 bytes of high bits
//!   before the nibbles;
//! * `q6_k`: 256 elements, 210 bytes: 128 bytes of low nibbles, 64 bytes of
//!   high 2-bit pairs, 16 `i8` sub-block scales, then `d`.

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
    /// GGML `Q4_0`: blocks of 32 elements in 18 bytes.
    #[serde(rename = "q4_0")]
    #[allow(non_camel_case_types)]
    Q4_0,
    /// GGML `Q8_0`: blocks of 32 elements in 34 bytes.
    #[serde(rename = "q8_0")]
    #[allow(non_camel_case_types)]
    Q8_0,
    /// GGML `Q4_K`: super-blocks of 256 elements in 144 bytes.
    #[serde(rename = "q4_k")]
    Q4K,
    /// GGML `Q5_K`: super-blocks of 256 elements in 176 bytes.
    #[serde(rename = "q5_k")]
    Q5K,
    /// GGML `Q6_K`: super-blocks of 256 elements in 210 bytes.
    #[serde(rename = "q6_k")]
    Q6K,
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

    /// For GGML block types: (elements per block, bytes per block).
    pub fn ggml_block(&self) -> Option<(usize, usize)> {
        match *self {
            QuantType::Q4_0 => Some((32, 18)),
            QuantType::Q8_0 => Some((32, 34)),
            QuantType::Q4K => Some((256, 144)),
            QuantType::Q5K => Some((256, 176)),
            QuantType::Q6K => Some((256, 210)),
            _ => None,
        }
    }

    /// Whether this is one of the GGML block types.
    pub fn is_ggml(&self) -> bool {
        self.ggml_block().is_some()
    }

    /// Bytes needed for a `[rows, cols]` tensor of this type (for GGML block
    /// types `cols` must be a multiple of the block, see [`Self::check_cols`]).
    /// Saturates at `usize::MAX` for shapes no memory or file can hold, so a
    /// size read from an untrusted header compares unequal instead of
    /// wrapping; see [`Self::checked_nbytes`].
    pub fn nbytes(&self, rows: usize, cols: usize) -> usize {
        self.checked_nbytes(rows, cols).unwrap_or(usize::MAX)
    }

    /// [`Self::nbytes`], or `None` where the size overflows `usize`.
    pub fn checked_nbytes(&self, rows: usize, cols: usize) -> Option<usize> {
        let elems = rows.checked_mul(cols)?;
        match *self {
            QuantType::F32 => elems.checked_mul(4),
            QuantType::F16 | QuantType::Bf16 => elems.checked_mul(2),
            QuantType::Affine { bits, group, .. } => {
                let codes = elems.checked_mul(bits as usize)? / 8;
                let groups = rows.checked_mul(cols.checked_div(group as usize)?)?;
                codes.checked_add(groups.checked_mul(4)?)
            }
            QuantType::Q4_0
            | QuantType::Q8_0
            | QuantType::Q4K
            | QuantType::Q5K
            | QuantType::Q6K => {
                let (be, bb) = self.ggml_block()?;
                rows.checked_mul(cols / be)?.checked_mul(bb)
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
        if let Some((be, _)) = self.ggml_block() {
            if !cols.is_multiple_of(be) {
                return Err(crate::CoreError::Invalid(format!(
                    "row length {cols} is not a multiple of the {} block size {be}",
                    self.name()
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
            QuantType::Q4_0 => "q4_0".into(),
            QuantType::Q8_0 => "q8_0".into(),
            QuantType::Q4K => "q4_k".into(),
            QuantType::Q5K => "q5_k".into(),
            QuantType::Q6K => "q6_k".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_past_usize_are_none_not_a_wrap() {
        for q in [QuantType::F32, QuantType::Q4, QuantType::Q4K] {
            assert_eq!(q.checked_nbytes(usize::MAX / 2, 512), None);
            assert_eq!(q.nbytes(usize::MAX / 2, 512), usize::MAX);
            assert_eq!(q.checked_nbytes(3, 256), Some(q.nbytes(3, 256)));
        }
        let no_group = QuantType::Affine {
            bits: 4,
            group: 0,
            scale: ScaleType::F16,
        };
        assert_eq!(no_group.checked_nbytes(2, 64), None);
    }

    #[test]
    fn serde_names_and_sizes() {
        let cases = [
            (QuantType::Q4_0, "q4_0", 32, 18),
            (QuantType::Q8_0, "q8_0", 32, 34),
            (QuantType::Q4K, "q4_k", 256, 144),
            (QuantType::Q5K, "q5_k", 256, 176),
            (QuantType::Q6K, "q6_k", 256, 210),
        ];
        for (q, name, be, bb) in cases {
            let j = serde_json::to_string(&q).unwrap();
            assert_eq!(j, format!("{{\"kind\":\"{name}\"}}"));
            assert_eq!(serde_json::from_str::<QuantType>(&j).unwrap(), q);
            assert_eq!(q.name(), name);
            assert_eq!(q.ggml_block(), Some((be, bb)));
            assert_eq!(q.nbytes(3, be * 2), 3 * 2 * bb);
            assert!(q.check_cols(be * 5).is_ok());
            let e = q.check_cols(be + 16).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains(&be.to_string()), "{e}");
        }
        // Old manifests keep parsing.
        let old = r#"{"kind":"affine","bits":4,"group":64,"scale":"f16"}"#;
        assert_eq!(
            serde_json::from_str::<QuantType>(old).unwrap(),
            QuantType::Q4
        );
        assert_eq!(
            serde_json::from_str::<QuantType>(r#"{"kind":"bf16"}"#).unwrap(),
            QuantType::Bf16
        );
        assert_eq!(QuantType::F32.ggml_block(), None);
    }
}
