//! The pods bound to this node, as the daemon last saw them: filled by the API-server watch
//! ([`crate::cluster::kube`]), read by the allocator. It keeps serving what it saw through an API-server
//! outage, so `Allocate` for a pod already seen never waits on the network. Every change is
//! announced ([`PodStore::subscribe`]), so a kubelet call waiting for its pod to show up wakes
//! when it does; and such a call asks for the pod ([`PodStore::want_news`]), which cuts short the
//! watch's back-off after an outage: the kubelet has just seen the pod, so the API server is back.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use gpushare_core::PodSpec;
use gpushare_core::codec::CodecError;
use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_core::codec::node::PodRef;
use tokio::sync::watch;

/// What the daemon knows of one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodView {
    /// Namespace, name, UID.
    pub pod: PodRef,
    /// `spec.nodeName`.
    pub node: Option<String>,
    /// `metadata.creationTimestamp` (RFC 3339; sorts as text), the kubelet's admission order.
    pub created: String,
    /// `Succeeded`, `Failed`, or being deleted.
    pub terminal: bool,
    /// The containers' resources.
    pub spec: PodSpec,
    /// `metadata.annotations`.
    pub annotations: BTreeMap<String, String>,
    /// (container name, container runtime ID without its `containerd://` scheme) from the
    /// pod's container statuses, init containers included: ties a process's cgroup to its
    /// container.
    pub container_ids: Vec<(String, String)>,
}

/// A pod as stored: its view and its assignment, decoded once when stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredPod {
    /// What the daemon knows of the pod.
    pub view: PodView,
    /// Its `gpushare.io/assignment`, if it has one.
    pub assignment: Option<Result<Arc<Assignment>, CodecError>>,
    /// What is wrong with the assignment on this pod, worked out by the allocator on first use.
    pub problem: std::sync::OnceLock<Option<String>>,
}

impl StoredPod {
    fn new(view: PodView) -> Self {
        let assignment = view.annotations.get(ASSIGNMENT_KEY).map(|text| Assignment::decode(text).map(Arc::new));
        StoredPod { view, assignment, problem: std::sync::OnceLock::new() }
    }
}

/// A shared, thread-safe map of pods by UID.
#[derive(Clone, Debug)]
pub struct PodStore {
    inner: Arc<RwLock<BTreeMap<String, Arc<StoredPod>>>>,
    /// Set once a complete list has been stored: until then, a pod missing from the store
    /// proves nothing.
    synced: Arc<std::sync::atomic::AtomicBool>,
    /// Bumped after every change.
    changes: Arc<watch::Sender<u64>>,
    /// Raised by a kubelet call that waits for a pod the store does not have.
    wanted: Arc<tokio::sync::Notify>,
}

impl Default for PodStore {
    fn default() -> Self {
        PodStore {
            inner: Arc::default(),
            synced: Arc::default(),
            changes: Arc::new(watch::Sender::new(0)),
            wanted: Arc::default(),
        }
    }
}

impl PodStore {
    /// An empty store.
    #[must_use]
    pub fn new() -> Self {
        PodStore::default()
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver that sees a new value after every change of the store (a pod added,
    /// replaced or removed, or a complete list stored).
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Says that a kubelet call waits for a pod the store does not have: the kubelet has just
    /// seen it, so a watch waiting out its back-off should try again now ([`Self::wanted`]).
    pub fn want_news(&self) {
        self.wanted.notify_one();
    }

    /// Completes after the next [`Self::want_news`] (or at once, if one came since the last
    /// wait).
    pub async fn wanted(&self) {
        self.wanted.notified().await;
    }

    /// Adds or replaces a pod, decoding its assignment.
    pub fn upsert(&self, view: PodView) {
        let stored = Arc::new(StoredPod::new(view));
        if let Ok(mut map) = self.inner.write() {
            map.insert(stored.view.pod.uid.clone(), stored);
        }
        self.changed();
    }

    /// Forgets a pod; returns what was known of it.
    pub fn remove(&self, uid: &str) -> Option<Arc<StoredPod>> {
        let removed = self.inner.write().ok().and_then(|mut map| map.remove(uid));
        if removed.is_some() {
            self.changed();
        }
        removed
    }

    /// Replaces the whole content (after a complete list).
    pub fn replace_all(&self, views: Vec<PodView>) {
        let stored: BTreeMap<String, Arc<StoredPod>> =
            views.into_iter().map(|v| (v.pod.uid.clone(), Arc::new(StoredPod::new(v)))).collect();
        if let Ok(mut map) = self.inner.write() {
            *map = stored;
        }
        self.synced.store(true, std::sync::atomic::Ordering::SeqCst);
        self.changed();
    }

    /// Whether a complete list of the pods bound to this node has been stored.
    #[must_use]
    pub fn is_synced(&self) -> bool {
        self.synced.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// One pod.
    #[must_use]
    pub fn get(&self, uid: &str) -> Option<Arc<StoredPod>> {
        self.inner.read().ok().and_then(|map| map.get(uid).cloned())
    }

    /// Every pod, by UID (shared, not copied).
    #[must_use]
    pub fn snapshot(&self) -> Vec<Arc<StoredPod>> {
        self.inner.read().map(|map| map.values().cloned().collect()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::PodStore;

    #[tokio::test]
    async fn a_call_wanting_a_pod_wakes_the_watch_waiting_out_its_back_off() {
        let store = PodStore::new();
        let waiter = store.clone();
        let woke = tokio::spawn(async move { waiter.wanted().await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!woke.is_finished(), "nothing wanted yet");
        store.want_news();
        tokio::time::timeout(Duration::from_secs(5), woke).await.expect("the watch woke").unwrap();
        // Asked while nobody waited: the next wait returns at once.
        store.want_news();
        tokio::time::timeout(Duration::from_secs(5), store.wanted()).await.expect("kept for the next wait");
    }
}
