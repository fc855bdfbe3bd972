//! The GGUF container (llama.cpp's model file), version 3 (2 is read too).
//!
//! Layout (all little-endian):
//! 1. header: magic `GGUF`, `u32` version, `u64` tensor count, `u64` metadata count;
//! 2. metadata: `count` key/value pairs, key = string, value = `u32` type + payload
//!    (strings are `u64` length + UTF-8 bytes; arrays are `u32` item type,
//!    `u64` count, items);
//! 3. tensor infos: name, `u32` n_dims, `u64` dims (ggml order: `dims[0]` is
//!    the row length, the fastest-varying index), `u32` ggml type, `u64`
//!    offset relative to the data section;
//! 4. padding to `general.alignment` (default 32), then the data section;
//!    every tensor offset is a multiple of the alignment.
//!
//! [`GgufFile::open`] maps a file and checks everything up front: a bad magic,
//! an unsupported version, a truncated header, an unknown tensor type or a
//! tensor whose bytes lie beyond the end of the file is a [`GgufError`]
//! naming the file and the part. [`GgufWriter`] writes metadata and tensor
//! infos, then streams tensor data in declaration order into a temporary
//! file that is renamed into place when [`GgufWriter::finish`] succeeds.

mod reader;
mod types;
mod writer;

pub use reader::{GgufFile, TensorInfo};
pub use slipstream_outpath::Overwrite;
pub use types::{GgmlType, Value, ValueType};
pub use writer::{check_gguf_target, GgufWriter, TensorDecl};

/// Magic bytes at offset 0.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Version written by [`GgufWriter`].
pub const VERSION: u32 = 3;
/// Alignment used when the file does not set `general.alignment`.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// Metadata key of the data alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// Whether `bytes` (the start of a file) look like GGUF.
pub fn has_magic(bytes: &[u8]) -> bool {
    bytes.len() >= 4 && bytes[..4] == MAGIC
}

/// Whether the file at `path` starts with the GGUF magic (false if unreadable).
pub fn is_gguf_file(path: &std::path::Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .map(|_| has_magic(&head))
        .unwrap_or(false)
}

/// Everything that can go wrong; each message names the file and the part.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file (magic {found:02x?}, expected \"GGUF\")")]
    BadMagic { path: String, found: Vec<u8> },
    #[error("{path}: GGUF version {version} is not supported (2 or 3)")]
    Version { path: String, version: u32 },
    #[error("{path}: truncated: {what} needs bytes up to {need}, the file has {len}")]
    Truncated {
        path: String,
        what: String,
        need: u64,
        len: u64,
    },
    #[error("{path}: tensor {name} ({ty}) has unknown ggml type id {id}")]
    UnknownType {
        path: String,
        name: String,
        id: u32,
        ty: &'static str,
    },
    #[error("{path}: tensor {name}: data [{start}, {end}) lies beyond the end of the file ({len} bytes)")]
    TensorBeyondEnd {
        path: String,
        name: String,
        start: u64,
        end: u64,
        len: u64,
    },
    #[error("{path}: {what}")]
    Invalid { path: String, what: String },
}

pub type Result<T> = std::result::Result<T, GgufError>;

pub(crate) fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

#[cfg(test)]
mod tests;
