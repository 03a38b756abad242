//! gpushare's DRA path beside NVIDIA's DRA driver (`kubernetes-sigs/dra-driver-nvidia-gpu`, its
//! GPU kubelet plugin with consumable shares of memory), in the scenarios of docs/comparison.md's
//! DRA table: for each driver a fresh real-cluster box with one node of two 40 GB GPUs served
//! through DRA, ResourceClaims asking memory of one device class (`gpushare-memory`,
//! `gpu.nvidia.com`), placed by the real kube-scheduler and prepared by the real kubelet; then
//! one set of rules applied to what each container got (gpushare's node runs containerd and
//! runc, which inject its CDI specs, and each process reports what it saw; NVIDIA's driver, built
//! from source, runs on the recording runtime, which applies its specs): every running container sees
//! exactly the GPUs its claim was allocated and is told its budget, no GPU holds more than it
//! has, every pod that does not run says why. NVIDIA's driver runs where `GPUSHARE_PEERS_SRC`
//! gives its source (`tests/peers/build`); without it, its column keeps the last recorded run and
//! the suite says so. Evidence: `target/tmp/side-by-side/<scenario>.json`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stderr)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpushare_testkit::containerd::PROBE_IMAGE;
use gpushare_testkit::nvidia_dra;
use gpushare_testkit::nvml::FakeGpu;
use gpushare_testkit::realbox::{Runtime, is_root, merge_toml};
use serde_json::{Value, json};

mod realbox;
mod sides;
use realbox::{RealBox, get, repo, up_on};
use sides::{Verdict, record_in};

const NODE: &str = "gpu-node";
const GPU_MIB: u64 = 40_960;
/// The first cell of the DRA table's header in docs/comparison.md.
const TABLE: &str = "DRA scenario";

/// A DRA driver under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Driver {
    /// gpushared's DRA path (`[sharing] dra`), the shipped device class.
    Gpushare,
    /// NVIDIA's DRA driver, consumable shares of memory on.
    Nvidia,
}

impl Driver {
    /// The drivers that run here; `GPUSHARE_SIDES` (`gpushare`, `nvidia-dra`) keeps only those.
    fn runnable() -> Vec<Driver> {
        let chosen = std::env::var("GPUSHARE_SIDES").ok();
        [Driver::Gpushare, Driver::Nvidia]
            .into_iter()
            .filter(|d| chosen.as_deref().is_none_or(|c| c.split(',').any(|k| k.trim() == d.key())))
            .filter(|d| match d {
                Driver::Gpushare => true,
                Driver::Nvidia => nvidia_dra::built()
                    .map(|(_, commits)| {
                        eprintln!("NVIDIA's DRA driver built from: {}", commits.trim().replace('\n', "; "));
                    })
                    .map_err(|why| eprintln!("{why}"))
                    .is_ok(),
            })
            .collect()
    }

