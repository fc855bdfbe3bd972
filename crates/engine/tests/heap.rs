//! `heap::keep_freed_memory` keeps freed activation memory in the process
//! for reuse, and `heap::release_freed` returns it. Runs on the main thread
//! (no test harness): glibc serves the main thread from the heap that the
//! setting applies to in full.

use slipstream_engine::guard::current_rss_bytes;
use slipstream_engine::heap;

/// An activation-sized buffer, written so its pages are resident.
const BUFFER: usize = 256 << 20;

fn main() {
    if !cfg!(all(target_os = "linux", target_env = "gnu")) {
        println!("heap: glibc on Linux only; skipped");
        return;
    }
    let rss = || current_rss_bytes().expect("VmRSS readable on Linux");
    heap::keep_freed_memory();
    let before = rss();
    let buf = vec![1u8; BUFFER];
    std::hint::black_box(&buf);
    let held = rss();
    assert!(
        held >= before + BUFFER as u64 * 9 / 10,
        "buffer not resident: {before} -> {held}"
    );
    drop(buf);
    let kept = rss();
    assert!(
        kept >= before + BUFFER as u64 * 9 / 10,
        "freed buffer returned at once: {before} -> {kept}"
    );
    // The next allocation of that size reuses the kept pages.
    let again = vec![2u8; BUFFER];
    std::hint::black_box(&again);
    assert!(
        rss() < kept + (BUFFER as u64) / 10,
        "second buffer did not reuse the first"
    );
    drop(again);
    {
        let _release = heap::ReleaseOnDrop;
    }
    let after = rss();
    assert!(
        after < before + (BUFFER as u64) / 10,
        "freed memory kept after release: {before} -> {after}"
    );
    println!(
        "heap: ok ({} MB kept until released, {} MB after)",
        (kept - before) >> 20,
        after.saturating_sub(before) >> 20
    );
}
