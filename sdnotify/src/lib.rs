//! systemd integration for gpushare's services (`Type=notify`): `READY=1`, `STATUS=`,
//! `STOPPING=1` and the watchdog, sent as `sd_notify` datagrams to `$NOTIFY_SOCKET` (a path, or
//! `@name` in the abstract namespace). Without `$NOTIFY_SOCKET` every call does nothing, as
//! libsystemd's does. Used by gpushared and gpushare-extender.
//!
//! The watchdog ping is earned, not timed: every half of `$WATCHDOG_USEC`, [`watchdog`] runs a
//! liveness probe (in gpushared: take the allocator's lock and ask the ledger a question; in the
//! extender: take the cluster view's lock) on the async runtime's blocking pool, and pings only
//! if the probe answers within that half. [`watchdog_with_heartbeat`] also requires a
//! [`Heartbeat`] that a service's main loop beats as it turns to be fresh (in gpushared: the
//! `select!` loop that follows kubelet restarts, registration and signals). A stuck runtime, a
//! deadlock, a hung ledger or a main loop that stopped turning stops the pings, and systemd
//! restarts the service.

use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Where notifications go.
#[derive(Clone, Debug)]
pub struct Notifier {
    target: Option<Arc<Target>>,
}

#[derive(Debug)]
struct Target {
    socket: UnixDatagram,
    addr: SocketAddr,
    name: String,
}

impl Notifier {
    /// The notifier systemd asked for through `$NOTIFY_SOCKET`; silent if it is unset. An
    /// unusable address is logged once and the notifier stays silent.
    #[must_use]
    pub fn from_env() -> Self {
        match std::env::var("NOTIFY_SOCKET") {
            Ok(addr) if !addr.is_empty() => Self::to(&addr),
            _ => Notifier { target: None },
        }
    }

    /// A notifier sending to `addr` (a path, or `@name` for the abstract namespace).
    #[must_use]
    pub fn to(addr: &str) -> Self {
        let parsed = if let Some(name) = addr.strip_prefix('@') {
            abstract_addr(name.as_bytes())
        } else if addr.starts_with('/') {
            SocketAddr::from_pathname(addr)
        } else {
            Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "neither a path nor @abstract"))
        };
        let target = parsed.and_then(|a| UnixDatagram::unbound().map(|s| (s, a)));
        match target {
            Ok((socket, addr_)) => {
                Notifier { target: Some(Arc::new(Target { socket, addr: addr_, name: addr.to_owned() })) }
            }
            Err(e) => {
                tracing::warn!(notify_socket = %addr, error = %e, "NOTIFY_SOCKET is unusable; systemd will not hear from this service");
                Notifier { target: None }
            }
        }
    }

    /// Whether notifications go anywhere.
    #[must_use]
    pub fn is_enabled(&self) -> bool {
        self.target.is_some()
    }

    /// Sends `lines` (`KEY=VALUE`, one per line) as one datagram. Failures are logged, never
    /// fatal: systemd not listening must not stop the service.
    pub fn send(&self, lines: &[&str]) {
        let Some(t) = &self.target else { return };
        let payload = lines.join("\n");
        if let Err(e) = t.socket.send_to_addr(payload.as_bytes(), &t.addr) {
            tracing::debug!(notify_socket = %t.name, error = %e, "sd_notify failed");
        }
    }

    /// `READY=1` with a status line.
    pub fn ready(&self, status: &str) {
        let status = format!("STATUS={}", one_line(status));
        self.send(&["READY=1", &status]);
    }

    /// `STATUS=` (one line).
    pub fn status(&self, status: &str) {
        self.send(&[&format!("STATUS={}", one_line(status))]);
    }

    /// `STOPPING=1` with a status line.
    pub fn stopping(&self, status: &str) {
        let status = format!("STATUS={}", one_line(status));
        self.send(&["STOPPING=1", &status]);
    }

    /// `WATCHDOG=1`.
    pub fn watchdog_ping(&self) {
        self.send(&["WATCHDOG=1"]);
    }
}

