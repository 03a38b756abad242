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

use std::collections::BTreeMap;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::inventory::{Health, NodeInventory};
use crate::request::{ContainerRequest, ContainerRole, PodRequest};
use crate::units::Mib;

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

/// The state of one GPU, as a rejection reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuState {
    /// NVML index.
    pub index: u32,
    /// Capacity in MiB (total rounded to the unit).
    pub capacity: Mib,
    /// Free memory.
    pub free: Mib,
    /// Why it cannot be used at all, if so.
    pub unusable: Option<Unusable>,
}

/// Why a GPU takes no allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unusable {
    /// Health check failed.
    Unhealthy(String),
    /// Cordoned by an operator.
    Cordoned,
    /// Handed out whole (`whole` mode), never shared.
    Whole,
    /// Served through DRA (`dra` mode): ResourceClaims only.
    Dra,
}

/// Why a pod does not fit on a node.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum Rejection {
    /// The node reports no GPUs.
    #[error("node has no GPUs")]
    NoGpus,
    /// The node counts devices in another unit than the cluster.
    #[error("node counts GPU memory in {node}, the cluster in {cluster}; set the same unit on its daemon")]
    UnitMismatch {
        /// The node's unit.
        node: crate::units::MemoryUnit,
        /// The unit the pod's request was read in.
        cluster: crate::units::MemoryUnit,
    },
    /// Every GPU is unhealthy, cordoned or handed out whole.
    #[error("no GPU takes allocations: {}", states(.gpus, None))]
    NoSchedulableGpus {
        /// Each GPU's state.
        gpus: Vec<GpuState>,
    },
    /// A container asks for more GPUs than the node has usable.
    #[error("container {container:?} needs {needs} GPUs, node has {usable} that take allocations")]
    TooFewGpus {
        /// Container name.
        container: String,
        /// GPUs asked for.
        needs: u32,
        /// Healthy, uncordoned GPUs on the node.
        usable: u32,
    },
    /// Even an empty GPU of this node is too small for a container's share.
    #[error("container {container:?} needs {per_gpu} on a GPU, the largest usable GPU here has {largest}")]
    GpuTooSmall {
        /// Container name.
        container: String,
        /// Memory per GPU.
        per_gpu: Mib,
        /// Largest usable capacity on the node.
        largest: Mib,
    },
    /// The containers fit one by one on an empty node but not all together.
    #[error("the pod's containers together need more than this node's usable GPUs hold even when empty")]
    PodTooLarge,
    /// Not enough free memory now; preemption may help.
    #[error("{}", insufficient(.container.as_deref(), *.per_gpu, *.gpus, .detail))]
    Insufficient {
        /// The container that could not be placed, if one alone does not fit; `None` when each
        /// fits alone but not all together.
        container: Option<String>,
        /// Its per-GPU need (the largest need among containers when `container` is `None`).
        per_gpu: Mib,
        /// How many GPUs it needs.
        gpus: u32,
        /// Every GPU's state.
        detail: Vec<GpuState>,
    },
}

impl Rejection {
    /// Whether evicting pods could make room (kube-scheduler's `FailedNodes`), as opposed to a
    /// node that can never hold the pod (`FailedAndUnresolvableNodes`).
    #[must_use]
    pub fn is_resolvable(&self) -> bool {
        matches!(self, Rejection::Insufficient { .. })
    }
}

fn states(gpus: &[GpuState], need: Option<Mib>) -> String {
    let mut out = String::new();
    for (i, g) in gpus.iter().enumerate() {
        if i > 0 {
            out.push_str("; ");
        }
        let line = match &g.unusable {
            Some(Unusable::Unhealthy(reason)) => format!("GPU{}: unhealthy ({reason})", g.index),
            Some(Unusable::Cordoned) => format!("GPU{}: cordoned", g.index),
            Some(Unusable::Whole) => format!("GPU{}: handed out whole, not shared", g.index),
            Some(Unusable::Dra) => {
                format!("GPU{}: served through DRA (ResourceClaims), not device-plugin shares", g.index)
            }
            None => match need {
                Some(n) if g.free < n => {
                    format!("GPU{}: {} of {} MiB free, needs {}", g.index, g.free.get(), g.capacity.get(), n.get())
                }
                _ => format!("GPU{}: {} of {} MiB free", g.index, g.free.get(), g.capacity.get()),
            },
        };
        out.push_str(&line);
    }
    out
}

