//! Element conversions and encoding of one tensor into its stored layout.

use half::{bf16, f16};
use rayon::prelude::*;
use safetensors::Dtype;
use slipstream_core::QuantType;

/// Elements converted per parallel work item (4 MiB of f32).
const CHUNK: usize = 1 << 20;

/// Where the bytes of one output tensor (or one expert part) come from.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PartSrc<'a> {
    /// Little-endian floats (F32, BF16 or F16), row-major `[rows, cols]`.
    Float { dtype: Dtype, data: &'a [u8] },
    /// Already in our affine layout (MLX): copied bit-exactly.
    Quant {
        qtype: QuantType,
        codes: &'a [u8],
        scales: &'a [u8],
        biases: &'a [u8],
    },
}

impl PartSrc<'_> {
    pub fn bytes(&self) -> u64 {
        match self {
            PartSrc::Float { data, .. } => data.len() as u64,
            PartSrc::Quant {
                codes,
                scales,
                biases,
                ..
            } => (codes.len() + scales.len() + biases.len()) as u64,
        }
    }
}

pub(crate) fn dtype_bytes(dtype: Dtype) -> usize {
    dtype.bitsize() / 8
}

/// Decodes little-endian `dtype` elements into `out`, adding 1 when `shift`.
pub(crate) fn decode_into(dtype: Dtype, bytes: &[u8], out: &mut [f32], shift: bool) {
    let add = if shift { 1.0f32 } else { 0.0f32 };
    match dtype {
        Dtype::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                *o = if shift { add + v } else { v };
            }
        }
        Dtype::BF16 => {
            // bf16 is the top half of an f32: exact, NaN payloads included.
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                let v = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
                *o = if shift { add + v } else { v };
            }
        }
        Dtype::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                let v = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                *o = if shift { add + v } else { v };
            }
        }
        other => unreachable!("decode of {other} (dtypes are checked when planning)"),
    }
}

/// Encodes a tensor into `qtype`'s byte layout. `shift` adds 1 to every
/// element (zero-centred norm weights). Quantized sources are copied.
pub(crate) fn encode(
    src: &PartSrc,
    rows: usize,
    cols: usize,
    qtype: QuantType,
    shift: bool,
) -> Vec<u8> {
    match *src {
        PartSrc::Quant {
            codes,
            scales,
            biases,
            ..
        } => {
            let mut out = Vec::with_capacity(codes.len() + scales.len() + biases.len());
            out.extend_from_slice(codes);
            out.extend_from_slice(scales);
            out.extend_from_slice(biases);
            out
        }
        PartSrc::Float { dtype, data } => encode_float(dtype, data, rows, cols, qtype, shift),
    }
}

