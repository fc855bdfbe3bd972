//! Driving the `slipstream` binary from the CLI crate's test files (on top
//! of `slipstream_testkit::cli`, which the other crates' tests share too).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use slipstream_testkit::{bin, cli};

/// `slipstream repack` of fixture `name` with `--quant quant` to
/// `dir/NAME.slip`; the model path.
pub fn repack_fixture(name: &str, quant: &str, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{name}.slip"));
    let stderr = cli::repack(bin!(), name, Some(quant), &out);
    assert!(stderr.contains("MB/s"), "repack prints its speed: {stderr}");
    out
}

/// `slipstream run --model MODEL ARGS...`, not yet started (for callers
/// that add to it).
pub fn run_command(model: &Path, args: &[&str]) -> Command {
    let mut cmd = bin!();
    cmd.args(["run", "--model"]).arg(model).args(args);
    cmd
}

/// The output of `slipstream run --model MODEL ARGS...`.
pub fn run(model: &Path, args: &[&str]) -> Output {
    run_command(model, args).output().unwrap()
}

/// The output of `slipstream ARGS...`.
pub fn slipstream(args: &[&str]) -> Output {
    bin!().args(args).output().unwrap()
}

/// A test's path as a `&str` argument (temp and fixture paths are UTF-8).
pub fn utf8(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A JSON file the binary wrote (`--stats-json`, `results.json`).
pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}
