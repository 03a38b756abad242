//! Tests of the cluster view: usage from assignments, the daemon winning disagreements,
//! in-flight binds, terminal pods, Alibaba's pods, pending pods.

use std::time::{Duration, Instant};

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment, ContainerAssignment, GpuShare};
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeAllocation, NodeState, PodRef};
use gpushare_core::placement::{NodePolicy, Placer};
use gpushare_core::schedule::Policies;
use gpushare_core::{ContainerRole, Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory, ResourceNames};
use serde_json::json;

use super::*;
use crate::objects::{NodeObject, PodObject};

pub(crate) fn config(alibaba: bool) -> ViewConfig {
    ViewConfig {
        unit: MemoryUnit::Mib,
        names: if alibaba { ResourceNames::alibaba() } else { ResourceNames::gpushare() },
        alibaba,
        assume_ttl: Duration::from_secs(300),
        heartbeat_by_wall_clock: false,
    }
}

pub(crate) fn uuid(node: &str, i: u32) -> GpuUuid {
    GpuUuid::new(format!("GPU-{node}-{i}")).unwrap()
}

/// A node whose daemon publishes `gpus` GPUs of `mib` each, with `allocations`.
pub(crate) fn node(name: &str, gpus: u32, mib: u64, generation: u64, allocations: Vec<NodeAllocation>) -> NodeObject {
    node_telling(name, gpus, mib, generation, allocations, false)
}

/// [`node`], whose daemon says whether it tells look-alike pods apart itself.
pub(crate) fn node_telling(
    name: &str,
    gpus: u32,
    mib: u64,
    generation: u64,
    allocations: Vec<NodeAllocation>,
    tells_lookalikes_apart: bool,
) -> NodeObject {
    let list: Vec<Gpu> = (0..gpus)
        .map(|i| {
            let mut g = Gpu::new(i, uuid(name, i), "Tesla T4", Mib::new(mib));
            g.minor = Some(i);
            g
        })
        .collect();
    let inventory = NodeInventory::new(MemoryUnit::Mib, list).unwrap();
    let mut used = vec![Mib::ZERO; gpus as usize];
    for a in &allocations {
        used[a.gpu as usize] = used[a.gpu as usize].saturating_add(a.mib);
    }
    let state = NodeState {
        generation,
        daemon_version: "0.1.0".into(),
        inventory,
        used,
        allocations,
        claims: vec![],
        over_budget: vec![],
        tells_lookalikes_apart,
    };
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {NODE_STATE_KEY: state.encode().unwrap()}},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}
    }))
    .unwrap()
}

pub(crate) fn assignment(node: &str, containers: &[(&str, &[(u32, u64)])]) -> Assignment {
    Assignment {
        node: node.into(),
        unit: MemoryUnit::Mib,
        containers: containers
            .iter()
            .map(|(name, gpus)| ContainerAssignment {
                name: (*name).into(),
                role: ContainerRole::App,
                gpus: gpus.iter().map(|&(i, m)| GpuShare { index: i, uuid: uuid(node, i), mib: Mib::new(m) }).collect(),
            })
            .collect(),
    }
}

/// A pod asking for `mib` in one container, optionally bound with an assignment.
pub(crate) fn pod(name: &str, mib: u64, bound: Option<(&str, Assignment)>, phase: &str) -> PodObject {
    let mut annotations = serde_json::Map::new();
    let mut node = String::new();
    if let Some((n, a)) = bound {
        node = n.to_owned();
        annotations.insert(ASSIGNMENT_KEY.into(), json!(a.encode().unwrap()));
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}"), "annotations": annotations},
        "spec": {"nodeName": node, "containers": [{"name": "main", "resources": {"limits": {"gpushare.io/gpu-mem": mib.to_string()}}}]},
        "status": {"phase": phase}
    }))
    .unwrap()
}

pub(crate) fn holding(pod: &str, container: &str, gpu: u32, mib: u64) -> NodeAllocation {
    NodeAllocation {
        pod: PodRef { namespace: "default".into(), name: pod.into(), uid: format!("uid-{pod}") },
        container: container.into(),
        role: ContainerRole::App,
        gpu,
        mib: Mib::new(mib),
    }
}

/// An in-flight bind of pod `name` (`default`, UID `uid-<name>`) to `node`, not yet bound.
fn assumed(name: &str, node: &str, assignment: Assignment) -> Assumed {
    Assumed {
        namespace: "default".into(),
        name: name.into(),
        node: node.into(),
        assignment,
        bound: false,
        since: Instant::now(),
    }
}

