//! A kubelet stand-in that speaks the real protocols, on the kubelet's side.
//!
//! - **Registration** on `<dir>/kubelet.sock`: on `Register` it does what the kubelet does —
//!   dials the plugin's socket back, calls `GetDevicePluginOptions`, and streams `ListAndWatch`
//!   with the kubelet's 4 MiB receive limit. A newer registration replaces the older one: only
//!   the newest `ListAndWatch` stream feeds the device list. When that stream ends (the plugin
//!   died or closed it), every device of the list turns unhealthy, as the kubelet's
//!   `PluginDisconnected` marks them: the node's allocatable drops to 0 until the plugin
//!   registers again.
//! - **Admission**: [`Kubelet::admit_pod`] admits a named pod's containers the way the kubelet's
//!   device manager does (`devicesToAllocate`): init containers first, then the others; each
//!   container takes the pod's reusable devices (those its init containers held) first, and only
//!   if it needs more asks `GetPreferredAllocation` over the healthy devices not in use (the
//!   reused ones as `must_include`), then calls `Allocate`. [`Kubelet::admit`] is the older,
//!   anonymous form: app containers only, not listed by PodResources.
//! - **PodResources v1** ([`Kubelet::start_with_pod_resources`]): `List`, `Get` and
//!   `GetAllocatableResources` on their own socket, answering as the kubelet does — the pods
//!   admitted through the stand-in, their non-init containers, one `ContainerDevices` per
//!   device and NUMA node; the kubelet's rate limit (100 per second, bursts of 10). A test can
//!   add entries the plugin never allocated ([`Kubelet::inject_pod_resources`]) and forget pods
//!   ([`Kubelet::remove_pod`]).
//! - **A dropped plugin** ([`Kubelet::disconnect_plugin`]): the kubelet closes the plugin's
//!   stream and connection without restarting, as a 1.29 kubelet's registration race does.
//! - **Restart** ([`Kubelet::restart`]): the kubelet process dies (its listeners and
//!   connections are cut), then starts again: it deletes every socket in the device-plugin
//!   directory (not the `kubelet_internal_checkpoint` file), listens on fresh sockets, forgets
//!   the plugin's devices until it registers again, and keeps the admitted pods (the real
//!   kubelet restores them from its checkpoint).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use gpushare_proto::deviceplugin::device_plugin_client::DevicePluginClient;
use gpushare_proto::deviceplugin::registration_server::{Registration, RegistrationServer};
use gpushare_proto::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Device, DevicePluginOptions, Empty,
    PreferredAllocationRequest, RegisterRequest,
};
use gpushare_proto::podresources::pod_resources_lister_server::{PodResourcesLister, PodResourcesListerServer};
use gpushare_proto::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices, ContainerResources,
    GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse, NumaNode,
    PodResources, TopologyInfo,
};
use gpushare_proto::{DEVICE_PLUGIN_VERSION, HEALTHY, UNHEALTHY};
use prost::Message as _;
use tokio::sync::watch;
use tokio_stream::StreamExt as _;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// The kubelet's gRPC receive limit.
pub const MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// The device manager's checkpoint file, the one file a kubelet start leaves in the
/// device-plugin directory.
pub const CHECKPOINT_FILE: &str = "kubelet_internal_checkpoint";

/// The PodResources rate limit: requests per second (the kubelet's `DefaultQPS`).
pub const POD_RESOURCES_QPS: f64 = 100.0;

/// The PodResources rate limit: burst tokens (the kubelet's `DefaultBurstTokens`).
pub const POD_RESOURCES_BURST: f64 = 10.0;

/// One container of a pod to admit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerSpec {
    /// The container's name, unique in its pod.
    pub name: String,
    /// Devices of the registered resource it asks for (its limit); 0 for none.
    pub units: usize,
    /// An init container (run to completion before the app containers; not a sidecar).
    pub init: bool,
    /// A restartable init container (`restartPolicy: Always`): admitted in init order, before
    /// the app containers, but its devices are its own for the pod's life, as an app's are.
    pub sidecar: bool,
}

impl ContainerSpec {
    /// An app container asking for `units` devices.
    #[must_use]
    pub fn app(name: &str, units: usize) -> ContainerSpec {
        ContainerSpec { name: name.to_owned(), units, init: false, sidecar: false }
    }

    /// An init container asking for `units` devices.
    #[must_use]
    pub fn init(name: &str, units: usize) -> ContainerSpec {
        ContainerSpec { name: name.to_owned(), units, init: true, sidecar: false }
    }

    /// A sidecar (a restartable init container) asking for `units` devices.
    #[must_use]
    pub fn sidecar(name: &str, units: usize) -> ContainerSpec {
        ContainerSpec { name: name.to_owned(), units, init: false, sidecar: true }
    }
}

/// One container's answer from the plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// The devices the kubelet gave it.
    pub devices: Vec<String>,
    /// The environment the plugin returned.
    pub envs: BTreeMap<String, String>,
    /// The mounts the plugin returned, as `host_path:container_path[:ro]`.
    pub mounts: Vec<String>,
}

/// A container of an admitted pod, as the device manager records it.
#[derive(Debug, Clone)]
struct HeldBy {
    name: String,
    init: bool,
    resource: String,
    /// The devices, with their topology as known when they were allocated.
    devices: Vec<Device>,
}

/// A pod admitted through the stand-in.
#[derive(Debug, Clone)]
struct Pod {
    namespace: String,
    name: String,
    /// In admission order: init containers first.
    containers: Vec<HeldBy>,
}

impl Pod {
    /// What `List` and `Get` report: the non-init containers, in spec order, one
    /// `ContainerDevices` per device and NUMA node (none for a device without topology), as
    /// the kubelet's `containerDevicesFromResourceDeviceInstances` does.
    fn resources(&self) -> PodResources {
        PodResources {
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            containers: self
                .containers
                .iter()
                .filter(|c| !c.init)
                .map(|c| ContainerResources {
                    name: c.name.clone(),
                    devices: c.devices.iter().flat_map(|d| per_numa_node(&c.resource, d)).collect(),
                    ..ContainerResources::default()
                })
                .collect(),
            ..PodResources::default()
        }
    }

    fn device_ids(&self) -> impl Iterator<Item = &str> {
        self.containers.iter().flat_map(|c| c.devices.iter().map(|d| d.id.as_str()))
    }
}

