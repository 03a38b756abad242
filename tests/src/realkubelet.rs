//! The real kubelet as a node of the real-cluster box: its root (pods, checkpoints, the
//! pod-resources socket) and pod logs under one folder per node, authenticated as
//! `system:node:<name>` (group `system:nodes`), with the recording runtime of [`crate::cri`] as
//! its container runtime.
//!
//! The one path a kubelet does not let one move is the device plugins' directory: it is
//! `/var/lib/kubelet/device-plugins/` whatever `--root-dir` says (`DevicePluginPath` in
//! `k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1`). So each kubelet runs in a mount namespace of
//! its own (`unshare --mount`) where the node's own directory is bind-mounted there; gpushared
//! reaches the same sockets through the node's directory. Kubelets of several tests then run
//! side by side, the machine's `/var/lib/kubelet` is left alone, and the mounts the kubelet makes
//! (its root directory onto itself) end with it.
//!
//! The settings are those a container on cgroup v1 needs (kubelet 1.35 and later refuse cgroup
//! v1 unless `failCgroupV1: false`): no quality-of-service cgroups, no node-allocatable
//! enforcement, swap allowed; thresholds that would evict or collect images on a busy build
//! machine are off; up to 1,000 pods (the benchmarks run 500 on one node). `ResourceHealthStatus` (and `ResourceHealthStatusMessage`, which needs it) is
//! off, as docs/install.md asks of every kubelet from 1.36 on that serves gpushare's per-MiB
//! devices: with it, each device list the kubelet receives is checked device by device against
//! every allocation under the device manager's lock, which stalls pod admission for minutes after
//! a kubelet restart on a node with GPU pods. Its API is served on loopback with
//! client-certificate authentication only.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;

use crate::cluster::{Proc, wait_for};
use crate::ports::free_port;
use crate::realkube::ControlPlane;

/// The kubelet's device plugin directory, which `--root-dir` does not move: in the kubelet's
/// mount namespace, the node's [`KubeletDirs::device_plugins`] is mounted here.
pub const DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";

/// Where one node's kubelet keeps its state.
#[derive(Clone, Debug)]
pub struct KubeletDirs {
    /// `--root-dir`: pods, checkpoints, plugins.
    pub root: PathBuf,
    /// The pod logs (`podLogsDir`; from kubelet 1.30 on, [`POD_LOGS_DIR_MINOR`]).
    pub logs: PathBuf,
}

impl KubeletDirs {
    /// The directories of a node kept under `dir`.
    #[must_use]
    pub fn under(dir: &Path) -> KubeletDirs {
        KubeletDirs { root: dir.join("kubelet"), logs: dir.join("pod-logs") }
    }

    /// The device plugins' directory, where `kubelet.sock` is, as processes outside the
    /// kubelet's mount namespace (gpushared) reach it.
    #[must_use]
    pub fn device_plugins(&self) -> PathBuf {
        self.root.parent().unwrap_or(&self.root).join("device-plugins")
    }

    /// The PodResources socket.
    #[must_use]
    pub fn pod_resources(&self) -> PathBuf {
        self.root.join("pod-resources").join("kubelet.sock")
    }
}

/// The first minor version whose kubelet writes pod logs where `podLogsDir` says
/// ([`KubeletDirs::logs`]); an older one writes them to `/var/log/pods`, which every node of the
/// machine shares, and removes the log folders of pods it does not know, other nodes' among them.
pub const POD_LOGS_DIR_MINOR: u32 = 30;

/// The feature gates the kubelet runs with: per-device health in pod status off, as
/// docs/install.md asks of kubelets serving gpushare in MiB (one device per MiB makes kubelet
/// 1.36+ stall after a restart).
pub const DEFAULT_GATES: &[(&str, bool)] = &[("ResourceHealthStatus", false), ("ResourceHealthStatusMessage", false)];

/// The minor version that introduced each gate the suites set: an older kubelet is not given it.
const GATES_SINCE: &[(&str, u32)] = &[("ResourceHealthStatus", 31), ("ResourceHealthStatusMessage", 36)];

