//! The allocation service: decides which pod and container each kubelet call serves, checks
//! the GPU has room in the ledger, writes the ledger before answering, and builds the
//! container's environment. It knows nothing of gRPC; `plugin` translates.
//!
//! The kubelet's calls carry only device IDs. The pod is resolved from the pods bound to this
//! node that carry a `gpushare.io/assignment` and still have a container without a ledger row:
//! the kubelet admits one pod at a time, its containers in order (init containers first), so
//! the container being admitted is the first pending container of some pod, and its size is
//! the `allocation_size` asked for. The pod already being admitted wins; otherwise the oldest
//! (the kubelet's admission order). `GetPreferredAllocation` proposes devices on the assigned
//! GPU and remembers the proposal, so the `Allocate` that follows is tied to the same container.
//! A repeated `Allocate` of the same devices gets the same answer from the ledger.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use gpushare_core::codec::alibaba;
use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment, ContainerAssignment};
use gpushare_core::codec::node::PodRef;
use gpushare_core::devices::DeviceMap;
use gpushare_core::placement::footprint;
use gpushare_core::{ContainerRole, GpuUuid, Mib, NodeInventory, PodRequest, ResourceNames};
use thiserror::Error;

use crate::config::Compatibility;
use crate::ledger::{Ledger, LedgerError, NewRow, Row, request_key};
use crate::pods::{PodStore, PodView};

/// Why a kubelet call cannot be served. Every message says what an operator can do.
#[derive(Debug, Error)]
pub enum AllocError {
    /// No pod bound to this node waits for this many devices.
    #[error(
        "no pod bound to node {node} is waiting for {units} {unit} of {resource}{detail}; pods asking for \
         {resource} must be placed by gpushare-extender (kube-scheduler's extender configuration), which writes \
         the {key} annotation"
    )]
    NoCandidate {
        /// This node.
        node: String,
        /// Devices asked for.
        units: usize,
        /// The unit.
        unit: gpushare_core::MemoryUnit,
        /// The memory resource.
        resource: String,
        /// What was found instead.
        detail: String,
        /// The annotation key.
        key: &'static str,
    },
    /// A device ID that is not one of this daemon's.
    #[error("device {0:?} is not one of gpushared's devices on this node (a stale kubelet checkpoint?)")]
    UnknownDevice(String),
    /// The assignment names a GPU this node does not have.
    #[error("pod {pod}: assigned GPU {uuid} is not on this node; delete the pod so it is placed again")]
    UnknownGpu {
        /// namespace/name.
        pod: String,
        /// The GPU.
        uuid: GpuUuid,
    },
    /// The assigned GPU turned unhealthy since the pod was placed.
    #[error("pod {pod}: assigned GPU{index} is unhealthy ({reason}); delete the pod so it is placed again")]
    Unhealthy {
        /// namespace/name.
        pod: String,
        /// GPU index.
        index: u32,
        /// Why.
        reason: String,
    },
    /// The ledger says the GPU has no room for this container.
    #[error(
        "pod {pod} container {container:?}: GPU{index} has {free} free in the ledger, needs {needs}; nothing was \
         allocated"
    )]
    NoRoom {
        /// namespace/name.
        pod: String,
        /// Container.
        container: String,
        /// GPU index.
        index: u32,
        /// Free by the ledger.
        free: Mib,
        /// Needed.
        needs: Mib,
    },
    /// The ledger could not be written: nothing was allocated.
    #[error("{0}; nothing was allocated")]
    Ledger(#[from] LedgerError),
}

/// A container's answer: the environment the kubelet puts into it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// Environment variables.
    pub envs: BTreeMap<String, String>,
    /// Which pod and container it was for.
    pub pod: PodRef,
    /// The container.
    pub container: String,
}

/// Which container a proposal was made for.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Owner {
    uid: String,
    container: String,
}

#[derive(Debug)]
struct State {
    ledger: Ledger,
    /// Proposals by device-set key.
    proposals: BTreeMap<String, Owner>,
    /// The pod the kubelet is admitting (the last one served).
    admitting: Option<String>,
}

/// A container waiting for its devices.
#[derive(Clone, Debug)]
struct Candidate {
    view: PodView,
    assignment: Assignment,
    container: ContainerAssignment,
    units: u64,
}

