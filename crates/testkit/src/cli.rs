//! Driving the `slipstream` binary from a test of the CLI crate.

use std::path::Path;
use std::process::{Command, Output};

/// A `Command` for the `slipstream` binary under test (only in the CLI
/// crate's integration tests, where Cargo names the binary).
#[macro_export]
macro_rules! bin {
    () => {
        std::process::Command::new(env!("CARGO_BIN_EXE_slipstream"))
    };
}

/// Stdout and stderr of a command that must have succeeded.
pub fn ok(out: Output) -> (String, String) {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        out.status.success(),
        "failed:\nstdout: {stdout}\nstderr: {stderr}"
    );
    (stdout, stderr)
}

/// Stderr of a command that must have failed with a clear `error:` line,
/// not a panic. Only the command's bracketed status lines (`[memory] ...`,
/// printed at start) may come before it.
pub fn failed(out: Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "should have failed: {stderr}");
    assert!(
        !stderr.contains("panicked"),
        "panic instead of an error: {stderr}"
    );
    let first_other = stderr.lines().find(|l| !l.starts_with('['));
    assert!(
        first_other.is_some_and(|l| l.starts_with("error:")),
        "unclear error: {stderr}"
    );
    stderr
}

/// `slipstream repack` of fixture `name` to `out` (with `--quant quant`
/// when given) through the binary `bin`; returns the repack's stderr.
pub fn repack(mut bin: Command, name: &str, quant: Option<&str>, out: &Path) -> String {
    bin.args(["repack", "--input"])
        .arg(crate::fixture(name))
        .arg("--output")
        .arg(out);
    if let Some(q) = quant {
        bin.args(["--quant", q]);
    }
    ok(bin.output().unwrap()).1
}

/// The fixture's reference token ids under `key` (`prompt_tokens`,
/// `greedy_tokens`).
pub fn reference_ids(name: &str, key: &str) -> Vec<u32> {
    let json = crate::read_json(&crate::fixture(name).join("reference.json"));
    crate::token_ids(&json, key)
}
