//! The pods bound to this node, as the daemon last saw them: filled by the API-server watch
//! ([`crate::cluster::kube`]), read by the allocator. It keeps what it saw through an API-server
//! outage, so the `Allocate` that follows a `GetPreferredAllocation`, and a pod's later
//! containers, never wait on the network. Every change is
//! announced ([`PodStore::subscribe`]), so a kubelet call waiting for its pod to show up wakes
//! when it does; and such a call asks for the pod ([`PodStore::want_news`]), which cuts short the
//! watch's back-off after an outage: the kubelet has just seen the pod, so the API server is back.
//!
//! The watch may lag behind the kubelet's own, so a kubelet call never takes the store's word
//! that a pod is the only one waiting: it asks for a consistent read of the node's pods that
//! starts after the call did ([`PodStore::confirm`], served by
//! [`crate::cluster::kube::refresh_pods`]). Reads and watch events are merged by resource
//! version, so an older copy of a pod never replaces a newer one, and a deleted pod never
//! comes back from a read that began before its deletion.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// `metadata.creationTimestamp` (RFC 3339, whole seconds; sorts as text): the kubelet
    /// admits the pods of one batch in this order.
    pub created: String,
    /// `metadata.resourceVersion`, as the number etcd makes it; 0 if it is not one.
    pub version: u64,
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
    /// The resource version at which the store first saw the pod bound to this node: the order
    /// in which the kubelet's watch delivered the pods (it admits pods one batch at a time, each
    /// batch in creation order, and a batch is usually one pod).
    pub arrival: u64,
}

impl StoredPod {
    fn new(view: PodView, earlier: Option<&StoredPod>) -> Self {
        let assignment = view.annotations.get(ASSIGNMENT_KEY).map(|text| Assignment::decode(text).map(Arc::new));
        let arrival = match earlier {
            Some(e) if e.view.node.is_some() && e.view.node == view.node => e.arrival,
            _ => view.version,
        };
        StoredPod { view, assignment, problem: std::sync::OnceLock::new(), arrival }
    }

    /// Whether `view` is older than this copy (both versions known).
    fn is_newer_than(&self, view: &PodView) -> bool {
        view.version != 0 && self.view.version > view.version
    }
}

/// How many deleted pods the store remembers, so that a read begun before a deletion cannot
/// bring the pod back.
const TOMBSTONES: usize = 4096;

/// The pods, and the deletions seen recently: UID → resource version of the deletion.
#[derive(Debug, Default)]
struct Pods {
    by_uid: BTreeMap<String, Arc<StoredPod>>,
    deleted: BTreeMap<String, u64>,
}

impl Pods {
    /// Stores `view` unless the store has a newer copy or saw the pod deleted later; returns
    /// whether it did.
    fn merge(&mut self, view: PodView) -> bool {
        let uid = &view.pod.uid;
        if self.deleted.get(uid).is_some_and(|at| view.version != 0 && view.version <= *at) {
            return false;
        }
        let earlier = self.by_uid.get(uid);
        if earlier.is_some_and(|e| e.is_newer_than(&view)) {
            return false;
        }
        let stored = Arc::new(StoredPod::new(view, earlier.map(AsRef::as_ref)));
        self.by_uid.insert(stored.view.pod.uid.clone(), stored);
        true
    }
}

/// A consistent read's outcome, as [`PodStore::confirm`] reports it.
#[derive(Clone, Debug, Default)]
struct Refreshed {
    /// The last request the read served: it began after every request up to this one.
    serves: u64,
    /// Why it failed, if it did.
    error: Option<String>,
}

/// A shared, thread-safe map of pods by UID.
#[derive(Clone, Debug)]
pub struct PodStore {
    inner: Arc<RwLock<Pods>>,
    /// Set once a complete list has been stored: until then, a pod missing from the store
    /// proves nothing.
    synced: Arc<AtomicBool>,
    /// Bumped after every change.
    changes: Arc<watch::Sender<u64>>,
    /// Raised by a kubelet call that waits for a pod the store does not have.
    wanted: Arc<tokio::sync::Notify>,
    /// Consistent reads asked for, counted.
    requested: Arc<watch::Sender<u64>>,
    /// The last consistent read's outcome.
    refreshed: Arc<watch::Sender<Refreshed>>,
    /// Whether something serves consistent reads ([`Self::serve_reads`]).
    served: Arc<AtomicBool>,
    /// Where reads of named pods go, once something serves them ([`Self::serve_fetches`]).
    fetches: Arc<std::sync::Mutex<Option<tokio::sync::mpsc::UnboundedSender<Fetch>>>>,
}

