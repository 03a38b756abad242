//! The cluster in a box: stand-ins that speak the real protocols, for tests and the demo.
//!
//! - [`apiserver`]: the Kubernetes API server's HTTP/JSON for Pods and Nodes;
//! - [`containerd`]: containerd and runc as a real node's runtime;
//! - [`probe`]: what each container's process on containerd reported about itself;
//! - [`cri`]: a container runtime for the real kubelet that runs nothing and records what each container was given;
//! - [`call_timer`]: a relay that times each call kube-scheduler makes to an extender, by verb, the same way for every extender;
//! - [`cdi`]: the runtime's CDI: the devices the kubelet names, applied from the specs of one directory;
//! - [`cluster`]: the whole box as processes (API server, kubelets, daemons, extender, scheduler);
//! - [`invariants`]: design.md's invariants checked across the box from the outside;
//! - [`lag`]: a TCP relay that holds back a server's answers, for a daemon whose pod watch lags the kubelet's;
//! - [`kubelet`]: the kubelet's side of the device plugin API and its PodResources API, restarts included;
//! - [`notify`]: systemd's end of `sd_notify`, recording what a service notifies;
//! - [`nri`]: the container runtime's end of an NRI plugin's connection;
//! - [`node`]: the kubelet stand-in as a node: registers its Node, admits the pods bound to it, writes their status;
//! - [`ports`]: free TCP ports for the servers a test starts, outside the kernel's ephemeral range;
//! - [`peers`]: the peer systems (NVIDIA's device plugin) built from Go modules and run as a node of the real-cluster box;
//! - [`rng`]: a seeded xorshift for tie-breaks and fault choices;
//! - [`nvml`]: the fake NVML library, built from C, and its configuration;
//! - [`realbox`]: the real-cluster box: control plane, extender, kube-scheduler, and nodes of real kubelets and gpushared;
//! - [`realkube`]: the real etcd, kube-apiserver and kube-scheduler as processes;
//! - [`realkubelet`]: the real kubelet as a node, with [`cri`] as its container runtime;
//! - [`scheduler`]: the kube-scheduler stand-in.

pub mod apiserver;
pub mod call_timer;
pub mod cdi;
pub mod cluster;
pub mod containerd;
pub mod cpu;
pub mod cri;
pub mod invariants;
pub mod kubelet;
pub mod lag;
pub mod node;
pub mod notify;
pub mod nri;
pub mod null_dra;
pub mod null_plugin;
pub mod nvidia_dra;
pub mod nvml;
pub mod peers;
pub mod ports;
pub mod probe;
pub mod realbox;
pub mod realkube;
pub mod realkubelet;
pub mod recording_nri;
pub mod rng;
pub mod scheduler;

/// The folder `GPUSHARE_BOX_DIR` names for a box to keep its state, logs and records in, or
/// `None` where it is unset or empty (an empty value would put them in the test's working
/// directory, the source tree).
#[must_use]
pub fn box_dir() -> Option<std::path::PathBuf> {
    std::env::var_os("GPUSHARE_BOX_DIR").filter(|d| !d.is_empty()).map(std::path::PathBuf::from)
}

/// Skips a test whose prerequisite this machine lacks (`reason` says which), except under CI
/// (`CI` set, as `.ci/run` sets it), where it fails: there a skipped test would count as
/// passed without proving anything.
///
/// # Panics
/// Under CI, always.
pub fn skip_unless_ci(reason: &str) {
    assert!(std::env::var_os("CI").is_none(), "{reason}, and CI must run this test: see .ci/run");
    eprintln!("skipped: {reason}");
}
