//! The extender's decisions: filter, prioritize, bind and preempt over the cluster view. The
//! HTTP layer only translates JSON to these calls; the API server is reached through the
//! [`Cluster`] seam (the real one is in [`crate::kube`]).
//!
//! Binds are serialized per node: under the node's lock the fit is checked again against the
//! current view, GPUs are chosen, the in-flight assumption is recorded, and **one** Binding
//! carries the assignment annotations (the API server copies a Binding's annotations onto the
//! pod in the same update that sets `spec.nodeName`). A failed call rolls the assumption back;
//! a retried bind of a pod already bound to the node with its assignment succeeds again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use parking_lot::MutexGuard;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gpushare_core::PodRequest;
use gpushare_core::codec::alibaba::AlibabaAnnotations;
use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_core::placement::{GpuPolicy, Placer};
use gpushare_core::schedule::Policies;
use thiserror::Error;

use crate::inspect::ClusterReport;
use crate::metrics::{BindOutcome, Metrics};
use crate::objects::PodObject;
use crate::view::summary::Shape;
use crate::view::{Assumed, ClusterView, Evicted, Holding, Placed};
use crate::wire::{
    BindingArgs, BindingResult, ExtenderArgs, FilterResult, HostPriority, MetaPod, MetaVictims, Name, NodeList,
    PreemptionArgs, PreemptionResult,
};

/// What the API server said to a call.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum ClusterError {
    /// HTTP 409: the pod is already bound, or changed meanwhile.
    #[error("conflict: {0}")]
    Conflict(String),
    /// HTTP 404.
    #[error("not found: {0}")]
    NotFound(String),
    /// Anything else: unreachable, refused, timed out.
    #[error("{0}")]
    Failed(String),
}

/// A Binding to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Pod UID (a precondition: a re-created pod of the same name is not bound by mistake).
    pub uid: String,
    /// Target node.
    pub node: String,
    /// Annotations the API server copies onto the pod.
    pub annotations: BTreeMap<String, String>,
}

/// The API-server calls the verbs make.
pub trait Cluster: Send + Sync + 'static {
    /// Reads one pod.
    fn get_pod(&self, namespace: &str, name: &str) -> impl Future<Output = Result<PodObject, ClusterError>> + Send;
    /// Creates a `pods/binding`.
    fn bind(&self, binding: &Binding) -> impl Future<Output = Result<(), ClusterError>> + Send;
}

/// Nodes a filter looks at between two glances at the clock.
const FILTER_CHUNK: usize = 256;

/// How long a filter holds the view's lock before it hands it to a request waiting for it:
/// long enough that an ordinary filter (5,000 names: under a millisecond) runs in one hold,
/// short enough that a huge one does not hold up the others.
const FILTER_SLICE: Duration = Duration::from_millis(1);

/// One node's candidate victims: (node, victims as (UID, priority when known), PDB violations).
type Candidates = (String, Vec<(String, Option<i32>)>, i64);

struct State {
    view: ClusterView,
    placer: Placer,
}

/// What a bind can do under its node's lock.
#[derive(Debug)]
enum Attempt {
    /// An earlier try of this very bind went through.
    AlreadyBound,
    /// Create this Binding (the assumption is recorded).
    Bind(Binding),
    /// Every placement on the node would sit on other GPUs than this look-alike's, which the
    /// node is still admitting.
    LookalikeInAdmission(String),
}

/// The extender.
pub struct Extender<C> {
    /// The view and the placer: a fair lock, so a long request that hands it over between
    /// chunks of work does hand it over.
    state: parking_lot::Mutex<State>,
    cluster: C,
    policies: Policies,
    /// Percent of a node's score taken from how idle its chosen GPUs are (0: not weighed).
    busy_weight: u8,
    metrics: Metrics,
    ready: AtomicBool,
    node_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Woken whenever the watchers change the view.
    changed: tokio::sync::Notify,
    /// How long a bind waits for a look-alike's admission to be reported before it refuses.
    lookalike_wait: Duration,
    /// The schedulers whose pods it binds ([`Self::with_scheduler_names`]).
    scheduler_names: Vec<String>,
}

