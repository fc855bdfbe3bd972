//! Exact conversion of `Q4_0` and `Q8_0` blocks to the affine layout.
//!
//! A `Q4_0` block is `d * (q - 8)` over 32 elements: affine 4-bit, group 32,
//! scale `d`, bias `-8 d`. A `Q8_0` block is `d * q` with `q` an `i8`: affine
//! 8-bit, group 32, codes `q + 128`, scale `d`, bias `-128 d`. Both biases are
//! `d` times a power of two, so they are exact f16 values unless the product
//! leaves the f16 range; [`converts_exactly`] checks that for every block.
//!
//! Exactness: with `d` an f16 (11 significant bits) and codes of at most
//! 8 bits, `scale * code` and `d * (q - 8)` (or `d * q`) are exact in f32,
//! and so is `scale * code + bias`, whose value is representable. The
//! affine reference therefore dequantizes to the same f32 numbers as the
//! GGML reference. The one difference is the sign of a zero: where GGML
//! computes `d * 0` with a negative `d` (or `+0 * negative`) it gets `-0.0`,
//! the affine form `x + (-x)` gives `+0.0`; the two compare equal and no
//! product or sum over a row tells them apart unless every term is zero.

use slipstream_core::{QuantType, ScaleType};

/// Elements per group of the converted layout (one GGML block).
pub const GROUP: u32 = 32;

/// The affine layout `q` converts to exactly: `Q4_0` -> 4-bit and `Q8_0` ->
/// 8-bit, group 32, f16 scales. `None` for every other type.
pub fn affine_of(q: QuantType) -> Option<QuantType> {
    let bits = match q {
        QuantType::Q4_0 => 4,
        QuantType::Q8_0 => 8,
        _ => return None,
    };
    Some(QuantType::Affine {
        bits,
        group: GROUP,
        scale: ScaleType::F16,
    })
}

/// `(code offset, block bytes)` of `Q4_0` / `Q8_0`: the bias is `-offset * d`.
fn offset_and_block(q: QuantType) -> Option<(f32, usize)> {
    match q {
        QuantType::Q4_0 => Some((8.0, 18)),
        QuantType::Q8_0 => Some((128.0, 34)),
        _ => None,
    }
}

/// The bias `-offset * d` as f16 bits when it is exact and finite (and `d`
/// finite), else `None`.
fn exact_bias(d: half::f16, offset: f32) -> Option<half::f16> {
    if !d.is_finite() {
        return None;
    }
    // Exact in f32: `d` has 11 significant bits and `offset` is a power of two.
    let b = -offset * d.to_f32();
    let b16 = half::f16::from_f32(b);
    (b16.is_finite() && b16.to_f32() == b).then_some(b16)
}

/// Whether every block of `blocks` (whole `Q4_0` or `Q8_0` blocks) has a
/// finite `d` whose bias `-8 d` / `-128 d` is an exact finite f16. `false`
/// for any other type or a length that is not whole blocks.
pub fn converts_exactly(q: QuantType, blocks: &[u8]) -> bool {
    let Some((offset, bb)) = offset_and_block(q) else {
        return false;
    };
    blocks.len().is_multiple_of(bb)
        && blocks
            .chunks_exact(bb)
            .all(|b| exact_bias(half::f16::from_le_bytes([b[0], b[1]]), offset).is_some())
}

