//! `gpushare-extender`: the command line. Without a subcommand it serves kube-scheduler (the
//! configuration file says where and how); `simulate` is the offline run of the same
//! placement decisions over a cluster description and Pod manifests.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser as _;
use gpushare_core::ResourceNames;
use gpushare_core::placement::{GpuPolicy, NodePolicy};
use gpushare_core::schedule::Policies;
use gpushare_extender::cli::{ExtenderCli, ExtenderCommand, print_stdout};
use gpushare_extender::config::{Compatibility, Config, DEFAULT_PATH};
use gpushare_extender::confine;
use gpushare_extender::kube::{KubeCluster, client, watch};
use gpushare_extender::server::{ServerOptions, observe_router, router, serve, tls_acceptor};
use gpushare_extender::service::Extender;
use gpushare_extender::simulate::{Simulation, parse_cluster, parse_workload, run};
use gpushare_extender::view::{ClusterView, ViewConfig};
use gpushare_sdnotify::{Notifier, watchdog, watchdog_interval};

fn main() -> ExitCode {
    match real_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpushare-extender: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> anyhow::Result<()> {
    let cli = ExtenderCli::parse();
    if let Some(path) = cli.check_config {
        // The confinement too: the extender refuses to start without the one asked for.
        unit_drop_in(&Config::load(&path, true)?)?;
        println!("{}: ok", path.display());
        return Ok(());
    }
    let must_exist = cli.config != Path::new(DEFAULT_PATH);
    if cli.unit_drop_in {
        let made = unit_drop_in(&Config::load(&cli.config, must_exist)?)?;
        return print_stdout(&made.unwrap_or_default()).context("writing to stdout");
    }
    let Some(command) = cli.command else {
        let config = Config::load(&cli.config, must_exist)?;
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init();
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the async runtime")?
            .block_on(serve_scheduler(config));
    };
    match command {
        ExtenderCommand::Simulate { cluster, workload, gpu_policy, node_policy, alibaba, show_annotations } => {
            let read =
                |path: &PathBuf| std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()));
            let spec = parse_cluster(&read(&cluster)?).with_context(|| format!("{}", cluster.display()))?;
            let pods = parse_workload(&read(&workload)?).with_context(|| format!("{}", workload.display()))?;
            let names = if alibaba { ResourceNames::alibaba() } else { ResourceNames::gpushare() };
            let policies = Policies { gpu: gpu_policy, node: node_policy };
            let mut sim = Simulation::new(&spec, names, policies).with_context(|| format!("{}", cluster.display()))?;
            let header = format!(
                "Placing {} pods from {} on {} nodes (unit {}, GPU policy {}, node policy {})\n\n",
                pods.len(),
                workload.display(),
                spec.nodes.len(),
                spec.unit,
                policy_name(gpu_policy == GpuPolicy::Binpack),
                policy_name(node_policy == NodePolicy::Binpack),
            );
            // `simulate ... | head` stops reading early: not an error (print! would panic).
            print_stdout(&format!("{header}{}", run(&mut sim, &pods, show_annotations))).context("writing to stdout")
        }
    }
}