impl<C> std::fmt::Debug for Extender<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extender").field("policies", &self.policies).finish_non_exhaustive()
    }
}

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl<C: Cluster> Extender<C> {
    /// An extender over `view`, calling the API server through `cluster`.
    pub fn new(view: ClusterView, cluster: C, policies: Policies) -> Self {
        Extender {
            state: parking_lot::Mutex::new(State { view, placer: Placer::new() }),
            cluster,
            policies,
            busy_weight: 0,
            metrics: Metrics::default(),
            ready: AtomicBool::new(false),
            node_locks: Mutex::new(HashMap::new()),
            changed: tokio::sync::Notify::new(),
            lookalike_wait: Duration::ZERO,
            scheduler_names: vec![crate::objects::DEFAULT_SCHEDULER.to_owned()],
        }
    }

    /// The same extender binding only pods whose `spec.schedulerName` is one of `names` (the
    /// profiles of the kube-scheduler that calls it): a pod of another scheduler is that
    /// scheduler's to place, and a bind for it is refused.
    #[must_use]
    pub fn with_scheduler_names(mut self, names: Vec<String>) -> Self {
        self.scheduler_names = names;
        self
    }

    /// The same extender letting a bind wait up to `wait` for the node to report a look-alike
    /// pod admitted (see [`Extender::bind`]) before it refuses; zero refuses at once.
    #[must_use]
    pub fn with_lookalike_wait(mut self, wait: Duration) -> Self {
        self.lookalike_wait = wait;
        self
    }

    /// The same extender weighing GPU activity in `prioritize`: `busy_weight` percent (0–100)
    /// of each node's score is how idle the GPUs the pod would land on are, from the
    /// utilisation the daemons publish.
    #[must_use]
    pub fn with_busy_weight(mut self, busy_weight: u8) -> Self {
        self.busy_weight = busy_weight.min(100);
        self
    }

    /// Whether the view is free now or within `patience`: a caller that must not wait long
    /// for it (an async worker) goes elsewhere when it is not.
    #[must_use]
    pub fn view_free_within(&self, patience: Duration) -> bool {
        self.state.try_lock_for(patience).is_some()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // parking_lot's lock is not poisoned by a panic: the view cannot be left half-updated
        // in a way that matters more than stopping would, so the extender keeps serving.
        self.state.lock()
    }

    /// Runs `f` on the view (the watchers feed it through this).
    pub fn with_view<R>(&self, f: impl FnOnce(&mut ClusterView) -> R) -> R {
        let mut s = self.state();
        let r = f(&mut s.view);
        s.view.refresh();
        drop(s);
        self.changed.notify_waiters();
        r
    }

    /// Like [`Self::with_view`], but leaves the per-node usage caches to the next refresh: a
    /// relist applies tens of thousands of pods, and one refresh at its end computes each
    /// node's usage once, in one sweep, instead of once per pod.
    pub fn with_view_batched<R>(&self, f: impl FnOnce(&mut ClusterView) -> R) -> R {
        f(&mut self.state().view)
    }

    /// Marks the view synced (both initial lists applied) or not.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// Whether the view has synced.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The cluster as the view sees it.
    pub fn report(&self) -> ClusterReport {
        ClusterReport::from_view(&mut self.state().view)
    }

    /// The Prometheus exposition text.
    pub fn render_metrics(&self) -> String {
        let (report, disagreements, invalid, counts) = {
            let mut s = self.state();
            let invalid = s.view.invalid_assignments();
            (ClusterReport::from_view(&mut s.view), s.view.disagreements(), invalid, s.view.counts())
        };
        let samples = (report.node_samples(), report.gpu_samples());
        self.metrics.render(&samples.0, &samples.1, (disagreements, invalid), counts, self.is_ready())
    }

    fn not_ready() -> String {
        "the gpushare extender has not synced its view of nodes and pods yet; the scheduler will retry".to_owned()
    }

    fn expire(view: &mut ClusterView) {
        let now = view.now();
        for (uid, a) in view.expire(now) {
            tracing::warn!(pod = %a.key(), uid = %uid, node = %a.node, bound = a.bound,
                "in-flight bind never showed in the watch; no longer counted");
        }
        view.refresh();
    }

    /// `filter`: the candidate nodes where every GPU container of the pod fits.
    pub fn filter<'a>(&self, args: &'a ExtenderArgs<'_>) -> FilterResult<'a> {
        let candidates = args.candidates();
        let mut result = FilterResult::default();
        if !self.is_ready() {
            result.error = Self::not_ready();
            return result;
        }
        let mut passing = Vec::new();
        let request = {
            let mut s = self.state();
            Self::expire(&mut s.view);
            s.view.request_of(&args.pod)
        };
        match request {
            Err(why) => {
                let reason = format!("pod {}: {why}", args.pod.key());
                for n in &candidates {
                    result.failed_and_unresolvable.insert((*n).to_owned(), reason.clone());
                }
            }
            Ok(request) if request.is_empty() => passing.clone_from(&candidates),
            Ok(request) => {
                let uid = args.pod.uid();
                let shape = Shape::of(&request);
                // The view's lock is handed on every FILTER_SLICE, so that a request naming
                // hundreds of thousands of nodes does not hold up the others for its whole run.
                let mut s = self.state();
                let mut held_since = Instant::now();
                for chunk in candidates.chunks(FILTER_CHUNK) {
                    if held_since.elapsed() >= FILTER_SLICE {
                        // Hands the lock to any request waiting for it, then takes it back.
                        MutexGuard::bump(&mut s);
                        held_since = Instant::now();
                    }
                    let State { view, placer } = &mut *s;
                    let gone = view.evicted(&[uid]);
                    for n in chunk {
                        // Most nodes of a healthy cluster take the common shape outright, as
                        // their summary shows; only the others go through the placer, which
                        // also says why not.
                        if shape.as_ref().is_some_and(|s| view.passes_at_a_glance(n, s, &gone)) {
                            passing.push(*n);
                            continue;
                        }
                        let fits = view.surely_fits(n, &request, &gone) == Some(true)
                            || match view.score(placer, n, &request, self.policies, self.busy_weight, &gone) {
                                Ok(_) => true,
                                Err(r) if r.is_resolvable() => {
                                    result.failed_nodes.insert((*n).to_owned(), r.to_string());
                                    false
                                }
                                Err(r) => {
                                    result.failed_and_unresolvable.insert((*n).to_owned(), r.to_string());
                                    false
                                }
                            };
                        if !fits {
                            continue;
                        }
                        // A node still admitting a look-alike elsewhere on it would defer the
                        // bind: the scheduler had better choose another node now.
                        if view.admits_lookalike(n, &request, uid)
                            && let Ok(Placed::Behind(other)) =
                                view.place_clear_of_lookalikes(placer, n, &request, uid, self.policies.gpu, &gone)
                        {
                            result
                                .failed_nodes
                                .insert((*n).to_owned(), Self::lookalike_reason(n, &other, &args.pod.key()));
                            continue;
                        }
                        passing.push(*n);
                    }
                }
            }
        }
        if args.node_names.is_some() || args.nodes.is_none() {
            result.node_names = Some(passing.into_iter().map(Name::from).collect());
        } else if let Some(list) = &args.nodes {
            let keep: HashSet<&str> = passing.into_iter().collect();
            let items = list.items.iter().filter(|n| keep.contains(NodeList::name_of(n))).cloned().collect();
            result.nodes = Some(NodeList { items });
        }
        result
    }

    /// `prioritize`: 0–10 per candidate under the node policy; 0 where the pod does not fit.
    pub fn prioritize<'a>(&self, args: &'a ExtenderArgs<'_>) -> Vec<HostPriority<'a>> {
        let candidates = args.candidates();
        let mut s = self.state();
        let State { view, placer } = &mut *s;
        let request = view.request_of(&args.pod).ok().filter(|r| !r.is_empty());
        let gone = view.evicted(&[args.pod.uid()]);
        let request = request.filter(|_| self.is_ready());
        let shape = request.as_ref().and_then(Shape::of);
        candidates
            .into_iter()
            .map(|host| {
                let score = request.as_ref().map_or(0, |r| self.score_of(view, placer, host, r, shape.as_ref(), &gone));
                HostPriority { host: Name::from(host), score: i64::from(score) }
            })
            .collect()
    }

    /// A candidate's score, 0 where the pod does not fit: from its summary when that can say,
    /// else from the placer.
    fn score_of(
        &self,
        view: &ClusterView,
        placer: &mut Placer,
        node: &str,
        request: &PodRequest,
        shape: Option<&Shape>,
        gone: &Evicted<'_>,
    ) -> u8 {
        shape
            .and_then(|s| view.score_at_a_glance(node, s, self.policies, self.busy_weight, gone))
            .unwrap_or_else(|| view.score(placer, node, request, self.policies, self.busy_weight, gone).unwrap_or(0))
    }

    fn node_lock(&self, node: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.node_locks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        locks.entry(node.to_owned()).or_default().clone()
    }

    /// `bind`: places the pod on the node's GPUs and creates one Binding carrying the
    /// assignment.
    pub async fn bind(&self, args: &BindingArgs) -> BindingResult {
        let outcome = self.bind_inner(args).await;
        let (kind, error) = match outcome {
            Ok(()) => (BindOutcome::Bound, String::new()),
            Err((kind, e)) => (kind, e),
        };
        self.metrics.bind(kind);
        let pod = format!("{}/{}", args.pod_namespace, args.pod_name);
        if error.is_empty() {
            tracing::info!(pod = %pod, node = %args.node, "bound");
        } else {
            tracing::warn!(pod = %pod, node = %args.node, error = %error, "bind refused");
        }
        BindingResult { error }
    }

    async fn bind_inner(&self, args: &BindingArgs) -> Result<(), (BindOutcome, String)> {
        let invalid = |m: String| (BindOutcome::Invalid, m);
        if args.pod_name.is_empty() || args.node.is_empty() {
            return Err(invalid("bind needs PodName and Node".to_owned()));
        }
        if !self.is_ready() {
            return Err((BindOutcome::Failed, Self::not_ready()));
        }
        let namespace = if args.pod_namespace.is_empty() { "default" } else { args.pod_namespace.as_str() };
        let key = format!("{namespace}/{}", args.pod_name);
        // The pod as the view has it, else as the API server has it (the watch may lag).
        let known = {
            let s = self.state();
            let entry = if args.pod_uid.is_empty() {
                s.view.pod_named(namespace, &args.pod_name)
            } else {
                s.view.pod(&args.pod_uid)
            };
            entry.map(|p| {
                let assigned = matches!(p.holding, Holding::Assigned(_));
                (p.uid.clone(), p.node.clone(), p.request.clone(), assigned, p.scheduler.clone())
            })
        };
        let (uid, bound_to, request, assigned, scheduler) = match known {
            Some(k) => k,
            None => {
                let pod = self.cluster.get_pod(namespace, &args.pod_name).await.map_err(|e| match e {
                    ClusterError::NotFound(_) => invalid(format!("pod {key} does not exist")),
                    e => (BindOutcome::Failed, format!("reading pod {key}: {e}")),
                })?;
                if !args.pod_uid.is_empty() && pod.uid() != args.pod_uid {
                    return Err(invalid(format!(
                        "pod {key} has UID {}, the scheduler asked for {}: it was re-created",
                        pod.uid(),
                        args.pod_uid
                    )));
                }
                let holding = pod.annotations().contains_key(ASSIGNMENT_KEY);
                let request = self.state().view.request_of(&pod);
                (pod.uid().to_owned(), pod.node().map(str::to_owned), request, holding, pod.scheduler().to_owned())
            }
        };
        // Only what kube-scheduler sends: its own pods, and only those it asked us to place.
        if !self.scheduler_names.contains(&scheduler) {
            return Err(invalid(format!(
                "pod {key} is placed by scheduler {scheduler:?}, not by one this extender serves ({}); add it to \
                 [scheduling] scheduler_names if its kube-scheduler profile calls this extender",
                self.scheduler_names.join(", ")
            )));
        }
        if request.as_ref().is_ok_and(PodRequest::is_empty) {
            return Err(invalid(format!(
                "pod {key} asks for no GPU memory of this extender's resources: it binds only the pods it places, and \
                 kube-scheduler binds the others itself"
            )));
        }
        match bound_to.as_deref() {
            Some(n) if n == args.node && assigned => return Ok(()),
            Some(n) => return Err(invalid(format!("pod {key} is already bound to {n}"))),
            None => {}
        }
        let request = request.map_err(|why| invalid(format!("pod {key}: {why}")))?;

        // A look-alike still in admission on the node: wait (unlocked) for the view to change,
        // up to `lookalike_wait`, rather than refuse at once and leave the pod to the scheduler's
        // backoff (1 s, then 2 s).
        let deadline = tokio::time::Instant::now() + self.lookalike_wait;
        let lock = self.node_lock(&args.node);
        let (binding, _serial) = loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let serial = lock.lock().await;
            match self.attempt(args, namespace, &key, &uid, &request)? {
                Attempt::AlreadyBound => return Ok(()),
                Attempt::Bind(binding) => break (binding, serial),
                Attempt::LookalikeInAdmission(other) => {
                    drop(serial);
                    if tokio::time::timeout_at(deadline, changed).await.is_err() {
                        return Err((BindOutcome::Deferred, Self::lookalike_reason(&args.node, &other, &key)));
                    }
                }
            }
        };
        match self.cluster.bind(&binding).await {
            Ok(()) => {
                self.state().view.confirm(&uid);
                Ok(())
            }
            Err(ClusterError::Conflict(why)) => {
                // Perhaps an earlier try of this very bind went through and its reply was lost.
                let landed = self.cluster.get_pod(namespace, &args.pod_name).await.ok().filter(|p| {
                    p.uid() == uid
                        && p.node() == Some(args.node.as_str())
                        && (binding.annotations.is_empty() || p.annotations().contains_key(ASSIGNMENT_KEY))
                });
                let mut s = self.state();
                if let Some(pod) = landed {
                    s.view.apply_pod(&pod);
                    s.view.refresh();
                    Ok(())
                } else {
                    s.view.forget(&uid);
                    s.view.refresh();
                    Err((BindOutcome::Failed, format!("binding pod {key} to {}: {why}", args.node)))
                }
            }
            Err(e) => {
                let mut s = self.state();
                s.view.forget(&uid);
                s.view.refresh();
                drop(s);
                Err((BindOutcome::Failed, format!("binding pod {key} to {}: {e}", args.node)))
            }
        }
    }

    /// The part of a bind under the node's lock: re-checks the fit against the current view,
    /// chooses the GPUs and records the assumption, or says why it must wait.
    fn attempt(
        &self,
        args: &BindingArgs,
        namespace: &str,
        key: &str,
        uid: &str,
        request: &PodRequest,
    ) -> Result<Attempt, (BindOutcome, String)> {
        let invalid = |m: String| (BindOutcome::Invalid, m);
        let mut s = self.state();
        let State { view, placer } = &mut *s;
        Self::expire(view);
        if let Some(a) = view.assumption(uid) {
            if a.bound && a.node == args.node {
                return Ok(Attempt::AlreadyBound); // a retry of a bind that already went through
            }
            if a.bound {
                return Err(invalid(format!("pod {key} was just bound to {}", a.node)));
            }
        }
        let mut annotations = BTreeMap::new();
        if !request.is_empty() {
            let gone = view.evicted(&[uid]);
            let placed = view
                .place_clear_of_lookalikes(placer, &args.node, request, uid, self.policies.gpu, &gone)
                .map_err(|r| (BindOutcome::NoFit, format!("pod {key} no longer fits node {}: {r}", args.node)))?;
            let assignment = match placed {
                Placed::Clear(a) => a,
                Placed::Behind(other) => return Ok(Attempt::LookalikeInAdmission(other)),
            };
            let encoded = assignment.encode().map_err(|e| invalid(format!("pod {key}: {e}")))?;
            annotations.insert(ASSIGNMENT_KEY.to_owned(), encoded);
            if view.config().alibaba
                && let Ok(inventory) = view.inventory(&args.node)
                && let Some(a) = AlibabaAnnotations::from_assignment(&assignment, inventory, request, now_ns())
            {
                annotations.extend(a.encode());
            }
            let now = view.now();
            view.assume(uid, Self::assumed(namespace, &args.pod_name, &args.node, assignment, now));
            view.refresh();
        }
        Ok(Attempt::Bind(Binding {
            namespace: namespace.to_owned(),
            name: args.pod_name.clone(),
            uid: uid.to_owned(),
            node: args.node.clone(),
            annotations,
        }))
    }

    fn lookalike_reason(node: &str, other: &str, pod: &str) -> String {
        format!(
            "node {node} is still admitting pod {other}, one of whose GPU requests is the size of one of pod {pod}'s \
             but on other GPUs; the kubelet cannot tell the two apart, so {pod} goes there once the node's daemon \
             reports {other} allocated"
        )
    }

    fn assumed(namespace: &str, name: &str, node: &str, assignment: Assignment, now: Instant) -> Assumed {
        Assumed {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            node: node.to_owned(),
            assignment,
            bound: false,
            since: now,
        }
    }

    /// `preempt`: per candidate node, kube-scheduler's victims plus whatever further pods of
    /// lower priority than the preemptor the GPUs need, in decreasing priority.
    ///
    /// kube-scheduler's victims are kept, every one: it chose them for its own resources (CPU,
    /// memory, and the node's total of the memory resource, which the kubelet checks too).
    /// When evicting them does not make room on the GPUs, pods on the node with a lower priority
    /// than the preemptor that hold GPU memory are added, lowest priority (then largest) first,
    /// until the pod fits; any added pod not needed after all is given back, highest priority
    /// first. The list is sorted by decreasing priority, as kube-scheduler reads it (`Pods[0]` is
    /// the most important victim when it picks a node). A node where no such set makes room,
    /// or whose list would be empty, is left out: kube-scheduler abandons the whole preemption on
    /// an empty list. `NumPDBViolations` is kube-scheduler's, kept within 0 and the list's length.
    pub fn preempt(&self, args: &PreemptionArgs) -> PreemptionResult {
        let mut result = PreemptionResult::default();
        let mut s = self.state();
        let State { view, placer } = &mut *s;
        let Ok(request) = view.request_of(&args.pod) else { return result };
        let mut per_node: Vec<Candidates> = Vec::new();
        if let Some(meta) = &args.node_name_to_meta_victims {
            for (node, v) in meta {
                let victims = v.pods.iter().map(|p| (p.uid.clone(), view.pod(&p.uid).map(|e| e.priority))).collect();
                per_node.push((node.clone(), victims, v.num_pdb_violations));
            }
        } else if let Some(full) = &args.node_name_to_victims {
            for (node, v) in full {
                let victims = v.pods.iter().map(|p| (p.uid().to_owned(), Some(p.spec.priority.unwrap_or(0)))).collect();
                per_node.push((node.clone(), victims, v.num_pdb_violations));
            }
        }
        let me = args.pod.uid();
        let my_priority = args.pod.spec.priority.unwrap_or(0);
        for (node, victims, pdb) in per_node {
            let extra = if request.is_empty() {
                Vec::new()
            } else {
                match gpu_victims(view, placer, self.policies.gpu, &node, &request, me, my_priority, &victims) {
                    Some(extra) => extra,
                    None => {
                        tracing::debug!(%node, "preempt: no set of lower-priority pods makes room on its GPUs; node left out");
                        continue;
                    }
                }
            };
            // A victim the view does not know (it holds no GPU memory) ranks with the one before
            // it in kube-scheduler's list, which comes most important first.
            let mut last = i32::MAX;
            let mut all: Vec<(String, i32)> = victims
                .into_iter()
                .map(|(uid, prio)| {
                    last = prio.unwrap_or(last);
                    (uid, last)
                })
                .collect();
            all.extend(extra);
            if all.is_empty() {
                tracing::debug!(%node, "preempt: the pod needs no victim there; node left out");
                continue;
            }
            // Stable: kube-scheduler's own order is kept among equals.
            all.sort_by_key(|(_, prio)| std::cmp::Reverse(*prio));
            let count = i64::try_from(all.len()).unwrap_or(i64::MAX);
            let pods = all.into_iter().map(|(uid, _)| MetaPod { uid }).collect();
            result
                .node_name_to_meta_victims
                .insert(node, MetaVictims { pods, num_pdb_violations: pdb.clamp(0, count) });
        }
        result
    }
}

