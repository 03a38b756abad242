//! Tests of the verbs over the in-memory cluster fake: the filter's two failure maps, both
//! node forms, binds that are atomic, serialized, idempotent and rolled back, and preemption
//! that frees a GPU with the fewest, lowest-priority victims.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};

use super::fake::FakeCluster;
use super::*;
use crate::metrics::BindOutcome;
use crate::view::tests::{assignment, config, holding, node, pod};
use crate::wire::{BindingArgs, MetaPod, PreemptionArgs};
use crate::wire::{MetaVictims, Name, NodeList};

fn extender(nodes: &[crate::objects::NodeObject], pods: &[PodObject]) -> Arc<Extender<FakeCluster>> {
    waiting_extender(nodes, pods, Duration::ZERO)
}

/// An extender whose binds wait up to `wait` for a look-alike's admission to be reported.
fn waiting_extender(
    nodes: &[crate::objects::NodeObject],
    pods: &[PodObject],
    wait: Duration,
) -> Arc<Extender<FakeCluster>> {
    let cluster = FakeCluster::default();
    let mut view = ClusterView::new(config(false));
    for n in nodes {
        view.apply_node(n);
    }
    for p in pods {
        view.apply_pod(p);
        cluster.put(p.clone());
    }
    let ext = Arc::new(Extender::new(view, cluster, Policies::default()).with_lookalike_wait(wait));
    ext.set_ready(true);
    ext
}

fn args<'a>(pod: &PodObject, nodes: &[&'a str]) -> ExtenderArgs<'a> {
    ExtenderArgs { pod: pod.clone(), nodes: None, node_names: Some(nodes.iter().map(|n| Name::from(*n)).collect()) }
}

fn bind_args(pod: &str, node: &str) -> BindingArgs {
    BindingArgs {
        pod_name: pod.into(),
        pod_namespace: "default".into(),
        pod_uid: format!("uid-{pod}"),
        node: node.into(),
    }
}

#[test]
fn filter_sorts_nodes_into_fit_preemptable_and_hopeless() {
    let cpu: crate::objects::NodeObject = serde_json::from_value(json!({"metadata": {"name": "cpu"}})).unwrap();
    let full = pod("full", 900, Some(("busy", assignment("busy", &[("main", &[(0, 900)])]))), "Running");
    let ext = extender(
        &[node("free", 1, 1000, 1, vec![]), node("busy", 1, 1000, 1, vec![]), node("small", 1, 100, 1, vec![]), cpu],
        &[full],
    );
    let want = pod("want", 500, None, "Pending");
    let a = args(&want, &["free", "busy", "small", "cpu", "ghost"]);
    let r = ext.filter(&a);
    assert_eq!(r.node_names.as_deref(), Some(&[Name::from("free")][..]));
    assert_eq!(r.failed_nodes.keys().collect::<Vec<_>>(), ["busy"]);
    assert!(r.failed_nodes["busy"].contains("100 of 1000 MiB free"), "{:?}", r.failed_nodes);
    assert_eq!(r.failed_and_unresolvable.keys().collect::<Vec<_>>(), ["cpu", "ghost", "small"]);
    assert!(r.error.is_empty());
    // nodeCacheCapable: false — the passing Node objects go back as they came.
    let items = vec![json!({"metadata": {"name": "free"}, "extra": 1}), json!({"metadata": {"name": "busy"}})];
    let a = ExtenderArgs { pod: want.clone(), nodes: Some(NodeList { items }), node_names: None };
    let r = ext.filter(&a);
    assert_eq!(r.nodes.unwrap().items, [json!({"metadata": {"name": "free"}, "extra": 1})]);
    assert!(r.node_names.is_none());
    // An invalid request fails every node, unresolvably, with the reason.
    let mut bad = want.clone();
    bad.spec.containers[0]
        .resources
        .limits
        .insert("gpushare.io/gpu-mem".into(), gpushare_core::request::QuantityText("lots".into()));
    let a = args(&bad, &["free"]);
    let r = ext.filter(&a);
    assert!(r.failed_and_unresolvable["free"].contains("lots"), "{r:?}");
    // Before the view has synced: an error the scheduler retries.
    ext.set_ready(false);
    assert!(ext.filter(&args(&want, &["free"])).error.contains("not synced"));
}

