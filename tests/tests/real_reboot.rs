//! A node reboot on the real-cluster box (issue 36): a node of the real kubelet and gpushared,
//! with device-plugin pods and prepared DRA claims running, loses power. Everything under `/run`
//! goes (the runtime's containers, the CDI specs gpushared wrote), `/var/lib` stays (the
//! kubelet's checkpoints, gpushared's ledger), and a pod is deleted and another bound while the
//! node is down. Once it is up again, every container runs again on its own GPU with its
//! budget, read from what the runtime created; each claim is prepared again before its
//! containers start; the deleted pod holds nothing; the new pod is admitted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpushare_core::codec::node::NodeState;
use gpushare_testkit::cri::{CDI_DIR, Created};
use gpushare_testkit::nvml::FakeGpu;
use gpushare_testkit::realbox::{RealNode, is_root, repo};
use serde_json::{Value, json};

mod realbox;
use realbox::{RealBox, claim, pod, up, wait_bound};

/// Waits until `names` run on the node (90 s: a reboot's pods and claims come back together).
fn wait_running(b: &RealBox, names: &[&str]) -> BTreeMap<String, Created> {
    realbox::wait_running(b, NODE, names, Duration::from_secs(90))
}

const NODE: &str = "node-r";
const GPU_MIB: u64 = 40_960;

fn node(b: &RealBox) -> &RealNode {
    b.node(NODE).unwrap()
}

/// A pod whose one container uses the claim `claim`.
fn claim_pod(name: &str, claim: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"automountServiceAccountToken": false,
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                 "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "infinity"],
                                 "resources": {"claims": [{"name": "gpu"}]}}]},
    })
}

/// What a container was given that decides its GPU and budget.
fn grant(c: &Created) -> (String, String) {
    let env = |k: &str| c.envs.get(k).cloned().unwrap_or_default();
    (env("NVIDIA_VISIBLE_DEVICES"), env("GPUSHARE_MEMORY_MIB"))
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
    if !is_root() {
        gpushare_testkit::skip_unless_ci("the real kubelet needs root (it runs in a mount namespace of its own)");
        return;
    }
    let Some(mut b) = up().await else { return };
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
        b.plane.create(&pod(name, 10_000)).unwrap();
    }
    for name in claim_pods {
        b.plane.create(&claim(&format!("c-{name}"), 6000)).unwrap();
        b.plane.create(&claim_pod(name, &format!("c-{name}"))).unwrap();
    }
    let all: Vec<&str> = plugin_pods.iter().chain(&claim_pods).copied().collect();
    let before: BTreeMap<String, (String, String)> =
        wait_running(&b, &all).iter().map(|(p, c)| (p.clone(), grant(c))).collect();
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
        plane.create(&pod("p-4", 10_000))
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        node(&b).runtime.recording().unwrap().created().is_empty(),
        "the runtime kept containers across the reboot"
    );
    wait_bound(&b, &["p-4".to_owned()]).await;

    // Every pod runs again, on the GPU and with the budget it had; none failed admission.
    let after_names: Vec<&str> = ["p-0", "p-1", "p-2", "p-4"].iter().chain(&claim_pods).copied().collect();
    let after = wait_running(&b, &after_names);
    for (p, c) in &after {
        if let Some(had) = before.get(p) {
            assert_eq!(&grant(c), had, "{p} came back with another grant");
        }
    }
    assert_eq!(grant(&after["p-4"]).1, "10000");
    // Each container was created once since the boot: the claims were prepared again (their
    // specs are back) before the runtime created their containers.
    assert_eq!(
        node(&b).runtime.recording().unwrap().created().len(),
        after_names.len(),
        "{:?}",
        node(&b).runtime.recording().unwrap().created()
    );
    assert_eq!(specs(), 4, "the CDI specs were not written again");

    // The ledger holds the running pods and claims, and nothing for p-3: the kubelet no
    // longer lists it, and once the rows' grace period (30 s from the allocation) is over,
    // gpushared reconciles and releases them.
    let mut want_used = vec![0u64; 4];
    for c in after.values() {
        let (gpu, mib) = grant(c);
        let index = gpus.iter().position(|g| g.uuid == gpu).unwrap_or_else(|| panic!("unknown GPU {gpu}"));
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
