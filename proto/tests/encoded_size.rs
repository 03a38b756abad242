//! The core's `list_and_watch_size` (computed without protobuf) must equal the size prost
//! really encodes, or the daemon's 4 MiB guard would be wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use gpushare_core::devices::{DeviceMap, list_and_watch_size};
use gpushare_core::{Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory};
use gpushare_proto::UNHEALTHY;
use gpushare_proto::deviceplugin::{Device, ListAndWatchResponse, NumaNode, TopologyInfo};
use prost::Message as _;

fn response(inv: &NodeInventory, numa: bool) -> ListAndWatchResponse {
    let map = DeviceMap::new(inv);
    let mut devices = Vec::new();
    for (pos, g) in inv.gpus().iter().enumerate() {
        let topology =
            g.numa_node.filter(|_| numa).map(|n| TopologyInfo { nodes: vec![NumaNode { id: i64::from(n) }] });
        devices.extend(map.ids(pos).map(|id| Device { id, health: UNHEALTHY.to_owned(), topology: topology.clone() }));
    }
    ListAndWatchResponse { devices, source: None }
}

#[test]
fn computed_size_equals_prost_encoding() {
    for (unit, sizes, numas) in [
        (MemoryUnit::Mib, vec![62, 63, 3844, 3845, 15_360], vec![None, Some(0), Some(1), Some(200), None]),
        (MemoryUnit::Mib, vec![300_000], vec![Some(3)]),
        (MemoryUnit::Gib, vec![16_276, 81_920], vec![Some(0), None]),
    ] {
        let gpus = sizes
            .iter()
            .zip(&numas)
            .zip(0u32..)
            .map(|((mib, numa), i)| {
                let mut g = Gpu::new(i, GpuUuid::new(format!("GPU-{i}")).unwrap(), "T4", Mib::new(*mib));
                g.numa_node = *numa;
                g
            })
            .collect();
        let inv = NodeInventory::new(unit, gpus).unwrap();
        for numa in [true, false] {
            assert_eq!(
                list_and_watch_size(&inv, numa),
                response(&inv, numa).encoded_len(),
                "{unit} {sizes:?} numa={numa}"
            );
        }
    }
}
