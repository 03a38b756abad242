//! The allocation service: decides which pod and container each kubelet call serves, checks
//! the GPU has room in the ledger, writes the ledger before answering, and builds the
//! container's environment. It knows nothing of gRPC; `plugin` translates.
//!
//! This module is the thin service: it holds the state behind one lock and sequences the pure
//! parts beside it — [`resolve`] (which container a call is for), [`propose`] (which devices to
//! propose), [`room`] (whether the GPU has room), [`env`] (the container's answer),
//! [`admission`] (the admissions under way, changed only by its `Step`s) and [`held`] (the live
//! rows in memory, with the indexes each call reads). The node's GPUs
//! ([`gpus`]), reconciliation ([`repair`]), the operator's queries ([`queries`]) and a rebuild
//! of a ledger that lost rows ([`rebuild`]) are the service's other jobs, one module each.
//!
//! The kubelet's calls carry only device IDs. `GetPreferredAllocation` proposes devices on the
//! assigned GPU and remembers the proposal, so the `Allocate` that follows is tied to the same
//! container. A repeated `Allocate` of the same devices gets the same answer from the ledger.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use gpushare_core::codec::node::{NodeAllocation, OverBudget};
use gpushare_core::devices::DeviceMap;
use gpushare_core::{ContainerRole, Health, NodeInventory, ResourceNames};
use tokio::sync::watch;

use crate::allocation::ledger::{ClaimRow, HistoryReader, Ledger, LedgerError, NewRow, Row, key_hash, request_key};
use crate::allocation::pods::PodStore;
use crate::config::{Compatibility, DeviceNodesConfig, MpsConfig};

mod admission;
mod claims;
mod creating;
mod env;
mod error;
mod gpus;
mod held;
mod propose;
mod queries;
pub use queries::spawn_history_pruning;
mod rebuild;
mod repair;
mod resolve;
mod room;

use admission::{Admissions, Owner, Step};
pub use claims::{ClaimError, ClaimRef, ClaimShare, PreparedShare};
pub use creating::Creation;
pub use env::{Answer, Edits, Mount};
pub use error::AllocError;
pub use gpus::Summary;
use held::{Held, HeldRows};
use resolve::{Candidate, Scope};
pub use resolve::{Care, KubeletListing, KubeletSays};

#[derive(Debug)]
struct State {
    ledger: Ledger,
    /// The GPUs with their current health and cordon (the static facts are also in
    /// [`Allocator::inventory`]).
    inventory: NodeInventory,
    /// The live rows, in allocation order, indexed.
    held: HeldRows,
    /// The admissions under way.
    admissions: Admissions,
    /// The ledger lacks allocations the node last published: these, to be booked again once
    /// the pods bound here are listed ([`rebuild`]). No call is served meanwhile.
    rebuilding: Option<Vec<NodeAllocation>>,
    /// The live DRA claim rows ([`claims`]), in preparation order.
    claims: Vec<ClaimRow>,
}

