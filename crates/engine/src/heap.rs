//! How the C heap treats activation buffers (glibc on Linux; elsewhere
//! nothing changes).
//!
//! A prefill chunk allocates and frees buffers of 50-200 MB in every layer
//! (projections, routed-expert outputs per rank). glibc serves each
//! allocation above 32 MiB with a fresh `mmap` and unmaps it on free, so
//! every layer faulted in and zeroed its activations again: 6 % of a
//! 3,072-token prefill of the 35B model on the dev VM. While a prefill runs,
//! [`PrefillHeap`] has glibc serve them from the heap and keep what is freed
//! there for the next layer; when it ends, the free part goes back to the
//! kernel, so an idle process's footprint is its live data again.
//!
//! glibc's main heap (the `slipstream run` thread's) holds buffers of any
//! size; the heaps of other threads' arenas are at most 64 MiB each, so on
//! the server's engine thread only buffers below that are kept (all of them
//! for chunks of up to ~1k tokens of the 35B model).

/// Free heap memory glibc keeps at the top of the heap during a prefill
/// instead of returning it (glibc's default is 128 KiB).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const KEEP_FREED_BYTES: libc::c_int = 1 << 30;

/// glibc's default for the most `mmap`ed allocations at a time.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const DEFAULT_MMAP_MAX: libc::c_int = 65536;

/// Size from which allocations are `mmap`ed outside a prefill: the most
/// glibc's own sliding threshold reaches (32 MiB on 64-bit), which setting
/// any parameter freezes, so decode's per-token buffers (logits, 1 MB) stay
/// in the heap.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 32 << 20;

/// Held for the length of a prefill: large allocations come from the heap
/// and freed memory stays there; on drop, allocations from
/// [`MMAP_THRESHOLD`] up are mapped again and the heap's free pages are
/// returned to the kernel.
pub struct PrefillHeap {
    _private: (),
}

impl PrefillHeap {
    pub fn enter() -> PrefillHeap {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: `mallopt` only changes the allocator's parameters, under
        // the allocator's own locks; any value is valid for these two.
        unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0);
            libc::mallopt(libc::M_TRIM_THRESHOLD, KEEP_FREED_BYTES);
        }
        PrefillHeap { _private: () }
    }

    /// Returns the heap's free pages to the kernel now (between prefill
    /// chunks, so the memory guard's footprint is live data only and the
    /// next chunk's predicted activations are not counted twice).
    pub fn release_freed(&self) {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: `malloc_trim` only hands free heap pages back to the
        // kernel; live allocations are untouched.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

impl Drop for PrefillHeap {
    fn drop(&mut self) {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: as in `enter`.
        unsafe {
            libc::mallopt(libc::M_MMAP_MAX, DEFAULT_MMAP_MAX);
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        }
        self.release_freed();
    }
}
