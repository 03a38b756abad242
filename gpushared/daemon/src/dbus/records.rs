//! The records the status API answers with: named structs, each serialized as the D-Bus struct
//! of its fields in order, so the wire signatures (`docs/dbus.md`) are those of the tuples the
//! API has always sent. Field names exist only in Rust.

use serde::{Deserialize, Serialize};
use zbus::Type;

/// One GPU as the API shows it; wire signature `(ussttssb)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct GpuRecord {
    /// NVML index.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// Model name.
    pub model: String,
    /// Total memory, MiB.
    pub total_mib: u64,
    /// Memory the ledger holds, MiB.
    pub used_mib: u64,
    /// `Healthy` or `Unhealthy`.
    pub health: String,
    /// Why unhealthy (empty when healthy).
    pub reason: String,
    /// Cordoned by an operator.
    pub cordoned: bool,
}

/// One live allocation; wire signature `(ssssssutx)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct AllocationRecord {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The pod's UID.
    pub pod_uid: String,
    /// The container.
    pub container: String,
    /// `init`, `sidecar` or `app`.
    pub role: String,
    /// The GPU's UUID.
    pub gpu_uuid: String,
    /// The GPU's index.
    pub gpu_index: u32,
    /// Memory held, MiB.
    pub mib: u64,
    /// When it was allocated, Unix ms.
    pub allocated_at_ms: i64,
}

/// What one GPU is doing; wire signature `(usix)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct ActivityRecord {
    /// NVML index.
    pub index: u32,
    /// Sharing mode: `shared`, `mps` or `whole`.
    pub mode: String,
    /// NVML's utilisation in percent at the last sample (-1: not reported).
    pub utilization_percent: i32,
    /// Memory in use by every process at that sample, MiB (-1: not sampled).
    pub memory_in_use_mib: i64,
}

/// One container over its budget; wire signature `(ssssuttx)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct OverBudgetRecord {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The pod's UID.
    pub pod_uid: String,
    /// The container (empty: not tied to one).
    pub container: String,
    /// The GPU's index.
    pub gpu_index: u32,
    /// Memory in use, MiB.
    pub in_use_mib: u64,
    /// The budget, MiB.
    pub budget_mib: u64,
    /// Over since, Unix ms.
    pub since_ms: i64,
}

/// One history entry; wire signature `(xss)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct HistoryRecord {
    /// When, Unix ms.
    pub at_ms: i64,
    /// The kind (`docs/dbus.md` lists them; the daemon's `EventKind`).
    pub kind: String,
    /// What happened.
    pub detail: String,
}

/// One live DRA claim's share of a GPU; wire signature `(ssssutx)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct ClaimRecord {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub claim: String,
    /// The claim's UID.
    pub claim_uid: String,
    /// The GPU's UUID.
    pub gpu_uuid: String,
    /// The GPU's NVML index.
    pub gpu_index: u32,
    /// MiB held.
    pub mib: u64,
    /// When it was prepared, Unix ms.
    pub prepared_at_ms: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_signatures_are_the_documented_tuples() {
        assert_eq!(<Vec<GpuRecord> as Type>::SIGNATURE.to_string(), "a(ussttssb)");
        assert_eq!(<Vec<AllocationRecord> as Type>::SIGNATURE.to_string(), "a(ssssssutx)");
        assert_eq!(<Vec<ActivityRecord> as Type>::SIGNATURE.to_string(), "a(usix)");
        assert_eq!(<Vec<OverBudgetRecord> as Type>::SIGNATURE.to_string(), "a(ssssuttx)");
        assert_eq!(<Vec<HistoryRecord> as Type>::SIGNATURE.to_string(), "a(xss)");
        assert_eq!(<Vec<ClaimRecord> as Type>::SIGNATURE.to_string(), "a(ssssutx)");
    }
}
