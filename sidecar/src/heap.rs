//! How the process's heap treats memory a step frees: kept for the next step rather than given
//! back to the kernel and faulted in again.
//!
//! Every engine step allocates its activations afresh (a prefill of 1000 tokens of SmolLM2
//! takes buffers of 2 to 12 MB per projection) and frees them at its end. glibc's defaults serve
//! allocations over 128 KiB with `mmap` until its dynamic threshold has risen past them, and trim
//! the heap's top once 128 KiB of it is free: either way the next step's buffers are fresh pages,
//! zeroed by the kernel one fault at a time. Measured on the built-in decoder (SmolLM2 Q4_1, the
//! sidecar with and without these settings alternated, medians of 3, 2 cores): a 1003-token
//! prefill 1.46 → 1.12 s, 32 streams 449 → 547 tokens/s, one stream and 8 unchanged; the
//! resident set after that work 230 → 260 MB.
//!
//! No crate sets an allocator's options; `mallopt` is glibc's own interface to them, hence the
//! one foreign function here. Elsewhere (musl, other systems) nothing changes. At high core
//! counts each thread's arena keeps its own largest step's buffers (the threshold applies to
//! each): measured on 2 cores only.

/// Allocations up to this size come from the heap: glibc's highest allowed threshold on 64-bit
/// systems (larger ones are mapped and unmapped whatever the setting).
pub const MMAP_THRESHOLD: i32 = 32 << 20;
/// Freed memory at the heap's top is given back once this much of it is free.
pub const TRIM_THRESHOLD: i32 = 512 << 20;

/// Applies both thresholds; false where the C library refused one (or is not glibc). Call it
/// before any other thread starts: glibc's manual marks `mallopt` MT-Unsafe (it changes
/// parameters that other threads' arenas read without its lock).
pub fn keep_freed_memory() -> bool {
    imp::apply()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
mod imp {
    pub fn apply() -> bool {
        // SAFETY: `mallopt` takes two integers and changes glibc's allocator parameters; it
        // touches no memory of ours. It is called (see `keep_freed_memory`) before any other
        // thread exists, so no arena reads those parameters while they change.
        let mmap = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, super::MMAP_THRESHOLD) };
        // SAFETY: as above.
        let trim = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, super::TRIM_THRESHOLD) };
        mmap == 1 && trim == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod imp {
    pub fn apply() -> bool {
        false
    }
}
