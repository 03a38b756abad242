//! gpushare on the real container runtime (issue 37): a node of the real-cluster box whose
//! kubelet drives containerd 2 and runc (`gpushare_testkit::containerd`), so every container
//! really starts. Its process, the probe of `tests/runtime/cmd/probe`, reports what it sees, and
//! each check reads that: the device plugin's `Allocate` environment, a DRA claim's CDI spec as
//! containerd injects it, and a restart of containerd with the pods running.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_testkit::containerd::{PROBE_IMAGE, Seen};
use gpushare_testkit::nvml::FakeGpu;
use gpushare_testkit::realbox::{RealNode, Runtime, is_root, repo};
use gpushare_testkit::realkube::DRA_MINOR;
use serde_json::{Value, json};

mod realbox;
use realbox::{RealBox, claim, get, up_on, wait_bound};

const NODE: &str = "node-c";
const GPU_MIB: u64 = 40_960;

fn node(b: &RealBox) -> &RealNode {
    b.node(NODE).unwrap()
}

/// The box on containerd with one node of four 40 GB GPUs: 0 and 1 shared through the device
/// plugin, 2 and 3 through DRA. `None` where this machine cannot run it.
async fn containerd_box() -> Option<RealBox> {
    if !is_root() {
        gpushare_testkit::skip_unless_ci("the real kubelet and containerd need root");
        return None;
    }
    let mut b = up_on("gpushare-scheduler-config.yaml", "", Runtime::Containerd).await?;
    if b.plane.minor < DRA_MINOR {
        eprintln!("skipped: the DRA half needs Kubernetes 1.36 or later (this is 1.{})", b.plane.minor);
        return None;
    }
    b.plane.apply(&repo().join("etc/kubernetes/gpushare-deviceclass.yaml")).unwrap_or_else(|e| panic!("{e:#}"));
    let gpus: Vec<FakeGpu> = (0..4).map(|i| FakeGpu::new(NODE, i, GPU_MIB, "A100-PCIE-40GB")).collect();
    let config = b.dra_config(NODE, &[2, 3]);
    b.add_node(NODE, &gpus, ("", &config)).unwrap_or_else(|e| panic!("{e:#}"));
    b.wait_allocatable(NODE, "gpushare.io/gpu-mem", "81920", Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e:#}"));
    Some(b)
}

/// A pod of the probe image whose one container asks the device plugin for `mib` MiB.
fn plugin_pod(name: &str, mib: u64) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"automountServiceAccountToken": false,
                 "containers": [{"name": "main", "image": PROBE_IMAGE,
                                 "resources": {"limits": {"gpushare.io/gpu-mem": mib.to_string()}}}]}})
}

/// A pod of the probe image whose `containers` all use the claim `claim`.
fn claim_pod(name: &str, claim: &str, containers: &[&str]) -> Value {
    realbox::claim_pod(name, claim, containers, PROBE_IMAGE)
}

