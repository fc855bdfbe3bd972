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