fn used(view: &mut ClusterView, node: &str) -> Vec<u64> {
    view.usage(node).unwrap().total().iter().map(|m| m.get()).collect()
}

#[test]
fn bound_pods_count_by_their_assignment_until_the_daemon_reports_them() {
    let mut v = ClusterView::new(config(false));
    v.apply_node(&node("n1", 2, 1000, 1, vec![]));
    v.apply_pod(&pod("a", 300, Some(("n1", assignment("n1", &[("main", &[(1, 300)])]))), "Pending"));
    v.apply_pod(&pod("b", 200, None, "Pending")); // not bound: counts nowhere
    assert_eq!(used(&mut v, "n1"), [0, 300]);
    // The daemon admits it on the same GPU: counted once.
    v.apply_node(&node("n1", 2, 1000, 2, vec![holding("a", "main", 1, 300)]));
    assert_eq!(used(&mut v, "n1"), [0, 300]);
    assert_eq!(v.disagreements(), 0);
}

#[test]
fn a_grant_wider_than_the_spec_is_not_counted() {
    let mut v = ClusterView::new(config(false));
    v.apply_node(&node("n1", 2, 1000, 1, vec![]));
    // The spec asks for 300 MiB on one GPU; the annotation its owner wrote fills both GPUs.
    v.apply_pod(&pod("greedy", 300, Some(("n1", assignment("n1", &[("main", &[(0, 1000), (1, 1000)])]))), "Running"));
    v.apply_pod(&pod("honest", 300, Some(("n1", assignment("n1", &[("main", &[(1, 300)])]))), "Running"));
    assert_eq!(used(&mut v, "n1"), [0, 300]);
    assert_eq!(v.invalid_assignments(), 1);
    let greedy = v.pod("uid-greedy").unwrap();
    assert!(
        matches!(&greedy.holding, Holding::Invalid(why) if why.contains("does not match its spec")),
        "{:?}",
        greedy.holding
    );
}

#[test]
fn the_daemon_wins_a_disagreement_and_it_is_counted() {
    let mut v = ClusterView::new(config(false));
    v.apply_node(&node("n1", 2, 1000, 1, vec![]));
    v.apply_pod(&pod("a", 300, Some(("n1", assignment("n1", &[("main", &[(0, 300)])]))), "Running"));
    // The daemon holds it on GPU1 instead, and holds a pod the extender never saw.
    let found =
        v.apply_node(&node("n1", 2, 1000, 2, vec![holding("a", "main", 1, 300), holding("ghost", "main", 0, 100)]));
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found.iter().any(|f| f.contains("ghost") && f.contains("does not know")), "{found:?}");
    assert!(found.iter().any(|f| f.contains("default/a") && f.contains("counting the daemon's")), "{found:?}");
    assert_eq!(v.disagreements(), 2);
    // The assignment's GPU0 share counts as the max with the daemon's per-GPU figure.
    assert_eq!(used(&mut v, "n1"), [400, 300]);
    // The same generation again is not a new disagreement.
    v.apply_node(&node("n1", 2, 1000, 2, vec![holding("a", "main", 1, 300)]));
    assert_eq!(v.disagreements(), 2);
}

#[test]
fn terminal_pods_release_unless_the_daemon_still_holds_them() {
    let mut v = ClusterView::new(config(false));
    v.apply_node(&node("n1", 1, 1000, 1, vec![]));
    v.apply_pod(&pod("done", 300, Some(("n1", assignment("n1", &[("main", &[(0, 300)])]))), "Succeeded"));
    assert_eq!(used(&mut v, "n1"), [0]);
    v.apply_node(&node("n1", 1, 1000, 2, vec![holding("done", "main", 0, 300)]));
    assert_eq!(used(&mut v, "n1"), [300]);
    v.delete_pod("uid-done");
    assert_eq!(used(&mut v, "n1"), [300], "the daemon's report still counts until it republishes");
    v.apply_node(&node("n1", 1, 1000, 3, vec![]));
    assert_eq!(used(&mut v, "n1"), [0]);
}

