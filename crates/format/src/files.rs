//! Opening the files a model names, defensively: regular files only (a FIFO
//! would hang the reader, `/dev/zero` would grow it without bound), sizes
//! bounded, names confined to the model directory.

use std::fs::File;
use std::io::Read;
use std::path::{Component, Path};

use crate::{FormatError, Result};

/// Largest `manifest.json` read (a 512-expert, 94-layer pool's checksums
/// are ~1.5 MB of JSON).
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;
/// Largest side file (tokenizer) read from a model directory.
pub const MAX_SIDE_FILE_BYTES: u64 = 256 << 20;

/// Opens `path` for reading if it is a regular file (symlinks followed)
/// of at most `max_bytes`.
pub fn open_regular(path: &Path, max_bytes: u64) -> Result<File> {
    let meta = std::fs::metadata(path).map_err(|e| FormatError::io(path, e))?;
    if !meta.is_file() {
        return Err(FormatError::Invalid(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    if meta.len() > max_bytes {
        return Err(FormatError::Invalid(format!(
            "{} is {} bytes, more than the {max_bytes} this file may have",
            path.display(),
            meta.len()
        )));
    }
    File::open(path).map_err(|e| FormatError::io(path, e))
}

/// Reads a regular file of at most `max_bytes` (the bound holds even if the
/// file grows while it is read).
pub fn read_regular(path: &Path, max_bytes: u64) -> Result<Vec<u8>> {
    let file = open_regular(path, max_bytes)?;
    let mut out = Vec::new();
    file.take(max_bytes + 1)
        .read_to_end(&mut out)
        .map_err(|e| FormatError::io(path, e))?;
    if out.len() as u64 > max_bytes {
        return Err(FormatError::Invalid(format!(
            "{} grew past {max_bytes} bytes while being read",
            path.display()
        )));
    }
    Ok(out)
}

/// Whether `name` is one plain file name (no directory part, no `..`), so
/// `dir.join(name)` stays inside `dir`.
pub fn is_plain_file_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    matches!(parts.next(), Some(Component::Normal(_))) && parts.next().is_none()
}
