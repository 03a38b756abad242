//! The peer systems run beside gpushare on the real-cluster box (docs/comparison.md), unmodified,
//! on the same fake NVML library and under the same real kubelet: NVIDIA's k8s-device-plugin,
//! built by `tests/peers/build` from the Go modules pinned in `tests/peers/go.mod` into a cache
//! outside `target/` (`GPUSHARE_PEERS_BIN` names a directory that has the binaries instead).
//!
//! NVIDIA's plugin serves its socket in `/var/lib/kubelet/device-plugins/` whatever its flags say
//! (the kubelet's `DevicePluginPath`), so it runs in a mount namespace of its own with the node's
//! device-plugin directory bind-mounted there, as the node's kubelet does ([`crate::realkubelet`]).

use std::path::{Path, PathBuf};

use anyhow::Context as _;

use crate::cluster::Proc;
use crate::nvml::{self, FakeGpu};
use crate::realbox::{RealCluster, RealNode};
use crate::realkubelet::{DEFAULT_GATES, RealKubelet, with_device_plugin_dir};

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
    std::fs::create_dir_all(host).with_context(|| format!("creating {}", host.display()))?;
    let library = nvml::build(host)?;
    let nvml_config = host.join("fake-nvml.conf");
    nvml::write_config(&nvml_config, gpus, nvml_extra)?;
    let config = host.join("nvidia-device-plugin.yaml");
    std::fs::write(&config, nvidia_config(sharing)).with_context(|| format!("writing {}", config.display()))?;
    let library_dir = library.parent().context("the library's directory")?;
    let (program, args) = with_device_plugin_dir(
        plugin_dir,
        &bin.join("nvidia-device-plugin"),
        vec![format!("--config-file={}", config.display())],
    );
    plane.spawn(
        &format!("nvidia-device-plugin-{node}"),
        &program,
        args,
        vec![
            ("LD_LIBRARY_PATH".into(), library_dir.display().to_string()),
            ("FAKE_NVML_CONFIG".into(), nvml_config.display().to_string()),
        ],
    )
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
        let host = self.plane.dir.join(name);
        let runtime = crate::cri::RecordingRuntime::serve(&host.join("cri/cri.sock"))?;
        let kubelet = RealKubelet::start_with_gates(&self.plane, name, &host, &runtime.endpoint(), DEFAULT_GATES)?;
        let events = host.join("nvml-events");
        let daemon = start_nvidia_device_plugin(
            &self.plane,
            name,
            &host.join("nvidia"),
            &kubelet.dirs.device_plugins(),
            gpus,
            (&nvml::events_directive(&events), sharing),
        )?;
        self.nodes.push(RealNode { name: name.to_owned(), host, runtime, kubelet, daemon, events });
        self.nodes.last_mut().context("the node just added")
    }
}
