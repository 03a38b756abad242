//! The daemon's run, step by step, as systemd sees it: start (the ledger, the GPUs, the
//! cluster), serve the device plugin API, say READY=1, follow the kubelet until a stop signal,
//! then stop cleanly. Each step is its module's; this one only puts them in order.
//!
//! - [`signals`]: SIGTERM and SIGINT, caught from the first moment;
//! - [`start`]: the ledger, the GPUs and the allocator; GPU health; the cluster side;
//! - [`serve`]: the device-plugin server, its registrations and the kubelet's restarts.

mod serve;
mod signals;
mod start;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use gpushared::config::Config;
use gpushared::status::Status;
use gpushared::systemd::{Heartbeat, Notifier};
use tokio::task::JoinSet;

use serve::Serving;
use signals::StopSignals;

/// Runs the daemon with `config` until SIGTERM or SIGINT.
///
/// # Errors
/// What stops it from starting or serving, with its context.
pub(crate) async fn run(config: Config) -> anyhow::Result<()> {
    let notifier = Notifier::from_env();
    // First: a SIGTERM while the daemon starts (discovery, the ledger, the D-Bus wait) must end
    // in STOPPING=1 and exit 0 like one later, not kill the process.
    let mut stop = StopSignals::install();
    let node = start::open(&config, &notifier)?;
    let (evict_tx, evict_rx) = tokio::sync::mpsc::unbounded_channel();
    let health_stop = start::watch_gpus(&config, &node, &evict_tx)?;
    let mut tasks = JoinSet::new();
    let client = start::join_cluster(&config, &node, &notifier, evict_rx, &mut tasks).await?;
    let serving = Serving::start(&config, &node, client, &mut tasks)?;
    let heartbeat = ready(&config, &node, &serving.status, &notifier, &mut stop, &mut tasks).await;
    serving.run(&config, &node, &mut stop, &notifier, heartbeat, &mut tasks).await?;
    tasks.abort_all();
    health_stop.store(true, Ordering::Relaxed);
    // The whole log into the file: a lost -wal after a clean stop then loses nothing.
    match node.alloc.checkpoint_at_stop() {
        Ok(()) => tracing::info!("ledger checkpointed into its file"),
        Err(e) => tracing::warn!(error = %e, "the ledger's write-ahead log could not be emptied at stop"),
    }
    Ok(())
}

/// The status API's first connection, then READY=1 with the status line and, under a systemd
/// watchdog, the heartbeat its pings follow. None (and no READY=1) when a stop signal arrived
/// while starting: the serving loop then stops at once.
///
/// The status API's first connection is made before READY, so `systemctl start gpushared`
/// returns with gpusharectl able to answer; a bus that is down or slow delays it 2 s at most
/// (the status API is never on the allocation path; it keeps retrying in the background). A
/// stop signal during the wait ends it.
async fn ready(
    config: &Config,
    node: &start::Node,
    status: &Status,
    notifier: &Notifier,
    stop: &mut StopSignals,
    tasks: &mut JoinSet<()>,
) -> Option<Heartbeat> {
    if config.dbus.enabled {
        let (first_tx, first_rx) = tokio::sync::oneshot::channel();
        tasks.spawn(gpushared::dbus::serve(config.dbus.bus(), Arc::clone(&node.alloc), Some(first_tx)));
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
    if stop.has_arrived() {
        tracing::info!("a stop signal arrived while starting");
        return None;
    }
    notifier.ready(&status.line());
    tasks.spawn(gpushared::status::report_status(notifier.clone(), status.clone()));
    // The serving loop beats the heartbeat every time round; the watchdog pings only while it
    // is fresh, so a stuck loop (kubelet restarts, registration, signals) stops the pings too.
    let interval = gpushared::systemd::watchdog_interval()?;
    let heartbeat = Heartbeat::for_watchdog(interval);
    tracing::info!(
        interval = ?interval,
        heartbeat_period = ?heartbeat.period(),
        heartbeat_bound = ?heartbeat.bound(),
        "systemd watchdog on; pinging at half the interval while the allocator answers and the main loop turns"
    );
    let probe = Arc::clone(&node.alloc);
    tasks.spawn(gpushared::systemd::watchdog_with_heartbeat(
        notifier.clone(),
        interval,
        heartbeat.clone(),
        move || probe.probe().is_ok(),
    ));
    Some(heartbeat)
}
