//! Servers `slipstream bench agent` starts itself: `slipstream serve` on a
//! `.slip` model and llama.cpp's `llama-server` on the same weights as GGUF,
//! each a child process on a free loopback port, logging to a file, killed
//! when dropped.
//!
//! llama-server's prompt caching is set as its documentation
//! (`tools/server/README.md` of the pinned llama.cpp) advises for hybrid
//! models such as qwen35moe, whose recurrent layers cannot be rolled back:
//! context checkpoints (`--ctx-checkpoints`, PR 15293), the RAM prompt cache
//! (`--cache-ram`, PR 16391) and chunk reuse (`--cache-reuse`, which the
//! server turns off itself where the memory cannot shift, as hybrid memory
//! cannot; it is passed so that the command states the advised setting).
//! `cache_prompt` is on by default. `--slot-save-path` is not used: it only
//! serves explicit save/restore calls, which an agent client never makes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// llama-server's prompt-caching settings.
#[derive(Clone, Debug)]
pub struct LlamaCaching {
    /// `--ctx-checkpoints`: checkpoints kept per slot.
    pub ctx_checkpoints: usize,
    /// `--cache-ram`: MiB of the RAM prompt cache (-1: no limit).
    pub cache_ram_mib: i64,
    /// `--cache-reuse`: smallest chunk reused by KV shifting.
    pub cache_reuse: usize,
}

impl Default for LlamaCaching {
    /// The pinned llama.cpp's defaults for checkpoints (32) and the RAM
    /// cache (8192 MiB), and the 256-token chunks its docs suggest.
    fn default() -> Self {
        Self {
            ctx_checkpoints: 32,
            cache_ram_mib: 8192,
            cache_reuse: 256,
        }
    }
}

/// The `llama-server` binary in a directory (`DIR/llama-server` or
/// `DIR/bin/llama-server`), or the path itself when it is a file.
pub fn llama_server_bin(path: &Path) -> Result<PathBuf> {
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    for cand in [path.join("llama-server"), path.join("bin/llama-server")] {
        if cand.is_file() {
            return Ok(cand);
        }
    }
    bail!(
        "no llama-server at {} (nor in it or its bin/): build one with scripts/build_llama_cpp.sh",
        path.display()
    )
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// `slipstream serve` on `model`, every model name accepted.
pub fn slipstream_command(
    runner: &Path,
    model: &Path,
    port: u16,
    threads: usize,
    ctx_size: usize,
    extra: &[String],
) -> Command {
    let mut c = Command::new(runner);
    c.arg("serve").arg("--model").arg(model);
    c.args(["--host", "127.0.0.1", "--port", &port.to_string()]);
    c.args(["--threads", &threads.to_string()]);
    c.args(["--max-context", &ctx_size.to_string()]);
    c.arg("--any-model");
    c.args(extra);
    c
}

/// `llama-server` on `gguf` with the advised prompt caching.
pub fn llama_command(
    bin: &Path,
    gguf: &Path,
    port: u16,
    threads: usize,
    ctx_size: usize,
    caching: &LlamaCaching,
    extra: &[String],
) -> Command {
    let mut c = Command::new(bin);
    c.arg("-m").arg(gguf);
    c.args(["--host", "127.0.0.1", "--port", &port.to_string()]);
    c.args(["-t", &threads.to_string(), "-c", &ctx_size.to_string()]);
    c.arg("--jinja");
    c.args(["--ctx-checkpoints", &caching.ctx_checkpoints.to_string()]);
    c.args(["--cache-ram", &caching.cache_ram_mib.to_string()]);
    c.args(["--cache-reuse", &caching.cache_reuse.to_string()]);
    c.args(extra);
    c
}

/// A started server; killed when dropped.
pub struct ServerProcess {
    child: Child,
    pub base_url: String,
    /// The command line, for the record.
    pub command: String,
    pub log: PathBuf,
}

impl ServerProcess {
    /// Spawns `cmd` with stdout and stderr in `log`.
    pub fn spawn(mut cmd: Command, port: u16, log: &Path) -> Result<Self> {
        let out =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        let command = crate::shell_words(&cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", cmd.get_program().to_string_lossy()))?;
        Ok(Self {
            child,
            base_url: format!("http://127.0.0.1:{port}"),
            command,
            log: log.to_path_buf(),
        })
    }

    /// Waits until `GET /health` answers 200 (llama-server answers 503 while
    /// it loads); fails when the process exits or `timeout` passes.
    pub async fn wait_ready(&mut self, client: &reqwest::Client, timeout: Duration) -> Result<f64> {
        let start = Instant::now();
        let url = format!("{}/health", self.base_url);
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "the server exited ({status}) before it was ready: {}",
                    crate::tail(&self.log, 4)
                );
            }
            if let Ok(r) = client
                .get(&url)
                .timeout(Duration::from_secs(5))
                .send()
                .await
            {
                if r.status().is_success() {
                    return Ok(start.elapsed().as_secs_f64());
                }
            }
            if start.elapsed() > timeout {
                bail!(
                    "the server was not ready after {:.0} s: {}",
                    timeout.as_secs_f64(),
                    crate::tail(&self.log, 4)
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Peak resident set of the process so far (VmHWM), in bytes.
    pub fn peak_rss_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        status.lines().find_map(|l| {
            let kb: u64 = l
                .strip_prefix("VmHWM:")?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some(kb * 1024)
        })
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(c: &Command) -> String {
        c.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn commands_state_the_caching() {
        let c = llama_command(
            Path::new("/l/llama-server"),
            Path::new("/m.gguf"),
            8080,
            2,
            65536,
            &LlamaCaching::default(),
            &["-np".into(), "1".into()],
        );
        assert_eq!(
            args(&c),
            "-m /m.gguf --host 127.0.0.1 --port 8080 -t 2 -c 65536 --jinja --ctx-checkpoints 32 --cache-ram 8192 --cache-reuse 256 -np 1"
        );
        let c = slipstream_command(Path::new("/s"), Path::new("/m.slip"), 9, 2, 4096, &[]);
        assert_eq!(
            args(&c),
            "serve --model /m.slip --host 127.0.0.1 --port 9 --threads 2 --max-context 4096 --any-model"
        );
        assert!(free_port().unwrap() > 0);
        let dir = tempfile::tempdir().unwrap();
        assert!(llama_server_bin(dir.path()).is_err());
        std::fs::create_dir(dir.path().join("bin")).unwrap();
        std::fs::write(dir.path().join("bin/llama-server"), "").unwrap();
        assert_eq!(
            llama_server_bin(dir.path()).unwrap(),
            dir.path().join("bin/llama-server")
        );
    }
}
