//! gpushared as a DRA driver under the real kube-scheduler and kubelet: a node of the
//! real-cluster box serves its GPUs through DRA (`[sharing] dra`); gpushared publishes the
//! node's ResourceSlice and registers with the kubelet's plugin watcher; kube-scheduler
//! allocates each ResourceClaim a share of one GPU's `memory` capacity; the kubelet asks
//! gpushared to prepare it and hands the runtime the CDI device, which containerd resolves from
//! gpushared's spec. What each container's process saw is checked: the GPU the scheduler
//! allocated and the claim's budget.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpushare_testkit::containerd::PROBE_IMAGE;
use gpushare_testkit::nvml::FakeGpu;
use gpushare_testkit::realbox::{RealNode, Runtime, Started, is_root, merge_toml, repo};
use gpushare_testkit::realkube::DRA_MINOR;
use serde_json::{Value, json};

mod realbox;
use realbox::{RealBox, claim, get, up_on};

const NODE: &str = "node-d";
const GPU_MIB: u64 = 40_960;

/// The box with one node whose two 40 GB GPUs are served through DRA; waits for its slice.
async fn dra_box() -> Option<RealBox> {
    dra_box_with(2, GPU_MIB, "").await
}

/// The box with one node of `count` GPUs of `mib` MiB, all served through DRA, with
/// `config_extra` added to gpushared.toml (`{host}` in it: the node's directory); waits for its
/// slice.
async fn dra_box_with(count: u32, mib: u64, config_extra: &str) -> Option<RealBox> {
    if !is_root() {
        gpushare_testkit::skip_unless_ci("the real kubelet needs root (it runs in a mount namespace of its own)");
        return None;
    }
    let mut b = up_on("gpushare-scheduler-config.yaml", "", Runtime::Containerd).await?;
    if b.plane.minor < DRA_MINOR {
        eprintln!(
            "skipped: claims consume memory with DRAConsumableCapacity, on by default from Kubernetes 1.36 (this is 1.{})",
            b.plane.minor
        );
        return None;
    }
    b.plane.apply(&repo().join("etc/kubernetes/gpushare-deviceclass.yaml")).unwrap_or_else(|e| panic!("{e:#}"));
    let host = b.plane.dir.join(NODE);
    let config_extra = config_extra.replace("{host}", &host.display().to_string());
    // Both texts may have a [sharing] table: merged table by table.
    let config = merge_toml(&config_extra, &b.dra_config(NODE, &(0..count).collect::<Vec<_>>())).unwrap();
    let gpus: Vec<FakeGpu> = (0..count).map(|i| FakeGpu::new(NODE, i, mib, "A100-PCIE-40GB")).collect();
    b.add_node(NODE, &gpus, ("", &config)).unwrap_or_else(|e| panic!("{e:#}"));
    let all: Vec<String> = (0..count).map(|i| format!("gpu-{i}")).collect();
    wait_slice(&b, &all.iter().map(String::as_str).collect::<Vec<_>>());
    Some(b)
}

