//! Over-use detection: the memory each GPU process uses (NVML's running compute processes, and
//! on MPS GPUs the MPS clients), tied to its pod and container through the process's cgroup,
//! compared with the container's budget in the ledger.
//!
//! - A process's cgroup (`<proc>/<pid>/cgroup`) names its pod UID (`pod<uid>` in the kubelet's
//!   cgroup paths, cgroupfs or systemd driver) and its container's runtime ID (the last path
//!   segment, `cri-containerd-<id>.scope`, `docker-<id>.scope`, `crio-<id>.scope` or `<id>`),
//!   which the pod's container statuses map to the container's name. A process outside any
//!   pod (the MPS server, a host tool) is not any container's.
//! - A container is **over budget** on a GPU when its processes there use more than its
//!   budget plus `[overuse] tolerance_mib`. A container using a GPU it has no budget on (a
//!   pod that set `NVIDIA_VISIBLE_DEVICES` itself) is over a budget of 0.
//! - The [`Detector`] decides (no I/O, the time passed in); [`run`] feeds it on a thread of its
//!   own and hands its verdicts to the allocator (ledger history, node annotation, D-Bus) and,
//!   with `action = "evict"`, the pods to evict to the API-server side.
//! - Eviction applies only to containers with a gpushare budget on the GPU, once they have
//!   stayed over for `evict_after_seconds`, once per pod.
//! - GPUs served through DRA are not sampled ([`sampled`]): a claim's memory is shared by the
//!   containers of every pod that uses it, so there is no container budget to compare with, and
//!   each of them would read as over a budget of 0.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use gpushare_core::codec::node::{NodeAllocation, OverBudget, PodRef};
use gpushare_core::{Mib, NodeInventory};
use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

use crate::allocation::allocator::Allocator;
use crate::allocation::ledger::EventKind;
use crate::allocation::pods::PodStore;
use crate::config::{OveruseAction, OveruseConfig};

/// One process on a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuProcess {
    /// Its process ID (in the daemon's PID namespace, the host's).
    pub pid: u32,
    /// The GPU memory it uses; `None` when NVML cannot tell.
    pub used: Option<Mib>,
}

/// A source of the processes running on each GPU (NVML on real hosts and on the fake library).
pub trait GpuProcesses: Send {
    /// The processes on the GPU with this NVML index; `mps` also lists the MPS clients.
    ///
    /// # Errors
    /// The reason, for the log, when the GPU does not answer.
    fn processes(&mut self, gpu: u32, mps: bool) -> Result<Vec<GpuProcess>, String>;
}

/// The processes from NVML.
pub struct NvmlProcesses {
    nvml: Arc<Nvml>,
}

impl std::fmt::Debug for NvmlProcesses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlProcesses").finish_non_exhaustive()
    }
}

impl NvmlProcesses {
    /// Processes read through `nvml`.
    #[must_use]
    pub fn new(nvml: Arc<Nvml>) -> Self {
        NvmlProcesses { nvml }
    }
}

impl GpuProcesses for NvmlProcesses {
    fn processes(&mut self, gpu: u32, mps: bool) -> Result<Vec<GpuProcess>, String> {
        let device = self.nvml.device_by_index(gpu).map_err(|e| format!("NVML GPU{gpu}: {e}"))?;
        let mut all = device.running_compute_processes().map_err(|e| format!("NVML GPU{gpu} processes: {e}"))?;
        if mps {
            match device.mps_running_compute_processes() {
                Ok(clients) => all.extend(clients),
                // A driver without the MPS query: the compute list is what there is.
                Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => {}
                Err(e) => return Err(format!("NVML GPU{gpu} MPS clients: {e}")),
            }
        }
        let mut by_pid: BTreeMap<u32, Option<Mib>> = BTreeMap::new();
        for p in all {
            let used = match p.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => Some(Mib::new(bytes.div_ceil(1024 * 1024))),
                UsedGpuMemory::Unavailable => None,
            };
            let entry = by_pid.entry(p.pid).or_insert(used);
            *entry = (*entry).max(used);
        }
        Ok(by_pid.into_iter().map(|(pid, used)| GpuProcess { pid, used }).collect())
    }
}

/// Where a process runs, as its cgroup names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessCgroup {
    /// The pod's UID (with dashes).
    pub pod_uid: String,
    /// The container's runtime ID, when the path names one.
    pub container_id: Option<String>,
}

