//! Refusing weights that are not finite numbers: a NaN or an infinity in a
//! checkpoint (or in a quantized block's scale) repacks and runs today,
//! producing garbage tokens. Every tensor and expert part is dequantized
//! row by row through the kernels' own reference and checked before it is
//! written, so the check knows every storage type the runtime reads.

use rayon::prelude::*;
use slipstream_core::{QuantType, TensorView};
use slipstream_format::ExpertPart;

use crate::convert::PartSrc;
use crate::{RepackError, Result};

/// Checks the source floats of a tensor before it is converted (a
/// quantizer would turn a NaN into some finite code and hide it). Quantized
/// sources are checked after conversion by [`check_finite`].
pub(crate) fn check_source(name: &str, src: &PartSrc) -> Result<()> {
    let PartSrc::Float { dtype, data } = *src else {
        return Ok(());
    };
    // Non-finite means every exponent bit set, in each float format.
    let (size, exponent): (usize, u32) = match dtype {
        safetensors::Dtype::F32 => (4, 0x7f80_0000),
        safetensors::Dtype::BF16 => (2, 0x7f80),
        safetensors::Dtype::F16 => (2, 0x7c00),
        _ => return Ok(()),
    };
    let bits = |b: &[u8]| {
        if size == 4 {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]])
        } else {
            u16::from_le_bytes([b[0], b[1]]) as u32
        }
    };
    let found = data
        .par_chunks(size * 4096)
        .enumerate()
        .find_map_first(|(chunk, bytes)| {
            bytes
                .chunks_exact(size)
                .position(|b| bits(b) & exponent == exponent)
                .map(|i| chunk * 4096 + i)
        });
    match found {
        None => Ok(()),
        Some(i) => Err(RepackError::UnexpectedTensor {
            name: name.to_string(),
            message: format!(
                "element {i} is not a finite number (NaN or infinity) in the checkpoint"
            ),
        }),
    }
}

/// Checks that every value of a `[rows, cols]` tensor stored as `qtype` in
/// `bytes` is finite; the error names the tensor, its row and column.
pub(crate) fn check_finite(
    name: &str,
    qtype: QuantType,
    [rows, cols]: [usize; 2],
    bytes: &[u8],
) -> Result<()> {
    let view =
        TensorView::new(qtype, rows, cols, bytes).map_err(|e| RepackError::UnexpectedTensor {
            name: name.to_string(),
            message: e.to_string(),
        })?;
    let bad = (0..rows).into_par_iter().find_map_first(|r| {
        let mut row = vec![0f32; cols];
        slipstream_kernels::dequantize_row(&view, r, &mut row);
        row.iter()
            .position(|v| !v.is_finite())
            .map(|c| (r, c, row[c]))
    });
    match bad {
        None => Ok(()),
        Some((r, c, v)) => Err(RepackError::UnexpectedTensor {
            name: name.to_string(),
            message: format!(
                "holds {v} at row {r}, column {c}: the checkpoint's weights are not finite numbers"
            ),
        }),
    }
}

/// [`check_finite`] for the three parts of expert `expert` of `layer`.
pub(crate) fn check_expert_finite(
    layer: usize,
    expert: usize,
    layout: &[ExpertPart],
    parts: &[&[u8]],
) -> Result<()> {
    for (part, bytes) in layout.iter().zip(parts) {
        check_finite(
            &format!("expert {expert} of layer {layer}, {}", part.name),
            part.qtype,
            part.shape,
            bytes,
        )?;
    }
    Ok(())
}
