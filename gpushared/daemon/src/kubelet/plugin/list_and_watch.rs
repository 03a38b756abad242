//! `ListAndWatch` framed here instead of by tonic, so each device list is freed once sent.
//!
//! tonic encodes a stream's messages into one buffer that lives as long as the stream and
//! never shrinks: after the first device list (about 1.5 MB for 131 072 devices in MiB mode)
//! the daemon would hold that much for as long as the kubelet is connected, which is always.
//! Here each message is encoded into a buffer of exactly its size, handed to the HTTP/2 layer as
//! one data frame and freed when it has been written. The wire format is gRPC's own: status 200,
//! `content-type: application/grpc`, each message as a 5-byte prefix (not compressed, big-endian
//! length) and the message, and `grpc-status: 0` in the trailers when the stream ends (the
//! server being replaced). Every other method goes to tonic's generated service unchanged.

use std::convert::Infallible;
use std::task::{Context, Poll};

use futures::StreamExt as _;
use gpushare_proto::deviceplugin::ListAndWatchResponse;
use gpushare_proto::deviceplugin::device_plugin_server::DevicePluginServer;
use http_body::Frame;
use prost::Message as _;
use tonic::body::Body;
use tonic::codegen::{Bytes, Service, http};
use tonic::server::NamedService;

use super::Plugin;

/// The path the kubelet calls for the device list.
const PATH: &str = "/v1beta1.DevicePlugin/ListAndWatch";

/// The device plugin service: `ListAndWatch` answered here, everything else by tonic.
#[derive(Debug, Clone)]
pub(super) struct PluginService {
    plugin: Plugin,
    inner: DevicePluginServer<Plugin>,
}

impl PluginService {
    pub(super) fn new(plugin: Plugin) -> Self {
        PluginService { inner: DevicePluginServer::new(plugin.clone()), plugin }
    }
}

impl NamedService for PluginService {
    const NAME: &'static str = <DevicePluginServer<Plugin> as NamedService>::NAME;
}

impl Service<http::Request<Body>> for PluginService {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = futures::future::Either<
        std::future::Ready<Result<Self::Response, Infallible>>,
        <DevicePluginServer<Plugin> as Service<http::Request<Body>>>::Future,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Service::<http::Request<Body>>::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if request.uri().path() == PATH {
            futures::future::Either::Left(std::future::ready(Ok(device_lists(&self.plugin))))
        } else {
            futures::future::Either::Right(self.inner.call(request))
        }
    }
}

/// The streaming response: one gRPC message per device snapshot, until the server stops.
fn device_lists(plugin: &Plugin) -> http::Response<Body> {
    let messages = plugin
        .device_lists()
        .map(|message| grpc_message(&message).map(Frame::data))
        .chain(futures::stream::once(std::future::ready(Ok(Frame::trailers(ok_trailers())))));
    let mut response = http::Response::new(Body::new(http_body_util::StreamBody::new(messages)));
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
    response
}

/// The trailers of a stream that ended normally.
fn ok_trailers() -> http::HeaderMap {
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    trailers
}

/// `message` with gRPC's length prefix, in a buffer of exactly its size.
///
/// # Errors
/// A message too long for the prefix's 32-bit length (the daemon refuses a device list over
/// the kubelet's 4 MiB at startup, so only a bug gets here); the stream is reset.
fn grpc_message(message: &ListAndWatchResponse) -> Result<Bytes, tonic::Status> {
    let len = message.encoded_len();
    let prefix = u32::try_from(len)
        .map_err(|_| tonic::Status::internal(format!("a device list of {len} bytes does not fit a gRPC message")))?;
    let mut buf = Vec::with_capacity(5 + len);
    buf.push(0);
    buf.extend_from_slice(&prefix.to_be_bytes());
    message.encode_raw(&mut buf);
    Ok(Bytes::from(buf))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_proto::deviceplugin::Device;

    #[test]
    fn a_message_is_prefixed_with_its_exact_length() {
        let message = ListAndWatchResponse {
            devices: vec![Device { id: "a".into(), health: "Healthy".into(), topology: None }],
            source: None,
        };
        let framed = grpc_message(&message).unwrap();
        let body = message.encode_to_vec();
        assert_eq!(framed[0], 0, "not compressed");
        assert_eq!(u32::from_be_bytes([framed[1], framed[2], framed[3], framed[4]]) as usize, body.len());
        assert_eq!(&framed[5..], &body[..]);
        assert_eq!(framed.len(), 5 + body.len());
    }
}
