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
