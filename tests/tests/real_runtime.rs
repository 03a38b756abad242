//! gpushare on the real container runtime (issue 37): a node of the real-cluster box whose
//! kubelet drives containerd 2 and runc (`gpushare_testkit::containerd`), so every container
//! really starts. Its process, the probe of `tests/runtime/cmd/probe`, reports what it sees, and
//! each check reads that: the device plugin's `Allocate` environment and device nodes, a DRA
//! claim's CDI spec as containerd injects it (its device nodes among it), the rest of the
//! environment of a lean answer through gpushared's NRI plugin, a restart of containerd with
//! the pods running, and a node whose kubelet counts the memory (`[kubelet] advertise =
//! "capacity"`), where each container gets its grant through NRI alone, its device nodes and
//! MPS pipe directory among it, and whose containerd, requiring gpushared's NRI plugin, refuses
//! a container while gpushared is stopped.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_testkit::containerd::PROBE_IMAGE;
use gpushare_testkit::nvml::FakeGpu;
use gpushare_testkit::probe::Seen;
use gpushare_testkit::realbox::{RealNode, Runtime, is_root, merge_toml, repo};
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
/// plugin, 2 and 3 through DRA; 1 and 3 are MPS GPUs (their clients mount the pipe directory).
/// `None` where this machine cannot run it.
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
    let pipe = pipe_directory(&b);
    // gpushared-mps.service makes the pipe directory on a host (`install -d`).
    std::fs::create_dir_all(&pipe).unwrap();
    let host = b.plane.dir.join(NODE);
    // The device plugin's answers carry the lean set: the rest of each container's environment
    // (`GPUSHARE_MEMORY_MIB`, which the checks read, among it) reaches it through NRI.
    let mps = format!(
        "[sharing]\nmps = [1, 3]\n[mps]\npipe_directory = \"{pipe}\"\nlog_directory = \"{log}\"\n\
         environment_file = \"{env}\"\n[kubelet]\nenvironment = \"lean\"\n",
        log = host.join("mps-log").display(),
        env = host.join("mps.env").display(),
    );
    let config = merge_toml(&mps, &b.dra_config(NODE, &[2, 3])).unwrap();
    b.add_node(NODE, &gpus, ("", &config)).unwrap_or_else(|e| panic!("{e:#}"));
    b.wait_allocatable(NODE, "gpushare.io/gpu-mem", "81920", Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e:#}"));
    Some(b)
}

/// The node's MPS pipe directory, mounted into MPS clients at the same path.
fn pipe_directory(b: &RealBox) -> String {
    b.plane.dir.join(NODE).join("mps-pipe").display().to_string()
}

/// A pod of the probe image whose one container asks the device plugin for `mib` MiB; its
/// probe tries to write in `try_write`.
fn plugin_pod(name: &str, mib: u64, try_write: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"automountServiceAccountToken": false,
                 "containers": [{"name": "main", "image": PROBE_IMAGE, "env": [{"name": "PROBE_WRITE", "value": try_write}],
                                 "resources": {"limits": {"gpushare.io/gpu-mem": mib.to_string()}}}]}})
}

/// A pod of the probe image whose `containers` all use the claim `claim`.
fn claim_pod(name: &str, claim: &str, containers: &[&str]) -> Value {
    realbox::claim_pod(name, claim, containers, PROBE_IMAGE)
}

/// Waits until pod `name` is Running and each of its `containers` reported what it saw;
/// returns the latest report of each, by container name.
fn wait_seen(b: &RealBox, name: &str, containers: &[&str]) -> BTreeMap<String, Seen> {
    wait_seen_on(b, NODE, name, containers)
}

