//! The kubelet's gRPC APIs, generated into `OUT_DIR` from `deviceplugin.proto` and
//! `podresources.proto` (written from the upstream field tables): the device plugin API that
//! gpushared serves and registers with, and the PodResources API it reconciles against. The
//! stand-in kubelet of the tests uses the same code from the other side. [`compact`] holds the
//! hand-written messages for the two large device lists; [`uds`] dials gRPC servers on unix
//! sockets.

/// The device plugin API, package `v1beta1`.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod deviceplugin {
    tonic::include_proto!("v1beta1");
    pub use crate::compact::{ContainerPreferredAllocationRequest, ListAndWatchResponse};
}

/// The PodResources API, package `v1`.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod podresources {
    tonic::include_proto!("v1");
}

pub mod compact;
pub mod uds;

/// `Device.health` of a healthy device.
pub const HEALTHY: &str = "Healthy";
/// `Device.health` of an unhealthy device.
pub const UNHEALTHY: &str = "Unhealthy";
/// The only device plugin API version the kubelet supports.
pub const DEVICE_PLUGIN_VERSION: &str = "v1beta1";