/// A consistent read of named pods ([`PodStore::confirm_named`]): each `namespace/name` read
/// with no resource version and merged into the store, then `done` told the outcome.
#[derive(Debug)]
pub struct Fetch {
    /// The pods, `(namespace, name)`.
    pub pods: Vec<(String, String)>,
    /// Told once the pods found are merged: whether the read settled every pod named (the API
    /// server showed each, or said it has none), or why it failed.
    pub done: tokio::sync::oneshot::Sender<Result<bool, String>>,
    /// When the call asked for it.
    pub asked: std::time::Instant,
}

impl Default for PodStore {
    fn default() -> Self {
        PodStore {
            inner: Arc::default(),
            synced: Arc::default(),
            changes: Arc::new(watch::Sender::new(0)),
            wanted: Arc::default(),
            requested: Arc::new(watch::Sender::new(0)),
            refreshed: Arc::new(watch::Sender::new(Refreshed::default())),
            served: Arc::default(),
            fetches: Arc::default(),
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

    /// Adds or replaces a pod, decoding its assignment, unless the store has a newer copy or
    /// saw it deleted since.
    pub fn upsert(&self, view: PodView) {
        if self.inner.write().is_ok_and(|mut pods| pods.merge(view)) {
            self.changed();
        }
    }

    /// Forgets a pod, deleted at resource version `deleted_at`; returns what was known of it.
    pub fn remove(&self, uid: &str, deleted_at: u64) -> Option<Arc<StoredPod>> {
        let removed = self.inner.write().ok().and_then(|mut pods| {
            if deleted_at != 0 {
                pods.deleted.insert(uid.to_owned(), deleted_at);
                if pods.deleted.len() > TOMBSTONES
                    && let Some(oldest) = pods.deleted.iter().min_by_key(|(_, at)| **at).map(|(u, _)| u.clone())
                {
                    pods.deleted.remove(&oldest);
                }
            }
            pods.by_uid.remove(uid)
        });
        if removed.is_some() {
            self.changed();
        }
        removed
    }

    /// Replaces the whole content (after a complete list of the watch), keeping the newer copy
    /// of a pod a consistent read stored meanwhile.
    pub fn replace_all(&self, views: Vec<PodView>) {
        if let Ok(mut pods) = self.inner.write() {
            let mut fresh = Pods { by_uid: BTreeMap::new(), deleted: std::mem::take(&mut pods.deleted) };
            for view in views {
                // The copy held so far, for `merge` to keep if newer and to take the arrival from.
                if let Some(kept) = pods.by_uid.remove(&view.pod.uid) {
                    fresh.by_uid.insert(view.pod.uid.clone(), kept);
                }
                fresh.merge(view);
            }
            *pods = fresh;
        }
        self.synced.store(true, Ordering::SeqCst);
        self.changed();
    }

    /// Merges what a consistent read of the node's pods returned ([`Self::upsert`] for each).
    /// A read that brought something the watch had not delivered says the watch lags, or waits
    /// out a back-off while the API server is back: it is asked to try again now
    /// ([`Self::want_news`]). Returns whether the store changed.
    pub fn merge_read(&self, views: Vec<PodView>) -> bool {
        let changed = self.inner.write().is_ok_and(|mut pods| views.into_iter().fold(false, |c, v| pods.merge(v) | c));
        if changed {
            self.changed();
            self.want_news();
        }
        changed
    }

    /// Waits for a consistent read of the node's pods that began after this call, merged into
    /// the store: from then on the store has every pod the kubelet can have seen. Returns
    /// whether a read was made: none, at once, when nothing serves reads (a store without an
    /// API server, in tests).
    ///
    /// # Errors
    /// Why the read failed (the API server cannot be reached, say).
    pub async fn confirm(&self) -> Result<bool, String> {
        if !self.served.load(Ordering::SeqCst) {
            return Ok(false);
        }
        let mut refreshed = self.refreshed.subscribe();
        let mut wanted = 0;
        self.requested.send_modify(|n| {
            *n += 1;
            wanted = *n;
        });
        let outcome =
            refreshed.wait_for(|r| r.serves >= wanted).await.map_err(|_| "the daemon is stopping".to_owned())?;
        outcome.error.clone().map_or(Ok(true), Err)
    }

    /// Reads the named pods consistently, after this call, into the store: cheaper than
    /// [`Self::confirm`] when the kubelet said which pods it may be admitting. Returns whether
    /// a read was made that settles every pod named: not when nothing serves such reads (at
    /// once), nor when the API server would not show one of them to this node.
    ///
    /// # Errors
    /// Why the read failed.
    pub async fn confirm_named(&self, pods: Vec<(String, String)>) -> Result<bool, String> {
        let sender = self.fetches.lock().ok().and_then(|f| f.clone());
        let Some(sender) = sender else { return Ok(false) };
        let (done, outcome) = tokio::sync::oneshot::channel();
        sender
            .send(Fetch { pods, done, asked: std::time::Instant::now() })
            .map_err(|_| "the daemon is stopping".to_owned())?;
        outcome.await.map_err(|_| "the daemon is stopping".to_owned())?
    }

    /// Takes on serving reads of named pods ([`Self::confirm_named`]).
    #[must_use]
    pub fn serve_fetches(&self) -> tokio::sync::mpsc::UnboundedReceiver<Fetch> {
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
        if let Ok(mut f) = self.fetches.lock() {
            *f = Some(sender);
        }
        receiver
    }

    /// Takes on serving consistent reads: the receiver sees the count of reads asked for; each
    /// read is reported with [`Self::read_done`].
    #[must_use]
    pub fn serve_reads(&self) -> watch::Receiver<u64> {
        self.served.store(true, Ordering::SeqCst);
        self.requested.subscribe()
    }

    /// Reports a consistent read that began once `serves` reads had been asked for.
    pub fn read_done(&self, serves: u64, error: Option<String>) {
        self.refreshed.send_replace(Refreshed { serves, error });
    }

    /// Whether a complete list of the pods bound to this node has been stored.
    #[must_use]
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::SeqCst)
    }

