//! The move off Alibaba's gpushare, live, as docs/install.md §7 tells an operator to make it.
//!
//! Alibaba's gpushare-scheduler-extender and gpushare-device-plugin (MiB mode), built from
//! source by `tests/peers/build` (`GPUSHARE_PEERS_SRC`) and run unmodified, place a mixed
//! workload on three real-kubelet nodes of the real-cluster box. Then the suite takes §7's
//! steps in order — gpushare-extender installed (compatibility `alibaba`), the first node
//! cordoned, handed to gpushared and checked, kube-scheduler switched, the node uncordoned —
//! takes the way back on that node for an operator who aborts (§7, "Going back"), and then the
//! whole move, node by node. New pods arrive after every step, and the pods already running
//! stay.
//!
//! Every node runs containerd and runc, so each container really starts and the pods already
//! running live through each step as processes. After every step the same checks, from what
//! each container's process reported and what containerd lists as running:
//! - no container of a pod was created again, and none moved to another GPU;
//! - every pod runs (or, where the step leaves no node to place GPU pods on, waits and says
//!   why), each GPU pod's container on the GPU its placement names, told its budget;
//! - no GPU holds more than it has, and both `kubectl-inspect-gpushare` (Alibaba's, and ours
//!   with `--alibaba`) print the same table, each GPU's use exactly what its running containers
//!   need: nothing missed, nothing counted twice;
//! - each node's kubelet reports all its memory allocatable, and its pods ask no more.
//!
//! The evidence of each step goes to `target/tmp/move-off-alibaba.json`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_testkit::cluster::{Proc, http_get};
use gpushare_testkit::containerd::PROBE_IMAGE;
use gpushare_testkit::nvml::FakeGpu;
use gpushare_testkit::peers::{self, ALIYUN_GPU_MEM};
use gpushare_testkit::realbox::{Runtime, Started, is_root};
use serde_json::{Value, json};

mod realbox;
use realbox::{RealBox, get, repo, up_on};

/// The GPU nodes, each of two GPUs of [`GPU_MIB`].
const NODES: [&str; 3] = ["gpu-a", "gpu-b", "gpu-c"];
/// Each GPU's memory.
const GPU_MIB: u64 = 16160;
/// gpushared.toml and gpushare-extender.toml as §7 has them for Alibaba's MiB mode.
const OURS: &str = "[resources]\nunit = \"MiB\"\ncompatibility = \"alibaba\"\n";

fn gpus(node: &str) -> Vec<FakeGpu> {
    (0..2).map(|i| FakeGpu::new(node, i, GPU_MIB, "Tesla V100-SXM2-16GB")).collect()
}

/// A pod as Alibaba's users write it: `aliyun.com/gpu-mem` MiB for its one container, or (0) a
/// pod that needs no GPU; on `node` only, if one is named.
fn pod(name: &str, mib: u64, node: Option<&str>) -> Value {
    let resources = if mib == 0 {
        json!({"requests": {"cpu": "10m"}})
    } else {
        json!({"limits": {ALIYUN_GPU_MEM: mib.to_string()}})
    };
    let mut p = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
           "spec": {"automountServiceAccountToken": false,
                    "containers": [{"name": "main", "image": PROBE_IMAGE, "resources": resources}]}});
    if let Some(node) = node {
        p["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": node});
    }
    p
}

/// A container as first seen running: its pod's UID, node and GPU (UUID; none for a pod
/// without GPU).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Placed {
    uid: String,
    node: String,
    gpu: Option<String>,
}

/// One look at the cluster: the pods, each container start on the nodes (with its node), and
/// the pods that may wait in this step.
struct Seen {
    pods: Value,
    created: Vec<(String, Started)>,
    may_wait: Vec<String>,
}

impl Seen {
    /// Whether pod `name` waits with the scheduler's reason, and may.
    fn waits(&self, name: &str) -> bool {
        self.may_wait.iter().any(|n| n == name) && !waiting(find(&self.pods, name)).is_empty()
    }
}

/// The move under way: the box, Alibaba's extender, and what was seen so far.
struct Move {
    b: RealBox,
    alibaba_extender: Proc,
    alibaba_url: String,
    /// Every pod created, with the MiB it asks (0: no GPU).
    pods: Vec<(String, u64)>,
    /// The pods only for one node, and that node.
    pinned: BTreeMap<String, String>,
    /// Each pod's container as first seen running.
    first: BTreeMap<String, Placed>,
    waves: usize,
    /// MiB the running containers need on each GPU (node, index), as the last check saw.
    used: BTreeMap<(String, u32), u64>,
    evidence: Vec<Value>,
}

