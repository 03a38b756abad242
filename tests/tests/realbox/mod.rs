//! What the real-cluster suites share: the control plane with the shipped RBAC, the extender
//! under its own identity and kube-scheduler with the shipped configuration ([`up`]); gpushared
//! as a node on the fake NVML library ([`start_gpushared`]); pods and nodes as the tests write
//! them. Each suite uses part of it.
#![allow(dead_code)]

use std::path::Path;
use std::time::{Duration, Instant};

use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_core::{Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory};
use gpushare_testkit::cluster::{Binaries, Proc, http_get};
use gpushare_testkit::nvml::{self, FakeGpu};
use gpushare_testkit::realkube::{self, ControlPlane};
use serde_json::{Value, json};

pub(crate) fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

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
        over_budget: vec![],
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
                 "containers": [{"name": "main", "image": "registry.example/app:1",
                                 "resources": {"limits": {"gpushare.io/gpu-mem": mib.to_string()}}}]}})
}

pub(crate) fn get(plane: &ControlPlane, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    serde_json::from_str(&plane.kubectl(&all).unwrap()).unwrap()
}

/// The control plane with the shipped RBAC applied, the extender under its own identity, and
/// kube-scheduler with the shipped configuration; `None` when the components cannot be had
/// here (outside CI).
pub(crate) struct RealBox {
    pub(crate) plane: ControlPlane,
    pub(crate) extender: Proc,
    /// The extender's address.
    pub(crate) addr: std::net::SocketAddr,
    _temp: tempfile::TempDir,
}

pub(crate) async fn up() -> Option<RealBox> {
    up_with("gpushare-scheduler-config.yaml", "").await
}

/// [`up`] with kube-scheduler loading `etc/kube-scheduler/<scheduler_config>` and
/// `extender_extra` added to the extender's configuration.
pub(crate) async fn up_with(scheduler_config: &str, extender_extra: &str) -> Option<RealBox> {
    if !realkube::available() {
        gpushare_testkit::skip_unless_ci("no Go to build the real Kubernetes components");
        return None;
    }
    let bin = realkube::binaries().unwrap();
    // GPUSHARE_BOX_DIR keeps every log, certificate and etcd's data to study.
    let temp = tempfile::Builder::new().prefix("gpushare-real.").tempdir().unwrap();
    let dir = std::env::var_os("GPUSHARE_BOX_DIR").map_or_else(|| temp.path().to_owned(), std::path::PathBuf::from);
    let mut plane = ControlPlane::start(&dir, &bin).unwrap();
    // The shipped RBAC: the extender's identity may read Nodes and Pods and bind Pods.
    plane.apply(&repo().join("etc/kubernetes/gpushare-extender-rbac.yaml")).unwrap();

    let ours = Binaries::beside_current_exe().unwrap();
    let extender_kubeconfig = plane.pki.kubeconfig(&plane.server, "gpushare-extender", &[]).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let config = dir.join("gpushare-extender.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"{addr}\"\n[kubernetes]\nkubeconfig = \"{}\"\n{extender_extra}",
            extender_kubeconfig.display()
        ),
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
            &repo().join("etc/kube-scheduler").join(scheduler_config),
            &format!("http://{addr}/gpushare-scheduler"),
        )
        .unwrap();
    Some(RealBox { plane, extender, addr, _temp: temp })
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

/// Starts gpushared as `node` (its own `system:node:` certificate) on fake GPUs, against the
/// kubelet whose device plugins live in `plugin_dir` and whose PodResources socket is
/// `pod_resources`; its ledger, configuration and fake NVML library under `host`. `extra` is
/// (fake NVML directives, further gpushared.toml text).
pub(crate) fn start_gpushared(
    plane: &ControlPlane,
    node: &str,
    host: &Path,
    (plugin_dir, pod_resources): (&Path, &Path),
    gpus: &[FakeGpu],
    (nvml_extra, config_extra): (&str, &str),
) -> Proc {
    std::fs::create_dir_all(host).unwrap();
    let library = nvml::build(host).unwrap();
    let nvml_config = host.join("fake-nvml.conf");
    nvml::write_config(&nvml_config, gpus, nvml_extra).unwrap();
    let node_kubeconfig =
        plane.pki.kubeconfig(&plane.server, &format!("system:node:{node}"), &["system:nodes"]).unwrap();
    let config = host.join("gpushared.toml");
    std::fs::write(
        &config,
        format!(
            "node_name = \"{node}\"\n[kubelet]\ndevice_plugin_dir = \"{}\"\npod_resources_socket = \"{}\"\n\
             [ledger]\npath = \"{}\"\n[kubernetes]\nkubeconfig = \"{}\"\n[nvml]\nlibrary = \"{}\"\n[dbus]\nenabled = false\n{config_extra}",
            plugin_dir.display(),
            pod_resources.display(),
            host.join("ledger.db").display(),
            node_kubeconfig.display(),
            library.display()
        ),
    )
    .unwrap();
    let ours = Binaries::beside_current_exe().unwrap();
    plane
        .spawn(
            &format!("gpushared-{node}"),
            &ours.gpushared,
            vec!["--config".into(), config.display().to_string()],
            vec![("RUST_LOG".into(), "info".into()), ("FAKE_NVML_CONFIG".into(), nvml_config.display().to_string())],
        )
        .unwrap()
}
