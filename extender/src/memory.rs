//! Handing memory back after the initial lists. Listing a large cluster parses every Pod once
//! (51,000 pods: about 170 MiB of short-lived objects); glibc's allocator keeps those pages
//! unless asked, so the extender would sit on 255 MiB where its view needs 87 MiB
//! (BENCHMARKS.md). The daemon does the same after its large device lists.

/// Gives the allocator's free pages back to the kernel (a no-op on C libraries other than glibc).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn release_free_memory() {
    // SAFETY: malloc_trim takes no pointers and is thread-safe; it only returns free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Gives free memory back (no-op here).
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_memory() {}
