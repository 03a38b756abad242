//! The daemon's configuration file (`/etc/gpushare/gpushared.toml` by default), every key
//! documented in `docs/gpushared.md`. Unknown keys and bad values are refused with the file,
//! the line and what to write instead; a missing file means all defaults.
//!
//! Sections with rules of their own have a file each: `sharing` (`[sharing]`, `[mps]`), `health`
//! (`[health]`, `[overuse]`), `dra` (`[dra]`) and `nri` (`[nri]`).

use std::path::{Path, PathBuf};

pub use gpushare_core::request::Compatibility;
use gpushare_core::request::{ResourceName, ResourceNames};
use gpushare_core::resources::Resources;
use gpushare_core::{Gpu, GpuUuid, MemoryUnit, Mib};
use serde::Deserialize;
use thiserror::Error;

/// Where the daemon looks when `--config` is not given.
pub const DEFAULT_PATH: &str = "/etc/gpushare/gpushared.toml";

/// A configuration that cannot be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file exists but cannot be read.
    #[error("{path}: cannot read: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML of the documented shape; the message carries the line.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What the parser or validator said, with the line.
        message: String,
    },
}

/// An absolute path (relative paths would depend on the daemon's working directory).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbsPath(PathBuf);

impl AbsPath {
    /// The path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl<'de> Deserialize<'de> for AbsPath {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let p = PathBuf::deserialize(d)?;
        if p.is_absolute() {
            Ok(AbsPath(p))
        } else {
            Err(serde::de::Error::custom(format!(
                "{:?} is relative; write an absolute path such as \"/{}\"",
                p,
                p.display()
            )))
        }
    }
}

fn abs(p: &str) -> AbsPath {
    AbsPath(PathBuf::from(p))
}

/// A file name inside a directory (no `/`), such as the plugin's socket name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileName(String);

impl FileName {
    /// The name.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for FileName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.is_empty() || s.contains('/') || s == "." || s == ".." || s == "kubelet.sock" {
            Err(serde::de::Error::custom(format!(
                "{s:?} is not a usable socket file name; write a plain name such as \"gpushared.sock\""
            )))
        } else {
            Ok(FileName(s))
        }
    }
}

/// The whole configuration.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// This node's name in Kubernetes; default: `$NODE_NAME`, else the host name.
    #[serde(default)]
    pub node_name: Option<String>,
    /// Where the kubelet is.
    #[serde(default)]
    pub kubelet: KubeletConfig,
    /// How to reach the API server.
    #[serde(default)]
    pub kubernetes: KubernetesConfig,
    /// The allocation ledger.
    #[serde(default)]
    pub ledger: LedgerConfig,
    /// Resource names, unit and compatibility.
    #[serde(default)]
    pub resources: ResourcesConfig,
    /// GPU discovery through NVML.
    #[serde(default)]
    pub nvml: NvmlConfig,
    /// A static GPU list for hosts without NVML; when present, NVML is not used.
    #[serde(default)]
    pub gpus: Vec<StaticGpu>,
    /// Reconciliation with the kubelet.
    #[serde(default)]
    pub reconcile: ReconcileConfig,
    /// GPU health.
    #[serde(default)]
    pub health: HealthConfig,
    /// The local status API.
    #[serde(default)]
    pub dbus: DbusConfig,
    /// How each GPU is shared.
    #[serde(default)]
    pub sharing: SharingConfig,
    /// CUDA MPS, for the GPUs `[sharing] mps` names.
    #[serde(default)]
    pub mps: MpsConfig,
    /// Over-use detection: containers whose processes use more GPU memory than their budget.
    #[serde(default)]
    pub overuse: OveruseConfig,
    /// The DRA driver, for the GPUs `[sharing] dra` names (docs/dra.md).
    #[serde(default)]
    pub dra: DraConfig,
    /// The NVIDIA device nodes gpushared names to the runtime itself, if any.
    #[serde(default)]
    pub device_nodes: DeviceNodesConfig,
    /// gpushared as an NRI plugin of the container runtime.
    #[serde(default)]
    pub nri: NriConfig,
}

/// `[dbus]`: the local status API.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DbusConfig {
    /// Serve the status API at all.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// `system` for the system bus, or a D-Bus address such as `unix:path=/run/x/bus`.
    #[serde(default = "default_bus")]
    pub address: String,
}

