//! Detects kubelet restarts. A starting kubelet deletes every socket in its device-plugin
//! directory (ours included) and listens on a new `kubelet.sock` at once; a device plugin must
//! then serve on a new socket and register again. [`KubeletWatch`] compares the identity
//! (device, inode and change time) of `kubelet.sock` and of the plugin's own socket with what it
//! last acknowledged: a socket recreated at once can get the same inode number (ext4 reuses
//! them), so the inode alone is no proof that nothing happened, while the new socket's change
//! time is its creation, after the old one's. It is woken by inotify on the directory, with a
//! polling fallback: every 250 ms when inotify is unavailable, every 5 s as a safety net when it
//! is.
//!
//! What is acknowledged is what a change saw, never the directory read again later: the
//! kubelet removes the sockets and listens anew within milliseconds, and a `kubelet.sock`
//! created after the plugin socket's loss was seen must still count as a change of its own.

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt as _;

/// A file's identity: (device, inode, change time in s and ns).
type Identity = (u64, u64, i64, i64);

fn identity(path: &Path) -> Option<Identity> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// What changed since the last acknowledgement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Change {
    /// `kubelet.sock` is new (a kubelet (re)started): register again.
    pub kubelet_restarted: bool,
    /// The plugin's socket is gone or replaced: serve on a new one.
    pub plugin_socket_lost: bool,
}

/// Watches the device-plugin directory.
pub struct KubeletWatch {
    kubelet_sock: PathBuf,
    plugin_sock: PathBuf,
    kubelet: Option<Identity>,
    plugin: Option<Identity>,
    /// `kubelet.sock` as the last change returned by [`Self::changed`] saw it.
    seen_kubelet: Option<Identity>,
    events: Option<inotify::EventStream<Vec<u8>>>,
    tick: tokio::time::Interval,
}

impl std::fmt::Debug for KubeletWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeletWatch")
            .field("kubelet_sock", &self.kubelet_sock)
            .field("plugin_sock", &self.plugin_sock)
            .field("inotify", &self.events.is_some())
            .finish_non_exhaustive()
    }
}