/// One device as the kubelet reports it over PodResources: an entry per NUMA node, or one
/// without topology.
fn per_numa_node(resource: &str, device: &Device) -> Vec<ContainerDevices> {
    let nodes = device.topology.as_ref().map(|t| t.nodes.as_slice()).unwrap_or_default();
    if nodes.is_empty() {
        return vec![ContainerDevices {
            resource_name: resource.to_owned(),
            device_ids: vec![device.id.clone()].into(),
            topology: None,
        }];
    }
    nodes
        .iter()
        .map(|n| ContainerDevices {
            resource_name: resource.to_owned(),
            device_ids: vec![device.id.clone()].into(),
            topology: Some(TopologyInfo { nodes: vec![NumaNode { id: n.id }] }),
        })
        .collect()
}

/// A token bucket, as `golang.org/x/time/rate` with the kubelet's PodResources settings.
#[derive(Debug)]
struct Limiter {
    tokens: f64,
    last: Option<Instant>,
}

impl Limiter {
    fn new() -> Limiter {
        Limiter { tokens: POD_RESOURCES_BURST, last: None }
    }

    fn allow(&mut self, now: Instant) -> bool {
        if let Some(last) = self.last {
            let refill = now.saturating_duration_since(last).as_secs_f64() * POD_RESOURCES_QPS;
            self.tokens = (self.tokens + refill).min(POD_RESOURCES_BURST);
        }
        self.last = Some(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// What the stand-in knows: the plugin, the pods, the counters.
#[derive(Debug)]
struct Shared {
    registrations: Vec<RegisterRequest>,
    /// How many of `registrations` came before the latest restart.
    registrations_before_restart: usize,
    restarts: usize,
    /// Bumped by every accepted registration and every restart: a `ListAndWatch` reader feeds
    /// the device list only while its generation is the current one.
    generation: u64,
    /// The resource of the newest registration (kept across restarts, as the checkpoint's
    /// registered devices are).
    resource: Option<String>,
    options: Option<DevicePluginOptions>,
    client: Option<DevicePluginClient<Channel>>,
    stream: Option<tokio::task::JoinHandle<()>>,
    largest_message: usize,
    stream_errors: Vec<String>,
    /// Devices allocated outside any named pod ([`Kubelet::allocate`], [`Kubelet::admit`]).
    loose: HashSet<String>,
    pods: Vec<Pod>,
    /// The pod in admission, with the containers `List` shows for it (sidecars and app
    /// containers, in spec order): the kubelet adds a pod to its pod manager before admitting
    /// it, so `List` shows it from then on, each container's devices once allocated.
    admitting: Option<(Pod, Vec<String>)>,
    injected: Vec<PodResources>,
    limiter: Limiter,
    pod_resources_requests: usize,
    pod_resources_rejected: usize,
    /// Further resources ([`Kubelet::also_serve`]), each with its own plugin connection.
    others: BTreeMap<String, Other>,
}

/// A further resource's plugin, as the kubelet keeps one per resource.
#[derive(Debug)]
struct Other {
    devices: Arc<watch::Sender<Vec<Device>>>,
    client: Option<DevicePluginClient<Channel>>,
    stream: Option<tokio::task::JoinHandle<()>>,
}

impl Default for Shared {
    fn default() -> Shared {
        Shared {
            registrations: Vec::new(),
            registrations_before_restart: 0,
            restarts: 0,
            generation: 0,
            resource: None,
            options: None,
            client: None,
            stream: None,
            largest_message: 0,
            stream_errors: Vec::new(),
            loose: HashSet::new(),
            pods: Vec::new(),
            admitting: None,
            injected: Vec::new(),
            limiter: Limiter::new(),
            pod_resources_requests: 0,
            pod_resources_rejected: 0,
            others: BTreeMap::new(),
        }
    }
}

impl Shared {
    /// Every device held: by a pod (init containers too, until the pod goes), by an injected
    /// entry of the registered resource, or outside any pod.
    fn in_use(&self) -> HashSet<String> {
        let mut in_use = self.loose.clone();
        in_use.extend(self.pods.iter().flat_map(Pod::device_ids).map(str::to_owned));
        for pod in &self.injected {
            for c in &pod.containers {
                for d in &c.devices {
                    if self.resource.as_deref().is_none_or(|r| r == d.resource_name) {
                        in_use.extend(d.device_ids.iter().map(str::to_owned));
                    }
                }
            }
        }
        in_use
    }

    /// The `List` answer: admitted pods in admission order, the pod in admission, then
    /// injected entries.
    fn list(&self) -> Vec<PodResources> {
        let admitting = self.admitting.as_ref().map(|(pod, listed)| {
            let so_far = pod.resources();
            PodResources {
                containers: listed
                    .iter()
                    .map(|name| {
                        so_far.containers.iter().find(|c| &c.name == name).cloned().unwrap_or_else(|| {
                            ContainerResources { name: name.clone(), ..ContainerResources::default() }
                        })
                    })
                    .collect(),
                ..so_far
            }
        });
        self.pods.iter().map(Pod::resources).chain(admitting).chain(self.injected.iter().cloned()).collect()
    }

    fn get(&self, namespace: &str, name: &str) -> Option<PodResources> {
        self.list().into_iter().find(|p| p.namespace == namespace && p.name == name)
    }
}

impl Shared {
    /// Every plugin client gone: each resource's connection and `ListAndWatch` reader, the
    /// generation bumped so that a reader still finishing feeds nothing.
    fn drop_clients(&mut self) {
        self.generation += 1;
        self.client = None;
        if let Some(stream) = self.stream.take() {
            stream.abort();
        }
        for other in self.others.values_mut() {
            other.client = None;
            if let Some(stream) = other.stream.take() {
                stream.abort();
            }
        }
    }
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The `Registration` service of one kubelet run.
#[derive(Debug, Clone)]
struct Service {
    dir: PathBuf,
    /// The restart count when this run started: registrations reaching a dead run are refused.
    epoch: usize,
    shared: Arc<Mutex<Shared>>,
    devices: Arc<watch::Sender<Vec<Device>>>,
}

#[tonic::async_trait]
impl Registration for Service {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let r = request.into_inner();
        if r.version != DEVICE_PLUGIN_VERSION {
            return Err(Status::unknown(format!("unsupported device plugin version {:?}", r.version)));
        }
        if !r.resource_name.contains('/') || r.resource_name.starts_with("kubernetes.io/") {
            return Err(Status::unknown(format!("invalid extended resource name {:?}", r.resource_name)));
        }
        // As the kubelet: dial the plugin back (10 s), ask its options, then watch devices.
        let socket = self.dir.join(&r.endpoint);
        let channel = tokio::time::timeout(Duration::from_secs(10), gpushare_proto::uds::connect(&socket))
            .await
            .map_err(|_| Status::unknown(format!("timed out dialling {}", socket.display())))?
            .map_err(|e| Status::unknown(format!("cannot dial {}: {e}", socket.display())))?;
        let mut client = DevicePluginClient::new(channel).max_decoding_message_size(MAX_MESSAGE);
        let options = client.get_device_plugin_options(Empty {}).await?.into_inner();
        let mut stream = client.list_and_watch(Empty {}).await?.into_inner();
        let mut shared = lock(&self.shared);
        if shared.restarts != self.epoch {
            return Err(Status::unavailable("the kubelet is restarting"));
        }
        if let Some(other) = shared.others.get_mut(&r.resource_name) {
            // A further resource: its own client and device list, beside the main one.
            if let Some(old) = other.stream.take() {
                old.abort();
            }
            other.client = Some(client);
            let devices = Arc::clone(&other.devices);
            other.stream = Some(tokio::spawn(async move {
                while let Ok(Some(list)) = stream.message().await {
                    devices.send_replace(list.devices);
                }
            }));
            shared.registrations.push(r);
            return Ok(Response::new(Empty {}));
        }
        shared.generation += 1;
        let generation = shared.generation;
        shared.resource = Some(r.resource_name.clone());
        shared.registrations.push(r);
        shared.options = Some(options);
        shared.client = Some(client);
        // The newest registration's stream replaces the older one.
        if let Some(old) = shared.stream.take() {
            old.abort();
        }
        let (state, devices) = (Arc::clone(&self.shared), Arc::clone(&self.devices));
        shared.stream = Some(tokio::spawn(async move {
            loop {
                match stream.message().await {
                    Ok(Some(list)) => {
                        let len = list.encoded_len();
                        let mut s = lock(&state);
                        if s.generation != generation {
                            break;
                        }
                        s.largest_message = s.largest_message.max(len);
                        devices.send_replace(list.devices);
                    }
                    Ok(None) => {
                        if lock(&state).generation == generation {
                            mark_unhealthy(&devices);
                        }
                        break;
                    }
                    Err(e) => {
                        let mut s = lock(&state);
                        if s.generation == generation {
                            s.stream_errors.push(e.to_string());
                            mark_unhealthy(&devices);
                        }
                        break;
                    }
                }
            }
        }));
        Ok(Response::new(Empty {}))
    }
}

/// Every device of the list unhealthy: what the kubelet does when the plugin's stream ends.
fn mark_unhealthy(devices: &watch::Sender<Vec<Device>>) {
    devices.send_modify(|list| {
        for d in list {
            d.health = UNHEALTHY.to_owned();
        }
    });
}

/// The `v1.PodResourcesLister` service.
#[derive(Debug, Clone)]
struct PodResourcesService {
    shared: Arc<Mutex<Shared>>,
    devices: Arc<watch::Sender<Vec<Device>>>,
}

impl PodResourcesService {
    /// Counts the request, and refuses it over the rate limit as the kubelet's interceptor does.
    fn admit(&self) -> Result<MutexGuard<'_, Shared>, Status> {
        let mut shared = lock(&self.shared);
        shared.pod_resources_requests += 1;
        if !shared.limiter.allow(Instant::now()) {
            shared.pod_resources_rejected += 1;
            return Err(Status::resource_exhausted("rejected by rate limit"));
        }
        Ok(shared)
    }
}

#[tonic::async_trait]
impl PodResourcesLister for PodResourcesService {
    async fn list(
        &self,
        _request: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        let shared = self.admit()?;
        Ok(Response::new(ListPodResourcesResponse { pod_resources: shared.list() }))
    }

    async fn get_allocatable_resources(
        &self,
        _request: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        let shared = self.admit()?;
        let devices = match &shared.resource {
            Some(resource) => self
                .devices
                .borrow()
                .iter()
                .filter(|d| d.health == HEALTHY)
                .flat_map(|d| per_numa_node(resource, d))
                .collect(),
            None => Vec::new(),
        };
        Ok(Response::new(AllocatableResourcesResponse { devices, ..AllocatableResourcesResponse::default() }))
    }

    async fn get(&self, request: Request<GetPodResourcesRequest>) -> Result<Response<GetPodResourcesResponse>, Status> {
        let shared = self.admit()?;
        let r = request.into_inner();
        match shared.get(&r.pod_namespace, &r.pod_name) {
            Some(pod) => Ok(Response::new(GetPodResourcesResponse { pod_resources: Some(pod) })),
            // The kubelet answers with a plain Go error: gRPC code Unknown.
            None => Err(Status::unknown(format!("pod {} in namespace {} not found", r.pod_name, r.pod_namespace))),
        }
    }
}

/// One gRPC server on a unix socket, whose accepted connections can all be cut at once, as
/// the death of the process does.
#[derive(Debug)]
struct Served {
    task: tokio::task::JoinHandle<()>,
    connections: Arc<Mutex<Vec<std::os::unix::net::UnixStream>>>,
}

impl Served {
    /// Serves `router` on `listener`, counting each connection accepted in `accepted`.
    fn start(
        listener: tokio::net::UnixListener,
        router: tonic::transport::server::Router,
        accepted: Arc<AtomicUsize>,
    ) -> Served {
        let connections = Arc::new(Mutex::new(Vec::new()));
        let tracked = Arc::clone(&connections);
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener).map(move |accepted_now| {
            let std = accepted_now?.into_std()?;
            accepted.fetch_add(1, Ordering::Relaxed);
            let handle = std.try_clone()?;
            tracked.lock().unwrap_or_else(PoisonError::into_inner).push(handle);
            tokio::net::UnixStream::from_std(std)
        });
        let task = tokio::spawn(async move {
            let _ = router.serve_with_incoming(incoming).await;
        });
        Served { task, connections }
    }

    /// Stops accepting and cuts every connection.
    fn kill(&self) {
        self.task.abort();
        for c in self.connections.lock().unwrap_or_else(PoisonError::into_inner).drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    /// [`Served::kill`], waiting until the listener is closed.
    async fn kill_and_wait(self) {
        self.task.abort();
        let _ = self.task.await;
        for c in self.connections.lock().unwrap_or_else(PoisonError::into_inner).drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Binds a unix socket, replacing a stale one, creating its directory (the stand-in kubelet's
/// sockets, the recording runtime's CRI and NRI sockets).
///
/// # Errors
/// When the directory cannot be made, the stale socket removed, or the socket bound.
pub(crate) fn bind_socket(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing the stale {}", path.display())),
    }
    tokio::net::UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))
}

/// What a starting kubelet's device manager does to its directory
/// (`CleanupPluginDirectory`): removes every socket (`os.Stat`, so a symlink to a socket too),
/// keeping directories, other files and the checkpoint.
fn cleanup_plugin_directory(dir: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry.with_context(|| format!("reading {}", dir.display()))?;
        if entry.file_name() == CHECKPOINT_FILE {
            continue;
        }
        let path = entry.path();
        let Ok(meta) = std::fs::metadata(&path) else { continue };
        if meta.is_dir() || !meta.file_type().is_socket() {
            continue;
        }
        std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
    }
    Ok(())
}

/// A running kubelet stand-in.
#[derive(Debug)]
pub struct Kubelet {
    dir: PathBuf,
    pod_resources_socket: Option<PathBuf>,
    shared: Arc<Mutex<Shared>>,
    devices_tx: Arc<watch::Sender<Vec<Device>>>,
    devices: watch::Receiver<Vec<Device>>,
    servers: Mutex<Vec<Served>>,
    /// Connections accepted on the PodResources socket, across restarts.
    pod_resources_connections: Arc<AtomicUsize>,
    /// The kubelet admits one pod at a time.
    admission: tokio::sync::Mutex<()>,
}

impl Kubelet {
    /// Serves `Registration` on `<dir>/kubelet.sock` (creating `dir`, replacing a stale socket;
    /// unlike [`Kubelet::restart`] it leaves other sockets in `dir` alone).
    ///
    /// # Errors
    /// If the socket cannot be bound.
    pub async fn start(dir: &Path) -> anyhow::Result<Kubelet> {
        Kubelet::launch(dir, None)
    }

