//! Faults and preemption on the real cluster with real kubelets: the extender killed while pods
//! wait, the API server down for 10 s, kube-scheduler killed, a node whose gpushared hung or
//! died, and GPU holders preempted by a pod of higher priority. Two nodes, each the real kubelet (on containerd and runc) and gpushared on two T4s. After
//! each fault the invariants are checked from the outside: every pod that is bound runs on its
//! node with the GPU and budget of its assignment, no container is created twice, no GPU holds
//! more than it has, and each gpushared publishes exactly the pods of its node.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_testkit::cluster::http_get;
use gpushare_testkit::nvml::FakeGpu;
use gpushare_testkit::realbox::{Runtime, is_root};
use serde_json::{Value, json};

mod realbox;
use realbox::{RealBox, get, live_named, pod, preempt_calls, priority_classes, up_on, wait_bound};

const NODES: [&str; 2] = ["fa-a", "fa-b"];
const T4: u64 = 15360;

/// The real-cluster box with two nodes of the real kubelet and gpushared on two T4s each
/// (`config_extra` added to each gpushared.toml), once each kubelet reports their memory.
async fn two_nodes(config_extra: &str) -> Option<RealBox> {
    if !is_root() {
        gpushare_testkit::skip_unless_ci("the real kubelet needs root (it runs in a mount namespace of its own)");
        return None;
    }
    let mut b = up_on("gpushare-scheduler-config.yaml", "", Runtime::Containerd).await?;
    for node in NODES {
        let gpus = [FakeGpu::new(node, 0, T4, "Tesla T4"), FakeGpu::new(node, 1, T4, "Tesla T4")];
        b.add_node(node, &gpus, ("", config_extra)).unwrap_or_else(|e| panic!("{e:#}"));
    }
    for node in NODES {
        b.wait_allocatable(node, "gpushare.io/gpu-mem", &(2 * T4).to_string(), Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e:#}"));
    }
    Some(b)
}

/// A pod of `mib` that only `node` may take.
fn pod_on(name: &str, mib: u64, node: &str) -> Value {
    let mut p = pod(name, mib);
    p["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": node});
    p
}

fn create(b: &RealBox, pods: &[Value]) -> Vec<String> {
    for p in pods {
        b.plane.create(p).unwrap();
    }
    pods.iter().map(|p| p["metadata"]["name"].as_str().unwrap().to_owned()).collect()
}

