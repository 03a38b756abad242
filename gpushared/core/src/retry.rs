//! How gpushared and the extender wait between attempts after their watches of the API server
//! fail: exponential backoff with jitter, in the manner of client-go's reflector, so that the
//! daemons of a whole cluster do not hammer an API server that is coming back, all at once and
//! every second, while the one extender, on every pod's scheduling path, is back within seconds.
//! No clock and no randomness here: the caller passes the jitter and does the waiting.

use std::time::Duration;

/// The waits between attempts against one failing peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
    failures: u32,
}

impl Backoff {
    /// For a client that runs on every node (gpushared): 800 ms doubling to 10 s, as
    /// client-go's reflector starts, capped lower so that a node is current again within
    /// seconds of the API server's return (1,000 nodes then retry at 100 a second at most).
    #[must_use]
    pub const fn per_node() -> Backoff {
        Backoff::new(Duration::from_millis(800), Duration::from_secs(10))
    }

    /// For a client of which a cluster runs one or a few, on every pod's scheduling path (the
    /// extender): 500 ms doubling to 2 s.
    #[must_use]
    pub const fn cluster_wide() -> Backoff {
        Backoff::new(Duration::from_millis(500), Duration::from_secs(2))
    }

    /// `first` after the first failure, doubling after each further one, at most `max`.
    #[must_use]
    pub const fn new(first: Duration, max: Duration) -> Backoff {
        Backoff { first, max, next: first, failures: 0 }
    }

    /// One more failure: how long to wait before the next attempt, with `jitter_permille`
    /// (0–1000, taken modulo 1001) thousandths of the wait added, so that clients that failed
    /// together do not come back together. Never more than `max`.
    pub fn failed(&mut self, jitter_permille: u32) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let base = self.next;
        self.next = base.saturating_mul(2).min(self.max);
        let extra = base.saturating_mul(jitter_permille % 1001) / 1000;
        base.saturating_add(extra).min(self.max)
    }

    /// Failures since the last success.
    #[must_use]
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// A success: the next failure waits `first` again. Returns how many failures it ends.
    pub fn succeeded(&mut self) -> u32 {
        self.next = self.first;
        std::mem::take(&mut self.failures)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_to_the_cap_and_start_over_after_a_success() {
        let mut b = Backoff::per_node();
        let waits: Vec<u128> = (0..6).map(|_| b.failed(0).as_millis()).collect();
        assert_eq!(waits, [800, 1600, 3200, 6400, 10_000, 10_000]);
        let mut c = Backoff::cluster_wide();
        let waits: Vec<u128> = (0..4).map(|_| c.failed(0).as_millis()).collect();
        assert_eq!(waits, [500, 1000, 2000, 2000]);
        assert_eq!(b.failures(), 6);
        assert_eq!(b.succeeded(), 6);
        assert_eq!((b.failures(), b.failed(0)), (0, Duration::from_millis(800)));
    }

    #[test]
    fn jitter_adds_up_to_the_wait_itself_and_never_passes_the_cap() {
        let mut b = Backoff::per_node();
        assert_eq!(b.failed(500), Duration::from_millis(1200));
        assert_eq!(b.failed(1000), Duration::from_millis(3200));
        assert_eq!(b.failed(2002), Duration::from_millis(3200), "taken modulo 1001");
        for _ in 0..10 {
            assert!(b.failed(999) <= Duration::from_secs(10));
        }
        let mut huge = Backoff::new(Duration::MAX, Duration::MAX);
        assert_eq!(huge.failed(1000), Duration::MAX, "saturates");
    }
}