    /// Like [`Kubelet::start`], and also serves `v1.PodResourcesLister` on
    /// `pod_resources_socket` (creating its directory, replacing a stale socket).
    ///
    /// # Errors
    /// If a socket cannot be bound.
    pub async fn start_with_pod_resources(dir: &Path, pod_resources_socket: &Path) -> anyhow::Result<Kubelet> {
        Kubelet::launch(dir, Some(pod_resources_socket))
    }

    fn launch(dir: &Path, pod_resources_socket: Option<&Path>) -> anyhow::Result<Kubelet> {
        let (tx, devices) = watch::channel(Vec::new());
        let kubelet = Kubelet {
            dir: dir.to_owned(),
            pod_resources_socket: pod_resources_socket.map(Path::to_owned),
            shared: Arc::new(Mutex::new(Shared::default())),
            devices_tx: Arc::new(tx),
            devices,
            servers: Mutex::new(Vec::new()),
            pod_resources_connections: Arc::new(AtomicUsize::new(0)),
            admission: tokio::sync::Mutex::new(()),
        };
        kubelet.listen()?;
        Ok(kubelet)
    }

    /// Binds the sockets of one kubelet run and serves them: PodResources first, then
    /// `kubelet.sock` (whose creation is what plugins watch for).
    fn listen(&self) -> anyhow::Result<()> {
        let epoch = lock(&self.shared).restarts;
        let mut servers = Vec::new();
        if let Some(path) = &self.pod_resources_socket {
            let listener = bind_socket(path)?;
            let service =
                PodResourcesService { shared: Arc::clone(&self.shared), devices: Arc::clone(&self.devices_tx) };
            let router = tonic::transport::Server::builder().add_service(PodResourcesListerServer::new(service));
            servers.push(Served::start(listener, router, Arc::clone(&self.pod_resources_connections)));
        }
        let sock = self.dir.join("kubelet.sock");
        let listener = match bind_socket(&sock) {
            Ok(l) => l,
            Err(e) => {
                servers.iter().for_each(Served::kill);
                return Err(e);
            }
        };
        let service = Service {
            dir: self.dir.clone(),
            epoch,
            shared: Arc::clone(&self.shared),
            devices: Arc::clone(&self.devices_tx),
        };
        let router = tonic::transport::Server::builder().add_service(RegistrationServer::new(service));
        servers.push(Served::start(listener, router, Arc::new(AtomicUsize::new(0))));
        self.servers.lock().unwrap_or_else(PoisonError::into_inner).extend(servers);
        Ok(())
    }

