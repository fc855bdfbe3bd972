//! Shared vocabulary of slipstream: element types, quantization layouts,
//! tensor views over raw bytes, the normalised model configuration.
//!
//! Architecture invariant: this crate does no I/O and knows no file format;
//! everything downstream speaks these types.

pub mod config;
pub mod quant;
pub mod schema;
pub mod size;
pub mod tensor;

pub use config::{Architecture, ModelConfig};
pub use quant::{QuantType, ScaleType};
pub use tensor::TensorView;

/// Errors shared by every crate that validates shapes or layouts.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("shape mismatch for {what}: expected {expected:?}, found {found:?}")]
    Shape {
        what: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{0}")]
    Invalid(String),
}

pub use tensor::{ExpertWeights, SharedBytes, Tensor};

/// Experts handed over together by [`ExpertSource::with_expert_batches`]:
/// `(expert id, weights)` pairs.
pub type ExpertBatch<'a> = [(u32, ExpertWeights<'a>)];

/// Error type crossing crate boundaries through the traits below.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Where a model gets its dense (non-expert) weights, by canonical name.
pub trait TensorSource {
    fn tensor(&self, name: &str) -> Result<Tensor, BoxError>;
    fn has_tensor(&self, name: &str) -> bool;
}

/// One layer's expert demand for a batch of tokens (a decode step or a
/// prefill chunk).
#[derive(Debug, Clone, Copy)]
pub struct ExpertRequest<'a> {
    pub layer: usize,
    /// Distinct expert ids, ascending.
    pub experts: &'a [u32],
    /// `counts[i]`: tokens of the batch routed to `experts[i]`.
    pub counts: &'a [u32],
    /// Tokens in the batch.
    pub tokens: u32,
}

/// The only way a model reaches routed experts. Implementations decide where
/// the weights live (all resident, a bounded cache over the SSD, VRAM, ...);
/// none of them may change the numbers a model computes.
pub trait ExpertSource: Send {
    /// Announces the experts the next [`ExpertSource::with_experts`] call of
    /// this layer will need, so reads can start while the caller computes
    /// something else (the shared expert). Optional.
    fn begin(&mut self, _request: &ExpertRequest<'_>) -> Result<(), BoxError> {
        Ok(())
    }

    /// Calls `compute(expert, weights)` exactly once for every id in
    /// `request.experts`, in whatever order the weights become available.
    /// Callers must make their result independent of that order.
    fn with_experts(
        &mut self,
        request: &ExpertRequest<'_>,
        compute: &mut dyn FnMut(u32, ExpertWeights<'_>),
    ) -> Result<(), BoxError>;

    /// [`ExpertSource::with_experts`] that hands over every expert that is
    /// ready at the same time as one batch (e.g. all cache hits), so the
    /// caller can compute them in parallel. Every id in `request.experts`
    /// appears in exactly one batch; batches come in whatever order the
    /// weights become available. The default delivers batches of one.
    fn with_expert_batches(
        &mut self,
        request: &ExpertRequest<'_>,
        compute: &mut dyn FnMut(&ExpertBatch<'_>),
    ) -> Result<(), BoxError> {
        self.with_experts(request, &mut |e, w| compute(&[(e, w)]))
    }
}
