//! The real-cluster box: the real control plane ([`crate::realkube`]) with gpushare's shipped
//! RBAC applied, the extender under its own identity, kube-scheduler loading a shipped
//! configuration, and per node the real kubelet ([`crate::realkubelet`]) and gpushared on the
//! fake NVML library, authenticated as its node. Each kubelet's container runtime is the
//! recording runtime of [`crate::cri`] or, where [`RealOptions::runtime`] says so, containerd
//! and runc ([`crate::containerd`]), which run every container for real.
//! The real-cluster suites and `gpushare-box demo --real` are built on it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};

use crate::cluster::{Binaries, ClusterSpec, Proc, fake_gpus, http_get};
use crate::containerd::Containerd;
use crate::cri::RecordingRuntime;
use crate::nvml::{self, FakeGpu};
use crate::ports::free_port;
use crate::realkube::{self, ControlPlane};
use crate::realkubelet::{DEFAULT_GATES, KubeletDirs, POD_LOGS_DIR_MINOR, RealKubelet};

/// The repository the box's shipped files (`etc/`) come from.
#[must_use]
pub fn repo() -> &'static Path {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR"));
    tests.parent().unwrap_or(tests)
}

/// Whether this process runs as root, as the real kubelet needs (it runs in a mount namespace
/// of its own).
#[must_use]
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|s| s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0")))
}

/// How to start a [`RealCluster`].
#[derive(Clone, Debug)]
pub struct RealOptions {
    /// Keep the state (logs, certificates, etcd's data) here instead of a temporary directory.
    pub dir: Option<PathBuf>,
    /// The kube-scheduler configuration, a file of `etc/kube-scheduler`.
    pub scheduler_config: String,
    /// Added to the extender's configuration (TOML).
    pub extender_extra: String,
    /// The nodes' container runtime.
    pub runtime: Runtime,
}

/// Which container runtime the nodes' kubelets drive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Runtime {
    /// The recording runtime ([`crate::cri`]): runs nothing, keeps what each container was given.
    #[default]
    Recording,
    /// containerd 2 and runc ([`crate::containerd`]): every container runs the probe, which
    /// reports what it sees.
    Containerd,
}

/// One node's container runtime.
#[derive(Debug)]
pub enum NodeRuntime {
    /// The recording runtime.
    Recording(RecordingRuntime),
    /// containerd.
    Containerd(Containerd),
}

impl NodeRuntime {
    /// The recording runtime, whose records the suites on it read; `None` on a node that runs
    /// containerd, whose containers' reports are [`RealNode::seen`].
    #[must_use]
    pub fn recording(&self) -> Option<&RecordingRuntime> {
        match self {
            NodeRuntime::Recording(r) => Some(r),
            NodeRuntime::Containerd(_) => None,
        }
    }

    /// containerd, if the node runs it.
    #[must_use]
    pub fn containerd(&self) -> Option<&Containerd> {
        match self {
            NodeRuntime::Recording(_) => None,
            NodeRuntime::Containerd(c) => Some(c),
        }
    }

    /// containerd, if the node runs it, to restart.
    #[must_use]
    pub fn containerd_mut(&mut self) -> Option<&mut Containerd> {
        match self {
            NodeRuntime::Recording(_) => None,
            NodeRuntime::Containerd(c) => Some(c),
        }
    }

    /// Loses what the runtime keeps in tmpfs, as a host's power cut does: the recording runtime
    /// forgets every sandbox, container and record (and serves again, unused while the kubelet
    /// is down); containerd is halted with its containers.
    ///
    /// # Errors
    /// If the runtime cannot serve again or its state cannot be emptied.
    pub fn halt(&mut self) -> anyhow::Result<()> {
        match self {
            NodeRuntime::Recording(r) => r.reboot(),
            NodeRuntime::Containerd(c) => c.halt(),
        }
    }

    /// Starts the runtime halted by [`Self::halt`], as a boot does.
    ///
    /// # Errors
    /// If it does not serve again.
    pub fn boot(&mut self) -> anyhow::Result<()> {
        match self {
            NodeRuntime::Recording(_) => Ok(()),
            NodeRuntime::Containerd(c) => c.boot(),
        }
    }
}

impl Default for RealOptions {
    fn default() -> Self {
        RealOptions {
            dir: None,
            scheduler_config: "gpushare-scheduler-config.yaml".into(),
            extender_extra: String::new(),
            runtime: Runtime::Recording,
        }
    }
}

