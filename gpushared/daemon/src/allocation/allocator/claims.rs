//! DRA claims in the allocation service: `NodePrepareResources` checks the allocation
//! kube-scheduler made against this node's own ledger — the GPU is one of this node's, served
//! through DRA, healthy, and has room beside every live claim and device-plugin row on it — and
//! writes the claim's rows before it answers; `NodeUnprepareResources` releases them. Both are
//! idempotent: a claim already prepared is answered from its rows, one already released (or
//! never prepared) unprepares as a success. The answer is the claim's environment, which the
//! `dra` module writes into the claim's CDI spec.

use std::collections::BTreeMap;

use gpushare_core::codec::assignment::GpuShare;
pub use gpushare_core::dra::ClaimRef;
use gpushare_core::{Health, Mib, SharingMode, dra};
use thiserror::Error;

use super::{Allocator, room};
use crate::allocation::ledger::{ClaimRow, LedgerError, NewClaimRow};

/// One device of the claim's allocation that is this driver's on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimShare {
    /// The claim's request it answers.
    pub request: String,
    /// The device (`gpu-<index>`).
    pub device: String,
    /// kube-scheduler's share ID (empty where it gave none).
    pub share_id: String,
    /// The memory it consumes.
    pub mib: Mib,
}

/// A claim prepared: its shares as the ledger holds them, and the environment and mounts its
/// CDI device carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedShare {
    /// The rows, one per share.
    pub rows: Vec<ClaimRow>,
    /// The claim's environment.
    pub envs: BTreeMap<String, String>,
    /// Host directories its containers mount (the MPS pipe directory on `dra-mps` GPUs).
    pub mounts: Vec<super::Mount>,
    /// The device nodes its containers get (`[device_nodes]`).
    pub devices: Vec<crate::config::DeviceNode>,
}

/// Why a claim cannot be prepared. Each says what an operator can do.
#[derive(Debug, Error)]
pub enum ClaimError {
    /// The allocation has none of this node's devices.
    #[error("claim {claim}: its allocation holds no device of this driver on this node")]
    NoDevices {
        /// The claim.
        claim: String,
    },
    /// A device name this node does not publish.
    #[error(
        "claim {claim}: device {device:?} is not one this node publishes (its devices are gpu-<index>); \
         delete the pod and the claim so that kube-scheduler allocates again"
    )]
    UnknownDevice {
        /// The claim.
        claim: String,
        /// The device.
        device: String,
    },
    /// The GPU is not served through DRA (the configuration changed after the allocation).
    #[error(
        "claim {claim}: GPU {index} is in {mode} mode, not dra, on this node; name it in [sharing] dra (after a \
         drain) or delete the pod and the claim so that kube-scheduler allocates again"
    )]
    NotDra {
        /// The claim.
        claim: String,
        /// The GPU.
        index: u32,
        /// Its mode.
        mode: SharingMode,
    },
    /// The GPU is unhealthy.
    #[error("claim {claim}: GPU {index} is unhealthy ({reason}); the kubelet retries, or delete the pod and the claim")]
    Unhealthy {
        /// The claim.
        claim: String,
        /// The GPU.
        index: u32,
        /// Why.
        reason: String,
    },
    /// The GPU was cordoned after kube-scheduler allocated the claim.
    #[error(
        "claim {claim}: GPU {index} is cordoned on this node (gpusharectl uncordon {index}), and the claim is new to it; \
         delete the pod and the claim so that kube-scheduler allocates again"
    )]
    Cordoned {
        /// The claim.
        claim: String,
        /// The GPU.
        index: u32,
    },
    /// The ledger says the GPU has no room: the API and the node disagree.
    #[error(
        "claim {claim}: GPU {index} has {free} MiB free of {total} MiB in this node's ledger, and the claim consumes \
         {mib} MiB; refusing to overcommit (the API's allocations and the node's ledger disagree: see \
         `gpusharectl allocations` and `gpusharectl claims`)"
    )]
    NoRoom {
        /// The claim.
        claim: String,
        /// The GPU.
        index: u32,
        /// Free MiB in the ledger.
        free: u64,
        /// The GPU's total.
        total: u64,
        /// What the claim consumes there.
        mib: u64,
    },
    /// The ledger could not be written or read.
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// The live rows of the claim with UID `uid`, if it has any (it is prepared).
fn rows_of(claims: &[ClaimRow], uid: &str) -> Option<Vec<ClaimRow>> {
    let rows: Vec<ClaimRow> = claims.iter().filter(|r| r.share.claim_uid == uid).cloned().collect();
    (!rows.is_empty()).then_some(rows)
}

