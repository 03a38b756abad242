//! What the side-by-side suite shares: each system under test set up as a node of the
//! real-cluster box, a workload written the way that system's users write it, what the real
//! kubelet then did (each pod's phase and the scheduler's reason, each container's GPUs and
//! budget as its process reported them on containerd, or as the recording runtime received
//! them for HAMi), the evidence kept as JSON, and the check that
//! docs/comparison.md says what was seen.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

use gpushare_testkit::containerd::PROBE_IMAGE;
use gpushare_testkit::nvml::FakeGpu;
use gpushare_testkit::peers::{self, ALIYUN_GPU_MEM, HAMI_GPU, HAMI_GPUMEM, HAMI_SPLIT, NVIDIA_GPU, NvidiaSharing};
use gpushare_testkit::realbox::{Runtime, is_root};
use serde_json::{Value, json};

use crate::realbox::{RealBox, get, repo, up_on};

/// The node every scenario runs on.
pub(crate) const NODE: &str = "gpu-node";

/// A system under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum System {
    /// gpushared and gpushare-extender.
    Gpushare,
    /// NVIDIA's k8s-device-plugin with time-slicing, 4 replicas per GPU (the value of NVIDIA's
    /// own example), under the default kube-scheduler.
    Nvidia,
    /// Alibaba's gpushare-device-plugin in MiB mode (`--memory-unit=MiB`, as its users run it)
    /// and gpushare-scheduler-extender, built from source (`GPUSHARE_PEERS_SRC`).
    Alibaba,
    /// HAMi's scheduler (extender and mutating webhook) and NVIDIA device plugin, built from
    /// source (`GPUSHARE_PEERS_SRC`), with its chart's defaults: each GPU shared by up to 10
    /// pods, memory asked per GPU in MiB (`nvidia.com/gpumem`).
    Hami,
}

/// Time-slicing replicas per GPU for [`System::Nvidia`].
pub(crate) const NVIDIA_REPLICAS: u32 = 4;

impl System {
    /// Every system, in the order of the table's columns.
    pub(crate) const ALL: [System; 4] = [System::Gpushare, System::Nvidia, System::Alibaba, System::Hami];

    /// The systems that can run here: each peer built from source only when its source was
    /// given; for one that was not, one line on stderr saying so (its column keeps the last
    /// recorded run).
    #[must_use]
    /// `GPUSHARE_SIDES` (a comma-separated list of `gpushare`, `nvidia`, `alibaba`, `hami`)
    /// keeps only those, to study one system (with `GPUSHARE_BOX_DIR`, which holds one box).
    pub(crate) fn runnable() -> Vec<System> {
        let chosen = std::env::var("GPUSHARE_SIDES").ok();
        System::ALL
            .into_iter()
            .filter(|s| chosen.as_deref().is_none_or(|c| c.split(',').any(|k| k.trim() == s.key())))
            .filter(|s| match s {
                System::Alibaba => gpushare_testkit::peers::alibaba()
                    .map(|(_, commits)| {
                        eprintln!("Alibaba's gpushare built from: {}", commits.trim().replace('\n', "; "));
                    })
                    .map_err(|why| eprintln!("{why}"))
                    .is_ok(),
                System::Hami => gpushare_testkit::peers::hami()
                    .map(|(_, commits)| eprintln!("HAMi built from: {}", commits.trim().replace('\n', "; ")))
                    .map_err(|why| eprintln!("{why}"))
                    .is_ok(),
                System::Gpushare | System::Nvidia => true,
            })
            .collect()
    }

