//! Model architectures on the CPU kernels.
//!
//! Architecture invariant: models never touch files, sockets or caches. They
//! get dense weights through [`TensorSource`] and routed experts only through
//! [`slipstream_core::ExpertSource`], and every number they compute is
//! independent of chunk size, thread count and expert arrival order.

pub mod backend;
pub mod blocks;
pub mod loader;
pub mod mtp;
pub mod ops;
pub mod qwen3_5_moe;
pub mod qwen3_moe;
pub mod speculative;
pub mod state;
pub mod transformer;

use slipstream_core::{Architecture, BoxError, ModelConfig, TensorSource};

pub use backend::{Backend, CpuBackend, NormKind};
pub use blocks::Route;
pub use mtp::{MtpHead, MtpOutput, MtpState};
pub use speculative::{StateTrail, VerifyPass};
pub use state::ModelState;
pub use transformer::{Logits, RouteObserver, Transformer};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("weights: {0}")]
    Weight(String),
    #[error("config: {0}")]
    Config(String),
    #[error("token id {token} is outside the vocabulary (size {vocab})")]
    Token { token: u32, vocab: usize },
    #[error("state: {0}")]
    State(String),
    #[error("expert store: {0}")]
    Store(BoxError),
}

/// Builds the model for `cfg.architecture` from `src`.
pub fn load(cfg: &ModelConfig, src: &dyn TensorSource) -> Result<Transformer, ModelError> {
    cfg.validate()
        .map_err(|e| ModelError::Config(e.to_string()))?;
    match cfg.architecture {
        Architecture::Qwen35Moe | Architecture::Qwen3Next => qwen3_5_moe::load(cfg, src),
        Architecture::Qwen3Moe => qwen3_moe::load(cfg, src),
    }
}
