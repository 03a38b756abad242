//! The node's GPUs as the allocation service keeps them: health, sampled activity, cordons and
//! the containers over budget, each change recorded in the ledger history; and what the node
//! publishes of them with its allocations ([`Allocator::node_state`]).

use gpushare_core::codec::node::{NodeAllocation, NodeClaim, NodeState, OverBudget, used_per_gpu};
use gpushare_core::dra::ClaimRef;
use gpushare_core::{Activity, Health, NodeInventory};

use super::{AllocError, Allocator};
use crate::allocation::ledger::{EventKind, LedgerError};

/// The state of the node's GPUs and ledger, as the systemd status and logs summarize it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Summary {
    /// GPUs served.
    pub gpus: usize,
    /// Of which healthy.
    pub healthy: usize,
    /// Live ledger rows.
    pub allocations: usize,
}

impl Allocator {
    /// The GPUs with their current health and cordon.
    #[must_use]
    pub fn current_inventory(&self) -> NodeInventory {
        self.lock().inventory.clone()
    }

    /// GPU count, healthy GPUs, live allocations.
    #[must_use]
    pub fn summary(&self) -> Summary {
        let state = self.lock();
        Summary {
            gpus: state.inventory.gpus().len(),
            healthy: state.inventory.gpus().iter().filter(|g| g.health.is_healthy()).count(),
            allocations: state.held.len(),
        }
    }

    /// Proves the allocation path is not stuck: takes its lock and asks the ledger a question.
    ///
    /// # Errors
    /// [`LedgerError`] if the ledger does not answer.
    pub fn probe(&self) -> Result<(), LedgerError> {
        self.lock().ledger.schema_version().map(|_| ())
    }

    /// Sets a GPU's health, recording a change in the ledger history. Returns whether it
    /// changed. An unhealthy GPU takes no new allocation; existing ones are kept.
    ///
    /// # Errors
    /// [`AllocError::Ledger`] if the history cannot be written (the health is set anyway:
    /// refusing allocations on a failing GPU matters more than its history).
    pub fn set_health(&self, index: u32, health: Health) -> Result<bool, AllocError> {
        let mut state = self.lock();
        let Some(gpu) = state.inventory.gpu_mut(index) else { return Ok(false) };
        if gpu.health == health {
            return Ok(false);
        }
        let detail = match &health {
            Health::Healthy => format!("GPU{index} ({}) is healthy again", gpu.uuid),
            Health::Unhealthy { reason } => format!("GPU{index} ({}) is unhealthy: {reason}", gpu.uuid),
        };
        gpu.health = health;
        let recorded = state.ledger.record_event(EventKind::Health, &detail);
        drop(state);
        self.changed();
        recorded?;
        Ok(true)
    }

    /// Records what GPU `index` is doing; publishes it (a node-state change) only when it
    /// differs meaningfully from what was last published ([`Activity::differs_from`]). Returns
    /// whether it did.
    pub fn set_activity(&self, index: u32, activity: Activity) -> bool {
        let mut state = self.lock();
        let Some(gpu) = state.inventory.gpu_mut(index) else { return false };
        if gpu.activity.is_some_and(|before| !activity.differs_from(&before, gpu.total)) {
            return false;
        }
        gpu.activity = Some(activity);
        drop(state);
        self.activity.send_modify(|n| *n = n.wrapping_add(1));
        true
    }

    /// Keeps the containers over budget now (published with the node state and on D-Bus) and
    /// records `events` (kind, detail: who went over or back within budget) in the ledger
    /// history; the over-use detector decides both.
    ///
    /// # Errors
    /// [`AllocError::Ledger`] if the history cannot be written (the list is kept anyway).
    pub fn set_over_budget(&self, current: Vec<OverBudget>, events: &[(EventKind, String)]) -> Result<(), AllocError> {
        *self.over_budget.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = current;
        if events.is_empty() {
            return Ok(());
        }
        let mut recorded = Ok(());
        {
            let mut state = self.lock();
            for (kind, detail) in events {
                recorded = recorded.and(state.ledger.record_event(*kind, detail));
            }
        }
        self.changed();
        Ok(recorded?)
    }

