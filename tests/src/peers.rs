//! The peer systems run beside gpushare on the real-cluster box (docs/comparison.md), unmodified,
//! on the same fake NVML library and under the same real kubelet: NVIDIA's k8s-device-plugin,
//! built by `tests/peers/build` from the Go modules pinned in `tests/peers/go.mod` into a cache
//! outside `target/` (`GPUSHARE_PEERS_BIN` names a directory that has the binaries instead); and,
//! where `GPUSHARE_PEERS_SRC` names their checkouts, Alibaba's gpushare-scheduler-extender,
//! gpushare-device-plugin and kubectl-inspect-gpushare, built by the same script from source.
//!
//! Both device plugins serve their sockets in `/var/lib/kubelet/device-plugins/` (the kubelet's
//! `DevicePluginPath`; NVIDIA's whatever its flags say, Alibaba's has no flag for it), so each
//! runs in a mount namespace of its own with the node's device-plugin directory bind-mounted
//! there, as the node's kubelet does ([`crate::realkubelet`]).

use std::path::{Path, PathBuf};

use anyhow::Context as _;

use crate::cluster::Proc;
use crate::nvml::{self, FakeGpu};
use crate::realbox::{RealCluster, RealNode};
use crate::realkubelet::{DEFAULT_GATES, KubeletDirs, RealKubelet, with_device_plugin_dir};

/// NVIDIA's resource name for a GPU (or a time-slicing replica of one).
pub const NVIDIA_GPU: &str = "nvidia.com/gpu";

/// The directory of the peers' binaries: `$GPUSHARE_PEERS_BIN`, or what `tests/peers/build`
/// builds (or finds in its cache).
///
/// # Errors
/// If Go or a C compiler is missing, or the build fails, with its output.
pub fn binaries() -> anyhow::Result<PathBuf> {
    crate::realkube::built_by("GPUSHARE_PEERS_BIN", &Path::new(env!("CARGO_MANIFEST_DIR")).join("peers").join("build"))
}

/// How NVIDIA's device plugin shares a GPU: time-slicing, each GPU advertised `replicas` times
/// (1: no sharing).
#[derive(Clone, Copy, Debug)]
pub struct NvidiaSharing {
    /// Replicas per GPU.
    pub replicas: u32,
}

/// The plugin's configuration file (its `--config-file`): device IDs by UUID, environment
/// variables as the device list, time-slicing with `sharing.replicas` replicas per GPU.
#[must_use]
pub fn nvidia_config(sharing: NvidiaSharing) -> String {
    let mut text = String::from(
        "version: v1\nflags:\n  migStrategy: none\n  failOnInitError: true\n  plugin:\n    passDeviceSpecs: false\n    \
         deviceListStrategy: [envvar]\n    deviceIDStrategy: uuid\n",
    );
    if sharing.replicas > 1 {
        text.push_str(&format!(
            "sharing:\n  timeSlicing:\n    resources:\n    - name: {NVIDIA_GPU}\n      replicas: {}\n",
            sharing.replicas
        ));
    }
    text
}

/// Starts NVIDIA's device plugin for the kubelet whose device plugins live in `plugin_dir`, on
/// `gpus` of the fake NVML library (`nvml_extra`: further directives, such as the event file),
/// its files under `host`.
///
/// # Errors
/// If the peer cannot be built, the library cannot be built, a file cannot be written, or it
/// cannot be started.
pub fn start_nvidia_device_plugin(
    plane: &crate::realkube::ControlPlane,
    node: &str,
    host: &Path,
    plugin_dir: &Path,
    gpus: &[FakeGpu],
    (nvml_extra, sharing): (&str, NvidiaSharing),
) -> anyhow::Result<Proc> {
    let bin = binaries()?;
    let env = on_fake_nvml(host, gpus, nvml_extra)?;
    let config = host.join("nvidia-device-plugin.yaml");
    std::fs::write(&config, nvidia_config(sharing)).with_context(|| format!("writing {}", config.display()))?;
    let (program, args) = with_device_plugin_dir(
        plugin_dir,
        &bin.join("nvidia-device-plugin"),
        vec![format!("--config-file={}", config.display())],
    );
    plane.spawn(&format!("nvidia-device-plugin-{node}"), &program, args, env)
}

