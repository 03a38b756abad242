//! A device plugin that does nothing but answer: `devices` devices of one resource, every one
//! healthy, `GetPreferredAllocation` answered with the first devices offered and `Allocate`
//! with an empty response, each at once. Run on a real kubelet it measures what the kubelet
//! itself spends admitting a pod with so many devices registered (its device manager's sets,
//! the checkpoint it writes after every allocation): the floor under any plugin of that many
//! devices (`gpushare-box null-plugin`, the side-by-side bench's `floor-mib` system).
//!
//! Given the kubelet's PodResources socket, each `GetPreferredAllocation` first asks it `List`
//! and waits for the answer: the one place the kubelet says which pod it is admitting, since no
//! device-plugin call names the pod. That is the floor under any plugin that must know the pod it
//! serves (the side-by-side bench's `floor-gib`). Given a kubeconfig as well, it then reads each
//! pod the answer names as holding none of the resource with a quorum `GET`: `List` names pods,
//! not UIDs, so a plugin whose pod watch may lag must read the pod to know which one of that name
//! it serves. That is the floor under a plugin that never serves the wrong pod
//! (`floor-gib-read`).

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use gpushare_proto::DEVICE_PLUGIN_VERSION;
use gpushare_proto::compact::DeviceSource;
use gpushare_proto::deviceplugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
use gpushare_proto::deviceplugin::registration_client::RegistrationClient;
use gpushare_proto::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, ContainerPreferredAllocationResponse,
    DevicePluginOptions, Empty, ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse, RegisterRequest,
};
use gpushare_proto::podresources::ListPodResourcesRequest;
use gpushare_proto::podresources::pod_resources_lister_client::PodResourcesListerClient;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// `count` devices named `d0`, `d1`, ..., all healthy, without topology.
#[derive(Debug, Clone, Copy)]
struct Devices {
    count: u32,
}

impl DeviceSource for Devices {
    fn for_each_device(&self, f: &mut dyn FnMut(&str, bool, Option<i64>)) {
        let mut id = String::with_capacity(8);
        for k in 0..self.count {
            id.clear();
            id.push('d');
            id.push_str(&k.to_string());
            f(&id, true, None);
        }
    }
}

#[derive(Clone)]
struct NullPlugin {
    devices: Devices,
    /// The resource served.
    resource: String,
    /// The kubelet's PodResources socket, asked once per `GetPreferredAllocation`.
    ask: Option<PathBuf>,
    /// A client of the API server, to read the pods `List` names.
    read: Option<kube::Client>,
}

