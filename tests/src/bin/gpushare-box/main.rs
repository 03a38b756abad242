//! `gpushare-box`: the cluster in a box.
//!
//! - `gpushare-box demo` brings up a whole cluster on this machine — the API-server stand-in,
//!   per node a kubelet stand-in and the real `gpushared` on simulated GPUs, the real
//!   `gpushare-extender`, the kube-scheduler stand-in — applies a workload, prints where every
//!   container landed and why the rest wait, and stays up for `kubectl`, `gpusharectl` and
//!   `kubectl-inspect-gpushare` until Ctrl-C.
//! - `gpushare-box demo --real` does the same with the real Kubernetes components instead of
//!   the stand-ins (the `real` module).
//! - `gpushare-box apiserver | kubelet | scheduler` run one stand-in; the demo and the suites
//!   start them as processes.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use gpushare_testkit::apiserver::{ApiServer, Options as ApiOptions};
use gpushare_testkit::cluster::{self, Cluster, Options};
use gpushare_testkit::node::{NodeAgent, NodeConfig};
use gpushare_testkit::scheduler::{Scheduler, SchedulerConfig};
use tokio::signal::unix::{SignalKind, signal};

mod real;

#[derive(Parser, Debug)]
#[command(name = "gpushare-box", version, about = "gpushare's cluster in a box: stand-ins and the demo")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Bring up a cluster with simulated GPUs, place a workload, and explain the result.
    Demo {
        /// The cluster file (docs/simulate.md).
        #[arg(long, default_value = "examples/cluster.yaml")]
        cluster: PathBuf,
        /// Pod manifests to apply (multi-document YAML).
        #[arg(long, default_value = "examples/workload.yaml")]
        workload: PathBuf,
        /// Keep the state (logs, ledgers, kubeconfig) in this directory instead of a temporary one.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Stop after printing the result instead of staying up.
        #[arg(long)]
        exit: bool,
        /// Run the real Kubernetes components instead of the stand-ins: etcd, kube-apiserver,
        /// kube-scheduler with the shipped configuration, and per node the real kubelet (needs
        /// root, and Go to build the components or a directory of them; docs/box.md).
        #[arg(long)]
        real: bool,
    },
    /// The Kubernetes API-server stand-in (SIGUSR1 starts an outage, SIGUSR2 ends it).
    Apiserver {
        /// Address to listen on (port 0: any free port).
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        /// Write a kubeconfig for it here once it listens.
        #[arg(long)]
        kubeconfig_out: PathBuf,
    },
    /// A kubelet stand-in for one node (SIGHUP restarts it, SIGUSR1 toggles refusing pods).
    Kubelet {
        /// The Node's name.
        #[arg(long)]
        node: String,
        /// The Node's `InternalIP`.
        #[arg(long, default_value = "127.0.0.1")]
        address: String,
        /// The API server.
        #[arg(long)]
        kubeconfig: PathBuf,
        /// The device-plugin directory.
        #[arg(long)]
        plugin_dir: PathBuf,
        /// The PodResources socket.
        #[arg(long)]
        pod_resources_socket: PathBuf,
        /// Where to record what each container received (JSON lines).
        #[arg(long)]
        record: PathBuf,
        /// The third octet of pod IPs.
        #[arg(long, default_value_t = 0)]
        pod_subnet: u8,
        /// Report each allocated device's health in pod status, as the kubelet's
        /// `ResourceHealthStatus` feature gate does.
        #[arg(long)]
        resource_health_status: bool,
    },
    /// A device plugin that answers every call at once and does nothing else: the kubelet's
    /// own cost at a device count (the side-by-side bench's `floor-mib`), or with
    /// `--pod-resources`, that of a plugin that must know its pod (`floor-gib`), and with
    /// `--read-pods` too, that of one that must know it whatever its pod watch's lag
    /// (`floor-gib-read`).
    NullPlugin {
        /// The kubelet's device-plugin directory.
        #[arg(long)]
        plugin_dir: PathBuf,
        /// The extended resource to serve.
        #[arg(long)]
        resource: String,
        /// How many devices.
        #[arg(long)]
        devices: u32,
        /// The kubelet's PodResources socket: each `GetPreferredAllocation` waits for one
        /// `List` of it first.
        #[arg(long)]
        pod_resources: Option<PathBuf>,
        /// A kubeconfig: each `GetPreferredAllocation` then also reads, with a quorum `GET`, the
        /// pods the kubelet's `List` names as holding none of the resource.
        #[arg(long, requires = "pod_resources")]
        read_pods: Option<PathBuf>,
    },
    /// A DRA driver that answers every call at once and prepares nothing: Kubernetes' own cost
    /// of a pod with a claim (the side-by-side bench's `floor-dra`).
    NullDra {
        /// The kubelet's plugin-registration directory.
        #[arg(long)]
        registry_dir: PathBuf,
        /// The directory for the driver's own socket.
        #[arg(long)]
        plugin_dir: PathBuf,
    },
    /// The kube-scheduler stand-in, calling the extender as kube-scheduler does.
    Scheduler {
        /// The API server.
        #[arg(long)]
        kubeconfig: PathBuf,
        /// The extender's urlPrefix.
        #[arg(long, default_value = "http://127.0.0.1:39999/gpushare-scheduler")]
        extender: String,
        /// The first retry's backoff, milliseconds (kube-scheduler: 1000).
        #[arg(long, default_value_t = 1000)]
        initial_backoff_ms: u64,
        /// Keep this file listing each node the scheduler's view holds, with the
        /// `resourceVersion` it holds it at ("name version" lines; written once its node watch
        /// has listed, replaced on change).
        #[arg(long)]
        nodes_file: Option<PathBuf>,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let quiet = matches!(cli.command, Cmd::Demo { .. });
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(if quiet { "warn" } else { "info" }));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gpushare-box: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpushare-box: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(command: Cmd) -> anyhow::Result<()> {
    match command {
        Cmd::Apiserver { listen, kubeconfig_out } => {
            let api = ApiServer::start_at(listen, ApiOptions::default()).await?;
            let tmp = kubeconfig_out.with_extension("tmp");
            api.write_kubeconfig(&tmp)?;
            std::fs::rename(&tmp, &kubeconfig_out).with_context(|| format!("writing {}", kubeconfig_out.display()))?;
            tracing::info!(url = %api.url(), "API server stand-in listening");
            let mut usr1 = signal(SignalKind::user_defined1())?;
            let mut usr2 = signal(SignalKind::user_defined2())?;
            let stopped = until_stopped();
            tokio::pin!(stopped);
            loop {
                tokio::select! {
                    _ = usr1.recv() => {
                        tracing::warn!("SIGUSR1: outage, every request gets 503 and watches end");
                        api.set_unavailable(true);
                    }
                    _ = usr2.recv() => {
                        tracing::warn!("SIGUSR2: serving again");
                        api.set_unavailable(false);
                    }
                    result = &mut stopped => return result,
                }
            }
        }
        Cmd::Kubelet {
            node,
            address,
            kubeconfig,
            plugin_dir,
            pod_resources_socket,
            record,
            pod_subnet,
            resource_health_status,
        } => {
            let client = client(&kubeconfig)?;
            let config = NodeConfig {
                node,
                plugin_dir,
                pod_resources_socket,
                record,
                address,
                labels: BTreeMap::new(),
                pod_subnet,
                resource_health_status,
            };
            let agent = NodeAgent::start(config, client).await?;
            let mut hup = signal(SignalKind::hangup())?;
            let mut usr1 = signal(SignalKind::user_defined1())?;
            let run = tokio::spawn(Arc::clone(&agent).run());
            let stopped = until_stopped();
            tokio::pin!(stopped);
            loop {
                tokio::select! {
                    _ = hup.recv() => {
                        tracing::info!("SIGHUP: restarting the kubelet");
                        agent.restart().await?;
                    }
                    _ = usr1.recv() => {
                        let refusing = !agent.is_refusing();
                        tracing::info!(refusing, "SIGUSR1");
                        agent.set_refusing(refusing);
                    }
                    result = &mut stopped => return result,
                }
                if run.is_finished() {
                    return run.await?;
                }
            }
        }
        Cmd::NullPlugin { plugin_dir, resource, devices, pod_resources, read_pods } => tokio::select! {
            result = gpushare_testkit::null_plugin::run(&plugin_dir, &resource, devices, pod_resources, read_pods) => result,
            result = until_stopped() => result,
        },
        Cmd::NullDra { registry_dir, plugin_dir } => tokio::select! {
            result = gpushare_testkit::null_dra::run(&registry_dir, &plugin_dir) => result,
            result = until_stopped() => result,
        },
        Cmd::Scheduler { kubeconfig, extender, initial_backoff_ms, nodes_file } => {
            let client = client(&kubeconfig)?;
            let mut config = SchedulerConfig::gpushare(&extender);
            config.initial_backoff = Duration::from_millis(initial_backoff_ms);
            let scheduler = Scheduler::new(config);
            let publish = async {
                match nodes_file {
                    Some(path) => publish_node_versions(&scheduler, &path).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                result = scheduler.run(client) => result,
                result = publish => result,
                result = until_stopped() => {
                    tracing::info!(stats = ?scheduler.stats(), "scheduler stopping");
                    result
                }
            }
        }
        Cmd::Demo { cluster, workload, dir, exit, real: false } => demo(&cluster, &workload, dir, exit).await,
        Cmd::Demo { cluster, workload, dir, exit, real: true } => real::demo(&cluster, &workload, dir, exit).await,
    }
}

/// Keeps `path` listing the nodes `scheduler`'s view holds and their `resourceVersion`s,
/// replaced whole (written beside it, then renamed) whenever they change.
async fn publish_node_versions(scheduler: &Scheduler, path: &std::path::Path) -> anyhow::Result<()> {
    let staging = path.with_extension("new");
    let mut written = None;
    loop {
        let versions = scheduler.node_versions();
        if !versions.is_empty() && written.as_ref() != Some(&versions) {
            let text: String = versions.iter().map(|(name, version)| format!("{name} {version}\n")).collect();
            std::fs::write(&staging, text).with_context(|| format!("writing {}", staging.display()))?;
            std::fs::rename(&staging, path).with_context(|| format!("renaming into {}", path.display()))?;
            written = Some(versions);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn client(kubeconfig: &std::path::Path) -> anyhow::Result<kube::Client> {
    Ok(cluster::client_from_kubeconfig(kubeconfig)?.0)
}

async fn until_stopped() -> anyhow::Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}

async fn demo(
    cluster_file: &std::path::Path,
    workload_file: &std::path::Path,
    dir: Option<PathBuf>,
    exit: bool,
) -> anyhow::Result<()> {
    let spec = cluster::read_cluster(cluster_file)
        .with_context(|| "pass --cluster (the sample is examples/cluster.yaml in the repository)")?;
    let pods = cluster::read_workload(workload_file)
        .with_context(|| "pass --workload (the sample is examples/workload.yaml in the repository)")?;
    let started = Instant::now();
    println!(
        "Starting the cluster in a box: an API server, {} nodes (kubelet stand-in + gpushared on simulated GPUs), the extender, a kube-scheduler stand-in...",
        spec.nodes.len()
    );
    // `GPUSHARE_BOX_DAEMON_EXTRA`: TOML added to every node's gpushared.toml (docs/box.md).
    let daemon_extra = std::env::var("GPUSHARE_BOX_DAEMON_EXTRA").unwrap_or_default();
    let options = Options { dir, daemon_extra, ..Options::default() };
    let mut cluster = Cluster::up(&spec, &options).await?;
    println!("Ready in {:.1} s ({}).", started.elapsed().as_secs_f64(), cluster.dir.display());
    let applied = Instant::now();
    println!("Applying {} ({} pods)...", workload_file.display(), pods.len());
    // The stand-in API server runs no admission policy: what the shipped one
    // (etc/kubernetes/gpushare-admission-policy.yaml) refuses is refused here by the core's rule,
    // which the admission_policy suite proves it agrees with on the real API server.
    let mut refused = Vec::new();
    let mut admitted = Vec::new();
    for pod in pods {
        match refusal(&pod, spec.unit) {
            Some(why) => refused.push((cluster::pod_json_key(&pod), why)),
            None => admitted.push(pod),
        }
    }
    let pods = admitted;
    print_refused(&refused);
    cluster.apply(&pods).await?;
    let settled = match cluster.settle(Duration::from_secs(60)).await {
        Ok(pods) => {
            println!("Settled in {:.1} s.\n", applied.elapsed().as_secs_f64());
            pods
        }
        Err(e) => {
            // Shown as they are: pods waiting for a look-alike's admission are marked so.
            println!("Not settled after {:.0} s ({e:#}); as things stand:\n", applied.elapsed().as_secs_f64());
            cluster.pods().await?
        }
    };
    println!("{}", cluster.inspect(&[])?);
    print_pods(&settled, &received(&cluster));
    println!("\nExplore it:");
    println!("  export KUBECONFIG={}", cluster.kubeconfig.display());
    println!("  kubectl get pods -A -o wide");
    println!("  {} -d", cluster.bin.inspect.display());
    if let Some(address) = cluster.nodes.first().and_then(|n| n.bus_address.as_ref()) {
        println!("  {} --address {address} status", cluster.bin.gpusharectl.display());
    }
    println!("  logs: {}/logs/", cluster.dir.display());
    if exit {
        cluster.shutdown();
        return Ok(());
    }
    println!("\nRunning. Ctrl-C stops every process and removes what the demo created.");
    until_stopped().await?;
    println!("Stopping...");
    cluster.shutdown();
    Ok(())
}

/// Why the shipped admission policy refuses `pod` at apply, by the core's rule for a cluster
/// counting `unit`; `None` if it is admitted.
fn refusal(pod: &serde_json::Value, unit: gpushare_core::MemoryUnit) -> Option<String> {
    let spec: gpushare_core::PodSpec = serde_json::from_value(pod.get("spec")?.clone()).ok()?;
    gpushare_core::PodRequest::from_spec(&spec, &gpushare_core::ResourceNames::gpushare(), unit)
        .err()
        .map(|e| e.to_string())
}

/// Prints the pods the API server refused at apply, each with its reason.
fn print_refused(refused: &[(String, String)]) {
    if refused.is_empty() {
        return;
    }
    println!("Refused at apply (gpushare's admission policy, as kubectl apply shows it):");
    for (pod, reason) in refused {
        println!("  {pod:<22} {reason}");
    }
}

/// What one container was given, as the demo shows it.
struct Received {
    name: String,
    init: bool,
    gpu: bool,
    env: BTreeMap<String, String>,
}

/// What the stand-in kubelets recorded of each pod's containers, by pod UID.
fn received(cluster: &Cluster) -> BTreeMap<String, Vec<Received>> {
    let records: BTreeMap<String, gpushare_testkit::node::Record> =
        cluster.nodes.iter().flat_map(gpushare_testkit::cluster::BoxNode::admissions).collect();
    records
        .into_iter()
        .map(|(uid, r)| {
            let containers = r
                .containers
                .into_iter()
                .map(|c| Received { name: c.name, init: c.init, gpu: c.units > 0, env: c.env })
                .collect();
            (uid, containers)
        })
        .collect()
}

/// Prints where each pod's containers landed and what they received, then the pods that wait
/// and why, and those that failed.
fn print_pods(pods: &[k8s_openapi::api::core::v1::Pod], received: &BTreeMap<String, Vec<Received>>) {
    let mut sorted: Vec<&k8s_openapi::api::core::v1::Pod> = pods.iter().collect();
    sorted.sort_by_key(|p| cluster::pod_key(p));
    println!("What each container received:");
    for pod in &sorted {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        if let Some(containers) = received.get(&uid) {
            println!("  {:<22} on {}", cluster::pod_key(pod), node.unwrap_or_default());
            for c in containers {
                let env = |k: &str| c.env.get(k).cloned().unwrap_or_default();
                if !c.gpu {
                    println!("      {:<21} no GPU", c.name);
                    continue;
                }
                println!(
                    "      {:<21} GPU {:<4} {:>6} MiB per GPU  NVIDIA_VISIBLE_DEVICES={}",
                    if c.init { format!("{} (init)", c.name) } else { c.name.clone() },
                    env("GPUSHARE_GPU_INDEXES"),
                    env("GPUSHARE_MEMORY_MIB"),
                    env("NVIDIA_VISIBLE_DEVICES"),
                );
            }
        }
    }
    let waiting: Vec<_> = sorted.iter().filter_map(|p| cluster::unschedulable_reason(p).map(|r| (p, r))).collect();
    if !waiting.is_empty() {
        println!("\nWaiting (the scheduler's PodScheduled condition, as kubectl describe shows it):");
        for (pod, reason) in waiting {
            let passing = if cluster::is_transient(&reason) { " (passes on its own; retried)" } else { "" };
            println!("  {:<22} {reason}{passing}", cluster::pod_key(pod));
        }
    }
    let failed: Vec<_> =
        sorted.iter().filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed")).collect();
    if !failed.is_empty() {
        println!("\nFailed:");
        for pod in failed {
            let s = pod.status.as_ref();
            println!(
                "  {:<22} {}: {}",
                cluster::pod_key(pod),
                s.and_then(|s| s.reason.clone()).unwrap_or_default(),
                s.and_then(|s| s.message.clone()).unwrap_or_default()
            );
        }
    }
}
