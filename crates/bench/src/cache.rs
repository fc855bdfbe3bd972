//! Putting the page cache in a stated state before a run, and measuring it.
//!
//! Cold: every model file is fsynced and then dropped with
//! `posix_fadvise(POSIX_FADV_DONTNEED)` (or the whole page cache is dropped
//! through `/proc/sys/vm/drop_caches` when asked for and writable). Warm:
//! every model file is read once. Either way the share of the files' pages
//! resident afterwards is measured with `mincore` and recorded, so a run
//! says what state it actually met (pages another process holds mapped are
//! not dropped by `DONTNEED`).

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::matrix::CacheMode;

/// How a cold cache is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EvictMethod {
    /// `posix_fadvise(DONTNEED)` on each model file after `fsync`: touches
    /// only the model's pages.
    Fadvise,
    /// `sync` + `echo 1 > /proc/sys/vm/drop_caches`: every clean page on the
    /// machine (needs root; affects every other process).
    DropCaches,
}

impl EvictMethod {
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "fadvise" => Ok(Self::Fadvise),
            "drop-caches" => Ok(Self::DropCaches),
            other => bail!("bad --evict {other:?}: expected fadvise or drop-caches"),
        }
    }
}

/// What was done to the cache before a run, and what it held after.
#[derive(Clone, Debug, Serialize)]
pub struct CacheReport {
    pub mode: CacheMode,
    /// `fadvise`, `drop-caches` or `pre-read`.
    pub method: String,
    /// Share of the model files' pages in the page cache after preparing, 0..1.
    pub resident_fraction: Option<f64>,
    pub seconds: f64,
}

/// The regular files of a model: the files of a directory (one level deep
/// and its subdirectories), or the file itself.
pub fn model_files(path: &Path) -> Result<Vec<PathBuf>> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))?
        {
            let entry = entry.with_context(|| format!("listing {}", dir.display()))?;
            let ft = entry.file_type()?;
            if ft.is_dir() {
                stack.push(entry.path());
            } else if ft.is_file() {
                out.push(entry.path());
            }
        }
    }
    out.sort();
    if out.is_empty() {
        bail!("{} holds no files", path.display());
    }
    Ok(out)
}

/// Puts `files` in `mode`; `evict` chooses how a cold cache is made.
pub fn prepare(files: &[PathBuf], mode: CacheMode, evict: EvictMethod) -> Result<CacheReport> {
    let t = std::time::Instant::now();
    let method = match mode {
        CacheMode::Cold => match evict {
            EvictMethod::Fadvise => {
                evict_fadvise(files)?;
                "fadvise"
            }
            EvictMethod::DropCaches => {
                drop_caches()?;
                "drop-caches"
            }
        },
        CacheMode::Warm => {
            pre_read(files)?;
            "pre-read"
        }
    };
    Ok(CacheReport {
        mode,
        method: method.to_string(),
        resident_fraction: resident_fraction(files).ok(),
        seconds: t.elapsed().as_secs_f64(),
    })
}

/// fsync + `POSIX_FADV_DONTNEED` on every file.
pub fn evict_fadvise(files: &[PathBuf]) -> Result<()> {
    for f in files {
        let file = File::open(f).with_context(|| format!("opening {} to evict it", f.display()))?;
        // Dirty pages are not dropped: write them out first.
        file.sync_all()
            .with_context(|| format!("fsync {}", f.display()))?;
        // SAFETY: plain syscall on a descriptor `file` owns for the call's
        // duration; offset 0 and length 0 mean the whole file.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            bail!(
                "posix_fadvise(DONTNEED) on {}: {}",
                f.display(),
                std::io::Error::from_raw_os_error(rc)
            );
        }
    }
    Ok(())
}

/// `sync`, then `1` into `/proc/sys/vm/drop_caches`.
pub fn drop_caches() -> Result<()> {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "1\n").context(
        "writing /proc/sys/vm/drop_caches (needs root and a writable /proc/sys; use --evict fadvise)",
    )
}

/// Reads every file once, sequentially, so its pages enter the cache.
pub fn pre_read(files: &[PathBuf]) -> Result<()> {
    let mut buf = vec![0u8; 4 << 20];
    for f in files {
        let mut file =
            File::open(f).with_context(|| format!("opening {} to pre-read it", f.display()))?;
        loop {
            let n = file
                .read(&mut buf)
                .with_context(|| format!("reading {}", f.display()))?;
            if n == 0 {
                break;
            }
        }
    }
    Ok(())
}

/// Share of the files' pages resident in the page cache (`mincore`), 0..1.
pub fn resident_fraction(files: &[PathBuf]) -> Result<f64> {
    let page = page_size();
    let (mut resident, mut total) = (0u64, 0u64);
    for f in files {
        let file = File::open(f).with_context(|| format!("opening {}", f.display()))?;
        let len = file.metadata()?.len();
        if len == 0 {
            continue;
        }
        // SAFETY: a read-only shared mapping that is never dereferenced here
        // (mincore only asks the kernel about its pages); the file may change
        // underneath, which does not matter for a residency query.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("mapping {}", f.display()))?;
        let pages = len.div_ceil(page) as usize;
        let mut vec = vec![0u8; pages];
        // SAFETY: `map` is a live mapping of `len` bytes starting page-aligned;
        // `vec` has one byte per page of it, as mincore(2) requires.
        let rc = unsafe {
            libc::mincore(
                map.as_ptr() as *mut libc::c_void,
                len as usize,
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            bail!(
                "mincore on {}: {}",
                f.display(),
                std::io::Error::last_os_error()
            );
        }
        resident += vec.iter().filter(|&&b| b & 1 == 1).count() as u64;
        total += pages as u64;
    }
    Ok(if total == 0 {
        0.0
    } else {
        resident as f64 / total as f64
    })
}

fn page_size() -> u64 {
    // SAFETY: sysconf with a valid name has no side effects.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_then_cold() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("a.bin"), vec![7u8; 1 << 20]).unwrap();
        std::fs::write(dir.path().join("sub/b.bin"), vec![1u8; 3 << 20]).unwrap();
        let files = model_files(dir.path()).unwrap();
        assert_eq!(files.len(), 2);
        let w = prepare(&files, CacheMode::Warm, EvictMethod::Fadvise).unwrap();
        assert_eq!(w.method, "pre-read");
        assert!(w.resident_fraction.unwrap() > 0.99, "{w:?}");
        let c = prepare(&files, CacheMode::Cold, EvictMethod::Fadvise).unwrap();
        assert_eq!(c.method, "fadvise");
        // tmpfs ignores DONTNEED; only check eviction where the filesystem honours it.
        let frac = c.resident_fraction.unwrap();
        assert!((0.0..=1.0).contains(&frac));
        assert!(model_files(&dir.path().join("missing")).is_err());
    }
}
