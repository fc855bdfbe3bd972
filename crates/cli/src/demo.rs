//! The embedded demo model: a small qwen3_5_moe checkpoint compiled into the
//! binary (trained by `tools/demo/train_demo.py`), repacked on first use into
//! the user's cache directory so `slipstream run` works offline with no
//! arguments.

use std::path::{Path, PathBuf};

use slipstream_format::SlipModel;
use slipstream_repack::{repack, QuantChoice, RepackOptions};

/// The checkpoint files, as committed under `models/demo/`.
const FILES: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!("../../../models/demo/config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../../models/demo/model.safetensors"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../../../models/demo/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../../models/demo/tokenizer_config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../../../models/demo/generation_config.json"),
    ),
];

/// Prompt used when `slipstream run` gets none.
pub const DEFAULT_PROMPT: &str = "And it came to pass";

/// Where repacked models are cached: `$SLIPSTREAM_CACHE`, else
/// `$XDG_CACHE_HOME/slipstream`, else `~/.cache/slipstream`.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("SLIPSTREAM_CACHE") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(p).join("slipstream");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("slipstream")
}

fn content_hash() -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for (name, bytes) in FILES {
        h.update(name.as_bytes());
        h.update(bytes);
    }
    format!("{:016x}", h.digest())
}

/// Path of the repacked demo model, repacking it first when it is missing
/// or does not open (a damaged cache is rebuilt, never used).
pub fn ensure_demo_model(
    progress: &dyn Fn(slipstream_repack::ProgressEvent),
) -> anyhow::Result<PathBuf> {
    open_demo_model(progress).map(|model| model.dir)
}

/// The repacked demo model, opened (and so verified), repacking it first
/// when it is missing or does not open.
pub fn open_demo_model(
    progress: &dyn Fn(slipstream_repack::ProgressEvent),
) -> anyhow::Result<SlipModel> {
    let dir = cache_dir();
    let target = dir.join(format!("demo-{}.slip", content_hash()));
    if target.exists() {
        if let Ok(model) = SlipModel::open(&target) {
            return Ok(model);
        }
    }
    std::fs::create_dir_all(&dir)
        .map_err(|e| anyhow::anyhow!("cannot create cache directory {}: {e}", dir.display()))?;
    let src = tempdir_in(&dir)?;
    let result = (|| {
        for (name, bytes) in FILES {
            std::fs::write(src.join(name), bytes)?;
        }
        repack(
            &RepackOptions {
                input: src.clone(),
                output: target.clone(),
                overwrite: Default::default(),
                quant: QuantChoice::Q4,
                ggml_to_affine: false,
            },
            progress,
        )?;
        anyhow::Ok(())
    })();
    let _ = std::fs::remove_dir_all(&src);
    result?;
    Ok(SlipModel::open(&target)?)
}

fn tempdir_in(dir: &Path) -> anyhow::Result<PathBuf> {
    let p = dir.join(format!(".demo-src-{}", std::process::id()));
    if p.exists() {
        std::fs::remove_dir_all(&p)?;
    }
    std::fs::create_dir_all(&p)?;
    Ok(p)
}
