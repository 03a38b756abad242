//! A small xorshift generator: the scheduler stand-in's tie-breaks and the fault suite's
//! choices. Not for anything that needs real randomness.

use std::time::{SystemTime, UNIX_EPOCH};

/// Marsaglia's xorshift64.
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    /// Seeded with `seed` (0 is replaced, xorshift would stay at 0): the same seed, the same
    /// sequence.
    #[must_use]
    pub fn new(seed: u64) -> XorShift {
        XorShift(if seed == 0 { 0x9E37_79B9_7F4A_7C15 } else { seed })
    }

    /// Seeded from the clock.
    #[must_use]
    pub fn from_clock() -> XorShift {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        XorShift::new(u64::try_from(nanos & u128::from(u64::MAX)).unwrap_or(0) | 1)
    }

    /// The next value below `n` (0 for `n` = 0).
    pub fn below(&mut self, n: u64) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x % n.max(1)
    }
}
