//! What each GPU of a node has in use, attributed to its holders: the daemon's report first,
//! then the assignments of pods it has not reported, then in-flight binds; and where the
//! daemon's report and the view disagree.

use super::*;

impl ClusterView {
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
    pub(super) fn footprint(&self, inventory: &NodeInventory, holding: &Holding) -> Option<Vec<Mib>> {
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

    pub(super) fn compute_usage(&self, node: &str) -> Usage {
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
                && !state.tells_lookalikes_apart
                && let Holding::Assigned(a) = &pod.holding
            {
                let pod = pod.key();
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
                        usage.pending.push((pod.key(), r.long_running_memory()));
                    }
                    continue;
                }
            };
            counted.insert(uid.as_str());
            usage.pods.push(Holder { uid: uid.clone(), pod: pod.key(), mib, assumed: false });
        }
        // Pods the daemon holds that the view has elsewhere or not at all: the daemon wins.
        for (uid, (pod, mib)) in reported {
            counted.insert(uid);
            let key = pod.to_string();
            usage.pods.push(Holder { uid: uid.to_owned(), pod: key, mib, assumed: false });
        }
        for (uid, a) in &self.assumed {
            if a.node != node || counted.contains(uid.as_str()) {
                continue;
            }
            if !state.tells_lookalikes_apart {
                let pod = a.key();
                usage.admitting.push(Admitting { uid: uid.clone(), pod, assignment: a.assignment.clone() });
            }
            if let Some(mib) = self.footprint(inventory, &Holding::Assigned(Box::new(a.assignment.clone()))) {
                usage.pods.push(Holder { uid: uid.clone(), pod: a.key(), mib, assumed: true });
            }
        }
        usage.pods.sort_by(|a, b| a.pod.cmp(&b.pod).then_with(|| a.uid.cmp(&b.uid)));
        usage.pending.sort();
        usage.total = usage.without(&HashSet::new());
        usage
    }

    /// Where the daemon's report and the view disagree on `node`.
    pub(super) fn disagreements_on(&self, node: &str) -> Vec<String> {
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
}
