//! The extender against the API-server stand-in over time: hundreds of binds racing into one
//! node, a restart that rebuilds the same view, and a cluster switching over from Alibaba's
//! extender with its pods still running.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

use gpushare_core::Mib;
use gpushare_core::codec::alibaba;
use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeAllocation, NodeState, PodRef, used_per_gpu};
use serde_json::{Value, json};

mod common;
use common::{http, node_object, pod_object, start, start_with, until};

fn bind_body(pod: &Value, node: &str) -> String {
    json!({"PodName": pod["metadata"]["name"], "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": node})
        .to_string()
}

/// Plays gpu-a's daemon: publishes every assigned pod as allocated, as it would once the
/// kubelet admitted them.
fn publish_allocations(api: &gpushare_testkit::apiserver::ApiServer, generation: u64) -> usize {
    let mut state =
        NodeState::decode(api.node("gpu-a").unwrap()["metadata"]["annotations"][NODE_STATE_KEY].as_str().unwrap())
            .unwrap();
    state.allocations.clear();
    for p in api.list(gpushare_testkit::apiserver::Kind::Pod) {
        let Some(a) = p.pointer(&format!("/metadata/annotations/{}", ASSIGNMENT_KEY.replace('/', "~1"))) else {
            continue;
        };
        for c in Assignment::decode(a.as_str().unwrap()).unwrap().containers {
            for g in c.gpus {
                state.allocations.push(NodeAllocation {
                    pod: PodRef {
                        namespace: "default".into(),
                        name: p["metadata"]["name"].as_str().unwrap().into(),
                        uid: p["metadata"]["uid"].as_str().unwrap().into(),
                    },
                    container: c.name.clone(),
                    role: c.role,
                    gpu: g.index,
                    mib: g.mib,
                });
            }
        }
    }
    state.used = used_per_gpu(&state.inventory, &state.allocations, &state.claims);
    state.generation = generation;
    let n = state.allocations.len();
    api.patch(
        gpushare_testkit::apiserver::Kind::Node,
        "",
        "gpu-a",
        &json!({"metadata": {"annotations": {NODE_STATE_KEY: state.encode().unwrap()}}}),
    )
    .unwrap();
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_racing_binds_into_one_node_never_overcommit() {
    let h = start(1 << 20).await;
    // 4 GPUs of 16 GiB take 64 pods of 1 GiB; 300 race for them.
    h.api.create_node(node_object("gpu-a", 4, 16_384)).unwrap();
    let pods: Vec<Value> =
        (0..300).map(|i| h.api.create_pod("default", pod_object(&format!("p{i:03}"), 1024)).unwrap()).collect();
    until("ready with every pod", async || {
        h.ext.is_ready() && h.ext.with_view(|v| v.counts().0 == 1 && v.counts().1 == 300)
    })
    .await;
    let addr = h.addr;
    let (mut bound, mut refused) = (0, 0);
    let mut waiting: Vec<&Value> = pods.iter().collect();
    // Rounds: all race; look-alikes that would land on another GPU while the first ones are
    // still being admitted are deferred; then the "daemon" reports what it allocated.
    for round in 1..=10 {
        let tasks: Vec<_> = waiting
            .iter()
            .map(|p| {
                let body = bind_body(p, "gpu-a");
                tokio::spawn(async move { http(addr, "POST", "/gpushare-scheduler/bind", &body).await })
            })
            .collect();
        let mut deferred = Vec::new();
        for (t, p) in tasks.into_iter().zip(&waiting) {
            let (status, body) = t.await.unwrap();
            assert_eq!(status, 200, "{body}");
            let error = serde_json::from_str::<Value>(&body).unwrap()["Error"].as_str().unwrap().to_owned();
            if error.is_empty() {
                bound += 1;
            } else if error.contains("is still admitting") {
                deferred.push(*p);
            } else {
                assert!(error.contains("no longer fits node gpu-a"), "{error}");
                refused += 1;
            }
        }
        waiting = deferred;
        if waiting.is_empty() {
            break;
        }
        until("the binds in the view", async || h.ext.with_view(|v| v.counts().2) == 0).await;
        let n = publish_allocations(&h.api, 1 + round);
        until("the daemon's report in the view", async || {
            h.ext.report().nodes[0].gpus.iter().map(|g| g.used_mib).sum::<u64>() == n as u64 * 1024
        })
        .await;
    }
    assert!(waiting.is_empty(), "{} still deferred after 10 rounds", waiting.len());
    assert_eq!((bound, refused), (64, 236));
    // What the API server holds: per GPU, never more than its 16 384 MiB.
    let mut per_gpu: BTreeMap<String, u64> = BTreeMap::new();
    let mut on_node = 0;
    for p in h.api.list(gpushare_testkit::apiserver::Kind::Pod) {
        let Some(a) = p.pointer(&format!("/metadata/annotations/{}", ASSIGNMENT_KEY.replace('/', "~1"))) else {
            continue;
        };
        assert_eq!(p["spec"]["nodeName"], "gpu-a");
        on_node += 1;
        for (uuid, mib) in Assignment::decode(a.as_str().unwrap()).unwrap().footprint() {
            *per_gpu.entry(uuid.to_string()).or_default() += mib.get();
        }
    }
    assert_eq!(on_node, 64);
    assert_eq!(per_gpu.len(), 4);
    assert!(per_gpu.values().all(|m| *m == 16_384), "{per_gpu:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_extender_rebuilds_the_same_view() {
    let mut h = start(1 << 20).await;
    h.api.create_node(node_object("gpu-a", 2, 15_360)).unwrap();
    h.api.create_node(node_object("gpu-b", 1, 15_360)).unwrap();
    let pods: Vec<Value> = [3000, 5000, 7000, 1000, 2500]
        .iter()
        .enumerate()
        .map(|(i, mib)| h.api.create_pod("default", pod_object(&format!("p{i}"), *mib)).unwrap())
        .collect();
    until("ready", async || h.ext.is_ready() && h.ext.with_view(|v| v.counts().0 == 2 && v.counts().1 == 5)).await;
    for (i, p) in pods.iter().enumerate() {
        let node = if i % 2 == 0 { "gpu-a" } else { "gpu-b" };
        let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/bind", &bind_body(p, node)).await;
        assert_eq!(body, r#"{"Error":""}"#);
    }
    until("no bind in flight", async || h.ext.with_view(|v| v.counts().2) == 0).await;
    let before = h.ext.report();
    assert_eq!(before.nodes.iter().flat_map(|n| &n.gpus).map(|g| g.used_mib).sum::<u64>(), 18_500);
    h.restart(false).await;
    until("the new extender ready", async || {
        h.ext.is_ready() && h.ext.with_view(|v| v.counts().0 == 2 && v.counts().1 == 5)
    })
    .await;
    assert_eq!(h.ext.report(), before);
    // And it answers the same: the 15 360 MiB GPU of gpu-b with 6 000 used takes 9 000 more, not 10 000.
    let q = h.api.create_pod("default", pod_object("q", 10_000)).unwrap();
    until("q", async || h.ext.with_view(|v| v.counts().1) == 6).await;
    let filter = json!({"Pod": q, "Nodes": null, "NodeNames": ["gpu-b"]}).to_string();
    let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/filter", &filter).await;
    let result: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(result["NodeNames"], json!([]), "{body}");
    assert!(result["FailedNodes"]["gpu-b"].as_str().unwrap().contains("9360 of 15360 MiB free"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_switches_over_from_alibabas_extender() {
    let h = start_with(true, 1 << 20).await;
    h.api.create_node(node_object("gpu-a", 2, 15_360)).unwrap();
    // Running pods Alibaba's extender placed: GPU 1 (minor 1) holds 14 000 MiB.
    let mut old = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "legacy", "namespace": "default",
                     "annotations": {alibaba::IDX: "1", alibaba::POD: "14000", alibaba::DEV: "15360",
                                     alibaba::ASSIGNED: "true", alibaba::ASSUME_TIME: "1700000000000000000"}},
        "spec": {"nodeName": "gpu-a", "containers": [{"name": "main", "image": "cuda",
                 "resources": {"limits": {alibaba::MEMORY_RESOURCE: "14000"}}}]},
        "status": {"phase": "Running"}
    });
    old = h.api.create_pod("default", old).unwrap();
    assert_eq!(old["spec"]["nodeName"], "gpu-a");
    // A new pod, unchanged workload YAML: Alibaba's resource name.
    let new = h
        .api
        .create_pod(
            "default",
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "fresh", "namespace": "default"},
                   "spec": {"containers": [{"name": "main", "image": "cuda",
                            "resources": {"limits": {alibaba::MEMORY_RESOURCE: "8000"}}}]}}),
        )
        .unwrap();
    until("ready", async || h.ext.is_ready() && h.ext.with_view(|v| v.counts().0 == 1 && v.counts().1 == 2)).await;
    let report = h.ext.report();
    assert_eq!(report.nodes[0].gpus[1].used_mib, 14_000, "Alibaba's pod is counted: {report:?}");
    let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/bind", &bind_body(&new, "gpu-a")).await;
    assert_eq!(body, r#"{"Error":""}"#);
    let stored = h.api.pod("default", "fresh").unwrap();
    let annotations = &stored["metadata"]["annotations"];
    let a = Assignment::decode(annotations[ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
    assert_eq!(a.containers[0].gpus[0].index, 0, "GPU 1 is Alibaba's pod's: only GPU 0 has room");
    // Alibaba's annotations too, for its device plugin and tools still in the cluster.
    assert_eq!(annotations[alibaba::IDX], "0");
    assert_eq!(annotations[alibaba::POD], "8000");
    assert_eq!(annotations[alibaba::ASSIGNED], "false");
}

/// A node whose daemon hands GPU1 out whole, serves GPU2 through DRA with one claim prepared,
/// and reports a container over its budget on GPU0: the extender places shares only on GPU0,
/// and the over-budget container and the claim reach the inspect view and the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_and_dra_gpus_take_no_share_and_their_holders_are_reported() {
    use gpushare_core::codec::node::{NodeClaim, OverBudget};
    use gpushare_core::dra::ClaimRef;
    use gpushare_core::{Gpu, GpuUuid, MemoryUnit, NodeInventory, SharingMode};

    let h = start(1024 * 1024).await;
    let gpus: Vec<Gpu> = (0..3)
        .map(|i| {
            let mut g = Gpu::new(i, GpuUuid::new(format!("GPU-w-{i}")).unwrap(), "A100", Mib::new(16_000));
            g.mode = [SharingMode::Shared, SharingMode::Whole, SharingMode::Dra][i as usize];
            g
        })
        .collect();
    let inventory = NodeInventory::new(MemoryUnit::Mib, gpus).unwrap();
    let claims = vec![NodeClaim {
        claim: ClaimRef { uid: "u-claim".into(), namespace: "ml".into(), name: "infer-gpu".into() },
        request: "gpu".into(),
        gpu: 2,
        mib: Mib::new(3500),
    }];
    let state = NodeState {
        generation: 1,
        daemon_version: "0.1.0".into(),
        used: used_per_gpu(&inventory, &[], &claims),
        inventory,
        allocations: vec![],
        claims,
        over_budget: vec![OverBudget {
            pod: PodRef { namespace: "ml".into(), name: "train".into(), uid: "u-train".into() },
            container: "main".into(),
            gpu: 0,
            in_use: Mib::new(5200),
            budget: Mib::new(4096),
            since_ms: 1_763_892_000_000,
        }],
        tells_lookalikes_apart: false,
    };
    h.api
        .create_node(json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "gpu-w", "annotations": {NODE_STATE_KEY: state.encode().unwrap()}}}))
        .unwrap();
    let one = h.api.create_pod("default", pod_object("one", 12_000)).unwrap();
    let mut two = pod_object("two", 16_000);
    two["spec"]["containers"][0]["resources"]["limits"]["gpushare.io/gpu-count"] = json!("2");
    let two = h.api.create_pod("default", two).unwrap();
    let uids =
        [one["metadata"]["uid"].as_str().unwrap().to_owned(), two["metadata"]["uid"].as_str().unwrap().to_owned()];
    until("the node and pods in the view", async || {
        h.ext.with_view(|v| v.inventory("gpu-w").is_ok() && uids.iter().all(|u| v.pod(u).is_some()))
    })
    .await;

    let filter = |pod: &Value| json!({"Pod": pod, "Nodes": null, "NodeNames": ["gpu-w"]}).to_string();
    let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/filter", &filter(&one)).await;
    let result: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(result["NodeNames"], json!(["gpu-w"]), "12 000 MiB fit GPU0: {body}");
    let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/filter", &filter(&two)).await;
    let result: Value = serde_json::from_str(&body).unwrap();
    let why = result["FailedAndUnresolvableNodes"]["gpu-w"].as_str().unwrap_or_else(|| panic!("{body}"));
    assert!(why.contains("needs 2 GPUs, node has 1 that take allocations"), "the whole GPU is no second GPU: {why}");
    let bind = json!({"PodName": "one", "PodNamespace": "default", "PodUID": uids[0], "Node": "gpu-w"}).to_string();
    assert_eq!(http(h.addr, "POST", "/gpushare-scheduler/bind", &bind).await.1, r#"{"Error":""}"#);
    let stored = h.api.pod("default", "one").unwrap();
    let a = Assignment::decode(stored["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
    assert_eq!(a.containers[0].gpus[0].index, 0, "never on the whole GPU");

    let (_, body) = http(h.observe, "GET", "/gpushare-scheduler/inspect/gpu-w", "").await;
    let report: Value = serde_json::from_str(&body).unwrap();
    let gpus = report["nodes"][0]["gpus"].as_array().unwrap();
    assert_eq!((gpus[1]["mode"].as_str(), gpus[1]["totalMiB"].as_u64()), (Some("whole"), Some(0)), "{body}");
    assert_eq!(
        gpus[0]["overBudget"],
        json!([{"pod": "ml/train", "container": "main", "inUseMiB": 5200, "budgetMiB": 4096}]),
        "{body}"
    );
    assert_eq!((gpus[2]["mode"].as_str(), gpus[2]["usedMiB"].as_u64()), (Some("dra"), Some(3500)), "{body}");
    assert_eq!(
        gpus[2]["claims"],
        json!([{"claim": "ml/infer-gpu", "uid": "u-claim", "request": "gpu", "mib": 3500}]),
        "{body}"
    );
    assert!(gpus[0].get("claims").is_none(), "{body}");
    let (_, metrics) = http(h.observe, "GET", "/metrics", "").await;
    assert!(
        metrics.contains("gpushare_gpu_containers_over_budget{node=\"gpu-w\",gpu=\"0\",uuid=\"GPU-w-0\"} 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "gpushare_container_gpu_memory_in_use_mib{node=\"gpu-w\",gpu=\"0\",namespace=\"ml\",pod=\"train\",container=\"main\"} 5200\n"
        ),
        "{metrics}"
    );
    assert!(metrics.contains("gpushare_gpu_schedulable{node=\"gpu-w\",gpu=\"1\",uuid=\"GPU-w-1\"} 0\n"), "{metrics}");
    for (name, value) in [
        ("gpushare_gpu_memory_used_mib", 3500),
        ("gpushare_gpu_memory_claimed_mib", 3500),
        ("gpushare_gpu_dra_claims", 1),
    ] {
        let line = format!("{name}{{node=\"gpu-w\",gpu=\"2\",uuid=\"GPU-w-2\"}} {value}\n");
        assert!(metrics.contains(&line), "{line}{metrics}");
    }
    assert!(metrics.contains("gpushare_gpu_dra_claims{node=\"gpu-w\",gpu=\"0\",uuid=\"GPU-w-0\"} 0\n"), "{metrics}");
}

/// A T4 holding one pod whose init container (10 000 MiB) ran before its app container
/// (8 000 MiB): the daemon publishes 10 000 used, and inspect, metrics and filter agree with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_init_container_is_not_added_to_the_app_containers() {
    let h = start(1 << 20).await;
    h.api.create_node(node_object("gpu-a", 1, 15_360)).unwrap();
    let limits = |mib: u64| json!({"limits": {"gpushare.io/gpu-mem": mib.to_string()}});
    let pod = h
        .api
        .create_pod(
            "default",
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "chat", "namespace": "default"},
                   "spec": {"initContainers": [{"name": "fetch", "image": "cuda", "resources": limits(10_000)}],
                            "containers": [{"name": "main", "image": "cuda", "resources": limits(8000)}]}}),
        )
        .unwrap();
    until("ready", async || h.ext.is_ready() && h.ext.with_view(|v| v.counts().0 == 1 && v.counts().1 == 1)).await;
    let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/bind", &bind_body(&pod, "gpu-a")).await;
    assert_eq!(body, r#"{"Error":""}"#);
    until("no bind in flight", async || h.ext.with_view(|v| v.counts().2) == 0).await;
    // The daemon's report, both rows with their roles: usedMiB 10 000.
    assert_eq!(publish_allocations(&h.api, 2), 2);
    let mut state =
        NodeState::decode(h.api.node("gpu-a").unwrap()["metadata"]["annotations"][NODE_STATE_KEY].as_str().unwrap())
            .unwrap();
    assert_eq!(state.used, vec![Mib::new(10_000)]);
    // A sample of NVML's in-use figure marks this publication, to wait for it in the view.
    let mut gpus = state.inventory.gpus().to_vec();
    gpus[0].activity = Some(gpushare_core::Activity { utilization: Some(5), in_use: Mib::new(9000) });
    state.inventory = gpushare_core::NodeInventory::new(state.inventory.unit(), gpus).unwrap();
    state.generation = 3;
    let value = state.encode().unwrap();
    h.api
        .patch(
            gpushare_testkit::apiserver::Kind::Node,
            "",
            "gpu-a",
            &json!({"metadata": {"annotations": {NODE_STATE_KEY: value}}}),
        )
        .unwrap();
    until("the daemon's report in the view", async || h.ext.report().nodes[0].gpus[0].in_use_mib == Some(9000)).await;
    let (status, body) = http(h.observe, "GET", "/gpushare-scheduler/inspect/gpu-a", "").await;
    assert_eq!(status, 200, "{body}");
    let inspect: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(inspect["nodes"][0]["gpus"][0]["usedMiB"], 10_000, "{body}");
    assert_eq!(inspect["nodes"][0]["gpus"][0]["pods"][0]["mib"], 10_000, "{body}");
    let (_, metrics) = http(h.observe, "GET", "/metrics", "").await;
    assert!(metrics.contains("gpushare_gpu_memory_used_mib{node=\"gpu-a\",gpu=\"0\",uuid=\"GPU-gpu-a-0\"} 10000\n"));
    // 5 360 MiB are free: a 5 000 MiB pod fits.
    let q = h.api.create_pod("default", pod_object("q", 5000)).unwrap();
    until("q", async || h.ext.with_view(|v| v.counts().1) == 2).await;
    let filter = json!({"Pod": q, "Nodes": null, "NodeNames": ["gpu-a"]}).to_string();
    let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/filter", &filter).await;
    let result: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(result["NodeNames"], json!(["gpu-a"]), "{body}");
}

