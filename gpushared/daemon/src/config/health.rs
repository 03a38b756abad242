//! `[health]` and `[overuse]`: when a GPU's faults make it unhealthy and when it recovers, and
//! how the GPUs' processes are compared with their containers' budgets (and what is done to a
//! container over its budget).

use serde::Deserialize;

use super::{AbsPath, Seconds, abs, yes};

/// `[health]`: how GPU faults turn a GPU unhealthy, and how it recovers.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthConfig {
    /// Xid codes that are the application's fault, not the GPU's: ignored.
    #[serde(default = "default_ignored_xids")]
    pub ignored_xids: Vec<u64>,
    /// Seconds between probes of every GPU (a GPU that stops answering is unhealthy).
    #[serde(default = "default_probe_interval")]
    pub probe_interval_seconds: Seconds,
    /// An unhealthy GPU with no new fault for this long that answers a probe is healthy again;
    /// 0 turns automatic recovery off.
    #[serde(default = "default_recovery")]
    pub recovery_seconds: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            ignored_xids: default_ignored_xids(),
            probe_interval_seconds: default_probe_interval(),
            recovery_seconds: default_recovery(),
        }
    }
}

/// The application Xids NVIDIA's device plugin also ignores: 13 (graphics engine exception),
/// 31 (GPU memory page fault), 43 (GPU stopped processing), 45 (preemptive cleanup), 68
/// (video processor exception), 109 (context switch timeout).
pub const DEFAULT_IGNORED_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

fn default_ignored_xids() -> Vec<u64> {
    DEFAULT_IGNORED_XIDS.to_vec()
}

fn default_probe_interval() -> Seconds {
    Seconds(5)
}

fn default_recovery() -> u64 {
    300
}

/// What happens to a container over its budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OveruseAction {
    /// Log it, record it in the ledger history, publish it; nothing else.
    Warn,
    /// As `warn`, and evict the pod through the API once it has stayed over for
    /// `evict_after_seconds`.
    Evict,
}

/// `[overuse]`: how the GPUs' processes are compared with the containers' budgets.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OveruseConfig {
    /// Whether the processes are sampled at all (only with NVML).
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Seconds between samples.
    #[serde(default = "default_overuse_interval")]
    pub interval_seconds: Seconds,
    /// Memory a container may use above its budget before it counts as over.
    #[serde(default)]
    pub tolerance_mib: u64,
    /// `warn` or `evict`.
    #[serde(default = "default_overuse_action")]
    pub action: OveruseAction,
    /// With `action = "evict"`: how long a container stays over before its pod is evicted.
    #[serde(default = "default_evict_after")]
    pub evict_after_seconds: Seconds,
    /// Where the processes' cgroups are read (`<dir>/<pid>/cgroup`).
    #[serde(default = "default_proc_directory")]
    pub proc_directory: AbsPath,
}

impl Default for OveruseConfig {
    fn default() -> Self {
        OveruseConfig {
            enabled: true,
            interval_seconds: default_overuse_interval(),
            tolerance_mib: 0,
            action: default_overuse_action(),
            evict_after_seconds: default_evict_after(),
            proc_directory: default_proc_directory(),
        }
    }
}

fn default_overuse_interval() -> Seconds {
    Seconds(10)
}

fn default_overuse_action() -> OveruseAction {
    OveruseAction::Warn
}

fn default_evict_after() -> Seconds {
    Seconds(60)
}

fn default_proc_directory() -> AbsPath {
    abs("/proc")
}
