//! The kubelet stand-in driven through real gRPC: a small device plugin in the test registers
//! over `kubelet.sock` and serves `ListAndWatch`, `GetPreferredAllocation` (the first N
//! offered, `must_include` first) and `Allocate` (an environment naming the devices); a real
//! PodResources client reads `List`, `Get` and `GetAllocatableResources`. Named admission,
//! init-container reuse, pod removal, injected entries, a kubelet restart, a replaced
//! registration and the rate limit. Every test is bounded by a 10 s timeout.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt as _};
use gpushare_proto::deviceplugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
use gpushare_proto::deviceplugin::registration_client::RegistrationClient;
use gpushare_proto::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, ContainerPreferredAllocationRequest,
    ContainerPreferredAllocationResponse, Device, DevicePluginOptions, Empty, ListAndWatchResponse, NumaNode,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
    RegisterRequest, TopologyInfo,
};
use gpushare_proto::podresources::pod_resources_lister_client::PodResourcesListerClient;
use gpushare_proto::podresources::{
    AllocatableResourcesRequest, ContainerDevices, ContainerResources, GetPodResourcesRequest, ListPodResourcesRequest,
    PodResources,
};
use gpushare_proto::{HEALTHY, UNHEALTHY};
use gpushare_testkit::kubelet::{ContainerSpec, Kubelet};
use tokio::sync::watch;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

const LIMIT: Duration = Duration::from_secs(10);
const RESOURCE: &str = "example.com/dev";
const ENV: &str = "TEST_DEVICES";

/// Runs a test body under the 10 s limit.
async fn within<F: Future>(body: F) -> F::Output {
    tokio::time::timeout(LIMIT, body).await.expect("the test took more than 10 s")
}

fn device(id: &str, health: &str, numa: Option<i64>) -> Device {
    Device {
        id: id.to_owned(),
        health: health.to_owned(),
        topology: numa.map(|n| TopologyInfo { nodes: vec![NumaNode { id: n }] }),
    }
}

/// d0-d3 on NUMA node 0, d4-d5 on node 1, d6 without topology, d7 unhealthy.
fn eight_devices() -> Vec<Device> {
    let mut d: Vec<Device> = (0..4).map(|i| device(&format!("d{i}"), HEALTHY, Some(0))).collect();
    d.push(device("d4", HEALTHY, Some(1)));
    d.push(device("d5", HEALTHY, Some(1)));
    d.push(device("d6", HEALTHY, None));
    d.push(device("d7", UNHEALTHY, None));
    d
}

fn strings(ids: &[&str]) -> Vec<String> {
    ids.iter().map(|s| (*s).to_owned()).collect()
}

/// What the plugin was asked.
#[derive(Debug, Default)]
struct Calls {
    preferred: Vec<ContainerPreferredAllocationRequest>,
    allocate: Vec<Vec<String>>,
}

/// The device plugin of the tests.
#[derive(Debug, Clone)]
struct TestPlugin {
    devices: Arc<watch::Sender<Vec<Device>>>,
    preferred_available: bool,
    calls: Arc<Mutex<Calls>>,
    open_streams: Arc<AtomicUsize>,
    /// End each `ListAndWatch` stream after this many lists, as a plugin that dies would.
    lists_per_stream: Option<usize>,
}

impl TestPlugin {
    fn new(devices: Vec<Device>, preferred_available: bool) -> TestPlugin {
        TestPlugin {
            devices: Arc::new(watch::channel(devices).0),
            preferred_available,
            calls: Arc::default(),
            open_streams: Arc::default(),
            lists_per_stream: None,
        }
    }

    /// This plugin, ending each `ListAndWatch` stream after `n` lists.
    fn ending_after(mut self, n: usize) -> TestPlugin {
        self.lists_per_stream = Some(n);
        self
    }

    fn preferred_calls(&self) -> Vec<ContainerPreferredAllocationRequest> {
        self.calls.lock().unwrap().preferred.clone()
    }

