//! A kube-scheduler stand-in: it schedules pods the way kube-scheduler does with one HTTP extender
//! configured as in `etc/kube-scheduler/gpushare-scheduler-config.yaml` (`urlPrefix`,
//! `filterVerb`, `prioritizeVerb`, `weight`, `bindVerb`, `nodeCacheCapable: true`,
//! `ignorable: false`, `managedResources` with `ignoredByScheduler`).
//!
//! What it does, after kube-scheduler (`pkg/scheduler`, cited per function):
//!
//! - watches Nodes and the non-terminal Pods (the field selector kube-scheduler's pod informer
//!   uses) with `kube`'s watcher, retrying with its default backoff while the API server is away;
//! - queues the pending pods it is responsible for (`spec.schedulerName`), by priority, then
//!   creation time, then namespace and name; pods that failed wait out a per-pod exponential
//!   backoff; unschedulable pods wait for a cluster event (a Node added or changed, a pod on a
//!   node deleted or terminated) or for `unschedulable_flush`;
//! - schedules one pod at a time: the node-level filters (`NodeUnschedulable`, `TaintToleration`,
//!   the `nodeSelector` part of `NodeAffinity`, `NodeResourcesFit`), then the extender's filter
//!   (for pods that request a managed resource), its prioritize (unless one node is left), the
//!   best score with ties broken at random; then it assumes the pod on the node and binds it in a
//!   task of its own (through the extender's bind verb, or a `pods/binding` of its own for pods
//!   the extender does not manage), so the next pod's cycle starts at once;
//! - explains a pod that cannot be placed as kube-scheduler does: a `PodScheduled=False`
//!   condition, reason `Unschedulable` (or `SchedulerError`), with the message
//!   `0/3 nodes are available: 1 Insufficient gpushare.io/gpu-mem, 2 <extender reason>.`
//!
//! Not done (deviations): preemption (`preemptVerb` is not called, so no `preemption: ...` suffix
//! in the messages), score plugins other than the extender's, node affinity terms, pod
//! (anti-)affinity, topology spread, volumes and host ports, Events, HTTPS to the extender,
//! nominated nodes, and more than one extender or profile. `cpu`, `memory` and
//! `ephemeral-storage` are checked only on nodes that advertise them, and the pod count only on
//! nodes with `pods` in their allocatable. A node whose `Ready` condition is not `True` is treated
//! as carrying the taint the node lifecycle controller would put on it.

use crate::rng::XorShift;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use bytes::Bytes;
use futures::StreamExt as _;
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{Binding, Container, Node, ObjectReference, Pod, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Client, ResourceExt as _};
use serde::Serialize;
use serde_json::{Map, Value, json};
use tokio::sync::Notify;
use tokio::task::JoinSet;

/// The scheduler name pods get when they name none.
pub const DEFAULT_SCHEDULER_NAME: &str = "default-scheduler";

/// kube-scheduler's `framework.MaxNodeScore`.
const MAX_NODE_SCORE: i64 = 100;
/// The extender API's `MaxExtenderPriority`.
const MAX_EXTENDER_PRIORITY: i64 = 10;

/// An extender's `managedResources` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagedResource {
    /// The extended resource's name, for example `gpushare.io/gpu-mem`.
    pub name: String,
    /// `ignoredByScheduler`: the scheduler's own fit check skips this resource.
    pub ignored_by_scheduler: bool,
}

/// The scheduler profile and its one extender, with the queue's timings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// The `spec.schedulerName` of the pods to schedule (a pod naming none means
    /// [`DEFAULT_SCHEDULER_NAME`]).
    pub scheduler_name: String,
    /// The extender's `urlPrefix`, for example `http://127.0.0.1:39999/gpushare-scheduler`
    /// (plain HTTP only).
    pub extender_url: String,
    /// `filterVerb`; empty: no filter call.
    pub filter_verb: String,
    /// `prioritizeVerb`; empty: no prioritize call.
    pub prioritize_verb: String,
    /// `bindVerb`; empty: the scheduler binds every pod itself.
    pub bind_verb: String,
    /// `weight`, which must be positive when `prioritize_verb` is set.
    pub weight: i64,
    /// `managedResources`; empty: the extender is sent every pod.
    pub managed_resources: Vec<ManagedResource>,
    /// `httpTimeout` of every call to the extender.
    pub http_timeout: Duration,
    /// `podInitialBackoffSeconds`.
    pub initial_backoff: Duration,
    /// `podMaxBackoffSeconds`.
    pub max_backoff: Duration,
    /// `podMaxInUnschedulablePodsDuration`: an unschedulable pod is retried after this long even
    /// without a cluster event.
    pub unschedulable_flush: Duration,
}

impl SchedulerConfig {
    /// The shipped configuration (`etc/kube-scheduler/gpushare-scheduler-config.yaml`) with the
    /// extender at `extender_url`: `gpushare.io/gpu-mem` counted by the scheduler,
    /// `gpushare.io/gpu-count` ignored by it, and kube-scheduler's default timings.
    #[must_use]
    pub fn gpushare(extender_url: &str) -> Self {
        SchedulerConfig {
            scheduler_name: DEFAULT_SCHEDULER_NAME.to_owned(),
            extender_url: extender_url.to_owned(),
            filter_verb: "filter".to_owned(),
            prioritize_verb: "prioritize".to_owned(),
            bind_verb: "bind".to_owned(),
            weight: 1,
            managed_resources: vec![
                ManagedResource { name: "gpushare.io/gpu-mem".to_owned(), ignored_by_scheduler: false },
                ManagedResource { name: "gpushare.io/gpu-count".to_owned(), ignored_by_scheduler: true },
            ],
            http_timeout: Duration::from_secs(5),
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(10),
            unschedulable_flush: Duration::from_secs(5 * 60),
        }
    }

    /// How long a pod waits after its `attempts`-th failed attempt: `initial_backoff` doubled per
    /// earlier attempt, at most `max_backoff` (kube-scheduler's `calculateBackoffDuration`).
    #[must_use]
    pub fn backoff(&self, attempts: u32) -> Duration {
        let mut backoff = self.initial_backoff;
        for _ in 1..attempts {
            backoff = backoff.saturating_mul(2);
            if backoff >= self.max_backoff {
                return self.max_backoff;
            }
        }
        backoff.min(self.max_backoff)
    }

    /// Whether the extender is sent `pod`: with managed resources, only if a container or init
    /// container requests or limits one of them (`HTTPExtender.IsInterested`).
    #[must_use]
    pub fn is_interested(&self, pod: &Pod) -> bool {
        if self.managed_resources.is_empty() {
            return true;
        }
        let Some(spec) = &pod.spec else { return false };
        spec.containers.iter().chain(spec.init_containers.iter().flatten()).any(|c| {
            c.resources.as_ref().is_some_and(|r| {
                [&r.requests, &r.limits]
                    .into_iter()
                    .flatten()
                    .any(|m| self.managed_resources.iter().any(|mr| m.contains_key(&mr.name)))
            })
        })
    }

    /// Whether the scheduler's fit check skips `resource` (`ignoredByScheduler`).
    fn ignores(&self, resource: &str) -> bool {
        self.managed_resources.iter().any(|m| m.ignored_by_scheduler && m.name == resource)
    }
}

/// Calls to the extender, per verb.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct VerbCounts {
    /// The filter verb.
    pub filter: u64,
    /// The prioritize verb.
    pub prioritize: u64,
    /// The bind verb.
    pub bind: u64,
}

/// The pods in the scheduling queue, by where they wait.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct QueueStats {
    /// Ready to be scheduled.
    pub active: u64,
    /// Waiting out their backoff.
    pub backoff: u64,
    /// Waiting for a cluster event.
    pub unschedulable: u64,
    /// Being scheduled or bound.
    pub in_flight: u64,
}

