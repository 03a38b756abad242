//! The look-alike rule, in one place: a pod must not be bound to a node that is still admitting
//! another pod one of whose device requests is the size of one of its own, on other GPUs
//! ([`Assignment::is_lookalike_of`]), because the kubelet's device-plugin calls carry only device
//! counts and the daemon could serve either first. Such a
//! pod goes beside the look-alikes when there is room; otherwise it waits ([`Placed::Behind`]).
//! filter and bind both ask [`ClusterView::place_clear_of_lookalikes`].

use super::*;

/// Where a pod goes on a node that may be admitting look-alikes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placed {
    /// Here: no pod in admission on the node can be taken for it.
    Clear(Assignment),
    /// Nowhere yet: every placement would be taken for this pod's (`namespace/name`), still in
    /// admission on other GPUs of the node.
    Behind(String),
}

impl ClusterView {
    /// Places `pod` on `node` like [`Self::place`], but only on the GPUs of the look-alike
    /// pods `node` is still admitting (every other GPU counted full), so that whichever of them
    /// the daemon serves first gets what it was assigned. `None` when no look-alike is in
    /// admission there or the pod does not fit on their GPUs.
    fn place_beside_lookalikes(
        &mut self,
        placer: &mut Placer,
        node: &str,
        pod: &PodRequest,
        uid: &str,
        policy: GpuPolicy,
        evicted: &Evicted<'_>,
    ) -> Option<Assignment> {
        let sizes = pod.request_sizes();
        let usage = self.usage(node).ok()?;
        let beside: HashSet<String> = usage
            .admitting
            .iter()
            .filter(|a| a.uid != uid && !a.assignment.request_sizes().is_disjoint(&sizes))
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

    /// Whether `node` is admitting a pod one of whose device requests is the size of one of
    /// `pod`'s: the cheap test before [`Self::lookalike_in_admission`].
    pub fn admits_lookalike(&mut self, node: &str, pod: &PodRequest, uid: &str) -> bool {
        let sizes = pod.request_sizes();
        !sizes.is_empty()
            && self.usage(node).is_ok_and(|u| {
                u.admitting.iter().any(|a| a.uid != uid && !a.assignment.request_sizes().is_disjoint(&sizes))
            })
    }

    /// Places `pod` on `node` as things stand with the `evicted` pods gone, clear of the
    /// look-alikes `node` is admitting: where the placer puts it if no look-alike is confused
    /// with it, else beside the look-alikes if there is room, else [`Placed::Behind`] the
    /// look-alike it would be confused with.
    ///
    /// # Errors
    /// The node's [`NodeRefusal`] when the pod does not fit at all.
    pub fn place_clear_of_lookalikes(
        &mut self,
        placer: &mut Placer,
        node: &str,
        pod: &PodRequest,
        uid: &str,
        policy: GpuPolicy,
        evicted: &Evicted<'_>,
    ) -> Result<Placed, NodeRefusal> {
        let assignment = self.place(placer, node, pod, policy, evicted)?;
        let Some(other) = self.lookalike_in_admission(node, uid, &assignment) else {
            return Ok(Placed::Clear(assignment));
        };
        Ok(self
            .place_beside_lookalikes(placer, node, pod, uid, policy, evicted)
            .filter(|beside| self.lookalike_in_admission(node, uid, beside).is_none())
            .map_or(Placed::Behind(other), Placed::Clear))
    }

    /// A pod bound (or being bound) to `node` that its daemon has not allocated yet and that
    /// the kubelet cannot tell from a pod placed as `assignment`: a device request of each is
    /// the same size, but their GPUs differ. The kubelet's device-plugin calls carry only device
    /// counts, so the daemon would serve whichever it takes to be first; binding a look-alike
    /// while the other is admitted could hand each the other's GPUs. Returns `namespace/name`.
    fn lookalike_in_admission(&mut self, node: &str, uid: &str, assignment: &Assignment) -> Option<String> {
        let usage = self.usage(node).ok()?;
        usage.admitting.iter().find(|a| a.uid != uid && a.assignment.is_lookalike_of(assignment)).map(|a| a.pod.clone())
    }
}
