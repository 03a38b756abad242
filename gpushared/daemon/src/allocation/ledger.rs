//! The durable allocation ledger: one SQLite file (WAL, `synchronous=FULL`) holding every
//! allocation the daemon ever answered, live or released, and an event history.
//!
//! - Each `Allocate` is one transaction, committed (and so fsynced) before the reply.
//! - A release sets `released_at` and a reason rather than delete the row, so the ledger is
//!   also the who-had-which-slice-when history; that history is read in pages on a connection
//!   of its own and pruned by age and count (`history.rs`).
//! - The schema is versioned with `PRAGMA user_version`; [`MIGRATIONS`] (`schema.rs`) bring any older file up
//!   to date at open.
//! - The GPUs last seen answering are remembered (`gpus`, [`Ledger::known_gpus`]), so a GPU that
//!   does not answer at start is still served, unhealthy, under its last identity.
//! - At open the file's integrity is checked. A corrupt or unreadable ledger is moved aside
//!   (never silently replaced): [`Opened::moved_aside`] tells the caller, who reports it loudly.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use gpushare_core::codec::node::PodRef;
use gpushare_core::devices::{device_set_ids, device_set_key};
use gpushare_core::{ContainerRole, GpuUuid, Mib};
use rusqlite::{Connection, OptionalExtension, params};
use thiserror::Error;

/// A ledger problem. Each names the file.
#[derive(Debug, Error)]
pub enum LedgerError {
    /// SQLite refused an operation.
    #[error("ledger {path}: {what}: {source}")]
    Sqlite {
        /// The file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// SQLite's error.
        source: rusqlite::Error,
    },
    /// The directory or a file around the ledger could not be prepared.
    #[error("ledger {path}: {what}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file was written by a newer gpushared.
    #[error("ledger {path}: schema version {found} is newer than this gpushared knows ({known}); upgrade gpushared")]
    TooNew {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: i64,
        /// The newest this build knows.
        known: usize,
    },
    /// A row that breaks the ledger's own rules (a bug or a hand-edited file).
    #[error("ledger {path}: row {id}: {why}")]
    BadRow {
        /// The file.
        path: PathBuf,
        /// Row id.
        id: i64,
        /// What is wrong.
        why: String,
    },
}

/// One container's share of one GPU, as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    /// Row id.
    pub id: i64,
    /// The pod.
    pub pod: PodRef,
    /// The container.
    pub container: String,
    /// How it runs.
    pub role: ContainerRole,
    /// The GPU.
    pub gpu_uuid: GpuUuid,
    /// The GPU's index when allocated.
    pub gpu_index: u32,
    /// Memory held.
    pub mib: Mib,
    /// The kubelet devices of the whole container request, sorted.
    pub device_ids: Vec<String>,
    /// The canonical key of the device set ([`device_set_key`]), as stored.
    pub request_key: String,
    /// Unix milliseconds.
    pub allocated_at: i64,
    /// Unix milliseconds, once released.
    pub released_at: Option<i64>,
    /// Why it was released.
    pub release_reason: Option<String>,
}

/// A row to write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewRow {
    /// The pod.
    pub pod: PodRef,
    /// The container.
    pub container: String,
    /// How it runs.
    pub role: ContainerRole,
    /// The GPU.
    pub gpu_uuid: GpuUuid,
    /// The GPU's index.
    pub gpu_index: u32,
    /// Memory held.
    pub mib: Mib,
    /// The kubelet devices of the whole container request.
    pub device_ids: Vec<String>,
}

/// One entry of the event history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// Unix milliseconds.
    pub at: i64,
    /// `allocated`, `released`, `ledger-moved-aside`, `health`, ...
    pub kind: String,
    /// Human-readable detail.
    pub detail: String,
}

/// The canonical key of a set of device IDs, as stored ([`device_set_key`]).
#[must_use]
pub fn request_key(device_ids: &[String]) -> String {
    device_set_key(device_ids)
}

/// A hash of a device-set key ([`request_key`]), for the checks made in memory before the
/// ledger is read.
#[must_use]
pub fn key_hash(key: &str) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::hash::DefaultHasher::new();
    key.hash(&mut h);
    h.finish()
}

