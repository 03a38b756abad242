//! The GPUs this node last saw answering: their identity (UUID, index, model, memory, minor,
//! NUMA node, PCI bus id), remembered in the ledger's `gpus` table at every start. A GPU that
//! does not answer at the next start (fallen off the bus, its UUID query failing) is then still
//! served, unhealthy, under this identity, and its allocations keep their GPU.

use gpushare_core::{Gpu, GpuUuid, Mib};
use rusqlite::params;

use super::{EventKind, Ledger, LedgerError, now_ms, sql};

/// A `gpus` row as SQLite holds it: rowid, UUID, index, model, MiB, minor, NUMA node, PCI bus id.
type Raw = (i64, String, i64, String, i64, Option<i64>, Option<i64>, Option<String>);

impl Ledger {
    /// The GPUs remembered, by index (healthy, uncordoned and shared: only the identity is kept).
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses or a row breaks the table's rules.
    pub fn known_gpus(&self) -> Result<Vec<Gpu>, LedgerError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT rowid, uuid, gpu_index, model, total_mib, minor, numa_node, pci_bus_id FROM gpus \
                 ORDER BY gpu_index, uuid",
            )
            .map_err(self.err("reading the known GPUs"))?;
        let raw = stmt
            .query_map([], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?, r.get(7)?))
            })
            .map_err(self.err("reading the known GPUs"))?
            .collect::<Result<Vec<Raw>, _>>()
            .map_err(self.err("reading the known GPUs"))?;
        raw.into_iter()
            .map(|(id, uuid, index, model, total, minor, numa, pci)| {
                let bad =
                    |why: String| LedgerError::BadRow { path: self.path.clone(), id, why: format!("gpus: {why}") };
                let uuid = GpuUuid::new(uuid).map_err(|e| bad(e.to_string()))?;
                let index = u32::try_from(index).map_err(|_| bad(format!("index {index}")))?;
                let total = u64::try_from(total).map_err(|_| bad(format!("total {total} MiB")))?;
                let mut gpu = Gpu::new(index, uuid, model, Mib::new(total));
                gpu.minor = minor.and_then(|m| u32::try_from(m).ok());
                gpu.numa_node = numa.and_then(|n| u32::try_from(n).ok());
                gpu.pci_bus_id = pci;
                Ok(gpu)
            })
            .collect()
    }

    /// Remembers `gpus` (those that answered at this start) as the last identity of each, in
    /// one transaction.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses; then nothing changed.
    pub fn remember_gpus(&mut self, gpus: &[Gpu]) -> Result<(), LedgerError> {
        let at = now_ms();
        let path = self.path.clone();
        let sqlite = |what| sql(&path, what);
        let tx = self.conn.transaction().map_err(sqlite("starting to remember the GPUs"))?;
        for g in gpus {
            tx.execute(
                "INSERT OR REPLACE INTO gpus (uuid, gpu_index, model, total_mib, minor, numa_node, pci_bus_id, seen_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                params![
                    g.uuid.as_str(),
                    g.index,
                    g.model,
                    i64::try_from(g.total.get()).unwrap_or(i64::MAX),
                    g.minor,
                    g.numa_node,
                    g.pci_bus_id,
                    at
                ],
            )
            .map_err(sqlite("remembering a GPU"))?;
        }
        tx.commit().map_err(sqlite("committing the GPUs"))
    }

    /// Forgets a remembered GPU (replaced, or removed for good), with an event of `kind` and
    /// `detail`, in one transaction. Returns whether it was remembered.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses; then nothing changed.
    pub fn forget_gpu(&mut self, uuid: &str, kind: EventKind, detail: &str) -> Result<bool, LedgerError> {
        let path = self.path.clone();
        let sqlite = |what| sql(&path, what);
        let tx = self.conn.transaction().map_err(sqlite("starting to forget a GPU"))?;
        let n = tx.execute("DELETE FROM gpus WHERE uuid = ?1", params![uuid]).map_err(sqlite("forgetting a GPU"))?;
        if n > 0 {
            tx.execute(
                "INSERT INTO events (at, kind, detail) VALUES (?1, ?2, ?3)",
                params![now_ms(), kind.as_str(), detail],
            )
            .map_err(sqlite("recording an event"))?;
        }
        tx.commit().map_err(sqlite("committing a forgotten GPU"))?;
        Ok(n > 0)
    }
}
