//! `slipstream hwbench`: the ceilings of the machine slipstream runs on.
//!
//! * SSD reads with the page cache bypassed (`O_DIRECT`) on a scratch file of
//!   unique (pseudo-random, incompressible) data; every test reads its own
//!   fresh region so no test is served by an earlier one: sequential 4 MiB,
//!   one expert as 3 separate reads (gate, up, down) vs 1 contiguous record,
//!   random 4 KiB, each at several reader-thread counts; plus a cached-RAM
//!   control (buffered reads of a region already in the page cache).
//! * Memory read bandwidth at 1..N threads.
//! * Kernel ceilings: the q4 matrix-vector kernel in GB/s of weights on
//!   expert-sized matrices (a pool of distinct experts larger than the caches,
//!   as decode sees them) and the head-sized matrix, and the prefill matrix
//!   kernel in GFLOP/s.
//! * Rayon fork/join cost per parallel call.
//! * A sustained load (the head matvec on all threads) in windows, showing
//!   any sag.
//!
//! [`run`] returns a [`Report`] (serde-serializable); [`Report::table`]
//! renders it as text.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use serde::Serialize;
use slipstream_core::{QuantType, TensorView};
use slipstream_kernels as k;

/// Bytes of one expert record of the 35B model (gate + up + down, q4).
pub const EXPERT_BYTES: usize = 1_769_472;
/// One expert part (a third of [`EXPERT_BYTES`]).
pub const EXPERT_PART_BYTES: usize = EXPERT_BYTES / 3;
const SEQ_BLOCK: usize = 4 << 20;
const RAND_BLOCK: usize = 4096;
const ALIGN: usize = 4096;

/// What to measure.
#[derive(Debug, Clone)]
pub struct Config {
    /// Directory for the scratch file (on the disk that holds the models).
    pub scratch_dir: PathBuf,
    /// Size of the scratch file; each SSD test gets an equal fresh share.
    pub scratch_bytes: u64,
    /// Reader-thread counts for the SSD tests.
    pub io_threads: Vec<usize>,
    /// Longest time one SSD test reads for.
    pub io_test_secs: f64,
    /// Skip the SSD tests.
    pub skip_ssd: bool,
    /// Bytes of the memory-bandwidth buffer.
    pub mem_bytes: usize,
    /// Bytes of the pool of distinct expert matrices for the kernel test.
    pub expert_pool_bytes: usize,
    /// Rows of the head-sized matrix (248320 for the real head).
    pub head_rows: usize,
    /// Tokens of the prefill matmul test.
    pub prefill_tokens: usize,
    /// Seconds of sustained load (0: skip).
    pub sustain_secs: f64,
    /// Keep the scratch file afterwards.
    pub keep_scratch: bool,
}

impl Config {
    /// The full benchmark (a few minutes plus `sustain_secs`).
    pub fn full(scratch_dir: PathBuf, scratch_gb: f64, sustain_secs: f64) -> Config {
        Config {
            scratch_dir,
            scratch_bytes: (scratch_gb * (1u64 << 30) as f64) as u64,
            io_threads: vec![1, 2, 4, 8],
            io_test_secs: 3.0,
            skip_ssd: false,
            mem_bytes: 1 << 30,
            expert_pool_bytes: 768 << 20,
            head_rows: 248_320,
            prefill_tokens: 256,
            sustain_secs,
            keep_scratch: false,
        }
    }