/// The result of opening a ledger.
#[derive(Debug)]
pub struct Opened {
    /// The ledger.
    pub ledger: Ledger,
    /// Where a corrupt or unreadable previous file was moved, if it was.
    pub moved_aside: Option<(PathBuf, String)>,
}

/// The open ledger.
#[derive(Debug)]
pub struct Ledger {
    path: PathBuf,
    conn: Connection,
}

/// Maps a SQLite error to a [`LedgerError`] naming the file and the operation.
fn sql(path: &Path, what: &'static str) -> impl FnOnce(rusqlite::Error) -> LedgerError + use<> {
    let path = path.to_owned();
    move |source| LedgerError::Sqlite { path, what, source }
}

/// Now, in Unix milliseconds (the ledger's clock).
#[must_use]
pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn role_str(role: ContainerRole) -> &'static str {
    match role {
        ContainerRole::Init => "init",
        ContainerRole::Sidecar => "sidecar",
        ContainerRole::App => "app",
    }
}

impl Ledger {
    /// Opens (creating if needed) the ledger at `path`: checks integrity, applies migrations.
    /// A corrupt or unreadable file is renamed to `<path>.corrupt-<unix-ms>` (with its WAL)
    /// and a fresh ledger created, recording the event; the caller must report it loudly.
    ///
    /// # Errors
    /// [`LedgerError`] if the directory cannot be prepared, the file is from a newer version,
    /// or a fresh ledger cannot be created.
    pub fn open(path: &Path) -> Result<Opened, LedgerError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| LedgerError::Io {
                path: path.to_owned(),
                what: "creating its directory",
                source,
            })?;
        }
        match Self::open_checked(path) {
            Ok(ledger) => Ok(Opened { ledger, moved_aside: None }),
            Err(e @ LedgerError::TooNew { .. }) => Err(e),
            Err(problem) => {
                let aside = PathBuf::from(format!("{}.corrupt-{}", path.display(), now_ms()));
                for suffix in ["", "-wal", "-shm"] {
                    let from = PathBuf::from(format!("{}{suffix}", path.display()));
                    let to = PathBuf::from(format!("{}{suffix}", aside.display()));
                    if from.exists() {
                        std::fs::rename(&from, &to).map_err(|source| LedgerError::Io {
                            path: path.to_owned(),
                            what: "moving the corrupt ledger aside",
                            source,
                        })?;
                    }
                }
                let mut ledger = Self::open_checked(path)?;
                let why = problem.to_string();
                ledger.record_event(
                    EventKind::LedgerMovedAside,
                    &format!("the previous ledger was unusable ({why}); it was kept at {}", aside.display()),
                )?;
                Ok(Opened { ledger, moved_aside: Some((aside, why)) })
            }
        }
    }

    fn open_checked(path: &Path) -> Result<Ledger, LedgerError> {
        let sqlite = |what| sql(path, what);
        let conn = Connection::open(path).map_err(sqlite("opening"))?;
        restrict_permissions(path);
        conn.busy_timeout(std::time::Duration::from_secs(5)).map_err(sqlite("setting the busy timeout"))?;
        let check: String =
            conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).map_err(sqlite("checking integrity"))?;
        if check != "ok" {
            return Err(LedgerError::BadRow { path: path.to_owned(), id: 0, why: format!("integrity check: {check}") });
        }
        let mode: String =
            conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0)).map_err(sqlite("enabling WAL"))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(LedgerError::BadRow { path: path.to_owned(), id: 0, why: format!("journal mode is {mode}") });
        }
        // Checkpoints run from a second connection ([`Ledger::checkpointer`]), not inside an
        // allocation's commit.
        conn.execute_batch("PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON; PRAGMA wal_autocheckpoint = 0;")
            .map_err(sqlite("setting durability"))?;
        let mut ledger = Ledger { path: path.to_owned(), conn };
        ledger.migrate()?;
        Ok(ledger)
    }

    fn err(&self, what: &'static str) -> impl Fn(rusqlite::Error) -> LedgerError + '_ {
        move |source| LedgerError::Sqlite { path: self.path.clone(), what, source }
    }

    /// The file.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the rows of one container request in one transaction, committed before return.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses (for example a live row for the same container and GPU).
    pub fn allocate(&mut self, rows: &[NewRow]) -> Result<Vec<Row>, LedgerError> {
        let at = now_ms();
        let path = self.path.clone();
        let sqlite = |what| sql(&path, what);
        let tx = self.conn.transaction().map_err(sqlite("starting an allocation"))?;
        let mut written = Vec::with_capacity(rows.len());
        for r in rows {
            let key = request_key(&r.device_ids);
            tx.prepare_cached(
                "INSERT INTO allocations (pod_uid, namespace, pod_name, container, role, gpu_uuid, gpu_index, mib,
                                          device_ids, allocated_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
            )
            .and_then(|mut insert| {
                insert.execute(params![
                    r.pod.uid,
                    r.pod.namespace,
                    r.pod.name,
                    r.container,
                    role_str(r.role),
                    r.gpu_uuid.as_str(),
                    r.gpu_index,
                    i64::try_from(r.mib.get()).unwrap_or(i64::MAX),
                    key,
                    at
                ])
            })
            .map_err(sqlite("writing an allocation"))?;
            written.push(Row {
                id: tx.last_insert_rowid(),
                pod: r.pod.clone(),
                container: r.container.clone(),
                role: r.role,
                gpu_uuid: r.gpu_uuid.clone(),
                gpu_index: r.gpu_index,
                mib: r.mib,
                device_ids: device_set_ids(&key).unwrap_or_default(),
                request_key: key,
                allocated_at: at,
                released_at: None,
                release_reason: None,
            });
        }
        tx.commit().map_err(sqlite("committing an allocation"))?;
        Ok(written)
    }

    /// Releases every live row of a pod, keeping them as history. Returns how many.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses.
    pub fn release_pod(&mut self, pod_uid: &str, reason: &str) -> Result<usize, LedgerError> {
        self.conn
            .execute(
                "UPDATE allocations SET released_at = ?1, release_reason = ?2 WHERE pod_uid = ?3 AND released_at IS NULL",
                params![now_ms(), reason, pod_uid],
            )
            .map_err(self.err("releasing a pod"))
    }

    /// Releases these live rows (a reconciliation repair), keeping them as history. Returns
    /// how many were live.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses; then nothing is released.
    pub fn release_rows(&mut self, ids: &[i64], reason: &str) -> Result<usize, LedgerError> {
        let at = now_ms();
        let path = self.path.clone();
        let sqlite = |what| sql(&path, what);
        let tx = self.conn.transaction().map_err(sqlite("starting a release"))?;
        let mut n = 0;
        for id in ids {
            n += tx
                .prepare_cached(
                    "UPDATE allocations SET released_at = ?1, release_reason = ?2 WHERE id = ?3 AND released_at IS NULL",
                )
                .and_then(|mut update| update.execute(params![at, reason, id]))
                .map_err(sqlite("releasing an allocation"))?;
        }
        tx.commit().map_err(sqlite("committing a release"))?;
        Ok(n)
    }

    /// Live rows (not released), oldest first.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses or a row is malformed.
    pub fn live(&self) -> Result<Vec<Row>, LedgerError> {
        self.rows("WHERE released_at IS NULL ORDER BY id", params![])
    }

    /// Live rows written for exactly this device set.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses or a row is malformed.
    pub fn live_by_key(&self, key: &str) -> Result<Vec<Row>, LedgerError> {
        self.rows("WHERE released_at IS NULL AND device_ids = ?1 ORDER BY id", params![key])
    }

    /// Live rows of one pod's container, oldest first.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses or a row is malformed.
    pub fn live_of(&self, pod_uid: &str, container: &str) -> Result<Vec<Row>, LedgerError> {
        self.rows(
            "WHERE released_at IS NULL AND pod_uid = ?1 AND container = ?2 ORDER BY id",
            params![pod_uid, container],
        )
    }

    /// Whether the ledger has ever held a row, live or released, for this pod's container.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses.
    pub fn ever_held(&self, pod_uid: &str, container: &str) -> Result<bool, LedgerError> {
        self.conn
            .prepare_cached("SELECT EXISTS (SELECT 1 FROM allocations WHERE pod_uid = ?1 AND container = ?2)")
            .and_then(|mut stmt| stmt.query_row(params![pod_uid, container], |r| r.get::<_, bool>(0)))
            .map_err(self.err("looking up a container's history"))
    }

    /// Copies the database and its write-ahead log (what is left of them) to `<path>.<tag>-<unix-ms>`,
    /// for an operator to look into; returns the copy of the database.
    ///
    /// # Errors
    /// [`LedgerError::Io`] if a file cannot be copied.
    pub fn keep_copy(&self, tag: &str) -> Result<PathBuf, LedgerError> {
        let copy = PathBuf::from(format!("{}.{tag}-{}", self.path.display(), now_ms()));
        for suffix in ["", "-wal"] {
            let from = PathBuf::from(format!("{}{suffix}", self.path.display()));
            let to = PathBuf::from(format!("{}{suffix}", copy.display()));
            if from.exists() {
                std::fs::copy(&from, &to).map_err(|source| LedgerError::Io {
                    path: self.path.clone(),
                    what: "keeping a copy of the ledger",
                    source,
                })?;
            }
        }
        Ok(copy)
    }

    /// Every row, live and released, allocated at or after `since_ms`.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses or a row is malformed.
    pub fn all_since(&self, since_ms: i64) -> Result<Vec<Row>, LedgerError> {
        self.rows("WHERE allocated_at >= ?1 OR released_at >= ?1 ORDER BY id", params![since_ms])
    }

    fn rows(&self, tail: &str, args: &[&dyn rusqlite::ToSql]) -> Result<Vec<Row>, LedgerError> {
        let sql = format!(
            "SELECT id, pod_uid, namespace, pod_name, container, role, gpu_uuid, gpu_index, mib, device_ids,
                    allocated_at, released_at, release_reason FROM allocations {tail}"
        );
        let mut stmt = self.conn.prepare_cached(&sql).map_err(self.err("reading allocations"))?;
        let raw = stmt
            .query_map(args, |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    PodRef { uid: r.get(1)?, namespace: r.get(2)?, name: r.get(3)? },
                    r.get::<_, String>(4)?,
                    r.get::<_, String>(5)?,
                    r.get::<_, String>(6)?,
                    r.get::<_, i64>(7)?,
                    r.get::<_, i64>(8)?,
                    r.get::<_, String>(9)?,
                    r.get::<_, i64>(10)?,
                    r.get::<_, Option<i64>>(11)?,
                    r.get::<_, Option<String>>(12)?,
                ))
            })
            .map_err(self.err("reading allocations"))?;
        let mut out = Vec::new();
        for item in raw {
            let (id, pod, container, role, uuid, index, mib, key, at, released, reason) =
                item.map_err(self.err("reading allocations"))?;
            let bad = |why: String| LedgerError::BadRow { path: self.path.clone(), id, why };
            let role = match role.as_str() {
                "init" => ContainerRole::Init,
                "sidecar" => ContainerRole::Sidecar,
                "app" => ContainerRole::App,
                other => return Err(bad(format!("unknown role {other:?}"))),
            };
            out.push(Row {
                id,
                pod,
                container,
                role,
                gpu_uuid: GpuUuid::new(uuid).map_err(|e| bad(e.to_string()))?,
                gpu_index: u32::try_from(index).map_err(|_| bad(format!("GPU index {index}")))?,
                mib: Mib::new(u64::try_from(mib).map_err(|_| bad(format!("{mib} MiB")))?),
                device_ids: device_set_ids(&key).ok_or_else(|| bad(format!("malformed device set {key:?}")))?,
                request_key: key,
                allocated_at: at,
                released_at: released,
                release_reason: reason,
            });
        }
        Ok(out)
    }

    /// Appends an event to the history.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses.
    pub fn record_event(&mut self, kind: EventKind, detail: &str) -> Result<(), LedgerError> {
        self.conn
            .execute(
                "INSERT INTO events (at, kind, detail) VALUES (?1, ?2, ?3)",
                params![now_ms(), kind.as_str(), detail],
            )
            .map(|_| ())
            .map_err(self.err("recording an event"))
    }

    /// The GPUs an operator cordoned (UUIDs); they stay cordoned across restarts.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses.
    pub fn cordoned(&self) -> Result<Vec<String>, LedgerError> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT gpu_uuid FROM cordons ORDER BY gpu_uuid")
            .map_err(self.err("reading cordons"))?;
        let rows = stmt.query_map([], |r| r.get(0)).map_err(self.err("reading cordons"))?;
        rows.collect::<Result<Vec<String>, _>>().map_err(self.err("reading cordons"))
    }

    /// Records a GPU as cordoned or not, with an event, in one transaction.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses; then nothing changed.
    pub fn set_cordon(&mut self, gpu_uuid: &str, cordoned: bool, detail: &str) -> Result<(), LedgerError> {
        let at = now_ms();
        let path = self.path.clone();
        let sqlite = |what| sql(&path, what);
        let tx = self.conn.transaction().map_err(sqlite("starting a cordon change"))?;
        if cordoned {
            tx.execute("INSERT OR REPLACE INTO cordons (gpu_uuid, cordoned_at) VALUES (?1, ?2)", params![gpu_uuid, at])
        } else {
            tx.execute("DELETE FROM cordons WHERE gpu_uuid = ?1", params![gpu_uuid])
        }
        .map_err(sqlite("recording a cordon"))?;
        tx.execute(
            "INSERT INTO events (at, kind, detail) VALUES (?1, ?2, ?3)",
            params![at, if cordoned { EventKind::Cordon } else { EventKind::Uncordon }.as_str(), detail],
        )
        .map_err(sqlite("recording an event"))?;
        tx.commit().map_err(sqlite("committing a cordon change"))
    }

    /// Events at or after `since_ms`, oldest first.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses.
    pub fn events_since(&self, since_ms: i64) -> Result<Vec<Event>, LedgerError> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT at, kind, detail FROM events WHERE at >= ?1 ORDER BY id")
            .map_err(self.err("reading events"))?;
        let rows = stmt
            .query_map(params![since_ms], |r| Ok(Event { at: r.get(0)?, kind: r.get(1)?, detail: r.get(2)? }))
            .map_err(self.err("reading events"))?;
        rows.collect::<Result<Vec<_>, _>>().map_err(self.err("reading events"))
    }

    /// Copies the whole write-ahead log into the database file and empties the log: at a
    /// clean stop, so that the file alone holds everything (a lost `-wal` then loses nothing).
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses or another connection holds the log.
    pub fn checkpoint_truncate(&self) -> Result<(), LedgerError> {
        let busy: i64 = self
            .conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))
            .map_err(self.err("checkpointing the write-ahead log"))?;
        if busy != 0 {
            return Err(LedgerError::BadRow {
                path: self.path.clone(),
                id: 0,
                why: "the write-ahead log is in use; it was not emptied".into(),
            });
        }
        Ok(())
    }

    /// The schema version of the open file.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses.
    pub fn schema_version(&self) -> Result<i64, LedgerError> {
        self.conn.query_row("PRAGMA user_version", [], |r| r.get(0)).map_err(self.err("reading the schema version"))
    }

    /// The live row with this id, if any (for tests and the status API).
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses.
    pub fn is_live(&self, id: i64) -> Result<bool, LedgerError> {
        self.conn
            .query_row("SELECT 1 FROM allocations WHERE id = ?1 AND released_at IS NULL", params![id], |_| Ok(()))
            .optional()
            .map(|o| o.is_some())
            .map_err(self.err("reading an allocation"))
    }
}

/// The ledger holds who used which GPU: root only.
fn restrict_permissions(path: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
    if let Some(dir) = path.parent()
        && dir.file_name().is_some_and(|n| n == "gpushare")
    {
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    }
}

mod checkpoint;
mod claims;
mod events;
mod gpus;
mod history;
mod schema;

pub use checkpoint::{Checkpointer, spawn_checkpoints};
pub use claims::{ClaimRow, NewClaimRow};
pub use events::EventKind;
pub use history::{BadCursor, Cursor, HistoryLine, HistoryPage, HistoryReader, MAX_PAGE, Retention};
pub use schema::{MIGRATIONS, Migration};

#[cfg(test)]
mod tests;
