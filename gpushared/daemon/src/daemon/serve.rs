//! The daemon's kubelet side while it serves: the device-plugin server and its registrations
//! (or, where the kubelet counts the memory, the Node's count instead), kubelet restarts and
//! dropped streams, the whole-GPU plugin and the DRA driver as tasks of their own, the
//! heartbeat the watchdog reads; until a stop signal, then their orderly stop.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use gpushare_core::SharingMode;
use gpushared::allocation::allocator::Allocator;
use gpushared::config::Config;
use gpushared::kubelet::plugin::{self, Plugin};
use gpushared::kubelet::streams::{self, Dropped};
use gpushared::kubelet::watch::{Change, KubeletWatch};
use gpushared::status::Status;
use gpushared::systemd::Heartbeat;
use gpushared::systemd::Notifier;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use super::signals::StopSignals;
use super::start::Node;

/// A registration with the kubelet under way.
type Registration = Pin<Box<dyn Future<Output = Result<(), tonic::Status>> + Send>>;

/// The device-plugin server and what follows the kubelet for it.
pub(super) struct Serving {
    alloc: Arc<Allocator>,
    plugin: Plugin,
    socket: PathBuf,
    /// The server on the socket now (`None` only while it is replaced).
    server: Option<plugin::Server>,
    kubelet: KubeletWatch,
    dropped: Dropped,
    registered: Arc<AtomicBool>,
    /// For the DRA driver's ResourceSlice.
    client: kube::Client,
    /// The daemon's status line and D-Bus answers.
    pub(super) status: Status,
}

impl Serving {
    /// Serves the device plugin API on its socket, the kubelet's device list following GPU
    /// health (tasks in `tasks`); nothing is registered yet.
    ///
    /// # Errors
    /// The socket cannot be bound.
    pub(super) fn start(
        config: &Config,
        node: &Node,
        client: kube::Client,
        tasks: &mut JoinSet<()>,
    ) -> anyhow::Result<Serving> {
        let alloc = Arc::clone(&node.alloc);
        let snapshot = plugin::DeviceSnapshot {
            inventory: Arc::new(node.inventory.clone()),
            numa: config.resources.numa_topology,
        };
        let (devices_tx, devices_rx) = watch::channel(snapshot);
        tasks.spawn(plugin::follow_health(Arc::clone(&alloc), devices_tx));
        // Free pages go back to the kernel every 10 s, and once a burst of allocations has been
        // quiet for 1 s (the device lists and requests it passed through are gone by then).
        tasks.spawn(gpushared::memory::trim_after_bursts(alloc.subscribe()));

        let socket = config.socket_path();
        let plugin =
            Plugin::new(Arc::clone(&alloc), devices_rx).with_pod_resources(config.kubelet.pod_resources_socket.path());
        let server = plugin::Server::start(plugin.clone(), &socket)
            .with_context(|| format!("binding the plugin socket {}", socket.display()))?;
        let kubelet = KubeletWatch::new(config.kubelet.device_plugin_dir.path(), &socket);
        tracing::info!(socket = %socket.display(), resource = %alloc.resource(), inotify = kubelet.uses_inotify(), "serving the device plugin API");
        let registered = Arc::new(AtomicBool::new(false));
        let status = Status {
            alloc: Arc::clone(&alloc),
            registered: Arc::clone(&registered),
            kubelet: config.kubelet_socket(),
            wake: Arc::new(tokio::sync::Notify::new()),
        };
        let dropped = Dropped::new(plugin.streams());
        Ok(Serving { alloc, plugin, socket, server: Some(server), kubelet, dropped, registered, client, status })
    }

    /// Registers with the kubelet and serves until a stop signal: reconciles with the kubelet
    /// after every registration, serves on a new socket and registers again after a kubelet
    /// restart or a dropped stream, runs the whole-GPU plugin and the DRA driver when the GPUs'
    /// modes ask for them, and beats `heartbeat` every time round. Then says STOPPING=1 and
    /// stops them all, the plugin socket removed.
    ///
    /// # Errors
    /// The kubelet refused the registration, the socket cannot be bound again, or the
    /// whole-GPU plugin or the DRA driver failed; the daemon then exits at once, as it would.
    pub(super) async fn run(
        mut self,
        config: &Config,
        node: &Node,
        stop: &mut StopSignals,
        notifier: &Notifier,
        heartbeat: Option<Heartbeat>,
        tasks: &mut JoinSet<()>,
    ) -> anyhow::Result<()> {
        let reconcile_now = Arc::new(tokio::sync::Notify::new());
        tasks.spawn(gpushared::kubelet::pod_resources::reconcile_loop(
            Arc::clone(&self.alloc),
            node.pods.clone(),
            config.kubelet.pod_resources_socket.path().to_owned(),
            config.reconcile.clone(),
            Arc::clone(&reconcile_now),
            self.plugin.latest_list(),
        ));
        if config.nri.enabled {
            tasks.spawn(gpushared::nri::run(Arc::clone(&self.alloc), config.nri.clone()));
        }
        // A node whose kubelet counts the memory registers no device plugin for it: its Node's
        // status carries the count instead, and containers are served at their creation.
        let counted = self.alloc.counted();
        let mut registration = if counted {
            tasks.spawn(gpushared::cluster::capacity::run(
                self.client.clone(),
                self.alloc.node().to_owned(),
                Arc::clone(&self.alloc),
            ));
            self.set_registered(true);
            None
        } else {
            Some(self.register(config))
        };
        let (others_stop, others_stop_rx) = watch::channel(false);
        let mut whole = self.start_whole(config, others_stop_rx);
        let mut dra = self.start_dra(config, &others_stop);
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
                    self.kubelet.registered();
                    self.dropped.registered();
                    self.set_registered(true);
                    reconcile_now.notify_one();
                }
                change = self.kubelet.changed() => {
                    self.follow(change).await?;
                    if counted {
                        self.set_registered(true);
                    } else if change.kubelet_restarted || change.plugin_socket_lost {
                        registration = Some(self.register(config));
                        self.dropped.registering();
                    }
                }
                () = self.dropped.dropped(), if registration.is_none() => {
                    tracing::warn!(
                        kubelet = %config.kubelet_socket().display(),
                        grace = ?streams::GRACE,
                        "the kubelet holds no device-list stream of this plugin; registering again"
                    );
                    self.set_registered(false);
                    registration = Some(self.register(config));
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
        if let Some(server) = self.server.take() {
            server.stop(true).await;
        }
        let _ = others_stop.send(true);
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
        Ok(())
    }