fn encode_float(
    dtype: Dtype,
    data: &[u8],
    rows: usize,
    cols: usize,
    qtype: QuantType,
    shift: bool,
) -> Vec<u8> {
    let n = rows * cols;
    let esz = dtype_bytes(dtype);
    debug_assert_eq!(data.len(), n * esz);
    match qtype {
        QuantType::F32 | QuantType::Bf16 | QuantType::F16 => {
            let osz = if qtype == QuantType::F32 { 4 } else { 2 };
            let same = !shift
                && matches!(
                    (qtype, dtype),
                    (QuantType::F32, Dtype::F32)
                        | (QuantType::Bf16, Dtype::BF16)
                        | (QuantType::F16, Dtype::F16)
                );
            let mut out = vec![0u8; n * osz];
            out.par_chunks_mut(CHUNK * osz)
                .zip(data.par_chunks(CHUNK * esz))
                .for_each(|(o, s)| {
                    if same {
                        o.copy_from_slice(s);
                        return;
                    }
                    let mut tmp = vec![0f32; s.len() / esz];
                    decode_into(dtype, s, &mut tmp, shift);
                    match qtype {
                        QuantType::F32 => {
                            for (d, v) in o.chunks_exact_mut(4).zip(&tmp) {
                                d.copy_from_slice(&v.to_le_bytes());
                            }
                        }
                        QuantType::Bf16 => {
                            for (d, v) in o.chunks_exact_mut(2).zip(&tmp) {
                                d.copy_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes());
                            }
                        }
                        _ => {
                            for (d, v) in o.chunks_exact_mut(2).zip(&tmp) {
                                d.copy_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes());
                            }
                        }
                    }
                });
            out
        }
        QuantType::Affine { bits, group, scale } => {
            let group = group as usize;
            let rows_per = (CHUNK / cols.max(1)).max(1);
            let chunks: Vec<(usize, Vec<u8>)> = (0..rows.div_ceil(rows_per))
                .into_par_iter()
                .map(|k| {
                    let r0 = k * rows_per;
                    let r1 = (r0 + rows_per).min(rows);
                    let s = &data[r0 * cols * esz..r1 * cols * esz];
                    let mut vals = vec![0f32; (r1 - r0) * cols];
                    decode_into(dtype, s, &mut vals, shift);
                    let q = slipstream_kernels::quantize::quantize_affine(
                        &vals,
                        r1 - r0,
                        cols,
                        bits,
                        group,
                        scale,
                    );
                    (r0, q)
                })
                .collect();
            // Each chunk is [codes | scales | biases] for its rows; the whole
            // tensor wants all codes, then all scales, then all biases.
            let code_row = cols * bits as usize / 8;
            let scale_row = (cols / group) * 2;
            let codes_total = rows * code_row;
            let scales_total = rows * scale_row;
            let mut out = vec![0u8; qtype.nbytes(rows, cols)];
            for (r0, q) in chunks {
                let nr = q.len() / (code_row + 2 * scale_row);
                let (c, rest) = q.split_at(nr * code_row);
                let (s, b) = rest.split_at(nr * scale_row);
                out[r0 * code_row..][..c.len()].copy_from_slice(c);
                out[codes_total + r0 * scale_row..][..s.len()].copy_from_slice(s);
                out[codes_total + scales_total + r0 * scale_row..][..b.len()].copy_from_slice(b);
            }
            out
        }
        QuantType::Q4_0 | QuantType::Q8_0 | QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => {
            // GGML block rows are self-contained: quantize row chunks independently.
            let rows_per = (CHUNK / cols.max(1)).max(1);
            let chunks: Vec<Vec<u8>> = (0..rows.div_ceil(rows_per))
                .into_par_iter()
                .map(|k| {
                    let r0 = k * rows_per;
                    let r1 = (r0 + rows_per).min(rows);
                    let mut vals = vec![0f32; (r1 - r0) * cols];
                    decode_into(
                        dtype,
                        &data[r0 * cols * esz..r1 * cols * esz],
                        &mut vals,
                        shift,
                    );
                    slipstream_kernels::quantize::from_f32(&vals, r1 - r0, cols, qtype)
                })
                .collect();
            chunks.concat()
        }
    }
}

/// Rows taken from a fused tensor laid out `[groups, group_rows, cols]`:
/// for each `(start, len)` of `takes` in turn, rows `start..start + len` of
/// every group. Qwen3-Next's `in_proj_qkvz` holds `[q dk, k dk, v r*dv,
/// z r*dv]` rows per key head: the canonical `in_proj_qkv` is the takes
/// `(0, dk), (dk, dk), (2dk, r*dv)` (all q heads, all k heads, all v heads)
/// and `in_proj_z` the take `(2dk + r*dv, r*dv)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RowPick {
    pub groups: usize,
    pub group_rows: usize,
    pub takes: Vec<(usize, usize)>,
}

/// A [`PartSrc`] with its bytes owned (the rows a [`RowPick`] gathered).
pub(crate) enum OwnedSrc {
    Float {
        dtype: Dtype,
        data: Vec<u8>,
    },
    Quant {
        qtype: QuantType,
        codes: Vec<u8>,
        scales: Vec<u8>,
        biases: Vec<u8>,
    },
}

