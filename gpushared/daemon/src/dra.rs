//! gpushared as a DRA driver (docs/dra.md), for the GPUs `[sharing] dra` names: it publishes
//! the node's ResourceSlice ([`slices`]), registers with the kubelet's plugin watcher and
//! serves the DRA plugin API ([`grpc`]), prepares each claim against the node's ledger and
//! writes its CDI spec ([`service`], [`cdi`]). Claims are rows of the same ledger as the device
//! plugin's allocations.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use thiserror::Error;

use crate::allocation::allocator::Allocator;
use crate::config::DraConfig;

pub mod cdi;
pub mod grpc;
pub mod service;
pub mod slices;

/// The API server as the claims' source, with the node's credentials (the Node authorizer
/// lets a node read the claims of the pods bound to it).
#[derive(Clone)]
pub struct ApiClaims(pub kube::Client);

impl std::fmt::Debug for ApiClaims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiClaims")
    }
}

impl service::ClaimSource for ApiClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String> {
        Api::<ResourceClaim>::namespaced(self.0.clone(), namespace)
            .get(name)
            .await
            .map_err(|e| format!("reading ResourceClaim {namespace}/{name} from the API server: {e}"))
    }
}

/// Why the DRA driver stopped serving.
#[derive(Debug, Error)]
pub enum DraError {
    /// A directory or socket could not be made.
    #[error("{what} {path}: {source}; check [dra] in gpushared.toml and that the directory is writable")]
    Socket {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The gRPC servers failed.
    #[error("serving the DRA plugin API: {0}")]
    Serve(#[from] tonic::transport::Error),
}

/// Serves the DRA driver until `stop` turns true: binds the DRA socket, then the registration
/// socket (so the kubelet never dials a socket that is not there yet), and keeps the node's
/// ResourceSlice published.
///
/// # Errors
/// A socket that cannot be bound, or the servers failing.
pub async fn run(
    config: DraConfig,
    client: kube::Client,
    alloc: Arc<Allocator>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), DraError> {
    let plugin_socket = config.plugin_socket();
    let registration_socket = config.registration_socket();
    for dir in [config.plugin_dir.path(), config.registry_dir.path()] {
        std::fs::create_dir_all(dir).map_err(|source| DraError::Socket {
            what: "creating",
            path: dir.to_owned(),
            source,
        })?;
    }
    let bind = |p: &Path| {
        crate::kubelet::plugin::bind(p).map_err(|source| DraError::Socket {
            what: "binding",
            path: p.to_owned(),
            source,
        })
    };
    let plugin = bind(&plugin_socket)?;
    let reg = bind(&registration_socket)?;
    let driver = Arc::new(service::Driver {
        alloc: Arc::clone(&alloc),
        claims: ApiClaims(client.clone()),
        driver: config.driver.clone(),
        node: alloc.node().to_owned(),
        cdi_dir: config.cdi_dir.path().to_owned(),
    });
    let registration =
        grpc::RegistrationService { driver: config.driver.clone(), endpoint: plugin_socket.display().to_string() };
    tracing::info!(driver = %config.driver, socket = %plugin_socket.display(), registration = %registration_socket.display(),
        cdi = %config.cdi_dir.path().display(), "serving the DRA plugin API");
    let publisher = tokio::spawn(slices::run(client, config.driver.clone(), alloc));
    let shutdown = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    let shutdown = futures::FutureExt::shared(Box::pin(shutdown));
    let served = grpc::serve(driver, registration, (plugin, reg), shutdown).await;
    publisher.abort();
    // The registration socket goes with the driver: the kubelet's watcher sees it removed.
    let _ = std::fs::remove_file(&registration_socket);
    let _ = std::fs::remove_file(&plugin_socket);
    Ok(served?)
}