/// The allocation service of one node.
#[derive(Debug)]
pub struct Allocator {
    node: String,
    names: ResourceNames,
    compat: Compatibility,
    inventory: NodeInventory,
    devices: DeviceMap,
    pods: PodStore,
    state: Mutex<State>,
}

impl Allocator {
    /// A service for `node`'s `inventory`, reading `pods` and writing `ledger`.
    #[must_use]
    pub fn new(
        node: String,
        names: ResourceNames,
        compat: Compatibility,
        inventory: NodeInventory,
        pods: PodStore,
        ledger: Ledger,
    ) -> Self {
        let devices = DeviceMap::new(&inventory);
        Allocator {
            node,
            names,
            compat,
            inventory,
            devices,
            pods,
            state: Mutex::new(State { ledger, proposals: BTreeMap::new(), admitting: None }),
        }
    }

    /// The inventory served.
    #[must_use]
    pub fn inventory(&self) -> &NodeInventory {
        &self.inventory
    }

    /// The device IDs served.
    #[must_use]
    pub fn devices(&self) -> &DeviceMap {
        &self.devices
    }

    /// The memory resource name.
    #[must_use]
    pub fn resource(&self) -> &str {
        self.names.memory.as_str()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the ledger half-written (SQLite
        // transactions), so a poisoned lock is still safe to use.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Live ledger rows.
    ///
    /// # Errors
    /// [`AllocError::Ledger`].
    pub fn live(&self) -> Result<Vec<Row>, AllocError> {
        Ok(self.lock().ledger.live()?)
    }

    /// Runs `f` on the ledger (for release and reconciliation).
    ///
    /// # Errors
    /// What `f` returns.
    pub fn with_ledger<T>(&self, f: impl FnOnce(&mut Ledger) -> Result<T, LedgerError>) -> Result<T, LedgerError> {
        f(&mut self.lock().ledger)
    }

    /// The containers waiting for devices, one per pod (its first container without a ledger
    /// row), plus notes on pods that cannot be served, for error messages.
    fn pending(&self, live: &[Row]) -> (Vec<Candidate>, Vec<String>) {
        let held: BTreeSet<(&str, &str)> = live.iter().map(|r| (r.pod.uid.as_str(), r.container.as_str())).collect();
        let mut out = Vec::new();
        let mut notes = Vec::new();
        for view in self.pods.snapshot() {
            if view.terminal || view.node.as_deref() != Some(self.node.as_str()) {
                continue;
            }
            let name = format!("{}/{}", view.pod.namespace, view.pod.name);
            let Some(text) = view.annotations.get(ASSIGNMENT_KEY) else {
                let asks = PodRequest::from_spec(&view.spec, &self.names, self.inventory.unit())
                    .map_or(true, |r| !r.is_empty());
                if asks {
                    notes.push(format!("{name} has no {ASSIGNMENT_KEY} annotation"));
                }
                continue;
            };
            let assignment = match Assignment::decode(text) {
                Ok(a) if a.node == self.node => a,
                Ok(a) => {
                    notes.push(format!("{name} is assigned to node {}", a.node));
                    continue;
                }
                Err(e) => {
                    notes.push(format!("{name}: {e}"));
                    continue;
                }
            };
            let next = assignment.containers.iter().find(|c| !held.contains(&(view.pod.uid.as_str(), c.name.as_str())));
            if let Some(container) = next.cloned() {
                let mib: u64 = container.gpus.iter().map(|g| g.mib.get()).sum();
                let units = mib / self.inventory.unit().mib_per_unit();
                out.push(Candidate { view: view.clone(), assignment: assignment.clone(), container, units });
            }
        }
        (out, notes)
    }

    /// The container a request of `units` devices is for.
    fn choose(&self, state: &State, units: usize, live: &[Row]) -> Result<Candidate, AllocError> {
        let (pending, notes) = self.pending(live);
        let mut fitting: Vec<Candidate> =
            pending.iter().filter(|c| usize::try_from(c.units).is_ok_and(|u| u == units)).cloned().collect();
        // The pod being admitted first; then containers without an outstanding proposal (a
        // proposal not yet followed by Allocate belongs to another admission); then the oldest.
        let proposed: BTreeSet<(&str, &str)> =
            state.proposals.values().map(|o| (o.uid.as_str(), o.container.as_str())).collect();
        let key = |c: &Candidate| {
            (
                state.admitting.as_deref() != Some(c.view.pod.uid.as_str()),
                proposed.contains(&(c.view.pod.uid.as_str(), c.container.name.as_str())),
                c.view.created.clone(),
                c.view.pod.namespace.clone(),
                c.view.pod.name.clone(),
            )
        };
        fitting.sort_by_cached_key(key);
        fitting.into_iter().next().ok_or_else(|| {
            let mut seen: Vec<String> = pending
                .iter()
                .map(|c| {
                    format!(
                        "{}/{} container {:?} waits for {} {}",
                        c.view.pod.namespace,
                        c.view.pod.name,
                        c.container.name,
                        c.units,
                        self.inventory.unit()
                    )
                })
                .collect();
            seen.extend(notes);
            let detail = if seen.is_empty() { String::new() } else { format!(" ({})", seen.join("; ")) };
            AllocError::NoCandidate {
                node: self.node.clone(),
                units,
                unit: self.inventory.unit(),
                resource: self.names.memory.to_string(),
                detail,
                key: ASSIGNMENT_KEY,
            }
        })
    }

    /// Answers `GetPreferredAllocation` for one container: `size` devices from `available`,
    /// including `must_include`, on the GPUs assigned to the container being admitted.
    ///
    /// # Errors
    /// [`AllocError`] if no pod waits for `size` devices or the ledger cannot be read.
    pub fn preferred(
        &self,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Result<Vec<String>, AllocError> {
        let mut state = self.lock();
        let live = state.ledger.live()?;
        let cand = self.choose(&state, size, &live)?;
        let unit = self.inventory.unit().mib_per_unit();
        // Devices still needed on each assigned GPU.
        let mut need: BTreeMap<usize, u64> = BTreeMap::new();
        for g in &cand.container.gpus {
            if let Some(pos) = self.inventory.position_of(&g.uuid) {
                *need.entry(pos).or_default() += g.mib.get() / unit;
            }
        }
        let mut chosen: Vec<String> = must_include.to_vec();
        for id in must_include {
            if let Some((pos, _)) = self.devices.resolve(id)
                && let Some(n) = need.get_mut(&pos)
            {
                *n = n.saturating_sub(1);
            }
        }
        let taken: BTreeSet<&str> = must_include.iter().map(String::as_str).collect();
        let mut by_gpu: BTreeMap<usize, Vec<(u64, &String)>> = BTreeMap::new();
        for id in available.iter().filter(|id| !taken.contains(id.as_str())) {
            if let Some((pos, k)) = self.devices.resolve(id) {
                by_gpu.entry(pos).or_default().push((k, id));
            }
        }
        for (pos, n) in &need {
            if let Some(ids) = by_gpu.get_mut(pos) {
                ids.sort_unstable();
                let n = usize::try_from(*n).unwrap_or(usize::MAX).min(ids.len());
                chosen.extend(ids.drain(..n).map(|(_, id)| id.clone()));
            }
        }
        if chosen.len() < size {
            // The kubelet's view of this GPU is fuller than ours; any devices keep the count
            // right, the environment still names the assigned GPU.
            tracing::warn!(
                pod = %format!("{}/{}", cand.view.pod.namespace, cand.view.pod.name),
                container = %cand.container.name,
                "not enough free devices on the assigned GPU in the kubelet's view; proposing others"
            );
            let rest = by_gpu.into_values().flatten().map(|(_, id)| id.clone());
            chosen.extend(rest.take(size - chosen.len()));
        }
        chosen.truncate(size.max(must_include.len()));
        state.proposals.insert(
            request_key(&chosen),
            Owner { uid: cand.view.pod.uid.clone(), container: cand.container.name.clone() },
        );
        Ok(chosen)
    }

    /// Answers `Allocate` for one container's devices: resolves the container, checks the
    /// ledger has room, commits the ledger rows, then returns the environment. The same
    /// devices again get the same answer.
    ///
    /// # Errors
    /// [`AllocError`], and nothing is written.
    pub fn allocate(&self, device_ids: &[String]) -> Result<Answer, AllocError> {
        for id in device_ids {
            if self.devices.resolve(id).is_none() {
                return Err(AllocError::UnknownDevice(id.clone()));
            }
        }
        let key = request_key(device_ids);
        let mut state = self.lock();
        let existing = state.ledger.live_by_key(&key)?;
        let live = state.ledger.live()?;
        // Several containers may hold the same devices (see below); the latest one answers.
        if let Some(last) = existing.last() {
            // The kubelet hands an init container's devices on to the next container of the
            // pod: the same devices then belong to a new container, not to a repeated call.
            let reused = last.role == ContainerRole::Init && {
                let (pending, _) = self.pending(&live);
                pending.iter().any(|c| {
                    c.view.pod.uid == last.pod.uid && usize::try_from(c.units).is_ok_and(|u| u == device_ids.len())
                })
            };
            if !reused {
                let rows: Vec<Row> = existing
                    .iter()
                    .filter(|r| r.pod.uid == last.pod.uid && r.container == last.container)
                    .cloned()
                    .collect();
                let view = self.pods.get(&last.pod.uid);
                return Ok(self.answer_from_rows(last, &rows, view.as_ref()));
            }
        }
        let owner = state.proposals.get(&key).cloned();
        let cand = match owner.and_then(|o| self.candidate_for(&o, &live)) {
            Some(c) => c,
            None => self.choose(&state, device_ids.len(), &live)?,
        };
        let pod_name = format!("{}/{}", cand.view.pod.namespace, cand.view.pod.name);
        let mut rows = Vec::with_capacity(cand.container.gpus.len());
        for g in &cand.container.gpus {
            let gpu = self
                .inventory
                .gpus()
                .iter()
                .find(|x| x.uuid == g.uuid)
                .ok_or_else(|| AllocError::UnknownGpu { pod: pod_name.clone(), uuid: g.uuid.clone() })?;
            if let gpushare_core::Health::Unhealthy { reason } = &gpu.health {
                return Err(AllocError::Unhealthy { pod: pod_name, index: gpu.index, reason: reason.clone() });
            }
            rows.push(NewRow {
                pod: cand.view.pod.clone(),
                container: cand.container.name.clone(),
                role: cand.container.role,
                gpu_uuid: g.uuid.clone(),
                gpu_index: gpu.index,
                mib: g.mib,
                device_ids: device_ids.to_vec(),
            });
        }
        self.check_room(&live, &rows, &pod_name)?;
        state.ledger.allocate(&rows)?;
        state.proposals.remove(&key);
        state.admitting = Some(cand.view.pod.uid.clone());
        tracing::info!(
            pod = %pod_name,
            container = %cand.container.name,
            gpus = %rows.iter().map(|r| format!("GPU{}", r.gpu_index)).collect::<Vec<_>>().join(","),
            mib = rows.iter().map(|r| r.mib.get()).sum::<u64>(),
            "allocated"
        );
        Ok(Answer {
            envs: self.envs(&cand.view, &cand.assignment, &cand.container),
            pod: cand.view.pod.clone(),
            container: cand.container.name.clone(),
        })
    }

    /// The candidate for a remembered proposal, if that container still waits.
    fn candidate_for(&self, owner: &Owner, live: &[Row]) -> Option<Candidate> {
        let (pending, _) = self.pending(live);
        pending.into_iter().find(|c| c.view.pod.uid == owner.uid && c.container.name == owner.container)
    }

    /// Refuses rows that would take a GPU past its capacity, counting every pod's footprint.
    fn check_room(&self, live: &[Row], new: &[NewRow], pod_name: &str) -> Result<(), AllocError> {
        type PodRows = BTreeMap<String, Vec<(ContainerRole, GpuUuid, Mib)>>;
        fn used(pods: &PodRows) -> BTreeMap<GpuUuid, Mib> {
            let mut used: BTreeMap<GpuUuid, Mib> = BTreeMap::new();
            for rows in pods.values() {
                for (g, m) in footprint(rows.iter().map(|(role, g, m)| (*role, [(g.clone(), *m)]))) {
                    let e = used.entry(g).or_insert(Mib::ZERO);
                    *e = e.saturating_add(m);
                }
            }
            used
        }
        let mut pods: PodRows = BTreeMap::new();
        for r in live {
            pods.entry(r.pod.uid.clone()).or_default().push((r.role, r.gpu_uuid.clone(), r.mib));
        }
        let before = used(&pods);
        for r in new {
            pods.entry(r.pod.uid.clone()).or_default().push((r.role, r.gpu_uuid.clone(), r.mib));
        }
        let after = used(&pods);
        for r in new {
            let Some(gpu) = self.inventory.gpus().iter().find(|g| g.uuid == r.gpu_uuid) else { continue };
            let cap = gpu.capacity(self.inventory.unit());
            if after.get(&r.gpu_uuid).copied().unwrap_or_default() > cap {
                return Err(AllocError::NoRoom {
                    pod: pod_name.to_owned(),
                    container: r.container.clone(),
                    index: gpu.index,
                    free: cap.saturating_sub(before.get(&r.gpu_uuid).copied().unwrap_or_default()),
                    needs: r.mib,
                });
            }
        }
        Ok(())
    }

    fn answer_from_rows(&self, first: &Row, rows: &[Row], view: Option<&PodView>) -> Answer {
        let container = ContainerAssignment {
            name: first.container.clone(),
            role: first.role,
            gpus: rows
                .iter()
                .map(|r| gpushare_core::codec::assignment::GpuShare {
                    index: r.gpu_index,
                    uuid: r.gpu_uuid.clone(),
                    mib: r.mib,
                })
                .collect(),
        };
        let assignment = view
            .and_then(|v| v.annotations.get(ASSIGNMENT_KEY))
            .and_then(|t| Assignment::decode(t).ok())
            .unwrap_or_else(|| Assignment {
                node: self.node.clone(),
                unit: self.inventory.unit(),
                containers: vec![container.clone()],
            });
        let fallback = PodView {
            pod: first.pod.clone(),
            node: Some(self.node.clone()),
            created: String::new(),
            terminal: false,
            spec: gpushare_core::PodSpec::default(),
            annotations: BTreeMap::new(),
        };
        let view = view.unwrap_or(&fallback);
        Answer {
            envs: self.envs(view, &assignment, &container),
            pod: first.pod.clone(),
            container: first.container.clone(),
        }
    }

    /// The environment of a container (documented in docs/gpushared.md).
    fn envs(&self, view: &PodView, assignment: &Assignment, c: &ContainerAssignment) -> BTreeMap<String, String> {
        let mut gpus: Vec<&gpushare_core::codec::assignment::GpuShare> = c.gpus.iter().collect();
        gpus.sort_by_key(|g| g.index);
        let join = |f: &dyn Fn(&gpushare_core::codec::assignment::GpuShare) -> String| {
            gpus.iter().map(|g| f(g)).collect::<Vec<_>>().join(",")
        };
        let total_of =
            |uuid: &GpuUuid| self.inventory.gpus().iter().find(|g| &g.uuid == uuid).map_or(Mib::ZERO, |g| g.total);
        let container_mib: u64 = gpus.iter().map(|g| g.mib.get()).sum();
        let per_gpu = gpus.first().map_or(0, |g| g.mib.get());
        let mut env = BTreeMap::new();
        env.insert("NVIDIA_VISIBLE_DEVICES".to_owned(), join(&|g| g.uuid.to_string()));
        env.insert("GPUSHARE_GPU_UUIDS".to_owned(), join(&|g| g.uuid.to_string()));
        env.insert("GPUSHARE_GPU_INDEXES".to_owned(), join(&|g| g.index.to_string()));
        env.insert("GPUSHARE_GPU_TOTAL_MIB".to_owned(), join(&|g| total_of(&g.uuid).get().to_string()));
        env.insert("GPUSHARE_MEMORY_MIB".to_owned(), per_gpu.to_string());
        env.insert("GPUSHARE_MEMORY_TOTAL_MIB".to_owned(), container_mib.to_string());
        env.insert("GPUSHARE_UNIT".to_owned(), self.inventory.unit().to_string());
        env.insert("GPUSHARE_POD".to_owned(), format!("{}/{}", view.pod.namespace, view.pod.name));
        env.insert("GPUSHARE_CONTAINER".to_owned(), c.name.clone());
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
                env.insert(alibaba::IDX.to_owned(), g.minor.unwrap_or(g.index).to_string());
                env.insert(alibaba::DEV.to_owned(), unit.whole_units(g.total).to_string());
            }
            env.insert(alibaba::POD.to_owned(), unit.whole_units(Mib::new(pod_mib)).to_string());
            env.insert(alibaba::CONTAINER.to_owned(), unit.whole_units(Mib::new(container_mib)).to_string());
        }
        env
    }
}

#[cfg(test)]
mod tests;