/// The allocation service of one node.
#[derive(Debug)]
pub struct Allocator {
    node: String,
    names: ResourceNames,
    compat: Compatibility,
    mps: MpsConfig,
    nodes: DeviceNodesConfig,
    lean: bool,
    /// `[kubelet] advertise = "capacity"`: the kubelet counts the memory and calls no
    /// `Allocate`; containers are allocated as the runtime creates them ([`creating`]).
    counted: bool,
    inventory: NodeInventory,
    devices: DeviceMap,
    pods: PodStore,
    state: Mutex<State>,
    /// The ledger's history, read on a connection of its own: never under `state`'s lock.
    history: Mutex<HistoryReader>,
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
    /// Whether the kubelet's PodResources answered when last asked: then calls are told apart
    /// by asking it, and the node says so ([`gpushare_core::codec::node::NodeState::tells_lookalikes_apart`]).
    kubelet_answers: std::sync::atomic::AtomicBool,
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
        let claims = ledger.live_claims()?;
        let history = Mutex::new(ledger.history_reader()?);
        Ok(Allocator {
            node,
            names,
            compat,
            mps: MpsConfig::default(),
            nodes: DeviceNodesConfig::default(),
            lean: false,
            counted: false,
            inventory,
            devices,
            pods,
            state: Mutex::new(State {
                ledger,
                inventory: live_inventory,
                held,
                admissions: Admissions::default(),
                rebuilding: None,
                claims,
            }),
            history,
            changes: watch::Sender::new(0),
            activity: watch::Sender::new(0),
            admission: watch::Sender::new(false),
            over_budget: Mutex::new(Vec::new()),
            kubelet_answers: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The same service with `mps` for the containers placed on MPS GPUs.
    #[must_use]
    pub fn with_mps(mut self, mps: MpsConfig) -> Self {
        self.mps = mps;
        self
    }

    /// The same service naming the device nodes `nodes` says.
    #[must_use]
    pub fn with_device_nodes(mut self, nodes: DeviceNodesConfig) -> Self {
        self.nodes = nodes;
        self
    }

    /// The same service answering `Allocate` with the variables `environment` says.
    #[must_use]
    pub fn with_environment(mut self, environment: crate::config::ContainerEnvironment) -> Self {
        self.lean = environment == crate::config::ContainerEnvironment::Lean;
        self
    }

    /// The same service for the way `advertise` says the memory reaches the kubelet.
    #[must_use]
    pub fn with_advertise(mut self, advertise: crate::config::Advertise) -> Self {
        self.counted = advertise == crate::config::Advertise::Capacity;
        self
    }

    /// Whether the kubelet counts the memory (`[kubelet] advertise = "capacity"`): containers
    /// are then allocated as the runtime creates them.
    #[must_use]
    pub fn counted(&self) -> bool {
        self.counted
    }

    /// Which device nodes are named to the runtime.
    #[must_use]
    pub fn device_nodes(&self) -> &DeviceNodesConfig {
        &self.nodes
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

    /// The pods bound to this node, as the service reads them.
    #[must_use]
    pub fn pods(&self) -> &PodStore {
        &self.pods
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the ledger half-written (SQLite
        // transactions), so a poisoned lock is still safe to use.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn scope(&self) -> Scope<'_> {
        Scope { node: &self.node, names: &self.names, unit: self.inventory.unit() }
    }

    fn environment(&self) -> env::Environment<'_> {
        env::Environment {
            node: &self.node,
            inventory: &self.inventory,
            mps: &self.mps,
            nodes: &self.nodes,
            compat: self.compat,
            lean: self.lean,
        }
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
        state.held.remove_where(|h| h.pod.uid == uid);
        state.admissions.apply(Step::Released { uid: uid.to_owned() });
        drop(state);
        if n > 0 {
            self.changed();
        }
        Ok(n)
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
        self.preferred_with(available, must_include, size, &Care::AS_IS)
    }

    /// [`Self::preferred`], choosing the container as sure as `care` asks.
    ///
    /// # Errors
    /// As [`Self::preferred`], and [`AllocError::Ambiguous`] or [`AllocError::Unconfirmed`].
    pub fn preferred_with<'a, I>(
        &self,
        available: I,
        must_include: &[String],
        size: usize,
        care: &Care,
    ) -> Result<Vec<String>, AllocError>
    where
        I: IntoIterator<Item = &'a str> + Clone,
    {
        let mut state = self.lock();
        Self::rebuilding(&state)?;
        Self::same_kubelet(&state, care)?;
        self.release_offered(&mut state, available.clone(), must_include)?;
        let pods = self.pods.snapshot();
        let cand = self.scope().choose(&pods, &state.held, &state.admissions, size, care)?;
        let proposal =
            propose::propose(&self.inventory, &self.devices, cand.container(), available, must_include, size);
        if proposal.short {
            tracing::warn!(
                pod = %cand.view().pod,
                container = %cand.container().name,
                "not enough free devices on the assigned GPU in the kubelet's view; proposing others"
            );
        }
        let owner = Owner { uid: cand.view().pod.uid.clone(), container: cand.container().name.clone() };
        state.admissions.apply(Step::Proposed { key: request_key(&proposal.devices), owner });
        Ok(proposal.devices)
    }

    /// Answers `Allocate` for one container's devices: resolves the container, checks the
    /// ledger has room, commits the ledger rows, then returns the environment. The same
    /// devices again get the same answer.
    ///
    /// # Errors
    /// [`AllocError`], and nothing is written.
    pub fn allocate(&self, device_ids: &[String]) -> Result<Answer, AllocError> {
        self.allocate_with(device_ids, &Care::AS_IS)
    }

    /// [`Self::allocate`]; where no proposal names the container, it is chosen as sure as
    /// `care` asks.
    ///
    /// # Errors
    /// As [`Self::allocate`], and [`AllocError::Ambiguous`] or [`AllocError::Unconfirmed`].
    pub fn allocate_with(&self, device_ids: &[String], care: &Care) -> Result<Answer, AllocError> {
        self.check_devices(device_ids)?;
        let key = request_key(device_ids);
        let mut state = self.lock();
        Self::rebuilding(&state)?;
        Self::same_kubelet(&state, care)?;
        if let Some(answer) = self.repeated(&state, &key, device_ids.len())? {
            return Ok(answer);
        }
        let proposed = state.admissions.owner(&key);
        let cand = proposed.and_then(|o| self.scope().candidate_for(self.pods.get(&o.uid)?, o, &state.held));
        let cand = match cand {
            Some(c) => c,
            // Only now the whole pod store: most calls follow a proposal and need one pod.
            None => {
                let pods = self.pods.snapshot();
                self.scope().choose(&pods, &state.held, &state.admissions, device_ids.len(), care)?
            }
        };
        let rows = Self::rows_for(&state.inventory, &cand, device_ids)?;
        room::check_room(&self.inventory, &state.held, &state.claims, &rows, &cand.view().pod.to_string())?;
        let written = state.ledger.allocate(&rows)?;
        state.held.extend(written.iter().map(|r| Arc::new(Held::from(r))));
        state.admissions.apply(Step::Allocated { key, uid: cand.view().pod.uid.clone() });
        drop(state);
        self.changed();
        tracing::info!(
            pod = %cand.view().pod,
            container = %cand.container().name,
            gpus = %rows.iter().map(|r| format!("GPU{}", r.gpu_index)).collect::<Vec<_>>().join(","),
            mib = rows.iter().map(|r| r.mib.get()).sum::<u64>(),
            "allocated"
        );
        Ok(self.environment().answer(&cand.view().pod, &cand.assignment, cand.container()))
    }

    /// Refuses a call the kubelet made before its last restart: served now, it would commit a
    /// proposal or rows the new kubelet never recorded, taken for the pod's own when the new
    /// kubelet admits it again (its devices offered as free would put the pod in doubt).
    fn same_kubelet(state: &State, care: &Care) -> Result<(), AllocError> {
        match care.generation {
            Some(g) if g != state.admissions.kubelet_generation() => Err(AllocError::KubeletRestarted),
            _ => Ok(()),
        }
    }

    /// Which kubelet is running: it changes with each [`Self::kubelet_restarted`]. A call
    /// records it as it comes ([`Care::generation`]).
    #[must_use]
    pub fn kubelet_generation(&self) -> u64 {
        self.lock().admissions.kubelet_generation()
    }

    /// Refuses a call naming a device that is not this daemon's, or one device twice.
    fn check_devices(&self, device_ids: &[String]) -> Result<(), AllocError> {
        if let Some(id) = device_ids.iter().find(|id| self.devices.resolve(id).is_none()) {
            return Err(AllocError::UnknownDevice(id.clone()));
        }
        let mut seen = HashSet::with_capacity(device_ids.len());
        match device_ids.iter().find(|id| !seen.insert(id.as_str())) {
            Some(twice) => Err(AllocError::BadRequest(format!(
                "device {twice:?} is listed twice in one Allocate; each device is one unit, held once"
            ))),
            None => Ok(()),
        }
    }

    /// The answer already given, if the devices of `key` are held: a repeated `Allocate`.
    /// Several containers may hold the same devices; the latest one answers. The kubelet hands
    /// an init container's devices on to the next container of the pod: those then belong to a
    /// new container, which is not a repeat.
    fn repeated(&self, state: &State, key: &str, units: usize) -> Result<Option<Answer>, AllocError> {
        let hash = key_hash(key);
        if !state.held.iter().any(|h| h.key_hash == hash) {
            return Ok(None);
        }
        let existing = state.ledger.live_by_key(key)?;
        let Some(last) = existing.last() else { return Ok(None) };
        let reused = last.role == ContainerRole::Init && {
            let (pending, _) = self.scope().pending(&self.pods.snapshot(), &state.held, Some(units), false);
            pending.iter().any(|c| c.view().pod.uid == last.pod.uid)
        };
        if reused {
            return Ok(None);
        }
        let rows: Vec<Row> =
            existing.iter().filter(|r| r.pod.uid == last.pod.uid && r.container == last.container).cloned().collect();
        let pod = self.pods.get(&last.pod.uid);
        Ok(Some(self.environment().answer_from_rows(last, &rows, pod.as_deref())))
    }

    /// The ledger rows for `cand` holding `device_ids`; refused if an assigned GPU is gone,
    /// unhealthy or cordoned in `inventory` (the GPUs as they are now).
    fn rows_for(inventory: &NodeInventory, cand: &Candidate, device_ids: &[String]) -> Result<Vec<NewRow>, AllocError> {
        let pod = || cand.view().pod.to_string();
        let mut rows = Vec::with_capacity(cand.container().gpus.len());
        for g in &cand.container().gpus {
            let gpu = inventory
                .gpus()
                .iter()
                .find(|x| x.uuid == g.uuid)
                .ok_or_else(|| AllocError::UnknownGpu { pod: pod(), uuid: g.uuid.clone() })?;
            if let Health::Unhealthy { reason } = &gpu.health {
                return Err(AllocError::Unhealthy { pod: pod(), index: gpu.index, reason: reason.clone() });
            }
            if gpu.cordoned {
                return Err(AllocError::Cordoned { pod: pod(), index: gpu.index });
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
        Ok(rows)
    }

    /// Releases recent rows whose devices the kubelet offers as free (`available`, less its
    /// `must_include`): the kubelet does not hold them, so the container they were allocated
    /// to never got them — an admission that failed after `Allocate`, or an `Allocate` the
    /// kubelet made for a pod the daemon took for another (it admitted a pod its own watch
    /// still showed after it was deleted). Left in place, the row would make its pod look
    /// admitted, and the pod's real admission would be taken for the next pod in line. A set
    /// the kubelet holds is never offered, so one device of each set is enough to tell. Its pod
    /// is then in doubt, unless the row came before the kubelet's last restart: a kubelet
    /// killed between `Allocate` and its checkpoint never recorded the row and admits the pod
    /// again, which is then served as any pod waiting.
    fn release_offered<'a, I>(&self, state: &mut State, available: I, must_include: &[String]) -> Result<(), AllocError>
    where
        I: IntoIterator<Item = &'a str>,
    {
        const RECENT_MS: i64 = 120_000;
        let since = crate::allocation::ledger::now_ms() - RECENT_MS;
        let stale = state.held.recent_beginning_with(available, since, must_include);
        if stale.is_empty() {
            return Ok(());
        }
        let reason = "the kubelet offers these devices as free, so it never gave them to this container";
        state.ledger.release_rows(&stale.iter().copied().collect::<Vec<_>>(), reason)?;
        for h in state.held.remove_where(|h| stale.contains(&h.id)) {
            tracing::warn!(pod = %h.pod, container = %h.container, gpu = h.gpu_index, mib = h.mib.get(), reason,
                "released");
            let uid = h.pod.uid.clone();
            let explained = state.admissions.before_kubelet_restart(h.allocated_at);
            state.admissions.apply(if explained { Step::Released { uid } } else { Step::Offered { uid } });
        }
        self.changed();
        Ok(())
    }

    /// Records whether the kubelet's PodResources answered when last asked; a change is
    /// published with the node state.
    pub fn set_kubelet_answers(&self, answers: bool) {
        if self.kubelet_answers.swap(answers, std::sync::atomic::Ordering::Relaxed) != answers {
            if answers {
                tracing::info!("the kubelet's PodResources answers: it is asked which look-alike pod it admits");
            } else {
                tracing::warn!(
                    "the kubelet's PodResources does not answer: look-alike pods are bound to this node one at a time"
                );
            }
            self.activity.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Whether the kubelet's PodResources answered when last asked.
    #[must_use]
    pub fn kubelet_answers(&self) -> bool {
        self.kubelet_answers.load(std::sync::atomic::Ordering::Relaxed)
    }

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
    /// it had started are over. It admits those pods again, oldest first, asking for new
    /// proposals; a stale one would sort its pod behind look-alikes as if another admission were
    /// still under way for it, and a look-alike would be served in its place. Returns how many
    /// were forgotten.
    pub fn kubelet_restarted(&self) -> usize {
        let at_ms = crate::allocation::ledger::now_ms();
        let forgotten = self.lock().admissions.apply(Step::KubeletRestarted { at_ms });
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
}

#[cfg(test)]
pub(crate) mod tests;
