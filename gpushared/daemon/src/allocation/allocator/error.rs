//! Why a kubelet call (or an operator's request) cannot be served: one error type for the
//! allocation service, each message saying what an operator can do.

use gpushare_core::{GpuUuid, MemoryUnit, Mib};
use thiserror::Error;

use crate::allocation::ledger::LedgerError;

/// Why a kubelet call cannot be served. Every message says what an operator can do.
#[derive(Debug, Error)]
pub enum AllocError {
    /// No pod bound to this node waits for this many devices.
    #[error(
        "no pod bound to node {node} is waiting for {units} {unit} of {resource}{detail}; pods asking for \
         {resource} must be placed by gpushare-extender (kube-scheduler's extender configuration), which writes \
         the {key} annotation"
    )]
    NoCandidate {
        /// This node.
        node: String,
        /// Devices asked for.
        units: usize,
        /// The unit.
        unit: MemoryUnit,
        /// The memory resource.
        resource: String,
        /// What was found instead.
        detail: String,
        /// The annotation key.
        key: &'static str,
    },
    /// A container the runtime is creating asks for GPU memory on a node whose kubelet counts
    /// it (`[kubelet] advertise = "capacity"`), and cannot be given its GPU.
    #[error(
        "refusing to create container {container:?} of pod {pod} (UID {uid}): it asks for GPU memory and {why}; \
         nothing was allocated. The kubelet retries the container; if it keeps failing, delete the pod so that \
         gpushare-extender places it again"
    )]
    NotServed {
        /// namespace/name.
        pod: String,
        /// The pod's UID.
        uid: String,
        /// The container.
        container: String,
        /// Why not.
        why: String,
    },
    /// A container the runtime is creating belongs to a pod the pod store cannot show bound
    /// here, and the pod could not be read from the API server: whether the container asks for
    /// GPU memory is not known.
    #[error(
        "refusing to create a container of pod {pod} (UID {uid}): gpushared cannot read the pod from the API \
         server ({why}), so it cannot tell whether the container asks for GPU memory; the kubelet retries the \
         container"
    )]
    PodUnread {
        /// namespace/name.
        pod: String,
        /// The pod's UID.
        uid: String,
        /// Why the read failed.
        why: String,
    },
    /// A container the runtime is creating carries a device-plugin answer that is not its own.
    #[error(
        "refusing to create container {container:?} of pod {pod} (UID {uid}): its environment names pod {answered} \
         (GPUSHARE_POD) and {why}; it would run on GPUs granted to another pod. The kubelet retries the container; \
         if it keeps failing, delete the pod so that it is admitted again"
    )]
    WrongPod {
        /// namespace/name.
        pod: String,
        /// The pod's UID.
        uid: String,
        /// The container.
        container: String,
        /// The pod its answer names.
        answered: String,
        /// What shows that the answer is not its own.
        why: String,
    },
    /// A device ID that is not one of this daemon's.
    #[error("device {0:?} is not one of gpushared's devices on this node (a stale kubelet checkpoint?)")]
    UnknownDevice(String),
    /// The assignment names a GPU this node does not have.
    #[error("pod {pod}: assigned GPU {uuid} is not on this node; delete the pod so it is placed again")]
    UnknownGpu {
        /// namespace/name.
        pod: String,
        /// The GPU.
        uuid: GpuUuid,
    },
    /// The assigned GPU turned unhealthy since the pod was placed.
    #[error("pod {pod}: assigned GPU{index} is unhealthy ({reason}); delete the pod so it is placed again")]
    Unhealthy {
        /// namespace/name.
        pod: String,
        /// GPU index.
        index: u32,
        /// Why.
        reason: String,
    },
    /// The ledger says the GPU has no room for this container.
    #[error(
        "pod {pod} container {container:?}: GPU{index} has {free} free in the ledger, needs {needs}; nothing was \
         allocated"
    )]
    NoRoom {
        /// namespace/name.
        pod: String,
        /// Container.
        container: String,
        /// GPU index.
        index: u32,
        /// Free by the ledger.
        free: Mib,
        /// Needed.
        needs: Mib,
    },
    /// The ledger could not be written: nothing was allocated.
    #[error("{0}; nothing was allocated")]
    Ledger(#[from] LedgerError),
    /// The assigned GPU was cordoned by an operator since the pod was placed.
    #[error(
        "pod {pod}: assigned GPU{index} is cordoned (gpusharectl uncordon {index}); delete the pod so it is placed again"
    )]
    Cordoned {
        /// namespace/name.
        pod: String,
        /// GPU index.
        index: u32,
    },
    /// The kubelet's call itself is wrong: no device, or one device twice.
    #[error("{0}")]
    BadRequest(String),
    /// The pod the kubelet is admitting carries an assignment that does not fit its spec.
    #[error("pod {pod}: {reason}; nothing was allocated: delete the pod so gpushare-extender places it again")]
    BadAssignment {
        /// namespace/name.
        pod: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The ledger is being rebuilt: no allocation can be checked against it yet.
    #[error(
        "the allocation ledger lacked {missing} allocation(s) this node had published and is being rebuilt from the \
         pods bound to this node; calls are served once it is (see gpushared's log)"
    )]
    Rebuilding {
        /// Rows still to book.
        missing: usize,
    },
    /// An operator named a GPU this node does not have.
    #[error("no GPU {0:?} on this node; name it by its index or UUID (gpusharectl gpus lists them)")]
    NoSuchGpu(String),
    /// The pod first in line had devices the kubelet then offered as free.
    #[error(
        "pod {pod} waits for {units} {unit}, but the kubelet offered the devices allocated to it earlier as free: \
         its admission failed or was another pod's, or the pod is gone and the API server has not said so yet; \
         not served until the pod watch settles which pod the kubelet admits"
    )]
    Doubtful {
        /// namespace/name.
        pod: String,
        /// Devices asked for.
        units: usize,
        /// The unit.
        unit: MemoryUnit,
    },
    /// The kubelet that made the call restarted while it was served.
    #[error(
        "the kubelet that made this call restarted while it was served; nothing was allocated: the new kubelet \
         admits the pod again"
    )]
    KubeletRestarted,
    /// Pods the kubelet cannot tell apart wait: the same first request, other GPUs.
    #[error(
        "pods {first} and {other} both wait for {units} {unit} first but are assigned different GPUs; the kubelet's \
         call does not say which it admits (gpushare-extender binds such pods to a node one at a time)"
    )]
    Ambiguous {
        /// The one that would be chosen.
        first: String,
        /// A look-alike.
        other: String,
        /// Devices asked for.
        units: usize,
        /// The unit.
        unit: MemoryUnit,
    },
    /// The container chosen belongs to a pod whose admission has not started, and the pod
    /// store has not been read consistently since the call came: the pod watch may lag behind
    /// the kubelet's, so the pod the kubelet admits may be one not seen yet. The caller reads
    /// the node's pods ([`crate::allocation::pods::PodStore::confirm`]) and asks again.
    #[error(
        "pod {pod} would be served, but the daemon has not read this node's pods since the kubelet's call came, so \
         another pod may be the one admitted; it reads them before answering"
    )]
    Unconfirmed {
        /// namespace/name of the pod that would be served; empty when none would.
        pod: String,
    },
}

