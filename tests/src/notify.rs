//! systemd's side of `sd_notify` for tests: a datagram socket bound as `NOTIFY_SOCKET` that
//! records every notification a service sends, with when, as systemd would receive it.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a service told "systemd", in order, with when.
#[derive(Clone, Debug, Default)]
pub struct Notes(Arc<Mutex<Vec<(Instant, String)>>>);

impl Notes {
    /// Binds `path` and records every datagram from then on.
    ///
    /// # Panics
    /// If `path` cannot be bound.
    #[must_use]
    pub fn listen(path: &std::path::Path) -> Notes {
        let sock = UnixDatagram::bind(path).unwrap();
        let notes = Notes::default();
        let out = notes.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            while let Ok(n) = sock.recv(&mut buf) {
                out.0.lock().unwrap().push((Instant::now(), String::from_utf8_lossy(&buf[..n]).into_owned()));
            }
        });
        notes
    }

    /// Every notification so far.
    #[must_use]
    pub fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().iter().map(|(_, m)| m.clone()).collect()
    }

    /// The first notification `pred` accepts, waiting up to `within` for it (blocking).
    ///
    /// # Panics
    /// If none comes in time, with every notification received.
    pub fn wait_for(&self, what: &str, within: Duration, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(m) = self.all().into_iter().find(|m| pred(m)) {
                return m;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("no {what} notification within {within:?}; got {:#?}", self.all());
    }

    /// How many `WATCHDOG=1` pings arrived in `[from, to)`.
    #[must_use]
    pub fn pings_between(&self, from: Instant, to: Instant) -> usize {
        self.0.lock().unwrap().iter().filter(|(at, m)| *at >= from && *at < to && m == "WATCHDOG=1").count()
    }
}
