//! gpushared, the node daemon: it discovers the host's GPUs, serves the kubelet's device
//! plugin API, resolves which pod and container each `Allocate` is for, and records every
//! allocation in a durable ledger before answering.
//!
//! - [`allocator`]: which container each kubelet call serves, checked and recorded;
//! - [`cli`]: the `gpushared` command line (its flags, for the binary and the man page);
//! - [`config`]: the configuration file;
//! - [`ctl`]: `gpusharectl`, the operator's command line over the status API;
//! - [`dbus`]: the local status API on the D-Bus system bus;
//! - [`discovery`]: the host's GPUs, from NVML or the configuration;
//! - [`gpu_events`]: Xid and ECC events and GPU probes, from NVML;
//! - [`health`]: the GPU health policy, automatic recovery included;
//! - [`heartbeat`]: the heartbeat renewed on this node's Node;
//! - [`kube`]: the watch of the pods bound to this node;
//! - [`kubelet_watch`]: kubelet restarts, seen in the device-plugin directory;
//! - [`ledger`]: the SQLite allocation ledger;
//! - [`memory`]: keeping resident memory small after the kubelet's large device lists;
//! - [`mps`]: the environment file the MPS control daemon's unit reads (the GPUs in MPS mode);
//! - [`objects`]: the parts of Pods and Nodes the daemon reads;
//! - [`overuse`]: GPU processes against the containers' budgets, with warn or evict;
//! - [`plugin`]: the kubelet device plugin API and registration;
//! - [`pods`]: the pods bound to this node, as last seen;
//! - [`publish`]: the node-state annotation on this node's Node;
//! - [`reconcile`]: the ledger against the kubelet's PodResources record;
//! - [`recovery`]: the ledger against the node's last publication at start, and its rebuild;
//! - [`startup`]: the checks on the configuration against this host, before serving;
//! - [`systemd`]: readiness, status and the watchdog for `Type=notify`;
//! - [`whole`]: whole GPUs beside the shares, as a second device-plugin resource.

pub mod allocator;
pub mod cli;
pub mod config;
pub mod ctl;
pub mod dbus;
pub mod discovery;
pub mod gpu_events;
pub mod health;
pub mod heartbeat;
pub mod kube;
pub mod kubelet_watch;
pub mod ledger;
pub mod memory;
pub mod mps;
pub mod objects;
pub mod overuse;
pub mod plugin;
pub mod pods;
pub mod publish;
pub mod reconcile;
pub mod recovery;
pub mod startup;
pub mod whole;

pub use gpushare_sdnotify as systemd;

/// This daemon's version, as published in the node state and on D-Bus.
pub const DAEMON_VERSION: &str = env!("CARGO_PKG_VERSION");
