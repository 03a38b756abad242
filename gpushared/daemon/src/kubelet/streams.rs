//! Notices a kubelet that dropped the plugin without restarting. A registered plugin is fed
//! to the kubelet through one `ListAndWatch` stream that the kubelet opens right after it
//! accepts the registration and holds for as long as it uses the plugin. [`StreamCount`] counts
//! the streams open on the plugin's server; [`Dropped`] resolves when, while registered, none
//! has been open for [`GRACE`], and the daemon then registers again.
//!
//! A kubelet restart also ends the stream, but it replaces the sockets too, which
//! [`super::watch`] sees within milliseconds and answers with a registration of its own; the
//! grace leaves it that. What only this catches is a kubelet that closes the stream and stays:
//! kubelets up to at least 1.29 key their plugin clients by resource name alone, and when a
//! restarted plugin registers before the kubelet noticed the old one's stream end, the old
//! client's cleanup disconnects the new client (`runClient` in the kubelet's device-plugin
//! handler) and marks every device unhealthy. Nothing else would ever tell that kubelet about
//! the devices again: its allocatable stays at 0 and every pod it admits fails.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// How long a registered plugin may go without an open `ListAndWatch` stream before it
/// registers again: the kubelet opens one within milliseconds of accepting a registration,
/// and the directory watch answers a kubelet restart within 250 ms even when polling.
pub const GRACE: Duration = Duration::from_millis(500);

/// The number of `ListAndWatch` streams open on the plugin's servers. Cheap to clone; every
/// clone counts into the same number.
#[derive(Clone, Debug, Default)]
pub struct StreamCount {
    open: std::sync::Arc<watch::Sender<usize>>,
}

impl StreamCount {
    /// Counts one stream open until the returned guard is dropped (with the stream).
    #[must_use]
    pub fn open(&self) -> StreamGuard {
        self.open.send_modify(|n| *n += 1);
        StreamGuard { open: std::sync::Arc::clone(&self.open) }
    }

    /// The count now and after every change.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<usize> {
        self.open.subscribe()
    }
}

/// One open stream; dropping it closes it in the count.
#[derive(Debug)]
pub struct StreamGuard {
    open: std::sync::Arc<watch::Sender<usize>>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.open.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Watches the count for a registered plugin the kubelet holds no stream of.
#[derive(Debug)]
pub struct Dropped {
    streams: watch::Receiver<usize>,
    grace: Duration,
    /// Registered, and no registration under way: a stream is due.
    armed: bool,
    /// Since when none has been open (while armed).
    since: Option<Instant>,
}

impl Dropped {
    /// Watches `count` with [`GRACE`]; unarmed until [`Self::registered`].
    #[must_use]
    pub fn new(count: &StreamCount) -> Self {
        Self::with_grace(count, GRACE)
    }

    /// The same with another grace (tests).
    #[must_use]
    pub fn with_grace(count: &StreamCount, grace: Duration) -> Self {
        Dropped { streams: count.subscribe(), grace, armed: false, since: None }
    }

    /// The kubelet accepted a registration: from now on it must hold a stream.
    pub fn registered(&mut self) {
        self.armed = true;
        self.since = (*self.streams.borrow_and_update() == 0).then(Instant::now);
    }

    /// A registration is under way: nothing is due until it is accepted.
    pub fn registering(&mut self) {
        self.armed = false;
        self.since = None;
    }

    /// Resolves once, while armed, no stream has been open for the grace; disarms. Cancel-safe:
    /// what it saw is kept between calls.
    pub async fn dropped(&mut self) {
        loop {
            if self.armed {
                let open = *self.streams.borrow_and_update();
                if open > 0 {
                    self.since = None;
                } else if self.since.is_none() {
                    self.since = Some(Instant::now());
                }
            }
            let deadline = self.since.filter(|_| self.armed).map(|t| t + self.grace);
            tokio::select! {
                changed = self.streams.changed() => {
                    if changed.is_err() {
                        // The plugin is gone with its counter: nothing will open or close.
                        std::future::pending::<()>().await;
                    }
                }
                () = async { tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now)).await }, if deadline.is_some() => {
                    if *self.streams.borrow() == 0 {
                        self.registering();
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_millis(100);

    async fn resolves(d: &mut Dropped, within: Duration) -> bool {
        tokio::time::timeout(within, d.dropped()).await.is_ok()
    }

    #[tokio::test]
    async fn nothing_is_due_before_a_registration_is_accepted() {
        let count = StreamCount::default();
        let mut d = Dropped::with_grace(&count, GRACE);
        assert!(!resolves(&mut d, GRACE * 3).await);
        let s = count.open();
        drop(s);
        assert!(!resolves(&mut d, GRACE * 3).await, "not registered yet");
    }

    #[tokio::test]
    async fn a_stream_closed_while_registered_is_noticed_after_the_grace() {
        let count = StreamCount::default();
        let mut d = Dropped::with_grace(&count, GRACE);
        let s = count.open();
        d.registered();
        assert!(!resolves(&mut d, GRACE * 3).await, "the kubelet holds its stream");
        let started = Instant::now();
        drop(s);
        assert!(resolves(&mut d, GRACE * 10).await);
        assert!(started.elapsed() >= GRACE, "after the grace: {:?}", started.elapsed());
        // Disarmed until the next registration is accepted.
        assert!(!resolves(&mut d, GRACE * 3).await);
    }

    #[tokio::test]
    async fn a_registration_whose_stream_never_opens_is_noticed() {
        let count = StreamCount::default();
        let mut d = Dropped::with_grace(&count, GRACE);
        d.registered();
        assert!(resolves(&mut d, GRACE * 10).await);
    }

    #[tokio::test]
    async fn a_stream_reopened_within_the_grace_is_no_drop() {
        let count = StreamCount::default();
        let mut d = Dropped::with_grace(&count, GRACE);
        let s = count.open();
        d.registered();
        drop(s);
        let _again = count.open();
        assert!(!resolves(&mut d, GRACE * 3).await);
    }

    #[tokio::test]
    async fn a_registration_under_way_disarms_it() {
        let count = StreamCount::default();
        let mut d = Dropped::with_grace(&count, GRACE);
        let s = count.open();
        d.registered();
        drop(s);
        d.registering();
        assert!(!resolves(&mut d, GRACE * 3).await);
        let _s = count.open();
        d.registered();
        assert!(!resolves(&mut d, GRACE * 3).await);
    }

    /// Cancelled by another branch of the daemon's loop again and again (its heartbeat), the
    /// wait keeps what it saw and still ends one grace after the stream closed.
    #[tokio::test]
    async fn survives_being_cancelled_between_polls() {
        let count = StreamCount::default();
        let mut d = Dropped::with_grace(&count, GRACE);
        let s = count.open();
        d.registered();
        drop(s);
        let started = Instant::now();
        loop {
            if tokio::time::timeout(Duration::from_millis(10), d.dropped()).await.is_ok() {
                break;
            }
            assert!(started.elapsed() < GRACE * 10, "never noticed");
        }
        assert!(started.elapsed() < GRACE * 3, "noticed late: {:?}", started.elapsed());
    }
}