#[test]
fn prioritize_prefers_the_fuller_node_under_binpack() {
    let p = pod("p", 500, Some(("half", assignment("half", &[("main", &[(0, 500)])]))), "Running");
    let ext = extender(&[node("empty", 1, 1000, 1, vec![]), node("half", 1, 1000, 1, vec![])], &[p]);
    let a = args(&pod("q", 400, None, "Pending"), &["empty", "half", "ghost"]);
    let scores = ext.prioritize(&a);
    let get = |h: &str| scores.iter().find(|s| s.host.as_str() == h).unwrap().score;
    assert!(get("half") > get("empty"), "{scores:?}");
    assert_eq!(get("ghost"), 0);
    assert!(scores.iter().all(|s| (0..=10).contains(&s.score)));
}

#[tokio::test]
async fn bind_creates_one_binding_with_the_assignment_and_is_idempotent() {
    let p = pod("p", 300, None, "Pending");
    let ext = extender(&[node("n1", 2, 1000, 1, vec![])], &[p]);
    let r = ext.bind(&bind_args("p", "n1")).await;
    assert_eq!(r.error, "");
    let bindings = ext.cluster.bindings();
    assert_eq!(bindings.len(), 1);
    let a = Assignment::decode(&bindings[0].annotations[ASSIGNMENT_KEY]).unwrap();
    assert_eq!(a.node, "n1");
    assert_eq!(a.containers[0].gpus.len(), 1);
    assert_eq!(bindings[0].uid, "uid-p");
    // Counted while the watch has not shown it.
    assert_eq!(ext.report().nodes[0].gpus.iter().map(|g| g.used_mib).sum::<u64>(), 300);
    // A retry of the same bind succeeds without a second Binding.
    assert_eq!(ext.bind(&bind_args("p", "n1")).await.error, "");
    assert_eq!(ext.cluster.bindings().len(), 1);
    // The watch shows it bound; a retry still succeeds; binding elsewhere does not.
    let bound = ext.cluster.pod("default", "p").unwrap();
    ext.with_view(|v| v.apply_pod(&bound));
    assert_eq!(ext.bind(&bind_args("p", "n1")).await.error, "");
    assert!(ext.bind(&bind_args("p", "n2")).await.error.contains("already bound to n1"));
    assert_eq!(ext.metrics().binds(BindOutcome::Bound), 3);
}

#[tokio::test]
async fn a_failed_binding_rolls_back_and_a_lost_reply_is_recognized() {
    let ext =
        extender(&[node("n1", 1, 1000, 1, vec![])], &[pod("p", 600, None, "Pending"), pod("q", 600, None, "Pending")]);
    ext.cluster.fail_next(ClusterError::Failed("connection reset".into()));
    let r = ext.bind(&bind_args("p", "n1")).await;
    assert!(r.error.contains("connection reset"), "{r:?}");
    assert_eq!(ext.report().nodes[0].gpus[0].used_mib, 0, "the assumption is rolled back");
    // The API server applied a binding but the reply was lost: the retry's 409 is recognized.
    assert_eq!(ext.bind(&bind_args("q", "n1")).await.error, "");
    ext.with_view(|v| v.forget("uid-q"));
    let r = ext.bind(&bind_args("q", "n1")).await;
    assert_eq!(r.error, "", "{r:?}");
    assert_eq!(ext.metrics().binds(BindOutcome::Failed), 1);
}

