//! A node reboot on the real-cluster box (issue 36): a node of the real kubelet and gpushared,
//! with device-plugin pods and prepared DRA claims running, loses power. Everything under `/run`
//! goes (the runtime's containers, the CDI specs gpushared wrote), `/var/lib` stays (the
//! kubelet's checkpoints, gpushared's ledger), and a pod is deleted and another bound while the
//! node is down. Once it is up again, every container runs again on its own GPU with its
//! budget; each claim is prepared again before its containers start; the deleted pod holds
//! nothing; the new pod is admitted. It runs twice: on the recording runtime (the grants read
//! from what the runtime created) and on containerd and runc (read from what each new process
//! saw, its containers killed by the power cut). A third test checks the kubelet's side of
//! advertising memory as a count in the node's status: kept across kubelet restarts, gone with
//! the Node.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpushare_core::codec::node::NodeState;
use gpushare_testkit::containerd::PROBE_IMAGE;
use gpushare_testkit::cri::CDI_DIR;
use gpushare_testkit::nvml::FakeGpu;
use gpushare_testkit::peers::NullAsks;
use gpushare_testkit::realbox::{RealNode, Runtime, is_root, repo};
use serde_json::{Value, json};

mod realbox;
use realbox::{RealBox, claim, get, pod, up_on, wait_bound};

/// Container starts per pod name.
type Starts = BTreeMap<String, usize>;

/// How many times each pod's container started since `before` was counted: on the recording
/// runtime, every record it holds (a reboot empties it); on containerd, every report of a
/// process beyond those of `before`.
fn starts_since(b: &RealBox, before: &Starts) -> Starts {
    let n = node(b);
    let mut starts = Starts::new();
    if let Some(r) = n.runtime.recording() {
        for c in r.created() {
            *starts.entry(c.pod).or_default() += 1;
        }
        return starts;
    }
    for s in n.seen().unwrap_or_else(|e| panic!("{e:#}")) {
        *starts.entry(s.pod).or_default() += 1;
    }
    for (pod, count) in before {
        if let Some(now) = starts.get_mut(pod) {
            *now = now.saturating_sub(*count);
        }
    }
    starts.retain(|_, count| *count > 0);
    starts
}

/// What decides a running container's GPU and budget: (`NVIDIA_VISIBLE_DEVICES`,
/// `GPUSHARE_MEMORY_MIB`) of its latest start, as the recording runtime was asked or as the
/// process on containerd saw them.
fn latest_grant(b: &RealBox, pod: &str) -> Option<(String, String)> {
    let n = node(b);
    let grant = |env: &BTreeMap<String, String>| {
        let get = |k: &str| env.get(k).cloned().unwrap_or_default();
        (get("NVIDIA_VISIBLE_DEVICES"), get("GPUSHARE_MEMORY_MIB"))
    };
    if let Some(r) = n.runtime.recording() {
        return r.running().iter().rev().find(|c| c.pod == pod).map(|c| grant(&c.envs));
    }
    let seen = n.seen().unwrap_or_else(|e| panic!("{e:#}"));
    seen.iter().filter(|s| s.pod == pod).max_by_key(|s| s.attempt).map(|s| grant(&s.env))
}