/// Builds the fake NVML library into `host` (created if need be) and writes its configuration
/// of `gpus` (`nvml_extra`: further directives); the environment that makes a peer load both.
///
/// # Errors
/// If the directory, the library or the configuration cannot be made.
fn on_fake_nvml(host: &Path, gpus: &[FakeGpu], nvml_extra: &str) -> anyhow::Result<Vec<(String, String)>> {
    std::fs::create_dir_all(host).with_context(|| format!("creating {}", host.display()))?;
    let library = nvml::build(host)?;
    let nvml_config = host.join("fake-nvml.conf");
    nvml::write_config(&nvml_config, gpus, nvml_extra)?;
    let library_dir = library.parent().context("the library's directory")?;
    Ok(vec![
        ("LD_LIBRARY_PATH".into(), library_dir.display().to_string()),
        ("FAKE_NVML_CONFIG".into(), nvml_config.display().to_string()),
    ])
}

impl RealCluster {
    /// Adds node `name` served by NVIDIA's device plugin instead of gpushared: the recording
    /// runtime, the real kubelet (registered and Ready) and the plugin on `gpus` shared as
    /// `sharing` says. The node's `daemon` is the plugin. Does not wait for its devices.
    ///
    /// # Errors
    /// A component that does not start, with its log.
    pub fn add_nvidia_node(
        &mut self,
        name: &str,
        gpus: &[FakeGpu],
        sharing: NvidiaSharing,
    ) -> anyhow::Result<&mut RealNode> {
        self.add_plugin_node(name, |plane, host, plugin_dir, nvml_extra| {
            start_nvidia_device_plugin(plane, name, &host.join("nvidia"), plugin_dir, gpus, (nvml_extra, sharing))
        })
    }

    /// Adds node `name` served by [`crate::null_plugin`]: `devices` devices of `resource`, each
    /// call answered at once (`gpushare-box null-plugin`), or, as `asks` says, each
    /// `GetPreferredAllocation` after one PodResources `List` of the node's kubelet, and a quorum
    /// `GET` of the pods it names (with the node's identity).
    ///
    /// # Errors
    /// A component that does not start, with its log.
    pub fn add_null_plugin_node(
        &mut self,
        name: &str,
        resource: &str,
        devices: u32,
        asks: NullAsks,
    ) -> anyhow::Result<&mut RealNode> {
        let program = crate::cluster::Binaries::beside_current_exe()?.stand_ins;
        self.add_plugin_node(name, |plane, host, plugin_dir, _| {
            let mut args = vec![
                "null-plugin".to_owned(),
                format!("--plugin-dir={}", plugin_dir.display()),
                format!("--resource={resource}"),
                format!("--devices={devices}"),
            ];
            if asks != NullAsks::Nothing {
                let socket = KubeletDirs::under(host).pod_resources();
                args.push(format!("--pod-resources={}", socket.display()));
            }
            if asks == NullAsks::KubeletAndApiServer {
                let identity = format!("system:node:{name}");
                let kubeconfig = plane.pki.kubeconfig(&plane.server, &identity, &["system:nodes"])?;
                args.push(format!("--read-pods={}", kubeconfig.display()));
            }
            // `GPUSHARE_BOX_DAEMON_LOG` filters its log as gpushared's.
            let log = std::env::var("GPUSHARE_BOX_DAEMON_LOG").unwrap_or_else(|_| "info".into());
            plane.spawn(&format!("null-plugin-{name}"), &program, args, vec![("RUST_LOG".into(), log)])
        })
    }

    /// Adds node `name` served by [`crate::null_dra`]: a DRA driver that answers every call at
    /// once (`gpushare-box null-dra`), registered with the node's kubelet. The node's
    /// ResourceSlice is the caller's to create ([`crate::null_dra::slice`]).
    ///
    /// # Errors
    /// A component that does not start, with its log.
    pub fn add_null_dra_node(&mut self, name: &str) -> anyhow::Result<&mut RealNode> {
        let program = crate::cluster::Binaries::beside_current_exe()?.stand_ins;
        self.add_plugin_node(name, |plane, host, _, _| {
            let args = vec![
                "null-dra".to_owned(),
                format!("--registry-dir={}", KubeletDirs::under(host).root.join("plugins_registry").display()),
                format!("--plugin-dir={}", host.join("null-dra").display()),
            ];
            plane.spawn(&format!("null-dra-{name}"), &program, args, Vec::new())
        })
    }