    /// The containers over their budget, as last sampled.
    #[must_use]
    pub fn over_budget(&self) -> Vec<OverBudget> {
        self.over_budget.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Adds an entry to the ledger's event history.
    ///
    /// # Errors
    /// [`AllocError::Ledger`].
    pub fn record_event(&self, kind: EventKind, detail: &str) -> Result<(), AllocError> {
        Ok(self.lock().ledger.record_event(kind, detail)?)
    }

    /// Cordons (`true`) or uncordons a GPU named by index or UUID: a cordoned GPU keeps its
    /// allocations, is published as cordoned (the extender places nothing new on it), and stays
    /// so across restarts. Returns the GPU's index and whether anything changed.
    ///
    /// # Errors
    /// [`AllocError::NoSuchGpu`], or [`AllocError::Ledger`] (then nothing changed).
    pub fn set_cordon(&self, gpu: &str, cordoned: bool) -> Result<(u32, bool), AllocError> {
        let mut state = self.lock();
        let found = state
            .inventory
            .gpus()
            .iter()
            .find(|g| g.uuid.as_str() == gpu || gpu.parse::<u32>().is_ok_and(|i| i == g.index))
            .map(|g| (g.index, g.uuid.clone(), g.cordoned));
        let Some((index, uuid, was)) = found else { return Err(AllocError::NoSuchGpu(gpu.to_owned())) };
        if was == cordoned {
            return Ok((index, false));
        }
        let detail = format!("GPU{index} ({uuid}) {}", if cordoned { "cordoned" } else { "uncordoned" });
        state.ledger.set_cordon(uuid.as_str(), cordoned, &detail)?;
        if let Some(g) = state.inventory.gpu_mut(index) {
            g.cordoned = cordoned;
        }
        drop(state);
        tracing::warn!(gpu = index, %uuid, cordoned, "{detail}");
        self.changed();
        Ok((index, true))
    }

    /// What this node publishes: its GPUs, the memory its ledger holds on each (pods by the
    /// init-container rule, DRA claims as they are) and the holders.
    #[must_use]
    pub fn node_state(&self, generation: u64, daemon_version: &str) -> NodeState {
        // Copy out under the lock (pointers, not rows); compute without it.
        let (inventory, held, rebuilding, claims) = {
            let state = self.lock();
            let claims: Vec<NodeClaim> = state
                .claims
                .iter()
                .map(|r| NodeClaim {
                    claim: ClaimRef {
                        uid: r.share.claim_uid.clone(),
                        namespace: r.share.namespace.clone(),
                        name: r.share.name.clone(),
                    },
                    request: r.share.request.clone(),
                    gpu: r.share.gpu_index,
                    mib: r.share.mib,
                })
                .collect();
            (state.inventory.clone(), state.held.to_vec(), state.rebuilding.clone().unwrap_or_default(), claims)
        };
        // While the ledger is rebuilt, what it lost is still published as held.
        let allocations: Vec<NodeAllocation> = held
            .iter()
            .filter_map(|h| {
                let gpu = inventory.gpus().iter().find(|g| g.uuid == h.gpu)?;
                Some(NodeAllocation {
                    pod: h.pod.clone(),
                    container: h.container.clone(),
                    role: h.role,
                    gpu: gpu.index,
                    mib: h.mib,
                })
            })
            .chain(rebuilding)
            .collect();
        let used = used_per_gpu(&inventory, &allocations, &claims);
        let over_budget = self.over_budget();
        NodeState {
            generation,
            daemon_version: daemon_version.to_owned(),
            inventory,
            used,
            allocations,
            claims,
            over_budget,
            // On a counted node every grant is made at the container's creation, which names
            // the pod by UID: no call can be answered for another pod.
            tells_lookalikes_apart: self.kubelet_answers() || self.counted(),
        }
    }
}