/// A snapshot of the scheduler's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SchedulerStats {
    /// Scheduling cycles run (one per pod popped from the queue).
    pub attempts: u64,
    /// Pods bound.
    pub scheduled: u64,
    /// Cycles that found no node (a `FitError`, or no node at all).
    pub unschedulable: u64,
    /// Cycles or bindings that failed: an extender's `Error`, an HTTP failure or timeout, a
    /// malformed answer, a failed binding. The pod is retried after its backoff.
    pub errors: u64,
    /// Calls made to the extender.
    pub extender_calls: VerbCounts,
    /// Calls to the extender that failed (a failed prioritize is ignored, as kube-scheduler does).
    pub extender_failures: VerbCounts,
    /// Bindings the scheduler created itself (pods the extender does not manage).
    pub direct_binds: u64,
    /// `PodScheduled=False` conditions written.
    pub status_patches: u64,
    /// How long the last successful binding took, in microseconds.
    pub last_bind_micros: u64,
    /// How long the slowest successful binding took, in microseconds.
    pub max_bind_micros: u64,
    /// The queue now.
    pub queue: QueueStats,
}

#[derive(Debug, Default)]
struct Counters {
    attempts: AtomicU64,
    scheduled: AtomicU64,
    unschedulable: AtomicU64,
    errors: AtomicU64,
    calls: [AtomicU64; 3],
    failures: [AtomicU64; 3],
    direct_binds: AtomicU64,
    status_patches: AtomicU64,
    last_bind_micros: AtomicU64,
    max_bind_micros: AtomicU64,
}

/// An index into [`Counters::calls`] and [`Counters::failures`].
#[derive(Debug, Clone, Copy)]
enum Verb {
    Filter = 0,
    Prioritize = 1,
    Bind = 2,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

fn verbs(counters: &[AtomicU64; 3]) -> VerbCounts {
    let [filter, prioritize, bind] = counters.each_ref().map(|c| c.load(Ordering::Relaxed));
    VerbCounts { filter, prioritize, bind }
}

/// A pod's namespace and name.
type PodKey = (String, String);

fn pod_key(pod: &Pod) -> PodKey {
    (pod.namespace().unwrap_or_default(), pod.name_any())
}

fn show(key: &PodKey) -> String {
    format!("{}/{}", key.0, key.1)
}

/// The active queue's order: priority (highest first), creation time, namespace and name
/// (kube-scheduler's `PrioritySort` plugin orders by priority, then by when the pod was queued).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Order {
    priority: Reverse<i32>,
    created: Option<Timestamp>,
    key: PodKey,
}

impl Order {
    fn of(key: &PodKey, pod: &Pod) -> Order {
        Order {
            priority: Reverse(pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)),
            created: pod.metadata.creation_timestamp.as_ref().map(|t| t.0),
            key: key.clone(),
        }
    }
}

/// Where a queued pod waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Active,
    /// Until then.
    Backoff(Instant),
    /// Since then.
    Unschedulable(Instant),
    /// Being scheduled; the move epoch when it was popped.
    InFlight(u64),
    /// Assumed on a node, being bound.
    Binding,
}

#[derive(Debug)]
struct Entry {
    pod: Arc<Pod>,
    order: Order,
    place: Place,
    attempts: u32,
    last_attempt: Option<Instant>,
}

/// A pod popped for a scheduling cycle.
#[derive(Debug)]
struct Popped {
    key: PodKey,
    pod: Arc<Pod>,
    attempts: u32,
}

/// kube-scheduler's `PriorityQueue`: the active queue, the backoff queue and the unschedulable
/// pods, in one map.
#[derive(Debug, Default)]
struct Queue {
    entries: HashMap<PodKey, Entry>,
    active: BTreeSet<Order>,
    /// Bumped by every cluster event that moves unschedulable pods (kube-scheduler's
    /// `moveRequestCycle`): a pod found unschedulable while one happened goes to backoff instead.
    move_epoch: u64,
}

impl Queue {
    /// A new pending pod joins the active queue; a known one is updated, and moved if it was
    /// unschedulable and its spec changed (`PriorityQueue.Update`).
    fn upsert(&mut self, key: PodKey, pod: Arc<Pod>, changed: bool, now: Instant, config: &SchedulerConfig) {
        if let Some(entry) = self.entries.get_mut(&key) {
            entry.pod = pod;
            if changed && matches!(entry.place, Place::Unschedulable(_)) {
                Self::requeue(&mut self.active, entry, now, config);
            }
            return;
        }
        let order = Order::of(&key, &pod);
        self.active.insert(order.clone());
        self.entries.insert(key, Entry { pod, order, place: Place::Active, attempts: 0, last_attempt: None });
    }

    /// To the active queue, or to backoff if its backoff has not passed (`requeuePodViaQueueingHint`).
    fn requeue(active: &mut BTreeSet<Order>, entry: &mut Entry, now: Instant, config: &SchedulerConfig) {
        match entry.last_attempt.map(|t| t + config.backoff(entry.attempts)) {
            Some(until) if until > now => entry.place = Place::Backoff(until),
            _ => {
                entry.place = Place::Active;
                active.insert(entry.order.clone());
            }
        }
    }

    fn remove(&mut self, key: &PodKey) {
        if let Some(entry) = self.entries.remove(key) {
            self.active.remove(&entry.order);
        }
    }

    /// A cluster event: every unschedulable pod is retried (after its backoff)
    /// (`MoveAllToActiveOrBackoffQueue`).
    fn move_all(&mut self, now: Instant, config: &SchedulerConfig) {
        self.move_epoch += 1;
        for entry in self.entries.values_mut() {
            if matches!(entry.place, Place::Unschedulable(_)) {
                Self::requeue(&mut self.active, entry, now, config);
            }
        }
    }

    /// Pods whose backoff passed become active (`flushBackoffQCompleted`); pods unschedulable for
    /// longer than `unschedulable_flush` are retried (`flushUnschedulablePodsLeftover`).
    fn flush(&mut self, now: Instant, config: &SchedulerConfig) {
        for entry in self.entries.values_mut() {
            match entry.place {
                Place::Backoff(until) if until <= now => {
                    entry.place = Place::Active;
                    self.active.insert(entry.order.clone());
                }
                Place::Unschedulable(since) if since + config.unschedulable_flush <= now => {
                    Self::requeue(&mut self.active, entry, now, config);
                }
                _ => {}
            }
        }
    }

    /// When [`Queue::flush`] next has something to do.
    fn next_deadline(&self, config: &SchedulerConfig) -> Option<Instant> {
        self.entries
            .values()
            .filter_map(|e| match e.place {
                Place::Backoff(until) => Some(until),
                Place::Unschedulable(since) => Some(since + config.unschedulable_flush),
                _ => None,
            })
            .min()
    }

    /// The first active pod; its attempts count up (`PriorityQueue.Pop`).
    fn pop(&mut self) -> Option<Popped> {
        while let Some(order) = self.active.pop_first() {
            let Some(entry) = self.entries.get_mut(&order.key) else { continue };
            if entry.place != Place::Active {
                continue;
            }
            entry.attempts = entry.attempts.saturating_add(1);
            entry.place = Place::InFlight(self.move_epoch);
            return Some(Popped { key: order.key, pod: Arc::clone(&entry.pod), attempts: entry.attempts });
        }
        None
    }

    /// The pod being scheduled is assumed on a node; false if it went away meanwhile.
    fn assume(&mut self, key: &PodKey) -> bool {
        match self.entries.get_mut(key) {
            Some(entry) if matches!(entry.place, Place::InFlight(_)) => {
                entry.place = Place::Binding;
                true
            }
            _ => false,
        }
    }

    /// The cycle or the binding failed: an unschedulable pod waits for an event (or backs off if
    /// one came during its cycle), a failed one backs off (`AddUnschedulableIfNotPresent`).
    /// Returns the pod's latest state, or `None` if it is no longer queued.
    fn failed(
        &mut self,
        key: &PodKey,
        unschedulable: bool,
        now: Instant,
        config: &SchedulerConfig,
    ) -> Option<Arc<Pod>> {
        let move_epoch = self.move_epoch;
        let entry = self.entries.get_mut(key)?;
        let popped_at = match entry.place {
            Place::InFlight(epoch) => Some(epoch),
            Place::Binding => None,
            _ => return None,
        };
        entry.last_attempt = Some(now);
        entry.place = match popped_at {
            Some(epoch) if unschedulable && epoch == move_epoch => Place::Unschedulable(now),
            _ => Place::Backoff(now + config.backoff(entry.attempts)),
        };
        Some(Arc::clone(&entry.pod))
    }

