//! The extender's clock, as a seam: the view reads the time through [`Clock`] to date heartbeat
//! renewals, judge nodes stale and expire in-flight binds. The binaries use [`SystemClock`];
//! tests move a [`ManualClock`] by hand instead of sleeping through heartbeat periods.

#[cfg(any(test, feature = "testing"))]
use std::time::Duration;
use std::time::Instant;

/// Where the view reads the time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The monotonic now.
    fn now(&self) -> Instant;
    /// The wall-clock now, Unix ms.
    fn unix_ms(&self) -> i64;
}

/// The host's clocks.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn unix_ms(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
    }
}

/// A clock that stands still until a test moves it ([`ManualClock::advance`]).
#[cfg(any(test, feature = "testing"))]
#[derive(Debug)]
pub struct ManualClock {
    start: Instant,
    start_unix_ms: i64,
    moved: std::sync::Mutex<Duration>,
}

#[cfg(any(test, feature = "testing"))]
impl ManualClock {
    /// A clock standing at the host's now.
    #[must_use]
    pub fn new() -> Self {
        ManualClock { start: Instant::now(), start_unix_ms: SystemClock.unix_ms(), moved: std::sync::Mutex::default() }
    }

    /// Moves the clock on by `by`.
    pub fn advance(&self, by: Duration) {
        *self.moved.lock().unwrap_or_else(std::sync::PoisonError::into_inner) += by;
    }

    fn moved(&self) -> Duration {
        *self.moved.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(any(test, feature = "testing"))]
impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(any(test, feature = "testing"))]
impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.start + self.moved()
    }

    fn unix_ms(&self) -> i64 {
        self.start_unix_ms.saturating_add(i64::try_from(self.moved().as_millis()).unwrap_or(i64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told_and_both_faces_agree() {
        let c = ManualClock::new();
        let (t0, w0) = (c.now(), c.unix_ms());
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(c.now(), t0, "it stands still");
        c.advance(Duration::from_millis(1500));
        assert_eq!(c.now() - t0, Duration::from_millis(1500));
        assert_eq!(c.unix_ms() - w0, 1500);
    }
}
