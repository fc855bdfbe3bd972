//! Helpers shared by the engine's integration tests.

use std::path::{Path, PathBuf};

use slipstream_repack::{repack, QuantChoice, RepackOptions};

/// A committed fixture checkpoint under `tests/fixtures/`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Repacks fixture `name` with `quant` into `dir` and returns the model path.
pub fn repacked(name: &str, quant: QuantChoice, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{name}-{quant}.slip"));
    repack(
        &RepackOptions {
            input: fixture(name),
            output: out.clone(),
            overwrite: Default::default(),
            quant,
        },
        &|_| {},
    )
    .unwrap();
    out
}

/// The prompt the streaming and snapshot tests share.
pub fn prompt() -> Vec<u32> {
    (0..23).map(|i| (i * 37 + 11) % 500).collect()
}
