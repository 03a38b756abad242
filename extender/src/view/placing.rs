//! The view's answers to the verbs for one node: whether a pod fits, its score and its
//! placement, from the node's summary at a glance or the long way through the core's placer.

use super::*;

impl ClusterView {
    /// Runs `f` on a node's inventory and its usage with the `evicted` pods gone: one lookup
    /// when the usage is cached, no copy unless an evicted pod holds memory there.
    pub(super) fn with_node<R>(
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
