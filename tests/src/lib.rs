//! The cluster in a box: stand-ins that speak the real protocols, for tests and the demo.
//!
//! - [`apiserver`]: the Kubernetes API server's HTTP/JSON for Pods and Nodes;
//! - [`kubelet`]: the kubelet's side of the device plugin API and its PodResources API, restarts included;
//! - [`nvml`]: the fake NVML library, built from C, and its configuration.

pub mod apiserver;
pub mod kubelet;
pub mod nvml;
