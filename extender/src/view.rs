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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::{Duration, Instant};

use gpushare_core::codec::alibaba::AlibabaAnnotations;
use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_core::codec::heartbeat::{HEARTBEAT_KEY, Heartbeat};
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState, pod_footprints};
use gpushare_core::placement::{GpuPolicy, NodeView, Placer, Rejection};
use gpushare_core::schedule::Policies;
use gpushare_core::{MemoryUnit, Mib, NodeInventory, PodRequest, ResourceNames};

use crate::objects::{NodeObject, PodObject};

pub mod summary;

use summary::{NodeTable, Shape, Summary};

/// `FxHash`: a fast hash for the view's short keys (node names, UIDs). They come from the API
/// server, not from anyone who could choose colliding keys, so `SipHash`'s flood resistance is
/// not needed, and it cost a quarter of a 5,000-node filter.
#[derive(Clone, Copy, Debug, Default)]
pub struct FxHasher(u64);

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by node name or UID.
pub type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

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
}

/// A hash of an annotation value, to tell an unchanged one without keeping it.
fn value_hash(value: &str) -> u64 {
    use std::hash::BuildHasher as _;
    std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(value)
}

/// Takes `node`'s heartbeat into `entry`: a new value is a renewal, seen now (or, by the wall
/// clock, when the daemon says it wrote it).
fn renew(entry: &mut NodeEntry, node: &NodeObject, name: &str, by_wall_clock: bool) {
    match node.annotation(HEARTBEAT_KEY).map(|v| (v, Heartbeat::decode(v))) {
        Some((value, Ok(h))) => {
            if entry.heartbeat.as_ref().is_none_or(|r| r.value != value) {
                let now = Instant::now();
                let seen = if by_wall_clock {
                    let wall_ms = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
                    let ago = u64::try_from(wall_ms.saturating_sub(h.at_ms)).unwrap_or(0);
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

/// One pod that asks for GPU memory.
#[derive(Clone, Debug)]
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
    /// Pods bound (or being bound) to the node that its daemon has not reported allocated yet.
    pub admitting: Vec<Admitting>,
    /// Pods bound to the node with a request but no placement yet (Alibaba's `PENDING`).
    pub pending: Vec<(String, Mib)>,
    /// `base` plus every holder.
    total: Vec<Mib>,
}

/// A pod its node's daemon has not reported allocated yet (see
/// [`ClusterView::lookalike_in_admission`]).
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
            table: NodeTable::default(),
        }
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
                Ok(a) => Holding::Assigned(Box::new(a)),
                Err(e) => Holding::Invalid(e.to_string()),
            };
        }
        if self.config.alibaba {
            return match AlibabaAnnotations::decode(&annotations) {
                Ok(Some(a)) => Holding::Alibaba(a),
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
            usage.admitting.iter().map(|a| a.assignment.first_request()),
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

    /// Adds or updates a node. Returns the disagreements between what its daemon now reports
    /// and what the view believes, one readable line each (already counted).
    pub fn apply_node(&mut self, node: &NodeObject) -> Vec<String> {
        let name = node.name().to_owned();
        let state_value = node.annotation(NODE_STATE_KEY);
        let state_hash = state_value.map(value_hash);
        if let Some(entry) = self.nodes.get_mut(&name) {
            renew(entry, node, &name, self.config.heartbeat_by_wall_clock);
            // A heartbeat alone (every node every 20 s): the published state is unchanged, so
            // nothing is decoded again and no usage recomputed; only the record's deadline moves.
            if entry.state_hash == state_hash && entry.address == node.address() {
                let stale_at = entry.heartbeat.as_ref().map(Renewal::stale_at);
                if let Some(mut s) = self.table.get(&name).copied()
                    && s.stale_at != stale_at
                {
                    s.stale_at = stale_at;
                    self.table.set(&name, Some(s));
                }
                return Vec::new();
            }
        }
        let gpus = match state_value {
            None => NodeGpus::NotSharing,
            Some(v) => match NodeState::decode(v) {
                Ok(s) => NodeGpus::Reported(Box::new(s)),
                Err(e) => NodeGpus::Invalid(e.to_string()),
            },
        };
        self.index_reports(&name, &gpus);
        let by_wall_clock = self.config.heartbeat_by_wall_clock;
        let entry = self.nodes.entry(name.clone()).or_insert_with(|| {
            let mut entry = NodeEntry {
                address: String::new(),
                gpus: NodeGpus::NotSharing,
                cache: None,
                heartbeat: None,
                state_hash: None,
            };
            renew(&mut entry, node, &name, by_wall_clock);
            entry
        });
        let old_generation = match &entry.gpus {
            NodeGpus::Reported(s) => Some(s.generation),
            _ => None,
        };
        entry.address = node.address().to_owned();
        entry.gpus = gpus;
        entry.state_hash = state_hash;
        entry.cache = None;
        self.dirty.push(name.clone());
        self.table.set(&name, None);
        let Some(entry) = self.nodes.get(&name) else { return Vec::new() };
        match &entry.gpus {
            NodeGpus::Reported(s) if old_generation != Some(s.generation) && self.comparing() => {
                let found = self.disagreements_on(&name);
                self.disagreements += found.len() as u64;
                found
            }
            _ => Vec::new(),
        }
    }

    /// Keeps `reported` (UID → nodes whose daemon holds it) in step as `node` changes to `new`.
    fn index_reports(&mut self, node: &str, new: &NodeGpus) {
        if let Some(NodeGpus::Reported(old)) = self.nodes.get(node).map(|e| &e.gpus) {
            for a in &old.allocations {
                if let Some(nodes) = self.reported.get_mut(&a.pod.uid) {
                    nodes.retain(|n| n != node);
                    if nodes.is_empty() {
                        self.reported.remove(&a.pod.uid);
                    }
                }
            }
        }
        if let NodeGpus::Reported(state) = new {
            for a in &state.allocations {
                let nodes = self.reported.entry(a.pod.uid.clone()).or_default();
                if !nodes.iter().any(|n| n == node) {
                    nodes.push(node.to_owned());
                }
            }
        }
    }

    /// Removes a node.
    pub fn delete_node(&mut self, name: &str) {
        self.index_reports(name, &NodeGpus::NotSharing);
        self.nodes.remove(name);
        self.table.remove(name);
    }

    /// The pods in `uids` as gone, with the nodes where they hold memory.
    #[must_use]
    pub fn evicted<'a>(&self, uids: &[&'a str]) -> Evicted<'a> {
        let mut nodes: Vec<String> = Vec::new();
        for uid in uids {
            let bound = self.pods.get(*uid).and_then(|p| p.node.clone());
            let assumed = self.assumed.get(*uid).map(|a| a.node.clone());
            let reported = self.reported.get(*uid).into_iter().flatten().cloned();
            for n in bound.into_iter().chain(assumed).chain(reported) {
                if !nodes.contains(&n) {
                    nodes.push(n);
                }
            }
        }
        Evicted { uids: uids.iter().copied().collect(), nodes, now: Instant::now() }
    }

    /// Replaces every node (a watch restart's full list).
    pub fn replace_nodes<'a>(&mut self, nodes: impl IntoIterator<Item = &'a NodeObject>) -> Vec<String> {
        let mut seen = HashSet::new();
        let mut found = Vec::new();
        for n in nodes {
            seen.insert(n.name().to_owned());
            found.extend(self.apply_node(n));
        }
        let gone: Vec<String> = self.nodes.keys().filter(|n| !seen.contains(*n)).cloned().collect();
        for name in gone {
            self.delete_node(&name);
        }
        found.extend(self.listed(InitialLists { nodes: true, pods: false }));
        found
    }

    /// Holds back comparing daemons' reports with the view until both initial lists (Nodes
    /// and Pods) are in: a report naming a pod the pod list has not delivered yet is no
    /// disagreement. [`Self::replace_nodes`] and [`Self::retain_pods`] end each list; the one
    /// that completes the pair compares every node once.
    pub fn await_initial_lists(&mut self) {
        self.awaiting = InitialLists { nodes: true, pods: true };
    }

    fn comparing(&self) -> bool {
        self.awaiting == InitialLists::default()
    }

    /// Marks `done` lists as in; compares every node when that makes both.
    fn listed(&mut self, done: InitialLists) -> Vec<String> {
        if self.comparing() {
            return Vec::new();
        }
        self.awaiting.nodes &= !done.nodes;
        self.awaiting.pods &= !done.pods;
        if !self.comparing() {
            return Vec::new();
        }
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        let found: Vec<String> = names.iter().flat_map(|n| self.disagreements_on(n)).collect();
        self.disagreements += found.len() as u64;
        found
    }

    /// Whether the view keeps `pod`: it asks for GPU memory or holds a placement.
    #[must_use]
    pub fn keeps(&self, pod: &PodObject) -> bool {
        pod.asks_for_gpu(&self.config.names) || self.holding_of(pod) != Holding::Nothing
    }

    /// Adds or updates a pod. Pods that ask for no GPU and hold nothing are not kept.
    pub fn apply_pod(&mut self, pod: &PodObject) {
        let uid = pod.uid().to_owned();
        self.remove_pod(&uid);
        let holding = self.holding_of(pod);
        if !pod.asks_for_gpu(&self.config.names) && holding == Holding::Nothing {
            return;
        }
        let node = pod.node().map(str::to_owned);
        // The watch caught up with a bind: the pod's own annotation counts from now on.
        if node.is_some()
            && matches!(holding, Holding::Assigned(_) | Holding::Alibaba(_))
            && let Some(a) = self.assumed.remove(&uid)
        {
            self.touch(Some(&a.node));
        }
        let entry = PodEntry {
            namespace: pod.namespace().to_owned(),
            name: pod.name().to_owned(),
            uid: uid.clone(),
            node: node.clone(),
            priority: pod.spec.priority.unwrap_or(0),
            terminal: pod.is_terminal(),
            request: self.request_of(pod),
            holding,
        };
        if let Some(n) = &node {
            self.bound.entry(n.clone()).or_default().insert(uid.clone());
            self.touch(Some(n));
        }
        self.pods.insert(uid, entry);
    }

    fn remove_pod(&mut self, uid: &str) -> Option<PodEntry> {
        let old = self.pods.remove(uid)?;
        if let Some(n) = &old.node {
            if let Some(set) = self.bound.get_mut(n) {
                set.remove(uid);
                if set.is_empty() {
                    self.bound.remove(n);
                }
            }
            self.touch(Some(n));
        }
        Some(old)
    }

    /// Removes a pod and any bind assumed for it.
    pub fn delete_pod(&mut self, uid: &str) {
        self.remove_pod(uid);
        if let Some(a) = self.assumed.remove(uid) {
            self.touch(Some(&a.node));
        }
    }

    /// Replaces every pod (a watch restart's full list).
    pub fn replace_pods<'a>(&mut self, pods: impl IntoIterator<Item = &'a PodObject>) {
        let old: Vec<String> = self.pods.keys().cloned().collect();
        for uid in old {
            self.remove_pod(&uid);
        }
        for p in pods {
            self.apply_pod(p);
        }
    }

    /// Forgets every pod whose UID is not in `keep` (the end of a relist applied as it came).
    pub fn retain_pods(&mut self, keep: &HashSet<String>) -> Vec<String> {
        let gone: Vec<String> = self.pods.keys().filter(|uid| !keep.contains(*uid)).cloned().collect();
        for uid in gone {
            self.remove_pod(&uid);
        }
        self.listed(InitialLists { nodes: false, pods: true })
    }

    /// Records an in-flight bind.
    pub fn assume(&mut self, uid: &str, assumed: Assumed) {
        let node = assumed.node.clone();
        if let Some(old) = self.assumed.insert(uid.to_owned(), assumed) {
            self.touch(Some(&old.node));
        }
        self.touch(Some(&node));
    }

    /// Marks an in-flight bind as accepted by the API server.
    pub fn confirm(&mut self, uid: &str) {
        if let Some(a) = self.assumed.get_mut(uid) {
            a.bound = true;
        }
    }

    /// Drops an in-flight bind (the call failed).
    pub fn forget(&mut self, uid: &str) -> Option<Assumed> {
        let a = self.assumed.remove(uid)?;
        self.touch(Some(&a.node));
        Some(a)
    }

    /// Drops assumptions older than the configured time; returns them.
    pub fn expire(&mut self, now: Instant) -> Vec<(String, Assumed)> {
        let ttl = self.config.assume_ttl;
        let old: Vec<String> = self
            .assumed
            .iter()
            .filter(|(_, a)| now.saturating_duration_since(a.since) > ttl)
            .map(|(uid, _)| uid.clone())
            .collect();
        old.into_iter().filter_map(|uid| self.forget(&uid).map(|a| (uid, a))).collect()
    }

    /// The assumption for a pod, if any.
    #[must_use]
    pub fn assumption(&self, uid: &str) -> Option<&Assumed> {
        self.assumed.get(uid)
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

    /// How fresh `node`'s published state is, when its daemon renews a heartbeat.
    #[must_use]
    pub fn freshness(&self, node: &str) -> Option<Freshness> {
        let r = self.nodes.get(node)?.heartbeat.as_ref()?;
        Some(Freshness { age: r.seen.elapsed(), stale_after: r.stale_after })
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

    /// A node's usage, attributed to its holders.
    ///
    /// # Errors
    /// Why the node has no GPUs to account.
    pub fn usage(&mut self, node: &str) -> Result<&Usage, NodeRefusal> {
        self.inventory(node)?;
        let fresh = match self.nodes.get(node).and_then(|e| e.cache.as_ref()) {
            Some(_) => None,
            None => Some(self.compute_usage(node)),
        };
        if let Some(u) = fresh {
            self.nodes.get_mut(node).ok_or(NodeRefusal::Unknown)?.cache = Some(u);
            self.sync(node);
        }
        self.nodes.get(node).and_then(|e| e.cache.as_ref()).ok_or(NodeRefusal::Unknown)
    }

    /// A pod's footprint per GPU position of `inventory`, from its holding.
    fn footprint(&self, inventory: &NodeInventory, holding: &Holding) -> Option<Vec<Mib>> {
        let mut mib = vec![Mib::ZERO; inventory.gpus().len()];
        match holding {
            Holding::Assigned(a) => {
                for (uuid, m) in a.footprint() {
                    let p = inventory.position_of(&uuid)?;
                    mib[p] = mib[p].saturating_add(m);
                }
            }
            Holding::Alibaba(a) if self.config.alibaba => {
                let (p, m) = a.usage(inventory)?;
                mib[p] = m;
            }
            _ => return None,
        }
        Some(mib)
    }

    fn compute_usage(&self, node: &str) -> Usage {
        let Some(entry) = self.nodes.get(node) else { return Usage::default() };
        let NodeGpus::Reported(state) = &entry.gpus else { return Usage::default() };
        let inventory = &state.inventory;
        let n = inventory.gpus().len();
        // What the daemon attributes to each pod, by the rule its `usedMiB` follows.
        let mut reported: BTreeMap<&str, (&gpushare_core::codec::node::PodRef, Vec<Mib>)> = BTreeMap::new();
        let mut attributed = vec![Mib::ZERO; n];
        for (uid, f) in pod_footprints(inventory, &state.allocations) {
            for (t, m) in attributed.iter_mut().zip(&f.mib) {
                *t = t.saturating_add(*m);
            }
            reported.insert(uid, (f.pod, f.mib));
        }
        let base = state.used.iter().zip(&attributed).map(|(u, a)| u.saturating_sub(*a)).collect();
        let mut usage = Usage { base, pods: Vec::new(), admitting: Vec::new(), pending: Vec::new(), total: Vec::new() };
        let mut counted: HashSet<&str> = HashSet::new();
        for uid in self.bound.get(node).into_iter().flatten() {
            let Some(pod) = self.pods.get(uid) else { continue };
            let daemon = reported.remove(uid.as_str());
            let own = if pod.terminal { None } else { self.footprint(inventory, &pod.holding) };
            if daemon.is_none()
                && own.is_some()
                && let Holding::Assigned(a) = &pod.holding
            {
                let pod = format!("{}/{}", pod.namespace, pod.name);
                usage.admitting.push(Admitting { uid: uid.clone(), pod, assignment: (**a).clone() });
            }
            let mib = match (daemon, own) {
                // The daemon wins; what it has not admitted yet (a container still to come) is added.
                (Some((_, d)), Some(o)) => d.iter().zip(&o).map(|(d, o)| (*d).max(*o)).collect(),
                (Some((_, d)), None) => d,
                (None, Some(o)) => o,
                (None, None) => {
                    if !pod.terminal
                        && pod.holding == Holding::Nothing
                        && let Ok(r) = &pod.request
                        && !r.is_empty()
                    {
                        usage.pending.push((format!("{}/{}", pod.namespace, pod.name), r.long_running_memory()));
                    }
                    continue;
                }
            };
            counted.insert(uid.as_str());
            usage.pods.push(Holder {
                uid: uid.clone(),
                pod: format!("{}/{}", pod.namespace, pod.name),
                mib,
                assumed: false,
            });
        }
        // Pods the daemon holds that the view has elsewhere or not at all: the daemon wins.
        for (uid, (pod, mib)) in reported {
            counted.insert(uid);
            let key = format!("{}/{}", pod.namespace, pod.name);
            usage.pods.push(Holder { uid: uid.to_owned(), pod: key, mib, assumed: false });
        }
        for (uid, a) in &self.assumed {
            if a.node != node || counted.contains(uid.as_str()) {
                continue;
            }
            let pod = format!("{}/{}", a.namespace, a.name);
            usage.admitting.push(Admitting { uid: uid.clone(), pod, assignment: a.assignment.clone() });
            if let Some(mib) = self.footprint(inventory, &Holding::Assigned(Box::new(a.assignment.clone()))) {
                usage.pods.push(Holder {
                    uid: uid.clone(),
                    pod: format!("{}/{}", a.namespace, a.name),
                    mib,
                    assumed: true,
                });
            }
        }
        usage.pods.sort_by(|a, b| a.pod.cmp(&b.pod).then_with(|| a.uid.cmp(&b.uid)));
        usage.pending.sort();
        usage.total = usage.without(&HashSet::new());
        usage
    }

    /// Where the daemon's report and the view disagree on `node`.
    fn disagreements_on(&self, node: &str) -> Vec<String> {
        let Some(entry) = self.nodes.get(node) else { return Vec::new() };
        let NodeGpus::Reported(state) = &entry.gpus else { return Vec::new() };
        // The daemon's rows by pod, in one sorted list rather than a map of sets: this runs on
        // every change of a node's state, over all of its allocations.
        let mut rows: Vec<(&str, u32, &gpushare_core::codec::node::PodRef)> =
            state.allocations.iter().map(|a| (a.pod.uid.as_str(), a.gpu, &a.pod)).collect();
        rows.sort_unstable_by(|a, b| a.0.cmp(b.0).then(a.1.cmp(&b.1)));
        rows.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);
        let mut out = Vec::new();
        for same_pod in rows.chunk_by(|a, b| a.0 == b.0) {
            let (uid, _, pod) = same_pod[0];
            // The extender's own bind to this node, which its pod watch has not shown yet: the
            // daemon agrees with it.
            if self.assumed.get(uid).is_some_and(|a| a.node == node)
                && self.pods.get(uid).is_none_or(|p| p.node.is_none())
            {
                continue;
            }
            let who = || format!("{}/{} (uid {uid})", pod.namespace, pod.name);
            match self.pods.get(uid) {
                None => out.push(format!(
                    "node {node}'s daemon holds memory for pod {}, which the extender does not know",
                    who()
                )),
                Some(p) if p.node.as_deref() != Some(node) => out.push(format!(
                    "node {node}'s daemon holds memory for pod {}, which the extender has on {}",
                    who(),
                    p.node.as_deref().unwrap_or("no node")
                )),
                Some(PodEntry { holding: Holding::Assigned(a), .. }) => {
                    let assigned = |gpu: u32| a.containers.iter().any(|c| c.gpus.iter().any(|g| g.index == gpu));
                    if !same_pod.iter().all(|(_, gpu, _)| assigned(*gpu)) {
                        let gpus: BTreeSet<u32> = same_pod.iter().map(|(_, gpu, _)| *gpu).collect();
                        let assigned: BTreeSet<u32> =
                            a.containers.iter().flat_map(|c| c.gpus.iter().map(|g| g.index)).collect();
                        out.push(format!(
                            "node {node}'s daemon holds pod {} on GPU {gpus:?}, its assignment says GPU {assigned:?}; counting the daemon's",
                            who()
                        ));
                    }
                }
                Some(_) => {}
            }
        }
        out
    }

    /// Runs `f` on a node's inventory and its usage with the `evicted` pods gone: one lookup
    /// when the usage is cached, no copy unless an evicted pod holds memory there.
    fn with_node<R>(
        &self,
        node: &str,
        evicted: &Evicted<'_>,
        f: impl FnOnce(&NodeInventory, &[Mib]) -> R,
    ) -> Result<R, NodeRefusal> {
        let entry = self.nodes.get(node).ok_or(NodeRefusal::Unknown)?;
        if let Some(h) = self.stale(node) {
            return Err(NodeRefusal::Stale(h));
        }
        let inventory = match &entry.gpus {
            NodeGpus::Reported(s) => &s.inventory,
            NodeGpus::NotSharing => return Err(NodeRefusal::NotSharing),
            NodeGpus::Invalid(why) => return Err(NodeRefusal::Invalid(why.clone())),
        };
        match &entry.cache {
            Some(usage) if !evicted.touches(node) => Ok(f(inventory, &usage.total)),
            Some(usage) => Ok(f(inventory, &usage.without(&evicted.uids))),
            // Not refreshed yet: computed for this call only.
            None => Ok(f(inventory, &self.compute_usage(node).without(&evicted.uids))),
        }
    }

    /// Places `pod` on `node` like [`Self::place`], but only on the GPUs of the look-alike
    /// pods `node` is still admitting (every other GPU counted full), so that whichever of them
    /// the daemon serves first gets what it was assigned. `None` when no look-alike is in
    /// admission there or the pod does not fit on their GPUs.
    pub fn place_beside_lookalikes(
        &mut self,
        placer: &mut Placer,
        node: &str,
        pod: &PodRequest,
        uid: &str,
        policy: GpuPolicy,
        evicted: &Evicted<'_>,
    ) -> Option<Assignment> {
        let first = pod.first_request()?;
        let usage = self.usage(node).ok()?;
        let beside: HashSet<String> = usage
            .admitting
            .iter()
            .filter(|a| a.uid != uid && a.assignment.first_request() == Some(first))
            .flat_map(|a| a.assignment.containers.iter().flat_map(|c| c.gpus.iter().map(|g| g.uuid.to_string())))
            .collect();
        if beside.is_empty() {
            return None;
        }
        self.with_node(node, evicted, |inventory, used| {
            let used: Vec<Mib> = inventory
                .gpus()
                .iter()
                .zip(used)
                .map(|(g, u)| if beside.contains(g.uuid.as_str()) { *u } else { g.total })
                .collect();
            let view = NodeView::new(inventory, &used).ok()?;
            let placement = placer.place(view, pod, policy).ok()?;
            Some(Assignment::from_placement(node, inventory, pod, &placement))
        })
        .ok()
        .flatten()
    }

    /// Whether `node` certainly takes `pod`, decided from its [`Summary`] without the placer:
    /// for the common shape (one container on one or more GPUs, the node's unit) it is enough
    /// that enough schedulable GPUs have the room. `None` when the shortcut does not apply or
    /// the answer is no (the caller then asks [`Self::score`], which also says why).
    #[must_use]
    pub fn surely_fits(&self, node: &str, pod: &PodRequest, evicted: &Evicted<'_>) -> Option<bool> {
        let shape = Shape::of(pod)?;
        let s = self.table.get(node)?;
        if evicted.touches(node) || s.is_stale_at(evicted.now) {
            return None;
        }
        s.fits(&shape)
    }

    /// filter's answer from `node`'s [`Summary`] alone: `true` when the node certainly takes
    /// a pod of `shape` and admits no pod that could be its look-alike, so that it passes with
    /// no further look; `false` when the long way must decide (and say why not).
    #[must_use]
    pub fn passes_at_a_glance(&self, node: &str, shape: &Shape, evicted: &Evicted<'_>) -> bool {
        self.table.get(node).is_some_and(|s| {
            s.fits(shape) == Some(true) && !s.may_admit_lookalike(shape.first) && !s.is_stale_at(evicted.now)
        }) && !evicted.touches(node)
    }

    /// prioritize's score from `node`'s [`Summary`] alone: what [`Self::score`] answers when
    /// the pod fits, `None` when the long way must decide (no fit, GPU activity weighed, an
    /// evicted pod on the node, no summary).
    #[must_use]
    pub fn score_at_a_glance(
        &self,
        node: &str,
        shape: &Shape,
        policies: Policies,
        busy_weight: u8,
        evicted: &Evicted<'_>,
    ) -> Option<u8> {
        if busy_weight != 0 {
            return None;
        }
        let s = self.table.get(node)?;
        let score = s.score(shape, policies.node)?;
        (!evicted.touches(node) && !s.is_stale_at(evicted.now)).then_some(score)
    }

    /// Scores `node` for `pod` (0–10) with the `evicted` pods gone (the pod itself, so an
    /// earlier try of its own bind does not count against it), or says why it cannot take it.
    ///
    /// # Errors
    /// The node's [`NodeRefusal`].
    pub fn score(
        &self,
        placer: &mut Placer,
        node: &str,
        pod: &PodRequest,
        policies: Policies,
        busy_weight: u8,
        evicted: &Evicted<'_>,
    ) -> Result<u8, NodeRefusal> {
        self.with_node(node, evicted, |inventory, used| {
            let view = NodeView::new(inventory, used).map_err(|e| NodeRefusal::Invalid(e.to_string()))?;
            placer
                .score_weighing_activity(view, pod, policies.gpu, policies.node, busy_weight)
                .map_err(NodeRefusal::Rejected)
        })?
    }

    /// Places `pod` on `node` as things stand, with the `evicted` pods gone.
    ///
    /// # Errors
    /// The node's [`NodeRefusal`].
    pub fn place(
        &self,
        placer: &mut Placer,
        node: &str,
        pod: &PodRequest,
        policy: GpuPolicy,
        evicted: &Evicted<'_>,
    ) -> Result<Assignment, NodeRefusal> {
        self.with_node(node, evicted, |inventory, used| {
            let view = NodeView::new(inventory, used).map_err(|e| NodeRefusal::Invalid(e.to_string()))?;
            let placement = placer.place(view, pod, policy).map_err(NodeRefusal::Rejected)?;
            Ok(Assignment::from_placement(node, inventory, pod, &placement))
        })?
    }
}

