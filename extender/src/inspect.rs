//! The model behind `kubectl inspect gpushare`: [`ClusterReport`], built from the cluster view
//! (nodes and pods sorted), is the extender's `inspect` JSON, `kubectl-inspect-gpushare -o
//! json`, the metrics' per-GPU figures, and the tables [`tables`] renders.

mod tables;

pub use tables::{GpuCell, NodeRow, percent, summary};

use gpushare_core::{Health, MemoryUnit, Mib};
use serde::{Deserialize, Serialize};

use crate::view::{ClusterView, NodeGpus};

/// The whole cluster, as the view sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterReport {
    /// The cluster unit.
    pub unit: MemoryUnit,
    /// Nodes whose daemon publishes GPUs, sorted by name.
    pub nodes: Vec<NodeReport>,
    /// Nodes whose published state cannot be read, with the reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreadable: Vec<(String, String)>,
}

/// One node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeReport {
    /// Name.
    pub name: String,
    /// Internal IP.
    pub address: String,
    /// The unit its daemon counts in.
    pub unit: MemoryUnit,
    /// Its GPUs in index order.
    pub gpus: Vec<GpuReport>,
    /// Pods bound to the node that hold no GPU yet, with what they ask for.
    pub pending: Vec<PodShare>,
    /// Seconds since the extender saw its daemon renew its heartbeat (absent: the daemon
    /// publishes none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_age_seconds: Option<u64>,
    /// The daemon stopped renewing its heartbeat: no new pod is placed there.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stale: bool,
}

/// One GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuReport {
    /// NVML index.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// Model.
    pub model: String,
    /// Allocatable memory (total rounded down to the unit).
    #[serde(rename = "totalMiB")]
    pub total_mib: u64,
    /// In use, reconciled view.
    #[serde(rename = "usedMiB")]
    pub used_mib: u64,
    /// Healthy.
    pub healthy: bool,
    /// Why not, when not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_reason: Option<String>,
    /// Cordoned by an operator.
    pub cordoned: bool,
    /// How it is shared: `shared`, `mps`, `whole`, `dra` or `dra-mps`; `alibaba` on a node
    /// Alibaba's device plugin still serves (listed with compatibility `alibaba`, never placed on).
    #[serde(default)]
    pub mode: String,
    /// Its utilisation at the daemon's last published sample, percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub util_percent: Option<u8>,
    /// Memory in use on it by every process at that sample (NVML), not `usedMiB`.
    #[serde(rename = "inUseMiB", default, skip_serializing_if = "Option::is_none")]
    pub in_use_mib: Option<u64>,
    /// Who holds it.
    pub pods: Vec<PodShare>,
    /// The DRA claims prepared on it, as its daemon reported them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub claims: Vec<ClaimShare>,
    /// Containers whose processes use more of it than their budget, as its daemon last saw.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub over_budget: Vec<OverBudgetShare>,
}

/// A container over its budget on one GPU, as its node's daemon reported it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OverBudgetShare {
    /// `namespace/name`.
    pub pod: String,
    /// The container (empty when not tied to one).
    #[serde(default)]
    pub container: String,
    /// Memory its processes use on the GPU.
    #[serde(rename = "inUseMiB")]
    pub in_use_mib: u64,
    /// Its budget there (0: none).
    #[serde(rename = "budgetMiB")]
    pub budget_mib: u64,
}

/// One request's share of one GPU in a DRA ResourceClaim, as its node's daemon reported it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimShare {
    /// `namespace/name` of the ResourceClaim.
    pub claim: String,
    /// Its UID.
    pub uid: String,
    /// The claim's request the share answers.
    pub request: String,
    /// Memory it consumes (kube-scheduler's `consumedCapacity`).
    pub mib: u64,
}

/// A pod's memory on one GPU (or, for pending pods, its request).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodShare {
    /// `namespace/name`.
    pub pod: String,
    /// UID, when known.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
    /// Memory.
    pub mib: u64,
    /// A bind the extender made that the watch has not shown yet.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_flight: bool,
}

