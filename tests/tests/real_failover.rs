//! Scheduler failover on the real-cluster box (issue 36): an HA control plane runs
//! kube-scheduler on two hosts with leader election, each beside its own extender (called over
//! its own loopback address, as the shipped configuration does). The leader's kube-scheduler
//! and extender are killed with `SIGKILL` in the middle of a burst. The other scheduler takes
//! the lease and places the rest through its own extender; the real kubelet admits every pod
//! through gpushared, and containerd and runc start every container. Checked from what each
//! container's process reported: no GPU holds more than it has, every container runs on the
//! GPU of its pod's assignment with its budget, no pod failed, and the pods that do not fit wait.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_testkit::cluster::http_get;
use gpushare_testkit::nvml::FakeGpu;
use gpushare_testkit::realbox::{Runtime, Started, is_root, repo, start_extender_named};
use gpushare_testkit::realkube::EXTENDER_URL;
use serde_json::Value;

mod realbox;
use realbox::{RealBox, get, pod, up_on};

const NODE: &str = "node-f";
const GPU_MIB: u64 = 15_360;
/// What kube-scheduler logs on taking the lease (capitalised since client-go 0.30).
const ACQUIRED: &str = "successfully acquired lease";
/// Pods of the burst that fit the node.
const FIT: usize = 170;

