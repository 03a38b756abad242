//! A [`Cluster`] in memory, for tests: pods by namespace and name, bindings applied to them
//! as the API server would (node set, annotations copied, 409 if already bound), failures on
//! demand.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::{Binding, Cluster, ClusterError};
use crate::objects::PodObject;

/// The fake.
#[derive(Debug, Default)]
pub struct FakeCluster {
    pods: Mutex<BTreeMap<(String, String), PodObject>>,
    bindings: Mutex<Vec<Binding>>,
    fail_next: Mutex<Vec<ClusterError>>,
}

impl FakeCluster {
    /// Stores a pod.
    pub fn put(&self, pod: PodObject) {
        let key = (pod.namespace().to_owned(), pod.name().to_owned());
        self.pods.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(key, pod);
    }

    /// A stored pod.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<PodObject> {
        let pods = self.pods.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        pods.get(&(namespace.to_owned(), name.to_owned())).cloned()
    }

    /// Every binding call so far, including failed ones.
    pub fn bindings(&self) -> Vec<Binding> {
        self.bindings.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// The next binding call fails with `e` (queued in order).
    pub fn fail_next(&self, e: ClusterError) {
        self.fail_next.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(e);
    }
}

impl Cluster for FakeCluster {
    async fn get_pod(&self, namespace: &str, name: &str) -> Result<PodObject, ClusterError> {
        self.pod(namespace, name).ok_or_else(|| ClusterError::NotFound(format!("pods {name:?} not found")))
    }

    async fn bind(&self, b: &Binding) -> Result<(), ClusterError> {
        self.bindings.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(b.clone());
        let failure = {
            let mut f = self.fail_next.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            (!f.is_empty()).then(|| f.remove(0))
        };
        if let Some(e) = failure {
            return Err(e);
        }
        let mut pods = self.pods.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(pod) = pods.get_mut(&(b.namespace.clone(), b.name.clone())) else {
            return Err(ClusterError::NotFound(format!("pods {:?} not found", b.name)));
        };
        if pod.uid() != b.uid {
            return Err(ClusterError::Conflict(format!("UID precondition failed for {}", b.name)));
        }
        if let Some(n) = pod.node() {
            return Err(ClusterError::Conflict(format!("pod {} is already assigned to node {n:?}", b.name)));
        }
        pod.spec.node_name.clone_from(&b.node);
        pod.metadata.annotations.get_or_insert_default().extend(b.annotations.clone());
        Ok(())
    }
}