    /// Adds node `name` whose device plugin `start` starts (given the control plane, the node's
    /// directory, its kubelet's device-plugin directory and the fake NVML event directive): the
    /// recording runtime, the real kubelet (registered and Ready), then the plugin as the node's
    /// `daemon`.
    pub(crate) fn add_plugin_node(
        &mut self,
        name: &str,
        start: impl FnOnce(&crate::realkube::ControlPlane, &Path, &Path, &str) -> anyhow::Result<Proc>,
    ) -> anyhow::Result<&mut RealNode> {
        let host = self.plane.dir.join(name);
        let (runtime, cri_proxy, endpoint) = self.node_runtime(name, &host)?;
        let kubelet = RealKubelet::start_with_gates(&self.plane, name, &host, &endpoint, DEFAULT_GATES)?;
        let events = host.join("nvml-events");
        let daemon = start(&self.plane, &host, &kubelet.dirs.device_plugins(), &nvml::events_directive(&events))?;
        self.nodes.push(RealNode { name: name.to_owned(), host, runtime, cri_proxy, kubelet, daemon, events });
        self.nodes.last_mut().context("the node just added")
    }
}

/// What the plugin of a [`RealCluster::add_null_plugin_node`] asks before each
/// `GetPreferredAllocation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NullAsks {
    /// Nothing: every call answered at once.
    Nothing,
    /// The kubelet's PodResources `List`.
    Kubelet,
    /// That `List`, then a quorum `GET` of each pod it names as holding none of the resource.
    KubeletAndApiServer,
}

/// Alibaba's resource name for GPU memory (in the unit of its device plugin's `--memory-unit`).
pub const ALIYUN_GPU_MEM: &str = "aliyun.com/gpu-mem";

/// Alibaba's gpushare, built from source by `tests/peers/build` when `GPUSHARE_PEERS_SRC` names
/// its checkouts: the binaries' directory and the commits built (`peers.txt`), or one line saying
/// why it cannot run here.
///
/// # Errors
/// The line saying why: the peers' build failed, or no source was given for it.
pub fn alibaba() -> Result<(PathBuf, String), String> {
    built_from_source(
        "Alibaba's gpushare",
        &["gpushare-scheduler-extender", "gpushare-device-plugin", "kubectl-inspect-gpushare"],
    )
}

/// A peer built from source by `tests/peers/build` (`who`, its binaries `wanted`): the
/// binaries' directory and the commits built (`peers.txt`), or one line saying why it cannot run
/// here.
///
/// # Errors
/// The line saying why: the peers' build failed, or no source was given for it.
pub(crate) fn built_from_source(who: &str, wanted: &[&str]) -> Result<(PathBuf, String), String> {
    let bin = binaries().map_err(|e| format!("the peers' build failed: {e:#}"))?;
    if let Some(missing) = wanted.iter().find(|b| !bin.join(b).is_file()) {
        return Err(format!(
            "{who} did not run: {missing} is not in {} (set GPUSHARE_PEERS_SRC to a folder with its source, \
             docs/comparison.md)",
            bin.display()
        ));
    }
    let commits = std::fs::read_to_string(bin.join("peers.txt")).unwrap_or_default();
    Ok((bin, commits))
}

/// What Alibaba's `kubectl-inspect-gpushare` and ours (`--alibaba`, the binary beside the
/// running test) print of the cluster `kubeconfig` names, each as its output or its error.
///
/// # Panics
/// If Alibaba's gpushare is not built, or ours cannot be found.
#[allow(clippy::unwrap_used)]
#[must_use]
pub fn inspect_both(kubeconfig: &Path) -> (String, String) {
    let (bin, _) = alibaba().unwrap();
    let text = |r: anyhow::Result<String>| r.unwrap_or_else(|e| format!("{e:#}"));
    let theirs = text(crate::cluster::inspect(&bin.join("kubectl-inspect-gpushare"), kubeconfig, &[]));
    let ours_bin = crate::cluster::Binaries::beside_current_exe().unwrap().inspect;
    (theirs, text(crate::cluster::inspect(&ours_bin, kubeconfig, &["--alibaba"])))
}