/// One node: the real kubelet, its runtime, and gpushared.
#[derive(Debug)]
pub struct RealNode {
    /// The node's name.
    pub name: String,
    /// Its directory: the kubelet's state, gpushared's ledger and configuration.
    pub host: PathBuf,
    /// The container runtime the kubelet drives.
    pub runtime: NodeRuntime,
    /// `cri-proxy` in front of it, for a kubelet older than 1.31 ([`RealCluster::node_runtime`]).
    pub cri_proxy: Option<Proc>,
    /// The kubelet.
    pub kubelet: RealKubelet,
    /// gpushared.
    pub daemon: Proc,
    /// The fake NVML library's event file: [`nvml::inject`] a line to raise an event.
    pub events: PathBuf,
}

/// One container start as the suites check it on either runtime: on the recording runtime, what
/// `CreateContainer` was given; on containerd, what the process itself reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Started {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The pod's UID.
    pub pod_uid: String,
    /// The container's name.
    pub container: String,
    /// Its environment.
    pub envs: BTreeMap<String, String>,
    /// The paths of its device nodes in the container: those the kubelet and CDI named on the
    /// recording runtime, every node under `/dev` its process saw on containerd.
    pub devices: Vec<String>,
    /// Whether this start is running now.
    pub running: bool,
}

impl RealNode {
    /// What each container's process reported about itself on a node that runs containerd,
    /// one entry per container start ([`crate::probe::seen`], from the kubelet's pod logs).
    ///
    /// # Errors
    /// If the logs cannot be read or hold a report that is not the probe's.
    pub fn seen(&self) -> anyhow::Result<Vec<crate::probe::Seen>> {
        crate::probe::seen(&self.kubelet.dirs.logs)
    }

    /// Every container start on the node so far, each marked running or not: the recording
    /// runtime's records in order, or containerd's processes' reports (by pod, container and
    /// attempt), running where its CRI service lists that attempt as running.
    ///
    /// # Errors
    /// If containerd does not answer or its processes' reports cannot be read.
    pub fn started(&self) -> anyhow::Result<Vec<Started>> {
        let containerd = match &self.runtime {
            NodeRuntime::Recording(r) => return Ok(r.created().into_iter().map(Started::from).collect()),
            NodeRuntime::Containerd(c) => c,
        };
        let running = containerd.running()?;
        Ok(self
            .seen()?
            .into_iter()
            .map(|s| {
                let live = running
                    .iter()
                    .any(|(uid, name, attempt)| *uid == s.pod_uid && *name == s.container && *attempt == s.attempt);
                Started::reported(s, live)
            })
            .collect())
    }

    /// The containers running on the node now, the latest start of each ([`Self::started`]'s
    /// running ones).
    ///
    /// # Errors
    /// If containerd does not answer or its processes' reports cannot be read.
    pub fn running(&self) -> anyhow::Result<Vec<Started>> {
        Ok(self.started()?.into_iter().filter(|s| s.running).collect())
    }
}

impl From<crate::cri::Created> for Started {
    fn from(c: crate::cri::Created) -> Self {
        Started {
            namespace: c.namespace,
            pod: c.pod,
            pod_uid: c.pod_uid,
            container: c.container,
            envs: c.envs,
            devices: c.devices.into_iter().map(|(_, path)| path).collect(),
            running: c.running,
        }
    }
}

impl Started {
    /// A start on containerd: what its process reported, and whether it runs now.
    fn reported(s: crate::probe::Seen, running: bool) -> Self {
        Started {
            namespace: s.namespace,
            pod: s.pod,
            pod_uid: s.pod_uid,
            container: s.container,
            envs: s.env,
            devices: s.devices.into_iter().map(|d| d.path).collect(),
            running,
        }
    }
}

/// The real cluster: control plane, extender, kube-scheduler, and the nodes added to it.
#[derive(Debug)]
pub struct RealCluster {
    /// etcd, kube-apiserver and kube-scheduler.
    pub plane: ControlPlane,
    /// The extender.
    pub extender: Proc,
    /// The extender's address.
    pub addr: SocketAddr,
    /// The extender's `/metrics` and `/inspect` (`[server] observe_listen`).
    pub observe: SocketAddr,
    /// The nodes, as [`Self::add_node`] added them.
    pub nodes: Vec<RealNode>,
    /// The container runtime each node added gets.
    pub runtime: Runtime,
    /// The NRI plugins containerd requires on each node added from now on (none by default;
    /// [`crate::containerd::Containerd::start`]).
    pub nri_required: Vec<String>,
    _temp: Option<tempfile::TempDir>,
}

