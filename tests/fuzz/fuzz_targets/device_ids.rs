//! The device-ID codec: any text resolves to one of a node's devices or to none, and a device
//! it resolves to has exactly that ID; any text is a device-set key or not, and a key that
//! reads as a set is the key of that set.
#![no_main]

use std::sync::OnceLock;

use gpushare_core::devices::{DeviceMap, device_set_ids, device_set_key, device_set_len};
use gpushare_core::{Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory};
use libfuzzer_sys::fuzz_target;

fn devices() -> &'static DeviceMap {
    static MAP: OnceLock<DeviceMap> = OnceLock::new();
    MAP.get_or_init(|| {
        let gpus = (0..4)
            .map(|i| {
                Gpu::new(
                    i,
                    GpuUuid::new(format!("GPU-8f6e2c1a-53b4-7f0e-9d2c-1a2b3c4d5e{i:02}")).unwrap(),
                    "H100",
                    Mib::new(81_559),
                )
            })
            .collect();
        DeviceMap::new(&NodeInventory::new(MemoryUnit::Mib, gpus).unwrap())
    })
}

fuzz_target!(|text: &str| {
    let map = devices();
    if let Some((gpu, k)) = map.resolve(text) {
        assert_eq!(map.id(gpu, k).as_deref(), Some(text), "resolves to a device with another ID");
    }
    // Every key is parsed; only small sets are built (a key may stand for two million IDs,
    // which the product reads only from its own ledger, and which would slow the search down).
    let len = device_set_len(text);
    if len.is_some_and(|n| n <= 4096)
        && let Some(ids) = device_set_ids(text)
    {
        assert_eq!(u64::try_from(ids.len()).ok(), len);
        let key = device_set_key(&ids);
        let back = device_set_ids(&key).expect("a key made from a set reads back");
        let (mut a, mut b) = (ids.clone(), back);
        a.sort();
        a.dedup();
        b.sort();
        b.dedup();
        assert_eq!(a, b, "the set changed through its key");
    }
    let parts: Vec<&str> = text.split(',').filter(|s| !s.is_empty()).collect();
    let key = device_set_key(&parts);
    let mut back = device_set_ids(&key).expect("a key made from IDs reads back");
    let mut want: Vec<String> = parts.iter().map(|s| (*s).to_owned()).collect();
    want.sort();
    want.dedup();
    back.sort();
    back.dedup();
    assert_eq!(back, want, "IDs changed through their key");
});