impl AllocError {
    /// The gRPC code its caller receives, the same for every caller: the kubelet (device plugin,
    /// over gRPC) and the container runtime (NRI, over ttrpc, which carries gRPC's codes).
    #[must_use]
    pub fn code(&self) -> tonic::Code {
        match self {
            AllocError::UnknownDevice(_) | AllocError::BadRequest(_) | AllocError::BadAssignment { .. } => {
                tonic::Code::InvalidArgument
            }
            AllocError::NoRoom { .. } => tonic::Code::ResourceExhausted,
            AllocError::NoCandidate { .. }
            | AllocError::Ambiguous { .. }
            | AllocError::Doubtful { .. }
            | AllocError::UnknownGpu { .. }
            | AllocError::Unhealthy { .. }
            | AllocError::Cordoned { .. }
            | AllocError::WrongPod { .. }
            | AllocError::NotServed { .. } => tonic::Code::FailedPrecondition,
            AllocError::Ledger(_) => tonic::Code::Internal,
            AllocError::Rebuilding { .. } | AllocError::Unconfirmed { .. } | AllocError::PodUnread { .. } => {
                tonic::Code::Unavailable
            }
            AllocError::NoSuchGpu(_) => tonic::Code::NotFound,
            AllocError::KubeletRestarted => tonic::Code::Aborted,
        }
    }
}