/// The pods beyond kube-scheduler's `victims` that `node`'s GPUs need evicted for `request`:
/// holders of GPU memory there with a priority below `below`, as few and as unimportant as do.
/// `None` when even all of them would not make room.
#[allow(clippy::too_many_arguments)] // one call site; the parts of one question
fn gpu_victims(
    view: &mut ClusterView,
    placer: &mut Placer,
    policy: GpuPolicy,
    node: &str,
    request: &PodRequest,
    me: &str,
    below: i32,
    victims: &[(String, Option<i32>)],
) -> Option<Vec<(String, i32)>> {
    let holders = view.usage(node).ok()?.pods.clone();
    let mut more: Vec<(String, i32, u64)> = holders
        .iter()
        .filter(|h| !h.assumed && h.uid != me && !victims.iter().any(|(v, _)| *v == h.uid))
        .filter_map(|h| {
            let held = h.mib.iter().map(|m| m.get()).sum::<u64>();
            let prio = view.pod(&h.uid)?.priority;
            (held > 0 && prio < below).then(|| (h.uid.clone(), prio, held))
        })
        .collect();
    more.sort_by_key(|(_, prio, held)| (*prio, std::cmp::Reverse(*held)));
    let fits = |view: &ClusterView, placer: &mut Placer, extra: &[&str]| {
        let mut uids: Vec<&str> = victims.iter().map(|(u, _)| u.as_str()).chain(extra.iter().copied()).collect();
        uids.push(me);
        let gone = view.evicted(&uids);
        view.place(placer, node, request, policy, &gone).is_ok()
    };
    let mut chosen: Vec<(&str, i32)> = Vec::new();
    let mut ok = fits(view, placer, &[]);
    for (uid, prio, _) in &more {
        if ok {
            break;
        }
        chosen.push((uid, *prio));
        ok = fits(view, placer, &chosen.iter().map(|(u, _)| *u).collect::<Vec<_>>());
    }
    if !ok {
        return None;
    }
    for i in (0..chosen.len()).rev() {
        let without: Vec<&str> = chosen.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, (u, _))| *u).collect();
        if fits(view, placer, &without) {
            chosen.remove(i);
        }
    }
    Some(chosen.into_iter().map(|(uid, prio)| (uid.to_owned(), prio)).collect())
}

