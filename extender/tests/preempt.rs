//! `preempt` over HTTP, with the bodies kube-scheduler sends (`nodeCacheCapable: true`, so
//! victims by UID) against the API-server stand-in: kube-scheduler's contract
//! (`pkg/scheduler/framework/preemption`) is that every node answered has at least one victim,
//! victims come in decreasing priority, and `NumPDBViolations` is never negative.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment, ContainerAssignment, GpuShare};
use gpushare_core::{ContainerRole, GpuUuid, MemoryUnit, Mib};
use serde_json::{Value, json};

mod common;
use common::{http, node_object, start, until};

/// A running pod bound to `node` holding `mib` on GPU `gpu`, at `priority`.
fn holder(name: &str, node: &str, gpu: u32, mib: u64, priority: i32) -> Value {
    let assignment = Assignment {
        node: node.into(),
        unit: MemoryUnit::Mib,
        containers: vec![ContainerAssignment {
            name: "main".into(),
            role: ContainerRole::App,
            gpus: vec![GpuShare {
                index: gpu,
                uuid: GpuUuid::new(format!("GPU-{node}-{gpu}")).unwrap(),
                mib: Mib::new(mib),
            }],
        }],
    };
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "default",
                        "annotations": {ASSIGNMENT_KEY: assignment.encode().unwrap()}},
           "spec": {"nodeName": node, "priority": priority,
                    "containers": [{"name": "main", "image": "cuda",
                                    "resources": {"limits": {"gpushare.io/gpu-mem": mib.to_string()}}}]},
           "status": {"phase": "Running"}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempt_answers_what_kube_scheduler_accepts() {
    let h = start(1 << 20).await;
    // gpu-a, two GPUs of 1000: GPU0 a (400, prio 1), b (400, prio 5); GPU1 c (700, 0), d (300, 0).
    // gpu-b: one empty GPU (the pod needs no victim there).
    h.api.create_node(node_object("gpu-a", 2, 1000)).unwrap();
    h.api.create_node(node_object("gpu-b", 1, 1000)).unwrap();
    let mut uid = std::collections::BTreeMap::new();
    for (name, gpu, mib, prio) in [("a", 0, 400, 1), ("b", 0, 400, 5), ("c", 1, 700, 0), ("d", 1, 300, 0)] {
        let p = h.api.create_pod("default", holder(name, "gpu-a", gpu, mib, prio)).unwrap();
        uid.insert(name, p["metadata"]["uid"].as_str().unwrap().to_owned());
    }
    let cpu_hog = h
        .api
        .create_pod(
            "default",
            json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "cpu-hog", "namespace": "default"},
        "spec": {"nodeName": "gpu-a", "priority": 2, "containers": [{"name": "main", "image": "busybox"}]},
        "status": {"phase": "Running"}}),
        )
        .unwrap();
    uid.insert("cpu-hog", cpu_hog["metadata"]["uid"].as_str().unwrap().to_owned());
    let want = h
        .api
        .create_pod(
            "default",
            json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "want", "namespace": "default"},
        "spec": {"priority": 10, "containers": [{"name": "main", "image": "cuda",
                 "resources": {"limits": {"gpushare.io/gpu-mem": "600"}}}]}}),
        )
        .unwrap();
    // The view holds the pods that ask for GPU memory; the CPU hog's priority is unknown to it.
    until("ready", async || h.ext.is_ready() && h.ext.with_view(|v| v.counts().0 == 2 && v.counts().1 == 5)).await;
    let preempt = async |victims: Value| {
        let body = json!({"Pod": want, "NodeNameToVictims": null, "NodeNameToMetaVictims": victims}).to_string();
        let (status, body) = http(h.addr, "POST", "/gpushare-scheduler/preempt", &body).await;
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<Value>(&body).unwrap()["NodeNameToMetaVictims"].clone()
    };
    let pods = |names: &[&str]| names.iter().map(|n| json!({"UID": uid[n]})).collect::<Vec<_>>();

    // kube-scheduler chose the CPU hog (no GPU memory) and counts a negative PDB figure: the hog
    // stays, c is added for GPU1, in decreasing priority; gpu-b, empty, is left out.
    let r = preempt(json!({
        "gpu-a": {"Pods": pods(&["cpu-hog"]), "NumPDBViolations": -1},
        "gpu-b": {"Pods": [], "NumPDBViolations": 0},
    }))
    .await;
    assert_eq!(r, json!({"gpu-a": {"Pods": pods(&["cpu-hog", "c"]), "NumPDBViolations": 0}}));

    // Victims that make room already are all kept, in kube-scheduler's order (most important
    // first); a list out of order is put in order.
    let r = preempt(json!({"gpu-a": {"Pods": pods(&["cpu-hog", "a", "d"]), "NumPDBViolations": 1}})).await;
    assert_eq!(r, json!({"gpu-a": {"Pods": pods(&["cpu-hog", "a", "d"]), "NumPDBViolations": 1}}));
    let r = preempt(json!({"gpu-a": {"Pods": pods(&["d", "a"]), "NumPDBViolations": 3}})).await;
    assert_eq!(r, json!({"gpu-a": {"Pods": pods(&["a", "d"]), "NumPDBViolations": 2}}));
}
