//! What the daemon's latency benchmarks share: nearest-rank percentiles of the samples and
//! the one-line report each prints per measured call.

use std::time::Duration;

/// The `per_mille`-th sample of a sorted list (nearest rank).
pub(crate) fn percentile(sorted: &[Duration], per_mille: usize) -> Duration {
    sorted[(sorted.len() - 1) * per_mille / 1000]
}

/// Prints `name` with the count, p50, p90, p99 and maximum of `samples` (at least one).
pub(crate) fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    println!(
        "{name:<28} n={:<4} p50={:>8.3?} p90={:>8.3?} p99={:>8.3?} max={:>8.3?}",
        samples.len(),
        percentile(&samples, 500),
        percentile(&samples, 900),
        percentile(&samples, 990),
        samples[samples.len() - 1]
    );
}
