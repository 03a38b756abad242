//! The invariants of design.md, checked across the whole box from the outside: what the API
//! server holds (pods, their assignment annotations, the daemons' node-state annotations) and
//! what each kubelet stand-in recorded that its containers received.
//!
//! **Always** (at any instant, whatever is going on):
//! 1. no GPU's assigned memory (the assignments of the live pods bound to its node) exceeds its
//!    total, nor does the memory its daemon publishes as used;
//! 2. no device is held by two live pods of a node (the kubelet's accounting);
//! 3. every admitted container received exactly the GPUs of its assignment
//!    (`NVIDIA_VISIBLE_DEVICES`), its per-GPU budget (`GPUSHARE_MEMORY_MIB`) and as many devices
//!    as it asked for; a pod is admitted on the node it is bound to and nowhere else.
//!
//! **Once the box is quiet** ([`Report::settled_violations`]): each daemon's published
//! allocations are exactly the long-running containers of the live pods admitted on its node —
//! nothing lost, nothing duplicated, nothing left behind by a deleted pod.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_core::devices::device_set_ids;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Serialize;

use crate::cluster::pod_key as key;
use crate::node::Record;

/// What a check found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Live pods (not finished) seen.
    pub pods: usize,
    /// Pods bound to a node.
    pub bound: usize,
    /// Pods admitted by a kubelet.
    pub admitted: usize,
    /// Containers whose environment was compared with their assignment.
    pub containers_checked: usize,
    /// GPUs checked for overcommit.
    pub gpus_checked: usize,
    /// Violations of the always-invariants.
    pub violations: Vec<String>,
    /// Disagreements that must be gone once the box is quiet.
    pub settled_violations: Vec<String>,
}

impl Report {
    /// Whether nothing was violated (the settled disagreements included).
    #[must_use]
    pub fn is_clean(&self) -> bool {
        self.violations.is_empty() && self.settled_violations.is_empty()
    }

    /// The violations as lines for a failure message.
    #[must_use]
    pub fn describe(&self) -> String {
        let mut out = String::new();
        for v in self.violations.iter().chain(&self.settled_violations) {
            let _ = writeln!(out, "  {v}");
        }
        out
    }
}

fn is_live(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    !matches!(phase, "Succeeded" | "Failed")
}