/// A running real kubelet.
#[derive(Debug)]
pub struct RealKubelet {
    /// The node's name.
    pub node: String,
    /// Its directories.
    pub dirs: KubeletDirs,
    /// The process.
    pub proc: Proc,
    /// The port of its API (`/metrics` among it), HTTPS on loopback; clients authenticate with
    /// a certificate of the cluster's CA.
    pub port: u16,
    /// The port of its `/healthz`.
    healthz: u16,
}

impl RealKubelet {
    /// Starts a kubelet for `node`, its state under `dir`, with the container runtime at
    /// `runtime` (`unix:///...`), and waits until it has registered its Node.
    ///
    /// # Errors
    /// If the kubelet does not start or register within a minute (with the end of its log).
    pub fn start(plane: &ControlPlane, node: &str, dir: &Path, runtime: &str) -> anyhow::Result<RealKubelet> {
        Self::start_with_gates(plane, node, dir, runtime, DEFAULT_GATES)
    }

    /// [`Self::start`] with the feature gates `gates` instead of [`DEFAULT_GATES`].
    ///
    /// # Errors
    /// If the kubelet does not start or register within a minute (with the end of its log).
    pub fn start_with_gates(
        plane: &ControlPlane,
        node: &str,
        dir: &Path,
        runtime: &str,
        gates: &[(&str, bool)],
    ) -> anyhow::Result<RealKubelet> {
        // A gate the kubelet does not know stops it: those newer than it are left out.
        let gates: String = gates
            .iter()
            .filter(|(gate, _)| GATES_SINCE.iter().all(|(g, minor)| g != gate || plane.minor >= *minor))
            .map(|(gate, on)| format!("  {gate}: {on}\n"))
            .collect();
        let dirs = KubeletDirs::under(dir);
        std::fs::create_dir_all(&dirs.root)?;
        std::fs::create_dir_all(dirs.device_plugins())?;
        // The mount point; mounting over it in the kubelet's namespace leaves the machine's as is.
        std::fs::create_dir_all(DEVICE_PLUGIN_DIR)
            .with_context(|| format!("creating {DEVICE_PLUGIN_DIR}, the kubelet's mount point"))?;
        std::fs::create_dir_all(&dirs.logs)?;
        let kubeconfig = plane.pki.kubeconfig(&plane.server, &format!("system:node:{node}"), &["system:nodes"])?;
        let config = dir.join("kubelet-config.yaml");
        let (port, healthz) = (free_port()?, free_port()?);
        std::fs::write(
            &config,
            format!(
                "apiVersion: kubelet.config.k8s.io/v1beta1\n\
                 kind: KubeletConfiguration\n\
                 address: 127.0.0.1\n\
                 port: {port}\n\
                 readOnlyPort: 0\n\
                 healthzBindAddress: 127.0.0.1\n\
                 healthzPort: {healthz}\n\
                 authentication:\n  anonymous:\n    enabled: false\n  webhook:\n    enabled: false\n  \
                 x509:\n    clientCAFile: {ca}\n\
                 authorization:\n  mode: AlwaysAllow\n\
                 cgroupDriver: cgroupfs\n\
                 cgroupsPerQOS: false\n\
                 enforceNodeAllocatable: []\n\
                 failCgroupV1: false\n\
                 failSwapOn: false\n\
                 protectKernelDefaults: false\n\
                 localStorageCapacityIsolation: false\n\
                 containerRuntimeEndpoint: {runtime}\n\
                 imageServiceEndpoint: {runtime}\n\
                 podLogsDir: {logs}\n\
                 resolvConf: \"\"\n\
                 registerNode: true\n\
                 maxPods: 1000\n\
                 nodeStatusUpdateFrequency: 2s\n\
                 syncFrequency: 5s\n\
                 imageGCHighThresholdPercent: 100\n\
                 imageGCLowThresholdPercent: 99\n\
                 featureGates:\n{gates}\
                 evictionHard:\n  memory.available: \"1Mi\"\n  nodefs.available: \"1%\"\n  \
                 imagefs.available: \"1%\"\n  nodefs.inodesFree: \"1%\"\n",
                ca = plane.pki.ca().display(),
                logs = dirs.logs.display(),
            ),
        )?;
        let (program, args) = with_device_plugin_dir(
            &dirs.device_plugins(),
            &plane.bin.join("kubelet"),
            vec![
                format!("--config={}", config.display()),
                format!("--kubeconfig={}", kubeconfig.display()),
                format!("--root-dir={}", dirs.root.display()),
                format!("--cert-dir={}", dirs.root.join("pki").display()),
                format!("--hostname-override={node}"),
                "--v=2".into(),
            ],
        );
        let proc = plane.spawn(&format!("kubelet-{node}"), &program, args, vec![])?;
        let mut kubelet = RealKubelet { node: node.to_owned(), dirs, proc, port, healthz };
        kubelet.wait_registered(plane, Duration::from_secs(60))?;
        // No node lifecycle controller runs to lift the taint a new node is registered with
        // once it is Ready: done here, as it would.
        let taints = plane.kubectl(&["get", "node", node, "-o", "jsonpath={.spec.taints[*].key}"])?;
        if taints.split_whitespace().any(|t| t == "node.kubernetes.io/not-ready") {
            plane.kubectl(&["taint", "node", node, "node.kubernetes.io/not-ready:NoSchedule-"])?;
        }
        Ok(kubelet)
    }

