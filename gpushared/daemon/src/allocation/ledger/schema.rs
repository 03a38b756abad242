//! The ledger's schema: each migration from one `PRAGMA user_version` to the next, and how a
//! file is brought up to date at open (refused when it is newer than this daemon knows).

use gpushare_core::devices::device_set_key;
use rusqlite::params;

use super::{Ledger, LedgerError, sql};

/// One schema migration.
#[derive(Clone, Copy, Debug)]
pub enum Migration {
    /// SQL statements.
    Sql(&'static str),
    /// Version 2: `device_ids` holds the compact device-set key
    /// ([`gpushare_core::devices::device_set_key`]) instead of every ID joined by commas.
    CompactDeviceSets,
}

/// Schema migrations; entry `i` takes a file from version `i` to `i + 1`.
pub const MIGRATIONS: &[Migration] = &[
    Migration::Sql(
        r"
CREATE TABLE allocations (
    id             INTEGER PRIMARY KEY,
    pod_uid        TEXT    NOT NULL,
    namespace      TEXT    NOT NULL,
    pod_name       TEXT    NOT NULL,
    container      TEXT    NOT NULL,
    role           TEXT    NOT NULL CHECK (role IN ('init', 'sidecar', 'app')),
    gpu_uuid       TEXT    NOT NULL,
    gpu_index      INTEGER NOT NULL,
    mib            INTEGER NOT NULL CHECK (mib > 0),
    device_ids     TEXT    NOT NULL,
    allocated_at   INTEGER NOT NULL,
    released_at    INTEGER,
    release_reason TEXT
);
CREATE UNIQUE INDEX allocations_live_container
    ON allocations (pod_uid, container, gpu_uuid) WHERE released_at IS NULL;
CREATE INDEX allocations_live_devices ON allocations (device_ids) WHERE released_at IS NULL;
CREATE TABLE events (
    id     INTEGER PRIMARY KEY,
    at     INTEGER NOT NULL,
    kind   TEXT    NOT NULL,
    detail TEXT    NOT NULL
);
",
    ),
    Migration::CompactDeviceSets,
    Migration::Sql(
        r"
CREATE TABLE cordons (
    gpu_uuid   TEXT    PRIMARY KEY,
    cordoned_at INTEGER NOT NULL
);
",
    ),
    Migration::Sql(
        r"
CREATE TABLE gpus (
    uuid       TEXT    PRIMARY KEY,
    gpu_index  INTEGER NOT NULL,
    model      TEXT    NOT NULL,
    total_mib  INTEGER NOT NULL CHECK (total_mib > 0),
    minor      INTEGER,
    numa_node  INTEGER,
    pci_bus_id TEXT,
    seen_at    INTEGER NOT NULL
);
",
    ),
    // Version 5: the DRA claims prepared on this node (ledger/claims.rs).
    Migration::Sql(
        r"
CREATE TABLE claims (
    id             INTEGER PRIMARY KEY,
    claim_uid      TEXT    NOT NULL,
    namespace      TEXT    NOT NULL,
    claim_name     TEXT    NOT NULL,
    request        TEXT    NOT NULL,
    share_id       TEXT    NOT NULL,
    gpu_uuid       TEXT    NOT NULL,
    gpu_index      INTEGER NOT NULL,
    mib            INTEGER NOT NULL CHECK (mib > 0),
    prepared_at    INTEGER NOT NULL,
    released_at    INTEGER,
    release_reason TEXT
);
CREATE UNIQUE INDEX claims_live ON claims (claim_uid, request, gpu_uuid, share_id) WHERE released_at IS NULL;
",
    ),
];

impl Ledger {
    /// Brings the file up to [`MIGRATIONS`]' version, one transaction per step.
    pub(super) fn migrate(&mut self) -> Result<(), LedgerError> {
        let path = self.path.clone();
        let sqlite = |what| sql(&path, what);
        let version: i64 = self
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(sqlite("reading the schema version"))?;
        let known = MIGRATIONS.len();
        let current = usize::try_from(version).unwrap_or(usize::MAX);
        if current > known {
            return Err(LedgerError::TooNew { path: self.path.clone(), found: version, known });
        }
        for (i, migration) in MIGRATIONS.iter().enumerate().skip(current) {
            let tx = self.conn.transaction().map_err(sqlite("starting a migration"))?;
            match migration {
                Migration::Sql(sql) => tx.execute_batch(sql).map_err(sqlite("migrating the schema"))?,
                Migration::CompactDeviceSets => {
                    let rows: Vec<(i64, String)> = tx
                        .prepare("SELECT id, device_ids FROM allocations")
                        .and_then(|mut stmt| {
                            stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<Result<Vec<_>, _>>()
                        })
                        .map_err(sqlite("reading device sets to migrate"))?;
                    for (id, joined) in rows {
                        let ids: Vec<&str> = joined.split(',').filter(|s| !s.is_empty()).collect();
                        tx.execute(
                            "UPDATE allocations SET device_ids = ?1 WHERE id = ?2",
                            params![device_set_key(&ids), id],
                        )
                        .map_err(sqlite("migrating a device set"))?;
                    }
                }
            }
            tx.pragma_update(None, "user_version", i64::try_from(i + 1).unwrap_or(i64::MAX))
                .map_err(sqlite("recording the schema version"))?;
            tx.commit().map_err(sqlite("committing a migration"))?;
        }
        // A fresh file is created at version 0: only an existing one is said to be migrated.
        if current > 0 && current < known {
            tracing::info!(ledger = %self.path.display(), from = current, to = known, "ledger schema migrated");
        }
        Ok(())
    }
}
