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
use gpushared::gpus::events::NvmlEvents;
use gpushared::gpus::health;
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
    let checkpointer = opened.ledger.checkpointer()?;
    std::thread::Builder::new()
        .name("ledger-checkpoint".into())
        .spawn(move || {
            loop {
                std::thread::sleep(Duration::from_secs(10));
                let start = std::time::Instant::now();
                match checkpointer.checkpoint() {
                    Ok(frames) => tracing::debug!(frames, took = ?start.elapsed(), "ledger checkpoint"),
                    Err(e) => tracing::warn!(error = %e, "ledger checkpoint failed; will retry"),
                }
            }
        })
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

    // Pods the over-use detector evicts (`[overuse] action = "evict"`), to the API-server side.
    let (evict_tx, evict_rx) = tokio::sync::mpsc::unbounded_channel();
    // GPU health: NVML events and probes, on a thread of its own.
    let health_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if nvml {
        let events = NvmlEvents::open(&config.nvml.library)?;
        let policy = health::Policy::from(&config.health);
        tracing::info!(
            watched = ?events.watched(),
            ignored_xids = ?policy.ignored_xids,
            probe_interval = ?policy.probe_interval,
            recovery = ?policy.recovery,
            "watching GPU health"
        );
        let mut tracker = health::Tracker::new(policy, inventory.gpus().iter().map(|g| g.index));
        for (gpu, reason) in lost_at_start {
            tracker.start_unhealthy(gpu, reason, std::time::Instant::now());
        }
        // Over-use detection shares the health watcher's NVML handle.
        if config.overuse.enabled {
            let o = &config.overuse;
            tracing::info!(interval = ?o.interval_seconds.duration(), tolerance_mib = o.tolerance_mib,
                action = ?o.action, evict_after = ?o.evict_after_seconds.duration(),
                proc = %o.proc_directory.path().display(), "watching GPU processes against their containers' budgets");
            gpushared::gpus::overuse::spawn(
                gpushared::gpus::overuse::NvmlProcesses::new(events.nvml()),
                gpushared::gpus::overuse::Detector::new(gpushared::gpus::overuse::Policy::from(o)),
                Arc::clone(&alloc),
                pods.clone(),
                gpushared::gpus::overuse::Sampling {
                    every: o.interval_seconds.duration(),
                    proc_dir: o.proc_directory.path().to_owned(),
                },
                evict_tx.clone(),
                Arc::clone(&health_stop),
            )
            .context("starting the GPU over-use thread")?;
        } else {
            tracing::info!("GPU over-use detection is turned off ([overuse] enabled = false)");
        }
        health::spawn(events, tracker, Arc::clone(&alloc), Arc::clone(&health_stop))
            .context("starting the GPU health thread")?;
    } else {
        tracing::warn!(
            "GPU health and over-use are not monitored: the GPUs come from the static [[gpus]] list, not NVML"
        );
    }

    let client = gpushared::cluster::kube::client(config.kubernetes.kubeconfig.path()).await?;
    // Before anything is served or published: a ledger that lost what the node published.
    notifier.status("starting: checking the ledger against the node's last publication");
    let rebuilding = gpushared::cluster::recovery::check_ledger(client.clone(), &node, &alloc).await > 0;
    let mut tasks = tokio::task::JoinSet::new();
    if rebuilding {
        tasks.spawn(gpushared::cluster::recovery::finish_rebuild(Arc::clone(&alloc), pods.clone()));
    }
    tasks.spawn(gpushared::cluster::kube::watch_pods(client.clone(), node.clone(), pods.clone(), Arc::clone(&alloc)));
    tasks.spawn(gpushared::cluster::kube::evict_pods(client.clone(), evict_rx, Arc::clone(&alloc)));
    tasks.spawn(gpushared::cluster::heartbeat::run(
        client.clone(),
        node.clone(),
        config.kubernetes.heartbeat_seconds.duration(),
    ));
    tasks.spawn(publish::run(KubeNode::new(client, node.clone()), Arc::clone(&alloc), publish::Timing::default()));

    // The kubelet's device list follows the GPUs' health.
    let (devices_tx, devices_rx) = watch::channel(plugin::DeviceSnapshot { inventory: Arc::new(inventory), numa });
    tasks.spawn(follow_health(Arc::clone(&alloc), devices_tx));
    // Free pages go back to the kernel every 10 s, and once a burst of allocations has been
    // quiet for 1 s (the device lists and requests it passed through are gone by then).
    tasks.spawn(gpushared::memory::trim_after_bursts(alloc.subscribe()));

    let socket = config.socket_path();
    let dir = config.kubelet.device_plugin_dir.path().to_owned();
    let plugin = Plugin::new(Arc::clone(&alloc), devices_rx);
    let mut server = plugin::Server::start(plugin.clone(), &socket)
        .with_context(|| format!("binding the plugin socket {}", socket.display()))?;
    let mut kubelet = KubeletWatch::new(&dir, &socket);
    tracing::info!(socket = %socket.display(), resource = %alloc.resource(), inotify = kubelet.uses_inotify(), "serving the device plugin API");

    let registered = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let status = Status {
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
        tasks.spawn(report_status(notifier.clone(), status.clone()));
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
    tasks.spawn(reconcile_loop(
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
                    if change.kubelet_restarted {
                        // Once per new kubelet.sock (a restart often removes the plugin socket
                        // first, in an event of its own): the new kubelet's own proposals stay.
                        let forgotten = alloc.kubelet_restarted();
                        tracing::warn!(kubelet = %config.kubelet_socket().display(), forgotten_proposals = forgotten, "the kubelet restarted; registering again");
                    }
                    kubelet.acknowledge_kubelet();
                    registered.store(false, std::sync::atomic::Ordering::SeqCst);
                    status.changed();
                    registration = Some(register());
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
    tasks.abort_all();
    health_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    // The whole log into the file: a lost -wal after a clean stop then loses nothing.
    match alloc.checkpoint_at_stop() {
        Ok(()) => tracing::info!("ledger checkpointed into its file"),
        Err(e) => tracing::warn!(error = %e, "the ledger's write-ahead log could not be emptied at stop"),
    }
    Ok(())
}

/// What the systemd status line says.
#[derive(Clone)]
struct Status {
    alloc: Arc<Allocator>,
    registered: Arc<std::sync::atomic::AtomicBool>,
    kubelet: std::path::PathBuf,
    /// Wakes [`report_status`] when the registration changes.
    wake: Arc<tokio::sync::Notify>,
}

impl Status {
    fn line(&self) -> String {
        let s = self.alloc.summary();
        let gpus = if s.healthy == s.gpus {
            format!("{} GPU{}", s.gpus, if s.gpus == 1 { "" } else { "s" })
        } else {
            format!("{} GPUs ({} unhealthy)", s.gpus, s.gpus - s.healthy)
        };
        let allocations = format!("{} allocation{}", s.allocations, if s.allocations == 1 { "" } else { "s" });
        if self.registered.load(std::sync::atomic::Ordering::SeqCst) {
            format!("serving {gpus}, {allocations}")
        } else {
            format!("waiting for the kubelet at {}; {gpus}, {allocations}", self.kubelet.display())
        }
    }

    /// Wakes [`report_status`].
    fn changed(&self) {
        self.wake.notify_one();
    }
}

/// Sends the status line to systemd after every change, at most every 200 ms.
async fn report_status(notifier: Notifier, status: Status) {
    let mut changes = status.alloc.subscribe();
    let mut last = String::new();
    loop {
        let line = status.line();
        if line != last {
            notifier.status(&line);
            last = line;
        }
        tokio::select! {
            changed = changes.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = status.wake.notified() => {}
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        changes.borrow_and_update();
    }
}

/// Sends the kubelet a new device list when a GPU's health changes.
async fn follow_health(alloc: Arc<Allocator>, devices: watch::Sender<plugin::DeviceSnapshot>) {
    let mut changes = alloc.subscribe();
    loop {
        let now = alloc.current_inventory();
        let differs = devices.borrow().inventory.gpus().iter().zip(now.gpus()).any(|(a, b)| a.health != b.health);
        if differs {
            devices.send_modify(|d| d.inventory = Arc::new(now));
        }
        if changes.changed().await.is_err() {
            return;
        }
    }
}

/// Reconciles the ledger with the kubelet's PodResources API every interval and when asked
/// (after each registration).
async fn reconcile_loop(
    alloc: Arc<Allocator>,
    pods: PodStore,
    socket: std::path::PathBuf,
    config: gpushared::config::ReconcileConfig,
    now: Arc<tokio::sync::Notify>,
) {
    let grace = i64::try_from(config.grace_seconds.duration().as_millis()).unwrap_or(i64::MAX);
    let mut every = tokio::time::interval(config.interval_seconds.duration());
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    let mut warned = false;
    let mut changes = alloc.subscribe();
    loop {
        tokio::select! {
            _ = every.tick() => {}
            () = now.notified() => {}
            // Soon after allocations: the kubelet's record says at once whether an answer went
            // to the pod the daemon took it for, before the node state is published (100 ms).
            Ok(()) = changes.changed() => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                changes.borrow_and_update();
            }
        }
        if !pods.is_synced() {
            tracing::info!("reconciliation waits for the first complete list of this node's pods");
            continue;
        }
        let list = match gpushared::kubelet::pod_resources::list(&socket, Duration::from_secs(10)).await {
            Ok(list) => {
                warned = false;
                list
            }
            Err(e) => {
                if warned {
                    tracing::debug!(error = %e, "reconciliation skipped");
                } else {
                    tracing::warn!(error = %e, "reconciliation skipped; will retry");
                    warned = true;
                }
                continue;
            }
        };
        let view = gpushared::kubelet::pod_resources::kubelet_view(&list, alloc.resource());
        let probe = Arc::clone(&alloc);
        match tokio::task::spawn_blocking(move || probe.reconcile(&view, grace)).await {
            Ok(Ok(repairs)) if repairs.is_empty() => tracing::debug!("reconciled with the kubelet: nothing to repair"),
            Ok(Ok(repairs)) => tracing::info!(repairs = repairs.len(), "reconciled with the kubelet"),
            Ok(Err(e)) => tracing::error!(error = %e, "reconciliation failed"),
            // The runtime stopping under the task: the daemon is stopping, nothing failed.
            Err(e) if e.is_cancelled() => tracing::debug!("reconciliation cancelled: the daemon is stopping"),
            Err(e) => tracing::error!(error = %e, "reconciliation task failed"),
        }
    }
}
