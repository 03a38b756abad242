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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use gpushare_core::codec::alibaba;
use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment, ContainerAssignment};
use gpushare_core::codec::node::{NodeAllocation, NodeState, OverBudget, PodRef, used_per_gpu};
use gpushare_core::devices::DeviceMap;
use gpushare_core::placement::footprint;
use gpushare_core::{Activity, ContainerRole, GpuUuid, Health, Mib, NodeInventory, PodRequest, ResourceNames};
use thiserror::Error;
use tokio::sync::watch;

use crate::config::{Compatibility, MpsConfig};
use crate::ledger::{EventKind, Ledger, LedgerError, NewRow, Row, request_key};
use crate::pods::{PodStore, PodView, StoredPod};
use crate::reconcile::{KnownPod, KubeletView, Repair};

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
    /// The assigned GPU was cordoned by an operator since the pod was placed.
    #[error(
        "pod {pod}: assigned GPU{index} is cordoned (gpusharectl uncordon {index}); delete the pod so it is placed again"
    )]
    Cordoned {
        /// namespace/name.
        pod: String,
        /// GPU index.
        index: u32,
    },
    /// The kubelet's call itself is wrong: no device, or one device twice.
    #[error("{0}")]
    BadRequest(String),
    /// The pod the kubelet is admitting carries an assignment that does not fit its spec.
    #[error("pod {pod}: {reason}; nothing was allocated: delete the pod so gpushare-extender places it again")]
    BadAssignment {
        /// namespace/name.
        pod: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The ledger is being rebuilt: no allocation can be checked against it yet.
    #[error(
        "the allocation ledger lacked {missing} allocation(s) this node had published and is being rebuilt from the \
         pods bound to this node; calls are served once it is (see gpushared's log)"
    )]
    Rebuilding {
        /// Rows still to book.
        missing: usize,
    },
    /// An operator named a GPU this node does not have.
    #[error("no GPU {0:?} on this node; name it by its index or UUID (gpusharectl gpus lists them)")]
    NoSuchGpu(String),
    /// The pod first in line had devices the kubelet then offered as free.
    #[error(
        "pod {pod} waits for {units} {unit}, but the kubelet offered the devices allocated to it earlier as free: \
         its admission failed or was another pod's, or the pod is gone and the API server has not said so yet; \
         not served until the pod watch settles which pod the kubelet admits"
    )]
    Doubtful {
        /// namespace/name.
        pod: String,
        /// Devices asked for.
        units: usize,
        /// The unit.
        unit: gpushare_core::MemoryUnit,
    },
    /// Pods the kubelet cannot tell apart wait: the same first request, other GPUs.
    #[error(
        "pods {first} and {other} both wait for {units} {unit} first but are assigned different GPUs; the kubelet's \
         call does not say which it admits (gpushare-extender binds such pods to a node one at a time)"
    )]
    Ambiguous {
        /// The one that would be chosen.
        first: String,
        /// A look-alike.
        other: String,
        /// Devices asked for.
        units: usize,
        /// The unit.
        unit: gpushare_core::MemoryUnit,
    },
}

/// A container's answer: the environment the kubelet puts into it, and what it mounts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// Environment variables.
    pub envs: BTreeMap<String, String>,
    /// Host directories mounted into the container (the MPS pipe directory on MPS GPUs).
    pub mounts: Vec<Mount>,
    /// Which pod and container it was for.
    pub pod: PodRef,
    /// The container.
    pub container: String,
}

/// A host directory mounted into a container, read-write, at the same path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    /// The path, on the host and in the container.
    pub path: std::path::PathBuf,
}

/// Which container a proposal was made for.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Owner {
    uid: String,
    container: String,
}

/// A live ledger row, as the allocator keeps it in memory (the ledger is the durable truth;
/// this mirror is loaded from it at start and updated after each commit).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Held {
    /// [`key_hash`] of the row's device set: most `Allocate` calls are for a new set, and this
    /// tells them so without reading the ledger.
    key_hash: u64,
    /// The ledger row.
    id: i64,
    pod: PodRef,
    container: String,
    role: ContainerRole,
    gpu: GpuUuid,
    gpu_index: u32,
    mib: Mib,
    /// One device of the set (the kubelet holds a set entirely or not at all), for
    /// [`Allocator::release_offered`].
    first_device: Option<String>,
    allocated_at: i64,
}

impl From<&Row> for Held {
    fn from(r: &Row) -> Self {
        Held {
            key_hash: key_hash(&r.request_key),
            id: r.id,
            pod: r.pod.clone(),
            container: r.container.clone(),
            role: r.role,
            gpu: r.gpu_uuid.clone(),
            gpu_index: r.gpu_index,
            mib: r.mib,
            first_device: r.device_ids.first().cloned(),
            allocated_at: r.allocated_at,
        }
    }
}

#[derive(Debug)]
struct State {
    ledger: Ledger,
    /// The GPUs with their current health and cordon (the static facts are also in
    /// [`Allocator::inventory`]).
    inventory: NodeInventory,
    /// The live rows, in allocation order.
    held: Vec<Arc<Held>>,
    /// Proposals by device-set key.
    proposals: BTreeMap<String, Owner>,
    /// Pods whose rows were released because the kubelet offered their devices as free: it
    /// may have admitted another pod with them, or freed them because the pod is gone while
    /// the pod watch has not said so yet. Such a pod is served again only once it is clear.
    doubtful: BTreeSet<String>,
    /// The pod the kubelet is admitting (the last one served).
    admitting: Option<String>,
    /// The ledger lacks allocations the node last published: these, to be booked again once
    /// the pods bound here are listed ([`rebuild`]). No call is served meanwhile.
    rebuilding: Option<Vec<NodeAllocation>>,
}

/// A container waiting for its devices.
#[derive(Clone, Debug)]
struct Candidate {
    pod: Arc<StoredPod>,
    assignment: Arc<Assignment>,
    /// Position of the container in `assignment.containers`.
    position: usize,
    units: u64,
}

impl Candidate {
    fn view(&self) -> &PodView {
        &self.pod.view
    }

    fn container(&self) -> &ContainerAssignment {
        // `position` comes from enumerating this same, immutable assignment.
        &self.assignment.containers[self.position]
    }
}