/// Waits until every pod of `names` is Running and its container started since `before`
/// (90 s: a reboot's pods and claims come back together); returns their grants.
fn wait_running(b: &RealBox, names: &[&str], before: &Starts) -> BTreeMap<String, (String, String)> {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let starts = starts_since(b, before);
        let running: Vec<&str> = names
            .iter()
            .copied()
            .filter(|name| {
                starts.contains_key(*name)
                    && get(&b.plane, &["get", "pod", name, "-n", "default"])["status"]["phase"] == "Running"
            })
            .collect();
        if running.len() == names.len() {
            return names.iter().map(|n| ((*n).to_owned(), latest_grant(b, n).unwrap_or_default())).collect();
        }
        assert!(
            Instant::now() < deadline,
            "only {running:?} of {names:?} run after 90 s\nkubelet:\n{}\ngpushared:\n{}",
            node(b).kubelet.proc.log_tail(30),
            node(b).daemon.log_tail(20)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

const NODE: &str = "node-r";
const GPU_MIB: u64 = 40_960;

fn node(b: &RealBox) -> &RealNode {
    b.node(NODE).unwrap()
}

/// A pod of `image` whose one container asks the device plugin for `mib` MiB.
fn plugin_pod(name: &str, mib: u64, image: &str) -> Value {
    let mut p = pod(name, mib);
    p["spec"]["containers"][0]["image"] = image.into();
    p
}

/// The node's published state.
fn state(b: &RealBox) -> NodeState {
    b.node_state(NODE).unwrap_or_else(|e| panic!("{e:#}"))
}

/// The pods gpushared publishes as holding device-plugin memory, and its MiB used per GPU.
fn published(b: &RealBox) -> (Vec<String>, Vec<u64>) {
    let s = state(b);
    let mut pods: Vec<String> = s.allocations.iter().map(|a| a.pod.name.clone()).collect();
    pods.sort();
    pods.dedup();
    (pods, s.used.iter().map(|m| m.get()).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reboot_every_pod_and_claim_comes_back_and_a_deleted_pod_holds_nothing() {
    reboot_on(Runtime::Recording, "registry.example/app:1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reboot_on_containerd_every_process_comes_back_with_its_grant() {
    reboot_on(Runtime::Containerd, PROBE_IMAGE).await;
}

/// The reboot on `runtime`, its pods of `image`.
async fn reboot_on(runtime: Runtime, image: &str) {
    if !is_root() {
        gpushare_testkit::skip_unless_ci("the real kubelet needs root (it runs in a mount namespace of its own)");
        return;
    }
    let Some(mut b) = up_on("gpushare-scheduler-config.yaml", "", runtime).await else { return };
    if b.plane.minor < gpushare_testkit::realkube::DRA_MINOR {
        eprintln!(
            "skipped: the claims consume memory with DRAConsumableCapacity, on by default from Kubernetes 1.36 (this is 1.{})",
            b.plane.minor
        );
        return;
    }
    b.plane.apply(&repo().join("etc/kubernetes/gpushare-deviceclass.yaml")).unwrap_or_else(|e| panic!("{e:#}"));
    // Four 40 GB GPUs: 0 and 1 shared through the device plugin, 2 and 3 through DRA.
    let gpus: Vec<FakeGpu> = (0..4).map(|i| FakeGpu::new(NODE, i, GPU_MIB, "A100-PCIE-40GB")).collect();
    let config = b.dra_config(NODE, &[2, 3]);
    b.add_node(NODE, &gpus, ("", &config)).unwrap_or_else(|e| panic!("{e:#}"));
    b.wait_allocatable(NODE, "gpushare.io/gpu-mem", "81920", Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e:#}"));

    let plugin_pods = ["p-0", "p-1", "p-2", "p-3"];
    let claim_pods = ["d-0", "d-1", "d-2", "d-3"];
    for name in plugin_pods {
        b.plane.create(&plugin_pod(name, 10_000, image)).unwrap();
    }
    for name in claim_pods {
        b.plane.create(&claim(&format!("c-{name}"), 6000)).unwrap();
        b.plane.create(&realbox::claim_pod(name, &format!("c-{name}"), &["main"], image)).unwrap();
    }
    let all: Vec<&str> = plugin_pods.iter().chain(&claim_pods).copied().collect();
    let before = wait_running(&b, &all, &Starts::new());
    let starts_before = starts_since(&b, &Starts::new());
    for (p, (gpu, mib)) in &before {
        assert!(!gpu.is_empty(), "{p} runs with no GPU");
        assert_eq!(mib, if p.starts_with('p') { "10000" } else { "6000" }, "{p}");
    }
    let cdi = node(&b).host.join("cri").join(CDI_DIR);
    let specs = || std::fs::read_dir(&cdi).map_or(0, |d| d.filter_map(Result::ok).count());
    assert_eq!(specs(), 4, "a CDI spec per prepared claim");

    // The power goes. While the node is down, p-3 is deleted for good (as the pod garbage
    // collector or an operator with --force would) and p-4 is bound to the node.
    b.reboot(NODE, |plane| {
        plane.kubectl(&["delete", "pod", "p-3", "-n", "default", "--grace-period=0", "--force"])?;
        plane.create(&plugin_pod("p-4", 10_000, image))
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    wait_bound(&b, &["p-4".to_owned()]).await;

    // Every pod runs again, on the GPU and with the budget it had; none failed admission.
    let after_names: Vec<&str> = ["p-0", "p-1", "p-2", "p-4"].iter().chain(&claim_pods).copied().collect();
    let after = wait_running(&b, &after_names, &starts_before);
    for (p, grant) in &after {
        if let Some(had) = before.get(p) {
            assert_eq!(grant, had, "{p} came back with another grant");
        }
    }
    assert_eq!(after["p-4"].1, "10000");
    // Each container was started once since the boot (the power cut killed the others): the
    // claims were prepared again (their specs are back) before the runtime created their
    // containers.
    let starts = starts_since(&b, &starts_before);
    let want: Starts = after_names.iter().map(|p| ((*p).to_owned(), 1)).collect();
    assert_eq!(starts, want, "container starts since the boot");
    assert_eq!(specs(), 4, "the CDI specs were not written again");

    // The ledger holds the running pods and claims, and nothing for p-3: the kubelet no
    // longer lists it, and once the rows' grace period (30 s from the allocation) is over,
    // gpushared reconciles and releases them.
    let mut want_used = vec![0u64; 4];
    for (gpu, mib) in after.values() {
        let index = gpus.iter().position(|g| g.uuid == *gpu).unwrap_or_else(|| panic!("unknown GPU {gpu}"));
        want_used[index] += mib.parse::<u64>().unwrap();
    }
    let want_pods: Vec<String> = ["p-0", "p-1", "p-2", "p-4"].map(str::to_owned).to_vec();
    let deadline = Instant::now() + Duration::from_secs(45);
    loop {
        let (pods, used) = published(&b);
        if pods == want_pods && used == want_used {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "gpushared publishes {pods:?} using {used:?}, not {want_pods:?} using {want_used:?}\n{}",
            node(&b).daemon.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(state(&b).claims.len(), 4, "{:?}", state(&b).claims);
    b.shutdown();
}

/// The resource of the count patched into the node's status; no plugin serves it.
const COUNTED: &str = "example.com/counted";

/// How many times the kubelet logged `what`.
fn kubelet_said(b: &RealBox, node_name: &str, what: &str) -> usize {
    b.node(node_name).unwrap().kubelet.proc.log().matches(what).count()
}

/// Waits until the kubelet logged `what` `times` times.
fn wait_kubelet_said(b: &RealBox, node_name: &str, what: &str, times: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while kubelet_said(b, node_name, what) < times {
        assert!(
            Instant::now() < deadline,
            "the kubelet did not log {what:?} {times} times in 60 s:\n{}",
            b.node(node_name).unwrap().kubelet.proc.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// What serving MiB mode's memory as a count in the node's status (rather than a device per
/// MiB; BENCHMARKS.md, "MiB mode's memory as a counted resource") rests on, on the real
/// kubelet: a count patched into the node's status stays there across a kubelet restart and a
/// boot with the device-plugin directory emptied, and is gone with a Node deleted and
/// registered anew, whose advertiser must then write it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_count_in_the_nodes_status_outlives_kubelet_restarts_not_a_new_node() {
    const COUNT_NODE: &str = "node-count";
    if !is_root() {
        gpushare_testkit::skip_unless_ci("the real kubelet needs root (it runs in a mount namespace of its own)");
        return;
    }
    let Some(mut b) = up_on("gpushare-scheduler-config.yaml", "", Runtime::Recording).await else { return };
    // The node's plugin serves one device of another resource: the kubelet's device manager
    // then keeps a checkpoint, as on every node that runs one.
    b.add_null_plugin_node(COUNT_NODE, "example.com/gib", 1, NullAsks::Nothing).unwrap_or_else(|e| panic!("{e:#}"));
    let path = format!("/status/capacity/{}", COUNTED.replace('/', "~1"));
    let patch = json!([{"op": "add", "path": path, "value": "131072"}]).to_string();
    b.plane.kubectl(&["patch", "node", COUNT_NODE, "--subresource=status", "--type=json", "-p", &patch]).unwrap();
    b.wait_allocatable(COUNT_NODE, COUNTED, "131072", Duration::from_secs(60)).unwrap_or_else(|e| panic!("{e:#}"));
    // The plugin's device reaches the kubelet apart from the patched count, and the device
    // manager writes its checkpoint as it takes the device: wait for both, not for the count.
    b.wait_allocatable(COUNT_NODE, "example.com/gib", "1", Duration::from_secs(60)).unwrap_or_else(|e| panic!("{e:#}"));
    let checkpoint = b.node(COUNT_NODE).unwrap().kubelet.dirs.device_plugins().join("kubelet_internal_checkpoint");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !checkpoint.exists() {
        assert!(Instant::now() < deadline, "no device checkpoint at {} after 30 s", checkpoint.display());
        std::thread::sleep(Duration::from_millis(100));
    }

    // A restart: the kubelet finds its node registered and keeps the count.
    let registered = "Successfully registered node";
    let before = kubelet_said(&b, COUNT_NODE, registered);
    let n = b.nodes.iter_mut().find(|n| n.name == COUNT_NODE).unwrap();
    n.kubelet.restart(&b.plane).unwrap_or_else(|e| panic!("{e:#}"));
    wait_kubelet_said(&b, COUNT_NODE, registered, before + 1);
    assert_eq!(b.allocatable(COUNT_NODE, COUNTED).unwrap(), "131072");
    let zeroed = "Zero out resource capacity in existing node";
    assert_eq!(kubelet_said(&b, COUNT_NODE, zeroed), 0);

    // Booted with its device-plugin directory emptied (a node whose /var/lib/kubelet was
    // wiped): its device manager would zero every extended resource when it finds no
    // checkpoint, but it counts every file of that directory as one, its own registration
    // socket among them, made before the node registers; the count stays. (The plugin is
    // stopped first, so that it does not register again and write a checkpoint.)
    let n = b.nodes.iter_mut().find(|n| n.name == COUNT_NODE).unwrap();
    n.kubelet.halt();
    n.daemon.kill();
    let dir = checkpoint.parent().unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        std::fs::remove_file(entry.unwrap().path()).unwrap();
    }
    n.kubelet.boot(&b.plane).unwrap_or_else(|e| panic!("{e:#}"));
    wait_kubelet_said(&b, COUNT_NODE, registered, before + 2);
    assert!(!checkpoint.exists(), "{} was written again", checkpoint.display());
    assert_eq!(b.allocatable(COUNT_NODE, COUNTED).unwrap(), "131072");
    assert_eq!(kubelet_said(&b, COUNT_NODE, zeroed), 0);

    // A Node deleted and registered anew has none: whoever advertises the count writes it again.
    let n = b.nodes.iter_mut().find(|n| n.name == COUNT_NODE).unwrap();
    n.kubelet.halt();
    b.plane.kubectl(&["delete", "node", COUNT_NODE]).unwrap();
    let n = b.nodes.iter_mut().find(|n| n.name == COUNT_NODE).unwrap();
    n.kubelet.boot(&b.plane).unwrap_or_else(|e| panic!("{e:#}"));
    wait_kubelet_said(&b, COUNT_NODE, registered, before + 3);
    assert_eq!(b.allocatable(COUNT_NODE, COUNTED).unwrap(), "");
    b.shutdown();
}
