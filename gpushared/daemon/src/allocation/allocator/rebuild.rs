//! A ledger that lost allocations (its `-wal` gone, the file truncated or replaced) is told
//! from the node's own last publication: every container the node published as holding memory
//! must have a row in the ledger, live or released. What is missing is booked again for the
//! pods still bound here and running, once the pod watch has listed them; until then no
//! kubelet call is served ([`AllocError::Rebuilding`]), so nothing is placed on memory the
//! ledger forgot. The kubelet's PodResources, when reachable, then corrects the device sets
//! (reconciliation releases a rebuilt row and adopts what the kubelet holds).

use std::sync::Arc;

use gpushare_core::codec::node::NodeAllocation;

use super::{AllocError, Allocator, Held};
use crate::allocation::ledger::{LedgerError, NewRow};

/// What a rebuild booked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rebuilt {
    /// Rows booked again.
    pub rows: usize,
    /// Of the missing rows, those of pods gone or finished meanwhile: not booked.
    pub gone: usize,
}

impl Allocator {
    /// The allocations of `published` (the node's last published state) of which the ledger
    /// has no row at all, live or released.
    ///
    /// # Errors
    /// [`LedgerError`] if the ledger cannot be read.
    pub fn missing_from_ledger(&self, published: &[NodeAllocation]) -> Result<Vec<NodeAllocation>, LedgerError> {
        let state = self.lock();
        let mut missing = Vec::new();
        for a in published {
            if !state.ledger.ever_held(&a.pod.uid, &a.container)? {
                missing.push(a.clone());
            }
        }
        Ok(missing)
    }

    /// Keeps a copy of the ledger's files as they are (see [`crate::allocation::ledger::Ledger::keep_copy`]).
    ///
    /// # Errors
    /// [`LedgerError::Io`].
    pub fn keep_ledger_copy(&self, tag: &str) -> Result<std::path::PathBuf, LedgerError> {
        self.lock().ledger.keep_copy(tag)
    }

    /// At a clean stop: the ledger's log copied into its file and emptied
    /// ([`crate::allocation::ledger::Ledger::checkpoint_truncate`]).
    ///
    /// # Errors
    /// [`LedgerError`].
    pub fn checkpoint_at_stop(&self) -> Result<(), LedgerError> {
        self.lock().ledger.checkpoint_truncate()
    }

    /// Stops serving until [`Self::finish_rebuild`] books `missing` again.
    pub fn begin_rebuild(&self, missing: Vec<NodeAllocation>) {
        self.lock().rebuilding = Some(missing);
    }

    /// Whether a rebuild is under way, with the rows still to book.
    pub(super) fn rebuilding(state: &super::State) -> Result<(), AllocError> {
        match &state.rebuilding {
            Some(missing) => Err(AllocError::Rebuilding { missing: missing.len() }),
            None => Ok(()),
        }
    }

    /// Books the missing rows of the pods the pod watch lists as bound here and not finished
    /// (call once it has listed them), records it in the history, and serves again.
    ///
    /// # Errors
    /// [`LedgerError`]; the rebuild stays pending and calls stay refused.
    pub fn finish_rebuild(&self) -> Result<Rebuilt, LedgerError> {
        let mut state = self.lock();
        let Some(missing) = state.rebuilding.clone() else { return Ok(Rebuilt::default()) };
        let mut rows = Vec::new();
        let mut gone = 0;
        for a in &missing {
            let live = self
                .pods
                .get(&a.pod.uid)
                .is_some_and(|p| !p.view.terminal && p.view.node.as_deref() == Some(self.node.as_str()));
            let gpu = state.inventory.by_index(a.gpu).map(|g| g.uuid.clone());
            match gpu {
                Some(gpu_uuid) if live => rows.push(NewRow {
                    pod: a.pod.clone(),
                    container: a.container.clone(),
                    role: a.role,
                    gpu_uuid,
                    gpu_index: a.gpu,
                    mib: a.mib,
                    // The devices are the kubelet's word; reconciliation adopts them.
                    device_ids: Vec::new(),
                }),
                _ => gone += 1,
            }
        }
        let written = state.ledger.allocate(&rows)?;
        state.held.extend(written.iter().map(|r| Arc::new(Held::from(r))));
        let detail = format!(
            "rebuilt {} allocation(s) the ledger had lost, from the node's last published state and the pods bound \
             here; {gone} more belonged to pods gone or finished since",
            rows.len()
        );
        state.ledger.record_event(crate::allocation::ledger::EventKind::LedgerRebuilt, &detail)?;
        state.rebuilding = None;
        drop(state);
        self.changed();
        Ok(Rebuilt { rows: rows.len(), gone })
    }
}
