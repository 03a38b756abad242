//! Ledger tests against real SQLite files in a temporary directory.

use std::os::unix::fs::PermissionsExt as _;

use super::*;

fn pod(uid: &str) -> PodRef {
    PodRef { namespace: "default".into(), name: format!("pod-{uid}"), uid: uid.into() }
}

fn row(uid: &str, container: &str, gpu: &str, mib: u64, ids: &[&str]) -> NewRow {
    NewRow {
        pod: pod(uid),
        container: container.into(),
        role: ContainerRole::App,
        gpu_uuid: GpuUuid::new(gpu).unwrap(),
        gpu_index: 0,
        mib: Mib::new(mib),
        device_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
    }
}

fn open(dir: &tempfile::TempDir) -> Opened {
    Ledger::open(&dir.path().join("gpushare").join("ledger.db")).unwrap()
}

#[test]
fn a_new_ledger_is_durable_and_current() {
    let dir = tempfile::tempdir().unwrap();
    let opened = open(&dir);
    assert!(opened.moved_aside.is_none());
    let l = opened.ledger;
    assert_eq!(l.schema_version().unwrap(), 5);
    let mode: String = l.conn.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
    assert_eq!(mode, "wal");
    let sync: i64 = l.conn.query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap();
    assert_eq!(sync, 2, "synchronous=FULL");
    assert_eq!(std::fs::metadata(l.path()).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::metadata(l.path().parent().unwrap()).unwrap().permissions().mode() & 0o777, 0o700);
}

#[test]
fn allocations_survive_reopening_and_releases_keep_history() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut l = open(&dir).ledger;
        let written = l
            .allocate(&[
                row("u1", "main", "GPU-a", 2000, &["b2", "a1"]),
                row("u1", "main", "GPU-b", 2000, &["b2", "a1"]),
            ])
            .unwrap();
        assert_eq!(written.len(), 2);
        assert_eq!(written[0].request_key, "=a1,b2", "not gpushare IDs: kept whole");
        l.allocate(&[row("u2", "main", "GPU-a", 500, &["c3"])]).unwrap();
    }
    let mut l = open(&dir).ledger;
    assert_eq!(l.live().unwrap().len(), 3);
    assert_eq!(l.live_by_key(&request_key(&["a1".into(), "b2".into()])).unwrap().len(), 2);
    assert_eq!(l.release_pod("u1", "pod deleted").unwrap(), 2);
    assert_eq!(l.release_pod("u1", "again").unwrap(), 0);
    let live = l.live().unwrap();
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].pod.uid, "u2");
    let all = l.all_since(0).unwrap();
    assert_eq!(all.len(), 3);
    assert_eq!(all[0].release_reason.as_deref(), Some("pod deleted"));
    assert!(all[0].released_at.is_some());
    // The same container can be allocated again once released (a restarted pod keeps its UID).
    l.allocate(&[row("u1", "main", "GPU-a", 2000, &["a1", "b2"])]).unwrap();
}

#[test]
fn an_allocation_is_all_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut l = open(&dir).ledger;
    l.allocate(&[row("u1", "main", "GPU-b", 1, &["x"])]).unwrap();
    // The second row clashes with the live one: nothing of this request is written.
    let err = l.allocate(&[row("u1", "main", "GPU-a", 1, &["y"]), row("u1", "main", "GPU-b", 1, &["y"])]).unwrap_err();
    assert!(err.to_string().contains("writing an allocation"), "{err}");
    assert_eq!(l.live().unwrap().len(), 1);
}

#[test]
fn events_are_recorded_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut l = open(&dir).ledger;
    l.record_event(EventKind::Health, "GPU-a: Xid 79").unwrap();
    l.record_event(EventKind::Health, "GPU-a: recovered").unwrap();
    let events = l.events_since(0).unwrap();
    assert_eq!(events.iter().map(|e| e.detail.as_str()).collect::<Vec<_>>(), ["GPU-a: Xid 79", "GPU-a: recovered"]);
    assert!(l.events_since(i64::MAX).unwrap().is_empty());
}

#[test]
fn a_corrupt_file_is_moved_aside_not_silently_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    std::fs::write(&path, b"this is not a database, but an operator's data worth keeping").unwrap();
    let opened = Ledger::open(&path).unwrap();
    let (aside, why) = opened.moved_aside.expect("moved aside");
    assert!(aside.to_string_lossy().contains("ledger.db.corrupt-"), "{}", aside.display());
    assert_eq!(std::fs::read(&aside).unwrap(), b"this is not a database, but an operator's data worth keeping");
    assert!(!why.is_empty());
    let events = opened.ledger.events_since(0).unwrap();
    assert_eq!(events[0].kind, "ledger-moved-aside");
    assert!(events[0].detail.contains(&aside.display().to_string()), "{}", events[0].detail);
}

#[test]
fn a_damaged_database_fails_its_integrity_check_and_is_moved_aside() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    {
        let mut l = Ledger::open(&path).unwrap().ledger;
        for i in 0..200 {
            l.allocate(&[row(&format!("u{i}"), "main", "GPU-a", 1, &[&format!("d{i}")])]).unwrap();
        }
        l.conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE); PRAGMA journal_mode = DELETE;").unwrap();
    }
    // Scribble over the middle of the file (past the header page).
    let mut bytes = std::fs::read(&path).unwrap();
    assert!(bytes.len() > 8192, "{}", bytes.len());
    for b in &mut bytes[4096..8192] {
        *b = 0xA5;
    }
    std::fs::write(&path, &bytes).unwrap();
    let opened = Ledger::open(&path).unwrap();
    assert!(opened.moved_aside.is_some());
    assert!(opened.ledger.live().unwrap().is_empty());
}

