//! The `impl Gpu` launch wrappers, one file per op family. Each checks
//! the buffer sizes its kernels read and write before it launches.

pub(crate) mod attention;
pub(crate) mod gdn;
pub(crate) mod matvec;
pub(crate) mod moe;
pub(crate) mod norm_rope;
pub(crate) mod probe;
pub(crate) mod prompt_q8;
pub(crate) mod sample;
