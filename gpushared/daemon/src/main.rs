//! The `gpushared` command line: parse flags, load the configuration, run the daemon.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use clap::Parser;
use gpushare_core::NodeInventory;
use gpushare_core::devices::{KUBELET_MAX_MESSAGE_BYTES, list_and_watch_size};
use gpushared::allocator::Allocator;
use gpushared::config::{Config, DEFAULT_PATH};
use gpushared::discovery::{Discovery, NvmlDiscovery, StaticDiscovery};
use gpushared::ledger::Ledger;
use gpushared::plugin::{self, Plugin};
use gpushared::pods::PodStore;
use tokio::sync::watch;

/// gpushare's node daemon: serves the kubelet's device plugin API for GPU memory.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// The configuration file (a missing file at the default path means all defaults).
    #[arg(long, value_name = "FILE", default_value = DEFAULT_PATH)]
    config: PathBuf,
    /// Check FILE and exit: 0 if gpushared would accept it, 1 with the reason if not.
    #[arg(long, value_name = "FILE")]
    check_config: Option<PathBuf>,
}

fn main() -> ExitCode {
    // Before any thread starts: two allocator arenas keep the resident set small (memory.rs).
    gpushared::memory::limit_arenas(2);
    let cli = Cli::parse();
    if let Some(path) = cli.check_config {
        return match Config::load(&path, true) {
            Ok(_) => {
                println!("{}: ok", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("gpushared: {e}");
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
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the async runtime")?
            .block_on(run(config))
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("gpushared: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Resolves when SIGTERM or SIGINT arrives.
async fn terminated() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

async fn run(config: Config) -> anyhow::Result<()> {
    let node = config
        .node_name()
        .context("cannot tell this node's name: set node_name in the configuration or the NODE_NAME variable")?;
    let discovery: Box<dyn Discovery> = if config.gpus.is_empty() {
        Box::new(NvmlDiscovery::init(&config.nvml.library)?)
    } else {
        Box::new(StaticDiscovery::new(config.gpus.iter().map(gpushared::config::StaticGpu::to_gpu).collect()))
    };
    let gpus = discovery.discover()?;
    let inventory = NodeInventory::new(config.resources.unit, gpus)
        .with_context(|| format!("GPUs from {}", discovery.describe()))?;
    tracing::info!(source = %discovery.describe(), gpus = inventory.gpus().len(), node = %node, "GPUs discovered");
    for g in inventory.gpus() {
        tracing::info!(index = g.index, uuid = %g.uuid, model = %g.model, total_mib = g.total.get(), numa = ?g.numa_node, "GPU");
    }
    if inventory.gpus().is_empty() {
        tracing::warn!("no GPUs found: the kubelet gets an empty device list");
    }
    let numa = config.resources.numa_topology;
    let size = list_and_watch_size(&inventory, numa);
    if size > KUBELET_MAX_MESSAGE_BYTES {
        let hint = if numa && list_and_watch_size(&inventory, false) <= KUBELET_MAX_MESSAGE_BYTES {
            "set [resources] numa_topology = false, or unit = \"GiB\" on every node and the extender"
        } else {
            "set [resources] unit = \"GiB\" on every node and the extender"
        };
        bail!(
            "this node's device list ({} devices of 1 {}) would be {size} bytes, over the kubelet's {KUBELET_MAX_MESSAGE_BYTES}-byte \
             message limit, and the kubelet would drop every device; {hint}",
            gpushare_core::devices::DeviceMap::new(&inventory).total(),
            inventory.unit(),
        );
    }

    let opened = Ledger::open(config.ledger.path.path())?;
    if let Some((aside, why)) = &opened.moved_aside {
        tracing::error!(
            kept_at = %aside.display(),
            reason = %why,
            "THE ALLOCATION LEDGER WAS UNUSABLE and has been moved aside; starting with an empty ledger"
        );
    }
    // Copy the write-ahead log into the database file every 10 s, off the allocation path.
    let checkpointer = opened.ledger.checkpointer()?;
    std::thread::Builder::new()
        .name("ledger-checkpoint".into())
        .spawn(move || {
            loop {
                std::thread::sleep(std::time::Duration::from_secs(10));
                if let Err(e) = checkpointer.checkpoint() {
                    tracing::warn!(error = %e, "ledger checkpoint failed; will retry");
                }
            }
        })
        .context("starting the ledger checkpoint thread")?;
    let pods = PodStore::new();
    let alloc = Arc::new(Allocator::new(
        node.clone(),
        config.resources.names(),
        config.resources.compatibility,
        inventory.clone(),
        pods.clone(),
        opened.ledger,
    )?);
    tracing::info!(live = alloc.live()?.len(), ledger = %config.ledger.path.path().display(), "ledger restored");

    let client = gpushared::kube::client(config.kubernetes.kubeconfig.path()).await?;
    let watch_task = tokio::spawn(gpushared::kube::watch_pods(client, node.clone(), pods, Arc::clone(&alloc)));

    let (devices_tx, devices_rx) =
        watch::channel(plugin::DeviceSnapshot { inventory: Arc::new(inventory.clone()), numa });
    let socket = config.socket_path();
    let listener = plugin::bind(&socket).with_context(|| format!("binding the plugin socket {}", socket.display()))?;
    // The device list sent to the kubelet is built only while it is sent; hand its pages back.
    let trim_task = tokio::spawn(async {
        let mut every = tokio::time::interval(std::time::Duration::from_secs(10));
        loop {
            every.tick().await;
            let _ = tokio::task::spawn_blocking(gpushared::memory::release_free_memory).await;
        }
    });
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let server = tokio::spawn(plugin::serve(Plugin::new(Arc::clone(&alloc), devices_rx), listener, async move {
        let _ = stop_rx.wait_for(|stop| *stop).await;
    }));
    tracing::info!(socket = %socket.display(), resource = %alloc.resource(), "serving the device plugin API");

    let registration = plugin::register(
        config.kubelet_socket(),
        config.kubelet.socket_name.as_str().to_owned(),
        alloc.resource().to_owned(),
    );
    let stopped = terminated();
    tokio::pin!(stopped);
    tokio::select! {
        r = registration => {
            r.map_err(|s| anyhow::anyhow!("the kubelet refused the registration: {}", s.message()))?;
            stopped.await;
        }
        () = &mut stopped => {}
    }
    tracing::info!("stopping");
    // End the ListAndWatch streams first: a graceful shutdown waits for open streams.
    drop(devices_tx);
    let _ = stop_tx.send(true);
    if tokio::time::timeout(std::time::Duration::from_secs(5), server).await.is_err() {
        tracing::warn!("the plugin server did not stop within 5 s");
    }
    watch_task.abort();
    trim_task.abort();
    let _ = std::fs::remove_file(&socket);
    Ok(())
}
