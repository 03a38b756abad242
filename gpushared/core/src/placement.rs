//! Placement on one node: which GPUs each of a pod's containers gets, under a GPU-level policy
//! (binpack or spread); the node's score 0–10 under a node-level policy; and, when the pod does
//! not fit, a [`Rejection`] that names the GPUs and says whether preemption could help.
//!
//! Rules every placement keeps (property-tested):
//! - a container asking for K GPUs gets K distinct GPUs with its memory split evenly;
//! - no GPU's usage plus the pod's footprint exceeds its capacity (total rounded to the unit);
//! - unhealthy, cordoned and whole-mode GPUs are never chosen.
//!
//! A pod's footprint on a GPU follows Kubernetes' init-container rule: app containers and
//! sidecars add up; each init container runs alone beside the sidecars started before it, so
//! the footprint is `max(long-running sum, max over init containers of (init + earlier sidecars))`.
//! Init containers prefer GPUs the pod's long-running containers use, because the kubelet hands
//! an init container's devices on to the app containers.
//!
//! The search is exact for small pods (a depth-first search over GPU choices, bounded by a step
//! budget) so a multi-container pod is not refused just because a greedy pass chose badly.
//!
//! This module holds the policies, the node as placement sees it, the result and the score;
//! `search` holds the [`Placer`], and `rejection` the reasons a pod does not fit.

use std::collections::BTreeMap;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::inventory::NodeInventory;
use crate::request::{ContainerRole, PodRequest};
use crate::units::Mib;

mod rejection;
mod search;

pub use rejection::{GpuState, Rejection, Unusable};
pub use search::{Placer, SEARCH_BUDGET};

/// How GPUs are chosen within a node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuPolicy {
    /// Fill the fullest GPU that still fits (best fit); keeps whole GPUs free for big requests.
    #[default]
    Binpack,
    /// Use the emptiest GPU; spreads load and noisy neighbours.
    Spread,
}

/// How nodes are ranked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodePolicy {
    /// Prefer the node that is fullest after placement.
    #[default]
    Binpack,
    /// Prefer the node that is emptiest after placement.
    Spread,
}

/// A policy name that is neither `binpack` nor `spread`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown placement policy {0:?}: write \"binpack\" or \"spread\"")]
pub struct UnknownPolicy(pub String);

impl FromStr for GpuPolicy {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "binpack" => Ok(GpuPolicy::Binpack),
            "spread" => Ok(GpuPolicy::Spread),
            _ => Err(UnknownPolicy(s.to_owned())),
        }
    }
}

impl FromStr for NodePolicy {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "binpack" => Ok(NodePolicy::Binpack),
            "spread" => Ok(NodePolicy::Spread),
            _ => Err(UnknownPolicy(s.to_owned())),
        }
    }
}

/// The highest node score (kube-scheduler's `MaxExtenderPriority`).
pub const MAX_SCORE: u8 = 10;

/// Usage that does not line up with the inventory it describes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("usage lists {usage} GPUs but the inventory has {gpus}")]
pub struct UsageMismatch {
    /// Entries in the usage slice.
    pub usage: usize,
    /// GPUs in the inventory.
    pub gpus: usize,
}

/// A node's GPUs together with what is already allocated on each (same order as
/// [`NodeInventory::gpus`]).
#[derive(Clone, Copy, Debug)]
pub struct NodeView<'a> {
    inventory: &'a NodeInventory,
    used: &'a [Mib],
}

impl<'a> NodeView<'a> {
    /// Pairs an inventory with its usage.
    ///
    /// # Errors
    /// [`UsageMismatch`] if `used` does not have one entry per GPU.
    pub fn new(inventory: &'a NodeInventory, used: &'a [Mib]) -> Result<Self, UsageMismatch> {
        if used.len() == inventory.gpus().len() {
            Ok(NodeView { inventory, used })
        } else {
            Err(UsageMismatch { usage: used.len(), gpus: inventory.gpus().len() })
        }
    }

