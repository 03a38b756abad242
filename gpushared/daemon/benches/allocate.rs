//! Allocate through the socket, with the durable ledger commit: the daemon's own plugin server
//! and registration in this process, the kubelet stand-in as the client over the unix socket, a
//! real SQLite ledger in a temporary directory (on the build machine's disk).
//!
//! 8 GPUs of 16 384 MiB (131 072 devices), 500 single-container pods of 200 MiB spread over
//! them, bound one at a time, each admitted the kubelet's way: GetPreferredAllocation over every
//! free device, then Allocate. Prints p50/p90/p99/max latency of each call and the admissions per second.
//!
//! Then the same admissions over a ledger that holds a long history (`GPUSHARE_BENCH_HISTORY`
//! lines, 300 000 unless set), once alone and once while a thread reads that whole history
//! page after page as the D-Bus `HistoryPage` handler does: Allocate's latency both ways and
//! their ratio.
//!
//! Run: `cargo bench -p gpushared --bench allocate`. Results: BENCHMARKS.md.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_core::{Gpu, MemoryUnit, Mib, NodeInventory, ResourceNames};
use gpushare_testkit::kubelet::Kubelet;
use gpushared::allocation::allocator::Allocator;
use gpushared::allocation::ledger::Ledger;
use gpushared::allocation::pods::PodStore;
use gpushared::config::Compatibility;
use gpushared::kubelet::plugin::{self, Plugin};

mod common;
mod workload;
use common::report;
use workload::{pod, quantile, uuid};

const GPUS: u32 = 8;
const GPU_MIB: u64 = 16_384;
const PODS: usize = 500;
const POD_MIB: u64 = 200;

/// An allocator for 8 GPUs, its ledger in `dir`, and its pod store. Pods are added one at a
/// time just before their admission ([`pod`]), as gpushare-extender binds pods that look alike
/// to the kubelet (same size, other GPUs): the next once the node reports the previous one
/// allocated. With all 500 bound at once every call would be ambiguous, and the daemon would
/// wait out its 5 s for the pod watch before serving the oldest.
fn setup(dir: &std::path::Path) -> (NodeInventory, Arc<Allocator>, PodStore) {
    let gpus = (0..GPUS).map(|i| Gpu::new(i, uuid(i), "Tesla T4", Mib::new(GPU_MIB))).collect();
    let inventory = NodeInventory::new(MemoryUnit::Mib, gpus).unwrap();
    let pods = PodStore::new();
    let ledger = Ledger::open(&dir.join("ledger.db")).unwrap().ledger;
    let alloc = Arc::new(
        Allocator::new(
            "bench-node".into(),
            ResourceNames::gpushare(),
            Compatibility::Gpushare,
            inventory.clone(),
            pods.clone(),
            ledger,
        )
        .unwrap(),
    );
    (inventory, alloc, pods)
}

/// The allocator alone, no gRPC: the service's own cost per call.
fn direct(dir: &std::path::Path) {
    let (_, alloc, pods) = setup(dir);
    let mut in_use = std::collections::HashSet::new();
    let all: Vec<String> =
        (0..usize::try_from(GPUS).unwrap()).flat_map(|g| alloc.devices().ids(g).collect::<Vec<_>>()).collect();
    let mut preferred = Vec::with_capacity(PODS);
    let mut allocate = Vec::with_capacity(PODS);
    for p in 0..PODS {
        pods.upsert(pod(p, GPUS, MemoryUnit::Mib, POD_MIB));
        let available: Vec<String> = all.iter().filter(|d| !in_use.contains(*d)).cloned().collect();
        let t = Instant::now();
        let ids =
            alloc.preferred(available.iter().map(String::as_str), &[], usize::try_from(POD_MIB).unwrap()).unwrap();
        preferred.push(t.elapsed());
        let t = Instant::now();
        alloc.allocate(&ids).unwrap();
        allocate.push(t.elapsed());
        in_use.extend(ids);
    }
    println!("The allocation service alone (no gRPC, no client), same workload");
    report("preferred()", preferred);
    report("allocate() (durable)", allocate);
}

/// What one run of [`admit_all`] measured.
struct Run {
    preferred: Vec<Duration>,
    allocate: Vec<Duration>,
    elapsed: Duration,
    /// History lines read meanwhile.
    lines_read: usize,
}

/// `events` lines of history in the ledger at `dir` before the daemon opens it, written the way
/// a node that has run for a long time has them (one transaction here, for speed).
fn long_history(dir: &std::path::Path, events: usize) {
    let mut db = rusqlite::Connection::open(dir.join("ledger.db")).unwrap();
    let tx = db.transaction().unwrap();
    {
        let mut insert = tx.prepare("INSERT INTO events (at, kind, detail) VALUES (?1, 'bench', ?2)").unwrap();
        for i in 0..events {
            let detail = format!("default/old-pod-{i:07} container \"main\" GPU{} 200 MiB released", i % 8);
            insert.execute(rusqlite::params![1_700_000_000_000_i64 + i64::try_from(i).unwrap(), detail]).unwrap();
        }
    }
    tx.commit().unwrap();
}

