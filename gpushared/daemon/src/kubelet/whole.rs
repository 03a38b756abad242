//! Whole GPUs beside the shares: the GPUs `[sharing] whole` names are served as a second
//! device-plugin resource (`[resources] whole`, `gpushare.io/gpu` by default) on a socket of
//! their own, one device per GPU named by its UUID, registered with the kubelet like the memory
//! resource. kube-scheduler and the kubelet count it as any extended resource.
//!
//! A GPU is either shared or whole, never both: a whole GPU offers no memory devices (the
//! core's capacity is zero), the extender never places a share on it (it is not schedulable
//! for shares), and its whole device is reported `Unhealthy` to the kubelet while it is
//! unhealthy, cordoned, or still holds shares from before it was switched to `whole` (so the
//! kubelet hands it to no pod until those containers are gone). `Allocate` answers
//! `NVIDIA_VISIBLE_DEVICES` with the GPUs' UUIDs and records the hand-out in the ledger history.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use gpushare_core::{Gpu, Mib, SharingMode};
use gpushare_proto::deviceplugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
use gpushare_proto::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, Device, DevicePluginOptions, Empty,
    ListAndWatchResponse, NumaNode, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, TopologyInfo,
};
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::allocation::allocator::Allocator;
use crate::kubelet::plugin::stopped;
use crate::kubelet::streams::{self, Dropped, StreamCount};
use crate::kubelet::watch::KubeletWatch;

/// The whole GPUs' devices as the kubelet sees them now: each whole-mode GPU, by UUID,
/// `Healthy` only while it is healthy, not cordoned, and holds no share.
#[must_use]
pub fn devices(gpus: &[Gpu], used: &[Mib], numa: bool) -> Vec<Device> {
    gpus.iter()
        .zip(used.iter().copied().chain(std::iter::repeat(Mib::ZERO)))
        .filter(|(g, _)| g.mode == SharingMode::Whole)
        .map(|(g, used)| Device {
            id: g.uuid.to_string(),
            health: if unusable(g, used).is_none() { gpushare_proto::HEALTHY } else { gpushare_proto::UNHEALTHY }
                .to_owned(),
            topology: g.numa_node.filter(|_| numa).map(|n| TopologyInfo { nodes: vec![NumaNode { id: i64::from(n) }] }),
        })
        .collect()
}

/// Why a whole GPU cannot be handed out now, if it cannot.
fn unusable(g: &Gpu, used: Mib) -> Option<String> {
    if let gpushare_core::Health::Unhealthy { reason } = &g.health {
        Some(format!("GPU{} ({}) is unhealthy: {reason}", g.index, g.uuid))
    } else if g.cordoned {
        Some(format!("GPU{} ({}) is cordoned", g.index, g.uuid))
    } else if used > Mib::ZERO {
        Some(format!(
            "GPU{} ({}) still holds {} MiB of shares from before it was set to whole; it is handed out once they are released",
            g.index,
            g.uuid,
            used.get()
        ))
    } else {
        None
    }
}

/// The tonic service for the whole-GPU resource.
#[derive(Debug, Clone)]
pub struct WholePlugin {
    alloc: Arc<Allocator>,
    numa: bool,
    stop: watch::Receiver<bool>,
    /// The `ListAndWatch` streams open, on every server of this plugin.
    streams: StreamCount,
}

impl WholePlugin {
    /// A service answering from `alloc`'s GPUs; `numa` publishes their NUMA nodes.
    #[must_use]
    pub fn new(alloc: Arc<Allocator>, numa: bool) -> Self {
        WholePlugin { alloc, numa, stop: watch::Sender::new(false).subscribe(), streams: StreamCount::default() }
    }

