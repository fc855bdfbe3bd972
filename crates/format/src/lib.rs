//! The `.slip` model format.
//!
//! A `.slip` model is a directory:
//! - `manifest.json`: format version, normalised [`ModelConfig`], dense tensor
//!   index, expert pool layout with one checksum per expert record, tokenizer
//!   file name, chat template, stop tokens, model hash.
//! - `dense.bin`: every non-expert tensor, each 64-byte aligned, mapped at load.
//! - `experts.bin`: expert `e` of layer `l` is one record at
//!   `(l * num_experts + e) * record_stride`, `record_stride` a multiple of
//!   4096, holding gate, up and down weights back to back. One read per expert.
//! - `tokenizer.json` (optional).
//!
//! Architecture invariant: a reader never hands out bytes it has not checked:
//! dense tensors are verified when the model is opened, expert records each
//! time they are read.

mod files;
mod manifest;
mod reader;
mod target;
mod writer;

pub use files::{open_regular, read_regular, MAX_MANIFEST_BYTES, MAX_SIDE_FILE_BYTES};
pub use manifest::{
    DenseEntry, ExpertPart, ExpertPoolIndex, GenerationDefaults, Manifest, SourceInfo, FORMAT_NAME,
    FORMAT_VERSION, FORMAT_VERSION_LAYER_PARTS,
};
pub use reader::{record_checksum, ExpertRead, InPlaceModel, SlipModel, StackedPart};
pub use slipstream_outpath::Overwrite;
pub use target::check_model_target;
pub use writer::{ExpertPoolLayout, ManifestInfo, SlipWriter};

/// Record alignment in the expert pool: the page size, and what O_DIRECT needs.
pub const RECORD_ALIGN: usize = 4096;
/// Alignment of every dense tensor inside `dense.bin`.
pub const DENSE_ALIGN: usize = 64;

pub const MANIFEST_FILE: &str = "manifest.json";
pub const DENSE_FILE: &str = "dense.bin";
pub const EXPERTS_FILE: &str = "experts.bin";
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Everything that can go wrong reading or writing a `.slip` model.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a slipstream model manifest: {reason}")]
    BadManifest { path: String, reason: String },
    #[error("{path}: format version {found} is not supported (this build reads {supported}); repack the checkpoint with this build")]
    Version {
        path: String,
        found: u32,
        supported: u32,
    },
    #[error("{path}: file is {found} bytes but the manifest says {expected}: truncated or from another model")]
    Size {
        path: String,
        expected: u64,
        found: u64,
    },
    #[error("{path}: tensor {name} checksum mismatch: the file is corrupted")]
    DenseChecksum { path: String, name: String },
    #[error("{path}: expert {expert} of layer {layer} checksum mismatch: the file is corrupted")]
    ExpertChecksum {
        path: String,
        layer: usize,
        expert: usize,
    },
    #[error("tensor {0} is not in the model")]
    MissingTensor(String),
    #[error("{0}")]
    Invalid(String),
}

impl FormatError {
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        FormatError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, FormatError>;

/// 64-bit checksum used for tensors and expert records (xxh3: ~20 GB/s, so
/// verifying each expert read costs far less than reading it).
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

pub(crate) fn align_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}
