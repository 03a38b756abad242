//! The ledger's history, read in pages and kept bounded.
//!
//! - Read: [`HistoryReader`] is a connection of its own, read-only, so a long read of the
//!   history never holds the allocator's lock or its connection (SQLite's write-ahead log lets
//!   it read beside the writer). The history is one stream ordered by time: the events, each
//!   allocation row's booking and its release. A page is at most [`MAX_PAGE`] lines; its
//!   [`Cursor`] says where the next one starts, so no line is skipped or repeated however many
//!   share a millisecond.
//! - Pruned: [`Ledger::prune_history`] deletes events and released rows (allocations and DRA
//!   claims) older than the configured age, and the oldest beyond the configured count, in
//!   small batches so no transaction holds the writer long. Live rows are never touched. Freed
//!   pages are reused, so a node that has run for a year keeps a file of bounded size.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use rusqlite::{Connection, OpenFlags, params};
use thiserror::Error;

#[cfg(test)]
use super::events::EventKind;
use super::{Ledger, LedgerError, sql};

/// The most lines one page holds.
pub const MAX_PAGE: usize = 10_000;

/// Rows deleted per transaction while pruning.
const PRUNE_BATCH: usize = 5_000;

/// One line of the history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryLine {
    /// When, Unix ms.
    pub at_ms: i64,
    /// What kind ([`EventKind`]'s string).
    pub kind: String,
    /// What happened.
    pub detail: String,
}

/// Where a page of the history ended: the next page starts after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    at_ms: i64,
    source: i64,
    id: i64,
}

/// A cursor that is not one the daemon handed out.
#[derive(Debug, Error)]
#[error("history cursor {0:?} is not one gpushared handed out; start again with an empty cursor")]
pub struct BadCursor(String);

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.at_ms, self.source, self.id)
    }
}

impl FromStr for Cursor {
    type Err = BadCursor;

    fn from_str(s: &str) -> Result<Self, BadCursor> {
        let bad = || BadCursor(s.chars().take(64).collect());
        let mut parts = s.split('.');
        let mut next = || parts.next().and_then(|p| p.parse::<i64>().ok()).ok_or_else(bad);
        let cursor = Cursor { at_ms: next()?, source: next()?, id: next()? };
        if parts.next().is_some() || !(0..=2).contains(&cursor.source) {
            return Err(bad());
        }
        Ok(cursor)
    }
}

/// A page of the history, oldest first; `next` is where the following page starts, `None` at
/// the end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryPage {
    /// The lines.
    pub lines: Vec<HistoryLine>,
    /// Where the next page starts.
    pub next: Option<Cursor>,
}

/// How much history the ledger keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// Lines older than this many days are deleted; 0 keeps them.
    pub days: u32,
    /// At most this many events and this many released rows of each table are kept; 0 keeps all.
    pub max_rows: u64,
}

/// A read-only connection to the ledger for its history.
#[derive(Debug)]
pub struct HistoryReader {
    path: PathBuf,
    conn: Connection,
}

/// The history as one stream: source 0 the events, 1 the bookings, 2 the releases.
const STREAM: &str = r#"
SELECT at, 0 AS source, id, kind, detail FROM events
UNION ALL
SELECT allocated_at, 1, id, 'allocated',
       printf('%s/%s container "%s" GPU%d %d MiB', namespace, pod_name, container, gpu_index, mib)
  FROM allocations
UNION ALL
SELECT released_at, 2, id, 'released',
       printf('%s/%s container "%s" GPU%d %d MiB: %s', namespace, pod_name, container, gpu_index, mib,
              coalesce(release_reason, ''))
  FROM allocations WHERE released_at IS NOT NULL
"#;

impl HistoryReader {
    /// Opens `path` read-only.
    ///
    /// # Errors
    /// [`LedgerError`] if it cannot be opened.
    pub fn open(path: &Path) -> Result<HistoryReader, LedgerError> {
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(path, flags).map_err(sql(path, "opening a history connection"))?;
        conn.busy_timeout(std::time::Duration::from_secs(5)).map_err(sql(path, "setting the busy timeout"))?;
        Ok(HistoryReader { path: path.to_owned(), conn })
    }