fn insufficient(container: Option<&str>, per_gpu: Mib, gpus: u32, detail: &[GpuState]) -> String {
    match container {
        Some(name) if gpus == 1 => format!("container {name:?} does not fit: {}", states(detail, Some(per_gpu))),
        Some(name) => format!(
            "container {name:?} needs {gpus} GPUs with {} MiB free each: {}",
            per_gpu.get(),
            states(detail, Some(per_gpu))
        ),
        None => format!("the pod's containers do not fit together: {}", states(detail, None)),
    }
}

/// Steps the exact search may take before it gives up on a pod (each step tries one choice
/// of GPUs for one container). Ordinary pods need a handful.
pub const SEARCH_BUDGET: u32 = 4096;

/// A reusable placement engine: holds scratch buffers so that evaluating thousands of nodes
/// for one pod allocates nothing per node that fits.
#[derive(Debug, Default)]
pub struct Placer {
    policy: GpuPolicy,
    /// Capacity per GPU position; zero for GPUs that take no allocation.
    cap: Vec<Mib>,
    /// Capacity minus usage by other pods.
    free: Vec<Mib>,
    /// This pod's long-running load per GPU during the search.
    load: Vec<Mib>,
    /// This pod's footprint per GPU once placed.
    foot: Vec<Mib>,
    /// Sidecar load started before the init container being placed.
    before: Vec<Mib>,
    shares: Vec<Share>,
    /// Long-running containers in search order, then init containers in spec order.
    long: Vec<Need>,
    init: Vec<Need>,
    /// Whether each container (by request position) is a sidecar.
    sidecar: Vec<bool>,
    /// Candidate GPUs per search depth as (policy key, position), sorted.
    cands: Vec<Vec<(u64, usize)>>,
    /// Candidate GPUs of an init container as (not held by the pod, policy key, position).
    init_cands: Vec<(bool, u64, usize)>,
    combo: Vec<usize>,
    budget: u32,
    /// While set, long-running containers prefer GPUs with at least this much room: those an
    /// init container of the pod could share with them (see [`Placer::colocated`]).
    colocate: Option<Mib>,
}

/// One container's need, as the search sees it.
#[derive(Clone, Copy, Debug)]
struct Need {
    container: usize,
    share: Mib,
    gpus: usize,
}

impl Placer {
    /// A placer with empty buffers.
    #[must_use]
    pub fn new() -> Self {
        Placer::default()
    }

    /// Places `pod` on `node` under `policy`.
    ///
    /// # Errors
    /// A [`Rejection`] saying why the pod does not fit.
    pub fn place(&mut self, node: NodeView<'_>, pod: &PodRequest, policy: GpuPolicy) -> Result<Placement, Rejection> {
        self.run(node, pod, policy)?;
        let mut shares = self.shares.clone();
        // Positions follow the inventory's index order.
        shares.sort_unstable_by_key(|s| (s.container, s.gpu));
        Ok(Placement { shares, footprint: self.foot.clone() })
    }

    /// Scores `node` for `pod` (0–[`MAX_SCORE`]) after placing it under `gpu_policy`.
    ///
    /// # Errors
    /// A [`Rejection`] if the pod does not fit.
    pub fn score(
        &mut self,
        node: NodeView<'_>,
        pod: &PodRequest,
        gpu_policy: GpuPolicy,
        node_policy: NodePolicy,
    ) -> Result<u8, Rejection> {
        self.run(node, pod, gpu_policy)?;
        let mut capacity: u128 = 0;
        let mut after: u128 = 0;
        for ((cap, used), added) in self.cap.iter().zip(node.used).zip(&self.foot) {
            if *cap == Mib::ZERO {
                continue;
            }
            capacity += u128::from(cap.get());
            after += u128::from(used.saturating_add(*added).get().min(cap.get()));
        }
        Ok(node_score(after, capacity, node_policy))
    }