    /// Restarts the kubelet, as a real restart does: the running process dies (listeners
    /// closed, every connection cut, the plugin's `ListAndWatch` stream dropped, its client
    /// and devices forgotten), then the new one deletes every socket in the device-plugin
    /// directory (keeping directories, other files and `kubelet_internal_checkpoint`) and the
    /// PodResources socket, and listens again on fresh sockets. Admitted and injected pods
    /// stay (the real kubelet restores them from its checkpoint), so do the counters;
    /// [`Kubelet::registrations_since_restart`] starts again from zero. The same `Kubelet`
    /// goes on serving.
    ///
    /// # Errors
    /// If the directory cannot be cleaned or a socket cannot be bound.
    pub async fn restart(&self) -> anyhow::Result<()> {
        let servers = std::mem::take(&mut *self.servers.lock().unwrap_or_else(PoisonError::into_inner));
        for s in servers {
            s.kill_and_wait().await;
        }
        {
            let mut shared = self.shared();
            shared.restarts += 1;
            shared.registrations_before_restart = shared.registrations.len();
            shared.options = None;
            shared.drop_clients();
            for other in shared.others.values_mut() {
                other.devices.send_replace(Vec::new());
            }
        }
        self.devices_tx.send_replace(Vec::new());
        std::fs::create_dir_all(&self.dir).with_context(|| format!("creating {}", self.dir.display()))?;
        cleanup_plugin_directory(&self.dir)?;
        self.listen()
    }