/// The rows of an inspect summary table (header, nodes, the cluster's total), each as its
/// whitespace-separated cells, the rule line left out, in order: Alibaba's inspect lists the
/// nodes in no fixed order.
#[must_use]
pub fn inspect_rows(table: &str) -> Vec<Vec<&str>> {
    let mut rows: Vec<Vec<&str>> =
        table.lines().filter(|l| !l.starts_with("---")).map(|l| l.split_whitespace().collect()).collect();
    rows.sort();
    rows
}

/// The `used/total` cell of GPU `index` in `node`'s row of an inspect summary table.
#[must_use]
pub fn inspect_cell(table: &str, node: &str, index: u32) -> Option<String> {
    let rows = inspect_rows(table);
    let header = rows.iter().find(|r| r.first() == Some(&"NAME"))?;
    let column = header.iter().position(|h| h.starts_with(&format!("GPU{index}(")))?;
    let row = rows.iter().find(|r| r.first() == Some(&node))?;
    row.get(column).map(|c| (*c).to_owned())
}

/// Alibaba's kube-scheduler configuration in `kubescheduler.config.k8s.io/v1` form (its own
/// files are Policy JSON and v1beta2, which Kubernetes 1.28+ no longer loads), with the same
/// extender settings: filter and bind at `url`, `aliyun.com/gpu-mem` managed, not ignorable.
#[must_use]
pub fn alibaba_scheduler_config(url: &str) -> String {
    format!(
        "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\nclientConnection:\n  \
         {kubeconfig}\nextenders:\n- urlPrefix: \"{url}\"\n  filterVerb: filter\n  bindVerb: bind\n  \
         enableHTTPS: false\n  nodeCacheCapable: true\n  managedResources:\n  - name: {ALIYUN_GPU_MEM}\n    \
         ignoredByScheduler: false\n  ignorable: false\n",
        kubeconfig = crate::realkube::SCHEDULER_KUBECONFIG,
    )
}

/// Starts Alibaba's gpushare-scheduler-extender ([`spawn_alibaba_extender`]) and points
/// kube-scheduler at it with [`alibaba_scheduler_config`]. Returns the extender.
///
/// # Errors
/// If it is not built, does not answer within 30 s, or kube-scheduler does not start.
pub fn start_alibaba_extender(plane: &mut crate::realkube::ControlPlane) -> anyhow::Result<Proc> {
    let (extender, url) = spawn_alibaba_extender(plane, "info")?;
    plane.start_scheduler_config(&alibaba_scheduler_config(&url))?;
    Ok(extender)
}

/// Starts Alibaba's gpushare-scheduler-extender as its deployment does (`PORT`, a kubeconfig;
/// here the administrator's, where its manifest binds it a `ClusterRole`), logging at
/// `log_level` (its `LOG_LEVEL`: `debug`, `info`, `warn` or `error`; its manifest ships `debug`,
/// which logs a line per node and pod of every filter). Returns it once it answers, with the
/// `urlPrefix` kube-scheduler reaches it at.
///
/// # Errors
/// If it is not built or does not answer within 30 s.
pub fn spawn_alibaba_extender(
    plane: &crate::realkube::ControlPlane,
    log_level: &str,
) -> anyhow::Result<(Proc, String)> {
    let (bin, _) = alibaba().map_err(anyhow::Error::msg)?;
    let port = crate::ports::free_port()?;
    let mut extender = plane.spawn(
        "alibaba-extender",
        &bin.join("gpushare-scheduler-extender"),
        vec![],
        vec![
            ("PORT".into(), port.to_string()),
            ("KUBECONFIG".into(), plane.admin.display().to_string()),
            ("LOG_LEVEL".into(), log_level.to_owned()),
        ],
    )?;
    wait_listening(&mut extender, port, "Alibaba's extender")?;
    Ok((extender, format!("http://127.0.0.1:{port}/gpushare-scheduler")))
}