/// Reads a `/proc/<pid>/cgroup` file: the pod UID and container ID of the first line whose path
/// is under a kubelet pod cgroup (`pod<uid>` segment, dashes or underscores); `None` for a
/// process outside any pod.
#[must_use]
pub fn parse_cgroup(text: &str) -> Option<ProcessCgroup> {
    text.lines().find_map(|line| {
        // hierarchy-ID:controllers:path; the path may itself hold ':'.
        let path = line.splitn(3, ':').nth(2)?;
        let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        let at = segments.iter().rposition(|s| pod_uid(s).is_some())?;
        let pod_uid = pod_uid(segments[at])?;
        let container_id = segments.get(at + 1).and_then(|s| container_id(s));
        Some(ProcessCgroup { pod_uid, container_id })
    })
}

/// `pod<uid>` (cgroupfs) or `kubepods-<qos>-pod<uid_with_underscores>.slice` (systemd).
fn pod_uid(segment: &str) -> Option<String> {
    let segment = segment.strip_suffix(".slice").unwrap_or(segment);
    let at = segment.rfind("pod")?;
    let uid = segment[at + 3..].replace('_', "-");
    let well_formed = uid.len() == 36
        && uid.char_indices().all(|(i, c)| if [8, 13, 18, 23].contains(&i) { c == '-' } else { c.is_ascii_hexdigit() });
    (well_formed && (at == 0 || segment[..at].ends_with('-'))).then_some(uid)
}

/// `<id>`, or `<runtime>-<id>.scope` (systemd): the hex ID.
fn container_id(segment: &str) -> Option<String> {
    let segment = segment.strip_suffix(".scope").unwrap_or(segment);
    let id = segment.rsplit('-').next()?;
    (id.len() >= 12 && id.chars().all(|c| c.is_ascii_hexdigit())).then(|| id.to_owned())
}

/// What the detector needs of a pod bound to this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KnownPod {
    /// Namespace, name, UID.
    pub pod: PodRef,
    /// (container name, runtime ID).
    pub container_ids: Vec<(String, String)>,
}

/// The detector's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Use above the budget that is still within it.
    pub tolerance: Mib,
    /// Whether over-budget pods are evicted.
    pub action: OveruseAction,
    /// How long a container stays over before its pod is evicted (ms).
    pub evict_after_ms: i64,
}

impl From<&OveruseConfig> for Policy {
    fn from(c: &OveruseConfig) -> Self {
        Policy {
            tolerance: Mib::new(c.tolerance_mib),
            action: c.action,
            evict_after_ms: i64::try_from(c.evict_after_seconds.duration().as_millis()).unwrap_or(i64::MAX),
        }
    }
}

/// What one assessment changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Every container over budget now.
    pub current: Vec<OverBudget>,
    /// Of which newly over.
    pub began: Vec<OverBudget>,
    /// Over at the last assessment, within budget (or gone) now; as last seen.
    pub ended: Vec<OverBudget>,
    /// Pods to evict now (each once), with the over-budget entry that decided it.
    pub evict: Vec<OverBudget>,
}

type Key = (String, String, u32);

/// Compares the GPUs' processes with the containers' budgets, remembering who is over since
/// when (see the module documentation).
#[derive(Clone, Debug)]
pub struct Detector {
    policy: Policy,
    over: BTreeMap<Key, OverBudget>,
    evicted: BTreeSet<String>,
}

impl Detector {
    /// No container over budget yet.
    #[must_use]
    pub fn new(policy: Policy) -> Self {
        Detector { policy, over: BTreeMap::new(), evicted: BTreeSet::new() }
    }

