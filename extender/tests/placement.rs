//! Placement choices as kube-scheduler meets them through bind: the assignment the extender
//! writes on the pod.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use serde_json::{Value, json};

mod common;
use common::{http, node_object, pod_object, start, until};

fn bind_body(pod: &Value, node: &str) -> String {
    json!({"PodName": pod["metadata"]["name"], "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": node})
        .to_string()
}

/// Init 20 000 + app 1 000 on a node of three A10-sized GPUs, two of them 15 000 full: both go
/// on the free GPU (20 000 charged), not the app on a fuller GPU and the init container on the
/// free one (21 000 over two GPUs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_init_container_and_its_app_share_a_gpu_when_that_charges_less() {
    let h = start(1 << 20).await;
    h.api.create_node(node_object("gpu-a", 3, 23_028)).unwrap();
    let fillers: Vec<Value> =
        (0..2).map(|i| h.api.create_pod("default", pod_object(&format!("fill{i}"), 15_000 + i)).unwrap()).collect();
    let limits = |mib: u64| json!({"limits": {"gpushare.io/gpu-mem": mib.to_string()}});
    let pod = h
        .api
        .create_pod(
            "default",
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "warm", "namespace": "default"},
                   "spec": {"initContainers": [{"name": "load", "image": "cuda", "resources": limits(20_000)}],
                            "containers": [{"name": "serve", "image": "cuda", "resources": limits(1000)}]}}),
        )
        .unwrap();
    until("ready", async || h.ext.is_ready() && h.ext.with_view(|v| v.counts().0 == 1 && v.counts().1 == 3)).await;
    for p in &fillers {
        let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/bind", &bind_body(p, "gpu-a")).await;
        assert_eq!(body, r#"{"Error":""}"#);
    }
    let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/bind", &bind_body(&pod, "gpu-a")).await;
    assert_eq!(body, r#"{"Error":""}"#);
    let stored = h.api.pod("default", "warm").unwrap();
    let a = Assignment::decode(stored["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
    let gpus: Vec<(&str, u32)> = a.containers.iter().map(|c| (c.name.as_str(), c.gpus[0].index)).collect();
    assert_eq!(gpus, [("load", 2), ("serve", 2)]);
    let footprint: u64 = a.footprint().values().map(|m| m.get()).sum();
    assert_eq!(footprint, 20_000);
}
