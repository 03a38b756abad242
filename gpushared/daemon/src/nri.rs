//! gpushared as an NRI plugin of the container runtime (`[nri]`, docs/gpushared.md): it dials
//! the runtime's NRI socket, registers, subscribes to `CreateContainer`, and answers each from
//! the allocation service ([`Allocator::container_creating`]): the full environment of a
//! container that holds devices, a counted container's whole grant (its variables, device nodes
//! and mounts, [`adjust`]), a refusal for one that carries another pod's answer. This
//! module only translates between NRI's messages ([`gpushare_proto::nri`], over
//! [`gpushare_proto::nri_wire`]) and that call. When the runtime goes away (restarted, stopped,
//! its socket not there yet) the plugin dials again every [`RETRY`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpushare_core::codec::node::PodRef;
use gpushare_proto::nri::{self as api, EVENT_CREATE_CONTAINER, PLUGIN_SERVICE, RUNTIME_SERVICE};
use gpushare_proto::nri_wire::{self as wire, Decoder, Message, PLUGIN_CONN, REQUEST, RESPONSE, RUNTIME_CONN};
use gpushare_proto::ttrpc;
use prost::Message as _;
use thiserror::Error;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;
use tonic::Code;

use crate::allocation::allocator::{AllocError, Allocator, Creation};
use crate::config::NriConfig;

/// How soon the runtime's socket is dialled again after the connection ended or failed.
pub const RETRY: Duration = Duration::from_secs(2);

/// The name the plugin registers under.
pub const PLUGIN_NAME: &str = "gpushare";

/// The ttrpc stream of the registration (a client's first stream).
const REGISTRATION: u32 = 1;

