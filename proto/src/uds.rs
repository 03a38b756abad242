//! gRPC over unix sockets: a client channel to a socket path (the kubelet's `kubelet.sock`,
//! a device plugin's socket, the PodResources socket).

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// Connects to the gRPC server listening on the unix socket at `path`. The URI is only a
/// placeholder: the connector dials the socket. `:authority` is `localhost`, as the kubelet's
/// own clients send it.
///
/// # Errors
/// The transport error if the socket cannot be dialled.
pub async fn connect(path: &Path) -> Result<Channel, tonic::transport::Error> {
    endpoint().connect_with_connector(connector(path.to_owned())).await
}

/// Like [`connect`], but dials lazily on first use (and again after a failure).
#[must_use]
pub fn connect_lazy(path: &Path) -> Channel {
    endpoint().connect_with_connector_lazy(connector(path.to_owned()))
}

fn endpoint() -> Endpoint {
    Endpoint::from_static("http://localhost").connect_timeout(std::time::Duration::from_secs(10))
}

fn connector(
    path: PathBuf,
) -> impl tower::Service<
    Uri,
    Response = TokioIo<tokio::net::UnixStream>,
    Error = std::io::Error,
    Future = impl Future<Output = std::io::Result<TokioIo<tokio::net::UnixStream>>> + Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |_: Uri| {
        let path = path.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
    })
}
