//! The ledger's durable commit alone ([`Ledger::allocate`]: one row, WAL, `synchronous=FULL`)
//! under three conditions, to tell the commit's own cost from the machine's state around it:
//! back to back; after churning memory the way a `GetPreferredAllocation` in MiB mode does
//! (131 072 short strings built and dropped); after 20 ms idle (the cores fall asleep).
//!
//! Run: `cargo bench -p gpushared --bench ledger_commit`. Results: BENCHMARKS.md.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use gpushare_core::codec::node::PodRef;
use gpushare_core::devices::DeviceMap;
use gpushare_core::{ContainerRole, Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory};
use gpushared::allocation::ledger::{Ledger, NewRow};

const ROWS: usize = 500;

fn uuid(gpu: u32) -> GpuUuid {
    GpuUuid::new(format!("GPU-bench-{gpu}")).unwrap()
}

fn row(devices: &DeviceMap, i: usize) -> NewRow {
    let gpu = u32::try_from(i % 8).unwrap();
    let first = u64::try_from(i / 8 * 200).unwrap();
    NewRow {
        pod: PodRef { namespace: "bench".into(), name: format!("pod-{i:04}"), uid: format!("uid-{i:04}") },
        container: "main".into(),
        role: ContainerRole::App,
        gpu_uuid: uuid(gpu),
        gpu_index: gpu,
        mib: Mib::new(200),
        // 200 devices of one GPU, as in MiB mode.
        device_ids: (first..first + 200).map(|k| devices.id(i % 8, k).unwrap()).collect(),
    }
}

fn run(base: &std::path::Path, devices: &DeviceMap, name: &str, before_each: &dyn Fn()) {
    let dir = tempfile::tempdir_in(base).unwrap();
    let mut ledger = Ledger::open(&dir.path().join("ledger.db")).unwrap().ledger;
    let mut samples = Vec::with_capacity(ROWS);
    for i in 0..ROWS {
        let new = [row(devices, i)];
        before_each();
        let t = Instant::now();
        ledger.allocate(&new).unwrap();
        samples.push(t.elapsed());
    }
    // LEDGER_SLOWEST=N prints the N slowest commits with their place in the run.
    if let Some(n) = std::env::var("LEDGER_SLOWEST").ok().and_then(|v| v.parse::<usize>().ok()) {
        let mut slowest: Vec<(Duration, usize)> = samples.iter().copied().zip(1..).collect();
        slowest.sort_by(|a, b| b.cmp(a));
        let list: Vec<String> = slowest.iter().take(n).map(|(d, i)| format!("#{i} {d:.3?}")).collect();
        println!("  slowest: {}", list.join(", "));
    }
    samples.sort();
    let at = |per_mille: usize| samples[(samples.len() - 1) * per_mille / 1000];
    println!("{name:<40} p50 {:>9.3?}  p90 {:>9.3?}  p99 {:>9.3?}", at(500), at(900), at(990));
}

fn main() {
    let base = std::env::var("BENCH_DIR").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
    let base = std::path::Path::new(&base);
    let gpus = (0..8).map(|i| Gpu::new(i, uuid(i), "Tesla T4", Mib::new(16_384))).collect();
    let devices = DeviceMap::new(&NodeInventory::new(MemoryUnit::Mib, gpus).unwrap());
    println!("Ledger::allocate, one row per commit, {ROWS} commits each");
    run(base, &devices, "back to back", &|| {});
    run(base, &devices, "after churning 131 072 strings", &|| {
        let ids: Vec<String> = (0..131_072).map(|k| format!("Q{k}")).collect();
        std::hint::black_box(&ids);
    });
    run(base, &devices, "after 20 ms idle", &|| std::thread::sleep(Duration::from_millis(20)));
}