/// Checks the invariants over `pods` and `nodes` (as listed from the API server) and the
/// kubelets' live admissions (`admissions[node]`, by pod UID).
#[must_use]
pub fn check(pods: &[Pod], nodes: &[Node], admissions: &BTreeMap<String, BTreeMap<String, Record>>) -> Report {
    let mut r = Report::default();
    let states: BTreeMap<String, NodeState> = nodes
        .iter()
        .filter_map(|n| {
            let name = n.metadata.name.clone()?;
            let value = n.metadata.annotations.as_ref()?.get(NODE_STATE_KEY)?;
            match NodeState::decode(value) {
                Ok(state) => Some((name, state)),
                Err(e) => {
                    r.violations.push(format!("node {name}: its node-state annotation does not decode: {e}"));
                    None
                }
            }
        })
        .collect();
    let by_uid: BTreeMap<String, &Pod> = pods.iter().filter_map(|p| Some((p.metadata.uid.clone()?, p))).collect();

    // 1. Assigned memory per GPU, from the API server's pods.
    let mut assigned: BTreeMap<(String, String), u64> = BTreeMap::new();
    let mut assignments: BTreeMap<String, Assignment> = BTreeMap::new();
    for pod in pods.iter().filter(|p| is_live(p)) {
        r.pods += 1;
        let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else { continue };
        r.bound += 1;
        let Some(value) = pod.metadata.annotations.as_ref().and_then(|a| a.get(ASSIGNMENT_KEY)) else { continue };
        match Assignment::decode(value) {
            Ok(a) => {
                if a.node != node {
                    r.violations.push(format!("pod {}: bound to {node} but assigned on {}", key(pod), a.node));
                }
                for (uuid, mib) in a.footprint() {
                    *assigned.entry((node.clone(), uuid.to_string())).or_default() += mib.get();
                }
                assignments.insert(pod.metadata.uid.clone().unwrap_or_default(), a);
            }
            Err(e) => r.violations.push(format!("pod {}: its assignment does not decode: {e}", key(pod))),
        }
    }
    for (node, state) in &states {
        for (pos, gpu) in state.inventory.gpus().iter().enumerate() {
            r.gpus_checked += 1;
            let total = gpu.capacity(state.inventory.unit()).get();
            let a = assigned.get(&(node.clone(), gpu.uuid.to_string())).copied().unwrap_or(0);
            if a > total {
                r.violations.push(format!("node {node} GPU {}: {a} MiB assigned, {total} MiB total", gpu.index));
            }
            let used = state.used.get(pos).map_or(0, |m| m.get());
            if used > total {
                r.violations
                    .push(format!("node {node} GPU {}: its daemon publishes {used} MiB used of {total}", gpu.index));
            }
        }
    }

    // 2 and 3. What the kubelets recorded.
    let mut admitted_on: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (node, live) in admissions {
        let mut holders: BTreeMap<String, String> = BTreeMap::new();
        for (uid, record) in live {
            admitted_on.entry(uid.clone()).or_default().push(node.clone());
            let Some(pod) = by_uid.get(uid) else { continue };
            if !is_live(pod) {
                continue;
            }
            r.admitted += 1;
            let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()).unwrap_or_default();
            if bound != node {
                r.violations.push(format!("pod {}: admitted on {node} but bound to {bound:?}", key(pod)));
            }
            for c in &record.containers {
                let devices = device_set_ids(&c.devices).unwrap_or_default();
                if devices.len() != c.units && !c.devices.is_empty() {
                    r.violations.push(format!(
                        "pod {} container {}: asked for {} devices, received {}",
                        key(pod),
                        c.name,
                        c.units,
                        devices.len()
                    ));
                }
                for d in devices {
                    if let Some(other) = holders.insert(d.clone(), uid.clone())
                        && other != *uid
                    {
                        r.violations.push(format!("node {node}: device {d} held by two pods ({other} and {uid})"));
                    }
                }
                if c.units == 0 {
                    continue;
                }
                let Some(a) = assignments.get(uid) else {
                    r.violations.push(format!("pod {}: admitted with GPU devices but has no assignment", key(pod)));
                    continue;
                };
                let Some(ca) = a.container(&c.name) else {
                    r.violations.push(format!("pod {} container {}: not in its assignment", key(pod), c.name));
                    continue;
                };
                r.containers_checked += 1;
                let want: Vec<String> = ca.gpus.iter().map(|g| g.uuid.to_string()).collect();
                let got = c.env.get("NVIDIA_VISIBLE_DEVICES").cloned().unwrap_or_default();
                if got != want.join(",") {
                    r.violations.push(format!(
                        "pod {} container {}: NVIDIA_VISIBLE_DEVICES={got}, assigned {}",
                        key(pod),
                        c.name,
                        want.join(",")
                    ));
                }
                let per_gpu = ca.gpus.first().map_or(0, |g| g.mib.get()).to_string();
                let budget = c.env.get("GPUSHARE_MEMORY_MIB").cloned().unwrap_or_default();
                if budget != per_gpu {
                    r.violations.push(format!(
                        "pod {} container {}: GPUSHARE_MEMORY_MIB={budget}, assigned {per_gpu}",
                        key(pod),
                        c.name
                    ));
                }
            }
        }
    }
    for (uid, nodes) in &admitted_on {
        if nodes.len() > 1 {
            r.violations.push(format!("pod {uid}: admitted on several nodes {nodes:?}"));
        }
    }

    // Settled: the daemons' allocations are the admitted pods' long-running containers.
    for (node, state) in &states {
        let published: BTreeSet<(String, String, u32, u64)> =
            state.allocations.iter().map(|a| (a.pod.uid.clone(), a.container.clone(), a.gpu, a.mib.get())).collect();
        let mut expected = BTreeSet::new();
        for (uid, record) in admissions.get(node).into_iter().flatten() {
            if !by_uid.get(uid).is_some_and(|p| is_live(p)) {
                continue;
            }
            let Some(a) = assignments.get(uid) else { continue };
            for c in record.containers.iter().filter(|c| !c.init && c.units > 0) {
                if let Some(ca) = a.container(&c.name) {
                    for g in &ca.gpus {
                        expected.insert((uid.clone(), c.name.clone(), g.index, g.mib.get()));
                    }
                }
            }
        }
        let published_live: BTreeSet<_> = published.iter().filter(|(_, c, _, _)| !c.is_empty()).cloned().collect();
        for missing in expected.difference(&published_live) {
            r.settled_violations.push(format!("node {node}: its daemon does not publish {missing:?}"));
        }
        for extra in published_live.difference(&expected) {
            let init = assignments
                .get(&extra.0)
                .and_then(|a| a.container(&extra.1))
                .is_some_and(|c| c.role == gpushare_core::ContainerRole::Init);
            if !init {
                r.settled_violations.push(format!(
                    "node {node}: its daemon publishes {extra:?}, which no live admitted container holds"
                ));
            }
        }
    }
    r
}
