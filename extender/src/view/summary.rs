//! Each node's placement figures in one small record, and the node names that find them: what
//! filter and prioritize read for the common pod (one container on one or more GPUs), so that a
//! 5,000-node request looks at one contiguous table instead of three scattered objects per node.
//!
//! The records are a cache of the view's own per-node state (inventory and usage totals): the
//! view rewrites a node's record whenever it computes or drops that node's usage, and a node
//! without a record (usage not computed yet, more than [`INLINE_GPUS`] GPUs, figures too large)
//! is simply decided the long way.

use std::hash::Hasher as _;

use gpushare_core::placement::{NodePolicy, node_score};
use gpushare_core::{MemoryUnit, Mib, PodRequest};

use super::FxHasher;

/// GPUs a record holds; nodes with more are decided the long way.
pub const INLINE_GPUS: usize = 8;

/// Distinct request sizes of the pods a node is admitting that a record lists; with more,
/// every pod with a first request is sent the long way on that node.
pub const LOOKALIKE_SIZES: usize = 4;

/// One node's figures as placement sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Summary {
    /// The unit its daemon counts in.
    pub unit: MemoryUnit,
    /// Free memory (capacity in the unit minus usage) per GPU position; 0 for a GPU that takes
    /// no allocation (unhealthy, cordoned, or no capacity in the unit).
    pub free: [u32; INLINE_GPUS],
    /// Sum of the capacities of the GPUs that take allocations.
    pub capacity: u64,
    /// Sum over those GPUs of their usage, each capped at its capacity.
    pub used: u64,
    /// Distinct request sizes (MiB) of the containers of the pods the node is admitting, in
    /// `lookalikes[..lookalike_count]`; `None` count when there are more than fit (or a size
    /// does not fit in 32 bits).
    pub lookalikes: [u32; LOOKALIKE_SIZES],
    /// How many of `lookalikes` are set; `None` when unknown (too many).
    pub lookalike_count: Option<u8>,
    /// When the node's daemon turns stale unless it renews its heartbeat (the view's clock);
    /// `None` for daemons that publish no heartbeat. Kept here so that filter and prioritize
    /// need no second lookup per node.
    pub stale_at: Option<std::time::Instant>,
}

/// The shape a summary decides: every GPU container of the pod is one container asking for
/// `gpus` GPUs with `share` on each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Memory per GPU, more than zero.
    pub share: u64,
    /// GPUs, at least one.
    pub gpus: usize,
    /// The unit the request was read in.
    pub unit: MemoryUnit,
    /// The pod's one request size (for look-alikes).
    pub first: Option<u64>,
}

impl Shape {
    /// The shape of `pod`, when a summary can decide it.
    #[must_use]
    pub fn of(pod: &PodRequest) -> Option<Shape> {
        let [c] = pod.containers() else { return None };
        let share = c.per_gpu().get();
        let gpus = usize::try_from(c.gpus).ok().filter(|g| *g >= 1)?;
        (share > 0).then(|| Shape { share, gpus, unit: pod.unit(), first: pod.first_request().map(Mib::get) })
    }
}

impl Summary {
    /// Whether the node's daemon is presumed gone at `now`: its heartbeat not renewed in time.
    #[must_use]
    pub fn is_stale_at(&self, now: std::time::Instant) -> bool {
        self.stale_at.is_some_and(|t| now > t)
    }

    /// How many GPUs have room for `share`.
    #[must_use]
    pub fn gpus_with_room(&self, share: u64) -> usize {
        self.free.iter().filter(|f| u64::from(**f) >= share).count()
    }

    /// Whether the pod certainly fits (`Some(true)`), or the record cannot say (`None`: the
    /// placer decides, and says why not).
    #[must_use]
    pub fn fits(&self, shape: &Shape) -> Option<bool> {
        (shape.unit == self.unit && self.gpus_with_room(shape.share) >= shape.gpus).then_some(true)
    }

    /// The node's score (0–`MAX_SCORE`) for the pod under `policy`, when it fits: the GPUs it
    /// lands on each take `share` without reaching their capacity, whichever they are, so the
    /// core's [`node_score`] of the sums is the placer's score.
    #[must_use]
    pub fn score(&self, shape: &Shape, policy: NodePolicy) -> Option<u8> {
        self.fits(shape)?;
        let added = u128::from(shape.share) * shape.gpus as u128;
        Some(node_score(u128::from(self.used) + added, u128::from(self.capacity), policy))
    }

    /// Whether the node may be admitting a pod with a request of size `first` (then the long
    /// way checks exactly).
    #[must_use]
    pub fn may_admit_lookalike(&self, first: Option<u64>) -> bool {
        let Some(first) = first else { return false };
        match self.lookalike_count {
            None => true,
            Some(n) => self.lookalikes[..usize::from(n)].iter().any(|s| u64::from(*s) == first),
        }
    }
}