    /// One assessment: `processes` per GPU index, each process's cgroup from `cgroup`, the
    /// budgets from the ledger, the pods from the API server; `now_ms` in Unix milliseconds.
    pub fn assess(
        &mut self,
        processes: &[(u32, GpuProcess)],
        cgroup: impl Fn(u32) -> Option<ProcessCgroup>,
        budgets: &[NodeAllocation],
        pods: impl Fn(&str) -> Option<KnownPod>,
        now_ms: i64,
    ) -> Verdict {
        // Memory in use per (pod UID, container, GPU).
        let mut in_use: BTreeMap<Key, (PodRef, Mib)> = BTreeMap::new();
        for &(gpu, process) in processes {
            let Some(used) = process.used else { continue };
            let Some(cg) = cgroup(process.pid) else { continue };
            let known = pods(&cg.pod_uid);
            let pod_budgets = || budgets.iter().filter(|b| b.pod.uid == cg.pod_uid && b.gpu == gpu);
            let Some(pod) =
                known.as_ref().map(|k| k.pod.clone()).or_else(|| pod_budgets().next().map(|b| b.pod.clone()))
            else {
                tracing::debug!(pid = process.pid, pod_uid = %cg.pod_uid, gpu, "a GPU process of a pod not seen yet");
                continue;
            };
            let by_id = cg.container_id.as_ref().and_then(|id| {
                known.as_ref()?.container_ids.iter().find(|(_, cid)| cid == id).map(|(name, _)| name.clone())
            });
            let container = by_id.unwrap_or_else(|| {
                // Not tied to a container yet (no status seen): the pod's only container with a
                // budget on the GPU, else the pod as a whole.
                let mut names: Vec<&str> = pod_budgets().map(|b| b.container.as_str()).collect();
                names.sort_unstable();
                names.dedup();
                if names.len() == 1 { names[0].to_owned() } else { String::new() }
            });
            let entry = in_use.entry((cg.pod_uid.clone(), container, gpu)).or_insert((pod, Mib::ZERO));
            entry.1 = entry.1.saturating_add(used);
        }
        let mut verdict = Verdict::default();
        let mut over = BTreeMap::new();
        for (key, (pod, used)) in in_use {
            let (uid, container, gpu) = &key;
            let budget = budgets
                .iter()
                .filter(|b| &b.pod.uid == uid && b.gpu == *gpu && (container.is_empty() || &b.container == container))
                .fold(Mib::ZERO, |sum, b| sum.saturating_add(b.mib));
            if used <= budget.saturating_add(self.policy.tolerance) {
                continue;
            }
            let since_ms = self.over.get(&key).map_or(now_ms, |o| o.since_ms);
            let entry = OverBudget { pod, container: container.clone(), gpu: *gpu, in_use: used, budget, since_ms };
            if !self.over.contains_key(&key) {
                verdict.began.push(entry.clone());
            }
            over.insert(key, entry);
        }
        for (key, gone) in std::mem::take(&mut self.over) {
            if !over.contains_key(&key) {
                verdict.ended.push(gone);
            }
        }
        if self.policy.action == OveruseAction::Evict {
            for o in over.values() {
                let due = now_ms.saturating_sub(o.since_ms) >= self.policy.evict_after_ms;
                if due && o.budget > Mib::ZERO && self.evicted.insert(o.pod.uid.clone()) {
                    verdict.evict.push(o.clone());
                }
            }
        }
        // A pod evicted and gone is forgotten; a new pod never reuses a UID.
        self.evicted.retain(|uid| over.keys().any(|(u, _, _)| u == uid) || budgets.iter().any(|b| &b.pod.uid == uid));
        verdict.current = over.values().cloned().collect();
        self.over = over;
        verdict
    }
}

/// The words for one over-budget container, for logs and the ledger history.
#[must_use]
pub fn describe(o: &OverBudget) -> String {
    let who = if o.container.is_empty() {
        o.pod.to_string()
    } else {
        format!("{}/{} container {:?}", o.pod.namespace, o.pod.name, o.container)
    };
    if o.budget == Mib::ZERO {
        format!("{who} uses {} MiB on GPU{} without a budget there", o.in_use.get(), o.gpu)
    } else {
        format!("{who} uses {} MiB on GPU{}, over its budget of {} MiB", o.in_use.get(), o.gpu, o.budget.get())
    }
}

/// A pod to evict, sent from the detector's thread to the API-server side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Eviction {
    /// The pod.
    pub pod: PodRef,
    /// Why, for the log and the history.
    pub reason: String,
}

/// Reads `<dir>/<pid>/cgroup`.
fn read_cgroup(dir: &Path, pid: u32) -> Option<ProcessCgroup> {
    std::fs::read_to_string(dir.join(pid.to_string()).join("cgroup")).ok().as_deref().and_then(parse_cgroup)
}

/// The sampler's settings.
#[derive(Clone, Debug)]
pub struct Sampling {
    /// Time between samples.
    pub every: Duration,
    /// Where the processes' cgroups are read.
    pub proc_dir: PathBuf,
}

