//! gpushare under the real kubelet: a node of the real-cluster box runs the real kubelet (on
//! containerd and runc, `gpushare_testkit::containerd`) and gpushared as that node. The real
//! kube-scheduler places pods through the extender, the real kubelet admits them through
//! gpushared's device plugin, and what each container's process saw is checked against the
//! assignment the extender wrote: the GPU it sees and its budget.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_testkit::containerd::PROBE_IMAGE;
use gpushare_testkit::nvml::FakeGpu;
use gpushare_testkit::realbox::{RealNode, Runtime, Started, is_root};

mod realbox;
use realbox::{RealBox, get, pod, up_on, wait_bound};

const NODE: &str = "node-k";

/// The real-cluster box, when this machine can run the real kubelet.
async fn real_box() -> Option<RealBox> {
    if !is_root() {
        gpushare_testkit::skip_unless_ci("the real kubelet needs root (it runs in a mount namespace of its own)");
        return None;
    }
    up_on("gpushare-scheduler-config.yaml", "", Runtime::Containerd).await
}

/// [`real_box`] set up as a cluster moving from Alibaba's gpushare: the shipped Alibaba
/// scheduler configuration and the extender with `compatibility = "alibaba"`.
async fn alibaba_box() -> Option<RealBox> {
    if !is_root() {
        gpushare_testkit::skip_unless_ci("the real kubelet needs root (it runs in a mount namespace of its own)");
        return None;
    }
    up_on("gpushare-scheduler-config-alibaba.yaml", "[resources]\ncompatibility = \"alibaba\"\n", Runtime::Containerd)
        .await
}

/// Adds the node with the real kubelet and gpushared on two T4s; waits until the kubelet
/// reports the device plugin's memory in the node's allocatable.
fn start_node(b: &mut RealBox) {
    start_node_with(b, "", ("gpushare.io/gpu-mem", "30720"));
}

/// [`start_node`] with `config_extra` added to gpushared.toml, waiting for the kubelet to
/// report `amount` of `resource`.
fn start_node_with(b: &mut RealBox, config_extra: &str, (resource, amount): (&str, &str)) {
    let gpus = [FakeGpu::new(NODE, 0, 15360, "Tesla T4"), FakeGpu::new(NODE, 1, 15360, "Tesla T4")];
    b.add_node(NODE, &gpus, ("", config_extra)).unwrap_or_else(|e| panic!("{e:#}"));
    b.wait_allocatable(NODE, resource, amount, Duration::from_secs(60)).unwrap_or_else(|e| panic!("{e:#}"));
}

fn the_node(b: &RealBox) -> &RealNode {
    b.node(NODE).unwrap()
}

/// Waits until every pod of `names` is Running with one running container each; returns
/// their containers as the runtime created them, by pod name.
fn wait_running(b: &RealBox, names: &[&str]) -> BTreeMap<String, Started> {
    realbox::wait_running(b, NODE, names, Duration::from_secs(60))
}