    fn stats(&self) -> QueueStats {
        let mut stats = QueueStats::default();
        for entry in self.entries.values() {
            let counter = match entry.place {
                Place::Active => &mut stats.active,
                Place::Backoff(_) => &mut stats.backoff,
                Place::Unschedulable(_) => &mut stats.unschedulable,
                Place::InFlight(_) | Place::Binding => &mut stats.in_flight,
            };
            *counter += 1;
        }
        stats
    }
}

/// What the watches show, the assumed pods and the queue.
#[derive(Debug, Default)]
struct State {
    nodes: BTreeMap<String, Arc<Node>>,
    /// Every non-terminal pod.
    pods: HashMap<PodKey, Arc<Pod>>,
    /// Pods assumed on a node whose binding the watch has not shown yet (the scheduler cache's
    /// assumed pods), with the node.
    assumed: HashMap<PodKey, (String, Arc<Pod>)>,
    queue: Queue,
    nodes_synced: bool,
    pods_synced: bool,
    /// During a relist, the objects seen so far; the others are gone when it ends.
    node_relist: Option<HashSet<String>>,
    pod_relist: Option<HashSet<PodKey>>,
}

#[derive(Debug)]
struct Inner {
    config: SchedulerConfig,
    counters: Counters,
    state: Mutex<State>,
    wake: Notify,
}

/// The kube-scheduler stand-in. Clones share the counters.
#[derive(Debug, Clone)]
pub struct Scheduler {
    inner: Arc<Inner>,
}

impl Scheduler {
    /// A scheduler with `config`; [`Scheduler::run`] starts it.
    #[must_use]
    pub fn new(config: SchedulerConfig) -> Self {
        let inner =
            Inner { config, counters: Counters::default(), state: Mutex::new(State::default()), wake: Notify::new() };
        Scheduler { inner: Arc::new(inner) }
    }

    /// Its configuration.
    #[must_use]
    pub fn config(&self) -> &SchedulerConfig {
        &self.inner.config
    }

    /// The counters now.
    #[must_use]
    pub fn stats(&self) -> SchedulerStats {
        let c = &self.inner.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SchedulerStats {
            attempts: load(&c.attempts),
            scheduled: load(&c.scheduled),
            unschedulable: load(&c.unschedulable),
            errors: load(&c.errors),
            extender_calls: verbs(&c.calls),
            extender_failures: verbs(&c.failures),
            direct_binds: load(&c.direct_binds),
            status_patches: load(&c.status_patches),
            last_bind_micros: load(&c.last_bind_micros),
            max_bind_micros: load(&c.max_bind_micros),
            queue: self.inner.lock().queue.stats(),
        }
    }

    /// Each node's `resourceVersion` as its node watch last delivered it; empty until the
    /// watch has listed. A box waits on it before it calls itself ready (`gpushare-box
    /// scheduler --nodes-file`), so no pod is tried against an older view of a node than the
    /// API server already shows.
    #[must_use]
    pub fn node_versions(&self) -> BTreeMap<String, String> {
        let st = self.inner.lock();
        if !st.nodes_synced {
            return BTreeMap::new();
        }
        st.nodes
            .iter()
            .map(|(name, node)| (name.clone(), node.metadata.resource_version.clone().unwrap_or_default()))
            .collect()
    }

    /// Watches the cluster through `client` and schedules, until the future is dropped (which
    /// also stops the bindings in flight). Run one at a time: each run starts from an empty
    /// cache and queue. The counters add up over runs.
    ///
    /// # Errors
    /// If the configuration is unusable (an extender URL that is not `http://host[:port]/...`, a
    /// prioritize verb without a positive weight), or a watch ends.
    pub async fn run(&self, client: Client) -> anyhow::Result<()> {
        let config = &self.inner.config;
        if !config.prioritize_verb.is_empty() && config.weight <= 0 {
            bail!("the extender has a prioritize verb, so it must have a positive weight, not {}", config.weight);
        }
        let extender = Arc::new(Extender::new(config)?);
        *self.inner.lock() = State::default();
        tracing::info!(scheduler = %config.scheduler_name, extender = %config.extender_url, "scheduler starting");
        tokio::select! {
            result = self.inner.watch_nodes(client.clone()) => result,
            result = self.inner.watch_pods(client.clone()) => result,
            result = schedule_loop(&self.inner, &client, &extender) => result,
        }
    }
}

fn node_name(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref()).filter(|n| !n.is_empty())
}

fn is_terminal(pod: &Pod) -> bool {
    matches!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"))
}

/// Whether an update is one kube-scheduler reacts to (`isPodUpdated` ignores status and
/// resourceVersion, so its own condition patch is not one).
fn spec_changed(old: &Pod, new: &Pod) -> bool {
    old.spec != new.spec
        || old.metadata.labels != new.metadata.labels
        || old.metadata.annotations != new.metadata.annotations
}

