//! gpushare under the real Kubernetes control plane: etcd, kube-apiserver with Node and RBAC
//! authorization, and kube-scheduler loading the shipped configuration, built from Go modules
//! (`tests/kube/build`). The extender runs as the user the shipped `ClusterRole` binds
//! (`etc/kubernetes/gpushare-extender-rbac.yaml`), so the test proves it needs no more. The
//! nodes are API-only (Node objects with their daemon's published state, no kubelet): the real
//! scheduler filters, prioritizes and binds through the extender, and every bound pod carries
//! an assignment that fits its node's GPUs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_core::{Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory};
use gpushare_testkit::cluster::{Binaries, http_get};
use gpushare_testkit::realkube::{self, ControlPlane};
use serde_json::{Value, json};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// A Node as its daemon would leave it: GPUs of `mib` in the node state, the memory as the
/// kubelet's allocatable `gpushare.io/gpu-mem`.
fn node(name: &str, model: &str, mib: u64, count: u32) -> (Value, Value) {
    let gpus: Vec<Gpu> = (0..count)
        .map(|i| Gpu::new(i, GpuUuid::new(format!("GPU-{name}-{i}")).unwrap(), model, Mib::new(mib)))
        .collect();
    let state = NodeState {
        generation: 1,
        daemon_version: "0.1.0".into(),
        inventory: NodeInventory::new(MemoryUnit::Mib, gpus).unwrap(),
        used: vec![Mib::ZERO; count as usize],
        allocations: vec![],
        over_budget: vec![],
    };
    let total = (mib * u64::from(count)).to_string();
    let object = json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {NODE_STATE_KEY: state.encode().unwrap()}}});
    let resources = json!({"cpu": "32", "memory": "128Gi", "pods": "110", "gpushare.io/gpu-mem": total});
    let status = json!({"capacity": resources, "allocatable": resources,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "API-only node",
                        "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}]});
    (object, status)
}

fn pod(name: &str, mib: u64) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"automountServiceAccountToken": false,
                 "containers": [{"name": "main", "image": "registry.example/app:1",
                                 "resources": {"limits": {"gpushare.io/gpu-mem": mib.to_string()}}}]}})
}

fn get(plane: &ControlPlane, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    serde_json::from_str(&plane.kubectl(&all).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_scheduler_places_gpu_pods_through_the_extender() {
    if !realkube::available() {
        gpushare_testkit::skip_unless_ci("no Go to build the real Kubernetes components");
        return;
    }
    let bin = realkube::binaries().unwrap();
    // GPUSHARE_BOX_DIR keeps every log, certificate and etcd's data to study.
    let temp = tempfile::Builder::new().prefix("gpushare-real.").tempdir().unwrap();
    let kept = std::env::var_os("GPUSHARE_BOX_DIR").map(std::path::PathBuf::from);
    let dir = kept.as_deref().unwrap_or(temp.path());
    let mut plane = ControlPlane::start(dir, &bin).unwrap();

    // The shipped RBAC: the extender's identity may read Nodes and Pods and bind Pods.
    plane.apply(&repo().join("etc/kubernetes/gpushare-extender-rbac.yaml")).unwrap();
    for (name, model, mib, count) in [("node-a", "Tesla T4", 15360, 2), ("node-b", "NVIDIA A10", 24576, 1)] {
        let (object, status) = node(name, model, mib, count);
        plane.add_api_only_node(&object, &status).unwrap();
    }

    let ours = Binaries::beside_current_exe().unwrap();
    let extender_kubeconfig = plane.pki.kubeconfig(&plane.server, "gpushare-extender", &[]).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let config = dir.join("gpushare-extender.toml");
    std::fs::write(
        &config,
        format!("[server]\nlisten = \"{addr}\"\n[kubernetes]\nkubeconfig = \"{}\"\n", extender_kubeconfig.display()),
    )
    .unwrap();
    let mut extender = plane
        .spawn(
            "extender",
            &ours.extender,
            vec!["--config".into(), config.display().to_string()],
            vec![("RUST_LOG".into(), "info".into())],
        )
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while http_get(addr, "/readyz").await.is_none_or(|(s, _)| s != 200) {
        assert!(extender.exited().is_none(), "the extender exited:\n{}", extender.log_tail(30));
        assert!(Instant::now() < deadline, "the extender is not ready:\n{}", extender.log_tail(30));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    plane
        .start_scheduler(
            &repo().join("etc/kube-scheduler/gpushare-scheduler-config.yaml"),
            &format!("http://{addr}/gpushare-scheduler"),
        )
        .unwrap();

    // One pod that fits no GPU: node-b lacks the memory in all (the scheduler's own check),
    // node-a has it only across its two GPUs (the extender's). Then five that fit (15,360 +
    // 15,360 + 24,576 MiB of GPUs).
    plane.create(&pod("too-big", 25_000)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let condition = loop {
        let too_big = get(&plane, &["get", "pod", "too-big", "-n", "default"]);
        assert!(too_big["spec"]["nodeName"].is_null(), "too-big was bound");
        let condition = too_big["status"]["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "PodScheduled").cloned());
        if let Some(c) = condition {
            break c;
        }
        assert!(Instant::now() < deadline, "too-big has no PodScheduled condition after 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(condition["status"], "False", "{condition}");
    assert_eq!(condition["reason"], "Unschedulable", "{condition}");
    let message = condition["message"].as_str().unwrap();
    eprintln!("too-big: {message}");
    assert!(message.contains("1 Insufficient gpushare.io/gpu-mem"), "{message}");
    assert!(message.contains("needs 25000 MiB on a GPU, the largest usable GPU here has 15360 MiB"), "{message}");
    let sizes = [10_000, 9_000, 8_000, 5_000, 4_000];
    for (i, mib) in sizes.iter().enumerate() {
        plane.create(&pod(&format!("fits-{i}"), *mib)).unwrap();
    }

    let deadline = Instant::now() + Duration::from_secs(60);
    let bound = loop {
        let pods = get(&plane, &["get", "pods", "-n", "default"]);
        let items = pods["items"].as_array().unwrap().clone();
        let bound: Vec<Value> = items.into_iter().filter(|p| p["spec"]["nodeName"].is_string()).collect();
        if bound.len() == sizes.len() {
            break bound;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} pods bound after 60 s\nscheduler:\n{}\nextender:\n{}",
            bound.len(),
            sizes.len(),
            plane.scheduler.as_ref().unwrap().log_tail(40),
            extender.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };

    // Every bound pod's assignment names GPUs of its node, and no GPU holds more than it has.
    let mut used: BTreeMap<(String, u32), u64> = BTreeMap::new();
    for p in &bound {
        let node = p["spec"]["nodeName"].as_str().unwrap();
        let value = p["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().expect("an assignment");
        let a = Assignment::decode(value).unwrap();
        assert_eq!(a.node, node);
        for c in &a.containers {
            for share in &c.gpus {
                assert!(share.uuid.as_str().starts_with(&format!("GPU-{node}-")), "{value}");
                *used.entry((node.to_owned(), share.index)).or_default() += share.mib.get();
            }
        }
    }
    for ((node, gpu), mib) in &used {
        let total = if node == "node-b" { 24_576 } else { 15_360 };
        assert!(*mib <= total, "{node} GPU{gpu}: {mib} of {total} MiB");
    }

    let too_big = get(&plane, &["get", "pod", "too-big", "-n", "default"]);
    assert!(too_big["spec"]["nodeName"].is_null(), "too-big was bound");
    extender.kill();
}
