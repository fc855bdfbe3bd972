//! Records the commit the binary was built from, for results written where
//! `git` is not available (`SLIPSTREAM_BUILD_COMMIT`, `unknown` outside a checkout).

fn main() {
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=SLIPSTREAM_BUILD_COMMIT={commit}");
    // Rebuild when HEAD moves (the paths are relative to this crate).
    for p in ["../../.git/HEAD", "../../.git/refs/heads"] {
        if std::path::Path::new(p).exists() {
            println!("cargo:rerun-if-changed={p}");
        }
    }
}