    fn current(&self) -> Vec<Device> {
        let state = self.alloc.node_state(0, "");
        devices(state.inventory.gpus(), &state.used, self.numa)
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for WholePlugin {
    async fn get_device_plugin_options(&self, _: Request<Empty>) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions { pre_start_required: false, get_preferred_allocation_available: false }))
    }

    type ListAndWatchStream = DeviceStream;

    /// The list now and after every change of health, cordon or shares that changes it.
    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let this = self.clone();
        let changes = tokio_stream::wrappers::WatchStream::new(self.alloc.subscribe());
        let mut last: Option<Vec<Device>> = None;
        let open = self.streams.open();
        let lists = changes
            .filter_map(move |_| {
                let _counted = &open;
                let now = this.current();
                let changed = last.as_ref() != Some(&now);
                last = Some(now.clone());
                std::future::ready(changed.then(|| Ok(ListAndWatchResponse { devices: now, source: None })))
            })
            .take_until(Box::pin(stopped(self.stop.clone())));
        Ok(Response::new(Box::pin(lists)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented("gpushared's whole-GPU resource has no preferred allocation (its options say so)"))
    }

    async fn allocate(&self, request: Request<AllocateRequest>) -> Result<Response<AllocateResponse>, Status> {
        let state = self.alloc.node_state(0, "");
        let gpus = state.inventory.gpus();
        let mut responses = Vec::new();
        let mut handed = Vec::new();
        for r in request.into_inner().container_requests {
            if r.devices_ids.is_empty() {
                return Err(Status::invalid_argument("a container request with no device IDs"));
            }
            let mut uuids = Vec::with_capacity(r.devices_ids.len());
            let mut minors = Vec::with_capacity(r.devices_ids.len());
            for id in &r.devices_ids {
                let Some((pos, g)) = gpus.iter().enumerate().find(|(_, g)| g.uuid.as_str() == id) else {
                    return Err(Status::invalid_argument(format!("{id:?} is not a GPU of this node")));
                };
                if g.mode != SharingMode::Whole {
                    return Err(Status::invalid_argument(format!(
                        "GPU{} ({id}) is {}, not handed out whole; list it in [sharing] whole",
                        g.index, g.mode
                    )));
                }
                if let Some(why) = unusable(g, state.used.get(pos).copied().unwrap_or(Mib::ZERO)) {
                    return Err(Status::failed_precondition(why));
                }
                uuids.push(id.clone());
                minors.push(g.device_number());
                handed.push(format!("GPU{} ({id})", g.index));
            }
            let envs = std::collections::HashMap::from([("NVIDIA_VISIBLE_DEVICES".to_owned(), uuids.join(","))]);
            let devices = super::device_specs(&self.alloc.device_nodes().nodes(&minors));
            responses.push(ContainerAllocateResponse { envs, devices, ..Default::default() });
        }
        let gpus = handed.join(", ");
        // Success only once the ledger has the hand-out (invariant 2): the kubelet retries an
        // UNAVAILABLE answer.
        if let Err(e) = self
            .alloc
            .record_event(crate::allocation::ledger::EventKind::WholeAllocated, &format!("{gpus} handed out whole"))
        {
            tracing::error!(gpus = %gpus, error = %e, "whole-GPU allocation refused: the ledger cannot record it");
            return Err(Status::unavailable(format!(
                "{gpus} not handed out: the ledger cannot record it ({e}); the kubelet retries"
            )));
        }
        tracing::info!(gpus = %gpus, "whole GPUs allocated");
        Ok(Response::new(AllocateResponse { container_responses: responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// Where the whole-GPU resource is served and registered.
#[derive(Clone, Debug)]
pub struct Endpoint {
    /// The kubelet's device-plugin directory.
    pub dir: PathBuf,
    /// The socket's file name in it.
    pub socket_name: String,
    /// The resource name.
    pub resource: String,
}

/// One generation of the server on the socket.
struct Generation {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Generation {
    fn start(plugin: &WholePlugin, socket: &std::path::Path) -> std::io::Result<Generation> {
        let listener = crate::kubelet::plugin::bind(socket)?;
        let stop = watch::Sender::new(false);
        let plugin = WholePlugin { stop: stop.subscribe(), ..plugin.clone() };
        let shutdown = stopped(stop.subscribe());
        let task = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DevicePluginServer::new(plugin))
                .serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(listener), shutdown),
        );
        Ok(Generation { stop, task })
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        if tokio::time::timeout(Duration::from_secs(5), self.task).await.is_err() {
            tracing::warn!("the whole-GPU plugin server did not stop within 5 s");
        }
    }
}

/// Serves and registers the whole-GPU resource until `shutdown` turns `true`, serving again on
/// a new socket and registering again after a kubelet restart; removes its socket at the end.
///
/// # Errors
/// The socket cannot be bound, or the kubelet refused the registration.
pub async fn run(plugin: WholePlugin, at: Endpoint, shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let socket = at.dir.join(&at.socket_name);
    let kubelet_socket = at.dir.join("kubelet.sock");
    let mut server = Generation::start(&plugin, &socket)
        .with_context(|| format!("binding the whole-GPU plugin socket {}", socket.display()))?;
    let mut kubelet = KubeletWatch::new(&at.dir, &socket);
    tracing::info!(socket = %socket.display(), resource = %at.resource, "serving whole GPUs");
    let register = || {
        Box::pin(crate::kubelet::plugin::register(
            kubelet_socket.clone(),
            at.socket_name.clone(),
            at.resource.clone(),
            false,
        ))
    };
    let mut registration = Some(register());
    let mut dropped = Dropped::new(&plugin.streams);
    let mut quit = Box::pin(stopped(shutdown));
    loop {
        tokio::select! {
            biased;
            () = &mut quit => break,
            Some(r) = async { match registration.as_mut() { Some(f) => Some(f.await), None => None } } => {
                registration = None;
                r.map_err(|s| anyhow::anyhow!("the kubelet refused the whole-GPU registration: {}", s.message()))?;
                kubelet.registered();
                dropped.registered();
            }
            change = kubelet.changed() => {
                if change.plugin_socket_lost {
                    tracing::warn!(socket = %socket.display(), "the whole-GPU plugin socket was removed; serving on a new one");
                    server.stop().await;
                    server = Generation::start(&plugin, &socket)
                        .with_context(|| format!("binding the whole-GPU plugin socket {} again", socket.display()))?;
                    kubelet.acknowledge_plugin_socket();
                }
                if change.kubelet_restarted || change.plugin_socket_lost {
                    kubelet.acknowledge_kubelet();
                    registration = Some(register());
                    dropped.registering();
                }
            }
            () = dropped.dropped(), if registration.is_none() => {
                tracing::warn!(
                    kubelet = %kubelet_socket.display(),
                    grace = ?streams::GRACE,
                    "the kubelet holds no whole-GPU device-list stream; registering again"
                );
                registration = Some(register());
            }
        }
    }
    server.stop().await;
    let _ = std::fs::remove_file(&socket);
    Ok(())
}

/// The whole-GPU socket's file name beside the memory resource's: `gpushared.sock` gives
/// `gpushared-whole.sock`.
#[must_use]
pub fn socket_name(memory_socket: &str) -> String {
    let stem = memory_socket.strip_suffix(".sock").unwrap_or(memory_socket);
    format!("{stem}-whole.sock")
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_core::GpuUuid;

    fn gpu(i: u32, mode: SharingMode) -> Gpu {
        let mut g = Gpu::new(i, GpuUuid::new(format!("GPU-{i}")).unwrap(), "A100", Mib::new(81_920));
        g.mode = mode;
        g.numa_node = Some(i);
        g
    }

    #[test]
    fn only_whole_gpus_are_listed_and_only_free_healthy_ones_are_healthy() {
        let mut gpus = vec![
            gpu(0, SharingMode::Shared),
            gpu(1, SharingMode::Whole),
            gpu(2, SharingMode::Whole),
            gpu(3, SharingMode::Whole),
            gpu(4, SharingMode::Whole),
        ];
        gpus[2].cordoned = true;
        gpus[3].health = gpushare_core::Health::Unhealthy { reason: "Xid 79".into() };
        let used = [Mib::new(500), Mib::ZERO, Mib::ZERO, Mib::ZERO, Mib::new(1)];
        let list = devices(&gpus, &used, true);
        let summary: Vec<(&str, &str)> = list.iter().map(|d| (d.id.as_str(), d.health.as_str())).collect();
        assert_eq!(
            summary,
            vec![("GPU-1", "Healthy"), ("GPU-2", "Unhealthy"), ("GPU-3", "Unhealthy"), ("GPU-4", "Unhealthy")]
        );
        assert_eq!(list[0].topology, Some(TopologyInfo { nodes: vec![NumaNode { id: 1 }] }));
        assert_eq!(devices(&gpus, &used, false)[0].topology, None);
        assert!(unusable(&gpus[4], used[4]).unwrap().contains("still holds 1 MiB of shares"));
    }

    #[test]
    fn the_socket_is_named_after_the_memory_resource_socket() {
        assert_eq!(socket_name("gpushared.sock"), "gpushared-whole.sock");
        assert_eq!(socket_name("x"), "x-whole.sock");
    }
}
