//! gpushare's kube-scheduler extender: the cluster view of GPU nodes and pods, the filter /
//! prioritize / bind / preempt decisions over it, the HTTP server kube-scheduler calls, the
//! `kubectl-inspect-gpushare` tables, and the offline simulator.
//!
//! - [`objects`]: the parts of Pods and Nodes that are read;
//! - [`view`]: the cluster view, reconciled with what each daemon publishes (no I/O);
//! - [`service`]: the verbs, over the view and the [`service::Cluster`] seam;
//! - [`wire`]: kube-scheduler's extender JSON;
//! - [`server`]: the HTTP adapter; [`kube`]: the API server; [`config`]: the config file;
//! - [`confine`]: the unit's network confinement (`--unit-drop-in`);
//! - [`cli`]: the command lines of `gpushare-extender` and `kubectl-inspect-gpushare`;
//! - [`metrics`], [`inspect`], [`simulate`], [`memory`].

pub mod cli;
pub mod clock;
pub mod config;
pub mod confine;
pub mod inspect;
pub mod kube;
pub mod memory;
pub mod metrics;
pub mod objects;
pub mod server;
pub mod service;
pub mod simulate;
pub mod view;
pub mod wire;