impl Allocator {
    /// Prepares `claim` with `shares` (its allocation's devices of this driver on this node).
    ///
    /// # Errors
    /// A [`ClaimError`] saying why; then nothing is written.
    pub fn prepare_claim(&self, claim: &ClaimRef, shares: &[ClaimShare]) -> Result<PreparedShare, ClaimError> {
        let name = claim.to_string();
        let mut state = self.lock();
        if let Some(rows) = rows_of(&state.claims, &claim.uid) {
            return Ok(self.prepared(&name, rows));
        }
        if shares.is_empty() {
            return Err(ClaimError::NoDevices { claim: name });
        }
        let mut rows: Vec<NewClaimRow> = Vec::with_capacity(shares.len());
        for s in shares {
            let gpu = dra::device_index(&s.device)
                .and_then(|i| state.inventory.gpus().iter().find(|g| g.index == i))
                .ok_or_else(|| ClaimError::UnknownDevice { claim: name.clone(), device: s.device.clone() })?;
            if !gpu.mode.is_dra() {
                return Err(ClaimError::NotDra { claim: name, index: gpu.index, mode: gpu.mode });
            }
            if let Health::Unhealthy { reason } = &gpu.health {
                return Err(ClaimError::Unhealthy { claim: name, index: gpu.index, reason: reason.clone() });
            }
            // A cordoned GPU keeps what it holds (a claim prepared before, answered above) and
            // takes nothing new, as device-plugin `Allocate` refuses it too.
            if gpu.cordoned {
                return Err(ClaimError::Cordoned { claim: name, index: gpu.index });
            }
            rows.push(NewClaimRow {
                claim_uid: claim.uid.clone(),
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                request: s.request.clone(),
                share_id: s.share_id.clone(),
                gpu_uuid: gpu.uuid.clone(),
                gpu_index: gpu.index,
                mib: s.mib,
            });
        }
        // The room rule device-plugin rows follow too: every pod and claim on the GPU counts.
        if let Some(full) = room::claim_room(&state.inventory, &state.held, &state.claims, &rows) {
            return Err(ClaimError::NoRoom {
                claim: name,
                index: full.gpu.index,
                free: full.free.get(),
                total: full.limit.get(),
                mib: full.needs.get(),
            });
        }
        let written = state.ledger.prepare_claim(&rows)?;
        state.claims.extend(written.iter().cloned());
        drop(state);
        self.changed();
        tracing::info!(claim = %name, uid = %claim.uid, shares = ?written.iter().map(|r| (r.share.gpu_index, r.share.mib.get())).collect::<Vec<_>>(), "claim prepared");
        Ok(self.prepared(&name, written))
    }

    /// The claim as prepared, if it is (live rows under its UID): a repeated prepare is
    /// answered from here, without asking the API server.
    #[must_use]
    pub fn prepared_claim(&self, claim: &ClaimRef) -> Option<PreparedShare> {
        let rows = rows_of(&self.lock().claims, &claim.uid)?;
        Some(self.prepared(&claim.to_string(), rows))
    }

    /// Unprepares the claim with this UID: its live rows are released. Returns how many.
    ///
    /// # Errors
    /// The ledger's error; then nothing is released.
    pub fn unprepare_claim(&self, uid: &str) -> Result<usize, ClaimError> {
        let mut state = self.lock();
        let released = state.ledger.release_claim(uid, "unprepared by the kubelet")?;
        state.claims.retain(|r| r.share.claim_uid != uid);
        drop(state);
        if released > 0 {
            self.changed();
            tracing::info!(uid, shares = released, "claim unprepared");
        }
        Ok(released)
    }

    /// The live claim rows.
    #[must_use]
    pub fn live_claims(&self) -> Vec<ClaimRow> {
        self.lock().claims.clone()
    }