impl Move {
    /// The cluster before the move: Alibaba's extender called by kube-scheduler, and its device
    /// plugin serving each node labelled `gpushare=true`, as its `DaemonSet` selects them.
    /// gpushare-extender is not running yet.
    async fn up() -> Option<Move> {
        if !is_root() {
            gpushare_testkit::skip_unless_ci("the real kubelet needs root (it runs in a mount namespace of its own)");
            return None;
        }
        if let Err(why) = peers::alibaba() {
            // Said in the CI log by tests/peers/build too: the harness keeps this to itself.
            eprintln!("the move off Alibaba did not run: {why}");
            return None;
        }
        let mut b = up_on("gpushare-scheduler-config-alibaba.yaml", OURS, Runtime::Containerd).await?;
        b.extender.stop(Duration::from_secs(5));
        let (alibaba_extender, alibaba_url) = peers::spawn_alibaba_extender(&b.plane, "info").unwrap();
        b.plane.start_scheduler_config(&peers::alibaba_scheduler_config(&alibaba_url)).unwrap();
        for node in NODES {
            b.add_alibaba_node(node, &gpus(node), "MiB").unwrap();
            b.plane.kubectl(&["label", "node", node, "gpushare=true"]).unwrap();
        }
        let m = Move {
            b,
            alibaba_extender,
            alibaba_url,
            pods: vec![],
            pinned: BTreeMap::new(),
            first: BTreeMap::new(),
            waves: 0,
            used: BTreeMap::new(),
            evidence: vec![],
        };
        for node in NODES {
            m.wait_all_allocatable(node);
        }
        Some(m)
    }

    /// Waits until `node`'s kubelet reports all its GPU memory allocatable.
    fn wait_all_allocatable(&self, node: &str) {
        let total = (GPU_MIB * 2).to_string();
        self.b
            .wait_allocatable(node, ALIYUN_GPU_MEM, &total, Duration::from_secs(90))
            .unwrap_or_else(|e| panic!("{e:#}\n{}", self.b.node(node).unwrap().daemon.log_tail(30)));
    }

    /// New pods arrive: one per entry of `mib` (0: a pod without GPU).
    fn arrive(&mut self, mib: &[u64]) {
        self.arrive_on(None, mib);
    }

    /// [`Self::arrive`], the pods only for `node` where one is named.
    fn arrive_on(&mut self, node: Option<&str>, mib: &[u64]) {
        self.waves += 1;
        for (i, &m) in mib.iter().enumerate() {
            let name = format!("w{}-{i}-{m}", self.waves);
            self.b.plane.create(&pod(&name, m, node)).unwrap();
            if let Some(node) = node {
                self.pinned.insert(name.clone(), node.to_owned());
            }
            self.pods.push((name, m));
        }
    }

    fn kubectl(&self, args: &[&str]) {
        self.b.plane.kubectl(args).unwrap_or_else(|e| panic!("kubectl {}: {e:#}", args.join(" ")));
    }