    fn register(&self, config: &Config) -> Registration {
        Box::pin(plugin::register(
            config.kubelet_socket(),
            config.kubelet.socket_name.as_str().to_owned(),
            self.alloc.resource().to_owned(),
            true,
        ))
    }

    fn set_registered(&self, registered: bool) {
        self.registered.store(registered, Ordering::SeqCst);
        self.status.changed();
    }

    /// After a kubelet restart (or the plugin socket's loss): serves on a new socket, and
    /// forgets what the kubelet before left open; the caller registers again.
    async fn follow(&mut self, change: Change) -> anyhow::Result<()> {
        if change.plugin_socket_lost {
            tracing::warn!(socket = %self.socket.display(), "the plugin socket was removed (a kubelet restart?); serving on a new one");
            if let Some(old) = self.server.take() {
                old.stop(false).await;
            }
            self.server = Some(
                plugin::Server::start(self.plugin.clone(), &self.socket)
                    .with_context(|| format!("binding the plugin socket {} again", self.socket.display()))?,
            );
            self.kubelet.acknowledge_plugin_socket();
        }
        if change.kubelet_restarted || change.plugin_socket_lost {
            // A starting kubelet removes the plugin socket, often seen before its new
            // kubelet.sock: either ends the calls of the kubelet before, which the new one never
            // recorded. Its own calls come only after the registration that follows, which
            // absorbs a kubelet.sock created meanwhile (no second restart).
            let forgotten = self.alloc.kubelet_restarted();
            tracing::warn!(kubelet = %self.status.kubelet.display(), forgotten_proposals = forgotten, "the kubelet restarted; registering again");
            self.kubelet.acknowledge_kubelet();
            self.set_registered(false);
        }
        Ok(())
    }

    /// Whole GPUs, when `[sharing] whole` names any: a second resource on a socket of its own.
    fn start_whole(&self, config: &Config, stop: watch::Receiver<bool>) -> Option<JoinHandle<anyhow::Result<()>>> {
        if !self.alloc.inventory().gpus().iter().any(|g| g.mode == SharingMode::Whole) {
            return None;
        }
        let endpoint = gpushared::kubelet::whole::Endpoint {
            dir: config.kubelet.device_plugin_dir.path().to_owned(),
            socket_name: gpushared::kubelet::whole::socket_name(config.kubelet.socket_name.as_str()),
            resource: config.resources.whole.as_str().to_owned(),
        };
        let plugin =
            gpushared::kubelet::whole::WholePlugin::new(Arc::clone(&self.alloc), config.resources.numa_topology);
        Some(tokio::spawn(gpushared::kubelet::whole::run(plugin, endpoint, stop)))
    }

    /// The DRA driver, when `[sharing] dra` names any GPU: its own sockets and the node's
    /// ResourceSlice (docs/dra.md). None (any more): a slice left from when some were is
    /// withdrawn, and a registration socket a crash left behind is removed, so the kubelet
    /// stops dialing it.
    fn start_dra(
        &self,
        config: &Config,
        stop: &watch::Sender<bool>,
    ) -> Option<JoinHandle<Result<(), gpushared::dra::DraError>>> {
        if self.alloc.inventory().gpus().iter().any(|g| g.mode.is_dra()) {
            return Some(tokio::spawn(gpushared::dra::run(
                config.dra.clone(),
                self.client.clone(),
                Arc::clone(&self.alloc),
                stop.subscribe(),
            )));
        }
        let _ = std::fs::remove_file(config.dra.registration_socket());
        tokio::spawn(gpushared::dra::slices::withdraw(
            self.client.clone(),
            config.dra.driver.clone(),
            self.alloc.node().to_owned(),
        ));
        None
    }
}