    /// [`Self::score`] blended with how idle the GPUs the pod would land on are: `busy_weight`
    /// percent (0–100) of the result is `MAX_SCORE` × (100 − the busiest chosen GPU's last
    /// published utilisation) / 100; a GPU without a sample counts as idle. 0 is [`Self::score`].
    ///
    /// # Errors
    /// A [`Rejection`] if the pod does not fit.
    pub fn score_weighing_activity(
        &mut self,
        node: NodeView<'_>,
        pod: &PodRequest,
        gpu_policy: GpuPolicy,
        node_policy: NodePolicy,
        busy_weight: u8,
    ) -> Result<u8, Rejection> {
        let base = self.score(node, pod, gpu_policy, node_policy)?;
        let weight = u32::from(busy_weight.min(100));
        if weight == 0 {
            return Ok(base);
        }
        let busiest = node
            .inventory
            .gpus()
            .iter()
            .zip(&self.foot)
            .filter(|(_, added)| **added > Mib::ZERO)
            .filter_map(|(g, _)| g.activity.and_then(|a| a.utilization))
            .map(|u| u32::from(u.min(100)))
            .max()
            .unwrap_or(0);
        let idle = u32::from(MAX_SCORE) * (100 - busiest);
        let blended = (u32::from(base) * 100 * (100 - weight) + idle * weight + 5_000) / 10_000;
        Ok(u8::try_from(blended.min(u32::from(MAX_SCORE))).unwrap_or(MAX_SCORE))
    }

    fn run(&mut self, node: NodeView<'_>, pod: &PodRequest, policy: GpuPolicy) -> Result<(), Rejection> {
        if node.inventory.gpus().is_empty() {
            return Err(Rejection::NoGpus);
        }
        if node.inventory.unit() != pod.unit() {
            return Err(Rejection::UnitMismatch { node: node.inventory.unit(), cluster: pod.unit() });
        }
        self.reset(node, pod, policy);
        let usable = self.cap.iter().filter(|c| **c > Mib::ZERO).count();
        if usable == 0 {
            return Err(Rejection::NoSchedulableGpus { gpus: gpu_states(node) });
        }
        let largest = self.cap.iter().copied().max().unwrap_or(Mib::ZERO);
        for c in pod.containers() {
            if usize::try_from(c.gpus).map_or(true, |k| k > usable) {
                let usable = u32::try_from(usable).unwrap_or(u32::MAX);
                return Err(Rejection::TooFewGpus { container: c.name.clone(), needs: c.gpus, usable });
            }
            if c.per_gpu() > largest {
                return Err(Rejection::GpuTooSmall { container: c.name.clone(), per_gpu: c.per_gpu(), largest });
            }
        }
        // Cheap necessary conditions first: each container alone, and the long-running total.
        let alone = pod.containers().iter().find(|c| !fits_alone(&self.free, c));
        if alone.is_none() && self.long_total_fits(&self.free) && self.search() {
            self.colocated();
            return Ok(());
        }
        // Explain. First: would the pod fit this node if it were empty? If not, preemption
        // cannot help.
        let free_now = std::mem::take(&mut self.free);
        self.free.clone_from(&self.cap);
        let fits_empty = self.long_total_fits(&self.cap) && self.search();
        self.free = free_now;
        if !fits_empty {
            return Err(Rejection::PodTooLarge);
        }
        let detail = gpu_states(node);
        Err(match alone {
            Some(c) => {
                Rejection::Insufficient { container: Some(c.name.clone()), per_gpu: c.per_gpu(), gpus: c.gpus, detail }
            }
            None => Rejection::Insufficient {
                container: None,
                per_gpu: pod.containers().iter().map(ContainerRequest::per_gpu).max().unwrap_or(Mib::ZERO),
                gpus: 1,
                detail,
            },
        })
    }