#[cfg(target_os = "linux")]
fn abstract_addr(name: &[u8]) -> std::io::Result<SocketAddr> {
    use std::os::linux::net::SocketAddrExt as _;
    SocketAddr::from_abstract_name(name)
}

#[cfg(not(target_os = "linux"))]
fn abstract_addr(_: &[u8]) -> std::io::Result<SocketAddr> {
    Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "abstract sockets are Linux-only"))
}

/// `STATUS=` must be one line.
fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

/// The watchdog interval systemd asked for: `$WATCHDOG_USEC`, if `$WATCHDOG_PID` is unset or
/// this process.
#[must_use]
pub fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok().filter(|&u| u > 0)?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID")
        && pid.parse::<u32>().ok() != Some(std::process::id())
    {
        return None;
    }
    Some(Duration::from_micros(usec))
}

/// A loop's proof that it turns, for [`watchdog_with_heartbeat`]: the loop calls
/// [`Heartbeat::beat`] each time round (with a timer arm of [`Heartbeat::period`] in its
/// `select!`, so it turns even when nothing else happens), and the heartbeat is stale once the
/// last beat is older than its bound. Cheap to clone; every clone is the same heartbeat.
#[derive(Clone, Debug)]
pub struct Heartbeat {
    inner: Arc<HeartbeatInner>,
}

#[derive(Debug)]
struct HeartbeatInner {
    /// What `last` counts from.
    origin: Instant,
    /// The last beat, in nanoseconds since `origin`.
    last: AtomicU64,
    /// How old the last beat may be.
    bound: Duration,
}

impl Heartbeat {
    /// A heartbeat, beaten now, that is stale once its last beat is older than `bound`.
    #[must_use]
    pub fn new(bound: Duration) -> Self {
        Heartbeat { inner: Arc::new(HeartbeatInner { origin: Instant::now(), last: AtomicU64::new(0), bound }) }
    }

    /// The heartbeat for systemd's watchdog `interval`: stale after half the interval (the
    /// watchdog's probe period), so a loop stuck from time `t` gets its last ping by `t` + half
    /// the interval, and systemd's watchdog fires by `t` + 1.5 intervals.
    #[must_use]
    pub fn for_watchdog(interval: Duration) -> Self {
        Self::new(interval / 2)
    }

    /// How old the last beat may be.
    #[must_use]
    pub fn bound(&self) -> Duration {
        self.inner.bound
    }

    /// How often the loop should beat: a quarter of the bound (at least 1 ms), so three late
    /// or missed beats in a row are still no alarm.
    #[must_use]
    pub fn period(&self) -> Duration {
        (self.inner.bound / 4).max(Duration::from_millis(1))
    }