    /// The kubelet drops the plugin's clients without restarting: closes their `ListAndWatch`
    /// streams and connections (every resource's) and marks every device unhealthy, its
    /// sockets left as they are.
    /// A kubelet that keys its plugin clients by resource name alone (1.29 does) does this to
    /// a restarted plugin that registered before the old one's stream end was seen: the old
    /// client's cleanup disconnects the newest client (`runClient`). Only a new registration
    /// brings the devices back.
    pub fn disconnect_plugin(&self) {
        {
            let mut shared = self.shared();
            shared.drop_clients();
            for other in shared.others.values() {
                mark_unhealthy(&other.devices);
            }
        }
        mark_unhealthy(&self.devices_tx);
    }

    /// The device-plugin directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The PodResources socket, if the stand-in serves one.
    #[must_use]
    pub fn pod_resources_socket(&self) -> Option<&Path> {
        self.pod_resources_socket.as_deref()
    }

    fn shared(&self) -> MutexGuard<'_, Shared> {
        lock(&self.shared)
    }

    /// Every registration accepted so far, across restarts.
    #[must_use]
    pub fn registrations(&self) -> Vec<RegisterRequest> {
        self.shared().registrations.clone()
    }

    /// The registrations accepted since the latest restart (all of them if none).
    #[must_use]
    pub fn registrations_since_restart(&self) -> Vec<RegisterRequest> {
        let shared = self.shared();
        shared.registrations[shared.registrations_before_restart..].to_vec()
    }

    /// How many times [`Kubelet::restart`] ran.
    #[must_use]
    pub fn restarts(&self) -> usize {
        self.shared().restarts
    }

    /// The plugin's options as read at registration (none since a restart until it registers
    /// again).
    #[must_use]
    pub fn options(&self) -> Option<DevicePluginOptions> {
        self.shared().options
    }

    /// The largest `ListAndWatch` message received, in bytes.
    #[must_use]
    pub fn largest_message(&self) -> usize {
        self.shared().largest_message
    }

    /// Errors that ended the current `ListAndWatch` stream or an earlier one (a message over the
    /// limit shows here; a stream replaced by a newer registration or a restart does not).
    #[must_use]
    pub fn stream_errors(&self) -> Vec<String> {
        self.shared().stream_errors.clone()
    }

    /// PodResources requests received (answered or refused).
    #[must_use]
    pub fn pod_resources_requests(&self) -> usize {
        self.shared().pod_resources_requests
    }

    /// Connections accepted on the PodResources socket, across restarts.
    #[must_use]
    pub fn pod_resources_connections(&self) -> usize {
        self.pod_resources_connections.load(Ordering::Relaxed)
    }

    /// PodResources requests refused by the rate limit.
    #[must_use]
    pub fn pod_resources_rejected(&self) -> usize {
        self.shared().pod_resources_rejected
    }

    /// Waits until `n` registrations have been accepted in all (across restarts).
    ///
    /// # Errors
    /// On timeout.
    pub async fn wait_registered(&self, n: usize, timeout: Duration) -> anyhow::Result<RegisterRequest> {
        self.wait_registration(n, timeout, false).await
    }

    /// Waits until `n` registrations have been accepted since the latest restart.
    ///
    /// # Errors
    /// On timeout.
    pub async fn wait_registered_since_restart(&self, n: usize, timeout: Duration) -> anyhow::Result<RegisterRequest> {
        self.wait_registration(n, timeout, true).await
    }

