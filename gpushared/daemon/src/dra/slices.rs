//! The node's ResourceSlice: one device per GPU the pool offers ([`dra::offered`]: in `dra`
//! mode, healthy, not cordoned), each allowing many allocations and carrying a `memory`
//! capacity that claims consume in whole MiB, and attributes an operator selects on. It is
//! published under the node's own credentials (the Node authorizer lets a node write slices
//! with its own `spec.nodeName`), and again whenever a GPU leaves or rejoins the pool. A node
//! that serves no GPU through DRA any more withdraws its slice ([`withdraw`]), so kube-scheduler
//! allocates nothing there that no driver would prepare.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpushare_core::{Gpu, NodeInventory, dra};
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity, ResourcePool,
    ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};

use crate::allocation::allocator::Allocator;

/// The slice's name: `<node>-<driver>`.
#[must_use]
pub fn slice_name(node: &str, driver: &str) -> String {
    format!("{node}-{driver}")
}

/// The device a GPU is in the slice.
#[must_use]
pub fn device(gpu: &Gpu) -> Device {
    let string = |s: &str| DeviceAttribute { string: Some(s.to_owned()), ..DeviceAttribute::default() };
    let int = |i: i64| DeviceAttribute { int: Some(i), ..DeviceAttribute::default() };
    let mut attributes = BTreeMap::from([
        ("model".to_owned(), string(&gpu.model)),
        ("uuid".to_owned(), string(gpu.uuid.as_str())),
        ("index".to_owned(), int(i64::from(gpu.index))),
        ("memoryMiB".to_owned(), int(i64::try_from(gpu.total.get()).unwrap_or(i64::MAX))),
        ("sharing".to_owned(), string(gpu.mode.as_str())),
    ]);
    if let Some(numa) = gpu.numa_node {
        attributes.insert("numaNode".to_owned(), int(i64::from(numa)));
    }
    let one_mib = Quantity("1Mi".to_owned());
    let memory = DeviceCapacity {
        value: Quantity(dra::memory_quantity(gpu.total)),
        request_policy: Some(CapacityRequestPolicy {
            default: Some(one_mib.clone()),
            valid_range: Some(CapacityRequestPolicyRange { min: one_mib.clone(), max: None, step: Some(one_mib) }),
            valid_values: None,
        }),
    };
    Device {
        name: dra::device_name(gpu.index),
        allow_multiple_allocations: Some(true),
        attributes: Some(attributes),
        capacity: Some(BTreeMap::from([(dra::MEMORY_CAPACITY.to_owned(), memory)])),
        ..Device::default()
    }
}

/// The node's slice for `inventory` (its GPUs as they are now).
#[must_use]
pub fn slice(driver: &str, node: &str, inventory: &NodeInventory, generation: i64) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta { name: Some(slice_name(node, driver)), ..ObjectMeta::default() },
        spec: ResourceSliceSpec {
            driver: driver.to_owned(),
            node_name: Some(node.to_owned()),
            pool: ResourcePool { name: node.to_owned(), generation, resource_slice_count: 1 },
            devices: Some(inventory.gpus().iter().filter(|g| dra::offered(g)).map(device).collect()),
            ..ResourceSliceSpec::default()
        },
    }
}

/// Keeps the node's slice in step with its GPUs: publishes it now and after every change of
/// the allocation service (health, cordons), retrying every 5 s while the API server refuses.
pub async fn run(client: kube::Client, driver: String, alloc: Arc<Allocator>) {
    let api: Api<ResourceSlice> = Api::all(client);
    let node = alloc.node().to_owned();
    let name = slice_name(&node, &driver);
    let mut changes = alloc.subscribe();
    let mut resync = tokio::time::interval_at(tokio::time::Instant::now() + RESYNC, RESYNC);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut published: Option<Vec<Device>> = None;
    loop {
        let inventory = alloc.current_inventory();
        let devices: Vec<Device> = inventory.gpus().iter().filter(|g| dra::offered(g)).map(device).collect();
        if published.as_ref() != Some(&devices) {
            match publish(&api, &driver, &node, &inventory).await {
                Ok(written) => {
                    if let Some(generation) = written {
                        tracing::info!(slice = %name, devices = devices.len(), generation, "ResourceSlice published");
                    }
                    published = Some(devices);
                }
                Err(e) => {
                    tracing::warn!(slice = %name, error = %e, "cannot publish the node's ResourceSlice; retrying in 5 s");
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    continue;
                }
            }
        }
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            // The slice as the API server has it is checked again now and then: one deleted or
            // changed by someone else is written back.
            _ = resync.tick() => published = None,
        }
    }
}

