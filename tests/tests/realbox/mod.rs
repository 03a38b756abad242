//! What the real-cluster suites share: the real-cluster box of
//! [`gpushare_testkit::realbox`] brought up, or the test skipped where it cannot run ([`up`]);
//! pods and nodes as the tests write them. Each suite uses part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_core::{Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory};
use gpushare_testkit::containerd::PROBE_IMAGE;
use gpushare_testkit::realbox::{RealCluster, RealOptions, Runtime, Started};
use gpushare_testkit::realkube::{self, ControlPlane};
use serde_json::{Value, json};

#[allow(unused_imports)]
pub(crate) use gpushare_testkit::realbox::{repo, start_gpushared};

/// The real-cluster box of a suite.
pub(crate) type RealBox = RealCluster;

/// A Node as its daemon would leave it: GPUs of `mib` in the node state, the memory as the
/// kubelet's allocatable `gpushare.io/gpu-mem`.
pub(crate) fn node(name: &str, model: &str, mib: u64, count: u32) -> (Value, Value) {
    let gpus: Vec<Gpu> = (0..count)
        .map(|i| Gpu::new(i, GpuUuid::new(format!("GPU-{name}-{i}")).unwrap(), model, Mib::new(mib)))
        .collect();
    let state = NodeState {
        generation: 1,
        daemon_version: "0.1.0".into(),
        inventory: NodeInventory::new(MemoryUnit::Mib, gpus).unwrap(),
        used: vec![Mib::ZERO; count as usize],
        allocations: vec![],
        claims: vec![],
        over_budget: vec![],
        tells_lookalikes_apart: false,
    };
    let total = (mib * u64::from(count)).to_string();
    let object = json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {NODE_STATE_KEY: state.encode().unwrap()}}});
    (object, ready_status(&total))
}

/// A Ready node's status as its kubelet reports it, with `gpu_mem` devices of gpushare.io/gpu-mem.
pub(crate) fn ready_status(gpu_mem: &str) -> Value {
    let resources = json!({"cpu": "32", "memory": "128Gi", "pods": "110", "gpushare.io/gpu-mem": gpu_mem});
    json!({"capacity": resources, "allocatable": resources,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet ready",
                        "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}]})
}

pub(crate) fn pod(name: &str, mib: u64) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"automountServiceAccountToken": false,
                 "containers": [{"name": "main", "image": PROBE_IMAGE,
                                 "resources": {"limits": {"gpushare.io/gpu-mem": mib.to_string()}}}]}})
}

/// A ResourceClaim for `mib` MiB of one GPU of the shipped class.
pub(crate) fn claim(name: &str, mib: u64) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpushare-memory",
            "capacity": {"requests": {"memory": format!("{mib}Mi")}},
        }}]}},
    })
}

/// A pod whose `containers` all run `sleep infinity` from `image` and use the claim `claim`.
pub(crate) fn claim_pod(name: &str, claim: &str, containers: &[&str], image: &str) -> Value {
    let containers: Vec<Value> = containers
        .iter()
        .map(|c| json!({"name": c, "image": image, "command": ["sleep", "infinity"], "resources": {"claims": [{"name": "gpu"}]}}))
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"automountServiceAccountToken": false,
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}], "containers": containers},
    })
}

pub(crate) fn get(plane: &ControlPlane, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    serde_json::from_str(&plane.kubectl(&all).unwrap()).unwrap()
}

/// The real-cluster box with the shipped configurations; `None` when the components cannot
/// be had here (outside CI).
pub(crate) async fn up() -> Option<RealBox> {
    up_with("gpushare-scheduler-config.yaml", "").await
}

/// [`up`] with kube-scheduler loading `etc/kube-scheduler/<scheduler_config>` and
/// `extender_extra` added to the extender's configuration. `GPUSHARE_BOX_DIR` keeps every log,
/// certificate and etcd's data to study.
pub(crate) async fn up_with(scheduler_config: &str, extender_extra: &str) -> Option<RealBox> {
    up_on(scheduler_config, extender_extra, Runtime::Recording).await
}

