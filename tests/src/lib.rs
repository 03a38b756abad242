//! The cluster in a box: stand-ins that speak the real protocols, for tests and the demo.
//!
//! - [`kubelet`]: the kubelet's side of the device plugin API.

pub mod kubelet;