    fn key(self) -> &'static str {
        match self {
            Driver::Gpushare => "gpushare",
            Driver::Nvidia => "nvidia-dra",
        }
    }

    /// Its column in docs/comparison.md's DRA table.
    fn column(self) -> &'static str {
        match self {
            Driver::Gpushare => "gpushare",
            Driver::Nvidia => "NVIDIA DRA driver",
        }
    }

    /// The container runtime of its node: containerd and runc for gpushare. NVIDIA's driver
    /// stays on the recording runtime: its specs run `nvidia-cdi-hook` and mount the driver
    /// root's libraries, and its source is not there in CI to prove them on containerd.
    fn runtime(self) -> Runtime {
        match self {
            Driver::Gpushare => Runtime::Containerd,
            Driver::Nvidia => Runtime::Recording,
        }
    }

    fn class(self) -> &'static str {
        match self {
            Driver::Gpushare => "gpushare-memory",
            Driver::Nvidia => nvidia_dra::DEVICE_CLASS,
        }
    }

    /// The box with the node's two GPUs served by this driver (`ours_extra`: added to
    /// gpushared.toml), once its ResourceSlice lists both; `None` where it cannot run here.
    async fn up(self, ours_extra: &str) -> Option<RealBox> {
        if !is_root() {
            gpushare_testkit::skip_unless_ci("the real kubelet needs root (it runs in a mount namespace of its own)");
            return None;
        }
        let mut b = up_on("gpushare-scheduler-config.yaml", "", self.runtime()).await?;
        let gpus = gpus();
        match self {
            Driver::Gpushare => {
                b.plane.apply(&repo().join("etc/kubernetes/gpushare-deviceclass.yaml")).unwrap();
                let config = merge_toml(ours_extra, &b.dra_config(NODE, &[0, 1])).unwrap();
                b.add_node(NODE, &gpus, ("", &config)).map(|_| ())
            }
            Driver::Nvidia => {
                b.plane.create(&nvidia_dra::device_class()).unwrap();
                b.add_nvidia_dra_node(NODE, &gpus).map(|_| ())
            }
        }
        .unwrap_or_else(|e| panic!("{e:#}"));
        wait_pool(&b, 2);
        Some(b)
    }

    /// A claim for `mib` MiB of each of `count` GPUs of this driver's class.
    fn claim(self, name: &str, mib: u64, count: u32) -> Value {
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": self.class(), "allocationMode": "ExactCount", "count": count,
                "capacity": {"requests": {"memory": format!("{mib}Mi")}},
            }}]}},
        })
    }
}

/// The node's GPUs: UUIDs of NVIDIA's form, which its driver's CDI generation needs.
fn gpus() -> Vec<FakeGpu> {
    (0..2).map(|i| FakeGpu::new(NODE, i, GPU_MIB, "NVIDIA A100-PCIE-40GB").with_nvidia_uuid()).collect()
}

/// A pod whose `containers` all use the claim `claim`.
fn pod(name: &str, claim: &str, containers: &[&str]) -> Value {
    let containers: Vec<Value> = containers
        .iter()
        .map(|c| json!({"name": c, "image": PROBE_IMAGE, "resources": {"claims": [{"name": "gpu"}]}}))
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"automountServiceAccountToken": false,
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}], "containers": containers},
    })
}

