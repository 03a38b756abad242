//! `allocate()` while the history is read (issue 35: nothing local stalls an allocation). A
//! ledger with a long history (200 000 lines, the default `history_max_rows`), then the
//! allocation service admits 500 pods of 200 MiB on 8 GPUs of 16 384 MiB the kubelet's way
//! (`preferred()`, then `allocate()` with its durable commit): the first 250 with nothing else
//! running, the next 250 while another thread pages through the whole history over and over
//! (`history_page`, 10 000 lines a page, as `gpusharectl history` and D-Bus `HistoryPage` do).
//! Prints each phase's `allocate()` latency and how many history lines were read a second.
//!
//! Run: `cargo bench -p gpushared --bench history_read`. Results: BENCHMARKS.md.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpushared::allocation::ledger::{EventKind, Ledger, MAX_PAGE};

mod common;
use common::{GPUS, POD_MIB, PODS, pod, report, setup};

/// History lines in the ledger before the pods come: `[ledger] history_max_rows`'s default.
const HISTORY: i64 = 200_000;

fn main() {
    let base = std::env::var("BENCH_DIR").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
    let dir = tempfile::tempdir_in(&base).unwrap();
    let path = dir.path().join("ledger.db");
    // The schema, then a year's worth of events written straight into the file.
    drop(Ledger::open(&path).unwrap());
    let mut conn = rusqlite::Connection::open(&path).unwrap();
    let tx = conn.transaction().unwrap();
    {
        let mut insert = tx.prepare("INSERT INTO events (at, kind, detail) VALUES (?1, ?2, ?3)").unwrap();
        let start_ms = 1_767_225_600_000_i64; // 2026-01-01
        for i in 0..HISTORY {
            let detail = format!("allocated GPU{} 200 MiB to bench/old-{i:06} container \"main\"", i % 8);
            insert.execute(rusqlite::params![start_ms + i * 150_000, EventKind::Allocated.as_str(), detail]).unwrap();
        }
    }
    tx.commit().unwrap();
    drop(conn);

    let (_, alloc, pods) = setup(dir.path());
    let all: Vec<String> =
        (0..usize::try_from(GPUS).unwrap()).flat_map(|g| alloc.devices().ids(g).collect::<Vec<_>>()).collect();
    let mut in_use = HashSet::new();
    let mut admit = |p: usize| {
        pods.upsert(pod(p));
        let available: Vec<String> = all.iter().filter(|d| !in_use.contains(*d)).cloned().collect();
        let ids =
            alloc.preferred(available.iter().map(String::as_str), &[], usize::try_from(POD_MIB).unwrap()).unwrap();
        let t = Instant::now();
        alloc.allocate(&ids).unwrap();
        let took = t.elapsed();
        in_use.extend(ids);
        took
    };

    let quiet: Vec<Duration> = (0..PODS / 2).map(&mut admit).collect();

    let stop = Arc::new(AtomicBool::new(false));
    let lines = Arc::new(AtomicU64::new(0));
    let reader = {
        let (alloc, stop, lines) = (Arc::clone(&alloc), Arc::clone(&stop), Arc::clone(&lines));
        std::thread::spawn(move || {
            let started = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                let mut cursor = None;
                loop {
                    let page = alloc.history_page(0, cursor, MAX_PAGE).unwrap();
                    lines.fetch_add(page.lines.len() as u64, Ordering::Relaxed);
                    match page.next {
                        Some(next) if !stop.load(Ordering::Relaxed) => cursor = Some(next),
                        _ => break,
                    }
                }
            }
            started.elapsed()
        })
    };
    // Let the reader get going before the first measured call.
    while lines.load(Ordering::Relaxed) == 0 {
        std::thread::yield_now();
    }
    let reading: Vec<Duration> = (PODS / 2..PODS).map(&mut admit).collect();
    stop.store(true, Ordering::Relaxed);
    let read_for = reader.join().unwrap();

    println!(
        "allocate() with {HISTORY} history lines in the ledger, {GPUS} GPUs, pods of {POD_MIB} MiB, durable commits"
    );
    report("allocate(), quiet", quiet);
    report("allocate(), history read", reading);
    let read = lines.load(Ordering::Relaxed);
    println!(
        "history read beside it      {read} lines in {read_for:.2?} ({:.0} lines/s, {:.1} passes over the history)",
        read as f64 / read_for.as_secs_f64(),
        read as f64 / (HISTORY as f64 + 2.0 * (PODS / 2) as f64)
    );
    assert_eq!(alloc.live().unwrap().len(), PODS);
}
