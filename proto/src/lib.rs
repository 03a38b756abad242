//! The kubelet's gRPC APIs, generated into `OUT_DIR` from `deviceplugin.proto`,
//! `podresources.proto`, `dra.proto` and `pluginregistration.proto` (written from the upstream
//! field tables): the device plugin API that gpushared serves and registers with, the
//! PodResources API it reconciles against, and the DRA plugin API it serves as a DRA driver,
//! registered through the kubelet's plugin watcher; and the part of the container runtime's NRI
//! API (`nri.proto`, with ttrpc's envelope `ttrpc.proto`) that gpushared's NRI plugin speaks,
//! framed by [`nri_wire`]. The
//! stand-in kubelet of the tests uses the same code from the other side. [`compact`] holds the
//! hand-written messages for the large device lists; [`uds`] dials gRPC servers on unix
//! sockets; [`authority`] lets tonic serve the kubelet's plugin watcher, whose requests it would
//! refuse.

/// The device plugin API, package `v1beta1`.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod deviceplugin {
    tonic::include_proto!("v1beta1");
    pub use crate::compact::{ContainerPreferredAllocationRequest, ListAndWatchResponse, PreferredAllocationRequest};
}

/// The PodResources API, package `v1`.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod podresources {
    tonic::include_proto!("v1");
    pub use crate::compact::ContainerDevices;
}

/// The DRA plugin API, package `k8s.io.kubelet.pkg.apis.dra.v1`.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod dra {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// The plugin registration API, package `pluginregistration` (v1).
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// The NRI plugin API, package `nri.pkg.api.v1alpha1` (the part gpushared uses), carried over
/// ttrpc.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod nri {
    tonic::include_proto!("nri.pkg.api.v1alpha1");
    /// The ttrpc service the runtime serves.
    pub const RUNTIME_SERVICE: &str = "nri.pkg.api.v1alpha1.Runtime";
    /// The ttrpc service a plugin serves.
    pub const PLUGIN_SERVICE: &str = "nri.pkg.api.v1alpha1.Plugin";
    /// `Event.CREATE_CONTAINER`: bit `4 - 1` of `ConfigureResponse.events`.
    pub const EVENT_CREATE_CONTAINER: i32 = 4;
}

/// ttrpc's envelope, package `ttrpc`.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod ttrpc {
    tonic::include_proto!("ttrpc");
}

/// The service a DRA plugin names in `PluginInfo.supported_versions`.
pub const DRA_PLUGIN_SERVICE: &str = "v1.DRAPlugin";
/// `PluginInfo.type` of a DRA plugin.
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";

pub mod authority;
pub mod compact;
pub mod nri_wire;
pub mod registration;
pub mod uds;

/// `Device.health` of a healthy device.
pub const HEALTHY: &str = "Healthy";
/// `Device.health` of an unhealthy device.
pub const UNHEALTHY: &str = "Unhealthy";
/// The only device plugin API version the kubelet supports.
pub const DEVICE_PLUGIN_VERSION: &str = "v1beta1";
