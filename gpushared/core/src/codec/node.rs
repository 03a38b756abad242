//! The node state a daemon publishes on its Node object: schema version 1.
//!
//! ```json
//! {"v":1,"generation":7,"daemon":"0.1.0","unit":"MiB","tellsLookalikesApart":true,"gpus":[
//!   {"index":0,"uuid":"GPU-8f6e…","minor":0,"model":"Tesla T4","totalMiB":15360,"numa":0,
//!    "health":"Healthy","cordoned":false,"usedMiB":3500,
//!    "pods":[{"namespace":"default","name":"infer-1","uid":"3f1c…","container":"main","mib":3500}]},
//!   {"index":1,"uuid":"GPU-2a41…","model":"Tesla T4","totalMiB":15360,"health":"Healthy","mode":"dra",
//!    "usedMiB":4096,"pods":[],
//!    "claims":[{"namespace":"ml","name":"train-gpu-x7k2q","uid":"9d0e…","request":"gpu","mib":4096}]}]}
//! ```
//!
//! `usedMiB` is the daemon's own figure (what its ledger holds on the GPU, by the init-container
//! rule of [`crate::placement`]); the extender trusts it over its own assumptions. `pods` lists
//! the holders per container for people and for reconciliation; a holder's `role` (`init` or
//! `sidecar`; omitted for app containers) lets every reader charge each pod by the same rule,
//! [`pod_footprints`], so no view adds an init container to the app containers it ran before.
//! `claims` (absent when empty) lists the DRA ResourceClaims prepared on the GPU, each request's
//! share once; they count in `usedMiB` as they are ([`used_per_gpu`]). `generation` grows with
//! every publication so a reader can ignore a stale value. `overBudget` (absent when empty) lists the containers whose
//! processes use more of the GPU's memory than their budget, as the daemon last sampled them.
//! `tellsLookalikesApart` (absent when false) says the daemon learns from the kubelet itself
//! which pod each device-plugin call is for (its PodResources `List`), or grants memory only as
//! the runtime creates a container, which names its pod (a counted node), so look-alike pods
//! (device requests of one size) may be bound to the node while another is still admitted.

use serde::{Deserialize, Serialize};

use std::collections::BTreeMap;

use super::{CodecError, app_role, decode_versioned, encode_checked, is_app_role};
use crate::dra::ClaimRef;
use crate::inventory::{Activity, Gpu, GpuUuid, Health, NodeInventory, SharingMode};
use crate::placement::footprint;
use crate::request::ContainerRole;
use crate::units::{MemoryUnit, Mib};

/// The Node annotation key.
pub const NODE_STATE_KEY: &str = "gpushare.io/node-state";
/// The schema version this build writes and reads.
pub const NODE_STATE_VERSION: u32 = 1;

/// A pod as annotations refer to it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PodRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID, which tells a re-created pod of the same name apart.
    pub uid: String,
}

/// `namespace/name`, as kubectl names a pod (the UID is left out).
impl std::fmt::Display for PodRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One container's share of one GPU, as the daemon's ledger holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeAllocation {
    /// The pod.
    pub pod: PodRef,
    /// The container.
    pub container: String,
    /// How the container runs, which decides how its memory counts (see [`pod_footprints`]).
    pub role: ContainerRole,
    /// The GPU's NVML index.
    pub gpu: u32,
    /// Memory held.
    pub mib: Mib,
}

/// One request's share of one GPU in a DRA ResourceClaim, as the daemon's ledger holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeClaim {
    /// The claim.
    pub claim: ClaimRef,
    /// The claim's request the share answers.
    pub request: String,
    /// The GPU's NVML index.
    pub gpu: u32,
    /// Memory it consumes.
    pub mib: Mib,
}

/// What one pod occupies on a node, from its allocations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFootprint<'a> {
    /// The pod.
    pub pod: &'a PodRef,
    /// Memory per GPU position of the inventory, by the init-container rule.
    pub mib: Vec<Mib>,
}

