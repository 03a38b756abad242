//! Why a pod does not fit on a node: each GPU's state as a [`Rejection`] reports it, the
//! rejections themselves with the text kube-scheduler shows, and whether preemption could help.

use thiserror::Error;

use super::NodeView;
use crate::inventory::Health;
use crate::units::Mib;

/// The state of one GPU, as a rejection reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuState {
    /// NVML index.
    pub index: u32,
    /// Capacity in MiB (total rounded to the unit).
    pub capacity: Mib,
    /// Free memory.
    pub free: Mib,
    /// Why it cannot be used at all, if so.
    pub unusable: Option<Unusable>,
}

/// Why a GPU takes no allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unusable {
    /// Health check failed.
    Unhealthy(String),
    /// Cordoned by an operator.
    Cordoned,
    /// Handed out whole (`whole` mode), never shared.
    Whole,
    /// Served through DRA (`dra` mode): ResourceClaims only.
    Dra,
}

/// Why a pod does not fit on a node.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum Rejection {
    /// The node reports no GPUs.
    #[error("node has no GPUs")]
    NoGpus,
    /// The node counts devices in another unit than the cluster.
    #[error("node counts GPU memory in {node}, the cluster in {cluster}; set the same unit on its daemon")]
    UnitMismatch {
        /// The node's unit.
        node: crate::units::MemoryUnit,
        /// The unit the pod's request was read in.
        cluster: crate::units::MemoryUnit,
    },
    /// Every GPU is unhealthy, cordoned or handed out whole.
    #[error("no GPU takes allocations: {}", states(.gpus, None))]
    NoSchedulableGpus {
        /// Each GPU's state.
        gpus: Vec<GpuState>,
    },
    /// A container asks for more GPUs than the node has usable.
    #[error("container {container:?} needs {needs} GPUs, node has {usable} that take allocations")]
    TooFewGpus {
        /// Container name.
        container: String,
        /// GPUs asked for.
        needs: u32,
        /// Healthy, uncordoned GPUs on the node.
        usable: u32,
    },
    /// Even an empty GPU of this node is too small for a container's share.
    #[error("container {container:?} needs {per_gpu} on a GPU, the largest usable GPU here has {largest}")]
    GpuTooSmall {
        /// Container name.
        container: String,
        /// Memory per GPU.
        per_gpu: Mib,
        /// Largest usable capacity on the node.
        largest: Mib,
    },
    /// The containers fit one by one on an empty node but not all together.
    #[error("the pod's containers together need more than this node's usable GPUs hold even when empty")]
    PodTooLarge,
    /// Not enough free memory now; preemption may help.
    #[error("{}", insufficient(.container.as_deref(), *.per_gpu, *.gpus, .detail))]
    Insufficient {
        /// The container that could not be placed, if one alone does not fit; `None` when each
        /// fits alone but not all together.
        container: Option<String>,
        /// Its per-GPU need (the largest need among containers when `container` is `None`).
        per_gpu: Mib,
        /// How many GPUs it needs.
        gpus: u32,
        /// Every GPU's state.
        detail: Vec<GpuState>,
    },
}

impl Rejection {
    /// Whether evicting pods could make room (kube-scheduler's `FailedNodes`), as opposed to a
    /// node that can never hold the pod (`FailedAndUnresolvableNodes`).
    #[must_use]
    pub fn is_resolvable(&self) -> bool {
        matches!(self, Rejection::Insufficient { .. })
    }
}

fn states(gpus: &[GpuState], need: Option<Mib>) -> String {
    let mut out = String::new();
    for (i, g) in gpus.iter().enumerate() {
        if i > 0 {
            out.push_str("; ");
        }
        let line = match &g.unusable {
            Some(Unusable::Unhealthy(reason)) => format!("GPU{}: unhealthy ({reason})", g.index),
            Some(Unusable::Cordoned) => format!("GPU{}: cordoned", g.index),
            Some(Unusable::Whole) => format!("GPU{}: handed out whole, not shared", g.index),
            Some(Unusable::Dra) => {
                format!("GPU{}: served through DRA (ResourceClaims), not device-plugin shares", g.index)
            }
            None => match need {
                Some(n) if g.free < n => {
                    format!("GPU{}: {} of {} MiB free, needs {}", g.index, g.free.get(), g.capacity.get(), n.get())
                }
                _ => format!("GPU{}: {} of {} MiB free", g.index, g.free.get(), g.capacity.get()),
            },
        };
        out.push_str(&line);
    }
    out
}

fn insufficient(container: Option<&str>, per_gpu: Mib, gpus: u32, detail: &[GpuState]) -> String {
    match container {
        Some(name) if gpus == 1 => format!("container {name:?} does not fit: {}", states(detail, Some(per_gpu))),
        Some(name) => format!(
            "container {name:?} needs {gpus} GPUs with {} MiB free each: {}",
            per_gpu.get(),
            states(detail, Some(per_gpu))
        ),
        None => format!("the pod's containers do not fit together: {}", states(detail, None)),
    }
}

/// Each GPU of `node`, with what it has free and why it takes no allocation, if so.
pub(super) fn gpu_states(node: NodeView<'_>) -> Vec<GpuState> {
    let unit = node.inventory.unit();
    node.inventory
        .gpus()
        .iter()
        .zip(node.used)
        .map(|(g, used)| GpuState {
            index: g.index,
            capacity: g.capacity(unit),
            free: g.capacity(unit).saturating_sub(*used),
            unusable: match (&g.health, g.cordoned) {
                _ if g.mode == crate::inventory::SharingMode::Whole => Some(Unusable::Whole),
                _ if g.mode.is_dra() => Some(Unusable::Dra),
                (Health::Unhealthy { reason }, _) => Some(Unusable::Unhealthy(reason.clone())),
                (Health::Healthy, true) => Some(Unusable::Cordoned),
                (Health::Healthy, false) => None,
            },
        })
        .collect()
}
