//! The container runtime's end of one NRI plugin connection: what containerd does on its NRI
//! socket, for the plugin's tests and benchmarks. It reads the plugin's messages through
//! NRI's framing ([`gpushare_proto::nri_wire`]), answers its registration, and calls its
//! Plugin service. A stand-in for tests: anything unexpected is a panic that fails the test.
#![allow(clippy::expect_used, clippy::panic)]

use gpushare_proto::nri::{self as api, PLUGIN_SERVICE, RUNTIME_SERVICE};
use gpushare_proto::nri_wire::{self as wire, Decoder, Message, PLUGIN_CONN, REQUEST, RESPONSE, RUNTIME_CONN};
use gpushare_proto::ttrpc;
use prost::Message as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;

/// The ttrpc stream of a plugin's registration (a client's first stream).
const REGISTRATION: u32 = 1;

/// The runtime's end of a plugin's connection.
#[derive(Debug)]
pub struct Runtime {
    /// The connection, accepted on the runtime's socket.
    pub socket: UnixStream,
    decoder: Decoder,
    stream: u32,
    buf: Vec<u8>,
}

impl Runtime {
    /// The runtime's end of `socket`, a plugin's connection.
    #[must_use]
    pub fn new(socket: UnixStream) -> Self {
        Runtime { socket, decoder: Decoder::default(), stream: 1, buf: vec![0; 64 * 1024] }
    }

    /// The plugin's next message, or `None` once it closed the connection.
    ///
    /// # Panics
    /// On framing that is not NRI's, or a failed read.
    pub async fn message(&mut self) -> Option<Message> {
        loop {
            if let Some(m) = self.decoder.next_message().expect("NRI's framing") {
                return Some(m);
            }
            let n = self.socket.read(&mut self.buf).await.expect("reading the plugin's connection");
            if n == 0 {
                return None;
            }
            self.decoder.push(&self.buf[..n]);
        }
    }

    /// Calls the plugin's `method` with `payload`; returns its response.
    ///
    /// # Panics
    /// If the plugin does not answer that call, or the connection fails.
    pub async fn call(&mut self, method: &str, payload: Vec<u8>) -> ttrpc::Response {
        self.stream += 2;
        let request =
            ttrpc::Request { service: PLUGIN_SERVICE.into(), method: method.into(), payload, ..Default::default() };
        let bytes = wire::frame(PLUGIN_CONN, self.stream, REQUEST, &request.encode_to_vec()).expect("a small request");
        self.socket.write_all(&bytes).await.expect("writing to the plugin");
        let m = self.message().await.expect("an answer");
        assert_eq!((m.conn, m.stream, m.kind), (PLUGIN_CONN, self.stream, RESPONSE));
        ttrpc::Response::decode(m.payload).expect("a ttrpc response")
    }

    /// Reads the plugin's registration and answers it with `status` (`None`: accepted).
    ///
    /// # Panics
    /// If the plugin's first message is not its registration, or the connection fails.
    pub async fn registration(&mut self, status: Option<ttrpc::Status>) -> api::RegisterPluginRequest {
        let m = self.message().await.expect("a registration");
        assert_eq!((m.conn, m.stream, m.kind), (RUNTIME_CONN, REGISTRATION, REQUEST));
        let request = ttrpc::Request::decode(m.payload).expect("a ttrpc request");
        assert_eq!((request.service.as_str(), request.method.as_str()), (RUNTIME_SERVICE, "RegisterPlugin"));
        let response = ttrpc::Response { status, payload: api::Empty {}.encode_to_vec() };
        let bytes = wire::frame(RUNTIME_CONN, REGISTRATION, RESPONSE, &response.encode_to_vec()).expect("small");
        self.socket.write_all(&bytes).await.expect("writing to the plugin");
        api::RegisterPluginRequest::decode(request.payload.as_slice()).expect("a registration request")
    }
}