    /// One pod.
    #[must_use]
    pub fn get(&self, uid: &str) -> Option<Arc<StoredPod>> {
        self.inner.read().ok().and_then(|pods| pods.by_uid.get(uid).cloned())
    }

    /// Every pod, by UID (shared, not copied).
    #[must_use]
    pub fn snapshot(&self) -> Vec<Arc<StoredPod>> {
        self.inner.read().map(|pods| pods.by_uid.values().cloned().collect()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use gpushare_core::codec::node::PodRef;

    use super::{PodStore, PodView};

    fn view(uid: &str, version: u64, node: Option<&str>) -> PodView {
        PodView {
            pod: PodRef { namespace: "ns".into(), name: format!("p-{uid}"), uid: uid.into() },
            node: node.map(str::to_owned),
            created: "2026-01-01T00:00:00Z".into(),
            version,
            terminal: false,
            spec: gpushare_core::PodSpec::default(),
            annotations: std::collections::BTreeMap::new(),
            container_ids: Vec::new(),
        }
    }

    #[test]
    fn an_older_copy_never_replaces_a_newer_one_nor_brings_a_deleted_pod_back() {
        let store = PodStore::new();
        store.upsert(view("a", 10, Some("n")));
        // A watch lagging behind a consistent read delivers an older copy: kept out.
        store.upsert(view("a", 7, None));
        assert_eq!(store.get("a").unwrap().view.version, 10);
        assert!(store.merge_read(vec![view("a", 12, Some("n")), view("b", 11, Some("n"))]));
        assert_eq!(store.get("a").unwrap().view.version, 12);
        // Deleted at 15: a read begun before the deletion does not bring it back; a later
        // pod of the same UID cannot exist, but a version past the deletion would be taken.
        store.remove("a", 15);
        assert!(!store.merge_read(vec![view("a", 12, Some("n"))]), "nothing new");
        assert!(store.get("a").is_none(), "a deleted pod came back");
        // A relist keeps the newer copy a read stored meanwhile.
        store.merge_read(vec![view("b", 20, Some("n"))]);
        store.replace_all(vec![view("b", 11, Some("n"))]);
        assert_eq!(store.get("b").unwrap().view.version, 20);
    }

    #[test]
    fn a_pod_arrives_once_at_the_version_it_was_first_seen_bound() {
        let store = PodStore::new();
        store.upsert(view("a", 3, None));
        store.upsert(view("a", 5, Some("n")));
        store.upsert(view("a", 9, Some("n")));
        assert_eq!(store.get("a").unwrap().arrival, 5);
        store.replace_all(vec![view("a", 12, Some("n"))]);
        assert_eq!(store.get("a").unwrap().arrival, 5);
    }

    #[tokio::test]
    async fn a_confirmation_waits_for_a_read_begun_after_it() {
        let store = PodStore::new();
        // Nothing serves reads: the store is all there is.
        assert_eq!(store.confirm().await, Ok(false));
        let mut requested = store.serve_reads();
        let asker = store.clone();
        let first = tokio::spawn(async move { asker.confirm().await });
        requested.wait_for(|n| *n >= 1).await.unwrap();
        let serving = *requested.borrow_and_update();
        // A read reported for an earlier request does not answer this one.
        store.read_done(serving - 1, None);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!first.is_finished(), "answered by a read begun before it");
        store.read_done(serving, Some("the API server is away".into()));
        assert_eq!(first.await.unwrap(), Err("the API server is away".to_owned()));
        let asker = store.clone();
        let second = tokio::spawn(async move { asker.confirm().await });
        requested.wait_for(|n| *n > serving).await.unwrap();
        store.read_done(*requested.borrow_and_update(), None);
        assert_eq!(second.await.unwrap(), Ok(true));
    }

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
