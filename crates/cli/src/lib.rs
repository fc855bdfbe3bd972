//! Library side of the `slipstream` command: pieces the binary and its
//! integration tests share.

pub mod demo;
pub mod hwbench_cmd;
pub mod machine_memory;
pub mod replay_cmd;
pub mod sampling_args;
pub mod serve_cmd;
pub mod speculate_args;
pub mod store_args;
pub mod synth_cmd;

/// Where a GGUF run in place keeps its checksum table when the file's own
/// directory cannot take it (read-only): the cache directory's `gguf-index`.
pub fn gguf_index_dir() -> Option<std::path::PathBuf> {
    Some(demo::cache_dir().join("gguf-index"))
}

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

/// The Jinja source of `--chat-template FILE`: a template file, or a JSON
/// file with a `chat_template` string (a `tokenizer_config.json`); checked
/// to parse.
pub fn read_chat_template(path: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--chat-template: reading {}", path.display()))?;
    let source = match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(v) if v.is_object() => v
            .get("chat_template")
            .and_then(serde_json::Value::as_str)
            .map(str::to_string)
            .with_context(|| {
                format!(
                    "--chat-template: {} is JSON without a `chat_template` string",
                    path.display()
                )
            })?,
        _ => text,
    };
    slipstream_engine::ChatTemplate::new(&source)
        .with_context(|| format!("--chat-template {}", path.display()))?;
    Ok(source)
}

/// `--chat-template-kwargs JSON`: template variables as a JSON object
/// (`enable_thinking` and `preserve_thinking` booleans when given).
pub fn parse_template_kwargs(
    json: &str,
) -> anyhow::Result<serde_json::Map<String, serde_json::Value>> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| {
        anyhow::anyhow!(
            "--chat-template-kwargs is not JSON ({e}); expected an object, e.g. '{{\"enable_thinking\": false}}'"
        )
    })?;
    slipstream_server::prompt::template_kwargs(v, "--chat-template-kwargs")
        .map_err(anyhow::Error::msg)
}