/// The pods of the burst, by name.
fn pods(b: &RealBox) -> BTreeMap<String, Value> {
    get(&b.plane, &["get", "pods", "-n", "default"])["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["metadata"]["name"].as_str().unwrap().to_owned(), p.clone()))
        .collect()
}

fn bound(pods: &BTreeMap<String, Value>) -> usize {
    pods.values().filter(|p| p["spec"]["nodeName"].is_string()).count()
}

/// Asserts that no pod failed (at admission or otherwise).
fn none_failed(b: &RealBox, pods: &BTreeMap<String, Value>) {
    for (name, p) in pods {
        assert_ne!(
            p["status"]["phase"],
            "Failed",
            "{name} failed: {}\nkubelet:\n{}",
            p["status"],
            b.node(NODE).unwrap().kubelet.proc.log_tail(30)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leaders_scheduler_and_extender_killed_mid_burst_lose_no_pod_and_overcommit_nothing() {
    if !is_root() {
        gpushare_testkit::skip_unless_ci("the real kubelet needs root (it runs in a mount namespace of its own)");
        return;
    }
    let Some(mut b) = up_on("gpushare-scheduler-config.yaml", "", Runtime::Containerd).await else { return };
    let gpus = [FakeGpu::new(NODE, 0, GPU_MIB, "Tesla T4"), FakeGpu::new(NODE, 1, GPU_MIB, "Tesla T4")];
    b.add_node(NODE, &gpus, ("", "")).unwrap_or_else(|e| panic!("{e:#}"));
    b.wait_allocatable(NODE, "gpushare.io/gpu-mem", "30720", Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e:#}"));

    // The box's kube-scheduler took the lease when it started; the second host's pair starts
    // now and stands by.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !b.plane.scheduler.as_ref().unwrap().log().to_lowercase().contains(ACQUIRED) {
        assert!(Instant::now() < deadline, "the first kube-scheduler never took the lease");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (mut extender_b, addr_b, observe_b) =
        start_extender_named(&b.plane, "extender-b", "", "info").unwrap_or_else(|e| panic!("{e:#}"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while http_get(addr_b, "/readyz").await.is_none_or(|(s, _)| s != 200) {
        assert!(Instant::now() < deadline, "extender-b is not ready:\n{}", extender_b.log_tail(20));
        assert!(extender_b.exited().is_none(), "extender-b exited:\n{}", extender_b.log_tail(20));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let shipped = std::fs::read_to_string(repo().join("etc/kube-scheduler/gpushare-scheduler-config.yaml")).unwrap();
    let config_b = shipped.replace(EXTENDER_URL, &format!("http://{addr_b}/gpushare-scheduler"));
    let (scheduler_b, _) = b.plane.spawn_scheduler("kube-scheduler-b", &config_b).unwrap_or_else(|e| panic!("{e:#}"));

    // 180 pods of 180 MiB where 170 fit (85 a GPU), in one burst.
    let names: Vec<String> = (0..180).map(|i| format!("f-{i:03}")).collect();
    let manifest = b.plane.dir.join("burst.json");
    let items: Vec<Value> = names.iter().map(|n| pod(n, 180)).collect();
    std::fs::write(&manifest, serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string())
        .unwrap();
    // Mid-burst (kubectl still creating pods), the leader's host goes: its kube-scheduler and
    // extender SIGKILLed.
    let manifest = manifest.display().to_string();
    std::thread::scope(|scope| {
        let creating = scope.spawn(|| b.plane.kubectl(&["create", "-f", &manifest]));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let n = bound(&pods(&b));
            if n >= 20 {
                assert!(n < FIT, "the burst was over before the leader could be killed ({n} bound)");
                break;
            }
            assert!(Instant::now() < deadline, "only {n} pods bound after 60 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        b.plane.scheduler.as_ref().unwrap().signal("KILL").unwrap();
        b.extender.signal("KILL").unwrap();
        creating.join().unwrap().unwrap();
    });
    b.plane.scheduler.as_mut().unwrap().kill();
    b.extender.kill();
    let killed_at = Instant::now();
    let bound_at_kill = bound(&pods(&b));

    // The standby takes the lease (kube-scheduler's default lease: 15 s) and places the rest.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !scheduler_b.log().to_lowercase().contains(ACQUIRED) {
        assert!(Instant::now() < deadline, "kube-scheduler-b never took the lease:\n{}", scheduler_b.log_tail(20));
        std::thread::sleep(Duration::from_millis(200));
    }
    let took_over = killed_at.elapsed();
    let led_at = Instant::now();
    let mut bound_in = None;
    let (running, all) = loop {
        let all = pods(&b);
        none_failed(&b, &all);
        if bound_in.is_none() && bound(&all) == FIT {
            bound_in = Some(led_at.elapsed());
        }
        let running: BTreeMap<String, Started> = b
            .node(NODE)
            .unwrap()
            .running()
            .unwrap_or_else(|e| panic!("{e:#}"))
            .into_iter()
            .map(|c| (c.pod.clone(), c))
            .collect();
        let phases_running = all.values().filter(|p| p["status"]["phase"] == "Running").count();
        if running.len() == FIT && phases_running == FIT {
            break (running, all);
        }
        // Liveness bounds, not timings. The standby places the rest within 60 s of taking the
        // lease. Starting 170 containers under runc on a machine the whole box shares takes
        // longer than that alone (about 70 s on 2 cores), so the bound on running is wider.
        let (what, done, limit) = match bound_in {
            None => ("bound", bound(&all), 60),
            Some(_) => ("running", running.len(), 180),
        };
        assert!(
            led_at.elapsed() < Duration::from_secs(limit),
            "{done} of {FIT} pods {what} {limit} s after kube-scheduler-b took the lease ({} bound, {} running); not running: {:?}\nkube-scheduler-b:\n{}\nextender-b:\n{}",
            bound(&all),
            running.len(),
            all.keys().filter(|p| !running.contains_key(*p)).collect::<Vec<_>>(),
            scheduler_b.log_tail(30),
            extender_b.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    let placed_in = led_at.elapsed();

    // Each container on its assignment's GPU with its budget; no GPU over its memory.
    let mut per_gpu: BTreeMap<String, u64> = BTreeMap::new();
    for (name, c) in &running {
        let p = &all[name];
        let a = Assignment::decode(p["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
        let share = &a.containers[0].gpus[0];
        assert_eq!(c.envs.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str), Some(share.uuid.as_str()), "{name}");
        assert_eq!(c.envs.get("GPUSHARE_MEMORY_MIB"), Some(&share.mib.get().to_string()), "{name}");
        assert_eq!(c.envs.get("GPUSHARE_POD"), Some(&format!("default/{name}")), "{name}");
        *per_gpu.entry(share.uuid.as_str().to_owned()).or_default() += share.mib.get();
    }
    assert_eq!(per_gpu.values().copied().collect::<Vec<_>>(), [15_300, 15_300], "{per_gpu:?}");
    // Each container was created once: no pod was admitted twice or replaced.
    let started = b.node(NODE).unwrap().started().unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(started.len(), FIT, "containers started: {}", started.len());
    // The ten that do not fit wait, unbound, told why.
    let waiting: Vec<&Value> = all.values().filter(|p| !p["spec"]["nodeName"].is_string()).collect();
    assert_eq!(waiting.len(), 10);
    for p in waiting {
        assert_eq!(p["status"]["phase"], "Pending", "{p}");
    }
    // kube-scheduler-b's own extender bound what was left at the kill.
    let (_, metrics) = http_get(observe_b, "/metrics").await.expect("extender-b's /metrics");
    let bound_b: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("gpushare_extender_binds_total{outcome=\"bound\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no bound count in extender-b's metrics:\n{metrics}"));
    assert!(
        usize::try_from(bound_b).unwrap() >= FIT - bound_at_kill,
        "extender-b bound {bound_b}, {bound_at_kill} were bound at the kill"
    );
    eprintln!(
        "failover: {bound_at_kill} of {FIT} bound at the kill; lease taken {took_over:?} later; the rest bound {:?} \
         and running {placed_in:?} after that",
        bound_in.unwrap_or(placed_in)
    );
    drop(scheduler_b);
    extender_b.kill();
    b.shutdown();
}