    /// The inventory.
    #[must_use]
    pub fn inventory(&self) -> &'a NodeInventory {
        self.inventory
    }

    /// Usage per GPU position.
    #[must_use]
    pub fn used(&self) -> &'a [Mib] {
        self.used
    }
}

/// One slice of one GPU handed to one container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    /// Position of the container in [`PodRequest::containers`].
    pub container: usize,
    /// Position of the GPU in [`NodeInventory::gpus`].
    pub gpu: usize,
    /// Memory on that GPU.
    pub mib: Mib,
}

/// Where each container of a pod goes on one node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    shares: Vec<Share>,
    footprint: Vec<Mib>,
}

impl Placement {
    /// Every share, grouped by container in request order.
    #[must_use]
    pub fn shares(&self) -> &[Share] {
        &self.shares
    }

    /// GPU positions of one container.
    pub fn gpus_of(&self, container: usize) -> impl Iterator<Item = usize> + '_ {
        self.shares.iter().filter(move |s| s.container == container).map(|s| s.gpu)
    }

    /// What the pod adds to each GPU (by position): see the module docs for the init rule.
    #[must_use]
    pub fn footprint(&self) -> &[Mib] {
        &self.footprint
    }
}

/// A node's score (0–[`MAX_SCORE`]) under `policy` from its schedulable `capacity` and what
/// would be used `after` the pod is placed: binpack favours the fuller node, spread the emptier.
/// The one rule: the placer scores with it, and the extender's per-node summaries too.
#[must_use]
pub fn node_score(after: u128, capacity: u128, policy: NodePolicy) -> u8 {
    if capacity == 0 {
        return 0;
    }
    let full = (after.min(capacity) * u128::from(MAX_SCORE)) / capacity;
    let full = u8::try_from(full).unwrap_or(MAX_SCORE);
    match policy {
        NodePolicy::Binpack => full,
        NodePolicy::Spread => MAX_SCORE - full,
    }
}

/// Places `pod` on `node` with a fresh [`Placer`].
///
/// # Errors
/// A [`Rejection`] saying why the pod does not fit.
pub fn place(node: NodeView<'_>, pod: &PodRequest, policy: GpuPolicy) -> Result<Placement, Rejection> {
    Placer::new().place(node, pod, policy)
}

/// A pod's footprint per GPU from its containers' shares, containers given in request order
/// (init containers first, in spec order): the accounting rule of the module docs, for usage
/// rebuilt from assignments.
pub fn footprint<K, C, S>(containers: C) -> BTreeMap<K, Mib>
where
    K: Ord + Clone,
    C: IntoIterator<Item = (ContainerRole, S)>,
    S: IntoIterator<Item = (K, Mib)>,
{
    let mut long: BTreeMap<K, Mib> = BTreeMap::new();
    let mut sidecars: BTreeMap<K, Mib> = BTreeMap::new();
    let mut peak: BTreeMap<K, Mib> = BTreeMap::new();
    for (role, shares) in containers {
        for (k, m) in shares {
            match role {
                ContainerRole::Init => {
                    let with = sidecars.get(&k).copied().unwrap_or(Mib::ZERO).saturating_add(m);
                    let e = peak.entry(k).or_insert(Mib::ZERO);
                    *e = (*e).max(with);
                }
                ContainerRole::Sidecar => {
                    let e = sidecars.entry(k.clone()).or_insert(Mib::ZERO);
                    *e = e.saturating_add(m);
                    let e = long.entry(k).or_insert(Mib::ZERO);
                    *e = e.saturating_add(m);
                }
                ContainerRole::App => {
                    let e = long.entry(k).or_insert(Mib::ZERO);
                    *e = e.saturating_add(m);
                }
            }
        }
    }
    for (k, m) in peak {
        let e = long.entry(k).or_insert(Mib::ZERO);
        *e = (*e).max(m);
    }
    long
}

#[cfg(test)]
mod tests;