#[test]
fn in_flight_binds_count_until_the_watch_shows_them_and_roll_back_on_failure() {
    let mut v = ClusterView::new(config(false));
    v.apply_node(&node("n1", 1, 1000, 1, vec![]));
    v.apply_pod(&pod("a", 600, None, "Pending"));
    let a = assignment("n1", &[("main", &[(0, 600)])]);
    v.assume("uid-a", assumed("a", "n1", a.clone()));
    assert_eq!(used(&mut v, "n1"), [600]);
    let mut placer = Placer::new();
    let req = v.request_of(&pod("b", 600, None, "Pending")).unwrap();
    let none = v.evicted(&[]);
    assert!(v.score(&mut placer, "n1", &req, Policies::default(), 0, &none).unwrap_err().is_resolvable());
    // The pod's own bind does not count against itself.
    assert!(v.score(&mut placer, "n1", &req, Policies::default(), 0, &v.evicted(&["uid-a"])).is_ok());
    v.forget("uid-a");
    assert_eq!(used(&mut v, "n1"), [0]);
    // Bound: the watch's update replaces the assumption, counted once.
    v.assume("uid-a", assumed("a", "n1", a.clone()));
    v.confirm("uid-a");
    v.apply_pod(&pod("a", 600, Some(("n1", a.clone())), "Pending"));
    assert!(v.assumption("uid-a").is_none());
    assert_eq!(used(&mut v, "n1"), [600]);
    // Expiry.
    v.assume("uid-x", Assumed { since: Instant::now() - Duration::from_secs(301), ..assumed("x", "n1", a.clone()) });
    assert_eq!(used(&mut v, "n1"), [1200]);
    let expired = v.expire(Instant::now());
    assert_eq!(expired.len(), 1);
    assert_eq!(used(&mut v, "n1"), [600]);
}

#[test]
fn a_daemon_reporting_the_extenders_own_bind_before_the_watch_shows_it_agrees() {
    let mut v = ClusterView::new(config(false));
    v.apply_node(&node("n1", 1, 1000, 1, vec![]));
    v.apply_pod(&pod("a", 600, None, "Pending"));
    let a = assignment("n1", &[("main", &[(0, 600)])]);
    v.assume("uid-a", Assumed { bound: true, ..assumed("a", "n1", a) });
    // The daemon (fast kubelet) reports it before the extender's pod watch shows the binding.
    let found = v.apply_node(&node("n1", 1, 1000, 2, vec![holding("a", "main", 0, 600)]));
    assert!(found.is_empty(), "{found:?}");
    assert_eq!(v.disagreements(), 0);
    assert_eq!(used(&mut v, "n1"), [600], "counted once");
    // The same report about a pod bound elsewhere by this extender is still a disagreement.
    let found = v.apply_node(&node("n2", 1, 1000, 1, vec![holding("a", "main", 0, 600)]));
    assert_eq!(found.len(), 1, "{found:?}");
}

#[test]
fn pods_placed_by_alibabas_extender_count_with_compatibility_on() {
    let alibaba_pod = |name: &str| -> PodObject {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}"),
                         "annotations": {"ALIYUN_COM_GPU_MEM_IDX": "1", "ALIYUN_COM_GPU_MEM_POD": "250",
                                         "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "main", "resources": {"limits": {"aliyun.com/gpu-mem": "250"}}}]},
            "status": {"phase": "Running"}
        }))
        .unwrap()
    };
    let mut on = ClusterView::new(config(true));
    on.apply_node(&node("n1", 2, 1000, 1, vec![]));
    on.apply_pod(&alibaba_pod("old"));
    assert_eq!(used(&mut on, "n1"), [0, 250]);
    let mut off = ClusterView::new(config(false));
    off.apply_node(&node("n1", 2, 1000, 1, vec![]));
    off.apply_pod(&alibaba_pod("old"));
    assert_eq!(used(&mut off, "n1"), [0, 0]);
    // A tenant's own annotations claiming more than its spec asks for make no node look full.
    let mut inflated = alibaba_pod("inflated");
    inflated.metadata.annotations.get_or_insert_default().insert("ALIYUN_COM_GPU_MEM_POD".into(), "1000".into());
    on.apply_node(&node("n1", 2, 1000, 2, vec![]));
    on.apply_pod(&inflated);
    assert_eq!(used(&mut on, "n1"), [0, 250]);
    assert_eq!(on.invalid_assignments(), 1);
}