/// Why a connection to the runtime's NRI ended.
#[derive(Debug, Error)]
pub enum NriError {
    /// The socket cannot be dialled (the runtime is not running, or NRI is off in it).
    #[error(
        "cannot reach the runtime's NRI socket {path}: {source}; is the runtime running with NRI enabled \
         (containerd: [plugins.'io.containerd.nri.v1.nri'] disable = false)?"
    )]
    Dial {
        /// The socket.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Reading or writing the socket failed.
    #[error("the NRI connection failed: {0}")]
    Io(#[from] std::io::Error),
    /// The runtime sent bytes that are not NRI's framing.
    #[error("the runtime's NRI sent malformed framing: {0}")]
    Wire(#[from] wire::WireError),
    /// The runtime sent a message that does not decode.
    #[error("the runtime's NRI sent a malformed {what}: {source}")]
    Decode {
        /// Which message.
        what: &'static str,
        /// Why.
        source: prost::DecodeError,
    },
    /// The runtime refused the registration.
    #[error("the runtime refused gpushared's NRI registration (code {code}): {message}")]
    Refused {
        /// The code.
        code: i32,
        /// The runtime's message.
        message: String,
    },
}

/// Serves as the runtime's NRI plugin, forever: dials, registers and serves; dials again
/// [`RETRY`] after the connection ends.
pub async fn run(alloc: Arc<Allocator>, config: NriConfig) {
    let mut unreachable = false;
    loop {
        match serve(&alloc, &config).await {
            Ok(()) => {
                unreachable = false;
                tracing::info!("the runtime ended the NRI connection; dialling again");
            }
            Err(e @ NriError::Dial { .. }) => {
                // Said once per outage: the socket is missing until the runtime is up.
                if !unreachable {
                    tracing::warn!(error = %e, "not yet an NRI plugin of the runtime; dialling again");
                }
                unreachable = true;
            }
            Err(e) => {
                unreachable = false;
                tracing::warn!(error = %e, "the NRI connection ended; dialling again");
            }
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// One connection: registers, then answers the runtime's calls until it closes the connection
/// or shuts the plugin down.
///
/// # Errors
/// [`NriError`]; the connection is then dropped.
pub async fn serve(alloc: &Allocator, config: &NriConfig) -> Result<(), NriError> {
    let path = config.socket.path();
    let mut socket =
        UnixStream::connect(path).await.map_err(|source| NriError::Dial { path: path.to_owned(), source })?;
    let register = api::RegisterPluginRequest {
        plugin_name: PLUGIN_NAME.to_owned(),
        plugin_idx: config.index.clone(),
        nri_version: String::new(),
    };
    let call = ttrpc::Request {
        service: RUNTIME_SERVICE.to_owned(),
        method: "RegisterPlugin".to_owned(),
        payload: register.encode_to_vec(),
        ..ttrpc::Request::default()
    };
    socket.write_all(&wire::frame(RUNTIME_CONN, REGISTRATION, REQUEST, &call.encode_to_vec())?).await?;
    let mut decoder = Decoder::default();
    let mut buf = vec![0; 64 * 1024];
    loop {
        let Some(message) = decoder.next_message()? else {
            let n = socket.read(&mut buf).await?;
            if n == 0 {
                return Ok(());
            }
            decoder.push(&buf[..n]);
            continue;
        };
        match (message.conn, message.kind) {
            (RUNTIME_CONN, RESPONSE) if message.stream == REGISTRATION => registered(&message, config)?,
            (PLUGIN_CONN, REQUEST) => {
                let request = ttrpc::Request::decode(message.payload)
                    .map_err(|source| NriError::Decode { what: "ttrpc request", source })?;
                let shutdown = request.method == "Shutdown";
                let response = match read_pod_first(alloc, &request).await {
                    Some(refusal) => refusal,
                    None => answer(alloc, &request),
                };
                socket
                    .write_all(&wire::frame(PLUGIN_CONN, message.stream, RESPONSE, &response.encode_to_vec())?)
                    .await?;
                if shutdown {
                    return Ok(());
                }
            }
            (conn, kind) => tracing::debug!(conn, kind, stream = message.stream, "ignored an NRI message"),
        }
    }
}

/// The refusal of a `CreateContainer` whose pod cannot be read first
/// ([`Allocator::read_before_creating`]); `None` for every other call, and for a container that
/// may go on to [`answer`]. A payload that does not decode is answered as such by `answer`.
async fn read_pod_first(alloc: &Allocator, request: &ttrpc::Request) -> Option<ttrpc::Response> {
    if request.service != PLUGIN_SERVICE || request.method != "CreateContainer" {
        return None;
    }
    let pod = api::CreateContainerRequest::decode(request.payload.as_slice()).ok()?.pod?;
    let pod = PodRef { namespace: pod.namespace, name: pod.name, uid: pod.uid };
    let e = alloc.read_before_creating(&pod).await.err()?;
    tracing::warn!(pod = %pod, error = %e, "cannot read a pod whose container is being created");
    Some(ttrpc::Response { status: Some(refusal(&e)), payload: Vec::new() })
}

/// Reads the runtime's answer to the registration.
fn registered(message: &Message, config: &NriConfig) -> Result<(), NriError> {
    let response = ttrpc::Response::decode(message.payload.clone())
        .map_err(|source| NriError::Decode { what: "registration response", source })?;
    match response.status {
        Some(s) if s.code != 0 => Err(NriError::Refused { code: s.code, message: s.message }),
        _ => {
            tracing::info!(socket = %config.socket.path().display(), index = %config.index, "registered as the runtime's NRI plugin");
            Ok(())
        }
    }
}

/// The response to one call of the runtime: its result, or a status saying why not (a method
/// gpushared does not serve, a payload that does not decode, a refused container).
#[must_use]
pub fn answer(alloc: &Allocator, request: &ttrpc::Request) -> ttrpc::Response {
    let result = if request.service == PLUGIN_SERVICE {
        call(alloc, &request.method, &request.payload)
    } else {
        Err(failure(Code::Unimplemented, format!("gpushared serves no ttrpc service {:?}", request.service)))
    };
    match result {
        Ok(payload) => ttrpc::Response { status: Some(ttrpc::Status::default()), payload },
        Err(status) => ttrpc::Response { status: Some(status), payload: Vec::new() },
    }
}

/// A refusal with gRPC's `code`, as ttrpc carries it.
fn failure(code: Code, message: String) -> ttrpc::Status {
    ttrpc::Status { code: i32::from(code), message }
}

/// An allocation error as the runtime receives it: the code the kubelet would
/// ([`AllocError::code`]).
fn refusal(e: &AllocError) -> ttrpc::Status {
    failure(e.code(), e.to_string())
}

fn decode<M: prost::Message + Default>(method: &str, payload: &[u8]) -> Result<M, ttrpc::Status> {
    M::decode(payload)
        .map_err(|e| failure(Code::Internal, format!("gpushared cannot decode the {method} request: {e}")))
}

/// One call of the Plugin service, by method.
fn call(alloc: &Allocator, method: &str, payload: &[u8]) -> Result<Vec<u8>, ttrpc::Status> {
    match method {
        "Configure" => {
            let req: api::ConfigureRequest = decode(method, payload)?;
            tracing::info!(runtime = %req.runtime_name, version = %req.runtime_version, "configured by the runtime's NRI");
            Ok(api::ConfigureResponse { events: 1 << (EVENT_CREATE_CONTAINER - 1) }.encode_to_vec())
        }
        // Containers that exist already were created with what they have; none is changed.
        "Synchronize" => {
            let req: api::SynchronizeRequest = decode(method, payload)?;
            Ok(api::SynchronizeResponse { update: Vec::new(), more: req.more }.encode_to_vec())
        }
        "CreateContainer" => {
            let req: api::CreateContainerRequest = decode(method, payload)?;
            create_container(alloc, req).map(|r| r.encode_to_vec())
        }
        "Shutdown" | "StateChange" => Ok(api::Empty {}.encode_to_vec()),
        other => Err(failure(Code::Unimplemented, format!("gpushared does not serve NRI's {other}"))),
    }
}

fn create_container(
    alloc: &Allocator,
    req: api::CreateContainerRequest,
) -> Result<api::CreateContainerResponse, ttrpc::Status> {
    let (pod, container) = (req.pod.unwrap_or_default(), req.container.unwrap_or_default());
    let pod = PodRef { namespace: pod.namespace, name: pod.name, uid: pod.uid };
    // The ledger read is short; the runtime waits for the answer either way.
    let creation = tokio::task::block_in_place(|| alloc.container_creating(&pod, &container.name, &container.env));
    match creation {
        Ok(Creation::NotOurs) => Ok(api::CreateContainerResponse::default()),
        Ok(Creation::Environment(envs)) => {
            tracing::debug!(pod = %pod, container = %container.name, added = envs.len(), "a container's environment completed");
            let adjust = api::ContainerAdjustment { env: adjust::env(envs), ..Default::default() };
            Ok(api::CreateContainerResponse { adjust: Some(adjust), update: Vec::new() })
        }
        Ok(Creation::Granted(edits)) => {
            let adjust = adjust::adjustment(edits).map_err(|why| {
                tracing::warn!(pod = %pod, container = %container.name, error = %why, "cannot name a container's device nodes");
                failure(Code::FailedPrecondition, why)
            })?;
            tracing::debug!(
                pod = %pod,
                container = %container.name,
                devices = adjust.linux.as_ref().map_or(0, |l| l.devices.len()),
                mounts = adjust.mounts.len(),
                "a container's grant given"
            );
            Ok(api::CreateContainerResponse { adjust: Some(adjust), update: Vec::new() })
        }
        Err(e) => {
            tracing::warn!(pod = %pod, container = %container.name, error = %e, "refused a container's creation");
            Err(refusal(&e))
        }
    }
}

mod adjust;
#[cfg(test)]
mod tests;
