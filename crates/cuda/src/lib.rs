//! CUDA backend: kernels compiled at run time by NVRTC, device buffers,
//! and [`CudaModel`], the CUDA implementation of the model's
//! [`slipstream_models::Backend`] with dense weights resident in VRAM and
//! a per-layer VRAM expert cache.
//!
//! Layout: `device` (context, streams, allocation, copies, launches),
//! `desc` (the descriptors kernels take), `options` ([`CudaTuning`]: every
//! tuning switch, built by the caller), `ops/` (the `impl Gpu` launch
//! wrappers by op family), `model/` ([`CudaModel`]), `kernels/` (the CUDA
//! source by family, concatenated in a fixed order into one NVRTC unit,
//! [`KERNELS`]).
//!
//! Nothing here links against CUDA: the driver and NVRTC are loaded
//! dynamically (cudarc `dynamic-loading`), so the crate builds and its tests
//! skip cleanly on machines without a GPU. Call [`available`] before
//! [`Gpu::new`]. Nothing here reads the environment.
//!
//! Device addresses are [`DevPtr`]s (what the kernels' pointer parameters
//! take); every buffer is a [`DBuf`] whose size the wrappers check before a
//! launch.

/// Packs kernel arguments (each a `&T: DeviceRepr` local) into the
/// pointer array `cuLaunchKernel` takes.
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        [$(($a) as *const _ as *mut std::ffi::c_void),*]
    };
}

/// [`args!`] of the grouped gate/up kernels, in their order: the gate and
/// up templates, the expert records (`$route`, a [`RouteBases`]) with the
/// gate and up offsets, the groups (`$grp`: offsets and pair lists, two
/// [`DBuf`]s), each pair's token row, the pass's input in the kernel's form
/// (one or two pointers), then `h`. A macro: the input's arity differs by
/// kernel, and the pointers must point at the caller's locals.
macro_rules! grouped_gate_up_args {
    ($gt:expr, $ut:expr, $route:expr, $grp:expr, $xrow:expr, [$($x:expr),+], $h:expr) => {
        args!(
            $gt,
            $ut,
            &$route.addr,
            &$route.offsets[0],
            &$route.offsets[1],
            &$grp.0.ptr,
            &$grp.1.ptr,
            $xrow,
            $($x,)+
            $h
        )
    };
}

mod desc;
mod device;
mod devptr;
mod model;
mod ops;
mod options;

pub use desc::{Position, QKind, RouteBases, WDesc};
pub use device::{
    available, bytemuck_f32, compile_kernels, probe, DBuf, DWeight, Gpu, Mapped, MOE_MIN_BLOCKS,
};
pub use devptr::DevPtr;
pub use model::{CudaModel, CudaOptions, CudaStats};
pub use ops::attention::{AttnIo, ATT_CHUNK, ATT_MAXG, PA_SPLIT};
pub use ops::gdn::{GdnConv, GdnStep};
pub use ops::matvec::A4V_TOKENS_PER_BLOCK;
pub use ops::moe::ExpertsIo;
pub use ops::norm_rope::QkPrep;
pub use ops::sample::SampleScratch;
pub use options::{CudaTuning, GdnForm, PromptPrecision, TensorCoreUse};

/// The kernel source, compiled by NVRTC when a [`Gpu`] is created: the
/// files of `kernels/` in this order (each uses only what an earlier one
/// defines; `common.cuh` holds the types, macros and shared helpers).
pub const KERNELS: &str = concat!(
    include_str!("kernels/common.cuh"),
    include_str!("kernels/a4.cu"),
    include_str!("kernels/a4v.cu"),
    include_str!("kernels/moe_a4v.cu"),
    include_str!("kernels/tensor_core.cu"),
    include_str!("kernels/prompt_tc.cu"),
    include_str!("kernels/prompt_q8.cu"),
    include_str!("kernels/generic.cu"),
    include_str!("kernels/norm_rope.cu"),
    include_str!("kernels/attention.cu"),
    include_str!("kernels/gdn.cu"),
    include_str!("kernels/router.cu"),
    include_str!("kernels/sample.cu"),
    include_str!("kernels/embed_probe.cu"),
);

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