#[test]
fn a_node_alibabas_plugin_serves_is_listed_by_inspect_and_never_placed_on() {
    let alibaba_pod = |name: &str, idx: u32, units: u64, phase: &str| -> PodObject {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}"),
                         "annotations": {"ALIYUN_COM_GPU_MEM_IDX": idx.to_string(),
                                         "ALIYUN_COM_GPU_MEM_POD": units.to_string(),
                                         "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}},
            "spec": {"nodeName": "old", "containers": [{"name": "main",
                     "resources": {"limits": {"aliyun.com/gpu-mem": units.to_string()}}}]},
            "status": {"phase": phase}
        }))
        .unwrap()
    };
    // As Alibaba's plugin leaves it: 2 GPUs, 81920 MiB in all, no gpushare.io/node-state.
    let old: NodeObject = serde_json::from_value(json!({"metadata": {"name": "old"},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.9"}],
                   "capacity": {"aliyun.com/gpu-count": "2", "aliyun.com/gpu-mem": "81920", "cpu": "8"}}}))
    .unwrap();
    let mut on = ClusterView::new(config(true));
    on.apply_node(&old);
    for (name, idx, units, phase) in [("a", 0, 12000, "Running"), ("b", 0, 3000, "Running"), ("c", 1, 9000, "Running")]
    {
        on.apply_pod(&alibaba_pod(name, idx, units, phase));
    }
    on.apply_pod(&alibaba_pod("done", 1, 5000, "Succeeded"));
    let report = crate::inspect::ClusterReport::from_view(&mut on);
    let listed = report.nodes.iter().find(|n| n.name == "old").expect("the node Alibaba's plugin serves is listed");
    assert_eq!(listed.address, "10.0.0.9");
    let cells: Vec<(u32, u64, u64, &str)> =
        listed.gpus.iter().map(|g| (g.index, g.used_mib, g.total_mib, g.mode.as_str())).collect();
    assert_eq!(cells, [(0, 15000, 40960, "alibaba"), (1, 9000, 40960, "alibaba")]);
    assert_eq!(listed.gpus[1].pods.iter().map(|p| p.pod.as_str()).collect::<Vec<_>>(), ["default/c"]);
    assert!(report.gpu_samples().iter().all(|g| !g.schedulable), "never offered for placement");
    assert_eq!(on.inventory("old").unwrap_err(), NodeRefusal::NotSharing);
    // Without compatibility the node is not gpushare's business at all.
    let mut off = ClusterView::new(config(false));
    off.apply_node(&old);
    assert!(crate::inspect::ClusterReport::from_view(&mut off).nodes.is_empty());
    // Once gpushared publishes there, the node is read from its node state instead.
    on.apply_node(&node("old", 2, 40960, 1, vec![]));
    assert_eq!(on.alibaba_gpus("old"), None);
    assert_eq!(used(&mut on, "old"), [15000, 9000]);
}

#[test]
fn pods_seen_before_their_node_count_once_it_arrives() {
    let mut v = ClusterView::new(config(false));
    v.apply_pod(&pod("a", 300, Some(("n1", assignment("n1", &[("main", &[(0, 300)])]))), "Running"));
    v.apply_node(&node("n1", 1, 1000, 1, vec![]));
    assert_eq!(used(&mut v, "n1"), [300]);
    v.replace_nodes(&[]);
    v.replace_nodes(&[node("n1", 1, 1000, 2, vec![])]);
    assert_eq!(used(&mut v, "n1"), [300]);
}

#[test]
fn bound_pods_without_a_placement_are_pending_and_refusals_say_why() {
    let mut v = ClusterView::new(config(false));
    v.apply_node(&node("n1", 1, 1000, 1, vec![]));
    let mut p = pod("waiting", 100, None, "Pending");
    p.spec.node_name = "n1".into();
    v.apply_pod(&p);
    assert_eq!(v.usage("n1").unwrap().pending, [("default/waiting".to_owned(), Mib::new(100))]);
    let plain: NodeObject = serde_json::from_value(json!({"metadata": {"name": "cpu"}})).unwrap();
    v.apply_node(&plain);
    let broken: NodeObject =
        serde_json::from_value(json!({"metadata": {"name": "bad", "annotations": {NODE_STATE_KEY: "{"}}})).unwrap();
    v.apply_node(&broken);
    let req = v.request_of(&pod("x", 100, None, "Pending")).unwrap();
    let mut placer = Placer::new();
    let none = v.evicted(&[]);
    let why = |v: &mut ClusterView, placer: &mut Placer, n: &str| {
        v.score(placer, n, &req, Policies::default(), 0, &none).unwrap_err()
    };
    assert_eq!(why(&mut v, &mut placer, "cpu"), NodeRefusal::NotSharing);
    assert!(why(&mut v, &mut placer, "cpu").to_string().contains("gpushared is not running"));
    assert!(matches!(why(&mut v, &mut placer, "bad"), NodeRefusal::Invalid(_)));
    assert_eq!(why(&mut v, &mut placer, "nowhere"), NodeRefusal::Unknown);
    assert!(!why(&mut v, &mut placer, "cpu").is_resolvable());
    // Non-GPU pods are not kept at all.
    let cpu_pod: PodObject = serde_json::from_value(json!({"metadata": {"name": "c", "uid": "c"}})).unwrap();
    v.apply_pod(&cpu_pod);
    assert!(v.pod("c").is_none());
    // A relist drops what is gone.
    v.replace_nodes(&[node("n1", 1, 1000, 2, vec![])]);
    assert_eq!(v.node_names(), ["n1"]);
}