    /// Up to `max` lines (at most [`MAX_PAGE`]) from `since_ms` on, after `after` if given,
    /// oldest first.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses.
    pub fn page(&self, since_ms: i64, after: Option<Cursor>, max: usize) -> Result<HistoryPage, LedgerError> {
        let max = max.clamp(1, MAX_PAGE);
        let after = after.unwrap_or(Cursor { at_ms: i64::MIN, source: -1, id: -1 });
        let query = format!(
            "SELECT at, source, id, kind, detail FROM ({STREAM}) WHERE at >= ?1 AND (at, source, id) > (?2, ?3, ?4) \
             ORDER BY at, source, id LIMIT ?5"
        );
        let err = || sql(&self.path, "reading the history");
        let mut stmt = self.conn.prepare_cached(&query).map_err(err())?;
        let limit = i64::try_from(max).unwrap_or(i64::MAX).saturating_add(1);
        let rows = stmt
            .query_map(params![since_ms, after.at_ms, after.source, after.id, limit], |r| {
                Ok((
                    Cursor { at_ms: r.get(0)?, source: r.get(1)?, id: r.get(2)? },
                    HistoryLine { at_ms: r.get(0)?, kind: r.get(3)?, detail: r.get(4)? },
                ))
            })
            .map_err(err())?;
        let mut lines = Vec::new();
        let mut last = None;
        let mut more = false;
        for row in rows {
            let (cursor, line) = row.map_err(err())?;
            if lines.len() == max {
                more = true;
                break;
            }
            lines.push(line);
            last = Some(cursor);
        }
        Ok(HistoryPage { lines, next: last.filter(|_| more) })
    }
}

#[cfg(test)]
impl HistoryReader {
    /// Opens a read transaction and reads in it, as a long read of the history would, until
    /// [`Self::end_read`].
    pub(crate) fn begin_read(&self) {
        #[allow(clippy::unwrap_used)]
        {
            self.conn.execute_batch("BEGIN").unwrap();
            let _: i64 = self.conn.query_row("SELECT count(*) FROM events", [], |r| r.get(0)).unwrap();
        }
    }

    /// Ends [`Self::begin_read`]'s transaction.
    pub(crate) fn end_read(&self) {
        #[allow(clippy::unwrap_used)]
        self.conn.execute_batch("ROLLBACK").unwrap();
    }
}

impl Ledger {
    /// A read-only connection for the history ([`HistoryReader`]).
    ///
    /// # Errors
    /// [`LedgerError`] if the file cannot be opened again.
    pub fn history_reader(&self) -> Result<HistoryReader, LedgerError> {
        HistoryReader::open(&self.path)
    }