    fn reset(&mut self, node: NodeView<'_>, pod: &PodRequest, policy: GpuPolicy) {
        let unit = node.inventory.unit();
        self.policy = policy;
        self.cap.clear();
        self.free.clear();
        for (g, used) in node.inventory.gpus().iter().zip(node.used) {
            let cap = if g.is_schedulable() { g.capacity(unit) } else { Mib::ZERO };
            self.cap.push(cap);
            self.free.push(cap.saturating_sub(*used));
        }
        self.long.clear();
        self.init.clear();
        self.sidecar.clear();
        self.sidecar.extend(pod.containers().iter().map(|c| c.role == ContainerRole::Sidecar));
        for (i, c) in pod.containers().iter().enumerate() {
            let need = Need { container: i, share: c.per_gpu(), gpus: usize::try_from(c.gpus).unwrap_or(usize::MAX) };
            if c.role.is_long_running() {
                self.long.push(need);
            } else {
                self.init.push(need);
            }
        }
        // Biggest long-running containers first: fewer dead ends in the search.
        self.long.sort_by_key(|n| (std::cmp::Reverse(n.share), std::cmp::Reverse(n.gpus), n.container));
        if self.cands.len() < self.long.len() {
            self.cands.resize_with(self.long.len(), Vec::new);
        }
    }

    /// Whether the long-running containers' memory fits in the sum of `room` at all.
    fn long_total_fits(&self, room: &[Mib]) -> bool {
        let total: u128 = room.iter().map(|m| u128::from(m.get())).sum();
        let need: u128 = self.long.iter().map(|n| u128::from(n.share.get()) * n.gpus as u128).sum();
        need <= total
    }

    /// With init containers, a second search where the long-running containers prefer GPUs
    /// with room for the largest init container too, so that it can run where they will: init
    /// 20 000 + app 1 000 then takes 20 000 on one GPU rather than 1 000 on the fullest GPU and
    /// 20 000 on another. The placement with the smaller footprint wins; the first on a tie.
    fn colocated(&mut self) {
        let Some(largest) = self.init.iter().map(|n| n.share).max() else { return };
        if self.long.is_empty() {
            return;
        }
        let total = |foot: &[Mib]| foot.iter().map(|m| u128::from(m.get())).sum::<u128>();
        let (shares, foot) = (self.shares.clone(), self.foot.clone());
        self.colocate = Some(largest);
        let found = self.search();
        self.colocate = None;
        if !found || total(&self.foot) >= total(&foot) {
            self.shares = shares;
            self.foot = foot;
        }
    }

    /// Exact bounded search; on success `shares` and `foot` describe the placement.
    fn search(&mut self) -> bool {
        self.load.clear();
        self.load.resize(self.cap.len(), Mib::ZERO);
        self.shares.clear();
        self.budget = SEARCH_BUDGET;
        self.place_long(0)
    }

    fn place_long(&mut self, depth: usize) -> bool {
        let Some(&need) = self.long.get(depth) else {
            return self.place_inits();
        };
        let mut cands = std::mem::take(&mut self.cands[depth]);
        cands.clear();
        for p in 0..self.cap.len() {
            let room = self.free[p].saturating_sub(self.load[p]);
            if self.cap[p] > Mib::ZERO && room >= need.share {
                let key = policy_key(self.policy, room) >> 1;
                // Searching for a colocated placement: GPUs too small for the init container last.
                let last = self.colocate.is_some_and(|m| self.free[p] < m);
                cands.push((key | (u64::from(last) << 63), p));
            }
        }
        let ok = if cands.len() < need.gpus {
            false
        } else if need.gpus == 1 && cands.len() > 1 {
            // The usual case: try the policy's favourite first, and sort the rest only if the
            // search has to come back here.
            cands.select_nth_unstable(0);
            self.combos(depth, need, 0, &cands[..1]) || {
                cands[1..].sort_unstable();
                self.combos(depth, need, 1, &cands)
            }
        } else {
            cands.sort_unstable();
            self.combos(depth, need, 0, &cands)
        };
        self.cands[depth] = cands;
        ok
    }

    /// Tries every `need.gpus`-subset of `cands` (in policy order) for the container at `depth`.
    fn combos(&mut self, depth: usize, need: Need, start: usize, cands: &[(u64, usize)]) -> bool {
        let chosen = self.combo.len() - self.combo_base(depth);
        if chosen == need.gpus {
            if self.budget == 0 {
                return false;
            }
            self.budget -= 1;
            let base = self.combo_base(depth);
            for i in base..self.combo.len() {
                let p = self.combo[i];
                self.load[p] = self.load[p].saturating_add(need.share);
                self.shares.push(Share { container: need.container, gpu: p, mib: need.share });
            }
            if self.place_long(depth + 1) {
                return true;
            }
            for i in base..self.combo.len() {
                let p = self.combo[i];
                self.load[p] = self.load[p].saturating_sub(need.share);
                self.shares.pop();
            }
            return false;
        }
        let missing = need.gpus - chosen;
        for j in start..cands.len() {
            if cands.len() - j < missing || self.budget == 0 {
                break;
            }
            self.combo.push(cands[j].1);
            let ok = self.combos(depth, need, j + 1, cands);
            self.combo.pop();
            if ok {
                return true;
            }
        }
        false
    }