#[test]
fn the_filter_shortcut_agrees_with_the_placer() {
    // Nodes of 4 GPUs with every mix of usage, a sick GPU and a cordoned one; pods of every size.
    let mut v = ClusterView::new(config(false));
    let mut names = Vec::new();
    for n in 0..24u64 {
        let name = format!("n{n}");
        let allocations = (0..4u32)
            .filter(|g| (n + u64::from(*g)) % 3 != 0)
            .map(|g| holding(&format!("p{n}-{g}"), "main", g, 100 + ((n * 37 + u64::from(g) * 211) % 900)))
            .collect();
        let mut object = node(&name, 4, 1000, 1, allocations);
        if n % 5 == 0 {
            // GPU0 unhealthy, GPU1 cordoned.
            let key = object.metadata.annotations.as_mut().unwrap();
            let mut state = NodeState::decode(&key[NODE_STATE_KEY]).unwrap();
            let mut inv = state.inventory.clone();
            inv.gpu_mut(0).unwrap().health = gpushare_core::Health::Unhealthy { reason: "Xid 79".into() };
            inv.gpu_mut(1).unwrap().cordoned = true;
            state.inventory = inv;
            key.insert(NODE_STATE_KEY.into(), state.encode().unwrap());
        }
        v.apply_node(&object);
        names.push(name);
    }
    v.refresh();
    let none = v.evicted(&[]);
    let mut placer = Placer::new();
    let mut shortcuts = 0;
    for mib in (50..=1000).step_by(50) {
        let req = v.request_of(&pod("x", mib, None, "Pending")).unwrap();
        for n in &names {
            let full = v.score(&mut placer, n, &req, Policies::default(), 0, &none).is_ok();
            let quick = v.surely_fits(n, &req, &none);
            assert_eq!(quick, full.then_some(true), "{n}, {mib} MiB");
            shortcuts += usize::from(quick.is_some());
        }
    }
    assert!(shortcuts > 100, "the shortcut applies: {shortcuts}");
    // Not for shapes it does not cover, nor for a node an evicted pod touches.
    let two: PodObject = serde_json::from_value(json!({
        "metadata": {"name": "two", "namespace": "default", "uid": "uid-two"},
        "spec": {"containers": [
            {"name": "a", "resources": {"limits": {"gpushare.io/gpu-mem": "100"}}},
            {"name": "b", "resources": {"limits": {"gpushare.io/gpu-mem": "100"}}}]}
    }))
    .unwrap();
    assert_eq!(v.surely_fits("n1", &v.request_of(&two).unwrap(), &none), None);
    let small = v.request_of(&pod("x", 50, None, "Pending")).unwrap();
    assert_eq!(v.surely_fits("n1", &small, &v.evicted(&["uid-p1-1"])), None);
    assert_eq!(v.surely_fits("nowhere", &small, &none), None);
}

#[test]
fn a_relist_applied_as_it_comes_forgets_the_pods_it_did_not_see() {
    let mut v = ClusterView::new(config(false));
    v.apply_node(&node("n1", 2, 1000, 1, vec![]));
    v.apply_pod(&pod("a", 300, Some(("n1", assignment("n1", &[("main", &[(0, 300)])]))), "Running"));
    v.apply_pod(&pod("b", 200, Some(("n1", assignment("n1", &[("main", &[(1, 200)])]))), "Running"));
    assert_eq!(used(&mut v, "n1"), [300, 200]);
    // The relist shows only "a" (b was deleted while the watch was down).
    v.apply_pod(&pod("a", 300, Some(("n1", assignment("n1", &[("main", &[(0, 300)])]))), "Running"));
    v.retain_pods(&HashSet::from(["uid-a".to_owned()]));
    assert_eq!(used(&mut v, "n1"), [300, 0]);
}

/// A pod of one container asking for `mib` over `gpus` GPUs.
fn pod_on_gpus(name: &str, mib: u64, gpus: u32) -> PodObject {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {
            "gpushare.io/gpu-mem": mib.to_string(), "gpushare.io/gpu-count": gpus.to_string()}}}]},
        "status": {"phase": "Pending"}
    }))
    .unwrap()
}

