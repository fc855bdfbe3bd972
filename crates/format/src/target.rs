//! What a `.slip` writer may replace at its output path: nothing, an empty
//! directory, or a directory verified as a slipstream model. Everything else
//! is refused before anything is written (see `slipstream-outpath`).

use std::fs;
use std::io::Read;
use std::path::Path;

use slipstream_outpath::Overwrite;

use crate::{
    FormatError, Result, DENSE_FILE, EXPERTS_FILE, FORMAT_NAME, MANIFEST_FILE, TOKENIZER_FILE,
};

/// Every name a `.slip` directory holds.
const MODEL_FILES: [&str; 4] = [MANIFEST_FILE, DENSE_FILE, EXPERTS_FILE, TOKENIZER_FILE];

/// Largest manifest read when checking a target (a 512-expert, 94-layer
/// pool's checksums are ~1.5 MB of JSON).
const MAX_PROBE_MANIFEST_BYTES: u64 = 256 << 20;

/// The first entry of `dir` that is not a file a `.slip` model writes.
fn foreign_entry(dir: &Path) -> std::io::Result<Option<String>> {
    for e in fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !e.file_type()?.is_file() || !MODEL_FILES.contains(&name.as_str()) {
            return Ok(Some(name));
        }
    }
    Ok(None)
}

/// Whether `dir` holds only files a `.slip` model writes (or nothing): a
/// temp directory of this writer, or a model.
pub(crate) fn holds_only_model_files(dir: &Path) -> bool {
    matches!(foreign_entry(dir), Ok(None))
}

/// Whether `dir/manifest.json` is a regular file naming this format.
fn has_model_manifest(dir: &Path) -> bool {
    let path = dir.join(MANIFEST_FILE);
    let Ok(meta) = fs::symlink_metadata(&path) else {
        return false;
    };
    if !meta.is_file() || meta.len() > MAX_PROBE_MANIFEST_BYTES {
        return false;
    }
    let mut text = Vec::new();
    let read = fs::File::open(&path).and_then(|f| {
        f.take(MAX_PROBE_MANIFEST_BYTES)
            .read_to_end(&mut text)
            .map(|_| ())
    });
    read.is_ok()
        && serde_json::from_slice::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("format").and_then(|f| f.as_str()).map(str::to_owned))
            .is_some_and(|f| f == FORMAT_NAME)
}

/// Checks that writing a model to `target` loses nothing the user did not
/// ask to replace. Touches nothing.
pub fn check_model_target(target: &Path, overwrite: Overwrite) -> Result<()> {
    let refuse = |why: &str| {
        Err(FormatError::Invalid(format!(
            "{} {why}; nothing was written or removed. Choose another --output, or remove it yourself",
            target.display()
        )))
    };
    let meta = match fs::symlink_metadata(target) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(FormatError::io(target, e)),
    };
    if meta.file_type().is_symlink() {
        return refuse("is a symbolic link, not a slipstream model directory");
    }
    if !meta.is_dir() {
        return refuse("exists and is a file, not a slipstream model directory");
    }
    if let Some(name) = foreign_entry(target).map_err(|e| FormatError::io(target, e))? {
        return refuse(&format!(
            "exists and is not a slipstream model (it holds {name:?}, which a model does not)"
        ));
    }
    let empty = fs::read_dir(target)
        .map_err(|e| FormatError::io(target, e))?
        .next()
        .is_none();
    if empty || has_model_manifest(target) || overwrite == Overwrite::Force {
        return Ok(());
    }
    Err(FormatError::Invalid(format!(
        "{} looks like a damaged slipstream model (its manifest is missing or unreadable); \
         nothing was written or removed. Pass --force to replace it",
        target.display()
    )))
}
