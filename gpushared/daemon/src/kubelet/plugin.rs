//! The kubelet device plugin API (v1beta1), served on a unix socket: a thin tonic adapter
//! over [`Allocator`], the device list the kubelet receives, and registration with the kubelet.
//!
//! Startup order, as the kubelet requires: bind the socket and serve first, then `Register`
//! (retried with backoff while the kubelet is not up).

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use gpushare_core::NodeInventory;
use gpushare_core::devices::DeviceMap;
use gpushare_proto::DEVICE_PLUGIN_VERSION;
use gpushare_proto::deviceplugin::device_plugin_server::DevicePlugin;
use gpushare_proto::deviceplugin::registration_client::RegistrationClient;
use gpushare_proto::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, ContainerPreferredAllocationResponse,
    DevicePluginOptions, Empty, ListAndWatchResponse, Mount, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse, RegisterRequest,
};
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::allocation::allocator::{AllocError, Allocator, Care, KubeletSays};
use crate::kubelet::pod_resources::{LatestList, PodResourcesClient};
use crate::kubelet::streams::StreamCount;

mod asking;
mod list_and_watch;
mod stages;

use asking::KUBELET_RETRY;
use stages::{Stages, timed};

/// What the kubelet's device list is made from: the GPUs with their health. Cheap to clone;
/// the list itself (one entry per unit, 131 072 for 8 x 16 GiB) is written straight into the
/// encoded `ListAndWatch` message ([`DeviceSource`](gpushare_proto::compact::DeviceSource)),
/// never held as values.
#[derive(Clone, Debug)]
pub struct DeviceSnapshot {
    /// The GPUs and their health.
    pub inventory: Arc<NodeInventory>,
    /// Whether to publish NUMA nodes.
    pub numa: bool,
}

impl gpushare_proto::compact::DeviceSource for DeviceSnapshot {
    fn for_each_device(&self, f: &mut dyn FnMut(&str, bool, Option<i64>)) {
        let devices = DeviceMap::new(&self.inventory);
        let mut id = String::with_capacity(8);
        for (pos, g) in self.inventory.gpus().iter().enumerate() {
            let healthy = g.health.is_healthy();
            let numa = g.numa_node.filter(|_| self.numa).map(i64::from);
            for k in 0..devices.units(pos) {
                id.clear();
                if devices.push_id(pos, k, &mut id) {
                    f(&id, healthy, numa);
                }
            }
        }
    }
}

/// An allocation error as the kubelet receives it ([`AllocError::code`]).
fn status(e: &AllocError) -> Status {
    Status::new(e.code(), e.to_string())
}

/// The kubelet admitting a container, from its first call: ends the admission when dropped
/// (the call answered, refused or cancelled), unless kept open for the `Allocate` that follows
/// a `GetPreferredAllocation`.
struct Admission<'a> {
    alloc: &'a Allocator,
    open: bool,
}

impl<'a> Admission<'a> {
    fn start(alloc: &'a Allocator) -> Self {
        alloc.admission_started();
        Admission { alloc, open: false }
    }

    fn keep_open(mut self) {
        self.open = true;
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if !self.open {
            self.alloc.admission_ended();
        }
    }
}

/// The tonic service.
#[derive(Debug, Clone)]
pub struct Plugin {
    alloc: Arc<Allocator>,
    devices: watch::Receiver<DeviceSnapshot>,
    /// Set to `true` to end every `ListAndWatch` stream (the server is being replaced).
    stop: watch::Receiver<bool>,
    /// The kubelet's PodResources, asked which pod a call is for when several could be.
    pod_resources: Option<PodResourcesClient>,
    /// The latest answer of the kubelet's PodResources, shared with reconciliation.
    latest_list: LatestList,
    /// The `ListAndWatch` streams open, on every server of this plugin.
    streams: StreamCount,
}

impl Plugin {
    /// A service answering from `alloc`, streaming device lists from `devices`.
    #[must_use]
    pub fn new(alloc: Arc<Allocator>, devices: watch::Receiver<DeviceSnapshot>) -> Self {
        Plugin {
            alloc,
            devices,
            stop: watch::Sender::new(false).subscribe(),
            pod_resources: None,
            latest_list: LatestList::default(),
            streams: StreamCount::default(),
        }
    }