/// [`up_with`] with the nodes' container runtime `runtime`.
pub(crate) async fn up_on(scheduler_config: &str, extender_extra: &str, runtime: Runtime) -> Option<RealBox> {
    if !realkube::available() {
        gpushare_testkit::skip_unless_ci("no Go to build the real Kubernetes components");
        return None;
    }
    let options = RealOptions {
        dir: gpushare_testkit::box_dir(),
        scheduler_config: scheduler_config.into(),
        extender_extra: extender_extra.into(),
        runtime,
    };
    Some(RealCluster::up(&options).await.unwrap_or_else(|e| panic!("{e:#}")))
}

/// Waits up to `timeout` until every pod of `names` is Running with its one container running
/// in `node`'s runtime, failing at once if one of them failed; returns the containers by pod name.
pub(crate) fn wait_running(b: &RealBox, node: &str, names: &[&str], timeout: Duration) -> BTreeMap<String, Started> {
    let n = b.node(node).unwrap();
    let deadline = Instant::now() + timeout;
    loop {
        let running: BTreeMap<String, Started> = n
            .running()
            .unwrap_or_else(|e| panic!("{e:#}"))
            .into_iter()
            .filter(|c| names.contains(&c.pod.as_str()))
            .map(|c| (c.pod.clone(), c))
            .collect();
        let pods = get(&b.plane, &["get", "pods", "-n", "default"]);
        let phase = |name: &str| {
            pods["items"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["metadata"]["name"] == name)
                .map(|p| p["status"]["phase"].as_str().unwrap_or_default().to_owned())
        };
        for name in names {
            assert_ne!(
                phase(name).as_deref(),
                Some("Failed"),
                "{name} failed\npods: {pods}\nkubelet:\n{}",
                n.kubelet.proc.log_tail(40)
            );
        }
        if running.len() == names.len() && names.iter().all(|name| phase(name).as_deref() == Some("Running")) {
            return running;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} containers running after {timeout:?}\npods: {pods}\nkubelet:\n{}\ngpushared:\n{}",
            running.len(),
            names.len(),
            n.kubelet.proc.log_tail(40),
            n.daemon.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Waits until `names` are all bound; returns the pods.
pub(crate) async fn wait_bound(b: &RealBox, names: &[String]) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pods = get(&b.plane, &["get", "pods", "-n", "default"]);
        let bound: Vec<Value> = pods["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| names.iter().any(|n| p["metadata"]["name"] == n.as_str()) && p["spec"]["nodeName"].is_string())
            .cloned()
            .collect();
        if bound.len() == names.len() {
            return bound;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} pods bound after 60 s\nscheduler:\n{}\nextender:\n{}",
            bound.len(),
            names.len(),
            b.plane.scheduler.as_ref().unwrap().log_tail(40),
            b.extender.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Priority classes `low` (100) and `high` (1000), for the preemption tests.
pub(crate) fn priority_classes(b: &RealBox) {
    for (name, value) in [("low", 100), ("high", 1000)] {
        b.plane
            .create(&json!({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                            "metadata": {"name": name}, "value": value}))
            .unwrap();
    }
}

/// How many times kube-scheduler called the extender's `preempt`, from its metrics.
pub(crate) async fn preempt_calls(b: &RealBox) -> u64 {
    let (_, metrics) = gpushare_testkit::cluster::http_get(b.observe, "/metrics").await.unwrap_or_default();
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("gpushare_extender_request_duration_seconds_count{verb=\"preempt\"} "))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .unwrap_or(0)
}

/// The pods of `default` named `prefix…` that are not being deleted.
pub(crate) fn live_named(b: &RealBox, prefix: &str) -> Vec<String> {
    let pods = get(&b.plane, &["get", "pods", "-n", "default"]);
    pods["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter_map(|p| p["metadata"]["name"].as_str())
        .filter(|n| n.starts_with(prefix))
        .map(str::to_owned)
        .collect()
}
