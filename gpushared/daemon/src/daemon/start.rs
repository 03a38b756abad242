//! The daemon's start, before anything is served: the ledger, the GPUs, the allocator over them
//! and what keeps them (the ledger's threads, GPU health), then the node's side of the cluster
//! (the pod watch, the node's publication, its heartbeat).

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context as _;
use gpushare_core::NodeInventory;
use gpushared::allocation::allocator::Allocator;
use gpushared::allocation::ledger::Ledger;
use gpushared::allocation::pods::PodStore;
use gpushared::cluster::publish::{self, KubeNode};
use gpushared::config::Config;
use gpushared::gpus::overuse::Eviction;
use gpushared::systemd::Notifier;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// This node as the daemon serves it.
#[derive(Debug)]
pub(super) struct Node {
    /// Its name.
    pub(super) name: String,
    /// Its GPUs, as discovered (health included).
    pub(super) inventory: NodeInventory,
    /// The allocation service over the ledger.
    pub(super) alloc: Arc<Allocator>,
    /// The pods bound to it, as the watch sees them.
    pub(super) pods: PodStore,
    /// Whether the GPUs came from NVML (health events need it).
    nvml: bool,
    /// GPUs that did not answer at start, with why.
    lost_at_start: Vec<(u32, String)>,
}

/// The ledger first (it remembers the GPUs, so one that does not answer now is still served,
/// unhealthy, under its last identity), then the GPUs, the MPS environment file, and the
/// allocator over both; the ledger's checkpoint and pruning threads start with it.
///
/// # Errors
/// A ledger that cannot be opened, a host the configuration does not fit, an MPS file that
/// cannot be written, a thread that cannot start.
pub(super) fn open(config: &Config, notifier: &Notifier) -> anyhow::Result<Node> {
    notifier.status("starting: restoring the ledger");
    let mut opened = Ledger::open(config.ledger.path.path())?;
    if let Some((aside, why)) = &opened.moved_aside {
        tracing::error!(
            kept_at = %aside.display(),
            reason = %why,
            "THE ALLOCATION LEDGER WAS UNUSABLE and has been moved aside; starting with an empty ledger"
        );
    }
    let known = opened.ledger.known_gpus().unwrap_or_else(|e| {
        tracing::error!(error = %e, "cannot read the GPUs the ledger remembers; a GPU that does not answer is not served");
        Vec::new()
    });
    notifier.status("starting: discovering GPUs");
    let host = gpushared::startup::inspect_host(config, &known)?;
    gpushared::startup::record_discovery(&mut opened.ledger, &host)?;
    let lost_at_start: Vec<(u32, String)> = host
        .inventory
        .gpus()
        .iter()
        .filter_map(|g| match &g.health {
            gpushare_core::Health::Unhealthy { reason } => Some((g.index, reason.clone())),
            gpushare_core::Health::Healthy => None,
        })
        .collect();
    let (name, inventory, nvml) = (host.node, host.inventory, host.nvml.is_some());
    tracing::info!(source = %host.source, gpus = inventory.gpus().len(), node = %name, "GPUs discovered");
    for g in inventory.gpus() {
        tracing::info!(index = g.index, uuid = %g.uuid, model = %g.model, total_mib = g.total.get(), numa = ?g.numa_node,
            mode = %g.mode, healthy = g.health.is_healthy(), "GPU");
    }
    if inventory.gpus().is_empty() {
        tracing::warn!("no GPUs found: the kubelet gets an empty device list");
    }
    // Before READY: gpushared-mps.service, ordered after this unit, reads it when it starts.
    let mps_file = config.mps.environment_file.path();
    let done = gpushared::gpus::mps::write_environment(
        mps_file,
        gpushared::gpus::mps::environment(inventory.gpus(), &config.mps).as_deref(),
    )
    .map_err(anyhow::Error::msg)?;
    if done != "absent" {
        tracing::info!(file = %mps_file.display(), action = done, "MPS environment file");
    }

    // Copy the write-ahead log into the database file every 10 s, off the allocation path.
    gpushared::allocation::ledger::spawn_checkpoints(opened.ledger.checkpointer()?, Duration::from_secs(10))
        .context("starting the ledger checkpoint thread")?;
    let pods = PodStore::new();
    let alloc = Arc::new(
        Allocator::new(
            name.clone(),
            config.resources.names(),
            config.resources.compatibility,
            inventory.clone(),
            pods.clone(),
            opened.ledger,
        )?
        .with_mps(config.mps.clone())
        .with_device_nodes(config.device_nodes.clone())
        .with_environment(config.kubelet.environment)
        .with_advertise(config.kubelet.advertise),
    );
    tracing::info!(live = alloc.summary().allocations, ledger = %config.ledger.path.path().display(), "ledger restored");
    // The history kept to `[ledger] history_days` and `history_max_rows`: at start, then hourly.
    gpushared::allocation::allocator::spawn_history_pruning(
        Arc::clone(&alloc),
        config.ledger.retention(),
        Duration::from_secs(3600),
    )
    .context("starting the ledger pruning thread")?;
    Ok(Node { name, inventory, alloc, pods, nvml, lost_at_start })
}

