//! The extender's decisions: filter, prioritize, bind and preempt over the cluster view. The
//! HTTP layer only translates JSON to these calls; the API server is reached through the
//! [`Cluster`] seam (the real one is in [`crate::kube`]).
//!
//! Binds are serialized per node: under the node's lock the fit is checked again against the
//! current view, GPUs are chosen, the in-flight assumption is recorded, and **one** Binding
//! carries the assignment annotations (the API server copies a Binding's annotations onto the
//! pod in the same update that sets `spec.nodeName`). A failed call rolls the assumption back;
//! a retried bind of a pod already bound to the node with its assignment succeeds again.
//!
//! Filter and prioritize are here; `bind` and `preempt` have a file each, and `fake` is the
//! in-memory [`Cluster`] for tests.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use parking_lot::MutexGuard;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gpushare_core::PodRequest;
use gpushare_core::placement::Placer;
use gpushare_core::schedule::Policies;
use thiserror::Error;

use crate::inspect::ClusterReport;
use crate::metrics::Metrics;
use crate::objects::PodObject;
use crate::view::summary::Shape;
use crate::view::{ClusterView, Evicted, Placed};
use crate::wire::{ExtenderArgs, FilterResult, HostPriority, Name, NodeList};

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

struct State {
    view: ClusterView,
    placer: Placer,
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

    /// The view's lock, taken from an async task: at once when it is free; when a long request
    /// holds it, the wait gives this worker's queued tasks to another thread first
    /// (`block_in_place`), so that health, readiness and the request timeouts queued behind a
    /// watch event are not held up for as long as that request. A current-thread runtime (or
    /// none) waits in place.
    fn state_from_task(&self) -> MutexGuard<'_, State> {
        if let Some(s) = self.state.try_lock() {
            return s;
        }
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(|| self.state()),
            _ => self.state(),
        }
    }

    /// Runs `f` on the view, then refreshes the view's caches (the watchers feed the view
    /// through this, from their tasks: see [`Self::state_from_task`]).
    pub fn with_view<R>(&self, f: impl FnOnce(&mut ClusterView) -> R) -> R {
        let mut s = self.state_from_task();
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
        f(&mut self.state_from_task().view)
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
}

mod bind;
/// A [`Cluster`] in memory, for tests: pods by namespace and name, bindings applied to them
/// as the API server would (node set, annotations copied, 409 if already bound), failures on
/// demand.
#[cfg(any(test, feature = "testing"))]
pub mod fake;
mod preempt;

#[cfg(test)]
mod tests;