/// Waits until each of `names` is Running with its container running on its node; then checks
/// the invariants over every pod there is ([`check`]).
fn wait_running(b: &RealBox, names: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pods = get(&b.plane, &["get", "pods", "-n", "default"]);
        let items = pods["items"].as_array().unwrap();
        let ready = names.iter().all(|name| {
            items.iter().any(|p| {
                let Some(node) = p["spec"]["nodeName"].as_str().and_then(|n| b.node(n)) else { return false };
                p["metadata"]["name"] == name.as_str()
                    && p["status"]["phase"] == "Running"
                    && node.running().unwrap().iter().any(|c| &c.pod == name)
            })
        });
        if ready {
            check(b);
            return;
        }
        let logs: Vec<String> =
            b.nodes.iter().map(|n| format!("gpushared {}:\n{}", n.name, n.daemon.log_tail(20))).collect();
        assert!(Instant::now() < deadline, "not all of {names:?} run after 60 s\npods: {pods}\n{}", logs.join("\n"));
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The invariants over every bound pod that has not ended: its one container created once, on
/// its node, with the GPU and budget of its assignment; no GPU over its total; each gpushared
/// publishing (soon) exactly those pods of its node.
fn check(b: &RealBox) {
    let pods = get(&b.plane, &["get", "pods", "-n", "default"]);
    let mut per_gpu: BTreeMap<String, u64> = BTreeMap::new();
    let mut per_node: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for p in pods["items"].as_array().unwrap() {
        let Some(node) = p["spec"]["nodeName"].as_str() else { continue };
        // A pod whose containers ended (a preempted victim before its kubelet removes it) holds
        // nothing.
        if matches!(p["status"]["phase"].as_str(), Some("Failed" | "Succeeded")) {
            continue;
        }
        let name = p["metadata"]["name"].as_str().unwrap();
        let a = Assignment::decode(p["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
        let share = &a.containers[0].gpus[0];
        assert!(share.uuid.as_str().contains(node), "{name} on {node} assigned {}", share.uuid.as_str());
        *per_gpu.entry(share.uuid.as_str().to_owned()).or_default() += share.mib.get();
        per_node.entry(node.to_owned()).or_default().push(name.to_owned());
        let created: Vec<_> = b.nodes.iter().flat_map(|n| n.started().unwrap()).filter(|c| c.pod == name).collect();
        if p["status"]["phase"] != "Running" {
            continue;
        }
        assert_eq!(created.len(), 1, "{name}: containers created {created:?}");
        let env = |k: &str| created[0].envs.get(k).cloned().unwrap_or_default();
        assert_eq!(env("NVIDIA_VISIBLE_DEVICES"), share.uuid.as_str(), "{name}");
        assert_eq!(env("GPUSHARE_MEMORY_MIB"), share.mib.get().to_string(), "{name}");
        assert!(
            b.node(node).unwrap().running().unwrap().iter().any(|c| c.pod == name),
            "{name} does not run on {node}"
        );
    }
    for (gpu, mib) in &per_gpu {
        let who: Vec<String> = pods["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                format!(
                    "{} {} deleting={} {}",
                    p["metadata"]["name"],
                    p["status"]["phase"],
                    p["metadata"]["deletionTimestamp"],
                    p["metadata"]["annotations"][ASSIGNMENT_KEY]
                )
            })
            .collect();
        assert!(*mib <= T4, "{gpu} holds {mib} MiB of {T4}:\n{}", who.join("\n"));
    }
    for node in &b.nodes {
        let mut want = per_node.remove(&node.name).unwrap_or_default();
        want.sort();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let state = b.node_state(&node.name).unwrap();
            let mut held: Vec<String> = state.allocations.iter().map(|a| a.pod.name.clone()).collect();
            held.sort();
            held.dedup();
            if held == want {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "gpushared on {} publishes {held:?}, not {want:?}\n{}",
                node.name,
                node.daemon.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

/// The pods that wait unbound, of `names`, checked over `secs` seconds.
fn stays_unbound(b: &RealBox, names: &[String], secs: u64) {
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        for name in names {
            let p = get(&b.plane, &["get", "pod", name, "-n", "default"]);
            assert!(p["spec"]["nodeName"].is_null(), "{name} was bound: {}", p["spec"]);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extender_killed_and_the_control_plane_down_lose_nothing_on_real_kubelets() {
    let Some(mut b) = two_nodes("").await else { return };
    let first = create(&b, &[pod("f-1", 6000), pod("f-2", 7000), pod("f-3", 5000), pod("f-4", 4000)]);
    wait_bound(&b, &first).await;
    wait_running(&b, &first);

    // The extender SIGKILLed: kube-scheduler cannot reach it (the shipped configuration makes it
    // not ignorable), so new pods wait rather than land unchecked; once it is back they are
    // placed, admitted and run on the GPUs of their assignments.
    b.extender.kill();
    let second = create(&b, &[pod("f-5", 8000), pod("f-6", 3000)]);
    stays_unbound(&b, &second, 3);
    b.extender.kill_and_restart().unwrap();
    wait_bound(&b, &second).await;
    wait_running(&b, &second);

    // kube-apiserver down for 10 s, then kube-scheduler SIGKILLed and started again: the
    // kubelets and gpushared keep every pod running, nothing is created twice, and the next
    // pods are placed and admitted.
    let running = b.nodes.iter().map(|n| n.running().unwrap().len()).sum::<usize>();
    b.plane.apiserver.kill();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(b.nodes.iter().map(|n| n.running().unwrap().len()).sum::<usize>(), running, "containers stopped");
    b.plane.apiserver.kill_and_restart().unwrap();
    b.plane.wait_ready(Duration::from_secs(60)).unwrap();
    b.plane.scheduler.as_mut().unwrap().kill_and_restart().unwrap();
    let third = create(&b, &[pod("f-7", 6000), pod("f-8", 2000)]);
    wait_bound(&b, &third).await;
    let all: Vec<String> = first.iter().chain(&second).chain(&third).cloned().collect();
    wait_running(&b, &all);

    for n in &mut b.nodes {
        assert!(n.daemon.exited().is_none(), "gpushared on {} exited:\n{}", n.name, n.daemon.log_tail(30));
    }
    assert!(b.extender.exited().is_none(), "the extender exited:\n{}", b.extender.log_tail(30));
}

/// Whether the extender's metrics call `node` stale.
async fn stale(b: &RealBox, node: &str) -> bool {
    let (_, metrics) = http_get(b.observe, "/metrics").await.unwrap_or_default();
    metrics.contains(&format!("gpushare_node_stale{{node=\"{node}\"}} 1"))
}

/// The `PodScheduled` condition's message of pod `name`.
fn why_waiting(b: &RealBox, name: &str) -> String {
    let p = get(&b.plane, &["get", "pod", name, "-n", "default"]);
    let conditions = p["status"]["conditions"].as_array().cloned().unwrap_or_default();
    let scheduled = conditions.iter().find(|c| c["type"] == "PodScheduled");
    scheduled.and_then(|c| c["message"].as_str()).unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_gpushared_hung_or_died_takes_no_new_pod_until_it_is_back() {
    // A heartbeat every second: a node is stale after 3 s of silence.
    let Some(mut b) = two_nodes("[kubernetes]\nheartbeat_seconds = 1\n").await else { return };
    let (sick, well) = (NODES[0], NODES[1]);
    let mut all = create(&b, &[pod_on("d-1", 6000, sick)]);
    wait_bound(&b, &all).await;
    wait_running(&b, &all);

    // gpushared hung (SIGSTOP): its device plugin stream stays open, so the kubelet still lists
    // the node's memory as allocatable; only its silent heartbeat tells. The extender calls the
    // node stale: a pod that may go anywhere goes to the other node, one that may only go there
    // waits with the extender's reason, and d-1 runs on.
    b.nodes[0].daemon.signal("STOP").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !stale(&b, sick).await {
        assert!(Instant::now() < deadline, "the extender never called {sick} stale:\n{}", b.extender.log_tail(30));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let anywhere = create(&b, &[pod("d-2", 5000)]);
    let bound = wait_bound(&b, &anywhere).await;
    assert_eq!(bound[0]["spec"]["nodeName"], well, "d-2 went to the node whose gpushared hangs");
    let pinned = create(&b, &[pod_on("d-3", 5000, sick)]);
    stays_unbound(&b, &pinned, 4);
    let reason = why_waiting(&b, "d-3");
    assert!(reason.contains("has not renewed"), "{reason}");
    assert!(b.node(sick).unwrap().running().unwrap().iter().any(|c| c.pod == "d-1"), "d-1 stopped running");

    // Going on (SIGCONT): it renews its heartbeat, the extender takes the node back, and d-3 is
    // placed there and admitted.
    b.nodes[0].daemon.signal("CONT").unwrap();
    wait_bound(&b, &pinned).await;
    all.extend(anywhere.into_iter().chain(pinned));
    wait_running(&b, &all);

    // gpushared killed: its stream ends and the kubelet marks every device of it unhealthy at
    // once, so the node's allocatable is 0 and kube-scheduler itself keeps new pods off; the
    // running pods run on. Started again, it registers, the allocatable is back, and the waiting
    // pod is placed and admitted.
    b.nodes[0].daemon.kill();
    b.wait_allocatable(sick, "gpushare.io/gpu-mem", "0", Duration::from_secs(30)).unwrap_or_else(|e| panic!("{e:#}"));
    let pinned = create(&b, &[pod_on("d-4", 2000, sick)]);
    stays_unbound(&b, &pinned, 3);
    let reason = why_waiting(&b, "d-4");
    assert!(reason.contains("Insufficient gpushare.io/gpu-mem"), "{reason}");
    let running = b.node(sick).unwrap().running().unwrap();
    assert!(["d-1", "d-3"].iter().all(|n| running.iter().any(|c| c.pod == *n)), "{running:?}");
    b.nodes[0].daemon.kill_and_restart().unwrap();
    wait_bound(&b, &pinned).await;
    all.extend(pinned);
    wait_running(&b, &all);
    assert!(!stale(&b, sick).await, "{sick} still stale");
}

/// Preemption under real kubelets: lower-priority pods fill a node's two T4s; a pod of higher
/// priority that only that node may take makes kube-scheduler ask the extender's `preempt`,
/// delete the victims it names; their kubelet stops them, gpushared releases their memory, and
/// the pod is placed and admitted in the room they left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn higher_priority_pods_preempt_gpu_holders_under_real_kubelets() {
    let Some(b) = two_nodes("").await else { return };
    let node = NODES[0];
    priority_classes(&b);
    let with_priority = |name: &str, mib: u64, class: &str| {
        let mut p = pod_on(name, mib, node);
        p["spec"]["priorityClassName"] = json!(class);
        p["spec"]["terminationGracePeriodSeconds"] = json!(1);
        p
    };
    // 15,000 of each GPU's 15,360 MiB held.
    let low: Vec<Value> = (0..6).map(|i| with_priority(&format!("low-{i}"), 5000, "low")).collect();
    let low = create(&b, &low);
    wait_bound(&b, &low).await;
    wait_running(&b, &low);

    // 8,000 MiB on one GPU needs two of the three there gone.
    let urgent = create(&b, &[with_priority("urgent", 8000, "high")]);
    wait_bound(&b, &urgent).await;
    wait_running(&b, &urgent);
    // kube-scheduler picks its victims for the node's total (two are enough there), not per
    // GPU; where its two sit on different GPUs, the extender adds the one more that makes room
    // on one GPU (the daemon tells look-alikes apart, so the six were not bound beside one
    // another one at a time, and their GPUs follow the order of binding).
    let left = live_named(&b, "low-");
    assert!((3..=4).contains(&left.len()), "two victims, or three when two GPUs held them: {left:?}");
    let running = b.node(node).unwrap().running().unwrap();
    assert_eq!(running.len(), left.len() + 1, "{running:?}");
    assert!(preempt_calls(&b).await >= 1, "the extender's preempt was never called");
}
