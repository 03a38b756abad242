//! The plugin-registration service a DRA plugin serves to the kubelet's plugin watcher: what it
//! is ([`DRA_PLUGIN_TYPE`](crate::DRA_PLUGIN_TYPE), its driver name, its socket) and the
//! kubelet's verdict, logged. gpushared's DRA driver and the bench's null driver both serve it.

use tonic::{Request, Response, Status};

use crate::pluginregistration::registration_server::Registration;
use crate::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse};

/// The registration service of the DRA plugin `driver` serving on `endpoint`.
#[derive(Clone, Debug)]
pub struct DraRegistration {
    /// The driver's name.
    pub driver: String,
    /// The DRA socket's absolute path.
    pub endpoint: String,
}

#[tonic::async_trait]
impl Registration for DraRegistration {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: crate::DRA_PLUGIN_TYPE.to_owned(),
            name: self.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: vec![crate::DRA_PLUGIN_SERVICE.to_owned()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = %self.driver, "the kubelet registered the DRA plugin");
        } else {
            tracing::error!(driver = %self.driver, error = %status.error, "the kubelet refused the DRA plugin");
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