/// [`wait_seen`] for a pod on node `on`.
fn wait_seen_on(b: &RealBox, on: &str, name: &str, containers: &[&str]) -> BTreeMap<String, Seen> {
    let n = b.node(on).unwrap();
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

/// How many times gpushared has registered as containerd's NRI plugin.
fn registrations(b: &RealBox) -> usize {
    node(b).daemon.log().matches("registered as the runtime's NRI plugin").count()
}

/// Waits until gpushared has registered as containerd's NRI plugin `times` times.
fn wait_registered(b: &RealBox, times: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while registrations(b) < times {
        assert!(
            Instant::now() < deadline,
            "gpushared has not registered with NRI {times} times:\n{}",
            node(b).daemon.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Standard base64, as Go's JSON writes a byte slice.
fn base64(text: &str) -> Vec<u8> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in text.bytes().filter(|&c| c != b'=') {
        let v = ALPHABET.iter().position(|&a| a == c).unwrap_or_else(|| panic!("{c} is not base64"));
        acc = (acc << 6) | u32::try_from(v).unwrap();
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push(u8::try_from((acc >> bits) & 0xff).unwrap());
        }
    }
    out
}

/// The UUID of the node's GPU `index`.
fn uuid(index: u32) -> String {
    FakeGpu::new(NODE, index, GPU_MIB, "A100-PCIE-40GB").uuid
}

/// Checks that the process of `pod`'s container ran in a container of its own and saw its
/// grant: the GPU and budget of the assignment the extender wrote, and on the MPS GPU (1) the
/// pipe directory, mounted read-only so that the process cannot write there. Returns the GPU.
fn check_plugin_pod(b: &RealBox, pod: &str, seen: &Seen) -> String {
    let p = get(&b.plane, &["get", "pod", pod, "-n", "default"]);
    let a = Assignment::decode(p["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
    let share = &a.containers[0].gpus[0];
    let env = |k: &str| seen.env.get(k).cloned().unwrap_or_default();
    assert_eq!(env("NVIDIA_VISIBLE_DEVICES"), share.uuid.as_str(), "{pod}: {:?}", seen.env);
    assert_eq!(env("GPUSHARE_MEMORY_MIB"), share.mib.get().to_string(), "{pod}");
    assert_eq!(env("CUDA_DEVICE_MEMORY_LIMIT_0"), format!("{}m", share.mib.get()), "{pod}");
    assert_eq!(env("GPUSHARE_POD"), format!("default/{pod}"), "{pod}");
    assert_real_container(pod, seen);
    let gpu = env("NVIDIA_VISIBLE_DEVICES");
    assert_gpu_nodes(pod, seen, &[if gpu == uuid(1) { 1 } else { 0 }]);
    let pipe = pipe_directory(b);
    if gpu == uuid(1) {
        assert_mps_client(pod, seen, &pipe);
        assert_eq!(env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), format!("0={}M", share.mib.get()), "{pod}");
    } else {
        assert_eq!(gpu, uuid(0), "{pod}: a device-plugin GPU");
        assert!(seen.mount(&pipe).is_none() && !seen.env.contains_key("CUDA_MPS_PIPE_DIRECTORY"), "{pod}: {seen:?}");
        assert!(seen.writes[&pipe].contains("no such file or directory"), "{pod}: {:?}", seen.writes);
    }
    gpu
}

/// The process is an MPS client: it was told the pipe directory, sees it mounted read-only, and
/// its own attempt to create a file there failed (it cannot stop the control daemon or replace
/// its sockets, issue 35).
fn assert_mps_client(pod: &str, seen: &Seen, pipe: &str) {
    assert_eq!(seen.env.get("CUDA_MPS_PIPE_DIRECTORY").map(String::as_str), Some(pipe), "{pod}: {:?}", seen.env);
    let mount = seen.mount(pipe).unwrap_or_else(|| panic!("{pod}: {pipe} is not mounted: {:?}", seen.mounts));
    assert!(mount.read_only(), "{pod}: {mount:?}");
    assert!(seen.writes[pipe].contains("read-only file system"), "{pod}: {:?}", seen.writes);
}

/// The process sees the driver's nodes of its GPUs and no other GPU's, made by runc from the
/// node's stand-ins (`[device_nodes]`: through `Allocate`'s device specs or the claim's CDI
/// spec): `/dev/nvidia<minor>` of each (the fake GPU `i` has minor `i`), `nvidiactl`, and
/// `nvidia-uvm`; not `nvidia-uvm-tools`, which the node lacks.
fn assert_gpu_nodes(pod: &str, seen: &Seen, minors: &[u32]) {
    let mut nvidia: Vec<(&str, &str, u32, u32)> = seen
        .devices
        .iter()
        .filter(|d| d.path.starts_with("/dev/nvidia"))
        .map(|d| (d.path.as_str(), d.kind.as_str(), d.major, d.minor))
        .collect();
    nvidia.sort_unstable();
    let gpus: Vec<String> = minors.iter().map(|m| format!("/dev/nvidia{m}")).collect();
    let mut want: Vec<(&str, &str, u32, u32)> =
        gpus.iter().zip(minors).map(|(path, m)| (path.as_str(), "c", 195, *m)).collect();
    want.extend([("/dev/nvidia-uvm", "c", 510, 0), ("/dev/nvidiactl", "c", 195, 255)]);
    want.sort_unstable();
    assert_eq!(nvidia, want, "{pod}/{}: its GPUs' device nodes and the control nodes", seen.container);
}

/// The process ran in a real container: PID 1 of its namespace, on an overlay root, with the
/// kubelet's `/etc/hosts` mounted.
fn assert_real_container(pod: &str, seen: &Seen) {
    assert_eq!(seen.pid, 1, "{pod}/{}: not the first process of its own PID namespace", seen.container);
    assert_eq!(seen.mount("/").map(|m| m.fstype.as_str()), Some("overlay"), "{pod}: {:?}", seen.mounts);
    assert!(seen.mount("/etc/hosts").is_some(), "{pod}: no /etc/hosts from the kubelet: {:?}", seen.mounts);
}

/// A claim for `mib` MiB of the GPU the CEL `expression` selects.
fn claim_where(name: &str, mib: u64, expression: &str) -> Value {
    let mut c = claim(name, mib);
    c["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = json!([{"cel": {"expression": expression}}]);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_containerd_each_process_sees_its_grant_and_a_restart_keeps_them_running() {
    let Some(mut b) = containerd_box().await else { return };
    let pipe = pipe_directory(&b);

    // Device plugin: Allocate's environment and mounts reach each process. 30,000 and 20,000
    // MiB cannot share a GPU, so both GPUs, the MPS one among them, are used.
    wait_registered(&b, 1);
    let plugin = [("cp-a", 6000), ("cp-b", 30000), ("cp-c", 20000)];
    for (name, mib) in plugin {
        b.plane.create(&plugin_pod(name, mib, &pipe)).unwrap();
    }
    wait_bound(&b, &plugin.map(|(n, _)| n.to_owned())).await;
    let mut gpus = Vec::new();
    for (name, _) in plugin {
        let seen = wait_seen(&b, name, &["main"]);
        gpus.push(check_plugin_pod(&b, name, &seen["main"]));
    }
    assert!(gpus.contains(&uuid(0)) && gpus.contains(&uuid(1)), "{gpus:?}");
    // What the kubelet keeps of each answer is the lean set: `GPUSHARE_MEMORY_MIB`, which each
    // process saw, came through NRI.
    let checkpoint = node(&b).kubelet.dirs.device_plugins().join("kubelet_internal_checkpoint");
    let checkpoint: Value = serde_json::from_slice(&std::fs::read(&checkpoint).unwrap()).unwrap();
    let entries = checkpoint["Data"]["PodDeviceEntries"].as_array().unwrap();
    assert_eq!(entries.len(), plugin.len());
    for e in entries {
        let answer = String::from_utf8_lossy(&base64(e["AllocResp"].as_str().unwrap())).into_owned();
        assert!(answer.contains("GPUSHARE_POD") && !answer.contains("GPUSHARE_MEMORY_MIB"), "{answer:?}");
    }

    // A container whose environment names another pod in GPUSHARE_POD (here its own spec's, as
    // a wrong answer would) is refused by gpushared's NRI plugin: containerd fails its creation
    // with gpushared's reason, which the kubelet reports on the pod.
    let mut forged = plugin_pod("cp-forged", 0, &pipe);
    forged["spec"]["containers"][0]["resources"] = json!({});
    forged["spec"]["containers"][0]["env"] = json!([{"name": "GPUSHARE_POD", "value": "default/cp-a"}]);
    b.plane.create(&forged).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let p = get(&b.plane, &["get", "pod", "cp-forged", "-n", "default"]);
        let waiting = &p["status"]["containerStatuses"][0]["state"]["waiting"];
        if waiting["reason"] == "CreateContainerError" {
            let message = waiting["message"].as_str().unwrap_or_default();
            assert!(message.contains("refusing to create container \"main\" of pod default/cp-forged"), "{p}");
            break;
        }
        assert_ne!(p["status"]["phase"], "Running", "a container carrying another pod's answer started: {p}");
        assert!(Instant::now() < deadline, "cp-forged was not refused within 60 s: {p}");
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(node(&b).seen().unwrap().iter().all(|s| s.pod != "cp-forged"));
    b.plane.kubectl(&["delete", "pod", "cp-forged", "-n", "default", "--wait=false"]).unwrap();

    // DRA: containerd resolves each claim's CDI device from the spec gpushared wrote. Both
    // containers of a pod share a plain claim on GPU 2; a claim on the dra-mps GPU 3 makes its
    // container an MPS client through the spec's read-only mount.
    b.plane.create(&claim_where("cc-3500", 3500, r#"device.attributes["gpu.gpushare.io"].index == 2"#)).unwrap();
    b.plane.create(&claim_pod("cd-a", "cc-3500", &["main", "sidecar"])).unwrap();
    b.plane
        .create(&claim_where("cc-mps", 10_240, r#"device.attributes["gpu.gpushare.io"].sharing == "dra-mps""#))
        .unwrap();
    let mut mps_pod = claim_pod("cd-mps", "cc-mps", &["main"]);
    mps_pod["spec"]["containers"][0]["env"] = json!([{"name": "PROBE_WRITE", "value": pipe}]);
    b.plane.create(&mps_pod).unwrap();
    let seen = wait_seen(&b, "cd-a", &["main", "sidecar"]);
    for (container, s) in &seen {
        let env = |k: &str| s.env.get(k).cloned().unwrap_or_default();
        assert_eq!(env("NVIDIA_VISIBLE_DEVICES"), uuid(2), "{container}: {:?}", s.env);
        assert_eq!(env("GPUSHARE_MEMORY_MIB"), "3500", "{container}");
        assert_eq!(env("CUDA_DEVICE_MEMORY_LIMIT_0"), "3500m", "{container}");
        assert_eq!(env("GPUSHARE_GPU_TOTAL_MIB"), GPU_MIB.to_string(), "{container}");
        assert_eq!(env("GPUSHARE_CLAIM"), "default/cc-3500", "{container}");
        assert!(s.mount(&pipe).is_none(), "{container}: {:?}", s.mounts);
        assert_real_container("cd-a", s);
        assert_gpu_nodes("cd-a", s, &[2]);
    }
    let seen = wait_seen(&b, "cd-mps", &["main"]);
    let s = &seen["main"];
    assert_eq!(s.env.get("NVIDIA_VISIBLE_DEVICES"), Some(&uuid(3)), "{:?}", s.env);
    assert_eq!(s.env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").map(String::as_str), Some("0=10240M"), "{:?}", s.env);
    assert_mps_client("cd-mps", s, &pipe);
    assert_gpu_nodes("cd-mps", s, &[3]);

    // containerd killed and started again: the shims keep the containers running, the kubelet
    // starts none of them again, and a pod placed afterwards runs with its grant.
    let before = node(&b).seen().unwrap().len();
    let registered = registrations(&b);
    let n = b.nodes.iter_mut().find(|n| n.name == NODE).unwrap();
    n.runtime.containerd_mut().expect("the box runs containerd").restart().unwrap_or_else(|e| panic!("{e:#}"));
    // gpushared dials the new containerd's NRI again; a container created before it has would
    // get the lean answer alone.
    wait_registered(&b, registered + 1);
    b.plane.create(&plugin_pod("cp-after", 8000, &pipe)).unwrap();
    wait_bound(&b, &["cp-after".to_owned()]).await;
    let seen = wait_seen(&b, "cp-after", &["main"]);
    check_plugin_pod(&b, "cp-after", &seen["main"]);
    let all = node(&b).seen().unwrap();
    assert_eq!(all.len(), before + 1, "a container started again after containerd's restart: {all:#?}");
    for name in ["cp-a", "cp-b", "cp-c", "cd-a", "cd-mps"] {
        let p = get(&b.plane, &["get", "pod", name, "-n", "default"]);
        assert_eq!(p["status"]["phase"], "Running", "{name}: {p}");
        let restarts: Vec<&Value> =
            p["status"]["containerStatuses"].as_array().unwrap().iter().map(|c| &c["restartCount"]).collect();
        assert!(restarts.iter().all(|r| **r == 0), "{name}: {p}");
    }

    on_a_node_that_counts_the_memory(&mut b).await;
    b.shutdown();
}

/// A node whose kubelet counts the memory (`[kubelet] advertise = "capacity"`, MiB mode): gpushared
/// writes the count into its Node's status and registers no device plugin; the kubelet admits
/// each pod by the count and calls no plugin; each container gets the GPU and budget of its
/// assignment as containerd creates it, through gpushared's NRI plugin, with its GPU's device
/// node and the control nodes (`[device_nodes]`), and on the MPS GPU (1) the pipe directory,
/// read-only; a deleted pod's grant is released.
async fn on_a_node_that_counts_the_memory(b: &mut RealBox) {
    const COUNTED: &str = "node-n";
    let gpus: Vec<FakeGpu> = (0..2).map(|i| FakeGpu::new(COUNTED, i, GPU_MIB, "A100-PCIE-40GB")).collect();
    let host = b.plane.dir.join(COUNTED);
    let pipe = host.join("mps-pipe").display().to_string();
    std::fs::create_dir_all(&pipe).unwrap();
    let config = format!(
        "[kubelet]\nadvertise = \"capacity\"\n[sharing]\nmps = [1]\n[mps]\npipe_directory = \"{pipe}\"\n\
         log_directory = \"{log}\"\nenvironment_file = \"{env}\"\n",
        log = host.join("mps-log").display(),
        env = host.join("mps.env").display(),
    );
    // Its containerd requires gpushared's NRI plugin, as docs/gpushared.md configures a counted
    // node's runtime (NRI's default validator, `required_plugins`).
    b.nri_required = vec!["gpushare".to_owned()];
    b.add_node(COUNTED, &gpus, ("", &config)).unwrap_or_else(|e| panic!("{e:#}"));
    b.nri_required.clear();
    b.wait_allocatable(COUNTED, "gpushare.io/gpu-mem", &(2 * GPU_MIB).to_string(), Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let n = b.node(COUNTED).unwrap();
    assert!(
        n.daemon.log().contains("the Node's status carries the GPU memory as a count"),
        "{}",
        n.daemon.log_tail(30)
    );

    let pods = [("cn-a", 6000), ("cn-b", 30000), ("cn-c", 20000)];
    for (name, mib) in pods {
        let mut p = plugin_pod(name, mib, &pipe);
        p["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": COUNTED});
        b.plane.create(&p).unwrap();
    }
    wait_bound(b, &pods.map(|(n, _)| n.to_owned())).await;
    let mut gpus_used = Vec::new();
    for (name, mib) in pods {
        let s = wait_seen_on(b, COUNTED, name, &["main"]).remove("main").unwrap();
        let p = get(&b.plane, &["get", "pod", name, "-n", "default"]);
        assert_eq!(p["spec"]["nodeName"], COUNTED, "{p}");
        let a = Assignment::decode(p["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
        let share = &a.containers[0].gpus[0];
        assert_eq!(share.mib.get(), mib, "{name}: {a:?}");
        let env = |k: &str| s.env.get(k).cloned().unwrap_or_default();
        assert_eq!(env("NVIDIA_VISIBLE_DEVICES"), share.uuid.as_str(), "{name}: {:?}", s.env);
        assert_eq!(env("GPUSHARE_MEMORY_MIB"), mib.to_string(), "{name}");
        assert_eq!(env("CUDA_DEVICE_MEMORY_LIMIT_0"), format!("{mib}m"), "{name}");
        assert_eq!(env("GPUSHARE_POD"), format!("default/{name}"), "{name}");
        assert_real_container(name, &s);
        assert_gpu_nodes(name, &s, &[share.index]);
        if share.index == 1 {
            assert_mps_client(name, &s, &pipe);
            assert_eq!(env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), format!("0={mib}M"), "{name}");
        } else {
            assert!(s.mount(&pipe).is_none() && !s.env.contains_key("CUDA_MPS_PIPE_DIRECTORY"), "{name}: {s:?}");
        }
        gpus_used.push(share.uuid.as_str().to_owned());
    }
    gpus_used.sort_unstable();
    gpus_used.dedup();
    assert_eq!(gpus_used.len(), 2, "30,000 and 20,000 MiB cannot share a 40,960 MiB GPU: {gpus_used:?}");
    // The kubelet called no plugin: its device checkpoint holds no pod.
    let checkpoint = n.kubelet.dirs.device_plugins().join("kubelet_internal_checkpoint");
    if let Ok(raw) = std::fs::read(&checkpoint) {
        let checkpoint: Value = serde_json::from_slice(&raw).unwrap();
        let entries = &checkpoint["Data"]["PodDeviceEntries"];
        assert!(entries.is_null() || entries.as_array().is_some_and(Vec::is_empty), "{checkpoint}");
    }
    // The node state is published after the grants are committed, not with them.
    wait_held(b, COUNTED, &["cn-a", "cn-b", "cn-c"], 30, "after their containers ran");

    // A deleted pod's grant goes back.
    b.plane.kubectl(&["delete", "pod", "cn-b", "-n", "default", "--wait=false"]).unwrap();
    wait_held(b, COUNTED, &["cn-a", "cn-c"], 60, "after cn-b's deletion");

    fails_closed_while_gpushared_is_away(b, COUNTED, &pipe);
}

/// Waits up to `secs` seconds until node `on`'s published state holds grants of exactly the
/// pods `want` (sorted), `when` saying after what in the failure.
fn wait_held(b: &RealBox, on: &str, want: &[&str], secs: u64, when: &str) {
    let held = || -> Vec<String> {
        let mut pods: Vec<String> = b.node_state(on).unwrap().allocations.into_iter().map(|a| a.pod.name).collect();
        pods.sort_unstable();
        pods.dedup();
        pods
    };
    let deadline = Instant::now() + Duration::from_secs(secs);
    while held() != want {
        assert!(
            Instant::now() < deadline,
            "the node state holds grants of {:?}, not {want:?}, {secs} s {when}\n{}",
            held(),
            b.node(on).unwrap().daemon.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// A counted node's containerd requires gpushared's NRI plugin: while gpushared is stopped, a
/// container of a pod bound there is refused (the kubelet reports `CreateContainerError` naming
/// the plugin and retries) rather than created without its grant, with whatever GPUs its image
/// names; once gpushared is back, the kubelet's retry creates it with its grant.
fn fails_closed_while_gpushared_is_away(b: &mut RealBox, counted: &str, pipe: &str) {
    let n = b.nodes.iter_mut().find(|n| n.name == counted).unwrap();
    n.daemon.kill();
    // The extender still places pods there: the daemon's heartbeat is not stale yet.
    let mut p = plugin_pod("cn-d", 8000, pipe);
    p["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": counted});
    p["spec"]["containers"][0]["env"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}));
    b.plane.create(&p).unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    let refusal = loop {
        let pod = get(&b.plane, &["get", "pod", "cn-d", "-n", "default"]);
        let waiting = &pod["status"]["containerStatuses"][0]["state"]["waiting"];
        if waiting["reason"] == "CreateContainerError" {
            break waiting["message"].as_str().unwrap_or_default().to_owned();
        }
        assert!(
            Instant::now() < deadline && pod["status"]["phase"] != "Running",
            "cn-d was not refused while gpushared is away: {pod}\ncontainerd:\n{}",
            b.node(counted).unwrap().runtime.containerd().map(|c| c.log_tail(20)).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    assert!(refusal.contains("required plugin") && refusal.contains("gpushare"), "{refusal}");
    let uid = get(&b.plane, &["get", "pod", "cn-d", "-n", "default"])["metadata"]["uid"].as_str().unwrap().to_owned();
    let started = b.node(counted).unwrap().seen().unwrap();
    assert!(!started.iter().any(|s| s.pod_uid == uid), "cn-d's process ran without gpushared: {started:?}");

    let n = b.nodes.iter_mut().find(|n| n.name == counted).unwrap();
    n.daemon.start().unwrap_or_else(|e| panic!("{e:#}"));
    let s = wait_seen_on(b, counted, "cn-d", &["main"]).remove("main").unwrap();
    let env = |k: &str| s.env.get(k).cloned().unwrap_or_default();
    assert_eq!(env("GPUSHARE_MEMORY_MIB"), "8000", "{:?}", s.env);
    assert_ne!(env("NVIDIA_VISIBLE_DEVICES"), "all", "{:?}", s.env);
    assert_eq!(env("GPUSHARE_POD"), "default/cn-d", "{:?}", s.env);
}