impl Default for DbusConfig {
    fn default() -> Self {
        DbusConfig { enabled: true, address: default_bus() }
    }
}

fn default_bus() -> String {
    "system".to_owned()
}

/// Which bus to serve the status API on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bus {
    /// The system bus.
    System,
    /// A bus at this address (`unix:path=...`).
    Address(String),
}

impl DbusConfig {
    /// The bus to serve on.
    #[must_use]
    pub fn bus(&self) -> Bus {
        if self.address == "system" { Bus::System } else { Bus::Address(self.address.clone()) }
    }
}

/// `[kubelet]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubeletConfig {
    /// The kubelet's device-plugin directory (holds `kubelet.sock`).
    #[serde(default = "default_device_plugin_dir")]
    pub device_plugin_dir: AbsPath,
    /// The plugin's socket file name in that directory.
    #[serde(default = "default_socket_name")]
    pub socket_name: FileName,
    /// The kubelet's PodResources API socket.
    #[serde(default = "default_pod_resources_socket")]
    pub pod_resources_socket: AbsPath,
    /// Which variables the device plugin's `Allocate` answers carry.
    #[serde(default)]
    pub environment: ContainerEnvironment,
    /// How the node's GPU memory reaches the kubelet: a device per unit, or a count.
    #[serde(default)]
    pub advertise: Advertise,
}

impl Default for KubeletConfig {
    fn default() -> Self {
        KubeletConfig {
            device_plugin_dir: default_device_plugin_dir(),
            socket_name: default_socket_name(),
            pod_resources_socket: default_pod_resources_socket(),
            environment: ContainerEnvironment::default(),
            advertise: Advertise::default(),
        }
    }
}

/// `[kubelet] advertise`: how the node's GPU memory reaches the kubelet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Advertise {
    /// The device plugin registers one device per unit; the kubelet calls `Allocate`.
    #[default]
    Devices,
    /// The node's status carries the units as a count (patched through the API server); no
    /// device plugin serves them, the kubelet admits a pod by the count alone, and each
    /// container gets its GPU at its creation, through the runtime's NRI (`[nri]`).
    Capacity,
}

/// `[kubelet] environment`: which variables the device plugin's `Allocate` answers carry. The
/// kubelet keeps every answer in its device checkpoint and rewrites and hashes the whole file
/// at each admission, so the answer's size is paid again for every pod already on the node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContainerEnvironment {
    /// Every variable of docs/gpushared.md's table.
    #[default]
    Full,
    /// What places and bounds the container: `NVIDIA_VISIBLE_DEVICES`,
    /// `CUDA_DEVICE_MEMORY_LIMIT_<i>`, `GPUSHARE_POD`, `GPUSHARE_CONTAINER`, the MPS client's
    /// variables and, under compatibility `alibaba`, Alibaba's; not the informational
    /// `GPUSHARE_GPU_*`, `GPUSHARE_MEMORY_*` and `GPUSHARE_UNIT`.
    Lean,
}

fn default_pod_resources_socket() -> AbsPath {
    abs("/var/lib/kubelet/pod-resources/kubelet.sock")
}

/// `[reconcile]`: the ledger against the kubelet's PodResources record.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconcileConfig {
    /// Seconds between reconciliations (one also follows every kubelet (re)registration).
    #[serde(default = "default_reconcile_interval")]
    pub interval_seconds: Seconds,
    /// Rows younger than this are never released by a reconciliation (the kubelet records an
    /// allocation only after `Allocate` returned).
    #[serde(default = "default_reconcile_grace")]
    pub grace_seconds: Seconds,
}

impl Default for ReconcileConfig {
    fn default() -> Self {
        ReconcileConfig { interval_seconds: default_reconcile_interval(), grace_seconds: default_reconcile_grace() }
    }
}

fn default_reconcile_interval() -> Seconds {
    Seconds(60)
}

fn default_reconcile_grace() -> Seconds {
    Seconds(30)
}

/// A whole number of seconds, at least 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seconds(u64);

impl Seconds {
    /// The duration.
    #[must_use]
    pub fn duration(self) -> std::time::Duration {
        std::time::Duration::from_secs(self.0)
    }
}

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u64::deserialize(d)?;
        if n == 0 {
            Err(serde::de::Error::custom("0 seconds is not allowed; write at least 1"))
        } else {
            Ok(Seconds(n))
        }
    }
}

