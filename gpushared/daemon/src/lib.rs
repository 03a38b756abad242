//! gpushared, the node daemon: it discovers the host's GPUs, serves the kubelet's device
//! plugin API, resolves which pod and container each `Allocate` is for, and records every
//! allocation in a durable ledger before answering.
//!
//! - [`allocator`]: which container each kubelet call serves, checked and recorded;
//! - [`config`]: the configuration file;
//! - [`discovery`]: the host's GPUs, from NVML or the configuration;
//! - [`ledger`]: the SQLite allocation ledger;
//! - [`pods`]: the pods bound to this node, as last seen.

pub mod allocator;
pub mod config;
pub mod discovery;
pub mod ledger;
pub mod pods;
