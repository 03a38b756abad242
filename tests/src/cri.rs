//! A container runtime for the real kubelet that runs nothing and records everything: the CRI
//! v1 `RuntimeService` and `ImageService` on a unix socket, keeping pod sandboxes and containers
//! as records. A started container "runs" until the kubelet stops it, so its pod is Running; what
//! `CreateContainer` received (the environment, devices, mounts and CDI devices the device
//! plugin's Allocate answer put there, with the environment of those CDI devices applied from
//! the specs in [`CDI_DIR`] beside its socket) is kept for the tests to check, and written to the
//! container's log as `KEY=value` lines, as `env` in the container would print them.
//!
//! A container whose command is `true`, or one named to [`RecordingRuntime::finish_at_start`]
//! (an init container that has done its work), exits 0 as soon as it starts; any other runs
//! until the kubelet stops it, and then reads as killed (137).
//! Every image is present (nothing is pulled); the node's network is ready; the cgroup driver is
//! cgroupfs. Calls it does not serve (streaming lists, events, stats, exec) answer UNIMPLEMENTED.
//! It serves NRI as containerd does, on [`crate::recording_nri::NRI_SOCKET`] beside its socket:
//! a registered plugin that subscribed to `CreateContainer` adjusts each container's
//! environment after the device plugin's answer and the CDI devices are applied, or refuses it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio_stream::StreamExt as _;
use tonic::{Request, Response, Status};

/// The generated CRI messages and services, package `runtime.v1`.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod api {
    tonic::include_proto!("runtime.v1");
}

use api::image_service_server::{ImageService, ImageServiceServer};
use api::runtime_service_server::{RuntimeService, RuntimeServiceServer};

use crate::recording_nri::{Nri, nri_container, nri_pod};

/// The folder beside the runtime's socket whose CDI specs it applies ([`crate::cdi`]).
pub const CDI_DIR: &str = "cdi";

/// The name the runtime gives the kubelet: container IDs read `gpushare-cri://<id>`.
pub const RUNTIME_NAME: &str = "gpushare-cri";

/// What the kubelet asked one container to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Created {
    /// The runtime's ID of the container.
    pub id: String,
    /// The pod's namespace, name and UID, from its sandbox.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The pod's UID.
    pub pod_uid: String,
    /// The container's name.
    pub container: String,
    /// Its environment, as the kubelet set it (the device plugin's `envs` among the pod's own).
    pub envs: BTreeMap<String, String>,
    /// Device nodes: (host path, container path), the kubelet's and its CDI devices'.
    pub devices: Vec<(String, String)>,
    /// Mounts: (host path, container path).
    pub mounts: Vec<(String, String)>,
    /// The container paths of the read-only mounts (the kubelet's `readonly`, CDI's `ro`).
    pub read_only_mounts: Vec<String>,
    /// CDI device names.
    pub cdi_devices: Vec<String>,
    /// Whether it is running now (started and not stopped).
    pub running: bool,
}

#[derive(Debug)]
struct Sandbox {
    config: api::PodSandboxConfig,
    ready: bool,
    created_at: i64,
}

#[derive(Debug)]
struct Container {
    sandbox: String,
    config: api::ContainerConfig,
    state: api::ContainerState,
    created_at: i64,
    started_at: i64,
    finished_at: i64,
    exit_code: i32,
    log_path: String,
}

#[derive(Debug, Default)]
struct Store {
    next: u64,
    sandboxes: HashMap<String, Sandbox>,
    containers: HashMap<String, Container>,
    /// Every container ever created, in order, with what it was given.
    created: Vec<Created>,
    /// (namespace, pod, container) that exit 0 as soon as they start.
    finishing: std::collections::HashSet<(String, String, String)>,
}

impl Store {
    fn id(&mut self, kind: &str) -> String {
        self.next += 1;
        format!("{kind}{:060x}", self.next)
    }
}

/// The runtime, serving while this lives.
#[derive(Debug)]
pub struct RecordingRuntime {
    store: Arc<Mutex<Store>>,
    socket: PathBuf,
    task: tokio::task::JoinHandle<()>,
    nri: Arc<Nri>,
}

impl Drop for RecordingRuntime {
    fn drop(&mut self) {
        self.task.abort();
        self.nri.stop();
    }
}