    /// The `ListAndWatch` streams open on this plugin's servers (the kubelet holds one while
    /// it uses the plugin).
    #[must_use]
    pub fn streams(&self) -> &StreamCount {
        &self.streams
    }

    /// The device list now and after every change, until the server stops; counted open in
    /// [`Self::streams`] until the kubelet or the server drops it.
    fn device_lists(&self) -> impl Stream<Item = ListAndWatchResponse> + Send + 'static {
        let open = self.streams.open();
        tokio_stream::wrappers::WatchStream::new(self.devices.clone())
            .map(move |snapshot| {
                let _counted = &open;
                ListAndWatchResponse::from_source(Arc::new(snapshot))
            })
            .take_until(Box::pin(stopped(self.stop.clone())))
    }

    /// The same, asking the kubelet's PodResources at `socket` which pod a call is for when
    /// several could be (while [`Allocator::kubelet_answers`]).
    #[must_use]
    pub fn with_pod_resources(mut self, socket: &Path) -> Self {
        self.pod_resources = Some(PodResourcesClient::new(socket));
        self
    }

    /// Where this plugin's calls share the kubelet's latest PodResources answer.
    #[must_use]
    pub fn latest_list(&self) -> LatestList {
        self.latest_list.clone()
    }

    /// The same, ending its `ListAndWatch` streams once `stop` turns `true`.
    #[must_use]
    pub fn with_stop(mut self, stop: watch::Receiver<bool>) -> Self {
        self.stop = stop;
        self
    }
}