    /// Deletes one batch (at most [`PRUNE_BATCH`] rows per table) of the history `retention`
    /// no longer keeps at `now_ms`: events and released rows older than its age, and the
    /// oldest beyond its count. Live rows are never deleted. Returns the rows deleted; call
    /// again until it returns 0.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses; nothing of the batch is deleted then.
    pub fn prune_history(&mut self, now_ms: i64, retention: Retention) -> Result<usize, LedgerError> {
        let cutoff = if retention.days == 0 {
            i64::MIN
        } else {
            now_ms.saturating_sub(i64::from(retention.days).saturating_mul(86_400_000))
        };
        // The newest `max_rows` are kept: OFFSET past them finds the first one to delete.
        let keep =
            if retention.max_rows == 0 { i64::MAX } else { i64::try_from(retention.max_rows).unwrap_or(i64::MAX) };
        let batch = i64::try_from(PRUNE_BATCH).unwrap_or(i64::MAX);
        let err = || sql(&self.path, "pruning the history");
        let tx = self.conn.transaction().map_err(err())?;
        let mut deleted = 0;
        deleted += tx
            .execute(
                "DELETE FROM events WHERE id IN (SELECT id FROM events WHERE at < ?1 OR id <= coalesce(
                     (SELECT id FROM events ORDER BY id DESC LIMIT 1 OFFSET ?2), -1) ORDER BY id LIMIT ?3)",
                params![cutoff, keep, batch],
            )
            .map_err(err())?;
        for table in ["allocations", "claims"] {
            deleted += tx
                .execute(
                    &format!(
                        "DELETE FROM {table} WHERE id IN (SELECT id FROM {table} WHERE released_at IS NOT NULL AND
                         (released_at < ?1 OR id <= coalesce((SELECT id FROM {table} WHERE released_at IS NOT NULL
                          ORDER BY id DESC LIMIT 1 OFFSET ?2), -1)) ORDER BY id LIMIT ?3)"
                    ),
                    params![cutoff, keep, batch],
                )
                .map_err(err())?;
        }
        tx.commit().map_err(err())?;
        Ok(deleted)
    }

    /// Records a history line as an event, at `at_ms` (for tests that need an old history).
    #[cfg(test)]
    pub(crate) fn event_at(&mut self, at_ms: i64, kind: EventKind, detail: &str) {
        #[allow(clippy::unwrap_used)]
        self.conn
            .execute("INSERT INTO events (at, kind, detail) VALUES (?1, ?2, ?3)", params![at_ms, kind.as_str(), detail])
            .unwrap();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn ledger() -> (tempfile::TempDir, Ledger) {
        let dir = tempfile::tempdir().unwrap();
        let opened = Ledger::open(&dir.path().join("ledger.db")).unwrap();
        (dir, opened.ledger)
    }

    fn count(l: &Ledger, table: &str) -> i64 {
        l.conn.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0)).unwrap()
    }

    #[test]
    fn pages_read_every_line_once_however_many_share_a_millisecond() {
        let (_dir, mut l) = ledger();
        for i in 0..25 {
            l.event_at(1_000 + i / 10, EventKind::Health, &format!("line {i}"));
        }
        let reader = l.history_reader().unwrap();
        let mut seen = Vec::new();
        let mut after = None;
        loop {
            let page = reader.page(0, after, 4).unwrap();
            assert!(page.lines.len() <= 4);
            seen.extend(page.lines.into_iter().map(|line| line.detail));
            match page.next {
                Some(next) => after = Some(next.to_string().parse().unwrap()),
                None => break,
            }
        }
        let want: Vec<String> = (0..25).map(|i| format!("line {i}")).collect();
        assert_eq!(seen, want);
        // `since` bounds it from below; a page never exceeds MAX_PAGE.
        assert_eq!(reader.page(1_002, None, usize::MAX).unwrap().lines.len(), 5);
        for bad in ["", "1.2", "1.2.3.4", "1.7.3", "x.0.1"] {
            assert!(bad.parse::<Cursor>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_year_of_history_is_pruned_to_the_retention_and_live_rows_stay() {
        let (_dir, mut l) = ledger();
        let day = 86_400_000;
        let now = 400 * day;
        for d in (0..365).rev() {
            l.event_at(now - d * day, EventKind::Reconcile, &format!("day {d}"));
        }
        // A live allocation from long ago, and a release as old: only the release goes.
        l.conn
            .execute_batch(
                "INSERT INTO allocations (pod_uid, namespace, pod_name, container, role, gpu_uuid, gpu_index, mib,
                     device_ids, allocated_at, released_at, release_reason) VALUES
                 ('u1', 'ns', 'live', 'main', 'app', 'GPU-a', 0, 100, 'k1', 0, NULL, NULL),
                 ('u2', 'ns', 'gone', 'main', 'app', 'GPU-a', 0, 100, 'k2', 0, 1, 'deleted');",
            )
            .unwrap();
        let retention = Retention { days: 90, max_rows: 0 };
        while l.prune_history(now, retention).unwrap() > 0 {}
        // Days 0 to 90: the line exactly 90 days old is not older than 90 days.
        assert_eq!(count(&l, "events"), 91);
        assert_eq!(count(&l, "allocations"), 1);
        let live: i64 = l
            .conn
            .query_row("SELECT count(*) FROM allocations WHERE pod_name = 'live' AND released_at IS NULL", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(live, 1, "the live row stays");
        // The count bounds it too.
        while l.prune_history(now, Retention { days: 0, max_rows: 30 }).unwrap() > 0 {}
        assert_eq!(count(&l, "events"), 30);
        let reader = l.history_reader().unwrap();
        // The live row's booking is the oldest line; the events kept are the newest.
        let page = reader.page(1, None, MAX_PAGE).unwrap();
        assert_eq!(page.lines.first().unwrap().detail, "day 29", "the newest are kept");
    }
}