#[tokio::test]
async fn concurrent_binds_to_one_node_never_overcommit() {
    let pods: Vec<PodObject> = (0..12).map(|i| pod(&format!("p{i}"), 250, None, "Pending")).collect();
    let ext = extender(&[node("n1", 2, 1000, 1, vec![])], &pods);
    let race = |names: Vec<String>| {
        let tasks: Vec<_> = names
            .into_iter()
            .map(|n| {
                let ext = ext.clone();
                tokio::spawn(async move { (n.clone(), ext.bind(&bind_args(&n, "n1")).await) })
            })
            .collect();
        async move {
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        }
    };
    // Binpack fills GPU0 with four; the others would go to GPU1 while those four, which look
    // the same to the kubelet, are not admitted yet: deferred.
    let first = race((0..12).map(|i| format!("p{i}")).collect()).await;
    let bound: Vec<&str> = first.iter().filter(|(_, r)| r.error.is_empty()).map(|(n, _)| n.as_str()).collect();
    assert_eq!(bound.len(), 4, "{first:?}");
    for (_, r) in first.iter().filter(|(_, r)| !r.error.is_empty()) {
        assert!(r.error.contains("is still admitting pod default/p"), "{r:?}");
    }
    assert_eq!(ext.metrics().binds(BindOutcome::Deferred), 8);
    // The daemon reports them allocated: the rest race again, and only what fits is bound.
    let held = bound.iter().map(|n| holding(n, "main", 0, 250)).collect();
    ext.with_view(|v| v.apply_node(&node("n1", 2, 1000, 2, held)));
    let rest: Vec<String> = first.iter().filter(|(_, r)| !r.error.is_empty()).map(|(n, _)| n.clone()).collect();
    let second = race(rest).await;
    let ok = second.iter().filter(|(_, r)| r.error.is_empty()).count();
    for (_, r) in second.iter().filter(|(_, r)| !r.error.is_empty()) {
        assert!(r.error.contains("no longer fits"), "{r:?}");
    }
    assert_eq!(ok, 4);
    let report = ext.report();
    assert!(report.nodes[0].gpus.iter().all(|g| g.used_mib <= g.total_mib));
    assert_eq!(report.nodes[0].gpus.iter().map(|g| g.used_mib).sum::<u64>(), 2000);
    assert_eq!(ext.metrics().binds(BindOutcome::NoFit), 4);
}

/// Node n1 (2 GPUs of 1000 MiB) with GPU0 full of four 250-MiB look-alikes p0..p3, bound but
/// not yet reported admitted; p4 (the same size) and q (100 MiB) are pending.
async fn gpu0_full_of_lookalikes(wait: Duration) -> Arc<Extender<FakeCluster>> {
    let mut pods: Vec<PodObject> = (0..5).map(|i| pod(&format!("p{i}"), 250, None, "Pending")).collect();
    pods.push(pod("q", 100, None, "Pending"));
    let ext = waiting_extender(&[node("n1", 2, 1000, 1, vec![])], &pods, wait);
    for i in 0..4 {
        assert_eq!(ext.bind(&bind_args(&format!("p{i}"), "n1")).await.error, "");
    }
    ext
}

