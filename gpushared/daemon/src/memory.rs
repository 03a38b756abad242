//! Keeping the daemon's resident memory small.
//!
//! In MiB mode the kubelet's device lists are large (131 072 IDs for 8 GPUs of 16 GiB), and they
//! pass through the daemon as short-lived strings: the device list it sends, and the list of
//! free devices in every `GetPreferredAllocation` request. glibc's allocator keeps the pages
//! such a burst leaves behind, in one arena per thread that touched them, so without care a
//! daemon that needs a few MiB sits on tens. Two measures (figures in BENCHMARKS.md):
//!
//! - [`limit_arenas`] at startup, before any thread starts: two arenas instead of eight per core,
//!   and buffers of 1 MiB and more (the encoded device lists) always in their own mappings,
//!   returned to the kernel when freed (glibc otherwise raises that threshold after the first
//!   large buffer is freed, and later ones then fragment the heap); smaller working buffers stay
//!   in the heap, where reusing them is cheaper than mapping fresh pages on every request;
//! - [`release_free_memory`] after each burst: free pages go back to the kernel, after a large
//!   list at once, and ([`trim_after_bursts`]) once a burst of allocations has been quiet for a
//!   second, and every 10 s.
//!
//! Both are no-ops on C libraries other than glibc.

/// A list of at least this many device IDs leaves enough freed memory behind to be worth
/// returning at once.
pub const LARGE_LIST: usize = 4096;

/// Limits glibc's allocator to `n` arenas and fixes its mmap threshold at 1 MiB. Call before
/// the runtime starts any thread.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn limit_arenas(n: u16) {
    // SAFETY: mallopt only sets a tunable of the allocator; it takes no pointers. A refusal
    // leaves glibc's default, which is only more memory.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, i32::from(n));
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1024 * 1024);
    }
}

/// Limits the allocator's arenas (no-op here).
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn limit_arenas(_n: u16) {}

/// Called once a list of `ids` device IDs has been dropped: returns the freed pages when the
/// list was large enough to matter ([`LARGE_LIST`]).
pub fn after_list(ids: usize) {
    if ids >= LARGE_LIST {
        release_free_memory();
    }
}

/// Gives the allocator's free pages back to the kernel. Costs a walk of the heap (well under a
/// millisecond for this daemon), so call it after a burst, not on every request.
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

/// How long a burst of allocations must be quiet before its freed pages are returned.
pub const QUIET: std::time::Duration = std::time::Duration::from_secs(1);

/// Returns free pages every 10 s, and [`QUIET`] after the last of a burst of changes seen on
/// `changes` (the allocator's): the steady state of a node holds no pages its last burst freed.
/// Runs until the sender is gone.
pub async fn trim_after_bursts(mut changes: tokio::sync::watch::Receiver<u64>) {
    let mut every = tokio::time::interval(std::time::Duration::from_secs(10));
    loop {
        tokio::select! {
            _ = every.tick() => {}
            changed = changes.changed() => {
                if changed.is_err() {
                    return;
                }
                loop {
                    match tokio::time::timeout(QUIET, changes.changed()).await {
                        Ok(Ok(())) => {}
                        Ok(Err(_)) => return,
                        Err(_) => break,
                    }
                }
            }
        }
        let _ = tokio::task::spawn_blocking(release_free_memory).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn trims_after_a_quiet_second_and_stops_with_the_allocator() {
        let (tx, rx) = tokio::sync::watch::channel(0u64);
        let task = tokio::spawn(trim_after_bursts(rx));
        for i in 1..=3 {
            tx.send_replace(i);
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        tokio::time::sleep(QUIET + std::time::Duration::from_millis(300)).await;
        assert!(!task.is_finished(), "it keeps going while the allocator lives");
        drop(tx);
        tokio::time::timeout(std::time::Duration::from_secs(15), task).await.unwrap().unwrap();
    }
}