impl RecordingRuntime {
    /// Serves on `socket` (replacing a stale one), until dropped.
    ///
    /// # Errors
    /// When the socket cannot be bound.
    pub fn serve(socket: &Path) -> anyhow::Result<Self> {
        let listener = crate::kubelet::bind_socket(socket)?;
        let store = Arc::new(Mutex::new(Store::default()));
        let fs = socket.parent().unwrap_or(socket).to_owned();
        let nri = Nri::serve(&fs.join(crate::recording_nri::NRI_SOCKET), existing(&store))?;
        let service = Service { store: Arc::clone(&store), fs, nri: Arc::clone(&nri) };
        let router = tonic::transport::Server::builder()
            .add_service(RuntimeServiceServer::new(service.clone()))
            .add_service(ImageServiceServer::new(service));
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener).map(|s| s);
        let task = tokio::spawn(async move {
            if let Err(e) = router.serve_with_incoming(incoming).await {
                tracing::warn!(error = %e, "the recording runtime stopped");
            }
        });
        Ok(RecordingRuntime { store, socket: socket.to_owned(), task, nri })
    }

    /// Loses everything, as a runtime does when its host reboots: stops serving and serves
    /// again on the same socket with no sandbox, container or record (its state lives in
    /// tmpfs on a host).
    ///
    /// # Errors
    /// When the socket cannot be bound again.
    pub fn reboot(&mut self) -> anyhow::Result<()> {
        self.task.abort();
        *self = RecordingRuntime::serve(&self.socket)?;
        Ok(())
    }

    /// The NRI plugin registered now (`50-gpushare`), if one is.
    #[must_use]
    pub fn nri_plugin(&self) -> Option<String> {
        self.nri.plugin_name()
    }

    /// How long each NRI `CreateContainer` call to the plugin took, in order.
    #[must_use]
    pub fn nri_create_latencies(&self) -> Vec<std::time::Duration> {
        self.nri.create_latencies()
    }

    /// The socket, as the kubelet's `containerRuntimeEndpoint` names it.
    #[must_use]
    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Every container created so far, in order, with whether it runs now.
    #[must_use]
    pub fn created(&self) -> Vec<Created> {
        let store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
        store
            .created
            .iter()
            .map(|c| Created {
                running: store.containers.get(&c.id).is_some_and(|r| r.state == api::ContainerState::ContainerRunning),
                ..c.clone()
            })
            .collect()
    }

    /// Makes container `container` of pod `namespace/pod` exit 0 as soon as it starts, as an
    /// init container that has done its work would (its command need not be `true`).
    pub fn finish_at_start(&self, namespace: &str, pod: &str, container: &str) {
        let mut store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
        store.finishing.insert((namespace.to_owned(), pod.to_owned(), container.to_owned()));
    }

    /// The containers running now.
    #[must_use]
    pub fn running(&self) -> Vec<Created> {
        self.created().into_iter().filter(|c| c.running).collect()
    }
}

#[derive(Clone, Debug)]
struct Service {
    store: Arc<Mutex<Store>>,
    /// The directory reported as the image and container filesystem.
    fs: PathBuf,
    nri: Arc<Nri>,
}

/// What a plugin registering with the runtime's NRI is synchronized with: every sandbox and
/// container in `store`.
fn existing(store: &Arc<Mutex<Store>>) -> crate::recording_nri::Existing {
    let store = Arc::clone(store);
    Arc::new(move || {
        let store = store.lock().unwrap_or_else(PoisonError::into_inner);
        let pods = store.sandboxes.iter().map(|(id, s)| nri_pod(id, s.config.metadata.as_ref())).collect();
        let containers = store
            .containers
            .iter()
            .map(|(id, c)| nri_container(id, &c.sandbox, &c.config, &env_of(&c.config)))
            .collect();
        (pods, containers)
    })
}

/// A container's environment, as the kubelet set it.
fn env_of(config: &api::ContainerConfig) -> BTreeMap<String, String> {
    config.envs.iter().map(|kv| (kv.key.clone(), String::from_utf8_lossy(&kv.value).into_owned())).collect()
}

fn now_ns() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

