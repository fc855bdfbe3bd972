//! How the C heap treats activation buffers (glibc on Linux; elsewhere
//! nothing changes).
//!
//! A prefill chunk allocates and frees buffers of 50-200 MB in every layer
//! (projections, routed-expert outputs per rank). By default glibc serves
//! each allocation above its threshold (at most 32 MiB) with a fresh `mmap`
//! and unmaps it on free, and returns freed memory at the top of the heap
//! past 128 KiB, so every layer faulted in and zeroed its activations
//! again. [`keep_freed_memory`] has glibc serve every size from the heap and
//! keep up to 1 GiB freed there for reuse; [`release_freed`] hands the free
//! part back to the kernel between prefill chunks and after a prefill, so
//! the memory guard reads live data and an idle process shrinks again.
//!
//! Measured on the dev VM (35B synthetic model, 1,066-token prompt, 2
//! threads, `slipstream run --resident --phases`): prefill 48.2-49.2
//! ms/token with glibc's defaults, 47.3-48.1 with the setting made only
//! for the prefill, 45.4 with it made before the model loads, as
//! [`crate::Engine::open`] does.
//!
//! glibc's main heap (the main thread's) holds buffers of any size; the
//! heaps of other threads' arenas are at most 64 MiB each, so an engine on
//! another thread keeps only buffers below that (all of them for chunks of
//! up to ~1k tokens of the 35B model). Hence `slipstream serve` runs its
//! engine on the main thread too. Measured (4-layer cut,
//! 3,072-token prompt, `cargo run --release -p slipstream-engine --example
//! prefill_thread -- l4.slip IDS main|thread 2`): 4.65-4.66 ms/token on the
//! main thread, 4.85-4.93 on a spawned one. One arena for every thread
//! (`M_ARENA_MAX` = 1, set before any thread starts) evens them out but
//! slows the main thread to 4.81-4.87 (the compute pool's allocations then
//! share its arena), so it is not set.

/// Free memory glibc keeps at the top of the heap instead of returning it
/// (its default is 128 KiB).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const KEEP_FREED_BYTES: libc::c_int = 1 << 30;

/// Makes glibc serve allocations of every size from the heap and keep
/// freed memory for reuse, for the life of the process (idempotent).
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: `mallopt` only changes the allocator's parameters,
            // under the allocator's own locks; any value is valid for these
            // two.
            unsafe {
                libc::mallopt(libc::M_MMAP_MAX, 0);
                libc::mallopt(libc::M_TRIM_THRESHOLD, KEEP_FREED_BYTES);
            }
        });
    }
}

/// Returns the heap's free pages to the kernel now.
pub fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only hands free heap pages back to the kernel;
    // live allocations are untouched.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Calls [`release_freed`] when dropped: held for a prefill, so its freed
/// activations go back on every way out.
pub struct ReleaseOnDrop;

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        release_freed();
    }
}
