//! A pool of reader threads doing `pread` of whole expert records into
//! caller-provided memory, optionally with O_DIRECT.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Read-ahead advice given to the kernel for the expert pool file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Readahead {
    /// POSIX_FADV_NORMAL: the kernel's default read-ahead.
    #[default]
    Default,
    /// No advice call at all.
    Off,
    /// POSIX_FADV_RANDOM: read-ahead disabled (expert reads are random).
    Random,
}

impl std::str::FromStr for Readahead {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "default" => Ok(Readahead::Default),
            "off" => Ok(Readahead::Off),
            "random" => Ok(Readahead::Random),
            _ => Err(format!(
                "unknown readahead {s:?}: expected default, off or random"
            )),
        }
    }
}

/// Whether expert reads bypass the page cache (`--direct-io`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectIo {
    /// Decided per run from the slots and the memory (see
    /// `slipstream_engine::resolve_direct_io`).
    #[default]
    Auto,
    /// O_DIRECT: the page cache holds no second copy of read experts.
    On,
    /// Buffered reads: the page cache keeps read experts, a second cache
    /// level below the slots while memory allows.
    Off,
}

impl std::str::FromStr for DirectIo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DirectIo::Auto),
            "on" | "true" => Ok(DirectIo::On),
            "off" | "false" => Ok(DirectIo::Off),
            _ => Err(format!(
                "unknown --direct-io value {s:?}: expected auto, on or off"
            )),
        }
    }
}

/// Whether `path` can be opened with O_DIRECT (some filesystems, e.g.
/// tmpfs, refuse it).
pub fn supports_direct_io(path: &Path) -> bool {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .is_ok()
}

/// Destination of a read: raw memory owned by the store.
#[derive(Clone, Copy)]
struct Dest(*mut u8);
// SAFETY: a `Dest` is handed to exactly one reader thread, which writes the
// job's range and reports completion; the store does not touch that range
// until the completion arrives, and the memory outlives the pool.
unsafe impl Send for Dest {}

struct Job {
    id: usize,
    offset: u64,
    len: usize,
    dest: Dest,
}

/// A finished read.
pub struct Done {
    pub id: usize,
    pub result: std::io::Result<()>,
}

pub struct ReaderPool {
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    threads: Vec<JoinHandle<()>>,
}

/// Opens the pool file with the requested flags and advice.
pub fn open_pool_file(path: &Path, direct: bool, readahead: Readahead) -> std::io::Result<File> {
    let mut opts = OpenOptions::new();
    opts.read(true);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let file = opts.open(path).map_err(|e| {
        if direct && e.raw_os_error() == Some(libc::EINVAL) {
            std::io::Error::new(
                e.kind(),
                format!(
                    "{}: this filesystem does not support direct I/O (drop --direct-io)",
                    path.display()
                ),
            )
        } else {
            std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
        }
    })?;
    let advice = match readahead {
        Readahead::Default => Some(libc::POSIX_FADV_NORMAL),
        Readahead::Random => Some(libc::POSIX_FADV_RANDOM),
        Readahead::Off => None,
    };
    if let Some(advice) = advice {
        use std::os::fd::AsRawFd;
        // SAFETY: plain syscall on a valid, open descriptor; advice only.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, advice) };
    }
    Ok(file)
}

impl ReaderPool {
    pub fn new(file: File, threads: usize) -> Self {
        let file = Arc::new(file);
        let (job_tx, job_rx) = channel::<Job>();
        let (done_tx, done_rx) = channel::<Done>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let threads = (0..threads.max(1))
            .map(|i| {
                let file = file.clone();
                let job_rx = job_rx.clone();
                let done_tx = done_tx.clone();
                std::thread::Builder::new()
                    .name(format!("expert-reader-{i}"))
                    .spawn(move || loop {
                        let job = match job_rx.lock() {
                            Ok(rx) => rx.recv(),
                            Err(_) => return,
                        };
                        let Ok(job) = job else { return };
                        // SAFETY: see `Dest`: this thread is the only writer
                        // of `dest[..len]` until it sends `Done`.
                        let buf = unsafe { std::slice::from_raw_parts_mut(job.dest.0, job.len) };
                        let result = file.read_exact_at(buf, job.offset);
                        if done_tx.send(Done { id: job.id, result }).is_err() {
                            return;
                        }
                    })
                    .expect("spawning a reader thread")
            })
            .collect();
        ReaderPool {
            jobs: Some(job_tx),
            done: done_rx,
            threads,
        }
    }

    /// Queues a read of `len` bytes at `offset` into `dest`.
    ///
    /// # Safety
    /// `dest..dest+len` must stay valid and untouched by the caller until
    /// the matching [`Done`] has been received.
    pub unsafe fn submit(&self, id: usize, offset: u64, len: usize, dest: *mut u8) {
        if let Some(tx) = &self.jobs {
            let _ = tx.send(Job {
                id,
                offset,
                len,
                dest: Dest(dest),
            });
        }
    }

    /// A finished read, if one is waiting (never blocks).
    pub fn try_wait(&self) -> Option<Done> {
        self.done.try_recv().ok()
    }

    /// Blocks until a read finishes.
    pub fn wait(&self) -> Done {
        self.done.recv().unwrap_or(Done {
            id: usize::MAX,
            result: Err(std::io::Error::other("reader threads are gone")),
        })
    }
}

impl Drop for ReaderPool {
    fn drop(&mut self) {
        self.jobs.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
