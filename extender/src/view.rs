//! The cluster view: every gpushare node's GPUs and every GPU pod, as watched from the API
//! server, and the binds the extender made that the watch has not shown yet. No I/O: the
//! watchers feed it objects, the verbs read it.
//!
//! What a GPU has in use is reconciled from three sources, each pod counted once:
//! - what the node's daemon publishes (`gpushare.io/node-state`): the memory its ledger holds,
//!   per pod. **The daemon wins**: a pod it reports is counted as it reports it, whatever the
//!   pod's annotation says, and a disagreement is logged and counted;
//! - the assignment annotation of each non-terminal pod bound to the node that the daemon has
//!   not reported yet (bound, not yet admitted by the kubelet), and with Alibaba compatibility
//!   the `ALIYUN_COM_GPU_MEM_IDX` annotation of pods Alibaba's extender placed;
//! - in-flight binds (assumptions) for pods whose binding the watch has not delivered yet; they
//!   expire after a configurable time in case the watch never shows them.
//!
//! This module holds the entries and their accessors; the behaviour is one module per job:
//! [`nodes`] and [`pods`] (what the watches deliver), [`usage`] (what each GPU has in use),
//! [`placing`] (fit, score and placement for one node), [`lookalike`] (the look-alike rule),
//! [`summary`] (the glance path), [`alibaba`] (nodes Alibaba's device plugin still serves, for
//! inspect) and [`hash`].

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_core::codec::alibaba::AlibabaAnnotations;
use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_core::codec::heartbeat::{HEARTBEAT_KEY, Heartbeat};
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState, pod_footprints};
use gpushare_core::placement::{GpuPolicy, NodeView, Placer, Rejection};
use gpushare_core::schedule::Policies;
use gpushare_core::{MemoryUnit, Mib, NodeInventory, PodRequest, ResourceNames};

pub use self::alibaba::{AlibabaGpu, AlibabaNode};
use crate::clock::{Clock, SystemClock};
use crate::objects::{NodeObject, PodObject};

mod alibaba;
mod hash;
mod lookalike;
mod nodes;
mod placing;
mod pods;
pub mod summary;
mod usage;

use hash::value_hash;
pub use hash::{FxHasher, FxMap};
pub use lookalike::Placed;
pub use nodes::NodeReading;

use summary::{NodeTable, Shape, Summary};

/// Pods to count as gone (the pod being placed, preemption victims) and the nodes where they
/// hold memory, found once per request so that untouched nodes cost nothing extra; and the
/// moment the request is judged at, so that heartbeat deadlines cost no clock read per node.
#[derive(Clone, Debug)]
pub struct Evicted<'a> {
    uids: HashSet<&'a str>,
    nodes: Vec<String>,
    now: Instant,
}

impl Evicted<'_> {
    fn touches(&self, node: &str) -> bool {
        self.nodes.iter().any(|n| n == node)
    }
}

/// What the view needs to know about the cluster's settings.
#[derive(Clone, Debug)]
pub struct ViewConfig {
    /// The cluster unit.
    pub unit: MemoryUnit,
    /// The resource names pods ask with.
    pub names: ResourceNames,
    /// Count pods placed by Alibaba's extender.
    pub alibaba: bool,
    /// How long an in-flight bind is counted without the watch showing it.
    pub assume_ttl: Duration,
    /// Date a heartbeat by the time the daemon wrote in it, against this host's clock, rather
    /// than by when this view saw it change: for a one-shot view (`kubectl-inspect-gpushare`)
    /// that has seen no renewal. A long-lived view watches and needs no clock agreement.
    pub heartbeat_by_wall_clock: bool,
}

/// Which initial lists a view fed by watches still waits for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct InitialLists {
    nodes: bool,
    pods: bool,
}