#[test]
fn the_summary_scores_and_filters_as_the_placer() {
    // The nodes of the shortcut test above: every mix of usage, sick and cordoned GPUs.
    let mut v = ClusterView::new(config(false));
    let mut names = Vec::new();
    for n in 0..24u64 {
        let name = format!("n{n}");
        let allocations = (0..4u32)
            .filter(|g| (n + u64::from(*g)) % 3 != 0)
            .map(|g| holding(&format!("p{n}-{g}"), "main", g, 100 + ((n * 37 + u64::from(g) * 211) % 900)))
            .collect();
        let mut object = node(&name, 4, 1000, 1, allocations);
        if n % 5 == 0 {
            let key = object.metadata.annotations.as_mut().unwrap();
            let mut state = NodeState::decode(&key[NODE_STATE_KEY]).unwrap();
            state.inventory.gpu_mut(0).unwrap().health = gpushare_core::Health::Unhealthy { reason: "Xid 79".into() };
            state.inventory.gpu_mut(1).unwrap().cordoned = true;
            key.insert(NODE_STATE_KEY.into(), state.encode().unwrap());
        }
        v.apply_node(&object);
        names.push(name);
    }
    v.refresh();
    assert!(v.summaries_in_step());
    let none = v.evicted(&[]);
    let mut placer = Placer::new();
    let mut glances = 0;
    for gpus in 1..=3u32 {
        for mib in (50..=1000).step_by(50).map(|m| m * u64::from(gpus)) {
            let req = v.request_of(&pod_on_gpus("x", mib, gpus)).unwrap();
            let shape = Shape::of(&req).unwrap();
            assert_eq!(shape.gpus, gpus as usize);
            for node_policy in [NodePolicy::Binpack, NodePolicy::Spread] {
                for gpu_policy in [GpuPolicy::Binpack, GpuPolicy::Spread] {
                    let policies = Policies { gpu: gpu_policy, node: node_policy };
                    for n in &names {
                        let full = v.score(&mut placer, n, &req, policies, 0, &none).ok();
                        let glance = v.score_at_a_glance(n, &shape, policies, 0, &none);
                        assert_eq!(glance, full, "{n}, {mib} MiB on {gpus} GPUs, {policies:?}");
                        assert_eq!(v.passes_at_a_glance(n, &shape, &none), full.is_some(), "{n}, {mib} MiB");
                        assert_eq!(v.surely_fits(n, &req, &none), full.map(|_| true), "{n}, {mib} MiB");
                        glances += usize::from(glance.is_some());
                    }
                }
            }
        }
    }
    assert!(glances > 500, "the summary decides most: {glances}");
    // Not with GPU activity weighed, nor for a node an evicted pod touches, nor an unknown one.
    let small = v.request_of(&pod("x", 50, None, "Pending")).unwrap();
    let shape = Shape::of(&small).unwrap();
    assert_eq!(v.score_at_a_glance("n1", &shape, Policies::default(), 30, &none), None);
    assert_eq!(v.score_at_a_glance("n1", &shape, Policies::default(), 0, &v.evicted(&["uid-p1-1"])), None);
    assert!(!v.passes_at_a_glance("n1", &shape, &v.evicted(&["uid-p1-1"])));
    assert!(!v.passes_at_a_glance("nowhere", &shape, &none));
}

#[test]
fn a_node_admitting_a_pod_of_a_request_of_the_same_size_is_left_to_the_long_way() {
    let mut v = ClusterView::new(config(false));
    v.apply_node(&node("n1", 2, 1000, 1, vec![]));
    // Bound with its assignment, not reported by the daemon yet: in admission.
    v.apply_pod(&pod("a", 300, Some(("n1", assignment("n1", &[("main", &[(0, 300)])]))), "Pending"));
    v.refresh();
    let none = v.evicted(&[]);
    let same = Shape::of(&v.request_of(&pod("b", 300, None, "Pending")).unwrap()).unwrap();
    let other = Shape::of(&v.request_of(&pod("c", 200, None, "Pending")).unwrap()).unwrap();
    assert!(!v.passes_at_a_glance("n1", &same, &none));
    assert!(v.passes_at_a_glance("n1", &other, &none));
    // Once the daemon reports it allocated, no longer.
    v.apply_node(&node("n1", 2, 1000, 2, vec![holding("a", "main", 0, 300)]));
    v.refresh();
    assert!(v.passes_at_a_glance("n1", &same, &none));
    // Any of its requests counts, not only the first: the daemon serves the next container
    // without a row, whichever it is.
    let two = assignment("n1", &[("fetch", &[(0, 100)]), ("main", &[(0, 250)])]);
    let mut d = pod("d", 350, Some(("n1", two)), "Pending");
    d.spec.containers = serde_json::from_value(json!([
        {"name": "fetch", "resources": {"limits": {"gpushare.io/gpu-mem": "100"}}},
        {"name": "main", "resources": {"limits": {"gpushare.io/gpu-mem": "250"}}}
    ]))
    .unwrap();
    v.apply_pod(&d);
    v.refresh();
    let later = Shape::of(&v.request_of(&pod("e", 250, None, "Pending")).unwrap()).unwrap();
    assert!(!v.passes_at_a_glance("n1", &later, &none));
    assert!(v.summaries_in_step());
}

