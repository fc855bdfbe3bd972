//! A pool of reader threads doing `pread` of whole expert records into
//! caller-provided memory, optionally with O_DIRECT.
//!
//! Reads are demand reads (a token waits for them) or background reads
//! (`submit_background`: the store's fill of free slots). Demand reads are
//! always taken first. A background read goes in pieces of
//! [`BACKGROUND_PIECE`] bytes; before each piece its reader serves every
//! demand read still queued, then waits while another reader is busy with
//! one. So a miss shares the disk with at most one piece per background
//! reader instead of whole records (on a slow disk a 1.8 MB record in front
//! of a miss is tens of milliseconds), also with a single reader thread.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
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

/// One contiguous read of a job: `len` bytes at `offset` into `dest`, of
/// which the first `need` must arrive (the rest may lie past the end of
/// the file).
#[derive(Clone, Copy)]
pub struct Segment {
    pub offset: u64,
    pub len: usize,
    pub need: usize,
    dest: Dest,
}

/// A read job: one segment. An expert of several segments (a GGUF read in
/// place: its three parts) is a group of jobs that readers take in
/// parallel; the group completes once, when its last segment is read.
struct Job {
    id: usize,
    seg: Segment,
    group: Option<Arc<Group>>,
}

/// The segments of one submission still being read, and its first error.
struct Group {
    left: AtomicUsize,
    error: Mutex<Option<std::io::Error>>,
}

impl Job {
    /// Settles this job's read: the submission's result once every
    /// segment of it is done, `None` while some are still being read.
    fn finish(&self, result: std::io::Result<()>) -> Option<std::io::Result<()>> {
        let Some(g) = &self.group else {
            return Some(result);
        };
        if let Err(e) = result {
            if let Ok(mut first) = g.error.lock() {
                first.get_or_insert(e);
            }
        }
        if g.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return None;
        }
        match g.error.lock().ok().and_then(|mut e| e.take()) {
            Some(e) => Some(Err(e)),
            None => Some(Ok(())),
        }
    }
}

/// The readers' shared state: queued jobs and demand reads in progress.
#[derive(Default)]
struct Queues {
    demand: VecDeque<Job>,
    background: VecDeque<Job>,
    /// Demand reads taken by a reader and not yet done.
    demand_active: usize,
    closed: bool,
}

#[derive(Default)]
struct Shared {
    queues: Mutex<Queues>,
    /// Signalled when a job is queued, the pool closes, or the last demand
    /// read in progress ends.
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> Option<MutexGuard<'_, Queues>> {
        self.queues.lock().ok()
    }

    /// Blocks for the next job, demand reads first; `None` once closed and
    /// drained.
    fn next_job(&self) -> Option<(Job, bool)> {
        let mut q = self.lock()?;
        loop {
            if let Some(job) = q.demand.pop_front() {
                q.demand_active += 1;
                return Some((job, false));
            }
            if let Some(job) = q.background.pop_front() {
                return Some((job, true));
            }
            if q.closed {
                return None;
            }
            q = self.changed.wait(q).ok()?;
        }
    }

    /// Before a background piece: takes a queued demand read if there is
    /// one (the caller serves it and asks again), else waits while another
    /// reader is busy with a demand read. The timeout bounds a wait should
    /// a notification be missed.
    fn demand_before_piece(&self) -> Option<Job> {
        let mut q = self.lock()?;
        loop {
            if let Some(job) = q.demand.pop_front() {
                q.demand_active += 1;
                return Some(job);
            }
            if q.demand_active == 0 || q.closed {
                return None;
            }
            q = match self.changed.wait_timeout(q, Duration::from_millis(50)) {
                Ok((guard, _)) => guard,
                Err(_) => return None,
            };
        }
    }

    fn demand_done(&self) {
        if let Some(mut q) = self.lock() {
            q.demand_active = q.demand_active.saturating_sub(1);
            if q.demand_active == 0 {
                self.changed.notify_all();
            }
        }
    }
}

/// One reader thread: takes jobs until the pool closes or the store stops
/// listening.
fn reader_loop(file: &File, shared: &Shared, done: &Sender<Done>) {
    while let Some((job, background)) = shared.next_job() {
        let result = if background {
            match read_in_pieces(file, &job, shared, done) {
                Some(r) => r,
                None => return,
            }
        } else {
            read_demand(file, &job, shared)
        };
        if let Some(result) = job.finish(result) {
            if done.send(Done { id: job.id, result }).is_err() {
                return;
            }
        }
    }
}

