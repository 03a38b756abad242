//! The live ledger rows as the allocator keeps them in memory ([`Held`]), and the indexes its
//! calls read on every kubelet call: which containers of a pod hold rows, and which rows a
//! device set begins with. The ledger is the durable truth; this mirror is loaded from it at
//! start and changed after each commit, only through [`HeldRows`], so the indexes never drift
//! from the rows (a proptest checks them against a plain scan of the rows). The indexes hash
//! with foldhash, not the standard library's `SipHash`: a `GetPreferredAllocation` looks up each
//! device the kubelet offers (in MiB mode up to 131,072 a call), and the keys are device IDs and
//! the API server's pod UIDs, which no tenant chooses.

use std::collections::BTreeSet;

use foldhash::HashMap;
use std::ops::Deref;
use std::sync::Arc;

use gpushare_core::codec::node::PodRef;
use gpushare_core::{ContainerRole, GpuUuid, Mib};

use crate::allocation::ledger::{Row, key_hash};

/// A live ledger row, as the allocator keeps it in memory (the ledger is the durable truth;
/// this mirror is loaded from it at start and updated after each commit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Held {
    /// [`key_hash`] of the row's device set: most `Allocate` calls are for a new set, and this
    /// tells them so without reading the ledger.
    pub key_hash: u64,
    /// The ledger row.
    pub id: i64,
    /// The pod holding it.
    pub pod: PodRef,
    /// The container holding it.
    pub container: String,
    /// How the container runs (its memory counts by the core's footprint rule).
    pub role: ContainerRole,
    /// The GPU.
    pub gpu: GpuUuid,
    /// The GPU's index.
    pub gpu_index: u32,
    /// Memory held.
    pub mib: Mib,
    /// One device of the set (the kubelet holds a set entirely or not at all), for releasing
    /// the rows whose devices the kubelet offers as free.
    pub first_device: Option<String>,
    /// When it was allocated, Unix ms.
    pub allocated_at: i64,
}

impl From<&Row> for Held {
    fn from(r: &Row) -> Self {
        Held {
            key_hash: key_hash(&r.request_key),
            id: r.id,
            pod: r.pod.clone(),
            container: r.container.clone(),
            role: r.role,
            gpu: r.gpu_uuid.clone(),
            gpu_index: r.gpu_index,
            mib: r.mib,
            first_device: r.device_ids.first().cloned(),
            allocated_at: r.allocated_at,
        }
    }
}

/// The live rows in allocation order, indexed by pod and by a set's first device. Reads see a
/// slice of rows (`Deref`); changes go through [`HeldRows::extend`] and
/// [`HeldRows::remove_where`], which keep the indexes in step.
#[derive(Debug, Default)]
pub(super) struct HeldRows {
    rows: Vec<Arc<Held>>,
    /// Pod UID → its rows.
    by_pod: HashMap<String, Vec<Arc<Held>>>,
    /// A set's first device → the rows of sets that begin with it.
    by_first_device: HashMap<String, Vec<Arc<Held>>>,
}

impl Deref for HeldRows {
    type Target = [Arc<Held>];

    fn deref(&self) -> &[Arc<Held>] {
        &self.rows
    }
}

impl FromIterator<Arc<Held>> for HeldRows {
    fn from_iter<I: IntoIterator<Item = Arc<Held>>>(rows: I) -> Self {
        let mut held = HeldRows::default();
        held.extend(rows);
        held
    }
}

impl HeldRows {
    /// Adds rows just committed, after those already held.
    pub(super) fn extend(&mut self, rows: impl IntoIterator<Item = Arc<Held>>) {
        for h in rows {
            self.by_pod.entry(h.pod.uid.clone()).or_default().push(Arc::clone(&h));
            if let Some(first) = &h.first_device {
                self.by_first_device.entry(first.clone()).or_default().push(Arc::clone(&h));
            }
            self.rows.push(h);
        }
    }

    /// Removes the rows `gone` picks (their ledger rows were released) and returns them, in
    /// allocation order.
    pub(super) fn remove_where(&mut self, mut gone: impl FnMut(&Held) -> bool) -> Vec<Arc<Held>> {
        let (removed, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.rows).into_iter().partition(|h| gone(h));
        self.rows = kept;
        for h in &removed {
            unindex(&mut self.by_pod, &h.pod.uid, h);
            if let Some(first) = &h.first_device {
                unindex(&mut self.by_first_device, first, h);
            }
        }
        removed
    }

    /// Whether `container` of pod `uid` holds a row.
    pub(super) fn holds(&self, uid: &str, container: &str) -> bool {
        self.by_pod.get(uid).is_some_and(|rows| rows.iter().any(|h| h.container == container))
    }

    /// Whether any container of pod `uid` holds a row.
    pub(super) fn holds_any(&self, uid: &str) -> bool {
        self.by_pod.contains_key(uid)
    }

    /// The rows allocated at `since` or later whose set begins with one of `devices`, leaving
    /// out sets that begin with one of `except`.
    pub(super) fn recent_beginning_with<'d>(
        &self,
        devices: impl IntoIterator<Item = &'d str>,
        since: i64,
        except: &[String],
    ) -> BTreeSet<i64> {
        devices
            .into_iter()
            .filter(|d| !except.iter().any(|e| e == d))
            .filter_map(|d| self.by_first_device.get(d))
            .flatten()
            .filter(|h| h.allocated_at >= since)
            .map(|h| h.id)
            .collect()
    }
}

/// Drops `row` from `index[key]`, and the key once it indexes nothing.
fn unindex(index: &mut HashMap<String, Vec<Arc<Held>>>, key: &str, row: &Arc<Held>) {
    if let Some(rows) = index.get_mut(key) {
        rows.retain(|h| !Arc::ptr_eq(h, row));
        if rows.is_empty() {
            index.remove(key);
        }
    }
}

#[cfg(test)]
mod tests;
