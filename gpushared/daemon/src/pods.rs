//! The pods bound to this node, as the daemon last saw them: filled by the API-server watch
//! ([`crate::kube`]), read by the allocator. It keeps serving what it saw through an API-server
//! outage, so `Allocate` for a pod already seen never waits on the network.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use gpushare_core::PodSpec;
use gpushare_core::codec::node::PodRef;

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
}

/// A shared, thread-safe map of pods by UID.
#[derive(Clone, Debug, Default)]
pub struct PodStore {
    inner: Arc<RwLock<BTreeMap<String, PodView>>>,
}

impl PodStore {
    /// An empty store.
    #[must_use]
    pub fn new() -> Self {
        PodStore::default()
    }

    /// Adds or replaces a pod.
    pub fn upsert(&self, view: PodView) {
        if let Ok(mut map) = self.inner.write() {
            map.insert(view.pod.uid.clone(), view);
        }
    }

    /// Forgets a pod; returns what was known of it.
    pub fn remove(&self, uid: &str) -> Option<PodView> {
        self.inner.write().ok().and_then(|mut map| map.remove(uid))
    }

    /// Replaces the whole content (after a relist).
    pub fn replace_all(&self, views: Vec<PodView>) {
        if let Ok(mut map) = self.inner.write() {
            *map = views.into_iter().map(|v| (v.pod.uid.clone(), v)).collect();
        }
    }

    /// One pod.
    #[must_use]
    pub fn get(&self, uid: &str) -> Option<PodView> {
        self.inner.read().ok().and_then(|map| map.get(uid).cloned())
    }

    /// Every pod, by UID.
    #[must_use]
    pub fn snapshot(&self) -> Vec<PodView> {
        self.inner.read().map(|map| map.values().cloned().collect()).unwrap_or_default()
    }
}