fn default_device_plugin_dir() -> AbsPath {
    abs("/var/lib/kubelet/device-plugins")
}

fn default_socket_name() -> FileName {
    FileName("gpushared.sock".to_owned())
}

/// `[kubernetes]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// The kubeconfig the daemon uses; by default the kubelet's own, so the Node authorizer
    /// lets it read the pods bound to this node and patch this Node.
    #[serde(default = "default_kubeconfig")]
    pub kubeconfig: AbsPath,
    /// How often the daemon renews its `gpushare.io/heartbeat` on the Node; the extender stops
    /// placing pods by a node's published state after three periods without a renewal.
    #[serde(default = "default_heartbeat")]
    pub heartbeat_seconds: Seconds,
    /// Confine `gpushared.service` to the API server the kubeconfig names: the package's
    /// systemd generator writes `IPAddressDeny=any` with `IPAddressAllow=` that address
    /// ([`crate::cluster::confine`]). The server must be named by an address (or `localhost`);
    /// the daemon refuses to start otherwise.
    #[serde(default)]
    pub confine_network: bool,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        KubernetesConfig {
            kubeconfig: default_kubeconfig(),
            heartbeat_seconds: default_heartbeat(),
            confine_network: false,
        }
    }
}

fn default_heartbeat() -> Seconds {
    Seconds(20)
}

fn default_kubeconfig() -> AbsPath {
    abs("/etc/kubernetes/kubelet.conf")
}

/// `[ledger]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LedgerConfig {
    /// The SQLite file.
    #[serde(default = "default_ledger")]
    pub path: AbsPath,
    /// History older than this many days (events, released allocations and claims) is
    /// deleted; 0 keeps it.
    #[serde(default = "default_history_days")]
    pub history_days: u32,
    /// At most this many events, and released rows of each table, are kept; 0 keeps all.
    #[serde(default = "default_history_max_rows")]
    pub history_max_rows: u64,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        LedgerConfig {
            path: default_ledger(),
            history_days: default_history_days(),
            history_max_rows: default_history_max_rows(),
        }
    }
}

fn default_history_days() -> u32 {
    90
}

fn default_history_max_rows() -> u64 {
    200_000
}

impl LedgerConfig {
    /// How much history the ledger keeps.
    #[must_use]
    pub fn retention(&self) -> crate::allocation::ledger::Retention {
        crate::allocation::ledger::Retention { days: self.history_days, max_rows: self.history_max_rows }
    }
}

fn default_ledger() -> AbsPath {
    abs("/var/lib/gpushare/ledger.db")
}

/// `[resources]`: the keys both binaries read ([`Resources`], flattened here by hand: serde
/// cannot deny unknown keys through `flatten`), and the daemon's own two.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourcesConfig {
    /// The cluster unit, `MiB` or `GiB`; must be the same on every node and the extender.
    #[serde(default)]
    pub unit: MemoryUnit,
    /// `gpushare` or `alibaba`.
    #[serde(default)]
    pub compatibility: Compatibility,
    /// Overrides the memory resource name.
    #[serde(default)]
    pub memory: Option<ResourceName>,
    /// Overrides the GPU-count resource name.
    #[serde(default)]
    pub count: Option<ResourceName>,
    /// The resource whole GPUs (`[sharing] whole`) are handed out as, one device per GPU.
    #[serde(default = "default_whole_resource")]
    pub whole: ResourceName,
    /// Publish each GPU's NUMA node to the kubelet (topology hints); costs 4–6 bytes per device
    /// in the kubelet's 4 MiB device list.
    #[serde(default = "yes")]
    pub numa_topology: bool,
}

fn yes() -> bool {
    true
}

fn default_whole_resource() -> ResourceName {
    ResourceName::gpushare_whole()
}

impl Default for ResourcesConfig {
    fn default() -> Self {
        ResourcesConfig {
            unit: MemoryUnit::default(),
            compatibility: Compatibility::default(),
            memory: None,
            count: None,
            whole: default_whole_resource(),
            numa_topology: true,
        }
    }
}

impl ResourcesConfig {
    /// The keys both binaries read, for the core's rule.
    #[must_use]
    pub fn shared(&self) -> Resources {
        Resources {
            unit: self.unit,
            compatibility: self.compatibility,
            memory: self.memory.clone(),
            count: self.count.clone(),
        }
    }

