//! The heartbeat a daemon renews on its Node: schema version 1.
//!
//! ```json
//! {"v":1,"at":1764072000000,"everySeconds":20}
//! ```
//!
//! `at` is the daemon's clock when it wrote the value (Unix milliseconds), for people;
//! `everySeconds` is how often it renews it. Readers judge freshness by their own clock: a node
//! whose heartbeat has not changed for [`Heartbeat::stale_after`] (three periods) is stale, its
//! daemon presumed gone, and its published state is not trusted for new placements. Clocks of
//! the node and the reader need not agree.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{CodecError, decode_versioned, encode_checked};

/// The Node annotation key.
pub const HEARTBEAT_KEY: &str = "gpushare.io/heartbeat";
/// The schema version this build writes and reads.
pub const HEARTBEAT_VERSION: u32 = 1;
/// Periods without a renewal after which a node is stale.
pub const MISSED_PERIODS: u32 = 3;

/// One renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    /// When the daemon wrote it, by its clock (Unix milliseconds).
    pub at_ms: i64,
    /// How often the daemon renews it, in seconds (at least 1).
    pub every_seconds: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Wire {
    v: u32,
    at: i64,
    every_seconds: u32,
}

impl Heartbeat {
    /// How long without a renewal makes the node stale.
    #[must_use]
    pub fn stale_after(&self) -> Duration {
        Duration::from_secs(u64::from(self.every_seconds) * u64::from(MISSED_PERIODS))
    }

    /// Encodes the annotation value.
    ///
    /// # Errors
    /// [`CodecError::Invalid`] for a period of 0.
    pub fn encode(&self) -> Result<String, CodecError> {
        if self.every_seconds == 0 {
            return Err(invalid("everySeconds is 0; a heartbeat is renewed at least every second".into()));
        }
        encode_checked(HEARTBEAT_KEY, &Wire { v: HEARTBEAT_VERSION, at: self.at_ms, every_seconds: self.every_seconds })
    }

    /// Decodes an annotation value.
    ///
    /// # Errors
    /// A [`CodecError`] for malformed or unknown-version values and a period of 0.
    pub fn decode(value: &str) -> Result<Self, CodecError> {
        let wire: Wire = decode_versioned(HEARTBEAT_KEY, value, HEARTBEAT_VERSION)?;
        if wire.every_seconds == 0 {
            return Err(invalid("everySeconds is 0; a heartbeat is renewed at least every second".into()));
        }
        Ok(Heartbeat { at_ms: wire.at, every_seconds: wire.every_seconds })
    }
}

fn invalid(reason: String) -> CodecError {
    CodecError::Invalid { key: HEARTBEAT_KEY, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_reads_as_documented() {
        let h = Heartbeat { at_ms: 1_764_072_000_000, every_seconds: 20 };
        let text = h.encode().unwrap();
        assert_eq!(text, r#"{"v":1,"at":1764072000000,"everySeconds":20}"#);
        assert_eq!(Heartbeat::decode(&text).unwrap(), h);
        assert_eq!(h.stale_after(), Duration::from_secs(60));
    }

    #[test]
    fn bad_values_are_errors_not_panics() {
        for (text, want) in [
            ("", "malformed"),
            (r#"{"v":2}"#, "schema version 2 is not supported"),
            (r#"{"v":1,"at":"x","everySeconds":1}"#, "malformed"),
            (r#"{"v":1,"at":1,"everySeconds":0}"#, "everySeconds is 0"),
            (r#"{"v":1,"at":1,"everySeconds":-5}"#, "malformed"),
        ] {
            let err = Heartbeat::decode(text).unwrap_err().to_string();
            assert!(err.contains(want) && err.starts_with("annotation gpushare.io/heartbeat"), "{text}: {err}");
        }
        assert!(Heartbeat { at_ms: 0, every_seconds: 0 }.encode().is_err());
    }
}