/// A hash of a device-set key, for the in-memory check before the ledger is asked.
fn key_hash(key: &str) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::hash::DefaultHasher::new();
    key.hash(&mut h);
    h.finish()
}

/// The allocation service of one node.
#[derive(Debug)]
pub struct Allocator {
    node: String,
    names: ResourceNames,
    compat: Compatibility,
    mps: MpsConfig,
    inventory: NodeInventory,
    devices: DeviceMap,
    pods: PodStore,
    state: Mutex<State>,
    /// Bumped after every change of the ledger's live rows or of a GPU's health, so the
    /// node annotation and the systemd status follow.
    changes: watch::Sender<u64>,
    /// Bumped when a GPU's sampled activity changes meaningfully: only the node annotation
    /// follows it (not reconciliation, the kubelet's device list or the D-Bus signals).
    activity: watch::Sender<u64>,
    /// `true` while the kubelet admits a container through the shared-memory resource (the
    /// whole-GPU resource's `Allocate` changes no allocation and is not tracked): from the start of its
    /// `GetPreferredAllocation` (or of an `Allocate` without one) until that `Allocate` is
    /// answered or a call fails. Work that can wait (the node annotation) holds back meanwhile.
    admission: watch::Sender<bool>,
    /// The containers over their budget, as the over-use detector last saw them.
    over_budget: Mutex<Vec<OverBudget>>,
}

impl Allocator {
    /// A service for `node`'s `inventory`, reading `pods` and writing `ledger`.
    ///
    /// # Errors
    /// [`LedgerError`] if the ledger's live rows cannot be read.
    pub fn new(
        node: String,
        names: ResourceNames,
        compat: Compatibility,
        inventory: NodeInventory,
        pods: PodStore,
        ledger: Ledger,
    ) -> Result<Self, LedgerError> {
        let devices = DeviceMap::new(&inventory);
        let mut live_inventory = inventory.clone();
        for uuid in ledger.cordoned()? {
            let index = live_inventory.gpus().iter().find(|g| g.uuid.as_str() == uuid).map(|g| g.index);
            if let Some(g) = index.and_then(|i| live_inventory.gpu_mut(i)) {
                g.cordoned = true;
            }
        }
        let held = ledger.live()?.iter().map(|r| Arc::new(Held::from(r))).collect();
        Ok(Allocator {
            node,
            names,
            compat,
            mps: MpsConfig::default(),
            inventory,
            devices,
            pods,
            state: Mutex::new(State {
                ledger,
                inventory: live_inventory,
                held,
                proposals: BTreeMap::new(),
                doubtful: BTreeSet::new(),
                admitting: None,
                rebuilding: None,
            }),
            changes: watch::Sender::new(0),
            activity: watch::Sender::new(0),
            admission: watch::Sender::new(false),
            over_budget: Mutex::new(Vec::new()),
        })
    }

    /// The same service with `mps` for the containers placed on MPS GPUs.
    #[must_use]
    pub fn with_mps(mut self, mps: MpsConfig) -> Self {
        self.mps = mps;
        self
    }