impl OwnedSrc {
    pub fn as_src(&self) -> PartSrc<'_> {
        match self {
            OwnedSrc::Float { dtype, data } => PartSrc::Float {
                dtype: *dtype,
                data,
            },
            OwnedSrc::Quant {
                qtype,
                codes,
                scales,
                biases,
            } => PartSrc::Quant {
                qtype: *qtype,
                codes,
                scales,
                biases,
            },
        }
    }
}

impl RowPick {
    /// Rows of the fused source tensor.
    pub fn source_rows(&self) -> usize {
        self.groups * self.group_rows
    }

    /// Source row of each output row, in output order.
    pub fn rows(&self) -> Vec<usize> {
        let mut v = Vec::new();
        for &(start, len) in &self.takes {
            for g in 0..self.groups {
                v.extend((start..start + len).map(|r| g * self.group_rows + r));
            }
        }
        v
    }

    /// The picked rows of `src`, a whole fused tensor of [`Self::source_rows`]
    /// rows. Float rows and the code, scale and bias rows of an affine
    /// tensor are independent, so rows move whole and values are unchanged.
    pub fn apply(&self, src: &PartSrc) -> OwnedSrc {
        let n = self.source_rows().max(1);
        let rows = self.rows();
        let gather = |bytes: &[u8]| -> Vec<u8> {
            let rb = bytes.len() / n;
            let mut out = Vec::with_capacity(rows.len() * rb);
            for &r in &rows {
                out.extend_from_slice(&bytes[r * rb..(r + 1) * rb]);
            }
            out
        };
        match *src {
            PartSrc::Float { dtype, data } => OwnedSrc::Float {
                dtype,
                data: gather(data),
            },
            PartSrc::Quant {
                qtype,
                codes,
                scales,
                biases,
            } => OwnedSrc::Quant {
                qtype,
                codes: gather(codes),
                scales: gather(scales),
                biases: gather(biases),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Qwen3-Next split, checked against transformers'
    /// `fix_query_key_value_ordering` written out by hand for 2 key heads,
    /// dk 1, 2 value heads per key head, dv 1: per key head the fused rows
    /// are [q, k, v0, v1, z0, z1].
    #[test]
    fn qwen3_next_split_matches_the_reference_ordering() {
        let (nk, dk, r, dv) = (2, 1, 2, 1);
        let per = 2 * dk + 2 * r * dv;
        let qkv = RowPick {
            groups: nk,
            group_rows: per,
            takes: vec![(0, dk), (dk, dk), (2 * dk, r * dv)],
        };
        let z = RowPick {
            groups: nk,
            group_rows: per,
            takes: vec![(2 * dk + r * dv, r * dv)],
        };
        // q0 q1 | k0 k1 | v(h0) v(h1) v(h2) v(h3): value heads 2k, 2k+1 of key head k.
        assert_eq!(qkv.rows(), vec![0, 6, 1, 7, 2, 3, 8, 9]);
        assert_eq!(z.rows(), vec![4, 5, 10, 11]);
        // Float rows of 2 f32 columns move whole.
        let data: Vec<u8> = (0..12 * 2).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let OwnedSrc::Float { data: got, .. } = z.apply(&PartSrc::Float {
            dtype: Dtype::F32,
            data: &data,
        }) else {
            panic!("float in, float out")
        };
        let vals: Vec<f32> = got
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(vals, vec![8., 9., 10., 11., 20., 21., 22., 23.]);
        // Affine rows: codes, scales and biases gathered row by row.
        let (codes, scales, biases) = ([0u8, 1, 2, 3], [10u8, 11, 12, 13], [20u8, 21, 22, 23]);
        let ba = RowPick {
            groups: 2,
            group_rows: 2,
            takes: vec![(1, 1)],
        };
        let OwnedSrc::Quant {
            codes: c,
            scales: s,
            biases: b,
            ..
        } = ba.apply(&PartSrc::Quant {
            qtype: QuantType::F32,
            codes: &codes,
            scales: &scales,
            biases: &biases,
        })
        else {
            panic!("quant in, quant out")
        };
        assert_eq!((c, s, b), (vec![1, 3], vec![11, 13], vec![21, 23]));
    }
}