#[test]
fn summaries_stay_in_step_as_pods_and_nodes_change() {
    let mut v = ClusterView::new(config(false));
    let check = |v: &mut ClusterView, what: &str| {
        assert!(v.summaries_in_step(), "before refresh, after {what}");
        v.refresh();
        assert!(v.summaries_in_step(), "after {what}");
    };
    let none = v.evicted(&[]);
    let shape = |v: &ClusterView, mib: u64| Shape::of(&v.request_of(&pod("x", mib, None, "Pending")).unwrap()).unwrap();
    for i in 0..40 {
        v.apply_node(&node(&format!("n{i}"), 2, 1000, 1, vec![]));
    }
    check(&mut v, "nodes");
    for i in 0..40 {
        let n = format!("n{i}");
        v.apply_pod(&pod(&format!("a{i}"), 700, Some((&n, assignment(&n, &[("main", &[(0, 700)])]))), "Running"));
        v.apply_pod(&pod(&format!("b{i}"), 800, Some((&n, assignment(&n, &[("main", &[(1, 800)])]))), "Running"));
    }
    check(&mut v, "pods");
    assert!(!v.passes_at_a_glance("n3", &shape(&v, 400), &none), "GPUs hold 300 and 200 free");
    assert!(v.passes_at_a_glance("n3", &shape(&v, 250), &none));
    // A pod deleted frees its GPU at once.
    v.delete_pod("uid-a3");
    check(&mut v, "a delete");
    assert!(v.passes_at_a_glance("n3", &shape(&v, 400), &none));
    // An in-flight bind counts, and is rolled back.
    v.assume("uid-z", assumed("z", "n3", assignment("n3", &[("main", &[(0, 900)])])));
    check(&mut v, "an assumption");
    assert!(!v.passes_at_a_glance("n3", &shape(&v, 400), &none));
    v.forget("uid-z");
    check(&mut v, "a forgotten assumption");
    assert!(v.passes_at_a_glance("n3", &shape(&v, 400), &none));
    // The node's daemon republishes: GPU0 cordoned.
    let mut object = node("n3", 2, 1000, 2, vec![holding("b3", "main", 1, 800)]);
    let key = object.metadata.annotations.as_mut().unwrap();
    let mut state = NodeState::decode(&key[NODE_STATE_KEY]).unwrap();
    state.inventory.gpu_mut(0).unwrap().cordoned = true;
    key.insert(NODE_STATE_KEY.into(), state.encode().unwrap());
    v.apply_node(&object);
    check(&mut v, "a cordon");
    assert!(!v.passes_at_a_glance("n3", &shape(&v, 300), &none), "GPU0 cordoned, GPU1 has 200 free");
    // Nodes deleted, and a relist that drops half of them and brings new ones.
    v.delete_node("n4");
    check(&mut v, "a node delete");
    assert!(!v.passes_at_a_glance("n4", &shape(&v, 100), &none));
    let relist: Vec<NodeObject> = (20..60).map(|i| node(&format!("n{i}"), 2, 1000, 3, vec![])).collect();
    v.replace_nodes(&relist);
    check(&mut v, "a node relist");
    assert!(!v.passes_at_a_glance("n5", &shape(&v, 100), &none));
    assert!(v.passes_at_a_glance("n55", &shape(&v, 900), &none));
    assert!(!v.passes_at_a_glance("n25", &shape(&v, 900), &none), "its pods still count");
    v.retain_pods(&HashSet::new());
    check(&mut v, "a pod relist");
    assert!(v.passes_at_a_glance("n25", &shape(&v, 900), &none));
    // Read through usage() before any refresh: the summary follows.
    v.apply_pod(&pod("late", 600, Some(("n30", assignment("n30", &[("main", &[(0, 600)])]))), "Running"));
    assert!(v.usage("n30").is_ok());
    assert!(v.summaries_in_step());
    assert!(!v.passes_at_a_glance("n30", &shape(&v, 600), &none), "in admission, and GPU0 holds it");
}