    /// Records that the loop turned.
    pub fn beat(&self) {
        let since = u64::try_from(self.inner.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.inner.last.fetch_max(since, Ordering::Relaxed);
    }

    /// The time since the last beat.
    #[must_use]
    pub fn age(&self) -> Duration {
        self.age_at(Instant::now())
    }

    /// Whether the last beat is older than the bound.
    #[must_use]
    pub fn is_stale(&self) -> bool {
        self.is_stale_at(Instant::now())
    }

    fn is_stale_at(&self, now: Instant) -> bool {
        self.age_at(now) > self.inner.bound
    }

    fn age_at(&self, now: Instant) -> Duration {
        let last = self.inner.origin + Duration::from_nanos(self.inner.last.load(Ordering::Relaxed));
        now.saturating_duration_since(last)
    }
}

/// Pings `notifier` every half of `interval` while `alive` answers `true` within that half;
/// runs until the task is dropped. A probe that fails or hangs withholds the ping (logged once
/// per episode), so systemd's watchdog fires if the service stays stuck.
pub async fn watchdog<F>(notifier: Notifier, interval: Duration, alive: F)
where
    F: Fn() -> bool + Send + Sync + 'static,
{
    run_watchdog(notifier, interval, None, alive).await;
}

/// [`watchdog`] that also withholds the ping while `heartbeat` is stale: a service whose
/// runtime and locks answer but whose main loop stopped turning is restarted too.
pub async fn watchdog_with_heartbeat<F>(notifier: Notifier, interval: Duration, heartbeat: Heartbeat, alive: F)
where
    F: Fn() -> bool + Send + Sync + 'static,
{
    run_watchdog(notifier, interval, Some(heartbeat), alive).await;
}

async fn run_watchdog<F>(notifier: Notifier, interval: Duration, heartbeat: Option<Heartbeat>, alive: F)
where
    F: Fn() -> bool + Send + Sync + 'static,
{
    let half = interval / 2;
    let alive = Arc::new(alive);
    let mut tick = tokio::time::interval(half);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stuck = false;
    loop {
        tick.tick().await;
        let probe = Arc::clone(&alive);
        let answered = match tokio::time::timeout(half, tokio::task::spawn_blocking(move || probe())).await {
            Ok(Ok(true)) => Ok(()),
            Ok(Ok(false)) => Err("the liveness probe failed".to_owned()),
            Ok(Err(e)) => Err(format!("the liveness probe panicked: {e}")),
            Err(_) => Err(format!("the liveness probe did not answer within {half:?}")),
        };
        // The heartbeat last, just before the ping: a loop stuck since `t` gets no ping after
        // `t` + its bound.
        let now = Instant::now();
        let verdict = answered.and_then(|()| match heartbeat.as_ref().filter(|h| h.is_stale_at(now)) {
            Some(h) => Err(format!(
                "the main loop has not turned for {:?} (its heartbeat is stale after {:?})",
                h.age_at(now),
                h.bound()
            )),
            None => Ok(()),
        });
        match verdict {
            Ok(()) => {
                if stuck {
                    tracing::info!("the service answers again; watchdog pings resume");
                    stuck = false;
                }
                notifier.watchdog_ping();
            }
            Err(why) => {
                if !stuck {
                    tracing::error!(reason = %why, "withholding the systemd watchdog ping");
                    stuck = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn listener() -> (tempfile::TempDir, UnixDatagram, String) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let sock = UnixDatagram::bind(&path).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        (dir, sock, path.display().to_string())
    }

    fn recv(sock: &UnixDatagram) -> String {
        let mut buf = [0u8; 4096];
        let n = sock.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn ready_status_and_stopping_are_datagrams_systemd_understands() {
        let (_dir, sock, path) = listener();
        let n = Notifier::to(&path);
        assert!(n.is_enabled());
        n.ready("serving 2 GPUs,\n3 allocations");
        assert_eq!(recv(&sock), "READY=1\nSTATUS=serving 2 GPUs, 3 allocations");
        n.status("waiting for the kubelet");
        assert_eq!(recv(&sock), "STATUS=waiting for the kubelet");
        n.stopping("stopping");
        assert_eq!(recv(&sock), "STOPPING=1\nSTATUS=stopping");
    }

    #[test]
    fn the_abstract_namespace_works_and_nothing_is_silent() {
        let name = format!("gpushare-test-{}", std::process::id());
        let sock = UnixDatagram::bind_addr(&abstract_addr(name.as_bytes()).unwrap()).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        Notifier::to(&format!("@{name}")).watchdog_ping();
        assert_eq!(recv(&sock), "WATCHDOG=1");
        // Unusable or absent targets are silent, never a failure.
        assert!(!Notifier::to("relative/path").is_enabled());
        Notifier { target: None }.ready("x");
    }

    /// The watchdog pings `sock` receives in the next `ms` milliseconds (it must have a read
    /// timeout); anything else arriving fails the test.
    fn count_pings(sock: &UnixDatagram, ms: u64) -> usize {
        let deadline = std::time::Instant::now() + Duration::from_millis(ms);
        let mut n = 0;
        let mut buf = [0u8; 64];
        while std::time::Instant::now() < deadline {
            if let Ok(len) = sock.recv(&mut buf) {
                assert_eq!(&buf[..len], b"WATCHDOG=1");
                n += 1;
            }
        }
        n
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pings_stop_while_the_probe_is_stuck_and_resume_after() {
        let (_dir, sock, path) = listener();
        sock.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let stuck = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stuck);
        let task = tokio::spawn(watchdog(Notifier::to(&path), Duration::from_millis(200), move || {
            while flag.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
            }
            true
        }));
        let count = |ms: u64| count_pings(&sock, ms);
        let healthy = tokio::task::block_in_place(|| count(1000));
        assert!(healthy >= 6, "about 10 pings a second while alive, got {healthy}");
        stuck.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(250)).await;
        let while_stuck = tokio::task::block_in_place(|| {
            let _ = count(100);
            count(1000)
        });
        assert_eq!(while_stuck, 0, "no ping while the probe hangs");
        stuck.store(false, Ordering::SeqCst);
        let after = tokio::task::block_in_place(|| count(1000));
        assert!(after >= 4, "pings resume, got {after}");
        task.abort();
    }

    #[test]
    fn a_heartbeat_is_stale_once_its_last_beat_is_older_than_its_bound() {
        let h = Heartbeat::new(Duration::from_millis(200));
        assert_eq!(h.bound(), Duration::from_millis(200));
        assert_eq!(h.period(), Duration::from_millis(50));
        assert!(!h.is_stale(), "beaten when made");
        // A clone's beat is the heartbeat's beat.
        h.clone().beat();
        let beaten = Instant::now();
        assert!(!h.is_stale_at(beaten + Duration::from_millis(150)), "150 ms after a beat");
        assert!(h.is_stale_at(beaten + Duration::from_millis(201)), "201 ms after the last beat");
        assert!(h.age_at(beaten + Duration::from_secs(3)) >= Duration::from_secs(3));
        // In real time.
        let h = Heartbeat::new(Duration::from_millis(20));
        std::thread::sleep(Duration::from_millis(40));
        assert!(h.is_stale() && h.age() >= Duration::from_millis(40));
        h.beat();
        assert!(!h.is_stale() && h.age() < Duration::from_millis(20));
        // For systemd's watchdog: stale after the probe period (half the interval); never a
        // zero timer period.
        let w = Heartbeat::for_watchdog(Duration::from_secs(30));
        assert_eq!((w.bound(), w.period()), (Duration::from_secs(15), Duration::from_millis(3750)));
        assert_eq!(Heartbeat::for_watchdog(Duration::from_micros(2)).period(), Duration::from_millis(1));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pings_stop_while_the_heartbeat_is_stale_though_the_probe_answers() {
        let (_dir, sock, path) = listener();
        sock.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let interval = Duration::from_millis(200);
        let heartbeat = Heartbeat::for_watchdog(interval);
        // The "main loop": beats every period while `turning`.
        let turning = Arc::new(AtomicBool::new(true));
        let beater = {
            let (heartbeat, turning) = (heartbeat.clone(), Arc::clone(&turning));
            tokio::spawn(async move {
                let mut every = tokio::time::interval(heartbeat.period());
                loop {
                    every.tick().await;
                    if turning.load(Ordering::SeqCst) {
                        heartbeat.beat();
                    }
                }
            })
        };
        let task = tokio::spawn(watchdog_with_heartbeat(Notifier::to(&path), interval, heartbeat, || true));
        let count = |ms: u64| count_pings(&sock, ms);
        let healthy = tokio::task::block_in_place(|| count(1000));
        assert!(healthy >= 6, "about 10 pings a second while the loop turns, got {healthy}");
        // The loop stops turning: after at most the bound (100 ms) and one probe period
        // (100 ms), no ping, though the probe itself keeps answering.
        turning.store(false, Ordering::SeqCst);
        let while_stuck = tokio::task::block_in_place(|| {
            let _ = count(250);
            count(1000)
        });
        assert_eq!(while_stuck, 0, "no ping while the main loop does not turn");
        turning.store(true, Ordering::SeqCst);
        let after = tokio::task::block_in_place(|| count(1000));
        assert!(after >= 4, "pings resume once it turns again, got {after}");
        task.abort();
        beater.abort();
    }
}