    /// A few seconds in all: small sizes, for tests and a first look.
    pub fn quick(scratch_dir: PathBuf) -> Config {
        Config {
            scratch_dir,
            scratch_bytes: 64 << 20,
            io_threads: vec![1, 2],
            io_test_secs: 0.2,
            skip_ssd: false,
            mem_bytes: 32 << 20,
            expert_pool_bytes: 8 << 20,
            head_rows: 4096,
            prefill_tokens: 16,
            sustain_secs: 0.5,
            keep_scratch: false,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub isa: String,
    /// 1-minute load average at the start and at the end.
    pub load_avg_start: f64,
    pub load_avg_end: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct IoPoint {
    /// `seq_4m`, `expert_3reads`, `expert_1read`, `random_4k`, `cached_ram`.
    pub pattern: String,
    /// Bytes of one read.
    pub read_bytes: usize,
    pub threads: usize,
    pub bytes: u64,
    pub secs: f64,
    pub gb_s: f64,
    /// Reads per second.
    pub iops: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Ssd {
    pub scratch_file: String,
    /// Whether reads bypassed the page cache with O_DIRECT (else buffered
    /// reads after evicting the file, which the control shows when it fails).
    pub direct: bool,
    pub write_gb_s: f64,
    pub tests: Vec<IoPoint>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BwPoint {
    pub threads: usize,
    pub gb_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct KernelPoint {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub tokens: usize,
    pub threads: usize,
    /// Microseconds per call (per matrix).
    pub us: f64,
    /// Weight bytes read per second.
    pub gb_s: f64,
    pub gflop_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Sustain {
    pub secs: f64,
    pub window_secs: f64,
    /// GB/s of weights per window.
    pub windows_gb_s: Vec<f64>,
    /// `100 * (1 - last window / first window)`.
    pub sag_pct: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ForkJoin {
    pub threads: usize,
    /// One `par_iter` over `threads` items doing nothing.
    pub par_iter_us: f64,
    /// One `rayon::join` of two empty closures.
    pub join_us: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub machine: Machine,
    pub ssd: Option<Ssd>,
    pub memory: Vec<BwPoint>,
    pub memory_best_gb_s: f64,
    pub kernels: Vec<KernelPoint>,
    pub fork_join: ForkJoin,
    pub sustain: Option<Sustain>,
    /// Reader threads with the best one-record-per-expert throughput (the
    /// smallest count within 5 % of the best).
    pub best_reader_threads: Option<usize>,
}

/// Runs every measurement; `log` receives progress lines.
pub fn run(cfg: &Config, log: &mut dyn FnMut(&str)) -> std::io::Result<Report> {
    let load_avg_start = load_avg();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let ssd = if cfg.skip_ssd {
        None
    } else {
        log("ssd: writing scratch file");
        Some(ssd_tests(cfg, log)?)
    };
    log("memory bandwidth");
    let memory = mem_tests(cfg.mem_bytes, cpus);
    let memory_best_gb_s = memory.iter().map(|p| p.gb_s).fold(0.0, f64::max);
    log("kernels");
    let kernels = kernel_tests(cfg, cpus);
    let fork_join = fork_join(cpus);
    let sustain = (cfg.sustain_secs > 0.0).then(|| {
        log("sustained load");
        sustain(cfg)
    });
    let best_reader_threads = ssd.as_ref().and_then(best_threads);
    Ok(Report {
        machine: Machine {
            cpus,
            cpu_model: cpu_model(),
            isa: k::Isa::detect().describe().to_string(),
            load_avg_start,
            load_avg_end: load_avg(),
        },
        ssd,
        memory,
        memory_best_gb_s,
        kernels,
        fork_join,
        sustain,
        best_reader_threads,
    })
}

fn best_threads(ssd: &Ssd) -> Option<usize> {
    let pts: Vec<&IoPoint> = ssd
        .tests
        .iter()
        .filter(|p| p.pattern == "expert_1read")
        .collect();
    let best = pts.iter().map(|p| p.gb_s).fold(0.0, f64::max);
    pts.iter()
        .filter(|p| p.gb_s >= 0.95 * best)
        .map(|p| p.threads)
        .min()
}

/// The 1-minute load average (0 where unknown).
pub fn load_avg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------
// Unique data
// ---------------------------------------------------------------------------

/// Fills `buf` with incompressible bytes that depend on `seed` (xorshift64*).
pub fn fill_unique(buf: &mut [u8], seed: u64) {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut chunks = buf.chunks_exact_mut(8);
    for c in &mut chunks {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        c.copy_from_slice(&s.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    for b in chunks.into_remainder() {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        *b = s as u8;
    }
}

/// A page-aligned heap buffer (O_DIRECT needs aligned memory).
struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain owned memory.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let layout = std::alloc::Layout::from_size_align(len.max(ALIGN), ALIGN).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "allocation of {len} bytes failed");
        AlignedBuf { ptr, len }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len.max(ALIGN), ALIGN).unwrap();
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) }
    }
}

// ---------------------------------------------------------------------------
// SSD
// ---------------------------------------------------------------------------

/// One read pattern: a list of (offset, len) operations over a region; an
/// "operation" may be several reads (the 3-part expert).
struct Pattern {
    name: &'static str,
    /// Reads of one operation, as (offset within the op, length).
    parts: Vec<(u64, usize)>,
    /// Bytes between consecutive op slots.
    stride: u64,
    /// Random order of slots (else ascending).
    random: bool,
}

fn ssd_tests(cfg: &Config, log: &mut dyn FnMut(&str)) -> std::io::Result<Ssd> {
    let patterns = [
        Pattern {
            name: "seq_4m",
            parts: vec![(0, SEQ_BLOCK)],
            stride: SEQ_BLOCK as u64,
            random: false,
        },
        Pattern {
            name: "expert_3reads",
            parts: (0..3)
                .map(|i| ((i * EXPERT_PART_BYTES) as u64, EXPERT_PART_BYTES))
                .collect(),
            stride: EXPERT_BYTES as u64,
            random: true,
        },
        Pattern {
            name: "expert_1read",
            parts: vec![(0, EXPERT_BYTES)],
            stride: EXPERT_BYTES as u64,
            random: true,
        },
        Pattern {
            name: "random_4k",
            parts: vec![(0, RAND_BLOCK)],
            stride: RAND_BLOCK as u64,
            random: true,
        },
    ];
    let ntests = patterns.len() * cfg.io_threads.len() + 1;
    let region = (cfg.scratch_bytes / ntests as u64) / SEQ_BLOCK as u64 * SEQ_BLOCK as u64;
    if region < 2 * EXPERT_BYTES as u64 {
        return Err(std::io::Error::other(format!(
            "scratch file of {} bytes is too small for {ntests} fresh regions",
            cfg.scratch_bytes
        )));
    }
    let total = region * ntests as u64;
    std::fs::create_dir_all(&cfg.scratch_dir)?;
    let path = cfg
        .scratch_dir
        .join(format!("slipstream-hwbench-{}.scratch", std::process::id()));
    let result = (|| {
        let write_gb_s = write_scratch(&path, total)?;
        let (file, direct) = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
        {
            Ok(f) => (f, true),
            Err(_) => (File::open(&path)?, false),
        };
        let mut tests = Vec::new();
        let mut next_region = 0u64;
        for p in &patterns {
            for &threads in &cfg.io_threads {
                let base = next_region * region;
                next_region += 1;
                if !direct {
                    evict(&file, base, region);
                }
                let pt = read_test(&file, p, base, region, threads, cfg.io_test_secs)?;
                log(&format!(
                    "  {} x{}: {:.2} GB/s",
                    pt.pattern, pt.threads, pt.gb_s
                ));
                tests.push(pt);
            }
        }
        // Cached-RAM control: buffered reads of a region read once before.
        let base = next_region * region;
        let buffered = File::open(&path)?;
        let warm = Pattern {
            name: "cached_ram",
            parts: vec![(0, EXPERT_BYTES)],
            stride: EXPERT_BYTES as u64,
            random: true,
        };
        read_test(&buffered, &warm, base, region, 1, f64::INFINITY)?;
        for &threads in &cfg.io_threads {
            tests.push(read_test(
                &buffered,
                &warm,
                base,
                region,
                threads,
                cfg.io_test_secs,
            )?);
        }
        Ok(Ssd {
            scratch_file: path.display().to_string(),
            direct,
            write_gb_s,
            tests,
        })
    })();
    if !cfg.keep_scratch {
        let _ = std::fs::remove_file(&path);
    }
    result
}

/// Writes `total` bytes of unique data, fsyncs and evicts it from the cache.
fn write_scratch(path: &std::path::Path, total: u64) -> std::io::Result<f64> {
    let mut f = File::create(path)?;
    let mut buf = vec![0u8; SEQ_BLOCK];
    let t0 = Instant::now();
    let mut off = 0u64;
    while off < total {
        fill_unique(&mut buf, off / SEQ_BLOCK as u64 + 1);
        f.write_all(&buf)?;
        off += SEQ_BLOCK as u64;
    }
    f.sync_all()?;
    let secs = t0.elapsed().as_secs_f64();
    evict(&f, 0, total);
    Ok(total as f64 / secs / 1e9)
}

fn evict(f: &File, off: u64, len: u64) {
    // SAFETY: plain syscall on an open descriptor.
    unsafe {
        libc::posix_fadvise(
            f.as_raw_fd(),
            off as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}

fn read_test(
    file: &File,
    p: &Pattern,
    base: u64,
    region: u64,
    threads: usize,
    max_secs: f64,
) -> std::io::Result<IoPoint> {
    let slots = (region / p.stride) as usize;
    let mut order: Vec<usize> = (0..slots).collect();
    if p.random {
        // Fisher-Yates with a fixed xorshift stream.
        let mut s = 0x1234_5678_9abc_def1u64 ^ base;
        for i in (1..order.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            order.swap(i, (s % (i as u64 + 1)) as usize);
        }
    }
    let next = AtomicUsize::new(0);
    let op_len: usize = p.parts.iter().map(|x| x.1).sum();
    let deadline = Duration::from_secs_f64(max_secs.min(1e6));
    let fd = file.as_raw_fd();
    let t0 = Instant::now();
    let done: Vec<std::io::Result<usize>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> std::io::Result<usize> {
                    let buf = AlignedBuf::new(op_len);
                    let mut ops = 0;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= order.len() || t0.elapsed() > deadline {
                            return Ok(ops);
                        }
                        let slot_off = base + order[i] as u64 * p.stride;
                        let mut at = 0usize;
                        for &(o, len) in &p.parts {
                            let mut got = 0usize;
                            while got < len {
                                // SAFETY: `buf` has op_len >= at + len bytes.
                                let r = unsafe {
                                    libc::pread(
                                        fd,
                                        buf.ptr.add(at + got).cast(),
                                        len - got,
                                        (slot_off + o + got as u64) as libc::off_t,
                                    )
                                };
                                if r < 0 {
                                    return Err(std::io::Error::last_os_error());
                                }
                                if r == 0 {
                                    return Err(std::io::Error::other("short read"));
                                }
                                got += r as usize;
                            }
                            at += len;
                        }
                        ops += 1;
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    let mut ops = 0;
    for d in done {
        ops += d?;
    }
    let bytes = (ops * op_len) as u64;
    Ok(IoPoint {
        pattern: p.name.to_string(),
        read_bytes: p.parts[0].1,
        threads,
        bytes,
        secs,
        gb_s: bytes as f64 / secs / 1e9,
        iops: (ops * p.parts.len()) as f64 / secs,
    })
}

// ---------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------

/// Sums `u64` words (the compiler vectorises the independent lanes).
#[inline(never)]
fn read_sum(buf: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    for c in buf.chunks_exact(8) {
        for i in 0..8 {
            acc[i] = acc[i].wrapping_add(c[i]);
        }
    }
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}

fn mem_tests(bytes: usize, cpus: usize) -> Vec<BwPoint> {
    let words = bytes / 8;
    let mut buf = vec![0u64; words];
    buf.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(i, c)| fill_unique(bytemuck_u8(c), i as u64 + 7));
    (1..=cpus)
        .map(|threads| BwPoint {
            threads,
            gb_s: mem_bw(&buf, threads),
        })
        .collect()
}

fn bytemuck_u8(c: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64 has no invalid bit patterns and u8 has alignment 1.
    unsafe { std::slice::from_raw_parts_mut(c.as_mut_ptr().cast(), c.len() * 8) }
}

/// Read bandwidth of `threads` threads each summing its share of `buf`
/// (best of several passes).
pub fn mem_bw(buf: &[u64], threads: usize) -> f64 {
    let share = buf.len() / threads / 8 * 8;
    let mut best = 0f64;
    let mut sink = 0u64;
    let t_all = Instant::now();
    let mut passes = 0;
    while passes < 3 || (t_all.elapsed().as_secs_f64() < 0.5 && passes < 20) {
        let t0 = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|i| {
                    let part = &buf[i * share..(i + 1) * share];
                    s.spawn(move || read_sum(part))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let dt = t0.elapsed().as_secs_f64();
        sink = sink.wrapping_add(sums.iter().sum::<u64>());
        best = best.max((share * threads * 8) as f64 / dt / 1e9);
        passes += 1;
    }
    std::hint::black_box(sink);
    best
}

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------

/// Random q4 (group 64, f16 scales) weights for `count` matrices of
/// `[rows, cols]`, back to back; returns the bytes and one matrix's size.
pub fn random_q4(rows: usize, cols: usize, count: usize, seed: u64) -> (Vec<u8>, usize) {
    let q = QuantType::Q4;
    let one = q.nbytes(rows, cols);
    let mut data = vec![0u8; one * count];
    data.par_chunks_mut(one).enumerate().for_each(|(i, m)| {
        fill_unique(m, seed + i as u64);
        // Sane scales and biases (small f16 values) after the codes.
        let code_bytes = rows * cols / 2;
        for (j, p) in m[code_bytes..].chunks_exact_mut(2).enumerate() {
            let v = ((j * 2654435761usize) % 2001) as f32 * 1e-5 - 0.01;
            p.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    });
    (data, one)
}

fn pool_with(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool")
}

/// Times `f` (one call = one unit) for at least `min_secs` after a warm-up;
/// best per-call seconds of 3 rounds.
fn time_calls(min_secs: f64, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t0 = Instant::now();
        let mut n = 0;
        while n == 0 || t0.elapsed().as_secs_f64() < min_secs / 3.0 {
            f();
            n += 1;
        }
        best = best.min(t0.elapsed().as_secs_f64() / n as f64);
    }
    best
}

fn kernel_tests(cfg: &Config, cpus: usize) -> Vec<KernelPoint> {
    let mut out = Vec::new();
    for (act, suffix) in [
        (k::Activations::Exact, ""),
        (k::Activations::Int16, "_i16act"),
    ] {
        kernel_tests_with(cfg, cpus, act, suffix, &mut out);
    }
    out
}

/// The kernel ceilings with one activation mode (`suffix` marks the name of
/// the non-default one).
fn kernel_tests_with(
    cfg: &Config,
    cpus: usize,
    act: k::Activations,
    suffix: &str,
    out: &mut Vec<KernelPoint>,
) {
    let isa = k::Isa::detect();
    let thread_counts: Vec<usize> = if cpus > 1 { vec![1, cpus] } else { vec![1] };
    let min_secs = if cfg.expert_pool_bytes < (64 << 20) {
        0.1
    } else {
        1.0
    };
    // Expert-sized: a pool of distinct matrices larger than the caches, each
    // used once per pass (as decode uses each routed expert once per token).
    for (name, rows, cols) in [
        ("q4_matvec_expert_gate_up", 512usize, 2048usize),
        ("q4_matvec_expert_down", 2048, 512),
    ] {
        let one = QuantType::Q4.nbytes(rows, cols);
        let count = (cfg.expert_pool_bytes / one).max(2);
        let (data, one) = random_q4(rows, cols, count, 11);
        let x: Vec<f32> = (0..cols).map(|i| ((i % 89) as f32 - 44.0) / 32.0).collect();
        let mut y = vec![0f32; rows];
        for &threads in &thread_counts {
            let pool = pool_with(threads);
            let mut i = 0;
            let dt = pool.install(|| {
                time_calls(min_secs, || {
                    let w = TensorView::new(QuantType::Q4, rows, cols, &data[i * one..][..one])
                        .unwrap();
                    k::matvec_act(isa, act, &w, &x, &mut y);
                    i = (i + 1) % count;
                })
            });
            out.push(point(
                &format!("{name}{suffix}"),
                rows,
                cols,
                1,
                threads,
                dt,
                one,
            ));
        }
    }
    // Head-sized.
    {
        let (rows, cols) = (cfg.head_rows, 2048);
        let (data, one) = random_q4(rows, cols, 1, 23);
        let w = TensorView::new(QuantType::Q4, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..cols).map(|i| ((i % 61) as f32 - 30.0) / 16.0).collect();
        let mut y = vec![0f32; rows];
        for &threads in &thread_counts {
            let pool = pool_with(threads);
            let dt =
                pool.install(|| time_calls(min_secs, || k::matvec_act(isa, act, &w, &x, &mut y)));
            out.push(point(
                &format!("q4_matvec_head{suffix}"),
                rows,
                cols,
                1,
                threads,
                dt,
                one,
            ));
        }
    }
    // Prefill: one expert matrix against a block of tokens.
    {
        let (rows, cols, n) = (512, 2048, cfg.prefill_tokens);
        let (data, one) = random_q4(rows, cols, 1, 31);
        let w = TensorView::new(QuantType::Q4, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i % 97) as f32 - 48.0) / 64.0)
            .collect();
        let mut y = vec![0f32; n * rows];
        for &threads in &thread_counts {
            let pool = pool_with(threads);
            let dt = pool
                .install(|| time_calls(min_secs, || k::matmul_act(isa, act, &w, &x, n, &mut y)));
            out.push(point(
                &format!("q4_matmul_prefill{suffix}"),
                rows,
                cols,
                n,
                threads,
                dt,
                one,
            ));
        }
    }
}

fn point(
    name: &str,
    rows: usize,
    cols: usize,
    tokens: usize,
    threads: usize,
    secs: f64,
    bytes: usize,
) -> KernelPoint {
    KernelPoint {
        name: name.to_string(),
        rows,
        cols,
        tokens,
        threads,
        us: secs * 1e6,
        gb_s: bytes as f64 / secs / 1e9,
        gflop_s: 2.0 * (rows * cols * tokens) as f64 / secs / 1e9,
    }
}

fn fork_join(cpus: usize) -> ForkJoin {
    let pool = pool_with(cpus);
    let (par_iter_us, join_us) = pool.install(|| {
        let calls = 20_000;
        let t0 = Instant::now();
        for _ in 0..calls {
            (0..cpus).into_par_iter().for_each(|i| {
                std::hint::black_box(i);
            });
        }
        let a = t0.elapsed().as_secs_f64() / calls as f64 * 1e6;
        let t0 = Instant::now();
        for _ in 0..calls {
            rayon::join(|| std::hint::black_box(1), || std::hint::black_box(2));
        }
        let b = t0.elapsed().as_secs_f64() / calls as f64 * 1e6;
        (a, b)
    });
    ForkJoin {
        threads: cpus,
        par_iter_us,
        join_us,
    }
}

fn sustain(cfg: &Config) -> Sustain {
    let (rows, cols) = (cfg.head_rows, 2048);
    let (data, one) = random_q4(rows, cols, 1, 41);
    let w = TensorView::new(QuantType::Q4, rows, cols, &data).unwrap();
    let x = vec![0.25f32; cols];
    let mut y = vec![0f32; rows];
    let windows = if cfg.sustain_secs >= 12.0 { 12 } else { 4 };
    let window_secs = cfg.sustain_secs / windows as f64;
    let mut windows_gb_s = Vec::new();
    for _ in 0..windows {
        let t0 = Instant::now();
        let mut n = 0u64;
        while t0.elapsed().as_secs_f64() < window_secs {
            k::matvec(&w, &x, &mut y);
            n += 1;
        }
        windows_gb_s.push(n as f64 * one as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    let first = windows_gb_s[0];
    let last = *windows_gb_s.last().unwrap();
    Sustain {
        secs: cfg.sustain_secs,
        window_secs,
        sag_pct: 100.0 * (1.0 - last / first),
        windows_gb_s,
    }
}

impl Report {
    /// The report as a text table.
    pub fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let m = &self.machine;
        let _ = writeln!(
            s,
            "machine: {} cpus, {}, kernels {} | load avg {:.2} -> {:.2}",
            m.cpus, m.cpu_model, m.isa, m.load_avg_start, m.load_avg_end
        );
        if let Some(ssd) = &self.ssd {
            let _ = writeln!(
                s,
                "\nSSD ({}, scratch written at {:.2} GB/s)",
                if ssd.direct {
                    "O_DIRECT"
                } else {
                    "buffered, evicted first (no O_DIRECT)"
                },
                ssd.write_gb_s
            );
            let mut threads: Vec<usize> = ssd.tests.iter().map(|p| p.threads).collect();
            threads.sort();
            threads.dedup();
            let _ = write!(s, "{:<16} {:>10}", "pattern", "read");
            for t in &threads {
                let _ = write!(s, " {:>12}", format!("th={t}"));
            }
            let _ = writeln!(s);
            let mut names: Vec<&str> = Vec::new();
            for p in &ssd.tests {
                if !names.contains(&p.pattern.as_str()) {
                    names.push(&p.pattern);
                }
            }
            for name in names {
                let rb = ssd.tests.iter().find(|p| p.pattern == name).unwrap();
                let _ = write!(s, "{:<16} {:>10}", name, human(rb.read_bytes));
                for t in &threads {
                    match ssd
                        .tests
                        .iter()
                        .find(|p| p.pattern == name && p.threads == *t)
                    {
                        Some(p) if name == "random_4k" => {
                            let _ = write!(s, " {:>12}", format!("{:.0} IOPS", p.iops));
                        }
                        Some(p) => {
                            let _ = write!(s, " {:>12}", format!("{:.2} GB/s", p.gb_s));
                        }
                        None => {
                            let _ = write!(s, " {:>12}", "-");
                        }
                    }
                }
                let _ = writeln!(s);
            }
            if let Some(t) = self.best_reader_threads {
                let _ = writeln!(s, "best reader threads (1 read/expert): {t}");
            }
        }
        let _ = writeln!(s, "\nmemory read bandwidth");
        for p in &self.memory {
            let _ = writeln!(s, "  threads={:<3} {:>7.2} GB/s", p.threads, p.gb_s);
        }
        let _ = writeln!(s, "\nkernels");
        for p in &self.kernels {
            let _ = writeln!(
                s,
                "  {:<26} [{}x{}] n={:<4} threads={:<3} {:>9.1} us {:>7.2} GB/s {:>7.1} GFLOP/s ({:.0} % of mem bw)",
                p.name,
                p.rows,
                p.cols,
                p.tokens,
                p.threads,
                p.us,
                p.gb_s,
                p.gflop_s,
                100.0 * p.gb_s / self.memory_best_gb_s
            );
        }
        let f = &self.fork_join;
        let _ = writeln!(
            s,
            "\nrayon fork/join ({} threads): par_iter {:.2} us, join {:.2} us per call",
            f.threads, f.par_iter_us, f.join_us
        );
        if let Some(su) = &self.sustain {
            let _ = writeln!(
                s,
                "\nsustained head matvec {:.0} s ({:.1} s windows): {} GB/s, sag {:.1} %",
                su.secs,
                su.window_secs,
                su.windows_gb_s
                    .iter()
                    .map(|v| format!("{v:.2}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                su.sag_pct
            );
        }
        s
    }
}

fn human(b: usize) -> String {
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}