    /// Where the GPUs chosen at `depth` start in `combo`: the sum of the GPU counts above it.
    fn combo_base(&self, depth: usize) -> usize {
        self.long.iter().take(depth).map(|n| n.gpus).sum()
    }

    /// Init containers, each independent of the others once the sidecars are placed.
    fn place_inits(&mut self) -> bool {
        let n = self.cap.len();
        self.foot.clear();
        self.foot.extend_from_slice(&self.load);
        let long_shares = self.shares.len();
        let mut cands = std::mem::take(&mut self.init_cands);
        let ok = self.place_inits_with(n, long_shares, &mut cands);
        self.init_cands = cands;
        ok
    }

    fn place_inits_with(&mut self, n: usize, long_shares: usize, cands: &mut Vec<(bool, u64, usize)>) -> bool {
        for idx in 0..self.init.len() {
            let need = self.init[idx];
            self.before.clear();
            self.before.resize(n, Mib::ZERO);
            for s in &self.shares[..long_shares] {
                if s.container < need.container && self.sidecar.get(s.container).copied().unwrap_or(false) {
                    self.before[s.gpu] = self.before[s.gpu].saturating_add(s.mib);
                }
            }
            cands.clear();
            for p in 0..n {
                let room = self.free[p].saturating_sub(self.before[p]);
                if self.cap[p] > Mib::ZERO && room >= need.share {
                    // GPUs the pod's long-running containers hold first, then policy order.
                    cands.push((self.load[p] == Mib::ZERO, policy_key(self.policy, room), p));
                }
            }
            if cands.len() < need.gpus {
                // Leave `shares` as the caller expects to unwind it.
                self.shares.truncate(long_shares);
                return false;
            }
            // Only the best `need.gpus` matter: no full sort.
            if need.gpus < cands.len() {
                cands.select_nth_unstable(need.gpus - 1);
            }
            for &(_, _, p) in &cands[..need.gpus] {
                self.foot[p] = self.foot[p].max(self.before[p].saturating_add(need.share));
                self.shares.push(Share { container: need.container, gpu: p, mib: need.share });
            }
        }
        true
    }
}

/// Whether `c` alone finds `c.gpus` GPUs with room for its share.
fn fits_alone(room: &[Mib], c: &ContainerRequest) -> bool {
    let fitting = room.iter().filter(|f| **f >= c.per_gpu()).count();
    usize::try_from(c.gpus).is_ok_and(|k| fitting >= k)
}

/// Sort key of a GPU with `room` free: ascending keys are the policy's order of preference
/// (positions break ties, lowest first).
fn policy_key(policy: GpuPolicy, room: Mib) -> u64 {
    match policy {
        GpuPolicy::Binpack => room.get(),
        GpuPolicy::Spread => u64::MAX - room.get(),
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

fn gpu_states(node: NodeView<'_>) -> Vec<GpuState> {
    let unit = node.inventory.unit();
    node.inventory
        .gpus()
        .iter()
        .zip(node.used)
        .map(|(g, used)| GpuState {
            index: g.index,
            capacity: g.capacity(unit),
            free: g.capacity(unit).saturating_sub(*used),
            unusable: match (&g.health, g.cordoned) {
                _ if g.mode == crate::inventory::SharingMode::Whole => Some(Unusable::Whole),
                _ if g.mode.is_dra() => Some(Unusable::Dra),
                (Health::Unhealthy { reason }, _) => Some(Unusable::Unhealthy(reason.clone())),
                (Health::Healthy, true) => Some(Unusable::Cordoned),
                (Health::Healthy, false) => None,
            },
        })
        .collect()
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