/// Each pod's footprint on `inventory`, keyed by UID, from its containers' `allocations` (in
/// admission order): the largest init container (plus the sidecars started before it) or the sum
/// of app containers and sidecars, whichever is more, per GPU ([`crate::placement::footprint`]).
/// This is the one rule behind the daemon's `usedMiB` and every view of it in the extender.
/// Allocations on a GPU the inventory lacks are left out.
#[must_use]
pub fn pod_footprints<'a>(
    inventory: &NodeInventory,
    allocations: &'a [NodeAllocation],
) -> BTreeMap<&'a str, PodFootprint<'a>> {
    // Per pod: its rows as (role, GPU position, memory), in admission order.
    type Rows = Vec<(ContainerRole, usize, Mib)>;
    let mut rows: BTreeMap<&'a str, (&'a PodRef, Rows)> = BTreeMap::new();
    for a in allocations {
        let Some(p) = inventory.gpus().iter().position(|g| g.index == a.gpu) else { continue };
        rows.entry(a.pod.uid.as_str()).or_insert_with(|| (&a.pod, Vec::new())).1.push((a.role, p, a.mib));
    }
    let n = inventory.gpus().len();
    rows.into_iter()
        .map(|(uid, (pod, rows))| {
            let mut mib = vec![Mib::ZERO; n];
            if rows.iter().all(|(role, _, _)| *role != ContainerRole::Init) {
                // No init container (nearly every pod): the sum of the containers, which is
                // what the rule comes to, without its bookkeeping.
                for (_, p, m) in rows {
                    mib[p] = mib[p].saturating_add(m);
                }
            } else {
                for (p, m) in footprint(rows.into_iter().map(|(role, p, m)| (role, [(p, m)]))) {
                    mib[p] = m;
                }
            }
            (uid, PodFootprint { pod, mib })
        })
        .collect()
}

/// Memory used per GPU position of `inventory`: the sum of every pod's [`pod_footprints`] plus
/// every DRA claim's share (a claim holds what kube-scheduler allocated it for as long as it is
/// prepared, whichever of its containers run). Rows on a GPU the inventory lacks are left out.
#[must_use]
pub fn used_per_gpu(inventory: &NodeInventory, allocations: &[NodeAllocation], claims: &[NodeClaim]) -> Vec<Mib> {
    let mut used = vec![Mib::ZERO; inventory.gpus().len()];
    for f in pod_footprints(inventory, allocations).values() {
        for (u, m) in used.iter_mut().zip(&f.mib) {
            *u = u.saturating_add(*m);
        }
    }
    for c in claims {
        if let Some(u) = inventory.gpus().iter().position(|g| g.index == c.gpu).and_then(|p| used.get_mut(p)) {
            *u = u.saturating_add(c.mib);
        }
    }
    used
}

/// A container whose processes use more of a GPU's memory than its budget (or use a GPU it has
/// no budget on), as the daemon last sampled them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverBudget {
    /// The pod.
    pub pod: PodRef,
    /// The container; empty when the processes could not be tied to one of the pod's containers.
    pub container: String,
    /// The GPU's NVML index.
    pub gpu: u32,
    /// Memory its processes use on the GPU.
    pub in_use: Mib,
    /// Its budget on the GPU (0: none).
    pub budget: Mib,
    /// Since when (Unix milliseconds).
    pub since_ms: i64,
}