/// The drop-in `config` asks for ([`confine::drop_in`]), outside the serving runtime.
fn unit_drop_in(config: &Config) -> anyhow::Result<Option<String>> {
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the async runtime")?;
    Ok(runtime.block_on(confine::drop_in(config))?)
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

async fn serve_scheduler(config: Config) -> anyhow::Result<()> {
    // A confinement asked for is made by the unit's generator from this same answer: refusing
    // here keeps the extender from running unconfined when it cannot be made.
    confine::drop_in(&config).await?;
    let tls = match config.server.tls() {
        Some((cert, key)) => Some(tls_acceptor(cert, key, config.server.client_ca.as_deref())?),
        None => None,
    };
    let client = client(config.kubernetes.kubeconfig.as_deref())
        .await
        .context("cannot reach the API server (set [kubernetes] kubeconfig)")?;
    let view = ClusterView::new(ViewConfig {
        unit: config.resources.unit,
        names: config.resources.names(),
        alibaba: config.resources.compatibility == Compatibility::Alibaba,
        assume_ttl: std::time::Duration::from_secs(config.scheduling.assume_timeout_seconds),
        heartbeat_by_wall_clock: false,
    });
    let extender = Arc::new(
        Extender::new(view, KubeCluster::new(client.clone()), config.scheduling.policies())
            .with_busy_weight(config.scheduling.busy_weight)
            .with_lookalike_wait(config.scheduling.lookalike_wait())
            .with_scheduler_names(config.scheduling.scheduler_names.clone()),
    );
    let listen = config.server.listen;
    let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| {
        format!(
            "cannot listen on {listen} (set [server] listen; under systemd, a port other than 39999 also needs \
                 SocketBindAllow=tcp:PORT in a drop-in)"
        )
    })?;
    let options = ServerOptions {
        prefix: config.server.prefix.clone(),
        max_body_bytes: config.server.max_body_bytes,
        timeout: config.server.request_timeout(),
    };
    let app = router(extender.clone(), &options);
    let observe = config.server.observe_listen;
    let observe_listener = tokio::net::TcpListener::bind(observe).await.with_context(|| {
        format!(
            "cannot listen on {observe} (set [server] observe_listen; under systemd, a port other than 39998 \
                 also needs SocketBindAllow=tcp:PORT in a drop-in)"
        )
    })?;
    let observe_app = observe_router(extender.clone(), &options);
    let watcher = tokio::spawn(watch(client, extender.clone()));
    let addr = listener.local_addr()?;
    let client_auth = config.server.client_ca.is_some();
    let observe_addr = observe_listener.local_addr()?;
    tracing::info!(listen = %addr, observe_listen = %observe_addr, prefix = %options.prefix, tls = tls.is_some(),
        client_auth, unit = %config.resources.unit, "serving kube-scheduler");
    if !addr.ip().is_loopback() && !client_auth {
        tracing::warn!(listen = %addr,
            "serving beyond loopback without client authentication (allow_unauthenticated): anyone who reaches \
             this address can bind pods to any node");
    }
    // Type=notify: ready once kube-scheduler can connect (healthz answers); the status line
    // follows the view's sync, and the watchdog is earned by the view's lock answering.
    let notifier = Notifier::from_env();
    notifier.ready(&status_line(addr, false));
    let status = tokio::spawn(follow_readiness(notifier.clone(), extender.clone(), addr));
    let watchdog = watchdog_interval().map(|interval| {
        let ext = extender.clone();
        tokio::spawn(watchdog(notifier.clone(), interval, move || ext.with_view_batched(|_| true)))
    });
    let shutdown = {
        let notifier = notifier.clone();
        async move {
            terminated().await;
            notifier.stopping("stopping: finishing the requests in flight");
        }
    };
    // /metrics and /inspect on their own listener, with the same TLS; stopped with the other.
    let (stop_observe, observe_stopped) = tokio::sync::oneshot::channel::<()>();
    let observer = tokio::spawn(serve(observe_listener, observe_app, tls.clone(), async {
        let _ = observe_stopped.await;
    }));
    serve(listener, app, tls, shutdown).await.context("serving")?;
    let _ = stop_observe.send(());
    if let Ok(Err(e)) = observer.await {
        tracing::warn!(error = %e, "serving /metrics and /inspect");
    }
    watcher.abort();
    status.abort();
    if let Some(w) = watchdog {
        w.abort();
    }
    tracing::info!("stopped");
    Ok(())
}

/// The `STATUS=` line systemd shows.
fn status_line(addr: std::net::SocketAddr, synced: bool) -> String {
    if synced {
        format!("serving kube-scheduler on {addr}; the view of nodes and pods is synced")
    } else {
        format!("serving kube-scheduler on {addr}; waiting for the first list of nodes and pods")
    }
}

/// Keeps the status line in step with the view's readiness (it turns back while a watch
/// relists after an API-server outage).
async fn follow_readiness(notifier: Notifier, extender: Arc<Extender<KubeCluster>>, addr: std::net::SocketAddr) {
    let mut shown = false;
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        let ready = extender.is_ready();
        if ready != shown {
            notifier.status(&status_line(addr, ready));
            shown = ready;
        }
    }
}

fn policy_name(binpack: bool) -> &'static str {
    if binpack { "binpack" } else { "spread" }
}