fn matches(labels: &HashMap<String, String>, selector: &HashMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The image record of `image`: every image is present, with an ID derived from its name.
fn image_of(image: &str) -> api::Image {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    image.hash(&mut h);
    api::Image {
        id: format!("sha256:{:064x}", h.finish()),
        repo_tags: vec![image.to_owned()],
        repo_digests: Vec::new(),
        size: 1 << 20,
        uid: None,
        username: String::new(),
        spec: Some(api::ImageSpec { image: image.to_owned(), ..Default::default() }),
        pinned: false,
    }
}

impl Service {
    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn status_of(id: &str, c: &Container) -> api::ContainerStatus {
        let exited = c.state == api::ContainerState::ContainerExited;
        api::ContainerStatus {
            id: id.to_owned(),
            metadata: c.config.metadata.clone(),
            state: c.state.into(),
            created_at: c.created_at,
            started_at: c.started_at,
            finished_at: c.finished_at,
            exit_code: c.exit_code,
            image: c.config.image.clone(),
            image_ref: c.config.image.as_ref().map(|i| image_of(&i.image).id).unwrap_or_default(),
            reason: match (exited, c.exit_code) {
                (false, _) => String::new(),
                (true, 0) => "Completed".into(),
                (true, _) => "Killed".into(),
            },
            message: String::new(),
            labels: c.config.labels.clone(),
            annotations: c.config.annotations.clone(),
            mounts: c.config.mounts.clone(),
            log_path: c.log_path.clone(),
            image_id: c.config.image.as_ref().map(|i| image_of(&i.image).id).unwrap_or_default(),
        }
    }
}

type Answer<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl RuntimeService for Service {
    async fn version(&self, _: Request<api::VersionRequest>) -> Answer<api::VersionResponse> {
        Ok(Response::new(api::VersionResponse {
            version: "0.1.0".into(),
            runtime_name: RUNTIME_NAME.into(),
            runtime_version: env!("CARGO_PKG_VERSION").into(),
            runtime_api_version: "v1".into(),
        }))
    }

    async fn run_pod_sandbox(&self, req: Request<api::RunPodSandboxRequest>) -> Answer<api::RunPodSandboxResponse> {
        let config = req.into_inner().config.ok_or_else(|| Status::invalid_argument("no sandbox config"))?;
        let mut store = self.store();
        let id = store.id("a");
        tracing::debug!(%id, pod = ?config.metadata, "RunPodSandbox");
        store.sandboxes.insert(id.clone(), Sandbox { config, ready: true, created_at: now_ns() });
        Ok(Response::new(api::RunPodSandboxResponse { pod_sandbox_id: id }))
    }

    async fn stop_pod_sandbox(&self, req: Request<api::StopPodSandboxRequest>) -> Answer<api::StopPodSandboxResponse> {
        let id = req.into_inner().pod_sandbox_id;
        let mut store = self.store();
        if let Some(s) = store.sandboxes.get_mut(&id) {
            s.ready = false;
        }
        let at = now_ns();
        for c in store.containers.values_mut().filter(|c| c.sandbox == id) {
            if c.state != api::ContainerState::ContainerExited {
                c.state = api::ContainerState::ContainerExited;
                c.finished_at = at;
                c.exit_code = 137;
            }
        }
        Ok(Response::new(api::StopPodSandboxResponse {}))
    }

    async fn remove_pod_sandbox(
        &self,
        req: Request<api::RemovePodSandboxRequest>,
    ) -> Answer<api::RemovePodSandboxResponse> {
        let id = req.into_inner().pod_sandbox_id;
        let mut store = self.store();
        store.sandboxes.remove(&id);
        store.containers.retain(|_, c| c.sandbox != id);
        Ok(Response::new(api::RemovePodSandboxResponse {}))
    }

    async fn pod_sandbox_status(
        &self,
        req: Request<api::PodSandboxStatusRequest>,
    ) -> Answer<api::PodSandboxStatusResponse> {
        let id = req.into_inner().pod_sandbox_id;
        let store = self.store();
        let s = store.sandboxes.get(&id).ok_or_else(|| Status::not_found(format!("no sandbox {id}")))?;
        let state = if s.ready { api::PodSandboxState::SandboxReady } else { api::PodSandboxState::SandboxNotready };
        Ok(Response::new(api::PodSandboxStatusResponse {
            status: Some(api::PodSandboxStatus {
                id: id.clone(),
                metadata: s.config.metadata.clone(),
                state: state.into(),
                created_at: s.created_at,
                network: Some(api::PodSandboxNetworkStatus { ip: "127.0.0.1".into() }),
                labels: s.config.labels.clone(),
                annotations: s.config.annotations.clone(),
                runtime_handler: String::new(),
            }),
            info: HashMap::new(),
            containers_statuses: Vec::new(),
            timestamp: 0,
        }))
    }

    async fn list_pod_sandbox(&self, req: Request<api::ListPodSandboxRequest>) -> Answer<api::ListPodSandboxResponse> {
        let filter = req.into_inner().filter.unwrap_or_default();
        let store = self.store();
        let items = store
            .sandboxes
            .iter()
            .filter(|(id, s)| {
                let state =
                    if s.ready { api::PodSandboxState::SandboxReady } else { api::PodSandboxState::SandboxNotready };
                (filter.id.is_empty() || **id == filter.id)
                    && filter.state.as_ref().is_none_or(|v| v.state == i32::from(state))
                    && matches(&s.config.labels, &filter.label_selector)
            })
            .map(|(id, s)| api::PodSandbox {
                id: id.clone(),
                metadata: s.config.metadata.clone(),
                state: if s.ready { api::PodSandboxState::SandboxReady } else { api::PodSandboxState::SandboxNotready }
                    .into(),
                created_at: s.created_at,
                labels: s.config.labels.clone(),
                annotations: s.config.annotations.clone(),
                runtime_handler: String::new(),
            })
            .collect();
        Ok(Response::new(api::ListPodSandboxResponse { items }))
    }

    async fn create_container(
        &self,
        req: Request<api::CreateContainerRequest>,
    ) -> Answer<api::CreateContainerResponse> {
        let req = req.into_inner();
        let config = req.config.ok_or_else(|| Status::invalid_argument("no container config"))?;
        let (meta, log_dir, id) = {
            let mut store = self.store();
            let sandbox = store
                .sandboxes
                .get(&req.pod_sandbox_id)
                .ok_or_else(|| Status::not_found(format!("no sandbox {}", req.pod_sandbox_id)))?;
            let meta = sandbox.config.metadata.clone().unwrap_or_default();
            let log_dir = sandbox.config.log_directory.clone();
            (meta, log_dir, store.id("c"))
        };
        let mut envs = env_of(&config);
        let cdi_devices: Vec<String> = config.cdi_devices.iter().map(|d| d.name.clone()).collect();
        let mut mounts: Vec<(String, String)> =
            config.mounts.iter().map(|m| (m.host_path.clone(), m.container_path.clone())).collect();
        let mut devices: Vec<(String, String)> =
            config.devices.iter().map(|d| (d.host_path.clone(), d.container_path.clone())).collect();
        let mut read_only_mounts: Vec<String> =
            config.mounts.iter().filter(|m| m.readonly).map(|m| m.container_path.clone()).collect();
        let mut edits = crate::cdi::Edits {
            envs: &mut envs,
            mounts: &mut mounts,
            read_only: &mut read_only_mounts,
            devices: &mut devices,
        };
        crate::cdi::apply(&self.fs.join(CDI_DIR), &cdi_devices, &mut edits).map_err(Status::failed_precondition)?;
        // NRI adjusts the container as the kubelet, the device plugin and CDI made it.
        let pod = nri_pod(&req.pod_sandbox_id, Some(&meta));
        let adjust = self
            .nri
            .create_container(pod, nri_container(&id, &req.pod_sandbox_id, &config, &envs))
            .await
            .map_err(|e| Status::unknown(format!("failed to create the container: {e}")))?;
        envs.extend(adjust.into_iter().map(|kv| (kv.key, kv.value)));
        let log_path = if log_dir.is_empty() || config.log_path.is_empty() {
            String::new()
        } else {
            Path::new(&log_dir).join(&config.log_path).display().to_string()
        };
        if !log_path.is_empty() {
            write_env_log(Path::new(&log_path), &envs);
        }
        let created = Created {
            id: id.clone(),
            namespace: meta.namespace,
            pod: meta.name,
            pod_uid: meta.uid,
            container: config.metadata.as_ref().map(|m| m.name.clone()).unwrap_or_default(),
            envs,
            devices,
            mounts,
            read_only_mounts,
            cdi_devices,
            running: false,
        };
        tracing::debug!(%id, pod = %created.pod, container = %created.container, "CreateContainer");
        let mut store = self.store();
        store.created.push(created);
        store.containers.insert(
            id.clone(),
            Container {
                sandbox: req.pod_sandbox_id,
                config,
                state: api::ContainerState::ContainerCreated,
                created_at: now_ns(),
                started_at: 0,
                finished_at: 0,
                exit_code: 0,
                log_path,
            },
        );
        Ok(Response::new(api::CreateContainerResponse { container_id: id }))
    }

    async fn start_container(&self, req: Request<api::StartContainerRequest>) -> Answer<api::StartContainerResponse> {
        let id = req.into_inner().container_id;
        let mut store = self.store();
        let store = &mut *store;
        let c = store.containers.get_mut(&id).ok_or_else(|| Status::not_found(format!("no container {id}")))?;
        if c.state != api::ContainerState::ContainerCreated {
            return Err(Status::failed_precondition(format!("container {id} is not in the created state")));
        }
        c.started_at = now_ns();
        let pod = store.sandboxes.get(&c.sandbox).and_then(|s| s.config.metadata.clone()).unwrap_or_default();
        let name = c.config.metadata.as_ref().map(|m| m.name.clone()).unwrap_or_default();
        if c.config.command == ["true"] || store.finishing.contains(&(pod.namespace, pod.name, name)) {
            c.state = api::ContainerState::ContainerExited;
            c.finished_at = c.started_at;
        } else {
            c.state = api::ContainerState::ContainerRunning;
        }
        Ok(Response::new(api::StartContainerResponse {}))
    }

    async fn stop_container(&self, req: Request<api::StopContainerRequest>) -> Answer<api::StopContainerResponse> {
        let id = req.into_inner().container_id;
        let mut store = self.store();
        if let Some(c) = store.containers.get_mut(&id)
            && c.state != api::ContainerState::ContainerExited
        {
            c.state = api::ContainerState::ContainerExited;
            c.finished_at = now_ns();
            c.exit_code = 137;
        }
        Ok(Response::new(api::StopContainerResponse {}))
    }

    async fn remove_container(
        &self,
        req: Request<api::RemoveContainerRequest>,
    ) -> Answer<api::RemoveContainerResponse> {
        let id = req.into_inner().container_id;
        self.store().containers.remove(&id);
        Ok(Response::new(api::RemoveContainerResponse {}))
    }

    async fn list_containers(&self, req: Request<api::ListContainersRequest>) -> Answer<api::ListContainersResponse> {
        let filter = req.into_inner().filter.unwrap_or_default();
        let store = self.store();
        let containers = store
            .containers
            .iter()
            .filter(|(id, c)| {
                (filter.id.is_empty() || **id == filter.id)
                    && (filter.pod_sandbox_id.is_empty() || c.sandbox == filter.pod_sandbox_id)
                    && filter.state.as_ref().is_none_or(|v| v.state == i32::from(c.state))
                    && matches(&c.config.labels, &filter.label_selector)
            })
            .map(|(id, c)| {
                let image_id = c.config.image.as_ref().map(|i| image_of(&i.image).id).unwrap_or_default();
                api::Container {
                    id: id.clone(),
                    pod_sandbox_id: c.sandbox.clone(),
                    metadata: c.config.metadata.clone(),
                    image: c.config.image.clone(),
                    image_ref: image_id.clone(),
                    state: c.state.into(),
                    created_at: c.created_at,
                    labels: c.config.labels.clone(),
                    annotations: c.config.annotations.clone(),
                    image_id,
                }
            })
            .collect();
        Ok(Response::new(api::ListContainersResponse { containers }))
    }

    async fn container_status(
        &self,
        req: Request<api::ContainerStatusRequest>,
    ) -> Answer<api::ContainerStatusResponse> {
        let id = req.into_inner().container_id;
        let store = self.store();
        let c = store.containers.get(&id).ok_or_else(|| Status::not_found(format!("no container {id}")))?;
        Ok(Response::new(api::ContainerStatusResponse { status: Some(Self::status_of(&id, c)), info: HashMap::new() }))
    }

    async fn update_container_resources(
        &self,
        _: Request<api::UpdateContainerResourcesRequest>,
    ) -> Answer<api::UpdateContainerResourcesResponse> {
        Ok(Response::new(api::UpdateContainerResourcesResponse {}))
    }

    async fn update_runtime_config(
        &self,
        _: Request<api::UpdateRuntimeConfigRequest>,
    ) -> Answer<api::UpdateRuntimeConfigResponse> {
        Ok(Response::new(api::UpdateRuntimeConfigResponse {}))
    }

    async fn status(&self, _: Request<api::StatusRequest>) -> Answer<api::StatusResponse> {
        let ready = |t: &str| api::RuntimeCondition { r#type: t.into(), status: true, ..Default::default() };
        Ok(Response::new(api::StatusResponse {
            status: Some(api::RuntimeStatus { conditions: vec![ready("RuntimeReady"), ready("NetworkReady")] }),
            info: HashMap::new(),
        }))
    }

    async fn runtime_config(&self, _: Request<api::RuntimeConfigRequest>) -> Answer<api::RuntimeConfigResponse> {
        Ok(Response::new(api::RuntimeConfigResponse {
            linux: Some(api::LinuxRuntimeConfiguration { cgroup_driver: api::CgroupDriver::Cgroupfs.into() }),
        }))
    }
}

#[tonic::async_trait]
impl ImageService for Service {
    async fn list_images(&self, _: Request<api::ListImagesRequest>) -> Answer<api::ListImagesResponse> {
        let store = self.store();
        let mut images: Vec<String> =
            store.containers.values().filter_map(|c| c.config.image.as_ref().map(|i| i.image.clone())).collect();
        images.sort();
        images.dedup();
        Ok(Response::new(api::ListImagesResponse { images: images.iter().map(|i| image_of(i)).collect() }))
    }

    async fn image_status(&self, req: Request<api::ImageStatusRequest>) -> Answer<api::ImageStatusResponse> {
        let image = req.into_inner().image.map(|i| i.image).unwrap_or_default();
        Ok(Response::new(api::ImageStatusResponse { image: Some(image_of(&image)), info: HashMap::new() }))
    }

    async fn pull_image(&self, req: Request<api::PullImageRequest>) -> Answer<api::PullImageResponse> {
        let image = req.into_inner().image.map(|i| i.image).unwrap_or_default();
        Ok(Response::new(api::PullImageResponse { image_ref: image_of(&image).id }))
    }

    async fn remove_image(&self, _: Request<api::RemoveImageRequest>) -> Answer<api::RemoveImageResponse> {
        Ok(Response::new(api::RemoveImageResponse {}))
    }

    async fn image_fs_info(&self, _: Request<api::ImageFsInfoRequest>) -> Answer<api::ImageFsInfoResponse> {
        let usage = api::FilesystemUsage {
            timestamp: now_ns(),
            fs_id: Some(api::FilesystemIdentifier { mountpoint: self.fs.display().to_string() }),
            used_bytes: Some(api::UInt64Value { value: 1 << 20 }),
            inodes_used: Some(api::UInt64Value { value: 1 }),
        };
        Ok(Response::new(api::ImageFsInfoResponse {
            image_filesystems: vec![usage.clone()],
            container_filesystems: vec![usage],
        }))
    }
}

/// Writes the environment to a container's log in the CRI log format, as `env` would print it.
fn write_env_log(path: &Path, envs: &BTreeMap<String, String>) {
    let at = chrono_like_now();
    let text: String = envs.iter().map(|(k, v)| format!("{at} stdout F {k}={v}\n")).collect();
    if let Some(parent) = path.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    if let Err(e) = std::fs::write(path, text) {
        tracing::debug!(path = %path.display(), error = %e, "cannot write the container's log");
    }
}

/// Now as RFC 3339 with nanoseconds in UTC, as CRI log lines start.
fn chrono_like_now() -> String {
    let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, day) = gpushare_core::time::civil_from_days(i64::try_from(days).unwrap_or(0));
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60,
        d.subsec_nanos()
    )
}

#[cfg(test)]
mod tests {
    use super::chrono_like_now;

    #[test]
    fn log_dates_are_civil() {
        use gpushare_core::time::civil_from_days;
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_782), (2026, 11, 25));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        let now = chrono_like_now();
        assert_eq!((now.len(), &now[4..5], &now[10..11], &now[29..]), (30, "-", "T", "Z"), "{now}");
    }
}
