//! The recording runtime's NRI ([`crate::cri`]): what containerd does on its NRI socket, so that
//! gpushared's NRI plugin serves the recording runtime's containers as it serves containerd's.
//! It accepts a plugin's connection on [`NRI_SOCKET`] beside the runtime's CRI socket, answers
//! its registration, configures it, synchronizes it with the pods and containers that exist,
//! and from then on hands it each container being created, when the plugin subscribed to
//! `CreateContainer`: the adjustment's environment is applied over the container's, and a
//! refusal fails the creation with the plugin's message (the kubelet reports it and creates the
//! container again later). One plugin at a time: a new connection replaces the last, as a
//! restarted plugin's does; a plugin whose connection failed is dropped, the call it failed
//! refused. Calls are made one at a time. With no plugin registered, a container is created as
//! it was asked to be, as containerd does without `required_plugins`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use gpushare_proto::nri as api;
use prost::Message as _;

use crate::cri::api as cri;
use crate::nri::Runtime;

/// The NRI socket's name, in the folder of the runtime's CRI socket (containerd's in the box is
/// named the same: [`crate::containerd::NRI_SOCKET`]).
pub const NRI_SOCKET: &str = crate::containerd::NRI_SOCKET;

/// The pods and containers that exist when a plugin registers, for its `Synchronize`.
pub type Existing = Arc<dyn Fn() -> (Vec<api::PodSandbox>, Vec<api::Container>) + Send + Sync>;

/// A registered plugin.
#[derive(Debug)]
struct Plugin {
    /// Its name and index, as it registered (`50-gpushare`).
    name: String,
    conn: Runtime,
    /// Whether it subscribed to `CreateContainer`.
    creates: bool,
}

/// The runtime's NRI, serving its socket until [`Nri::stop`].
pub struct Nri {
    plugin: tokio::sync::Mutex<Option<Plugin>>,
    /// The registered plugin's name, readable without waiting for a call in flight.
    registered: Mutex<Option<String>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// How long each `CreateContainer` call to a plugin took, answered or not, in order.
    create_latencies: Mutex<Vec<std::time::Duration>>,
}

impl std::fmt::Debug for Nri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nri").field("registered", &self.plugin_name()).finish_non_exhaustive()
    }
}

impl Nri {
    /// Serves NRI on `socket` (replacing a stale one); `existing` lists what a registering
    /// plugin is synchronized with.
    ///
    /// # Errors
    /// When the socket cannot be bound.
    pub fn serve(socket: &Path, existing: Existing) -> anyhow::Result<Arc<Self>> {
        let listener = crate::kubelet::bind_socket(socket)?;
        let nri = Arc::new(Nri {
            plugin: tokio::sync::Mutex::new(None),
            registered: Mutex::new(None),
            task: Mutex::new(None),
            create_latencies: Mutex::new(Vec::new()),
        });
        let weak = Arc::downgrade(&nri);
        let task = tokio::spawn(async move {
            loop {
                let conn = match listener.accept().await {
                    Ok((conn, _)) => conn,
                    Err(e) => {
                        tracing::warn!(error = %e, "the recording runtime's NRI stopped accepting");
                        return;
                    }
                };
                let Some(nri) = weak.upgrade() else { return };
                let existing = Arc::clone(&existing);
                tokio::spawn(async move {
                    match register(Runtime::new(conn), &existing).await {
                        Ok(plugin) => {
                            tracing::debug!(plugin = %plugin.name, creates = plugin.creates, "an NRI plugin registered");
                            let name = plugin.name.clone();
                            *nri.plugin.lock().await = Some(plugin);
                            *nri.registered.lock().unwrap_or_else(PoisonError::into_inner) = Some(name);
                        }
                        Err(e) => tracing::warn!(error = %e, "an NRI plugin failed to register"),
                    }
                });
            }
        });
        *nri.task.lock().unwrap_or_else(PoisonError::into_inner) = Some(task);
        Ok(nri)
    }

    /// Stops accepting plugins.
    pub fn stop(&self) {
        if let Some(task) = self.task.lock().unwrap_or_else(PoisonError::into_inner).take() {
            task.abort();
        }
    }