#[test]
fn reports_are_compared_only_once_both_initial_lists_are_in() {
    let mut v = ClusterView::new(config(false));
    v.await_initial_lists();
    // The node list comes first: its daemon holds pod a, which the pod list has not delivered.
    let n1 = node("n1", 1, 1000, 1, vec![holding("a", "main", 0, 300), holding("ghost", "main", 0, 100)]);
    assert!(v.replace_nodes([&n1]).is_empty());
    assert_eq!(v.disagreements(), 0);
    // A new generation before the pods are in is not compared either.
    let n1 = node("n1", 1, 1000, 2, vec![holding("a", "main", 0, 300), holding("ghost", "main", 0, 100)]);
    assert!(v.apply_node(&n1).is_empty());
    // The pod list completes the pair: a is known and bound there; the ghost alone disagrees.
    v.apply_pod(&pod("a", 300, Some(("n1", assignment("n1", &[("main", &[(0, 300)])]))), "Running"));
    let found = v.retain_pods(&HashSet::from(["uid-a".to_owned()]));
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("ghost"), "{found:?}");
    assert_eq!(v.disagreements(), 1);
    // From then on every new report is compared as it comes, and a relist compares nothing anew.
    let n1 = node("n1", 1, 1000, 3, vec![holding("a", "main", 0, 300), holding("ghost2", "main", 0, 100)]);
    assert_eq!(v.apply_node(&n1).len(), 1);
    assert!(v.retain_pods(&HashSet::from(["uid-a".to_owned()])).is_empty());
    assert_eq!(v.disagreements(), 2);
}

/// `node`'s state hashed and decoded, as the watch reads a changed one.
fn decoded(node: &NodeObject) -> NodeReading {
    let mut reading = NodeReading::hashed(node);
    reading.decode(node);
    reading
}

#[test]
fn a_node_state_read_before_the_lock_applies_as_one_read_under_it() {
    let mut v = ClusterView::new(config(false));
    let first = node("n1", 2, 1000, 1, vec![]);
    assert!(!v.holds_state(&first, &NodeReading::hashed(&first)), "a node the view has never seen");
    v.apply_reading(&first, decoded(&first));
    assert!(v.holds_state(&first, &NodeReading::hashed(&first)), "the same state again decodes nothing");
    // Changed, and only hashed (as if the watch had not decoded it): the view decodes it itself.
    let second = node("n1", 2, 1000, 2, vec![holding("a", "main", 1, 300)]);
    let reading = NodeReading::hashed(&second);
    assert!(!v.holds_state(&second, &reading));
    v.apply_reading(&second, reading);
    assert_eq!(used(&mut v, "n1"), [0, 300]);
    // Decoded before the lock, as the watch does: the same as applying the node.
    let third = node("n1", 2, 1000, 3, vec![holding("a", "main", 1, 300), holding("b", "main", 0, 200)]);
    v.apply_reading(&third, decoded(&third));
    assert_eq!(used(&mut v, "n1"), [200, 300]);
    let mut w = ClusterView::new(config(false));
    for n in [&first, &second, &third] {
        w.apply_node(n);
    }
    assert_eq!(used(&mut w, "n1"), used(&mut v, "n1"));
    // A full list read the same way replaces the nodes as replace_nodes does.
    let gone = node("n2", 1, 1000, 1, vec![]);
    v.apply_node(&gone);
    v.replace_read_nodes([(&third, decoded(&third))]);
    assert!(v.usage("n2").is_err(), "a node the list no longer has is gone");
    assert_eq!(used(&mut v, "n1"), [200, 300]);
}

#[test]
fn a_status_change_keeps_the_nodes_usage_cached_and_a_finish_recounts_it() {
    let mut v = ClusterView::new(config(false));
    v.apply_node(&node("n1", 1, 1000, 1, vec![]));
    let a = assignment("n1", &[("main", &[(0, 300)])]);
    v.apply_pod(&pod("a", 300, Some(("n1", a.clone())), "Pending"));
    v.refresh();
    assert!(v.node("n1").unwrap().cache.is_some());
    // The kubelet starts it: nothing the view counts changed, so nothing is recounted.
    v.apply_pod(&pod("a", 300, Some(("n1", a.clone())), "Running"));
    assert!(v.node("n1").unwrap().cache.is_some(), "a status change recounted the node");
    assert_eq!(used(&mut v, "n1"), [300]);
    // It finishes: its memory is free again.
    v.apply_pod(&pod("a", 300, Some(("n1", a)), "Succeeded"));
    assert!(v.node("n1").unwrap().cache.is_none());
    assert_eq!(used(&mut v, "n1"), [0]);
    assert!(v.summaries_in_step());
}
