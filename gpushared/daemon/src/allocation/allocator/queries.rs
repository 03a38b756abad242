//! The operator's questions to the allocation service (gpusharectl, over D-Bus): the live
//! allocations, the history (paged, off the allocator's lock), its pruning, and why a pod has what it has on this node.

use gpushare_core::codec::assignment::ASSIGNMENT_KEY;

use super::{AllocError, Allocator};
use crate::allocation::ledger::{Cursor, HistoryPage, Retention, Row};

impl Allocator {
    /// Live rows, of one pod (`namespace`, `name`) if given.
    ///
    /// # Errors
    /// [`AllocError::Ledger`].
    pub fn allocations(&self, pod: Option<(&str, &str)>) -> Result<Vec<Row>, AllocError> {
        let rows = self.live()?;
        Ok(rows.into_iter().filter(|r| pod.is_none_or(|(ns, n)| r.pod.namespace == ns && r.pod.name == n)).collect())
    }

    /// A page of the history from `since_ms` on, after `after` if given, of at most `max`
    /// lines: allocations, releases and events, oldest first ([`crate::allocation::ledger::HistoryReader::page`]). Read on
    /// the history's own connection: it never waits for, or holds up, an allocation.
    ///
    /// # Errors
    /// [`AllocError::Ledger`].
    pub fn history_page(&self, since_ms: i64, after: Option<Cursor>, max: usize) -> Result<HistoryPage, AllocError> {
        let reader = self.history.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(reader.page(since_ms, after, max)?)
    }

    /// Prunes the history `retention` no longer keeps at `now_ms`, a batch per hold of the
    /// allocator's lock so that allocations go on between batches; returns the rows deleted.
    ///
    /// # Errors
    /// [`AllocError::Ledger`]; the batches before it stay deleted.
    pub fn prune_history(&self, now_ms: i64, retention: Retention) -> Result<usize, AllocError> {
        let mut total = 0;
        loop {
            let deleted = self.lock().ledger.prune_history(now_ms, retention)?;
            if deleted == 0 {
                return Ok(total);
            }
            total += deleted;
        }
    }

    /// Where a pod's containers are and why, or why it has nothing on this node.
    ///
    /// # Errors
    /// [`AllocError::Ledger`].
    pub fn explain(&self, namespace: &str, name: &str) -> Result<String, AllocError> {
        let rows = self.allocations(Some((namespace, name)))?;
        let pod =
            self.pods.snapshot().into_iter().find(|p| p.view.pod.namespace == namespace && p.view.pod.name == name);
        let mut lines = Vec::new();
        match &pod {
            None => lines.push(format!("{namespace}/{name} is not bound to node {} as far as gpushared has seen", self.node)),
            Some(p) if p.view.terminal => lines.push(format!("{namespace}/{name} has finished or is being deleted")),
            Some(p) => match &p.assignment {
                None => lines.push(format!(
                    "{namespace}/{name} is bound to {} but has no {ASSIGNMENT_KEY} annotation: it asks for no GPU memory, or was not placed by gpushare-extender",
                    self.node
                )),
                Some(Err(e)) => lines.push(format!("{namespace}/{name}: {e}")),
                Some(Ok(a)) if a.node != self.node => {
                    lines.push(format!("{namespace}/{name} is assigned to node {}, not {}", a.node, self.node));
                }
                Some(Ok(a)) => {
                    lines.push(format!("{namespace}/{name} is assigned to this node by gpushare-extender:"));
                    for c in &a.containers {
                        let held: Vec<&Row> = rows.iter().filter(|r| r.container == c.name).collect();
                        let want = c.gpus.iter().map(|g| format!("GPU{} {} MiB", g.index, g.mib.get())).collect::<Vec<_>>().join(", ");
                        if held.is_empty() {
                            lines.push(format!("  container {:?}: assigned {want}; not admitted by the kubelet yet", c.name));
                        } else {
                            lines.push(format!("  container {:?}: assigned {want}; allocated (kubelet devices {})", c.name, held[0].request_key));
                        }
                    }
                }
            },
        }
        if pod.is_none() && !rows.is_empty() {
            lines
                .push(format!("  the ledger still holds {} row(s) for it; a reconciliation releases them", rows.len()));
        }
        Ok(lines.join("\n"))
    }
}

/// Prunes `alloc`'s history to `retention` now and then every `every`, on a thread of its own
/// (each batch takes the allocator's lock only briefly), logging what it deleted.
///
/// # Errors
/// The thread cannot be started.
pub fn spawn_history_pruning(
    alloc: std::sync::Arc<Allocator>,
    retention: Retention,
    every: std::time::Duration,
) -> std::io::Result<()> {
    if retention.days == 0 && retention.max_rows == 0 {
        return Ok(());
    }
    std::thread::Builder::new().name("ledger-prune".into()).spawn(move || {
        loop {
            let start = std::time::Instant::now();
            match alloc.prune_history(crate::allocation::ledger::now_ms(), retention) {
                Ok(0) => {}
                Ok(rows) => tracing::info!(rows, took = ?start.elapsed(), days = retention.days,
                    max_rows = retention.max_rows, "pruned the ledger's history"),
                Err(e) => tracing::warn!(error = %e, "pruning the ledger's history failed; will retry"),
            }
            std::thread::sleep(every);
        }
    })?;
    Ok(())
}