    /// Kills the kubelet (SIGKILL) and starts it again with the same settings and state, as
    /// `systemctl restart kubelet` after a crash would; waits until it reports its node again.
    ///
    /// # Errors
    /// If it does not come back within a minute.
    pub fn restart(&mut self, plane: &ControlPlane) -> anyhow::Result<()> {
        self.proc.kill_and_restart()?;
        self.wait_registered(plane, Duration::from_secs(60))
    }

    /// Kills the kubelet (SIGKILL), as a power cut would; [`Self::boot`] starts it again.
    pub fn halt(&mut self) {
        self.proc.kill();
    }

    /// Starts the kubelet halted by [`Self::halt`] with the same settings and state; waits
    /// until it reports its node Ready again.
    ///
    /// # Errors
    /// If it does not come back within a minute.
    pub fn boot(&mut self, plane: &ControlPlane) -> anyhow::Result<()> {
        self.proc.start()?;
        self.wait_registered(plane, Duration::from_secs(60))
    }

    /// Waits until the kubelet answers its `/healthz` and its Node is Ready.
    fn wait_registered(&mut self, plane: &ControlPlane, timeout: Duration) -> anyhow::Result<()> {
        let (node, healthz) = (self.node.clone(), self.healthz);
        wait_for(&mut self.proc, timeout, &format!("kubelet {node} to serve and report its node Ready"), || {
            healthy(healthz)
                && plane
                    .kubectl(&[
                        "get",
                        "node",
                        &node,
                        "-o",
                        "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
                    ])
                    .is_ok_and(|s| s.trim() == "True")
        })
    }
}

/// The command that runs `program` with `args` in a mount namespace of its own where
/// `plugin_dir` is mounted on [`DEVICE_PLUGIN_DIR`], as (program, arguments): `unshare` execs
/// it, so the process started is `program` itself. The node's kubelet runs so, and so does a
/// peer's device plugin that serves its socket there whatever its flags say.
#[must_use]
pub fn with_device_plugin_dir(plugin_dir: &Path, program: &Path, args: Vec<String>) -> (PathBuf, Vec<String>) {
    let mut all: Vec<String> = vec![
        "--mount".into(),
        "--propagation=private".into(),
        "--".into(),
        "sh".into(),
        "-c".into(),
        format!("mount --bind \"$0\" {DEVICE_PLUGIN_DIR} && exec \"$@\""),
        plugin_dir.display().to_string(),
        program.display().to_string(),
    ];
    all.extend(args);
    (PathBuf::from("unshare"), all)
}

/// Whether the kubelet's `/healthz` on `port` answers ok.
fn healthy(port: u16) -> bool {
    use std::io::{Read as _, Write as _};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_err() {
        return false;
    }
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    reply.starts_with("HTTP/1.") && reply.contains(" 200 ") && reply.ends_with("ok")
}
