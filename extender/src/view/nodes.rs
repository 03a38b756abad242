//! The node side of the view: a node's published state read ([`NodeReading`], before the
//! view's lock is taken) and applied with its heartbeat, its daemon's report compared with what
//! the view believes, and the initial lists awaited before comparing.

use super::*;

/// A node's published state, read outside the view: its hash (to tell an unchanged state, a
/// heartbeat alone) and, once [`Self::decode`] ran, what it says. The watch makes one before it
/// takes the view's lock, so that decoding a large state (hundreds of KiB from a node that
/// churns it) never holds up filter, prioritize or bind for the rest of the cluster.
#[derive(Debug)]
pub struct NodeReading {
    hash: Option<u64>,
    gpus: Option<NodeGpus>,
}

impl NodeReading {
    /// `node`'s state hashed, not decoded yet.
    #[must_use]
    pub fn hashed(node: &NodeObject) -> Self {
        Self { hash: node.annotation(NODE_STATE_KEY).map(value_hash), gpus: None }
    }

    /// Decodes `node`'s state (the node this reading was hashed from), if not done yet.
    pub fn decode(&mut self, node: &NodeObject) {
        if self.gpus.is_none() {
            self.gpus = Some(match node.annotation(NODE_STATE_KEY) {
                None => NodeGpus::NotSharing,
                Some(v) => match NodeState::decode(v) {
                    Ok(s) => NodeGpus::Reported(Box::new(s)),
                    Err(e) => NodeGpus::Invalid(e.to_string()),
                },
            });
        }
    }
}

impl ClusterView {
    /// Adds or updates a node. Returns the disagreements between what its daemon now reports
    /// and what the view believes, one readable line each (already counted).
    pub fn apply_node(&mut self, node: &NodeObject) -> Vec<String> {
        self.apply_reading(node, NodeReading::hashed(node))
    }

    /// Whether the view already holds the state `reading` was hashed from for `node`: then
    /// applying it decodes nothing (a heartbeat alone, every node every 20 s).
    #[must_use]
    pub fn holds_state(&self, node: &NodeObject, reading: &NodeReading) -> bool {
        self.nodes.get(node.name()).is_some_and(|e| e.state_hash == reading.hash)
    }

    /// [`Self::apply_node`] with the state read already (hashed, and decoded unless
    /// [`Self::holds_state`]); a reading not decoded is decoded here if the state changed.
    pub fn apply_reading(&mut self, node: &NodeObject, mut reading: NodeReading) -> Vec<String> {
        let name = node.name().to_owned();
        let state_hash = reading.hash;
        let state_value = node.annotation(NODE_STATE_KEY);
        let alibaba =
            if self.config.alibaba && state_value.is_none() { AlibabaNode::of(node, &self.config.names) } else { None };
        if let Some(entry) = self.nodes.get_mut(&name) {
            renew(entry, node, &name, self.config.heartbeat_by_wall_clock, &*self.clock);
            // A heartbeat alone (every node every 20 s): the published state is unchanged, so
            // nothing is decoded again and no usage recomputed; only the record's deadline moves.
            if entry.state_hash == state_hash && entry.address == node.address() && entry.alibaba == alibaba {
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
        reading.decode(node);
        let gpus = reading.gpus.unwrap_or(NodeGpus::NotSharing);
        self.index_reports(&name, &gpus);
        let by_wall_clock = self.config.heartbeat_by_wall_clock;
        let entry = self.nodes.entry(name.clone()).or_insert_with(|| {
            let mut entry = NodeEntry {
                address: String::new(),
                gpus: NodeGpus::NotSharing,
                cache: None,
                heartbeat: None,
                state_hash: None,
                alibaba: None,
            };
            renew(&mut entry, node, &name, by_wall_clock, &*self.clock);
            entry
        });
        let old_generation = match &entry.gpus {
            NodeGpus::Reported(s) => Some(s.generation),
            _ => None,
        };
        entry.address = node.address().to_owned();
        entry.gpus = gpus;
        entry.state_hash = state_hash;
        entry.alibaba = alibaba;
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
    pub(super) fn index_reports(&mut self, node: &str, new: &NodeGpus) {
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
        Evicted { uids: uids.iter().copied().collect(), nodes, now: self.clock.now() }
    }

    /// Replaces every node (a watch restart's full list).
    pub fn replace_nodes<'a>(&mut self, nodes: impl IntoIterator<Item = &'a NodeObject>) -> Vec<String> {
        self.replace_read_nodes(nodes.into_iter().map(|n| (n, NodeReading::hashed(n))))
    }

    /// [`Self::replace_nodes`] with each node's state read already ([`Self::apply_reading`]).
    pub fn replace_read_nodes<'a>(
        &mut self,
        nodes: impl IntoIterator<Item = (&'a NodeObject, NodeReading)>,
    ) -> Vec<String> {
        let mut seen = HashSet::new();
        let mut found = Vec::new();
        for (n, reading) in nodes {
            seen.insert(n.name().to_owned());
            found.extend(self.apply_reading(n, reading));
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
    pub(super) fn listed(&mut self, done: InitialLists) -> Vec<String> {
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
}
