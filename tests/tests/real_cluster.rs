//! gpushare under the real Kubernetes control plane: etcd, kube-apiserver with Node and RBAC
//! authorization, and kube-scheduler loading the shipped configuration, built from Go modules
//! (`tests/kube/build`). The extender runs as the user the shipped `ClusterRole` binds
//! (`etc/kubernetes/gpushare-extender-rbac.yaml`), so the test proves it needs no more. The
//! nodes are API-only (Node objects with their daemon's published state, no kubelet): the real
//! scheduler filters, prioritizes and binds through the extender, and every bound pod carries
//! an assignment that fits its node's GPUs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_core::codec::heartbeat::{HEARTBEAT_KEY, Heartbeat};
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_testkit::cluster::Proc;
use gpushare_testkit::kubelet::{ContainerSpec, Kubelet};
use gpushare_testkit::nvml::FakeGpu;
use serde_json::json;

mod realbox;
use realbox::{
    RealBox, get, live_named, node, pod, preempt_calls, priority_classes, ready_status, start_gpushared, up, wait_bound,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_scheduler_places_gpu_pods_through_the_extender() {
    let Some(mut b) = up().await else { return };
    for (name, model, mib, count) in [("node-a", "Tesla T4", 15360, 2), ("node-b", "NVIDIA A10", 24576, 1)] {
        let (object, status) = node(name, model, mib, count);
        b.plane.add_api_only_node(&object, &status).unwrap();
    }
    let plane = &b.plane;
    // One pod that fits no GPU: node-b lacks the memory in all (the scheduler's own check),
    // node-a has it only across its two GPUs (the extender's). Then five that fit (15,360 +
    // 15,360 + 24,576 MiB of GPUs).
    plane.create(&pod("too-big", 25_000)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let condition = loop {
        let too_big = get(plane, &["get", "pod", "too-big", "-n", "default"]);
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

    let names: Vec<String> = (0..sizes.len()).map(|i| format!("fits-{i}")).collect();
    let bound = wait_bound(&b, &names).await;

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

    let too_big = get(plane, &["get", "pod", "too-big", "-n", "default"]);
    assert!(too_big["spec"]["nodeName"].is_null(), "too-big was bound");
    b.extender.kill();
}

/// node-a as a kubelet would register it (its allocatable the device plugin's devices), with
/// the kubelet stand-in and gpushared on two fake 15,360 MiB T4s, authenticated as the node.
async fn start_node(b: &RealBox) -> (Kubelet, Proc) {
    let dir = b.plane.dir.clone();
    // The Node as a kubelet registers it, its allocatable the device plugin's devices.
    let status = ready_status("30720");
    b.plane
        .add_api_only_node(&json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}}), &status)
        .unwrap();

    let host = dir.join("node-a");
    let plugin_dir = host.join("device-plugins");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let pod_resources = host.join("pod-resources/kubelet.sock");
    let kubelet = Kubelet::start_with_pod_resources(&plugin_dir, &pod_resources).await.unwrap();
    let gpus = [FakeGpu::new("node-a", 0, 15360, "Tesla T4"), FakeGpu::new("node-a", 1, 15360, "Tesla T4")];
    let daemon = start_gpushared(&b.plane, "node-a", &host, (&plugin_dir, &pod_resources), &gpus, ("", "")).unwrap();
    kubelet
        .wait_registered(1, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", daemon.log_tail(40)));
    (kubelet, daemon)
}

/// Creates pods of (name, MiB), waits until the real scheduler bound them through the
/// extender, and admits each with the kubelet stand-in, checking that its container gets the
/// GPU of its assignment. Returns the names.
async fn place_and_admit(b: &RealBox, kubelet: &Kubelet, daemon: &Proc, pods: &[(&str, u64)]) -> Vec<String> {
    let sizes: Vec<(String, u64)> = pods.iter().map(|(n, m)| ((*n).to_owned(), *m)).collect();
    for (name, mib) in &sizes {
        b.plane.create(&pod(name, *mib)).unwrap();
    }
    let names: Vec<String> = sizes.iter().map(|(n, _)| n.clone()).collect();
    let bound = wait_bound(b, &names).await;
    for p in &bound {
        let name = p["metadata"]["name"].as_str().unwrap();
        let mib = sizes.iter().find(|(n, _)| n == name).unwrap().1;
        let assignment = Assignment::decode(p["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let admitted = loop {
            let spec = [ContainerSpec::app("main", usize::try_from(mib).unwrap())];
            match kubelet.admit_pod("default", name, &spec).await {
                Ok(mut a) => break a.remove(0),
                Err(e) if Instant::now() < deadline && format!("{e:#}").contains("no pod bound") => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("{name}: {e:#}\n{}", daemon.log_tail(40)),
            }
        };
        let uuid = assignment.containers[0].gpus[0].uuid.as_str();
        assert_eq!(admitted.envs.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str), Some(uuid), "{name}");
    }
    names
}

/// Waits until node-a's daemon publishes every pod of `names` as holding memory, and checks
/// that no GPU is published over its total.
async fn wait_published(b: &RealBox, daemon: &Proc, names: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let node = get(&b.plane, &["get", "node", "node-a"]);
        let state = NodeState::decode(node["metadata"]["annotations"][NODE_STATE_KEY].as_str().unwrap()).unwrap();
        let held: Vec<&str> = state.allocations.iter().map(|a| a.pod.name.as_str()).collect();
        if names.iter().all(|n| held.contains(&n.as_str())) {
            for (i, g) in state.inventory.gpus().iter().enumerate() {
                assert!(state.used[i] <= g.total, "GPU{i}: {} of {}", state.used[i], g.total);
            }
            break;
        }
        assert!(Instant::now() < deadline, "published {held:?}:\n{}", daemon.log_tail(40));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// gpushared authenticated as its node (`system:node:node-a`, the Node authorizer and
/// `NodeRestriction` in force) publishes its GPUs on its Node, watches the pods bound there,
/// and serves the kubelet (the stand-in) the GPUs the real scheduler and the extender chose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpushared_as_its_node_serves_the_pods_the_real_scheduler_placed() {
    let Some(mut b) = up().await else { return };
    let (kubelet, daemon) = start_node(&b).await;

    // Its GPUs and heartbeat on its Node, written with the node's own credentials.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let node = get(&b.plane, &["get", "node", "node-a"]);
        let annotations = &node["metadata"]["annotations"];
        if let (Some(state), Some(_)) = (annotations[NODE_STATE_KEY].as_str(), annotations[HEARTBEAT_KEY].as_str()) {
            assert_eq!(NodeState::decode(state).unwrap().inventory.gpus().len(), 2);
            break;
        }
        assert!(Instant::now() < deadline, "node-a's state not published:\n{}", daemon.log_tail(40));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Two pods, placed by the real scheduler through the extender, admitted by the kubelet
    // stand-in with the GPU of each assignment, and published as held.
    let names = place_and_admit(&b, &kubelet, &daemon, &[("train", 10_000), ("serve", 8_000)]).await;
    wait_published(&b, &daemon, &names).await;
    let log = daemon.log();
    assert!(!log.contains("forbidden"), "the daemon was refused something:\n{log}");
    b.extender.kill();
}

/// Preemption with the real scheduler: GPU holders of lower priority make room for a pod of
/// higher priority. The scheduler asks the extender's `preempt` which victims free the GPU
/// memory, deletes them, and places the pod once they are gone (the test plays the kubelet of
/// the API-only node and removes pods whose deletion was asked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_scheduler_preempts_lower_priority_gpu_holders() {
    let Some(mut b) = up().await else { return };
    let (object, status) = node("node-a", "Tesla T4", 15360, 1);
    b.plane.add_api_only_node(&object, &status).unwrap();
    priority_classes(&b);
    let with_priority = |name: &str, mib: u64, class: &str| {
        let mut p = pod(name, mib);
        p["spec"]["priorityClassName"] = json!(class);
        p
    };
    let low: Vec<String> = (0..3).map(|i| format!("low-{i}")).collect();
    for name in &low {
        b.plane.create(&with_priority(name, 5000, "low")).unwrap();
    }
    wait_bound(&b, &low).await;

    // 15,000 of 15,360 MiB held; 8,000 more need two of the three gone.
    b.plane.create(&with_priority("urgent", 8000, "high")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let urgent = loop {
        // The kubelet's part: a pod whose deletion was asked stops and is removed.
        let pods = get(&b.plane, &["get", "pods", "-n", "default"]);
        for p in pods["items"].as_array().unwrap() {
            if p["metadata"]["deletionTimestamp"].is_string() {
                let name = p["metadata"]["name"].as_str().unwrap();
                let _ = b.plane.kubectl(&["delete", "pod", name, "--grace-period=0", "--force", "--wait=false"]);
            }
        }
        let urgent = get(&b.plane, &["get", "pod", "urgent"]);
        if urgent["spec"]["nodeName"].is_string() {
            break urgent;
        }
        assert!(
            Instant::now() < deadline,
            "urgent not placed after 60 s: {}\nscheduler:\n{}\nextender:\n{}",
            urgent["status"],
            b.plane.scheduler.as_ref().unwrap().log_tail(40),
            b.extender.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let assignment = Assignment::decode(urgent["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
    assert_eq!(assignment.containers[0].gpus[0].uuid.as_str(), "GPU-node-a-0");
    let left = live_named(&b, "low-");
    assert_eq!(left.len(), 1, "two victims are enough, and needed: {left:?}");
    // The scheduler asked the extender which victims to take.
    assert!(preempt_calls(&b).await >= 1, "the extender's preempt was never called");
    b.extender.kill();
}

/// Outages of the real control plane lose nothing: the API server down for 10 s (every watch
/// of the extender and of gpushared broken, and resumed against a restarted server) and
/// kube-scheduler killed (`SIGKILL`) and started again. gpushared keeps the pod it serves, renews its
/// heartbeat once the server is back, and the next pod is placed and admitted on the GPU of
/// its assignment, with nothing published over a GPU's total.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outages_of_the_real_api_server_and_scheduler_lose_nothing() {
    let Some(mut b) = up().await else { return };
    let (kubelet, mut daemon) = start_node(&b).await;
    let mut names = place_and_admit(&b, &kubelet, &daemon, &[("before", 6000)]).await;
    wait_published(&b, &daemon, &names).await;

    b.plane.apiserver.kill();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let back = std::time::SystemTime::now();
    b.plane.apiserver.kill_and_restart().unwrap();
    b.plane.wait_ready(Duration::from_secs(60)).unwrap();
    b.plane.scheduler.as_mut().unwrap().kill_and_restart().unwrap();

    names.extend(place_and_admit(&b, &kubelet, &daemon, &[("after", 7000)]).await);
    wait_published(&b, &daemon, &names).await;
    let back_ms = i64::try_from(back.duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let node = get(&b.plane, &["get", "node", "node-a"]);
        let beat = Heartbeat::decode(node["metadata"]["annotations"][HEARTBEAT_KEY].as_str().unwrap()).unwrap();
        if beat.at_ms >= back_ms {
            break;
        }
        assert!(Instant::now() < deadline, "no heartbeat since the API server came back:\n{}", daemon.log_tail(40));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // One warning per watch for the whole outage (retries back off, at debug), and word when
    // each is back. gpushared admits through reads of the node's pods, not its watch, so its
    // watch may come back after the admission; a read that found the pod cut its back-off short.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !daemon.log().contains("pod watch back") && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let watches = [
        ("gpushared", "pod", daemon.log()),
        ("the extender", "node", b.extender.log()),
        ("the extender", "pod", b.extender.log()),
    ];
    for (who, what, log) in watches {
        let warned =
            log.lines().filter(|l| l.contains(" WARN ") && l.contains(&format!("{what} watch failed"))).count();
        assert_eq!(warned, 1, "{who} warned {warned} times of its {what} watch:\n{log}");
        assert!(log.contains(&format!("{what} watch back")), "{who}: no word that its {what} watch is back:\n{log}");
    }
    assert!(daemon.exited().is_none(), "gpushared exited:\n{}", daemon.log_tail(40));
    assert!(b.extender.exited().is_none(), "the extender exited:\n{}", b.extender.log_tail(40));
    b.extender.kill();
}