    async fn wait_registration(
        &self,
        n: usize,
        timeout: Duration,
        since_restart: bool,
    ) -> anyhow::Result<RegisterRequest> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            {
                let shared = self.shared();
                let first = if since_restart { shared.registrations_before_restart } else { 0 };
                if let Some(r) = shared.registrations[first..].get(n.saturating_sub(1)) {
                    return Ok(r.clone());
                }
            }
            if tokio::time::Instant::now() > deadline {
                let which = if since_restart { " since the restart" } else { "" };
                bail!("no registration #{n}{which} within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for a device list that satisfies `ok`.
    ///
    /// # Errors
    /// On timeout.
    pub async fn wait_devices(&self, timeout: Duration, ok: impl Fn(&[Device]) -> bool) -> anyhow::Result<Vec<Device>> {
        let mut rx = self.devices.clone();
        let result = tokio::time::timeout(timeout, rx.wait_for(|d| ok(d))).await;
        match result {
            Ok(Ok(d)) => Ok(d.clone()),
            _ => bail!("no matching device list within {timeout:?} (last had {} devices)", self.devices.borrow().len()),
        }
    }

    /// Serves `resource` as a further resource, as the kubelet keeps one plugin per resource:
    /// its registrations get a connection and a device list of their own
    /// ([`Kubelet::wait_devices_of`], [`Kubelet::allocate_of`]) and leave the main resource's
    /// alone. Call it before the plugin registers.
    pub fn also_serve(&self, resource: &str) {
        self.shared().others.entry(resource.to_owned()).or_insert_with(|| Other {
            devices: Arc::new(watch::Sender::new(Vec::new())),
            client: None,
            stream: None,
        });
    }

    /// Waits until the device list of a further resource satisfies `ok`.
    ///
    /// # Errors
    /// The resource is not served ([`Kubelet::also_serve`]), or no such list came in time.
    pub async fn wait_devices_of(
        &self,
        resource: &str,
        timeout: Duration,
        ok: impl Fn(&[Device]) -> bool,
    ) -> anyhow::Result<Vec<Device>> {
        let mut rx = self.shared().others.get(resource).context("not a further resource")?.devices.subscribe();
        let found =
            tokio::time::timeout(timeout, rx.wait_for(|d| ok(d))).await.ok().and_then(Result::ok).map(|d| d.clone());
        match found {
            Some(d) => Ok(d),
            None => bail!("no matching {resource} device list within {timeout:?} (last: {:?})", rx.borrow().clone()),
        }
    }

    /// `Allocate` of `devices` of a further resource for one container: its environment.
    ///
    /// # Errors
    /// No plugin of that resource is registered, or the plugin refused, with its message.
    pub async fn allocate_of(&self, resource: &str, devices: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
        let client = self.shared().others.get(resource).and_then(|o| o.client.clone());
        let client = client.with_context(|| format!("no plugin of {resource} has registered"))?;
        Ok(allocate_with(client, devices).await?.0)
    }

    /// The resource of the newest registration, kept across restarts.
    #[must_use]
    pub fn resource(&self) -> Option<String> {
        self.shared().resource.clone()
    }

    /// Whether a plugin is registered with this run of the kubelet (none right after a restart).
    #[must_use]
    pub fn is_registered(&self) -> bool {
        self.shared().client.is_some()
    }

    /// The latest device list's size: (all devices, healthy devices), what the kubelet reports
    /// as the node's capacity and allocatable for the resource.
    #[must_use]
    pub fn device_counts(&self) -> (usize, usize) {
        let devices = self.devices.borrow();
        (devices.len(), devices.iter().filter(|d| d.health == HEALTHY).count())
    }

    /// A receiver that sees every new device list.
    #[must_use]
    pub fn watch_devices(&self) -> watch::Receiver<Vec<Device>> {
        self.devices.clone()
    }

    /// The latest device list (empty after a restart until the plugin registers again).
    #[must_use]
    pub fn devices(&self) -> Vec<Device> {
        self.devices.borrow().clone()
    }

    fn client(&self) -> anyhow::Result<DevicePluginClient<Channel>> {
        self.shared().client.clone().context("no plugin has registered")
    }

    /// Admits one anonymous pod: for each container, in order, asks the plugin for a preferred
    /// allocation of `units` devices among the healthy devices not in use, and allocates them.
    /// No device is reused between containers, and PodResources does not list the pod (see
    /// [`Kubelet::admit_pod`] for both); the devices stay in use.
    ///
    /// # Errors
    /// The plugin's refusal, with its message.
    pub async fn admit(&self, containers: &[usize]) -> anyhow::Result<Vec<Admitted>> {
        let _admission = self.admission.lock().await;
        let mut out = Vec::with_capacity(containers.len());
        for &units in containers {
            let devices = self.preferred(units).await?;
            let (envs, mounts) = self.allocate_rpc(&devices).await?;
            self.shared().loose.extend(devices.iter().cloned());
            out.push(Admitted { devices, envs, mounts });
        }
        Ok(out)
    }

    /// Admits the pod `namespace/name` as the kubelet's device manager does, and records it
    /// for PodResources. Init containers go first, in the given order, then the others. For
    /// each container asking for units:
    /// - it first takes the pod's reusable devices: those of the init containers admitted
    ///   before it, less those an app container already took (the kubelet's `devicesToReuse`);
    /// - if it needs more, it asks `GetPreferredAllocation` (when the plugin offers it) for its
    ///   whole request over the healthy devices not in use plus the reused ones, which are
    ///   `must_include`; a plugin without preferred allocation gets the first free devices;
    ///   a container that reusable devices cover is not asked about;
    /// - then `Allocate` of all its devices.
    ///
    /// An init container's devices stay in use for other pods until the pod is removed. The
    /// stand-in is stricter than the kubelet about the preferred answer: one that is not
    /// exactly the request's size, drawn from the offer and holding every `must_include`
    /// device, is an error (the kubelet would quietly fill in). On an error nothing of the pod
    /// is recorded (the kubelet forgets a pod that failed admission).
    ///
    /// Returns one answer per container of `containers`, in the same order (no devices and no
    /// environment for a container asking for none).
    ///
    /// # Errors
    /// The pod is already admitted, a container name repeats, no plugin is registered, not
    /// enough devices are free, the plugin's preferred answer is unusable, or the plugin
    /// refused (with its message).
    pub async fn admit_pod(
        &self,
        namespace: &str,
        name: &str,
        containers: &[ContainerSpec],
    ) -> anyhow::Result<Vec<Admitted>> {
        let _admission = self.admission.lock().await;
        if namespace.is_empty() || name.is_empty() {
            bail!("a pod needs a namespace and a name (got {namespace:?}/{name:?})");
        }
        let mut names = HashSet::new();
        for c in containers {
            if c.name.is_empty() || !names.insert(c.name.as_str()) {
                bail!("pod {namespace}/{name}: container name {:?} is empty or repeated", c.name);
            }
        }
        if self.shared().pods.iter().any(|p| p.namespace == namespace && p.name == name) {
            bail!("pod {namespace}/{name} is already admitted");
        }
        // As the kubelet's device manager: every init container, sidecars included, in spec
        // order, then the app containers.
        let order = containers
            .iter()
            .enumerate()
            .filter(|(_, c)| c.init || c.sidecar)
            .chain(containers.iter().enumerate().filter(|(_, c)| !c.init && !c.sidecar));
        let mut pod = Pod { namespace: namespace.to_owned(), name: name.to_owned(), containers: Vec::new() };
        let listed = containers.iter().filter(|c| !c.init || c.sidecar).map(|c| c.name.clone()).collect();
        self.shared().admitting = Some((pod.clone(), listed));
        let mut answers: Vec<Option<Admitted>> = vec![None; containers.len()];
        let mut reusable: Vec<String> = Vec::new();
        for (i, spec) in order {
            let admitted = self
                .admit_container(&pod, spec, &reusable)
                .await
                .with_context(|| format!("pod {namespace}/{name} container {:?}", spec.name));
            // Rejected, the pod is no longer active: `List` drops it.
            let (admitted, held) = admitted.inspect_err(|_| self.shared().admitting = None)?;
            if spec.init {
                let known: HashSet<String> = reusable.iter().cloned().collect();
                reusable.extend(admitted.devices.iter().filter(|d| !known.contains(*d)).cloned());
            } else {
                let taken: HashSet<&String> = admitted.devices.iter().collect();
                reusable.retain(|d| !taken.contains(d));
            }
            pod.containers.push(held);
            if let Some((p, _)) = self.shared().admitting.as_mut() {
                p.containers.clone_from(&pod.containers);
            }
            answers[i] = Some(admitted);
        }
        let mut shared = self.shared();
        shared.admitting = None;
        if shared.pods.iter().any(|p| p.namespace == namespace && p.name == name) {
            bail!("pod {namespace}/{name} was admitted meanwhile");
        }
        shared.pods.push(pod);
        Ok(answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Admitted { devices: Vec::new(), envs: BTreeMap::new(), mounts: Vec::new() }))
            .collect())
    }