/// Whether a Node update can make a pod fit: allocatable, labels, annotations, taints,
/// `spec.unschedulable` or the conditions (heartbeats aside) changed (kube-scheduler's
/// `nodeSchedulingPropertiesChange`).
fn node_changed(old: &Node, new: &Node) -> bool {
    let conditions = |n: &Node| -> Vec<(String, String)> {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .map(|cs| cs.iter().map(|c| (c.type_.clone(), c.status.clone())).collect())
            .unwrap_or_default()
    };
    let allocatable = |n: &Node| n.status.as_ref().and_then(|s| s.allocatable.clone());
    let taints = |n: &Node| n.spec.as_ref().and_then(|s| s.taints.clone());
    let unschedulable = |n: &Node| n.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false);
    allocatable(old) != allocatable(new)
        || old.metadata.labels != new.metadata.labels
        || old.metadata.annotations != new.metadata.annotations
        || taints(old) != taints(new)
        || unschedulable(old) != unschedulable(new)
        || conditions(old) != conditions(new)
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether this scheduler should place `pod`: unbound, ours, not terminal, not being deleted.
    fn responsible(&self, pod: &Pod) -> bool {
        let name = pod
            .spec
            .as_ref()
            .and_then(|s| s.scheduler_name.as_deref())
            .filter(|n| !n.is_empty())
            .unwrap_or(DEFAULT_SCHEDULER_NAME);
        name == self.config.scheduler_name
            && node_name(pod).is_none()
            && !is_terminal(pod)
            && pod.metadata.deletion_timestamp.is_none()
    }

    async fn watch_nodes(&self, client: Client) -> anyhow::Result<()> {
        let events = watcher(Api::<Node>::all(client), watcher::Config::default()).default_backoff();
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(event) => self.node_event(event),
                Err(error) => tracing::warn!(%error, "the node watch failed; retrying with backoff"),
            }
        }
        bail!("the node watch ended")
    }

    async fn watch_pods(&self, client: Client) -> anyhow::Result<()> {
        // kube-scheduler's pod informer leaves out terminal pods: one that terminates is a delete.
        let config = watcher::Config::default().fields("status.phase!=Succeeded,status.phase!=Failed");
        let events = watcher(Api::<Pod>::all(client), config).default_backoff();
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(event) => self.pod_event(event),
                Err(error) => tracing::warn!(%error, "the pod watch failed; retrying with backoff"),
            }
        }
        bail!("the pod watch ended")
    }

    fn node_event(&self, event: watcher::Event<Node>) {
        let now = Instant::now();
        let mut st = self.lock();
        match event {
            watcher::Event::Init => st.node_relist = Some(HashSet::new()),
            watcher::Event::InitApply(node) => {
                if let Some(seen) = st.node_relist.as_mut() {
                    seen.insert(node.name_any());
                }
                self.node_applied(&mut st, node, now);
            }
            watcher::Event::InitDone => {
                let seen = st.node_relist.take().unwrap_or_default();
                st.nodes.retain(|name, _| seen.contains(name));
                st.nodes_synced = true;
                self.wake.notify_one();
            }
            watcher::Event::Apply(node) => self.node_applied(&mut st, node, now),
            watcher::Event::Delete(node) => {
                st.nodes.remove(&node.name_any());
            }
        }
    }

    /// A Node added, or changed in a way that can make a pod fit, retries the unschedulable pods.
    fn node_applied(&self, st: &mut State, node: Node, now: Instant) {
        let name = node.name_any();
        let node = Arc::new(node);
        let old = st.nodes.insert(name.clone(), Arc::clone(&node));
        if old.is_none_or(|old| node_changed(&old, &node)) {
            tracing::debug!(node = %name, "node added or changed: retrying unschedulable pods");
            st.queue.move_all(now, &self.config);
            self.wake.notify_one();
        }
    }

    fn pod_event(&self, event: watcher::Event<Pod>) {
        let now = Instant::now();
        let mut st = self.lock();
        match event {
            watcher::Event::Init => st.pod_relist = Some(HashSet::new()),
            watcher::Event::InitApply(pod) => {
                if let Some(seen) = st.pod_relist.as_mut() {
                    seen.insert(pod_key(&pod));
                }
                self.pod_applied(&mut st, pod, now);
            }
            watcher::Event::InitDone => {
                let seen = st.pod_relist.take().unwrap_or_default();
                let gone: Vec<PodKey> = st.pods.keys().filter(|k| !seen.contains(*k)).cloned().collect();
                for key in gone {
                    self.pod_deleted(&mut st, &key, now);
                }
                st.pods_synced = true;
                self.wake.notify_one();
            }
            watcher::Event::Apply(pod) => self.pod_applied(&mut st, pod, now),
            watcher::Event::Delete(pod) => self.pod_deleted(&mut st, &pod_key(&pod), now),
        }
    }

    fn pod_applied(&self, st: &mut State, pod: Pod, now: Instant) {
        let key = pod_key(&pod);
        if is_terminal(&pod) {
            self.pod_deleted(st, &key, now);
            return;
        }
        let pod = Arc::new(pod);
        let old = st.pods.insert(key.clone(), Arc::clone(&pod));
        if node_name(&pod).is_some() {
            // Bound (by us or anyone): counted on its node from now on, no longer assumed or queued.
            st.assumed.remove(&key);
            st.queue.remove(&key);
        } else if self.responsible(&pod) {
            let changed = old.is_some_and(|old| spec_changed(&old, &pod));
            st.queue.upsert(key, pod, changed, now, &self.config);
            self.wake.notify_one();
        } else {
            st.queue.remove(&key);
        }
    }

    /// A pod deleted or terminated; if it held room on a node, the unschedulable pods are retried.
    fn pod_deleted(&self, st: &mut State, key: &PodKey, now: Instant) {
        let old = st.pods.remove(key);
        st.queue.remove(key);
        let was_assumed = st.assumed.remove(key).is_some();
        if was_assumed || old.is_some_and(|p| node_name(&p).is_some()) {
            tracing::debug!(pod = %show(key), "pod on a node deleted: retrying unschedulable pods");
            st.queue.move_all(now, &self.config);
            self.wake.notify_one();
        }
    }

    /// The next pod to schedule, once both watches have listed (`WaitForCacheSync`). Cancel-safe.
    async fn pop(&self) -> Popped {
        loop {
            let deadline = {
                let mut st = self.lock();
                st.queue.flush(Instant::now(), &self.config);
                if st.nodes_synced
                    && st.pods_synced
                    && let Some(popped) = st.queue.pop()
                {
                    return popped;
                }
                st.queue.next_deadline(&self.config)
            };
            match deadline {
                Some(at) => {
                    tokio::select! {
                        () = self.wake.notified() => {}
                        () = tokio::time::sleep_until(tokio::time::Instant::from_std(at)) => {}
                    }
                }
                None => self.wake.notified().await,
            }
        }
    }

    /// The nodes with what the pods on them (bound or assumed) request, in name order.
    fn snapshot(&self) -> Vec<NodeInfo> {
        let st = self.lock();
        let mut infos: BTreeMap<&str, NodeInfo> = st
            .nodes
            .iter()
            .map(|(name, node)| {
                let info =
                    NodeInfo { name: name.clone(), node: Arc::clone(node), requested: Resources::new(), pods: 0 };
                (name.as_str(), info)
            })
            .collect();
        let bound = st.pods.values().filter_map(|p| node_name(p).map(|n| (n, p)));
        let assumed = st.assumed.values().map(|(n, p)| (n.as_str(), p));
        for (node, pod) in bound.chain(assumed) {
            if let Some(info) = infos.get_mut(node) {
                add(&mut info.requested, &pod_requests(pod));
                info.pods += 1;
            }
        }
        infos.into_values().collect()
    }
}

/// Resources in thousandths of their unit (millicores, millibytes, milli-devices).
type Resources = BTreeMap<String, u128>;

/// A node and what is requested on it.
#[derive(Debug)]
struct NodeInfo {
    name: String,
    node: Arc<Node>,
    requested: Resources,
    pods: u64,
}

/// A quantity in thousandths of its unit, rounded up; `None` if malformed or negative.
fn parse_milli(text: &str) -> Option<u128> {
    let s = text.trim();
    let s = s.strip_prefix('+').unwrap_or(s);
    let end = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, suffix) = s.split_at(end);
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return None;
    }
    let mut mantissa: u128 = 0;
    for b in int.bytes().chain(frac.bytes()) {
        mantissa = mantissa.checked_mul(10)?.checked_add(u128::from(b - b'0'))?;
    }
    let mut exp10 = 3 - i32::try_from(frac.len()).ok()?;
    let mut pow2 = 0;
    match suffix {
        "" => {}
        "n" => exp10 -= 9,
        "u" => exp10 -= 6,
        "m" => exp10 -= 3,
        "k" => exp10 += 3,
        "M" => exp10 += 6,
        "G" => exp10 += 9,
        "T" => exp10 += 12,
        "P" => exp10 += 15,
        "E" => exp10 += 18,
        "Ki" => pow2 = 10,
        "Mi" => pow2 = 20,
        "Gi" => pow2 = 30,
        "Ti" => pow2 = 40,
        "Pi" => pow2 = 50,
        "Ei" => pow2 = 60,
        other => exp10 += other.strip_prefix(['e', 'E'])?.parse::<i32>().ok()?,
    }
    let value = mantissa.checked_mul(1u128.checked_shl(pow2)?)?;
    if exp10 >= 0 {
        value.checked_mul(10u128.checked_pow(u32::try_from(exp10).ok()?)?)
    } else {
        Some(value.div_ceil(10u128.checked_pow(exp10.unsigned_abs())?))
    }
}

fn quantity(q: &Quantity) -> u128 {
    parse_milli(&q.0).unwrap_or(0)
}

fn add(total: &mut Resources, more: &Resources) {
    for (name, value) in more {
        let slot = total.entry(name.clone()).or_insert(0);
        *slot = slot.saturating_add(*value);
    }
}

fn max_into(total: &mut Resources, other: &Resources) {
    for (name, value) in other {
        let slot = total.entry(name.clone()).or_insert(0);
        *slot = (*slot).max(*value);
    }
}

/// A container's requests; a resource with only a limit requests its limit (the API server's
/// defaulting).
fn container_requests(container: &Container) -> Resources {
    let mut out = Resources::new();
    if let Some(resources) = &container.resources {
        for map in [&resources.limits, &resources.requests].into_iter().flatten() {
            for (name, q) in map {
                out.insert(name.clone(), quantity(q));
            }
        }
    }
    out
}

