//! The kubelet's side of the DRA driver, translated: the `DRAPlugin` service (prepare and
//! unprepare, each claim answered on its own) on `dra.sock`, and the plugin-registration
//! service on the registration socket the kubelet's plugin watcher finds. Every decision is
//! the [`Driver`]'s.

use std::collections::HashMap;
use std::sync::Arc;

use gpushare_proto::dra::dra_plugin_server::{DraPlugin, DraPluginServer};
use gpushare_proto::dra::{
    Device, NodePrepareResourceResponse, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
    NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
};
use gpushare_proto::pluginregistration::registration_server::RegistrationServer;
use tonic::{Request, Response, Status};

use crate::allocation::allocator::ClaimRef;
use crate::dra::service::{ClaimSource, Driver};

/// The `DRAPlugin` service.
#[derive(Debug)]
pub struct PluginService<S>(pub Arc<Driver<S>>);

#[tonic::async_trait]
impl<S: ClaimSource> DraPlugin for PluginService<S> {
    async fn node_prepare_resources(
        &self,
        request: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let mut claims = HashMap::new();
        for c in request.into_inner().claims {
            let claim = ClaimRef { uid: c.uid, namespace: c.namespace, name: c.name };
            let answer = match self.0.prepare(&claim).await {
                Ok(devices) => NodePrepareResourceResponse {
                    devices: devices
                        .into_iter()
                        .map(|d| Device {
                            request_names: vec![d.request],
                            pool_name: d.pool,
                            device_name: d.device,
                            cdi_device_ids: d.cdi_ids,
                            share_id: d.share_id,
                        })
                        .collect(),
                    error: String::new(),
                },
                Err(error) => {
                    tracing::warn!(claim = %claim, uid = %claim.uid, %error, "claim not prepared");
                    NodePrepareResourceResponse { devices: Vec::new(), error }
                }
            };
            claims.insert(claim.uid, answer);
        }
        Ok(Response::new(NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let mut claims = HashMap::new();
        for c in request.into_inner().claims {
            let error = self.0.unprepare(&c.uid).err().unwrap_or_default();
            if !error.is_empty() {
                tracing::warn!(uid = %c.uid, %error, "claim not unprepared");
            }
            claims.insert(c.uid, NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(NodeUnprepareResourcesResponse { claims }))
    }
}

/// The registration service: what the kubelet's plugin watcher asks of the plugin.
pub use gpushare_proto::registration::DraRegistration as RegistrationService;

/// Serves the DRA plugin on `plugin` and the registration service on `registration` until
/// `shutdown` resolves.
///
/// # Errors
/// The transport error if serving fails.
pub async fn serve<S: ClaimSource>(
    driver: Arc<Driver<S>>,
    registration: RegistrationService,
    (plugin, reg): (tokio::net::UnixListener, tokio::net::UnixListener),
    shutdown: impl Future<Output = ()> + Send + Clone + 'static,
) -> Result<(), tonic::transport::Error> {
    let incoming = |l| tokio_stream::wrappers::UnixListenerStream::new(l);
    let dra = tonic::transport::Server::builder()
        .add_service(DraPluginServer::new(PluginService(driver)))
        .serve_with_incoming_shutdown(incoming(plugin), shutdown.clone());
    // The kubelet's plugin watcher sends the socket's path as `:authority` (gpushare_proto::authority).
    let reg = tonic::transport::Server::builder()
        .add_service(RegistrationServer::new(registration))
        .serve_with_incoming_shutdown(gpushare_proto::authority::incoming(reg), shutdown);
    let (a, b) = tokio::join!(dra, reg);
    a.and(b)
}
