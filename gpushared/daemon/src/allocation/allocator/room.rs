//! Whether a GPU has room for new rows by the ledger — the one rule both paths into it follow,
//! device-plugin `Allocate` and DRA `NodePrepareResources`: every pod's footprint on the GPU
//! (its init containers counted by the core's rule, [`footprint`]) plus every live claim's
//! share, plus what the new rows add, must stay within the GPU's capacity. So neither path can
//! overcommit a GPU the other still holds memory on (a GPU moved between modes without a
//! drain). Pure: the held rows and the node's GPUs in, a refusal out.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use gpushare_core::placement::footprint;
use gpushare_core::{ContainerRole, Gpu, GpuUuid, Mib, NodeInventory};

use super::AllocError;
use super::held::Held;
use crate::allocation::ledger::{ClaimRow, NewClaimRow, NewRow};

/// What the ledger holds on some GPUs: each pod's rows, counted by the footprint rule, and
/// each claim's shares, counted as they are.
#[derive(Clone, Default)]
struct Load<'a> {
    pods: BTreeMap<&'a str, Vec<(ContainerRole, &'a GpuUuid, Mib)>>,
    claims: BTreeMap<&'a GpuUuid, Mib>,
}

impl<'a> Load<'a> {
    /// The live rows of `held` and `claims` on `gpus`.
    fn on(gpus: &BTreeSet<&GpuUuid>, held: &'a [Arc<Held>], claims: &'a [ClaimRow]) -> Self {
        let mut load = Load::default();
        for h in held.iter().filter(|h| gpus.contains(&h.gpu)) {
            load.pod_row(&h.pod.uid, h.role, &h.gpu, h.mib);
        }
        for c in claims.iter().filter(|c| gpus.contains(&c.share.gpu_uuid)) {
            load.claim(&c.share.gpu_uuid, c.share.mib);
        }
        load
    }

    fn pod_row(&mut self, uid: &'a str, role: ContainerRole, gpu: &'a GpuUuid, mib: Mib) {
        self.pods.entry(uid).or_default().push((role, gpu, mib));
    }

    fn claim(&mut self, gpu: &'a GpuUuid, mib: Mib) {
        let e = self.claims.entry(gpu).or_insert(Mib::ZERO);
        *e = e.saturating_add(mib);
    }

    /// Memory used per GPU.
    fn used(&self) -> BTreeMap<&'a GpuUuid, Mib> {
        let mut used = self.claims.clone();
        for rows in self.pods.values() {
            for (g, m) in footprint(rows.iter().map(|(role, g, m)| (*role, [(*g, *m)]))) {
                let e = used.entry(g).or_insert(Mib::ZERO);
                *e = e.saturating_add(m);
            }
        }
        used
    }
}

/// A GPU new rows would take past its limit.
#[derive(Debug)]
pub(super) struct Full<'a> {
    /// The GPU.
    pub gpu: &'a Gpu,
    /// Its limit.
    pub limit: Mib,
    /// Free before the new rows.
    pub free: Mib,
    /// What the new rows take there (by the footprint rule).
    pub needs: Mib,
}

/// The first GPU of `inventory` whose use goes past `limit(gpu)` from `before` to `after`.
fn first_full<'a>(
    inventory: &'a NodeInventory,
    before: &BTreeMap<&GpuUuid, Mib>,
    after: &BTreeMap<&GpuUuid, Mib>,
    limit: impl Fn(&Gpu) -> Mib,
) -> Option<Full<'a>> {
    after.iter().find_map(|(uuid, used)| {
        let gpu = inventory.gpus().iter().find(|g| &g.uuid == *uuid)?;
        let limit = limit(gpu);
        let was = before.get(uuid).copied().unwrap_or_default();
        (*used > limit).then(|| Full { gpu, limit, free: limit.saturating_sub(was), needs: used.saturating_sub(was) })
    })
}

/// Refuses `new` device-plugin rows (for pod `pod_name`) that would take a GPU of `inventory`
/// past its capacity in the node's unit, counting every pod in `held` and every claim.
pub(super) fn check_room(
    inventory: &NodeInventory,
    held: &[Arc<Held>],
    claims: &[ClaimRow],
    new: &[NewRow],
    pod_name: &str,
) -> Result<(), AllocError> {
    let gpus: BTreeSet<&GpuUuid> = new.iter().map(|r| &r.gpu_uuid).collect();
    let mut load = Load::on(&gpus, held, claims);
    let before = load.used();
    for r in new {
        load.pod_row(&r.pod.uid, r.role, &r.gpu_uuid, r.mib);
    }
    match first_full(inventory, &before, &load.used(), |g| g.capacity(inventory.unit())) {
        None => Ok(()),
        Some(full) => {
            // Name the first new row on that GPU (the container the refusal is about).
            let r = new.iter().find(|r| r.gpu_uuid == full.gpu.uuid);
            Err(AllocError::NoRoom {
                pod: pod_name.to_owned(),
                container: r.map(|r| r.container.clone()).unwrap_or_default(),
                index: full.gpu.index,
                free: full.free,
                needs: r.map_or(full.needs, |r| r.mib),
            })
        }
    }
}