impl NullPlugin {
    /// Asks the kubelet's PodResources `List`, as a plugin that must know its pod does, and
    /// reads the pods it names as holding none of the resource, when it has a client.
    async fn ask_kubelet(&self, socket: &Path) -> Result<(), Status> {
        let asked = std::time::Instant::now();
        let channel = gpushare_proto::uds::connect(socket)
            .await
            .map_err(|e| Status::unavailable(format!("cannot reach {}: {e}", socket.display())))?;
        let listed = PodResourcesListerClient::new(channel)
            .max_decoding_message_size(64 * 1024 * 1024)
            .list(ListPodResourcesRequest {})
            .await?
            .into_inner();
        let list_us = asked.elapsed().as_micros();
        let Some(client) = &self.read else {
            tracing::debug!(list_us, "asked the kubelet");
            return Ok(());
        };
        let holding_nothing = listed
            .pod_resources
            .iter()
            .filter(|p| p.containers.iter().all(|c| c.devices.iter().all(|d| d.resource_name != self.resource)));
        let reads = holding_nothing.map(|p| {
            let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(client.clone(), &p.namespace);
            async move {
                match pods.get(&p.name).await {
                    // Read either way: the Node authorizer refuses a pod bound moments ago (403),
                    // and a pod may be gone (404). The read's cost is what is measured.
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(e)) if e.code == 403 || e.code == 404 => Ok(()),
                    Err(e) => Err(Status::unavailable(format!("reading {}: {e}", p.name))),
                }
            }
        });
        let read = std::time::Instant::now();
        futures::future::try_join_all(reads).await?;
        tracing::debug!(list_us, get_us = read.elapsed().as_micros(), "asked the kubelet and read the pods it names");
        Ok(())
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl DevicePlugin for NullPlugin {
    async fn get_device_plugin_options(&self, _: Request<Empty>) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions { pre_start_required: false, get_preferred_allocation_available: true }))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let list = ListAndWatchResponse::from_source(Arc::new(self.devices));
        // The one list, then the stream stays open as long as the kubelet reads it.
        let stream = futures::stream::once(async move { Ok(list) }).chain(futures::stream::pending());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        if let Some(socket) = &self.ask {
            self.ask_kubelet(socket).await?;
        }
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|r| {
                let size = usize::try_from(r.allocation_size).unwrap_or(0);
                let mut ids: Vec<String> = r.must_include_device_i_ds.to_vec();
                for id in r.available_device_i_ds.iter() {
                    if ids.len() >= size {
                        break;
                    }
                    if !ids.iter().any(|x| x == id) {
                        ids.push(id.to_owned());
                    }
                }
                ContainerPreferredAllocationResponse { device_i_ds: ids }
            })
            .collect();
        Ok(Response::new(PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(&self, request: Request<AllocateRequest>) -> Result<Response<AllocateResponse>, Status> {
        let n = request.into_inner().container_requests.len();
        Ok(Response::new(AllocateResponse { container_responses: vec![ContainerAllocateResponse::default(); n] }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

use futures::StreamExt as _;

/// Serves `devices` devices of `resource` from `<plugin_dir>/null-plugin.sock` and registers
/// with the kubelet at `<plugin_dir>/kubelet.sock` (retried while the kubelet is not up), until
/// the serving fails; asking the kubelet's PodResources socket `ask` in each
/// `GetPreferredAllocation`, and reading the pods it names with the kubeconfig `read_with`.
///
/// # Errors
/// The socket cannot be bound, the kubeconfig cannot be read, the kubelet refuses the
/// registration, or serving fails.
pub async fn run(
    plugin_dir: &Path,
    resource: &str,
    devices: u32,
    ask: Option<PathBuf>,
    read_with: Option<PathBuf>,
) -> anyhow::Result<()> {
    let socket: PathBuf = plugin_dir.join("null-plugin.sock");
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket).with_context(|| format!("binding {}", socket.display()))?;
    let read = match read_with {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(&path)
                .with_context(|| format!("reading the kubeconfig {}", path.display()))?;
            let config =
                kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default()).await?;
            Some(kube::Client::try_from(config)?)
        }
        None => None,
    };
    let plugin = NullPlugin { devices: Devices { count: devices }, resource: resource.to_owned(), ask, read };
    let serving = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(plugin).max_encoding_message_size(usize::MAX))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let kubelet = plugin_dir.join("kubelet.sock");
    let request = RegisterRequest {
        version: DEVICE_PLUGIN_VERSION.to_owned(),
        endpoint: "null-plugin.sock".to_owned(),
        resource_name: resource.to_owned(),
        options: Some(DevicePluginOptions { pre_start_required: false, get_preferred_allocation_available: true }),
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let attempt = async {
            let channel = gpushare_proto::uds::connect(&kubelet).await?;
            RegistrationClient::new(channel).register(request.clone()).await.map_err(anyhow::Error::from)
        };
        match attempt.await {
            Ok(_) => break,
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::info!(error = %e, "waiting for the kubelet");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e.context(format!("registering with {}", kubelet.display()))),
        }
    }
    tracing::info!(%resource, devices, "registered with the kubelet");
    serving.await.context("the plugin server task")?.context("serving the device plugin")
}
