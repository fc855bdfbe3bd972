//! Plain descriptors passed to the kernels: weight matrices ([`WDesc`],
//! `struct W` in the kernels), device routing's tables ([`RouteBases`]) and
//! where a kernel reads the token's position from ([`Position`]).

use slipstream_core::{QuantType, ScaleType};

use crate::{CudaError, DevPtr, Result};

/// Weight kinds the kernels know (`QT_*` in common.cuh).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum QKind {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
    Affine4 = 3,
    Affine8 = 4,
    Q4_0 = 5,
    Q8_0 = 6,
    Q4K = 7,
    Q5K = 8,
    Q6K = 9,
}

/// A weight matrix as the kernels see it (`struct W` in common.cuh).
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
pub struct WDesc {
    pub codes: DevPtr,
    pub scales: DevPtr,
    pub biases: DevPtr,
    pub rows: i32,
    pub cols: i32,
    pub qt: i32,
    pub group: i32,
    pub scale_bf16: i32,
    pub pad: i32,
}

// SAFETY: plain repr(C) data matching `struct W` in common.cuh.
unsafe impl cudarc::driver::DeviceRepr for WDesc {}

impl WDesc {
    /// The descriptor of a `[rows, cols]` tensor of `qtype` stored at device
    /// address `base` (affine: codes, scales, biases back to back).
    pub fn new(qtype: QuantType, rows: usize, cols: usize, base: DevPtr) -> Result<WDesc> {
        // GGML blocks (GGUF import): whole blocks per row, on the generic
        // kernels; `group` carries the block's elements.
        let ggml = |k: QKind| {
            let be = qtype.ggml_block().map_or(1, |(be, _)| be);
            if !cols.is_multiple_of(be) {
                return Err(CudaError::Invalid(format!(
                    "{} rows of {cols} values are not whole blocks of {be}",
                    qtype.name()
                )));
            }
            Ok((k, be, false, qtype.nbytes(rows, cols), 0))
        };
        let (qt, group, sbf, cb, sb) = match qtype {
            QuantType::F32 => (QKind::F32, 0, false, 0, 0),
            QuantType::F16 => (QKind::F16, 0, false, 0, 0),
            QuantType::Bf16 => (QKind::Bf16, 0, false, 0, 0),
            QuantType::Affine { bits, group, scale } => {
                let g = group as usize;
                if !cols.is_multiple_of(g) || !g.is_multiple_of(8) {
                    return Err(CudaError::Invalid(format!(
                        "affine group {g} does not divide row length {cols}"
                    )));
                }
                let k = match bits {
                    4 => QKind::Affine4,
                    8 => QKind::Affine8,
                    b => {
                        return Err(CudaError::Invalid(format!(
                            "{b}-bit weights are not supported"
                        )))
                    }
                };
                let cb = rows * cols * bits as usize / 8;
                let sb = rows * (cols / g) * 2;
                (k, g, scale == ScaleType::Bf16, cb, sb)
            }
            QuantType::Q4_0 => ggml(QKind::Q4_0)?,
            QuantType::Q8_0 => ggml(QKind::Q8_0)?,
            QuantType::Q4K => ggml(QKind::Q4K)?,
            QuantType::Q5K => ggml(QKind::Q5K)?,
            QuantType::Q6K => ggml(QKind::Q6K)?,
        };
        Ok(WDesc {
            codes: base,
            scales: base.add_bytes(cb),
            biases: base.add_bytes(cb + sb),
            rows: rows as i32,
            cols: cols as i32,
            qt: qt as i32,
            group: group as i32,
            scale_bf16: sbf as i32,
            pad: 0,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows as usize
    }

    /// For affine 4-bit weights: the words each lane loads per step in the
    /// multi-row kernels (4, 2 or 1: 16-byte loads where the group and the
    /// row length allow). `None` for other kinds.
    pub fn a4_words(&self) -> Option<i32> {
        if self.qt != QKind::Affine4 as i32 {
            return None;
        }
        let (g, c) = (self.group, self.cols);
        Some(if g % 32 == 0 && c / 32 >= 32 {
            4
        } else if g % 16 == 0 && c / 16 >= 32 {
            2
        } else {
            1
        })
    }
    pub fn cols(&self) -> usize {
        self.cols as usize
    }

    /// For affine 4-bit weights that the wide ("a4v") kernels take: the
    /// 16-byte chunks (32 codes, one scale) each lane owns per row, 1, 2 or
    /// 4. They need `group` a power of two >= 32 and `cols = 32 * S` with S a power of
    /// two up to 32 (one chunk per lane, 32 / S rows per warp step) or
    /// `S = 32 * C`; codes 16-byte aligned (checked for dense weights;
    /// expert parts sit at 256-byte offsets). `None`: the older kernels.
    pub fn a4v_chunks(&self) -> Option<usize> {
        if self.qt != QKind::Affine4 as i32
            || self.group % 32 != 0
            || !(self.group as u32).is_power_of_two()
            || self.cols % 32 != 0
        {
            return None;
        }
        let s = (self.cols / 32) as usize;
        match s {
            1..=31 if 32usize.is_multiple_of(s) => Some(1),
            32 | 64 | 128 => Some(s / 32),
            _ => None,
        }
    }

    /// Rows a 256-thread block of the wide kernels covers: 8 warps x
    /// (32 / lanes per row) x rows per lane (`r_lane`).
    pub(crate) fn a4v_block_rows(&self, r_lane: usize) -> usize {
        let s = self.cols() / 32;
        8 * (32 / s.min(32)) * r_lane
    }

    /// Dynamic shared memory of the wide kernels for `rows_x` x rows of
    /// `cols` floats, padded 4 floats per 32, then one sum per 32.
    pub(crate) fn a4v_smem(&self, rows_x: usize) -> u32 {
        (rows_x * self.cols() / 32 * 37 * 4) as u32
    }
}

/// Device routing for [`Gpu::router_topk`]: `addr` holds one u64 device
/// address per expert (its VRAM record); for token t's routed experts in
/// rank order r the kernel writes, with `p = t k + r` over `T` tokens,
/// `out[p] = addr[id] + offsets[0]`, `out[T k + p] = addr[id] + offsets[1]`,
/// `out[2 T k + p] = addr[id] + offsets[2]` (gate, up, down: the table
/// [`Gpu::moe_experts`] reads).
#[derive(Debug, Clone, Copy)]
pub struct RouteBases {
    pub addr: DevPtr,
    pub offsets: [u64; 3],
    pub out: DevPtr,
}

/// Where a decode kernel takes the token's position from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Position {
    /// An argument of the launch (the launch is for this position only).
    Host(usize),
    /// The i32 at device address `ptr`, read when the kernel runs, so a
    /// launch captured in a CUDA graph replays at every position below
    /// `cap` (the KV cache's rows; attention grids are sized for it).
    Device { ptr: DevPtr, cap: usize },
}

#[cfg(test)]
mod tests {
    use super::{DevPtr, QKind, WDesc};
    use slipstream_core::QuantType;

    #[test]
    fn ggml_descriptors_take_whole_blocks_only() {
        let w = WDesc::new(QuantType::Q4K, 3, 512, DevPtr::from_raw(1000)).unwrap();
        assert_eq!(
            (w.qt, w.group, w.rows(), w.cols()),
            (QKind::Q4K as i32, 256, 3, 512)
        );
        assert_eq!(w.codes, DevPtr::from_raw(1000));
        let q = WDesc::new(QuantType::Q4_0, 2, 64, DevPtr::NULL).unwrap();
        assert_eq!((q.qt, q.group), (QKind::Q4_0 as i32, 32));
        for (t, cols) in [
            (QuantType::Q4K, 100usize),
            (QuantType::Q6K, 128),
            (QuantType::Q8_0, 48),
        ] {
            assert!(
                WDesc::new(t, 1, cols, DevPtr::NULL).is_err(),
                "{} of {cols} columns",
                t.name()
            );
        }
    }
}