/// Waits (at most 30 s) until `peer`, called `what` in the error, listens on `port` of
/// 127.0.0.1.
///
/// # Errors
/// If it exits first, or does not listen in time: with the end of its log.
fn wait_listening(peer: &mut Proc, port: u16, what: &str) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = peer.exited() {
            anyhow::bail!("{what} exited ({status}):\n{}", peer.log_tail(30));
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("{what} does not listen after 30 s:\n{}", peer.log_tail(30));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Ok(())
}

/// Starts Alibaba's gpushare-device-plugin for node `node` (as its `DaemonSet` does: `NODE_NAME`, a
/// kubeconfig, `--memory-unit`, health checks on) for the kubelet whose device plugins live in
/// `plugin_dir`, on `gpus` of the fake NVML library (`nvml_extra`: further directives), its files
/// under `host`.
///
/// # Errors
/// If it is not built, the library cannot be built, a file cannot be written, or it cannot be
/// started.
pub fn start_alibaba_device_plugin(
    plane: &crate::realkube::ControlPlane,
    node: &str,
    (host, plugin_dir): (&Path, &Path),
    gpus: &[FakeGpu],
    (nvml_extra, unit): (&str, &str),
) -> anyhow::Result<Proc> {
    let (bin, _) = alibaba().map_err(anyhow::Error::msg)?;
    let mut env = on_fake_nvml(host, gpus, nvml_extra)?;
    let (program, args) = with_device_plugin_dir(
        plugin_dir,
        &bin.join("gpushare-device-plugin"),
        // --token: its kubelet client is built at start whether or not it queries the kubelet
        // (--query-kubelet, off), and it stops when neither a token nor a service account is there.
        vec![format!("--memory-unit={unit}"), "--health-check".into(), "--token=unused".into(), "-logtostderr".into()],
    );
    env.push(("KUBECONFIG".into(), plane.admin.display().to_string()));
    env.push(("NODE_NAME".into(), node.to_owned()));
    plane.spawn(&format!("alibaba-device-plugin-{node}"), &program, args, env)
}

impl RealCluster {
    /// Adds node `name` served by Alibaba's gpushare-device-plugin in `unit` (`MiB` or `GiB`)
    /// instead of gpushared: the recording runtime, the real kubelet (registered and Ready) and
    /// the plugin on `gpus`. The node's `daemon` is the plugin. Does not wait for its devices.
    ///
    /// # Errors
    /// A component that does not start, with its log.
    pub fn add_alibaba_node(&mut self, name: &str, gpus: &[FakeGpu], unit: &str) -> anyhow::Result<&mut RealNode> {
        self.add_plugin_node(name, |plane, host, plugin_dir, nvml_extra| {
            start_alibaba_device_plugin(plane, name, (&host.join("alibaba"), plugin_dir), gpus, (nvml_extra, unit))
        })
    }
}

impl RealCluster {
    /// Hands node `name`'s GPUs from its device plugin to gpushared, as an operator does in
    /// docs/install.md §7 once the old plugin is told to stop: stops the node's plugin (SIGTERM,
    /// as the `DaemonSet` controller does when the node loses its label), writes gpushared's
    /// configuration (`config_extra` added to the generated file) on the same kubelet and fake
    /// NVML host, runs `gpushared --check-config` on it and starts gpushared as the node's
    /// `daemon`. Returns the check's report. Does not wait for its devices.
    ///
    /// # Errors
    /// An unknown node, a configuration the check refuses, or gpushared not starting.
    pub fn replace_with_gpushared(
        &mut self,
        name: &str,
        gpus: &[FakeGpu],
        config_extra: &str,
    ) -> anyhow::Result<String> {
        let i = self.nodes.iter().position(|n| n.name == name).with_context(|| format!("no node {name}"))?;
        let node = &mut self.nodes[i];
        node.daemon.stop(std::time::Duration::from_secs(5));
        let files = crate::realbox::GpusharedFiles::write(
            &self.plane,
            name,
            &node.host.join("gpushared"),
            (&node.kubelet.dirs.device_plugins(), &node.kubelet.dirs.pod_resources()),
            gpus,
            (&nvml::events_directive(&node.events), config_extra),
        )?;
        let report = files.check()?;
        node.daemon = files.spawn(&self.plane, name)?;
        Ok(report)
    }

