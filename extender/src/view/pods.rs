//! The pod side of the view: GPU pods as the watch shows them, and the binds the extender made
//! that the watch has not shown yet (assumptions, with their expiry).

use super::*;

impl ClusterView {
    /// Whether the view keeps `pod`: it asks for GPU memory or holds a placement.
    #[must_use]
    pub fn keeps(&self, pod: &PodObject) -> bool {
        pod.asks_for_gpu(&self.config.names) || self.holding_of(pod) != Holding::Nothing
    }

    /// Adds or updates a pod. Pods that ask for no GPU and hold nothing are not kept. An update
    /// that leaves the pod's entry as it was (the kubelet's status changes, most of a pod's
    /// updates) leaves its node's usage cached: recomputing it walks every pod of the node.
    pub fn apply_pod(&mut self, pod: &PodObject) {
        let uid = pod.uid().to_owned();
        let holding = self.holding_of(pod);
        if !pod.asks_for_gpu(&self.config.names) && holding == Holding::Nothing {
            self.remove_pod(&uid);
            return;
        }
        let node = pod.node().map(str::to_owned);
        // The watch caught up with a bind: the pod's own annotation counts from now on.
        if node.is_some()
            && matches!(holding, Holding::Assigned(_) | Holding::Alibaba(_))
            && let Some(a) = self.assumed.remove(&uid)
        {
            self.touch(Some(&a.node));
        }
        let entry = PodEntry {
            namespace: pod.namespace().to_owned(),
            name: pod.name().to_owned(),
            uid: uid.clone(),
            node: node.clone(),
            priority: pod.spec.priority.unwrap_or(0),
            scheduler: pod.scheduler().to_owned(),
            terminal: pod.is_terminal(),
            request: self.request_of(pod),
            holding,
        };
        if self.pods.get(&uid) == Some(&entry) {
            return;
        }
        self.remove_pod(&uid);
        if let Some(n) = &node {
            self.bound.entry(n.clone()).or_default().insert(uid.clone());
            self.touch(Some(n));
        }
        self.pods.insert(uid, entry);
    }

    pub(super) fn remove_pod(&mut self, uid: &str) -> Option<PodEntry> {
        let old = self.pods.remove(uid)?;
        if let Some(n) = &old.node {
            if let Some(set) = self.bound.get_mut(n) {
                set.remove(uid);
                if set.is_empty() {
                    self.bound.remove(n);
                }
            }
            self.touch(Some(n));
        }
        Some(old)
    }

    /// Removes a pod and any bind assumed for it.
    pub fn delete_pod(&mut self, uid: &str) {
        self.remove_pod(uid);
        if let Some(a) = self.assumed.remove(uid) {
            self.touch(Some(&a.node));
        }
    }

    /// Replaces every pod (a watch restart's full list).
    pub fn replace_pods<'a>(&mut self, pods: impl IntoIterator<Item = &'a PodObject>) {
        let old: Vec<String> = self.pods.keys().cloned().collect();
        for uid in old {
            self.remove_pod(&uid);
        }
        for p in pods {
            self.apply_pod(p);
        }
    }

    /// Forgets every pod whose UID is not in `keep` (the end of a relist applied as it came).
    pub fn retain_pods(&mut self, keep: &HashSet<String>) -> Vec<String> {
        let gone: Vec<String> = self.pods.keys().filter(|uid| !keep.contains(*uid)).cloned().collect();
        for uid in gone {
            self.remove_pod(&uid);
        }
        self.listed(InitialLists { nodes: false, pods: true })
    }

    /// Records an in-flight bind.
    pub fn assume(&mut self, uid: &str, assumed: Assumed) {
        let node = assumed.node.clone();
        if let Some(old) = self.assumed.insert(uid.to_owned(), assumed) {
            self.touch(Some(&old.node));
        }
        self.touch(Some(&node));
    }

    /// Marks an in-flight bind as accepted by the API server.
    pub fn confirm(&mut self, uid: &str) {
        if let Some(a) = self.assumed.get_mut(uid) {
            a.bound = true;
        }
    }

    /// Drops an in-flight bind (the call failed).
    pub fn forget(&mut self, uid: &str) -> Option<Assumed> {
        let a = self.assumed.remove(uid)?;
        self.touch(Some(&a.node));
        Some(a)
    }

    /// Drops assumptions older than the configured time; returns them.
    pub fn expire(&mut self, now: Instant) -> Vec<(String, Assumed)> {
        let ttl = self.config.assume_ttl;
        let old: Vec<String> = self
            .assumed
            .iter()
            .filter(|(_, a)| now.saturating_duration_since(a.since) > ttl)
            .map(|(uid, _)| uid.clone())
            .collect();
        old.into_iter().filter_map(|uid| self.forget(&uid).map(|a| (uid, a))).collect()
    }

    /// The assumption for a pod, if any.
    #[must_use]
    pub fn assumption(&self, uid: &str) -> Option<&Assumed> {
        self.assumed.get(uid)
    }
}