    /// One container of [`Kubelet::admit_pod`] (`devicesToAllocate`, then `Allocate`).
    async fn admit_container(
        &self,
        pod: &Pod,
        spec: &ContainerSpec,
        reusable: &[String],
    ) -> anyhow::Result<(Admitted, HeldBy)> {
        let (resource, options, in_use) = {
            let shared = self.shared();
            let resource = shared.resource.clone().unwrap_or_default();
            let mut in_use = shared.in_use();
            in_use.extend(pod.device_ids().map(str::to_owned));
            (resource, shared.options, in_use)
        };
        let mut held =
            HeldBy { name: spec.name.clone(), init: spec.init, resource: resource.clone(), devices: Vec::new() };
        if spec.units == 0 {
            return Ok((Admitted { devices: Vec::new(), envs: BTreeMap::new(), mounts: Vec::new() }, held));
        }
        if resource.is_empty() {
            bail!("cannot allocate unregistered device");
        }
        let all = self.devices();
        let healthy: Vec<&Device> = all.iter().filter(|d| d.health == HEALTHY).collect();
        if healthy.is_empty() {
            bail!("no healthy devices present; cannot allocate unhealthy devices {resource}");
        }
        // The reusable devices first.
        let mut allocated: Vec<String> = reusable.iter().take(spec.units).cloned().collect();
        let needed = spec.units - allocated.len();
        if needed > 0 {
            let available: Vec<String> =
                healthy.iter().filter(|d| !in_use.contains(&d.id)).map(|d| d.id.clone()).collect();
            if available.len() < needed {
                bail!(
                    "requested number of devices unavailable for {resource}. Requested: {needed}, Available: {}",
                    available.len()
                );
            }
            if options.is_some_and(|o| o.get_preferred_allocation_available) {
                let offer: Vec<String> = allocated.iter().chain(&available).cloned().collect();
                let answer = self.preferred_rpc(offer.clone(), allocated.clone(), spec.units).await?;
                check_preferred(&answer, &offer, &allocated, spec.units)?;
                let already: HashSet<String> = allocated.iter().cloned().collect();
                let new: Vec<String> = answer.into_iter().filter(|d| !already.contains(d)).collect();
                allocated.extend(new);
            } else {
                allocated.extend(available.into_iter().take(needed));
            }
        }
        let (envs, mounts) = self.allocate_rpc(&allocated).await?;
        let by_id: HashMap<&str, &Device> = all.iter().map(|d| (d.id.as_str(), d)).collect();
        held.devices = allocated
            .iter()
            .map(|id| {
                by_id.get(id.as_str()).map_or_else(|| Device { id: id.clone(), ..Device::default() }, |d| (*d).clone())
            })
            .collect();
        Ok((Admitted { devices: allocated, envs, mounts }, held))
    }

    /// Forgets the pod `namespace/name`, admitted or injected: its devices are free again and
    /// PodResources no longer lists it. Returns whether there was such a pod.
    pub fn remove_pod(&self, namespace: &str, name: &str) -> bool {
        let mut shared = self.shared();
        let before = shared.pods.len() + shared.injected.len();
        shared.pods.retain(|p| !(p.namespace == namespace && p.name == name));
        shared.injected.retain(|p| !(p.namespace == namespace && p.name == name));
        before != shared.pods.len() + shared.injected.len()
    }

    /// Adds an entry to the PodResources answer as if the kubelet held those devices for that
    /// pod, whether the plugin ever allocated them or not: `List` shows it after the admitted
    /// pods, `Get` finds it (after an admitted pod of the same name), and its devices of the
    /// registered resource count as in use. [`Kubelet::remove_pod`] takes it away.
    pub fn inject_pod_resources(&self, pod: PodResources) {
        self.shared().injected.push(pod);
    }

    /// What PodResources `List` answers now.
    #[must_use]
    pub fn pod_resources(&self) -> Vec<PodResources> {
        self.shared().list()
    }

    /// `GetPreferredAllocation` for `units` devices among the healthy devices not in use (by
    /// any pod, admitted or injected, or outside pods).
    ///
    /// # Errors
    /// The plugin's refusal.
    pub async fn preferred(&self, units: usize) -> anyhow::Result<Vec<String>> {
        let available: Vec<String> = {
            let in_use = self.shared().in_use();
            self.devices()
                .into_iter()
                .filter(|d| d.health == HEALTHY && !in_use.contains(&d.id))
                .map(|d| d.id)
                .collect()
        };
        if available.len() < units {
            bail!("only {} devices free, {units} requested", available.len());
        }
        let ids = self.preferred_rpc(available, Vec::new(), units).await?;
        if ids.len() != units {
            bail!("the plugin proposed {} devices for {units}", ids.len());
        }
        Ok(ids)
    }