impl ClusterReport {
    /// Reads the view.
    pub fn from_view(view: &mut ClusterView) -> Self {
        let unit = view.config().unit;
        let names: Vec<String> = view.node_names().into_iter().map(str::to_owned).collect();
        let mut report = ClusterReport { unit, nodes: Vec::new(), unreadable: Vec::new() };
        for name in names {
            let Some(entry) = view.node(&name) else { continue };
            let address = entry.address.clone();
            let (over_budget, claims) = match &entry.gpus {
                NodeGpus::NotSharing => {
                    report.nodes.extend(alibaba_node(view, &name, unit));
                    continue;
                }
                NodeGpus::Invalid(why) => {
                    report.unreadable.push((name, why.clone()));
                    continue;
                }
                NodeGpus::Reported(state) => (state.over_budget.clone(), state.claims.clone()),
            };
            let Ok(inventory) = view.inventory(&name).cloned() else { continue };
            let Ok(usage) = view.usage(&name).cloned() else { continue };
            let used = usage.total();
            let gpus = inventory
                .gpus()
                .iter()
                .enumerate()
                .map(|(p, g)| GpuReport {
                    index: g.index,
                    uuid: g.uuid.to_string(),
                    model: g.model.clone(),
                    total_mib: g.capacity(inventory.unit()).get(),
                    used_mib: used.get(p).copied().unwrap_or(Mib::ZERO).get(),
                    healthy: g.health.is_healthy(),
                    health_reason: match &g.health {
                        Health::Healthy => None,
                        Health::Unhealthy { reason } => Some(reason.clone()),
                    },
                    cordoned: g.cordoned,
                    mode: g.mode.as_str().to_owned(),
                    util_percent: g.activity.and_then(|a| a.utilization),
                    in_use_mib: g.activity.map(|a| a.in_use.get()),
                    over_budget: over_budget
                        .iter()
                        .filter(|o| o.gpu == g.index)
                        .map(|o| OverBudgetShare {
                            pod: o.pod.to_string(),
                            container: o.container.clone(),
                            in_use_mib: o.in_use.get(),
                            budget_mib: o.budget.get(),
                        })
                        .collect(),
                    claims: claims
                        .iter()
                        .filter(|c| c.gpu == g.index)
                        .map(|c| ClaimShare {
                            claim: c.claim.to_string(),
                            uid: c.claim.uid.clone(),
                            request: c.request.clone(),
                            mib: c.mib.get(),
                        })
                        .collect(),
                    pods: usage
                        .pods
                        .iter()
                        .filter_map(|h| {
                            let mib = h.mib.get(p).copied().unwrap_or(Mib::ZERO);
                            (mib > Mib::ZERO).then(|| PodShare {
                                pod: h.pod.clone(),
                                uid: h.uid.clone(),
                                mib: mib.get(),
                                in_flight: h.assumed,
                            })
                        })
                        .collect(),
                })
                .collect();
            let pending = usage
                .pending
                .iter()
                .map(|(pod, mib)| PodShare { pod: pod.clone(), uid: String::new(), mib: mib.get(), in_flight: false })
                .collect();
            let fresh = view.freshness(&name);
            report.nodes.push(NodeReport {
                name,
                address,
                unit: inventory.unit(),
                gpus,
                pending,
                heartbeat_age_seconds: fresh.map(|f| f.age.as_secs()),
                stale: fresh.is_some_and(|f| f.is_stale()),
            });
        }
        report
    }

    /// Only the node named `node`.
    #[must_use]
    pub fn only(mut self, node: &str) -> Self {
        self.nodes.retain(|n| n.name == node);
        self.unreadable.retain(|(n, _)| n == node);
        self
    }

    /// Per-node heartbeat figures for the metrics.
    #[must_use]
    pub fn node_samples(&self) -> Vec<crate::metrics::NodeSample> {
        self.nodes
            .iter()
            .map(|n| crate::metrics::NodeSample {
                node: n.name.clone(),
                heartbeat_age_seconds: n.heartbeat_age_seconds,
                stale: n.stale,
            })
            .collect()
    }

    /// Per-GPU figures for the metrics.
    #[must_use]
    pub fn gpu_samples(&self) -> Vec<crate::metrics::GpuSample> {
        self.nodes
            .iter()
            .flat_map(|n| {
                n.gpus.iter().map(|g| crate::metrics::GpuSample {
                    node: n.name.clone(),
                    index: g.index,
                    uuid: g.uuid.clone(),
                    used_mib: g.used_mib,
                    total_mib: g.total_mib,
                    schedulable: g.healthy && !g.cordoned && g.mode != "whole" && g.mode != "alibaba" && !n.stale,
                    claims: u64::try_from(g.claims.len()).unwrap_or(u64::MAX),
                    claimed_mib: g.claims.iter().map(|c| c.mib).fold(0, u64::saturating_add),
                    over_budget: g
                        .over_budget
                        .iter()
                        .map(|o| crate::metrics::OverBudgetSample {
                            pod: o.pod.clone(),
                            container: o.container.clone(),
                            in_use_mib: o.in_use_mib,
                            budget_mib: o.budget_mib,
                        })
                        .collect(),
                })
            })
            .collect()
    }
}

/// A node Alibaba's device plugin still serves, as Alibaba's inspect shows it ([`ClusterView::alibaba_gpus`]):
/// its GPUs by index, `mode` `alibaba`, no UUID or model (no gpushared reports them); `None` for
/// any other node.
fn alibaba_node(view: &ClusterView, name: &str, unit: MemoryUnit) -> Option<NodeReport> {
    let gpus = view.alibaba_gpus(name)?;
    let mib = |units: u64| unit.to_mib(units).map_or(u64::MAX, Mib::get);
    let gpus = gpus
        .into_iter()
        .map(|g| GpuReport {
            index: g.index,
            uuid: String::new(),
            model: String::new(),
            total_mib: mib(g.total),
            used_mib: g.pods.iter().map(|(_, _, units)| mib(*units)).fold(0, u64::saturating_add),
            healthy: true,
            health_reason: None,
            cordoned: false,
            mode: "alibaba".to_owned(),
            util_percent: None,
            in_use_mib: None,
            over_budget: Vec::new(),
            claims: Vec::new(),
            pods: g
                .pods
                .into_iter()
                .map(|(pod, uid, units)| PodShare { pod, uid, mib: mib(units), in_flight: false })
                .collect(),
        })
        .collect();
    let address = view.node(name).map(|e| e.address.clone()).unwrap_or_default();
    Some(NodeReport {
        name: name.to_owned(),
        address,
        unit,
        gpus,
        pending: Vec::new(),
        heartbeat_age_seconds: None,
        stale: false,
    })
}