    /// §7 step 1: gpushare-extender installed and running; kube-scheduler does not call it yet.
    async fn install_extender(&mut self) {
        self.b.extender.start().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while http_get(self.b.addr, "/readyz").await.is_none_or(|(s, _)| s != 200) {
            assert!(Instant::now() < deadline, "gpushare-extender is not ready:\n{}", self.b.extender.log_tail(30));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// §7 steps 2 and 5 up to the uncordon: cordon the node, take its `gpushare=true` label
    /// (Alibaba's plugin stops), install gpushared, check its configuration, enable it, and see
    /// its node state published.
    fn hand_to_gpushared(&mut self, node: &str) {
        self.kubectl(&["cordon", node]);
        self.kubectl(&["label", "node", node, "gpushare-"]);
        // `gpushared --check-config` runs in there: a configuration it refuses fails the step.
        self.b.replace_with_gpushared(node, &gpus(node), OURS).unwrap();
        self.wait_all_allocatable(node);
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.b.node_state(node).is_err() {
            assert!(Instant::now() < deadline, "gpushared publishes no node state on {node}");
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// §7 step 3: kube-scheduler loads the shipped Alibaba variant, calling gpushare-extender;
    /// Alibaba's extender is removed.
    fn switch_scheduler(&mut self) {
        let shipped = repo().join("etc/kube-scheduler/gpushare-scheduler-config-alibaba.yaml");
        let url = format!("http://{}/gpushare-scheduler", self.b.addr);
        self.b.plane.start_scheduler(&shipped, &url).unwrap();
        self.alibaba_extender.stop(Duration::from_secs(5));
    }

    /// §7 "Going back", on one node: cordon it, kube-scheduler back to Alibaba's extender (which
    /// would place pods gpushared then refuses, were any other node still on gpushared),
    /// gpushare-extender stopped, gpushared stopped and the node labelled for Alibaba's plugin
    /// again, then uncordoned.
    fn go_back(&mut self, node: &str) {
        self.kubectl(&["cordon", node]);
        self.alibaba_extender.start().unwrap();
        let config = peers::alibaba_scheduler_config(&self.alibaba_url);
        self.b.plane.start_scheduler_config(&config).unwrap();
        self.b.extender.stop(Duration::from_secs(5));
        self.b.replace_with_alibaba(node, &gpus(node), "MiB").unwrap();
        self.kubectl(&["label", "node", node, "gpushare=true"]);
        self.wait_all_allocatable(node);
        self.kubectl(&["uncordon", node]);
    }

    /// The most MiB free on one GPU of `node`, as the last check saw.
    fn most_free(&self, node: &str) -> u64 {
        (0..2).map(|i| GPU_MIB - self.used.get(&(node.to_owned(), i)).copied().unwrap_or(0)).max().unwrap_or(0)
    }

    /// Waits (at most 90 s) until every pod runs or, where `may_wait` or the pod is only for a
    /// cordoned node, waits with the scheduler's reason; then checks everything the module header
    /// lists and keeps the evidence of `step`.
    fn check(&mut self, step: &str, may_wait: bool) {
        let seen = self.settle(may_wait);
        let mut problems = Vec::new();
        let used = self.check_pods(&seen, &mut problems);
        let (theirs, ours) = peers::inspect_both(&self.b.plane.admin);
        check_inspects(&used, (&theirs, &ours), &mut problems);
        let kubelet = self.kubelet_view(&seen.pods);
        for (node, (allocatable, asked)) in &kubelet {
            if *allocatable != GPU_MIB * 2 || asked > allocatable {
                problems.push(format!("{node}'s kubelet: {allocatable} allocatable, its pods ask {asked}"));
            }
        }
        let placed: BTreeMap<&String, String> = self.first.iter().map(|(k, v)| (k, format!("{v:?}"))).collect();
        self.evidence.push(json!({"step": step, "problems": problems, "inspect": {"alibaba": theirs, "ours": ours},
                                  "kubelet": kubelet, "placed": placed}));
        self.used = used;
        let file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("move-off-alibaba.json");
        std::fs::write(&file, serde_json::to_string_pretty(&self.evidence).unwrap()).unwrap();
        eprintln!("{step}: {} pods, {} problems\n{ours}", self.pods.len(), problems.len());
        assert!(
            problems.is_empty(),
            "after \"{step}\":\n{}\nAlibaba's inspect:\n{theirs}\nours:\n{ours}\nevidence: {}",
            problems.join("\n"),
            file.display()
        );
    }

    /// Waits (at most 90 s) until every pod runs, has failed, or waits with the scheduler's
    /// reason where it may (`may_wait`, or the pod is only for a cordoned node); what was seen.
    fn settle(&self, may_wait: bool) -> Seen {
        let nodes = get(&self.b.plane, &["get", "nodes"]);
        let cordoned: Vec<&str> = nodes["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["spec"]["unschedulable"] == true)
            .filter_map(|n| n["metadata"]["name"].as_str())
            .collect();
        let may_wait: Vec<String> = self
            .pods
            .iter()
            .map(|(name, _)| name)
            .filter(|name| may_wait || self.pinned.get(*name).is_some_and(|n| cordoned.contains(&n.as_str())))
            .cloned()
            .collect();
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let seen = Seen {
                pods: get(&self.b.plane, &["get", "pods", "-n", "default"]),
                created: self
                    .b
                    .nodes
                    .iter()
                    .flat_map(|n| {
                        let started = n.started().unwrap_or_else(|e| panic!("{}: {e:#}", n.name));
                        started.into_iter().map(|c| (n.name.clone(), c))
                    })
                    .collect(),
                may_wait: may_wait.clone(),
            };
            let settled = self.pods.iter().all(|(name, _)| {
                let p = find(&seen.pods, name);
                let runs =
                    p["status"]["phase"] == "Running" && seen.created.iter().any(|(_, c)| &c.pod == name && c.running);
                runs || seen.waits(name) || p["status"]["phase"] == "Failed"
            });
            if settled || Instant::now() > deadline {
                return seen;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Checks each pod against what was seen: running (or waiting where it may), its one
    /// container never created again nor moved, each GPU pod on the GPU its placement names and
    /// told its budget. Returns the MiB the running containers need on each GPU (node, index).
    fn check_pods(&mut self, seen: &Seen, problems: &mut Vec<String>) -> BTreeMap<(String, u32), u64> {
        let mut used: BTreeMap<(String, u32), u64> = BTreeMap::new();
        for (name, mib) in &self.pods {
            let p = find(&seen.pods, name);
            if p["status"]["phase"] != "Running" {
                if !(p["status"]["phase"] == "Pending" && seen.waits(name)) {
                    let why = format!("{}{}", p["status"]["message"].as_str().unwrap_or(""), waiting(p));
                    problems.push(format!("{name} is {} ({why}) and not running", p["status"]["phase"]));
                }
                continue;
            }
            let mine: Vec<&(String, Started)> = seen.created.iter().filter(|(_, c)| &c.pod == name).collect();
            let [(node, c)] = mine.as_slice() else {
                problems.push(format!("{name}'s container was created {} times", mine.len()));
                continue;
            };
            let gpu = c.envs.get("NVIDIA_VISIBLE_DEVICES").filter(|_| *mib > 0).map(|v| gpu_uuid(node, v));
            let now = Placed { uid: c.pod_uid.clone(), node: node.clone(), gpu: gpu.clone() };
            match self.first.get(name) {
                Some(was) if *was != now => problems.push(format!("{name} was {was:?}, is now {now:?}")),
                Some(_) => {}
                None => {
                    self.first.insert(name.clone(), now);
                }
            }
            if !c.running {
                problems.push(format!("{name}'s container is no longer running"));
            }
            if *mib == 0 {
                continue;
            }
            let chosen = placement(node, p);
            let budget = c.envs.get("ALIYUN_COM_GPU_MEM_CONTAINER").and_then(|v| v.parse::<u64>().ok());
            if chosen.is_none() || gpu != chosen.as_ref().map(|(uuid, _)| uuid.clone()) || budget != Some(*mib) {
                problems.push(format!(
                    "{name} runs on {gpu:?} told {budget:?} MiB; it was placed on {chosen:?} for {mib} MiB"
                ));
            }
            if let Some((_, index)) = chosen {
                *used.entry((node.clone(), index)).or_default() += mib;
            }
        }
        for ((node, index), mib) in &used {
            if *mib > GPU_MIB {
                problems.push(format!("{node} GPU{index} runs containers that need {mib} of its {GPU_MIB} MiB"));
            }
        }
        used
    }

    /// Per node, the kubelet's allocatable `aliyun.com/gpu-mem` and what its pods that have not
    /// ended ask of it.
    fn kubelet_view(&self, items: &Value) -> BTreeMap<String, (u64, u64)> {
        NODES
            .iter()
            .map(|node| {
                let allocatable = self.b.allocatable(node, ALIYUN_GPU_MEM).unwrap().parse().unwrap_or(0);
                let asked = items["items"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|p| {
                        p["spec"]["nodeName"] == *node
                            && !matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
                    })
                    .filter_map(|p| p["spec"]["containers"][0]["resources"]["limits"][ALIYUN_GPU_MEM].as_str())
                    .filter_map(|v| v.parse::<u64>().ok())
                    .sum();
                ((*node).to_owned(), (allocatable, asked))
            })
            .collect()
    }
}

/// Checks that both inspects print the same table, and show each GPU used by exactly what its
/// running containers need (`used`): nothing counted twice, nothing missed.
fn check_inspects(used: &BTreeMap<(String, u32), u64>, (theirs, ours): (&str, &str), problems: &mut Vec<String>) {
    if peers::inspect_rows(ours) != peers::inspect_rows(theirs) {
        problems.push("kubectl-inspect-gpushare --alibaba and Alibaba's disagree".into());
    }
    for (view, table) in [("Alibaba's inspect", theirs), ("ours", ours)] {
        for node in NODES {
            for index in 0..2u32 {
                let cell = peers::inspect_cell(table, node, index);
                let want = format!("{}/{GPU_MIB}", used.get(&(node.to_owned(), index)).copied().unwrap_or(0));
                if cell.as_deref() != Some(want.as_str()) {
                    problems.push(format!("{view} shows {node} GPU{index} as {cell:?}; its containers: {want}"));
                }
            }
        }
    }
}

fn find<'a>(items: &'a Value, name: &str) -> &'a Value {
    items["items"].as_array().unwrap().iter().find(|p| p["metadata"]["name"] == name).unwrap_or(&Value::Null)
}

/// The scheduler's message for a pod it has not placed, or empty.
fn waiting(p: &Value) -> String {
    p["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "PodScheduled" && c["status"] == "False"))
        .and_then(|c| c["message"].as_str())
        .unwrap_or("")
        .to_owned()
}

/// A GPU as `NVIDIA_VISIBLE_DEVICES` on `node` names it, as its UUID: an index (as Alibaba's
/// plugin writes on some nodes) is the node's GPU of that index.
fn gpu_uuid(node: &str, v: &str) -> String {
    v.parse::<u32>().map_or_else(|_| v.to_owned(), |i| FakeGpu::new(node, i, 0, "").uuid)
}

/// The GPU pod `p` on `node` was placed on, (UUID, index): by gpushare-extender's assignment,
/// else by Alibaba's `ALIYUN_COM_GPU_MEM_IDX`.
fn placement(node: &str, p: &Value) -> Option<(String, u32)> {
    let annotations = &p["metadata"]["annotations"];
    if let Some(text) = annotations[ASSIGNMENT_KEY].as_str() {
        let a = Assignment::decode(text).ok()?;
        let uuid = a.containers.first()?.gpus.first()?.uuid.as_str().to_owned();
        let index = (0..2).find(|&i| FakeGpu::new(node, i, 0, "").uuid == uuid)?;
        return Some((uuid, index));
    }
    let index = annotations["ALIYUN_COM_GPU_MEM_IDX"].as_str()?.parse::<u32>().ok()?;
    Some((FakeGpu::new(node, index, 0, "").uuid, index))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_move_off_alibaba_keeps_every_pod_where_it_runs() {
    let Some(mut m) = Move::up().await else { return };
    m.arrive(&[4000, 2000, 7000, 0, 3000, 5000, 1000, 6000, 0]);
    m.check("Alibaba's gpushare places a mixed workload", false);

    m.install_extender().await;
    m.arrive(&[2000, 4000]);
    m.check("1. gpushare-extender installed, not called yet", false);

    m.hand_to_gpushared("gpu-a");
    m.arrive(&[3000, 1000]);
    // A pod only for gpu-a waits while it is cordoned: Alibaba's extender would place it there,
    // and gpushared refuse it.
    m.arrive_on(Some("gpu-a"), &[1000]);
    m.check("2. gpu-a cordoned, handed to gpushared", false);

    m.switch_scheduler();
    m.arrive(&[2000, 0]);
    m.check("3. kube-scheduler calls gpushare-extender (GPU pods wait: no switched node is uncordoned)", true);

    m.kubectl(&["uncordon", "gpu-a"]);
    m.arrive(&[5000, 3000]);
    m.check("4. gpu-a uncordoned", false);

    m.go_back("gpu-a");
    m.arrive(&[4000, 2000]);
    // A pod of all a GPU of gpu-a has left fits only where gpushare's pods leave that room: a
    // GPU over its total, or a pod waiting, unless Alibaba's extender counts them.
    let fill = m.most_free("gpu-a");
    m.arrive_on(Some("gpu-a"), &[fill]);
    m.check("going back: gpu-a on Alibaba's device plugin, kube-scheduler on its extender", false);

    m.install_extender().await;
    m.hand_to_gpushared("gpu-a");
    m.switch_scheduler();
    m.kubectl(&["uncordon", "gpu-a"]);
    // New GPU pods go to gpu-a alone until gpu-b is switched.
    let room = m.most_free("gpu-a");
    m.arrive(&[room, 0]);
    m.check("the move again: gpu-a on gpushared, kube-scheduler on gpushare-extender", false);

    for node in ["gpu-b", "gpu-c"] {
        m.hand_to_gpushared(node);
        m.kubectl(&["uncordon", node]);
        m.arrive(&[4000, 1000, 0]);
        m.check(&format!("5. {node} handed to gpushared and uncordoned"), false);
    }
    m.b.shutdown();
}