/// The whole view.
#[derive(Debug)]
pub struct ClusterView {
    config: ViewConfig,
    nodes: FxMap<String, NodeEntry>,
    /// UIDs of the GPU pods bound to each node name, whether or not the node is known yet (the
    /// pod watch may deliver before the node watch).
    bound: FxMap<String, BTreeSet<String>>,
    /// Nodes whose usage changed since the last [`ClusterView::refresh`].
    dirty: Vec<String>,
    /// Nodes whose daemon reports each UID (normally one).
    reported: FxMap<String, Vec<String>>,
    pods: FxMap<String, PodEntry>,
    assumed: FxMap<String, Assumed>,
    disagreements: u64,
    /// Where the view reads the time.
    clock: Arc<dyn Clock>,
    /// The initial lists still to come before daemons' reports are compared with the view
    /// (see [`Self::await_initial_lists`]).
    awaiting: InitialLists,
    /// Every node's [`Summary`] while its usage is cached: kept in step by [`Self::sync`]
    /// wherever a node or its cached usage changes.
    table: NodeTable,
}

impl ClusterView {
    /// An empty view.
    #[must_use]
    pub fn new(config: ViewConfig) -> Self {
        ClusterView {
            config,
            nodes: FxMap::default(),
            bound: FxMap::default(),
            reported: FxMap::default(),
            dirty: Vec::new(),
            pods: FxMap::default(),
            assumed: FxMap::default(),
            disagreements: 0,
            awaiting: InitialLists::default(),
            clock: Arc::new(SystemClock),
            table: NodeTable::default(),
        }
    }

    /// The same view reading the time from `clock` (tests move a manual one).
    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The time now, by the view's clock.
    #[must_use]
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The settings.
    #[must_use]
    pub fn config(&self) -> &ViewConfig {
        &self.config
    }

    /// Reads a pod's request under the cluster's names and unit.
    ///
    /// # Errors
    /// A person-readable reason when the request is invalid.
    pub fn request_of(&self, pod: &PodObject) -> Result<PodRequest, String> {
        PodRequest::from_spec(&pod.core_spec(), &self.config.names, self.config.unit).map_err(|e| e.to_string())
    }

    fn holding_of(&self, pod: &PodObject) -> Holding {
        let annotations = pod.annotations();
        if let Some(value) = annotations.get(ASSIGNMENT_KEY) {
            return match Assignment::decode(value) {
                // Whoever may write the pod may write its annotation: a grant wider than the
                // spec asks for is not counted (gpushared refuses to serve it).
                Ok(a) => match self.request_of(pod).and_then(|r| a.check_against(&r)) {
                    Ok(()) => Holding::Assigned(Box::new(a)),
                    Err(why) => {
                        tracing::warn!(pod = %pod.key(), reason = %why,
                            "ignoring an assignment that does not match the pod's spec (not written by the extender?)");
                        Holding::Invalid(format!("its {ASSIGNMENT_KEY} annotation does not match its spec: {why}"))
                    }
                },
                Err(e) => Holding::Invalid(e.to_string()),
            };
        }
        if self.config.alibaba {
            return match AlibabaAnnotations::decode(&annotations) {
                Ok(Some(a)) => match self.request_of(pod).and_then(|r| a.check_against(&r)) {
                    Ok(()) => Holding::Alibaba(a),
                    Err(why) => {
                        tracing::warn!(pod = %pod.key(), reason = %why,
                            "ignoring Alibaba placement annotations that do not match the pod's spec");
                        Holding::Invalid(format!("its Alibaba placement annotations do not match its spec: {why}"))
                    }
                },
                Ok(None) => Holding::Nothing,
                Err(e) => Holding::Invalid(e.to_string()),
            };
        }
        Holding::Nothing
    }

    fn touch(&mut self, node: Option<&str>) {
        if let Some(n) = node
            && let Some(entry) = self.nodes.get_mut(n)
        {
            entry.cache = None;
            self.dirty.push(n.to_owned());
            self.table.set(n, None);
        }
    }

    /// Rewrites `node`'s [`Summary`] from its entry (or drops it with the node).
    fn sync(&mut self, node: &str) {
        match self.nodes.get(node) {
            None => self.table.remove(node),
            Some(entry) => self.table.set(node, Self::summary_of(entry)),
        }
    }