/// Reads into `buf` from `offset` until at least `need` bytes arrived or
/// `buf` is full; fewer than `need` (the file ends) is an error.
fn read_at_least(file: &File, buf: &mut [u8], offset: u64, need: usize) -> std::io::Result<()> {
    let mut done = 0;
    while done < need.min(buf.len()) {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the file ends {} bytes into a read of {need}", done),
                ))
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_demand(file: &File, job: &Job, shared: &Shared) -> std::io::Result<()> {
    let seg = &job.seg;
    // SAFETY: see `Dest`: this thread is the only writer of `dest[..len]`
    // until the job's `Done` is sent.
    let buf = unsafe { std::slice::from_raw_parts_mut(seg.dest.0, seg.len) };
    let result = read_at_least(file, buf, seg.offset, seg.need);
    shared.demand_done();
    result
}

/// Reads a background job in pieces of [`BACKGROUND_PIECE`], serving the
/// queued demand reads and letting those in progress finish before each
/// piece. `None` when the store stopped listening.
fn read_in_pieces(
    file: &File,
    job: &Job,
    shared: &Shared,
    done: &Sender<Done>,
) -> Option<std::io::Result<()>> {
    let seg = &job.seg;
    let mut at = 0;
    while at < seg.need {
        while let Some(demand) = shared.demand_before_piece() {
            let result = read_demand(file, &demand, shared);
            if let Some(result) = demand.finish(result) {
                done.send(Done {
                    id: demand.id,
                    result,
                })
                .ok()?;
            }
        }
        let n = (seg.len - at).min(BACKGROUND_PIECE);
        // SAFETY: see `Dest`: this thread is the only writer of the job's
        // range until its `Done` is sent; `at + n <= len`.
        let piece = unsafe { std::slice::from_raw_parts_mut(seg.dest.0.add(at), n) };
        let need = (seg.need - at).min(n);
        if let Err(e) = read_at_least(file, piece, seg.offset + at as u64, need) {
            return Some(Err(e));
        }
        at += n;
    }
    Some(Ok(()))
}

impl Segment {
    /// `len` bytes at `offset` into `dest`, the first `need` required.
    pub fn new(offset: u64, len: usize, need: usize, dest: *mut u8) -> Self {
        Segment {
            offset,
            len,
            need: need.min(len),
            dest: Dest(dest),
        }
    }
}

/// A finished read.
pub struct Done {
    pub id: usize,
    pub result: std::io::Result<()>,
}

pub struct ReaderPool {
    shared: Arc<Shared>,
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
        let shared = Arc::new(Shared::default());
        let (done_tx, done_rx) = channel::<Done>();
        let threads = (0..threads.max(1))
            .map(|i| {
                let file = file.clone();
                let shared = shared.clone();
                let done_tx = done_tx.clone();
                std::thread::Builder::new()
                    .name(format!("expert-reader-{i}"))
                    .spawn(move || reader_loop(&file, &shared, &done_tx))
                    .expect("spawning a reader thread")
            })
            .collect();
        ReaderPool {
            shared,
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
        unsafe { self.queue(id, vec![Segment::new(offset, len, len, dest)], false) };
    }

    /// Queues the reads of several segments (one expert's parts) as one
    /// submission: the segments are queued together and taken by the
    /// reader threads in parallel (so they overlap); one [`Done`] comes
    /// for the submission, after its last segment.
    ///
    /// # Safety
    /// Every segment's `dest..dest+len` must stay valid and untouched by
    /// the caller until the matching [`Done`] has been received.
    pub unsafe fn submit_segments(&self, id: usize, segments: Vec<Segment>, background: bool) {
        // SAFETY: forwarded from the caller.
        unsafe { self.queue(id, segments, background) };
    }