/// The devices of the node's ResourceSlices, as published.
fn slice_devices(b: &RealBox) -> Vec<Value> {
    let slices = get(&b.plane, &["get", "resourceslices"]);
    slices["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["spec"]["nodeName"] == NODE)
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .collect()
}

/// A device's GPU UUID, from its `uuid` attribute (both drivers publish one).
fn device_uuid(d: &Value) -> Option<&str> {
    d["attributes"]["uuid"]["string"].as_str()
}

/// The devices the node's ResourceSlices offer now: name → UUID, those with a taint that keeps
/// claims off (`NoSchedule`, `NoExecute`) left out.
fn pool(b: &RealBox) -> BTreeMap<String, String> {
    slice_devices(b)
        .iter()
        .filter(|d| !d["taints"].as_array().into_iter().flatten().any(|t| t["effect"] != "None"))
        .filter_map(|d| Some((d["name"].as_str()?.to_owned(), device_uuid(d)?.to_owned())))
        .collect()
}

/// The device of the node's ResourceSlices whose UUID is `uuid`, as published.
fn slice_device(b: &RealBox, uuid: &str) -> Value {
    slice_devices(b).into_iter().find(|d| device_uuid(d) == Some(uuid)).unwrap_or(Value::Null)
}

/// Waits (a minute) until the pool has `count` devices.
fn wait_pool(b: &RealBox, count: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while pool(b).len() != count {
        assert!(
            Instant::now() < deadline,
            "the ResourceSlice offers {:?}, not {count} devices, after 60 s:\n{}",
            pool(b),
            b.node(NODE).unwrap().daemon.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// One pod of a scenario: its name, its claim's, its containers, the MiB its claim asks of each
/// GPU.
struct Want {
    pod: String,
    claim: String,
    containers: Vec<&'static str>,
    mib: u64,
}

fn want(pod: &str, containers: &[&'static str], mib: u64) -> Want {
    Want { pod: pod.to_owned(), claim: format!("{pod}-gpu"), containers: containers.to_vec(), mib }
}

/// Creates each pod's claim (`count` GPUs) and the pod.
fn create(b: &RealBox, d: Driver, pods: &[Want], count: u32) {
    for w in pods {
        b.plane.create(&d.claim(&w.claim, w.mib, count)).unwrap();
        b.plane.create(&pod(&w.pod, &w.claim, &w.containers)).unwrap();
    }
}

/// What one container was created with.
#[derive(Debug)]
struct SeenContainer {
    name: String,
    /// The GPUs it sees, by UUID: its `/dev/nvidiaN` device nodes and the UUIDs
    /// `NVIDIA_VISIBLE_DEVICES` names.
    gpus: Vec<String>,
    /// `GPUSHARE_MEMORY_MIB` or HAMi-core's `CUDA_DEVICE_MEMORY_LIMIT_0`, if any.
    budget_mib: Option<u64>,
    running: bool,
    created: usize,
}

/// What became of one pod.
#[derive(Debug)]
struct Seen {
    pod: String,
    phase: String,
    waiting: String,
    /// The GPUs its claim was allocated (UUID) and the MiB it consumes of each.
    allocated: Vec<(String, u64)>,
    containers: Vec<SeenContainer>,
}

impl Seen {
    fn runs(&self, containers: usize) -> bool {
        self.phase == "Running" && self.containers.iter().filter(|c| c.running).count() == containers
    }

    fn json(&self) -> Value {
        json!({"pod": self.pod, "phase": self.phase, "waiting": self.waiting, "allocated": self.allocated,
               "containers": self.containers.iter().map(|c| json!({"name": c.name, "gpus": c.gpus,
                   "budget_mib": c.budget_mib, "running": c.running, "created": c.created})).collect::<Vec<_>>()})
    }
}

/// A memory quantity as the API writes it (`12000Mi`, `40Gi`), MiB.
fn mib_of(q: &str) -> Option<u64> {
    if let Some(n) = q.strip_suffix("Mi") {
        return n.parse().ok();
    }
    if let Some(n) = q.strip_suffix("Gi") {
        return n.parse::<u64>().ok().map(|g| g * 1024);
    }
    q.parse::<u64>().ok().map(|bytes| bytes / (1024 * 1024))
}

/// What became of each of `pods`, now.
fn observe(b: &RealBox, pods: &[Want]) -> Vec<Seen> {
    let created = b.node(NODE).unwrap().started().unwrap_or_else(|e| panic!("{e:#}"));
    let items = get(&b.plane, &["get", "pods", "-n", "default"]);
    let claims = get(&b.plane, &["get", "resourceclaims", "-n", "default"]);
    let devices = slice_devices(b);
    let uuid_of = |device: &str| {
        devices
            .iter()
            .find(|d| d["name"] == device)
            .and_then(|d| device_uuid(d).map(str::to_owned))
            // Both drivers name a GPU `gpu-<index>`: the slice may be gone a while (a kubelet
            // restarting removes it until the driver registers again).
            .or_else(|| {
                device.strip_prefix("gpu-")?.parse::<usize>().ok().and_then(|i| gpus().get(i).map(|g| g.uuid.clone()))
            })
            .unwrap_or_else(|| format!("{device} (not in any slice)"))
    };
    let by_minor: BTreeMap<String, String> =
        gpus().into_iter().map(|g| (format!("/dev/nvidia{}", g.minor), g.uuid)).collect();
    pods.iter()
        .map(|w| {
            let find = |list: &Value, name: &str| {
                list["items"].as_array().and_then(|a| a.iter().find(|p| p["metadata"]["name"] == name)).cloned()
            };
            let p = find(&items, &w.pod).unwrap_or(Value::Null);
            let c = find(&claims, &w.claim).unwrap_or(Value::Null);
            let allocated = c["status"]["allocation"]["devices"]["results"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| {
                    let consumed = r["consumedCapacity"]["memory"].as_str().and_then(mib_of).unwrap_or(0);
                    (uuid_of(r["device"].as_str().unwrap_or_default()), consumed)
                })
                .collect();
            let containers = w
                .containers
                .iter()
                .map(|name| {
                    let mine: Vec<_> = created.iter().filter(|c| c.pod == w.pod && c.container == *name).collect();
                    let last = mine.last();
                    let mut gpus: Vec<String> = last
                        .map(|c| {
                            let nodes = c.devices.iter().filter_map(|path| by_minor.get(path).cloned());
                            let visible = c
                                .envs
                                .get("NVIDIA_VISIBLE_DEVICES")
                                .into_iter()
                                .flat_map(|v| v.split(','))
                                .filter(|v| v.starts_with("GPU-"))
                                .map(str::to_owned);
                            nodes.chain(visible).collect()
                        })
                        .unwrap_or_default();
                    gpus.sort();
                    gpus.dedup();
                    let budget_mib = last.and_then(|c| {
                        c.envs
                            .get("GPUSHARE_MEMORY_MIB")
                            .map(String::as_str)
                            .or_else(|| c.envs.get("CUDA_DEVICE_MEMORY_LIMIT_0").map(|v| v.trim_end_matches('m')))
                            .and_then(|v| v.parse().ok())
                    });
                    SeenContainer {
                        name: (*name).to_owned(),
                        gpus,
                        budget_mib,
                        running: last.is_some_and(|c| c.running),
                        created: mine.len(),
                    }
                })
                .collect();
            let waiting = p["status"]["conditions"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["type"] == "PodScheduled" && c["status"] == "False"))
                .and_then(|c| c["message"].as_str())
                .unwrap_or("")
                .to_owned();
            Seen {
                pod: w.pod.clone(),
                phase: p["status"]["phase"].as_str().unwrap_or("").to_owned(),
                waiting,
                allocated,
                containers,
            }
        })
        .collect()
}

/// Waits (at most `timeout`) until at least `running` of `pods` run and each other one says why
/// it waits, then two seconds more; returns what each became.
fn settle(b: &RealBox, pods: &[Want], running: usize, timeout: Duration) -> Vec<Seen> {
    let deadline = Instant::now() + timeout;
    loop {
        let seen = observe(b, pods);
        let runs = seen.iter().zip(pods).filter(|(s, w)| s.runs(w.containers.len())).count();
        let explained = seen.iter().zip(pods).all(|(s, w)| s.runs(w.containers.len()) || !s.waiting.is_empty());
        if (runs >= running && explained) || Instant::now() > deadline {
            std::thread::sleep(Duration::from_secs(2));
            return observe(b, pods);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The rules every scenario applies: each running container sees exactly its claim's GPUs and
/// is told its budget, was created once; no GPU holds more than it has; each pod that does not
/// run says why; `running` of them run.
fn judge(seen: &[Seen], pods: &[Want], running: usize) -> Verdict {
    let mut problems = Vec::new();
    let mut per_gpu: BTreeMap<&str, u64> = BTreeMap::new();
    for (s, w) in seen.iter().zip(pods) {
        if !s.runs(w.containers.len()) {
            if s.waiting.is_empty() {
                problems.push(format!("{} does not run ({}) and nothing says why", s.pod, s.phase));
            }
            continue;
        }
        let mut allocated: Vec<&str> = s.allocated.iter().map(|(u, _)| u.as_str()).collect();
        allocated.sort_unstable();
        for c in &s.containers {
            if c.gpus != allocated {
                problems.push(format!(
                    "{}/{} sees GPUs {:?}; its claim was allocated {allocated:?}",
                    s.pod, c.name, c.gpus
                ));
            }
            if c.budget_mib != Some(w.mib) {
                problems.push(format!("{}/{} is not told its {} MiB (told {:?})", s.pod, c.name, w.mib, c.budget_mib));
            }
            if c.created != 1 {
                problems.push(format!("{}/{} was created {} times", s.pod, c.name, c.created));
            }
        }
        for gpu in s.containers.iter().flat_map(|c| &c.gpus).collect::<std::collections::BTreeSet<_>>() {
            *per_gpu.entry(gpu).or_default() += w.mib;
        }
    }
    for (gpu, mib) in per_gpu {
        if mib > GPU_MIB {
            problems.push(format!("GPU {gpu} runs claims of {mib} MiB of its {GPU_MIB}"));
        }
    }
    let runs = seen.iter().zip(pods).filter(|(s, w)| s.runs(w.containers.len())).count();
    if runs != running {
        problems.push(format!("{runs} of {} pods run, not {running}", pods.len()));
    }
    if problems.is_empty() { Verdict::Pass } else { Verdict::Fail(problems.join("; ")) }
}

/// `verdict` with `problem` (a failure the common rules do not see) put first.
fn and_also(verdict: Verdict, problem: Option<String>) -> Verdict {
    match (verdict, problem) {
        (v, None) => v,
        (Verdict::Fail(how), Some(p)) => Verdict::Fail(format!("{p}; {how}")),
        (_, Some(p)) => Verdict::Fail(p),
    }
}

/// Runs `each` for every driver that runs here and records the outcomes in the DRA table.
async fn scenario(name: &str, each: impl AsyncFn(Driver) -> Option<(Verdict, Value)>) {
    let mut outcomes = Vec::new();
    for d in Driver::runnable() {
        let Some((verdict, evidence)) = each(d).await else { return };
        outcomes.push((
            d.column(),
            verdict.clone(),
            json!({"driver": d.column(), "verdict": verdict.to_string(), "seen": evidence}),
        ));
    }
    record_in(TABLE, name, &outcomes);
}

fn evidence(seen: &[Seen]) -> Value {
    Value::Array(seen.iter().map(Seen::json).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_one_claim_shared_by_two_containers() {
    scenario("dra-one-claim", async |d| {
        let mut b = d.up("").await?;
        let pods = [want("p", &["main", "sidecar"], 3500)];
        create(&b, d, &pods, 1);
        let seen = settle(&b, &pods, 1, Duration::from_secs(60));
        b.shutdown();
        Some((judge(&seen, &pods, 1), evidence(&seen)))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_same_size_claims_racing() {
    scenario("dra-race", async |d| {
        let mut b = d.up("").await?;
        // 8 claims of 12000 MiB at once: 3 fit each 40960 MiB GPU.
        let pods: Vec<Want> = (0..8).map(|i| want(&format!("r{i}"), &["main"], 12_000)).collect();
        create(&b, d, &pods, 1);
        let seen = settle(&b, &pods, 6, Duration::from_secs(60));
        b.shutdown();
        Some((judge(&seen, &pods, 6), evidence(&seen)))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_one_claim_of_two_gpus() {
    scenario("dra-multi-gpu", async |d| {
        let mut b = d.up("").await?;
        let pods = [want("m", &["main"], 8000)];
        create(&b, d, &pods, 2);
        let seen = settle(&b, &pods, 1, Duration::from_secs(60));
        b.shutdown();
        let two = (seen[0].allocated.len() != 2).then(|| format!("allocated {:?}, not two GPUs", seen[0].allocated));
        let verdict = and_also(judge(&seen, &pods, 1), two);
        Some((verdict, evidence(&seen)))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_a_claim_that_fits_no_gpu() {
    scenario("dra-no-fit", async |d| {
        let mut b = d.up("").await?;
        let pods = [want("big", &["main"], 50_000)];
        create(&b, d, &pods, 1);
        let seen = settle(&b, &pods, 0, Duration::from_secs(30));
        b.shutdown();
        // As in the device-plugin table: the reason must say what was asked and what there is.
        let waiting = &seen[0].waiting;
        let vague = !(waiting.contains("50000") && waiting.contains(&GPU_MIB.to_string()));
        let verdict = and_also(judge(&seen, &pods, 0), vague.then(|| format!("waits, but the reason is {waiting:?}")));
        Some((verdict, evidence(&seen)))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_a_gpu_with_an_xid() {
    scenario("dra-xid", async |d| {
        let mut b = d.up("[health]\nprobe_interval_seconds = 1\nrecovery_seconds = 15\n").await?;
        let first = [want("x1", &["main"], 1000)];
        create(&b, d, &first, 1);
        let seen = settle(&b, &first, 1, Duration::from_secs(60));
        let Some((sick, _)) = seen[0].allocated.first().cloned() else {
            b.shutdown();
            return Some((Verdict::Fail("the first claim did not run".into()), evidence(&seen)));
        };
        let index = gpus().iter().position(|g| g.uuid == sick).unwrap();
        gpushare_testkit::nvml::inject(&b.node(NODE).unwrap().events, &format!("xid {index} 79")).unwrap();
        // The sick GPU should leave the pool; a new claim should go to the other GPU.
        let t = Instant::now();
        while pool(&b).values().any(|u| *u == sick) && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(250));
        }
        let left = !pool(&b).values().any(|u| *u == sick);
        let taints = slice_device(&b, &sick)["taints"].clone();
        let second = [want("x2", &["main"], 1000)];
        create(&b, d, &second, 1);
        let after = settle(&b, &second, 1, Duration::from_secs(60));
        // Back once no new fault came for a while and the GPU answers (gpushare: 15 s here).
        let t = Instant::now();
        while !pool(&b).values().any(|u| *u == sick) && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(500));
        }
        let back = pool(&b).values().any(|u| *u == sick);
        b.shutdown();
        let mut problems = Vec::new();
        if !left {
            problems.push("the GPU with the Xid stayed in the pool for 20 s".to_owned());
        }
        if after[0].allocated.iter().any(|(u, _)| *u == sick) {
            problems.push("a new claim was allocated the GPU with the Xid".to_owned());
        }
        if left && !back {
            problems.push("the GPU did not come back within 60 s of the fault".to_owned());
        }
        let verdict = and_also(judge(&after, &second, 1), (!problems.is_empty()).then(|| problems.join("; ")));
        Some((
            verdict,
            json!({"sick": sick, "left": left, "taints": taints, "back": back, "first": evidence(&seen), "second": evidence(&after)}),
        ))
    })
    .await;
}

/// 6 claims of 6000 MiB running, 6 more arriving, and then `kill` (the kubelet or the driver's
/// plugin killed and started again): every running container keeps its GPU, all 12 run.
async fn burst_with_restart(d: Driver, kill: fn(&mut RealBox)) -> Option<(Verdict, Value)> {
    let mut b = d.up("").await?;
    let first: Vec<Want> = (0..6).map(|i| want(&format!("k{i}"), &["main"], 6000)).collect();
    create(&b, d, &first, 1);
    settle(&b, &first, 6, Duration::from_secs(60));
    let more: Vec<Want> = (6..12).map(|i| want(&format!("k{i}"), &["main"], 6000)).collect();
    create(&b, d, &more, 1);
    std::thread::sleep(Duration::from_millis(300));
    kill(&mut b);
    let all: Vec<Want> = first.into_iter().chain(more).collect();
    let seen = settle(&b, &all, 12, Duration::from_secs(90));
    // The node's GPUs offered again: a claim arriving now can be placed.
    let t = Instant::now();
    while pool(&b).len() != 2 && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(500));
    }
    let offered = pool(&b).len();
    b.shutdown();
    let problems =
        (offered != 2).then(|| format!("the node's ResourceSlice offers {offered} of 2 GPUs 60 s after the restart"));
    Some((and_also(judge(&seen, &all, 12), problems), json!({"seen": evidence(&seen), "offered_after": offered})))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_a_kubelet_restart_under_load() {
    scenario("dra-kubelet-restart", async |d| {
        burst_with_restart(d, |b| {
            let plane = &b.plane;
            b.nodes[0].kubelet.restart(plane).unwrap();
        })
        .await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_the_driver_restarted_mid_burst() {
    scenario("dra-driver-restart", async |d| {
        burst_with_restart(d, |b| {
            let daemon = &mut b.nodes[0].daemon;
            daemon.kill();
            std::thread::sleep(Duration::from_secs(2));
            daemon.start().unwrap();
        })
        .await
    })
    .await;
}