    /// The system's name in `GPUSHARE_SIDES`.
    #[must_use]
    pub(crate) fn key(self) -> &'static str {
        match self {
            System::Gpushare => "gpushare",
            System::Nvidia => "nvidia",
            System::Alibaba => "alibaba",
            System::Hami => "hami",
        }
    }

    /// The container runtime of its node: containerd and runc, so that containers' GPUs and
    /// budgets are what each process saw; HAMi's stays on the recording runtime, judged on
    /// what its plugin asked of it, since the plugin mounts its `libvgpu.so` and
    /// `ld.so.preload` from host paths the box does not have.
    #[must_use]
    pub(crate) fn runtime(self) -> Runtime {
        match self {
            System::Gpushare | System::Nvidia | System::Alibaba => Runtime::Containerd,
            System::Hami => Runtime::Recording,
        }
    }

    /// The column's heading in docs/comparison.md.
    #[must_use]
    pub(crate) fn column(self) -> &'static str {
        match self {
            System::Gpushare => "gpushare",
            System::Nvidia => "NVIDIA device plugin",
            System::Alibaba => "Alibaba gpushare",
            System::Hami => "HAMi",
        }
    }

    /// The real-cluster box with one node of `gpus` run by this system (`ours_extra`: added to
    /// gpushared.toml), its devices in the kubelet's allocatable; `None` where the box cannot run
    /// here (outside CI).
    pub(crate) async fn up(self, gpus: &[FakeGpu], ours_extra: &str) -> Option<RealBox> {
        let b = self.up_unwaited(gpus, ours_extra).await?;
        match self {
            System::Gpushare => b.wait_devices(NODE, Duration::from_secs(90)),
            System::Nvidia => {
                let replicas = (gpus.len() * NVIDIA_REPLICAS as usize).to_string();
                b.wait_allocatable(NODE, NVIDIA_GPU, &replicas, Duration::from_secs(60))
            }
            System::Alibaba => {
                let mib: u64 = gpus.iter().map(|g| g.memory_mib).sum();
                b.wait_allocatable(NODE, ALIYUN_GPU_MEM, &mib.to_string(), Duration::from_secs(90))
            }
            System::Hami => {
                let slots = (gpus.len() * HAMI_SPLIT as usize).to_string();
                let waited = b.wait_allocatable(NODE, HAMI_GPU, &slots, Duration::from_secs(90));
                // Its scheduler places nothing on a node until it has read the node's devices;
                // in a cluster that happens long before pods arrive.
                let registered = format!("node=\"{NODE}\"");
                let deadline = Instant::now() + Duration::from_secs(60);
                while gpushare_testkit::cluster::http_get(b.observe, "/metrics")
                    .await
                    .is_none_or(|(_, body)| !body.contains(&registered))
                {
                    assert!(Instant::now() < deadline, "HAMi's scheduler has not registered {NODE} after 60 s");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                waited
            }
        }
        .unwrap_or_else(|e| panic!("{e:#}"));
        Some(b)
    }

    /// [`Self::up`] without waiting for the node's devices.
    pub(crate) async fn up_unwaited(self, gpus: &[FakeGpu], ours_extra: &str) -> Option<RealBox> {
        if !is_root() {
            gpushare_testkit::skip_unless_ci("the real kubelet needs root (it runs in a mount namespace of its own)");
            return None;
        }
        let mut b = up_on("gpushare-scheduler-config.yaml", "", self.runtime()).await?;
        match self {
            System::Gpushare => b.add_node(NODE, gpus, ("", ours_extra)).map(|_| ()),
            System::Nvidia => b.add_nvidia_node(NODE, gpus, NvidiaSharing { replicas: NVIDIA_REPLICAS }).map(|_| ()),
            // Alibaba's extender takes the place of ours: kube-scheduler calls it alone.
            System::Alibaba => peers::start_alibaba_extender(&mut b.plane)
                .map(|extender| b.extender = extender)
                .and_then(|()| b.add_alibaba_node(NODE, gpus, "MiB").map(|_| ())),
            // HAMi's scheduler takes the place of our extender; its webhook sends the pods to it.
            // b.observe: its metrics, which say when it has registered the node.
            System::Hami => peers::start_hami_scheduler(&mut b.plane, HAMI_SPLIT)
                .map(|(scheduler, metrics)| (b.extender, b.observe) = (scheduler, metrics))
                .and_then(|()| b.add_hami_node(NODE, gpus, HAMI_SPLIT).map(|_| ())),
        }
        .unwrap_or_else(|e| panic!("{e:#}"));
        Some(b)
    }

    /// A pod of `containers` as this system's users ask for it: gpushare in MiB
    /// (`gpushare.io/gpu-mem`, and `gpushare.io/gpu-count` above one GPU); NVIDIA in GPUs
    /// (`nvidia.com/gpu`: time-slicing replicas), its memory not expressible; Alibaba in MiB
    /// (`aliyun.com/gpu-mem`, the container's whole memory: it has no GPU count per container).
    #[must_use]
    pub(crate) fn pod(self, name: &str, containers: &[Ctr]) -> Value {
        let spec = |c: &Ctr| {
            let limits = match self {
                System::Gpushare if c.gpus > 1 => {
                    json!({"gpushare.io/gpu-mem": (c.mib * u64::from(c.gpus)).to_string(),
                                                          "gpushare.io/gpu-count": c.gpus.to_string()})
                }
                System::Gpushare => json!({"gpushare.io/gpu-mem": c.mib.to_string()}),
                System::Nvidia => json!({NVIDIA_GPU: c.gpus.to_string()}),
                System::Alibaba => json!({ALIYUN_GPU_MEM: (c.mib * u64::from(c.gpus)).to_string()}),
                System::Hami => json!({HAMI_GPU: c.gpus.to_string(), HAMI_GPUMEM: c.mib.to_string()}),
            };
            // The probe: an app container waits, an init container runs `true` and exits.
            let command: &[&str] = if c.init { &["true"] } else { &[] };
            json!({"name": c.name, "image": PROBE_IMAGE, "command": command, "resources": {"limits": limits}})
        };
        let init: Vec<Value> = containers.iter().filter(|c| c.init).map(spec).collect();
        let main: Vec<Value> = containers.iter().filter(|c| !c.init).map(spec).collect();
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
               "spec": {"automountServiceAccountToken": false, "initContainers": init, "containers": main}})
    }
}

