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
//! nothing lost, nothing duplicated (no container listed twice on a GPU), nothing left behind by
//! a deleted pod; and every pod `Running` on a node has its kubelet's admission record there
//! (so a missing record file cannot pass for "nothing to check").

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_core::devices::device_set_ids;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Serialize;

use crate::cluster::{is_settled, phase, pod_key as key};
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
    /// Live pods `Running`, in the same read.
    pub running: usize,
    /// Pods `Failed` (admission refused, say), in the same read.
    pub failed: usize,
    /// Pods no node has room for (unbound, `Unschedulable`), in the same read.
    pub unplaced: usize,
    /// Pods still on their way (not [`is_settled`]), in the same
    /// read: a settled check waits for none.
    pub moving: usize,
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
    !matches!(phase(pod), "Succeeded" | "Failed")
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
    for pod in pods {
        let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
        match (is_settled(pod), phase(pod)) {
            (false, _) => r.moving += 1,
            (true, "Failed") => r.failed += 1,
            (true, "Running") => r.running += 1,
            (true, _) if !bound => r.unplaced += 1,
            _ => {}
        }
    }
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

    // Settled: every running pod was admitted on its node, as its kubelet recorded (a pod
    // admitted after the records were read is running without one for a moment).
    for pod in pods.iter().filter(|p| is_live(p)) {
        let running = phase(pod) == "Running";
        let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) else { continue };
        let Some(live) = admissions.get(node) else { continue };
        if running && !pod.metadata.uid.as_ref().is_some_and(|uid| live.contains_key(uid)) {
            r.settled_violations
                .push(format!("pod {}: Running on {node}, but its kubelet recorded no admission", key(pod)));
        }
    }

    // Settled: the daemons' allocations are the admitted pods' long-running containers.
    for (node, state) in &states {
        let mut times: BTreeMap<(&str, &str, u32), usize> = BTreeMap::new();
        for a in state.allocations.iter().filter(|a| !a.container.is_empty()) {
            *times.entry((a.pod.uid.as_str(), a.container.as_str(), a.gpu)).or_default() += 1;
        }
        for ((uid, container, gpu), n) in times.into_iter().filter(|(_, n)| *n > 1) {
            r.settled_violations.push(format!(
                "node {node}: its daemon publishes pod {uid} container {container} on GPU {gpu} {n} times"
            ));
        }
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

#[cfg(test)]
mod tests {
    //! Each invariant fed a state that breaks it, built in memory: pods and Nodes as the API
    //! server would list them, kubelet records as the stand-ins write them.

    use gpushare_core::codec::assignment::{ContainerAssignment, GpuShare};
    use gpushare_core::codec::node::{NodeAllocation, PodRef};
    use gpushare_core::{ContainerRole, Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory};
    use serde_json::json;

    use super::*;
    use crate::node::RecordedContainer;

    const TOTAL: u64 = 16_000;

    /// Each kubelet's live admissions, by node then pod UID.
    type Admissions = BTreeMap<String, BTreeMap<String, Record>>;

    fn uuid(gpu: u32) -> String {
        format!("GPU-test-{gpu}")
    }

    /// A Running pod `default/<name>` (UID `<name>-uid`) bound to `node`, with `containers`
    /// (name, [(GPU index, MiB)]) as its assignment.
    fn pod(name: &str, node: &str, containers: &[(&str, &[(u32, u64)])]) -> Pod {
        let assignment = Assignment {
            node: node.into(),
            unit: MemoryUnit::Mib,
            containers: containers
                .iter()
                .map(|(c, gpus)| ContainerAssignment {
                    name: (*c).into(),
                    role: ContainerRole::App,
                    gpus: gpus
                        .iter()
                        .map(|(i, mib)| GpuShare {
                            index: *i,
                            uuid: GpuUuid::new(uuid(*i)).unwrap(),
                            mib: Mib::new(*mib),
                        })
                        .collect(),
                })
                .collect(),
        };
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default", "uid": format!("{name}-uid"),
                         "annotations": {ASSIGNMENT_KEY: assignment.encode().unwrap()}},
            "spec": {"nodeName": node, "containers": containers.iter().map(|(c, _)| json!({"name": c})).collect::<Vec<_>>()},
            "status": {"phase": "Running"}
        }))
        .unwrap()
    }

    /// A Node with two GPUs of `TOTAL` MiB whose daemon publishes `used` and `allocations`
    /// (pod name, container, GPU, MiB).
    fn node(name: &str, used: [u64; 2], allocations: &[(&str, &str, u32, u64)]) -> Node {
        let gpus = (0..2).map(|i| Gpu::new(i, GpuUuid::new(uuid(i)).unwrap(), "Tesla T4", Mib::new(TOTAL))).collect();
        let state = NodeState {
            generation: 1,
            daemon_version: "test".into(),
            inventory: NodeInventory::new(MemoryUnit::Mib, gpus).unwrap(),
            used: used.iter().map(|m| Mib::new(*m)).collect(),
            allocations: allocations
                .iter()
                .map(|(pod, container, gpu, mib)| NodeAllocation {
                    pod: PodRef { namespace: "default".into(), name: (*pod).into(), uid: format!("{pod}-uid") },
                    container: (*container).into(),
                    role: ContainerRole::App,
                    gpu: *gpu,
                    mib: Mib::new(*mib),
                })
                .collect(),
            claims: vec![],
            over_budget: vec![],
            tells_lookalikes_apart: false,
        };
        serde_json::from_value(
            json!({"metadata": {"name": name, "annotations": {NODE_STATE_KEY: state.encode().unwrap()}}}),
        )
        .unwrap()
    }

    /// What a kubelet recorded for pod `name`'s container `container`: `devices` (IDs) and
    /// the environment the plugin answered.
    fn admitted(name: &str, container: &str, devices: &[&str], visible: &str, mib: u64) -> (String, Record) {
        let env = BTreeMap::from([
            ("NVIDIA_VISIBLE_DEVICES".to_owned(), visible.to_owned()),
            ("GPUSHARE_MEMORY_MIB".to_owned(), mib.to_string()),
        ]);
        let record = Record {
            event: "admitted".into(),
            namespace: "default".into(),
            name: name.into(),
            uid: format!("{name}-uid"),
            at_ms: 0,
            containers: vec![RecordedContainer {
                name: container.into(),
                init: false,
                units: devices.len(),
                devices: format!("={}", devices.join(",")),
                env,
            }],
            reason: None,
        };
        (record.uid.clone(), record)
    }

    /// Two pods sharing GPU 0 of node `n1` (6000 + 8000 of 16 000 MiB), as everything agrees.
    fn clean() -> (Vec<Pod>, Vec<Node>, Admissions) {
        let pods = vec![pod("a", "n1", &[("main", &[(0, 6_000)])]), pod("b", "n1", &[("main", &[(0, 8_000)])])];
        let nodes = vec![node("n1", [14_000, 0], &[("a", "main", 0, 6_000), ("b", "main", 0, 8_000)])];
        let records = BTreeMap::from([
            admitted("a", "main", &["d0", "d1"], &uuid(0), 6_000),
            admitted("b", "main", &["d2", "d3"], &uuid(0), 8_000),
        ]);
        (pods, nodes, BTreeMap::from([("n1".to_owned(), records)]))
    }

    /// `report` holds exactly one violation, and it contains `needle`.
    fn assert_only(violations: &[String], needle: &str, report: &Report) {
        assert_eq!(violations.len(), 1, "expected one violation naming {needle:?}:\n{}", report.describe());
        assert!(violations[0].contains(needle), "expected {needle:?}, got:\n{}", report.describe());
    }

    #[test]
    fn a_consistent_box_is_clean_and_every_container_is_checked() {
        let (pods, nodes, admissions) = clean();
        let report = check(&pods, &nodes, &admissions);
        assert!(report.is_clean(), "{}", report.describe());
        assert_eq!((report.pods, report.bound, report.admitted), (2, 2, 2));
        assert_eq!(report.containers_checked, 2);
        assert_eq!(report.gpus_checked, 2);
    }

    #[test]
    fn assignments_over_a_gpus_total_are_an_overcommit() {
        let (mut pods, nodes, admissions) = clean();
        pods.push(pod("c", "n1", &[("main", &[(0, 3_000)])]));
        let report = check(&pods, &nodes, &admissions);
        assert_only(&report.violations, "GPU 0: 17000 MiB assigned, 16000 MiB total", &report);
    }

    #[test]
    fn a_daemon_publishing_more_used_than_total_is_an_overcommit() {
        let (pods, mut nodes, admissions) = clean();
        nodes[0] = node("n1", [TOTAL + 1, 0], &[("a", "main", 0, 6_000), ("b", "main", 0, 8_000)]);
        let report = check(&pods, &nodes, &admissions);
        assert_only(&report.violations, "GPU 0: its daemon publishes 16001 MiB used of 16000", &report);
    }

    #[test]
    fn visible_devices_other_than_the_assignment_are_a_violation() {
        let (pods, nodes, mut admissions) = clean();
        let (uid, record) = admitted("b", "main", &["d2", "d3"], &uuid(1), 8_000);
        admissions.get_mut("n1").unwrap().insert(uid, record);
        let report = check(&pods, &nodes, &admissions);
        assert_only(
            &report.violations,
            "pod default/b container main: NVIDIA_VISIBLE_DEVICES=GPU-test-1, assigned GPU-test-0",
            &report,
        );
    }

    #[test]
    fn a_budget_other_than_the_assignment_is_a_violation() {
        let (pods, nodes, mut admissions) = clean();
        let (uid, record) = admitted("b", "main", &["d2", "d3"], &uuid(0), 16_000);
        admissions.get_mut("n1").unwrap().insert(uid, record);
        let report = check(&pods, &nodes, &admissions);
        assert_only(&report.violations, "GPUSHARE_MEMORY_MIB=16000, assigned 8000", &report);
    }

    #[test]
    fn a_device_allocated_to_two_pods_is_a_violation() {
        let (pods, nodes, mut admissions) = clean();
        let (uid, record) = admitted("b", "main", &["d1", "d2"], &uuid(0), 8_000);
        admissions.get_mut("n1").unwrap().insert(uid, record);
        let report = check(&pods, &nodes, &admissions);
        assert_only(&report.violations, "device d1 held by two pods", &report);
    }

    #[test]
    fn a_pod_admitted_on_two_nodes_is_a_violation() {
        let (pods, mut nodes, mut admissions) = clean();
        nodes.push(node("n2", [0, 0], &[]));
        let (uid, record) = admitted("a", "main", &["d0", "d1"], &uuid(0), 6_000);
        admissions.insert("n2".into(), BTreeMap::from([(uid, record)]));
        let report = check(&pods, &nodes, &admissions);
        assert!(
            report.violations.iter().any(|v| v.contains("admitted on n2 but bound to \"n1\"")),
            "{}",
            report.describe()
        );
        assert!(report.violations.iter().any(|v| v.contains("admitted on several nodes")), "{}", report.describe());
    }

    #[test]
    fn an_allocation_the_daemon_publishes_twice_is_a_settled_violation() {
        let (pods, mut nodes, admissions) = clean();
        let twice = [("a", "main", 0, 6_000), ("a", "main", 0, 6_000), ("b", "main", 0, 8_000)];
        nodes[0] = node("n1", [14_000, 0], &twice);
        let report = check(&pods, &nodes, &admissions);
        assert!(report.violations.is_empty(), "{}", report.describe());
        assert_only(&report.settled_violations, "publishes pod a-uid container main on GPU 0 2 times", &report);
    }

    #[test]
    fn an_allocation_the_daemon_lost_or_kept_is_a_settled_violation() {
        let (pods, mut nodes, admissions) = clean();
        nodes[0] = node("n1", [14_000, 0], &[("a", "main", 0, 6_000)]);
        let report = check(&pods, &nodes, &admissions);
        assert_only(&report.settled_violations, "does not publish (\"b-uid\", \"main\", 0, 8000)", &report);

        let gone = [("a", "main", 0, 6_000), ("b", "main", 0, 8_000), ("deleted", "main", 1, 1_000)];
        nodes[0] = node("n1", [15_000, 0], &gone);
        let report = check(&pods, &nodes, &admissions);
        assert_only(&report.settled_violations, "which no live admitted container holds", &report);
    }

    #[test]
    fn a_running_pod_its_kubelet_never_recorded_is_a_settled_violation() {
        // A missing or unread record file: nothing to compare, so nothing may pass for checked.
        let (pods, nodes, mut admissions) = clean();
        admissions.get_mut("n1").unwrap().clear();
        let report = check(&pods, &nodes, &admissions);
        assert_eq!(report.containers_checked, 0);
        assert!(report.violations.is_empty(), "{}", report.describe());
        let unrecorded: Vec<_> =
            report.settled_violations.iter().filter(|v| v.contains("its kubelet recorded no admission")).collect();
        assert_eq!(unrecorded.len(), 2, "{}", report.describe());
    }
}