    /// This node's name.
    #[must_use]
    pub fn node(&self) -> &str {
        &self.node
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

    /// Releases every live row of a pod (deleted, finished, gone), keeping the history.
    ///
    /// # Errors
    /// [`LedgerError`]; then nothing is released.
    pub fn release_pod(&self, uid: &str, reason: &str) -> Result<usize, LedgerError> {
        let mut state = self.lock();
        let n = state.ledger.release_pod(uid, reason)?;
        state.held.retain(|h| h.pod.uid != uid);
        state.doubtful.remove(uid);
        drop(state);
        if n > 0 {
            self.changed();
        }
        Ok(n)
    }

    /// The containers waiting for devices, one per pod (its first container without a ledger
    /// row), of `units` devices if given, plus notes on pods that cannot be served (for error
    /// messages, when `notes` is set).
    fn pending(&self, held: &[Arc<Held>], units: Option<usize>, want_notes: bool) -> (Vec<Candidate>, Vec<String>) {
        self.pending_among(self.pods.snapshot(), held, units, want_notes)
    }

    /// [`Self::pending`] among `pods` only.
    fn pending_among(
        &self,
        pods: Vec<Arc<StoredPod>>,
        held: &[Arc<Held>],
        units: Option<usize>,
        want_notes: bool,
    ) -> (Vec<Candidate>, Vec<String>) {
        let held: BTreeSet<(&str, &str)> = held.iter().map(|h| (h.pod.uid.as_str(), h.container.as_str())).collect();
        let mut out = Vec::new();
        let mut notes = Vec::new();
        for pod in pods {
            let view = &pod.view;
            if view.terminal || view.node.as_deref() != Some(self.node.as_str()) {
                continue;
            }
            let name = || format!("{}/{}", view.pod.namespace, view.pod.name);
            let assignment = match &pod.assignment {
                Some(Ok(a)) if a.node == self.node => {
                    if let Some(problem) = self.assignment_problem(&pod) {
                        if want_notes {
                            notes.push(format!("{}: {problem}", name()));
                        }
                        continue;
                    }
                    a
                }
                Some(Ok(a)) => {
                    if want_notes {
                        notes.push(format!("{} is assigned to node {}", name(), a.node));
                    }
                    continue;
                }
                Some(Err(e)) => {
                    if want_notes {
                        notes.push(format!("{}: {e}", name()));
                    }
                    continue;
                }
                None => {
                    let asks = want_notes
                        && PodRequest::from_spec(&view.spec, &self.names, self.inventory.unit())
                            .map_or(true, |r| !r.is_empty());
                    if asks {
                        notes.push(format!("{} has no {ASSIGNMENT_KEY} annotation", name()));
                    }
                    continue;
                }
            };
            let next =
                assignment.containers.iter().position(|c| !held.contains(&(view.pod.uid.as_str(), c.name.as_str())));
            if let Some(position) = next {
                let mib: u64 = assignment.containers[position].gpus.iter().map(|g| g.mib.get()).sum();
                let n = mib / self.inventory.unit().mib_per_unit();
                if units.is_none_or(|u| usize::try_from(n).is_ok_and(|n| n == u)) {
                    out.push(Candidate {
                        pod: Arc::clone(&pod),
                        assignment: Arc::clone(assignment),
                        position,
                        units: n,
                    });
                }
            }
        }
        (out, notes)
    }

    /// What is wrong with a pod's assignment on this node, if anything: it cannot be read, or
    /// it disagrees with the pod's containers ([`Assignment::check_against`]). Worked out once
    /// per version of the pod.
    fn assignment_problem<'p>(&self, pod: &'p StoredPod) -> Option<&'p str> {
        pod.problem
            .get_or_init(|| match &pod.assignment {
                Some(Err(e)) => Some(e.to_string()),
                Some(Ok(a)) => match PodRequest::from_spec(&pod.view.spec, &self.names, self.inventory.unit()) {
                    Err(e) => Some(e.to_string()),
                    Ok(request) => a.check_against(&request).err(),
                },
                None => None,
            })
            .as_deref()
    }

    /// A pod bound here whose assignment is unusable and one of whose containers, without a
    /// ledger row yet, asks for `units` devices: the container the kubelet is admitting, when
    /// no pod with a usable assignment waits for that many.
    fn unusable_for(&self, held: &[Arc<Held>], units: usize) -> Option<AllocError> {
        let per_unit = self.inventory.unit().mib_per_unit();
        self.pods.snapshot().into_iter().find_map(|pod| {
            let view = &pod.view;
            if view.terminal || view.node.as_deref() != Some(self.node.as_str()) {
                return None;
            }
            if matches!(&pod.assignment, Some(Ok(a)) if a.node != self.node) {
                return None;
            }
            let problem = self.assignment_problem(&pod)?;
            let request = PodRequest::from_spec(&view.spec, &self.names, self.inventory.unit()).ok();
            let asks = request.is_none_or(|r| {
                r.containers().iter().any(|c| {
                    c.memory.get() / per_unit == units as u64
                        && !held.iter().any(|h| h.pod.uid == view.pod.uid && h.container == c.name)
                })
            });
            asks.then(|| AllocError::BadAssignment {
                pod: format!("{}/{}", view.pod.namespace, view.pod.name),
                reason: problem.to_owned(),
            })
        })
    }

    /// The container a request of `units` devices is for.
    fn choose(&self, state: &State, units: usize, patient: bool) -> Result<Candidate, AllocError> {
        if units == 0 {
            return Err(AllocError::BadRequest(
                "the kubelet asked for 0 devices; a container that asks for GPU memory asks for at least one unit"
                    .into(),
            ));
        }
        let (mut fitting, _) = self.pending(&state.held, Some(units), false);
        if fitting.is_empty()
            && let Some(e) = self.unusable_for(&state.held, units)
        {
            return Err(e);
        }
        // The pod being admitted first; then containers without an outstanding proposal (a
        // proposal not yet followed by Allocate belongs to another admission); then the oldest.
        let proposed: BTreeSet<(&str, &str)> =
            state.proposals.values().map(|o| (o.uid.as_str(), o.container.as_str())).collect();
        let key = |c: &Candidate| {
            (
                state.admitting.as_deref() != Some(c.view().pod.uid.as_str()),
                proposed.contains(&(c.view().pod.uid.as_str(), c.container().name.as_str())),
                c.view().created.clone(),
                c.view().pod.namespace.clone(),
                c.view().pod.name.clone(),
            )
        };
        fitting.sort_by_cached_key(key);
        if let Some(top) = fitting.first()
            && state.doubtful.contains(&top.view().pod.uid)
        {
            let pod = format!("{}/{}", top.view().pod.namespace, top.view().pod.name);
            return Err(AllocError::Doubtful { pod, units, unit: self.inventory.unit() });
        }
        if patient && let Some((first, other)) = Self::ambiguity(state, &fitting) {
            return Err(AllocError::Ambiguous { first, other, units, unit: self.inventory.unit() });
        }
        fitting.into_iter().next().ok_or_else(|| {
            let (pending, notes) = self.pending(&state.held, None, true);
            let mut seen: Vec<String> = pending
                .iter()
                .map(|c| {
                    format!(
                        "{}/{} container {:?} waits for {} {}",
                        c.view().pod.namespace,
                        c.view().pod.name,
                        c.container().name,
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

    /// Releases recent rows whose devices the kubelet offers as free (`available`, less its
    /// `must_include`): the kubelet does not hold them, so the container they were allocated
    /// to never got them — an admission that failed after `Allocate`, or an `Allocate` the
    /// kubelet made for a pod the daemon took for another (it admitted a pod its own watch
    /// still showed after it was deleted). Left in place, the row would make its pod look
    /// admitted, and the pod's real admission would be taken for the next pod in line. A set
    /// the kubelet holds is never offered, so one device of each set is enough to tell.
    fn release_offered<'a, I>(&self, state: &mut State, available: I, must_include: &[String]) -> Result<(), AllocError>
    where
        I: IntoIterator<Item = &'a str>,
    {
        const RECENT_MS: i64 = 120_000;
        let since = crate::ledger::now_ms() - RECENT_MS;
        let mut first: HashMap<&str, Vec<i64>> = HashMap::new();
        for h in state.held.iter().filter(|h| h.allocated_at >= since) {
            if let Some(id) = &h.first_device
                && !must_include.contains(id)
            {
                first.entry(id.as_str()).or_default().push(h.id);
            }
        }
        if first.is_empty() {
            return Ok(());
        }
        let stale: BTreeSet<i64> = available.into_iter().filter_map(|id| first.get(id)).flatten().copied().collect();
        if stale.is_empty() {
            return Ok(());
        }
        let reason = "the kubelet offers these devices as free, so it never gave them to this container";
        state.ledger.release_rows(&stale.iter().copied().collect::<Vec<_>>(), reason)?;
        let (gone, kept): (Vec<Arc<Held>>, Vec<Arc<Held>>) =
            std::mem::take(&mut state.held).into_iter().partition(|h| stale.contains(&h.id));
        state.held = kept;
        for h in gone {
            tracing::warn!(pod = %format!("{}/{}", h.pod.namespace, h.pod.name), container = %h.container,
                gpu = h.gpu_index, mib = h.mib.get(), reason, "released");
            state.doubtful.insert(h.pod.uid.clone());
        }
        self.changed();
        Ok(())
    }

    /// Whether the first of `fitting` (sorted by [`Self::choose`]) is a guess: it has not
    /// started admission (no row, not the pod being admitted), and another pod that has not
    /// either waits for as many units first but is assigned differently. Returns both names.
    fn ambiguity(state: &State, fitting: &[Candidate]) -> Option<(String, String)> {
        let top = fitting.first()?;
        let started =
            |uid: &str| state.admitting.as_deref() == Some(uid) || state.held.iter().any(|h| h.pod.uid == uid);
        let uid = top.view().pod.uid.as_str();
        if started(uid) {
            return None;
        }
        let name = |c: &Candidate| format!("{}/{}", c.view().pod.namespace, c.view().pod.name);
        fitting[1..]
            .iter()
            .find(|c| {
                c.view().pod.uid != uid && !started(&c.view().pod.uid) && !c.assignment.same_placement(&top.assignment)
            })
            .map(|c| (name(top), name(c)))
    }

    /// Answers `GetPreferredAllocation` for one container: `size` devices from `available`,
    /// including `must_include`, on the GPUs assigned to the container being admitted.
    ///
    /// # Errors
    /// [`AllocError`] if no pod waits for `size` devices or the ledger cannot be read.
    pub fn preferred<'a, I>(
        &self,
        available: I,
        must_include: &[String],
        size: usize,
    ) -> Result<Vec<String>, AllocError>
    where
        I: IntoIterator<Item = &'a str> + Clone,
    {
        self.preferred_with(available, must_include, size, false)
    }

    /// [`Self::preferred`]; when `patient`, an ambiguous choice is
    /// [`AllocError::Ambiguous`] instead of a guess (the caller waits for the pod watch).
    ///
    /// # Errors
    /// As [`Self::preferred`], and [`AllocError::Ambiguous`].
    pub fn preferred_with<'a, I>(
        &self,
        available: I,
        must_include: &[String],
        size: usize,
        patient: bool,
    ) -> Result<Vec<String>, AllocError>
    where
        I: IntoIterator<Item = &'a str> + Clone,
    {
        let mut state = self.lock();
        Self::rebuilding(&state)?;
        self.release_offered(&mut state, available.clone(), must_include)?;
        let cand = self.choose(&state, size, patient)?;
        let unit = self.inventory.unit().mib_per_unit();
        // Devices still needed on each assigned GPU.
        let mut need: BTreeMap<usize, u64> = BTreeMap::new();
        for g in &cand.container().gpus {
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
        // Only the devices of the needed GPUs are looked at: their IDs start with the GPU's tag.
        let tags: Vec<(usize, String)> = need
            .keys()
            .filter_map(|&pos| self.devices.id(pos, 0).map(|id| (pos, id.chars().take(2).collect())))
            .collect();
        let mut by_gpu: BTreeMap<usize, Vec<(u64, &str)>> = BTreeMap::new();
        for id in available.clone() {
            let Some(&(pos, _)) = tags.iter().find(|(_, t)| id.starts_with(t.as_str())) else { continue };
            if taken.contains(id) {
                continue;
            }
            if let Some((p, k)) = self.devices.resolve(id)
                && p == pos
            {
                by_gpu.entry(pos).or_default().push((k, id));
            }
        }
        for (pos, n) in &need {
            if let Some(ids) = by_gpu.get_mut(pos) {
                let n = usize::try_from(*n).unwrap_or(usize::MAX).min(ids.len());
                // The lowest-numbered free devices, without sorting them all.
                if n > 0 && n < ids.len() {
                    ids.select_nth_unstable(n - 1);
                }
                ids.truncate(n);
                ids.sort_unstable();
                chosen.extend(ids.iter().map(|(_, id)| (*id).to_owned()));
            }
        }
        if chosen.len() < size {
            // The kubelet's view of this GPU is fuller than ours; any devices keep the count
            // right, the environment still names the assigned GPU.
            tracing::warn!(
                pod = %format!("{}/{}", cand.view().pod.namespace, cand.view().pod.name),
                container = %cand.container().name,
                "not enough free devices on the assigned GPU in the kubelet's view; proposing others"
            );
            let have: BTreeSet<String> = chosen.iter().cloned().collect();
            let rest: Vec<String> = available
                .into_iter()
                .filter(|id| !have.contains(*id))
                .take(size - chosen.len())
                .map(str::to_owned)
                .collect();
            chosen.extend(rest);
        }
        chosen.truncate(size.max(must_include.len()));
        state.proposals.insert(
            request_key(&chosen),
            Owner { uid: cand.view().pod.uid.clone(), container: cand.container().name.clone() },
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
        self.allocate_with(device_ids, false)
    }

    /// [`Self::allocate`]; when `patient`, an ambiguous choice (no proposal names the
    /// container) is [`AllocError::Ambiguous`] instead of a guess.
    ///
    /// # Errors
    /// As [`Self::allocate`], and [`AllocError::Ambiguous`].
    pub fn allocate_with(&self, device_ids: &[String], patient: bool) -> Result<Answer, AllocError> {
        for id in device_ids {
            if self.devices.resolve(id).is_none() {
                return Err(AllocError::UnknownDevice(id.clone()));
            }
        }
        let mut seen = HashSet::with_capacity(device_ids.len());
        if let Some(twice) = device_ids.iter().find(|id| !seen.insert(id.as_str())) {
            return Err(AllocError::BadRequest(format!(
                "device {twice:?} is listed twice in one Allocate; each device is one unit, held once"
            )));
        }
        let key = request_key(device_ids);
        let mut state = self.lock();
        Self::rebuilding(&state)?;
        let hash = key_hash(&key);
        let existing =
            if state.held.iter().any(|h| h.key_hash == hash) { state.ledger.live_by_key(&key)? } else { Vec::new() };
        // Several containers may hold the same devices (see below); the latest one answers.
        if let Some(last) = existing.last() {
            // The kubelet hands an init container's devices on to the next container of the
            // pod: the same devices then belong to a new container, not to a repeated call.
            let reused = last.role == ContainerRole::Init && {
                let (pending, _) = self.pending(&state.held, Some(device_ids.len()), false);
                pending.iter().any(|c| c.view().pod.uid == last.pod.uid)
            };
            if !reused {
                let rows: Vec<Row> = existing
                    .iter()
                    .filter(|r| r.pod.uid == last.pod.uid && r.container == last.container)
                    .cloned()
                    .collect();
                let pod = self.pods.get(&last.pod.uid);
                return Ok(self.answer_from_rows(last, &rows, pod.as_deref()));
            }
        }
        let owner = state.proposals.get(&key).cloned();
        let cand = match owner.and_then(|o| self.candidate_for(&o, &state.held)) {
            Some(c) => c,
            None => self.choose(&state, device_ids.len(), patient)?,
        };
        let pod_name = format!("{}/{}", cand.view().pod.namespace, cand.view().pod.name);
        let mut rows = Vec::with_capacity(cand.container().gpus.len());
        for g in &cand.container().gpus {
            let gpu = state
                .inventory
                .gpus()
                .iter()
                .find(|x| x.uuid == g.uuid)
                .ok_or_else(|| AllocError::UnknownGpu { pod: pod_name.clone(), uuid: g.uuid.clone() })?;
            if let gpushare_core::Health::Unhealthy { reason } = &gpu.health {
                return Err(AllocError::Unhealthy { pod: pod_name, index: gpu.index, reason: reason.clone() });
            }
            if gpu.cordoned {
                return Err(AllocError::Cordoned { pod: pod_name, index: gpu.index });
            }
            rows.push(NewRow {
                pod: cand.view().pod.clone(),
                container: cand.container().name.clone(),
                role: cand.container().role,
                gpu_uuid: g.uuid.clone(),
                gpu_index: gpu.index,
                mib: g.mib,
                device_ids: device_ids.to_vec(),
            });
        }
        self.check_room(&state.held, &rows, &pod_name)?;
        let written = state.ledger.allocate(&rows)?;
        state.held.extend(written.iter().map(|r| Arc::new(Held::from(r))));
        state.proposals.remove(&key);
        state.doubtful.remove(&cand.view().pod.uid);
        state.admitting = Some(cand.view().pod.uid.clone());
        drop(state);
        self.changed();
        tracing::info!(
            pod = %pod_name,
            container = %cand.container().name,
            gpus = %rows.iter().map(|r| format!("GPU{}", r.gpu_index)).collect::<Vec<_>>().join(","),
            mib = rows.iter().map(|r| r.mib.get()).sum::<u64>(),
            "allocated"
        );
        Ok(Answer {
            envs: self.envs(&cand.view().pod, &cand.assignment, cand.container()),
            mounts: self.mounts(cand.container()),
            pod: cand.view().pod.clone(),
            container: cand.container().name.clone(),
        })
    }

    /// The candidate for a remembered proposal, if that container still waits.
    fn candidate_for(&self, owner: &Owner, held: &[Arc<Held>]) -> Option<Candidate> {
        let pod = self.pods.get(&owner.uid)?;
        let (pending, _) = self.pending_among(vec![pod], held, None, false);
        pending.into_iter().find(|c| c.view().pod.uid == owner.uid && c.container().name == owner.container)
    }

    /// Refuses rows that would take a GPU past its capacity, counting every pod's footprint.
    fn check_room(&self, held: &[Arc<Held>], new: &[NewRow], pod_name: &str) -> Result<(), AllocError> {
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
        let gpus: BTreeSet<&GpuUuid> = new.iter().map(|r| &r.gpu_uuid).collect();
        let mut pods: PodRows = BTreeMap::new();
        for h in held.iter().filter(|h| gpus.contains(&h.gpu)) {
            pods.entry(h.pod.uid.clone()).or_default().push((h.role, h.gpu.clone(), h.mib));
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

    /// The answer already given for these rows (a repeated `Allocate`).
    fn answer_from_rows(&self, last: &Row, rows: &[Row], pod: Option<&StoredPod>) -> Answer {
        let container = ContainerAssignment {
            name: last.container.clone(),
            role: last.role,
            gpus: rows
                .iter()
                .map(|r| gpushare_core::codec::assignment::GpuShare {
                    index: r.gpu_index,
                    uuid: r.gpu_uuid.clone(),
                    mib: r.mib,
                })
                .collect(),
        };
        let assignment = match pod.and_then(|p| p.assignment.as_ref()) {
            Some(Ok(a)) => Arc::clone(a),
            _ => Arc::new(Assignment {
                node: self.node.clone(),
                unit: self.inventory.unit(),
                containers: vec![container.clone()],
            }),
        };
        Answer {
            envs: self.envs(&last.pod, &assignment, &container),
            mounts: self.mounts(&container),
            pod: last.pod.clone(),
            container: last.container.clone(),
        }
    }

    /// Whether every GPU of the container is in MPS mode (a container spanning shared and MPS
    /// GPUs is served as shared: one MPS client cannot leave some of its devices out).
    fn on_mps(&self, c: &ContainerAssignment) -> bool {
        !c.gpus.is_empty()
            && c.gpus.iter().all(|g| {
                self.inventory.gpus().iter().any(|x| x.uuid == g.uuid && x.mode == gpushare_core::SharingMode::Mps)
            })
    }

    /// What a container mounts: the MPS pipe directory when it is an MPS client.
    fn mounts(&self, c: &ContainerAssignment) -> Vec<Mount> {
        if self.on_mps(c) { vec![Mount { path: self.mps.pipe_directory.path().to_path_buf() }] } else { Vec::new() }
    }

    /// The environment of a container (documented in docs/gpushared.md).
    fn envs(&self, pod: &PodRef, assignment: &Assignment, c: &ContainerAssignment) -> BTreeMap<String, String> {
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
        env.insert("GPUSHARE_POD".to_owned(), format!("{}/{}", pod.namespace, pod.name));
        env.insert("GPUSHARE_CONTAINER".to_owned(), c.name.clone());
        // HAMi-core's budget per device, by the container's device ordinal (the order of
        // NVIDIA_VISIBLE_DEVICES): an image that carries that library enforces it.
        for (i, g) in gpus.iter().enumerate() {
            env.insert(format!("CUDA_DEVICE_MEMORY_LIMIT_{i}"), format!("{}m", g.mib.get()));
        }
        if self.on_mps(c) {
            // A client of the GPUs' MPS control daemon: its memory pinned to the budget, its
            // threads to the configured share.
            env.insert("CUDA_MPS_PIPE_DIRECTORY".to_owned(), self.mps.pipe_directory.path().display().to_string());
            env.insert(
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_owned(),
                gpus.iter().enumerate().map(|(i, g)| format!("{i}={}M", g.mib.get())).collect::<Vec<_>>().join(","),
            );
            let share = gpus
                .iter()
                .map(|g| self.mps.active_thread_percentage.percentage(g.mib, total_of(&g.uuid)))
                .max()
                .unwrap_or(100);
            env.insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_owned(), share.to_string());
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
                env.insert(alibaba::IDX.to_owned(), g.minor.unwrap_or(g.index).to_string());
                env.insert(alibaba::DEV.to_owned(), unit.whole_units(g.total).to_string());
            }
            env.insert(alibaba::POD.to_owned(), unit.whole_units(Mib::new(pod_mib)).to_string());
            env.insert(alibaba::CONTAINER.to_owned(), unit.whole_units(Mib::new(container_mib)).to_string());
        }
        env
    }
}

/// The state of the node's GPUs and ledger, as the systemd status and logs summarize it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Summary {
    /// GPUs served.
    pub gpus: usize,
    /// Of which healthy.
    pub healthy: usize,
    /// Live ledger rows.
    pub allocations: usize,
}

impl Allocator {
    fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver that sees a new value after every change of the live allocations or of a
    /// GPU's health.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// A receiver that sees a new value after every meaningful change of a GPU's sampled
    /// activity ([`Self::set_activity`]).
    #[must_use]
    pub fn subscribe_activity(&self) -> watch::Receiver<u64> {
        self.activity.subscribe()
    }

    /// Forgets the proposals the kubelet has not followed with `Allocate`, and ends the
    /// admission under way ([`Self::admission_ended`]): the kubelet restarted, so the admissions
    /// it had started are over. It admits
    /// those pods again, oldest first, asking for new proposals; a stale one would sort its pod
    /// behind look-alikes as if another admission were still under way for it, and a look-alike
    /// would be served in its place. Returns how many were forgotten.
    pub fn kubelet_restarted(&self) -> usize {
        let forgotten = std::mem::take(&mut self.lock().proposals).len();
        self.admission_ended();
        forgotten
    }

    /// The kubelet started an admission call (`GetPreferredAllocation` or `Allocate`).
    pub fn admission_started(&self) {
        self.admission.send_if_modified(|busy| !std::mem::replace(busy, true));
    }

    /// The kubelet's admission of a container is over: its `Allocate` was answered, or a call
    /// failed (the kubelet then fails the pod's admission and moves on).
    pub fn admission_ended(&self) {
        self.admission.send_if_modified(|busy| std::mem::replace(busy, false));
    }

    /// A receiver of whether the kubelet is admitting a container ([`Self::admission_started`]).
    #[must_use]
    pub fn subscribe_admission(&self) -> watch::Receiver<bool> {
        self.admission.subscribe()
    }

    /// The GPUs with their current health and cordon.
    #[must_use]
    pub fn current_inventory(&self) -> NodeInventory {
        self.lock().inventory.clone()
    }

    /// GPU count, healthy GPUs, live allocations.
    #[must_use]
    pub fn summary(&self) -> Summary {
        let state = self.lock();
        Summary {
            gpus: state.inventory.gpus().len(),
            healthy: state.inventory.gpus().iter().filter(|g| g.health.is_healthy()).count(),
            allocations: state.held.len(),
        }
    }

    /// Proves the allocation path is not stuck: takes its lock and asks the ledger a question.
    ///
    /// # Errors
    /// [`LedgerError`] if the ledger does not answer.
    pub fn probe(&self) -> Result<(), LedgerError> {
        self.lock().ledger.schema_version().map(|_| ())
    }

    /// Sets a GPU's health, recording a change in the ledger history. Returns whether it
    /// changed. An unhealthy GPU takes no new allocation; existing ones are kept.
    ///
    /// # Errors
    /// [`AllocError::Ledger`] if the history cannot be written (the health is set anyway:
    /// refusing allocations on a failing GPU matters more than its history).
    pub fn set_health(&self, index: u32, health: Health) -> Result<bool, AllocError> {
        let mut state = self.lock();
        let Some(gpu) = state.inventory.gpu_mut(index) else { return Ok(false) };
        if gpu.health == health {
            return Ok(false);
        }
        let detail = match &health {
            Health::Healthy => format!("GPU{index} ({}) is healthy again", gpu.uuid),
            Health::Unhealthy { reason } => format!("GPU{index} ({}) is unhealthy: {reason}", gpu.uuid),
        };
        gpu.health = health;
        let recorded = state.ledger.record_event(EventKind::Health, &detail);
        drop(state);
        self.changed();
        recorded?;
        Ok(true)
    }

    /// Records what GPU `index` is doing; publishes it (a node-state change) only when it
    /// differs meaningfully from what was last published ([`Activity::differs_from`]). Returns
    /// whether it did.
    pub fn set_activity(&self, index: u32, activity: Activity) -> bool {
        let mut state = self.lock();
        let Some(gpu) = state.inventory.gpu_mut(index) else { return false };
        if gpu.activity.is_some_and(|before| !activity.differs_from(&before, gpu.total)) {
            return false;
        }
        gpu.activity = Some(activity);
        drop(state);
        self.activity.send_modify(|n| *n = n.wrapping_add(1));
        true
    }

    /// Keeps the containers over budget now (published with the node state and on D-Bus) and
    /// records `events` (kind, detail: who went over or back within budget) in the ledger
    /// history; the over-use detector decides both.
    ///
    /// # Errors
    /// [`AllocError::Ledger`] if the history cannot be written (the list is kept anyway).
    pub fn set_over_budget(&self, current: Vec<OverBudget>, events: &[(EventKind, String)]) -> Result<(), AllocError> {
        *self.over_budget.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = current;
        if events.is_empty() {
            return Ok(());
        }
        let mut recorded = Ok(());
        {
            let mut state = self.lock();
            for (kind, detail) in events {
                recorded = recorded.and(state.ledger.record_event(*kind, detail));
            }
        }
        self.changed();
        Ok(recorded?)
    }

    /// The containers over their budget, as last sampled.
    #[must_use]
    pub fn over_budget(&self) -> Vec<OverBudget> {
        self.over_budget.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Adds an entry to the ledger's event history.
    ///
    /// # Errors
    /// [`AllocError::Ledger`].
    pub fn record_event(&self, kind: EventKind, detail: &str) -> Result<(), AllocError> {
        Ok(self.lock().ledger.record_event(kind, detail)?)
    }

    /// Makes the ledger agree with the kubelet's PodResources answer (see [`crate::reconcile`]);
    /// rows younger than `grace_ms` are not released. Call it only once the pod store has
    /// synced ([`PodStore::is_synced`]): a pod missing from it must mean the pod is gone. Every repair is logged and recorded in
    /// the history. Returns the repairs made.
    ///
    /// # Errors
    /// [`AllocError::Ledger`] if the ledger cannot be read or written; repairs before the
    /// failure are kept.
    pub fn reconcile(&self, kubelet: &KubeletView, grace_ms: i64) -> Result<Vec<Repair>, AllocError> {
        let pods = self.pods.snapshot();
        let known = |ns: &str, name: &str, container: &str| {
            let p = pods
                .iter()
                .filter(|p| p.view.pod.namespace == ns && p.view.pod.name == name)
                .min_by_key(|p| p.view.terminal)?;
            let role = match &p.assignment {
                Some(Ok(a)) => a.containers.iter().find(|c| c.name == container).map(|c| c.role),
                _ => None,
            };
            Some(KnownPod {
                pod: p.view.pod.clone(),
                role: role.unwrap_or(ContainerRole::App),
                finished: p.view.terminal,
            })
        };
        let running = |uid: &str| {
            pods.iter().any(|p| {
                p.view.pod.uid == uid && !p.view.terminal && p.view.node.as_deref() == Some(self.node.as_str())
            })
        };
        let mut state = self.lock();
        let live = state.ledger.live()?;
        let repairs = crate::reconcile::plan(&live, kubelet, known, running, crate::ledger::now_ms(), grace_ms);
        let mut done = Vec::with_capacity(repairs.len());
        for repair in repairs {
            match &repair {
                Repair::Release { rows, pod, container, reason } => {
                    state.ledger.release_rows(rows, reason)?;
                    state.held.retain(|h| !rows.contains(&h.id));
                    let detail = format!("released {}/{} container {container:?}: {reason}", pod.namespace, pod.name);
                    tracing::warn!(pod = %format!("{}/{}", pod.namespace, pod.name), container = %container, %reason, "reconcile: released");
                    state.ledger.record_event(EventKind::Reconcile, &detail)?;
                }
                Repair::Adopt { pod, container, role, device_ids, reason } => {
                    match self.adopt(&mut state, pod, container, *role, device_ids) {
                        Ok(gpus) => {
                            let detail = format!(
                                "adopted {gpus} for {}/{} container {container:?}: {reason}",
                                pod.namespace, pod.name
                            );
                            tracing::warn!(pod = %format!("{}/{}", pod.namespace, pod.name), container = %container, %gpus, "reconcile: adopted");
                            state.ledger.record_event(EventKind::Reconcile, &detail)?;
                        }
                        Err(AllocError::Ledger(e)) => return Err(AllocError::Ledger(e)),
                        Err(e) => {
                            tracing::error!(pod = %format!("{}/{}", pod.namespace, pod.name), container = %container, error = %e, "reconcile: cannot adopt what the kubelet holds");
                            state.ledger.record_event(
                                EventKind::Reconcile,
                                &format!("could not adopt {}/{} container {container:?}: {e}", pod.namespace, pod.name),
                            )?;
                            continue;
                        }
                    }
                }
                Repair::Unknown { holding } => {
                    tracing::warn!(
                        pod = %format!("{}/{}", holding.namespace, holding.name),
                        container = %holding.container,
                        devices = holding.device_ids.len(),
                        "reconcile: the kubelet holds devices for a pod not bound to this node as far as gpushared knows"
                    );
                    continue;
                }
            }
            done.push(repair);
        }
        drop(state);
        if !done.is_empty() {
            self.changed();
        }
        Ok(done)
    }

    /// Records `device_ids` as held by `pod`'s `container`; returns the GPUs, for the history.
    fn adopt(
        &self,
        state: &mut State,
        pod: &PodRef,
        container: &str,
        role: ContainerRole,
        device_ids: &[String],
    ) -> Result<String, AllocError> {
        let unit = self.inventory.unit().mib_per_unit();
        let mut per_gpu: BTreeMap<usize, u64> = BTreeMap::new();
        for id in device_ids {
            let (pos, _) = self.devices.resolve(id).ok_or_else(|| AllocError::UnknownDevice(id.clone()))?;
            *per_gpu.entry(pos).or_default() += unit;
        }
        let rows: Vec<NewRow> = per_gpu
            .iter()
            .filter_map(|(&pos, &mib)| {
                let g = state.inventory.gpus().get(pos)?;
                Some(NewRow {
                    pod: pod.clone(),
                    container: container.to_owned(),
                    role,
                    gpu_uuid: g.uuid.clone(),
                    gpu_index: g.index,
                    mib: Mib::new(mib),
                    device_ids: device_ids.to_vec(),
                })
            })
            .collect();
        self.check_room(&state.held, &rows, &format!("{}/{}", pod.namespace, pod.name))?;
        let written = state.ledger.allocate(&rows)?;
        state.held.extend(written.iter().map(|r| Arc::new(Held::from(r))));
        Ok(rows.iter().map(|r| format!("GPU{} {} MiB", r.gpu_index, r.mib.get())).collect::<Vec<_>>().join(", "))
    }

    /// Cordons (`true`) or uncordons a GPU named by index or UUID: a cordoned GPU keeps its
    /// allocations, is published as cordoned (the extender places nothing new on it), and stays
    /// so across restarts. Returns the GPU's index and whether anything changed.
    ///
    /// # Errors
    /// [`AllocError::NoSuchGpu`], or [`AllocError::Ledger`] (then nothing changed).
    pub fn set_cordon(&self, gpu: &str, cordoned: bool) -> Result<(u32, bool), AllocError> {
        let mut state = self.lock();
        let found = state
            .inventory
            .gpus()
            .iter()
            .find(|g| g.uuid.as_str() == gpu || gpu.parse::<u32>().is_ok_and(|i| i == g.index))
            .map(|g| (g.index, g.uuid.clone(), g.cordoned));
        let Some((index, uuid, was)) = found else { return Err(AllocError::NoSuchGpu(gpu.to_owned())) };
        if was == cordoned {
            return Ok((index, false));
        }
        let detail = format!("GPU{index} ({uuid}) {}", if cordoned { "cordoned" } else { "uncordoned" });
        state.ledger.set_cordon(uuid.as_str(), cordoned, &detail)?;
        if let Some(g) = state.inventory.gpu_mut(index) {
            g.cordoned = cordoned;
        }
        drop(state);
        tracing::warn!(gpu = index, %uuid, cordoned, "{detail}");
        self.changed();
        Ok((index, true))
    }

    /// Live rows, of one pod (`namespace`, `name`) if given.
    ///
    /// # Errors
    /// [`AllocError::Ledger`].
    pub fn allocations(&self, pod: Option<(&str, &str)>) -> Result<Vec<Row>, AllocError> {
        let rows = self.live()?;
        Ok(rows.into_iter().filter(|r| pod.is_none_or(|(ns, n)| r.pod.namespace == ns && r.pod.name == n)).collect())
    }

    /// The history since `since_ms`: allocations, releases and events, oldest first, as
    /// (unix ms, kind, detail).
    ///
    /// # Errors
    /// [`AllocError::Ledger`].
    pub fn history(&self, since_ms: i64) -> Result<Vec<(i64, String, String)>, AllocError> {
        let state = self.lock();
        let rows = state.ledger.all_since(since_ms)?;
        let events = state.ledger.events_since(since_ms)?;
        drop(state);
        let mut out: Vec<(i64, String, String)> = events.into_iter().map(|e| (e.at, e.kind, e.detail)).collect();
        for r in rows {
            let who = format!(
                "{}/{} container {:?} GPU{} {} MiB",
                r.pod.namespace,
                r.pod.name,
                r.container,
                r.gpu_index,
                r.mib.get()
            );
            if r.allocated_at >= since_ms {
                out.push((r.allocated_at, EventKind::Allocated.as_str().into(), who.clone()));
            }
            if let Some(at) = r.released_at.filter(|at| *at >= since_ms) {
                out.push((
                    at,
                    EventKind::Released.as_str().into(),
                    format!("{who}: {}", r.release_reason.unwrap_or_default()),
                ));
            }
        }
        out.sort_by_key(|e| e.0);
        Ok(out)
    }

    /// Where a pod's containers are and why, or why it has nothing on this node.
    ///
    /// # Errors
    /// [`AllocError::Ledger`].
    pub fn explain(&self, namespace: &str, name: &str) -> Result<String, AllocError> {
        let rows = self.allocations(Some((namespace, name)))?;
        let pod =
            self.pods.snapshot().into_iter().find(|p| p.view.pod.namespace == namespace && p.view.pod.name == name);
        let mut lines = Vec::new();
        match &pod {
            None => lines.push(format!("{namespace}/{name} is not bound to node {} as far as gpushared has seen", self.node)),
            Some(p) if p.view.terminal => lines.push(format!("{namespace}/{name} has finished or is being deleted")),
            Some(p) => match &p.assignment {
                None => lines.push(format!(
                    "{namespace}/{name} is bound to {} but has no {ASSIGNMENT_KEY} annotation: it asks for no GPU memory, or was not placed by gpushare-extender",
                    self.node
                )),
                Some(Err(e)) => lines.push(format!("{namespace}/{name}: {e}")),
                Some(Ok(a)) if a.node != self.node => {
                    lines.push(format!("{namespace}/{name} is assigned to node {}, not {}", a.node, self.node));
                }
                Some(Ok(a)) => {
                    lines.push(format!("{namespace}/{name} is assigned to this node by gpushare-extender:"));
                    for c in &a.containers {
                        let held: Vec<&Row> = rows.iter().filter(|r| r.container == c.name).collect();
                        let want = c.gpus.iter().map(|g| format!("GPU{} {} MiB", g.index, g.mib.get())).collect::<Vec<_>>().join(", ");
                        if held.is_empty() {
                            lines.push(format!("  container {:?}: assigned {want}; not admitted by the kubelet yet", c.name));
                        } else {
                            lines.push(format!("  container {:?}: assigned {want}; allocated (kubelet devices {})", c.name, held[0].request_key));
                        }
                    }
                }
            },
        }
        if pod.is_none() && !rows.is_empty() {
            lines
                .push(format!("  the ledger still holds {} row(s) for it; a reconciliation releases them", rows.len()));
        }
        Ok(lines.join("\n"))
    }

    /// What this node publishes: its GPUs, the memory its ledger holds on each (by the
    /// init-container rule) and the holders.
    #[must_use]
    pub fn node_state(&self, generation: u64, daemon_version: &str) -> NodeState {
        // Copy out under the lock (pointers, not rows); compute without it.
        let (inventory, held, rebuilding) = {
            let state = self.lock();
            (state.inventory.clone(), state.held.clone(), state.rebuilding.clone().unwrap_or_default())
        };
        // While the ledger is rebuilt, what it lost is still published as held.
        let allocations: Vec<NodeAllocation> = held
            .iter()
            .filter_map(|h| {
                let gpu = inventory.gpus().iter().find(|g| g.uuid == h.gpu)?;
                Some(NodeAllocation {
                    pod: h.pod.clone(),
                    container: h.container.clone(),
                    role: h.role,
                    gpu: gpu.index,
                    mib: h.mib,
                })
            })
            .chain(rebuilding)
            .collect();
        let used = used_per_gpu(&inventory, &allocations);
        let over_budget = self.over_budget();
        NodeState { generation, daemon_version: daemon_version.to_owned(), inventory, used, allocations, over_budget }
    }
}

mod rebuild;

#[cfg(test)]
pub(crate) mod tests;