    /// Queues a background read: like [`ReaderPool::submit`], but taken
    /// only when no demand read is queued, and read in pieces that give way
    /// to demand reads (see the module doc).
    ///
    /// # Safety
    /// As for [`ReaderPool::submit`].
    pub unsafe fn submit_background(&self, id: usize, offset: u64, len: usize, dest: *mut u8) {
        // SAFETY: forwarded from the caller.
        unsafe { self.queue(id, vec![Segment::new(offset, len, len, dest)], true) };
    }

    /// # Safety
    /// As for [`ReaderPool::submit`]: a reader writes each segment's
    /// `dest..dest+len`.
    unsafe fn queue(&self, id: usize, segments: Vec<Segment>, background: bool) {
        let group = (segments.len() > 1).then(|| {
            Arc::new(Group {
                left: AtomicUsize::new(segments.len()),
                error: Mutex::new(None),
            })
        });
        if let Some(mut q) = self.shared.lock() {
            for seg in segments {
                let job = Job {
                    id,
                    seg,
                    group: group.clone(),
                };
                if background {
                    q.background.push_back(job);
                } else {
                    q.demand.push_back(job);
                }
            }
            self.shared.changed.notify_all();
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
        // Readers finish the jobs already queued (their memory is the
        // store's, which outlives the pool), then stop.
        if let Some(mut q) = self.shared.lock() {
            q.closed = true;
        }
        self.shared.changed.notify_all();
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
    fn a_submission_of_segments_completes_once_with_its_bytes_or_an_error() {
        // 3 pages; the last segment's page runs past the end of the file.
        let data: Vec<u8> = (0..3 * 4096 - 100).map(|i| (i * 7 % 253) as u8).collect();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&data).unwrap();
        for threads in [1, 3] {
            for background in [false, true] {
                let pool = ReaderPool::new(File::open(f.path()).unwrap(), threads);
                let mut buf = vec![0u8; 3 * 4096];
                let p = buf.as_mut_ptr();
                // SAFETY: `buf` outlives the reads, waited for below.
                unsafe {
                    pool.submit_segments(
                        5,
                        vec![
                            Segment::new(8192, 4096, 4096 - 100, p),
                            Segment::new(0, 4096, 4096, p.add(4096)),
                            Segment::new(4096, 4096, 4096, p.add(8192)),
                        ],
                        background,
                    );
                }
                let d = pool.wait();
                assert_eq!(d.id, 5);
                d.result.unwrap();
                assert!(pool.try_wait().is_none(), "one completion per submission");
                assert_eq!(&buf[..4096 - 100], &data[8192..]);
                assert_eq!(&buf[4096..], &data[..8192]);
                // A segment the file cannot give: the submission fails once.
                // SAFETY: as above.
                unsafe {
                    pool.submit_segments(
                        6,
                        vec![
                            Segment::new(0, 4096, 4096, p),
                            Segment::new(8192, 4096, 4096, p.add(4096)),
                        ],
                        background,
                    );
                }
                let d = pool.wait();
                assert_eq!(d.id, 6);
                assert!(d.result.is_err());
                drop(pool);
            }
        }
    }

    #[test]
    fn background_pieces_wait_for_demand_reads_in_progress() {
        let shared = Arc::new(Shared::default());
        // A demand read taken by another reader.
        shared.lock().unwrap().demand_active = 1;
        let passed = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (shared, passed) = (shared.clone(), passed.clone());
            std::thread::spawn(move || {
                let served = shared.demand_before_piece();
                passed.store(true, Ordering::SeqCst);
                served.is_none()
            })
        };
        // Longer than the wait's timeout: a wait that wakes up must see
        // the demand read still running and wait again.
        std::thread::sleep(Duration::from_millis(120));
        assert!(
            !passed.load(Ordering::SeqCst),
            "background piece ran beside a demand read"
        );
        shared.demand_done();
        assert!(waiter.join().unwrap());
        assert!(passed.load(Ordering::SeqCst));
        // A queued demand read is handed to the background reader first.
        let mut byte = 0u8;
        shared.lock().unwrap().demand.push_back(Job {
            id: 3,
            seg: Segment::new(0, 1, 1, &mut byte),
            group: None,
        });
        let job = shared.demand_before_piece().expect("queued demand read");
        assert_eq!(job.id, 3);
        assert_eq!(shared.lock().unwrap().demand_active, 1);
        shared.demand_done();
        assert!(shared.demand_before_piece().is_none());
    }
}