/// Deletes the slices of `driver` on `node`, if there are any (gpushared starting with no GPU
/// in `[sharing] dra`: the GPUs moved back to the device plugin). The kubelet also wipes the
/// slices of a driver that unregistered, but only after a delay, and not after a crash that
/// left the registration socket behind. A cluster without `resource.k8s.io/v1` (404) or whose
/// authorizer lets the node see no slices (403) has none of ours; any other failure is retried,
/// 5 s doubling to 5 minutes, with one warning.
pub async fn withdraw(client: kube::Client, driver: String, node: String) {
    let api: Api<ResourceSlice> = Api::all(client);
    let mut wait = Duration::from_secs(5);
    let mut warned = false;
    loop {
        match withdraw_once(&api, &driver, &node).await {
            Ok(names) => {
                for name in &names {
                    tracing::info!(slice = %name, "no GPU is served through DRA: ResourceSlice withdrawn");
                }
                // Said whoever removed them (the kubelet's startup wipe may win the race).
                tracing::info!(%node, withdrawn = names.len(), "the node's ResourceSlices are checked: none of this driver is left");
                return;
            }
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 403 => {
                tracing::debug!(%node, error = %e, "no ResourceSlices to withdraw here");
                return;
            }
            Err(e) => {
                if !warned {
                    tracing::warn!(%node, %driver, error = %e, "cannot check for a ResourceSlice to withdraw; retrying");
                    warned = true;
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(300));
            }
        }
    }
}

async fn withdraw_once(api: &Api<ResourceSlice>, driver: &str, node: &str) -> Result<Vec<String>, kube::Error> {
    let mine = api.list(&ListParams::default().fields(&format!("spec.nodeName={node}"))).await?;
    let mut deleted = Vec::new();
    for name in mine.items.into_iter().filter(|s| s.spec.driver == driver).filter_map(|s| s.metadata.name) {
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => deleted.push(name),
            // Gone meanwhile (the kubelet wiped it): what was wanted.
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(deleted)
}

/// How often the slice in the API server is compared with the node's GPUs.
const RESYNC: Duration = Duration::from_secs(60);

/// Creates the slice, or replaces the one there with the pool's next generation; returns the
/// generation written, or `None` when the slice there already lists these devices.
async fn publish(
    api: &Api<ResourceSlice>,
    driver: &str,
    node: &str,
    inventory: &NodeInventory,
) -> Result<Option<i64>, kube::Error> {
    let name = slice_name(node, driver);
    // A node may only list its own slices (by `spec.nodeName`), and may not get one that does
    // not exist yet (the Node authorizer answers 403, not 404).
    let mine = api.list(&ListParams::default().fields(&format!("spec.nodeName={node}"))).await?;
    match mine.items.into_iter().find(|s| s.metadata.name.as_deref() == Some(name.as_str())) {
        None => {
            api.create(&PostParams::default(), &slice(driver, node, inventory, 0)).await?;
            Ok(Some(0))
        }
        Some(old) => {
            let want = slice(driver, node, inventory, old.spec.pool.generation);
            if old.spec == want.spec {
                return Ok(None);
            }
            let generation = old.spec.pool.generation.saturating_add(1);
            let mut new = slice(driver, node, inventory, generation);
            new.metadata.resource_version = old.metadata.resource_version;
            api.replace(&name, &PostParams::default(), &new).await?;
            Ok(Some(generation))
        }
    }
}

#[cfg(test)]
mod tests {
    use gpushare_core::{GpuUuid, Health, MemoryUnit, Mib, SharingMode};

    use super::*;

    #[test]
    fn the_slice_offers_each_healthy_dra_gpu_with_its_memory_in_mib() {
        let gpus = (0..3)
            .map(|i| {
                let mut g = Gpu::new(i, GpuUuid::new(format!("GPU-{i}")).unwrap(), "A100", Mib::new(81_920));
                g.mode = if i == 0 { SharingMode::Shared } else { SharingMode::Dra };
                g.numa_node = Some(1);
                g
            })
            .collect();
        let mut inventory = NodeInventory::new(MemoryUnit::Mib, gpus).unwrap();
        let s = slice("gpu.gpushare.io", "node-a", &inventory, 3);
        assert_eq!(s.metadata.name.as_deref(), Some("node-a-gpu.gpushare.io"));
        assert_eq!(s.spec.node_name.as_deref(), Some("node-a"));
        assert_eq!((s.spec.pool.name.as_str(), s.spec.pool.generation), ("node-a", 3));
        let devices = s.spec.devices.unwrap();
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu-1", "gpu-2"], "the shared GPU is the device plugin's");
        let d = &devices[0];
        assert_eq!(d.allow_multiple_allocations, Some(true));
        let memory = &d.capacity.as_ref().unwrap()["memory"];
        assert_eq!(memory.value.0, "80Gi");
        let policy = memory.request_policy.as_ref().unwrap();
        assert_eq!(policy.valid_range.as_ref().unwrap().step.as_ref().unwrap().0, "1Mi");
        let attrs = d.attributes.as_ref().unwrap();
        assert_eq!(attrs["uuid"].string.as_deref(), Some("GPU-1"));
        assert_eq!(attrs["numaNode"].int, Some(1));
        assert_eq!(attrs["memoryMiB"].int, Some(81_920));
        // An unhealthy GPU leaves the pool.
        inventory.gpu_mut(2).unwrap().health = Health::Unhealthy { reason: "Xid 79".to_owned() };
        let devices = slice("gpu.gpushare.io", "node-a", &inventory, 4).spec.devices.unwrap();
        assert_eq!(devices.len(), 1);
        // JSON as the API server reads it.
        let json = serde_json::to_value(device(inventory.gpus().get(1).unwrap())).unwrap();
        assert_eq!(json["allowMultipleAllocations"], true);
        assert_eq!(json["capacity"]["memory"]["requestPolicy"]["validRange"]["min"], "1Mi");
    }
}