    /// The registered plugin's index and name (`50-gpushare`), if one is.
    #[must_use]
    pub fn plugin_name(&self) -> Option<String> {
        self.registered.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// How long each `CreateContainer` call to a plugin took, from the request's write to the
    /// answer's read (the plugin's latency as the runtime sees it), in order.
    #[must_use]
    pub fn create_latencies(&self) -> Vec<std::time::Duration> {
        self.create_latencies.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Hands the container being created to the registered plugin, if it subscribed to
    /// `CreateContainer`; returns the environment it adjusts (none without such a plugin).
    ///
    /// # Errors
    /// The plugin's refusal, or why its connection failed (the plugin is then dropped).
    pub async fn create_container(
        &self,
        pod: api::PodSandbox,
        container: api::Container,
    ) -> Result<Vec<api::KeyValue>, String> {
        let mut plugin = self.plugin.lock().await;
        let Some(p) = plugin.as_mut().filter(|p| p.creates) else { return Ok(Vec::new()) };
        let name = p.name.clone();
        let request = api::CreateContainerRequest { pod: Some(pod), container: Some(container) };
        let started = std::time::Instant::now();
        let answer = p.conn.try_call("CreateContainer", request.encode_to_vec()).await;
        self.create_latencies.lock().unwrap_or_else(PoisonError::into_inner).push(started.elapsed());
        let answer = match answer {
            Ok(answer) => answer,
            Err(e) => {
                *plugin = None;
                *self.registered.lock().unwrap_or_else(PoisonError::into_inner) = None;
                return Err(format!("NRI plugin {name}: {e}; it is dropped"));
            }
        };
        if let Some(s) = answer.status.filter(|s| s.code != 0) {
            return Err(format!("NRI plugin {name} refused the container (code {}): {}", s.code, s.message));
        }
        let response = api::CreateContainerResponse::decode(answer.payload.as_slice())
            .map_err(|e| format!("NRI plugin {name} answered CreateContainer with what does not decode: {e}"))?;
        Ok(response.adjust.map(|a| a.env).unwrap_or_default())
    }
}

/// A CRI pod sandbox as NRI describes it.
pub(crate) fn nri_pod(id: &str, meta: Option<&cri::PodSandboxMetadata>) -> api::PodSandbox {
    let meta = meta.cloned().unwrap_or_default();
    api::PodSandbox { id: id.to_owned(), name: meta.name, uid: meta.uid, namespace: meta.namespace }
}

/// A CRI container as NRI describes it, with the environment `envs`.
pub(crate) fn nri_container(
    id: &str,
    sandbox: &str,
    config: &cri::ContainerConfig,
    envs: &BTreeMap<String, String>,
) -> api::Container {
    api::Container {
        id: id.to_owned(),
        pod_sandbox_id: sandbox.to_owned(),
        name: config.metadata.as_ref().map(|m| m.name.clone()).unwrap_or_default(),
        env: envs.iter().map(|(k, v)| format!("{k}={v}")).collect(),
    }
}

/// Registers the plugin on `conn`, configures it and synchronizes it with what exists.
async fn register(mut conn: Runtime, existing: &Existing) -> Result<Plugin, String> {
    let registration = conn.try_registration(None).await?;
    let name = format!("{}-{}", registration.plugin_idx, registration.plugin_name);
    let configure = api::ConfigureRequest {
        runtime_name: crate::cri::RUNTIME_NAME.into(),
        runtime_version: env!("CARGO_PKG_VERSION").into(),
        ..Default::default()
    };
    let answer = conn.try_call("Configure", configure.encode_to_vec()).await?;
    refused(&name, "Configure", answer.status.as_ref())?;
    let events = api::ConfigureResponse::decode(answer.payload.as_slice())
        .map_err(|e| format!("{name}'s Configure answer does not decode: {e}"))?
        .events;
    let (pods, containers) = existing();
    let sync = api::SynchronizeRequest { pods, containers, more: false };
    let answer = conn.try_call("Synchronize", sync.encode_to_vec()).await?;
    refused(&name, "Synchronize", answer.status.as_ref())?;
    let creates = events & (1 << (api::EVENT_CREATE_CONTAINER - 1)) != 0;
    Ok(Plugin { name, conn, creates })
}

fn refused(name: &str, call: &str, status: Option<&gpushare_proto::ttrpc::Status>) -> Result<(), String> {
    match status {
        Some(s) if s.code != 0 => Err(format!("{name} refused {call} (code {}): {}", s.code, s.message)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::collections::HashMap;
    use std::time::{Duration, Instant};

    use gpushare_proto::nri_wire::{self as wire, Decoder, PLUGIN_CONN, REQUEST, RESPONSE, RUNTIME_CONN};
    use gpushare_proto::ttrpc;
    use prost::Message as _;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::UnixStream;

    use super::{NRI_SOCKET, api};
    use crate::cri::RecordingRuntime;
    use crate::cri::api::runtime_service_client::RuntimeServiceClient;
    use crate::cri::api::{self as cri};

    /// A plugin on the runtime's NRI socket: registers as `50-test`, subscribes to
    /// `CreateContainer`, checks that `Synchronize` lists the sandbox `synced`, and answers each
    /// container: `refused` with a refusal, any other with `GPUSHARE_POD` and `A` set.
    async fn plugin(socket: std::path::PathBuf, synced: String) {
        let mut conn = UnixStream::connect(&socket).await.unwrap();
        let register =
            api::RegisterPluginRequest { plugin_name: "test".into(), plugin_idx: "50".into(), ..Default::default() };
        let call = ttrpc::Request {
            service: api::RUNTIME_SERVICE.into(),
            method: "RegisterPlugin".into(),
            payload: register.encode_to_vec(),
            ..Default::default()
        };
        conn.write_all(&wire::frame(RUNTIME_CONN, 1, REQUEST, &call.encode_to_vec()).unwrap()).await.unwrap();
        let (mut decoder, mut buf) = (Decoder::default(), vec![0; 64 * 1024]);
        loop {
            let Some(m) = decoder.next_message().unwrap() else {
                let n = conn.read(&mut buf).await.unwrap();
                if n == 0 {
                    return;
                }
                decoder.push(&buf[..n]);
                continue;
            };
            if (m.conn, m.kind) != (PLUGIN_CONN, REQUEST) {
                continue;
            }
            let request = ttrpc::Request::decode(m.payload).unwrap();
            let ok = |payload: Vec<u8>| ttrpc::Response { status: None, payload };
            let response = match request.method.as_str() {
                "Configure" => {
                    ok(api::ConfigureResponse { events: 1 << (api::EVENT_CREATE_CONTAINER - 1) }.encode_to_vec())
                }
                "Synchronize" => {
                    let sync = api::SynchronizeRequest::decode(request.payload.as_slice()).unwrap();
                    assert!(sync.pods.iter().any(|p| p.id == synced && p.name == "p"), "{sync:?}");
                    ok(api::SynchronizeResponse::default().encode_to_vec())
                }
                "CreateContainer" => {
                    let req = api::CreateContainerRequest::decode(request.payload.as_slice()).unwrap();
                    let (pod, container) = (req.pod.unwrap(), req.container.unwrap());
                    if container.name == "refused" {
                        let status = ttrpc::Status { code: 9, message: "no room on the GPU".into() };
                        ttrpc::Response { status: Some(status), payload: Vec::new() }
                    } else {
                        assert!(container.env.contains(&"B=kept".to_owned()), "{container:?}");
                        let kv = |key: &str, value: String| api::KeyValue { key: key.into(), value };
                        let env = vec![
                            kv("GPUSHARE_POD", format!("{}/{}", pod.namespace, pod.name)),
                            kv("A", "from-plugin".into()),
                        ];
                        let adjust = Some(api::ContainerAdjustment { env, ..Default::default() });
                        ok(api::CreateContainerResponse { adjust, update: Vec::new() }.encode_to_vec())
                    }
                }
                other => panic!("the runtime called {other}"),
            };
            conn.write_all(&wire::frame(PLUGIN_CONN, m.stream, RESPONSE, &response.encode_to_vec()).unwrap())
                .await
                .unwrap();
        }
    }

    fn container(name: &str) -> cri::ContainerConfig {
        let kv = |key: &str, value: &str| cri::KeyValue { key: key.into(), value: value.as_bytes().to_vec() };
        cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata { name: name.into(), attempt: 0 }),
            envs: vec![kv("A", "from-image"), kv("B", "kept")],
            ..Default::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_registered_plugin_adjusts_or_refuses_each_container() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = RecordingRuntime::serve(&dir.path().join("cri.sock")).unwrap();
        let channel = gpushare_proto::uds::connect(&dir.path().join("cri.sock")).await.unwrap();
        let mut client = RuntimeServiceClient::new(channel);
        let meta =
            cri::PodSandboxMetadata { name: "p".into(), uid: "u-1".into(), namespace: "default".into(), attempt: 0 };
        let config = cri::PodSandboxConfig { metadata: Some(meta), ..Default::default() };
        let sandbox = client
            .run_pod_sandbox(cri::RunPodSandboxRequest { config: Some(config.clone()), ..Default::default() })
            .await
            .unwrap()
            .into_inner()
            .pod_sandbox_id;
        let create = |name: &str| cri::CreateContainerRequest {
            pod_sandbox_id: sandbox.clone(),
            config: Some(container(name)),
            sandbox_config: Some(config.clone()),
        };
        // No plugin yet: the container is created as asked.
        client.create_container(create("before")).await.unwrap();
        let task = tokio::spawn(plugin(dir.path().join(NRI_SOCKET), sandbox.clone()));
        let deadline = Instant::now() + Duration::from_secs(10);
        while runtime.nri_plugin().is_none() {
            assert!(Instant::now() < deadline, "the plugin did not register");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(runtime.nri_plugin().as_deref(), Some("50-test"));
        client.create_container(create("main")).await.unwrap();
        assert_eq!(runtime.nri_create_latencies().len(), 1, "one call to the plugin");
        let refused = client.create_container(create("refused")).await.unwrap_err();
        assert!(refused.message().contains("no room on the GPU"), "{refused:?}");
        let envs: HashMap<String, _> = runtime.created().into_iter().map(|c| (c.container.clone(), c.envs)).collect();
        assert_eq!(envs["before"].get("A").map(String::as_str), Some("from-image"));
        assert!(!envs["before"].contains_key("GPUSHARE_POD"));
        assert_eq!(envs["main"].get("A").map(String::as_str), Some("from-plugin"));
        assert_eq!(envs["main"].get("B").map(String::as_str), Some("kept"));
        assert_eq!(envs["main"].get("GPUSHARE_POD").map(String::as_str), Some("default/p"));
        assert!(!envs.contains_key("refused"), "a refused container is not created");
        // The plugin goes away: the call it cannot answer is refused, and the plugin dropped.
        task.abort();
        let _ = task.await;
        let gone = client.create_container(create("gone")).await.unwrap_err();
        assert!(gone.message().contains("dropped"), "{gone:?}");
        assert_eq!(runtime.nri_plugin(), None);
        client.create_container(create("after")).await.unwrap();
    }
}
