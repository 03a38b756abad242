//! NVIDIA's DRA driver (`kubernetes-sigs/dra-driver-nvidia-gpu`, its GPU kubelet plugin) as a
//! node of the real-cluster box, beside gpushare's own DRA path (docs/comparison.md): built from
//! source by `tests/peers/build`, run unmodified on the fake NVML library as its chart runs it on
//! a host, with its consumable shares on (`memory`: each GPU one device whose memory claims
//! share, the DRA form of what gpushare does) and its NVML health checks on (both alpha feature
//! gates, off by default), as an operator who wants them runs it.
//!
//! What it needs of a host is made under the node's directory: a driver root with
//! `libnvidia-ml.so.1` (the fake library, also under the driver version's name and as
//! `libcuda.so.<version>`), `nvidia-smi` and character device nodes, `nvidia-cdi-hook` (built from the
//! NVIDIA container toolkit module pinned in `tests/peers/go.mod`), and the CDI directory the
//! node's runtime reads. Its GPUs need UUIDs of NVIDIA's form
//! ([`FakeGpu::with_nvidia_uuid`]): its CDI generation parses them.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

use crate::cluster::Proc;
use crate::nvml::{self, FakeGpu};
use crate::realbox::{RealCluster, RealNode};
use crate::realkubelet::KubeletDirs;

/// The driver version the fake NVML library reports by default (tests/fake-nvml/README.md).
const DRIVER_VERSION: &str = "550.54.15";

/// Its chart's device class for whole GPUs.
pub const DEVICE_CLASS: &str = "gpu.nvidia.com";

/// NVIDIA's DRA driver, built from source by `tests/peers/build` when `GPUSHARE_PEERS_SRC` names
/// its checkout: the binaries' directory and the commits built (`peers.txt`), or one line saying
/// why it cannot run here.
///
/// # Errors
/// The line saying why.
pub fn built() -> Result<(PathBuf, String), String> {
    crate::peers::built_from_source("NVIDIA's DRA driver", &["gpu-kubelet-plugin", "nvidia-cdi-hook"])
}

/// Its chart's `DeviceClass` for GPUs.
#[must_use]
pub fn device_class() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression":
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"}}]},
    })
}

/// Starts the GPU kubelet plugin for `node` on `gpus` of the fake NVML library, its files under
/// `host/nvidia-dra`, registered with the kubelet whose root is `kubelet_root`, writing its CDI
/// specs into `cdi_dir`, with consumable shares of memory and health checks on.
///
/// # Errors
/// If it is not built, the library cannot be built, or a file cannot be written.
pub fn start_plugin(
    plane: &crate::realkube::ControlPlane,
    node: &str,
    (host, kubelet_root, cdi_dir): (&Path, &Path, &Path),
    gpus: &[FakeGpu],
    nvml_extra: &str,
) -> anyhow::Result<Proc> {
    let (bin, _) = built().map_err(anyhow::Error::msg)?;
    let dir = host.join("nvidia-dra");
    // The driver root as the driver looks for it on a host: the library and nvidia-smi.
    let root = dir.join("driver-root");
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    let smi = root.join("usr/bin/nvidia-smi");
    for d in [&lib, &root.join("usr/bin"), &root.join("dev"), cdi_dir] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    // Named by the driver's version as a driver install names them, libcuda beside it: the
    // driver finds the libraries it mounts into containers by that name.
    let library = nvml::build(&lib)?;
    for name in [format!("libnvidia-ml.so.{DRIVER_VERSION}"), format!("libcuda.so.{DRIVER_VERSION}")] {
        std::fs::copy(&library, lib.join(&name)).with_context(|| format!("writing {name}"))?;
    }
    std::fs::write(&smi, "#!/bin/sh\necho 'nvidia-smi: the fake NVML library has no such tool' >&2\nexit 1\n")
        .with_context(|| format!("writing {}", smi.display()))?;
    set_executable(&smi)?;
    // Its device nodes: NVIDIA's CDI generation looks for them under the driver root and only
    // takes character devices.
    nvml::make_device_nodes(&root.join("dev"), gpus)?;
    let config = dir.join("fake-nvml.conf");
    nvml::write_config(&config, gpus, nvml_extra)?;
    let root_s = root.display().to_string();
    plane.spawn(
        &format!("nvidia-dra-{node}"),
        &bin.join("gpu-kubelet-plugin"),
        vec![
            format!("--node-name={node}"),
            format!("--cdi-root={}", cdi_dir.display()),
            format!("--nvidia-driver-root={root_s}"),
            format!("--container-driver-root={root_s}"),
            format!("--host-root={root_s}"),
            format!("--nvidia-cdi-hook-path={}", bin.join("nvidia-cdi-hook").display()),
            "--image-name=registry.k8s.io/dra-driver-nvidia-gpu:unused".into(),
            format!("--kubelet-registrar-directory-path={}", kubelet_root.join("plugins_registry").display()),
            format!("--kubelet-plugins-directory-path={}", kubelet_root.join("plugins").display()),
            "--consumable-shares=memory".into(),
            "--feature-gates=ConsumableShares=true,NVMLDeviceHealthCheck=true".into(),
            format!("--kubeconfig={}", plane.admin.display()),
            "-v=4".into(),
        ],
        vec![
            ("LD_LIBRARY_PATH".into(), lib.display().to_string()),
            ("FAKE_NVML_CONFIG".into(), config.display().to_string()),
        ],
    )
}

fn set_executable(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", path.display()))
}

impl RealCluster {
    /// Adds node `name` whose GPUs `gpus` NVIDIA's DRA driver serves ([`start_plugin`]) instead
    /// of gpushared: the recording runtime, the real kubelet (registered and Ready) and the
    /// plugin. The node's `daemon` is the plugin. Does not wait for its ResourceSlice.
    ///
    /// # Errors
    /// A component that does not start, with its log.
    pub fn add_nvidia_dra_node(&mut self, name: &str, gpus: &[FakeGpu]) -> anyhow::Result<&mut RealNode> {
        self.add_plugin_node(name, |plane, host, _, nvml_extra| {
            let kubelet = KubeletDirs::under(host);
            let cdi = host.join("cri").join(crate::cri::CDI_DIR);
            start_plugin(plane, name, (host, &kubelet.root, &cdi), gpus, nvml_extra)
        })
    }
}
