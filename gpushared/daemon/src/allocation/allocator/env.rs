//! A container's answer to the kubelet: the environment it gets (documented in
//! docs/gpushared.md) and what it mounts, built from its assignment and the node's GPUs. Pure:
//! the same rows always give the same answer, so a repeated `Allocate` is answered alike.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpushare_core::codec::alibaba;
use gpushare_core::codec::assignment::{Assignment, ContainerAssignment, GpuShare};
use gpushare_core::codec::node::PodRef;
use gpushare_core::{GpuUuid, Mib, NodeInventory};

use crate::allocation::ledger::Row;
use crate::allocation::pods::StoredPod;
use crate::config::{Compatibility, DeviceNode, DeviceNodesConfig, MpsConfig};

/// A container's answer: the environment the kubelet puts into it, and what it mounts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// Environment variables.
    pub envs: BTreeMap<String, String>,
    /// Host directories mounted into the container (the MPS pipe directory on MPS GPUs).
    pub mounts: Vec<Mount>,
    /// The device nodes it gets (`[device_nodes]`; none unless enabled).
    pub devices: Vec<DeviceNode>,
    /// Which pod and container it was for.
    pub pod: PodRef,
    /// The container.
    pub container: String,
}

/// A host directory mounted into a container at the same path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    /// The path, on the host and in the container.
    pub path: std::path::PathBuf,
    /// Mounted read-only.
    pub read_only: bool,
}

/// What a container or claim is given besides what its spec has: a prepared claim's CDI
/// device, or a container the runtime creates on a node whose kubelet counts the memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Edits {
    /// Its environment.
    pub envs: BTreeMap<String, String>,
    /// Its mounts.
    pub mounts: Vec<Mount>,
    /// Its device nodes (`[device_nodes]`; none unless enabled).
    pub devices: Vec<DeviceNode>,
}

impl From<Answer> for Edits {
    fn from(a: Answer) -> Self {
        Edits { envs: a.envs, mounts: a.mounts, devices: a.devices }
    }
}

/// What builds the answers of one node: its GPUs, the MPS settings, the device nodes named and
/// the compatibility mode.
#[derive(Clone, Copy, Debug)]
pub(super) struct Environment<'a> {
    /// This node.
    pub node: &'a str,
    /// Its GPUs.
    pub inventory: &'a NodeInventory,
    /// How MPS clients are set up.
    pub mps: &'a MpsConfig,
    /// Which device nodes are named.
    pub nodes: &'a DeviceNodesConfig,
    /// Whether Alibaba's variables are added.
    pub compat: Compatibility,
    /// Whether containers get only the variables that place and bound them
    /// (`[kubelet] environment = "lean"`).
    pub lean: bool,
}

/// The variables `[kubelet] environment = "lean"` leaves out of a container's answer: they
/// describe its GPUs and budget again, and each costs the kubelet its bytes in every
/// checkpoint rewrite (`NVIDIA_VISIBLE_DEVICES` and `CUDA_DEVICE_MEMORY_LIMIT_<i>` carry the
/// same GPUs and budget).
const INFORMATIONAL: [&str; 6] = [
    "GPUSHARE_GPU_UUIDS",
    "GPUSHARE_GPU_INDEXES",
    "GPUSHARE_GPU_TOTAL_MIB",
    "GPUSHARE_MEMORY_MIB",
    "GPUSHARE_MEMORY_TOTAL_MIB",
    "GPUSHARE_UNIT",
];

