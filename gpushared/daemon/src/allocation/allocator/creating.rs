//! What the container runtime is told when it creates a container (NRI's `CreateContainer`,
//! served by [`crate::nri`]): the runtime names the pod by UID, which no device-plugin call
//! does, so the container's ledger rows are found for certain. A container that holds rows gets
//! the full environment of docs/gpushared.md's table, whatever `[kubelet] environment` left out
//! of the answer the kubelet checkpoints; one that carries a device-plugin answer for another pod
//! is refused, so it never starts on that pod's GPUs.
//!
//! On a node whose kubelet counts the memory (`[kubelet] advertise = "capacity"`) no
//! device-plugin call comes at all: the container is allocated here, from its pod's assignment
//! checked against the pod's own spec, the rows committed before the answer, and it gets its
//! whole grant: every variable, replacing whatever its image or spec set under those names, its
//! GPUs' device nodes and, on MPS GPUs, the pipe directory. A pod whose watch
//! event has not come yet is read from the API server first ([`Allocator::read_before_creating`]).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use gpushare_core::PodRequest;
use gpushare_core::codec::node::PodRef;

use super::held::Held;
use super::resolve::Candidate;
use super::{AllocError, Allocator, Edits, room};
use crate::allocation::pods::StoredPod;

/// The variable of every device-plugin answer that names the pod it was for.
const ANSWERED_POD: &str = "GPUSHARE_POD";

/// What a container being created gets from gpushared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Creation {
    /// It holds none of this node's devices: nothing to change.
    NotOurs,
    /// The variables to add to it: those of its full answer that its environment lacks (none
    /// when the kubelet passed the full answer on). Its device nodes and mounts came with the
    /// device plugin's answer.
    Environment(BTreeMap<String, String>),
    /// On a node whose kubelet counts the memory, its whole grant: every variable of its
    /// answer, each replacing what the container has under that name, the device nodes of its
    /// GPUs (`[device_nodes]`) and the MPS pipe directory on MPS GPUs.
    Granted(Edits),
}

impl Allocator {
    /// Before a container of `pod` is served on a node whose kubelet counts the memory: a pod
    /// the store lacks, or does not show bound here, is read from the API server into the store
    /// first. The kubelet creates the containers of pods bound to its node only, so such a pod
    /// is one the pod watch has not delivered yet, and the store must not decide from an older
    /// view than the kubelet's. At once elsewhere, and for a pod the store shows bound here.
    ///
    /// # Errors
    /// [`AllocError::PodUnread`] when the read fails: the container is refused, and the kubelet
    /// creates it again later.
    pub async fn read_before_creating(&self, pod: &PodRef) -> Result<(), AllocError> {
        if !self.counted || self.pods.get(&pod.uid).is_some_and(|p| self.scope().bound_here(&p.view)) {
            return Ok(());
        }
        match self.pods.confirm_named(vec![(pod.namespace.clone(), pod.name.clone())]).await {
            Ok(_) => Ok(()),
            Err(why) => {
                Err(AllocError::PodUnread { pod: format!("{}/{}", pod.namespace, pod.name), uid: pod.uid.clone(), why })
            }
        }
    }