/// One container of a scenario's pod: what it needs (`mib` on each of `gpus` GPUs).
#[derive(Clone, Debug)]
pub(crate) struct Ctr {
    /// Its name.
    pub(crate) name: &'static str,
    /// MiB it needs on each GPU.
    pub(crate) mib: u64,
    /// GPUs.
    pub(crate) gpus: u32,
    /// An init container (it runs to completion first).
    pub(crate) init: bool,
}

impl Ctr {
    /// An app container named `main` that needs `mib` on one GPU.
    #[must_use]
    pub(crate) fn main(mib: u64) -> Ctr {
        Ctr { name: "main", mib, gpus: 1, init: false }
    }
}

/// What one container started with.
#[derive(Clone, Debug)]
pub(crate) struct SeenContainer {
    /// Its name.
    pub(crate) name: String,
    /// The GPUs `NVIDIA_VISIBLE_DEVICES` names, by UUID (an index there, as Alibaba's plugin
    /// writes on some nodes, is read as the UUID of the node's GPU of that index).
    pub(crate) gpus: Vec<String>,
    /// The budget it was told (`GPUSHARE_MEMORY_MIB`, or Alibaba's
    /// `ALIYUN_COM_GPU_MEM_CONTAINER`, MiB in its MiB mode), if any.
    pub(crate) budget_mib: Option<u64>,
    /// Whether it runs now.
    pub(crate) running: bool,
}

/// What became of one pod.
#[derive(Clone, Debug)]
pub(crate) struct Seen {
    /// The pod's name.
    pub(crate) pod: String,
    /// Its phase.
    pub(crate) phase: String,
    /// The scheduler's message while it waits (`PodScheduled` false), or empty.
    pub(crate) waiting: String,
    /// The kubelet's reason and message when it refused the pod (`Failed`), or empty.
    pub(crate) refused: String,
    /// Its containers, each start.
    pub(crate) containers: Vec<SeenContainer>,
}

impl Seen {
    /// Whether it runs with `containers` app containers running.
    #[must_use]
    pub(crate) fn runs(&self, app_containers: usize) -> bool {
        self.phase == "Running" && self.containers.iter().filter(|c| c.running).count() == app_containers
    }
}

/// Creates `pods` (name, containers) as `system` asks for them, then [`settle`]s.
pub(crate) fn run(b: &RealBox, system: System, pods: &[(String, Vec<Ctr>)], running: usize) -> Vec<Seen> {
    for (name, containers) in pods {
        b.plane.create(&system.pod(name, containers)).unwrap();
    }
    settle(b, pods, running)
}