    /// What a node's [`Summary`] is: from its inventory and cached usage, `None` without them.
    fn summary_of(entry: &NodeEntry) -> Option<Summary> {
        let (NodeGpus::Reported(state), Some(usage)) = (&entry.gpus, &entry.cache) else { return None };
        let inventory = &state.inventory;
        if inventory.gpus().is_empty() || usage.total.len() != inventory.gpus().len() {
            return None;
        }
        let unit = inventory.unit();
        let mut s = summary::summarize(
            unit,
            inventory.gpus().iter().zip(&usage.total).map(|(g, used)| (g.is_schedulable(), g.capacity(unit), *used)),
            usage.admitting.iter().flat_map(|a| a.assignment.request_sizes()).map(Some),
        )?;
        s.stale_at = entry.heartbeat.as_ref().map(Renewal::stale_at);
        Some(s)
    }

    /// The summary of every node that has one and what it should be, for tests.
    #[cfg(test)]
    pub(crate) fn summaries_in_step(&self) -> bool {
        self.table.len() == self.nodes.len()
            && self.nodes.iter().all(|(name, e)| self.table.get(name) == Self::summary_of(e).as_ref())
    }

    /// Recomputes the usage of every node changed since the last call, so that readers find
    /// it cached. Call after a batch of changes.
    pub fn refresh(&mut self) {
        for name in std::mem::take(&mut self.dirty) {
            if let Some(NodeEntry { gpus: NodeGpus::Reported(_), cache: None, .. }) = self.nodes.get(&name) {
                let usage = self.compute_usage(&name);
                if let Some(e) = self.nodes.get_mut(&name) {
                    e.cache = Some(usage);
                }
                self.sync(&name);
            }
        }
    }

    /// A pod by UID.
    #[must_use]
    pub fn pod(&self, uid: &str) -> Option<&PodEntry> {
        self.pods.get(uid)
    }

    /// A pod by namespace and name.
    #[must_use]
    pub fn pod_named(&self, namespace: &str, name: &str) -> Option<&PodEntry> {
        self.pods.values().find(|p| p.namespace == namespace && p.name == name)
    }

    /// A node.
    #[must_use]
    pub fn node(&self, name: &str) -> Option<&NodeEntry> {
        self.nodes.get(name)
    }

    /// Node names, sorted.
    #[must_use]
    pub fn node_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.nodes.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// How many nodes and GPU pods the view holds, and in-flight binds.
    #[must_use]
    pub fn counts(&self) -> (usize, usize, usize) {
        (self.nodes.len(), self.pods.len(), self.assumed.len())
    }

    /// Disagreements with the daemons found so far.
    #[must_use]
    pub fn disagreements(&self) -> u64 {
        self.disagreements
    }

    /// Pods whose placement annotation is not counted: it cannot be read, or it does not match
    /// the pod's spec.
    #[must_use]
    pub fn invalid_assignments(&self) -> usize {
        self.pods.values().filter(|p| matches!(p.holding, Holding::Invalid(_))).count()
    }

    /// How fresh `node`'s published state is, when its daemon renews a heartbeat.
    #[must_use]
    pub fn freshness(&self, node: &str) -> Option<Freshness> {
        let r = self.nodes.get(node)?.heartbeat.as_ref()?;
        Some(Freshness { age: self.clock.now().saturating_duration_since(r.seen), stale_after: r.stale_after })
    }

    fn stale(&self, node: &str) -> Option<Freshness> {
        self.freshness(node).filter(Freshness::is_stale)
    }

    /// A node's inventory, when its daemon publishes one.
    ///
    /// # Errors
    /// Why the node has none.
    pub fn inventory(&self, node: &str) -> Result<&NodeInventory, NodeRefusal> {
        match self.nodes.get(node).map(|e| &e.gpus) {
            None => Err(NodeRefusal::Unknown),
            Some(NodeGpus::NotSharing) => Err(NodeRefusal::NotSharing),
            Some(NodeGpus::Invalid(why)) => Err(NodeRefusal::Invalid(why.clone())),
            Some(NodeGpus::Reported(s)) => Ok(&s.inventory),
        }
    }
}