impl Environment<'_> {
    /// The answer for `c`, a container of `pod` placed by `assignment`.
    pub(super) fn answer(&self, pod: &PodRef, assignment: &Assignment, c: &ContainerAssignment) -> Answer {
        Answer {
            envs: self.envs(pod, assignment, c),
            mounts: self.mounts(c),
            devices: self.devices(&c.gpus),
            pod: pod.clone(),
            container: c.name.clone(),
        }
    }

    /// The answer already given for these rows (a repeated `Allocate`); `last` is the latest of
    /// them, `pod` the pod as stored, for its whole assignment.
    pub(super) fn answer_from_rows(&self, last: &Row, rows: &[Row], pod: Option<&StoredPod>) -> Answer {
        let container = ContainerAssignment {
            name: last.container.clone(),
            role: last.role,
            gpus: rows.iter().map(|r| GpuShare { index: r.gpu_index, uuid: r.gpu_uuid.clone(), mib: r.mib }).collect(),
        };
        let assignment = match pod.and_then(|p| p.assignment.as_ref()) {
            Some(Ok(a)) => Arc::clone(a),
            _ => Arc::new(Assignment {
                node: self.node.to_owned(),
                unit: self.inventory.unit(),
                containers: vec![container.clone()],
            }),
        };
        self.answer(&last.pod, &assignment, &container)
    }

    /// Whether every GPU of the container is in MPS mode (a container spanning shared and MPS
    /// GPUs is served as shared: one MPS client cannot leave some of its devices out).
    fn on_mps(&self, c: &ContainerAssignment) -> bool {
        self.all_mps(&c.gpus)
    }

    /// Whether there are GPUs and every one runs MPS (`mps` or `dra-mps`).
    fn all_mps(&self, gpus: &[GpuShare]) -> bool {
        !gpus.is_empty()
            && gpus.iter().all(|g| self.inventory.gpus().iter().any(|x| x.uuid == g.uuid && x.mode.runs_mps()))
    }

    /// What a container mounts: the MPS pipe directory when it is an MPS client.
    fn mounts(&self, c: &ContainerAssignment) -> Vec<Mount> {
        self.mps_mounts(self.on_mps(c))
    }

    fn mps_mounts(&self, mps: bool) -> Vec<Mount> {
        if mps {
            vec![Mount {
                path: self.mps.pipe_directory.path().to_path_buf(),
                read_only: self.mps.pipe_directory_read_only,
            }]
        } else {
            Vec::new()
        }
    }

    /// The device nodes of a container or claim holding `gpus`, in index order.
    fn devices(&self, gpus: &[GpuShare]) -> Vec<DeviceNode> {
        let mut gpus: Vec<&GpuShare> = gpus.iter().collect();
        gpus.sort_by_key(|g| g.index);
        let minors: Vec<u32> = gpus
            .iter()
            .map(|g| {
                let known = self.inventory.gpus().iter().find(|x| x.uuid == g.uuid);
                known.map_or(g.index, gpushare_core::Gpu::device_number)
            })
            .collect();
        self.nodes.nodes(&minors)
    }

    /// A GPU's total memory (zero for one this node does not have).
    fn total_of(&self, uuid: &GpuUuid) -> Mib {
        self.inventory.gpus().iter().find(|g| &g.uuid == uuid).map_or(Mib::ZERO, |g| g.total)
    }

    /// The environment, mounts and device nodes of a prepared DRA claim holding `shares` (its
    /// CDI device's, documented in docs/dra.md): the GPUs and budget variables a container
    /// placed by the device plugin gets, with `GPUSHARE_CLAIM` (namespace/name) for the pod and
    /// container; on `dra-mps` GPUs, the MPS client's variables and the pipe directory. Shares
    /// of several requests on one GPU are one GPU to the container, with their memory together.
    pub(super) fn claim_answer(&self, claim: &str, shares: &[GpuShare]) -> Edits {
        let mut merged: Vec<GpuShare> = Vec::with_capacity(shares.len());
        for s in shares {
            match merged.iter_mut().find(|m| m.index == s.index) {
                Some(m) => m.mib = m.mib.saturating_add(s.mib),
                None => merged.push(s.clone()),
            }
        }
        let mut gpus: Vec<&GpuShare> = merged.iter().collect();
        gpus.sort_by_key(|g| g.index);
        let mut env = self.budget_envs(&gpus);
        env.insert("GPUSHARE_CLAIM".to_owned(), claim.to_owned());
        let mps = self.all_mps(shares);
        if mps {
            self.mps_envs(&gpus, &mut env);
        }
        Edits { envs: env, mounts: self.mps_mounts(mps), devices: self.devices(&merged) }
    }

    /// The GPUs and budget of a container or claim holding `gpus` (sorted by index).
    fn budget_envs(&self, gpus: &[&GpuShare]) -> BTreeMap<String, String> {
        let join = |f: &dyn Fn(&GpuShare) -> String| gpus.iter().map(|g| f(g)).collect::<Vec<_>>().join(",");
        let container_mib: u64 = gpus.iter().map(|g| g.mib.get()).sum();
        let per_gpu = gpus.first().map_or(0, |g| g.mib.get());
        let mut env = BTreeMap::new();
        env.insert("NVIDIA_VISIBLE_DEVICES".to_owned(), join(&|g| g.uuid.to_string()));
        env.insert("GPUSHARE_GPU_UUIDS".to_owned(), join(&|g| g.uuid.to_string()));
        env.insert("GPUSHARE_GPU_INDEXES".to_owned(), join(&|g| g.index.to_string()));
        env.insert("GPUSHARE_GPU_TOTAL_MIB".to_owned(), join(&|g| self.total_of(&g.uuid).get().to_string()));
        env.insert("GPUSHARE_MEMORY_MIB".to_owned(), per_gpu.to_string());
        env.insert("GPUSHARE_MEMORY_TOTAL_MIB".to_owned(), container_mib.to_string());
        env.insert("GPUSHARE_UNIT".to_owned(), self.inventory.unit().to_string());
        // HAMi-core's budget per device, by the container's device ordinal (the order of
        // NVIDIA_VISIBLE_DEVICES): an image that carries that library enforces it.
        for (i, g) in gpus.iter().enumerate() {
            env.insert(format!("CUDA_DEVICE_MEMORY_LIMIT_{i}"), format!("{}m", g.mib.get()));
        }
        env
    }

    /// A client of the GPUs' MPS control daemon (`gpus` sorted by index): its memory pinned to
    /// the budget, its threads to the configured share.
    fn mps_envs(&self, gpus: &[&GpuShare], env: &mut BTreeMap<String, String>) {
        env.insert("CUDA_MPS_PIPE_DIRECTORY".to_owned(), self.mps.pipe_directory.path().display().to_string());
        env.insert(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_owned(),
            gpus.iter().enumerate().map(|(i, g)| format!("{i}={}M", g.mib.get())).collect::<Vec<_>>().join(","),
        );
        let share = gpus
            .iter()
            .map(|g| self.mps.active_thread_percentage.percentage(g.mib, self.total_of(&g.uuid)))
            .max()
            .unwrap_or(100);
        env.insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_owned(), share.to_string());
    }

    /// The environment of a container (documented in docs/gpushared.md).
    fn envs(&self, pod: &PodRef, assignment: &Assignment, c: &ContainerAssignment) -> BTreeMap<String, String> {
        let mut gpus: Vec<&GpuShare> = c.gpus.iter().collect();
        gpus.sort_by_key(|g| g.index);
        let container_mib: u64 = gpus.iter().map(|g| g.mib.get()).sum();
        let mut env = self.budget_envs(&gpus);
        env.insert("GPUSHARE_POD".to_owned(), pod.to_string());
        env.insert("GPUSHARE_CONTAINER".to_owned(), c.name.clone());
        if self.on_mps(c) {
            self.mps_envs(&gpus, &mut env);
        }
        if self.compat == Compatibility::Alibaba {
            let unit = self.inventory.unit();
            let first = gpus.first().and_then(|g| self.inventory.gpus().iter().find(|x| x.uuid == g.uuid));
            let pod_mib: u64 = assignment
                .containers
                .iter()
                .filter(|c| c.role.is_long_running())
                .flat_map(|c| c.gpus.iter().map(|g| g.mib.get()))
                .sum();
            if let Some(g) = first {
                env.insert(alibaba::IDX.to_owned(), g.device_number().to_string());
                env.insert(alibaba::DEV.to_owned(), unit.whole_units(g.total).to_string());
            }
            env.insert(alibaba::POD.to_owned(), unit.whole_units(Mib::new(pod_mib)).to_string());
            env.insert(alibaba::CONTAINER.to_owned(), unit.whole_units(Mib::new(container_mib)).to_string());
        }
        if self.lean {
            env.retain(|name, _| !INFORMATIONAL.contains(&name.as_str()));
        }
        env
    }
}
