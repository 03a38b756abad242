//! `[kubelet] advertise = "capacity"`: the node's GPU memory kept in its Node's status as a
//! count of units, capacity and allocatable, patched through the API server as Kubernetes'
//! "advertise extended resources for a node" does, instead of one device per unit. The kubelet
//! then admits a pod by the count alone and calls no plugin; each container gets its GPU as the
//! runtime creates it ([`crate::nri`]). The kubelet keeps such a count through its restarts, but
//! a Node deleted and registered again has lost it, and a GPU's health changes it: the Node is
//! watched, and the count written again whenever the Node's differs from [`units`].

use std::sync::Arc;

use futures::StreamExt as _;
use gpushare_core::NodeInventory;
use gpushare_core::devices::DeviceMap;
use gpushare_core::retry::Backoff;
use gpushare_core::units::parse_quantity;
use kube::api::{Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, Client};

use crate::allocation::allocator::Allocator;
use crate::cluster::objects::NodeCapacity;

/// The units the kubelet may admit: those of every healthy GPU shared through the memory
/// resource, as many as the device plugin would list healthy.
#[must_use]
pub fn units(inventory: &NodeInventory) -> u64 {
    let devices = DeviceMap::new(inventory);
    inventory.gpus().iter().enumerate().filter(|(_, g)| g.health.is_healthy()).map(|(pos, _)| devices.units(pos)).sum()
}

/// Whether the Node's status already carries `units` of `resource`, in capacity and in
/// allocatable.
#[must_use]
pub fn carries(node: &NodeCapacity, resource: &str, units: u64) -> bool {
    let is = |quantities: &std::collections::BTreeMap<String, String>| {
        quantities.get(resource).and_then(|q| parse_quantity(q).ok()).is_some_and(|q| q.value == units)
    };
    is(&node.status.capacity) && is(&node.status.allocatable)
}

/// Keeps the count of `alloc`'s memory resource in Node `node`'s status, forever: written when
/// the watch shows the Node without it (or with another count), and again after every change
/// of the GPUs' health. A Node that does not exist yet (the kubelet has not registered it) is
/// written once it appears.
pub async fn run(client: Client, node: String, alloc: Arc<Allocator>) {
    let api: Api<NodeCapacity> = Api::all(client);
    let resource = alloc.resource().to_owned();
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let mut stream = watcher(api.clone(), config).boxed();
    let mut changes = alloc.subscribe();
    // The Node as last seen, or as last written; `None` while there is none.
    let mut shown: Option<NodeCapacity> = None;
    let mut backoff = Backoff::per_node();
    loop {
        let want = units(&alloc.current_inventory());
        if let Some(seen) = shown.as_mut()
            && !carries(seen, &resource, want)
        {
            let body = serde_json::json!({ "status": {
                "capacity": { &resource: want.to_string() },
                "allocatable": { &resource: want.to_string() },
            }});
            match api.patch_status(&node, &PatchParams::default(), &Patch::Merge(&body)).await {
                Ok(n) => {
                    tracing::info!(node = %node, resource = %resource, units = want, "the Node's status carries the GPU memory as a count");
                    backoff.succeeded();
                    *seen = n;
                }
                Err(e) => {
                    let wait = backoff.failed(500);
                    tracing::warn!(node = %node, resource = %resource, error = %e, retry_in = ?wait, "cannot write the GPU memory's count into the Node's status");
                    tokio::time::sleep(wait).await;
                    continue;
                }
            }
        }
        tokio::select! {
            event = stream.next() => match event {
                Some(Ok(watcher::Event::Apply(n) | watcher::Event::InitApply(n))) => shown = Some(n),
                Some(Ok(watcher::Event::Delete(_))) => shown = None,
                Some(Ok(watcher::Event::Init | watcher::Event::InitDone)) => {}
                Some(Err(e)) => {
                    let wait = backoff.failed(500);
                    tracing::warn!(node = %node, error = %e, retry_in = ?wait, "the Node watch failed");
                    tokio::time::sleep(wait).await;
                }
                None => return,
            },
            changed = changes.changed() => if changed.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use gpushare_core::{Gpu, GpuUuid, Health, MemoryUnit, Mib};

    use super::*;

    fn node(capacity: &[(&str, &str)], allocatable: &[(&str, &str)]) -> NodeCapacity {
        let map = |kv: &[(&str, &str)]| kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        let mut n = NodeCapacity::default();
        n.status.capacity = map(capacity);
        n.status.allocatable = map(allocatable);
        n
    }

    #[test]
    fn counts_the_units_of_healthy_gpus_only() {
        let gpus = (0..3).map(|i| Gpu::new(i, GpuUuid::new(format!("GPU-{i}")).unwrap(), "A100", Mib::new(16_384)));
        let mut inventory = NodeInventory::new(MemoryUnit::Mib, gpus.collect()).unwrap();
        assert_eq!(units(&inventory), 3 * 16_384);
        inventory.gpu_mut(1).unwrap().health = Health::Unhealthy { reason: "Xid 79".into() };
        assert_eq!(units(&inventory), 2 * 16_384);
    }

    #[test]
    fn a_node_carries_the_count_only_in_both_capacity_and_allocatable() {
        let r = "gpushare.io/gpu-mem";
        assert!(carries(&node(&[(r, "131072")], &[(r, "131072")]), r, 131_072));
        // The API server writes 4000 as "4k".
        assert!(carries(&node(&[(r, "4k")], &[(r, "4k")]), r, 4000));
        assert!(!carries(&node(&[(r, "131072")], &[]), r, 131_072), "allocatable lacks it");
        assert!(!carries(&node(&[], &[(r, "131072")]), r, 131_072), "capacity lacks it");
        assert!(!carries(&node(&[(r, "65536")], &[(r, "65536")]), r, 131_072), "another count");
        assert!(!carries(&node(&[(r, "1.5")], &[(r, "1.5")]), r, 1), "not a whole number");
        assert!(!carries(&node(&[("other", "1")], &[("other", "1")]), r, 1));
    }
}