impl RealCluster {
    /// Starts the control plane, applies `etc/kubernetes/gpushare-extender-rbac.yaml` and the
    /// admission policy ([`apply_admission_policy`]), starts the extender as
    /// `gpushare-extender` and kube-scheduler with `options.scheduler_config` calling it. No node
    /// yet.
    ///
    /// # Errors
    /// A component that cannot be built or started, or does not get ready, with its log.
    pub async fn up(options: &RealOptions) -> anyhow::Result<RealCluster> {
        let bin = realkube::binaries()?;
        let (dir, temp) = match &options.dir {
            Some(d) => {
                std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
                (d.clone(), None)
            }
            None => {
                let t = tempfile::Builder::new().prefix("gpushare-real.").tempdir()?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        let mut plane = ControlPlane::start(&dir, &bin)?;
        // The shipped RBAC: the extender's identity may read Nodes and Pods and bind Pods.
        plane.apply(&repo().join("etc/kubernetes/gpushare-extender-rbac.yaml"))?;
        // Kubernetes 1.29 has no ValidatingAdmissionPolicy v1: there gpushared's own check of
        // each grant against the pod's requests is what holds (docs/install.md).
        if plane.minor >= realkube::ADMISSION_POLICY_MINOR {
            apply_admission_policy(&plane)?;
        }
        let (mut extender, addr, observe) = start_extender(&plane, &options.extender_extra, "info")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while http_get(addr, "/readyz").await.is_none_or(|(s, _)| s != 200) {
            if let Some(status) = extender.exited() {
                bail!("the extender exited ({status}):\n{}", extender.log_tail(30));
            }
            if Instant::now() > deadline {
                bail!("the extender is not ready after 30 s:\n{}", extender.log_tail(30));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        plane.start_scheduler(
            &repo().join("etc/kube-scheduler").join(&options.scheduler_config),
            &format!("http://{addr}/gpushare-scheduler"),
        )?;
        Ok(RealCluster {
            plane,
            extender,
            addr,
            observe,
            nodes: Vec::new(),
            runtime: options.runtime,
            nri_required: Vec::new(),
            _temp: temp,
        })
    }

    /// The real-cluster box for a cluster file ([`crate::cluster::read_cluster`]): [`Self::up`]
    /// with the file's unit, then per node the real kubelet and gpushared on its simulated GPUs,
    /// each waited for until its kubelet reports the devices; GPUs the file marks unhealthy get
    /// their Xid from NVML and are waited for until gpushared publishes them so.
    ///
    /// # Errors
    /// A GPU marked cordoned (cordoning needs gpushared's D-Bus API, which this box does not
    /// run), or a component that does not start or get ready.
    pub async fn for_spec(spec: &ClusterSpec, options: &RealOptions) -> anyhow::Result<RealCluster> {
        if let Some(node) = spec.nodes.iter().find(|n| n.gpus.iter().any(|g| g.cordoned)) {
            bail!(
                "node {} has a cordoned GPU: cordoning goes through gpushared's D-Bus API, which the \
                 real-cluster box does not run; leave `cordoned` out, or use the demo without --real",
                node.name
            );
        }
        let mut options = options.clone();
        options.extender_extra =
            merge_toml(&format!("[resources]\nunit = \"{}\"\n", spec.unit), &options.extender_extra)?;
        let mut cluster = RealCluster::up(&options).await?;
        for node in &spec.nodes {
            let unit = node.unit.unwrap_or(spec.unit);
            cluster.add_node(&node.name, &fake_gpus(node), ("", &format!("[resources]\nunit = \"{unit}\"\n")))?;
        }
        for node in &spec.nodes {
            cluster.wait_devices(&node.name, Duration::from_secs(60))?;
        }
        let mut faulty = Vec::new();
        for node in &spec.nodes {
            for (i, gpu) in node.gpus.iter().flat_map(|g| (0..g.count).map(move |_| g)).enumerate() {
                if let Some(fault) = &gpu.unhealthy {
                    let xid = fault.trim().strip_prefix("Xid ").unwrap_or("79");
                    let events = &cluster.node(&node.name).context("a node just added")?.events;
                    nvml::inject(events, &format!("xid {i} {xid}"))?;
                    faulty.push((node.name.clone(), i));
                }
            }
        }
        for (node, i) in faulty {
            cluster.wait_gpu_health(&node, i, false, Duration::from_secs(30))?;
        }
        Ok(cluster)
    }

    /// Adds node `name`: the recording runtime, the real kubelet (registered and Ready), and
    /// gpushared as that node on `gpus`. `extra` is (fake NVML directives, further
    /// gpushared.toml text). Does not wait for the device plugin: see
    /// [`Self::wait_allocatable`].
    ///
    /// # Errors
    /// A component that does not start, with its log.
    pub fn add_node(&mut self, name: &str, gpus: &[FakeGpu], extra: (&str, &str)) -> anyhow::Result<&mut RealNode> {
        self.add_node_with_gates(name, gpus, extra, DEFAULT_GATES)
    }

    /// [`Self::add_node`] with the kubelet's feature gates `gates`.
    ///
    /// # Errors
    /// A component that does not start, with its log.
    pub fn add_node_with_gates(
        &mut self,
        name: &str,
        gpus: &[FakeGpu],
        extra: (&str, &str),
        gates: &[(&str, bool)],
    ) -> anyhow::Result<&mut RealNode> {
        let host = self.plane.dir.join(name);
        let (runtime, cri_proxy, endpoint) = self.node_runtime(name, &host)?;
        let kubelet = RealKubelet::start_with_gates(&self.plane, name, &host, &endpoint, gates)?;
        let events = host.join("nvml-events");
        let nvml_extra = format!("{}{}", nvml::events_directive(&events), extra.0);
        // On a real runtime the node has the driver's device nodes, as a GPU host does, and
        // gpushared names them to the runtime (`[device_nodes]`): each container gets its GPUs'.
        // gpushared also joins containerd's NRI as a plugin (`[nri]`). The recording runtime
        // serves NRI on a socket of the same name ([`crate::recording_nri`]), which gpushared
        // joins where the node's configuration enables `[nri]`.
        let nri = host.join("cri").join(crate::containerd::NRI_SOCKET);
        let mut config_extra = merge_toml(&format!("[nri]\nsocket = \"{}\"\n", nri.display()), extra.1)?;
        if runtime.containerd().is_some() {
            let dev = host.join("dev");
            nvml::make_device_nodes(&dev, gpus)?;
            config_extra = merge_toml(
                &format!(
                    "[device_nodes]\nenabled = true\nhost_dir = \"{}\"\n[nri]\nenabled = true\nsocket = \"{}\"\n",
                    dev.display(),
                    nri.display()
                ),
                &config_extra,
            )?;
        }
        let daemon = start_gpushared(
            &self.plane,
            name,
            &host.join("gpushared"),
            (&kubelet.dirs.device_plugins(), &kubelet.dirs.pod_resources()),
            gpus,
            (&nvml_extra, &config_extra),
        )?;
        self.nodes.push(RealNode { name: name.to_owned(), host, runtime, cri_proxy, kubelet, daemon, events });
        self.nodes.last_mut().context("the node just added")
    }

    /// gpushared.toml text that serves the GPUs `indexes` of the node `name` (not added yet)
    /// through DRA, with its sockets where that node's kubelet looks and its CDI specs where the
    /// node's runtime reads them (docs/dra.md).
    #[must_use]
    pub fn dra_config(&self, name: &str, indexes: &[u32]) -> String {
        let host = self.plane.dir.join(name);
        let indexes: Vec<String> = indexes.iter().map(u32::to_string).collect();
        format!(
            "[sharing]\ndra = [{}]\n[dra]\nregistry_dir = \"{}\"\nplugin_dir = \"{}\"\ncdi_dir = \"{}\"\n",
            indexes.join(", "),
            KubeletDirs::under(&host).root.join("plugins_registry").display(),
            host.join("dra-plugin").display(),
            host.join("cri").join(crate::cri::CDI_DIR).display(),
        )
    }

    /// The node called `name`.
    #[must_use]
    pub fn node(&self, name: &str) -> Option<&RealNode> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The node's allocatable `resource`, as its kubelet reports it (empty when none).
    ///
    /// # Errors
    /// If kubectl fails.
    pub fn allocatable(&self, node: &str, resource: &str) -> anyhow::Result<String> {
        let path = format!("jsonpath={{.status.allocatable.{}}}", resource.replace('.', "\\."));
        Ok(self.plane.kubectl(&["get", "node", node, "-o", &path])?.trim().to_owned())
    }

    /// Waits until `node`'s kubelet reports `amount` of `resource` allocatable.
    ///
    /// # Errors
    /// On timeout, with the ends of gpushared's and the kubelet's logs.
    pub fn wait_allocatable(&self, node: &str, resource: &str, amount: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let now = self.allocatable(node, resource)?;
            if now == amount {
                return Ok(());
            }
            if Instant::now() > deadline {
                let logs = self.node(node).map_or_else(String::new, |n| {
                    format!("\ngpushared:\n{}\nkubelet:\n{}", n.daemon.log_tail(30), n.kubelet.proc.log_tail(30))
                });
                bail!("node {node}'s kubelet reports {now:?} of {resource}, not {amount}, after {timeout:?}{logs}");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Waits until `node`'s kubelet reports some of gpushare's devices (GPU memory or whole
    /// GPUs) allocatable.
    ///
    /// # Errors
    /// On timeout, with the ends of gpushared's and the kubelet's logs.
    pub fn wait_devices(&self, node: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let some = |r: &str| self.allocatable(node, r).is_ok_and(|a| !a.is_empty() && a != "0");
            if some("gpushare.io/gpu-mem") || some("gpushare.io/gpu") || some("aliyun.com/gpu-mem") {
                return Ok(());
            }
            if Instant::now() > deadline {
                let logs = self.node(node).map_or_else(String::new, |n| {
                    format!("\ngpushared:\n{}\nkubelet:\n{}", n.daemon.log_tail(30), n.kubelet.proc.log_tail(30))
                });
                bail!("node {node}'s kubelet reports none of gpushare's devices after {timeout:?}{logs}");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The node state `node`'s gpushared published, decoded.
    ///
    /// # Errors
    /// If kubectl fails, or the node has no (valid) annotation.
    pub fn node_state(&self, node: &str) -> anyhow::Result<NodeState> {
        let path = format!("jsonpath={{.metadata.annotations.{}}}", NODE_STATE_KEY.replace('.', "\\."));
        let value = self.plane.kubectl(&["get", "node", node, "-o", &path])?;
        if value.trim().is_empty() {
            bail!("node {node} has no {NODE_STATE_KEY} annotation");
        }
        Ok(NodeState::decode(value.trim())?)
    }

    /// Waits until `node`'s gpushared publishes GPU `index` as healthy (or not).
    ///
    /// # Errors
    /// On timeout.
    pub fn wait_gpu_health(&self, node: &str, index: usize, healthy: bool, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(state) = self.node_state(node)
                && state.inventory.gpus().get(index).is_some_and(|g| g.health.is_healthy() == healthy)
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                let state = if healthy { "healthy" } else { "unhealthy" };
                bail!("node {node} GPU {index} is not published {state} after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Makes namespace `ns` ready for pods as kube-controller-manager would (none runs here):
    /// the namespace, its `default` service account and its `kube-root-ca.crt` config map, which
    /// the kubelet mounts into pods with a service-account token.
    ///
    /// # Errors
    /// If kubectl fails for another reason than the object being there already.
    pub fn prepare_namespace(&self, ns: &str) -> anyhow::Result<()> {
        let ca = std::fs::read_to_string(self.plane.pki.ca()).context("reading the cluster's CA")?;
        let objects = [
            serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
            serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": "default", "namespace": ns}}),
            serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "kube-root-ca.crt", "namespace": ns}, "data": {"ca.crt": ca}}),
        ];
        for object in objects {
            if let Err(e) = self.plane.create(&object)
                && !format!("{e:#}").contains("AlreadyExists")
            {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Runs `kubectl-inspect-gpushare` with `args` as the administrator.
    ///
    /// # Errors
    /// If it cannot run or fails.
    pub fn inspect(&self, args: &[&str]) -> anyhow::Result<String> {
        crate::cluster::inspect(&Binaries::beside_current_exe()?.inspect, &self.plane.admin, args)
    }

    /// Reboots the node `name` as a power cut and a boot would. Its kubelet, gpushared and
    /// container runtime are killed; what a host keeps in tmpfs is lost (the runtime's sandboxes
    /// and containers, and the CDI specs: everything under `/run`), and its state directories
    /// are kept (the kubelet's checkpoints and gpushared's ledger: `/var/lib`). `while_down`
    /// runs with the node down. The node then starts in the order systemd gives it: the
    /// runtime, gpushared (`gpushared.service` is ordered before `kubelet.service`), then the
    /// kubelet, waited for until it reports the node Ready.
    ///
    /// # Errors
    /// An unknown node, what `while_down` returns, or a component that does not come back.
    pub fn reboot(
        &mut self,
        name: &str,
        while_down: impl FnOnce(&ControlPlane) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let node = self.nodes.iter_mut().find(|n| n.name == name).with_context(|| format!("no node {name}"))?;
        node.kubelet.halt();
        node.daemon.kill();
        node.runtime.halt()?;
        let cdi = node.host.join("cri").join(crate::cri::CDI_DIR);
        match std::fs::remove_dir_all(&cdi) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("emptying {}", cdi.display())),
        }
        while_down(&self.plane)?;
        // tmpfiles.d/gpushared.conf makes the CDI directory again at boot.
        std::fs::create_dir_all(&cdi).with_context(|| format!("creating {}", cdi.display()))?;
        node.runtime.boot()?;
        node.daemon.start()?;
        node.kubelet.boot(&self.plane)
    }

    /// Node `name`'s container runtime, as its kubelet reaches it: (the runtime, the
    /// `cri-proxy` in front of it if any, the kubelet's `containerRuntimeEndpoint`).
    ///
    /// containerd ([`Runtime::Containerd`], with a kubelet of 1.30 or later) serves
    /// `host/cri/containerd.sock` and reads the CDI specs of `host/cri/cdi`. The recording runtime serves `host/cri/cri.sock`; for a kubelet
    /// older than 1.31, which sends the socket's path as the HTTP/2 authority (the recording
    /// runtime refuses it), it serves `host/cri/runtime.sock` behind `cri-proxy` (built with the
    /// components) on `host/cri/cri.sock`.
    ///
    /// # Errors
    /// If a socket cannot be bound or the runtime or the proxy does not start.
    pub fn node_runtime(&self, name: &str, host: &Path) -> anyhow::Result<(NodeRuntime, Option<Proc>, String)> {
        let plane = &self.plane;
        // A kubelet before 1.30 writes pod logs to the machine's /var/log/pods and removes the
        // log folders of pods it does not know, other nodes' among them: their processes'
        // reports could not be read back, so such a node runs on the recording runtime.
        if self.runtime == Runtime::Containerd && plane.minor >= POD_LOGS_DIR_MINOR {
            let cri = host.join("cri");
            let containerd = Containerd::start(plane, name, &cri, &cri.join(crate::cri::CDI_DIR), &self.nri_required)?;
            let endpoint = containerd.endpoint();
            return Ok((NodeRuntime::Containerd(containerd), None, endpoint));
        }
        let socket = host.join("cri/cri.sock");
        if plane.minor >= CRI_AUTHORITY_MINOR {
            let runtime = RecordingRuntime::serve(&socket)?;
            let endpoint = runtime.endpoint();
            return Ok((NodeRuntime::Recording(runtime), None, endpoint));
        }
        let runtime = RecordingRuntime::serve(&host.join("cri/runtime.sock"))?;
        let proxy = plane.spawn(
            &format!("cri-proxy-{name}"),
            &plane.bin.join("cri-proxy"),
            vec![socket.display().to_string(), host.join("cri/runtime.sock").display().to_string()],
            vec![],
        )?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            if Instant::now() > deadline {
                bail!("cri-proxy did not listen on {} within 10 s:\n{}", socket.display(), proxy.log_tail(10));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok((NodeRuntime::Recording(runtime), Some(proxy), format!("unix://{}", socket.display())))
    }

    /// Stops everything: kube-scheduler and the extender, each node's gpushared (SIGTERM) and
    /// kubelet, then the API server and etcd.
    pub fn shutdown(&mut self) {
        if let Some(s) = self.plane.scheduler.as_mut() {
            s.stop(Duration::from_secs(2));
        }
        self.extender.stop(Duration::from_secs(2));
        for n in &mut self.nodes {
            n.daemon.stop(Duration::from_secs(5));
            n.kubelet.proc.stop(Duration::from_secs(5));
        }
        self.plane.apiserver.stop(Duration::from_secs(5));
        self.plane.etcd.stop(Duration::from_secs(5));
    }
}

/// The first minor version whose kubelet reaches a CRI runtime with the HTTP/2 authority
/// `localhost`; older ones send the socket's path, which the recording runtime refuses.
const CRI_AUTHORITY_MINOR: u32 = 31;

/// Applies the shipped `etc/kubernetes/gpushare-admission-policy.yaml` and waits until the API
/// server enforces it (it loads policies asynchronously): until a server-side dry run of a pod
/// with a GPU count and no memory is refused.
///
/// # Errors
/// If it cannot be applied, or is not in force after 60 s.
pub fn apply_admission_policy(plane: &ControlPlane) -> anyhow::Result<()> {
    plane.apply(&repo().join("etc/kubernetes/gpushare-admission-policy.yaml"))?;
    let probe = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "gpushare-admission-probe", "namespace": "default"},
        "spec": {"containers": [{"name": "probe", "image": "registry.example/probe:1",
                                 "resources": {"limits": {"gpushare.io/gpu-count": "1"}}}]}});
    let file = plane.dir.join("gpushare-admission-probe.json");
    std::fs::write(&file, probe.to_string())?;
    let file = file.display().to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match plane.kubectl(&["create", "--dry-run=server", "-f", &file]) {
            Err(e) if format!("{e:#}").contains("gpushare-requests") => return Ok(()),
            _ if Instant::now() > deadline => bail!("the admission policy is not in force after 60 s"),
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// Starts the extender against `plane` as `gpushare-extender` (its own client certificate, the
/// shipped cluster role's rights) on a free port, with `extra` added to its configuration and
/// `RUST_LOG` set to `log_filter`. Returns it and its address; it may not be ready yet.
///
/// # Errors
/// If its certificate or configuration cannot be written, or it cannot be started.
pub fn start_extender(
    plane: &ControlPlane,
    extra: &str,
    log_filter: &str,
) -> anyhow::Result<(Proc, SocketAddr, SocketAddr)> {
    start_extender_named(plane, "extender", extra, log_filter)
}

/// [`start_extender`] for one more extender, called `name` in the logs (its configuration
/// `gpushare-<name>.toml`), as the extender beside another control-plane host's kube-scheduler.
///
/// # Errors
/// As [`start_extender`].
pub fn start_extender_named(
    plane: &ControlPlane,
    name: &str,
    extra: &str,
    log_filter: &str,
) -> anyhow::Result<(Proc, SocketAddr, SocketAddr)> {
    let ours = Binaries::beside_current_exe()?;
    let kubeconfig = plane.pki.kubeconfig(&plane.server, "gpushare-extender", &[])?;
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let observe = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let config = plane.dir.join(format!("gpushare-{name}.toml"));
    let base = format!(
        "[server]\nlisten = \"{addr}\"\nobserve_listen = \"{observe}\"\n[kubernetes]\nkubeconfig = \"{}\"\n",
        kubeconfig.display()
    );
    std::fs::write(&config, merge_toml(&base, extra)?).with_context(|| format!("writing {}", config.display()))?;
    let extender = plane.spawn(
        name,
        &ours.extender,
        vec!["--config".into(), config.display().to_string()],
        vec![("RUST_LOG".into(), log_filter.into())],
    )?;
    Ok((extender, addr, observe))
}

/// Starts gpushared as `node` (its own `system:node:` certificate) on fake GPUs, against the
/// kubelet whose device plugins live in `plugin_dir` and whose PodResources socket is
/// `pod_resources`; its ledger, configuration and fake NVML library under `host`. `extra` is
/// (fake NVML directives, gpushared.toml text merged over the generated file).
///
/// # Errors
/// If the fake library cannot be built, a file cannot be written, or it cannot be started.
pub fn start_gpushared(
    plane: &ControlPlane,
    node: &str,
    host: &Path,
    dirs: (&Path, &Path),
    gpus: &[FakeGpu],
    extra: (&str, &str),
) -> anyhow::Result<Proc> {
    let files = GpusharedFiles::write(plane, node, host, dirs, gpus, extra)?;
    files.spawn(plane, node)
}

/// What gpushared runs from on a box node: its configuration and the fake NVML library's.
#[derive(Clone, Debug)]
pub struct GpusharedFiles {
    /// gpushared.toml.
    pub config: PathBuf,
    /// The fake NVML library's configuration.
    pub nvml_config: PathBuf,
}

impl GpusharedFiles {
    /// Builds the fake NVML library into `host` and writes both configurations, as
    /// [`start_gpushared`] starts gpushared with.
    ///
    /// # Errors
    /// If the fake library cannot be built or a file cannot be written.
    pub fn write(
        plane: &ControlPlane,
        node: &str,
        host: &Path,
        (plugin_dir, pod_resources): (&Path, &Path),
        gpus: &[FakeGpu],
        (nvml_extra, config_extra): (&str, &str),
    ) -> anyhow::Result<GpusharedFiles> {
        std::fs::create_dir_all(host).with_context(|| format!("creating {}", host.display()))?;
        let library = nvml::build(host)?;
        let nvml_config = host.join("fake-nvml.conf");
        nvml::write_config(&nvml_config, gpus, nvml_extra)?;
        let node_kubeconfig = plane.pki.kubeconfig(&plane.server, &format!("system:node:{node}"), &["system:nodes"])?;
        let base = format!(
            "node_name = \"{node}\"\n[kubelet]\ndevice_plugin_dir = \"{}\"\npod_resources_socket = \"{}\"\n\
             [ledger]\npath = \"{}\"\n[kubernetes]\nkubeconfig = \"{}\"\n[nvml]\nlibrary = \"{}\"\n[dbus]\nenabled = false\n",
            plugin_dir.display(),
            pod_resources.display(),
            host.join("ledger.db").display(),
            node_kubeconfig.display(),
            library.display()
        );
        let config = host.join("gpushared.toml");
        std::fs::write(&config, merge_toml(&base, config_extra)?)
            .with_context(|| format!("writing {}", config.display()))?;
        Ok(GpusharedFiles { config, nvml_config })
    }

    /// Runs `gpushared --check-config` on the configuration, as an operator does before enabling
    /// the unit: its report.
    ///
    /// # Errors
    /// If it cannot run, or finds the configuration or the host unusable (with its report).
    pub fn check(&self) -> anyhow::Result<String> {
        let ours = Binaries::beside_current_exe()?;
        let out = std::process::Command::new(&ours.gpushared)
            .arg("--check-config")
            .arg(&self.config)
            .env("FAKE_NVML_CONFIG", &self.nvml_config)
            .output()
            .with_context(|| format!("running {} --check-config", ours.gpushared.display()))?;
        let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if !out.status.success() {
            bail!("gpushared --check-config {} failed ({}):\n{report}", self.config.display(), out.status);
        }
        Ok(report)
    }

    /// Starts gpushared as `node` on these files, logging at `info` (or as
    /// `GPUSHARE_BOX_DAEMON_LOG` says: a `RUST_LOG` filter).
    ///
    /// # Errors
    /// If it cannot be started.
    pub fn spawn(&self, plane: &ControlPlane, node: &str) -> anyhow::Result<Proc> {
        let ours = Binaries::beside_current_exe()?;
        plane.spawn(
            &format!("gpushared-{node}"),
            &ours.gpushared,
            vec!["--config".into(), self.config.display().to_string()],
            vec![
                ("RUST_LOG".into(), std::env::var("GPUSHARE_BOX_DAEMON_LOG").unwrap_or_else(|_| "info".into())),
                ("FAKE_NVML_CONFIG".into(), self.nvml_config.display().to_string()),
            ],
        )
    }
}

/// `extra` laid over `base` (both TOML): its tables merged into those of `base` key by key, so
/// an extra `[kubernetes]` (gpushared) or `[resources]` (the extender) section adds to the one
/// `base` has rather than repeating it.
///
/// # Errors
/// Either text is not TOML.
pub fn merge_toml(base: &str, extra: &str) -> anyhow::Result<String> {
    fn merge(into: &mut toml::Table, from: toml::Table) {
        for (key, value) in from {
            match (into.get_mut(&key), value) {
                (Some(toml::Value::Table(old)), toml::Value::Table(new)) => merge(old, new),
                (_, value) => {
                    into.insert(key, value);
                }
            }
        }
    }
    let mut table: toml::Table = base.parse().context("the generated configuration")?;
    merge(&mut table, extra.parse().with_context(|| format!("the extra configuration text {extra:?}"))?);
    Ok(toml::to_string(&table)?)
}