    /// Hands node `name`'s GPUs back to Alibaba's gpushare-device-plugin in `unit`: stops the
    /// node's `daemon` (SIGTERM, as `systemctl disable --now gpushared` does) and starts
    /// Alibaba's plugin in its place, as its `DaemonSet` does once the node is labelled again.
    /// Does not wait for its devices.
    ///
    /// # Errors
    /// An unknown node, or the plugin not starting.
    pub fn replace_with_alibaba(&mut self, name: &str, gpus: &[FakeGpu], unit: &str) -> anyhow::Result<()> {
        let i = self.nodes.iter().position(|n| n.name == name).with_context(|| format!("no node {name}"))?;
        let node = &mut self.nodes[i];
        node.daemon.stop(std::time::Duration::from_secs(5));
        node.daemon = start_alibaba_device_plugin(
            &self.plane,
            name,
            (&node.host.join("alibaba"), &node.kubelet.dirs.device_plugins()),
            gpus,
            (&nvml::events_directive(&node.events), unit),
        )?;
        Ok(())
    }
}

/// HAMi's resource names and scheduler name, its chart's defaults: GPUs (`nvidia.com/gpu`, the
/// same name as NVIDIA's plugin), MiB of each (`nvidia.com/gpumem`), and the kube-scheduler
/// profile its webhook sends the pods that ask for them to.
pub const HAMI_GPU: &str = "nvidia.com/gpu";
/// HAMi's memory per GPU, MiB.
pub const HAMI_GPUMEM: &str = "nvidia.com/gpumem";
/// The scheduler name HAMi's webhook writes into the pods it manages.
pub const HAMI_SCHEDULER: &str = "hami-scheduler";
/// How many pods may share one GPU by default (its chart's `devicePlugin.deviceSplitCount`).
pub const HAMI_SPLIT: u32 = 10;

/// HAMi, built from source by `tests/peers/build` when `GPUSHARE_PEERS_SRC` names its checkout:
/// the binaries' directory and the commits built (`peers.txt`), or one line saying why it cannot
/// run here.
///
/// # Errors
/// The line saying why.
pub fn hami() -> Result<(PathBuf, String), String> {
    built_from_source("HAMi", &["hami-scheduler", "hami-device-plugin"])
}

/// HAMi's device configuration (its chart's `device-config.yaml`, NVIDIA's section, with the
/// chart's default values but `split` pods per GPU), which its scheduler and device plugin both
/// read.
#[must_use]
pub fn hami_device_config(split: u32) -> String {
    format!(
        "nvidia:\n  resourceCountName: {HAMI_GPU}\n  resourceMemoryName: {HAMI_GPUMEM}\n  \
         resourceMemoryPercentageName: nvidia.com/gpumem-percentage\n  resourceCoreName: nvidia.com/gpucores\n  \
         resourcePriorityName: nvidia.com/priority\n  overwriteEnv: false\n  defaultMemory: 0\n  defaultCores: 0\n  \
         defaultGPUNum: 1\n  preConfiguredDeviceMemory: 0\n  memoryFactor: 1\n  deviceSplitCount: {split}\n  \
         deviceMemoryScaling: 1\n  deviceCoreScaling: 1\n  enableNumaTopology: false\n  gpuCorePolicy: default\n  \
         libCudaLogLevel: 1\n  runtimeClassName: \"\"\n"
    )
}

/// kube-scheduler's configuration for HAMi, as its chart writes it for Kubernetes 1.26+: the
/// default profile and HAMi's, and its extender at `url` over HTTPS (its chart: `insecure`),
/// filter and bind, HAMi's resources managed and ignored by kube-scheduler. A plain `http://`
/// `url` (a [`crate::call_timer::CallTimer`] in front of it) is called over HTTP.
#[must_use]
pub fn hami_scheduler_config(url: &str) -> String {
    let tls = if url.starts_with("https://") { "true\n  tlsConfig:\n    insecure: true" } else { "false" };
    let managed: String =
        [HAMI_GPU, HAMI_GPUMEM, "nvidia.com/gpucores", "nvidia.com/gpumem-percentage", "nvidia.com/priority"]
            .iter()
            .map(|r| format!("  - name: {r}\n    ignoredByScheduler: true\n"))
            .collect();
    format!(
        "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\nclientConnection:\n  \
         {kubeconfig}\nprofiles:\n- schedulerName: default-scheduler\n- schedulerName: {HAMI_SCHEDULER}\nextenders:\n\
         - urlPrefix: \"{url}\"\n  enableHTTPS: {tls}\n  filterVerb: filter\n  \
         bindVerb: bind\n  nodeCacheCapable: true\n  weight: 1\n  httpTimeout: 30s\n  managedResources:\n{managed}",
        kubeconfig = crate::realkube::SCHEDULER_KUBECONFIG,
    )
}