/// What a daemon publishes: its GPUs, how much of each is used, and by whom.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeState {
    /// Grows with each publication.
    pub generation: u64,
    /// The daemon's version.
    pub daemon_version: String,
    /// GPUs, unit, health, cordon.
    pub inventory: NodeInventory,
    /// Used memory per GPU, in inventory order.
    pub used: Vec<Mib>,
    /// The device-plugin allocations behind `used`.
    pub allocations: Vec<NodeAllocation>,
    /// The DRA claims behind `used`.
    pub claims: Vec<NodeClaim>,
    /// Containers over their budget.
    pub over_budget: Vec<OverBudget>,
    /// Whether the daemon asks the kubelet which pod it is admitting, so that pods whose device
    /// requests look alike need not be admitted one at a time (the extender's look-alike rule
    /// does not apply to the node).
    pub tells_lookalikes_apart: bool,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Wire {
    v: u32,
    generation: u64,
    daemon: String,
    unit: MemoryUnit,
    /// Absent means false (and is what daemons before it wrote).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    tells_lookalikes_apart: bool,
    gpus: Vec<WireGpu>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireGpu {
    index: u32,
    uuid: GpuUuid,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    minor: Option<u32>,
    model: String,
    #[serde(rename = "totalMiB")]
    total_mib: Mib,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    numa: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pci: Option<String>,
    health: WireHealth,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    health_reason: Option<String>,
    #[serde(default)]
    cordoned: bool,
    /// Absent means shared (and is what daemons before MPS support wrote).
    #[serde(default, skip_serializing_if = "WireMode::is_shared")]
    mode: WireMode,
    /// NVML's utilisation, percent, at the last sample (absent: not sampled or not reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    util_percent: Option<u8>,
    /// NVML's memory in use by every process, at the last sample.
    #[serde(rename = "inUseMiB", default, skip_serializing_if = "Option::is_none")]
    in_use_mib: Option<Mib>,
    #[serde(rename = "usedMiB", default)]
    used_mib: Mib,
    #[serde(default)]
    pods: Vec<WireHolder>,
    /// Absent when empty (and from daemons before DRA).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    claims: Vec<WireClaim>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    over_budget: Vec<WireOver>,
}

#[derive(Serialize, Deserialize)]
struct WireClaim {
    namespace: String,
    name: String,
    uid: String,
    request: String,
    mib: Mib,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireOver {
    namespace: String,
    name: String,
    uid: String,
    #[serde(default)]
    container: String,
    #[serde(rename = "inUseMiB")]
    in_use_mib: Mib,
    #[serde(rename = "budgetMiB")]
    budget_mib: Mib,
    since: i64,
}

#[derive(Serialize, Deserialize, PartialEq, Eq, Clone, Copy)]
enum WireHealth {
    Healthy,
    Unhealthy,
}

#[derive(Serialize, Deserialize, PartialEq, Eq, Clone, Copy, Default)]
#[serde(rename_all = "lowercase")]
enum WireMode {
    #[default]
    Shared,
    Mps,
    Whole,
    Dra,
    #[serde(rename = "dra-mps")]
    DraMps,
}

impl WireMode {
    #[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
    fn is_shared(&self) -> bool {
        *self == WireMode::Shared
    }
}

#[derive(Serialize, Deserialize)]
struct WireHolder {
    namespace: String,
    name: String,
    uid: String,
    container: String,
    #[serde(default = "app_role", skip_serializing_if = "is_app_role")]
    role: ContainerRole,
    mib: Mib,
}

impl NodeState {
    /// Encodes the state as the annotation value.
    ///
    /// # Errors
    /// [`CodecError::TooLarge`] if the value would exceed Kubernetes' annotation limit, or
    /// [`CodecError::Invalid`] if `used` does not match the inventory or an allocation names a
    /// GPU the inventory lacks.
    pub fn encode(&self) -> Result<String, CodecError> {
        let gpus = self.inventory.gpus();
        if self.used.len() != gpus.len() {
            return Err(invalid(format!("{} usage figures for {} GPUs", self.used.len(), gpus.len())));
        }
        if let Some(a) = self.allocations.iter().find(|a| self.inventory.by_index(a.gpu).is_none()) {
            return Err(invalid(format!(
                "allocation of {}/{} names unknown GPU{}",
                a.pod.namespace, a.pod.name, a.gpu
            )));
        }
        if let Some(c) = self.claims.iter().find(|c| self.inventory.by_index(c.gpu).is_none()) {
            return Err(invalid(format!("claim {} names unknown GPU{}", c.claim, c.gpu)));
        }
        if let Some(o) = self.over_budget.iter().find(|o| self.inventory.by_index(o.gpu).is_none()) {
            return Err(invalid(format!("over-budget {}/{} names unknown GPU{}", o.pod.namespace, o.pod.name, o.gpu)));
        }
        let wire = Wire {
            v: NODE_STATE_VERSION,
            generation: self.generation,
            daemon: self.daemon_version.clone(),
            unit: self.inventory.unit(),
            tells_lookalikes_apart: self.tells_lookalikes_apart,
            gpus: gpus
                .iter()
                .zip(&self.used)
                .map(|(g, used)| WireGpu {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    minor: g.minor,
                    model: g.model.clone(),
                    total_mib: g.total,
                    numa: g.numa_node,
                    pci: g.pci_bus_id.clone(),
                    health: if g.health.is_healthy() { WireHealth::Healthy } else { WireHealth::Unhealthy },
                    health_reason: match &g.health {
                        Health::Healthy => None,
                        Health::Unhealthy { reason } => Some(reason.clone()),
                    },
                    cordoned: g.cordoned,
                    mode: match g.mode {
                        SharingMode::Shared => WireMode::Shared,
                        SharingMode::Mps => WireMode::Mps,
                        SharingMode::Whole => WireMode::Whole,
                        SharingMode::Dra => WireMode::Dra,
                        SharingMode::DraMps => WireMode::DraMps,
                    },
                    util_percent: g.activity.and_then(|a| a.utilization),
                    in_use_mib: g.activity.map(|a| a.in_use),
                    used_mib: *used,
                    pods: self
                        .allocations
                        .iter()
                        .filter(|a| a.gpu == g.index)
                        .map(|a| WireHolder {
                            namespace: a.pod.namespace.clone(),
                            name: a.pod.name.clone(),
                            uid: a.pod.uid.clone(),
                            container: a.container.clone(),
                            role: a.role,
                            mib: a.mib,
                        })
                        .collect(),
                    claims: self
                        .claims
                        .iter()
                        .filter(|c| c.gpu == g.index)
                        .map(|c| WireClaim {
                            namespace: c.claim.namespace.clone(),
                            name: c.claim.name.clone(),
                            uid: c.claim.uid.clone(),
                            request: c.request.clone(),
                            mib: c.mib,
                        })
                        .collect(),
                    over_budget: self
                        .over_budget
                        .iter()
                        .filter(|o| o.gpu == g.index)
                        .map(|o| WireOver {
                            namespace: o.pod.namespace.clone(),
                            name: o.pod.name.clone(),
                            uid: o.pod.uid.clone(),
                            container: o.container.clone(),
                            in_use_mib: o.in_use,
                            budget_mib: o.budget,
                            since: o.since_ms,
                        })
                        .collect(),
                })
                .collect(),
        };
        encode_checked(NODE_STATE_KEY, &wire)
    }

    /// Decodes an annotation value.
    ///
    /// # Errors
    /// A [`CodecError`] for oversized, malformed, unknown-version or self-contradicting values.
    pub fn decode(value: &str) -> Result<Self, CodecError> {
        let wire: Wire = decode_versioned(NODE_STATE_KEY, value, NODE_STATE_VERSION)?;
        let mut gpus = Vec::with_capacity(wire.gpus.len());
        let mut used = Vec::with_capacity(wire.gpus.len());
        let mut allocations = Vec::new();
        let mut claims = Vec::new();
        let mut over_budget = Vec::new();
        for g in wire.gpus {
            let health = match (g.health, g.health_reason) {
                (WireHealth::Healthy, _) => Health::Healthy,
                (WireHealth::Unhealthy, reason) => Health::Unhealthy { reason: reason.unwrap_or_default() },
            };
            for h in g.pods {
                if h.namespace.is_empty() || h.name.is_empty() || h.container.is_empty() {
                    return Err(invalid(format!(
                        "GPU{} lists a holder with an empty namespace, name or container",
                        g.index
                    )));
                }
                if h.mib == Mib::ZERO {
                    return Err(invalid(format!("GPU{}: {}/{} holds 0 MiB", g.index, h.namespace, h.name)));
                }
                allocations.push(NodeAllocation {
                    pod: PodRef { namespace: h.namespace, name: h.name, uid: h.uid },
                    container: h.container,
                    role: h.role,
                    gpu: g.index,
                    mib: h.mib,
                });
            }
            for c in g.claims {
                if c.namespace.is_empty() || c.name.is_empty() || c.uid.is_empty() {
                    return Err(invalid(format!("GPU{} lists a claim with an empty namespace, name or UID", g.index)));
                }
                if c.mib == Mib::ZERO {
                    return Err(invalid(format!("GPU{}: claim {}/{} consumes 0 MiB", g.index, c.namespace, c.name)));
                }
                claims.push(NodeClaim {
                    claim: ClaimRef { uid: c.uid, namespace: c.namespace, name: c.name },
                    request: c.request,
                    gpu: g.index,
                    mib: c.mib,
                });
            }
            for o in g.over_budget {
                if o.namespace.is_empty() || o.name.is_empty() {
                    return Err(invalid(format!(
                        "GPU{} lists an over-budget pod with an empty namespace or name",
                        g.index
                    )));
                }
                over_budget.push(OverBudget {
                    pod: PodRef { namespace: o.namespace, name: o.name, uid: o.uid },
                    container: o.container,
                    gpu: g.index,
                    in_use: o.in_use_mib,
                    budget: o.budget_mib,
                    since_ms: o.since,
                });
            }
            if let Some(p) = g.util_percent.filter(|p| *p > 100) {
                return Err(invalid(format!("GPU{} is {p}% utilized; a utilization is 0 to 100", g.index)));
            }
            gpus.push(Gpu {
                index: g.index,
                uuid: g.uuid,
                minor: g.minor,
                model: g.model,
                total: g.total_mib,
                health,
                cordoned: g.cordoned,
                numa_node: g.numa,
                pci_bus_id: g.pci,
                mode: match g.mode {
                    WireMode::Shared => SharingMode::Shared,
                    WireMode::Mps => SharingMode::Mps,
                    WireMode::Whole => SharingMode::Whole,
                    WireMode::Dra => SharingMode::Dra,
                    WireMode::DraMps => SharingMode::DraMps,
                },
                activity: g.in_use_mib.map(|in_use| Activity { utilization: g.util_percent, in_use }),
            });
            used.push((g.index, g.used_mib));
        }
        let inventory = NodeInventory::new(wire.unit, gpus).map_err(|e| invalid(e.to_string()))?;
        // The inventory sorts by index; keep `used` aligned with it.
        used.sort_by_key(|(index, _)| *index);
        Ok(NodeState {
            generation: wire.generation,
            daemon_version: wire.daemon,
            inventory,
            used: used.into_iter().map(|(_, m)| m).collect(),
            allocations,
            claims,
            over_budget,
            tells_lookalikes_apart: wire.tells_lookalikes_apart,
        })
    }
}

fn invalid(reason: String) -> CodecError {
    CodecError::Invalid { key: NODE_STATE_KEY, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_reference_reads_as_kubectl_names_it() {
        let pod = PodRef { namespace: "team-a".into(), name: "train-0".into(), uid: "u-1".into() };
        assert_eq!(pod.to_string(), "team-a/train-0");
    }

    fn sample() -> NodeState {
        let mut sick = Gpu::new(1, GpuUuid::new("GPU-b").unwrap(), "Tesla T4", Mib::new(15_360));
        sick.health = Health::Unhealthy { reason: "Xid 79".into() };
        sick.numa_node = Some(1);
        let mut g0 = Gpu::new(0, GpuUuid::new("GPU-a").unwrap(), "Tesla T4", Mib::new(15_360));
        g0.minor = Some(0);
        g0.pci_bus_id = Some("00000000:3B:00.0".into());
        g0.cordoned = true;
        g0.mode = SharingMode::Mps;
        g0.activity = Some(Activity { utilization: Some(37), in_use: Mib::new(4100) });
        NodeState {
            generation: 7,
            daemon_version: "0.1.0".into(),
            inventory: NodeInventory::new(MemoryUnit::Mib, vec![g0, sick]).unwrap(),
            used: vec![Mib::new(3500), Mib::new(2048)],
            allocations: vec![NodeAllocation {
                pod: PodRef { namespace: "default".into(), name: "infer-1".into(), uid: "u1".into() },
                container: "main".into(),
                role: ContainerRole::App,
                gpu: 0,
                mib: Mib::new(3500),
            }],
            claims: vec![NodeClaim {
                claim: ClaimRef { uid: "c9".into(), namespace: "ml".into(), name: "train-gpu".into() },
                request: "gpu".into(),
                gpu: 1,
                mib: Mib::new(2048),
            }],
            over_budget: vec![OverBudget {
                pod: PodRef { namespace: "default".into(), name: "infer-1".into(), uid: "u1".into() },
                container: "main".into(),
                gpu: 0,
                in_use: Mib::new(4100),
                budget: Mib::new(3500),
                since_ms: 1_700_000_000_000,
            }],
            tells_lookalikes_apart: true,
        }
    }

    #[test]
    fn round_trips_and_reads_as_documented() {
        let state = sample();
        let text = state.encode().unwrap();
        assert!(
            text.starts_with(
                r#"{"v":1,"generation":7,"daemon":"0.1.0","unit":"MiB","tellsLookalikesApart":true,"gpus":[{"index":0"#
            ),
            "{text}"
        );
        assert!(text.contains(r#""health":"Unhealthy","healthReason":"Xid 79""#), "{text}");
        assert!(text.contains(r#""usedMiB":3500,"pods":[{"namespace":"default","name":"infer-1""#), "{text}");
        assert!(text.contains(r#""mode":"mps","utilPercent":37,"inUseMiB":4100,"#), "{text}");
        assert!(
            text.contains(r#""usedMiB":2048,"pods":[],"claims":[{"namespace":"ml","name":"train-gpu","uid":"c9","request":"gpu","mib":2048}]"#),
            "{text}"
        );
        // A GPU without claims carries no key (what daemons before DRA wrote).
        assert_eq!(text.matches(r#""claims""#).count(), 1, "{text}");
        // Shared and unsampled GPUs carry neither key (what daemons before them wrote).
        let sick = &text[text.find(r#""index":1"#).unwrap()..];
        assert!(!sick.contains(r#""mode":"#) && !sick.contains("utilPercent") && !sick.contains("inUseMiB"), "{sick}");
        assert_eq!(NodeState::decode(&text).unwrap(), state);
    }

    #[test]
    fn unknown_fields_within_a_version_are_ignored() {
        let text = r#"{"v":1,"generation":1,"daemon":"9","unit":"GiB","future":true,
            "gpus":[{"index":0,"uuid":"u","model":"m","totalMiB":1024,"health":"Healthy","extra":[1]}]}"#;
        let state = NodeState::decode(text).unwrap();
        assert_eq!(state.inventory.unit(), MemoryUnit::Gib);
        assert_eq!(state.used, vec![Mib::ZERO]);
        // A daemon from before it does not tell look-alikes apart; false is not written.
        assert!(!state.tells_lookalikes_apart);
        let plain = NodeState { tells_lookalikes_apart: false, ..state };
        assert!(!plain.encode().unwrap().contains("tellsLookalikesApart"));
    }

    #[test]
    fn bad_values_are_errors_not_panics() {
        let cases: &[(&str, &str)] = &[
            ("", "malformed"),
            ("null", "malformed"),
            ("[]", "malformed"),
            ("{}", "schema version \"v\" is missing"),
            (r#"{"v":"1"}"#, "must be a whole number"),
            (r#"{"v":1.5}"#, "must be a whole number"),
            (r#"{"v":2,"anything":true}"#, "schema version 2 is not supported"),
            (r#"{"v":1}"#, "malformed"),
            (r#"{"v":1,"generation":-1,"daemon":"x","unit":"MiB","gpus":[]}"#, "malformed"),
            (r#"{"v":1,"generation":1,"daemon":"x","unit":"KiB","gpus":[]}"#, "malformed"),
            (
                r#"{"v":1,"generation":1,"daemon":"x","unit":"MiB","gpus":[{"index":0,"uuid":"a b","model":"m","totalMiB":1,"health":"Healthy"}]}"#,
                "invalid GPU UUID",
            ),
            (
                r#"{"v":1,"generation":1,"daemon":"x","unit":"MiB","gpus":[{"index":0,"uuid":"a","model":"m","totalMiB":1,"health":"Healthy"},{"index":0,"uuid":"b","model":"m","totalMiB":1,"health":"Healthy"}]}"#,
                "GPU index 0 appears twice",
            ),
            (
                r#"{"v":1,"generation":1,"daemon":"x","unit":"MiB","gpus":[{"index":0,"uuid":"a","model":"m","totalMiB":1,"health":"Sick"}]}"#,
                "malformed",
            ),
            (
                r#"{"v":1,"generation":1,"daemon":"x","unit":"MiB","gpus":[{"index":0,"uuid":"a","model":"m","totalMiB":1,"health":"Healthy","utilPercent":101,"inUseMiB":0}]}"#,
                "a utilization is 0 to 100",
            ),
            (
                r#"{"v":1,"generation":1,"daemon":"x","unit":"MiB","gpus":[{"index":0,"uuid":"a","model":"m","totalMiB":1,"health":"Healthy","mode":"exclusive"}]}"#,
                "malformed",
            ),
            (
                r#"{"v":1,"generation":1,"daemon":"x","unit":"MiB","gpus":[{"index":0,"uuid":"a","model":"m","totalMiB":9,"health":"Healthy","pods":[{"namespace":"","name":"p","uid":"u","container":"c","mib":1}]}]}"#,
                "empty namespace",
            ),
            (
                r#"{"v":1,"generation":1,"daemon":"x","unit":"MiB","gpus":[{"index":0,"uuid":"a","model":"m","totalMiB":9,"health":"Healthy","pods":[{"namespace":"d","name":"p","uid":"u","container":"c","mib":0}]}]}"#,
                "holds 0 MiB",
            ),
            (
                r#"{"v":1,"generation":1,"daemon":"x","unit":"MiB","gpus":[{"index":0,"uuid":"a","model":"m","totalMiB":9,"health":"Healthy","claims":[{"namespace":"d","name":"c","uid":"","request":"gpu","mib":1}]}]}"#,
                "a claim with an empty namespace, name or UID",
            ),
            (
                r#"{"v":1,"generation":1,"daemon":"x","unit":"MiB","gpus":[{"index":0,"uuid":"a","model":"m","totalMiB":9,"health":"Healthy","claims":[{"namespace":"d","name":"c","uid":"u","request":"gpu","mib":0}]}]}"#,
                "claim d/c consumes 0 MiB",
            ),
            (
                r#"{"v":1,"generation":1,"daemon":"x","unit":"MiB","gpus":[{"index":0,"uuid":"a","model":"m","totalMiB":9,"health":"Healthy","claims":[{"namespace":"d","name":"c","uid":"u","mib":5}]}]}"#,
                "malformed",
            ),
        ];
        for (text, want) in cases {
            let err = NodeState::decode(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
            assert!(err.starts_with("annotation gpushare.io/node-state"), "{err}");
        }
        let huge = format!(r#"{{"v":1,"pad":"{}"}}"#, "x".repeat(super::super::MAX_ANNOTATION_BYTES));
        assert!(matches!(NodeState::decode(&huge), Err(CodecError::TooLarge { .. })));
    }

    #[test]
    fn a_pod_is_charged_by_the_init_container_rule() {
        let gpu = |i: u32| Gpu::new(i, GpuUuid::new(format!("GPU-{i}")).unwrap(), "Tesla T4", Mib::new(15_360));
        let inventory = NodeInventory::new(MemoryUnit::Mib, vec![gpu(0), gpu(1)]).unwrap();
        let pod = |uid: &str| PodRef { namespace: "ml".into(), name: uid.into(), uid: uid.into() };
        let row = |uid: &str, container: &str, role, gpu, mib| NodeAllocation {
            pod: pod(uid),
            container: container.into(),
            role,
            gpu,
            mib: Mib::new(mib),
        };
        let allocations = vec![
            // init 10000 then app 8000 on GPU0: 10000, not 18000.
            row("a", "fetch", ContainerRole::Init, 0, 10_000),
            row("a", "main", ContainerRole::App, 0, 8000),
            // A sidecar started before the init container runs beside it: 500 + 3000.
            row("b", "proxy", ContainerRole::Sidecar, 1, 500),
            row("b", "warm", ContainerRole::Init, 1, 3000),
            row("b", "main", ContainerRole::App, 1, 2000),
            // A GPU the inventory lacks is left out.
            row("c", "main", ContainerRole::App, 7, 1000),
        ];
        let f = pod_footprints(&inventory, &allocations);
        assert_eq!(f["a"].mib, vec![Mib::new(10_000), Mib::ZERO]);
        assert_eq!(f["b"].mib, vec![Mib::ZERO, Mib::new(3500)]);
        assert!(!f.contains_key("c"), "{f:?}");
        assert_eq!(used_per_gpu(&inventory, &allocations, &[]), vec![Mib::new(10_000), Mib::new(3500)]);
        // A DRA claim counts as it is, beside the pods (and not on a GPU the inventory lacks).
        let claim = |gpu, mib| NodeClaim {
            claim: ClaimRef { uid: "c".into(), namespace: "ml".into(), name: "c".into() },
            request: "gpu".into(),
            gpu,
            mib: Mib::new(mib),
        };
        assert_eq!(
            used_per_gpu(&inventory, &allocations, &[claim(0, 2000), claim(0, 48), claim(7, 1)]),
            vec![Mib::new(12_048), Mib::new(3500)]
        );
        // The role travels in the annotation (omitted for app containers, as before).
        let state = NodeState {
            generation: 1,
            daemon_version: "x".into(),
            used: used_per_gpu(&inventory, &allocations[..5], &[]),
            inventory,
            allocations: allocations[..5].to_vec(),
            claims: Vec::new(),
            over_budget: Vec::new(),
            tells_lookalikes_apart: false,
        };
        let text = state.encode().unwrap();
        assert!(text.contains(r#""container":"fetch","role":"init","mib":10000"#), "{text}");
        assert!(text.contains(r#""container":"main","mib":8000"#), "{text}");
        assert_eq!(NodeState::decode(&text).unwrap(), state);
    }

    #[test]
    fn encode_refuses_inconsistent_state() {
        let mut state = sample();
        state.used.pop();
        assert!(state.encode().unwrap_err().to_string().contains("1 usage figures for 2 GPUs"));
        let mut state = sample();
        state.allocations[0].gpu = 9;
        assert!(state.encode().unwrap_err().to_string().contains("unknown GPU9"));
        let mut state = sample();
        state.claims[0].gpu = 4;
        assert!(state.encode().unwrap_err().to_string().contains("claim ml/train-gpu names unknown GPU4"));
    }
}