/// The GPUs whose processes are sampled, with whether their MPS clients are listed too: every
/// GPU but those served through DRA (`dra`, `dra-mps`).
#[must_use]
pub fn sampled(inventory: &NodeInventory) -> Vec<(u32, bool)> {
    inventory.gpus().iter().filter(|g| !g.mode.is_dra()).map(|g| (g.index, g.mode.runs_mps())).collect()
}

/// Samples every `sampling.every` until `stop` is set: the processes of every GPU, judged by
/// `detector`, recorded through `alloc`; pods to evict go to `evict`. Blocking: run it on a
/// thread of its own.
pub fn run(
    mut source: impl GpuProcesses,
    mut detector: Detector,
    alloc: &Allocator,
    pods: &PodStore,
    sampling: &Sampling,
    evict: &tokio::sync::mpsc::UnboundedSender<Eviction>,
    stop: &AtomicBool,
) {
    let gpus = sampled(alloc.inventory());
    let dra: Vec<u32> = alloc.inventory().gpus().iter().filter(|g| g.mode.is_dra()).map(|g| g.index).collect();
    if !dra.is_empty() {
        tracing::info!(gpus = ?dra, "over-use is not checked on GPUs served through DRA: a claim's memory has no per-container budget");
    }
    let mut failing: BTreeSet<u32> = BTreeSet::new();
    while !stop.load(Ordering::Relaxed) {
        let mut processes = Vec::new();
        for &(gpu, mps) in &gpus {
            match source.processes(gpu, mps) {
                Ok(list) => {
                    if failing.remove(&gpu) {
                        tracing::info!(gpu, "the GPU's processes can be listed again");
                    }
                    processes.extend(list.into_iter().map(|p| (gpu, p)));
                }
                Err(reason) => {
                    if failing.insert(gpu) {
                        tracing::warn!(gpu, %reason, "cannot list the GPU's processes; over-use on it is not checked until it answers");
                    }
                }
            }
        }
        let budgets = alloc.node_state(0, "").allocations;
        let verdict = detector.assess(
            &processes,
            |pid| read_cgroup(&sampling.proc_dir, pid),
            &budgets,
            |uid| {
                pods.get(uid).map(|p| KnownPod { pod: p.view.pod.clone(), container_ids: p.view.container_ids.clone() })
            },
            crate::allocation::ledger::now_ms(),
        );
        for o in &verdict.began {
            tracing::warn!(pod = %o.pod, container = %o.container, gpu = o.gpu,
                in_use_mib = o.in_use.get(), budget_mib = o.budget.get(), "container over its GPU memory budget");
        }
        for o in &verdict.ended {
            tracing::info!(pod = %o.pod, container = %o.container, gpu = o.gpu,
                "container back within its GPU memory budget");
        }
        let events: Vec<(EventKind, String)> = (verdict.began.iter().map(|o| (EventKind::OverBudget, describe(o))))
            .chain(
                verdict
                    .ended
                    .iter()
                    .map(|o| (EventKind::WithinBudget, format!("{}: no longer over budget", describe(o)))),
            )
            .collect();
        if let Err(e) = alloc.set_over_budget(verdict.current, &events) {
            tracing::error!(error = %e, "the over-budget change could not be recorded in the ledger history");
        }
        for o in verdict.evict {
            let reason =
                format!("{}, for {} s", describe(&o), (crate::allocation::ledger::now_ms() - o.since_ms) / 1000);
            if evict.send(Eviction { pod: o.pod, reason }).is_err() {
                tracing::error!("the eviction side is gone; over-budget pods are not evicted");
            }
        }
        let deadline = std::time::Instant::now() + sampling.every;
        while !stop.load(Ordering::Relaxed) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100).min(sampling.every));
        }
    }
}

/// Starts [`run`] on a thread named `gpu-overuse`.
///
/// # Errors
/// The I/O error if the thread cannot start.
pub fn spawn(
    source: impl GpuProcesses + 'static,
    detector: Detector,
    alloc: Arc<Allocator>,
    pods: PodStore,
    sampling: Sampling,
    evict: tokio::sync::mpsc::UnboundedSender<Eviction>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("gpu-overuse".into())
        .spawn(move || run(source, detector, &alloc, &pods, &sampling, &evict, &stop))
}

#[cfg(test)]
mod tests;
