//! The kinds of line in the ledger's event history: one enum, so that a kind is spelled once
//! and the list in `docs/dbus.md` is the whole list. The history stores and serves each kind
//! as its string (the D-Bus `History` method and `gpusharectl history` show it unchanged).

use std::fmt;

/// What a line of the event history records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A container's devices were booked (from the allocations table, not stored as an event).
    Allocated,
    /// A container's devices were given back (likewise from the allocations table).
    Released,
    /// A GPU turned unhealthy or healthy again.
    Health,
    /// An operator cordoned a GPU.
    Cordon,
    /// An operator uncordoned a GPU.
    Uncordon,
    /// Reconciliation with the kubelet released, adopted or could not adopt something.
    Reconcile,
    /// The ledger was unusable at start and was moved aside for a new one.
    LedgerMovedAside,
    /// The ledger was rebuilt from the API server's bound pods and assignments.
    LedgerRebuilt,
    /// At start the ledger did not account for every GPU's published usage.
    LedgerIncomplete,
    /// A GPU seen before does not answer: served Unhealthy under its last identity.
    GpuLost,
    /// A GPU seen before answers with another UUID: the old one is forgotten.
    GpuReplaced,
    /// A container went over its GPU memory budget.
    OverBudget,
    /// A container came back within its budget.
    WithinBudget,
    /// A pod over its budget was evicted.
    Evicted,
    /// The API server refused an over-budget pod's eviction.
    EvictionRefused,
    /// Whole GPUs were handed out through the whole-GPU resource.
    WholeAllocated,
}

impl EventKind {
    /// The kind as the history stores and shows it.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Allocated => "allocated",
            EventKind::Released => "released",
            EventKind::Health => "health",
            EventKind::Cordon => "cordon",
            EventKind::Uncordon => "uncordon",
            EventKind::Reconcile => "reconcile",
            EventKind::LedgerMovedAside => "ledger-moved-aside",
            EventKind::LedgerRebuilt => "ledger-rebuilt",
            EventKind::LedgerIncomplete => "ledger-incomplete",
            EventKind::GpuLost => "gpu-lost",
            EventKind::GpuReplaced => "gpu-replaced",
            EventKind::OverBudget => "over-budget",
            EventKind::WithinBudget => "within-budget",
            EventKind::Evicted => "evicted",
            EventKind::EvictionRefused => "eviction-refused",
            EventKind::WholeAllocated => "whole-allocated",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
