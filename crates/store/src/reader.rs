//! A pool of reader threads doing `pread` of whole expert records into
//! caller-provided memory, optionally with O_DIRECT.
//!
//! Reads are demand reads (a token waits for them) or background reads
//! (`submit_background`: the store's fill of free slots). A background
//! read goes in pieces of [`BACKGROUND_PIECE`] bytes and, before each
//! piece, waits while any reader is busy with a demand read, so a demand
//! read shares the disk with at most one piece per background reader
//! instead of whole records (on a slow disk a 1.8 MB record in front of
//! a miss is tens of milliseconds of wait).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Bytes a background read reads at a time before it checks for demand
/// reads again (a multiple of 4096, so O_DIRECT alignment holds for
/// page-aligned records).
pub const BACKGROUND_PIECE: usize = 256 << 10;

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
    background: bool,
}

/// Demand reads being read right now (taken by a reader, not yet done).
#[derive(Default)]
struct DemandGate {
    active: Mutex<usize>,
    idle: Condvar,
}

impl DemandGate {
    fn begin(&self) {
        if let Ok(mut n) = self.active.lock() {
            *n += 1;
        }
    }

    fn end(&self) {
        if let Ok(mut n) = self.active.lock() {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.idle.notify_all();
            }
        }
    }

    /// Blocks while a demand read is in progress. Only readers that took a
    /// job count, so a demand read still queued (every reader busy) never
    /// holds a background read back: no wait can deadlock. The timeout
    /// bounds a wait should a notification be missed.
    fn wait_idle(&self) {
        let Ok(mut n) = self.active.lock() else {
            return;
        };
        while *n > 0 {
            match self.idle.wait_timeout(n, Duration::from_millis(50)) {
                Ok((guard, _)) => n = guard,
                Err(_) => return,
            }
        }
    }
}

/// Reads `buf.len()` bytes at `offset` in pieces of [`BACKGROUND_PIECE`],
/// letting every demand read in progress finish before each piece.
fn read_in_pieces(file: &File, buf: &mut [u8], offset: u64, gate: &DemandGate) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        gate.wait_idle();
        let n = (buf.len() - done).min(BACKGROUND_PIECE);
        file.read_exact_at(&mut buf[done..done + n], offset + done as u64)?;
        done += n;
    }
    Ok(())
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
        let gate = Arc::new(DemandGate::default());
        let threads = (0..threads.max(1))
            .map(|i| {
                let file = file.clone();
                let job_rx = job_rx.clone();
                let done_tx = done_tx.clone();
                let gate = gate.clone();
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
                        let result = if job.background {
                            read_in_pieces(&file, buf, job.offset, &gate)
                        } else {
                            gate.begin();
                            let r = file.read_exact_at(buf, job.offset);
                            gate.end();
                            r
                        };
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

    /// Queues a demand read of `len` bytes at `offset` into `dest`.
    ///
    /// # Safety
    /// `dest..dest+len` must stay valid and untouched by the caller until
    /// the matching [`Done`] has been received.
    pub unsafe fn submit(&self, id: usize, offset: u64, len: usize, dest: *mut u8) {
        // SAFETY: forwarded from the caller.
        unsafe { self.send(id, offset, len, dest, false) }
    }

    /// Queues a background read: like [`ReaderPool::submit`], but read in
    /// pieces that give way to demand reads (see the module doc).
    ///
    /// # Safety
    /// As for [`ReaderPool::submit`].
    pub unsafe fn submit_background(&self, id: usize, offset: u64, len: usize, dest: *mut u8) {
        // SAFETY: forwarded from the caller.
        unsafe { self.send(id, offset, len, dest, true) }
    }

    /// # Safety
    /// As for [`ReaderPool::submit`].
    unsafe fn send(&self, id: usize, offset: u64, len: usize, dest: *mut u8, background: bool) {
        if let Some(tx) = &self.jobs {
            let _ = tx.send(Job {
                id,
                offset,
                len,
                dest: Dest(dest),
                background,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn background_and_demand_reads_bring_the_same_bytes() {
        // A length that is not a whole number of pieces, read by one thread
        // (the background read must not wait on the demand read queued
        // behind it) and by four.
        let len = 3 * BACKGROUND_PIECE + 4096 * 5;
        let data: Vec<u8> = (0..2 * len).map(|i| (i * 31 % 251) as u8).collect();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&data).unwrap();
        for threads in [1, 4] {
            let pool = ReaderPool::new(File::open(f.path()).unwrap(), threads);
            let mut bg = vec![0u8; len];
            let mut demand = vec![0u8; len];
            // SAFETY: both buffers outlive the reads, which are waited for
            // below before the buffers are touched.
            unsafe {
                pool.submit_background(7, 4096, len, bg.as_mut_ptr());
                pool.submit(8, 4096, len, demand.as_mut_ptr());
            }
            let mut ids = [pool.wait(), pool.wait()].map(|d| {
                d.result.unwrap();
                d.id
            });
            ids.sort();
            assert_eq!(ids, [7, 8]);
            assert_eq!(bg, &data[4096..4096 + len]);
            assert_eq!(demand, bg);
        }
    }

    #[test]
    fn background_pieces_wait_for_demand_reads_in_progress() {
        let gate = Arc::new(DemandGate::default());
        gate.begin();
        let passed = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (gate, passed) = (gate.clone(), passed.clone());
            std::thread::spawn(move || {
                gate.wait_idle();
                passed.store(true, Ordering::SeqCst);
            })
        };
        // Longer than the gate's timeout: a wait that wakes up must see
        // the demand read still running and wait again.
        std::thread::sleep(Duration::from_millis(120));
        assert!(!passed.load(Ordering::SeqCst), "background piece ran beside a demand read");
        gate.end();
        waiter.join().unwrap();
        assert!(passed.load(Ordering::SeqCst));
    }
}
