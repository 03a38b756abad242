//! What the container runtime is told when it creates a container (NRI's `CreateContainer`,
//! served by [`crate::nri`]): the runtime names the pod by UID, which no device-plugin call
//! does, so the container's ledger rows are found for certain. A container that holds rows gets
//! the full environment of docs/gpushared.md's table, whatever `[kubelet] environment` left out
//! of the answer the kubelet checkpoints; one that carries a device-plugin answer for another pod
//! is refused, so it never starts on that pod's GPUs.

use std::collections::{BTreeMap, HashSet};

use gpushare_core::codec::node::PodRef;

use super::{AllocError, Allocator};

/// The variable of every device-plugin answer that names the pod it was for.
const ANSWERED_POD: &str = "GPUSHARE_POD";

/// What a container being created gets from gpushared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Creation {
    /// It holds none of this node's devices: nothing to change.
    NotOurs,
    /// The variables to add to it: those of its full answer that its environment lacks (none
    /// when the kubelet passed the full answer on).
    Environment(BTreeMap<String, String>),
}

impl Allocator {
    /// What container `container` of `pod`, whose environment as the kubelet made it is `env`
    /// (`KEY=value` each), gets as the runtime creates it.
    ///
    /// # Errors
    /// [`AllocError::WrongPod`] when its environment carries an answer for another pod, or
    /// none of the ledger's rows are its own although it carries an answer;
    /// [`AllocError::Ledger`] when it carries an answer and the ledger cannot be read.
    pub fn container_creating(&self, pod: &PodRef, container: &str, env: &[String]) -> Result<Creation, AllocError> {
        // Every answer names its pod: a container without one holds nothing of this node's, and
        // is let through without a look at the ledger (whose trouble would stop it otherwise).
        let Some(answered) = env.iter().find_map(|kv| kv.strip_prefix(ANSWERED_POD)?.strip_prefix('=')) else {
            return Ok(Creation::NotOurs);
        };
        let this = format!("{}/{}", pod.namespace, pod.name);
        let wrong = |answered: &str, why: &str| AllocError::WrongPod {
            pod: this.clone(),
            uid: pod.uid.clone(),
            container: container.to_owned(),
            answered: answered.to_owned(),
            why: why.to_owned(),
        };
        if answered != this {
            return Err(wrong(answered, "its device-plugin answer was for that pod"));
        }
        let rows = self.lock().ledger.live_of(&pod.uid, container)?;
        let Some(last) = rows.last() else {
            return Err(wrong(answered, "the ledger holds no devices for it"));
        };
        let stored = self.pods.get(&pod.uid);
        let mut environment = self.environment();
        environment.lean = false;
        let answer = environment.answer_from_rows(last, &rows, stored.as_deref());
        // What the container has, from its answer or its spec, stays as it is.
        let has: HashSet<&str> = env.iter().filter_map(|kv| kv.split_once('=').map(|(k, _)| k)).collect();
        let missing = answer.envs.into_iter().filter(|(k, _)| !has.contains(k.as_str())).collect();
        Ok(Creation::Environment(missing))
    }
}