    fn allocate_calls(&self) -> Vec<Vec<String>> {
        self.calls.lock().unwrap().allocate.clone()
    }

    fn open_streams(&self) -> usize {
        self.open_streams.load(Ordering::SeqCst)
    }

    /// Serves on `socket` (replacing a stale one).
    fn serve(&self, socket: &Path) -> tokio::task::JoinHandle<()> {
        let _ = std::fs::remove_file(socket);
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        let server = tonic::transport::Server::builder().add_service(DevicePluginServer::new(self.clone()));
        tokio::spawn(async move {
            server.serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)).await.unwrap();
        })
    }
}

/// A `ListAndWatch` stream that counts itself open until the kubelet drops it.
struct Counted {
    inner: Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>,
    open: Arc<AtomicUsize>,
}

impl Stream for Counted {
    type Item = Result<ListAndWatchResponse, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().inner.as_mut().poll_next(cx)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::SeqCst);
    }
}

#[tonic::async_trait]
impl DevicePlugin for TestPlugin {
    async fn get_device_plugin_options(&self, _: Request<Empty>) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: self.preferred_available,
        }))
    }

    type ListAndWatchStream = Counted;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Counted>, Status> {
        self.open_streams.fetch_add(1, Ordering::SeqCst);
        let inner = tokio_stream::wrappers::WatchStream::new(self.devices.subscribe())
            .map(|devices| Ok(ListAndWatchResponse { devices, source: None }))
            .take(self.lists_per_stream.unwrap_or(usize::MAX));
        Ok(Response::new(Counted { inner: Box::pin(inner), open: Arc::clone(&self.open_streams) }))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let mut responses = Vec::new();
        for r in request.into_inner().container_requests {
            let size = usize::try_from(r.allocation_size).unwrap();
            let must = r.must_include_device_i_ds.to_vec();
            let mut ids = must.clone();
            ids.extend(r.available_device_i_ds.iter().filter(|d| !must.iter().any(|m| m == d)).map(str::to_owned));
            ids.truncate(size);
            self.calls.lock().unwrap().preferred.push(r);
            responses.push(ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(PreferredAllocationResponse { container_responses: responses }))
    }

    async fn allocate(&self, request: Request<AllocateRequest>) -> Result<Response<AllocateResponse>, Status> {
        let mut responses = Vec::new();
        for r in request.into_inner().container_requests {
            let envs = [(ENV.to_owned(), r.devices_ids.join(","))].into_iter().collect();
            self.calls.lock().unwrap().allocate.push(r.devices_ids);
            responses.push(ContainerAllocateResponse { envs, ..ContainerAllocateResponse::default() });
        }
        Ok(Response::new(AllocateResponse { container_responses: responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// Registers `endpoint` with the kubelet in `dir`, as a plugin does.
async fn register(dir: &Path, endpoint: &str, preferred_available: bool) {
    let channel = gpushare_proto::uds::connect(&dir.join("kubelet.sock")).await.unwrap();
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: "v1beta1".into(),
            endpoint: endpoint.into(),
            resource_name: RESOURCE.into(),
            options: Some(DevicePluginOptions {
                pre_start_required: false,
                get_preferred_allocation_available: preferred_available,
            }),
        })
        .await
        .unwrap();
}

/// A kubelet serving PodResources too, and a plugin registered with it.
struct Node {
    _tmp: tempfile::TempDir,
    kubelet: Kubelet,
    plugin: TestPlugin,
}

impl Node {
    async fn new(preferred_available: bool) -> Node {
        let tmp = tempfile::tempdir().unwrap();
        let dp = tmp.path().join("device-plugins");
        let kubelet =
            Kubelet::start_with_pod_resources(&dp, &tmp.path().join("pod-resources/kubelet.sock")).await.unwrap();
        let plugin = TestPlugin::new(eight_devices(), preferred_available);
        plugin.serve(&dp.join("test.sock"));
        register(&dp, "test.sock", preferred_available).await;
        kubelet.wait_devices(LIMIT, |d| d.len() == 8).await.unwrap();
        Node { _tmp: tmp, kubelet, plugin }
    }

    fn dp(&self) -> PathBuf {
        self.kubelet.dir().to_owned()
    }

    /// A PodResources client on a fresh connection.
    async fn pod_resources(&self) -> PodResourcesListerClient<Channel> {
        let socket = self.kubelet.pod_resources_socket().unwrap();
        PodResourcesListerClient::new(gpushare_proto::uds::connect(socket).await.unwrap())
    }

    async fn list(&self) -> Vec<PodResources> {
        self.pod_resources().await.list(ListPodResourcesRequest {}).await.unwrap().into_inner().pod_resources
    }

    async fn get(&self, namespace: &str, name: &str) -> Result<PodResources, Status> {
        let request = GetPodResourcesRequest { pod_name: name.into(), pod_namespace: namespace.into() };
        Ok(self.pod_resources().await.get(request).await?.into_inner().pod_resources.unwrap())
    }
}

/// Every device ID of a container, in order.
fn ids(c: &ContainerResources) -> Vec<String> {
    c.devices.iter().flat_map(|d| d.device_ids.iter().map(str::to_owned)).collect()
}

/// `namespace/name` of each listed pod.
fn names(list: &[PodResources]) -> Vec<String> {
    list.iter().map(|p| format!("{}/{}", p.namespace, p.name)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admits_a_named_pod_and_lists_it_over_pod_resources() {
    within(async {
        let node = Node::new(true).await;
        let k = &node.kubelet;
        let a = k.admit_pod("ml", "p1", &[ContainerSpec::app("a", 2), ContainerSpec::app("b", 0)]).await.unwrap();
        assert_eq!(a[0].devices, strings(&["d0", "d1"]));
        assert_eq!(a[0].envs[ENV], "d0,d1");
        assert!(a[1].devices.is_empty() && a[1].envs.is_empty());

        // Offered: the healthy devices (not d7), nothing to include, the request's size.
        let preferred = node.plugin.preferred_calls();
        assert_eq!(preferred.len(), 1);
        assert_eq!(preferred[0].available_device_i_ds.to_vec(), strings(&["d0", "d1", "d2", "d3", "d4", "d5", "d6"]));
        assert!(preferred[0].must_include_device_i_ds.is_empty());
        assert_eq!(preferred[0].allocation_size, 2);
        assert_eq!(node.plugin.allocate_calls(), [strings(&["d0", "d1"])]);

        // List: both containers, one entry per device with its NUMA node.
        let list = node.list().await;
        assert_eq!(names(&list), ["ml/p1"]);
        let containers: Vec<&str> = list[0].containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(containers, ["a", "b"]);
        let a_devices = &list[0].containers[0].devices;
        assert_eq!(a_devices.len(), 2);
        for (entry, id) in a_devices.iter().zip(["d0", "d1"]) {
            assert_eq!(entry.resource_name, RESOURCE);
            assert_eq!(entry.device_ids.to_vec(), [id]);
            assert_eq!(entry.topology.as_ref().unwrap().nodes[0].id, 0);
        }
        assert!(list[0].containers[1].devices.is_empty(), "a container without devices is listed empty");
        assert_eq!(k.pod_resources(), list);

        // Get: the same pod; an unknown one is the kubelet's plain error (code Unknown).
        assert_eq!(node.get("ml", "p1").await.unwrap(), list[0]);
        let err = node.get("ml", "nope").await.unwrap_err();
        assert_eq!(err.code(), Code::Unknown);
        assert_eq!(err.message(), "pod nope in namespace ml not found");

        // GetAllocatableResources: every healthy device, in use or not.
        let allocatable = node
            .pod_resources()
            .await
            .get_allocatable_resources(AllocatableResourcesRequest {})
            .await
            .unwrap()
            .into_inner()
            .devices;
        let all: Vec<&str> = allocatable.iter().filter_map(|d| d.device_ids.iter().next()).collect();
        assert_eq!(all, ["d0", "d1", "d2", "d3", "d4", "d5", "d6"]);
        assert!(allocatable.iter().all(|d| d.device_ids.len() == 1 && d.resource_name == RESOURCE));
        assert_eq!(allocatable[4].topology.as_ref().unwrap().nodes[0].id, 1);
        assert!(allocatable[6].topology.is_none(), "a device without topology is reported without");
    })
    .await;
}

/// The kubelet's device manager allocates every init container, sidecars (restartable init
/// containers) included, in spec order before the app containers; a sidecar may reuse an
/// earlier init container's devices, and keeps its own as an app container does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecars_are_admitted_in_init_order_and_keep_their_devices() {
    within(async {
        let node = Node::new(true).await;
        let spec = [
            ContainerSpec::app("main", 2),
            ContainerSpec::init("setup", 2),
            ContainerSpec::sidecar("proxy", 1),
            ContainerSpec::init("warm", 2),
        ];
        let a = node.kubelet.admit_pod("ml", "p", &spec).await.unwrap();
        let (main, setup, proxy, warm) = (&a[0].devices, &a[1].devices, &a[2].devices, &a[3].devices);
        assert_eq!(setup, &strings(&["d0", "d1"]));
        assert_eq!(proxy, &strings(&["d0"]), "the sidecar reuses setup's first device");
        assert_eq!(warm, &strings(&["d1", "d2"]), "warm reuses what the sidecar left of setup's");
        assert_eq!(main, &strings(&["d1", "d2"]), "main reuses warm's; the sidecar's d0 stays its own");
        // Called in that order: setup, proxy, warm, then main.
        assert_eq!(node.plugin.allocate_calls(), [setup.clone(), proxy.clone(), warm.clone(), main.clone()]);
        // PodResources lists the sidecar (first, as the kubelet lists restartable init containers
        // before the app containers), not the init containers.
        let list = node.list().await;
        let listed: Vec<&str> = list[0].containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(listed, ["proxy", "main"]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_container_devices_are_reused_by_the_next_containers() {
    within(async {
        let node = Node::new(true).await;
        let k = &node.kubelet;
        // Given out of order: the init container is admitted first all the same.
        let spec = [ContainerSpec::app("main", 3), ContainerSpec::init("setup", 3), ContainerSpec::app("side", 2)];
        let a = k.admit_pod("ml", "p2", &spec).await.unwrap();
        assert_eq!(a[1].devices, strings(&["d0", "d1", "d2"]), "setup");
        assert_eq!(a[0].devices, strings(&["d0", "d1", "d2"]), "main reuses setup's devices");
        assert_eq!(a[0].envs[ENV], "d0,d1,d2");
        assert_eq!(a[2].devices, strings(&["d3", "d4"]), "side gets new ones: main took the reusable devices");
        // main needed exactly the reusable devices: not asked about, but allocated.
        let preferred = node.plugin.preferred_calls();
        assert_eq!(preferred.len(), 2);
        assert_eq!(preferred[1].available_device_i_ds.to_vec(), strings(&["d3", "d4", "d5", "d6"]));
        assert_eq!(
            node.plugin.allocate_calls(),
            [strings(&["d0", "d1", "d2"]), strings(&["d0", "d1", "d2"]), strings(&["d3", "d4"])]
        );
        // The init container is not listed; the app containers in spec order.
        let list = node.list().await;
        let listed: Vec<(&str, Vec<String>)> = list[0].containers.iter().map(|c| (c.name.as_str(), ids(c))).collect();
        assert_eq!(listed, [("main", strings(&["d0", "d1", "d2"])), ("side", strings(&["d3", "d4"]))]);

        // A container needing more than the reusable devices: they are must_include.
        let a =
            k.admit_pod("ml", "p3", &[ContainerSpec::init("fetch", 1), ContainerSpec::app("model", 2)]).await.unwrap();
        assert_eq!(a[0].devices, ["d5"]);
        assert_eq!(a[1].devices, strings(&["d5", "d6"]));
        let last = node.plugin.preferred_calls().pop().unwrap();
        assert_eq!(last.must_include_device_i_ds.to_vec(), ["d5"]);
        assert_eq!(last.available_device_i_ds.to_vec(), strings(&["d5", "d6"]));
        assert_eq!(last.allocation_size, 2);

        // All seven healthy devices are held now.
        let err = k.admit_pod("ml", "p4", &[ContainerSpec::app("x", 1)]).await.unwrap_err();
        assert!(
            format!("{err:#}")
                .contains("requested number of devices unavailable for example.com/dev. Requested: 1, Available: 0"),
            "{err:#}"
        );
        assert_eq!(names(&node.list().await), ["ml/p2", "ml/p3"], "a pod that failed admission is not listed");

        // An init container's devices that no later container reused stay held for its pod.
        assert!(k.remove_pod("ml", "p2"));
        let a = k.admit_pod("ml", "p5", &[ContainerSpec::init("i", 3), ContainerSpec::app("m", 1)]).await.unwrap();
        assert_eq!((a[0].devices.len(), a[1].devices.len()), (3, 1));
        assert!(a[0].devices.contains(&a[1].devices[0]));
        let err = k.admit_pod("ml", "p6", &[ContainerSpec::app("n", 3)]).await.unwrap_err();
        assert!(format!("{err:#}").contains("Requested: 3, Available: 2"), "{err:#}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_pods_free_their_devices_and_injected_pods_are_listed_and_held() {
    within(async {
        let node = Node::new(true).await;
        let k = &node.kubelet;
        assert_eq!(k.admit_pod("ml", "p1", &[ContainerSpec::app("a", 4)]).await.unwrap()[0].devices.len(), 4);
        assert_eq!(
            k.admit_pod("ml", "p2", &[ContainerSpec::app("b", 3)]).await.unwrap()[0].devices,
            strings(&["d4", "d5", "d6"])
        );
        assert!(k.admit_pod("ml", "p3", &[ContainerSpec::app("c", 1)]).await.is_err());
        let err = k.admit_pod("ml", "p2", &[ContainerSpec::app("b", 1)]).await.unwrap_err();
        assert!(err.to_string().contains("already admitted"), "{err}");

        assert!(k.remove_pod("ml", "p1"));
        assert!(!k.remove_pod("ml", "p1"));
        assert_eq!(k.admit_pod("ml", "p3", &[ContainerSpec::app("c", 1)]).await.unwrap()[0].devices, ["d0"]);
        assert_eq!(names(&node.list().await), ["ml/p2", "ml/p3"]);

        // An entry the plugin never allocated: listed, found, and its devices of the resource held.
        let ghost = PodResources {
            name: "ghost".into(),
            namespace: "other".into(),
            containers: vec![ContainerResources {
                name: "c".into(),
                devices: vec![
                    ContainerDevices {
                        resource_name: RESOURCE.into(),
                        device_ids: strings(&["d1"]).into(),
                        topology: None,
                    },
                    ContainerDevices {
                        resource_name: "example.com/else".into(),
                        device_ids: strings(&["d2"]).into(),
                        topology: None,
                    },
                ],
                ..ContainerResources::default()
            }],
            ..PodResources::default()
        };
        k.inject_pod_resources(ghost.clone());
        let list = node.list().await;
        assert_eq!(names(&list), ["ml/p2", "ml/p3", "other/ghost"]);
        assert_eq!(list[2], ghost);
        assert_eq!(node.get("other", "ghost").await.unwrap(), ghost);
        assert_eq!(
            k.admit_pod("ml", "p4", &[ContainerSpec::app("d", 2)]).await.unwrap()[0].devices,
            strings(&["d2", "d3"]),
            "d1 is held by the injected entry; d2 under another resource is not"
        );
        assert!(k.remove_pod("other", "ghost"));
        assert_eq!(names(&node.list().await), ["ml/p2", "ml/p3", "ml/p4"]);
        assert_eq!(k.admit_pod("ml", "p5", &[ContainerSpec::app("e", 1)]).await.unwrap()[0].devices, ["d1"]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_without_preferred_allocation_gets_the_first_free_devices() {
    within(async {
        let node = Node::new(false).await;
        let a = node.kubelet.admit_pod("ml", "p", &[ContainerSpec::app("a", 2)]).await.unwrap();
        assert_eq!(a[0].devices, strings(&["d0", "d1"]));
        assert!(node.plugin.preferred_calls().is_empty());
        assert_eq!(node.plugin.allocate_calls().len(), 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_deletes_the_sockets_keeps_the_pods_and_takes_a_new_registration() {
    within(async {
        let node = Node::new(true).await;
        let k = &node.kubelet;
        let dp = node.dp();
        k.admit_pod("ml", "p1", &[ContainerSpec::app("a", 2)]).await.unwrap();
        std::fs::write(dp.join("kubelet_internal_checkpoint"), "{}").unwrap();
        std::fs::write(dp.join("notes.txt"), "not a socket").unwrap();
        std::fs::create_dir(dp.join("sub")).unwrap();
        drop(std::os::unix::net::UnixListener::bind(dp.join("stray.sock")).unwrap());
        let pr_socket = k.pod_resources_socket().unwrap().to_owned();
        let inode = |p: &Path| std::fs::metadata(p).unwrap().ino();
        // Hard links keep the old inodes alive, so that a new socket cannot reuse their numbers.
        std::fs::hard_link(dp.join("kubelet.sock"), dp.with_file_name("old-kubelet.sock")).unwrap();
        std::fs::hard_link(&pr_socket, dp.with_file_name("old-pr.sock")).unwrap();
        let (kubelet_ino, pr_ino) = (inode(&dp.join("kubelet.sock")), inode(&pr_socket));
        assert_eq!(node.plugin.open_streams(), 1);

        k.restart().await.unwrap();

        assert!(!dp.join("test.sock").exists(), "the plugin's socket is deleted");
        assert!(!dp.join("stray.sock").exists());
        assert!(dp.join("kubelet_internal_checkpoint").exists() && dp.join("notes.txt").exists());
        assert!(dp.join("sub").is_dir());
        assert_ne!(inode(&dp.join("kubelet.sock")), kubelet_ino, "a fresh kubelet.sock");
        assert_ne!(inode(&pr_socket), pr_ino, "a fresh PodResources socket");
        assert_eq!((k.restarts(), k.registrations().len(), k.registrations_since_restart().len()), (1, 1, 0));
        assert!(k.devices().is_empty() && k.options().is_none());
        // The plugin's ListAndWatch stream was dropped with the old process.
        while node.plugin.open_streams() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Pods survive; nothing is allocatable and nothing can be admitted until the plugin is back.
        let list = node.list().await;
        assert_eq!(names(&list), ["ml/p1"]);
        assert_eq!(ids(&list[0].containers[0]), strings(&["d0", "d1"]));
        let allocatable =
            node.pod_resources().await.get_allocatable_resources(AllocatableResourcesRequest {}).await.unwrap();
        assert!(allocatable.into_inner().devices.is_empty());
        let err = k.admit_pod("ml", "p2", &[ContainerSpec::app("b", 1)]).await.unwrap_err();
        assert!(format!("{err:#}").contains("no healthy devices present"), "{err:#}");

        // The plugin notices, serves again and re-registers.
        node.plugin.serve(&dp.join("test.sock"));
        register(&dp, "test.sock", true).await;
        k.wait_registered_since_restart(1, Duration::from_secs(1)).await.unwrap();
        assert_eq!(k.registrations().len(), 2);
        k.wait_devices(LIMIT, |d| d.len() == 8).await.unwrap();
        assert!(k.options().unwrap().get_preferred_allocation_available);
        let a = k.admit_pod("ml", "p2", &[ContainerSpec::app("b", 2)]).await.unwrap();
        assert_eq!(a[0].devices, strings(&["d2", "d3"]), "p1 still holds d0 and d1");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_registration_replaces_the_older_device_stream() {
    within(async {
        let node = Node::new(true).await;
        let k = &node.kubelet;
        let dp = node.dp();
        let newer = TestPlugin::new(vec![device("e0", HEALTHY, None), device("e1", HEALTHY, None)], true);
        newer.serve(&dp.join("newer.sock"));
        register(&dp, "newer.sock", true).await;
        k.wait_devices(LIMIT, |d| d.len() == 2).await.unwrap();
        // The kubelet dropped the older stream; an update from the older plugin changes nothing.
        while node.plugin.open_streams() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        node.plugin.devices.send_replace(eight_devices().into_iter().take(3).collect());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(k.devices().len(), 2);
        // The newer plugin's updates do.
        newer.devices.send_replace(vec![device("e0", UNHEALTHY, None), device("e1", HEALTHY, None)]);
        k.wait_devices(LIMIT, |d| d.iter().any(|d| d.health == UNHEALTHY)).await.unwrap();
        let a = k.admit_pod("ml", "p", &[ContainerSpec::app("a", 1)]).await.unwrap();
        assert_eq!(a[0].devices, ["e1"]);
        assert_eq!(newer.allocate_calls().len(), 1);
        assert!(node.plugin.allocate_calls().is_empty());
    })
    .await;
}

/// What the real kubelet does when a plugin's stream ends (`PluginDisconnected`): every device
/// of it turns unhealthy, so the node's allocatable is 0, until a plugin registers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_device_stream_leaves_every_device_unhealthy() {
    within(async {
        let node = Node::new(true).await;
        let k = &node.kubelet;
        let dp = node.dp();
        let dying =
            TestPlugin::new(vec![device("e0", HEALTHY, None), device("e1", HEALTHY, None)], true).ending_after(1);
        dying.serve(&dp.join("dying.sock"));
        register(&dp, "dying.sock", true).await;
        k.wait_devices(LIMIT, |d| d.len() == 2 && d.iter().all(|d| d.health == UNHEALTHY)).await.unwrap();
        assert_eq!(k.device_counts(), (2, 0));
        let refused = k.admit_pod("ml", "p", &[ContainerSpec::app("a", 1)]).await.unwrap_err();
        assert!(format!("{refused:#}").contains("no healthy devices"), "{refused:#}");
        // A plugin registering again brings its devices back.
        register(&dp, "test.sock", true).await;
        k.wait_devices(LIMIT, |d| d.len() == 8 && d.iter().filter(|d| d.health == HEALTHY).count() == 7).await.unwrap();
        assert_eq!(k.device_counts(), (8, 7));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_resources_is_rate_limited_like_the_kubelet() {
    within(async {
        let node = Node::new(true).await;
        let mut client = node.pod_resources().await;
        let mut rejected = 0;
        for _ in 0..200 {
            match client.list(ListPodResourcesRequest {}).await {
                Ok(_) => {}
                Err(s) => {
                    assert_eq!((s.code(), s.message()), (Code::ResourceExhausted, "rejected by rate limit"));
                    rejected += 1;
                }
            }
        }
        assert!(rejected > 0);
        assert_eq!((node.kubelet.pod_resources_requests(), node.kubelet.pod_resources_rejected()), (200, rejected));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_removes_both_sockets() {
    within(async {
        let tmp = tempfile::tempdir().unwrap();
        let pr = tmp.path().join("pr/kubelet.sock");
        let k = Kubelet::start_with_pod_resources(&tmp.path().join("dp"), &pr).await.unwrap();
        assert!(pr.exists() && tmp.path().join("dp/kubelet.sock").exists());
        k.stop();
        assert!(!pr.exists() && !tmp.path().join("dp/kubelet.sock").exists());
    })
    .await;
}