/// Builds a record from a node's inventory figures: per GPU position (whether it takes
/// allocations, capacity in the unit, usage), and the request sizes of the pods it is
/// admitting. `None` when the node does not fit a record.
#[must_use]
pub fn summarize(
    unit: MemoryUnit,
    gpus: impl ExactSizeIterator<Item = (bool, Mib, Mib)>,
    admitting: impl Iterator<Item = Option<Mib>>,
) -> Option<Summary> {
    if gpus.len() > INLINE_GPUS {
        return None;
    }
    let mut s = Summary {
        unit,
        free: [0; INLINE_GPUS],
        capacity: 0,
        used: 0,
        lookalikes: [0; LOOKALIKE_SIZES],
        lookalike_count: Some(0),
        stale_at: None,
    };
    for (i, (schedulable, cap, used)) in gpus.enumerate() {
        if !schedulable || cap == Mib::ZERO {
            continue;
        }
        s.free[i] = u32::try_from(cap.saturating_sub(used).get()).ok()?;
        s.capacity = s.capacity.checked_add(cap.get())?;
        s.used = s.used.checked_add(used.min(cap).get())?;
    }
    for first in admitting.flatten() {
        let Some(n) = s.lookalike_count else { break };
        let n = usize::from(n);
        let Ok(size) = u32::try_from(first.get()) else {
            s.lookalike_count = None;
            break;
        };
        if s.lookalikes[..n].contains(&size) {
            continue;
        }
        if n == LOOKALIKE_SIZES {
            s.lookalike_count = None;
            break;
        }
        s.lookalikes[n] = size;
        s.lookalike_count = u8::try_from(n + 1).ok();
    }
    Some(s)
}

#[derive(Clone, Debug)]
struct Slot {
    hash: u64,
    /// The name's place in `NodeTable::names`.
    start: u32,
    len: u32,
    /// False once the node is removed (the record waits in `vacant` for reuse).
    live: bool,
    summary: Option<Summary>,
}

/// Node name → [`Summary`]: an open-addressed table (linear probing) of record numbers over
/// records kept side by side, the names packed in one string. A lookup reads one bucket, one
/// record and the name's bytes, all from small contiguous arrays.
#[derive(Clone, Debug, Default)]
pub struct NodeTable {
    /// Record number + 1 per bucket, 0 when empty; a power of two long, at most half full.
    buckets: Vec<u32>,
    slots: Vec<Slot>,
    /// Records no longer used.
    vacant: Vec<u32>,
    names: String,
    /// Bytes of `names` that belong to removed nodes.
    dead: usize,
    len: usize,
}

fn hash_of(name: &str) -> u64 {
    let mut h = FxHasher::default();
    h.write(name.as_bytes());
    h.finish()
}