/// Starts HAMi's scheduler ([`spawn_hami_scheduler`], its chart's node policy `binpack`) and
/// points kube-scheduler at its extender ([`hami_scheduler_config`]). Returns HAMi's scheduler
/// and the address of its metrics, where `hami_gpu_memory_limit_bytes{node="…"}` shows each node
/// it has registered: it reads the nodes' device annotations every 15 s or so, and until then its
/// filter answers "node unregistered".
///
/// # Errors
/// If it cannot be started or set up, or kube-scheduler does not start.
pub fn start_hami_scheduler(
    plane: &mut crate::realkube::ControlPlane,
    split: u32,
) -> anyhow::Result<(Proc, std::net::SocketAddr)> {
    let (scheduler, url, metrics) = spawn_hami_scheduler(plane, split, "binpack", None)?;
    plane.start_scheduler_config(&hami_scheduler_config(&url))?;
    Ok((scheduler, metrics))
}

/// Starts HAMi's scheduler (its extender and mutating webhook, one HTTPS server as its chart
/// runs it, with a serving certificate of the box's CA for 127.0.0.1) with `split` pods per GPU
/// and the node policy `node_policy` (`binpack` or `spread`), and registers the webhook with the
/// API server through a URL client configuration and that CA. `kube_rate`, where given, raises
/// its API client's rate limits (`--kube-qps`, `--kube-burst`; client-go's defaults, 5 and 10,
/// otherwise): it sends two requests per node it registers. Returns it once it listens, with the
/// `urlPrefix` of its extender and the address of its metrics.
///
/// # Errors
/// If it is not built, a file cannot be written, it does not listen within 30 s, or the webhook
/// cannot be registered.
pub fn spawn_hami_scheduler(
    plane: &crate::realkube::ControlPlane,
    split: u32,
    node_policy: &str,
    kube_rate: Option<u32>,
) -> anyhow::Result<(Proc, String, std::net::SocketAddr)> {
    let (bin, _) = hami().map_err(anyhow::Error::msg)?;
    let port = crate::ports::free_port()?;
    let metrics = crate::ports::free_port()?;
    let (crt, key) = plane.pki.issue(
        "hami-scheduler",
        "/CN=hami-scheduler",
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n",
    )?;
    let config = plane.dir.join("hami-device-config.yaml");
    std::fs::write(&config, hami_device_config(split)).with_context(|| format!("writing {}", config.display()))?;
    let rate = kube_rate.map(|r| [format!("--kube-qps={r}"), format!("--kube-burst={r}")]).into_iter().flatten();
    let mut scheduler = plane.spawn(
        "hami-scheduler",
        &bin.join("hami-scheduler"),
        rate.chain([
            format!("--http_bind=127.0.0.1:{port}"),
            format!("--cert_file={}", crt.display()),
            format!("--key_file={}", key.display()),
            format!("--scheduler-name={HAMI_SCHEDULER}"),
            format!("--metrics-bind-address=127.0.0.1:{metrics}"),
            format!("--node-scheduler-policy={node_policy}"),
            "--gpu-scheduler-policy=spread".into(),
            format!("--device-config-file={}", config.display()),
            "--leader-elect=false".into(),
        ])
        .collect(),
        vec![
            ("KUBECONFIG".into(), plane.admin.display().to_string()),
            ("POD_NAME".into(), "hami-scheduler".into()),
            ("POD_NAMESPACE".into(), "kube-system".into()),
        ],
    )?;
    wait_listening(&mut scheduler, port, "HAMi's scheduler")?;
    let ca = std::fs::read(plane.pki.ca()).context("reading the box's CA")?;
    plane.create(&serde_json::json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "hami-webhook"},
        "webhooks": [{"name": "vgpu.hami.io", "admissionReviewVersions": ["v1beta1"],
            "clientConfig": {"url": format!("https://127.0.0.1:{port}/webhook"), "caBundle": base64(&ca)},
            "failurePolicy": "Ignore", "matchPolicy": "Equivalent", "reinvocationPolicy": "Never",
            "sideEffects": "None", "timeoutSeconds": 10,
            "objectSelector": {"matchExpressions": [{"key": "hami.io/webhook", "operator": "NotIn", "values": ["ignore"]}]},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"], "scope": "*"}]}]
    }))?;
    Ok((scheduler, format!("https://127.0.0.1:{port}"), std::net::SocketAddr::from(([127, 0, 0, 1], metrics))))
}

