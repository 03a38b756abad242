//! Allocation state: which container holds what on this node's GPUs, decided and kept durably.
//!
//! - [`allocator`]: the allocation service, a thin service over pure parts (which container a
//!   kubelet call serves, the devices proposed, the room check, the environment);
//! - [`ledger`]: the SQLite allocation ledger, the durable truth;
//! - [`pods`]: the pods bound to this node, as last seen (filled by [`crate::cluster::kube`]);
//! - [`reconcile`]: the plan that makes the ledger agree with the kubelet's PodResources.
//!
//! Nothing here speaks gRPC, D-Bus or HTTP: the kubelet, D-Bus and cluster areas call in.

pub mod allocator;
pub mod ledger;
pub mod pods;
pub mod reconcile;