/// What a node's GPUs are, as far as the view knows.
#[derive(Clone, Debug)]
pub enum NodeGpus {
    /// No `gpushare.io/node-state` annotation: no daemon publishes for this node.
    NotSharing,
    /// The annotation is there but cannot be read.
    Invalid(String),
    /// The daemon's last publication.
    Reported(Box<NodeState>),
}

/// One node.
#[derive(Clone, Debug)]
pub struct NodeEntry {
    /// Its address, for people.
    pub address: String,
    /// Its GPUs.
    pub gpus: NodeGpus,
    /// Usage, computed on demand and dropped on every change.
    cache: Option<Usage>,
    /// The daemon's heartbeat as last renewed; `None` from daemons that publish none.
    heartbeat: Option<Renewal>,
    /// [`value_hash`] of the node-state annotation the entry was made from.
    state_hash: Option<u64>,
    /// With Alibaba compatibility, a node no gpushared publishes for whose capacity Alibaba's
    /// device plugin sets: its GPUs, for inspect alone.
    pub alibaba: Option<AlibabaNode>,
}

/// Takes `node`'s heartbeat into `entry`: a new value is a renewal, seen now (or, by the wall
/// clock, when the daemon says it wrote it).
fn renew(entry: &mut NodeEntry, node: &NodeObject, name: &str, by_wall_clock: bool, clock: &dyn Clock) {
    match node.annotation(HEARTBEAT_KEY).map(|v| (v, Heartbeat::decode(v))) {
        Some((value, Ok(h))) => {
            if entry.heartbeat.as_ref().is_none_or(|r| r.value != value) {
                let now = clock.now();
                let seen = if by_wall_clock {
                    let ago = u64::try_from(clock.unix_ms().saturating_sub(h.at_ms)).unwrap_or(0);
                    now.checked_sub(Duration::from_millis(ago)).unwrap_or(now)
                } else {
                    now
                };
                entry.heartbeat = Some(Renewal { value: value.to_owned(), seen, stale_after: h.stale_after() });
            }
        }
        // An unreadable value renews nothing; the last one ages on.
        Some((_, Err(e))) => tracing::debug!(node = %name, error = %e, "unreadable heartbeat"),
        None => entry.heartbeat = None,
    }
}

/// A node's heartbeat as the view saw it renewed.
#[derive(Clone, Debug)]
struct Renewal {
    /// The annotation value: a new value is a renewal.
    value: String,
    /// When the view saw this value first, by its own clock.
    seen: Instant,
    /// No renewal for this long makes the node stale.
    stale_after: Duration,
}

impl Renewal {
    /// When the node turns stale without a further renewal.
    fn stale_at(&self) -> Instant {
        self.seen + self.stale_after
    }
}

/// How fresh a node's published state is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freshness {
    /// Time since the view saw the heartbeat renewed.
    pub age: Duration,
    /// The age at which the node is stale.
    pub stale_after: Duration,
}

impl Freshness {
    /// Whether the daemon is presumed gone.
    #[must_use]
    pub fn is_stale(&self) -> bool {
        self.age > self.stale_after
    }
}

/// What a pod holds, from its annotations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holding {
    /// No placement annotation.
    Nothing,
    /// gpushare's assignment.
    Assigned(Box<Assignment>),
    /// Alibaba's annotations (only read with compatibility on).
    Alibaba(AlibabaAnnotations),
    /// An annotation that cannot be read.
    Invalid(String),
}

