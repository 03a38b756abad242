//! `bind`: under the node's lock, check the fit again against the current view, choose the
//! GPUs, record the in-flight assumption, and create **one** Binding carrying the assignment; a
//! look-alike still in admission on other GPUs makes the bind wait or be refused.

use std::collections::BTreeMap;
use std::time::Instant;

use gpushare_core::PodRequest;
use gpushare_core::codec::alibaba::AlibabaAnnotations;
use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};

use super::{Binding, Cluster, ClusterError, Extender, State, now_ns};
use crate::metrics::BindOutcome;
use crate::view::{Assumed, Holding, Placed};
use crate::wire::{BindingArgs, BindingResult};

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

impl<C: Cluster> Extender<C> {
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

    pub(super) fn lookalike_reason(node: &str, other: &str, pod: &str) -> String {
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
}