    /// The resource names in force.
    #[must_use]
    pub fn names(&self) -> ResourceNames {
        self.shared().names()
    }
}

/// `[nvml]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmlConfig {
    /// The NVML library, a path or a name the dynamic loader resolves.
    #[serde(default = "default_nvml")]
    pub library: PathBuf,
}

impl Default for NvmlConfig {
    fn default() -> Self {
        NvmlConfig { library: default_nvml() }
    }
}

fn default_nvml() -> PathBuf {
    PathBuf::from("libnvidia-ml.so.1")
}

/// `[[gpus]]`: one GPU of a host without NVML.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticGpu {
    /// NVML-style index; unique.
    pub index: u32,
    /// UUID; unique.
    pub uuid: GpuUuid,
    /// Product name.
    pub model: String,
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// `/dev/nvidiaN` minor number.
    #[serde(default)]
    pub minor: Option<u32>,
    /// NUMA node.
    #[serde(default)]
    pub numa_node: Option<u32>,
}

impl StaticGpu {
    /// The GPU as the core sees it.
    #[must_use]
    pub fn to_gpu(&self) -> Gpu {
        let mut g = Gpu::new(self.index, self.uuid.clone(), self.model.clone(), Mib::new(self.memory_mib));
        g.minor = self.minor;
        g.numa_node = self.numa_node;
        g
    }
}

impl Config {
    /// Parses and validates configuration text; `path` only labels errors.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] with the line and the fix.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid { path: path.to_owned(), message };
        let config: Config = toml::from_str(text).map_err(|e| invalid(e.to_string().trim_end().to_owned()))?;
        if let Some(name) = &config.node_name
            && !is_dns_subdomain(name)
        {
            return Err(invalid(format!(
                "node_name {name:?} is not a Kubernetes node name; write the name `kubectl get nodes` shows"
            )));
        }
        for (i, g) in config.gpus.iter().enumerate() {
            if g.memory_mib == 0 {
                return Err(invalid(format!("gpus[{i}] (index {}): memory_mib must be above 0", g.index)));
            }
        }
        let mut indices: Vec<u32> = config.gpus.iter().map(|g| g.index).collect();
        indices.sort_unstable();
        if let Some(w) = indices.windows(2).find(|w| w[0] == w[1]) {
            return Err(invalid(format!("gpus: index {} appears twice; give each GPU its own index", w[0])));
        }
        let mut uuids: Vec<&GpuUuid> = config.gpus.iter().map(|g| &g.uuid).collect();
        uuids.sort();
        if let Some(w) = uuids.windows(2).find(|w| w[0] == w[1]) {
            return Err(invalid(format!("gpus: uuid {} appears twice; each GPU has its own UUID", w[0])));
        }
        if config.dbus.address != "system" && !config.dbus.address.contains(':') {
            return Err(invalid(format!(
                "dbus: address {:?} is not a D-Bus address; write \"system\" or an address such as \"unix:path=/run/gpushare/bus\"",
                config.dbus.address
            )));
        }
        let shared = config.resources.shared();
        shared.check().map_err(|e| invalid(e.to_string()))?;
        shared.check_whole(&config.resources.whole).map_err(|e| invalid(e.to_string()))?;
        config.dra.check().map_err(invalid)?;
        config.check_capacity().map_err(invalid)?;
        Ok(config)
    }

    /// `[kubelet] advertise = "capacity"` delivers each container's GPU through the runtime's
    /// NRI alone (its variables, `[device_nodes]`, the MPS pipe directory): NRI must be on.
    fn check_capacity(&self) -> Result<(), String> {
        if self.kubelet.advertise == Advertise::Capacity && !self.nri.enabled {
            return Err("kubelet: advertise = \"capacity\" needs [nri] enabled = true (each container gets its GPU \
                        when the runtime creates it); enable NRI or write advertise = \"devices\""
                .to_owned());
        }
        Ok(())
    }

    /// Reads `path`; a missing file at the default location means all defaults.
    ///
    /// # Errors
    /// [`ConfigError`] if the file cannot be read or is invalid.
    pub fn load(path: &Path, must_exist: bool) -> Result<Config, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Config::parse(&text, path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !must_exist => Config::parse("", path),
            Err(source) => Err(ConfigError::Read { path: path.to_owned(), source }),
        }
    }

    /// The node name in force: the config, else `$NODE_NAME`, else the host name.
    #[must_use]
    pub fn node_name(&self) -> Option<String> {
        self.node_name
            .clone()
            .or_else(|| std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty()))
            .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_lowercase()))
            .filter(|n| is_dns_subdomain(n))
    }

    /// The plugin socket's full path.
    #[must_use]
    pub fn socket_path(&self) -> PathBuf {
        self.kubelet.device_plugin_dir.path().join(self.kubelet.socket_name.as_str())
    }

    /// The kubelet's registration socket.
    #[must_use]
    pub fn kubelet_socket(&self) -> PathBuf {
        self.kubelet.device_plugin_dir.path().join("kubelet.sock")
    }
}

