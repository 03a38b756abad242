//! A node's GPUs as gpushare sees them: identity (UUID, NVML index, minor number), model,
//! total memory, health, cordon and NUMA node. The daemon builds an inventory from NVML;
//! the extender decodes it from the node annotation. Both then hand it to [`crate::placement`].

use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::units::{MemoryUnit, Mib};

/// A GPU's UUID as NVML reports it (`GPU-8f6e…`, `MIG-…`). Validated: 1–96 characters of
/// `[A-Za-z0-9_.:-]`, so it is safe in device IDs, environment variables and annotations.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct GpuUuid(String);

/// The most characters a [`GpuUuid`] may have.
pub const MAX_UUID_LEN: usize = 96;

/// A GPU UUID that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid GPU UUID {0:?}: expected 1-96 characters of letters, digits, '-', '_', '.', ':'")]
pub struct InvalidUuid(pub String);

impl GpuUuid {
    /// Validates `uuid`.
    ///
    /// # Errors
    /// [`InvalidUuid`] if it is empty, too long or has other characters.
    pub fn new(uuid: impl Into<String>) -> Result<Self, InvalidUuid> {
        let uuid = uuid.into();
        let ok = !uuid.is_empty()
            && uuid.len() <= MAX_UUID_LEN
            && uuid.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
        if ok { Ok(GpuUuid(uuid)) } else { Err(InvalidUuid(uuid)) }
    }

    /// The UUID text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for GpuUuid {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        GpuUuid::new(s).map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether a GPU may take allocations.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum Health {
    /// Answering and free of faults.
    #[default]
    Healthy,
    /// Not to be used; `reason` says why ("Xid 79", "ECC double-bit error", "not answering").
    Unhealthy {
        /// What made the daemon mark it unhealthy.
        reason: String,
    },
}

impl Health {
    /// True for [`Health::Healthy`].
    #[must_use]
    pub fn is_healthy(&self) -> bool {
        matches!(self, Health::Healthy)
    }
}

/// How a GPU's memory is shared among the containers placed on it (the daemon's `[sharing]`
/// configuration, published in the node annotation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum SharingMode {
    /// Containers share the GPU by memory budget; the budget reaches each container as
    /// environment variables (gpushare's, and HAMi-core's, which images carrying that library
    /// enforce).
    #[default]
    Shared,
    /// Containers are clients of the GPU's CUDA MPS control daemon, which pins each client's
    /// device memory to its budget and limits its share of the GPU's threads.
    Mps,
    /// The GPU is handed out whole, through the daemon's second resource (one device per GPU),
    /// and never shared: it offers no memory devices and takes no share.
    Whole,
    /// The GPU is served through Dynamic Resource Allocation: kube-scheduler places
    /// ResourceClaims on it by its published `memory` capacity, and the daemon prepares them.
    /// It offers no device-plugin devices and the extender places no share on it.
    Dra,
    /// Served through DRA, and each claim's containers are clients of the GPU's CUDA MPS
    /// control daemon (named in both `[sharing] dra` and `[sharing] mps`).
    DraMps,
}

impl SharingMode {
    /// The name in configuration files and annotations: `shared`, `mps`, `whole`, `dra` or
    /// `dra-mps`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            SharingMode::Shared => "shared",
            SharingMode::Mps => "mps",
            SharingMode::Whole => "whole",
            SharingMode::Dra => "dra",
            SharingMode::DraMps => "dra-mps",
        }
    }

    /// Parses [`Self::as_str`]'s names.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "shared" => Some(SharingMode::Shared),
            "mps" => Some(SharingMode::Mps),
            "whole" => Some(SharingMode::Whole),
            "dra" => Some(SharingMode::Dra),
            "dra-mps" => Some(SharingMode::DraMps),
            _ => None,
        }
    }

    /// Whether the device plugin's memory resource offers shares of a GPU in this mode
    /// (`shared` and `mps`); a whole GPU and a DRA GPU take none.
    #[must_use]
    pub fn takes_device_plugin_shares(self) -> bool {
        matches!(self, SharingMode::Shared | SharingMode::Mps)
    }

    /// Whether the GPU is served through DRA (`dra` or `dra-mps`).
    #[must_use]
    pub fn is_dra(self) -> bool {
        matches!(self, SharingMode::Dra | SharingMode::DraMps)
    }

    /// Whether the GPU's containers are clients of its CUDA MPS control daemon (`mps` or
    /// `dra-mps`).
    #[must_use]
    pub fn runs_mps(self) -> bool {
        matches!(self, SharingMode::Mps | SharingMode::DraMps)
    }
}

