//! The cluster in a box as processes: the API-server stand-in, per node a kubelet stand-in and
//! the real `gpushared` on the fake NVML library (and, when `dbus-daemon` is installed, a
//! private bus so `gpusharectl` works), the real `gpushare-extender`, and the kube-scheduler
//! stand-in — each its own process, with its log in `<dir>/logs/`. Used by `gpushare-box demo`
//! and by the end-to-end and fault suites.
//!
//! The binaries are looked up beside the running executable (`target/<profile>/`, or its parent
//! for a test in `deps/`): `cargo build --bins` builds them all.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};

use crate::invariants::Report;
use crate::node::{Record, live_admissions};
use crate::nvml::{self, FakeGpu};
use crate::ports::free_port;

use gpushare_core::MemoryUnit;
pub use gpushare_extender::simulate::{ClusterSpec, GpuSpec, NodeSpec};

/// Reads a cluster file (`examples/cluster.yaml`: the simulator's format, docs/simulate.md).
///
/// # Errors
/// If it cannot be read or is not a cluster file.
pub fn read_cluster(path: &Path) -> anyhow::Result<ClusterSpec> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let spec = gpushare_extender::simulate::parse_cluster(&text).with_context(|| format!("{}", path.display()))?;
    if spec.nodes.is_empty() {
        bail!("{} has no nodes", path.display());
    }
    Ok(spec)
}

/// `n` nodes `node-00`…, each with `gpus` GPUs of `memory_mib`.
#[must_use]
pub fn uniform_cluster(n: usize, gpus: u32, memory_mib: u64, unit: MemoryUnit) -> ClusterSpec {
    ClusterSpec {
        unit,
        nodes: (0..n)
            .map(|i| NodeSpec {
                name: format!("node-{i:02}"),
                address: String::new(),
                unit: None,
                gpus: vec![GpuSpec {
                    model: "Tesla T4".into(),
                    memory_mib,
                    count: gpus,
                    unhealthy: None,
                    cordoned: false,
                }],
            })
            .collect(),
    }
}

/// Reads the pods of a multi-document YAML workload file (other kinds are refused).
///
/// # Errors
/// If it cannot be read or a document is not a Pod.
pub fn read_workload(path: &Path) -> anyhow::Result<Vec<Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let docs =
        gpushare_extender::simulate::parse_documents::<Value>(&text).with_context(|| format!("{}", path.display()))?;
    let mut pods = Vec::new();
    for (doc, value) in docs {
        if value.get("kind").and_then(Value::as_str) != Some("Pod") {
            bail!("{} document {doc}: only Pods are applied", path.display());
        }
        pods.push(value);
    }
    Ok(pods)
}

/// Where the binaries are.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// `gpushare-box` (the stand-ins).
    pub stand_ins: PathBuf,
    /// `gpushared`.
    pub gpushared: PathBuf,
    /// `gpushare-extender`.
    pub extender: PathBuf,
    /// `kubectl-inspect-gpushare`.
    pub inspect: PathBuf,
    /// `gpusharectl`.
    pub gpusharectl: PathBuf,
}

impl Binaries {
    /// The binaries beside the running executable (`target/<profile>/`; from a test binary in
    /// `target/<profile>/deps/`, its parent).
    ///
    /// # Errors
    /// If one is missing: the message says to build them.
    pub fn beside_current_exe() -> anyhow::Result<Binaries> {
        let exe = std::env::current_exe().context("finding the running executable")?;
        let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
        if dir.file_name().is_some_and(|n| n == "deps") {
            dir.pop();
        }
        let find = |name: &str| -> anyhow::Result<PathBuf> {
            let path = dir.join(name);
            if path.is_file() {
                Ok(path)
            } else {
                bail!("{} is missing: build every binary first (cargo build --bins)", path.display())
            }
        };
        Ok(Binaries {
            stand_ins: find("gpushare-box")?,
            gpushared: find("gpushared")?,
            extender: find("gpushare-extender")?,
            inspect: find("kubectl-inspect-gpushare")?,
            gpusharectl: find("gpusharectl")?,
        })
    }
}

/// How to bring the box up.
#[derive(Debug, Clone)]
pub struct Options {
    /// The state directory (kept); `None`: a temporary one, removed on drop.
    pub dir: Option<PathBuf>,
    /// Start a private `dbus-daemon` per node when one is installed.
    pub dbus: bool,
    /// `RUST_LOG` for the processes.
    pub log_filter: String,
    /// Extra TOML for every `gpushared.toml` (sections allowed).
    pub daemon_extra: String,
    /// The scheduler stand-in's initial backoff, milliseconds.
    pub scheduler_backoff_ms: u64,
    /// The kubelet stand-ins report each allocated device's health in pod status (the
    /// kubelet's `ResourceHealthStatus` gate, which docs/install.md asks to turn off).
    pub kubelet_resource_health: bool,
    /// The daemons reach the API server through a relay that holds back its answers this
    /// long ([`crate::lag`]), while the kubelets connect directly: their pod watches lag
    /// behind the kubelets'.
    pub daemon_api_lag: Option<Duration>,
    /// The extender and the scheduler stand-in reach the API server through such a relay:
    /// their views of the nodes lag behind the API server's.
    pub deciders_api_lag: Option<Duration>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            dir: None,
            dbus: true,
            log_filter: "info".into(),
            daemon_extra: String::new(),
            scheduler_backoff_ms: 1000,
            kubelet_resource_health: false,
            daemon_api_lag: None,
            deciders_api_lag: None,
        }
    }
}

