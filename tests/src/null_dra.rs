//! A DRA driver that does nothing but answer: it registers with the kubelet's plugin watcher
//! and answers every `NodePrepareResources` and `NodeUnprepareResources` at once, preparing
//! nothing (no CDI device, no state). Its node's ResourceSlice is written by whoever runs it
//! ([`slice`]). Run on a real kubelet beside the real kube-scheduler it measures what
//! Kubernetes itself spends on a pod with a claim (the claim's allocation, the kubelet's DRA
//! manager and its checkpoint): the floor under any DRA driver (`gpushare-box null-dra`, the
//! side-by-side bench's `floor-dra` system).

use std::collections::HashMap;
use std::path::Path;

use anyhow::Context as _;
use gpushare_proto::dra::dra_plugin_server::{DraPlugin, DraPluginServer};
use gpushare_proto::dra::{
    NodePrepareResourceResponse, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
    NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
};
use gpushare_proto::pluginregistration::registration_server::RegistrationServer;
use gpushare_proto::registration::DraRegistration;
use serde_json::{Value, json};
use tonic::{Request, Response, Status};

/// The floor driver's name.
pub const DRIVER: &str = "null.gpushare.io";
/// The DeviceClass of its devices.
pub const DEVICE_CLASS: &str = "null-memory";

#[derive(Debug, Clone, Copy)]
struct NullDriver;

#[tonic::async_trait]
impl DraPlugin for NullDriver {
    async fn node_prepare_resources(
        &self,
        request: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(|c| (c.uid, NodePrepareResourceResponse { devices: Vec::new(), error: String::new() }))
            .collect::<HashMap<_, _>>();
        Ok(Response::new(NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(|c| (c.uid, NodeUnprepareResourceResponse { error: String::new() }))
            .collect::<HashMap<_, _>>();
        Ok(Response::new(NodeUnprepareResourcesResponse { claims }))
    }
}

/// Serves the driver on `<plugin_dir>/dra.sock` and its registration on
/// `<registry_dir>/null.gpushare.io-reg.sock`, where the kubelet's plugin watcher finds it,
/// until serving fails.
///
/// # Errors
/// A socket that cannot be bound, or serving that fails.
pub async fn run(registry_dir: &Path, plugin_dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(plugin_dir).with_context(|| format!("creating {}", plugin_dir.display()))?;
    std::fs::create_dir_all(registry_dir).with_context(|| format!("creating {}", registry_dir.display()))?;
    let dra = plugin_dir.join("dra.sock");
    let reg = registry_dir.join(format!("{DRIVER}-reg.sock"));
    let bind = |path: &Path| {
        let _ = std::fs::remove_file(path);
        tokio::net::UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))
    };
    let (dra_listener, reg_listener) = (bind(&dra)?, bind(&reg)?);
    let registrar = DraRegistration { driver: DRIVER.to_owned(), endpoint: dra.display().to_string() };
    let serving = tonic::transport::Server::builder()
        .add_service(DraPluginServer::new(NullDriver))
        .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(dra_listener));
    // The plugin watcher's `:authority` is the socket's path, which tonic refuses as it is.
    let registering = tonic::transport::Server::builder()
        .add_service(RegistrationServer::new(registrar))
        .serve_with_incoming(gpushare_proto::authority::incoming(reg_listener));
    tracing::info!(driver = DRIVER, socket = %dra.display(), "serving the null DRA driver");
    let (a, b) = tokio::join!(serving, registering);
    a.context("serving the DRA plugin")?;
    b.context("serving the registration")
}

/// The ResourceSlice of node `node` for the floor: `gpus` devices of `memory_mib` MiB of
/// consumable memory each, shared among claims, as gpushared's slice offers a GPU.
#[must_use]
pub fn slice(node: &str, gpus: u32, memory_mib: u64) -> Value {
    let devices: Vec<Value> = (0..gpus)
        .map(|i| {
            json!({"name": format!("gpu-{i}"), "allowMultipleAllocations": true,
                   "attributes": {"index": {"int": i}, "memoryMiB": {"int": memory_mib}},
                   "capacity": {"memory": {"value": format!("{memory_mib}Mi"),
                       "requestPolicy": {"default": "1Mi", "validRange": {"min": "1Mi", "step": "1Mi"}}}}})
        })
        .collect();
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
           "metadata": {"name": format!("{node}-{DRIVER}")},
           "spec": {"driver": DRIVER, "nodeName": node,
                    "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                    "devices": devices}})
}

/// The DeviceClass selecting the floor driver's devices.
#[must_use]
pub fn device_class() -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": DEVICE_CLASS},
           "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{DRIVER}\"")}}]}})
}
