//! The DRA driver's one deciding service: for each claim the kubelet names, the allocation
//! kube-scheduler wrote into the ResourceClaim (read from the API server, through
//! [`ClaimSource`]) is turned into this node's shares, checked and recorded by the allocation
//! service, and its CDI spec written — all before the claim is answered. The gRPC handlers
//! (`grpc`) only translate.

use std::path::PathBuf;
use std::sync::Arc;

use gpushare_core::dra;
use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::allocation::allocator::{Allocator, ClaimRef, ClaimShare, PreparedShare};
use crate::dra::cdi;

/// Where the ResourceClaims are read: the API server, or a fake in tests.
pub trait ClaimSource: Send + Sync + 'static {
    /// The claim `namespace/name`, or why it cannot be read.
    fn get(&self, namespace: &str, name: &str) -> impl Future<Output = Result<ResourceClaim, String>> + Send;
}

/// One device of a prepared claim, as the kubelet is answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The claim's top-level request it answers (a subrequest's parent).
    pub request: String,
    /// The pool (this node's name).
    pub pool: String,
    /// The device (`gpu-<index>`).
    pub device: String,
    /// The CDI devices the runtime applies (the claim's one device, on the first device of each
    /// request: [`dra::cdi_carriers`]).
    pub cdi_ids: Vec<String>,
    /// kube-scheduler's share ID, where it gave one.
    pub share_id: Option<String>,
}

/// The DRA driver of one node.
#[derive(Debug)]
pub struct Driver<S> {
    /// The allocation service (the ledger).
    pub alloc: Arc<Allocator>,
    /// The claims' source.
    pub claims: S,
    /// The driver's name.
    pub driver: String,
    /// This node (the pool's name).
    pub node: String,
    /// Where CDI specs go.
    pub cdi_dir: PathBuf,
}

impl<S: ClaimSource> Driver<S> {
    /// Prepares `claim`: answered from the ledger if it is already prepared, else from its
    /// allocation in the API. Returns its devices, or why it cannot be prepared.
    ///
    /// # Errors
    /// What is wrong and what to do, as the kubelet shows it in the pod's events.
    pub async fn prepare(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, String> {
        let prepared = match self.alloc.prepared_claim(claim) {
            Some(p) => p,
            None => {
                let object = self.claims.get(&claim.namespace, &claim.name).await?;
                let shares = shares_of(&object, claim, &self.driver, &self.node)?;
                self.alloc.prepare_claim(claim, &shares).map_err(|e| e.to_string())?
            }
        };
        // Written again on a repeated prepare: a spec lost with /var/run is back.
        let mounts: Vec<(PathBuf, bool)> = prepared.mounts.iter().map(|m| (m.path.clone(), m.read_only)).collect();
        let edits = cdi::Edits { envs: &prepared.envs, mounts: &mounts, devices: &prepared.devices };
        cdi::write(&self.cdi_dir, &claim.uid, edits)?;
        Ok(self.devices(claim, &prepared))
    }

    /// Unprepares the claim with `uid`: its rows are released and its CDI spec removed.
    ///
    /// # Errors
    /// What went wrong.
    pub fn unprepare(&self, uid: &str) -> Result<(), String> {
        self.alloc.unprepare_claim(uid).map_err(|e| e.to_string())?;
        cdi::remove(&self.cdi_dir, uid)
    }

    fn devices(&self, claim: &ClaimRef, prepared: &PreparedShare) -> Vec<PreparedDevice> {
        let carriers = dra::cdi_carriers(prepared.rows.iter().map(|r| r.share.request.as_str()));
        prepared
            .rows
            .iter()
            .zip(carriers)
            .map(|(r, carries)| PreparedDevice {
                request: dra::base_request(&r.share.request).to_owned(),
                pool: self.node.clone(),
                device: dra::device_name(r.share.gpu_index),
                cdi_ids: if carries { vec![dra::cdi_device_id(&claim.uid)] } else { Vec::new() },
                share_id: (!r.share.share_id.is_empty()).then(|| r.share.share_id.clone()),
            })
            .collect()
    }
}

/// The shares of `object`'s allocation that are `driver`'s on `node`'s pool.
///
/// # Errors
/// The claim is another (its UID differs), not allocated, or an allocation's memory is unusable.
pub fn shares_of(
    object: &ResourceClaim,
    claim: &ClaimRef,
    driver: &str,
    node: &str,
) -> Result<Vec<ClaimShare>, String> {
    let uid = object.metadata.uid.as_deref().unwrap_or_default();
    if uid != claim.uid {
        return Err(format!(
            "claim {claim} has UID {uid:?} in the API, and the kubelet asked for {:?}: it was deleted and made again; \
             the kubelet retries with the new one",
            claim.uid
        ));
    }
    let results = object
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
        .ok_or_else(|| format!("claim {claim} is not allocated yet"))?;
    results
        .iter()
        .filter(|r| r.driver == driver && r.pool == node)
        .map(|r| {
            let memory = r.consumed_capacity.as_ref().and_then(|c| c.get(dra::MEMORY_CAPACITY)).map(|q| q.0.as_str());
            let mib = dra::consumed_mib(&r.device, memory).map_err(|e| format!("claim {claim}: {e}"))?;
            Ok(ClaimShare {
                request: r.request.clone(),
                device: r.device.clone(),
                share_id: r.share_id.clone().unwrap_or_default(),
                mib,
            })
        })
        .collect()
}