/// Checks that each container got the GPU of its pod's assignment and the budget of it, and
/// that no GPU holds more than it has.
fn check_containers(b: &RealBox, containers: &BTreeMap<String, Started>) {
    let mut per_gpu: BTreeMap<String, u64> = BTreeMap::new();
    for (name, c) in containers {
        let p = get(&b.plane, &["get", "pod", name, "-n", "default"]);
        assert_eq!(p["spec"]["nodeName"], NODE, "{name}");
        let a = Assignment::decode(p["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
        let share = &a.containers[0].gpus[0];
        let env = |k: &str| c.envs.get(k).cloned().unwrap_or_default();
        assert_eq!(env("NVIDIA_VISIBLE_DEVICES"), share.uuid.as_str(), "{name}: {:?}", c.envs);
        assert_eq!(env("GPUSHARE_MEMORY_MIB"), share.mib.get().to_string(), "{name}");
        assert_eq!(env("CUDA_DEVICE_MEMORY_LIMIT_0"), format!("{}m", share.mib.get()), "{name}");
        assert_eq!(env("GPUSHARE_POD"), format!("default/{name}"), "{name}");
        assert_eq!(c.container, "main");
        *per_gpu.entry(share.uuid.as_str().to_owned()).or_default() += share.mib.get();
    }
    for (gpu, mib) in per_gpu {
        assert!(mib <= 15360, "{gpu} holds {mib} MiB of 15360");
    }
}

/// The pods gpushared publishes as holding memory on the node.
fn published(b: &RealBox) -> Vec<String> {
    let n = get(&b.plane, &["get", "node", NODE]);
    let Some(v) = n["metadata"]["annotations"][NODE_STATE_KEY].as_str() else { return Vec::new() };
    let mut pods: Vec<String> = NodeState::decode(v).unwrap().allocations.into_iter().map(|a| a.pod.name).collect();
    pods.sort();
    pods.dedup();
    pods
}

fn wait_published(b: &RealBox, want: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = published(b);
        if now == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "gpushared publishes {now:?}, not {want:?}\n{}",
            the_node(b).daemon.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_kubelet_runs_each_container_on_the_gpu_of_its_assignment() {
    let Some(mut b) = real_box().await else { return };
    start_node(&mut b);

    // Three pods that fill the two GPUs unevenly: the kubelet admits each through Allocate, and
    // the runtime is told what gpushared answered.
    let first = ["kb-a", "kb-b", "kb-c"];
    for (name, mib) in first.iter().zip([6000, 7000, 8000]) {
        b.plane.create(&pod(name, mib)).unwrap();
    }
    wait_bound(&b, &first.map(str::to_owned)).await;
    let containers = wait_running(&b, &first);
    check_containers(&b, &containers);
    wait_published(&b, &first);

    // The kubelet killed and started again: the pods keep running, nothing is created twice,
    // and a pod placed afterwards is admitted on the GPU of its assignment.
    let created = the_node(&b).started().unwrap().len();
    b.nodes[0].kubelet.restart(&b.plane).unwrap_or_else(|e| panic!("{e:#}"));
    b.plane.create(&pod("kb-d", 5000)).unwrap();
    wait_bound(&b, &["kb-d".to_owned()]).await;
    let all = ["kb-a", "kb-b", "kb-c", "kb-d"];
    let containers = wait_running(&b, &all);
    check_containers(&b, &containers);
    assert_eq!(
        the_node(&b).started().unwrap().len(),
        created + 1,
        "containers created again after the restart: {:?}",
        the_node(&b).started().unwrap()
    );
    wait_published(&b, &all);

    // A pod deleted: the kubelet stops its container and gpushared no longer counts it.
    b.plane.kubectl(&["delete", "pod", "kb-a", "-n", "default", "--grace-period=1"]).unwrap();
    wait_published(&b, &["kb-b", "kb-c", "kb-d"]);
    assert!(
        the_node(&b).running().unwrap().iter().all(|c| c.pod != "kb-a"),
        "kb-a still runs: {:?}",
        the_node(&b).running().unwrap()
    );
}

/// A pod with an init container (it runs `true` and exits), a sidecar (a restartable init
/// container) and two app containers, each asking for its own GPU memory.
fn mixed_pod(name: &str) -> serde_json::Value {
    let gpu = |mib: u64| serde_json::json!({"limits": {"gpushare.io/gpu-mem": mib.to_string()}});
    serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"automountServiceAccountToken": false,
                 "initContainers": [
                     {"name": "fetch", "image": PROBE_IMAGE, "command": ["true"], "resources": gpu(4000)},
                     {"name": "proxy", "image": PROBE_IMAGE, "restartPolicy": "Always", "resources": gpu(1000)}],
                 "containers": [
                     {"name": "main", "image": PROBE_IMAGE, "resources": gpu(3000)},
                     {"name": "worker", "image": PROBE_IMAGE, "resources": gpu(2000)}]}})
}

