//! Borrowed views of stored tensors.

use crate::quant::{QuantType, ScaleType};
use crate::CoreError;

/// A `[rows, cols]` tensor in one of the [`QuantType`] layouts, borrowed from
/// wherever it lives (a mapped file, an expert slot, a test buffer).
/// 1-D tensors are `[1, n]`.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub qtype: QuantType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// Validates that `data` has exactly the bytes the layout needs.
    pub fn new(
        qtype: QuantType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, CoreError> {
        qtype.check_cols(cols)?;
        let need = qtype.nbytes(rows, cols);
        if data.len() != need {
            return Err(CoreError::Invalid(format!(
                "tensor [{rows}, {cols}] {} needs {need} bytes, got {}",
                qtype.name(),
                data.len()
            )));
        }
        Ok(TensorView {
            qtype,
            rows,
            cols,
            data,
        })
    }

    pub fn numel(&self) -> usize {
        self.rows * self.cols
    }

    /// Affine layout parts: (codes, scales, biases) byte slices.
    /// Panics if the view is not affine (a programming error, not input).
    pub fn affine_parts(&self) -> (&'a [u8], &'a [u8], &'a [u8]) {
        let QuantType::Affine { bits, group, .. } = self.qtype else {
            panic!("affine_parts on a {} tensor", self.qtype.name());
        };
        let codes = self.rows * self.cols * bits as usize / 8;
        let groups = self.rows * (self.cols / group as usize);
        let (c, rest) = self.data.split_at(codes);
        let (s, b) = rest.split_at(groups * 2);
        (c, s, b)
    }
}

/// Converts a stored scale/bias value to f32.
#[inline]
pub fn scale_to_f32(ty: ScaleType, bytes: [u8; 2]) -> f32 {
    let bits = u16::from_le_bytes(bytes);
    match ty {
        ScaleType::F16 => half::f16::from_bits(bits).to_f32(),
        ScaleType::Bf16 => half::bf16::from_bits(bits).to_f32(),
    }
}

/// Bytes that a [`Tensor`] can share: a mapped file, a `Vec<u8>`, ...
pub type SharedBytes = std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>;

/// An owned, cheaply clonable tensor: shared bytes plus its layout.
#[derive(Clone)]
pub struct Tensor {
    pub qtype: QuantType,
    pub rows: usize,
    pub cols: usize,
    bytes: SharedBytes,
    start: usize,
    len: usize,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor[{}, {}] {}",
            self.rows,
            self.cols,
            self.qtype.name()
        )
    }
}

impl Tensor {
    /// A tensor over `bytes[start..start + len]`, validated against the layout.
    pub fn new(
        qtype: QuantType,
        rows: usize,
        cols: usize,
        bytes: SharedBytes,
        start: usize,
        len: usize,
    ) -> Result<Self, CoreError> {
        let total = (*bytes).as_ref().len();
        if start.checked_add(len).is_none_or(|end| end > total) {
            return Err(CoreError::Invalid(
                "tensor extent outside its buffer".into(),
            ));
        }
        let t = Tensor {
            qtype,
            rows,
            cols,
            bytes,
            start,
            len,
        };
        TensorView::new(qtype, rows, cols, t.raw())?;
        Ok(t)
    }

    /// An f32 tensor owning `values` (`[rows, cols]` row-major).
    pub fn from_f32(rows: usize, cols: usize, values: Vec<f32>) -> Result<Self, CoreError> {
        let bytes: Vec<u8> = bytemuck::cast_slice(&values).to_vec();
        let len = bytes.len();
        Tensor::new(
            QuantType::F32,
            rows,
            cols,
            std::sync::Arc::new(bytes),
            0,
            len,
        )
    }

    fn raw(&self) -> &[u8] {
        &(*self.bytes).as_ref()[self.start..self.start + self.len]
    }

    pub fn view(&self) -> TensorView<'_> {
        TensorView {
            qtype: self.qtype,
            rows: self.rows,
            cols: self.cols,
            data: self.raw(),
        }
    }
}

/// The three projections of one routed expert.
#[derive(Debug, Clone, Copy)]
pub struct ExpertWeights<'a> {
    /// `[intermediate, hidden]`
    pub gate: TensorView<'a>,
    /// `[intermediate, hidden]`
    pub up: TensorView<'a>,
    /// `[hidden, intermediate]`
    pub down: TensorView<'a>,
}