/// Waits until pod `name` is Running and each of its `containers` reported what it saw;
/// returns the latest report of each, by container name.
fn wait_seen(b: &RealBox, name: &str, containers: &[&str]) -> BTreeMap<String, Seen> {
    let n = node(b);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let p = get(&b.plane, &["get", "pod", name, "-n", "default"]);
        let uid = p["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
        let seen: BTreeMap<String, Seen> = n
            .seen()
            .unwrap_or_else(|e| panic!("{e:#}"))
            .into_iter()
            .filter(|s| s.pod == name && s.pod_uid == uid)
            .map(|s| (s.container.clone(), s))
            .collect();
        if p["status"]["phase"] == "Running" && containers.iter().all(|c| seen.contains_key(*c)) {
            return seen;
        }
        assert_ne!(p["status"]["phase"], "Failed", "{name} failed: {p}");
        assert!(
            Instant::now() < deadline,
            "{name}: not running with {containers:?} reported after 90 s\npod: {p}\nkubelet:\n{}\ncontainerd:\n{}\ngpushared:\n{}",
            n.kubelet.proc.log_tail(30),
            n.runtime.containerd().map(|c| c.log_tail(30)).unwrap_or_default(),
            n.daemon.log_tail(20),
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The UUID of the node's GPU `index`.
fn uuid(index: u32) -> String {
    FakeGpu::new(NODE, index, GPU_MIB, "A100-PCIE-40GB").uuid
}

/// Checks that the process of `pod`'s container ran in a container of its own (the first
/// process of its PID namespace, on the image's root) and saw its grant: the GPU and budget of
/// the assignment the extender wrote.
fn check_plugin_pod(b: &RealBox, pod: &str, seen: &Seen) {
    let p = get(&b.plane, &["get", "pod", pod, "-n", "default"]);
    let a = Assignment::decode(p["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
    let share = &a.containers[0].gpus[0];
    let env = |k: &str| seen.env.get(k).cloned().unwrap_or_default();
    assert_eq!(env("NVIDIA_VISIBLE_DEVICES"), share.uuid.as_str(), "{pod}: {:?}", seen.env);
    assert!([uuid(0), uuid(1)].contains(&env("NVIDIA_VISIBLE_DEVICES")), "{pod}: a device-plugin GPU");
    assert_eq!(env("GPUSHARE_MEMORY_MIB"), share.mib.get().to_string(), "{pod}");
    assert_eq!(env("CUDA_DEVICE_MEMORY_LIMIT_0"), format!("{}m", share.mib.get()), "{pod}");
    assert_eq!(env("GPUSHARE_POD"), format!("default/{pod}"), "{pod}");
    assert_real_container(pod, seen);
}

/// The process ran in a real container: PID 1 of its namespace, on an overlay root, with the
/// kubelet's `/etc/hosts` mounted.
fn assert_real_container(pod: &str, seen: &Seen) {
    assert_eq!(seen.pid, 1, "{pod}/{}: not the first process of its own PID namespace", seen.container);
    assert_eq!(seen.mount("/").map(|m| m.fstype.as_str()), Some("overlay"), "{pod}: {:?}", seen.mounts);
    assert!(seen.mount("/etc/hosts").is_some(), "{pod}: no /etc/hosts from the kubelet: {:?}", seen.mounts);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_containerd_each_process_sees_its_grant_and_a_restart_keeps_them_running() {
    let Some(mut b) = containerd_box().await else { return };

    // Device plugin: Allocate's environment reaches each process.
    let plugin = [("cp-a", 6000), ("cp-b", 30000), ("cp-c", 20000)];
    for (name, mib) in plugin {
        b.plane.create(&plugin_pod(name, mib)).unwrap();
    }
    wait_bound(&b, &plugin.map(|(n, _)| n.to_owned())).await;
    for (name, _) in plugin {
        let seen = wait_seen(&b, name, &["main"]);
        check_plugin_pod(&b, name, &seen["main"]);
    }

    // DRA: containerd resolves the claim's CDI device from the spec gpushared wrote, and both
    // containers of the pod see the claim's GPU and budget.
    b.plane.create(&claim("cc-3500", 3500)).unwrap();
    b.plane.create(&claim_pod("cd-a", "cc-3500", &["main", "sidecar"])).unwrap();
    let seen = wait_seen(&b, "cd-a", &["main", "sidecar"]);
    let c = get(&b.plane, &["get", "resourceclaim", "cc-3500", "-n", "default"]);
    let device = c["status"]["allocation"]["devices"]["results"][0]["device"].as_str().unwrap().to_owned();
    let index: u32 = device.strip_prefix("gpu-").unwrap().parse().unwrap();
    assert!(index >= 2, "a DRA GPU: {c}");
    for (container, s) in &seen {
        let env = |k: &str| s.env.get(k).cloned().unwrap_or_default();
        assert_eq!(env("NVIDIA_VISIBLE_DEVICES"), uuid(index), "{container}: {:?}", s.env);
        assert_eq!(env("GPUSHARE_MEMORY_MIB"), "3500", "{container}");
        assert_eq!(env("CUDA_DEVICE_MEMORY_LIMIT_0"), "3500m", "{container}");
        assert_eq!(env("GPUSHARE_GPU_TOTAL_MIB"), GPU_MIB.to_string(), "{container}");
        assert_eq!(env("GPUSHARE_CLAIM"), "default/cc-3500", "{container}");
        assert_real_container("cd-a", s);
    }

    // containerd killed and started again: the shims keep the containers running, the kubelet
    // starts none of them again, and a pod placed afterwards runs with its grant.
    let before = node(&b).seen().unwrap().len();
    let n = b.nodes.iter_mut().find(|n| n.name == NODE).unwrap();
    n.runtime.containerd_mut().expect("the box runs containerd").restart().unwrap_or_else(|e| panic!("{e:#}"));
    b.plane.create(&plugin_pod("cp-after", 8000)).unwrap();
    wait_bound(&b, &["cp-after".to_owned()]).await;
    let seen = wait_seen(&b, "cp-after", &["main"]);
    check_plugin_pod(&b, "cp-after", &seen["main"]);
    let all = node(&b).seen().unwrap();
    assert_eq!(all.len(), before + 1, "a container started again after containerd's restart: {all:#?}");
    for (name, _) in plugin {
        let p = get(&b.plane, &["get", "pod", name, "-n", "default"]);
        assert_eq!(p["status"]["phase"], "Running", "{name}: {p}");
        assert_eq!(p["status"]["containerStatuses"][0]["restartCount"], 0, "{name}: {p}");
    }
    b.shutdown();
}