/// Standard base64 of `bytes`, as a Kubernetes `caBundle` carries a certificate.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Starts HAMi's NVIDIA device plugin for node `node` as its `DaemonSet` does (`NODE_NAME`, a
/// kubeconfig, its device configuration, environment variables as the device list, no MIG) for
/// the kubelet whose device plugins live in `plugin_dir`, on `gpus` of the fake NVML library, its
/// files under `host`. Its `HOOK_PATH` (where HAMi-core's library would be) is an empty
/// directory: in-container enforcement needs a GPU and is not run here.
///
/// # Errors
/// If it is not built, the library cannot be built, a file cannot be written, or it cannot be
/// started.
pub fn start_hami_device_plugin(
    plane: &crate::realkube::ControlPlane,
    node: &str,
    (host, plugin_dir): (&Path, &Path),
    gpus: &[FakeGpu],
    (nvml_extra, split): (&str, u32),
) -> anyhow::Result<Proc> {
    let (bin, _) = hami().map_err(anyhow::Error::msg)?;
    let mut env = on_fake_nvml(host, gpus, nvml_extra)?;
    let config = host.join("device-config.yaml");
    std::fs::write(&config, hami_device_config(split)).with_context(|| format!("writing {}", config.display()))?;
    let hook = host.join("hook");
    std::fs::create_dir_all(hook.join("vgpu")).with_context(|| format!("creating {}", hook.display()))?;
    let (program, args) = with_device_plugin_dir(
        plugin_dir,
        &bin.join("hami-device-plugin"),
        vec![format!("--config-file={}", config.display()), "--mig-strategy=none".into()],
    );
    env.extend([
        ("KUBECONFIG".into(), plane.admin.display().to_string()),
        ("NODE_NAME".into(), node.to_owned()),
        ("HOOK_PATH".into(), hook.display().to_string()),
        ("DEVICE_LIST_STRATEGY".into(), "envvar".into()),
        ("PASS_DEVICE_SPECS".into(), "false".into()),
        ("NVIDIA_MIG_MONITOR_DEVICES".into(), "all".into()),
    ]);
    plane.spawn(&format!("hami-device-plugin-{node}"), &program, args, env)
}

impl RealCluster {
    /// Adds node `name` served by HAMi's device plugin instead of gpushared: the recording
    /// runtime, the real kubelet (registered and Ready) and the plugin on `gpus`, each shared by
    /// up to `split` pods. The node's `daemon` is the plugin. Does not wait for its devices.
    ///
    /// # Errors
    /// A component that does not start, with its log.
    pub fn add_hami_node(&mut self, name: &str, gpus: &[FakeGpu], split: u32) -> anyhow::Result<&mut RealNode> {
        self.add_plugin_node(name, |plane, host, plugin_dir, nvml_extra| {
            start_hami_device_plugin(plane, name, (&host.join("hami"), plugin_dir), gpus, (nvml_extra, split))
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        assert_eq!(super::base64(b""), "");
        assert_eq!(super::base64(b"f"), "Zg==");
        assert_eq!(super::base64(b"fo"), "Zm8=");
        assert_eq!(super::base64(b"foo"), "Zm9v");
        assert_eq!(super::base64(b"foob"), "Zm9vYg==");
        assert_eq!(super::base64(b"\xff\xfe\xfd"), "//79");
    }
}
