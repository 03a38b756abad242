//! gpushared, the node daemon: it discovers the host's GPUs, serves the kubelet's device
//! plugin API, resolves which pod and container each `Allocate` is for, and records every
//! allocation in a durable ledger before answering.
//!
//! The code is in areas, each a module of its own:
//!
//! - [`kubelet`]: the kubelet-facing side (device plugin, whole GPUs, restarts, reconciliation);
//! - [`allocation`]: the allocation service and its ledger;
//! - [`gpus`]: the node's GPUs (discovery, health, MPS, over-use);
//! - [`cluster`]: the API-server side (pod watch, node-state publication, heartbeat);
//! - [`dbus`]: the local status API on the D-Bus system bus;
//! - [`dra`]: the DRA driver (ResourceSlice, the kubelet's DRA plugin API, CDI specs);
//! - [`cli`], [`config`], [`startup`]: the command line, the configuration file and the checks
//!   on it against this host before serving;
//! - [`nri`]: the container runtime's side (an NRI plugin completing each container's environment);
//! - [`memory`]: keeping resident memory small after the kubelet's large device lists;
//! - [`status`]: the status line systemd shows;
//! - [`systemd`]: readiness, status and the watchdog for `Type=notify`.
//!
//! The arrows point one way: `kubelet`, `nri`, `dbus` and `cluster::publish` call the allocation
//! service; it reads `allocation::pods` and the GPUs' state; nothing in `allocation` or `gpus`
//! knows a protocol.

pub mod allocation;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod dbus;
pub mod dra;
pub mod gpus;
pub mod kubelet;
pub mod memory;
pub mod nri;
pub mod startup;
pub mod status;

pub use gpushare_sdnotify as systemd;

/// This daemon's version, as published in the node state and on D-Bus.
pub const DAEMON_VERSION: &str = env!("CARGO_PKG_VERSION");