/// Waits up to 30 s until pod `name`'s containers have started `count` times in all (on
/// containerd, until each process's report is in the pod's logs: the runtime writes them as it
/// copies the processes' output).
fn wait_started(b: &RealBox, name: &str, count: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let started = the_node(b).started().unwrap();
        if started.iter().filter(|c| c.pod == name).count() >= count {
            return;
        }
        assert!(Instant::now() < deadline, "{name}: not {count} container starts after 30 s: {started:?}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Checks every container the runtime created for pod `name` against its assignment: the GPU it
/// sees and its budget. Returns how many there were.
fn check_every_container(b: &RealBox, name: &str) -> usize {
    let p = get(&b.plane, &["get", "pod", name, "-n", "default"]);
    let a = Assignment::decode(p["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
    let created: Vec<Started> = the_node(b).started().unwrap().into_iter().filter(|c| c.pod == name).collect();
    for c in &created {
        let assigned = a
            .containers
            .iter()
            .find(|x| x.name == c.container)
            .unwrap_or_else(|| panic!("{name}: container {} has no assignment in {a:?}", c.container));
        let share = &assigned.gpus[0];
        assert_eq!(
            c.envs.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str),
            Some(share.uuid.as_str()),
            "{name}/{}",
            c.container
        );
        assert_eq!(c.envs.get("GPUSHARE_MEMORY_MIB"), Some(&share.mib.get().to_string()), "{name}/{}", c.container);
    }
    created.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_containers_sidecars_and_a_gpushared_restart_under_the_real_kubelet() {
    let Some(mut b) = real_box().await else { return };
    start_node(&mut b);

    // The kubelet runs the init container to completion, then the sidecar and both app
    // containers, each created with the GPU and budget of its own assignment.
    b.plane.create(&mixed_pod("mix-a")).unwrap();
    wait_bound(&b, &["mix-a".to_owned()]).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while the_node(&b).running().unwrap().iter().filter(|c| c.pod == "mix-a").count() < 3 {
        assert!(
            Instant::now() < deadline,
            "mix-a's containers: {:?}\n{}",
            the_node(&b).started().unwrap(),
            the_node(&b).daemon.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    wait_started(&b, "mix-a", 4);
    assert_eq!(check_every_container(&b, "mix-a"), 4, "{:?}", the_node(&b).started().unwrap());
    wait_published(&b, &["mix-a"]);

    // gpushared killed and started again: it comes back with its ledger, registers again, keeps
    // mix-a published, and serves the next pod on the GPU of its assignment.
    // The kubelet marks the devices unhealthy when the old stream ends, and a pod it admits
    // before the restarted daemon's first device list is processed fails with
    // UnexpectedAdmissionError, as with any device plugin (docs/gpushared.md, when gpushared
    // stops): mix-b is created once the kubelet has the devices healthy again.
    let log_before = the_node(&b).kubelet.proc.log().len();
    b.nodes[0].daemon.kill_and_restart().unwrap();
    wait_devices_healthy_since(&b, log_before);
    b.plane.create(&mixed_pod("mix-b")).unwrap();
    wait_bound(&b, &["mix-b".to_owned()]).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while the_node(&b).running().unwrap().iter().filter(|c| c.pod == "mix-b").count() < 3 {
        assert!(
            Instant::now() < deadline,
            "mix-b's containers: {:?}\npods: {}\nkubelet:\n{}\ngpushared:\n{}",
            the_node(&b).started().unwrap(),
            get(&b.plane, &["get", "pods", "-n", "default"]),
            the_node(&b).kubelet.proc.log_tail(60),
            the_node(&b).daemon.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    wait_started(&b, "mix-b", 4);
    assert_eq!(check_every_container(&b, "mix-b"), 4, "{:?}", the_node(&b).started().unwrap());
    wait_published(&b, &["mix-a", "mix-b"]);
    assert!(b.nodes[0].daemon.exited().is_none(), "{}", the_node(&b).daemon.log_tail(40));
}

/// Waits until the kubelet's log, past its first `offset` bytes, shows it processed a device
/// list of gpushared's memory resource with every device healthy.
fn wait_devices_healthy_since(b: &RealBox, offset: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let healthy = |line: &str| {
        let field = |name: &str| line.split(&format!("{name}=")).nth(1).and_then(|v| v.split_whitespace().next());
        line.contains("Processed device updates for resource")
            && line.contains("gpushare.io/gpu-mem")
            && field("totalCount").is_some_and(|t| t != "0" && field("healthyCount") == Some(t))
    };
    loop {
        let log = the_node(b).kubelet.proc.log();
        if String::from_utf8_lossy(log.as_bytes().get(offset..).unwrap_or_default()).lines().any(healthy) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the kubelet never listed gpushared's devices healthy after its restart:\n{}",
            the_node(b).kubelet.proc.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_allocatable(b: &RealBox, want: &str) {
    b.wait_allocatable(NODE, "gpushare.io/gpu-mem", want, Duration::from_secs(60)).unwrap_or_else(|e| panic!("{e:#}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_with_an_xid_leaves_the_kubelets_allocatable_and_comes_back() {
    let Some(mut b) = real_box().await else { return };
    start_node_with(
        &mut b,
        "[health]\nprobe_interval_seconds = 1\nrecovery_seconds = 15\n",
        ("gpushare.io/gpu-mem", "30720"),
    );
    let events = the_node(&b).events.clone();

    b.plane.create(&pod("x-a", 8000)).unwrap();
    wait_bound(&b, &["x-a".to_owned()]).await;
    let running = wait_running(&b, &["x-a"]);
    check_containers(&b, &running);
    let p = get(&b.plane, &["get", "pod", "x-a", "-n", "default"]);
    let a = Assignment::decode(p["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
    let sick = a.containers[0].gpus[0].index;

    // Xid 79 (fallen off the bus) on x-a's GPU: gpushared reports its devices Unhealthy and the
    // kubelet takes them out of the node's allocatable; x-a runs on. A pod that would fit the
    // sick GPU's room (7360) goes to the other GPU.
    gpushare_testkit::nvml::inject(&events, &format!("xid {sick} 79")).unwrap();
    wait_allocatable(&b, "15360");
    b.plane.create(&pod("x-b", 5000)).unwrap();
    wait_bound(&b, &["x-b".to_owned()]).await;
    let p = get(&b.plane, &["get", "pod", "x-b", "-n", "default"]);
    let a = Assignment::decode(p["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
    assert_ne!(a.containers[0].gpus[0].index, sick, "x-b was placed on the GPU with the Xid");
    // The kubelet's allocatable (15360) still counts x-a's 8000 MiB on the sick GPU, so kube-scheduler
    // itself sees 2360 MiB left for a pod of 6000 (the healthy GPU has 10360): it waits.
    b.plane.create(&pod("x-c", 6000)).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let p = get(&b.plane, &["get", "pod", "x-c", "-n", "default"]);
    assert!(p["spec"]["nodeName"].is_null(), "x-c was placed beyond the kubelet's allocatable: {}", p["metadata"]);
    assert!(the_node(&b).running().unwrap().iter().any(|c| c.pod == "x-a"), "x-a stopped running");

    // No new fault for recovery_seconds and the GPU answers: healthy again, back in the
    // allocatable, and x-c placed and admitted.
    wait_allocatable(&b, "30720");
    wait_bound(&b, &["x-c".to_owned()]).await;
    let running = wait_running(&b, &["x-a", "x-b", "x-c"]);
    check_containers(&b, &running);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alibaba_style_pods_run_under_the_real_kubelet_with_the_compatibility_setting() {
    let Some(mut b) = alibaba_box().await else { return };
    start_node_with(&mut b, "[resources]\ncompatibility = \"alibaba\"\n", ("aliyun.com/gpu-mem", "30720"));

    // Pods as Alibaba's users write them: aliyun.com/gpu-mem, nothing of gpushare's.
    let alibaba_pod = |name: &str, mib: u64| {
        serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"automountServiceAccountToken": false,
                     "containers": [{"name": "main", "image": PROBE_IMAGE,
                                     "resources": {"limits": {"aliyun.com/gpu-mem": mib.to_string()}}}]}})
    };
    let names = ["ali-a", "ali-b", "ali-c"];
    for (name, mib) in names.iter().zip([6000, 7000, 8000]) {
        b.plane.create(&alibaba_pod(name, mib)).unwrap();
    }
    wait_bound(&b, &names.map(str::to_owned)).await;
    let containers = wait_running(&b, &names);
    check_containers(&b, &containers);
    for (name, c) in &containers {
        let p = get(&b.plane, &["get", "pod", name, "-n", "default"]);
        let annotations = &p["metadata"]["annotations"];
        let a = Assignment::decode(annotations[ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
        let share = &a.containers[0].gpus[0];
        // Alibaba's annotations, written at bind, and its environment, as its device plugin set them.
        assert_eq!(annotations["ALIYUN_COM_GPU_MEM_IDX"], share.index.to_string(), "{name}: {annotations}");
        assert_eq!(annotations["ALIYUN_COM_GPU_MEM_POD"], share.mib.get().to_string(), "{name}");
        assert_eq!(c.envs.get("ALIYUN_COM_GPU_MEM_CONTAINER"), Some(&share.mib.get().to_string()), "{name}");
        assert_eq!(c.envs.get("ALIYUN_COM_GPU_MEM_DEV").map(String::as_str), Some("15360"), "{name}");
    }
    wait_published(&b, &names);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_gpu_beside_shared_ones_under_the_real_kubelet() {
    let Some(mut b) = real_box().await else { return };
    // GPU 1 handed out whole: the kubelet reports GPU 0's memory and one whole GPU.
    start_node_with(&mut b, "[sharing]\nwhole = [1]\n", ("gpushare.io/gpu-mem", "15360"));
    let whole =
        b.plane.kubectl(&["get", "node", NODE, "-o", "jsonpath={.status.allocatable.gpushare\\.io/gpu}"]).unwrap();
    assert_eq!(whole.trim(), "1");

    let whole_pod = |name: &str| {
        serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"automountServiceAccountToken": false,
                     "containers": [{"name": "main", "image": PROBE_IMAGE,
                                     "resources": {"limits": {"gpushare.io/gpu": "1"}}}]}})
    };
    b.plane.create(&pod("s-a", 6000)).unwrap();
    b.plane.create(&pod("s-b", 7000)).unwrap();
    b.plane.create(&whole_pod("w-a")).unwrap();
    wait_bound(&b, &["s-a".to_owned(), "s-b".to_owned(), "w-a".to_owned()]).await;
    let running = wait_running(&b, &["s-a", "s-b", "w-a"]);
    let (shares, wholes): (BTreeMap<String, Started>, BTreeMap<String, Started>) =
        running.into_iter().partition(|(name, _)| name.starts_with("s-"));
    check_containers(&b, &shares);
    for (name, c) in &shares {
        assert_eq!(c.envs.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str), Some("GPU-fake-node-k-0"), "{name}");
    }
    assert_eq!(wholes["w-a"].envs.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str), Some("GPU-fake-node-k-1"));
    // On containerd the whole GPU's container has that GPU's device node (minor 1), made by
    // runc from the node's stand-in, and no other GPU's.
    if the_node(&b).runtime.containerd().is_some() {
        let seen = the_node(&b).seen().unwrap();
        let w = seen.iter().find(|s| s.pod == "w-a").expect("w-a's process reported");
        let gpus: Vec<(&str, u32, u32)> = w
            .devices
            .iter()
            .filter(|d| d.path.strip_prefix("/dev/nvidia").is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())))
            .map(|d| (d.path.as_str(), d.major, d.minor))
            .collect();
        assert_eq!(gpus, [("/dev/nvidia1", 195, 1)], "w-a: {:?}", w.devices);
    }

    // The whole GPU is taken and GPU 0 has 2360 MiB left: a second whole pod and a share of
    // 5000 MiB both wait; neither lands on the other's GPU.
    b.plane.create(&whole_pod("w-b")).unwrap();
    b.plane.create(&pod("s-c", 5000)).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    for name in ["w-b", "s-c"] {
        let p = get(&b.plane, &["get", "pod", name, "-n", "default"]);
        assert!(p["spec"]["nodeName"].is_null(), "{name} was placed: {}", p["metadata"]);
    }
    assert_eq!(the_node(&b).running().unwrap().len(), 3, "{:?}", the_node(&b).running().unwrap());
}

/// A kubelet left with `ResourceHealthStatus` on (the default from 1.36) writes each allocated
/// device's health into pod status, one entry per MiB: gpushared sees it in the pods it watches
/// and tells the operator to turn the gate off. Small GPUs keep the kubelet's own cost low.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpushared_points_out_a_kubelet_reporting_per_mib_device_health() {
    let Some(mut b) = real_box().await else { return };
    if b.plane.minor < 36 {
        // Not a missing prerequisite: before 1.36 the gate is alpha and off by default (with
        // only the kubelet's gate on, 1.33 reported nothing where 1.32 did).
        eprintln!(
            "skipped: the ResourceHealthStatus gate is on by default from Kubernetes 1.36 (this is 1.{})",
            b.plane.minor
        );
        return;
    }
    let gpus = [FakeGpu::new(NODE, 0, 1024, "Tesla T4"), FakeGpu::new(NODE, 1, 1024, "Tesla T4")];
    b.add_node_with_gates(NODE, &gpus, ("", ""), &[("ResourceHealthStatus", true)]).unwrap_or_else(|e| panic!("{e:#}"));
    b.wait_allocatable(NODE, "gpushare.io/gpu-mem", "2048", Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e:#}"));
    b.plane.create(&pod("h-a", 300)).unwrap();
    wait_bound(&b, &["h-a".to_owned()]).await;
    wait_running(&b, &["h-a"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let p = get(&b.plane, &["get", "pod", "h-a", "-n", "default"]);
        let reported: usize = p["status"]["containerStatuses"][0]["allocatedResourcesStatus"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["name"] == "gpushare.io/gpu-mem")
            .map(|r| r["resources"].as_array().map_or(0, Vec::len))
            .sum();
        let log = the_node(&b).daemon.log();
        let warned = log.lines().filter(|l| l.contains(" WARN ") && l.contains("ResourceHealthStatus")).count();
        if reported == 300 && warned == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the kubelet reports {reported} devices' health; gpushared warned {warned} times\n{}",
            the_node(&b).daemon.log_tail(20)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// A pod created with its grant already written and its node already set, as a pod owner could
/// where gpushare's admission policy is not installed (here its bindings are deleted): the
/// kubelet asks gpushared, which holds the grant to the pod's own requests and refuses it, so
/// the pod fails admission with gpushared's reason and nothing is allocated or created. Both
/// widenings: a container asking memory on one GPU granted two, and one asking an even share
/// of two granted a sliver on one and nearly all on the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_its_owner_forged_is_refused_by_gpushared_without_the_admission_policy() {
    let Some(mut b) = real_box().await else { return };
    start_node(&mut b);
    // Kubernetes 1.29 has no ValidatingAdmissionPolicy v1: the box installed none.
    if b.plane.minor >= gpushare_testkit::realkube::ADMISSION_POLICY_MINOR {
        b.plane
            .kubectl(&["delete", "validatingadmissionpolicybinding", "gpushare-assignment", "gpushare-requests"])
            .unwrap();
    }
    let share = |index: u32, mib: u64| serde_json::json!({"index": index, "uuid": format!("GPU-fake-{NODE}-{index}"), "mib": mib});
    let forged = |name: &str, limits: serde_json::Value, gpus: Vec<serde_json::Value>| {
        let grant = serde_json::json!({"v": 1, "node": NODE, "unit": "MiB",
            "containers": [{"name": "main", "gpus": gpus}]});
        serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "annotations": {ASSIGNMENT_KEY: grant.to_string()}},
            "spec": {"nodeName": NODE, "automountServiceAccountToken": false,
                     "containers": [{"name": "main", "image": PROBE_IMAGE,
                                     "resources": {"limits": limits}}]}})
    };
    let cases = [
        (
            "forged-two-gpus",
            serde_json::json!({"gpushare.io/gpu-mem": "8000"}),
            vec![share(0, 4000), share(1, 4000)],
            "over 2 GPU(s), it asks for 1",
        ),
        (
            "forged-uneven",
            serde_json::json!({"gpushare.io/gpu-mem": "8000", "gpushare.io/gpu-count": "2"}),
            vec![share(0, 100), share(1, 7900)],
            "its request is an equal 4000 MiB on each of its 2 GPU(s)",
        ),
    ];
    for (name, limits, gpus, reason) in cases {
        b.plane.create(&forged(name, limits, gpus)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            let p = get(&b.plane, &["get", "pod", name, "-n", "default"]);
            if p["status"]["phase"] == "Failed" {
                break p["status"].clone();
            }
            assert!(
                Instant::now() < deadline,
                "{name} not refused after 60 s: {}\ngpushared:\n{}",
                p["status"],
                the_node(&b).daemon.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(250));
        };
        let message = status["message"].as_str().unwrap_or_default();
        assert_eq!(status["reason"], "UnexpectedAdmissionError", "{name}: {status}");
        assert!(message.contains(reason), "{name}: {message}");
        assert!(the_node(&b).started().unwrap().iter().all(|c| c.pod != name), "{name} was created");
    }
    assert!(published(&b).is_empty(), "gpushared holds memory for {:?}", published(&b));
}