impl NodeTable {
    /// Nodes in the table.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the table is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn home(&self, hash: u64) -> usize {
        // FxHash's high bits are its best mixed.
        let bits = self.buckets.len().trailing_zeros();
        usize::try_from(hash >> (64 - bits)).unwrap_or(0)
    }

    fn name_of(&self, slot: &Slot) -> &str {
        let start = slot.start as usize;
        self.names.get(start..start + slot.len as usize).unwrap_or("")
    }

    /// The bucket holding `name`, or the empty bucket where it would go.
    fn find(&self, name: &str, hash: u64) -> (usize, Option<usize>) {
        let mask = self.buckets.len() - 1;
        let mut b = self.home(hash);
        loop {
            let Some(r) = self.buckets[b].checked_sub(1) else { return (b, None) };
            let r = r as usize;
            let slot = &self.slots[r];
            if slot.hash == hash && self.name_of(slot) == name {
                return (b, Some(r));
            }
            b = (b + 1) & mask;
        }
    }

    /// The record of `name`, when the node is known and has one.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&Summary> {
        if self.len == 0 {
            return None;
        }
        let (_, r) = self.find(name, hash_of(name));
        self.slots[r?].summary.as_ref()
    }

    /// Whether `name` is in the table (with or without a record).
    #[must_use]
    pub fn contains(&self, name: &str) -> bool {
        self.len > 0 && self.find(name, hash_of(name)).1.is_some()
    }

    /// Sets the record of `name`, adding the node if new.
    pub fn set(&mut self, name: &str, summary: Option<Summary>) {
        let hash = hash_of(name);
        if !self.buckets.is_empty()
            && let (_, Some(r)) = self.find(name, hash)
        {
            self.slots[r].summary = summary;
            return;
        }
        if (self.len + 1) * 2 > self.buckets.len() {
            self.grow();
        }
        if self.dead > 4096 && self.dead * 2 > self.names.len() {
            self.compact();
        }
        let (Ok(start), Ok(len)) = (u32::try_from(self.names.len()), u32::try_from(name.len())) else {
            return; // over 4 GiB of names: that node is decided the long way
        };
        self.names.push_str(name);
        let slot = Slot { hash, start, len, live: true, summary };
        let r = match self.vacant.pop() {
            Some(r) => {
                self.slots[r as usize] = slot;
                r
            }
            None => {
                self.slots.push(slot);
                u32::try_from(self.slots.len() - 1).unwrap_or(u32::MAX)
            }
        };
        let (b, _) = self.find(name, hash);
        self.buckets[b] = r + 1;
        self.len += 1;
    }

    /// Removes `name`.
    pub fn remove(&mut self, name: &str) {
        if self.len == 0 {
            return;
        }
        let (mut hole, Some(r)) = self.find(name, hash_of(name)) else { return };
        self.buckets[hole] = 0;
        self.dead += name.len();
        self.slots[r].summary = None;
        self.slots[r].live = false;
        self.vacant.push(u32::try_from(r).unwrap_or(u32::MAX));
        self.len -= 1;
        // Shift the rest of the run back so that no lookup stops early at the hole.
        let mask = self.buckets.len() - 1;
        let mut b = hole;
        loop {
            b = (b + 1) & mask;
            let Some(moved) = self.buckets[b].checked_sub(1) else { break };
            let home = self.home(self.slots[moved as usize].hash);
            let stays = if hole <= b { hole < home && home <= b } else { hole < home || home <= b };
            if !stays {
                self.buckets[hole] = self.buckets[b];
                self.buckets[b] = 0;
                hole = b;
            }
        }
    }

    fn grow(&mut self) {
        let size = (self.buckets.len() * 2).max(16);
        self.buckets = vec![0; size];
        let mask = size - 1;
        for (r, slot) in self.slots.iter().enumerate() {
            if !slot.live {
                continue;
            }
            let mut b = self.home(slot.hash);
            while self.buckets[b] != 0 {
                b = (b + 1) & mask;
            }
            self.buckets[b] = u32::try_from(r + 1).unwrap_or(u32::MAX);
        }
    }

    /// Packs the names of the nodes still there.
    fn compact(&mut self) {
        let mut names = String::with_capacity(self.names.len() - self.dead);
        for slot in &mut self.slots {
            if !slot.live {
                continue;
            }
            let start = slot.start as usize;
            let name = self.names.get(start..start + slot.len as usize).unwrap_or("");
            slot.start = u32::try_from(names.len()).unwrap_or(u32::MAX);
            names.push_str(name);
        }
        self.names = names;
        self.dead = 0;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn record(free: u32) -> Summary {
        summarize(
            MemoryUnit::Mib,
            [(true, Mib::new(100), Mib::new(u64::from(100 - free)))].into_iter(),
            std::iter::empty(),
        )
        .unwrap()
    }

    #[test]
    fn table_follows_a_map_through_inserts_updates_and_removals() {
        let mut table = NodeTable::default();
        let mut map: HashMap<String, Option<Summary>> = HashMap::new();
        // A fixed pseudo-random walk: many removals, so runs get shifted and names compacted.
        let mut x: u64 = 12345;
        for step in 0..60_000u32 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let name = format!("node-{}", (x >> 33) % 3000);
            match (x >> 20) % 5 {
                0 | 1 => {
                    table.remove(&name);
                    map.remove(&name);
                }
                2 => {
                    table.set(&name, None);
                    map.insert(name.clone(), None);
                }
                _ => {
                    let s = Some(record(step % 100));
                    table.set(&name, s);
                    map.insert(name.clone(), s);
                }
            }
            if step % 997 == 0 {
                assert_eq!(table.len(), map.len());
                for i in 0..3000 {
                    let name = format!("node-{i}");
                    assert_eq!(table.contains(&name), map.contains_key(&name), "{name}");
                    assert_eq!(table.get(&name), map.get(&name).copied().flatten().as_ref(), "{name}");
                }
            }
        }
        assert!(table.names.len() < 200_000, "names are compacted: {} bytes", table.names.len());
    }

    #[test]
    fn records_count_only_gpus_that_take_allocations() {
        let s = summarize(
            MemoryUnit::Mib,
            [
                (true, Mib::new(100), Mib::new(30)),
                (false, Mib::new(100), Mib::ZERO),
                (true, Mib::ZERO, Mib::ZERO),
                (true, Mib::new(50), Mib::new(80)),
            ]
            .into_iter(),
            [Some(Mib::new(7)), None, Some(Mib::new(7)), Some(Mib::new(9))].into_iter(),
        )
        .unwrap();
        assert_eq!(s.free[..4], [70, 0, 0, 0]);
        assert_eq!((s.capacity, s.used), (150, 80));
        assert_eq!(s.lookalike_count, Some(2));
        assert!(s.may_admit_lookalike(Some(7)) && s.may_admit_lookalike(Some(9)));
        assert!(!s.may_admit_lookalike(Some(8)) && !s.may_admit_lookalike(None));
        let many = summarize(MemoryUnit::Mib, std::iter::empty(), (1..=5).map(|m| Some(Mib::new(m)))).unwrap();
        assert_eq!(many.lookalike_count, None);
        assert!(many.may_admit_lookalike(Some(100)));
        let nine = (0..9).map(|_| (true, Mib::new(1), Mib::ZERO)).collect::<Vec<_>>();
        assert!(summarize(MemoryUnit::Mib, nine.into_iter(), std::iter::empty()).is_none());
    }
}
