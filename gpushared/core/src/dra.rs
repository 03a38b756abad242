//! The rules of gpushared's DRA driver that do not touch Kubernetes' types: the names of the
//! devices it publishes and the CDI devices it hands the runtime, which GPUs its pool offers,
//! and the memory a claim's allocation consumes. The daemon's `dra` module maps them onto
//! `resource.k8s.io/v1` objects and CDI spec files; docs/dra.md documents them.

use thiserror::Error;

use crate::inventory::Gpu;
use crate::units::{Mib, parse_quantity};

/// The driver name gpushared publishes its ResourceSlices under and kube-scheduler writes into
/// each allocation result (`[dra] driver` changes it).
pub const DEFAULT_DRIVER: &str = "gpu.gpushare.io";

/// The capacity each published GPU carries, in bytes (a `resource.k8s.io` quantity in `Mi`).
pub const MEMORY_CAPACITY: &str = "memory";

/// The CDI kind (`vendor/class`) of the devices gpushared's CDI specs describe.
pub const CDI_KIND: &str = "gpushare.io/gpu";

const MIB: u64 = 1024 * 1024;

/// A ResourceClaim as the kubelet names it to the driver and the node state lists it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClaimRef {
    /// Its UID, which tells a re-created claim of the same name apart.
    pub uid: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// `namespace/name`, as kubectl names a claim (the UID is left out).
impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The device name a GPU has in the node's ResourceSlice: `gpu-<index>` (a DNS label, stable
/// while the GPU keeps its index).
#[must_use]
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The GPU index a [`device_name`] names, if it is one.
#[must_use]
pub fn device_index(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("gpu-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || (digits.len() > 1 && digits.starts_with('0'))
    {
        return None;
    }
    digits.parse().ok()
}

/// Whether the node's pool offers `gpu` for new claims: in `dra` or `dra-mps` mode, healthy and not
/// cordoned. A GPU that stops being offered leaves the ResourceSlice; claims already prepared on
/// it stay in the ledger until they are unprepared.
#[must_use]
pub fn offered(gpu: &Gpu) -> bool {
    gpu.mode.is_dra() && gpu.health.is_healthy() && !gpu.cordoned
}

/// The CDI device name (the part after `=`) of one prepared claim: one device carries the
/// whole claim's environment (every GPU it holds), so a container that uses the claim gets one
/// consistent `NVIDIA_VISIBLE_DEVICES` and budget.
#[must_use]
pub fn cdi_device(claim_uid: &str) -> String {
    format!("claim-{claim_uid}")
}

/// The fully qualified CDI device ID the kubelet hands the runtime: `gpushare.io/gpu=<name>`.
#[must_use]
pub fn cdi_device_id(claim_uid: &str) -> String {
    format!("{CDI_KIND}={}", cdi_device(claim_uid))
}

/// The request a container names for an allocation result's request: `gpu` for `gpu` and for
/// `gpu/small`, a subrequest of a `firstAvailable` list (containers name only top-level
/// requests, and the kubelet matches them against the request names the driver returns).
#[must_use]
pub fn base_request(request: &str) -> &str {
    request.split_once('/').map_or(request, |(base, _)| base)
}

/// Which of a claim's prepared devices, given their results' requests in order, carry the
/// claim's CDI device: the first of each top-level request. So a container that names any one
/// request gets the claim's environment once, and one that names the whole claim gets it once
/// per request (the runtime applies a repeated CDI device's edits as once: the same variables
/// and mounts again).
#[must_use]
pub fn cdi_carriers<'a>(requests: impl IntoIterator<Item = &'a str>) -> Vec<bool> {
    let mut seen: Vec<&str> = Vec::new();
    requests
        .into_iter()
        .map(|r| {
            let base = base_request(r);
            let first = !seen.contains(&base);
            if first {
                seen.push(base);
            }
            first
        })
        .collect()
}

/// Why an allocation's consumed memory cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConsumedError {
    /// The allocation has no `memory` in `consumedCapacity`: kube-scheduler allocated the GPU
    /// without consumable capacity (the feature gate is off somewhere).
    #[error(
        "the allocation of {device} consumes no {MEMORY_CAPACITY} capacity: kube-scheduler allocated it without \
         consumable capacity; turn the DRAConsumableCapacity feature gate on in kube-apiserver, kube-scheduler and the kubelet"
    )]
    Missing {
        /// The device.
        device: String,
    },
    /// The quantity is not one.
    #[error("the allocation of {device} consumes {text:?} of {MEMORY_CAPACITY}, which is not a byte count: {why}")]
    Malformed {
        /// The device.
        device: String,
        /// The text.
        text: String,
        /// The parser's reason.
        why: String,
    },
    /// Zero bytes.
    #[error("the allocation of {device} consumes no memory (0 bytes); a claim asks for at least 1Mi")]
    Zero {
        /// The device.
        device: String,
    },
}