#[tokio::test]
async fn a_look_alike_bind_waits_for_the_node_to_report_the_other_admitted() {
    let ext = gpu0_full_of_lookalikes(Duration::from_secs(2)).await;
    // p4 would get GPU1 while its look-alikes are in admission: it waits, and the node stays
    // free for other binds meanwhile (q, another size, is bound on GPU1 at once).
    let started = Instant::now();
    let waiting = tokio::spawn({
        let ext = ext.clone();
        async move { ext.bind(&bind_args("p4", "n1")).await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(!waiting.is_finished(), "the bind waits for the look-alikes' admission");
    assert_eq!(ext.cluster.bindings().len(), 4);
    let q = tokio::time::timeout(Duration::from_millis(500), ext.bind(&bind_args("q", "n1"))).await.unwrap();
    assert_eq!(q.error, "", "another bind to the node goes through while p4 waits: {q:?}");
    assert!(!waiting.is_finished());
    // The daemon reports them allocated: p4 is bound at once, on GPU1.
    let held = (0..4).map(|i| holding(&format!("p{i}"), "main", 0, 250)).collect();
    ext.with_view(|v| v.apply_node(&node("n1", 2, 1000, 2, held)));
    let r = tokio::time::timeout(Duration::from_secs(1), waiting).await.unwrap().unwrap();
    assert_eq!(r.error, "", "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "bound when the report came, not at the deadline");
    assert_eq!(ext.metrics().binds(BindOutcome::Deferred), 0);
    assert_eq!(ext.metrics().binds(BindOutcome::Bound), 6);
    let report = ext.report();
    assert_eq!(report.nodes[0].gpus.iter().map(|g| g.used_mib).collect::<Vec<_>>(), [1000, 350]);
}

#[tokio::test]
async fn a_look_alike_bind_is_refused_when_no_report_comes_in_time() {
    let ext = gpu0_full_of_lookalikes(Duration::from_millis(200)).await;
    let started = Instant::now();
    // A change elsewhere in the view wakes the bind, which finds the look-alikes still admitting.
    let other = tokio::spawn({
        let ext = ext.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            ext.with_view(|v| v.apply_node(&node("n2", 1, 1000, 1, vec![])));
        }
    });
    let r = ext.bind(&bind_args("p4", "n1")).await;
    other.await.unwrap();
    assert!(r.error.contains("is still admitting pod default/p"), "{r:?}");
    assert!(started.elapsed() >= Duration::from_millis(200), "refused only after the wait");
    assert_eq!(ext.metrics().binds(BindOutcome::Deferred), 1);
    assert_eq!(ext.cluster.bindings().len(), 4, "nothing bound, the assumption not kept");
    assert_eq!(ext.report().nodes.iter().find(|n| n.name == "n1").unwrap().gpus[1].used_mib, 0);
}

#[tokio::test]
async fn a_look_alike_on_the_same_gpu_is_not_held_back() {
    let ext = extender(
        &[node("n1", 2, 1000, 1, vec![])],
        &[pod("a", 300, None, "Pending"), pod("b", 300, None, "Pending"), pod("c", 200, None, "Pending")],
    );
    assert_eq!(ext.bind(&bind_args("a", "n1")).await.error, "");
    // Same size, same GPU (binpack): whichever the daemon serves first gets what it was assigned.
    assert_eq!(ext.bind(&bind_args("b", "n1")).await.error, "");
    // Another size is told apart by the kubelet's request.
    assert_eq!(ext.bind(&bind_args("c", "n1")).await.error, "");
    assert_eq!(ext.metrics().binds(BindOutcome::Deferred), 0);
}

#[tokio::test]
async fn bind_refuses_clearly() {
    let ext = extender(&[node("n1", 1, 1000, 1, vec![])], &[pod("big", 2000, None, "Pending")]);
    assert!(ext.bind(&bind_args("big", "n1")).await.error.contains("no longer fits node n1"));
    assert!(ext.bind(&bind_args("absent", "n1")).await.error.contains("does not exist"));
    let mut wrong = bind_args("big", "n1");
    wrong.pod_uid = "other".into();
    ext.with_view(|v| v.delete_pod("uid-big"));
    assert!(ext.bind(&wrong).await.error.contains("re-created"));
    assert!(ext.cluster.bindings().is_empty());
}

/// Whoever reaches the bind route gets only what kube-scheduler would ask: a pod of another
/// scheduler, a pod that asks for none of our resources, and a node that is not ours are each
/// refused, and nothing is bound.
#[tokio::test]
async fn bind_refuses_what_kube_scheduler_would_never_send() {
    let mut plain = pod("plain", 0, None, "Pending");
    plain.spec.containers[0].resources = Default::default();
    let mut theirs = pod("theirs", 500, None, "Pending");
    theirs.spec.scheduler_name = "other-scheduler".into();
    let ours = pod("ours", 500, None, "Pending");
    let ext = extender(&[node("n1", 1, 1000, 1, vec![])], &[plain, theirs, ours]);
    let e = ext.bind(&bind_args("plain", "n1")).await.error;
    assert!(e.contains("asks for no GPU memory"), "{e}");
    let e = ext.bind(&bind_args("theirs", "n1")).await.error;
    assert!(e.contains("placed by scheduler \"other-scheduler\"") && e.contains("scheduler_names"), "{e}");
    let e = ext.bind(&bind_args("ours", "nowhere")).await.error;
    assert!(e.contains("nowhere"), "{e}");
    assert!(ext.cluster.bindings().is_empty(), "{:?}", ext.cluster.bindings());
    assert_eq!(ext.metrics().binds(BindOutcome::Invalid), 2);

    // A profile named in the configuration is served.
    let mut theirs = pod("theirs", 500, None, "Pending");
    theirs.spec.scheduler_name = "gpu-scheduler".into();
    let (mut view, cluster) = (ClusterView::new(config(false)), FakeCluster::default());
    view.apply_node(&node("n1", 1, 1000, 1, vec![]));
    view.apply_pod(&theirs);
    cluster.put(theirs);
    let names = vec!["default-scheduler".into(), "gpu-scheduler".into()];
    let ext = Extender::new(view, cluster, Policies::default()).with_scheduler_names(names);
    ext.set_ready(true);
    assert_eq!(ext.bind(&bind_args("theirs", "n1")).await.error, "");
}

#[test]
fn preemption_keeps_the_schedulers_victims_and_adds_what_the_gpus_need() {
    let on = |name: &str, gpu: u32, mib: u64, prio: i32| {
        let mut p = pod(name, mib, Some(("n1", assignment("n1", &[("main", &[(gpu, mib)])]))), "Running");
        p.spec.priority = Some(prio);
        p
    };
    // n1, GPUs of 1000: GPU0 a (400, prio 1), b (400, prio 5); GPU1 c (700, prio 0), d (300, prio 0).
    // n2: its one GPU full with x, a pod the view does not know. n3: empty.
    let pods = [on("a", 0, 400, 1), on("b", 0, 400, 5), on("c", 1, 700, 0), on("d", 1, 300, 0)];
    let ext = extender(
        &[
            node("n1", 2, 1000, 1, vec![]),
            node("n2", 1, 1000, 1, vec![holding("x", "main", 0, 1000)]),
            node("n3", 1, 1000, 1, vec![]),
        ],
        &pods,
    );
    let want = |prio: i32| {
        let mut p = pod("want", 600, None, "Pending");
        p.spec.priority = Some(prio);
        p
    };
    let meta = |uids: &[&str], pdb: i64| MetaVictims {
        pods: uids.iter().map(|u| MetaPod { uid: (*u).into() }).collect(),
        num_pdb_violations: pdb,
    };
    let preempt = |pod: PodObject, nodes: &[(&str, MetaVictims)]| {
        let args = PreemptionArgs {
            pod,
            node_name_to_victims: None,
            node_name_to_meta_victims: Some(nodes.iter().map(|(n, v)| ((*n).to_owned(), v.clone())).collect()),
        };
        ext.preempt(&args)
            .node_name_to_meta_victims
            .into_iter()
            .map(|(n, v)| (n, (v.pods.into_iter().map(|p| p.uid).collect::<Vec<_>>(), v.num_pdb_violations)))
            .collect::<BTreeMap<_, _>>()
    };
    let uids = |u: &[&str]| u.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();

    // A victim kube-scheduler chose for CPU holds no GPU memory: it stays, and c (the largest
    // of the lowest priority) is added for GPU1. A negative PDB count is not echoed.
    let r = preempt(want(10), &[("n1", meta(&["uid-cpu"], -3)), ("n2", meta(&[], 0)), ("n3", meta(&[], 0))]);
    assert_eq!(r["n1"], (uids(&["uid-cpu", "uid-c"]), 0));
    // n2 (no lower-priority pod the view knows) and n3 (no victim needed) are left out, never
    // answered with an empty list.
    assert_eq!(r.len(), 1, "{r:?}");

    // kube-scheduler's victims make room already: all kept, nothing added, in decreasing
    // priority however they came; the PDB count is at most the number of victims.
    let r = preempt(want(10), &[("n1", meta(&["uid-d", "uid-a"], 5))]);
    assert_eq!(r["n1"], (uids(&["uid-a", "uid-d"]), 2));

    // Only pods of lower priority than the preemptor are added: at priority 1, c or d; at 0, none.
    assert_eq!(preempt(want(1), &[("n1", meta(&[], 0))])["n1"], (uids(&["uid-c"]), 0));
    assert!(preempt(want(0), &[("n1", meta(&[], 0))]).is_empty());

    // The full-pod form reads priorities from the pods themselves.
    let args = PreemptionArgs {
        pod: want(10),
        node_name_to_victims: Some(BTreeMap::from([(
            "n1".to_owned(),
            crate::wire::Victims { pods: vec![pods[3].clone(), pods[1].clone()], num_pdb_violations: 0 },
        )])),
        node_name_to_meta_victims: None,
    };
    let r = ext.preempt(&args);
    let got: Vec<&str> = r.node_name_to_meta_victims["n1"].pods.iter().map(|p| p.uid.as_str()).collect();
    assert_eq!(got, ["uid-b", "uid-d"]);
}

#[tokio::test]
async fn filter_steers_a_look_alike_away_from_a_node_still_admitting_one() {
    let ext = extender(
        &[node("n1", 2, 1000, 1, vec![]), node("n2", 2, 1000, 1, vec![])],
        &[pod("a", 600, None, "Pending"), pod("b", 600, None, "Pending")],
    );
    assert_eq!(ext.bind(&bind_args("a", "n1")).await.error, "");
    // On n1, b would land on GPU1 while a, on GPU0, is not admitted yet: n1 is no choice now.
    let b = pod("b", 600, None, "Pending");
    let a = args(&b, &["n1", "n2"]);
    let r = ext.filter(&a);
    assert_eq!(r.node_names.as_deref(), Some(&[Name::from("n2")][..]));
    assert!(r.failed_nodes["n1"].contains("still admitting pod default/a"), "{r:?}");
    // n1's daemon reports a allocated: n1 takes b again.
    ext.with_view(|v| v.apply_node(&node("n1", 2, 1000, 2, vec![holding("a", "main", 0, 600)])));
    let r = ext.filter(&a);
    assert_eq!(r.node_names.as_deref().map(<[Name<'_>]>::len), Some(2), "{r:?}");
}

#[tokio::test]
async fn a_node_that_tells_look_alikes_apart_takes_them_at_once() {
    let n1 = crate::view::tests::node_telling("n1", 2, 1000, 1, vec![], true);
    let ext = extender(
        &[n1, node("n2", 2, 1000, 1, vec![])],
        &[pod("a", 600, None, "Pending"), pod("b", 600, None, "Pending")],
    );
    assert_eq!(ext.bind(&bind_args("a", "n1")).await.error, "");
    // a, on one GPU, is not admitted yet; b fits only on the other. n1's daemon asks the
    // kubelet which pod each call is for, so b may go there now.
    let b = pod("b", 600, None, "Pending");
    let a = args(&b, &["n1", "n2"]);
    let r = ext.filter(&a);
    assert_eq!(r.node_names.as_deref().map(<[Name<'_>]>::len), Some(2), "{r:?}");
    assert_eq!(ext.bind(&bind_args("b", "n1")).await.error, "");
    assert_eq!(ext.metrics().binds(BindOutcome::Deferred), 0);
}

#[tokio::test]
async fn a_look_alike_goes_beside_the_one_in_admission_when_there_is_room() {
    let ext =
        extender(&[node("n1", 2, 1000, 1, vec![])], &[pod("a", 200, None, "Pending"), pod("b", 200, None, "Pending")]);
    assert_eq!(ext.bind(&bind_args("a", "n1")).await.error, "");
    let gpu_of = |uid: &str| ext.with_view(|v| v.assumption(uid).map(|a| a.assignment.containers[0].gpus[0].index));
    let a_gpu = gpu_of("uid-a").unwrap();
    // Another pod fills the other GPU: binpack alone would now put b there, apart from a.
    let other = 1 - a_gpu;
    ext.with_view(|v| v.apply_node(&node("n1", 2, 1000, 2, vec![holding("y", "main", other, 700)])));
    assert_eq!(ext.bind(&bind_args("b", "n1")).await.error, "");
    assert_eq!(gpu_of("uid-b"), Some(a_gpu), "b goes beside a, so either may be served first");
    assert_eq!(ext.metrics().binds(BindOutcome::Deferred), 0);
}

#[test]
fn prioritize_weighs_gpu_activity_only_when_configured() {
    // Two empty one-GPU nodes; the daemon of "hot" reports its GPU 90 % busy.
    let busy = |name: &str, util: Option<u8>| {
        let mut g =
            gpushare_core::Gpu::new(0, crate::view::tests::uuid(name, 0), "Tesla T4", gpushare_core::Mib::new(1000));
        g.activity =
            util.map(|u| gpushare_core::Activity { utilization: Some(u), in_use: gpushare_core::Mib::new(100) });
        let inventory = gpushare_core::NodeInventory::new(gpushare_core::MemoryUnit::Mib, vec![g]).unwrap();
        let state = gpushare_core::codec::node::NodeState {
            generation: 1,
            daemon_version: "0.1.0".into(),
            inventory,
            used: vec![gpushare_core::Mib::ZERO],
            allocations: vec![],
            claims: vec![],
            over_budget: vec![],
            tells_lookalikes_apart: false,
        };
        serde_json::from_value::<crate::objects::NodeObject>(json!({
            "metadata": {"name": name, "annotations": {gpushare_core::codec::node::NODE_STATE_KEY: state.encode().unwrap()}}
        }))
        .unwrap()
    };
    let nodes = [busy("hot", Some(90)), busy("cool", Some(5)), busy("unsampled", None)];
    let want = pod("q", 400, None, "Pending");
    let a = args(&want, &["hot", "cool", "unsampled"]);
    let score =
        |ext: &Extender<FakeCluster>, h: &str| ext.prioritize(&a).iter().find(|s| s.host.as_str() == h).unwrap().score;

    // Off by default: activity changes nothing.
    let plain = extender(&nodes, &[]);
    assert_eq!(score(&plain, "hot"), score(&plain, "cool"));
    // The inspect report shows what the daemons published.
    let report = plain.report();
    let gpu = |n: &str| report.nodes.iter().find(|x| x.name == n).unwrap().gpus[0].clone();
    assert_eq!(
        (gpu("hot").mode.as_str(), gpu("hot").util_percent, gpu("hot").in_use_mib),
        ("shared", Some(90), Some(100))
    );
    assert_eq!((gpu("unsampled").util_percent, gpu("unsampled").in_use_mib), (None, None));

    // Half the score from idleness: base 4 (400 of 1000 MiB after placement, binpack).
    let ext = Arc::new(Arc::try_unwrap(extender(&nodes, &[])).unwrap().with_busy_weight(50));
    assert_eq!(score(&ext, "hot"), 3, "(4 + 1) / 2, rounded up");
    assert_eq!(score(&ext, "cool"), 7, "(4 + 9.5) / 2, rounded");
    assert_eq!(score(&ext, "unsampled"), 7, "no sample counts as idle");
    // All of it: only idleness counts.
    let all = Arc::new(Arc::try_unwrap(extender(&nodes, &[])).unwrap().with_busy_weight(100));
    assert_eq!((score(&all, "hot"), score(&all, "cool")), (1, 10));
}