#[test]
fn a_ledger_from_a_newer_daemon_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    {
        let l = Ledger::open(&path).unwrap().ledger;
        l.conn.pragma_update(None, "user_version", 99).unwrap();
    }
    let err = Ledger::open(&path).unwrap_err();
    assert!(err.to_string().contains("schema version 99 is newer than this gpushared knows (5)"), "{err}");
    assert!(path.exists());
}

#[test]
fn a_second_connection_checkpoints_without_blocking_allocations() {
    let dir = tempfile::tempdir().unwrap();
    let mut l = open(&dir).ledger;
    let cp = l.checkpointer().unwrap();
    for i in 0..50 {
        l.allocate(&[row(&format!("u{i}"), "main", "GPU-a", 1, &[&format!("d{i}")])]).unwrap();
    }
    let wal = std::fs::metadata(format!("{}-wal", l.path().display())).unwrap().len();
    assert!(wal > 0);
    assert!(cp.checkpoint().unwrap() > 0, "frames copied");
    // Allocation goes on, and everything is still there.
    l.allocate(&[row("after", "main", "GPU-a", 1, &["z"])]).unwrap();
    assert_eq!(l.live().unwrap().len(), 51);
    drop(l);
    assert_eq!(open(&dir).ledger.live().unwrap().len(), 51);
}

#[test]
fn a_version_1_ledger_is_migrated_to_compact_device_sets() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpushare").join("ledger.db");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    {
        let conn = Connection::open(&path).unwrap();
        let Migration::Sql(v1) = MIGRATIONS[0] else { panic!("version 1 is SQL") };
        conn.execute_batch(v1).unwrap();
        conn.pragma_update(None, "user_version", 1).unwrap();
        conn.execute(
            "INSERT INTO allocations (pod_uid, namespace, pod_name, container, role, gpu_uuid, gpu_index, mib,
                                      device_ids, allocated_at)
             VALUES ('u1', 'default', 'p', 'main', 'app', 'GPU-a', 0, 3, 'Q30,Q31,Q32', 1)",
            [],
        )
        .unwrap();
    }
    let l = Ledger::open(&path).unwrap().ledger;
    assert_eq!(l.schema_version().unwrap(), 5);
    let live = l.live().unwrap();
    assert_eq!(live[0].request_key, "Q3:0-2");
    assert_eq!(live[0].device_ids, vec!["Q30", "Q31", "Q32"]);
    // The migrated row answers a repeated Allocate of the same devices, in any order.
    let ids: Vec<String> = ["Q32", "Q30", "Q31"].map(String::from).to_vec();
    assert_eq!(l.live_by_key(&request_key(&ids)).unwrap().len(), 1);
}

#[test]
fn cordons_persist_with_their_history() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut l = open(&dir).ledger;
        l.set_cordon("GPU-a", true, "GPU0 cordoned").unwrap();
        l.set_cordon("GPU-b", true, "GPU1 cordoned").unwrap();
        l.set_cordon("GPU-a", true, "again").unwrap();
        l.set_cordon("GPU-b", false, "GPU1 uncordoned").unwrap();
    }
    let l = open(&dir).ledger;
    assert_eq!(l.cordoned().unwrap(), vec!["GPU-a"]);
    let kinds: Vec<String> = l.events_since(0).unwrap().into_iter().map(|e| e.kind).collect();
    assert_eq!(kinds, vec!["cordon", "cordon", "cordon", "uncordon"]);
}

#[test]
fn the_gpus_seen_answering_are_remembered_across_restarts_until_forgotten() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = gpushare_core::Gpu::new(0, GpuUuid::new("GPU-a").unwrap(), "Tesla T4", Mib::new(15360));
    a.minor = Some(0);
    a.numa_node = Some(1);
    a.pci_bus_id = Some("00000000:3B:00.0".into());
    let b = gpushare_core::Gpu::new(1, GpuUuid::new("GPU-b").unwrap(), "NVIDIA A10", Mib::new(24576));
    {
        let mut l = open(&dir).ledger;
        assert!(l.known_gpus().unwrap().is_empty());
        l.remember_gpus(&[a.clone(), b.clone()]).unwrap();
        // Seen again at another index: its last identity replaces the first.
        let mut b_moved = b.clone();
        b_moved.index = 2;
        l.remember_gpus(std::slice::from_ref(&b_moved)).unwrap();
    }
    let mut l = open(&dir).ledger;
    let mut b_moved = b;
    b_moved.index = 2;
    assert_eq!(l.known_gpus().unwrap(), vec![a, b_moved]);
    assert!(l.forget_gpu("GPU-b", EventKind::GpuReplaced, "GPU2 replaced").unwrap());
    assert!(!l.forget_gpu("GPU-b", EventKind::GpuReplaced, "again").unwrap());
    assert_eq!(l.known_gpus().unwrap().len(), 1);
    let kinds: Vec<String> = l.events_since(0).unwrap().into_iter().map(|e| e.kind).collect();
    assert_eq!(kinds, vec!["gpu-replaced"]);
}