/// GPU health (NVML events and probes) and over-use, on threads of their own, until the
/// returned flag turns `true`; the pods over-use evicts go to `evictions`.
///
/// # Errors
/// A monitor thread that cannot start.
pub(super) fn watch_gpus(
    config: &Config,
    node: &Node,
    evictions: &mpsc::UnboundedSender<Eviction>,
) -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    gpushared::gpus::monitor::start(&gpushared::gpus::monitor::Monitor {
        nvml: node.nvml,
        config,
        inventory: &node.inventory,
        lost_at_start: node.lost_at_start.clone(),
        alloc: &node.alloc,
        pods: &node.pods,
        evictions,
        stop: &stop,
    })?;
    Ok(stop)
}

/// The node's side of the cluster, as tasks in `tasks`: first the ledger checked against the
/// node's last publication (before anything is served or published), then the pod watch and
/// its reads, evictions, the node's heartbeat and its publication. Returns the API client.
///
/// # Errors
/// A kubeconfig that cannot make a client.
pub(super) async fn join_cluster(
    config: &Config,
    node: &Node,
    notifier: &Notifier,
    evictions: mpsc::UnboundedReceiver<Eviction>,
    tasks: &mut JoinSet<()>,
) -> anyhow::Result<kube::Client> {
    let client = gpushared::cluster::kube::client(config.kubernetes.kubeconfig.path()).await?;
    let (name, pods, alloc) = (&node.name, &node.pods, &node.alloc);
    notifier.status("starting: checking the ledger against the node's last publication");
    if gpushared::cluster::recovery::check_ledger(client.clone(), name, alloc).await > 0 {
        tasks.spawn(gpushared::cluster::recovery::finish_rebuild(Arc::clone(alloc), pods.clone()));
    }
    tasks.spawn(gpushared::cluster::kube::watch_pods(client.clone(), name.clone(), pods.clone(), Arc::clone(alloc)));
    let reads = pods.serve_reads();
    tasks.spawn(gpushared::cluster::kube::refresh_pods(
        client.clone(),
        name.clone(),
        pods.clone(),
        reads,
        Arc::clone(alloc),
    ));
    let fetches = pods.serve_fetches();
    tasks.spawn(gpushared::cluster::kube::fetch_pods(client.clone(), pods.clone(), fetches, Arc::clone(alloc)));
    tasks.spawn(gpushared::cluster::kube::evict_pods(client.clone(), evictions, Arc::clone(alloc)));
    tasks.spawn(gpushared::cluster::heartbeat::run(
        client.clone(),
        name.clone(),
        config.kubernetes.heartbeat_seconds.duration(),
    ));
    tasks.spawn(publish::run(
        KubeNode::new(client.clone(), name.clone()),
        Arc::clone(alloc),
        publish::Timing::default(),
    ));
    Ok(client)
}
