//! The placement search: a reusable [`Placer`] that gives each of a pod's containers its GPUs
//! under a GPU-level policy, exactly for small pods (a depth-first search over GPU choices,
//! bounded by [`SEARCH_BUDGET`]), with scratch buffers reused from node to node.

use super::rejection::{Rejection, gpu_states};
use super::{GpuPolicy, MAX_SCORE, NodePolicy, NodeView, Placement, Share, node_score};
use crate::request::{ContainerRequest, ContainerRole, PodRequest};
use crate::units::Mib;

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
