//! Shared vocabulary of slipstream: element types, quantization layouts,
//! tensor views over raw bytes, the normalised model configuration.
//!
//! Architecture invariant: this crate does no I/O and knows no file format;
//! everything downstream speaks these types.

pub mod config;
pub mod quant;
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

/// Error type crossing crate boundaries through the traits below.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Where a model gets its dense (non-expert) weights, by canonical name.
pub trait TensorSource {
    fn tensor(&self, name: &str) -> Result<Tensor, BoxError>;
    fn has_tensor(&self, name: &str) -> bool;
}

/// The only way a model reaches routed experts. Implementations decide where
/// the weights live (all resident, a bounded cache over the SSD, VRAM, ...);
/// none of them may change the numbers a model computes.
pub trait ExpertSource: Send {
    /// Calls `compute(expert, weights)` exactly once for every distinct id in
    /// `experts` of `layer`, in whatever order the weights become available.
    /// Callers must make their result independent of that order.
    fn with_experts(
        &mut self,
        layer: usize,
        experts: &[u32],
        compute: &mut dyn FnMut(u32, ExpertWeights<'_>),
    ) -> Result<(), BoxError>;
}
