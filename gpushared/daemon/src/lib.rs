//! gpushared, the node daemon: it discovers the host's GPUs, serves the kubelet's device
//! plugin API, resolves which pod and container each `Allocate` is for, and records every
//! allocation in a durable ledger before answering.
//!
//! - [`config`]: the configuration file;
//! - [`ledger`]: the SQLite allocation ledger.

pub mod config;
pub mod ledger;
