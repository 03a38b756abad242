//! Whether a GPU has room for new rows by the ledger: every pod's footprint on it (its init
//! containers counted by the core's rule, [`footprint`]) plus what the new rows add must stay
//! within the GPU's capacity. Pure: the held rows and the node's GPUs in, a refusal out.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use gpushare_core::placement::footprint;
use gpushare_core::{ContainerRole, GpuUuid, Mib, NodeInventory};

use super::AllocError;
use super::resolve::Held;
use crate::allocation::ledger::NewRow;

type PodRows = BTreeMap<String, Vec<(ContainerRole, GpuUuid, Mib)>>;

fn used(pods: &PodRows) -> BTreeMap<GpuUuid, Mib> {
    let mut used: BTreeMap<GpuUuid, Mib> = BTreeMap::new();
    for rows in pods.values() {
        for (g, m) in footprint(rows.iter().map(|(role, g, m)| (*role, [(g.clone(), *m)]))) {
            let e = used.entry(g).or_insert(Mib::ZERO);
            *e = e.saturating_add(m);
        }
    }
    used
}

/// Refuses `new` rows (for pod `pod_name`) that would take a GPU of `inventory` past its
/// capacity, counting every pod's footprint in `held`.
pub(super) fn check_room(
    inventory: &NodeInventory,
    held: &[Arc<Held>],
    new: &[NewRow],
    pod_name: &str,
) -> Result<(), AllocError> {
    let gpus: BTreeSet<&GpuUuid> = new.iter().map(|r| &r.gpu_uuid).collect();
    let mut pods: PodRows = BTreeMap::new();
    for h in held.iter().filter(|h| gpus.contains(&h.gpu)) {
        pods.entry(h.pod.uid.clone()).or_default().push((h.role, h.gpu.clone(), h.mib));
    }
    let before = used(&pods);
    for r in new {
        pods.entry(r.pod.uid.clone()).or_default().push((r.role, r.gpu_uuid.clone(), r.mib));
    }
    let after = used(&pods);
    for r in new {
        let Some(gpu) = inventory.gpus().iter().find(|g| g.uuid == r.gpu_uuid) else { continue };
        let cap = gpu.capacity(inventory.unit());
        if after.get(&r.gpu_uuid).copied().unwrap_or_default() > cap {
            return Err(AllocError::NoRoom {
                pod: pod_name.to_owned(),
                container: r.container.clone(),
                index: gpu.index,
                free: cap.saturating_sub(before.get(&r.gpu_uuid).copied().unwrap_or_default()),
                needs: r.mib,
            });
        }
    }
    Ok(())
}