/// What a pod requests (`resourcehelper.PodRequests`): the app containers and the restartable
/// (sidecar) init containers add up; each other init container runs alone beside the sidecars
/// started before it, so the pod needs the larger of the two; plus `spec.overhead`.
fn pod_requests(pod: &Pod) -> Resources {
    let mut total = Resources::new();
    let Some(spec) = &pod.spec else { return total };
    for container in &spec.containers {
        add(&mut total, &container_requests(container));
    }
    let mut sidecars = Resources::new();
    let mut init_max = Resources::new();
    for container in spec.init_containers.iter().flatten() {
        let request = container_requests(container);
        let alone = if container.restart_policy.as_deref() == Some("Always") {
            add(&mut total, &request);
            add(&mut sidecars, &request);
            sidecars.clone()
        } else {
            let mut alone = request;
            add(&mut alone, &sidecars);
            alone
        };
        max_into(&mut init_max, &alone);
    }
    max_into(&mut total, &init_max);
    if let Some(overhead) = &spec.overhead {
        add(&mut total, &overhead.iter().map(|(k, q)| (k.clone(), quantity(q))).collect());
    }
    total
}

/// `Toleration.ToleratesTaint`.
fn tolerates(pod: &Pod, taint: &Taint) -> bool {
    let tolerations = pod.spec.as_ref().and_then(|s| s.tolerations.as_ref());
    tolerations.into_iter().flatten().any(|t| {
        let effect = t.effect.as_deref().unwrap_or("");
        let key = t.key.as_deref().unwrap_or("");
        if (!effect.is_empty() && effect != taint.effect) || (!key.is_empty() && key != taint.key) {
            return false;
        }
        match t.operator.as_deref().unwrap_or("") {
            "" | "Equal" => t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""),
            "Exists" => true,
            _ => false,
        }
    })
}

fn taint(key: &str, effect: &str) -> Taint {
    Taint { key: key.to_owned(), effect: effect.to_owned(), ..Taint::default() }
}

/// The node's taints that keep pods off (`NoSchedule`, `NoExecute`), plus the one the node
/// lifecycle controller puts on a node whose `Ready` condition is `False`
/// (`node.kubernetes.io/not-ready`) or `Unknown` (`node.kubernetes.io/unreachable`).
fn blocking_taints(node: &Node) -> Vec<Taint> {
    let mut taints: Vec<Taint> = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .collect();
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready").map(|c| c.status.as_str()));
    let implied = match ready {
        Some("False") => Some("node.kubernetes.io/not-ready"),
        Some("True") | None => None,
        Some(_) => Some("node.kubernetes.io/unreachable"),
    };
    if let Some(key) = implied
        && !taints.iter().any(|t| t.key == key)
    {
        taints.push(taint(key, "NoSchedule"));
    }
    taints
}

/// The node-level filters, in kube-scheduler's order; the reasons of the first that rejects the
/// node (`RunFilterPlugins` stops there).
fn node_fit(config: &SchedulerConfig, pod: &Pod, request: &Resources, info: &NodeInfo) -> Result<(), Vec<String>> {
    let node = &info.node;
    // NodeUnschedulable.
    let unschedulable = node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false);
    if unschedulable && !tolerates(pod, &taint("node.kubernetes.io/unschedulable", "NoSchedule")) {
        return Err(vec!["node(s) were unschedulable".to_owned()]);
    }
    // TaintToleration.
    if let Some(t) = blocking_taints(node).iter().find(|t| !tolerates(pod, t)) {
        let value = t.value.as_deref().unwrap_or("");
        return Err(vec![format!("node(s) had untolerated taint {{{}: {value}}}", t.key)]);
    }
    // NodeAffinity, the nodeSelector part.
    if let Some(selector) = pod.spec.as_ref().and_then(|s| s.node_selector.as_ref()) {
        let labels = node.metadata.labels.as_ref();
        if !selector.iter().all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v)) {
            return Err(vec!["node(s) didn't match Pod's node affinity/selector".to_owned()]);
        }
    }
    // NodeResourcesFit (`fitsRequest`).
    let allocatable: Resources = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .map(|a| a.iter().map(|(k, q)| (k.clone(), quantity(q))).collect())
        .unwrap_or_default();
    let mut reasons = Vec::new();
    if let Some(pods) = allocatable.get("pods")
        && u128::from(info.pods) + 1 > pods / 1000
    {
        reasons.push("Too many pods".to_owned());
    }
    for (name, &wanted) in request {
        if wanted == 0 || name == "pods" || config.ignores(name) {
            continue;
        }
        let advertised = allocatable.get(name).copied();
        if advertised.is_none() && matches!(name.as_str(), "cpu" | "memory" | "ephemeral-storage") {
            continue;
        }
        let used = info.requested.get(name).copied().unwrap_or(0);
        if wanted > advertised.unwrap_or(0).saturating_sub(used) {
            reasons.push(format!("Insufficient {name}"));
        }
    }
    if reasons.is_empty() { Ok(()) } else { Err(reasons) }
}

/// `FitError.Error()`: `0/N nodes are available: ` and the reasons with how many nodes gave each,
/// sorted as strings (`sortReasonsHistogram`), then a full stop.
fn fit_error_message(all_nodes: usize, reasons: &BTreeMap<String, Vec<String>>) -> String {
    let mut histogram: BTreeMap<&str, usize> = BTreeMap::new();
    for reason in reasons.values().flatten() {
        *histogram.entry(reason.as_str()).or_insert(0) += 1;
    }
    let mut parts: Vec<String> = histogram.into_iter().map(|(reason, n)| format!("{n} {reason}")).collect();
    parts.sort();
    format!("0/{all_nodes} nodes are available: {}.", parts.join(", "))
}

/// The highest score; ties broken by reservoir sampling, as kube-scheduler's `selectHost` does.
fn select_host(feasible: &[String], scores: &HashMap<String, i64>, rng: &mut XorShift) -> Option<String> {
    let mut best: Option<(&String, i64)> = None;
    let mut ties = 0u64;
    for name in feasible {
        let score = scores.get(name).copied().unwrap_or(0);
        match best {
            Some((_, top)) if score < top => {}
            Some((_, top)) if score == top => {
                ties += 1;
                if rng.below(ties) == 0 {
                    best = Some((name, score));
                }
            }
            _ => {
                best = Some((name, score));
                ties = 1;
            }
        }
    }
    best.map(|(name, _)| name.clone())
}

/// Why a cycle placed no pod.
#[derive(Debug)]
enum Failure {
    /// No node fits: the pod waits for a cluster event. The `FitError` message.
    Unschedulable(String),
    /// Something failed: the pod backs off.
    Error(anyhow::Error),
}

/// `ExtenderArgs` with `nodeCacheCapable: true`.
#[derive(Debug, Serialize)]
struct ExtenderArgs<'a> {
    #[serde(rename = "Pod")]
    pod: &'a Pod,
    #[serde(rename = "Nodes")]
    nodes: Option<Value>,
    #[serde(rename = "NodeNames")]
    node_names: &'a [String],
}

/// `ExtenderBindingArgs`.
#[derive(Debug, Serialize)]
struct ExtenderBindingArgs<'a> {
    #[serde(rename = "PodName")]
    pod_name: &'a str,
    #[serde(rename = "PodNamespace")]
    pod_namespace: &'a str,
    #[serde(rename = "PodUID")]
    pod_uid: &'a str,
    #[serde(rename = "Node")]
    node: &'a str,
}

/// What the extender's filter left.
#[derive(Debug, Default, PartialEq, Eq)]
struct FilterResult {
    node_names: Vec<String>,
    failed: BTreeMap<String, String>,
    failed_and_unresolvable: BTreeMap<String, String>,
}

/// A field as Go's `encoding/json` finds it: the exact key, else one equal but for case.
fn field<'a>(object: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    object.get(name).or_else(|| object.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v))
}

/// A JSON object, or `null` taken as an empty one (Go leaves the struct as it was).
fn object<'a>(value: &'a Value, what: &str) -> anyhow::Result<Option<&'a Map<String, Value>>> {
    match value {
        Value::Object(o) => Ok(Some(o)),
        Value::Null => Ok(None),
        other => bail!("{what} is not a JSON object: {other}"),
    }
}