/// Waits (at most a minute) until at least `running` of `pods` run all their app containers
/// and each of the others runs or says why it does not, then two seconds more, for what would
/// run beyond that to show; returns what each became. kube-scheduler retries a pod it could
/// not place with a back-off of up to 10 s, so a pod waiting is no sign that the node settled.
pub(crate) fn settle(b: &RealBox, pods: &[(String, Vec<Ctr>)], running: usize) -> Vec<Seen> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let apps = |c: &[Ctr]| c.iter().filter(|c| !c.init).count();
    loop {
        let seen = observe(b, pods);
        let runs = seen.iter().zip(pods).filter(|(s, (_, c))| s.runs(apps(c))).count();
        let explained =
            seen.iter().zip(pods).all(|(s, (_, c))| s.runs(apps(c)) || !s.waiting.is_empty() || s.phase == "Failed");
        if (runs >= running && explained) || Instant::now() > deadline {
            std::thread::sleep(Duration::from_secs(2));
            return observe(b, pods);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// What became of each of `pods`, now.
pub(crate) fn observe(b: &RealBox, pods: &[(String, Vec<Ctr>)]) -> Vec<Seen> {
    let started = b.node(NODE).unwrap().started().unwrap_or_else(|e| panic!("{e:#}"));
    let items = get(&b.plane, &["get", "pods", "-n", "default"]);
    pods.iter()
        .map(|(name, _)| {
            let p = items["items"].as_array().unwrap().iter().find(|p| p["metadata"]["name"] == name.as_str());
            let condition = p
                .and_then(|p| p["status"]["conditions"].as_array())
                .and_then(|cs| cs.iter().find(|c| c["type"] == "PodScheduled" && c["status"] == "False"));
            let containers = started
                .iter()
                .filter(|c| &c.pod == name)
                .map(|c| SeenContainer {
                    name: c.container.clone(),
                    gpus: c
                        .envs
                        .get("NVIDIA_VISIBLE_DEVICES")
                        .map(|v| v.split(',').map(gpu_uuid).collect())
                        .unwrap_or_default(),
                    budget_mib: c
                        .envs
                        .get("GPUSHARE_MEMORY_MIB")
                        .or_else(|| c.envs.get("ALIYUN_COM_GPU_MEM_CONTAINER"))
                        .map(String::as_str)
                        // HAMi-core's limit on the container's first GPU, `<MiB>m`.
                        .or_else(|| c.envs.get("CUDA_DEVICE_MEMORY_LIMIT_0").map(|v| v.trim_end_matches('m')))
                        .and_then(|v| v.parse().ok()),
                    running: c.running,
                })
                .collect();
            Seen {
                pod: name.clone(),
                phase: p.and_then(|p| p["status"]["phase"].as_str()).unwrap_or("").to_owned(),
                waiting: condition.and_then(|c| c["message"].as_str()).unwrap_or("").to_owned(),
                refused: p
                    .filter(|p| p["status"]["phase"] == "Failed")
                    .map(|p| format!("{}: {}", p["status"]["reason"], p["status"]["message"]))
                    .unwrap_or_default(),
                containers,
            }
        })
        .collect()
}

/// A GPU as `NVIDIA_VISIBLE_DEVICES` names it, as its UUID: an index is the node's GPU of that
/// index (the scenarios' GPUs are [`FakeGpu::new`]'s), anything else is taken as it is.
fn gpu_uuid(name: &str) -> String {
    match name.parse::<u32>() {
        Ok(i) => FakeGpu::new(NODE, i, 0, "").uuid,
        Err(_) => name.to_owned(),
    }
}

/// The MiB the running containers need on each GPU they see, by the GPU's UUID.
#[must_use]
pub(crate) fn load(seen: &[Seen], pods: &[(String, Vec<Ctr>)]) -> BTreeMap<String, u64> {
    let mut per_gpu = BTreeMap::new();
    for (s, (_, ctrs)) in seen.iter().zip(pods) {
        for c in s.containers.iter().filter(|c| c.running) {
            let Some(want) = ctrs.iter().find(|w| w.name == c.name) else { continue };
            for gpu in &c.gpus {
                *per_gpu.entry(gpu.clone()).or_default() += want.mib;
            }
        }
    }
    per_gpu
}

/// A scenario's outcome for one system.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// It did what the scenario asks.
    Pass,
    /// It did not; how.
    Fail(String),
    /// The system has no way to express the scenario; why.
    NotExpressible(String),
}

impl Verdict {
    /// The word a table cell starts with.
    #[must_use]
    pub(crate) fn word(&self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail(_) => "fail",
            Verdict::NotExpressible(_) => "n/a",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Pass => f.write_str("pass"),
            Verdict::Fail(how) => write!(f, "fail: {how}"),
            Verdict::NotExpressible(why) => write!(f, "n/a: {why}"),
        }
    }
}

