//! gpushare's core: the decisions both the node daemon (`gpushared`) and the scheduler
//! extender make, in one place so that they cannot disagree. It does no I/O and depends on no
//! runtime, gRPC, D-Bus, `SQLite`, NVML or Kubernetes client (CI checks the dependency tree).
//!
//! - [`units`]: the MiB newtype, the cluster unit, Kubernetes quantity parsing;
//! - [`inventory`]: a node's GPUs;
//! - [`request`]: a pod's GPU request, read and validated from its spec;
//! - [`resources`]: the `[resources]` section both binaries read, and its check;
//! - [`placement`]: placing a pod on one node, scoring the node, explaining a rejection;
//! - [`schedule`]: the same over many nodes (filter and prioritize);
//! - [`codec`]: the annotation schemas (node state, pod assignment, Alibaba's keys).
//! - [`devices`]: kubelet device IDs and the size of the device list the kubelet receives;
//! - [`dra`]: the DRA driver's device and CDI names, its pool, and the memory a claim consumes;
//! - [`time`]: RFC 3339 UTC times, formatted and parsed without a clock;
//! - [`confine`]: a unit's network confinement (`confine_network`): what may be allowed, and the
//!   systemd drop-in.

pub mod codec;
pub mod confine;
pub mod devices;
pub mod dra;
pub mod inventory;
pub mod placement;
pub mod request;
pub mod resources;
pub mod retry;
pub mod schedule;
pub mod time;
pub mod units;

/// gpushare's memory resource (a kubelet device-plugin resource, one device per unit).
pub const GPUSHARE_MEMORY_RESOURCE: &str = "gpushare.io/gpu-mem";
/// gpushare's GPU-count resource (scheduler-only, never advertised by nodes).
pub const GPUSHARE_COUNT_RESOURCE: &str = "gpushare.io/gpu-count";
/// gpushare's whole-GPU resource: one device per GPU in `whole` mode, advertised by the daemon
/// beside the memory resource and counted by kube-scheduler itself.
pub const GPUSHARE_WHOLE_RESOURCE: &str = "gpushare.io/gpu";
/// Alibaba's memory resource, read under `[resources] compatibility = "alibaba"`.
pub const ALIBABA_MEMORY_RESOURCE: &str = "aliyun.com/gpu-mem";
/// Alibaba's GPU-count resource.
pub const ALIBABA_COUNT_RESOURCE: &str = "aliyun.com/gpu-count";

pub use inventory::{Activity, Gpu, GpuUuid, Health, NodeInventory, SharingMode};
pub use placement::{GpuPolicy, NodePolicy, NodeView, Placement, Placer, Rejection};
pub use request::{ContainerRequest, ContainerRole, PodRequest, PodSpec, RequestError, ResourceNames};
pub use units::{MemoryUnit, Mib};
