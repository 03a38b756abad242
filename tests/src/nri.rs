//! The container runtime's end of one NRI plugin connection: what containerd does on its NRI
//! socket, for the plugin's tests and benchmarks. It reads the plugin's messages through
//! NRI's framing ([`gpushare_proto::nri_wire`]), answers its registration, and calls its
//! Plugin service. A stand-in for tests: anything unexpected is a panic that fails the test,
//! or, through the `try_` calls the recording runtime's NRI uses ([`crate::recording_nri`]), an
//! error saying what it was.
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
        self.try_message().await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Self::message`], saying what went wrong rather than panicking.
    ///
    /// # Errors
    /// On framing that is not NRI's, or a failed read.
    pub async fn try_message(&mut self) -> Result<Option<Message>, String> {
        loop {
            if let Some(m) = self.decoder.next_message().map_err(|e| format!("not NRI's framing: {e}"))? {
                return Ok(Some(m));
            }
            let n =
                self.socket.read(&mut self.buf).await.map_err(|e| format!("reading the plugin's connection: {e}"))?;
            if n == 0 {
                return Ok(None);
            }
            self.decoder.push(&self.buf[..n]);
        }
    }

    /// Calls the plugin's `method` with `payload`; returns its response.
    ///
    /// # Panics
    /// If the plugin does not answer that call, or the connection fails.
    pub async fn call(&mut self, method: &str, payload: Vec<u8>) -> ttrpc::Response {
        self.try_call(method, payload).await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Self::call`], saying what went wrong rather than panicking.
    ///
    /// # Errors
    /// If the plugin does not answer that call (it closed the connection, or answered another
    /// stream), or the connection fails.
    pub async fn try_call(&mut self, method: &str, payload: Vec<u8>) -> Result<ttrpc::Response, String> {
        self.stream += 2;
        let request =
            ttrpc::Request { service: PLUGIN_SERVICE.into(), method: method.into(), payload, ..Default::default() };
        let bytes = wire::frame(PLUGIN_CONN, self.stream, REQUEST, &request.encode_to_vec())
            .map_err(|e| format!("framing the {method} request: {e}"))?;
        self.socket.write_all(&bytes).await.map_err(|e| format!("writing to the plugin: {e}"))?;
        let m = self
            .try_message()
            .await?
            .ok_or_else(|| format!("the plugin closed its connection before answering {method}"))?;
        if (m.conn, m.stream, m.kind) != (PLUGIN_CONN, self.stream, RESPONSE) {
            return Err(format!(
                "the plugin sent (conn {}, stream {}, kind {}) where the answer to {method} was due",
                m.conn, m.stream, m.kind
            ));
        }
        ttrpc::Response::decode(m.payload)
            .map_err(|e| format!("the plugin's answer to {method} is no ttrpc response: {e}"))
    }

    /// Reads the plugin's registration and answers it with `status` (`None`: accepted).
    ///
    /// # Panics
    /// If the plugin's first message is not its registration, or the connection fails.
    pub async fn registration(&mut self, status: Option<ttrpc::Status>) -> api::RegisterPluginRequest {
        self.try_registration(status).await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Self::registration`], saying what went wrong rather than panicking.
    ///
    /// # Errors
    /// If the plugin's first message is not its registration, or the connection fails.
    pub async fn try_registration(
        &mut self,
        status: Option<ttrpc::Status>,
    ) -> Result<api::RegisterPluginRequest, String> {
        let m = self.try_message().await?.ok_or("the plugin closed its connection before registering")?;
        if (m.conn, m.stream, m.kind) != (RUNTIME_CONN, REGISTRATION, REQUEST) {
            return Err(format!(
                "the plugin's first message (conn {}, stream {}, kind {}) is not a registration",
                m.conn, m.stream, m.kind
            ));
        }
        let request =
            ttrpc::Request::decode(m.payload).map_err(|e| format!("the registration is no ttrpc request: {e}"))?;
        if (request.service.as_str(), request.method.as_str()) != (RUNTIME_SERVICE, "RegisterPlugin") {
            return Err(format!(
                "the plugin's first call is {}/{}, not RegisterPlugin",
                request.service, request.method
            ));
        }
        let response = ttrpc::Response { status, payload: api::Empty {}.encode_to_vec() };
        let bytes = wire::frame(RUNTIME_CONN, REGISTRATION, RESPONSE, &response.encode_to_vec())
            .map_err(|e| format!("framing the registration's answer: {e}"))?;
        self.socket.write_all(&bytes).await.map_err(|e| format!("writing to the plugin: {e}"))?;
        api::RegisterPluginRequest::decode(request.payload.as_slice())
            .map_err(|e| format!("a registration that does not decode: {e}"))
    }
}