/// The evidence of one scenario run for one system: what was seen, as JSON.
#[must_use]
pub(crate) fn evidence(system: System, verdict: &Verdict, seen: &[Seen], extra: &Value) -> Value {
    let pods: Vec<Value> = seen
        .iter()
        .map(|s| {
            json!({"pod": s.pod, "phase": s.phase, "waiting": s.waiting, "refused": s.refused,
                   "containers": s.containers.iter().map(|c| json!({"name": c.name, "gpus": c.gpus,
                       "budget_mib": c.budget_mib, "running": c.running})).collect::<Vec<_>>()})
        })
        .collect();
    json!({"system": system.column(), "verdict": verdict.to_string(), "pods": pods, "more": extra})
}

/// Keeps the evidence of `scenario` (one entry per system) in
/// `target/tmp/side-by-side/<scenario>.json`, then checks that docs/comparison.md's row of
/// `scenario` says what was seen: each system's cell starts with its verdict's word.
///
/// # Panics
/// If the row is missing or says otherwise.
pub(crate) fn record(scenario: &str, outcomes: &[(System, Verdict, Value)]) {
    let columns: Vec<(&str, Verdict, Value)> =
        outcomes.iter().map(|(s, v, e)| (s.column(), v.clone(), e.clone())).collect();
    record_in("scenario", scenario, &columns);
}

/// [`record`] for the table of docs/comparison.md whose header row starts with `header`, the
/// outcomes by column heading.
///
/// # Panics
/// If the row is missing or says otherwise.
pub(crate) fn record_in(header: &str, scenario: &str, outcomes: &[(&str, Verdict, Value)]) {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("side-by-side");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("{scenario}.json"));
    let all: Vec<&Value> = outcomes.iter().map(|(_, _, e)| e).collect();
    std::fs::write(&file, serde_json::to_string_pretty(&all).unwrap()).unwrap();
    for (column, verdict, _) in outcomes {
        eprintln!("{scenario}: {column}: {verdict}");
    }
    let doc = std::fs::read_to_string(repo().join("docs/comparison.md")).unwrap();
    let cells = row(&doc, scenario).unwrap_or_else(|| panic!("docs/comparison.md has no row for `{scenario}`"));
    let headings = row(&doc, header).unwrap_or_else(|| panic!("docs/comparison.md has no table headed {header:?}"));
    for (column, verdict, _) in outcomes {
        let at = headings
            .iter()
            .position(|h| h == column)
            .unwrap_or_else(|| panic!("docs/comparison.md's {header:?} table has no column {column:?}"));
        let cell = cells.get(at).map_or("", String::as_str);
        // A peer that loses a race only in some runs has failed it, and one passing run does not
        // contradict the record: such a cell starts with INTERMITTENT. gpushare's never may.
        let intermittent = cell.starts_with(INTERMITTENT);
        assert!(
            !(intermittent && column.starts_with("gpushare")),
            "docs/comparison.md calls gpushare's `{scenario}` intermittent: gpushare must pass every run"
        );
        assert!(
            cell.starts_with(verdict.word()) || (intermittent && *verdict == Verdict::Pass),
            "docs/comparison.md says {cell:?} of {column} in `{scenario}`, but this run saw {verdict} (evidence: {})",
            file.display()
        );
    }
}

/// How a docs/comparison.md cell starts for a peer that failed a scenario in some runs and
/// passed it in others (the cell says how often).
const INTERMITTENT: &str = "fail in some runs";

/// The cells of the table row whose first cell is `` `key` `` (or `key`, for the header).
fn row(doc: &str, key: &str) -> Option<Vec<String>> {
    doc.lines().find_map(|line| {
        let cells: Vec<String> =
            line.trim().strip_prefix('|')?.strip_suffix('|')?.split('|').map(|c| c.trim().to_owned()).collect();
        let first = cells.first()?;
        (first.trim_matches('`') == key).then_some(cells)
    })
}