/// Resolves once `stop` turns `true`; never if its sender is gone without doing so.
pub(crate) async fn stopped(mut stop: watch::Receiver<bool>) {
    if stop.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

/// How long a kubelet call waits for its pod to become clear in the pod store: to appear at all,
/// to be the only candidate, or for a consistent read of the node's pods to succeed. The kubelet
/// admits only pods it has seen bound, so a read begun after its call has the pod; only an
/// API-server outage keeps it from answering. Refusing at once would fail the pod's admission,
/// and the kubelet would go on to the next pod while the daemon still took the failed one to be
/// first in line; guessing among look-alikes could hand a container another's GPUs.
pub const CANDIDATE_WAIT: Duration = Duration::from_secs(5);

/// How often a call whose consistent read failed tries again.
const READ_RETRY: Duration = Duration::from_millis(250);

/// Runs `call` (which takes the allocator's lock and may commit to the ledger) where blocking is
/// allowed: on this worker thread, which hands its other tasks to another
/// ([`tokio::task::block_in_place`]), or on the blocking pool under a runtime of one thread.
/// On a node whose cores the kubelet and the API server keep busy, each hand-off between
/// threads waits for a core; running in place saves the pool's two hand-offs a run.
async fn run_blocking<T, F>(alloc: &Arc<Allocator>, call: &Arc<F>, care: &Care) -> Result<Result<T, AllocError>, Status>
where
    T: Send + 'static,
    F: Fn(&Allocator, &Care) -> Result<T, AllocError> + Send + Sync + 'static,
{
    if tokio::runtime::Handle::current().runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread {
        return Ok(tokio::task::block_in_place(|| call(alloc, care)));
    }
    let (alloc, f, now) = (Arc::clone(alloc), Arc::clone(call), care.clone());
    tokio::task::spawn_blocking(move || f(&alloc, &now))
        .await
        .map_err(|e| Status::internal(format!("allocation task failed: {e}")))
}

impl Plugin {
    /// Runs `call` where it may block ([`run_blocking`]), first with the pod store as it
    /// stands. If that would serve a pod whose admission has not started, or none at all, it
    /// reads consistently the pods the kubelet names, or else the node's pods
    /// ([`Self::confirm`]), and runs it again: the pod watch may lag behind the kubelet's, which
    /// has already seen the pod it admits; a call for no pod the read found is refused at once.
    /// When several pods could still be the one, it asks the kubelet's PodResources which it is
    /// admitting ([`KubeletSays`]) and runs it again with the answer.
    ///
    /// While it then cannot tell which of several pods it is for, or the first in line is
    /// doubtful (or, with no API server to read, finds no pod waiting), it runs again after each
    /// change of the pods bound here or of the allocations (asking the kubelet again), for up to
    /// [`CANDIDATE_WAIT`]. Then, if the kubelet could not be asked, once more, impatient (the
    /// oldest look-alike is taken); a call the kubelet's answer leaves ambiguous, one for a
    /// doubtful pod and every call while no read succeeds are refused: failing an admission is
    /// safe, handing a container another pod's GPU is not.
    ///
    /// Where its time went is logged at debug level ([`stages`]), under the name `name`.
    async fn waiting_for_the_pod<T, F>(&self, name: &'static str, call: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: Fn(&Allocator, &Care) -> Result<T, AllocError> + Send + Sync + 'static,
    {
        let mut stages = Stages::start();
        let result = self.resolving(call, &mut stages).await;
        stages.log(name, result.is_ok());
        result
    }

    /// [`Self::waiting_for_the_pod`], its time counted in `stages`.
    async fn resolving<T, F>(&self, call: F, stages: &mut Stages) -> Result<T, Status>
    where
        T: Send + 'static,
        F: Fn(&Allocator, &Care) -> Result<T, AllocError> + Send + Sync + 'static,
    {
        let call = Arc::new(call);
        let deadline = tokio::time::Instant::now() + CANDIDATE_WAIT;
        let askable = self.pod_resources.is_some() && self.alloc.kubelet_answers();
        let initial = if askable { KubeletSays::Askable } else { KubeletSays::Unasked };
        let generation = Some(self.alloc.kubelet_generation());
        let mut care = Care { patient: true, confirmed: false, kubelet: initial, generation };
        // Whether the API server was read since the call came: then a pod not found is not
        // there (deleted, say, while the kubelet's watch lagged), and waiting would only hold
        // up the kubelet's next admissions.
        let mut read = false;
        // Whether the kubelet answered since the call came.
        let mut asked = false;
        loop {
            // Subscribed before the call, so a change while it runs wakes the wait below.
            let mut pods = self.alloc.pods().subscribe();
            let mut allocations = self.alloc.subscribe();
            let (result, took) = timed(run_blocking(&self.alloc, &call, &care)).await;
            stages.runs += 1;
            stages.run += took;
            let result = result?;
            let waiting = tokio::time::Instant::now() < deadline;
            let mut retry_in = None;
            match result {
                Err(AllocError::Unconfirmed { pod }) => match self.confirm(&pod, &mut care, &mut asked, stages).await {
                    Ok(made) => {
                        care.confirmed = true;
                        read = made;
                        continue;
                    }
                    Err(e) if waiting => {
                        tracing::debug!(error = %e, "cannot read this node's pods yet; trying again");
                        retry_in = Some(READ_RETRY);
                    }
                    Err(e) => {
                        return Err(Status::unavailable(format!(
                            "cannot tell which pod the kubelet is admitting: the pod watch may lag behind the \
                             kubelet's, and no read of this node's pods succeeded within {CANDIDATE_WAIT:?} ({e}); \
                             check that the API server is reachable with gpushared's kubeconfig"
                        )));
                    }
                },
                Err(AllocError::Ambiguous { .. }) if care.kubelet == KubeletSays::Askable => {
                    let (kubelet, took) = timed(self.ask_kubelet()).await;
                    stages.kubelet += took;
                    care.kubelet = kubelet;
                    asked |= matches!(care.kubelet, KubeletSays::Listed(_));
                    continue;
                }
                Err(AllocError::NoCandidate { .. }) if waiting && !read => self.alloc.pods().want_news(),
                Err(AllocError::Doubtful { .. } | AllocError::Rebuilding { .. }) if waiting => {}
                Err(AllocError::Ambiguous { .. }) if waiting => {
                    if let KubeletSays::Listed(_) = care.kubelet {
                        // Asked again after the next change (or shortly): a pod it listed was
                        // rejected before this call, say, and the API server has it failed.
                        care.kubelet = KubeletSays::Askable;
                        retry_in = Some(KUBELET_RETRY);
                    }
                }
                Err(e @ AllocError::Ambiguous { .. }) if care.patient && !asked => {
                    tracing::warn!(error = %e, "still ambiguous after waiting; serving the oldest");
                    care.patient = false;
                    care.kubelet = KubeletSays::Unasked;
                    continue;
                }
                other => return other.map_err(|e| status(&e)),
            }
            let retry = retry_in.map_or(deadline, |d| (tokio::time::Instant::now() + d).min(deadline));
            // A closed channel (the daemon is stopping) waits out the deadline instead.
            let ((), took) = timed(async {
                tokio::select! {
                    Ok(()) = pods.changed() => {}
                    Ok(()) = allocations.changed() => {}
                    () = tokio::time::sleep_until(retry) => {}
                }
            })
            .await;
            stages.waited += took;
        }
    }
}

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(&self, _: Request<Empty>) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions { pre_start_required: false, get_preferred_allocation_available: true }))
    }

    type ListAndWatchStream = DeviceStream;

    /// Served through [`list_and_watch::PluginService`], which frames the same messages itself;
    /// this is the path a caller of the service in process takes.
    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        Ok(Response::new(Box::pin(self.device_lists().map(Ok))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let admission = Admission::start(&self.alloc);
        let requests = Arc::new(request.into_inner().container_requests);
        let mut sizes = Vec::with_capacity(requests.len());
        for r in requests.iter() {
            sizes.push(
                usize::try_from(r.allocation_size)
                    .map_err(|_| Status::invalid_argument(format!("allocation_size {}", r.allocation_size)))?,
            );
        }
        let sizes = Arc::new(sizes);
        let listed: usize = requests.iter().map(|r| r.available_device_i_ds.len()).sum();
        let responses = self
            .waiting_for_the_pod("GetPreferredAllocation", move |alloc, care| {
                requests
                    .iter()
                    .zip(sizes.iter())
                    .map(|(r, size)| {
                        alloc
                            .preferred_with(
                                r.available_device_i_ds.iter(),
                                &r.must_include_device_i_ds.to_vec(),
                                *size,
                                care,
                            )
                            .map(|device_i_ds| ContainerPreferredAllocationResponse { device_i_ds })
                    })
                    .collect::<Result<Vec<_>, AllocError>>()
            })
            .await;
        // The kubelet lists every free device (131 072 IDs for 8 x 16 GiB in MiB mode); the
        // list is dropped by now. A short list leaves nothing to return: no hand-off to the
        // blocking pool and back, which on busy cores waits for one.
        if listed >= crate::memory::LARGE_LIST {
            tokio::task::spawn_blocking(move || crate::memory::after_list(listed)).await.ok();
        }
        let container_responses = responses?;
        // Its Allocate follows.
        admission.keep_open();
        Ok(Response::new(PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(&self, request: Request<AllocateRequest>) -> Result<Response<AllocateResponse>, Status> {
        let _admission = Admission::start(&self.alloc);
        let requests = Arc::new(request.into_inner().container_requests);
        let responses = self
            .waiting_for_the_pod("Allocate", move |alloc, care| {
                requests
                    .iter()
                    .map(|r| {
                        alloc.allocate_with(&r.devices_ids, care).map(|a| ContainerAllocateResponse {
                            envs: a.envs.into_iter().collect(),
                            mounts: a
                                .mounts
                                .iter()
                                .map(|m| Mount {
                                    container_path: m.path.display().to_string(),
                                    host_path: m.path.display().to_string(),
                                    read_only: m.read_only,
                                })
                                .collect(),
                            devices: super::device_specs(&a.devices),
                            ..Default::default()
                        })
                    })
                    .collect::<Result<Vec<_>, AllocError>>()
            })
            .await
            .inspect_err(|e| tracing::warn!(error = %e.message(), "Allocate refused"))?;
        Ok(Response::new(AllocateResponse { container_responses: responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// Binds the plugin socket, removing a stale one; the socket is root-only.
///
/// # Errors
/// The I/O error if the socket cannot be bound.
pub fn bind(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Serves `plugin` on `listener` until `shutdown` resolves.
///
/// # Errors
/// The transport error if serving fails.
pub async fn serve(
    plugin: Plugin,
    listener: tokio::net::UnixListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(list_and_watch::PluginService::new(plugin))
        .serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(listener), shutdown)
        .await
}

/// One generation of the plugin server: its socket, serving until [`Server::stop`]. A kubelet
/// restart deletes the socket, and the daemon starts a new generation.
#[derive(Debug)]
pub struct Server {
    socket: PathBuf,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Server {
    /// Binds `socket` (replacing a stale file) and serves `plugin` on it.
    ///
    /// # Errors
    /// The I/O error if the socket cannot be bound.
    pub fn start(plugin: Plugin, socket: &Path) -> std::io::Result<Server> {
        let listener = bind(socket)?;
        let stop = watch::Sender::new(false);
        let plugin = plugin.with_stop(stop.subscribe());
        let task = tokio::spawn(serve(plugin, listener, stopped(stop.subscribe())));
        Ok(Server { socket: socket.to_owned(), stop, task })
    }

    /// Ends the `ListAndWatch` streams and stops serving (waiting up to 5 s for calls in
    /// flight); removes the socket if it is still this server's.
    pub async fn stop(self, remove_socket: bool) {
        let _ = self.stop.send(true);
        match tokio::time::timeout(Duration::from_secs(5), self.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the plugin server ended with an error"),
            Ok(Err(e)) => tracing::warn!(error = %e, "the plugin server task failed"),
            Err(_) => tracing::warn!("the plugin server did not stop within 5 s"),
        }
        if remove_socket {
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}

/// Registers `resource` served at `endpoint` with the kubelet at `kubelet_sock` (`preferred`:
/// whether the plugin offers `GetPreferredAllocation`), retrying with backoff (100 ms doubling
/// to 5 s) while the kubelet is not there, or went away before it answered (a kubelet
/// restarting mid-call). Returns once the kubelet accepted, or with the kubelet's refusal (a
/// refused registration is final: the kubelet rejects the name or version).
///
/// # Errors
/// The kubelet's refusal.
pub async fn register(
    kubelet_sock: PathBuf,
    endpoint: String,
    resource: String,
    preferred: bool,
) -> Result<(), Status> {
    let mut delay = Duration::from_millis(100);
    loop {
        let attempt = async {
            let channel = gpushare_proto::uds::connect(&kubelet_sock)
                .await
                .map_err(|e| Status::unavailable(format!("cannot reach {}: {e}", kubelet_sock.display())))?;
            RegistrationClient::new(channel)
                .register(RegisterRequest {
                    version: DEVICE_PLUGIN_VERSION.to_owned(),
                    endpoint: endpoint.clone(),
                    resource_name: resource.clone(),
                    options: Some(DevicePluginOptions {
                        pre_start_required: false,
                        get_preferred_allocation_available: preferred,
                    }),
                })
                .await
        };
        match attempt.await {
            Ok(_) => {
                tracing::info!(kubelet = %kubelet_sock.display(), %resource, %endpoint, "registered with the kubelet");
                return Ok(());
            }
            Err(s) if s.code() == tonic::Code::Unavailable || unanswered(&s) => {
                tracing::info!(kubelet = %kubelet_sock.display(), error = %s.message(), "waiting for the kubelet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(s) => return Err(s),
        }
    }
}

/// Whether a call failed below gRPC, its connection lost before an answer came (tonic's
/// "transport error"), rather than with a status the other side sent.
fn unanswered(status: &Status) -> bool {
    std::error::Error::source(status).is_some_and(<dyn std::error::Error>::is::<tonic::transport::Error>)
}

/// Sends the kubelet a new device list when a GPU's health changes.
pub async fn follow_health(alloc: Arc<Allocator>, devices: watch::Sender<DeviceSnapshot>) {
    let mut changes = alloc.subscribe();
    loop {
        let now = alloc.current_inventory();
        let differs = devices.borrow().inventory.gpus().iter().zip(now.gpus()).any(|(a, b)| a.health != b.health);
        if differs {
            devices.send_modify(|d| d.inventory = Arc::new(now));
        }
        if changes.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use gpushare_core::ContainerRole;
    use gpushare_proto::compact::{ContainerPreferredAllocationRequest, DeviceIds};
    use gpushare_proto::deviceplugin::ContainerAllocateRequest;

    use super::*;
    use crate::allocation::allocator::tests::{Fixture, fixture, pod};
    use crate::config::Compatibility;

    /// The plugin over the allocator tests' node (three GPUs of 1000 MiB in MiB mode), with one
    /// pod waiting for 100 MiB on GPU 0.
    fn plugin() -> (Plugin, Fixture) {
        let f = fixture(Compatibility::Gpushare);
        pod(&f, "a", "2026-11-24T10:00:00Z", &[("main", ContainerRole::App, &[(0, 100)])]);
        let snapshot = DeviceSnapshot { inventory: Arc::new(f.alloc.inventory().clone()), numa: false };
        (Plugin::new(Arc::clone(&f.alloc), watch::Sender::new(snapshot).subscribe()), f)
    }

    fn preferred(available: DeviceIds, size: i32) -> Request<PreferredAllocationRequest> {
        Request::new(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: available,
                must_include_device_i_ds: DeviceIds::new(),
                allocation_size: size,
            }],
        })
    }

    fn allocate(ids: Vec<String>) -> Request<AllocateRequest> {
        Request::new(AllocateRequest { container_requests: vec![ContainerAllocateRequest { devices_ids: ids }] })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_registration_the_kubelet_dropped_unanswered_is_made_again() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("kubelet.sock");
        let (plugin, _fixture) = plugin();
        let _server = Server::start(plugin, &dir.path().join("gpushared.sock")).unwrap();
        // A kubelet that takes the call and goes away before answering, as one restarting does.
        let listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let registering =
            tokio::spawn(register(sock.clone(), "gpushared.sock".into(), "gpushare.io/gpu-mem".into(), true));
        let (mut call, _) = listener.accept().await.unwrap();
        let _ = tokio::io::AsyncReadExt::read(&mut call, &mut [0u8; 64]).await;
        drop((call, listener));
        // The kubelet after it, on the same path.
        let kubelet = gpushare_testkit::kubelet::Kubelet::start(dir.path()).await.unwrap();
        let registered = tokio::time::timeout(Duration::from_secs(10), registering).await.unwrap().unwrap();
        assert!(registered.is_ok(), "{registered:?}");
        assert_eq!(kubelet.registrations().len(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_admission_is_open_from_the_preferred_allocation_until_its_allocate_is_answered() {
        let (plugin, f) = plugin();
        let admission = f.alloc.subscribe_admission();
        let free: DeviceIds = f.alloc.devices().ids(0).collect();
        let ids = plugin.get_preferred_allocation(preferred(free, 100)).await.unwrap().into_inner().container_responses
            [0]
        .device_i_ds
        .clone();
        assert!(*admission.borrow(), "its Allocate is on its way");
        let answer = plugin.allocate(allocate(ids)).await.unwrap().into_inner();
        assert!(answer.container_responses[0].envs.contains_key("NVIDIA_VISIBLE_DEVICES"));
        assert!(!*admission.borrow(), "answered");

        // Refused calls end the admission too: the kubelet fails it and moves on.
        let refused = plugin.get_preferred_allocation(preferred(DeviceIds::new(), -1)).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(!*admission.borrow(), "a refused GetPreferredAllocation");
        let refused = plugin.allocate(allocate(vec!["no-such-device".into()])).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(!*admission.borrow(), "a refused Allocate");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancelled_call_ends_its_admission() {
        let (plugin, f) = plugin();
        let mut admission = f.alloc.subscribe_admission();
        // No pod waits for 999 devices: the call waits for the pod watch until the kubelet gives up.
        let free: DeviceIds = f.alloc.devices().ids(0).collect();
        let p = plugin.clone();
        let call = tokio::spawn(async move { p.get_preferred_allocation(preferred(free, 999)).await });
        tokio::time::timeout(Duration::from_secs(5), admission.wait_for(|busy| *busy))
            .await
            .expect("the admission opens")
            .unwrap();
        call.abort();
        assert!(call.await.unwrap_err().is_cancelled());
        assert!(!*admission.borrow(), "the cancelled call ended it");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pod_that_shows_up_while_the_call_waits_is_served() {
        let f = fixture(Compatibility::Gpushare);
        let snapshot = DeviceSnapshot { inventory: Arc::new(f.alloc.inventory().clone()), numa: false };
        let plugin = Plugin::new(Arc::clone(&f.alloc), watch::Sender::new(snapshot).subscribe());
        let mut changes = f.alloc.pods().subscribe();
        let free: DeviceIds = f.alloc.devices().ids(1).collect();
        let call = tokio::spawn(async move { plugin.get_preferred_allocation(preferred(free, 200)).await });
        // The call finds no pod and waits; the pod watch then delivers it.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!call.is_finished(), "it waits for the pod watch rather than refusing");
        pod(&f, "late", "2026-11-24T10:00:00Z", &[("main", ContainerRole::App, &[(1, 200)])]);
        assert!(changes.has_changed().unwrap(), "the store announced the pod");
        changes.mark_unchanged();
        let ids = call.await.unwrap().unwrap().into_inner().container_responses[0].device_i_ds.clone();
        assert_eq!(ids.len(), 200);
        assert!(ids.iter().all(|id| f.alloc.devices().resolve(id).is_some_and(|(g, _)| g == 1)), "on its GPU");
    }
}