    fn prepared(&self, name: &str, rows: Vec<ClaimRow>) -> PreparedShare {
        let shares: Vec<GpuShare> = rows
            .iter()
            .map(|r| GpuShare { index: r.share.gpu_index, uuid: r.share.gpu_uuid.clone(), mib: r.share.mib })
            .collect();
        let edits = self.environment().claim_answer(name, &shares);
        PreparedShare { rows, envs: edits.envs, mounts: edits.mounts, devices: edits.devices }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpushare_core::{Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory, ResourceNames, SharingMode};

    use super::*;
    use crate::allocation::ledger::Ledger;
    use crate::allocation::pods::PodStore;
    use crate::config::Compatibility;

    /// Node-a with GPU 0 shared, GPU 1 in DRA mode and GPU 2 in DRA mode with MPS (1000 MiB
    /// each).
    fn allocator(dir: &std::path::Path) -> Arc<Allocator> {
        let ledger = Ledger::open(&dir.join("ledger.db")).unwrap().ledger;
        let gpus = (0..3)
            .map(|i| {
                let mut g = Gpu::new(i, GpuUuid::new(format!("GPU-{i}")).unwrap(), "T4", Mib::new(1000));
                g.mode = [SharingMode::Shared, SharingMode::Dra, SharingMode::DraMps][i as usize];
                g
            })
            .collect();
        let inventory = NodeInventory::new(MemoryUnit::Mib, gpus).unwrap();
        let names = ResourceNames::gpushare();
        let alloc = Allocator::new("node-a".into(), names, Compatibility::Gpushare, inventory, PodStore::new(), ledger);
        Arc::new(alloc.unwrap())
    }

    fn claim(uid: &str) -> ClaimRef {
        ClaimRef { uid: uid.to_owned(), namespace: "ns".to_owned(), name: format!("c-{uid}") }
    }

    fn share(device: &str, mib: u64) -> ClaimShare {
        ClaimShare { request: "gpu".to_owned(), device: device.to_owned(), share_id: String::new(), mib: Mib::new(mib) }
    }

    #[test]
    fn claims_pack_a_gpu_up_to_its_total_and_never_past_it() {
        let dir = tempfile::tempdir().unwrap();
        let alloc = allocator(dir.path());
        let a = alloc.prepare_claim(&claim("a"), &[share("gpu-1", 600)]).unwrap();
        assert_eq!(a.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-1");
        assert_eq!(a.envs["GPUSHARE_MEMORY_MIB"], "600");
        assert_eq!(a.envs["GPUSHARE_GPU_TOTAL_MIB"], "1000");
        assert_eq!(a.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "600m");
        assert_eq!(a.envs["GPUSHARE_CLAIM"], "ns/c-a");
        assert!(!a.envs.contains_key("GPUSHARE_POD"));
        alloc.prepare_claim(&claim("b"), &[share("gpu-1", 400)]).unwrap();
        let err = alloc.prepare_claim(&claim("c"), &[share("gpu-1", 1)]).unwrap_err().to_string();
        assert!(err.contains("GPU 1 has 0 MiB free of 1000 MiB") && err.contains("refusing to overcommit"), "{err}");
        // Two shares of one claim on one GPU count together.
        let err = alloc.prepare_claim(&claim("d"), &[share("gpu-2", 600), share("gpu-2", 600)]).unwrap_err();
        assert!(
            err.to_string()
                .contains("GPU 2 has 1000 MiB free of 1000 MiB in this node's ledger, and the claim consumes 1200 MiB"),
            "{err}"
        );
        assert_eq!(alloc.live_claims().len(), 2, "a refused claim writes nothing");
        // The node state publishes what the ledger holds on each GPU, claims included.
        assert_eq!(alloc.node_state(1, "t").used, [Mib::ZERO, Mib::new(1000), Mib::ZERO]);
    }

    #[test]
    fn a_claim_on_a_dra_mps_gpu_is_a_client_of_its_mps_daemon() {
        let dir = tempfile::tempdir().unwrap();
        let alloc = allocator(dir.path());
        let mps = alloc.prepare_claim(&claim("m"), &[share("gpu-2", 250)]).unwrap();
        assert_eq!(mps.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=250M");
        assert_eq!(mps.envs["CUDA_MPS_PIPE_DIRECTORY"], "/run/nvidia-mps");
        assert_eq!(mps.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25", "proportional: 250 of 1000 MiB");
        assert_eq!(mps.mounts.len(), 1);
        assert_eq!(mps.mounts[0].path, std::path::Path::new("/run/nvidia-mps"));
        assert!(mps.mounts[0].read_only);
        let plain = alloc.prepare_claim(&claim("p"), &[share("gpu-1", 250)]).unwrap();
        assert!(!plain.envs.contains_key("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") && plain.mounts.is_empty());
    }

    #[test]
    fn prepare_and_unprepare_are_idempotent_and_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let alloc = allocator(dir.path());
        let first = alloc.prepare_claim(&claim("a"), &[share("gpu-1", 300), share("gpu-2", 300)]).unwrap();
        assert_eq!(first.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-1,GPU-2");
        assert_eq!(first.envs["GPUSHARE_MEMORY_TOTAL_MIB"], "600");
        // Two requests' shares on one GPU: one GPU to the container, with both budgets.
        let (a, b) = (ClaimShare { request: "a".into(), ..share("gpu-1", 100) }, share("gpu-1", 200));
        let two = alloc.prepare_claim(&claim("t"), &[a, b]).unwrap();
        assert_eq!(two.rows.len(), 2, "a row per share");
        assert_eq!(two.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-1");
        assert_eq!(two.envs["GPUSHARE_MEMORY_MIB"], "300");
        assert_eq!(two.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "300m");
        assert!(!two.envs.contains_key("CUDA_DEVICE_MEMORY_LIMIT_1"), "{:?}", two.envs);
        alloc.unprepare_claim("t").unwrap();
        let again = alloc.prepare_claim(&claim("a"), &[share("gpu-1", 300), share("gpu-2", 300)]).unwrap();
        assert_eq!(again, first);
        drop(alloc);
        // A new daemon on the same ledger: the claim is still there, answered alike.
        let alloc = allocator(dir.path());
        assert_eq!(alloc.prepare_claim(&claim("a"), &[]).unwrap(), first);
        assert_eq!(alloc.unprepare_claim("a").unwrap(), 2);
        assert_eq!(alloc.unprepare_claim("a").unwrap(), 0);
        assert_eq!(alloc.unprepare_claim("never-prepared").unwrap(), 0);
        assert!(alloc.live_claims().is_empty());
        // The room is back.
        alloc.prepare_claim(&claim("b"), &[share("gpu-1", 1000)]).unwrap();
    }

    #[test]
    fn a_device_the_node_does_not_serve_through_dra_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let alloc = allocator(dir.path());
        let e = alloc.prepare_claim(&claim("a"), &[share("gpu-0", 10)]).unwrap_err().to_string();
        assert!(e.contains("GPU 0 is in shared mode, not dra") && e.contains("[sharing] dra"), "{e}");
        let e = alloc.prepare_claim(&claim("a"), &[share("gpu-9", 10)]).unwrap_err().to_string();
        assert!(e.contains("device \"gpu-9\" is not one this node publishes"), "{e}");
        let e = alloc.prepare_claim(&claim("a"), &[]).unwrap_err().to_string();
        assert!(e.contains("holds no device of this driver"), "{e}");
        alloc.set_health(1, gpushare_core::Health::Unhealthy { reason: "Xid 79".to_owned() }).unwrap();
        let e = alloc.prepare_claim(&claim("a"), &[share("gpu-1", 10)]).unwrap_err().to_string();
        assert!(e.contains("GPU 1 is unhealthy (Xid 79)"), "{e}");
    }

    #[test]
    fn a_cordoned_gpu_keeps_its_claims_and_takes_no_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let alloc = allocator(dir.path());
        let held = alloc.prepare_claim(&claim("a"), &[share("gpu-1", 100)]).unwrap();
        alloc.set_cordon("1", true).unwrap();
        // Asked again (the kubelet restarted): answered from the ledger.
        assert_eq!(alloc.prepare_claim(&claim("a"), &[share("gpu-1", 100)]).unwrap(), held);
        let e = alloc.prepare_claim(&claim("b"), &[share("gpu-1", 100)]).unwrap_err().to_string();
        assert!(e.contains("GPU 1 is cordoned on this node (gpusharectl uncordon 1)"), "{e}");
        assert_eq!(alloc.live_claims().len(), 1, "nothing written");
        alloc.set_cordon("1", false).unwrap();
        alloc.prepare_claim(&claim("b"), &[share("gpu-1", 100)]).unwrap();
    }
}