fn string_field(object: Option<&Map<String, Value>>, name: &str) -> anyhow::Result<String> {
    match object.and_then(|o| field(o, name)) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => bail!("{name} is not a string: {other}"),
    }
}

fn string_map(object: Option<&Map<String, Value>>, name: &str) -> anyhow::Result<BTreeMap<String, String>> {
    match object.and_then(|o| field(o, name)) {
        None | Some(Value::Null) => Ok(BTreeMap::new()),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                other => Err(anyhow!("{name}[{k}] is not a string: {other}")),
            })
            .collect(),
        Some(other) => bail!("{name} is not a map of strings: {other}"),
    }
}

/// Reads an `ExtenderFilterResult` (`HTTPExtender.Filter` with `nodeCacheCapable`): a non-empty
/// `Error` fails; `NodeNames` if not null (each must have been sent), else the names of
/// `Nodes.items`, else no node passes.
fn parse_filter_result(body: &[u8], sent: &[String]) -> anyhow::Result<FilterResult> {
    let value: Value = serde_json::from_slice(body).context("the answer is not JSON")?;
    let result = object(&value, "the answer")?;
    let error = string_field(result, "Error")?;
    if !error.is_empty() {
        bail!("{error}");
    }
    let node_names = match result.and_then(|o| field(o, "NodeNames")) {
        Some(Value::Array(names)) => {
            let mut out = Vec::with_capacity(names.len());
            for name in names {
                let Some(name) = name.as_str() else { bail!("NodeNames holds a non-string: {name}") };
                if !sent.iter().any(|s| s == name) {
                    bail!("the extender claims a filtered node {name:?} which is not found in the input node list");
                }
                out.push(name.to_owned());
            }
            out
        }
        None | Some(Value::Null) => match result.and_then(|o| field(o, "Nodes")) {
            None | Some(Value::Null) => Vec::new(),
            Some(nodes) => {
                let items = object(nodes, "Nodes")?.and_then(|o| field(o, "items"));
                let items = match items {
                    None | Some(Value::Null) => &[][..],
                    Some(Value::Array(items)) => items.as_slice(),
                    Some(other) => bail!("Nodes.items is not a list: {other}"),
                };
                items
                    .iter()
                    .map(|n| {
                        n.pointer("/metadata/name")
                            .and_then(Value::as_str)
                            .map(str::to_owned)
                            .ok_or_else(|| anyhow!("a node in Nodes.items has no name"))
                    })
                    .collect::<anyhow::Result<_>>()?
            }
        },
        Some(other) => bail!("NodeNames is not a list: {other}"),
    };
    Ok(FilterResult {
        node_names,
        failed: string_map(result, "FailedNodes")?,
        failed_and_unresolvable: string_map(result, "FailedAndUnresolvableNodes")?,
    })
}

/// Reads a `HostPriorityList`: the scores per host, summed if a host comes twice.
fn parse_host_priorities(body: &[u8]) -> anyhow::Result<HashMap<String, i64>> {
    let value: Value = serde_json::from_slice(body).context("the answer is not JSON")?;
    let list = match &value {
        Value::Null => &[][..],
        Value::Array(list) => list.as_slice(),
        other => bail!("the answer is not a list: {other}"),
    };
    let mut scores = HashMap::new();
    for item in list {
        let item = object(item, "a HostPriority")?;
        let host = string_field(item, "Host")?;
        let score = match item.and_then(|o| field(o, "Score")) {
            None | Some(Value::Null) => 0,
            Some(Value::Number(n)) => n.as_i64().ok_or_else(|| anyhow!("Score {n} of {host} is not an int64"))?,
            Some(other) => bail!("Score of {host} is not a number: {other}"),
        };
        let slot = scores.entry(host).or_insert(0i64);
        *slot = slot.saturating_add(score);
    }
    Ok(scores)
}

/// Reads an `ExtenderBindingResult`: a non-empty `Error` fails.
fn parse_binding_result(body: &[u8]) -> anyhow::Result<()> {
    let value: Value = serde_json::from_slice(body).context("the answer is not JSON")?;
    let error = string_field(object(&value, "the answer")?, "Error")?;
    if error.is_empty() { Ok(()) } else { Err(anyhow!("{error}")) }
}

/// Aborts the task when dropped.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The HTTP side of `HTTPExtender`.
#[derive(Debug)]
struct Extender {
    /// `urlPrefix` without its trailing slashes.
    url: String,
    /// `host:port` for the Host header.
    authority: String,
    host: String,
    port: u16,
    /// The path part of `urlPrefix`, without its trailing slashes.
    path: String,
    timeout: Duration,
    /// Connections kept alive between calls, as Go's `http.Client` keeps them.
    idle: std::sync::Mutex<Vec<Conn>>,
}

/// A kept-alive HTTP/1.1 connection to the extender.
#[derive(Debug)]
struct Conn {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    _task: AbortOnDrop,
}

impl Extender {
    /// An idle connection that is still open, else a new one.
    async fn connection(&self) -> anyhow::Result<Conn> {
        loop {
            let idle = self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
            let Some(mut conn) = idle else { break };
            if !conn.sender.is_closed() && conn.sender.ready().await.is_ok() {
                return Ok(conn);
            }
        }
        let stream = tokio::net::TcpStream::connect((self.host.as_str(), self.port)).await?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        let task = AbortOnDrop(tokio::spawn(async move {
            let _ = connection.await;
        }));
        Ok(Conn { sender, _task: task })
    }

    fn new(config: &SchedulerConfig) -> anyhow::Result<Extender> {
        let url = config.extender_url.trim_end_matches('/').to_owned();
        let uri: http::Uri = url.parse().with_context(|| format!("the extender URL {url:?} is malformed"))?;
        if uri.scheme_str() != Some("http") {
            bail!("the extender URL {url:?} must be http:// (HTTPS is not supported by the stand-in)");
        }
        let Some(authority) = uri.authority() else { bail!("the extender URL {url:?} has no host") };
        let host = authority.host().trim_start_matches('[').trim_end_matches(']').to_owned();
        let port = authority.port_u16().unwrap_or(80);
        let path = uri.path().trim_end_matches('/').to_owned();
        Ok(Extender {
            authority: authority.to_string(),
            host,
            port,
            path,
            url,
            timeout: config.http_timeout,
            idle: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// `HTTPExtender.send`: POSTs `args` as JSON to `urlPrefix/verb`; anything but `200` fails.
    async fn send(&self, verb: &str, args: &impl Serialize) -> anyhow::Result<Bytes> {
        let url = format!("{}/{verb}", self.url);
        let body = serde_json::to_vec(args).context("encoding the extender arguments")?;
        let exchange = async {
            let mut conn = self.connection().await?;
            let request = http::Request::post(format!("{}/{verb}", self.path))
                .header(http::header::HOST, &self.authority)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(body)))?;
            let response = conn.sender.send_request(request).await?;
            let status = response.status();
            let body = response.into_body().collect().await?.to_bytes();
            self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(conn);
            anyhow::Ok((status, body))
        };
        let (status, body) = match tokio::time::timeout(self.timeout, exchange).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => bail!("Post \"{url}\": {e:#}"),
            Err(_) => {
                bail!("Post \"{url}\": context deadline exceeded (Client.Timeout exceeded while awaiting headers)")
            }
        };
        if status != http::StatusCode::OK {
            bail!("failed {verb} with extender at URL {url}, code {}", status.as_u16());
        }
        Ok(body)
    }

    /// One counted call whose answer `parse` reads.
    async fn call<T>(
        &self,
        counters: &Counters,
        verb: Verb,
        name: &str,
        args: &impl Serialize,
        parse: impl FnOnce(&[u8]) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        bump(&counters.calls[verb as usize]);
        let result = match self.send(name, args).await {
            Ok(body) => parse(&body).with_context(|| format!("the {name} answer of extender {}", self.url)),
            Err(e) => Err(e),
        };
        if result.is_err() {
            bump(&counters.failures[verb as usize]);
        }
        result
    }
}