/// A [`Cluster`] in memory, for tests: pods by namespace and name, bindings applied to them
/// as the API server would (node set, annotations copied, 409 if already bound), failures on
/// demand.
#[cfg(any(test, feature = "testing"))]
pub mod fake {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use super::{Binding, Cluster, ClusterError};
    use crate::objects::PodObject;

    /// The fake.
    #[derive(Debug, Default)]
    pub struct FakeCluster {
        pods: Mutex<BTreeMap<(String, String), PodObject>>,
        bindings: Mutex<Vec<Binding>>,
        fail_next: Mutex<Vec<ClusterError>>,
    }

    impl FakeCluster {
        /// Stores a pod.
        pub fn put(&self, pod: PodObject) {
            let key = (pod.namespace().to_owned(), pod.name().to_owned());
            self.pods.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(key, pod);
        }

        /// A stored pod.
        pub fn pod(&self, namespace: &str, name: &str) -> Option<PodObject> {
            let pods = self.pods.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            pods.get(&(namespace.to_owned(), name.to_owned())).cloned()
        }

        /// Every binding call so far, including failed ones.
        pub fn bindings(&self) -> Vec<Binding> {
            self.bindings.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
        }

        /// The next binding call fails with `e` (queued in order).
        pub fn fail_next(&self, e: ClusterError) {
            self.fail_next.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(e);
        }
    }

    impl Cluster for FakeCluster {
        async fn get_pod(&self, namespace: &str, name: &str) -> Result<PodObject, ClusterError> {
            self.pod(namespace, name).ok_or_else(|| ClusterError::NotFound(format!("pods {name:?} not found")))
        }

        async fn bind(&self, b: &Binding) -> Result<(), ClusterError> {
            self.bindings.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(b.clone());
            let failure = {
                let mut f = self.fail_next.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                (!f.is_empty()).then(|| f.remove(0))
            };
            if let Some(e) = failure {
                return Err(e);
            }
            let mut pods = self.pods.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let Some(pod) = pods.get_mut(&(b.namespace.clone(), b.name.clone())) else {
                return Err(ClusterError::NotFound(format!("pods {:?} not found", b.name)));
            };
            if pod.uid() != b.uid {
                return Err(ClusterError::Conflict(format!("UID precondition failed for {}", b.name)));
            }
            if let Some(n) = pod.node() {
                return Err(ClusterError::Conflict(format!("pod {} is already assigned to node {n:?}", b.name)));
            }
            pod.spec.node_name.clone_from(&b.node);
            pod.metadata.annotations.get_or_insert_default().extend(b.annotations.clone());
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests;
