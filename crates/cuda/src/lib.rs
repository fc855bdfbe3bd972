//! CUDA backend: decode kernels compiled at run time by NVRTC
//! (`kernels/decode.cu`), device buffers, and [`CudaModel`], the CUDA
//! implementation of the model's [`slipstream_models::Backend`] with dense
//! weights resident in VRAM and a per-layer VRAM expert cache.
//!
//! Nothing here links against CUDA: the driver and NVRTC are loaded
//! dynamically (cudarc `dynamic-loading`), so the crate builds and its tests
//! skip cleanly on machines without a GPU. Call [`available`] before
//! [`Gpu::new`].
//!
//! Device addresses are passed to kernels as `u64`; every buffer is a
//! [`DBuf`] whose size the wrappers check before a launch.

/// Packs kernel arguments (each a `&T: DeviceRepr` local) into the
/// pointer array `cuLaunchKernel` takes.
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        [$(($a) as *const _ as *mut std::ffi::c_void),*]
    };
}

mod desc;
mod device;
mod model;
mod ops;
mod options;

pub use desc::{Position, QKind, RouteBases, WDesc};
pub use device::{
    available, bytemuck_f32, compile_kernels, probe, DBuf, DWeight, Gpu, Mapped, MOE_MIN_BLOCKS,
};
pub use model::{CudaModel, CudaOptions, CudaStats};
pub use ops::attention::{ATT_CHUNK, ATT_MAXG, PA_SPLIT};
pub use ops::matvec::A4V_TOKENS_PER_BLOCK;
pub use ops::sample::SampleScratch;
pub use options::{CudaTuning, GdnForm, TensorCoreUse};

/// The kernel source, compiled by NVRTC when a [`Gpu`] is created.
pub const KERNELS: &str = include_str!("kernels/decode.cu");

/// Errors of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("NVRTC could not compile the kernels: {0}")]
    Compile(String),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, CudaError>;
