//! Library side of the `slipstream` command: pieces the binary and its
//! integration tests share.

pub mod demo;
pub mod hwbench_cmd;
pub mod replay_cmd;
pub mod serve_cmd;
pub mod synth_cmd;

/// Where `slipstream hwbench` leaves its last full report for other commands.
pub fn hwbench_report_path() -> std::path::PathBuf {
    demo::cache_dir().join("hwbench.json")
}

/// Reader threads used when `--io-threads` is not given: the best count the
/// last `slipstream hwbench` measured on this machine, else 4 (the fan-out
/// that saturated an NVMe SSD in the reference's microbench).
pub fn default_io_threads() -> usize {
    std::fs::read(hwbench_report_path())
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v.get("best_reader_threads")?.as_u64())
        .map(|t| t.clamp(1, 64) as usize)
        .unwrap_or(4)
}