impl std::fmt::Display for SharingMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a GPU is doing, as NVML last said (the daemon samples it at every health probe).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Activity {
    /// Percent of the last sample period the GPU was busy, when NVML reports it.
    pub utilization: Option<u8>,
    /// Memory in use on the GPU by every process, ours or not.
    pub in_use: Mib,
}

impl Activity {
    /// Utilisation points that make a new sample worth publishing.
    pub const UTILIZATION_STEP: u8 = 10;
    /// Memory in use that makes a new sample worth publishing: this much, or a twentieth of
    /// the GPU's total if that is more.
    pub const IN_USE_STEP: Mib = Mib::new(256);

    /// Whether `self` differs from `before` enough to publish (on a GPU of `total`): a change
    /// of utilisation by [`Self::UTILIZATION_STEP`] points or in knowing it, or of the memory
    /// in use by [`Self::IN_USE_STEP`] or 5 % of `total`. Small jitter is not news.
    #[must_use]
    pub fn differs_from(&self, before: &Activity, total: Mib) -> bool {
        let utilization = match (self.utilization, before.utilization) {
            (Some(a), Some(b)) => a.abs_diff(b) >= Self::UTILIZATION_STEP,
            (a, b) => a.is_some() != b.is_some(),
        };
        let step = Self::IN_USE_STEP.get().max(total.get() / 20);
        utilization || self.in_use.get().abs_diff(before.in_use.get()) >= step
    }
}

/// One GPU of a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// NVML index (0-based, the order `nvidia-smi` lists).
    pub index: u32,
    /// NVML UUID; what `NVIDIA_VISIBLE_DEVICES` carries.
    pub uuid: GpuUuid,
    /// The `/dev/nvidiaN` minor number, when known. Alibaba's `ALIYUN_COM_GPU_MEM_IDX` names this.
    pub minor: Option<u32>,
    /// Product name, e.g. `Tesla T4`.
    pub model: String,
    /// Total memory as NVML reports it.
    pub total: Mib,
    /// Health as last judged by the daemon.
    pub health: Health,
    /// Cordoned by an operator: keeps its allocations, takes no new ones.
    pub cordoned: bool,
    /// NUMA node the GPU is attached to, when the platform reports one.
    pub numa_node: Option<u32>,
    /// PCI bus id (`00000000:3B:00.0`), when known.
    pub pci_bus_id: Option<String>,
    /// How its memory is shared.
    pub mode: SharingMode,
    /// What it is doing, when sampled.
    pub activity: Option<Activity>,
}

impl Gpu {
    /// Its device number, `N` of `/dev/nvidiaN`: the minor number, or the index where NVML did
    /// not give one (they agree on most hosts).
    #[must_use]
    pub fn device_number(&self) -> u32 {
        self.minor.unwrap_or(self.index)
    }

    /// A healthy, uncordoned GPU with no minor number or NUMA node; handy for tests and examples.
    #[must_use]
    pub fn new(index: u32, uuid: GpuUuid, model: impl Into<String>, total: Mib) -> Self {
        Gpu {
            index,
            uuid,
            minor: None,
            model: model.into(),
            total,
            health: Health::Healthy,
            cordoned: false,
            numa_node: None,
            pci_bus_id: None,
            mode: SharingMode::Shared,
            activity: None,
        }
    }