/// A daemon's report naming pods that exist and are bound is no disagreement, whichever of the
/// two initial lists (Nodes, Pods) a starting extender receives first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_extender_finds_no_disagreement_with_an_agreeing_daemon() {
    let mut h = start(1 << 20).await;
    h.api.create_node(node_object("gpu-a", 2, 15_360)).unwrap();
    let pods: Vec<Value> =
        (0..20).map(|i| h.api.create_pod("default", pod_object(&format!("p{i:02}"), 500 + i * 10)).unwrap()).collect();
    until("ready", async || h.ext.is_ready() && h.ext.with_view(|v| v.counts().0 == 1 && v.counts().1 == 20)).await;
    for p in &pods {
        let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/bind", &bind_body(p, "gpu-a")).await;
        assert_eq!(body, r#"{"Error":""}"#);
    }
    until("no bind in flight", async || h.ext.with_view(|v| v.counts().2) == 0).await;
    assert_eq!(publish_allocations(&h.api, 2), 20);
    for _ in 0..8 {
        h.restart(false).await;
        until("the new extender ready", async || {
            h.ext.is_ready() && h.ext.with_view(|v| v.counts().0 == 1 && v.counts().1 == 20)
        })
        .await;
        let (_, metrics) = http(h.observe, "GET", "/metrics", "").await;
        assert!(metrics.contains("gpushare_extender_view_disagreements_total 0\n"), "{metrics}");
    }
}