    /// What container `container` of `pod`, whose environment as the kubelet made it is `env`
    /// (`KEY=value` each), gets as the runtime creates it.
    ///
    /// # Errors
    /// [`AllocError::WrongPod`] when its environment carries an answer for another pod, or
    /// none of the ledger's rows are its own although it carries an answer;
    /// [`AllocError::Ledger`] when it carries an answer and the ledger cannot be read.
    /// On a node whose kubelet counts the memory: [`AllocError::NotServed`] when the container
    /// asks for memory and cannot be given it (no usable assignment, no room, a GPU gone).
    pub fn container_creating(&self, pod: &PodRef, container: &str, env: &[String]) -> Result<Creation, AllocError> {
        if self.counted {
            return self.counted_creating(pod, container, env);
        }
        // Every answer names its pod: a container without one holds nothing of this node's, and
        // is let through without a look at the ledger (whose trouble would stop it otherwise).
        let Some(answered) = answered_pod(env) else {
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

    /// [`Self::container_creating`] where the kubelet counts the memory: the container's rows
    /// are committed now (once: a container created again gets the rows it holds), from the
    /// pod the store holds under the UID the runtime named.
    fn counted_creating(&self, pod: &PodRef, container: &str, env: &[String]) -> Result<Creation, AllocError> {
        let this = format!("{}/{}", pod.namespace, pod.name);
        let refuse = |why: String| AllocError::NotServed {
            pod: this.clone(),
            uid: pod.uid.clone(),
            container: container.to_owned(),
            why,
        };
        let stored = self.pods.get(&pod.uid);
        let asks =
            match stored.as_deref().map(|p| PodRequest::from_spec(&p.view.spec, &self.names, self.inventory.unit())) {
                Some(Ok(request)) => request.containers().iter().any(|c| c.name == container),
                Some(Err(e)) => return Err(refuse(e.to_string())),
                None => false,
            };
        let Some(stored) = stored.filter(|_| asks) else {
            // Only gpushared's answers name their pod: here the container's own spec or image did.
            if let Some(answered) = answered_pod(env) {
                return Err(AllocError::WrongPod {
                    pod: this.clone(),
                    uid: pod.uid.clone(),
                    container: container.to_owned(),
                    answered: answered.to_owned(),
                    why: "it asks for no GPU memory on this node".to_owned(),
                });
            }
            return Ok(Creation::NotOurs);
        };
        let mut state = self.lock();
        Self::rebuilding(&state)?;
        let rows = state.ledger.live_of(&pod.uid, container)?;
        // Every variable: no checkpointed answer carries the rest.
        let mut environment = self.environment();
        environment.lean = false;
        let answer = if let Some(last) = rows.last() {
            environment.answer_from_rows(last, &rows, Some(&stored))
        } else {
            let cand = self.named(&stored, container).map_err(refuse)?;
            let new = Self::rows_for(&state.inventory, &cand, &[])?;
            room::check_room(&self.inventory, &state.held, &state.claims, &new, &this)?;
            let written = state.ledger.allocate(&new)?;
            state.held.extend(written.iter().map(|r| Arc::new(Held::from(r))));
            drop(state);
            self.changed();
            tracing::info!(
                pod = %this,
                container,
                gpus = %new.iter().map(|r| format!("GPU{}", r.gpu_index)).collect::<Vec<_>>().join(","),
                mib = new.iter().map(|r| r.mib.get()).sum::<u64>(),
                "allocated at the container's creation"
            );
            environment.answer(&cand.view().pod, &cand.assignment, cand.container())
        };
        Ok(Creation::Granted(answer.into()))
    }

    /// Container `container` of `pod`, as its assignment on this node places it, checked
    /// against the pod's own spec; or why not.
    fn named(&self, pod: &Arc<StoredPod>, container: &str) -> Result<Candidate, String> {
        let scope = self.scope();
        if !scope.bound_here(&pod.view) {
            return Err(format!("the pod is not running on node {} as far as the API server says", self.node));
        }
        let assignment = match &pod.assignment {
            None => {
                return Err(format!("the pod has no {} annotation", gpushare_core::codec::assignment::ASSIGNMENT_KEY));
            }
            Some(Err(e)) => return Err(e.to_string()),
            Some(Ok(a)) if a.node != self.node => return Err(format!("the pod is assigned to node {}", a.node)),
            Some(Ok(a)) => a,
        };
        if let Some(problem) = scope.assignment_problem(pod) {
            return Err(problem.to_owned());
        }
        let position = assignment
            .containers
            .iter()
            .position(|c| c.name == container)
            .ok_or_else(|| "its assignment gives this container no GPU".to_owned())?;
        Ok(Candidate::at(pod, assignment, position, scope.unit))
    }
}

/// The pod an answer in `env` names (`GPUSHARE_POD`), if any.
fn answered_pod(env: &[String]) -> Option<&str> {
    env.iter().find_map(|kv| kv.strip_prefix(ANSWERED_POD)?.strip_prefix('='))
}