impl PodEntry {
    /// `namespace/name`, as the daemon and kubectl name the pod.
    #[must_use]
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

impl Assumed {
    /// `namespace/name`, as the daemon and kubectl name the pod.
    #[must_use]
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// One pod that asks for GPU memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodEntry {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// Bound node.
    pub node: Option<String>,
    /// Scheduling priority.
    pub priority: i32,
    /// The scheduler that places it (`spec.schedulerName`).
    pub scheduler: String,
    /// Succeeded or Failed.
    pub terminal: bool,
    /// Its request, or why it is invalid.
    pub request: Result<PodRequest, String>,
    /// Where it is placed.
    pub holding: Holding,
}

/// A bind the extender made (or is making) that the watch has not shown yet.
#[derive(Clone, Debug)]
pub struct Assumed {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Target node.
    pub node: String,
    /// The assignment the Binding carries.
    pub assignment: Assignment,
    /// Whether the Binding call has returned success.
    pub bound: bool,
    /// When the bind started.
    pub since: Instant,
}

/// A node's usage, attributed: what no known pod explains (`base`), and each pod's share.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Memory per GPU position the daemon reports but attributes to no pod.
    pub base: Vec<Mib>,
    /// Each holder's memory per GPU position.
    pub pods: Vec<Holder>,
    /// Pods bound (or being bound) to the node that its daemon has not reported allocated yet,
    /// while they are look-alikes to keep apart (none where the node tells them apart itself).
    pub admitting: Vec<Admitting>,
    /// Pods bound to the node with a request but no placement yet (Alibaba's `PENDING`).
    pub pending: Vec<(String, Mib)>,
    /// `base` plus every holder.
    total: Vec<Mib>,
}

/// A pod its node's daemon has not reported allocated yet (see
/// [`ClusterView::place_clear_of_lookalikes`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admitting {
    /// UID.
    pub uid: String,
    /// `namespace/name`.
    pub pod: String,
    /// Its placement.
    pub assignment: Assignment,
}

/// One pod's memory on a node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holder {
    /// UID.
    pub uid: String,
    /// `namespace/name`.
    pub pod: String,
    /// Memory per GPU position.
    pub mib: Vec<Mib>,
    /// Whether it is only an in-flight bind.
    pub assumed: bool,
}

impl Usage {
    /// Total per GPU position.
    #[must_use]
    pub fn total(&self) -> Vec<Mib> {
        self.total.clone()
    }

    /// Total per GPU position if the pods in `gone` released their memory.
    #[must_use]
    pub fn without(&self, gone: &HashSet<&str>) -> Vec<Mib> {
        let mut used = self.base.clone();
        for h in self.pods.iter().filter(|h| !gone.contains(h.uid.as_str())) {
            for (u, m) in used.iter_mut().zip(&h.mib) {
                *u = u.saturating_add(*m);
            }
        }
        used
    }
}

/// Why a node cannot take a pod at all, or the placement's own rejection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeRefusal {
    /// The view has no such node.
    Unknown,
    /// No gpushare daemon publishes for it.
    NotSharing,
    /// Its published state cannot be read.
    Invalid(String),
    /// Its daemon has stopped renewing its heartbeat.
    Stale(Freshness),
    /// The placement says no.
    Rejected(Rejection),
}

impl NodeRefusal {
    /// Whether evicting pods could help (kube-scheduler's `FailedNodes`).
    #[must_use]
    pub fn is_resolvable(&self) -> bool {
        matches!(self, NodeRefusal::Rejected(r) if r.is_resolvable())
    }
}

impl std::fmt::Display for NodeRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeRefusal::Unknown => f.write_str("node is not in the gpushare extender's view (not watched yet?)"),
            NodeRefusal::NotSharing => {
                write!(f, "node publishes no {NODE_STATE_KEY} annotation: gpushared is not running there")
            }
            NodeRefusal::Invalid(why) => write!(f, "node's {NODE_STATE_KEY} annotation is unreadable: {why}"),
            NodeRefusal::Stale(h) => write!(
                f,
                "node's gpushared has not renewed its {HEARTBEAT_KEY} for {} s (stale after {} s), so its published \
                 GPU state is not trusted: is gpushared running there? (systemctl status gpushared on the node)",
                h.age.as_secs(),
                h.stale_after.as_secs()
            ),
            NodeRefusal::Rejected(r) => write!(f, "{r}"),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
