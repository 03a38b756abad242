//! The `gpushared` command line: parse flags, load the configuration, run the daemon.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use clap::Parser;
use futures::FutureExt as _;
use gpushared::allocation::allocator::Allocator;
use gpushared::allocation::ledger::Ledger;
use gpushared::allocation::pods::PodStore;
use gpushared::cli::Cli;
use gpushared::cluster::publish::{self, KubeNode};
use gpushared::config::{Config, DEFAULT_PATH};
use gpushared::kubelet::plugin::{self, Plugin};
use gpushared::kubelet::watch::KubeletWatch;
use gpushared::systemd::{Heartbeat, Notifier};
use std::time::Duration;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::watch;

fn main() -> ExitCode {
    // Before any thread starts: two allocator arenas keep the resident set small (memory.rs).
    gpushared::memory::limit_arenas(2);
    let cli = Cli::parse();
    if let Some(path) = cli.check_config {
        // The file, then every check the daemon runs with it on this host before it serves.
        let checked = Config::load(&path, true)
            .map_err(anyhow::Error::from)
            .and_then(|config| gpushared::startup::inspect_host(&config, &[]).map_err(anyhow::Error::from));
        return match checked {
            Ok(host) => {
                println!(
                    "{}: ok (node {}, {} GPUs from {})",
                    path.display(),
                    host.node,
                    host.inventory.gpus().len(),
                    host.source
                );
                // The check does not open the ledger: a GPU that does not answer is described
                // as if the ledger did not know it; the daemon serves it unhealthy if it does.
                for lost in &host.lost {
                    println!("note: {}", lost.describe());
                }
                for note in &host.notes {
                    println!("note: {note}");
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("gpushared: {}: {e:#}", path.display());
                ExitCode::FAILURE
            }
        };
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let must_exist = cli.config != std::path::Path::new(DEFAULT_PATH);
    let result = Config::load(&cli.config, must_exist).map_err(anyhow::Error::from).and_then(|config| {
        // Two workers whatever the host: the daemon's work is a few calls a second, and tokio's
        // default (one worker per core) would start 128 threads on a 128-core GPU host.
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the async runtime")?
            .block_on(run(config))
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Once, on stderr (the journal under systemd): the log writes to stderr too.
            eprintln!("gpushared: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// SIGTERM and SIGINT, caught from the moment [`StopSignals::install`] returns: a signal that
/// arrives while the daemon starts waits here (instead of killing the process) until the daemon
/// can stop cleanly.
struct StopSignals {
    signals: Option<(Signal, Signal)>,
    arrived: bool,
}

impl StopSignals {
    /// Installs the handlers. If that fails (it does not on Linux), the signals keep their
    /// default action, as before the handlers existed: the process ends at once.
    fn install() -> Self {
        let signals = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
            (Ok(term), Ok(int)) => Some((term, int)),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "cannot catch SIGTERM and SIGINT; they will end the daemon without STOPPING=1");
                None
            }
        };
        StopSignals { signals, arrived: false }
    }

    /// Resolves once SIGTERM or SIGINT has arrived, at once if one already has. Cancel-safe.
    async fn arrived(&mut self) {
        if self.arrived {
            return;
        }
        let Some((term, int)) = &mut self.signals else { return std::future::pending().await };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        self.arrived = true;
    }

    /// Whether SIGTERM or SIGINT has arrived, without waiting.
    fn has_arrived(&mut self) -> bool {
        self.arrived().now_or_never().is_some()
    }
}

async fn run(config: Config) -> anyhow::Result<()> {
    let notifier = Notifier::from_env();
    // First: a SIGTERM while the daemon starts (discovery, the ledger, the D-Bus wait) must end
    // in STOPPING=1 and exit 0 like one later, not kill the process.
    let mut stop = StopSignals::install();
    // The ledger first: it remembers the GPUs, so one that does not answer now is still served
    // (unhealthy) under its last identity.
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
    let host = gpushared::startup::inspect_host(&config, &known)?;
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
    let (node, inventory, nvml) = (host.node, host.inventory, host.nvml.is_some());
    tracing::info!(source = %host.source, gpus = inventory.gpus().len(), node = %node, "GPUs discovered");
    for g in inventory.gpus() {
        tracing::info!(index = g.index, uuid = %g.uuid, model = %g.model, total_mib = g.total.get(), numa = ?g.numa_node,
            mode = %g.mode, healthy = g.health.is_healthy(), "GPU");
    }
    if inventory.gpus().is_empty() {
        tracing::warn!("no GPUs found: the kubelet gets an empty device list");
    }
    let numa = config.resources.numa_topology;
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
            node.clone(),
            config.resources.names(),
            config.resources.compatibility,
            inventory.clone(),
            pods.clone(),
            opened.ledger,
        )?
        .with_mps(config.mps.clone()),
    );
    tracing::info!(live = alloc.summary().allocations, ledger = %config.ledger.path.path().display(), "ledger restored");
    // The history kept to `[ledger] history_days` and `history_max_rows`: at start, then hourly.
    gpushared::allocation::allocator::spawn_history_pruning(
        Arc::clone(&alloc),
        config.ledger.retention(),
        Duration::from_secs(3600),
    )
    .context("starting the ledger pruning thread")?;

    // Pods the over-use detector evicts (`[overuse] action = "evict"`), to the API-server side.
    let (evict_tx, evict_rx) = tokio::sync::mpsc::unbounded_channel();
    // GPU health (NVML events and probes) and over-use, on threads of their own.
    let health_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    gpushared::gpus::monitor::start(&gpushared::gpus::monitor::Monitor {
        nvml,
        config: &config,
        inventory: &inventory,
        lost_at_start,
        alloc: &alloc,
        pods: &pods,
        evictions: &evict_tx,
        stop: &health_stop,
    })?;

    let client = gpushared::cluster::kube::client(config.kubernetes.kubeconfig.path()).await?;
    // Before anything is served or published: a ledger that lost what the node published.
    notifier.status("starting: checking the ledger against the node's last publication");
    let rebuilding = gpushared::cluster::recovery::check_ledger(client.clone(), &node, &alloc).await > 0;
    let mut tasks = tokio::task::JoinSet::new();
    if rebuilding {
        tasks.spawn(gpushared::cluster::recovery::finish_rebuild(Arc::clone(&alloc), pods.clone()));
    }
    tasks.spawn(gpushared::cluster::kube::watch_pods(client.clone(), node.clone(), pods.clone(), Arc::clone(&alloc)));
    let reads = pods.serve_reads();
    tasks.spawn(gpushared::cluster::kube::refresh_pods(
        client.clone(),
        node.clone(),
        pods.clone(),
        reads,
        Arc::clone(&alloc),
    ));
    let fetches = pods.serve_fetches();
    tasks.spawn(gpushared::cluster::kube::fetch_pods(client.clone(), pods.clone(), fetches, Arc::clone(&alloc)));
    tasks.spawn(gpushared::cluster::kube::evict_pods(client.clone(), evict_rx, Arc::clone(&alloc)));
    tasks.spawn(gpushared::cluster::heartbeat::run(
        client.clone(),
        node.clone(),
        config.kubernetes.heartbeat_seconds.duration(),
    ));
    tasks.spawn(publish::run(
        KubeNode::new(client.clone(), node.clone()),
        Arc::clone(&alloc),
        publish::Timing::default(),
    ));

    // The kubelet's device list follows the GPUs' health.
    let (devices_tx, devices_rx) = watch::channel(plugin::DeviceSnapshot { inventory: Arc::new(inventory), numa });
    tasks.spawn(plugin::follow_health(Arc::clone(&alloc), devices_tx));
    // Free pages go back to the kernel every 10 s, and once a burst of allocations has been
    // quiet for 1 s (the device lists and requests it passed through are gone by then).
    tasks.spawn(gpushared::memory::trim_after_bursts(alloc.subscribe()));

    let socket = config.socket_path();
    let dir = config.kubelet.device_plugin_dir.path().to_owned();
    let plugin =
        Plugin::new(Arc::clone(&alloc), devices_rx).with_pod_resources(config.kubelet.pod_resources_socket.path());
    let mut server = plugin::Server::start(plugin.clone(), &socket)
        .with_context(|| format!("binding the plugin socket {}", socket.display()))?;
    let mut kubelet = KubeletWatch::new(&dir, &socket);
    tracing::info!(socket = %socket.display(), resource = %alloc.resource(), inotify = kubelet.uses_inotify(), "serving the device plugin API");

    let registered = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let status = gpushared::status::Status {
        alloc: Arc::clone(&alloc),
        registered: Arc::clone(&registered),
        kubelet: config.kubelet_socket(),
        wake: Arc::new(tokio::sync::Notify::new()),
    };
    // The status API's first connection is made before READY, so `systemctl start gpushared`
    // returns with gpusharectl able to answer; a bus that is down or slow delays it 2 s at most
    // (the status API is never on the allocation path; it keeps retrying in the background).
    // A stop signal during the wait ends it.
    if config.dbus.enabled {
        let (first_tx, first_rx) = tokio::sync::oneshot::channel();
        tasks.spawn(gpushared::dbus::serve(config.dbus.bus(), Arc::clone(&alloc), Some(first_tx)));
        tokio::select! {
            biased;
            () = stop.arrived() => {}
            first = tokio::time::timeout(Duration::from_secs(2), first_rx) => {
                if first.is_err() {
                    tracing::warn!("the D-Bus status API is not up after 2 s; ready without it (it keeps trying)");
                }
            }
        }
    } else {
        tracing::info!("the D-Bus status API is turned off ([dbus] enabled = false)");
    }
    // The main loop beats the heartbeat every time round; the watchdog pings only while it is
    // fresh, so a stuck loop (kubelet restarts, registration, signals) stops the pings too.
    let heartbeat = if stop.has_arrived() {
        // No READY=1: the main loop below stops at once.
        tracing::info!("a stop signal arrived while starting");
        None
    } else {
        notifier.ready(&status.line());
        tasks.spawn(gpushared::status::report_status(notifier.clone(), status.clone()));
        gpushared::systemd::watchdog_interval().map(|interval| {
            let heartbeat = Heartbeat::for_watchdog(interval);
            tracing::info!(
                interval = ?interval,
                heartbeat_period = ?heartbeat.period(),
                heartbeat_bound = ?heartbeat.bound(),
                "systemd watchdog on; pinging at half the interval while the allocator answers and the main loop turns"
            );
            let probe = Arc::clone(&alloc);
            tasks.spawn(gpushared::systemd::watchdog_with_heartbeat(
                notifier.clone(),
                interval,
                heartbeat.clone(),
                move || probe.probe().is_ok(),
            ));
            heartbeat
        })
    };
    let reconcile_now = Arc::new(tokio::sync::Notify::new());
    tasks.spawn(gpushared::kubelet::pod_resources::reconcile_loop(
        Arc::clone(&alloc),
        pods.clone(),
        config.kubelet.pod_resources_socket.path().to_owned(),
        config.reconcile.clone(),
        Arc::clone(&reconcile_now),
    ));

    let register = || {
        Box::pin(plugin::register(
            config.kubelet_socket(),
            config.kubelet.socket_name.as_str().to_owned(),
            alloc.resource().to_owned(),
            true,
        ))
    };
    let mut registration = Some(register());
    let mut dropped = gpushared::kubelet::streams::Dropped::new(plugin.streams());
    // Whole GPUs, when `[sharing] whole` names any: a second resource on a socket of its own.
    let (whole_stop, whole_stop_rx) = watch::channel(false);
    let mut whole = if alloc.inventory().gpus().iter().any(|g| g.mode == gpushare_core::SharingMode::Whole) {
        let endpoint = gpushared::kubelet::whole::Endpoint {
            dir: dir.clone(),
            socket_name: gpushared::kubelet::whole::socket_name(config.kubelet.socket_name.as_str()),
            resource: config.resources.whole.as_str().to_owned(),
        };
        let plugin = gpushared::kubelet::whole::WholePlugin::new(Arc::clone(&alloc), numa);
        Some(tokio::spawn(gpushared::kubelet::whole::run(plugin, endpoint, whole_stop_rx)))
    } else {
        None
    };
    // The DRA driver, when `[sharing] dra` names any GPU: its own sockets and the node's
    // ResourceSlice (docs/dra.md).
    let mut dra = if alloc.inventory().gpus().iter().any(|g| g.mode.is_dra()) {
        Some(tokio::spawn(gpushared::dra::run(
            config.dra.clone(),
            client.clone(),
            Arc::clone(&alloc),
            whole_stop.subscribe(),
        )))
    } else {
        // None (any more): a slice left from when some were is withdrawn, and a registration
        // socket a crash left behind is removed, so the kubelet stops dialing it.
        let _ = std::fs::remove_file(config.dra.registration_socket());
        tokio::spawn(gpushared::dra::slices::withdraw(
            client.clone(),
            config.dra.driver.clone(),
            alloc.node().to_owned(),
        ));
        None
    };
    // Without a watchdog nothing reads the heartbeat, and the timer arm is off.
    let mut beat = tokio::time::interval(heartbeat.as_ref().map_or(Duration::from_secs(3600), Heartbeat::period));
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if let Some(h) = &heartbeat {
            h.beat();
        }
        tokio::select! {
            // A stop first: one that arrived while starting stops the loop before it registers.
            biased;
            () = stop.arrived() => break,
            Some(r) = async { match registration.as_mut() { Some(f) => Some(f.await), None => None } } => {
                registration = None;
                r.map_err(|s| anyhow::anyhow!("the kubelet refused the registration: {}", s.message()))?;
                kubelet.registered();
                dropped.registered();
                registered.store(true, std::sync::atomic::Ordering::SeqCst);
                status.changed();
                reconcile_now.notify_one();
            }
            change = kubelet.changed() => {
                if change.plugin_socket_lost {
                    tracing::warn!(socket = %socket.display(), "the plugin socket was removed (a kubelet restart?); serving on a new one");
                    server.stop(false).await;
                    server = plugin::Server::start(plugin.clone(), &socket)
                        .with_context(|| format!("binding the plugin socket {} again", socket.display()))?;
                    kubelet.acknowledge_plugin_socket();
                }
                if change.kubelet_restarted || change.plugin_socket_lost {
                    // A starting kubelet removes the plugin socket, often seen before its new
                    // kubelet.sock: either ends the calls of the kubelet before, which the new
                    // one never recorded. Its own calls come only after the registration below,
                    // which absorbs a kubelet.sock created meanwhile (no second restart).
                    let forgotten = alloc.kubelet_restarted();
                    tracing::warn!(kubelet = %config.kubelet_socket().display(), forgotten_proposals = forgotten, "the kubelet restarted; registering again");
                    kubelet.acknowledge_kubelet();
                    registered.store(false, std::sync::atomic::Ordering::SeqCst);
                    status.changed();
                    registration = Some(register());
                    dropped.registering();
                }
            }
            () = dropped.dropped(), if registration.is_none() => {
                tracing::warn!(
                    kubelet = %config.kubelet_socket().display(),
                    grace = ?gpushared::kubelet::streams::GRACE,
                    "the kubelet holds no device-list stream of this plugin; registering again"
                );
                registered.store(false, std::sync::atomic::Ordering::SeqCst);
                status.changed();
                registration = Some(register());
            }
            Some(ended) = async { match dra.as_mut() { Some(t) => Some(t.await), None => None } } => {
                dra = None;
                match ended {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(e.into()),
                    Err(e) => bail!("the DRA driver task failed: {e}"),
                }
            }
            Some(ended) = async { match whole.as_mut() { Some(t) => Some(t.await), None => None } } => {
                whole = None;
                match ended {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(e),
                    Err(e) => bail!("the whole-GPU plugin task failed: {e}"),
                }
            }
            // Turns the loop (and so beats the heartbeat) when nothing else happens.
            _ = beat.tick(), if heartbeat.is_some() => {}
        }
    }
    tracing::info!("stopping");
    notifier.stopping("stopping: closing the plugin socket");
    // End the ListAndWatch streams first: a graceful shutdown waits for open streams.
    server.stop(true).await;
    let _ = whole_stop.send(true);
    if let Some(t) = whole
        && tokio::time::timeout(Duration::from_secs(6), t).await.is_err()
    {
        tracing::warn!("the whole-GPU plugin did not stop within 6 s");
    }
    if let Some(t) = dra
        && tokio::time::timeout(Duration::from_secs(6), t).await.is_err()
    {
        tracing::warn!("the DRA driver did not stop within 6 s");
    }
    tasks.abort_all();
    health_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    // The whole log into the file: a lost -wal after a clean stop then loses nothing.
    match alloc.checkpoint_at_stop() {
        Ok(()) => tracing::info!("ledger checkpointed into its file"),
        Err(e) => tracing::warn!(error = %e, "the ledger's write-ahead log could not be emptied at stop"),
    }
    Ok(())
}