impl KubeletWatch {
    /// Watches `dir` for `kubelet.sock` and `plugin_socket` (a name in `dir`), taking their
    /// current identities as acknowledged. Falls back to polling when inotify cannot be used.
    #[must_use]
    pub fn new(dir: &Path, plugin_socket: &Path) -> Self {
        let events = match Self::inotify(dir) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "inotify unavailable; polling the device-plugin directory every 250 ms");
                None
            }
        };
        let period = if events.is_some() { Duration::from_secs(5) } else { Duration::from_millis(250) };
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let kubelet_sock = dir.join("kubelet.sock");
        let plugin_sock = plugin_socket.to_owned();
        let kubelet = identity(&kubelet_sock);
        KubeletWatch {
            kubelet,
            plugin: identity(&plugin_sock),
            seen_kubelet: kubelet,
            kubelet_sock,
            plugin_sock,
            events,
            tick,
        }
    }

    /// Same as [`Self::new`] with inotify turned off: the polling fallback alone.
    #[must_use]
    pub fn polling(dir: &Path, plugin_socket: &Path) -> Self {
        let mut w = Self::new(dir, plugin_socket);
        w.events = None;
        w.tick = tokio::time::interval(Duration::from_millis(250));
        w.tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        w
    }

    fn inotify(dir: &Path) -> std::io::Result<inotify::EventStream<Vec<u8>>> {
        use inotify::{Inotify, WatchMask};
        let inotify = Inotify::init()?;
        let mut watches = inotify.watches();
        watches.add(
            dir,
            WatchMask::CREATE
                | WatchMask::DELETE
                | WatchMask::MOVED_TO
                | WatchMask::MOVED_FROM
                | WatchMask::DELETE_SELF,
        )?;
        inotify.into_event_stream(vec![0u8; 4096])
    }

    /// Whether inotify is in use.
    #[must_use]
    pub fn uses_inotify(&self) -> bool {
        self.events.is_some()
    }

    /// The current state against the acknowledged one, and `kubelet.sock` as it is now.
    fn compare(&self) -> (Change, Option<Identity>) {
        let kubelet = identity(&self.kubelet_sock);
        let plugin = identity(&self.plugin_sock);
        let change = Change {
            kubelet_restarted: kubelet.is_some() && kubelet != self.kubelet,
            plugin_socket_lost: plugin.is_none() || plugin != self.plugin,
        };
        (change, kubelet)
    }

    /// Takes the current identities as the new normal (after re-serving and registering).
    pub fn acknowledge(&mut self) {
        self.kubelet = identity(&self.kubelet_sock);
        self.plugin = identity(&self.plugin_sock);
    }

    /// Takes the plugin socket's current identity as normal (after binding it again).
    pub fn acknowledge_plugin_socket(&mut self) {
        self.plugin = identity(&self.plugin_sock);
    }

    /// Takes `kubelet.sock` as the last change saw it as normal (the registration it needs is
    /// under way). One that a starting kubelet created since is a change of its own.
    pub fn acknowledge_kubelet(&mut self) {
        self.kubelet = self.seen_kubelet;
    }

    /// Takes `kubelet.sock`'s current identity as normal: a registration just reached the
    /// kubelet listening on it, so a socket created while it was under way needs no other.
    pub fn registered(&mut self) {
        self.kubelet = identity(&self.kubelet_sock);
    }

    fn fall_back(&mut self, why: &str) {
        tracing::warn!(error = %why, "inotify failed; polling the device-plugin directory every 250 ms instead");
        self.events = None;
        self.tick = tokio::time::interval(Duration::from_millis(250));
        self.tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }

    /// Waits until something changed, then says what.
    pub async fn changed(&mut self) -> Change {
        loop {
            let (change, kubelet) = self.compare();
            if change.kubelet_restarted || change.plugin_socket_lost {
                self.seen_kubelet = kubelet;
                return change;
            }
            match &mut self.events {
                Some(events) => {
                    tokio::select! {
                        event = events.next() => match event {
                            Some(Ok(_)) => {}
                            Some(Err(e)) => self.fall_back(&e.to_string()),
                            None => self.fall_back("the event stream ended"),
                        },
                        _ = self.tick.tick() => {}
                    }
                }
                None => {
                    self.tick.tick().await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn scenario(polling: bool) {
        let dir = tempfile::tempdir().unwrap();
        let kubelet = dir.path().join("kubelet.sock");
        let plugin = dir.path().join("gpushared.sock");
        let _k = std::os::unix::net::UnixListener::bind(&kubelet).unwrap();
        let _p = std::os::unix::net::UnixListener::bind(&plugin).unwrap();
        let mut w =
            if polling { KubeletWatch::polling(dir.path(), &plugin) } else { KubeletWatch::new(dir.path(), &plugin) };
        assert_eq!(w.uses_inotify(), !polling);
        let quiet = tokio::time::timeout(Duration::from_millis(400), w.changed()).await;
        assert!(quiet.is_err(), "nothing changed yet: {quiet:?}");
        // A kubelet restart: every socket deleted, then a new kubelet.sock.
        let started = std::time::Instant::now();
        std::fs::remove_file(&plugin).unwrap();
        std::fs::remove_file(&kubelet).unwrap();
        let change = tokio::time::timeout(Duration::from_secs(2), w.changed()).await.unwrap();
        assert!(change.plugin_socket_lost);
        let _p2 = std::os::unix::net::UnixListener::bind(&plugin).unwrap();
        w.acknowledge_plugin_socket();
        w.acknowledge_kubelet();
        let _k2 = std::os::unix::net::UnixListener::bind(&kubelet).unwrap();
        let change = tokio::time::timeout(Duration::from_secs(2), w.changed()).await.unwrap();
        assert_eq!(change, Change { kubelet_restarted: true, plugin_socket_lost: false });
        assert!(started.elapsed() < Duration::from_secs(1), "seen in {:?}", started.elapsed());
        w.acknowledge();
        let quiet = tokio::time::timeout(Duration::from_millis(400), w.changed()).await;
        assert!(quiet.is_err(), "acknowledged: {quiet:?}");
    }

    /// The plugin socket's loss is seen first, and the new kubelet listens before the daemon
    /// gets round to acknowledging it (rebinding its socket takes a moment): the new
    /// `kubelet.sock` is still a restart, once, and a registration that reached it is the end.
    #[tokio::test]
    async fn a_kubelet_socket_created_before_the_acknowledgement_is_still_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let kubelet = dir.path().join("kubelet.sock");
        let plugin = dir.path().join("gpushared.sock");
        let _k = std::os::unix::net::UnixListener::bind(&kubelet).unwrap();
        let _p = std::os::unix::net::UnixListener::bind(&plugin).unwrap();
        let mut w = KubeletWatch::new(dir.path(), &plugin);
        std::fs::remove_file(&kubelet).unwrap();
        std::fs::remove_file(&plugin).unwrap();
        let change = tokio::time::timeout(Duration::from_secs(2), w.changed()).await.unwrap();
        assert_eq!(change, Change { kubelet_restarted: false, plugin_socket_lost: true });
        let _k2 = std::os::unix::net::UnixListener::bind(&kubelet).unwrap();
        let _p2 = std::os::unix::net::UnixListener::bind(&plugin).unwrap();
        w.acknowledge_plugin_socket();
        w.acknowledge_kubelet();
        let change = tokio::time::timeout(Duration::from_secs(2), w.changed()).await.unwrap();
        assert_eq!(change, Change { kubelet_restarted: true, plugin_socket_lost: false });
        w.acknowledge_kubelet();
        let quiet = tokio::time::timeout(Duration::from_millis(400), w.changed()).await;
        assert!(quiet.is_err(), "acknowledged: {quiet:?}");

        // A registration that reached the new kubelet absorbs its socket: no second restart.
        std::fs::remove_file(&kubelet).unwrap();
        std::fs::remove_file(&plugin).unwrap();
        let change = tokio::time::timeout(Duration::from_secs(2), w.changed()).await.unwrap();
        assert!(change.plugin_socket_lost);
        let _p3 = std::os::unix::net::UnixListener::bind(&plugin).unwrap();
        w.acknowledge_plugin_socket();
        w.acknowledge_kubelet();
        let _k3 = std::os::unix::net::UnixListener::bind(&kubelet).unwrap();
        w.registered();
        let quiet = tokio::time::timeout(Duration::from_millis(400), w.changed()).await;
        assert!(quiet.is_err(), "registered with the new kubelet: {quiet:?}");
    }

    #[tokio::test]
    async fn sees_a_kubelet_restart_through_inotify() {
        scenario(false).await;
    }

    #[tokio::test]
    async fn sees_a_kubelet_restart_by_polling() {
        scenario(true).await;
    }

    /// The real kubelet removes the sockets and listens again at once; the new `kubelet.sock`
    /// can carry the old one's inode number. Moving the very same socket away and back keeps
    /// the inode (as a reused inode number would): a restart must still be seen. The socket is
    /// older than one tick of the file-time clock first, as a running kubelet's always is.
    #[tokio::test]
    async fn sees_a_kubelet_socket_replaced_under_the_same_inode() {
        let dir = tempfile::tempdir().unwrap();
        let kubelet = dir.path().join("kubelet.sock");
        let plugin = dir.path().join("gpushared.sock");
        let _k = std::os::unix::net::UnixListener::bind(&kubelet).unwrap();
        let _p = std::os::unix::net::UnixListener::bind(&plugin).unwrap();
        let mut w = KubeletWatch::new(dir.path(), &plugin);
        assert!(w.uses_inotify());
        std::thread::sleep(Duration::from_millis(50));
        let aside = dir.path().join("aside");
        std::fs::rename(&kubelet, &aside).unwrap();
        std::fs::rename(&aside, &kubelet).unwrap();
        let change = tokio::time::timeout(Duration::from_secs(2), w.changed()).await.unwrap();
        assert_eq!(change, Change { kubelet_restarted: true, plugin_socket_lost: false });
        w.acknowledge();
        let quiet = tokio::time::timeout(Duration::from_millis(400), w.changed()).await;
        assert!(quiet.is_err(), "acknowledged: {quiet:?}");
    }
}