mod devices;
mod dra;
mod health;
mod nri;
mod sharing;
pub use devices::{DeviceNode, DeviceNodesConfig};
pub use dra::DraConfig;
pub use health::{DEFAULT_IGNORED_XIDS, HealthConfig, OveruseAction, OveruseConfig};
pub use nri::NriConfig;
pub use sharing::{GpuRef, MpsConfig, SharingConfig, ThreadShare};

fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse(text, Path::new("/etc/gpushare/gpushared.toml")).map_err(|e| e.to_string())
    }

    #[test]
    fn sharing_and_mps_read_gpus_by_index_or_uuid_and_check_the_thread_share() {
        let c = parse("[sharing]\nmps = [1, \"GPU-b\"]\n[mps]\nactive_thread_percentage = 50\n").unwrap();
        assert_eq!(c.sharing.mps, [GpuRef::Index(1), GpuRef::Uuid("GPU-b".into())]);
        assert_eq!(c.mps.active_thread_percentage, ThreadShare::Fixed(50));
        assert_eq!(c.mps.pipe_directory.path(), Path::new("/run/nvidia-mps"));
        assert!(c.mps.pipe_directory_read_only);
        let d = parse("").unwrap();
        assert!(d.sharing.mps.is_empty());
        assert_eq!(d.mps.active_thread_percentage, ThreadShare::Proportional);
        for bad in ["0", "101", "\"half\"", "-5"] {
            let err = parse(&format!("[mps]\nactive_thread_percentage = {bad}\n")).unwrap_err();
            assert!(err.contains("a percentage from 1 to 100"), "{bad}: {err}");
        }
        assert!(parse("[sharing]\nexclusive = [0]\n").unwrap_err().contains("exclusive"));
        // Proportional: the budget's share of the GPU, rounded up, 1 to 100.
        let p = ThreadShare::Proportional;
        assert_eq!(p.percentage(Mib::new(4096), Mib::new(16384)), 25);
        assert_eq!(p.percentage(Mib::new(1), Mib::new(16384)), 1);
        assert_eq!(p.percentage(Mib::new(16384), Mib::new(16384)), 100);
        assert_eq!(ThreadShare::Fixed(40).percentage(Mib::new(1), Mib::new(2)), 40);
    }

    #[test]
    fn sharing_sets_each_gpus_mode_and_refuses_a_gpu_the_host_lacks() {
        let mut gpus: Vec<Gpu> =
            (0..3).map(|i| Gpu::new(i, GpuUuid::new(format!("GPU-{i}")).unwrap(), "T4", Mib::new(1000))).collect();
        let sharing =
            SharingConfig { mps: vec![GpuRef::Index(2), GpuRef::Uuid("GPU-0".into())], whole: vec![], dra: vec![] };
        sharing.apply(&mut gpus, &[]).unwrap();
        let modes: Vec<&str> = gpus.iter().map(|g| g.mode.as_str()).collect();
        assert_eq!(modes, ["mps", "shared", "mps"]);
        let sharing =
            SharingConfig { mps: vec![GpuRef::Index(2)], whole: vec![GpuRef::Uuid("GPU-1".into())], dra: vec![] };
        sharing.apply(&mut gpus, &[]).unwrap();
        let modes: Vec<&str> = gpus.iter().map(|g| g.mode.as_str()).collect();
        assert_eq!(modes, ["shared", "whole", "mps"]);
        let err = SharingConfig { mps: vec![GpuRef::Index(7)], whole: vec![], dra: vec![] }
            .apply(&mut gpus, &[])
            .unwrap_err();
        assert!(
            err.contains("names GPU 7, which this host does not have; its GPUs are 0 (GPU-0), 1 (GPU-1), 2 (GPU-2)"),
            "{err}"
        );
        let err = SharingConfig { mps: vec![], whole: vec![GpuRef::Index(9)], dra: vec![] }
            .apply(&mut gpus, &[])
            .unwrap_err();
        assert!(err.starts_with("[sharing] whole names GPU 9"), "{err}");
        let both = SharingConfig { mps: vec![GpuRef::Index(1)], whole: vec![GpuRef::Index(1)], dra: vec![] };
        assert!(both.apply(&mut gpus, &[]).unwrap_err().contains("in mps and whole; a GPU is served one way"));
        let sharing = SharingConfig { mps: vec![], whole: vec![], dra: vec![GpuRef::Index(0), GpuRef::Index(2)] };
        sharing.apply(&mut gpus, &[]).unwrap();
        let modes: Vec<&str> = gpus.iter().map(|g| g.mode.as_str()).collect();
        assert_eq!(modes, ["dra", "shared", "dra"]);
        let twice = SharingConfig { mps: vec![], whole: vec![GpuRef::Index(2)], dra: vec![GpuRef::Index(2)] };
        assert!(twice.apply(&mut gpus, &[]).unwrap_err().contains("in whole and dra"));
        let both = SharingConfig { mps: vec![GpuRef::Index(1)], whole: vec![], dra: vec![GpuRef::Index(1)] };
        both.apply(&mut gpus, &[]).unwrap();
        assert_eq!(gpus[1].mode.as_str(), "dra-mps");
        // GPU 7 does not answer (its identity unknown): naming it, or a UUID no GPU answers
        // with, is a note, not a refusal; another missing index is still refused.
        let sharing =
            SharingConfig { mps: vec![GpuRef::Index(7), GpuRef::Uuid("GPU-x".into())], whole: vec![], dra: vec![] };
        let notes = sharing.apply(&mut gpus, &[7]).unwrap();
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes[0].contains("names GPU 7, which is not among the GPUs that answer"), "{notes:?}");
        assert!(
            SharingConfig { mps: vec![GpuRef::Index(8)], whole: vec![], dra: vec![] }.apply(&mut gpus, &[7]).is_err()
        );
    }

    #[test]
    fn advertising_a_count_needs_nri_and_takes_device_nodes_and_mps() {
        assert_eq!(parse("").unwrap().kubelet.advertise, Advertise::Devices);
        let counted = "[kubelet]\nadvertise = \"capacity\"\n[nri]\nenabled = true\n";
        assert_eq!(parse(counted).unwrap().kubelet.advertise, Advertise::Capacity);
        let err = parse("[kubelet]\nadvertise = \"capacity\"\n").unwrap_err();
        assert!(err.contains("needs [nri] enabled = true"), "{err}");
        // NRI delivers the device nodes and the MPS pipe directory too.
        let full = parse(&format!("{counted}[device_nodes]\nenabled = true\n[sharing]\nmps = [0]\n")).unwrap();
        assert!(full.device_nodes.enabled && full.kubelet.advertise == Advertise::Capacity);
        let err = parse("[kubelet]\nadvertise = \"count\"\n").unwrap_err();
        assert!(err.contains("devices") && err.contains("capacity"), "{err}");
    }

    #[test]
    fn the_shipped_file_is_the_defaults() {
        // etc/gpushared.toml is installed as the package's conffile: every key it sets must be
        // the documented default, so installing it changes nothing.
        let shipped = parse(include_str!("../../../etc/gpushared.toml")).unwrap();
        assert_eq!(format!("{shipped:?}"), format!("{:?}", parse("").unwrap()));
    }

    #[test]
    fn an_empty_file_means_the_documented_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.socket_path(), Path::new("/var/lib/kubelet/device-plugins/gpushared.sock"));
        assert_eq!(c.kubelet_socket(), Path::new("/var/lib/kubelet/device-plugins/kubelet.sock"));
        assert_eq!(c.kubernetes.kubeconfig.path(), Path::new("/etc/kubernetes/kubelet.conf"));
        assert_eq!(c.ledger.path.path(), Path::new("/var/lib/gpushare/ledger.db"));
        assert_eq!(c.nvml.library, Path::new("libnvidia-ml.so.1"));
        assert_eq!(c.resources.unit, MemoryUnit::Mib);
        assert_eq!(c.resources.names(), ResourceNames::gpushare());
        assert_eq!(c.resources.whole.as_str(), "gpushare.io/gpu");
        assert!(c.resources.numa_topology);
        assert!(c.gpus.is_empty());
        assert_eq!(c.kubelet.pod_resources_socket.path(), Path::new("/var/lib/kubelet/pod-resources/kubelet.sock"));
        assert_eq!(c.kubelet.environment, ContainerEnvironment::Full);
        assert!(!c.nri.enabled);
        assert_eq!((c.nri.socket.path(), c.nri.index.as_str()), (Path::new("/var/run/nri/nri.sock"), "50"));
        assert_eq!(c.reconcile.interval_seconds.duration().as_secs(), 60);
        assert_eq!(c.reconcile.grace_seconds.duration().as_secs(), 30);
        assert_eq!(c.health.ignored_xids, vec![13, 31, 43, 45, 68, 109]);
        assert_eq!(c.health.probe_interval_seconds.duration().as_secs(), 5);
        assert_eq!(c.health.recovery_seconds, 300);
        assert!(c.dbus.enabled);
        assert_eq!(c.dbus.bus(), Bus::System);
        assert!(c.overuse.enabled);
        assert_eq!(c.overuse.interval_seconds.duration().as_secs(), 10);
        assert_eq!(c.overuse.tolerance_mib, 0);
        assert_eq!(c.overuse.action, OveruseAction::Warn);
        assert_eq!(c.overuse.evict_after_seconds.duration().as_secs(), 60);
        assert_eq!(c.overuse.proc_directory.path(), Path::new("/proc"));
        assert_eq!(c.ledger.retention(), crate::allocation::ledger::Retention { days: 90, max_rows: 200_000 });
    }

    #[test]
    fn every_key_can_be_set() {
        let c = parse(
            r#"
node_name = "gpu-node-a"
[kubelet]
device_plugin_dir = "/tmp/dp"
socket_name = "x.sock"
pod_resources_socket = "/tmp/pr/kubelet.sock"
environment = "lean"
[reconcile]
interval_seconds = 5
grace_seconds = 2
[health]
ignored_xids = [13]
probe_interval_seconds = 1
recovery_seconds = 0
[kubernetes]
kubeconfig = "/tmp/kubeconfig"
[ledger]
path = "/tmp/ledger.db"
history_days = 30
history_max_rows = 1000
[resources]
unit = "GiB"
compatibility = "alibaba"
count = "example.com/gpus"
whole = "example.com/whole-gpu"
numa_topology = false
[nvml]
library = "/opt/nvidia/libnvidia-ml.so.1"
[overuse]
enabled = false
interval_seconds = 3
tolerance_mib = 512
action = "evict"
evict_after_seconds = 120
proc_directory = "/host/proc"
[[gpus]]
index = 0
uuid = "GPU-0"
model = "Tesla T4"
memory_mib = 15360
minor = 0
numa_node = 1
"#,
        )
        .unwrap();
        assert_eq!(c.node_name.as_deref(), Some("gpu-node-a"));
        assert_eq!(c.ledger.retention(), crate::allocation::ledger::Retention { days: 30, max_rows: 1000 });
        assert_eq!(c.socket_path(), Path::new("/tmp/dp/x.sock"));
        assert_eq!(c.resources.names().memory.as_str(), "aliyun.com/gpu-mem");
        assert_eq!(c.resources.names().count.as_str(), "example.com/gpus");
        assert_eq!(c.resources.whole.as_str(), "example.com/whole-gpu");
        assert_eq!(c.gpus[0].to_gpu().numa_node, Some(1));
        assert_eq!(c.kubelet.pod_resources_socket.path(), Path::new("/tmp/pr/kubelet.sock"));
        assert_eq!(c.kubelet.environment, ContainerEnvironment::Lean);
        assert_eq!(c.reconcile.interval_seconds.duration().as_secs(), 5);
        assert_eq!(c.health.ignored_xids, vec![13]);
        assert_eq!(c.health.recovery_seconds, 0);
        assert!(!c.overuse.enabled);
        assert_eq!(c.overuse.interval_seconds.duration().as_secs(), 3);
        assert_eq!(c.overuse.tolerance_mib, 512);
        assert_eq!(c.overuse.action, OveruseAction::Evict);
        assert_eq!(c.overuse.evict_after_seconds.duration().as_secs(), 120);
        assert_eq!(c.overuse.proc_directory.path(), Path::new("/host/proc"));
    }

    #[test]
    fn mistakes_name_the_file_the_line_and_the_fix() {
        let cases: &[(&str, &[&str])] = &[
            ("nodename = \"a\"", &["line 1", "unknown field `nodename`", "node_name"]),
            ("[kubelet]\ndevice_plugin_dir = \"var/lib\"", &["line 2", "is relative; write an absolute path"]),
            ("[kubelet]\nsocket_name = \"a/b.sock\"", &["line 2", "plain name such as \"gpushared.sock\""]),
            ("[kubelet]\nsocket_name = \"kubelet.sock\"", &["line 2", "not a usable socket file name"]),
            ("[resources]\nunit = \"KiB\"", &["line 2", "unknown variant `KiB`", "`MiB`"]),
            ("[kubelet]\nenvironment = \"minimal\"", &["line 2", "unknown variant `minimal`", "`full`", "`lean`"]),
            ("[nri]\nindex = \"5\"", &["line 2", "\"5\" is not two digits", "\"50\""]),
            ("[nri]\nsocket = \"nri.sock\"", &["line 2", "is relative"]),
            ("[nri]\nenable = true", &["line 2", "unknown field `enable`", "enabled"]),
            ("[resources]\ncompatibility = \"nvidia\"", &["line 2", "`gpushare`", "`alibaba`"]),
            ("[resources]\nmemory = \"gpu-mem\"", &["line 2", "no domain prefix"]),
            ("[resources]\nnuma_topology = \"yes\"", &["line 2", "expected a boolean"]),
            ("[[gpus]]\nindex = 0\nuuid = \"a b\"\nmodel = \"m\"\nmemory_mib = 1", &["line 3", "invalid GPU UUID"]),
            ("[[gpus]]\nindex = 0\nuuid = \"a\"\nmodel = \"m\"\nmemory_mib = 0", &["memory_mib must be above 0"]),
            ("[[gpus]]\nindex = 0\nuuid = \"a\"\nmodel = \"m\"", &["missing field `memory_mib`"]),
            (
                "[[gpus]]\nindex = 0\nuuid = \"a\"\nmodel = \"m\"\nmemory_mib = 1\n[[gpus]]\nindex = 0\nuuid = \"b\"\nmodel = \"m\"\nmemory_mib = 1",
                &["index 0 appears twice"],
            ),
            ("node_name = \"Node_A\"", &["not a Kubernetes node name"]),
            ("[resources]\ncount = \"gpushare.io/gpu-mem\"", &["must be two different resources"]),
            (
                "[resources]\nwhole = \"gpushare.io/gpu-mem\"",
                &["whole is \"gpushare.io/gpu-mem\"", "with their own resource"],
            ),
            ("[sharing]\nwhole = [\"x\", \"y\", true]", &["line 2"]),
            ("[ledger", &["line 1"]),
            ("[reconcile]\ninterval_seconds = 0", &["line 2", "write at least 1"]),
            ("[dbus]\naddress = \"session\"", &["not a D-Bus address", "unix:path="]),
            ("[health]\nignored_xids = [-1]", &["line 2"]),
            ("[overuse]\naction = \"kill\"", &["line 2", "unknown variant `kill`", "`warn`", "`evict`"]),
            ("[overuse]\nevict_after_seconds = 0", &["line 2", "write at least 1"]),
            ("[overuse]\nproc_directory = \"proc\"", &["line 2", "is relative"]),
            ("[health]\nprobe_interval = 3", &["line 2", "unknown field `probe_interval`", "probe_interval_seconds"]),
        ];
        for (text, wants) in cases {
            let err = parse(text).unwrap_err();
            assert!(err.starts_with("/etc/gpushare/gpushared.toml: "), "{err}");
            for want in *wants {
                assert!(err.contains(want), "{text:?}: missing {want:?} in {err}");
            }
        }
    }

    #[test]
    fn a_missing_file_is_all_defaults_only_where_allowed() {
        let nowhere = Path::new("/nonexistent/gpushared.toml");
        assert!(Config::load(nowhere, false).is_ok());
        let err = Config::load(nowhere, true).unwrap_err().to_string();
        assert!(err.starts_with("/nonexistent/gpushared.toml: cannot read"), "{err}");
    }
}
