//! A cgroup v1 memory cgroup that caps one child process.
//!
//! The cgroup is made under the benchmark's own memory cgroup (so any limit
//! above it still applies), named `slipstream-bench-<pid>-<n>`, given
//! `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes` where swap
//! accounting exists), and the child enters it before `exec` (see
//! `crate::child`). Page cache the child reads is charged to it, so the cap
//! counts the file cache too; `memory.max_usage_in_bytes` is the peak of
//! that charge. The cgroup is removed when dropped.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Where the cgroup v1 memory controller is mounted.
pub const MEMORY_ROOT: &str = "/sys/fs/cgroup/memory";

/// The memory cgroup this process is in (`/proc/self/cgroup`), as a
/// directory under [`MEMORY_ROOT`].
pub fn own_memory_cgroup() -> Result<PathBuf> {
    let root = Path::new(MEMORY_ROOT);
    if !root.join("memory.limit_in_bytes").exists() {
        bail!(
            "no cgroup v1 memory controller at {MEMORY_ROOT} (--memory-cap needs one; cgroup v2-only machines are not supported)"
        );
    }
    let text = std::fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, ctrls, path) = (parts.next(), parts.next(), parts.next());
        if let (Some(ctrls), Some(path)) = (ctrls, path) {
            if ctrls.split(',').any(|c| c == "memory") {
                return Ok(root.join(path.trim_start_matches('/')));
            }
        }
    }
    Ok(root.to_path_buf())
}

/// A memory cgroup, removed on drop.
#[derive(Debug)]
pub struct MemCgroup {
    dir: PathBuf,
    /// `cgroup.procs`, opened for writing before the child is forked so the
    /// child only has to `write(2)` its pid.
    procs: File,
    pub limit: u64,
    /// Whether `memory.memsw.limit_in_bytes` was set too.
    pub memsw: bool,
}

impl MemCgroup {
    /// Creates `parent/name` with a limit of `limit` bytes.
    pub fn create(parent: &Path, name: &str, limit: u64) -> Result<Self> {
        let dir = parent.join(name);
        std::fs::create_dir(&dir).with_context(|| {
            format!(
                "creating memory cgroup {} (--memory-cap needs a writable cgroup v1 memory hierarchy: run as root, or give --cgroup-parent a directory you may write)",
                dir.display()
            )
        })?;
        let mut cg = Self {
            procs: match OpenOptions::new()
                .write(true)
                .open(dir.join("cgroup.procs"))
            {
                Ok(f) => f,
                Err(e) => {
                    let _ = std::fs::remove_dir(&dir);
                    return Err(e)
                        .with_context(|| format!("opening {}/cgroup.procs", dir.display()));
                }
            },
            dir,
            limit,
            memsw: false,
        };
        cg.write("memory.limit_in_bytes", &limit.to_string())?;
        // Swap accounting is optional (absent unless the kernel enables it);
        // with it the cap also covers swapped-out pages.
        if cg.dir.join("memory.memsw.limit_in_bytes").exists() {
            cg.memsw = cg
                .write("memory.memsw.limit_in_bytes", &limit.to_string())
                .is_ok();
        }
        Ok(cg)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Raw descriptor of `cgroup.procs`, for the child's pre-exec hook.
    pub fn procs_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.procs.as_raw_fd()
    }

    fn write(&self, file: &str, value: &str) -> Result<()> {
        let p = self.dir.join(file);
        std::fs::write(&p, value).with_context(|| format!("writing {value} to {}", p.display()))
    }

    fn read_u64(&self, file: &str) -> Option<u64> {
        std::fs::read_to_string(self.dir.join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Peak charge (anonymous memory + page cache) in bytes.
    pub fn max_usage(&self) -> Option<u64> {
        self.read_u64("memory.max_usage_in_bytes")
    }

    /// Times the limit was hit.
    pub fn failcnt(&self) -> Option<u64> {
        self.read_u64("memory.failcnt")
    }

    /// OOM kills in this cgroup (`oom_kill` of `memory.oom_control`, on
    /// kernels that report it).
    pub fn oom_kills(&self) -> Option<u64> {
        let text = std::fs::read_to_string(self.dir.join("memory.oom_control")).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|v| v.trim().parse().ok())
    }

    /// Removes the cgroup; the kernel moves what is still charged to the parent.
    pub fn remove(self) -> Result<()> {
        let dir = self.dir.clone();
        drop(self);
        // After drop the directory is already removed (or the error was
        // swallowed there): report whether it is gone.
        if dir.exists() {
            bail!("could not remove cgroup {}", dir.display());
        }
        Ok(())
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        // A just-reaped child's cgroup can take a moment to empty.
        for _ in 0..50 {
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
            }
        }
        eprintln!("warning: could not remove cgroup {}", self.dir.display());
    }
}