impl ClusterView {
    /// Whether `node` is admitting a pod whose first device request is the size of `pod`'s:
    /// the cheap test before [`Self::lookalike_in_admission`].
    pub fn admits_lookalike(&mut self, node: &str, pod: &PodRequest, uid: &str) -> bool {
        let Some(first) = pod.first_request() else { return false };
        self.usage(node)
            .is_ok_and(|u| u.admitting.iter().any(|a| a.uid != uid && a.assignment.first_request() == Some(first)))
    }

    /// A pod bound (or being bound) to `node` that its daemon has not allocated yet and that
    /// the kubelet cannot tell from a pod placed as `assignment`: its first device request is
    /// the same size, but its GPUs differ. The kubelet's device-plugin calls carry only device
    /// counts, so the daemon would serve whichever it takes to be first; binding a look-alike
    /// while the other is admitted could hand each the other's GPUs. Returns `namespace/name`.
    pub fn lookalike_in_admission(&mut self, node: &str, uid: &str, assignment: &Assignment) -> Option<String> {
        let usage = self.usage(node).ok()?;
        usage.admitting.iter().find(|a| a.uid != uid && a.assignment.is_lookalike_of(assignment)).map(|a| a.pod.clone())
    }
}

#[cfg(test)]
pub(crate) mod tests;
