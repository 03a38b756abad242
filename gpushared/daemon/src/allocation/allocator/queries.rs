//! The operator's questions to the allocation service (gpusharectl, over D-Bus): the live
//! allocations, the history, and why a pod has what it has on this node.

use gpushare_core::codec::assignment::ASSIGNMENT_KEY;

use super::{AllocError, Allocator};
use crate::allocation::ledger::{EventKind, Row};

impl Allocator {
    /// Live rows, of one pod (`namespace`, `name`) if given.
    ///
    /// # Errors
    /// [`AllocError::Ledger`].
    pub fn allocations(&self, pod: Option<(&str, &str)>) -> Result<Vec<Row>, AllocError> {
        let rows = self.live()?;
        Ok(rows.into_iter().filter(|r| pod.is_none_or(|(ns, n)| r.pod.namespace == ns && r.pod.name == n)).collect())
    }

    /// The history since `since_ms`: allocations, releases and events, oldest first, as
    /// (unix ms, kind, detail).
    ///
    /// # Errors
    /// [`AllocError::Ledger`].
    pub fn history(&self, since_ms: i64) -> Result<Vec<(i64, String, String)>, AllocError> {
        let state = self.lock();
        let rows = state.ledger.all_since(since_ms)?;
        let events = state.ledger.events_since(since_ms)?;
        drop(state);
        let mut out: Vec<(i64, String, String)> = events.into_iter().map(|e| (e.at, e.kind, e.detail)).collect();
        for r in rows {
            let who = format!("{} container {:?} GPU{} {} MiB", r.pod, r.container, r.gpu_index, r.mib.get());
            if r.allocated_at >= since_ms {
                out.push((r.allocated_at, EventKind::Allocated.as_str().into(), who.clone()));
            }
            if let Some(at) = r.released_at.filter(|at| *at >= since_ms) {
                out.push((
                    at,
                    EventKind::Released.as_str().into(),
                    format!("{who}: {}", r.release_reason.unwrap_or_default()),
                ));
            }
        }
        out.sort_by_key(|e| e.0);
        Ok(out)
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