/// One scheduling cycle at a time; the bindings run as tasks of their own.
async fn schedule_loop(inner: &Arc<Inner>, client: &Client, extender: &Arc<Extender>) -> anyhow::Result<()> {
    let mut tasks = JoinSet::new();
    let mut rng = XorShift::from_clock();
    loop {
        tokio::select! {
            Some(done) = tasks.join_next() => {
                if let Err(e) = done
                    && e.is_panic()
                {
                    tracing::error!(error = %e, "a binding task panicked");
                }
            }
            popped = inner.pop() => schedule_one(inner, client, extender, &mut tasks, &mut rng, popped).await,
        }
    }
}

/// `ScheduleOne`: find a node, assume the pod there and start binding it; or record why not.
async fn schedule_one(
    inner: &Arc<Inner>,
    client: &Client,
    extender: &Arc<Extender>,
    tasks: &mut JoinSet<()>,
    rng: &mut XorShift,
    popped: Popped,
) {
    let Popped { key, pod, attempts } = popped;
    bump(&inner.counters.attempts);
    let nodes = inner.snapshot();
    let outcome = find_host(inner, extender, &pod, &nodes, rng).await;
    let now = Instant::now();
    let (reason, message) = match outcome {
        Ok(node) => {
            {
                let mut st = inner.lock();
                if !st.queue.assume(&key) {
                    tracing::debug!(pod = %show(&key), "the pod went away during its cycle");
                    return;
                }
                st.assumed.insert(key.clone(), (node.clone(), Arc::clone(&pod)));
            }
            tracing::info!(pod = %show(&key), node = %node, attempts, "pod assumed; binding");
            tasks.spawn(bind_cycle(Arc::clone(inner), client.clone(), Arc::clone(extender), key, pod, node));
            return;
        }
        Err(Failure::Unschedulable(message)) => {
            bump(&inner.counters.unschedulable);
            tracing::info!(pod = %show(&key), reason = %message, attempts, "pod unschedulable");
            ("Unschedulable", message)
        }
        Err(Failure::Error(error)) => {
            bump(&inner.counters.errors);
            let message = format!("{error:#}");
            tracing::warn!(pod = %show(&key), reason = %message, attempts, "scheduling the pod failed; backing off");
            ("SchedulerError", message)
        }
    };
    let latest = inner.lock().queue.failed(&key, reason == "Unschedulable", now, &inner.config);
    if let Some(latest) = latest {
        tasks.spawn(patch_condition(Arc::clone(inner), client.clone(), latest, reason, message));
    }
}

/// `schedulePod`: the node-level filters, the extender's filter, its prioritize, the best node.
async fn find_host(
    inner: &Inner,
    extender: &Extender,
    pod: &Pod,
    nodes: &[NodeInfo],
    rng: &mut XorShift,
) -> Result<String, Failure> {
    let config = &inner.config;
    if nodes.is_empty() {
        return Err(Failure::Unschedulable("no nodes available to schedule pods".to_owned()));
    }
    let request = pod_requests(pod);
    let mut reasons: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut feasible = Vec::new();
    for info in nodes {
        match node_fit(config, pod, &request, info) {
            Ok(()) => feasible.push(info.name.clone()),
            Err(why) => {
                reasons.insert(info.name.clone(), why);
            }
        }
    }
    let interested = config.is_interested(pod);
    // `findNodesThatPassExtenders`: only with nodes left and a pod the extender manages.
    if interested && !feasible.is_empty() && !config.filter_verb.is_empty() {
        let args = ExtenderArgs { pod, nodes: None, node_names: &feasible };
        let result = extender
            .call(&inner.counters, Verb::Filter, &config.filter_verb, &args, |body| {
                parse_filter_result(body, &feasible)
            })
            .await
            .map_err(Failure::Error)?;
        for (node, why) in &result.failed_and_unresolvable {
            reasons.entry(node.clone()).or_default().push(why.clone());
        }
        for (node, why) in &result.failed {
            if !result.failed_and_unresolvable.contains_key(node) {
                reasons.entry(node.clone()).or_default().push(why.clone());
            }
        }
        feasible = result.node_names;
    }
    if feasible.is_empty() {
        return Err(Failure::Unschedulable(fit_error_message(nodes.len(), &reasons)));
    }
    // One node left: no scoring.
    if let [only] = feasible.as_slice() {
        return Ok(only.clone());
    }
    let mut scores = HashMap::new();
    if interested && !config.prioritize_verb.is_empty() {
        let args = ExtenderArgs { pod, nodes: None, node_names: &feasible };
        let call =
            extender.call(&inner.counters, Verb::Prioritize, &config.prioritize_verb, &args, parse_host_priorities);
        match call.await {
            Ok(priorities) => {
                let factor = MAX_NODE_SCORE / MAX_EXTENDER_PRIORITY;
                for (host, score) in priorities {
                    scores.insert(host, score.saturating_mul(config.weight).saturating_mul(factor));
                }
            }
            // kube-scheduler ignores a failed prioritize: the other scores decide.
            Err(error) => tracing::warn!(error = %format!("{error:#}"), "the extender's prioritize failed; ignored"),
        }
    }
    select_host(&feasible, &scores, rng).ok_or_else(|| Failure::Error(anyhow!("no node to select")))
}

/// The binding cycle: the extender binds the pods it manages, the scheduler the others
/// (`DefaultBinder`). A failure forgets the assumption and backs the pod off.
async fn bind_cycle(
    inner: Arc<Inner>,
    client: Client,
    extender: Arc<Extender>,
    key: PodKey,
    pod: Arc<Pod>,
    node: String,
) {
    let config = &inner.config;
    let started = Instant::now();
    let result = if !config.bind_verb.is_empty() && config.is_interested(&pod) {
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        let args = ExtenderBindingArgs { pod_name: &key.1, pod_namespace: &key.0, pod_uid: uid, node: &node };
        extender.call(&inner.counters, Verb::Bind, &config.bind_verb, &args, parse_binding_result).await
    } else {
        bump(&inner.counters.direct_binds);
        bind_directly(&client, &pod, &node).await
    };
    match result {
        Ok(()) => {
            let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
            bump(&inner.counters.scheduled);
            inner.counters.last_bind_micros.store(micros, Ordering::Relaxed);
            inner.counters.max_bind_micros.fetch_max(micros, Ordering::Relaxed);
            tracing::info!(pod = %show(&key), node = %node, micros, "pod bound");
        }
        Err(error) => {
            bump(&inner.counters.errors);
            let message = format!("{error:#}");
            tracing::warn!(pod = %show(&key), node = %node, reason = %message, "binding failed; backing off");
            let now = Instant::now();
            let latest = {
                let mut st = inner.lock();
                st.assumed.remove(&key);
                // The room the pod held is free again (`handleBindingCycleError`).
                st.queue.move_all(now, config);
                st.queue.failed(&key, false, now, config)
            };
            inner.wake.notify_one();
            if let Some(latest) = latest {
                patch_condition(Arc::clone(&inner), client, latest, "SchedulerError", message).await;
            }
        }
    }
}

/// Creates the pod's Binding as `DefaultBinder` does.
async fn bind_directly(client: &Client, pod: &Pod, node: &str) -> anyhow::Result<()> {
    let name = pod.name_any();
    let namespace = pod.namespace().unwrap_or_default();
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(namespace.clone()),
            uid: pod.metadata.uid.clone(),
            ..ObjectMeta::default()
        },
        target: ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Node".to_owned()),
            name: Some(node.to_owned()),
            ..ObjectReference::default()
        },
    };
    let api: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let _: Value = api
        .create_subresource("binding", &name, &PostParams::default(), &binding)
        .await
        .with_context(|| format!("binding {namespace}/{name} to {node}"))?;
    Ok(())
}