/// A child process of the box, restartable, killed on drop.
#[derive(Debug)]
pub struct Proc {
    /// Its name in the logs directory.
    pub name: String,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
    /// How many times it was started.
    pub starts: usize,
}

impl Proc {
    pub(crate) fn spawn(
        name: &str,
        program: &Path,
        args: Vec<String>,
        env: Vec<(String, String)>,
        logs: &Path,
    ) -> anyhow::Result<Proc> {
        let mut p = Proc {
            name: name.into(),
            program: program.into(),
            args,
            env,
            log: logs.join(format!("{name}.log")),
            child: None,
            starts: 0,
        };
        p.start()?;
        Ok(p)
    }

    /// Starts it (again, after [`Self::kill`]) with the same arguments, its log appended to.
    ///
    /// # Errors
    /// If it cannot be started.
    pub fn start(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args).stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        self.child = Some(cmd.spawn().with_context(|| format!("starting {}", self.program.display()))?);
        self.starts += 1;
        Ok(())
    }

    /// The process id, while running.
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends a signal by name (`KILL`, `TERM`, `HUP`, `USR1`) with kill(1).
    ///
    /// # Errors
    /// If it is not running or kill fails.
    pub fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let pid = self.pid().context("not running")?;
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .stderr(Stdio::null())
            .status()
            .context("running kill")?;
        if !status.success() {
            bail!("kill -{signal} {pid} failed");
        }
        Ok(())
    }

    /// The last `lines` lines of its log.
    #[must_use]
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log(), lines)
    }

    /// SIGKILLs it and waits.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERMs it and waits up to `timeout`, then SIGKILLs.
    pub fn stop(&mut self, timeout: Duration) {
        if self.signal("TERM").is_ok() {
            let deadline = Instant::now() + timeout;
            while Instant::now() < deadline {
                if self.child.as_mut().is_none_or(|c| c.try_wait().ok().flatten().is_some()) {
                    self.child = None;
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.kill();
    }

    /// SIGKILLs it and starts it again with the same arguments.
    ///
    /// # Errors
    /// If it cannot be started.
    pub fn kill_and_restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.start()
    }

    /// Whether it exited (and how).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// Its log so far.
    #[must_use]
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One node of the box.
#[derive(Debug)]
pub struct BoxNode {
    /// Its spec.
    pub spec: NodeSpec,
    /// Its directory.
    pub dir: PathBuf,
    /// The kubelet stand-in.
    pub kubelet: Proc,
    /// `gpushared`.
    pub daemon: Proc,
    /// Its private bus, if any.
    pub bus: Option<Proc>,
    /// The bus address for `gpusharectl --address`.
    pub bus_address: Option<String>,
    /// The fake NVML event file.
    pub events: PathBuf,
    /// The kubelet stand-in's record file.
    pub record: PathBuf,
}

impl BoxNode {
    /// Injects a fake NVML event (`xid 0 79`, `recover 0`, ...).
    ///
    /// # Errors
    /// If the event file cannot be written.
    pub fn inject(&self, line: &str) -> anyhow::Result<()> {
        nvml::inject(&self.events, line)
    }

    /// The admissions in force on this node, by pod UID.
    #[must_use]
    pub fn admissions(&self) -> BTreeMap<String, Record> {
        live_admissions(&self.record)
    }
}

/// The running box.
pub struct Cluster {
    /// The state directory.
    pub dir: PathBuf,
    _temp: Option<tempfile::TempDir>,
    /// The binaries.
    pub bin: Binaries,
    /// The kubeconfig for the API server.
    pub kubeconfig: PathBuf,
    /// The API server's URL.
    pub api_url: String,
    /// The API-server stand-in.
    pub apiserver: Proc,
    /// The nodes.
    pub nodes: Vec<BoxNode>,
    /// The extender.
    pub extender: Proc,
    /// The extender's address (kube-scheduler's verbs).
    pub extender_addr: SocketAddr,
    /// The extender's `/metrics` and `/inspect` (`[server] observe_listen`).
    pub extender_observe: SocketAddr,
    /// The scheduler stand-in.
    pub scheduler: Proc,
    /// The cluster unit.
    pub unit: String,
    client: kube::Client,
    /// The relays the daemons' and the deciders' API connections go through, if they lag.
    _lag: [Option<crate::lag::Lag>; 2],
}

impl Cluster {
    /// Starts everything and waits until every node's daemon has published its GPUs and the
    /// extender is ready.
    ///
    /// # Errors
    /// A process that does not start or get ready in time, with the end of its log.
    pub async fn up(spec: &ClusterSpec, options: &Options) -> anyhow::Result<Cluster> {
        let bin = Binaries::beside_current_exe()?;
        let (dir, temp) = match &options.dir {
            Some(d) => {
                std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
                (d.clone(), None)
            }
            None => {
                let t = tempfile::Builder::new().prefix("gpushare-box.").tempdir()?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs)?;
        // `GPUSHARE_BOX_NVML`: a real NVML library (on a GPU host) instead of the simulated one;
        // the daemons then serve the host's own GPUs, whatever the cluster file says of them.
        let library = match std::env::var_os("GPUSHARE_BOX_NVML") {
            Some(real) => PathBuf::from(real),
            None => nvml::build(&dir)?,
        };
        let env = vec![("RUST_LOG".to_owned(), options.log_filter.clone())];

        // The API server.
        let kubeconfig = dir.join("kubeconfig");
        let _ = std::fs::remove_file(&kubeconfig);
        let mut apiserver = Proc::spawn(
            "apiserver",
            &bin.stand_ins,
            vec![
                "apiserver".into(),
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--kubeconfig-out".into(),
                path(&kubeconfig),
            ],
            env.clone(),
            &logs,
        )?;
        wait_for(&mut apiserver, Duration::from_secs(20), "the API server", || kubeconfig.is_file())?;
        let (client, api_url) = client_from_kubeconfig(&kubeconfig)?;
        let (lag, daemon_kubeconfig) = match options.daemon_api_lag {
            Some(delay) => {
                let (lag, path) = lagging(&dir, "kubeconfig-lagging", &kubeconfig, &api_url, delay).await?;
                (Some(lag), path)
            }
            None => (None, kubeconfig.clone()),
        };
        let (deciders_lag, deciders_kubeconfig) = match options.deciders_api_lag {
            Some(delay) => {
                let (lag, path) = lagging(&dir, "kubeconfig-deciders-lagging", &kubeconfig, &api_url, delay).await?;
                (Some(lag), path)
            }
            None => (None, kubeconfig.clone()),
        };

        let dbus_daemon = if options.dbus { which("dbus-daemon") } else { None };
        let mut nodes = Vec::new();
        for (i, node) in spec.nodes.iter().enumerate() {
            let kubeconfigs = (kubeconfig.as_path(), daemon_kubeconfig.as_path());
            nodes.push(start_node(&bin, &dir, &library, kubeconfigs, spec, node, i, options, dbus_daemon.as_deref())?);
        }

        // The extender and the scheduler.
        let port = free_port()?;
        let extender_addr = SocketAddr::from(([127, 0, 0, 1], port));
        let extender_observe = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let extender_config = dir.join("gpushare-extender.toml");
        std::fs::write(
            &extender_config,
            format!(
                "[server]\nlisten = \"{extender_addr}\"\nobserve_listen = \"{extender_observe}\"\n[kubernetes]\nkubeconfig = \"{}\"\n[resources]\nunit = \"{}\"\n",
                deciders_kubeconfig.display(),
                spec.unit
            ),
        )?;
        let extender = Proc::spawn(
            "extender",
            &bin.extender,
            vec!["--config".into(), path(&extender_config)],
            env.clone(),
            &logs,
        )?;
        let scheduler = Proc::spawn(
            "scheduler",
            &bin.stand_ins,
            vec![
                "scheduler".into(),
                "--kubeconfig".into(),
                path(&deciders_kubeconfig),
                "--extender".into(),
                format!("http://{extender_addr}/gpushare-scheduler"),
                "--initial-backoff-ms".into(),
                options.scheduler_backoff_ms.to_string(),
                "--nodes-file".into(),
                path(&dir.join(SCHEDULER_NODES_FILE)),
            ],
            env,
            &logs,
        )?;
        let mut cluster = Cluster {
            dir,
            _temp: temp,
            bin,
            kubeconfig,
            api_url,
            apiserver,
            nodes,
            extender,
            extender_addr,
            extender_observe,
            scheduler,
            unit: spec.unit.to_string(),
            client,
            _lag: [lag, deciders_lag],
        };
        cluster.wait_ready(Duration::from_secs(60)).await?;
        // GPUs the cluster file marks unhealthy get that fault from NVML, once their daemon
        // watches for events.
        let mut faulty = Vec::new();
        for node in &spec.nodes {
            for (i, gpu) in node.gpus.iter().flat_map(|g| (0..g.count).map(move |_| g)).enumerate() {
                if let Some(fault) = &gpu.unhealthy {
                    let xid = fault.trim().strip_prefix("Xid ").unwrap_or("79");
                    cluster.node(&node.name).context("node")?.inject(&format!("xid {i} {xid}"))?;
                    faulty.push((node.name.clone(), i));
                }
            }
        }
        for (node, i) in faulty {
            cluster.wait_gpu_health(&node, i, false, Duration::from_secs(20)).await?;
        }
        // GPUs the cluster file marks cordoned are cordoned as an operator would.
        let mut cordoned = Vec::new();
        for node in &spec.nodes {
            for (i, gpu) in node.gpus.iter().flat_map(|g| (0..g.count).map(move |_| g)).enumerate() {
                if gpu.cordoned {
                    cluster.cordon(&node.name, i)?;
                    cordoned.push((node.name.clone(), i));
                }
            }
        }
        for (node, i) in cordoned {
            cluster.wait_gpu_published(&node, i, "cordoned", |g| g.cordoned, Duration::from_secs(20)).await?;
        }
        // The faults and cordons are published: ready again once both views hold them.
        cluster.wait_ready(Duration::from_secs(60)).await?;
        Ok(cluster)
    }

    /// A kube client for the API server.
    #[must_use]
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// The node named `name`.
    #[must_use]
    pub fn node(&self, name: &str) -> Option<&BoxNode> {
        self.nodes.iter().find(|n| n.spec.name == name)
    }

    /// Waits until every node's daemon published its state and its kubelet its capacity, and
    /// both deciders see the node as the API server shows it: the extender's view holds the
    /// node's GPUs as its annotation has them (count, health, cordons), and the scheduler's
    /// view holds the node at its `resourceVersion` or later. A workload applied at once is
    /// then tried against every node as it is, not against an older view of one (a pod that
    /// misses its node there waits out a backoff, and a later pod can take its GPU).
    ///
    /// # Errors
    /// On timeout, naming what is missing.
    pub async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let nodes: Api<Node> = Api::all(self.client.clone());
        let resource = "gpushare.io/gpu-mem";
        loop {
            let mut missing = Vec::new();
            let scheduler_view = scheduler_node_versions(&self.dir.join(SCHEDULER_NODES_FILE));
            match nodes.list(&ListParams::default()).await {
                Ok(list) => {
                    for n in &self.nodes {
                        let name = &n.spec.name;
                        let found = list.items.iter().find(|x| x.metadata.name.as_deref() == Some(name));
                        let state = found
                            .and_then(|x| x.metadata.annotations.as_ref())
                            .and_then(|a| a.get(NODE_STATE_KEY))
                            .and_then(|v| NodeState::decode(v).ok());
                        // A kubelet reports the resource at 0 once the plugin registers, before
                        // its device list arrives (the real kubelet does too): not ready yet.
                        let capacity = found
                            .and_then(|x| x.status.as_ref())
                            .and_then(|s| s.allocatable.as_ref())
                            .and_then(|a| a.get(resource))
                            .is_some_and(|q| q.0.parse::<u64>().is_ok_and(|n| n > 0));
                        let Some(state) = state.filter(|_| capacity) else {
                            missing.push(format!("node {name} (no state annotation, or no capacity yet)"));
                            continue;
                        };
                        if !self.extender_sees(name, &state).await {
                            missing.push(format!("the extender's view of node {name}"));
                        }
                        let listed = found.and_then(|x| x.metadata.resource_version.as_deref());
                        if !caught_up(scheduler_view.get(name).map(String::as_str), listed) {
                            missing.push(format!("the scheduler's view of node {name}"));
                        }
                    }
                }
                Err(e) => missing.push(format!("the API server ({e})")),
            }
            if http_get(self.extender_addr, "/readyz").await.map(|(s, _)| s) != Some(200) {
                missing.push("the extender's readyz".into());
            }
            if missing.is_empty() {
                return Ok(());
            }
            for p in self.processes_mut() {
                if let Some(status) = p.exited() {
                    bail!("{} exited ({status}); its log ends:\n{}", p.name, tail(&p.log(), 30));
                }
            }
            if Instant::now() > deadline {
                bail!("the box is not ready after {timeout:?}: waiting for {}", missing.join(", "));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether the extender's view (its inspect route) holds `node`'s GPUs as `state` has them.
    async fn extender_sees(&self, node: &str, state: &NodeState) -> bool {
        let Some((200, body)) = http_get(self.extender_observe, &format!("/gpushare-scheduler/inspect/{node}")).await
        else {
            return false;
        };
        let Ok(report) = serde_json::from_str::<gpushare_extender::inspect::ClusterReport>(&body) else {
            return false;
        };
        let Some(seen) = report.nodes.iter().find(|n| n.name == node) else { return false };
        let published: Vec<(u32, bool, bool)> =
            state.inventory.gpus().iter().map(|g| (g.index, g.health.is_healthy(), g.cordoned)).collect();
        let viewed: Vec<(u32, bool, bool)> = seen.gpus.iter().map(|g| (g.index, g.healthy, g.cordoned)).collect();
        published == viewed
    }

    /// Cordons GPU `index` of `node` with `gpusharectl` over the node's bus.
    ///
    /// # Errors
    /// No bus (no `dbus-daemon` installed, or the box started without), or gpusharectl failed.
    pub fn cordon(&self, node: &str, index: usize) -> anyhow::Result<()> {
        let n = self.node(node).with_context(|| format!("no node {node}"))?;
        let Some(address) = &n.bus_address else {
            bail!("cordoning a GPU needs the node's D-Bus status API: install dbus-daemon (node {node} GPU {index})")
        };
        let out = Command::new(&self.bin.gpusharectl)
            .args(["--address", address, "cordon", &index.to_string()])
            .output()
            .context("running gpusharectl")?;
        if !out.status.success() {
            bail!("gpusharectl cordon {index} on {node}: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(())
    }

    /// The node-state annotation `node`'s daemon published, decoded.
    ///
    /// # Errors
    /// The API server's error, or no (valid) annotation.
    pub async fn node_state(&self, node: &str) -> anyhow::Result<NodeState> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let n = nodes.get(node).await.with_context(|| format!("getting node {node}"))?;
        let value = n
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(NODE_STATE_KEY))
            .with_context(|| format!("node {node} has no {NODE_STATE_KEY} annotation"))?;
        Ok(NodeState::decode(value)?)
    }

    /// Waits until `node`'s daemon publishes GPU `index` as healthy (or not).
    ///
    /// # Errors
    /// On timeout.
    pub async fn wait_gpu_health(
        &self,
        node: &str,
        index: usize,
        healthy: bool,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let what = if healthy { "healthy" } else { "unhealthy" };
        self.wait_gpu_published(node, index, what, |g| g.health.is_healthy() == healthy, timeout).await
    }

    /// Waits until `node`'s daemon publishes GPU `index` as `shown` says (`what`, for the error).
    async fn wait_gpu_published(
        &self,
        node: &str,
        index: usize,
        what: &str,
        shown: impl Fn(&gpushare_core::Gpu) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(state) = self.node_state(node).await
                && state.inventory.gpus().get(index).is_some_and(&shown)
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("node {node} GPU {index} is not published {what} after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Every process of the box.
    pub fn processes_mut(&mut self) -> impl Iterator<Item = &mut Proc> {
        let nodes = self.nodes.iter_mut().flat_map(|n| {
            let bus = n.bus.as_mut();
            [Some(&mut n.kubelet), Some(&mut n.daemon), bus].into_iter().flatten()
        });
        [&mut self.apiserver, &mut self.extender, &mut self.scheduler].into_iter().chain(nodes)
    }

    /// Creates pods (a namespace missing from a pod is `default`).
    ///
    /// # Errors
    /// The API server's refusal, naming the pod.
    pub async fn apply(&self, pods: &[Value]) -> anyhow::Result<()> {
        for pod in pods {
            let ns = pod.pointer("/metadata/namespace").and_then(Value::as_str).unwrap_or("default");
            let name = pod.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default();
            let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
            let typed: Pod = serde_json::from_value(pod.clone()).with_context(|| format!("pod {ns}/{name}"))?;
            api.create(&PostParams::default(), &typed).await.with_context(|| format!("creating pod {ns}/{name}"))?;
        }
        Ok(())
    }

    /// Deletes a pod.
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn delete_pod(&self, namespace: &str, name: &str) -> anyhow::Result<()> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        api.delete(name, &DeleteParams::default()).await.with_context(|| format!("deleting {namespace}/{name}"))?;
        Ok(())
    }

    /// Every pod.
    ///
    /// # Errors
    /// The API server's error.
    pub async fn pods(&self) -> anyhow::Result<Vec<Pod>> {
        let api: Api<Pod> = Api::all(self.client.clone());
        Ok(api.list(&ListParams::default()).await?.items)
    }

    /// Every node.
    ///
    /// # Errors
    /// The API server's error.
    pub async fn nodes(&self) -> anyhow::Result<Vec<Node>> {
        let api: Api<Node> = Api::all(self.client.clone());
        Ok(api.list(&ListParams::default()).await?.items)
    }

    /// Waits until no pod is still on its way: each is Running, Failed, Succeeded, or waits
    /// with a `PodScheduled=False` reason from the scheduler.
    ///
    /// # Errors
    /// On timeout, naming the pods still on their way.
    pub async fn settle(&self, timeout: Duration) -> anyhow::Result<Vec<Pod>> {
        settle(&self.client, timeout).await
    }

    /// Checks the invariants once ([`crate::invariants::check`]).
    ///
    /// # Errors
    /// The API server's error.
    pub async fn check(&self) -> anyhow::Result<Report> {
        // The records first: a pod admitted after they are read is simply not checked, while
        // one admitted before is bound in the pod list read after them.
        let admissions = self.nodes.iter().map(|n| (n.spec.name.clone(), n.admissions())).collect();
        let nodes = self.nodes().await?;
        let pods = self.pods().await?;
        Ok(crate::invariants::check(&pods, &nodes, &admissions))
    }

    /// Checks the invariants until the settled ones hold too (the daemons publish within a
    /// second) on a read where no pod is on its way (a pod the scheduler had found no room for
    /// may still be placed and admitted after [`Self::settle`]), or `timeout`; returns the last
    /// report. An always-invariant violation returns at once.
    ///
    /// # Errors
    /// The API server's error.
    pub async fn check_settled(&self, timeout: Duration) -> anyhow::Result<Report> {
        let deadline = Instant::now() + timeout;
        loop {
            let report = self.check().await?;
            let quiet = report.is_clean() && report.moving == 0;
            if quiet || !report.violations.is_empty() || Instant::now() > deadline {
                return Ok(report);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until pod `namespace/name` is in `phase`.
    ///
    /// # Errors
    /// On timeout, with the pod's last status.
    pub async fn wait_phase(&self, namespace: &str, name: &str, phase: &str, timeout: Duration) -> anyhow::Result<Pod> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let deadline = Instant::now() + timeout;
        loop {
            let pod = api.get_opt(name).await.ok().flatten();
            if let Some(p) = &pod
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some(phase)
            {
                return Ok(p.clone());
            }
            if Instant::now() > deadline {
                let status = pod.and_then(|p| p.status).map(|s| format!("{s:?}")).unwrap_or_default();
                bail!("pod {namespace}/{name} is not {phase} after {timeout:?}: {status}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Runs `kubectl-inspect-gpushare` with `args` against the box.
    ///
    /// # Errors
    /// If it cannot run or fails.
    pub fn inspect(&self, args: &[&str]) -> anyhow::Result<String> {
        inspect(&self.bin.inspect, &self.kubeconfig, args)
    }

    /// Stops everything: the scheduler and extender, the daemons (SIGTERM), the kubelets, the
    /// buses and the API server.
    pub fn shutdown(&mut self) {
        self.scheduler.stop(Duration::from_secs(2));
        self.extender.stop(Duration::from_secs(2));
        for n in &mut self.nodes {
            n.daemon.stop(Duration::from_secs(5));
            n.kubelet.stop(Duration::from_secs(2));
            if let Some(bus) = n.bus.as_mut() {
                bus.stop(Duration::from_secs(2));
            }
        }
        self.apiserver.stop(Duration::from_secs(2));
    }
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").field("dir", &self.dir).field("api_url", &self.api_url).finish_non_exhaustive()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The simulated GPUs of a cluster file's node, in index order (four to a NUMA node).
#[must_use]
pub fn fake_gpus(node: &NodeSpec) -> Vec<FakeGpu> {
    node.gpus
        .iter()
        .flat_map(|g| (0..g.count).map(move |_| g))
        .enumerate()
        .map(|(k, g)| {
            let k = u32::try_from(k).unwrap_or(u32::MAX);
            let mut gpu = FakeGpu::new(&node.name, k, g.memory_mib, &g.model);
            gpu.numa = Some(k / 4);
            gpu
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn start_node(
    bin: &Binaries,
    dir: &Path,
    library: &Path,
    (kubeconfig, daemon_kubeconfig): (&Path, &Path),
    spec: &ClusterSpec,
    node: &NodeSpec,
    i: usize,
    options: &Options,
    dbus_daemon: Option<&Path>,
) -> anyhow::Result<BoxNode> {
    let ndir = dir.join("nodes").join(&node.name);
    let plugin_dir = ndir.join("device-plugins");
    std::fs::create_dir_all(&plugin_dir)?;
    let logs = dir.join("logs");
    let pod_resources = ndir.join("pod-resources").join("kubelet.sock");
    let record = ndir.join("kubelet-record.jsonl");
    let events = ndir.join("nvml-events");
    std::fs::write(&events, "")?;
    let gpus = fake_gpus(node);
    let nvml_config = ndir.join("nvml.conf");
    nvml::write_config(&nvml_config, &gpus, &nvml::events_directive(&events))?;
    let address =
        if node.address.is_empty() { format!("10.0.{}.{}", i / 250, i % 250 + 10) } else { node.address.clone() };
    let env = vec![("RUST_LOG".to_owned(), options.log_filter.clone())];
    let kubelet = Proc::spawn(
        &format!("kubelet-{}", node.name),
        &bin.stand_ins,
        vec![
            "kubelet".into(),
            "--node".into(),
            node.name.clone(),
            "--address".into(),
            address,
            "--kubeconfig".into(),
            path(kubeconfig),
            "--plugin-dir".into(),
            path(&plugin_dir),
            "--pod-resources-socket".into(),
            path(&pod_resources),
            "--record".into(),
            path(&record),
            "--pod-subnet".into(),
            (i % 250).to_string(),
        ]
        .into_iter()
        .chain(options.kubelet_resource_health.then(|| "--resource-health-status".to_owned()))
        .collect(),
        env.clone(),
        &logs,
    )?;
    let (bus, bus_address) = match dbus_daemon {
        Some(program) => {
            let socket = ndir.join("bus");
            let config = ndir.join("bus.conf");
            std::fs::write(
                &config,
                format!(
                    "<!DOCTYPE busconfig PUBLIC \"-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN\" \
                     \"http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd\">\n<busconfig>\n  \
                     <type>system</type>\n  <listen>unix:path={}</listen>\n  <auth>EXTERNAL</auth>\n  \
                     <policy context=\"default\">\n    <allow user=\"*\"/>\n    <allow own=\"*\"/>\n    \
                     <allow send_destination=\"*\" eavesdrop=\"true\"/>\n    <allow eavesdrop=\"true\"/>\n  \
                     </policy>\n</busconfig>\n",
                    socket.display()
                ),
            )?;
            let bus = Proc::spawn(
                &format!("dbus-{}", node.name),
                program,
                vec![format!("--config-file={}", config.display()), "--nofork".into(), "--nopidfile".into()],
                Vec::new(),
                &logs,
            )?;
            (Some(bus), Some(format!("unix:path={}", socket.display())))
        }
        None => (None, None),
    };
    let dbus_section = match &bus_address {
        Some(a) => format!("[dbus]\nenabled = true\naddress = \"{a}\"\n"),
        None => "[dbus]\nenabled = false\n".to_owned(),
    };
    let config = ndir.join("gpushared.toml");
    std::fs::write(
        &config,
        format!(
            "node_name = \"{}\"\n[kubelet]\ndevice_plugin_dir = \"{}\"\npod_resources_socket = \"{}\"\n\
             [ledger]\npath = \"{}\"\n[kubernetes]\nkubeconfig = \"{}\"\n[nvml]\nlibrary = \"{}\"\n\
             [resources]\nunit = \"{}\"\n{dbus_section}{}\n",
            node.name,
            plugin_dir.display(),
            pod_resources.display(),
            ndir.join("state").join("ledger.db").display(),
            daemon_kubeconfig.display(),
            library.display(),
            node.unit.unwrap_or(spec.unit),
            options.daemon_extra
        ),
    )?;
    let mut daemon_env = env;
    daemon_env.push(("FAKE_NVML_CONFIG".into(), path(&nvml_config)));
    let daemon = Proc::spawn(
        &format!("gpushared-{}", node.name),
        &bin.gpushared,
        vec!["--config".into(), path(&config)],
        daemon_env,
        &logs,
    )?;
    Ok(BoxNode { spec: node.clone(), dir: ndir, kubelet, daemon, bus, bus_address, events, record })
}

/// Runs `kubectl-inspect-gpushare` (`program`) with `args` against the cluster of `kubeconfig`.
///
/// # Errors
/// If it cannot run or fails.
pub fn inspect(program: &Path, kubeconfig: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .context("running kubectl-inspect-gpushare")?;
    if !out.status.success() {
        bail!("kubectl-inspect-gpushare failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Waits until no pod is still on its way ([`is_settled`]); every pod.
///
/// # Errors
/// On timeout, naming the pods still on their way; the API server's error.
pub async fn settle(client: &kube::Client, timeout: Duration) -> anyhow::Result<Vec<Pod>> {
    let api: Api<Pod> = Api::all(client.clone());
    let deadline = Instant::now() + timeout;
    loop {
        let pods = api.list(&ListParams::default()).await?.items;
        let moving: Vec<String> = pods.iter().filter(|p| !is_settled(p)).map(pod_key).collect();
        if moving.is_empty() {
            return Ok(pods);
        }
        if Instant::now() > deadline {
            bail!("pods still on their way after {timeout:?}: {}", moving.join(", "));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A pod's phase (`Pending` until the API server has one).
#[must_use]
pub fn phase(pod: &Pod) -> &str {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("Pending")
}

/// Whether a pod is where it will stay for now: running or ended, or unschedulable for a
/// reason that lasts ([`is_transient`] reasons pass on their own within seconds).
#[must_use]
pub fn is_settled(pod: &Pod) -> bool {
    if matches!(phase(pod), "Running" | "Failed" | "Succeeded") {
        return true;
    }
    let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
    !bound && unschedulable_reason(pod).is_some_and(|r| !is_transient(&r))
}

/// Whether an unschedulable reason passes on its own: a node still admitting a look-alike pod
/// (the extender binds look-alikes one at a time per node), or an extender that has not synced
/// its view yet. kube-scheduler retries such pods after its backoff.
#[must_use]
pub fn is_transient(reason: &str) -> bool {
    reason.contains("is still admitting pod") || reason.contains("has not synced its view")
}

/// The scheduler's `PodScheduled=False` (`Unschedulable`) message, for a pod no node fits.
#[must_use]
pub fn unschedulable_reason(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
        .map(|c| c.message.clone().unwrap_or_default())
}

/// `namespace/name`.
#[must_use]
pub fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// `namespace/name` of a pod manifest (namespace `default` where it names none).
pub fn pod_json_key(pod: &Value) -> String {
    let meta = |k: &str| pod.pointer(&format!("/metadata/{k}")).and_then(Value::as_str).map(str::to_owned);
    format!("{}/{}", meta("namespace").unwrap_or_else(|| "default".into()), meta("name").unwrap_or_default())
}

/// A kube client for the API-server stand-in a kubeconfig written by `gpushare-box apiserver`
/// names, and its URL.
///
/// # Errors
/// If the file cannot be read or names no server.
pub fn client_from_kubeconfig(path: &Path) -> anyhow::Result<(kube::Client, String)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let url = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: "))
        .with_context(|| format!("{} names no server", path.display()))?
        .to_owned();
    Ok((client_for(&url)?, url))
}

/// A kube client for `url` (plain HTTP, no credentials).
///
/// # Errors
/// If the URL is not one.
pub fn client_for(url: &str) -> anyhow::Result<kube::Client> {
    let uri: http::Uri = url.parse().with_context(|| format!("{url} is not a URL"))?;
    let mut config = kube::Config::new(uri);
    config.default_namespace = "default".into();
    kube::Client::try_from(config).context("building a client for the API server")
}

/// A relay to the API server at `api_url` that holds back its answers by `delay`, and a copy of
/// `kubeconfig` named `name` in `dir` that goes through it.
async fn lagging(
    dir: &Path,
    name: &str,
    kubeconfig: &Path,
    api_url: &str,
    delay: Duration,
) -> anyhow::Result<(crate::lag::Lag, PathBuf)> {
    let upstream: SocketAddr = api_url
        .trim_start_matches("http://")
        .parse()
        .with_context(|| format!("the API server's URL {api_url} is not http://host:port"))?;
    let lag = crate::lag::Lag::start(upstream, delay).await?;
    let lagging = dir.join(name);
    let text = std::fs::read_to_string(kubeconfig)?;
    std::fs::write(&lagging, text.replace(&format!("server: {api_url}"), &format!("server: {}", lag.url())))?;
    Ok((lag, lagging))
}

/// The file the scheduler stand-in keeps its view's node versions in, in the box's directory.
pub const SCHEDULER_NODES_FILE: &str = "scheduler-nodes";

/// The node versions the scheduler stand-in last wrote to `path` (`gpushare-box scheduler
/// --nodes-file`): none while it has not listed the nodes yet.
#[must_use]
pub fn scheduler_node_versions(path: &Path) -> BTreeMap<String, String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(name, version)| (name.to_owned(), version.to_owned()))
        .collect()
}

/// Whether a view holding an object at version `held` has caught up with version `listed`.
/// The box's API server counts versions up from one, so the later version is the larger.
fn caught_up(held: Option<&str>, listed: Option<&str>) -> bool {
    let version = |v: Option<&str>| v.and_then(|v| v.parse::<u64>().ok());
    matches!((version(held), version(listed)), (Some(h), Some(l)) if h >= l)
}

/// `GET path` over plain HTTP/1.1; `None` if the server does not answer.
pub async fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let fut = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut out = Vec::new();
        stream.read_to_end(&mut out).await.ok()?;
        let text = String::from_utf8_lossy(&out).into_owned();
        let status = text.split_whitespace().nth(1)?.parse().ok()?;
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
        Some((status, body))
    };
    tokio::time::timeout(Duration::from_secs(5), fut).await.ok().flatten()
}

pub(crate) fn wait_for(proc: &mut Proc, timeout: Duration, what: &str, ready: impl Fn() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !ready() {
        if let Some(status) = proc.exited() {
            bail!("{what} exited ({status}); its log ends:\n{}", tail(&proc.log(), 30));
        }
        if Instant::now() > deadline {
            bail!("{what} is not up after {timeout:?}; its log ends:\n{}", tail(&proc.log(), 30));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(program)).find(|p| p.is_file())
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

#[cfg(test)]
mod settle_tests {
    use super::*;

    fn waiting(reason: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "default"},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                        "reason": "Unschedulable", "message": reason}]}
        }))
        .unwrap()
    }

    #[test]
    fn a_pod_waiting_for_a_look_alike_is_not_settled() {
        let lookalike = "0/2 nodes are available: 2 node gpu-a is still admitting pod default/web-01, one of whose GPU \
                         requests is the size of one of pod default/web-02's but on other GPUs";
        assert!(!is_settled(&waiting(lookalike)));
        assert!(is_transient(lookalike));
        let unfit = "0/2 nodes are available: 2 container \"main\" needs 38000 MiB on a GPU";
        assert!(is_settled(&waiting(unfit)));
        assert!(!is_transient(unfit));
    }
}

#[cfg(test)]
mod ready_tests {
    use super::*;

    #[test]
    fn a_view_has_caught_up_only_at_the_listed_version_or_later() {
        assert!(caught_up(Some("12"), Some("12")));
        assert!(caught_up(Some("13"), Some("12")));
        // Lexically larger, numerically older.
        assert!(!caught_up(Some("9"), Some("12")));
        assert!(!caught_up(None, Some("12")));
        assert!(!caught_up(Some("12"), None));
        assert!(!caught_up(Some("x"), Some("12")));
    }

    #[test]
    fn the_schedulers_node_file_reads_back_and_a_missing_one_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SCHEDULER_NODES_FILE);
        assert!(scheduler_node_versions(&path).is_empty());
        std::fs::write(&path, "gpu-a 17\ngpu-b 230\n").unwrap();
        let versions = scheduler_node_versions(&path);
        assert_eq!(versions.get("gpu-a").map(String::as_str), Some("17"));
        assert_eq!(versions.get("gpu-b").map(String::as_str), Some("230"));
    }
}
