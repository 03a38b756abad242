//! Checkpoints off the allocation path: a second connection copies the write-ahead log into
//! the database file (a passive checkpoint never blocks a commit), every few seconds on a
//! thread of its own.

use std::path::PathBuf;
use std::time::Duration;

use rusqlite::Connection;

use super::{Ledger, LedgerError, sql};

/// A second connection to the ledger that copies the write-ahead log into the database file
/// (a passive checkpoint: it never blocks the allocation path), run periodically.
#[derive(Debug)]
pub struct Checkpointer {
    path: PathBuf,
    conn: Connection,
}

impl Checkpointer {
    /// Runs one passive checkpoint; returns the WAL frames copied.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses.
    pub fn checkpoint(&self) -> Result<i64, LedgerError> {
        self.conn
            .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get::<_, i64>(2))
            .map_err(sql(&self.path, "checkpointing the write-ahead log"))
    }
}

impl Ledger {
    /// A checkpoint connection for this ledger.
    ///
    /// # Errors
    /// [`LedgerError`] if the file cannot be opened again.
    pub fn checkpointer(&self) -> Result<Checkpointer, LedgerError> {
        let conn = Connection::open(&self.path).map_err(sql(&self.path, "opening a checkpoint connection"))?;
        conn.busy_timeout(std::time::Duration::from_secs(5)).map_err(sql(&self.path, "setting the busy timeout"))?;
        // A checkpoint syncs the database file before the log may be reused: said here rather
        // than left to the build's default.
        conn.execute_batch("PRAGMA synchronous = FULL;").map_err(sql(&self.path, "setting synchronous"))?;
        Ok(Checkpointer { path: self.path.clone(), conn })
    }
}

/// Runs `checkpointer` every `every` on a thread of its own, for the life of the process.
///
/// # Errors
/// The thread cannot be started.
pub fn spawn_checkpoints(checkpointer: Checkpointer, every: Duration) -> std::io::Result<()> {
    std::thread::Builder::new().name("ledger-checkpoint".into()).spawn(move || {
        loop {
            std::thread::sleep(every);
            let start = std::time::Instant::now();
            match checkpointer.checkpoint() {
                Ok(frames) => tracing::debug!(frames, took = ?start.elapsed(), "ledger checkpoint"),
                Err(e) => tracing::warn!(error = %e, "ledger checkpoint failed; will retry"),
            }
        }
    })?;
    Ok(())
}