    /// Whether new device-plugin shares may land here: healthy, not cordoned, and neither a
    /// whole GPU nor a DRA one.
    #[must_use]
    pub fn is_schedulable(&self) -> bool {
        self.health.is_healthy() && !self.cordoned && self.mode.takes_device_plugin_shares()
    }

    /// The memory that can be handed out as device-plugin shares under `unit`: the total
    /// rounded down to whole units; none on a GPU handed out whole or served through DRA.
    #[must_use]
    pub fn capacity(&self, unit: MemoryUnit) -> Mib {
        if self.mode.takes_device_plugin_shares() { unit.round_down(self.total) } else { Mib::ZERO }
    }
}

/// An inventory that contradicts itself.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum InventoryError {
    /// Two GPUs share an index.
    #[error("GPU index {0} appears twice")]
    DuplicateIndex(u32),
    /// Two GPUs share a UUID.
    #[error("GPU UUID {0} appears twice")]
    DuplicateUuid(GpuUuid),
    /// A GPU with no memory cannot be shared.
    #[error("GPU{index} ({uuid}) reports no memory")]
    NoMemory {
        /// The GPU's index.
        index: u32,
        /// The GPU's UUID.
        uuid: GpuUuid,
    },
}

/// The GPUs of one node and the unit its daemon counts devices in. GPUs are kept sorted by
/// index; indices and UUIDs are unique.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInventory {
    unit: MemoryUnit,
    gpus: Vec<Gpu>,
}

impl NodeInventory {
    /// Builds an inventory, sorting the GPUs by index.
    ///
    /// # Errors
    /// [`InventoryError`] on a repeated index or UUID or a GPU with no memory.
    pub fn new(unit: MemoryUnit, mut gpus: Vec<Gpu>) -> Result<Self, InventoryError> {
        gpus.sort_by_key(|g| g.index);
        for pair in gpus.windows(2) {
            if let [a, b] = pair
                && a.index == b.index
            {
                return Err(InventoryError::DuplicateIndex(a.index));
            }
        }
        let mut uuids: Vec<&GpuUuid> = gpus.iter().map(|g| &g.uuid).collect();
        uuids.sort();
        for pair in uuids.windows(2) {
            if let [a, b] = pair
                && a == b
            {
                return Err(InventoryError::DuplicateUuid((*a).clone()));
            }
        }
        if let Some(g) = gpus.iter().find(|g| g.total == Mib::ZERO) {
            return Err(InventoryError::NoMemory { index: g.index, uuid: g.uuid.clone() });
        }
        Ok(NodeInventory { unit, gpus })
    }

    /// The unit this node's daemon advertises devices in.
    #[must_use]
    pub fn unit(&self) -> MemoryUnit {
        self.unit
    }

    /// The GPUs, sorted by index.
    #[must_use]
    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// The GPU with NVML index `index`.
    #[must_use]
    pub fn by_index(&self, index: u32) -> Option<&Gpu> {
        self.gpus.binary_search_by_key(&index, |g| g.index).ok().and_then(|i| self.gpus.get(i))
    }

    /// The position (in [`NodeInventory::gpus`]) of the GPU with this UUID.
    #[must_use]
    pub fn position_of(&self, uuid: &GpuUuid) -> Option<usize> {
        self.gpus.iter().position(|g| &g.uuid == uuid)
    }

    /// Mutable access for the daemon's health and cordon changes; identity fields must not change.
    pub fn gpu_mut(&mut self, index: u32) -> Option<&mut Gpu> {
        self.gpus.iter_mut().find(|g| g.index == index)
    }