/// `blocks` (a `[rows, cols]` tensor of `Q4_0` or `Q8_0`, rows back to back)
/// in the layout [`affine_of`] names, with the same `[rows, cols]` shape:
/// codes, then one f16 scale per block, then one f16 bias per block. GGML
/// blocks and affine groups both run row-major, so block `i` of the tensor
/// becomes group `i`. `None` unless [`converts_exactly`].
pub fn to_affine(q: QuantType, blocks: &[u8]) -> Option<(QuantType, Vec<u8>)> {
    let target = affine_of(q)?;
    let (offset, bb) = offset_and_block(q)?;
    if !converts_exactly(q, blocks) {
        return None;
    }
    let nb = blocks.len() / bb;
    let code_bytes = if q == QuantType::Q4_0 { 16 } else { 32 };
    let mut out = vec![0u8; nb * (code_bytes + 4)];
    let (codes, rest) = out.split_at_mut(nb * code_bytes);
    let (scales, biases) = rest.split_at_mut(nb * 2);
    for (i, b) in blocks.chunks_exact(bb).enumerate() {
        let d = half::f16::from_le_bytes([b[0], b[1]]);
        let bias = exact_bias(d, offset)?;
        scales[2 * i..2 * i + 2].copy_from_slice(&d.to_le_bytes());
        biases[2 * i..2 * i + 2].copy_from_slice(&bias.to_le_bytes());
        let c = &mut codes[i * code_bytes..(i + 1) * code_bytes];
        if q == QuantType::Q4_0 {
            // GGML: byte j holds element j (low nibble) and j + 16 (high).
            // Affine: byte k holds element 2k (low) and 2k + 1 (high).
            let qs = &b[2..18];
            let nib = |e: usize| {
                if e < 16 {
                    qs[e] & 0xF
                } else {
                    qs[e - 16] >> 4
                }
            };
            for (k, o) in c.iter_mut().enumerate() {
                *o = nib(2 * k) | (nib(2 * k + 1) << 4);
            }
        } else {
            // i8 `q` -> unsigned code `q + 128`: flip the sign bit.
            for (o, &v) in c.iter_mut().zip(&b[2..34]) {
                *o = v ^ 0x80;
            }
        }
    }
    Some((target, out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dequantize_row;
    use proptest::prelude::*;
    use slipstream_core::TensorView;

    /// f16 bits of the extreme scales: zeros, smallest and largest
    /// subnormals, smallest normal, the largest exact ones, max f16, inf, NaN.
    const EXTREME_D: [u16; 14] = [
        0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x8400, 0x6FFF, 0x7000, 0x5FFF, 0x7BFF,
        0xFBFF, 0x7C00, 0x7E00,
    ];

    /// `rows` x `nb` random blocks of `q`; each `d` random bits or, when
    /// `extreme`, one of [`EXTREME_D`].
    fn blocks(q: QuantType, rows: usize, nb: usize, seed: u64, extreme: bool) -> Vec<u8> {
        let (_, bb) = offset_and_block(q).unwrap();
        let mut s = seed | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut out = vec![0u8; rows * nb * bb];
        for b in out.chunks_exact_mut(bb) {
            let r = next();
            let d = if extreme {
                EXTREME_D[(r % EXTREME_D.len() as u64) as usize]
            } else {
                // Mostly the scales real files hold (|d| < 1), some any bits.
                if r % 4 == 0 {
                    (r >> 8) as u16
                } else {
                    ((r >> 8) as u16) & 0xBBFF
                }
            };
            b[..2].copy_from_slice(&d.to_le_bytes());
            for v in &mut b[2..] {
                *v = next() as u8;
            }
        }
        out
    }

    fn check(q: QuantType, rows: usize, nb: usize, seed: u64, extreme: bool) {
        let cols = nb * 32;
        let data = blocks(q, rows, nb, seed, extreme);
        let exact = converts_exactly(q, &data);
        let Some((aq, adata)) = to_affine(q, &data) else {
            assert!(!exact, "to_affine refused an exact tensor");
            return;
        };
        assert!(exact);
        assert_eq!(aq, affine_of(q).unwrap());
        let g = TensorView::new(q, rows, cols, &data).unwrap();
        let a = TensorView::new(aq, rows, cols, &adata).unwrap();
        let (mut yg, mut ya) = (vec![0f32; cols], vec![0f32; cols]);
        for r in 0..rows {
            dequantize_row(&g, r, &mut yg);
            dequantize_row(&a, r, &mut ya);
            for (j, (x, y)) in yg.iter().zip(&ya).enumerate() {
                // Same bits, except that a zero's sign may differ (module doc).
                assert!(
                    x.to_bits() == y.to_bits() || (*x == 0.0 && *y == 0.0),
                    "{} row {r} col {j}: ggml {x:e} affine {y:e}",
                    q.name()
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn conversion_dequantizes_to_the_same_values(
            q8 in any::<bool>(),
            rows in 1usize..5,
            nb in 1usize..6,
            seed in any::<u64>(),
            extreme in any::<bool>(),
        ) {
            let q = if q8 { QuantType::Q8_0 } else { QuantType::Q4_0 };
            check(q, rows, nb, seed, extreme);
        }
    }

    #[test]
    fn every_extreme_scale_converts_or_is_refused_as_documented() {
        for q in [QuantType::Q4_0, QuantType::Q8_0] {
            let (offset, bb) = offset_and_block(q).unwrap();
            for &d in &EXTREME_D {
                let mut b = vec![0x5Au8; bb];
                b[..2].copy_from_slice(&d.to_le_bytes());
                let d = half::f16::from_bits(d);
                let fits = d.is_finite() && (offset * d.to_f32().abs()) <= 65504.0;
                assert_eq!(converts_exactly(q, &b), fits, "{} d {d}", q.name());
                assert_eq!(to_affine(q, &b).is_some(), fits);
                // One overflowing block anywhere refuses the whole tensor.
                let mut two = blocks(q, 1, 1, 7, false);
                two[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
                two.extend_from_slice(&b);
                assert_eq!(to_affine(q, &two).is_some(), fits);
                check(q, 1, 1, d.to_bits() as u64 + 1, true);
            }
        }
        // The largest scales that still convert, and the first that does not.
        assert!(converts_exactly(
            QuantType::Q4_0,
            &[0xFF, 0x6F, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        ));
        assert!(!converts_exactly(
            QuantType::Q4_0,
            &[0x00, 0x70, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        ));
        assert!(!converts_exactly(QuantType::Q4K, &[0u8; 144]));
        assert!(!converts_exactly(QuantType::Q8_0, &[0u8; 33]));
    }
}
