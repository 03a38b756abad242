//! The kubelet-facing side: everything the kubelet calls or that watches the kubelet.
//!
//! - [`plugin`]: the device plugin API for GPU memory (v1beta1) and registration;
//! - [`whole`]: whole GPUs beside the shares, as a second device-plugin resource;
//! - [`watch`]: kubelet restarts, seen in the device-plugin directory;
//! - [`streams`]: a kubelet that dropped the plugin without restarting;
//! - [`pod_resources`]: the kubelet's PodResources API, for reconciliation.
//!
//! The handlers here only translate: every decision is the allocation service's
//! ([`crate::allocation::allocator`]).

pub mod plugin;
pub mod pod_resources;
pub mod streams;
pub mod watch;
pub mod whole;

use gpushare_proto::deviceplugin::DeviceSpec;

use crate::config::DeviceNode;

/// The device nodes of an `Allocate` answer, as the kubelet hands them to the runtime: each GPU's
/// node, and the control nodes the host has now, read and written.
fn device_specs(nodes: &[DeviceNode]) -> Vec<DeviceSpec> {
    nodes
        .iter()
        .filter(|n| n.named())
        .map(|n| DeviceSpec {
            container_path: n.container_path.display().to_string(),
            host_path: n.host_path.display().to_string(),
            permissions: "rw".to_owned(),
        })
        .collect()
}