/// Writes `PodScheduled=False` with `reason` and `message`, unless the pod already says so
/// (`updatePod` with `UpdatePodCondition`: the transition time stays while the status does).
async fn patch_condition(inner: Arc<Inner>, client: Client, pod: Arc<Pod>, reason: &'static str, message: String) {
    let existing = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "PodScheduled"));
    let transition = match existing {
        Some(c)
            if c.status == "False"
                && c.reason.as_deref() == Some(reason)
                && c.message.as_deref() == Some(message.as_str()) =>
        {
            return;
        }
        Some(c) if c.status == "False" => c.last_transition_time.clone(),
        _ => None,
    };
    let transition = transition.unwrap_or_else(|| Time(Timestamp::now()));
    let condition = json!({
        "type": "PodScheduled", "status": "False", "reason": reason, "message": message,
        "lastProbeTime": null, "lastTransitionTime": transition,
    });
    let (namespace, name) = pod_key(&pod);
    let api: Api<Pod> = Api::namespaced(client, &namespace);
    let patch = Patch::Strategic(json!({"status": {"conditions": [condition]}}));
    match api.patch_status(&name, &PatchParams::default(), &patch).await {
        Ok(_) => bump(&inner.counters.status_patches),
        Err(error) => {
            tracing::warn!(pod = %format!("{namespace}/{name}"), %error, "writing the PodScheduled condition failed");
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn pod(spec: &Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "ns"}, "spec": spec})).unwrap()
    }

    #[test]
    fn quantities() {
        for (text, milli) in [
            ("1", 1000),
            ("500m", 500),
            ("0.5", 500),
            ("1.5Gi", 1000 * (1536 << 20)),
            ("2k", 2_000_000),
            ("1e3", 1_000_000),
            ("1n", 1),
            ("4Gi", 4000 << 30),
        ] {
            assert_eq!(parse_milli(text), Some(milli), "{text}");
        }
        for bad in ["", "-1", "abc", "1.2.3", "1Qi", "."] {
            assert_eq!(parse_milli(bad), None, "{bad}");
        }
    }

    #[test]
    fn pod_requests_follow_init_containers_and_limits() {
        let p = pod(&json!({
            "containers": [
                {"name": "a", "resources": {"limits": {"gpushare.io/gpu-mem": "4"}, "requests": {"cpu": "100m"}}},
                {"name": "b", "resources": {"requests": {"cpu": "200m"}}},
            ],
            "initContainers": [
                {"name": "i", "resources": {"requests": {"cpu": "1", "gpushare.io/gpu-mem": "2"}}},
                {"name": "s", "restartPolicy": "Always", "resources": {"requests": {"cpu": "50m"}}},
            ],
            "overhead": {"cpu": "10m"},
        }));
        let r = pod_requests(&p);
        // max(100m + 200m + 50m sidecar, 1 alone) + 10m overhead.
        assert_eq!(r.get("cpu"), Some(&1010));
        assert_eq!(r.get("gpushare.io/gpu-mem"), Some(&4000));
        let config = SchedulerConfig::gpushare("http://127.0.0.1:1/x");
        assert!(config.is_interested(&p));
        assert!(!config.is_interested(&pod(&json!({"containers": [{"name": "c"}]}))));
    }

    #[test]
    fn fit_error_messages_count_and_sort_reasons() {
        let reasons = BTreeMap::from([
            ("a".to_owned(), vec!["Insufficient gpushare.io/gpu-mem".to_owned()]),
            ("b".to_owned(), vec!["not enough GPU memory".to_owned()]),
            ("c".to_owned(), vec!["not enough GPU memory".to_owned()]),
            ("d".to_owned(), vec!["Insufficient cpu".to_owned(), "Insufficient gpushare.io/gpu-mem".to_owned()]),
        ]);
        assert_eq!(
            fit_error_message(5, &reasons),
            "0/5 nodes are available: 1 Insufficient cpu, 2 Insufficient gpushare.io/gpu-mem, 2 not enough GPU memory."
        );
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let config = SchedulerConfig::gpushare("http://127.0.0.1:1/x");
        let secs: Vec<u64> = (1..=6).map(|a| config.backoff(a).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 10, 10]);
    }

    #[test]
    fn the_queue_orders_by_priority_then_age_then_name() {
        let config = SchedulerConfig::gpushare("http://127.0.0.1:1/x");
        let mut queue = Queue::default();
        let now = Instant::now();
        for (name, priority, created) in
            [("b", 0, "2024-01-01T00:00:00Z"), ("a", 0, "2024-01-01T00:00:00Z"), ("c", 5, "2024-01-02T00:00:00Z")]
        {
            let p: Pod = serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created},
                "spec": {"containers": [], "priority": priority},
            }))
            .unwrap();
            queue.upsert(pod_key(&p), Arc::new(p), false, now, &config);
        }
        let order: Vec<String> = std::iter::from_fn(|| queue.pop()).map(|p| p.key.1).collect();
        assert_eq!(order, ["c", "a", "b"]);
    }

    #[test]
    fn filter_results_are_read_as_kube_scheduler_reads_them() {
        let sent = ["a".to_owned(), "b".to_owned()];
        let r = parse_filter_result(br#"{"NodeNames":["a"],"FailedNodes":{"b":"full"},"Error":""}"#, &sent).unwrap();
        assert_eq!(r.node_names, ["a"]);
        assert_eq!(r.failed.get("b").map(String::as_str), Some("full"));
        // Keys match case-insensitively, as with Go's decoder; both lists null: no node passes.
        let r = parse_filter_result(br#"{"nodenames":["b"]}"#, &sent).unwrap();
        assert_eq!(r.node_names, ["b"]);
        assert!(parse_filter_result(br#"{"NodeNames":null,"Nodes":null}"#, &sent).unwrap().node_names.is_empty());
        let r = parse_filter_result(br#"{"Nodes":{"items":[{"metadata":{"name":"a"}}]}}"#, &sent).unwrap();
        assert_eq!(r.node_names, ["a"]);
        let err = parse_filter_result(br#"{"Error":"boom"}"#, &sent).unwrap_err();
        assert_eq!(err.to_string(), "boom");
        assert!(parse_filter_result(br#"{"NodeNames":["z"]}"#, &sent).is_err());
        assert!(parse_filter_result(b"not json", &sent).is_err());
        assert!(parse_filter_result(br#"{"NodeNames":"a"}"#, &sent).is_err());
        assert_eq!(
            parse_host_priorities(br#"[{"Host":"a","Score":3},{"Host":"a","Score":2}]"#).unwrap().get("a"),
            Some(&5)
        );
        assert!(parse_host_priorities(br#"[{"Host":"a","Score":"x"}]"#).is_err());
        assert!(parse_binding_result(br#"{"Error":""}"#).is_ok());
        assert!(parse_binding_result(br#"{"Error":"no"}"#).is_err());
    }

    #[test]
    fn ties_are_broken_among_the_best_only() {
        let feasible: Vec<String> = ["a", "b", "c"].map(str::to_owned).to_vec();
        let scores = HashMap::from([("a".to_owned(), 10), ("b".to_owned(), 30), ("c".to_owned(), 30)]);
        let mut rng = XorShift::from_clock();
        let mut seen = BTreeSet::new();
        for _ in 0..200 {
            seen.insert(select_host(&feasible, &scores, &mut rng).unwrap());
        }
        assert_eq!(seen, BTreeSet::from(["b".to_owned(), "c".to_owned()]));
    }

    #[test]
    fn taints_and_readiness() {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "n"},
            "status": {"conditions": [{"type": "Ready", "status": "False"}]},
        }))
        .unwrap();
        let info = NodeInfo { name: "n".into(), node: Arc::new(node), requested: Resources::new(), pods: 0 };
        let config = SchedulerConfig::gpushare("http://127.0.0.1:1/x");
        let plain = pod(&json!({"containers": []}));
        assert_eq!(
            node_fit(&config, &plain, &Resources::new(), &info),
            Err(vec!["node(s) had untolerated taint {node.kubernetes.io/not-ready: }".to_owned()])
        );
        let tolerant = pod(&json!({"containers": [], "tolerations": [{"operator": "Exists"}]}));
        assert_eq!(node_fit(&config, &tolerant, &Resources::new(), &info), Ok(()));
    }
}