/// Admits [`PODS`] pods through the socket, the kubelet's way, over a ledger at `dir` that
/// already holds `history` lines of history. With `read_history`, a thread meanwhile reads the
/// whole history page after page ([`gpushared::allocation::ledger::MAX_PAGE`] lines each, the
/// call the D-Bus `HistoryPage` handler makes on the blocking pool), from the start again
/// whenever it reaches the end, until the last admission.
async fn admit_all(dir: &std::path::Path, history: usize, read_history: bool) -> Run {
    Ledger::open(&dir.join("ledger.db")).unwrap();
    long_history(dir, history);
    let (inventory, alloc, pods) = setup(dir);
    let plugin_dir = dir.join("device-plugins");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let kubelet = Kubelet::start(&plugin_dir).await.unwrap();
    let (_devices_tx, devices_rx) =
        tokio::sync::watch::channel(plugin::DeviceSnapshot { inventory: Arc::new(inventory), numa: true });
    let listener = plugin::bind(&plugin_dir.join("gpushared.sock")).unwrap();
    tokio::spawn(plugin::serve(Plugin::new(Arc::clone(&alloc), devices_rx), listener, std::future::pending()));
    plugin::register(plugin_dir.join("kubelet.sock"), "gpushared.sock".into(), "gpushare.io/gpu-mem".into(), true)
        .await
        .unwrap();
    kubelet.wait_devices(Duration::from_secs(10), |d| !d.is_empty()).await.unwrap();

    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = read_history.then(|| {
        let (alloc, done) = (Arc::clone(&alloc), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut lines = 0;
            let mut after = None;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let page = alloc.history_page(0, after, gpushared::allocation::ledger::MAX_PAGE).unwrap();
                lines += page.lines.len();
                after = page.next;
            }
            lines
        })
    });
    let mut run = Run {
        preferred: Vec::with_capacity(PODS),
        allocate: Vec::with_capacity(PODS),
        elapsed: Duration::ZERO,
        lines_read: 0,
    };
    let started = Instant::now();
    for p in 0..PODS {
        pods.upsert(pod(p, GPUS, MemoryUnit::Mib, POD_MIB));
        let t = Instant::now();
        let ids = kubelet.preferred(usize::try_from(POD_MIB).unwrap()).await.unwrap();
        run.preferred.push(t.elapsed());
        let (_, took) = kubelet.allocate_timed(&ids).await.unwrap();
        run.allocate.push(took);
    }
    run.elapsed = started.elapsed();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    run.lines_read = reader.map_or(0, |r| r.join().unwrap());
    assert_eq!(alloc.live().unwrap().len(), PODS);
    run
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let base = std::env::var("BENCH_DIR").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
    let dir = tempfile::tempdir_in(&base).unwrap();
    let run = admit_all(dir.path(), 0, false).await;
    println!("Allocate through the socket: {GPUS} GPUs x {GPU_MIB} MiB, {PODS} pods x {POD_MIB} MiB, durable ledger");
    report("GetPreferredAllocation", run.preferred);
    report("Allocate (durable)", run.allocate);
    println!(
        "admissions per second    {:.0} (both calls, one container each)",
        PODS as f64 / run.elapsed.as_secs_f64()
    );
    let dir = tempfile::tempdir_in(&base).unwrap();
    tokio::task::block_in_place(|| direct(dir.path()));

    // A local user reading a long history (issue 35): the same admissions over a ledger of a
    // node that has run for long, alone and while the whole history is read page by page.
    let history = std::env::var("GPUSHARE_BENCH_HISTORY").ok().and_then(|v| v.parse().ok()).unwrap_or(300_000);
    let dir = tempfile::tempdir_in(&base).unwrap();
    let alone = admit_all(dir.path(), history, false).await;
    let dir = tempfile::tempdir_in(&base).unwrap();
    let read = admit_all(dir.path(), history, true).await;
    println!();
    println!("The same admissions over a ledger with {history} lines of history, alone and while it is read");
    report("Allocate, history idle", alone.allocate.clone());
    report("Allocate, history read", read.allocate.clone());
    println!(
        "history lines read meanwhile {} ({:.0} lines/s); Allocate read/idle: p50 {:.2}, p99 {:.2}; admissions/s {:.0} and {:.0}",
        read.lines_read,
        read.lines_read as f64 / read.elapsed.as_secs_f64(),
        quantile(&read.allocate, 500).as_secs_f64() / quantile(&alone.allocate, 500).as_secs_f64(),
        quantile(&read.allocate, 990).as_secs_f64() / quantile(&alone.allocate, 990).as_secs_f64(),
        PODS as f64 / alone.elapsed.as_secs_f64(),
        PODS as f64 / read.elapsed.as_secs_f64(),
    );
}