/// The first GPU of `inventory` that one claim's `new` shares would take past its total,
/// counting every pod in `held` and every live claim.
pub(super) fn claim_room<'a>(
    inventory: &'a NodeInventory,
    held: &[Arc<Held>],
    claims: &[ClaimRow],
    new: &[NewClaimRow],
) -> Option<Full<'a>> {
    let gpus: BTreeSet<&GpuUuid> = new.iter().map(|r| &r.gpu_uuid).collect();
    let mut load = Load::on(&gpus, held, claims);
    let before = load.used();
    for r in new {
        load.claim(&r.gpu_uuid, r.mib);
    }
    first_full(inventory, &before, &load.used(), |g| g.total)
}

#[cfg(test)]
mod tests {
    use gpushare_core::codec::node::PodRef;
    use gpushare_core::{MemoryUnit, NodeInventory};

    use super::*;

    fn inventory() -> NodeInventory {
        let gpus =
            (0..2).map(|i| Gpu::new(i, GpuUuid::new(format!("GPU-{i}")).unwrap(), "T4", Mib::new(1000))).collect();
        NodeInventory::new(MemoryUnit::Mib, gpus).unwrap()
    }

    fn row(pod: &str, role: ContainerRole, gpu: u32, mib: u64) -> NewRow {
        NewRow {
            pod: PodRef { namespace: "ns".into(), name: pod.into(), uid: pod.into() },
            container: format!("{pod}-c"),
            role,
            gpu_uuid: GpuUuid::new(format!("GPU-{gpu}")).unwrap(),
            gpu_index: gpu,
            mib: Mib::new(mib),
            device_ids: Vec::new(),
        }
    }

    fn held(r: &NewRow) -> Arc<Held> {
        Arc::new(Held {
            key_hash: 0,
            id: 0,
            pod: r.pod.clone(),
            container: r.container.clone(),
            role: r.role,
            gpu: r.gpu_uuid.clone(),
            gpu_index: r.gpu_index,
            mib: r.mib,
            first_device: None,
            allocated_at: 0,
        })
    }

    fn claim(uid: &str, gpu: u32, mib: u64) -> NewClaimRow {
        NewClaimRow {
            claim_uid: uid.into(),
            namespace: "ns".into(),
            name: uid.into(),
            request: "gpu".into(),
            share_id: String::new(),
            gpu_uuid: GpuUuid::new(format!("GPU-{gpu}")).unwrap(),
            gpu_index: gpu,
            mib: Mib::new(mib),
        }
    }

    fn live(c: NewClaimRow) -> ClaimRow {
        ClaimRow { id: 0, share: c, prepared_at: 0 }
    }

    #[test]
    fn device_plugin_rows_count_the_claims_on_the_gpu() {
        // GPU0 moved from dra back to shared without a drain: its 600 MiB claim still counts.
        let inv = inventory();
        let claims = [live(claim("c", 0, 600))];
        let err = check_room(&inv, &[], &claims, &[row("p", ContainerRole::App, 0, 500)], "ns/p").unwrap_err();
        assert!(err.to_string().contains("GPU0 has 400 MiB free in the ledger, needs 500 MiB"), "{err}");
        check_room(&inv, &[], &claims, &[row("p", ContainerRole::App, 0, 400)], "ns/p").unwrap();
        // A claim on another GPU does not.
        check_room(&inv, &[], &claims, &[row("p", ContainerRole::App, 1, 1000)], "ns/p").unwrap();
    }

    #[test]
    fn claims_count_pods_by_the_init_container_rule() {
        // A pod whose init container (700) ran before its app container (200) occupies 700.
        let inv = inventory();
        let rows = [row("p", ContainerRole::Init, 0, 700), row("p", ContainerRole::App, 0, 200)];
        let held: Vec<Arc<Held>> = rows.iter().map(held).collect();
        let claims = [live(claim("a", 0, 100))];
        assert!(claim_room(&inv, &held, &claims, &[claim("b", 0, 200)]).is_none());
        let full = claim_room(&inv, &held, &claims, &[claim("b", 0, 150), claim("b", 0, 51)]).unwrap();
        assert_eq!(
            (full.gpu.index, full.limit, full.free, full.needs),
            (0, Mib::new(1000), Mib::new(200), Mib::new(201))
        );
    }
}