/// The MiB an allocation of `device` consumes, from its `consumedCapacity.memory` quantity
/// (`None`: absent), rounded up to whole MiB.
///
/// # Errors
/// A [`ConsumedError`] saying what is wrong.
pub fn consumed_mib(device: &str, memory: Option<&str>) -> Result<Mib, ConsumedError> {
    let text = memory.ok_or_else(|| ConsumedError::Missing { device: device.to_owned() })?;
    let q = parse_quantity(text).map_err(|e| ConsumedError::Malformed {
        device: device.to_owned(),
        text: text.to_owned(),
        why: e.to_string(),
    })?;
    if q.value == 0 {
        return Err(ConsumedError::Zero { device: device.to_owned() });
    }
    Ok(Mib::new(q.value.div_ceil(MIB)))
}

/// A GPU's `memory` capacity as a quantity, in the canonical form the API server stores:
/// the largest binary suffix that keeps it whole (`40960` MiB is `40Gi`, `15000` MiB `15000Mi`),
/// so the slice read back compares equal to the one written.
#[must_use]
pub fn memory_quantity(total: Mib) -> String {
    const SUFFIXES: [&str; 5] = ["Mi", "Gi", "Ti", "Pi", "Ei"];
    let (mut value, mut i) = (total.get(), 0);
    while value != 0 && value % 1024 == 0 && i + 1 < SUFFIXES.len() {
        value /= 1024;
        i += 1;
    }
    format!("{value}{}", SUFFIXES[i])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::{GpuUuid, Health, SharingMode};

    #[test]
    fn each_top_level_request_carries_the_claim_once() {
        assert_eq!(base_request("gpu"), "gpu");
        assert_eq!(base_request("gpu/small"), "gpu");
        assert_eq!(cdi_carriers(["a", "a", "b", "c/x", "c/y", "b"]), [true, false, true, true, false, false]);
        assert!(cdi_carriers([]).is_empty());
    }

    #[test]
    fn device_names_round_trip_and_refuse_others() {
        assert_eq!(device_name(7), "gpu-7");
        assert_eq!(device_index("gpu-7"), Some(7));
        assert_eq!(device_index("gpu-12"), Some(12));
        for bad in ["gpu-", "gpu-07", "gpu-x", "GPU-1", "gpu-1a", "mig-1", "gpu--1"] {
            assert_eq!(device_index(bad), None, "{bad}");
        }
    }

    #[test]
    fn consumed_memory_rounds_up_to_whole_mib_and_names_what_is_wrong() {
        assert_eq!(consumed_mib("gpu-0", Some("3500Mi")), Ok(Mib::new(3500)));
        assert_eq!(consumed_mib("gpu-0", Some("4Gi")), Ok(Mib::new(4096)));
        assert_eq!(consumed_mib("gpu-0", Some("1048577")), Ok(Mib::new(2)));
        assert_eq!(consumed_mib("gpu-0", Some("1k")), Ok(Mib::new(1)));
        let missing = consumed_mib("gpu-0", None).unwrap_err().to_string();
        assert!(missing.contains("DRAConsumableCapacity"), "{missing}");
        let zero = consumed_mib("gpu-1", Some("0")).unwrap_err().to_string();
        assert!(zero.contains("gpu-1") && zero.contains("no memory"), "{zero}");
        let bad = consumed_mib("gpu-1", Some("lots")).unwrap_err().to_string();
        assert!(bad.contains("\"lots\""), "{bad}");
        assert_eq!(memory_quantity(Mib::new(81_920)), "80Gi");
        assert_eq!(memory_quantity(Mib::new(15_000)), "15000Mi");
        assert_eq!(memory_quantity(Mib::new(1_048_576)), "1Ti");
        assert_eq!(memory_quantity(Mib::new(1)), "1Mi");
        assert_eq!(memory_quantity(Mib::ZERO), "0Mi");
    }

    #[test]
    fn the_pool_offers_healthy_uncordoned_dra_gpus_only() {
        let uuid = GpuUuid::new("GPU-a".to_owned()).unwrap();
        let mut g = Gpu::new(0, uuid, "m".to_owned(), Mib::new(1000));
        assert!(!offered(&g), "shared mode is the device plugin's");
        g.mode = SharingMode::Dra;
        assert!(offered(&g));
        g.mode = SharingMode::DraMps;
        assert!(offered(&g));
        g.cordoned = true;
        assert!(!offered(&g));
        g.cordoned = false;
        g.health = Health::Unhealthy { reason: "Xid 79".to_owned() };
        assert!(!offered(&g));
        assert_eq!(cdi_device_id("0f1e"), "gpushare.io/gpu=claim-0f1e");
    }
}