    async fn preferred_rpc(
        &self,
        available: Vec<String>,
        must_include: Vec<String>,
        units: usize,
    ) -> anyhow::Result<Vec<String>> {
        let mut client = self.client()?;
        let request = PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: available.into(),
                must_include_device_i_ds: must_include.into(),
                allocation_size: i32::try_from(units)?,
            }],
        };
        let response = answered("GetPreferredAllocation", client.get_preferred_allocation(request)).await?;
        Ok(response.container_responses.into_iter().next().map(|r| r.device_i_ds).unwrap_or_default())
    }

    /// `GetDevicePluginOptions`, asked of the plugin now (the cheapest call: what a round trip
    /// costs).
    ///
    /// # Errors
    /// No plugin has registered, or the call failed.
    pub async fn ask_options(&self) -> anyhow::Result<DevicePluginOptions> {
        let mut client = self.client()?;
        answered("GetDevicePluginOptions", client.get_device_plugin_options(Empty {})).await
    }

    /// `Allocate` of these devices outside any pod; on success they are in use (until the
    /// stand-in goes: no pod holds them).
    ///
    /// # Errors
    /// The plugin's refusal.
    pub async fn allocate(&self, devices: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
        Ok(self.allocate_timed(devices).await?.0)
    }

    /// [`Kubelet::allocate`], with how long the call itself took: the plugin's answer over the
    /// socket, without the stand-in's own bookkeeping after it (a real kubelet's comes after
    /// the call too). Growing the set of devices in use now and then rehashes tens of
    /// thousands of IDs, which would otherwise show among a benchmark's slowest calls.
    ///
    /// # Errors
    /// The plugin's refusal, with its message.
    pub async fn allocate_timed(
        &self,
        devices: &[String],
    ) -> anyhow::Result<(BTreeMap<String, String>, std::time::Duration)> {
        let start = std::time::Instant::now();
        let (envs, _) = self.allocate_rpc(devices).await?;
        let took = start.elapsed();
        self.shared().loose.extend(devices.iter().cloned());
        Ok((envs, took))
    }

    /// `Allocate` for one container: the environment and the mounts it answered.
    async fn allocate_rpc(&self, devices: &[String]) -> anyhow::Result<(BTreeMap<String, String>, Vec<String>)> {
        allocate_with(self.client()?, devices).await
    }

    /// Stops serving, cuts the connections and removes `kubelet.sock` and the PodResources
    /// socket.
    pub fn stop(self) {
        for s in self.servers.lock().unwrap_or_else(PoisonError::into_inner).drain(..) {
            s.kill();
        }
        if let Some(stream) = self.shared().stream.take() {
            stream.abort();
        }
        let _ = std::fs::remove_file(self.dir.join("kubelet.sock"));
        if let Some(path) = &self.pod_resources_socket {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The stand-in's check of a preferred answer: the request's size, from the offer, every
/// `must_include` device, none twice.
fn check_preferred(answer: &[String], offer: &[String], must_include: &[String], units: usize) -> anyhow::Result<()> {
    let distinct: HashSet<&String> = answer.iter().collect();
    if answer.len() != units || distinct.len() != units {
        bail!(
            "the plugin's preferred allocation has {} distinct of {} devices for {units}",
            distinct.len(),
            answer.len()
        );
    }
    let offered: HashSet<&String> = offer.iter().collect();
    if let Some(d) = answer.iter().find(|d| !offered.contains(d)) {
        bail!("the plugin's preferred allocation holds {d:?}, which was not offered");
    }
    if let Some(d) = must_include.iter().find(|d| !distinct.contains(d)) {
        bail!("the plugin's preferred allocation leaves out {d:?}, which it must include");
    }
    Ok(())
}

fn code(s: &Status) -> String {
    format!("{:?}", s.code())
}

/// `Allocate` for one container on `client`: the environment and the mounts it answered.
/// How long the stand-in waits for a plugin's answer. A plugin killed in the middle of a burst
/// must fail the call, not leave it waiting forever (once in CI a call to a plugin killed with
/// SIGKILL never returned, and no timer was left to end the wait).
const PLUGIN_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// The answer to `call`, or its gRPC status (`call: code: message`), or that none came within
/// [`PLUGIN_CALL_TIMEOUT`].
async fn answered<T>(
    call: &str,
    answer: impl std::future::Future<Output = Result<tonic::Response<T>, Status>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(PLUGIN_CALL_TIMEOUT, answer).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(s)) => Err(anyhow::anyhow!("{call}: {}: {}", code(&s), s.message())),
        Err(_) => Err(anyhow::anyhow!("{call}: no answer within {PLUGIN_CALL_TIMEOUT:?}")),
    }
}

async fn allocate_with(
    mut client: DevicePluginClient<Channel>,
    devices: &[String],
) -> anyhow::Result<(BTreeMap<String, String>, Vec<String>)> {
    let request =
        AllocateRequest { container_requests: vec![ContainerAllocateRequest { devices_ids: devices.to_vec() }] };
    let response = answered("Allocate", client.allocate(request)).await?;
    let answer = response.container_responses.into_iter().next().context("empty Allocate response")?;
    let mounts = answer
        .mounts
        .iter()
        .map(|m| format!("{}:{}{}", m.host_path, m.container_path, if m.read_only { ":ro" } else { "" }))
        .collect();
    Ok((answer.envs.into_iter().collect(), mounts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_limit_allows_bursts_of_ten_then_a_hundred_per_second() {
        let mut limiter = Limiter::new();
        let t0 = Instant::now();
        assert_eq!((0..15).filter(|_| limiter.allow(t0)).count(), 10);
        // 50 ms later: 5 tokens back.
        let t1 = t0 + Duration::from_millis(50);
        assert_eq!((0..15).filter(|_| limiter.allow(t1)).count(), 5);
        // A long pause refills to the burst, no more.
        let t2 = t1 + Duration::from_secs(10);
        assert_eq!((0..15).filter(|_| limiter.allow(t2)).count(), 10);
    }

    #[test]
    fn podresources_reports_one_entry_per_device_and_numa_node() {
        let plain = Device { id: "a".into(), health: HEALTHY.into(), topology: None };
        let two = Device {
            id: "b".into(),
            health: HEALTHY.into(),
            topology: Some(gpushare_proto::deviceplugin::TopologyInfo {
                nodes: vec![
                    gpushare_proto::deviceplugin::NumaNode { id: 0 },
                    gpushare_proto::deviceplugin::NumaNode { id: 1 },
                ],
            }),
        };
        let e = per_numa_node("x.io/r", &plain);
        assert_eq!(e.len(), 1);
        assert!(e[0].topology.is_none());
        let e = per_numa_node("x.io/r", &two);
        let nodes: Vec<i64> = e.iter().map(|c| c.topology.as_ref().unwrap().nodes[0].id).collect();
        assert_eq!(nodes, [0, 1]);
        assert!(e.iter().all(|c| c.device_ids.to_vec() == ["b"] && c.resource_name == "x.io/r"));
    }

    #[test]
    fn a_preferred_answer_is_checked() {
        let offer: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let must = vec!["a".to_owned()];
        assert!(check_preferred(&["a".into(), "b".into()], &offer, &must, 2).is_ok());
        assert!(check_preferred(&["b".into(), "c".into()], &offer, &must, 2).is_err());
        assert!(check_preferred(&["a".into(), "z".into()], &offer, &must, 2).is_err());
        assert!(check_preferred(&["a".into(), "a".into()], &offer, &must, 2).is_err());
        assert!(check_preferred(&["a".into()], &offer, &must, 2).is_err());
    }
}