/// The devices of the node's ResourceSlice.
fn slice_devices(b: &RealBox) -> Vec<String> {
    let slices = get(&b.plane, &["get", "resourceslices"]);
    let mut names: Vec<String> = slices["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["spec"]["nodeName"] == NODE)
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .filter_map(|d| d["name"].as_str().map(str::to_owned))
        .collect();
    names.sort();
    names
}

/// Waits until the node's ResourceSlice lists exactly `devices`.
fn wait_slice(b: &RealBox, devices: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = slice_devices(b);
        if now == devices {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the ResourceSlice lists {now:?}, not {devices:?}, after 60 s\ngpushared:\n{}",
            node(b).daemon.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn node(b: &RealBox) -> &RealNode {
    b.node(NODE).unwrap()
}

/// A pod whose `containers` all use the claim `claim`.
fn pod(name: &str, claim: &str, containers: &[&str]) -> Value {
    realbox::claim_pod(name, claim, containers, PROBE_IMAGE)
}

/// Waits until `pod` has `count` running containers; returns them by container name.
fn wait_running(b: &RealBox, pod: &str, count: usize) -> BTreeMap<String, Started> {
    let n = node(b);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let running: BTreeMap<String, Started> = n
            .running()
            .unwrap_or_else(|e| panic!("{e:#}"))
            .into_iter()
            .filter(|c| c.pod == pod)
            .map(|c| (c.container.clone(), c))
            .collect();
        let p = get(&b.plane, &["get", "pod", pod, "-n", "default"]);
        if running.len() == count && p["status"]["phase"] == "Running" {
            return running;
        }
        assert!(
            Instant::now() < deadline,
            "{pod}: {} of {count} containers running after 60 s\npod: {p}\nkubelet:\n{}\ngpushared:\n{}",
            running.len(),
            n.kubelet.proc.log_tail(40),
            n.daemon.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The GPU device (`gpu-<index>`) and MiB kube-scheduler allocated to `claim`.
fn allocated(b: &RealBox, claim: &str) -> (String, String) {
    let c = get(&b.plane, &["get", "resourceclaim", claim, "-n", "default"]);
    let r = &c["status"]["allocation"]["devices"]["results"][0];
    assert_eq!(r["driver"], "gpu.gpushare.io", "{c}");
    assert_eq!(r["pool"], NODE, "{c}");
    (r["device"].as_str().unwrap().to_owned(), r["consumedCapacity"]["memory"].as_str().unwrap_or_default().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_for_3500_mib_runs_with_its_gpu_and_budget_and_its_containers_share_it() {
    let Some(mut b) = dra_box().await else { return };
    b.plane.create(&claim("c-3500", 3500)).unwrap();
    b.plane.create(&pod("p-3500", "c-3500", &["main", "sidecar"])).unwrap();
    let running = wait_running(&b, "p-3500", 2);
    let (device, consumed) = allocated(&b, "c-3500");
    assert_eq!(consumed, "3500Mi");
    // Written once: the slice read back agrees with the node's GPUs (40960 MiB stored as 40Gi).
    let slice = &get(&b.plane, &["get", "resourceslices"])["items"][0]["spec"];
    assert_eq!(slice["pool"]["generation"], 0, "{slice}");
    assert_eq!(slice["devices"][0]["capacity"]["memory"]["value"], "40Gi", "{slice}");
    let index: u32 = device.strip_prefix("gpu-").unwrap().parse().unwrap();
    let uuid = FakeGpu::new(NODE, index, GPU_MIB, "A100-PCIE-40GB").uuid;
    // containerd resolved the claim's CDI device from gpushared's spec: its environment is in
    // each process.
    for (name, c) in &running {
        let env = |k: &str| c.envs.get(k).cloned().unwrap_or_default();
        assert_eq!(env("NVIDIA_VISIBLE_DEVICES"), uuid, "{name}: {:?}", c.envs);
        assert_eq!(env("GPUSHARE_MEMORY_MIB"), "3500", "{name}");
        assert_eq!(env("CUDA_DEVICE_MEMORY_LIMIT_0"), "3500m", "{name}");
        assert_eq!(env("GPUSHARE_GPU_TOTAL_MIB"), GPU_MIB.to_string(), "{name}");
        assert_eq!(env("GPUSHARE_CLAIM"), "default/c-3500", "{name}");
    }
    // The claim is in the node's ledger before the pod ran; the node annotation lists it on its
    // GPU, and `kubectl inspect gpushare -d` gives it a row.
    assert!(node(&b).daemon.log().contains("claim prepared"), "{}", node(&b).daemon.log_tail(20));
    let uid = claim_uid(&b, "c-3500");
    wait_published_claims(&b, &[("c-3500", uid.as_str(), index, 3500)]);
    let details = b.inspect(&["-d"]).unwrap();
    let row = details.lines().find(|l| l.starts_with("resourceclaim/c-3500 ")).unwrap_or_else(|| panic!("{details}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    let mut want = vec!["resourceclaim/c-3500", "default", "0", "0"];
    want[2 + index as usize] = "3500";
    assert_eq!(cells, want, "{details}");
    // Deleting the pod unprepares it, and it leaves the annotation.
    b.plane.kubectl(&["delete", "pod", "p-3500", "--wait=true", "--timeout=60s"]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !node(&b).daemon.log().contains("claim unprepared") {
        assert!(Instant::now() < deadline, "not unprepared after 60 s:\n{}", node(&b).daemon.log_tail(30));
        std::thread::sleep(Duration::from_millis(250));
    }
    wait_published_claims(&b, &[]);
    b.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_mixed_sizes_pack_without_overcommit_and_one_that_fits_nowhere_stays_pending() {
    let Some(mut b) = dra_box().await else { return };
    // 2 x 40960 MiB: 30000 + 10000 on one GPU, 30000 + 10000 on the other; 20000 fits nowhere.
    let sizes = [("a", 30_000), ("b", 30_000), ("c", 10_000), ("d", 10_000)];
    for (name, mib) in sizes {
        b.plane.create(&claim(&format!("c-{name}"), mib)).unwrap();
        b.plane.create(&pod(&format!("p-{name}"), &format!("c-{name}"), &["main"])).unwrap();
    }
    let mut per_gpu: BTreeMap<String, u64> = BTreeMap::new();
    for (name, mib) in sizes {
        let running = wait_running(&b, &format!("p-{name}"), 1);
        let (device, _) = allocated(&b, &format!("c-{name}"));
        assert_eq!(running["main"].envs["GPUSHARE_MEMORY_MIB"], mib.to_string());
        *per_gpu.entry(device).or_default() += mib;
    }
    assert!(per_gpu.values().all(|&m| m <= GPU_MIB), "{per_gpu:?}");
    b.plane.create(&claim("c-big", 20_000)).unwrap();
    b.plane.create(&pod("p-big", "c-big", &["main"])).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let p = get(&b.plane, &["get", "pod", "p-big", "-n", "default"]);
        let reason = p["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "PodScheduled" && c["status"] == "False")
            .map(|c| c["message"].as_str().unwrap_or_default().to_owned());
        if let Some(reason) = reason {
            assert_eq!(p["status"]["phase"], "Pending");
            // kube-scheduler's own reason: no node has a GPU with 20000 MiB of memory left.
            assert!(reason.contains("cannot allocate all claims"), "{reason}");
            break;
        }
        assert!(Instant::now() < deadline, "p-big not reported unschedulable: {p}");
        std::thread::sleep(Duration::from_millis(250));
    }
    b.shutdown();
}

fn claim_uid(b: &RealBox, name: &str) -> String {
    get(&b.plane, &["get", "resourceclaim", name, "-n", "default"])["metadata"]["uid"].as_str().unwrap().to_owned()
}

/// Waits until the node annotation lists exactly `want` as its claims: (name, UID, GPU, MiB).
fn wait_published_claims(b: &RealBox, want: &[(&str, &str, u32, u64)]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = b.node_state(NODE).unwrap();
        let mut got: Vec<(String, String, u32, u64)> =
            state.claims.iter().map(|c| (c.claim.name.clone(), c.claim.uid.clone(), c.gpu, c.mib.get())).collect();
        got.sort();
        let want: Vec<(String, String, u32, u64)> =
            want.iter().map(|(n, u, g, m)| ((*n).to_owned(), (*u).to_owned(), *g, *m)).collect();
        if got == want {
            // Counted once each in `usedMiB`.
            let mut used = vec![0; state.inventory.gpus().len()];
            for (_, _, g, m) in &want {
                used[*g as usize] += m;
            }
            assert_eq!(state.used.iter().map(|m| m.get()).collect::<Vec<_>>(), used);
            return;
        }
        assert!(Instant::now() < deadline, "the node annotation lists claims {got:?}, not {want:?}, after 30 s");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The node's published usage per GPU (`usedMiB`, DRA claims included).
fn published_used(b: &RealBox) -> Vec<u64> {
    let n = get(&b.plane, &["get", "node", NODE]);
    let state: Value =
        serde_json::from_str(n["metadata"]["annotations"]["gpushare.io/node-state"].as_str().unwrap_or("{}")).unwrap();
    state["gpus"].as_array().into_iter().flatten().map(|g| g["usedMiB"].as_u64().unwrap_or(0)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xid_takes_the_gpu_out_of_the_pool_until_it_recovers() {
    let config = "[health]\nprobe_interval_seconds = 1\nrecovery_seconds = 15\n";
    let Some(mut b) = dra_box_with(2, GPU_MIB, config).await else { return };
    b.plane.create(&claim("c-1", 1000)).unwrap();
    b.plane.create(&pod("p-1", "c-1", &["main"])).unwrap();
    wait_running(&b, "p-1", 1);
    let (device, _) = allocated(&b, "c-1");
    let (sick, healthy) = if device == "gpu-0" { (0, "gpu-1") } else { (1, "gpu-0") };
    gpushare_testkit::nvml::inject(&node(&b).events, &format!("xid {sick} 79")).unwrap();
    // The sick GPU leaves the pool; the running pod runs on; a new claim goes to the other GPU.
    wait_slice(&b, &[healthy]);
    b.plane.create(&claim("c-2", 1000)).unwrap();
    b.plane.create(&pod("p-2", "c-2", &["main"])).unwrap();
    wait_running(&b, "p-2", 1);
    assert_eq!(allocated(&b, "c-2").0, healthy);
    assert!(node(&b).running().unwrap().iter().any(|c| c.pod == "p-1"), "p-1 runs on");
    // No new fault for recovery_seconds and the GPU answers: back in the pool.
    let deadline = Instant::now() + Duration::from_secs(60);
    while slice_devices(&b).len() != 2 {
        assert!(Instant::now() < deadline, "GPU {sick} not back after 60 s:\n{}", node(&b).daemon.log_tail(30));
        std::thread::sleep(Duration::from_millis(250));
    }
    b.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpushared_and_the_kubelet_killed_during_a_burst_of_prepares_lose_no_claim() {
    let Some(mut b) = dra_box().await else { return };
    // 12 claims of 6000 MiB: 6 fit each 40960 MiB GPU.
    let names: Vec<String> = (0..12).map(|i| format!("b-{i}")).collect();
    for n in &names {
        b.plane.create(&claim(&format!("c-{n}"), 6000)).unwrap();
        b.plane.create(&pod(n, &format!("c-{n}"), &["main"])).unwrap();
    }
    // Mid-burst: gpushared SIGKILLed and started again, then the kubelet.
    std::thread::sleep(Duration::from_millis(1500));
    b.nodes[0].daemon.kill_and_restart().unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let plane = &b.plane;
    b.nodes[0].kubelet.restart(plane).unwrap();
    let mut per_gpu = vec![0u64; 2];
    for n in &names {
        let running = wait_running(&b, n, 1);
        let c = &running["main"];
        let (device, consumed) = allocated(&b, &format!("c-{n}"));
        assert_eq!(consumed, "6000Mi");
        let index: usize = device.strip_prefix("gpu-").unwrap().parse().unwrap();
        let uuid = FakeGpu::new(NODE, u32::try_from(index).unwrap(), GPU_MIB, "A100-PCIE-40GB").uuid;
        assert_eq!(c.envs.get("NVIDIA_VISIBLE_DEVICES"), Some(&uuid), "{n}");
        assert_eq!(c.envs.get("GPUSHARE_MEMORY_MIB").map(String::as_str), Some("6000"), "{n}");
        per_gpu[index] += 6000;
    }
    assert_eq!(per_gpu, [36_000, 36_000]);
    // The ledger holds every claim once: the node publishes exactly what was allocated.
    let deadline = Instant::now() + Duration::from_secs(30);
    while published_used(&b) != per_gpu {
        assert!(Instant::now() < deadline, "published {:?}, allocated {per_gpu:?}", published_used(&b));
        std::thread::sleep(Duration::from_millis(250));
    }
    // Each container was started once, even across the restarts.
    for n in &names {
        let started = node(&b).started().unwrap().into_iter().filter(|c| &c.pod == n).count();
        assert_eq!(started, 1, "{n} started {started} times");
    }
    // Deleting the pods unprepares every claim: nothing is left on either GPU.
    b.plane.kubectl(&["delete", "pods", "--all", "--wait=true", "--timeout=90s"]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while published_used(&b) != [0, 0] {
        assert!(Instant::now() < deadline, "still published {:?}", published_used(&b));
        std::thread::sleep(Duration::from_millis(250));
    }
    b.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_8x80gb_node_takes_claims_at_mib_granularity() {
    let Some(mut b) = dra_box_with(8, 81_920, "").await else { return };
    let slices = get(&b.plane, &["get", "resourceslices", "-o", "json"]);
    eprintln!("ResourceSlice of 8 x 80 GB: {} bytes of JSON", slices["items"][0].to_string().len());
    for (name, mib) in [("one", 1), ("most", 81_919), ("odd", 4097)] {
        b.plane.create(&claim(&format!("c-{name}"), mib)).unwrap();
        b.plane.create(&pod(name, &format!("c-{name}"), &["main"])).unwrap();
    }
    for (name, mib) in [("one", 1), ("most", 81_919), ("odd", 4097)] {
        let running = wait_running(&b, name, 1);
        assert_eq!(running["main"].envs["GPUSHARE_MEMORY_MIB"], mib.to_string(), "{name}");
        assert_eq!(running["main"].envs["GPUSHARE_GPU_TOTAL_MIB"], "81920", "{name}");
        assert_eq!(allocated(&b, &format!("c-{name}")).1, format!("{mib}Mi"));
    }
    b.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_on_a_dra_mps_gpu_is_an_mps_client_with_its_pipe_directory() {
    // GPU 1 is named in [sharing] mps too: dra-mps. MPS's directories go under the node's.
    let config = "[mps]\npipe_directory = \"{host}/mps-pipe\"\nlog_directory = \"{host}/mps-log\"\n\
                  environment_file = \"{host}/mps.env\"\n";
    let Some(mut b) = dra_box_with(2, GPU_MIB, &format!("{config}[sharing]\nmps = [1]\n")).await else { return };
    let host = b.plane.dir.join(NODE);
    let pipe = host.join("mps-pipe").display().to_string();
    // gpushared-mps.service makes the directory (`install -d`) on a host.
    std::fs::create_dir_all(&pipe).unwrap();
    // One claim per GPU, each chosen by the slice's attributes (the sharing mode, the index).
    for (name, expression) in [
        ("c-mps", r#"device.attributes["gpu.gpushare.io"].sharing == "dra-mps""#),
        ("c-plain", r#"device.attributes["gpu.gpushare.io"].index == 0"#),
    ] {
        let mut c = claim(name, 10_240);
        c["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = json!([{"cel": {"expression": expression}}]);
        b.plane.create(&c).unwrap();
        // Each process tries to write in the pipe directory.
        let mut p = pod(&name.replace("c-", "p-"), name, &["main"]);
        p["spec"]["containers"][0]["env"] = json!([{"name": "PROBE_WRITE", "value": pipe}]);
        b.plane.create(&p).unwrap();
    }
    let mps = wait_running(&b, "p-mps", 1);
    let plain = wait_running(&b, "p-plain", 1);
    assert_eq!(allocated(&b, "c-mps").0, "gpu-1");
    assert_eq!(allocated(&b, "c-plain").0, "gpu-0");
    let c = &mps["main"];
    assert_eq!(c.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=10240M", "{:?}", c.envs);
    assert_eq!(c.envs["CUDA_MPS_PIPE_DIRECTORY"], pipe);
    assert_eq!(c.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
    // The process sees the directory mounted read-only (issue 35), and its own attempt to
    // create a file there failed on that: it cannot stop the control daemon or replace its
    // sockets.
    let seen = node(&b).seen().unwrap();
    let report = |pod: &str| seen.iter().find(|s| s.pod == pod).unwrap_or_else(|| panic!("no report of {pod}"));
    let client = report("p-mps");
    let mount = client.mount(&pipe).unwrap_or_else(|| panic!("{pipe} not mounted: {:?}", client.mounts));
    assert!(mount.read_only(), "{mount:?}");
    assert!(client.writes[&pipe].contains("read-only file system"), "{:?}", client.writes);
    assert!(std::fs::read_dir(&pipe).unwrap().next().is_none(), "a file was left in {pipe}");
    let c = &plain["main"];
    assert!(!c.envs.contains_key("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), "{c:?}");
    let other = report("p-plain");
    assert!(other.mount(&pipe).is_none(), "{:?}", other.mounts);
    assert!(other.writes[&pipe].contains("no such file or directory"), "{:?}", other.writes);
    // gpushared-mps.service's environment names the MPS GPU.
    let env = std::fs::read_to_string(host.join("mps.env")).unwrap();
    assert!(env.contains("GPU-fake-node-d-1") && !env.contains("GPU-fake-node-d-0"), "{env}");
    b.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moving_the_gpus_back_to_the_device_plugin_withdraws_the_slice() {
    let Some(mut b) = dra_box().await else { return };
    // The operator names no GPU in [sharing] dra any more; gpushared crashes and starts again
    // (the worst case: its registration socket is left behind).
    let path = node(&b).host.join("gpushared").join("gpushared.toml");
    let mut config: toml::Table = std::fs::read_to_string(&path).unwrap().parse().unwrap();
    config["sharing"].as_table_mut().unwrap().remove("dra");
    std::fs::write(&path, toml::to_string(&config).unwrap()).unwrap();
    b.nodes[0].daemon.kill_and_restart().unwrap();
    // The slice goes at once: gpushared deletes it (the kubelet's wipe after an unregistration
    // waits longer). Its startup wipe may still be pending and win the race, so the test asks
    // that gpushared checked none is left, not that it was the one that deleted it.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let slices = get(&b.plane, &["get", "resourceslices"]);
        let mine = slices["items"].as_array().into_iter().flatten().filter(|s| s["spec"]["nodeName"] == NODE).count();
        if mine == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the slice is still there after 20 s:\n{}", node(&b).daemon.log_tail(30));
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(node(&b).daemon.log().contains("none of this driver is left"), "{}", node(&b).daemon.log_tail(30));
    // The GPUs are device-plugin shares again.
    let shared = |b: &RealBox| {
        b.node_state(NODE)
            .is_ok_and(|s| s.inventory.gpus().iter().all(|g| g.mode == gpushare_core::SharingMode::Shared))
    };
    while !shared(&b) {
        assert!(Instant::now() < deadline + Duration::from_secs(10), "{:?}", b.node_state(NODE));
        std::thread::sleep(Duration::from_millis(250));
    }
    b.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_of_two_requests_reaches_each_container_whichever_request_it_names() {
    let Some(mut b) = dra_box().await else { return };
    // Request `a` asks for 1000 MiB; request `b` for the first that fits of 50000 MiB (no
    // 40 GB GPU has it) and 2000 MiB: kube-scheduler allocates its subrequest `b/small`.
    let exactly = |mib: u64| json!({"deviceClassName": "gpushare-memory", "capacity": {"requests": {"memory": format!("{mib}Mi")}}});
    let mut small = exactly(2000);
    small["name"] = json!("small");
    let mut big = exactly(50_000);
    big["name"] = json!("big");
    b.plane
        .create(&json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c-two", "namespace": "default"},
            "spec": {"devices": {"requests": [
                {"name": "a", "exactly": exactly(1000)},
                {"name": "b", "firstAvailable": [big, small]},
            ]}},
        }))
        .unwrap();
    let container = |name: &str, request: Option<&str>| {
        let claim = match request {
            Some(r) => json!({"name": "gpu", "request": r}),
            None => json!({"name": "gpu"}),
        };
        json!({"name": name, "image": PROBE_IMAGE, "command": ["sleep", "infinity"], "resources": {"claims": [claim]}})
    };
    b.plane
        .create(&json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p-two", "namespace": "default"},
            "spec": {"automountServiceAccountToken": false,
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": "c-two"}],
                     "containers": [container("only-a", Some("a")), container("only-b", Some("b")), container("all", None)]},
        }))
        .unwrap();
    let running = wait_running(&b, "p-two", 3);
    let c = get(&b.plane, &["get", "resourceclaim", "c-two", "-n", "default"]);
    let results = c["status"]["allocation"]["devices"]["results"].as_array().unwrap();
    let got: Vec<(&str, &str)> = results
        .iter()
        .map(|r| (r["request"].as_str().unwrap(), r["consumedCapacity"]["memory"].as_str().unwrap()))
        .collect();
    assert_eq!(got, [("a", "1000Mi"), ("b/small", "2000Mi")], "{c}");
    // Every container gets the claim's one CDI device (the kubelet names it twice for the
    // container that uses the whole claim, once per request, and containerd takes that), so each
    // process sees the claim's GPUs and all its memory.
    let gpus: std::collections::BTreeSet<&str> = results.iter().map(|r| r["device"].as_str().unwrap()).collect();
    for (name, c) in &running {
        assert_eq!(c.envs.get("GPUSHARE_MEMORY_TOTAL_MIB").map(String::as_str), Some("3000"), "{name}: {:?}", c.envs);
        let visible = c.envs.get("NVIDIA_VISIBLE_DEVICES").map_or(0, |v| v.split(',').count());
        assert_eq!(visible, gpus.len(), "{name}: one entry per GPU, {:?}", c.envs);
    }
    b.shutdown();
}