    /// Total schedulable capacity of the node's healthy, uncordoned GPUs.
    #[must_use]
    pub fn schedulable_capacity(&self) -> Mib {
        self.gpus.iter().filter(|g| g.is_schedulable()).map(|g| g.capacity(self.unit)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uuid(s: &str) -> GpuUuid {
        GpuUuid::new(s).unwrap()
    }

    #[test]
    fn uuids_are_validated() {
        for ok in ["GPU-8f6e3c2a-1b2c-4d5e-9f00-112233445566", "MIG-1:2", "g_0.1"] {
            assert!(GpuUuid::new(ok).is_ok(), "{ok}");
        }
        for bad in ["", "GPU 1", "GPU/1", "GPU=1", &"x".repeat(97), "GPÜ-1"] {
            assert!(GpuUuid::new(bad).is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<GpuUuid>("\"a b\"").is_err());
    }

    #[test]
    fn activity_is_news_only_past_its_steps() {
        let at = |u: Option<u8>, mib: u64| Activity { utilization: u, in_use: Mib::new(mib) };
        let total = Mib::new(16_384);
        let before = at(Some(50), 4000);
        assert!(!at(Some(59), 4000).differs_from(&before, total), "9 points");
        assert!(at(Some(60), 4000).differs_from(&before, total), "10 points");
        assert!(at(Some(40), 4000).differs_from(&before, total), "down 10 points");
        assert!(at(None, 4000).differs_from(&before, total), "no longer reported");
        // 5 % of 16 GiB is 819 MiB, more than the 256 MiB floor.
        assert!(!at(Some(50), 4818).differs_from(&before, total));
        assert!(at(Some(50), 4819).differs_from(&before, total));
        // On a small GPU the 256 MiB floor applies.
        assert!(!at(Some(50), 255).differs_from(&at(Some(50), 0), Mib::new(1000)));
        assert!(at(Some(50), 256).differs_from(&at(Some(50), 0), Mib::new(1000)));
    }

    #[test]
    fn inventory_sorts_and_refuses_duplicates() {
        let inv = NodeInventory::new(
            MemoryUnit::Mib,
            vec![Gpu::new(1, uuid("b"), "T4", Mib::new(10)), Gpu::new(0, uuid("a"), "T4", Mib::new(20))],
        )
        .unwrap();
        assert_eq!(inv.gpus()[0].index, 0);
        assert_eq!(inv.by_index(1).unwrap().uuid, uuid("b"));
        assert!(inv.by_index(7).is_none());
        assert_eq!(inv.position_of(&uuid("b")), Some(1));

        let dup_index = NodeInventory::new(
            MemoryUnit::Mib,
            vec![Gpu::new(0, uuid("a"), "T4", Mib::new(1)), Gpu::new(0, uuid("b"), "T4", Mib::new(1))],
        );
        assert_eq!(dup_index, Err(InventoryError::DuplicateIndex(0)));
        let dup_uuid = NodeInventory::new(
            MemoryUnit::Mib,
            vec![Gpu::new(0, uuid("a"), "T4", Mib::new(1)), Gpu::new(1, uuid("a"), "T4", Mib::new(1))],
        );
        assert_eq!(dup_uuid, Err(InventoryError::DuplicateUuid(uuid("a"))));
        let empty = NodeInventory::new(MemoryUnit::Mib, vec![Gpu::new(0, uuid("a"), "T4", Mib::ZERO)]);
        assert!(matches!(empty, Err(InventoryError::NoMemory { index: 0, .. })));
    }

    #[test]
    fn capacity_counts_only_schedulable_gpus_in_whole_units() {
        let mut sick = Gpu::new(1, uuid("b"), "T4", Mib::new(16_276));
        sick.health = Health::Unhealthy { reason: "Xid 79".into() };
        let mut cordoned = Gpu::new(2, uuid("c"), "T4", Mib::new(16_276));
        cordoned.cordoned = true;
        let inv =
            NodeInventory::new(MemoryUnit::Gib, vec![Gpu::new(0, uuid("a"), "T4", Mib::new(16_276)), sick, cordoned])
                .unwrap();
        assert_eq!(inv.schedulable_capacity(), Mib::new(15 * 1024));
    }
}
